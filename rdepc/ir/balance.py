"""Exact-load expert replication (``balance replicate``): the solver's NumPy reference.

Every microbatch, from the exact post-router load ``L[src, e]`` (rows source rank ``src``
routes to expert ``e``), every rank derives the same plan: which hot experts get a replica
in which of the N redundant slots of which rank, the quota each instance of an expert
carries, and how each source splits its rows of an expert over the instances. The
ownership map never changes: every expert keeps its home, replicas only add capacity.

The algorithm is UltraEP's (Algorithm 1): a binary search over the per-rank load threshold
τ with a greedy feasibility oracle, then a locality-first reroute. Integer arithmetic and
fixed tie-breaks (lowest rank, lowest expert id) make the plan a pure function of its
input, so ranks need no agreement step. numpy only: ``rdepc plan`` runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class ReplicationPlan:
    """One microbatch's plan. Ranks identify instances: a rank holds at most one of an expert."""

    slots: np.ndarray  # [W, N] int64: the expert in each redundant slot of each rank, -1 empty
    quota: np.ndarray  # [E, W] int64: rows the instance of e on rank t computes (0: no instance)
    split: np.ndarray  # [W, E, W] int64: rows of source src for expert e sent to its instance on t
    threshold: int  # the per-rank load bound the plan meets

    @property
    def rank_loads(self) -> np.ndarray:
        """Rows each rank computes under the plan, [W]."""
        return self.quota.sum(axis=0)


def owner_loads(load, owner) -> np.ndarray:
    """Rows each rank computes without replication: its home experts' loads, [W]."""
    import numpy as np

    load = np.asarray(load, dtype=np.int64)
    return np.bincount(np.asarray(owner), weights=load.sum(axis=0), minlength=load.shape[0]).astype(np.int64)


