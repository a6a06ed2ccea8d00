"""Route rows and where they sit: a row's identity decoded from its row_id, its admission
key, the spans of an owner's payload rows cut to a segment, ring slots, the m-tiles of the
grouped GEMM over them (and their table), and the links of ``dedup`` (X-MoE: one payload
row per (token, owner))."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import report
from rdepc.codegen.device.heap import peer
from rdepc.codegen.device.layout import (
    ADMITTED,
    DROP,
    E_MAX,
    EL_PAD,
    ERR_ROW_ID,
    K_PAD,
    OFFSETS,
    RID_0,
    RID_1,
    RID_2,
    SEGMENTS,
    SLOT_BLOCK,
    TILE_SLOTS,
    B,
    E,
    K,
    S,
    T,
    W,
)


@triton.jit
def radix(code: tl.constexpr, rid_r, rid_t, rid_k):
    """The row_id coefficient of route-row variable ``code`` (0 rank, 1 token, 2 slot)."""
    if code == 0:
        c = rid_r
    elif code == 1:
        c = rid_t
    else:
        c = rid_k
    return c


@triton.jit
def digit(code: tl.constexpr, d0, d1, d2, rid):
    """Variable ``code``'s value among the decoded digits d0, d1, d2 (the encoding's
    variables from its largest coefficient down: RID_0, RID_1, RID_2), or 0 when the
    encoding has no such variable (its extent is 1)."""
    if code == RID_0:
        x = d0
    elif code == RID_1:
        x = d1
    elif code == RID_2:
        x = d2
    else:
        x = rid * 0  # extent 1
    return x


@triton.jit
def decode(rid, rid_c, rid_r, rid_t, rid_k):
    """(rank, token, slot) of route row ``rid`` = c + a_rank·rank + a_token·token +
    a_slot·slot, a mixed-radix number (docs/language.md, route_row): each variable from the
    largest coefficient down (RID_0, RID_1, RID_2)."""
    v = rid - rid_c
    d0 = v // radix(RID_0, rid_r, rid_t, rid_k)
    d1 = d0
    d2 = d0
    if RID_1 >= 0:
        v = v % radix(RID_0, rid_r, rid_t, rid_k)
        d1 = v // radix(RID_1, rid_r, rid_t, rid_k)
    if RID_2 >= 0:
        v = v % radix(RID_1, rid_r, rid_t, rid_k)
        d2 = v // radix(RID_2, rid_r, rid_t, rid_k)
    return digit(0, d0, d1, d2, rid), digit(1, d0, d1, d2, rid), digit(2, d0, d1, d2, rid)


@triton.jit
def place(code: tl.constexpr, rank, token, slot):
    """Route-row variable ``code`` (0 rank, 1 token, 2 slot) of a row."""
    if code == 0:
        x = rank
    elif code == 1:
        x = token
    else:
        x = slot
    return x


@triton.jit
def mixed(dense, code: tl.constexpr, rank, token, slot):
    """``dense`` times the extent of variable ``code`` (W, T or K), plus its value."""
    if code == 0:
        d = dense * W + rank
    elif code == 1:
        d = dense * T + token
    else:
        d = dense * K + slot
    return d


@triton.jit
def dense_index(rank, token, slot):
    """A route row's row_id order as a dense index: mixed radix over the extents of the
    encoding's variables, largest coefficient first (0 when it has none)."""
    if RID_0 >= 0:
        dense = place(RID_0, rank, token, slot)
        if RID_1 >= 0:
            dense = mixed(dense, RID_1, rank, token, slot)
        if RID_2 >= 0:
            dense = mixed(dense, RID_2, rank, token, slot)
    else:
        dense = rank * 0
    return dense


