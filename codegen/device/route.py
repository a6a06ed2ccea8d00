"""Dispatch phases 1 and 2 (RDEP section 3.4): a front-end routes its rows and publishes
their counts per expert to the owners (``route``); each owner turns the counts every source
published into admitted rows and exact offsets, and publishes them back (``scan``)."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import report, validate
from rdepc.codegen.device.heap import peer, put
from rdepc.codegen.device.layout import (
    ADMITTED,
    COUNTS,
    E_MAX,
    E_PAD,
    EL_PAD,
    ERR_OVERFLOW,
    KEY_BITS,
    KEY_ROWS,
    KEYED,
    KEYS,
    OFFSETS,
    POSITIONS_BY_KEY,
    ROUTE_CHUNK_TOKENS,
    ROUTE_CHUNKS,
    ROUTE_COUNTS_AT,
    ROUTE_ROWS,
    ROUTE_SCRATCH,
    ST_ADMITTED,
    ST_ARRIVED,
    ST_CAP,
    ST_COLS,
    ST_MTILES,
    ST_RETURNED,
    ST_SENT,
    TOKENS,
    W_PAD,
    E,
    K,
    T,
    W,
)
from rdepc.codegen.device.rows import bind_m_tiles, row_key


@triton.jit
def route(
    heap, topk_ids, gates, order, owner_of, local_of, owner_first, rowpos, sorted_rows, scratch, stats, ctl, r,
    n_tokens, brought, item,
):  # fmt: skip
    """Front-end r: flatten its token-slot pairs into route rows, counted per expert — work
    item ``item`` of the route's 2 · ROUTE_CHUNKS, each on one chunk of ROUTE_CHUNK_TOKENS
    tokens.

    Route row i = t*K + k of token t, slot k. Items below ROUTE_CHUNKS count (:func:`count_chunk`):
    the chunk's inputs validated (here rather than on the host: no device→host sync in a
    call), each row's position among the chunk's rows to the same expert, the chunk's rows
    per expert. The others bucket (:func:`bucket_chunk`) once every chunk is counted (the
    kernel waits for the route's own done counter): the first turns the counts into bases —
    each chunk's per expert, each expert's bucket in (owner, local expert) order — and sends
    the counts to the owners (dispatch phase 1, :func:`route_bases`); the others wait for it
    too. Positions and buckets are those one pass over the rows in order would give.
    """
    c = item % ROUTE_CHUNKS
    t_lo = c * ROUTE_CHUNK_TOKENS
    t_hi = tl.minimum(n_tokens, t_lo + ROUTE_CHUNK_TOKENS)
    by_expert = scratch + tl.cast(r, tl.int64) * ROUTE_SCRATCH
    chunks = by_expert + ROUTE_COUNTS_AT  # per chunk, its count (then its base) per expert
    if item < ROUTE_CHUNKS:
        validate(topk_ids, gates, ctl, r, n_tokens, t_lo, t_hi)
        if c == 0:  # this call's rows sent and returned start at zero
            st = stats + tl.cast(r, tl.int64) * ST_COLS
            tl.store(st + ST_SENT, 0)
            tl.store(st + ST_RETURNED, 0)
        count_chunk(topk_ids, gates, rowpos, chunks + c * E_PAD, r, n_tokens, t_lo * K, t_hi * K)
    else:
        if c == 0:
            route_bases(heap, order, owner_of, local_of, by_expert, chunks, r, brought)
        bucket_chunk(
            heap, topk_ids, gates, owner_of, owner_first, rowpos, sorted_rows, by_expert, chunks + c * E_PAD, r,
            n_tokens, t_lo * K, t_hi * K,
        )  # fmt: skip


@triton.jit(noinline=True)
def count_chunk(topk_ids, gates, rowpos, counted, r, n_tokens, lo, hi):
    """Rows [lo, hi) of front-end r: each one's position among them to the same expert (a
    running one-hot prefix count: row order is ascending row_id) — under a keyed drop policy
    whose keys do not ascend with the rows (POSITIONS_BY_KEY), among all of r's rows to that
    expert in admission-key order (row_key; the owner admits the smallest keys, scan) — and
    their count per expert, into ``counted``."""
    n = n_tokens * K
    ids = topk_ids + tl.cast(r, tl.int64) * n
    if KEYED:
        rgates = gates + tl.cast(r, tl.int64) * n
    pos = rowpos + tl.cast(r, tl.int64) * (T * K)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    start = lo
    while start < hi:  # while, not range: the interpreter cannot index a range by a runtime scalar
        i = start + tl.arange(0, ROUTE_ROWS)
        start += ROUTE_ROWS
        e = tl.load(ids + i, mask=i < hi, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        if POSITIONS_BY_KEY:
            key = row_key(rgates, r, i, i < hi)
            before = tl.zeros([ROUTE_ROWS], tl.int32)
            j0 = 0
            while j0 < n:  # the rows of r to the same expert with a smaller key come first
                j = j0 + tl.arange(0, ROUTE_ROWS)
                j0 += ROUTE_ROWS
                ej = tl.load(ids + j, mask=j < n, other=-2).to(tl.int32)
                smaller = (ej[None, :] == e[:, None]) & (row_key(rgates, r, j, j < n)[None, :] < key[:, None])
                before += tl.sum(smaller.to(tl.int32), axis=1)
            tl.store(pos + i, before, mask=i < hi)
        else:
            before = tl.cumsum(onehot, axis=0) - onehot + counts[None, :]
            tl.store(pos + i, tl.sum(before * onehot, axis=1), mask=i < hi)
        counts += tl.sum(onehot, axis=0)
    tl.store(counted + experts, counts)


@triton.jit(noinline=True)
def route_bases(heap, order, owner_of, local_of, by_expert, chunks, r, brought):
    """Once every chunk of front-end r is counted: each chunk's base per expert (the rows of
    the chunks before it, in place of its count), each expert's bucket base with the experts
    in (owner, local) order (``by_expert``, then per (owner, local) and one past), which the
    dispatch reads; the counts to the owners (dispatch phase 1) with the tokens r brings."""
    experts = tl.arange(0, E_PAD)
    real = experts < E
    counts = tl.zeros([E_PAD], tl.int32)
    for c in range(ROUTE_CHUNKS):
        counted = tl.load(chunks + c * E_PAD + experts)
        tl.store(chunks + c * E_PAD + experts, counts)
        counts += counted
    by_order = by_expert + E_PAD
    tl.store(by_expert + experts, counts)
    tl.debug_barrier()
    ordered = tl.load(order + experts, mask=real, other=0)
    c = tl.load(by_expert + ordered, mask=real, other=0)
    ends = tl.cumsum(c, axis=0)
    tl.store(by_order + 1 + experts, ends, mask=real)
    tl.store(by_order + experts, 0, mask=experts == 0)
    tl.debug_barrier()
    tl.store(by_expert + ordered, ends - c, mask=real)
    tl.debug_barrier()
    # Dispatch phase 1: rows for (owner, local expert) into the owner's counts[r, local].
    q = tl.load(owner_of + experts, mask=real, other=0)
    local = tl.load(local_of + experts, mask=real, other=0)
    put((peer(heap, q) + COUNTS).to(tl.pointer_type(tl.int32)) + r * E_MAX + local, counts, real)
    # ... and how many tokens r brings to the call (``brought`` <= n_tokens, the rows past it route
    # nowhere): capacity follows the total (ranks may differ).
    peers = tl.arange(0, W_PAD)
    tokens = tl.zeros([W_PAD], tl.int64) + brought
    put((peer(heap, peers) + TOKENS).to(tl.pointer_type(tl.int64)) + r, tokens, peers < W)


@triton.jit(noinline=True)
def bucket_chunk(
    heap, topk_ids, gates, owner_of, owner_first, rowpos, sorted_rows, by_expert, base, r, n_tokens, lo, hi
):  # fmt: skip
    """Rows [lo, hi) of front-end r into their (owner, local expert) buckets, at their
    expert's bucket base plus their position — counted within the chunk, made r's by adding
    the chunk's ``base`` (rowpos keeps it for the dispatch's links and the combine) — and
    under a keyed policy their keys to the owners, into the owner's run for (r, local
    expert): ascending, as the positions."""
    n = n_tokens * K
    ids = topk_ids + tl.cast(r, tl.int64) * n
    if KEYED:
        rgates = gates + tl.cast(r, tl.int64) * n
    pos = rowpos + tl.cast(r, tl.int64) * (T * K)
    by_order = by_expert + E_PAD
    bucketed = sorted_rows + tl.cast(r, tl.int64) * (T * K)
    start = lo
    while start < hi:
        i = start + tl.arange(0, ROUTE_ROWS)
        start += ROUTE_ROWS
        e = tl.load(ids + i, mask=i < hi, other=-1).to(tl.int32)
        valid = (i < hi) & (e >= 0) & (e < E)  # an id out of range is counted by no expert: not routed
        p = tl.load(pos + i, mask=valid, other=0)
        if not POSITIONS_BY_KEY:
            p += tl.load(base + e, mask=valid, other=0)
            tl.store(pos + i, p, mask=valid)
        at = tl.load(by_expert + e, mask=valid, other=0) + p
        tl.store(bucketed + at, i, mask=valid)
        if KEYED:
            q = tl.load(owner_of + e, mask=valid, other=0)
            first = tl.load(by_order + tl.load(owner_first + q, mask=valid, other=0), mask=valid, other=0)
            key = row_key(rgates, r, i, valid)
            put((peer(heap, q) + KEYS).to(tl.pointer_type(tl.int64)) + r * (T * K) + at - first, key, valid)


@triton.jit
def keys_below(keys, counts, src, local, mine, bound):
    """Per local expert of the owner, how many of the keys source ``src`` published for it
    are below ``bound``: the source's keys sit at row src of ``keys``, one ascending run per
    local expert, in local order, as long as its published counts."""
    c = tl.load(counts + src * E_MAX + local, mask=mine, other=0)
    first = tl.cumsum(c, axis=0) - c
    run = keys + tl.cast(src, tl.int64) * (T * K)
    below = tl.zeros([EL_PAD], tl.int32)
    longest = tl.max(c, axis=0)
    u0 = 0
    while u0 < longest:
        u = u0 + tl.arange(0, KEY_ROWS)
        u0 += KEY_ROWS
        live = u[None, :] < c[:, None]
        key = tl.load(run + first[:, None] + u[None, :], mask=live, other=0)
        below += tl.sum((live & (key < bound[:, None])).to(tl.int32), axis=1)
    return below


@triton.jit
def publish(heap, recv, q, src, local, mine, offset, take):
    """Owner q's decision for source ``src``: the offset and admitted count of each of its
    (source, local expert) spans, into q's split table and back to the source."""
    split = recv + (tl.cast(q, tl.int64) * W + src) * (E_MAX * 2) + local * 2
    tl.store(split, offset, mask=mine)
    tl.store(split + 1, take, mask=mine)
    back = peer(heap, src)
    put((back + OFFSETS).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, offset, mine)
    put((back + ADMITTED).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, take, mine)


