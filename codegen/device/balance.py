"""Exact-load expert replication (``balance replicate``), on the device: every call, the
load the router just produced → the plan every rank would derive → physical expert ids.

Three launches before the layer's, no host sync between them (nothing there keeps a CUDA
graph from capturing them):
``balance_count`` (one program per source: L[src, e], rows of src for home expert e),
``balance_solve`` (one program: the plan, UltraEP's Algorithm 1 exactly as the NumPy
reference ``rdepc.ir.balance.solve`` runs it, same tie-breaks, so the two agree to the row)
and ``balance_reroute`` (one program per source: each route row's physical expert, by its
position among the source's rows of its expert and the plan's cumulative split). Slot j of
rank t is physical expert HOMES + t·SLOTS + j (``rdepc.passes.replicate``).

One process per rank, the ranks exchange through a symmetric allocation of their own
(``rdepc.runtime.balance``: three int64 counters at its start, ``rdepc.ir.balance.COUNTERS``
— loads, replica gradients and receipts arrived — then the load table, the slots' weights
and the replicas' gradients): ``balance_exchange`` replaces the count; the layer's own
kernel fills the slots, as tasks of its graph (``push_slot``, ``receive_slot``: a rank's
push and receive, ``rdepc.passes.tasks``), so the pushes overlap the route and dispatch;
``balance_give``/``balance_await``/``balance_reduce`` bring the replicas' weight gradients
home in the backward.
"""

import triton
import triton.language as tl
from rdepc.codegen.device.heap import peer_in, put
from rdepc.codegen.device.layout import (
    DTYPE,
    HOMES,
    HOMES_PAD,
    K_PAD,
    MIN_ROWS,
    ROUTE_ROWS,
    SLOTS,
    SLOTS_PAD,
    W_PAD,
    E,
    K,
    W,
)
from rdepc.codegen.device.signals import signal, wait
from rdepc.codegen.device.slots import copy_elems


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
def balance_count(topk_ids, load, n_tokens):
    """Program r (one process holds every rank): L[r, e], source r's rows of each home expert."""
    r = tl.program_id(0)
    n = n_tokens * K
    experts = tl.arange(0, HOMES_PAD)
    counts = count_rows(topk_ids + tl.cast(r, tl.int64) * n, n)
    tl.store(load + r * HOMES + experts, counts, mask=experts < HOMES)


@triton.jit
def balance_exchange(bal, stride, loads_at, topk_ids, n_tokens, rank, expected, bound, err):
    """One process per rank, rank ``rank``'s one program: its row of L (its own rows per home
    expert) into every rank's copy of the load table (``loads_at``: [W, HOMES] int32), a
    signal on each rank's first counter, then the wait until every source's row has landed
    here: W a call, counted over calls in ``expected[0]`` on the device, so that a replayed
    CUDA graph waits for its own call's rows (``err`` set when the bound expires)."""
    target = tl.load(expected) + W
    tl.store(expected, target)
    experts = tl.arange(0, HOMES_PAD)
    counts = count_rows(topk_ids, n_tokens * K)
    for t in range(W):
        base = peer_in(bal, t, stride)
        row = (base + loads_at).to(tl.pointer_type(tl.int32)) + rank * HOMES
        put(row + experts, counts, experts < HOMES)
        signal(base.to(tl.pointer_type(tl.int64)))
    settle(peer_in(bal, rank, stride).to(tl.pointer_type(tl.int64)), target, bound, err, 1)