@triton.jit
def row_key(gates, r, i, live):
    """Admission keys of route rows i = t*K + k of rank r, smallest admitted first. Under
    ``drop arrival`` ascending row_id (its order as a dense index); under ``round_robin``
    the token index first, the ranks taking turns from rank t mod W, then the slot; under
    ``lowest_gate`` the gate, highest first, then ascending row_id. Unique per row, below
    2^63."""
    t = tl.cast(i // K, tl.int64)
    k = tl.cast(i % K, tl.int64)
    rank = t * 0 + r
    token = t
    slot = k
    if DROP == "round_robin":
        key = (token * W + (rank - token % W + W) % W) * K + slot
    elif DROP == "lowest_gate":
        g = tl.load(gates + i, mask=live, other=0.0) + 0.0  # -0 as +0: equal gates tie on row_id
        bits = g.to(tl.int32, bitcast=True)
        up = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648  # the fp32 order, in [0, 2^32)
        key = (4294967295 - up) * 2147483648 + dense_index(rank, token, slot)  # highest gate first, then row_id
    else:
        key = dense_index(rank, token, slot)
    return key


@triton.jit
def clip(first, rows, s):
    """Spans [first, first + rows) of an owner's payload rows (one per local expert), cut to
    segment s: rows [s*S, s*S + S), which live in ring slot s % B. Returns their first rows
    and counts."""
    lo = tl.maximum(first, s * S)
    return lo, tl.maximum(tl.minimum(first + rows, s * S + S) - lo, 0)


@triton.jit
def locate(u, lo, n, local):
    """The u-th row of a piece made of spans (lo, n) per local expert: its span and its
    payload row."""
    ends = tl.cumsum(n, axis=0)
    which = tl.sum((ends[None, :] <= u[:, None]).to(tl.int32), axis=1)
    row = tl.sum(tl.where(which[:, None] == local[None, :], (lo - ends + n)[None, :], 0), axis=1) + u
    return which, row


@triton.jit
def ring_row(row, s, slot):
    """Where payload row ``row`` of segment s sits in a ring of B slots of S rows, in slot
    ``slot % B``: the owner's rings use slot s, a front-end's return ring the piece's claim."""
    return row - s * S + (slot % B) * S


@triton.jit
def owned_by(rank, rid, live, r, ctl, entry, epoch, s):
    """The live rows whose row_id ``rid`` decodes to ``rank`` r; one that decodes to another
    rank is reported, never moved."""
    bad = live & (rank != r)
    if tl.sum(bad.to(tl.int32), axis=0) > 0:
        report(ctl, ERR_ROW_ID, entry, -1, r, epoch, -1, s, tl.max(tl.where(bad, rid, -1), axis=0), r)
    return live & (rank == r)


@triton.jit
def m_tile(first, rows, s, j, BM: tl.constexpr):
    """Bind m-tile slots ``j`` (int32 [J]) of a segment s to (local expert, first row, live
    rows [lo, hi) of the tile), each [J], given the owner's rows per local expert: ``first``
    and ``rows`` ([EL_PAD], 0 rows past its experts).

    Tiles go expert by expert, each at rows first + i*BM of its local expert's rows, in
    every strategy: a row has the same place in its tile whether the rows are cut into
    segments or not, which keeps results bitwise identical across schedules (a GEMM's
    result for a row may depend on its place in the tile). A tile that a segment boundary
    cuts runs in both segments, each with its own rows live. Only tiles at an expert's end
    or at a segment boundary are partial: padding-free (no padding to the tallest group).
    A slot beyond the routing's tiles gets no live rows. At most ceil(min(R_q, S) / BM) +
    2 E_loc - 1 slots can have live rows (bulk: ceil(R_q / BM) + E_loc - 1), which is how
    many the plan gives each segment of owner q (rdepc.ir.sizes.m_tile_slots).
    """
    local = tl.arange(0, EL_PAD)
    lo, n = clip(first, rows, s)
    aligned = first + (lo - first) // BM * BM
    tiles = tl.where(n > 0, (lo + n - aligned + BM - 1) // BM, 0)
    ends = tl.cumsum(tiles, axis=0)
    which = tl.sum((ends[None, :] <= j[:, None]).to(tl.int32), axis=1)
    hit = local[None, :] == which[:, None]
    row0 = tl.sum(tl.where(hit, aligned[None, :], 0), axis=1)
    row0 += (j - tl.sum(tl.where(hit, (ends - tiles)[None, :], 0), axis=1)) * BM
    begin = tl.sum(tl.where(hit, lo[None, :], 0), axis=1)
    end = begin + tl.sum(tl.where(hit, n[None, :], 0), axis=1)
    return which, row0, tl.maximum(begin - row0, 0), tl.minimum(end - row0, BM)


@triton.jit
def bind_m_tiles(first, rows, tile_table, tile_done, q, n_slots, epoch, f_blocks, BM: tl.constexpr):
    """Owner q's m-tile table: the binding (``m_tile``) of each of its ``n_slots`` slots in
    every segment, as int32 (local expert, first row, lo, hi) at ``tile_table`` [W,
    SEGMENTS * TILE_SLOTS, 4]; returns how many have live rows (the m-tiles its grouped
    GEMM runs). The scan writes it once per call (the backward's again, from the forward's
    rows); a GEMM work item reads its m-tile's four words as scalars, which keeps its GEMM
    loop in uniform registers.

    Each slot's GEMM1 counter (``tile_done``, [W, SEGMENTS * TILE_SLOTS]) is set to its
    value before call ``epoch``, (epoch - 1) · ``f_blocks``: the GEMM kernel signals no
    counter of a slot without live rows (it counts those items done at once), so a slot
    empty in an earlier call would lag. The GEMM items of this call wait for this scan
    first, and the previous call's GEMM2 items have all passed their waits (the scan waits
    for the previous call's combine)."""
    # the words' addresses by hand: through m_tile_words the kernels that scan take 8 B more stack
    table = tile_table + tl.cast(q, tl.int64) * (SEGMENTS * TILE_SLOTS * 4)
    field = tl.arange(0, 4)
    live = tl.zeros([SLOT_BLOCK], tl.int32)
    for s in range(0, SEGMENTS):
        j0 = 0
        while j0 < n_slots:  # while, not range: the interpreter cannot take a runtime bound in a range
            j = j0 + tl.arange(0, SLOT_BLOCK)
            j0 += SLOT_BLOCK
            which, row0, lo, hi = m_tile(first, rows, s, j, BM)
            words = tl.where(
                field[None, :] == 0,
                which[:, None],
                tl.where(field[None, :] == 1, row0[:, None], tl.where(field[None, :] == 2, lo[:, None], hi[:, None])),
            )
            at = (j + s * TILE_SLOTS)[:, None] * 4 + field[None, :]
            tl.store(table + at, words, mask=(j < n_slots)[:, None])
            live += ((hi > lo) & (j < n_slots)).to(tl.int32)
    set_tile_counters(tile_done, q, n_slots, epoch, f_blocks)
    return tl.sum(live, axis=0)


@triton.jit(noinline=True)
def set_tile_counters(tile_done, q, n_slots, epoch, f_blocks):
    """``bind_m_tiles``' GEMM1 counters of owner q's slots: (epoch - 1) · f_blocks each. A
    call of its own, not inlined: in the unified kernel's backward its values cost a spill
    in a GEMM loop."""
    counters = tile_done + tl.cast(q, tl.int64) * (SEGMENTS * TILE_SLOTS)
    before = (tl.cast(epoch, tl.int64) - 1) * f_blocks
    for s in range(0, SEGMENTS):
        j0 = 0
        while j0 < n_slots:
            j = j0 + tl.arange(0, SLOT_BLOCK)
            j0 += SLOT_BLOCK
            tl.store(counters + s * TILE_SLOTS + j, before + tl.zeros([SLOT_BLOCK], tl.int64), mask=j < n_slots)


@triton.jit
def m_tile_words(tile_table, q, s, j):
    """Where slot j of owner q's segment s starts in the m-tile table [W, SEGMENTS *
    TILE_SLOTS, 4]: its four words (local expert, first row, lo, hi)."""
    return tile_table + (tl.cast(q, tl.int64) * (SEGMENTS * TILE_SLOTS) + s * TILE_SLOTS + j) * 4


@triton.jit
def bound_m_tile(tile_table, q, s, j):
    """Slot j of owner q's segment s as ``bind_m_tiles`` wrote it: (local expert, first
    row, lo, hi), four scalar loads."""
    at = m_tile_words(tile_table, q, s, j)
    return tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3)


@triton.jit
def segment_empty(tile_table, q, s, mask):
    """Whether owner q's segment s has no m-tile: its slot 0 without live rows, as
    ``bind_m_tiles`` wrote it (its lo and hi words). Scalars, or vectors under ``mask``."""
    at = m_tile_words(tile_table, q, s, 0)
    return tl.load(at + 3, mask=mask, other=0) <= tl.load(at + 2, mask=mask, other=0)


@triton.jit
def piece_rows(heap, recv, back, r, q, s, mask):
    """Rows of the piece source r and owner q move for segment s, found as the tasks find
    them: the spans q published (in r's heap slice: the dispatch and the unpack; q's split
    table ``recv`` where ``back``: the return) cut to the segment. Vectors under ``mask``."""
    local = tl.arange(0, EL_PAD)
    on = mask[:, None] & (local < E_MAX)[None, :]
    sent = on & (back == 0)[:, None]
    kept = on & (back != 0)[:, None]
    at = (q * E_MAX)[:, None] + local[None, :]
    split = recv + ((tl.cast(q, tl.int64) * W + r) * (E_MAX * 2))[:, None] + local[None, :] * 2
    me = peer(heap, r)
    first = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32))[:, None] + at, mask=sent, other=0)
    rows = tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32))[:, None] + at, mask=sent, other=0)
    first += tl.load(split, mask=kept, other=0)
    rows += tl.load(split + 1, mask=kept, other=0)
    _, count = clip(first, rows, s[:, None])
    return tl.sum(count, axis=1)


