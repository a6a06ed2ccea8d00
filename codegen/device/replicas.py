"""The replica map as device functions (``balance replicate``; UltraEP's balance plan): each call, the load the
router just produced → the plan every rank derives → each route row's physical expert.

Count the rows per home expert (:func:`count_rows`), solve UltraEP's Algorithm 1 exactly as
the NumPy reference ``rdepc.ir.balance.solve`` runs it, same tie-breaks, so the two agree
to the row (:func:`solve_plan`), and give each route row the instance its position among
its source's rows of the expert falls in (:func:`reroute_rows`). Slot j of rank t is
physical expert HOMES + t·SLOTS + j (``rdepc.passes.replicate``).

One process per rank they are tasks of the layer's own kernel (``rdepc.passes.tasks``):
``load r`` puts r's row of the load table into every rank's copy (the exchange's loads
region), ``solve q`` — once every rank's load has landed, the layer's own bounded waits —
writes q's copy of the plan (``rdepc.ir.balance.plan_tables``), ``reroute q`` the physical
ids q's route reads. Every rank derives the same plan from the same table, so they need no
further exchange. With every rank in one process the generated file's ``balance_count``,
``balance_solve`` and ``balance_reroute`` (``codegen/device/balance.py``) run them before
the layer's launch, whose slots' weights are gathered from the plan; in every other layer
SLOT_ELEMS is 0 and the kernel compiles none of them.
"""

import triton
import triton.language as tl
from rdepc.codegen.device.heap import peer_in, put
from rdepc.codegen.device.layout import (
    EX_LOADS_AT,
    HOMES,
    HOMES_PAD,
    K_PAD,
    MIN_ROWS,
    PLAN_CUM_AT,
    PLAN_LOADS_AT,
    PLAN_PHYS_AT,
    PLAN_SLOTS_AT,
    RANK_SLOTS_PAD,
    ROUTE_ROWS,
    SLOTS,
    W_PAD,
    E,
    K,
    W,
)


