"""Templates of the task kinds that move rows and count them — route, scan, dispatch,
return, unpack, combine — and the helpers they share, as the emitter writes them into a
generated kernel file (``emit.generate``). Each returns formatted source text: what depends
on the spec (the sideband fields carried, the capacity weights, the payload dtype, a
return ring) is decided here, the rest is fixed text that uses the file's constexprs.
"""

from __future__ import annotations

from rdepc.codegen import dedup
from rdepc.codegen.text import NARROW, narrowed

from rdepc.ir.contract import KernelContract


def helpers_source(p: KernelContract) -> str:
    return (
        (NARROW + "\n\n" if "bf16" in (p.dtype, p.dispatch) else "")
        + '''@triton.jit
def report(ctl, code, entry, dep, rank, epoch, queue, segment, seen, expected):
    """Record the call's first error for the host to raise (later ones are dropped): what
    happened, in which task-table entry, on which rank and queue, for which segment, and
    for a wait the flag (entry ``dep``) with the value seen versus the one expected."""
    zero = tl.zeros([], tl.int64)
    if tl.atomic_cas(ctl + CTL_ERR_CODE, zero, zero + code) == 0:
        tl.store(ctl + CTL_ERR_ENTRY, tl.cast(entry, tl.int64))
        tl.store(ctl + CTL_ERR_DEP, tl.cast(dep, tl.int64))
        tl.store(ctl + CTL_ERR_RANK, tl.cast(rank, tl.int64))
        tl.store(ctl + CTL_ERR_EPOCH, tl.cast(epoch, tl.int64))
        tl.store(ctl + CTL_ERR_RESOURCE, tl.cast(queue, tl.int64))
        tl.store(ctl + CTL_ERR_SEGMENT, tl.cast(segment, tl.int64))
        tl.store(ctl + CTL_ERR_SEEN, tl.cast(seen, tl.int64))
        tl.store(ctl + CTL_ERR_EXPECTED, tl.cast(expected, tl.int64))


@triton.jit
def done_flag(heap, table, entry, BACKWARD: tl.constexpr):
    """Entry ``entry``'s done counter: symmetric, in the heap slice of the rank that runs it,
    so a waiter on any rank reads it where its producer signals it. The backward counts in
    its own words."""
    row = table + entry * NCOL
    at = peer(heap, tl.load(row + C_RANK))
    if BACKWARD:
        at += BWD_FLAGS
    else:
        at += FLAGS
    return at.to(tl.pointer_type(tl.int64)) + tl.load(row + C_FLAG)


@triton.jit
def now(ctl, GLOBALTIMER: tl.constexpr):
    """A timestamp for the profile: %globaltimer (ns) on a GPU, else a logical clock (an
    atomic counter: an order, not a duration)."""
    if GLOBALTIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.atomic_add(ctl + CTL_CLOCK, 1)
    return t
'''
    )


