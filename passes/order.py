"""The global order of a task graph and its predicted timeline.

:func:`priority` gives each task its place in the strategy's intended order (step by step:
dispatch s, compute s − L, the returns of s − L − 1); :func:`topo_order` turns it into a
topological order of the graph (Kahn's algorithm, ties broken by that order);
:func:`timeline` predicts when each task runs when every resource takes its tasks one after
another in that order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rdepc.ir.graph import TaskGraph

ORDERS = ("returns-first", "dispatch-first")
# balance replicate: each of ORDERS with the weight pushes after the first segment's dispatch
# instead of before it (the busiest home's link carries both: which goes first is the cost
# model's choice)
LATE_PUSHES = ", pushes late"
BALANCE_ORDERS = ORDERS + tuple(o + LATE_PUSHES for o in ORDERS)


def priority(tg: TaskGraph, variant: str = "returns-first") -> list[tuple]:
    """The strategy's intended position of every task: (``balance replicate``: the plan's
    load, solve and reroute), route, scan, the weight pushes, then step by step — in step t,
    dispatch segment t, compute t − L (the first after the slots' receives), and the
    returns (with their unpacks) of t − L − 1 — then the combine. ``variant`` says whether
    a step's returns or its dispatches come first on the communication programs, and
    (``LATE_PUSHES``) whether the pushes wait for the first segment's dispatch."""
    geo = tg.geometry
    L = geo.lookahead
    late = variant.endswith(LATE_PUSHES)
    first = variant.removesuffix(LATE_PUSHES) == "returns-first"
    rank = {"B": 0, "A": 1, "C": 2} if first else {"C": 0, "A": 1, "B": 2}
    push = (2, 0, 3) if late else (1, 0, 1)
    keys = []
    for t in tg.tasks:
        match t.stage:
            case "balance" if t.detail in ("load", "solve", "reroute"):  # the plan gates the route
                k = (0, 0, -1)
            case "balance" if t.detail == "push":
                k = push
            case "balance":  # a rank's slots copied in just before its first GEMM1, which waits for it
                k = (2, L, rank["A"])
            case "route":
                k = (0, 0, 0)
            case "scan":
                k = (1, 0, 0)
            case "dispatch":
                k = (2, t.segment, rank["C"])
            case "compute":
                k = (2, t.segment + L, rank["A"])
            case "return":
                k = (2, t.segment + L + 1, rank["B"])
            case _ if t.detail == "unpack":
                k = (2, t.segment + L + 1, rank["B"])
            case _:
                k = (3, 0, 0)
        keys.append((*k, t.id))
    return keys


def topo_order(tg: TaskGraph, key: Sequence | None = None) -> list[int]:
    """A topological order of ``tg``: among ready tasks, the smallest ``key`` (default:
    the task built first) goes first. When sorting by ``key`` alone already gives a
    topological order (the usual case: the graph is built in its strategy's order), that
    order is returned without running Kahn's algorithm."""
    tasks = tg.tasks
    n = len(tasks)
    order = list(range(n)) if key is None else sorted(range(n), key=key.__getitem__)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    src, dst = tg.edges
    if bool(np.all(pos[src] < pos[dst])):
        return order
    key = list(range(n)) if key is None else key
    indeg = [len(t.deps) for t in tasks]
    succ: list[list[int]] = [[] for _ in range(n)]
    for t in tasks:
        for d in t.deps:
            succ[d].append(t.id)
    ready = [(key[i], i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(ready, (key[v], v))
    if len(order) != n:
        raise ValueError("the task graph has a cycle")
    return order


@dataclass(frozen=True, slots=True)
class Timeline:
    start: np.ndarray
    end: np.ndarray
    makespan: float
    critical_path: float


def timeline(
    tg: TaskGraph,
    order: Sequence[int],
    dur: np.ndarray,
    latency: float,
    unified: bool = False,
    empty: Sequence[bool] | None = None,
    unslotted: frozenset[int] = frozenset(),
) -> Timeline:
    """Start and end of every task when each resource — a rank's communication programs
    and its compute programs, or (``unified``) all of a rank's programs — runs its tasks one
    after another in ``order``. A flag crossing ranks costs ``latency``, except into a task
    that is ``empty`` under the routing: after the scan every rank knows which tasks are
    empty and resolves them locally (they still wait for their dependencies, so a ring
    slot's reuse order is kept). A GEMM1 task of ``unslotted`` does not wait for its rank's
    receive (``balance replicate``: none of its m-tiles computes a slot)."""
    tasks = tg.tasks
    n = len(tasks)
    own, other = tg.rank_deps
    start = [0.0] * n
    end = [0.0] * n
    cp = [0.0] * n
    # one resource per (rank, role), or per rank when unified
    res = [t.rank if unified else 2 * t.rank + (t.role != "comm") for t in tasks]
    free = [0.0] * (2 * max((t.rank for t in tasks), default=0) + 2)
    d = dur.tolist()
    no_lat = empty if empty is not None else [False] * n
    for u in order:
        near, far = own[u], other[u]
        if u in unslotted:  # its rank's receive is no dependency of it
            near = [p for p in near if tasks[p].stage != "balance"]
            far = [p for p in far if tasks[p].stage != "balance"]
        ready = longest = 0.0
        for p in near:
            if end[p] > ready:
                ready = end[p]
            if cp[p] > longest:
                longest = cp[p]
        lat = 0.0 if no_lat[u] else latency
        for p in far:
            x = end[p] + lat
            if x > ready:
                ready = x
            y = cp[p] + lat
            if y > longest:
                longest = y
        r = res[u]
        s = ready if ready >= free[r] else free[r]
        start[u] = s
        end[u] = free[r] = s + d[u]
        cp[u] = longest + d[u]
    return Timeline(np.asarray(start), np.asarray(end), max(end, default=0.0), max(cp, default=0.0))