@triton.jit
def settle(flag, target, bound, err, what):
    """Wait for ``flag`` to reach ``target``; on expiry set ``err`` to ``what`` (the counter
    waited on, plus one: the host names it in the error it raises)."""
    seen = wait(flag, target, bound, err)
    if seen < target:
        tl.store(err, what)


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
def balance_solve(load, owner_of, phys, cum, slot_table, loads):
    """One program: the plan for the load ``load`` [W, HOMES] (``rdepc.ir.balance.solve``).

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
def balance_reroute(topk_ids, phys_ids, phys, cum, n_tokens, rank0):
    """Program i, source r = ``rank0`` + i (one process per rank: its own, i = 0): each
    route row's physical expert. A row's position among r's rows of its
    expert (row order) picks the instance whose cumulative split first passes it. A token
    that names an expert twice sends both rows to one instance, so the layer's input check
    still sees the repeat; an id outside [0, HOMES) other than -1 becomes E (out of range
    there too)."""
    me = tl.program_id(0)
    r = rank0 + me
    n = n_tokens * K
    ids = topk_ids + tl.cast(me, tl.int64) * n
    out = phys_ids + tl.cast(me, tl.int64) * n
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
def balance_await(bal, stride, counter: tl.constexpr, slot_table, owner_of, expected, rank, bound, err):
    """Wait on this rank's counter ``counter`` for this call's arrivals, counted over calls
    in ``expected``: (1) one replica gradient per slot of any rank that holds an expert homed
    here; (2) one receipt per slot of this rank the plan filled: its gradient region was read
    by the home, so the next call's (or a sharing layer's) ``balance_give`` may write it again."""
    s = tl.arange(0, SLOTS_PAD)
    e = tl.load(slot_table + s, mask=s < W * SLOTS, other=-1)
    if counter == 1:
        mine = (e >= 0) & (tl.load(owner_of + tl.maximum(e, 0), mask=e >= 0, other=-1) == rank)
    else:
        mine = (s // SLOTS == rank) & (e >= 0)
    target = tl.load(expected + counter) + tl.sum(mine.to(tl.int64), axis=0)
    tl.store(expected + counter, target)
    settle(peer_in(bal, rank, stride).to(tl.pointer_type(tl.int64)) + counter, target, bound, err, counter + 1)


@triton.jit
def balance_give(bal, stride, grads_at, slot_table, owner_of, packed, P, rank):
    """Program j: the weight gradients of this rank's slot j (``packed`` [SLOTS, P]) into
    its own ``grads_at`` region, then a signal on the second counter of the expert's home."""
    j = tl.program_id(0)
    e = tl.load(slot_table + rank * SLOTS + j)
    if e >= 0:
        dst = (peer_in(bal, rank, stride) + grads_at).to(tl.pointer_type(DTYPE)) + tl.cast(j, tl.int64) * P
        copy_elems(packed + tl.cast(j, tl.int64) * P, dst, P)
        home = peer_in(bal, tl.load(owner_of + e), stride)
        signal(home.to(tl.pointer_type(tl.int64)) + 1)


@triton.jit
def balance_reduce(bal, stride, grads_at, slot_table, homes, packed, P):
    """Program i: into ``packed`` row i ([E_loc, P], zeros) each replica's gradient of home
    expert ``homes[i]``, read from the replicas' ranks in rank order and added in DTYPE (as
    the one-process layer adds them; autograd then adds the sum to the home's own gradient);
    then a receipt on the third counter of each replica's rank (its region may be written
    again)."""
    i = tl.program_id(0)
    e = tl.load(homes + i)
    row = packed + tl.cast(i, tl.int64) * P
    start = 0
    while start < P:
        c = start + tl.arange(0, 1024)
        acc = tl.load(row + c, mask=c < P)
        for t in range(W):
            for j in range(SLOTS):
                if tl.load(slot_table + t * SLOTS + j) == e:
                    src = (peer_in(bal, t, stride) + grads_at).to(tl.pointer_type(DTYPE)) + tl.cast(j, tl.int64) * P
                    acc = (acc.to(tl.float32) + tl.load(src + c, mask=c < P).to(tl.float32)).to(DTYPE)
        tl.store(row + c, acc, mask=c < P)
        start += 1024
    for t in range(W):
        for j in range(SLOTS):
            if tl.load(slot_table + t * SLOTS + j) == e:
                signal(peer_in(bal, t, stride).to(tl.pointer_type(tl.int64)) + 2)