@triton.jit
def scan(
    heap, n_local, rows_max, caps, recv, group, tile_table, tile_done, m_slots, stats, ctl, entry, epoch, q, f_blocks,
    BM: tl.constexpr,
):  # fmt: skip
    """Owner q, dispatch phase 2: the counts every source published → admitted rows → offsets.

    Each local expert admits at most cap = ``caps[n]`` rows, n the tokens all front-ends
    published with their counts. In arrival order (not KEYED): ascending row_id, which is
    source by source (rank, then token, then slot), so what a source gets admitted is a
    prefix of its run and admission is one running sum per expert. Under a keyed drop
    policy: the cap smallest of the keys every source published (row_key), a global step
    over all arrivals; each source's keys for an expert are one ascending run (its route
    positions), so what it gets admitted is a prefix of its run: the keys up to the
    expert's cap-th smallest, found bit by bit. Rows land grouped by local expert and,
    within an expert, by source: each (source, local expert) gets the exact offset of its
    span. Offsets and admitted counts are published back to the sources; the owner keeps
    them as its split table (``recv``) for the return, and its rows per local expert
    (``group``) with the m-tile table of its ``m_slots[q]`` slots per segment
    (``rows.bind_m_tiles``, which also sets their GEMM1 counters) for its GEMMs.
    """
    local = tl.arange(0, EL_PAD)
    mine = local < tl.load(n_local + q)
    peers = tl.arange(0, W_PAD)
    tokens = tl.load((peer(heap, q) + TOKENS).to(tl.pointer_type(tl.int64)) + peers, mask=peers < W, other=0)
    cap = tl.load(caps + tl.sum(tokens, axis=0))
    policy = cap
    counts = (peer(heap, q) + COUNTS).to(tl.pointer_type(tl.int32))
    arrived = tl.zeros([EL_PAD], tl.int32)
    for src in range(0, W):
        arrived += tl.load(counts + src * E_MAX + local, mask=mine, other=0)
    admitted = tl.minimum(arrived, cap)
    total = tl.sum(admitted, axis=0)
    over = total > tl.load(rows_max + q)
    if over:  # more rows than the plan sized this owner for (it bounds R_q): admit none, report
        report(ctl, ERR_OVERFLOW, entry, -1, q, epoch, -1, -1, total, tl.load(rows_max + q))
    cap = tl.where(over, 0, cap)
    admitted = tl.minimum(arrived, cap)
    first = tl.cumsum(admitted, axis=0) - admitted
    grp = group + tl.cast(q, tl.int64) * (E_MAX * 2) + local * 2
    tl.store(grp, first, mask=mine)
    tl.store(grp + 1, admitted, mask=mine)
    m_tiles = bind_m_tiles(first, admitted, tile_table, tile_done, q, tl.load(m_slots + q), epoch, f_blocks, BM)
    if KEYED:
        keys = (peer(heap, q) + KEYS).to(tl.pointer_type(tl.int64))
        kth = tl.zeros([EL_PAD], tl.int64)  # per local expert: the largest v with fewer than cap keys below it
        for b in range(0, KEY_BITS):
            trial = kth + (tl.full([EL_PAD], 1, tl.int64) << (KEY_BITS - 1 - b))
            below = tl.zeros([EL_PAD], tl.int32)
            for src in range(0, W):
                below += keys_below(keys, counts, src, local, mine, trial)
            kth = tl.where(below < cap, trial, kth)
        taken = tl.zeros([EL_PAD], tl.int32)
        for src in range(0, W):
            c = tl.load(counts + src * E_MAX + local, mask=mine, other=0)
            take = tl.where(arrived <= cap, c, keys_below(keys, counts, src, local, mine, kth + 1))
            take = tl.where(cap > 0, take, 0)
            offset = first + taken
            publish(heap, recv, q, src, local, mine, offset, take)
            taken += take
    else:
        before = tl.zeros([EL_PAD], tl.int32)
        for src in range(0, W):
            c = tl.load(counts + src * E_MAX + local, mask=mine, other=0)
            take = tl.minimum(tl.maximum(cap - before, 0), c)
            offset = first + tl.minimum(before, cap)
            publish(heap, recv, q, src, local, mine, offset, take)
            before += c
    st = stats + tl.cast(q, tl.int64) * ST_COLS
    tl.store(st + ST_ARRIVED + local, arrived, mask=local < E_MAX)
    tl.store(st + ST_ADMITTED + local, admitted, mask=local < E_MAX)
    tl.store(st + ST_MTILES, m_tiles)  # the padding-free counter: the m-tiles the grouped GEMM runs
    tl.store(st + ST_CAP, policy)
