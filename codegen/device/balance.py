"""A ``balance replicate`` layer's own launches around its kernel's.

With every rank in one process, three before the layer's, no host sync between them
(nothing there keeps a CUDA graph from capturing them): ``balance_count`` (one program per
source: L[src, e], rows of src for home expert e), ``balance_solve`` (one program: the
plan, ``codegen/device/replicas.py``) and ``balance_reroute`` (one program per source: each
route row's physical expert). One process per rank the plan is tasks of the layer's own
kernel (``load``, ``solve``, ``reroute``, beside its weight ``push`` and ``receive``), and
what is left here is the backward's: ``balance_give``/``balance_await``/``balance_reduce``
bring the replicas' weight gradients home through the exchange (``rdepc.runtime.balance``:
its int64 counters, ``rdepc.ir.balance.COUNTERS``, then the load table, the slots'
weights and the replicas' gradients).
"""

import triton
import triton.language as tl
from rdepc.codegen.device.heap import peer_in
from rdepc.codegen.device.layout import DTYPE, HOMES, HOMES_PAD, SLOTS, SLOTS_PAD, K, W
from rdepc.codegen.device.replicas import count_rows, reroute_rows, solve_plan
from rdepc.codegen.device.signals import signal, wait
from rdepc.codegen.device.slots import copy_elems


@triton.jit
def balance_count(topk_ids, load, n_tokens):
    """Program r (one process holds every rank): L[r, e], source r's rows of each home expert."""
    r = tl.program_id(0)
    n = n_tokens * K
    experts = tl.arange(0, HOMES_PAD)
    counts = count_rows(topk_ids + tl.cast(r, tl.int64) * n, n)
    tl.store(load + r * HOMES + experts, counts, mask=experts < HOMES)


@triton.jit
def settle(flag, target, bound, err, what):
    """Wait for ``flag`` to reach ``target``; on expiry set ``err`` to ``what`` (the counter
    waited on, plus one: the host names it in the error it raises)."""
    seen = wait(flag, target, bound, err)
    if seen < target:
        tl.store(err, what)


@triton.jit
def balance_solve(load, owner_of, phys, cum, slot_table, loads):
    """One program: the plan (:func:`solve_plan`; the tables as ``rdepc.ir.balance.plan_tables``)."""
    solve_plan(load, owner_of, phys, cum, slot_table, loads)


@triton.jit
def balance_reroute(topk_ids, phys_ids, phys, cum, n_tokens):
    """Program r (one process holds every rank): source r's route rows' physical experts
    (:func:`reroute_rows`)."""
    r = tl.program_id(0)
    at = tl.cast(r, tl.int64) * (n_tokens * K)
    reroute_rows(topk_ids + at, phys_ids + at, phys, cum, n_tokens * K, r)


@triton.jit
def balance_await(bal, stride, counter: tl.constexpr, slot_table, owner_of, expected, rank, bound, err):
    """Wait on this rank's counter ``counter`` for this call's arrivals, counted over calls
    in ``expected``: (0) one replica gradient per slot of any rank that holds an expert homed
    here; (1) one receipt per slot of this rank the plan filled: its gradient region was read
    by the home, so the next call's (or a sharing layer's) ``balance_give`` may write it again."""
    s = tl.arange(0, SLOTS_PAD)
    e = tl.load(slot_table + s, mask=s < W * SLOTS, other=-1)
    if counter == 0:
        mine = (e >= 0) & (tl.load(owner_of + tl.maximum(e, 0), mask=e >= 0, other=-1) == rank)
    else:
        mine = (s // SLOTS == rank) & (e >= 0)
    target = tl.load(expected + counter) + tl.sum(mine.to(tl.int64), axis=0)
    tl.store(expected + counter, target)
    settle(peer_in(bal, rank, stride).to(tl.pointer_type(tl.int64)) + counter, target, bound, err, counter + 1)


@triton.jit
def balance_give(bal, stride, grads_at, slot_table, owner_of, packed, P, rank):
    """Program j: the weight gradients of this rank's slot j (``packed`` [SLOTS, P]) into
    its own ``grads_at`` region, then a signal on the first counter of the expert's home (its replicas' gradients)."""
    j = tl.program_id(0)
    e = tl.load(slot_table + rank * SLOTS + j)
    if e >= 0:
        dst = (peer_in(bal, rank, stride) + grads_at).to(tl.pointer_type(DTYPE)) + tl.cast(j, tl.int64) * P
        copy_elems(packed + tl.cast(j, tl.int64) * P, dst, P)
        home = peer_in(bal, tl.load(owner_of + e), stride)
        signal(home.to(tl.pointer_type(tl.int64)))


@triton.jit
def balance_reduce(bal, stride, grads_at, slot_table, homes, packed, P):
    """Program i: into ``packed`` row i ([E_loc, P], zeros) each replica's gradient of home
    expert ``homes[i]``, read from the replicas' ranks in rank order and added in DTYPE (as
    the one-process layer adds them; autograd then adds the sum to the home's own gradient);
    then a receipt on the second counter of each replica's rank (its region may be written
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
                signal(peer_in(bal, t, stride).to(tl.pointer_type(tl.int64)) + 1)