@triton.jit
def expert_spans(group, q):
    """Owner q's rows per local expert as the scan left them: (first row, rows), [EL_PAD]
    each (0 rows past its experts)."""
    local = tl.arange(0, EL_PAD)
    grp = group + tl.cast(q, tl.int64) * (E_MAX * 2) + local * 2
    first = tl.load(grp, mask=local < E_MAX, other=0)
    return first, tl.load(grp + 1, mask=local < E_MAX, other=0)


@triton.jit
def links(heap, topk_ids, owner_of, local_of, rowpos, r, t, row, q, live, n_tokens):
    """dedup, front-end r: for route rows of its tokens ``t`` that sit at rows ``row`` of
    owner q, the rows at q of the token's first accepted slot there and of its next one
    after ``row`` (-1: none), from what q published back (offsets, admitted counts)."""
    kk = tl.arange(0, K_PAD)
    i = t[:, None] * K + kk[None, :]
    m = live[:, None] & (kk < K)[None, :]
    e = tl.load(topk_ids + tl.cast(r, tl.int64) * n_tokens * K + i, mask=m, other=-1)
    m = m & (e >= 0) & (e < E)
    to = tl.load(owner_of + e, mask=m, other=-1)
    at = to * E_MAX + tl.load(local_of + e, mask=m, other=0)
    p = tl.load(rowpos + tl.cast(r, tl.int64) * (T * K) + i, mask=m, other=0)
    me = peer(heap, r)
    m = m & (to == q) & (p < tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32)) + at, mask=m, other=0))
    rows = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32)) + at, mask=m, other=0) + p
    first = tl.min(tl.where(m, rows, 2147483647), axis=1)
    later = tl.min(tl.where(m & (rows > row[:, None]), rows, 2147483647), axis=1)
    return first, tl.where(later == 2147483647, -1, later)