def route_source(p: KernelContract) -> str:
    text = '''@triton.jit
def note(ctl, word, bad, key):
    """Count the offending rows ``bad`` into control word ``word`` and keep the earliest
    (the largest ``key``) in the word after it; nothing is written when none offends."""
    count = tl.sum(bad.to(tl.int64), axis=0)
    if count > 0:
        tl.atomic_add(ctl + word, count)
        tl.atomic_max(ctl + word + 1, tl.max(tl.where(bad, key, 0), axis=0))


@triton.jit
def validate(topk_ids, gates, ctl, r, n_tokens):
    """Front-end r's routing inputs: expert ids in [0, E) or -1 (a slot that routes nowhere:
    padding), K distinct experts per token, finite gates. Offenders are counted into the
    control block with the first one (key W*T*K - (r*T + t)*K - k: earliest is largest) for
    the host to raise after the call; the call goes on (an id out of range is routed
    nowhere, its slot not accepted), so no rank is left waiting and the next call starts
    clean."""
    base = tl.cast(r, tl.int64) * n_tokens * K
    key0 = W * T * K - tl.cast(r, tl.int64) * (T * K)
    slots = tl.arange(0, K_PAD)
    start = 0
    while start < n_tokens:
        t = start + tl.arange(0, VALIDATE_TOKENS)
        start += VALIDATE_TOKENS
        live = (t < n_tokens)[:, None] & (slots < K)[None, :]
        i = t[:, None] * K + slots[None, :]
        e = tl.load(topk_ids + base + i, mask=live, other=0)
        g = tl.load(gates + base + i, mask=live, other=0.0)
        key = tl.ravel(key0 - i)
        note(ctl, CTL_BAD_IDS, tl.ravel(live & ((e < -1) | (e >= E))), key)
        # NaN and +-inf (g - g is not 0); a slot that routes nowhere may carry any gate
        note(ctl, CTL_BAD_GATES, tl.ravel(live & (e != -1) & ((g - g) != 0)), key)
        routed = live & (e != -1)  # two slots that route nowhere are no repeated expert
        pair = routed[:, :, None] & routed[:, None, :] & (slots[:, None] < slots[None, :])[None, :, :]
        twice = tl.max(tl.max(((e[:, :, None] == e[:, None, :]) & pair).to(tl.int32), axis=2), axis=1) > 0
        note(ctl, CTL_DUP_TOKENS, twice, key0 - t * K)


@triton.jit
def route(
    heap, topk_ids, gates, order, owner_of, local_of, owner_first, rowpos, sorted_rows, scratch, stats, ctl, r,
    n_tokens, brought,
):  # fmt: skip
    """Front-end r: flatten its token-slot pairs into route rows, counted per expert.

    Route row i = t*K + k of token t, slot k. Pass 1 gives every row its
    @@ORDER@@ and counts the rows per expert; the counts go to
    the owners (dispatch phase 1). Pass 2 buckets the rows by (owner, local expert); the
    bucket base of each expert stays in ``scratch`` for the dispatch tasks. The inputs are
    validated first, here rather than on the host (no device→host sync in a call).
    """
    validate(topk_ids, gates, ctl, r, n_tokens)
    st = stats + tl.cast(r, tl.int64) * ST_COLS  # this call's rows sent and returned start at zero
    tl.store(st + ST_SENT, 0)
    tl.store(st + ST_RETURNED, 0)
    n = n_tokens * K
    ids = topk_ids + tl.cast(r, tl.int64) * n
@@RGATES@@    pos = rowpos + tl.cast(r, tl.int64) * (T * K)
    by_expert = scratch + tl.cast(r, tl.int64) * (2 * E_PAD + 2)
    by_order = by_expert + E_PAD
    experts = tl.arange(0, E_PAD)
    real = experts < E
    counts = tl.zeros([E_PAD], tl.int32)
    start = 0
    while start < n:  # while, not range: the interpreter cannot index a range by a runtime scalar
        i = start + tl.arange(0, ROUTE_ROWS)
        start += ROUTE_ROWS
        e = tl.load(ids + i, mask=i < n, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
@@POSITION@@        counts += tl.sum(onehot, axis=0)
    # Bucket bases: exclusive prefix sums of the counts with the experts in (owner, local) order.
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
    bucketed = sorted_rows + tl.cast(r, tl.int64) * (T * K)
    start = 0
    while start < n:
        i = start + tl.arange(0, ROUTE_ROWS)
        start += ROUTE_ROWS
        e = tl.load(ids + i, mask=i < n, other=-1).to(tl.int32)
        valid = (i < n) & (e >= 0) & (e < E)  # an id out of range is counted by no expert: not routed
        at = tl.load(by_expert + e, mask=valid, other=0) + tl.load(pos + i, mask=valid, other=0)
        tl.store(bucketed + at, i, mask=valid)
@@KEYS@@    # Dispatch phase 1: rows for (owner, local expert) into the owner's counts[r, local].
    q = tl.load(owner_of + experts, mask=real, other=0)
    local = tl.load(local_of + experts, mask=real, other=0)
    put((peer(heap, q) + COUNTS).to(tl.pointer_type(tl.int32)) + r * E_MAX + local, counts, real)
    # ... and how many tokens r brings to the call (``brought`` <= n_tokens, the rows past it route
    # nowhere): capacity follows the total (ranks may differ).
    peers = tl.arange(0, W_PAD)
    tokens = tl.zeros([W_PAD], tl.int64) + brought
    put((peer(heap, peers) + TOKENS).to(tl.pointer_type(tl.int64)) + r, tokens, peers < W)
'''
    running = """        before = tl.cumsum(onehot, axis=0) - onehot + counts[None, :]
        tl.store(pos + i, tl.sum(before * onehot, axis=1), mask=i < n)
"""
    if not p.keyed:
        doc = (
            "position among the rows r sends to the same expert (a running one-hot prefix count, in\n"
            "    row order, which is ascending row_id)"
        )
        return (
            text.replace("@@POSITION@@", running)
            .replace("@@KEYS@@", "")
            .replace("@@ORDER@@", doc)
            .replace("@@RGATES@@", "")
        )
    position = """        key = row_key(rgates, r, i, i < n)
        before = tl.zeros([ROUTE_ROWS], tl.int32)
        j0 = 0
        while j0 < n:  # the rows of r to the same expert with a smaller key come first
            j = j0 + tl.arange(0, ROUTE_ROWS)
            j0 += ROUTE_ROWS
            ej = tl.load(ids + j, mask=j < n, other=-2).to(tl.int32)
            smaller = (ej[None, :] == e[:, None]) & (row_key(rgates, r, j, j < n)[None, :] < key[:, None])
            before += tl.sum(smaller.to(tl.int32), axis=1)
        tl.store(pos + i, before, mask=i < n)
"""
    keys = """        # ... and the keys, into the owner's run for (r, local expert): ascending, as the positions
        q = tl.load(owner_of + e, mask=valid, other=0)
        first = tl.load(by_order + tl.load(owner_first + q, mask=valid, other=0), mask=valid, other=0)
        key = row_key(rgates, r, i, valid)
        put((peer(heap, q) + KEYS).to(tl.pointer_type(tl.int64)) + r * (T * K) + at - first, key, valid)
"""
    doc = (
        "position among the rows r sends to the same expert in admission-key order (row_key;\n"
        "    the owner admits the smallest keys, scan)"
    )
    if p.keys_in_row_order:  # a source's keys ascend with its rows: a running count places them
        position = running
        doc = (
            "position among the rows r sends to the same expert (a running one-hot prefix count, in\n"
            "    row order, which is admission-key order: row_key; the owner admits the smallest\n"
            "    keys, scan)"
        )
    text = text.replace("@@RGATES@@", "    rgates = gates + tl.cast(r, tl.int64) * n\n")
    return (
        row_key_source(p)
        + "\n\n"
        + text.replace("@@POSITION@@", position).replace("@@KEYS@@", keys).replace("@@ORDER@@", doc)
    )