@triton.jit
def count_rows(ids, n):
    """Rows of the ``n`` route rows at ``ids`` per home expert, [HOMES_PAD] (ids outside
    [0, HOMES) count nowhere: -1 is no expert, the layer's input check reports the others)."""
    experts = tl.arange(0, HOMES_PAD)
    counts = tl.zeros([HOMES_PAD], tl.int32)
    start = 0
    while start < n:
        i = start + tl.arange(0, ROUTE_ROWS)
        e = tl.load(ids + i, mask=i < n, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
        start += ROUTE_ROWS
    return counts


@triton.jit
def pick(values, index, at):
    """values[at] of a vector indexed by ``index``."""
    return tl.sum(tl.where(index == at, values, 0), axis=0)


@triton.jit
def pick2(values, rows, cols, r, c):
    """values[r, c] of a [len(rows), len(cols)] tensor."""
    return tl.sum(tl.sum(tl.where((rows[:, None] == r) & (cols[None, :] == c), values, 0), axis=1), axis=0)


@triton.jit
def probe(lam, owner, ell, tau, e_idx, w_idx, s_idx):
    """The greedy oracle at bound ``tau``: the quotas as (each home expert's quota at its
    owner [HOMES_PAD]; each rank's replicas in the order made, their experts and quotas
    [W_PAD, RANK_SLOTS_PAD], expert -1 where none), and whether every rank gets under
    ``tau``. Overloaded ranks by decreasing excess (lowest rank on a tie), each shedding its
    hottest home experts first (lowest id on a tie), each transfer one replica on the
    admissible rank with the most slack (lowest rank on a tie), of at least MIN_ROWS rows;
    a rank that cannot get under ``tau`` ends the probe. Every loop ends: each turn marks a
    rank, an expert or (a replica) a rank of the expert as done. An expert's quotas other
    than its home's are its replicas' (the rank shedding rows is always its owner), so the
    [HOMES, W] quota matrix is never held: at W = 72 it spilled the solver to 4 KB of stack."""
    real_w = w_idx < W
    exc = tl.where(real_w, tl.maximum(ell - tau, 0), 0)
    slk = tl.where(real_w, tl.maximum(tau - ell, 0), 0)
    order = tl.where(exc > 0, exc, -1)  # the rank order is fixed by the excess before any transfer
    used = tl.zeros([W_PAD], tl.int32)
    home_q = lam
    rep_e = tl.full([W_PAD, RANK_SLOTS_PAD], -1, tl.int32)
    rep_q = tl.zeros([W_PAD, RANK_SLOTS_PAD], tl.int32)
    ok = tau == tau
    while ok & (tl.max(order, axis=0) > 0):
        r = tl.argmax(order, axis=0)
        order = tl.where(w_idx == r, -1, order)
        cand_e = tl.where(owner == r, lam, -1)
        while (tl.max(cand_e, axis=0) >= 0) & (pick(exc, w_idx, r) > 0):
            e = tl.argmax(cand_e, axis=0)
            cand_e = tl.where(e_idx == e, -1, cand_e)
            go = e == e
            while go:  # one replica a rank at most
                holds = tl.max((rep_e == e).to(tl.int32), axis=1) > 0
                exc_r = pick(exc, w_idx, r)
                q_er = pick(home_q, e_idx, e)
                admissible = (slk > 0) & (used < SLOTS) & ~holds & (w_idx != r) & real_w
                t = tl.argmax(tl.where(admissible, slk, -1), axis=0)
                # at least MIN_ROWS even when less excess is left (rdepc.ir.balance._probe says why)
                delta = tl.minimum(tl.minimum(tl.maximum(exc_r, MIN_ROWS), pick(slk, w_idx, t)), q_er)
                go = (exc_r > 0) & (q_er > 0) & (tl.max(admissible.to(tl.int32), axis=0) > 0) & (delta >= MIN_ROWS)
                d = tl.where(go, delta, 0)
                home_q = tl.where(e_idx == e, home_q - d, home_q)
                at = go & (w_idx[:, None] == t) & (s_idx[None, :] == pick(used, w_idx, t))
                rep_e = tl.where(at, e, rep_e)
                rep_q = tl.where(at, d, rep_q)
                exc = tl.where(w_idx == r, tl.maximum(exc - d, 0), exc)
                slk = tl.where(w_idx == t, slk - d, slk)
                used = tl.where((w_idx == t) & go, used + 1, used)
        ok = pick(exc, w_idx, r) == 0
    return home_q, rep_e, rep_q, ok


@triton.jit
def per_rank(values, owner, w_idx):
    """Per rank, the sum of ``values`` [HOMES_PAD] over its home experts, [W_PAD]."""
    e_idx = tl.arange(0, HOMES_PAD)
    out = tl.zeros([W_PAD], tl.int32)
    for e in range(HOMES):
        out += tl.where(w_idx == pick(owner, e_idx, e), pick(values, e_idx, e), 0)
    return out


@triton.jit
def solve_plan(load, owner_of, phys, cum, slot_table, loads):
    """The plan for the load ``load`` [W, HOMES] (``rdepc.ir.balance.solve``), in one program.

    Writes ``phys`` [HOMES, W] (the physical expert of e's instance on rank t, -1 where e
    has none), ``cum`` [W, HOMES, W] (per source and expert, the inclusive running sum of
    the rows it sends each instance, in rank order), ``slot_table`` [W, SLOTS] (the home
    expert in each slot, -1 empty) and ``loads`` [2, W] (rows per rank before and after)."""
    e_idx = tl.arange(0, HOMES_PAD)
    w_idx = tl.arange(0, W_PAD)
    s_idx = tl.arange(0, RANK_SLOTS_PAD)
    real_e = e_idx < HOMES
    real_w = w_idx < W
    owner = tl.load(owner_of + e_idx, mask=real_e, other=-1)
    lam = tl.zeros([HOMES_PAD], tl.int32)
    for src in range(W):
        lam += tl.load(load + src * HOMES + e_idx, mask=real_e, other=0)
    ell = per_rank(lam, owner, w_idx)
    # a binary search over the per-rank bound τ; feasibility is taken as monotone in τ
    hi = tl.max(ell, axis=0)
    lo = (tl.sum(ell, axis=0) + W - 1) // W
    home_q = lam
    rep_e = tl.full([W_PAD, RANK_SLOTS_PAD], -1, tl.int32)
    rep_q = tl.zeros([W_PAD, RANK_SLOTS_PAD], tl.int32)
    while lo < hi:
        tau = (lo + hi) // 2
        q, re, rq, ok = probe(lam, owner, ell, tau, e_idx, w_idx, s_idx)
        home_q = tl.where(ok, q, home_q)
        rep_e = tl.where(ok, re, rep_e)
        rep_q = tl.where(ok, rq, rep_q)
        hi = tl.where(ok, tau, hi)
        lo = tl.where(ok, lo, tau + 1)
    # a rank's slots go to its replicas by expert id: slot j holds the one with j smaller ids there
    made = rep_e >= 0
    j = tl.sum(((rep_e[:, None, :] < rep_e[:, :, None]) & made[:, None, :]).to(tl.int32), axis=2)
    for s in range(SLOTS):
        tl.store(slot_table + w_idx * SLOTS + s, tl.max(tl.where(made & (j == s), rep_e, -1), axis=1), mask=real_w)
    tl.store(loads + w_idx, ell, mask=real_w)
    tl.store(loads + W + w_idx, per_rank(home_q, owner, w_idx) + tl.sum(rep_q, axis=1), mask=real_w)
    # each expert's instances: its home (while it keeps rows) and its replicas; an expert with
    # one has every source's rows go there (``at``)
    n = (home_q > 0).to(tl.int32)
    at = tl.where(home_q > 0, owner, 0)
    for t in range(W):
        col = tl.where(owner == t, e_idx, -1)
        for s in range(SLOTS):
            e = pick2(rep_e, w_idx, s_idx, t, s)
            slot = pick2(j, w_idx, s_idx, t, s)
            col = tl.where((e_idx == e) & (e >= 0), HOMES + t * SLOTS + slot, col)
            n += (e_idx == e).to(tl.int32)
            at += tl.where((e_idx == e) & (home_q == 0), t, 0)
        tl.store(phys + e_idx * W + t, col, mask=real_e)
    single = n <= 1
    both = real_e[:, None] & real_w[None, :]
    for src in range(W):
        rows = tl.load(load + src * HOMES + e_idx, mask=real_e, other=0)
        ends = tl.where(w_idx[None, :] >= at[:, None], rows[:, None], 0)
        tl.store(cum + (src * HOMES + e_idx[:, None]) * W + w_idx[None, :], ends, mask=both & single[:, None])
    for e in range(HOMES):
        if pick(single.to(tl.int32), e_idx, e) == 0:
            quota = tl.where(w_idx == pick(owner, e_idx, e), pick(home_q, e_idx, e), 0)
            quota += tl.sum(tl.where(rep_e == e, rep_q, 0), axis=1)
            split_rows(load, cum, quota, e, w_idx)


@triton.jit
def split_rows(load, cum, quota, e, w_idx):
    """Expert e's rows over its instances (quotas ``quota`` [W_PAD], two or more), source by source:
    ``rdepc.ir.balance._reroute`` — a source holding an instance fills it with its own rows
    first; the rest in proportion to the instances' remaining quotas, floors first and the
    leftover rows to the largest remainders (lowest rank on a tie)."""
    real_w = w_idx < W
    hosts = quota > 0
    demand = tl.load(load + w_idx * HOMES + e, mask=real_w, other=0)
    local = tl.where(hosts, tl.minimum(demand, quota), 0)
    rem = (quota - local).to(tl.int64)
    total = tl.sum(rem, axis=0)
    for src in range(W):
        d = pick(demand - local, w_idx, src).to(tl.int64)
        num = d * rem
        share = num // tl.maximum(total, 1)
        left = d - tl.sum(share, axis=0)
        frac = num - share * total
        while left > 0:  # a row each to the ``left`` largest remainders (no [W, W] ranking: it spilled at W = 72)
            w = tl.argmax(frac, axis=0)  # the first of the largest: lowest rank on a tie
            share = tl.where(w_idx == w, share + 1, share)
            frac = tl.where(w_idx == w, -1, frac)
            left -= 1
        rows = share + tl.where(w_idx == src, local, 0)
        tl.store(cum + (src * HOMES + e) * W + w_idx, tl.cumsum(rows.to(tl.int32), axis=0), mask=real_w)
        rem -= share
        total -= d


@triton.jit
def reroute_rows(ids, out, phys, cum, n, r):
    """Source r's ``n`` route rows at ``ids`` (home expert ids) → their physical experts at
    ``out``, in one program. A row's position among r's rows of its expert (row order)
    picks the instance whose cumulative split first passes it. A token that names an
    expert twice sends both rows to one instance, so the layer's input check still sees
    the repeat; an id outside [0, HOMES) other than -1 becomes E (out of range there too)."""
    experts = tl.arange(0, HOMES_PAD)
    w_idx = tl.arange(0, W_PAD)
    k_idx = tl.arange(0, K_PAD)
    counts = tl.zeros([HOMES_PAD], tl.int32)
    start = 0
    while start < n:
        i = start + tl.arange(0, ROUTE_ROWS)
        live = i < n
        given = tl.load(ids + i, mask=live, other=-1)
        mine = (given >= 0) & (given < HOMES)
        e = tl.where(mine, given, -1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        pos = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - onehot + counts[None, :]), axis=1)
        counts += tl.sum(onehot, axis=0)
        # the same expert earlier in the row's token: the row goes where the first went
        slot = i % K
        peers = i[:, None] - slot[:, None] + k_idx[None, :]
        earlier = (k_idx[None, :] < slot[:, None]) & live[:, None] & mine[:, None]
        same = (tl.load(ids + peers, mask=earlier, other=-1) == given[:, None]) & earlier
        pos -= tl.sum(same.to(tl.int32), axis=1)
        ends = tl.load(cum + (r * HOMES + e)[:, None] * W + w_idx[None, :], mask=mine[:, None] & (w_idx < W)[None, :])
        at = tl.sum(((ends <= pos[:, None]) & (w_idx < W)[None, :]).to(tl.int32), axis=1)
        p = tl.load(phys + e * W + at, mask=mine, other=0)
        tl.store(out + i, tl.where(mine, p, tl.where(given == -1, -1, E)).to(tl.int64), mask=live)
        start += ROUTE_ROWS


