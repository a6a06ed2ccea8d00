"""The balance plan as device functions (``balance replicate``): each call, the load the
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
def probe(lam, owner, ell, tau, home, e_idx, w_idx):
    """The greedy oracle at bound ``tau``: (the quotas [HOMES_PAD, W_PAD], whether every rank
    gets under ``tau``). Overloaded ranks by decreasing excess (lowest rank on a tie), each
    shedding its hottest home experts first (lowest id on a tie), each transfer one replica
    on the admissible rank with the most slack (lowest rank on a tie), of at least
    MIN_ROWS rows; a rank that cannot get under ``tau`` ends the probe. Every loop ends:
    each turn marks a rank, an expert or (a replica) a rank of the expert as done."""
    real_w = w_idx < W
    exc = tl.where(real_w, tl.maximum(ell - tau, 0), 0)
    slk = tl.where(real_w, tl.maximum(tau - ell, 0), 0)
    order = tl.where(exc > 0, exc, -1)  # the rank order is fixed by the excess before any transfer
    used = tl.zeros([W_PAD], tl.int32)
    quota = tl.where(home, lam[:, None], 0)
    ok = tau == tau
    while ok & (tl.max(order, axis=0) > 0):
        r = tl.argmax(order, axis=0)
        order = tl.where(w_idx == r, -1, order)
        cand_e = tl.where(owner == r, lam, -1)
        while (tl.max(cand_e, axis=0) >= 0) & (pick(exc, w_idx, r) > 0):
            e = tl.argmax(cand_e, axis=0)
            cand_e = tl.where(e_idx == e, -1, cand_e)
            row = e_idx[:, None] == e
            go = e == e
            while go:  # one replica a rank at most
                q_e = tl.sum(tl.where(row, quota, 0), axis=0)
                exc_r = pick(exc, w_idx, r)
                q_er = pick(q_e, w_idx, r)
                admissible = (slk > 0) & (used < SLOTS) & (q_e == 0) & (w_idx != r) & real_w
                t = tl.argmax(tl.where(admissible, slk, -1), axis=0)
                # at least MIN_ROWS even when less excess is left (rdepc.ir.balance._probe says why)
                delta = tl.minimum(tl.minimum(tl.maximum(exc_r, MIN_ROWS), pick(slk, w_idx, t)), q_er)
                go = (exc_r > 0) & (q_er > 0) & (tl.max(admissible.to(tl.int32), axis=0) > 0) & (delta >= MIN_ROWS)
                d = tl.where(go, delta, 0)
                quota += tl.where(row & (w_idx[None, :] == t), d, 0) - tl.where(row & (w_idx[None, :] == r), d, 0)
                exc = tl.where(w_idx == r, tl.maximum(exc - d, 0), exc)
                slk = tl.where(w_idx == t, slk - d, slk)
                used = tl.where((w_idx == t) & go, used + 1, used)
        ok = pick(exc, w_idx, r) == 0
    return quota, ok


@triton.jit
def solve_plan(load, owner_of, phys, cum, slot_table, loads):
    """The plan for the load ``load`` [W, HOMES] (``rdepc.ir.balance.solve``), in one program.

    Writes ``phys`` [HOMES, W] (the physical expert of e's instance on rank t, -1 where e
    has none), ``cum`` [W, HOMES, W] (per source and expert, the inclusive running sum of
    the rows it sends each instance, in rank order), ``slot_table`` [W, SLOTS] (the home
    expert in each slot, -1 empty) and ``loads`` [2, W] (rows per rank before and after)."""
    e_idx = tl.arange(0, HOMES_PAD)
    w_idx = tl.arange(0, W_PAD)
    real_e = e_idx < HOMES
    real_w = w_idx < W
    owner = tl.load(owner_of + e_idx, mask=real_e, other=-1)
    lam = tl.zeros([HOMES_PAD], tl.int32)
    for src in range(W):
        lam += tl.load(load + src * HOMES + e_idx, mask=real_e, other=0)
    home = owner[:, None] == w_idx[None, :]
    ell = tl.sum(tl.where(home, lam[:, None], 0), axis=0)
    # a binary search over the per-rank bound τ; feasibility is taken as monotone in τ
    hi = tl.max(ell, axis=0)
    lo = (tl.sum(ell, axis=0) + W - 1) // W
    best = tl.where(home, lam[:, None], 0)
    while lo < hi:
        tau = (lo + hi) // 2
        quota, ok = probe(lam, owner, ell, tau, home, e_idx, w_idx)
        best = tl.where(ok, quota, best)
        hi = tl.where(ok, tau, hi)
        lo = tl.where(ok, lo, tau + 1)
    held = (best > 0) & ~home
    j = tl.cumsum(held.to(tl.int32), axis=0) - held.to(tl.int32)  # slots go to replicas by expert id
    inst = tl.where(home, e_idx[:, None], tl.where(held, HOMES + w_idx[None, :] * SLOTS + j, -1))
    both = real_e[:, None] & real_w[None, :]
    tl.store(phys + e_idx[:, None] * W + w_idx[None, :], inst, mask=both)
    for s in range(SLOTS):
        tl.store(
            slot_table + w_idx * SLOTS + s, tl.max(tl.where(held & (j == s), e_idx[:, None], -1), axis=0), mask=real_w
        )
    tl.store(loads + w_idx, ell, mask=real_w)
    tl.store(loads + W + w_idx, tl.sum(best, axis=0), mask=real_w)
    # an expert with one instance: every source's rows of it go there
    single = tl.sum((best > 0).to(tl.int32), axis=1) <= 1
    at = tl.sum(tl.where(best > 0, w_idx[None, :], 0), axis=1)
    for src in range(W):
        rows = tl.load(load + src * HOMES + e_idx, mask=real_e, other=0)
        ends = tl.where(w_idx[None, :] >= at[:, None], rows[:, None], 0)
        tl.store(cum + (src * HOMES + e_idx[:, None]) * W + w_idx[None, :], ends, mask=both & single[:, None])
    for e in range(HOMES):
        if pick(single.to(tl.int32), e_idx, e) == 0:
            split_rows(load, cum, tl.sum(tl.where(e_idx[:, None] == e, best, 0), axis=0), e, w_idx)


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
        ahead = (frac[None, :] > frac[:, None]) | ((frac[None, :] == frac[:, None]) & (w_idx[None, :] < w_idx[:, None]))
        share += (tl.sum(ahead.to(tl.int32), axis=1) < left).to(tl.int64)
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