def row_key_source(p: KernelContract) -> str:
    """The admission key of a route row (< W·T·K unless by gate): under ``drop arrival`` its
    row_id's order as a dense index; under ``round_robin`` its (token, turn, slot) index, the
    turn (rank − token) mod W; under ``lowest_gate`` the gate's descending order, then row_id."""
    extent = {"rank": "W", "token": "T", "slot": "K"}
    dense = ""
    for v in p.row_id_order:  # mixed radix over the extents, largest coefficient first
        dense = v if not dense else f"{dense if ' ' not in dense else f'({dense})'} * {extent[v]} + {v}"
    if p.drop == "round_robin":
        body = "    return (token * W + (rank - token % W + W) % W) * K + slot\n"
        what = "token index first, the ranks taking turns from rank t mod W, then slot"
    elif p.drop == "lowest_gate":
        body = f"""    g = tl.load(gates + i, mask=live, other=0.0) + 0.0  # -0 as +0: equal gates tie on row_id
    bits = g.to(tl.int32, bitcast=True)
    up = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648  # the fp32 order, in [0, 2^32)
    return (4294967295 - up) * 2147483648 + {dense or "0"}  # highest gate first, then ascending row_id
"""
        what = "the gate, highest first, then ascending row_id"
    else:
        body = f"    return {dense or 'rank * 0'}\n"
        what = "ascending row_id (its order as a dense index)"
    return f'''@triton.jit
def row_key(gates, r, i, live):
    """Admission keys of route rows i = t*K + k of rank r, smallest admitted first:
    {what}. Unique per row, below 2^63."""
    t = tl.cast(i // K, tl.int64)
    k = tl.cast(i % K, tl.int64)
    rank = t * 0 + r
    token = t
    slot = k
{body}'''


