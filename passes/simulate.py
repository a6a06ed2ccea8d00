"""A discrete-event simulation of persistent programs taking a schedule's task table in
order, with random task times: the check that the global order cannot deadlock
(ARCHITECTURE.md, decision 2)."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence

from rdepc.ir.graph import Schedule


class DeadlockError(RuntimeError):
    pass


def simulate(
    sched: Schedule,
    duration: Callable[[int], float],
    programs: int | tuple[int, int] = 1,
    mode: str = "roles",
    order: Sequence[int] | None = None,
) -> tuple[list[float], list[float]]:
    """Run the task table with persistent programs and random task times.

    ``mode="roles"``: each (rank, role) resource has its own ticket counter and
    ``programs`` programs (an int, or (comm, compute)). ``mode="unified"``: one ticket
    counter over all ranks and roles (one launch covering all W ranks, as under Triton's
    interpreter) and ``programs`` programs in all. A program takes the next ticket of its
    counter, waits until every dependency is done, runs the task for ``duration(task)``
    and marks it done. Returns (start, end) per task id; raises :class:`DeadlockError` when no
    program can make progress while tasks remain. ``order`` replaces the schedule's order
    (to show that a bad order deadlocks).
    """
    tg = sched.graph
    tasks = tg.tasks
    order = list(sched.order if order is None else order)
    n = len(tasks)
    if mode == "roles":
        queues: dict[object, list[int]] = {}
        for u in order:
            queues.setdefault(sched.resource_of[u], []).append(u)
        counts = programs if isinstance(programs, tuple) else (programs, programs)
        per_role = {"comm": counts[0], "compute": counts[1], "all": max(counts)}
        progs = {q: per_role[sched.resources[q].role] for q in queues}
    elif mode == "unified":
        queues = {0: order}
        progs = {0: programs if isinstance(programs, int) else sum(programs)}
    else:
        raise ValueError(f"unknown mode '{mode}'")
    done = [False] * n
    start = [-1.0] * n
    end = [-1.0] * n
    nxt = dict.fromkeys(queues, 0)
    held: dict[object, list[int]] = {q: [] for q in queues}  # tickets held by waiting programs
    idle = dict(progs)
    running: list[tuple[float, int, object]] = []
    now = 0.0
    finished = 0

    def try_start(q, u) -> bool:
        if all(done[d] for d in tasks[u].deps):
            start[u] = now
            heapq.heappush(running, (now + duration(u), u, q))
            return True
        return False

    while finished < n:
        progressed = True
        while progressed:
            progressed = False
            for q in queues:
                while idle[q] > 0 and nxt[q] < len(queues[q]):
                    u = queues[q][nxt[q]]
                    nxt[q] += 1
                    idle[q] -= 1
                    if not try_start(q, u):
                        held[q].append(u)
                    progressed = True
                still = []
                for u in held[q]:
                    if not try_start(q, u):
                        still.append(u)
                    else:
                        progressed = True
                held[q] = still
        if not running:
            stuck = [tasks[u].name for q in held for u in held[q]][:5]
            raise DeadlockError(f"{n - finished} tasks left and no program can run; waiting: {', '.join(stuck)}")
        t_end, u, q = heapq.heappop(running)
        now = t_end
        end[u] = now
        done[u] = True
        finished += 1
        idle[q] += 1
    return start, end


def random_durations(sched: Schedule, seed: int = 0, empty: float = 0.0) -> Callable[[int], float]:
    """Task times: the predicted time scaled by a random factor in [0.25, 4), plus a small
    random delay; ``empty`` for tasks the prediction says take no time."""
    rng = random.Random(seed)
    pred = [e - s for s, e in zip(sched.start, sched.end, strict=True)]
    scale = max(pred, default=1.0) or 1.0
    table = [(p * rng.uniform(0.25, 4.0) if p > 0 else empty) + rng.uniform(0, 0.05 * scale) for p in pred]
    return table.__getitem__