@triton.jit
def load_task(exchange, ex_stride, home_ids, n_tokens, rank):
    """Rank ``rank``'s load task: its row of the load table (its own route rows per home
    expert) into every rank's copy, [W, HOMES] int32 at the exchange's loads region. The
    task's done flag, raised after it, tells every rank's solve."""
    experts = tl.arange(0, HOMES_PAD)
    counts = count_rows(home_ids + tl.cast(rank, tl.int64) * (n_tokens * K), n_tokens * K)
    for t in range(W):
        row = (peer_in(exchange, t, ex_stride) + EX_LOADS_AT).to(tl.pointer_type(tl.int32)) + rank * HOMES
        put(row + experts, counts, experts < HOMES)


# A call, not inlined: inlined, the solver raised the per-rank builds' stack (moonlight's shape,
# sm_90: transport kernel 224 -> 328 B, unified nvshmem 1,056 -> 1,312 B). The load and the
# reroute stay inlined: as calls too, the unified build's GEMM loops spilled.
@triton.jit(noinline=True)
def solve_task(exchange, ex_stride, plan, owner_of, rank):
    """Rank ``rank``'s solve task, once every rank's load has landed: the call's plan from its
    copy of the load table into ``plan`` (``rdepc.ir.balance.plan_tables``: the table itself
    first, for the host's statistics). Every rank writes the same bytes."""
    load = (peer_in(exchange, rank, ex_stride) + EX_LOADS_AT).to(tl.pointer_type(tl.int32))
    i = tl.arange(0, W_PAD * HOMES_PAD)
    tl.store(plan + i, tl.load(load + i, mask=i < W * HOMES), mask=i < W * HOMES)
    solve_plan(
        load, owner_of, plan + PLAN_PHYS_AT, plan + PLAN_CUM_AT, plan + PLAN_SLOTS_AT, plan + PLAN_LOADS_AT
    )  # fmt: skip


@triton.jit
def reroute_task(home_ids, topk_ids, plan, n_tokens, rank):
    """Rank ``rank``'s reroute task, after its solve: its route rows' physical experts into
    ``topk_ids``, which its route, dispatch and combine read."""
    at = tl.cast(rank, tl.int64) * (n_tokens * K)
    reroute_rows(home_ids + at, topk_ids + at, plan + PLAN_PHYS_AT, plan + PLAN_CUM_AT, n_tokens * K, rank)