def scan_source(p: KernelContract) -> str:
    text = '''@triton.jit
def scan(heap, n_local, rows_max, caps, recv, group, stats, ctl, entry, epoch, q):
    """Owner q, dispatch phase 2: the counts every source published → admitted rows → offsets.

    Each local expert admits at most cap = ``caps[n]`` rows, n the tokens all front-ends
    published with their counts, @@POLICY@@ Rows land grouped by local expert and,
    within an expert, by source: each (source, local expert) gets the exact offset of its
    span. Offsets and admitted counts are published back to the sources; the owner keeps
    them as its split table (``recv``) for the return.
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
@@TAKE@@        split = recv + (tl.cast(q, tl.int64) * W + src) * (E_MAX * 2) + local * 2
        tl.store(split, offset, mask=mine)
        tl.store(split + 1, take, mask=mine)
        back = peer(heap, src)
        put((back + OFFSETS).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, offset, mine)
        put((back + ADMITTED).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, take, mine)
@@NEXT@@    st = stats + tl.cast(q, tl.int64) * ST_COLS
    tl.store(st + ST_ARRIVED + local, arrived, mask=local < E_MAX)
    tl.store(st + ST_ADMITTED + local, admitted, mask=local < E_MAX)
    tl.store(st + ST_MTILES, 0)
    tl.store(st + ST_CAP, policy)
'''
    if not p.keyed:
        policy = """in arrival order: ascending row_id, which
    is source by source (rank, then token, then slot), so what a source gets admitted is a
    prefix of its run and admission is one running sum per expert."""
        take = """    before = tl.zeros([EL_PAD], tl.int32)
    for src in range(0, W):
        c = tl.load(counts + src * E_MAX + local, mask=mine, other=0)
        take = tl.minimum(tl.maximum(cap - before, 0), c)
        offset = first + tl.minimum(before, cap)
"""
        return text.replace("@@POLICY@@", policy).replace("@@TAKE@@", take).replace("@@NEXT@@", "        before += c\n")
    what = {
        "round_robin": "token index first, the ranks taking turns (row_key)",
        "lowest_gate": "highest gate first, then ascending row_id",
    }.get(p.drop, "ascending row_id")
    policy = f"""{what}: the cap smallest of
    the keys every source published (row_key), a global step over all arrivals. Each
    source's keys for an expert are one ascending run (its route positions), so what it
    gets admitted is a prefix of its run: the keys up to the expert's cap-th smallest,
    found bit by bit."""
    take = """    keys = (peer(heap, q) + KEYS).to(tl.pointer_type(tl.int64))
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
"""
    return (
        KEYS_BELOW
        + "\n\n"
        + text.replace("@@POLICY@@", policy).replace("@@TAKE@@", take).replace("@@NEXT@@", "        taken += take\n")
    )


KEYS_BELOW = '''@triton.jit
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
'''


def segment_source() -> str:
    return '''@triton.jit
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
'''


def decode_source(p: KernelContract) -> str:
    """The route-row identity read back: the spec's mixed-radix encoding, from its largest
    coefficient down."""
    coef = {"rank": "rid_r", "token": "rid_t", "slot": "rid_k"}
    lines = ["    v = rid - rid_c"]
    for i, var in enumerate(p.row_id_order):
        lines.append(f"    {var} = v // {coef[var]}")
        if i + 1 < len(p.row_id_order):
            lines.append(f"    v = v % {coef[var]}")
    lines += [f"    {var} = rid * 0  # extent 1" for var in ("rank", "token", "slot") if var not in p.row_id_order]
    formula = " + ".join(["c", *(f"a_{v}·{v}" for v in p.row_id_order)])
    return f'''@triton.jit
def decode(rid, rid_c, rid_r, rid_t, rid_k):
    """(rank, token, slot) of route row ``rid`` = {formula}, a mixed-radix number
    (docs/language.md, route_row): each variable from the largest coefficient down."""
{chr(10).join(lines)}
    return rank, token, slot
'''


