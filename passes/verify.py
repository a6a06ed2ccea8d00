"""The invariants of the graph and the schedule, checked between passes (``rdepc compile
--verify-each``; the memory plan's are its own, :mod:`rdepc.passes.memplan`, always checked).
Each verifier returns its problems, an empty list when there are none.

The graph: every task's id is its place, its rank one of the layer's, its dependencies other
tasks, and the graph acyclic. The schedule: the global order is a topological order of the
graph (what keeps persistent programs that take tasks in it from deadlocking), a task starts
after its inputs are done and each resource runs its tasks one after another in that order,
every task-table entry waits only on earlier ones, and the makespan lies between its lower
bounds (the busiest resource, the critical path) and below its upper ones: without flag latency
Graham's bound, with it the busy time plus the flags in flight.
"""

from __future__ import annotations

import itertools

from rdepc.ir.graph import Schedule, TaskGraph

EPS = 1e-12  # seconds: the timeline's float slack


def graph_problems(tg: TaskGraph) -> list[str]:
    tasks, W = tg.tasks, tg.geometry.W
    out = [f"task {t.id} is at place {i}" for i, t in enumerate(tasks) if t.id != i]
    out += [f"task {t.id} runs on rank {t.rank}, not one of 0..{W - 1}" for t in tasks if not 0 <= t.rank < W]
    out += [f"task {t.id} depends on {d}, not a task" for t in tasks for d in t.deps if not 0 <= d < len(tasks)]
    if out:
        return out
    waiting = [len(set(t.deps)) for t in tasks]
    users: dict[int, list[int]] = {}
    for t in tasks:
        for d in set(t.deps):
            users.setdefault(d, []).append(t.id)
    ready, seen = [t.id for t in tasks if waiting[t.id] == 0], 0
    while ready:
        u = ready.pop()
        seen += 1
        for v in users.get(u, ()):
            waiting[v] -= 1
            if waiting[v] == 0:
                ready.append(v)
    return (
        []
        if seen == len(tasks)
        else [f"the graph has a cycle: {len(tasks) - seen} of its tasks are on it or wait on it"]
    )


def schedule_problems(sched: Schedule) -> list[str]:
    tasks, pos, start, end = sched.graph.tasks, sched.position, sched.start, sched.end
    if sorted(sched.order) != list(range(len(tasks))):
        return ["the global order is not an order of every task once"]
    if any(pos[u] != i for i, u in enumerate(sched.order)):
        return ["the tasks' positions are not their places in the global order"]
    out = []
    for t in tasks:
        out += [f"task {t.id} is ordered before its input {d}" for d in t.deps if pos[d] >= pos[t.id]]
        out += [f"task {t.id} starts before its input {d} is done" for d in t.deps if start[t.id] < end[d] - EPS]
    out += [f"table entry {e.index} waits on a later entry" for e in sched.table if any(d >= e.index for d in e.deps)]
    per: dict[int, list[int]] = {}
    for u in sched.order:
        per.setdefault(sched.resource_of[u], []).append(u)
    for res, run in per.items():
        out += [
            f"resource {res} runs {b} before {a} is done" for a, b in itertools.pairwise(run) if start[b] < end[a] - EPS
        ]
    busy = max(sched.busy, default=0.0)
    if sched.makespan < busy - EPS or sched.makespan < sched.critical_path - EPS:
        out.append(f"the makespan {sched.makespan:g} s is below the busiest resource or the critical path")
    return out + _graham(sched) + _idle_in_flight(sched)


def _graham(sched: Schedule) -> list[str]:
    """Without flag latency, the timeline's makespan is at most every resource's busy time
    plus the critical path (Graham's bound)."""
    import numpy as np
    from rdepc.passes.order import timeline

    dur = np.asarray([e - s for s, e in zip(sched.start, sched.end, strict=True)])
    tl0 = timeline(sched.graph, sched.order, dur, 0.0, unified=sched.unified)
    if max(sched.busy, default=0.0) - EPS <= tl0.makespan <= sum(sched.busy) + tl0.critical_path + EPS:
        return []
    return [f"without flag latency the makespan {tl0.makespan:g} s is outside Graham's bounds"]


def _idle_in_flight(sched: Schedule) -> list[str]:
    """With flag latency, the time in which no program works is covered by flags in flight:
    the makespan is at most every resource's busy time plus that time."""
    from rdepc.passes.schedule import empty_mask

    tasks, end, lat = sched.graph.tasks, sched.end, sched.cost.rates.latency
    empty = empty_mask(sched.cost)
    flights = sorted(
        (end[d], end[d] + lat) for t in tasks if not empty[t.id] for d in t.deps if tasks[d].rank != t.rank
    )
    in_flight, cur = 0.0, -1.0
    for a, b in flights:
        if b > cur:
            in_flight += b - max(a, cur)
            cur = b
    if sched.makespan <= sum(sched.busy) + in_flight + EPS:
        return []
    return [f"the makespan {sched.makespan:g} s exceeds the busy time plus the flags in flight"]


__all__ = ["graph_problems", "schedule_problems"]