def imbalance(loads) -> float:
    """max/mean of per-rank loads (1.0 for an idle layer)."""
    import numpy as np

    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def solve(load, owner, slots: int, min_rows: int) -> ReplicationPlan:
    """The plan for load ``L[src, e]`` (W sources × E experts), ``owner[e]`` its home rank,
    ``slots`` redundant slots per rank and ``min_rows`` the least a replica may carry."""
    import numpy as np

    load = np.asarray(load, dtype=np.int64)
    owner = np.asarray(owner, dtype=np.int64)
    W, E = load.shape
    if owner.shape != (E,) or (owner < 0).any() or (owner >= W).any():
        raise ValueError(f"owner must give each of the {E} experts a rank in 0..{W - 1}")
    if (load < 0).any() or slots < 0 or min_rows < 1:
        raise ValueError("loads and slots must be non-negative and min_rows positive")
    lam = load.sum(axis=0)
    ell = owner_loads(load, owner)
    home = np.zeros((E, W), dtype=np.int64)
    home[np.arange(E), owner] = lam
    best, tau_best = home, int(ell.max()) if W else 0
    lo, hi = -(-int(ell.sum()) // W), tau_best
    while lo < hi:  # feasibility is taken as monotone in τ, as the seed's search does
        tau = (lo + hi) // 2
        quota = _probe(lam, owner, ell, tau, slots, min_rows)
        if quota is None:
            lo = tau + 1
        else:
            best, tau_best, hi = quota, tau, tau
    return ReplicationPlan(_slot_table(best, owner, slots), best, _reroute(load, best), tau_best)


def _probe(lam, owner, ell, tau: int, slots: int, min_rows: int):
    """The greedy oracle: the quotas [E, W] that bring every rank to at most τ, or None.

    Overloaded ranks shed excess hottest home expert first, each transfer creating one
    replica on the admissible rank with the most slack (no slot left, a rank that already
    holds the expert, or no slack: not admissible), of at least ``min_rows`` rows."""
    import numpy as np

    E, W = len(lam), len(ell)
    exc = np.maximum(ell - tau, 0)
    slk = np.maximum(tau - ell, 0)
    used = np.zeros(W, dtype=np.int64)
    quota = np.zeros((E, W), dtype=np.int64)
    quota[np.arange(E), owner] = lam
    for r in sorted(np.flatnonzero(exc), key=lambda r: (-exc[r], r)):
        for e in sorted(np.flatnonzero(owner == r), key=lambda e: (-lam[e], e)):
            while exc[r] > 0 and quota[e, r] > 0:
                ok = (slk > 0) & (used < slots) & (quota[e] == 0)
                ok[r] = False
                if not ok.any():
                    break
                t = int(np.argmax(np.where(ok, slk, -1)))  # the first of the most slack: lowest rank
                # A replica carries at least min_rows even when less excess is left (the rank
                # then ends below τ): the seed's oracle gives up there, which made the search
                # miss thresholds its probes could meet.
                delta = min(max(int(exc[r]), min_rows), int(slk[t]), int(quota[e, r]))
                if delta < min_rows:
                    break
                quota[e, r] -= delta
                quota[e, t] += delta
                exc[r] = max(int(exc[r]) - delta, 0)
                slk[t] -= delta
                used[t] += 1
            if exc[r] == 0:
                break
        if exc[r] > 0:
            return None  # this rank cannot get under τ; the rest cannot help it
    return quota


def _slot_table(quota, owner, slots: int):
    """[W, N]: each rank's replicas, lowest expert id first, then -1."""
    import numpy as np

    E, W = quota.shape
    table = np.full((W, slots), -1, dtype=np.int64)
    held = quota > 0
    held[np.arange(E), owner] = False
    for t in range(W):
        experts = np.flatnonzero(held[:, t])
        table[t, : len(experts)] = experts
    return table


def _reroute(load, quota):
    """The split [W, E, W]: each source's rows of e over e's instances, keeping row sums (a
    source's rows of e all assigned) and column sums (an instance gets exactly its quota).

    A source holding an instance fills it with its own rows first (locality); the remaining
    rows go out in proportion to the instances' remaining quotas, source by source in rank
    order, floors first and the leftover rows to the largest remainders (lowest rank on a
    tie). Each leftover row lands where the floor fell short of a positive fraction, so no
    instance is given more than its remaining quota."""
    import numpy as np

    W, E = load.shape
    split = np.zeros((W, E, W), dtype=np.int64)
    for e in range(E):
        hosts = np.flatnonzero(quota[e] > 0)
        if len(hosts) <= 1:  # no replica: every row goes to the one instance (or there are none)
            if len(hosts):
                split[:, e, hosts[0]] = load[:, e]
            continue
        demand = load[:, e].copy()
        rem = quota[e].copy()
        local = np.minimum(demand[hosts], rem[hosts])
        split[hosts, e, hosts] = local
        demand[hosts] -= local
        rem[hosts] -= local
        total = int(rem.sum())
        for src in np.flatnonzero(demand):
            d = int(demand[src])
            num = d * rem
            share = num // total
            left = d - int(share.sum())
            if left:
                frac = num - share * total
                order = np.lexsort((np.arange(W), -frac))  # largest remainder, then lowest rank
                share[order[:left]] += 1
            split[src, e] += share
            rem -= share
            total -= d
    return split


def push_bytes(slots, owner, expert_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each rank sends and receives when the plan's ``slots`` [W, N] are filled: a home
    sends each expert it has replicated once to each rank holding a replica of it, a rank
    receives one expert's weights per filled slot. ([W] int64 each.)"""
    import numpy as np

    slots = np.asarray(slots)
    held = slots[slots >= 0]
    W = slots.shape[0]
    sent = np.bincount(np.asarray(owner)[held], minlength=W).astype(np.int64) * expert_bytes
    return sent, (slots >= 0).sum(axis=1).astype(np.int64) * expert_bytes


def push_seconds(slots, owner, expert_bytes: int, link: float, latency: float) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: the bytes of its pushes it sends or receives, whichever is more, and the
    seconds they take alone: those bytes over the ``link`` (bytes/s), then one flag's
    ``latency`` (none for a rank with nothing to move): the planner's figure. The layer's
    push tasks share the links with its dispatch (the cost model's, from :func:`push_bytes`)."""
    import numpy as np

    busiest = np.maximum(*push_bytes(slots, owner, expert_bytes))
    return busiest, np.where(busiest > 0, busiest / link + latency, 0.0)


EXCHANGE_ALIGN = 256  # bytes: the exchange's counters, and the alignment of each of its regions
# The exchange's int64 counters, per rank: arrivals of its replicas' gradients and of the
# receipts for its own gradient slots (balance_await's ``counter``). The loads and the pushes
# into its slots are tasks of the layer, waited for on their done flags.
COUNTERS = {"gradients": 0, "receipts": 1}


def plan_tables(W: int, homes: int, slots: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """A call's plan as the device writes it, one int32 buffer: name -> (element offset,
    shape). ``load`` [W, E] (rows of each source for each home expert), ``phys`` [E, W]
    (the physical expert of e's instance on each rank, -1: none), ``cum`` [W, E, W] (each
    source's running split of its rows of e over the instances, in rank order), ``slots``
    [W, N] (the home expert each slot holds, -1: empty), ``loads`` [2, W] (rows per rank
    before and after)."""
    shapes = {"load": (W, homes), "phys": (homes, W), "cum": (W, homes, W), "slots": (W, slots), "loads": (2, W)}
    at, out = 0, {}
    for name, shape in shapes.items():
        out[name] = (at, shape)
        at += math.prod(shape)
    return out


def plan_elems(W: int, homes: int, slots: int) -> int:
    """Elements of :func:`plan_tables`' buffer."""
    at, shape = plan_tables(W, homes, slots)["loads"]
    return at + math.prod(shape)


# The solve's time per home expert per pass of its search (one pass a replica it makes, one
# more that finds none to make): the device solver timed natively, one launch of one program
# at moonlight's 64 and qwen3_30b_a3b's 128 home experts under five routings, 76-329 us for
# 3-11 replicas, fitted as 61 us + 0.154 us per home-pass (H200,
# bench/results/h200-2026-11-27-lease/balance-device-plan.log). The intercept is taken as the
# separate launch and its events' gap, which the task inside the layer's kernel does not pay.
# Those timings are of the solver before it kept the quotas as each expert's home quota and
# each rank's replicas (it held a [HOMES, W] matrix: at nvl72_e128's W = 72 it spilled and
# took 69-97 ms, h200-2026-11-28-lease); the slope awaits the next lease's timings.
SOLVE_PER_HOME_PASS = 0.154e-6


def solve_seconds(homes: int, replicas: int) -> float:
    """What the solve task costs the cost model when it makes ``replicas`` replicas."""
    return SOLVE_PER_HOME_PASS * homes * (replicas + 1)


# Elements of a slot one work item of the layer's push or receive task moves (512 KiB in
# bf16): a slot's weights spread over as many programs as take its chunks.
SLOT_CHUNK = 1 << 18


def slot_chunks(slot: int) -> int:
    """Work items one slot of ``slot`` elements takes in a push or receive task."""
    return -(-slot // SLOT_CHUNK)


def slot_elems(matrices, H, F, bias: bool):
    """Elements of one redundant slot, the total of :func:`slot_parts`: every operand of one
    expert side by side (its ``matrices`` H×F weights, then, with expert biases, b_up (2·F
    when gated) and b_down (H)). Plain arithmetic: ints for the runtime, symbols for the planner's formula."""
    return sum(n for _, n in slot_parts(H, F, matrices == 3, bias).values())


def slot_parts(H: int, F: int, gated: bool, bias: bool) -> dict[str, tuple[int, int]]:
    """One redundant slot's operands, packed as the layer's kernels read them in place
    (one process per rank): name -> (element offset, elements). GEMM1's operand [H, F, 2]
    with gate and up interleaved when gated (else [H, F]), GEMM2's [F, H], then with expert
    biases b_up ([F, 2] when gated) and b_down [H]. Their total is :func:`slot_elems`."""
    up = 2 * F if gated else F
    sizes = {"w_up": H * up, "w_down": F * H} | ({"b_up": up, "b_down": H} if bias else {})
    at, parts = 0, {}
    for name, n in sizes.items():
        parts[name] = (at, n)
        at += n
    return parts


def exchange_regions(W: int, homes: int, slots: int, slot: int, elem: int) -> tuple[dict[str, int], int]:
    """The symmetric allocation a replicated layer's ranks exchange through when they run one
    process each: per rank its int64 counters (:data:`COUNTERS`),
    the load table [W, homes] int32, ``slots`` slots of weights and as many of gradients
    (``slot`` elements of ``elem`` bytes each), each region aligned to
    :data:`EXCHANGE_ALIGN`. Returns each region's offset and the bytes one rank holds (the
    stride between ranks)."""
    sizes = {
        "counters": len(COUNTERS) * 8,
        "loads": W * homes * 4,
        "slots": slots * slot * elem,
        "grads": slots * slot * elem,
    }
    at, end = {}, 0
    for name, size in sizes.items():
        at[name] = end
        end += -(-size // EXCHANGE_ALIGN) * EXCHANGE_ALIGN
    return at, end


__all__ = [
    "COUNTERS",
    "EXCHANGE_ALIGN",
    "SLOT_CHUNK",
    "ReplicationPlan",
    "exchange_regions",
    "imbalance",
    "owner_loads",
    "plan_elems",
    "plan_tables",
    "push_bytes",
    "push_seconds",
    "slot_chunks",
    "slot_elems",
    "slot_parts",
    "solve",
    "solve_seconds",
]