def dispatch_source(p: KernelContract) -> str:
    sideband = ["        put((dst + SB_ROW_ID).to(tl.pointer_type(tl.int64)) + at, row_id, keep)"]
    if "local_expert" in p.sideband:
        sideband.append("        put((dst + SB_LOCAL_EXPERT).to(tl.pointer_type(tl.int32)) + at, which, keep)")
    if "gate" in p.sideband:
        sideband += [
            "        gate = tl.load(gates + base + i, mask=keep, other=0.0)",
            "        put((dst + SB_GATE).to(tl.pointer_type(tl.float32)) + at, gate, keep)",
        ]
    carried = ", ".join(p.sideband)
    text = (
        '''@triton.jit
def dispatch(
    heap,
    x,
    gates,
    order,
    owner_first,
    n_local,
    sorted_rows,
    scratch,
@@DEDUP_ARGS@@    stats,
    r,
    q,
    s,
    item,
    items,
    n_tokens,
    rid_c,
    rid_r,
    rid_t,
    rid_k,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CAST_F32: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Source r → owner q, segment s (dispatch phase 3): the admitted rows of r that fall in
    the segment, payload and sideband, into q's ring slot s % B.

    The backward sends along the same offsets (the forward's accepted set, never routed
    again): ``x`` is then dL/dy and ``gates`` g', each row goes as g'·dL/dy in the layer's
    dtype into q's backward payload ring, and its row_id beside it.

    Every row goes to the exact offset q published for its (source, local expert) span plus
    its position in the span; payload and sideband share that one split table (appendix
    A.3, condition 2). Spans are disjoint by construction, so placement needs no atomics.
    Work item ``item`` of ``items`` takes every items-th block of BLOCK_R rows.@@DEDUP_DOC@@
    """
    local = tl.arange(0, EL_PAD)
    mine = local < tl.load(n_local + q)
    me = peer(heap, r)
    offset = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, mask=mine, other=0)
    admitted = tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, mask=mine, other=0)
    lo, count = clip(offset, admitted, s)
    n = tl.sum(count, axis=0)
    expert = tl.load(order + tl.load(owner_first + q) + local, mask=mine, other=0)
    bucket = tl.load(scratch + tl.cast(r, tl.int64) * (2 * E_PAD + 2) + expert, mask=mine, other=0)
    dst = peer(heap, q)
    if BACKWARD:
        payload = (dst + BWD_PAYLOAD).to(tl.pointer_type(DTYPE))
    else:
        payload = (dst + PAYLOAD).to(tl.pointer_type(DISPATCH_DTYPE))
    rows = sorted_rows + tl.cast(r, tl.int64) * (T * K)
    base = tl.cast(r, tl.int64) * n_tokens * K
    start = item * BLOCK_R
    while start < n:
        u = start + tl.arange(0, BLOCK_R)
        start += items * BLOCK_R
        keep = u < n
        which, row = locate(u, lo, count, local)
        at_expert = which[:, None] == local[None, :]
        p = row - tl.sum(tl.where(at_expert, offset[None, :], 0), axis=1)  # position in r's run
        i = tl.load(rows + tl.sum(tl.where(at_expert, bucket[None, :], 0), axis=1) + p, mask=keep, other=0)
        t = i // K  # route row t*K + k of rank r
        k = i % K
        at = ring_row(row, s, s)
        src = x + (tl.cast(r, tl.int64) * n_tokens + t) * H
        to = payload + tl.cast(at, tl.int64) * H
@@LINKS@@        if BACKWARD:
            scale = tl.load(gates + base + i, mask=keep, other=0.0)
@@BACKWARD@@        else:
@@FORWARD@@            sent = tl.sum(@@SENT@@.to(tl.int32), axis=0)
            tl.atomic_add(stats + tl.cast(r, tl.int64) * ST_COLS + ST_SENT, sent)
        row_id = rid_c + tl.cast(r, tl.int64) * rid_r + tl.cast(t, tl.int64) * rid_t + k * rid_k
        if BACKWARD:
            put((dst + BWD_ROW_IDS).to(tl.pointer_type(tl.int64)) + at, row_id, keep)
        else:  # the sideband: '''
        + carried
        + "\n"
        + "\n".join("    " + line for line in sideband)
        + "\n"
    ).replace("@@FORWARD@@", _payload_rows(p, "lead" if p.dedup else "keep"))
    doc = """

    dedup: only the token's first slot at q sends its payload row (and scales; in the
    backward dL/dy as it is); every slot sends its sideband with the links to its token's
    first and next slot there (in the backward its g' too: the owner scales)."""
    scaled = """            for h in range(0, H, BLOCK_H):
                c = h + tl.arange(0, BLOCK_H)
                m = keep[:, None] & (c < H)[None, :]
                rows_h = tl.load(src[:, None] + c[None, :], mask=m)
                put(to[:, None] + c[None, :], @@SCALED@@, m)
"""
    subst = {
        "@@DEDUP_ARGS@@": "    topk_ids,\n    owner_of,\n    local_of,\n    rowpos,\n" if p.dedup else "",
        "@@DEDUP_DOC@@": doc if p.dedup else "",
        "@@LINKS@@": dedup.dispatch_links() if p.dedup else "",
        "@@BACKWARD@@": dedup.dispatch_backward() if p.dedup else scaled,
        "@@SENT@@": "lead" if p.dedup else "keep",
        "@@SCALED@@": narrowed(p, "rows_h.to(tl.float32) * scale[:, None]", "DTYPE"),
    }
    for k, v in subst.items():
        text = text.replace(k, v)
    return text


def _payload_rows(p: KernelContract, send: str) -> str:
    """The forward dispatch's payload rows (those ``send`` marks): as they are, narrowed to
    the dispatch dtype, or quantised to fp8 with their scales into the sideband."""
    scales = "(dst + SB_SCALE).to(tl.pointer_type(tl.float32))"
    if p.dispatch_scale == "row":
        return f"""            # fp8 e4m3, one scale per row: the row's largest magnitude first
            amax = tl.zeros([BLOCK_R], tl.float32)
            for h in range(0, H, BLOCK_H):
                c = h + tl.arange(0, BLOCK_H)
                m = {send}[:, None] & (c < H)[None, :]
                rows_h = tl.load(src[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(rows_h), axis=1))
            qscale = fp8_scale(amax)
            put({scales} + at, qscale, {send})
            for h in range(0, H, BLOCK_H):
                c = h + tl.arange(0, BLOCK_H)
                m = {send}[:, None] & (c < H)[None, :]
                rows_h = tl.load(src[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
                put(to[:, None] + c[None, :], to_e4m3(rows_h, qscale[:, None], CAST_F32), m)
"""
    if p.dispatch_scale == "block":
        return f"""            at_scales = {scales} + tl.cast(at, tl.int64) * SCALES
            for h in range(0, H, SCALE_COLS):  # fp8 e4m3, one scale per SCALE_COLS columns of a row
                c = h + tl.arange(0, SCALE_COLS)
                m = {send}[:, None] & (c < H)[None, :]
                rows_h = tl.load(src[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
                qscale = fp8_scale(tl.max(tl.abs(rows_h), axis=1))
                put(at_scales + h // SCALE_COLS, qscale, {send})
                put(to[:, None] + c[None, :], to_e4m3(rows_h, qscale[:, None], CAST_F32), m)
"""
    rows = "rows_h"
    if p.dispatch == "bf16" and p.dtype != "bf16":
        rows = narrowed(p, "rows_h.to(tl.float32)", "DISPATCH_DTYPE")
    elif p.dispatch != p.dtype:
        rows = "rows_h.to(DISPATCH_DTYPE)"
    return f"""            for h in range(0, H, BLOCK_H):
                c = h + tl.arange(0, BLOCK_H)
                m = {send}[:, None] & (c < H)[None, :]
                rows_h = tl.load(src[:, None] + c[None, :], mask=m)
                put(to[:, None] + c[None, :], {rows}, m)
"""


def return_regions_source(p: KernelContract) -> str:
    if not p.ring:
        return '''@triton.jit
def return_regions(me, BACKWARD: tl.constexpr):
    """Where returned rows land in a front-end's heap slice ``me``, each at its (token,
    slot) place: the forward's region, or the backward's."""
    if BACKWARD:
        return (me + BWD_RETURN).to(tl.pointer_type(DTYPE))
    return (me + RETURN).to(tl.pointer_type(DTYPE))
'''
    return '''@triton.jit
def return_regions(me, BACKWARD: tl.constexpr):
    """Where returned rows land in a front-end's heap slice ``me`` (a return ring) and their
    row_ids: the forward's regions, or the backward's."""
    if BACKWARD:
        return (me + BWD_RETURN).to(tl.pointer_type(DTYPE)), (me + BWD_RETURN_IDS).to(tl.pointer_type(tl.int64))
    return (me + RETURN).to(tl.pointer_type(DTYPE)), (me + RETURN_IDS).to(tl.pointer_type(tl.int64))
'''


def return_source(p: KernelContract) -> str:
    """The return task: the frame shared by both variants — the piece's rows by the owner's
    split table, their decoded row_ids, the count — around what each variant finds, lands
    and copies (under dedup: ``dedup.return_parts``)."""
    parts = dedup.return_parts(p) if p.dedup else _return_parts(p)
    text = '''@triton.jit
def return_rows(
    heap,
    recv,
    staging,
    staging_rid,
@@SAVED@@    stats,
    ctl,
    entry,
    epoch,
    q,
    r,
    s,
    claim,
    item,
    items,
    rid_c,
    rid_r,
    rid_t,
    rid_k,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
@@CAST@@    BACKWARD: tl.constexpr,
):
    """@@DOC@@
    """
    local = tl.arange(0, EL_PAD)
    split = recv + (tl.cast(q, tl.int64) * W + r) * (E_MAX * 2) + local * 2
    lo, count = clip(tl.load(split, mask=local < E_MAX, other=0), tl.load(split + 1, mask=local < E_MAX, other=0), s)
    n = tl.sum(count, axis=0)
    @@REGIONS@@ = return_regions(peer(heap, r), BACKWARD)
    out = staging + tl.cast(q, tl.int64) * (B * S) * H
    row_ids = staging_rid + tl.cast(q, tl.int64) * (B * S)
@@POINTERS@@    start = item * BLOCK_R
    while start < n:
        u = start + tl.arange(0, BLOCK_R)
        start += items * BLOCK_R
        live = u < n
        _, row = locate(u, lo, count, local)
@@FIND@@        @@DECODED@@ = decode(rid, rid_c, rid_r, rid_t, rid_k)
        ok = owned_by(rank, rid, @@SENDS@@, r, ctl, entry, epoch, s)
        if not BACKWARD:
            tl.atomic_add(stats + tl.cast(q, tl.int64) * ST_COLS + ST_RETURNED, tl.sum(ok.to(tl.int32), axis=0))
@@LAND@@@@COPY@@'''
    parts |= {
        "@@REGIONS@@": "landing, ids" if p.ring else "landing",
        "@@DECODED@@": "rank, _t, _k" if p.ring else "rank, t, k",
    }
    for k, v in parts.items():
        text = text.replace(k, v)
    return text


def _return_parts(p: KernelContract) -> dict[str, str]:
    """The plain return: every row of the piece goes, as the owner computed it."""
    if p.ring:
        land = """        at = ring_row(row, s, claim)  # the claim's slot of r's return ring
        to = landing + tl.cast(at, tl.int64) * H
        put(ids + at, rid, ok)
"""
        where = """into
    the slot of r's return ring that this piece claimed (claim % B), each row with its row_id;
    r's unpack places them."""
    else:
        land = """        to = landing + (t * K + k) * H
"""
        where = """each
    to its (token, slot) place, by its decoded row_id, never by its position (appendix A.3,
    condition 3)."""
    doc = f"""Owner q → front-end r, segment s: the outputs of r's rows in the segment, {where}

    The rows are found by the owner's saved split table (one span per local expert), cut to
    the segment. A row_id that decodes to another rank is reported, not written. The
    backward returns dL/dx rows the same way, into r's backward regions."""
    return {
        "@@CAST@@": "",
        "@@SAVED@@": "",
        "@@DOC@@": doc,
        "@@POINTERS@@": "",
        "@@FIND@@": """        frm = ring_row(row, s, s)
        rid = tl.load(row_ids + frm, mask=live, other=0)
""",
        "@@SENDS@@": "live",
        "@@LAND@@": land,
        "@@COPY@@": """        frm = out + tl.cast(frm, tl.int64) * H
        for h in range(0, H, BLOCK_H):
            c = h + tl.arange(0, BLOCK_H)
            m = ok[:, None] & (c < H)[None, :]
            put(to[:, None] + c[None, :], tl.load(frm[:, None] + c[None, :], mask=m), m)
""",
    }


def unpack_source(p: KernelContract) -> str:
    skip = "        live = live & (rid >= 0)  # dedup: no row at this place (its token returned elsewhere)\n"
    return '''@triton.jit
def unpack(
    heap,
    landing,
    ctl,
    entry,
    epoch,
    r,
    q,
    s,
    claim,
    item,
    items,
    rid_c,
    rid_r,
    rid_t,
    rid_k,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Front-end r: copy the piece owner q returned for segment s out of its return-ring
    slot (claim % B) to each row's (token, slot) place in r's private landing, by the row's
    decoded row_id (appendix A.3, condition 3); done, the slot is free for claim + B.

    Which slot rows hold the piece follows from what q published to r: the admitted spans
    (offset, count) per local expert, cut to the segment.
    """
    local = tl.arange(0, EL_PAD)
    me = peer(heap, r)
    offset = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, mask=local < E_MAX, other=0)
    admitted = tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, mask=local < E_MAX, other=0)
    lo, count = clip(offset, admitted, s)
    n = tl.sum(count, axis=0)
    ring, ids = return_regions(me, BACKWARD)
    mine = landing + tl.cast(r, tl.int64) * (T * K) * H
    start = item * BLOCK_R
    while start < n:
        u = start + tl.arange(0, BLOCK_R)
        start += items * BLOCK_R
        live = u < n
        _, row = locate(u, lo, count, local)
        at = ring_row(row, s, claim)
        rid = tl.load(ids + at, mask=live, other=0)
@@SKIP@@        rank, t, k = decode(rid, rid_c, rid_r, rid_t, rid_k)
        ok = owned_by(rank, rid, live, r, ctl, entry, epoch, s)
        frm = ring + tl.cast(at, tl.int64) * H
        to = mine + (t * K + k) * H
        for h in range(0, H, BLOCK_H):
            c = h + tl.arange(0, BLOCK_H)
            m = ok[:, None] & (c < H)[None, :]
            tl.store(to[:, None] + c[None, :], tl.load(frm[:, None] + c[None, :], mask=m), mask=m)
'''.replace("@@SKIP@@", skip if p.dedup else "")


def combine_source(p: KernelContract) -> str:
    if p.weights == "renormalize":
        weights = """    # g' = g * sum_j g_j / sum_{j accepted} g_j on accepted slots, 0 elsewhere; 0 if none survived.
    total = tl.sum(g, axis=1)
    survived = tl.sum(kept, axis=1)
    scale = tl.where(survived != 0, total / tl.where(survived != 0, survived, 1.0), 0.0)
    w = kept * scale[:, None]
"""
    else:
        weights = "    w = kept  # weights zero: accepted slots keep g, dropped ones get 0\n"
    text = (
        '''@triton.jit
def combine(
    heap,
@@LANDING_ARG@@    topk_ids,
    gates,
    y,
    accepted,
    slot,
    gprime,
    owner_of,
    local_of,
    rowpos,
    saved_out,
    r,
    tile,
    n_tokens,
    BLOCK_H: tl.constexpr,
    CAST_F32: tl.constexpr,
    SAVE: tl.constexpr,
):
    """Front-end r, one tile of tokens: y_t = sum_k g'_tk out_tk, the slots in fixed order.

    A slot is accepted iff its position in its (source, expert) run is below the count its
    owner admitted and published back. No float atomics: bitwise deterministic. The
    routing context backward will need (accepted set, payload slot at the owner, g') is
    written beside y; with ``SAVE`` also each accepted slot's expert output, for the gate
    gradient.
    """
    t = tile * COMBINE_TOKENS + tl.arange(0, COMBINE_TOKENS)
    k = tl.arange(0, K_PAD)
    live = (t < n_tokens)[:, None] & (k < K)[None, :]
    i = t[:, None] * K + k[None, :]
    base = tl.cast(r, tl.int64) * n_tokens * K
    e = tl.load(topk_ids + base + i, mask=live, other=0)
    live = live & (e >= 0) & (e < E)  # an id out of range was never routed (validate reports it)
    at = tl.load(owner_of + e, mask=live, other=0) * E_MAX + tl.load(local_of + e, mask=live, other=0)
    p = tl.load(rowpos + tl.cast(r, tl.int64) * (T * K) + i, mask=live, other=0)
    me = peer(heap, r)
    admitted = tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32)) + at, mask=live, other=0)
    offset = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32)) + at, mask=live, other=0)
    ok = live & (p < admitted)
    g = tl.load(gates + base + i, mask=live, other=0.0)
    kept = tl.where(ok, g, 0.0)
'''
        + weights
        + """    real = (t < n_tokens)[:, None] & (k < K)[None, :]
    tl.store(accepted + base + i, ok.to(tl.int8), mask=real)
    tl.store(slot + base + i, tl.where(ok, offset + p, -1), mask=real)
    tl.store(gprime + base + i, w, mask=real)
@@SUM@@"""
    )
    plain = """    tl.debug_barrier()  # the loop below reads g' and the accepted set back, slot by slot
@@LANDING@@    y_rows = y + (tl.cast(r, tl.int64) * n_tokens + t) * H
    real = t < n_tokens
    for h in range(0, H, BLOCK_H):
        c = h + tl.arange(0, BLOCK_H)
        acc = tl.zeros([COMBINE_TOKENS, BLOCK_H], tl.float32)
        for kk in range(K):
            wk = tl.load(gprime + base + t * K + kk, mask=real, other=0.0)
            ok_k = tl.load(accepted + base + t * K + kk, mask=real, other=0) != 0
            m = ok_k[:, None] & (c < H)[None, :]
            out = tl.load(landing + (t[:, None] * K + kk) * H + c[None, :], mask=m, other=0.0)
            acc += wk[:, None] * out.to(tl.float32)
            if SAVE:
                tl.store(saved_out + (base + t[:, None] * K + kk) * H + c[None, :], out, mask=m)
        keep = real[:, None] & (c < H)[None, :]
        tl.store(y_rows[:, None] + c[None, :], @@Y@@, mask=keep)
"""
    if p.dedup:  # the returned rows are per (token, owner): the owner kept each slot's output (gemm2)
        total = dedup.combine_leads("at // E_MAX", "offset + p") + "@@LANDING@@" + dedup.combine_sum(p)
        saves = "with ``SAVE`` also each accepted slot's expert output, for the gate\n    gradient."
        text = text.replace(saves, "under dedup the owners keep the expert outputs for\n    the gate gradient (gemm2).")
    text = text.replace("@@SUM@@", total if p.dedup else plain)
    landing = (
        "    landing = landing + tl.cast(r, tl.int64) * (T * K) * H  # unpacked from the return ring\n"
        if p.ring
        else "    landing = return_regions(me, False)\n"
    )
    return (
        text.replace("@@Y@@", narrowed(p, "acc", "DTYPE"))
        .replace("@@LANDING_ARG@@", "    landing,\n" if p.ring else "")
        .replace("@@LANDING@@", landing)
    )
