"""The scheduler: resources, program split, a global topological order, and its timeline.

Every task goes to one resource of the rank that runs it: its communication programs
(route, scan, dispatch, return, unpack, combine: split mode's transport kernel) or its
compute programs (the expert GEMMs: split mode's GEMM kernel).
How many programs communication gets is decided here, from the cost model
(:func:`rdepc.passes.cost.best_split`, refined on the predicted timeline).

The global order is a topological order of the graph (Kahn's algorithm, ties broken by the
strategy's intended order, which is the order the graph was built in: :mod:`rdepc.passes.order`). Persistent programs
that take tasks in that order — per resource, or all from one ticket counter — can never
deadlock: the earliest unfinished task always has its inputs done and a program free to
take it (docs/ARCHITECTURE.md, decision 2). :func:`rdepc.passes.simulate.simulate` checks that
with random task times.

Strategies (RDEP section 3.5):

* ``bulk`` — one segment per owner sized for its worst case, no overlap;
* ``pipelined`` — B = 2 semantics: in step s, dispatch s | compute s−1 | return s−2;
* ``deep`` — B > 2: dispatch runs up to B−1 segments ahead of compute.

Which strategy, cut, S and B a layer gets is the resolve pass's (:mod:`rdepc.passes.resolve`),
decided before the graph is built; it predicts each candidate's makespan with
:func:`predicted_makespan`.

The timeline (:func:`rdepc.passes.order.timeline`) is the cost model's prediction: each resource
runs its tasks one after another in the global order; a task starts when its resource is free and its inputs are
done (plus a flag's latency when they were produced on another rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from rdepc.passes.cost import Split, best_split, cost_model, durations
from rdepc.passes.order import BALANCE_ORDERS, LATE_PUSHES, ORDERS, Timeline, priority, timeline, topo_order

from rdepc.ir.graph import CostModel, Decision, Entry, Resource, Schedule, TaskGraph

REFINE_LIMIT = 60_000  # tasks: below this the split is refined on the timeline itself


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Measure of the union of intervals ``a`` minus the union of intervals ``b``
    (each list sorted by start and non-overlapping)."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while cur < e:
            if k >= len(b) or b[k][0] >= e:
                total += e - cur
                break
            bs, be = b[k]
            if bs > cur:
                total += bs - cur
            cur = max(cur, be)
            k += 1
    return total


def schedule(
    tg: TaskGraph,
    hw: str = "h100",
    counts=None,
    comm: int | None = None,
    decisions: Sequence[Decision] = (),
    refine: bool | None = None,
    held=None,
) -> Schedule:
    """Schedule ``tg`` on ``hw``: choose the program split (unless ``comm`` is given), the
    global order, and predict the timeline under ``counts`` (None: expected routing;
    ``held``: the balance plan's slots for them, :func:`rdepc.passes.cost.cost_model`)."""
    return schedule_costed(cost_model(tg, hw, counts, held), comm, decisions, refine)


def predicted_makespan(cm: CostModel) -> float:
    """The makespan :func:`schedule` predicts for ``cm``, without building the task table."""
    return _chosen(cm).tl.makespan


# The resolve pass predicts the winner's makespan, then the schedule pass schedules it: the
# choice is made once per cost model (immutable; the choice is read, never changed).
@lru_cache(maxsize=4)
def _chosen(cm: CostModel) -> _Choice:
    return _choose(cm, None, None, None)


def empty_mask(cm: CostModel) -> list[bool]:
    """Tasks that move nothing under the cost model's routing (their predicate holds)."""
    return [bool(t.empty_if) and r == 0 for t, r in zip(cm.graph.tasks, cm.rows, strict=True)]


@dataclass
class _Choice:
    split: Split | None  # None: unified (bulk)
    variant: str
    order: list[int]
    tl: Timeline
    dur: np.ndarray
    decisions: list[Decision]
    kernels: Split | None = None  # split mode's kernels where it differs from ``split`` (bulk)


def _choose(cm: CostModel, comm: int | None, refine: bool | None, variant: str | None) -> _Choice:
    """Choose the program split and the order within a step; predict the timeline."""
    tg = cm.graph
    geo = tg.geometry
    lat = cm.rates.latency
    N = cm.rates.sms
    empty = empty_mask(cm)
    if not geo.segmented and comm is None:
        order = topo_order(tg, priority(tg))
        dur = durations(cm, None)
        tl = timeline(tg, order, dur, lat, unified=True, empty=empty, unslotted=cm.unslotted)
        d = Decision("programs", f"all {N} programs take every task (unified)", "bulk: nothing to overlap")
        kernels, est = best_split(cm, False)
        k = Decision(
            "kernel split",
            f"{kernels.comm} transport / {kernels.compute} GEMM programs of {N} (split mode)",
            f"cost model: the stages take turns, {est * 1e3:.3f} ms summed on the busiest rank",
        )
        m = Decision(
            "kernel mode",
            f"phased {tl.makespan * 1e3:.3f} ms against split {est * 1e3:.3f} ms predicted",
            "cost model; rdepc tune times both on the GPU",
        )
        return _Choice(None, "returns-first", order, tl, dur, [d, k, m], kernels)
    variants = [variant] if variant else list(ORDERS) if geo.segmented else ["returns-first"]
    if geo.slots and not variant:  # balance replicate: the weight pushes before or after the first dispatch
        variants += [v + LATE_PUSHES for v in variants]
    orders = {v: topo_order(tg, priority(tg, v)) for v in variants}
    if comm is not None:
        dur = durations(cm, comm)
        tls = {v: timeline(tg, o, dur, lat, empty=empty, unslotted=cm.unslotted) for v, o in orders.items()}
        v = min(tls, key=lambda v: (tls[v].makespan, BALANCE_ORDERS.index(v)))
        ds = [Decision("programs", f"{comm} comm / {N - comm} compute of {N}", "given")]
        if len(tls) > 1:
            ds.append(_order_decision(v, tls))
        return _Choice(Split(comm, N - comm), v, orders[v], tls[v], dur, ds)
    split, est = best_split(cm, True)
    tls = {
        v: timeline(tg, o, durations(cm, split.comm), lat, empty=empty, unslotted=cm.unslotted)
        for v, o in orders.items()
    }
    v = min(tls, key=lambda v: (tls[v].makespan, BALANCE_ORDERS.index(v)))
    best = split.comm
    tried = {best: tls[v]}
    if refine if refine is not None else len(tg.tasks) <= REFINE_LIMIT:
        # A local search on the timeline itself, from the analytic split, halving the step.
        step = max(1, N // 8)
        while step >= 1:
            moved = False
            for p in (best - step, best + step):
                if 0 < p < N and p not in tried:
                    tried[p] = timeline(tg, orders[v], durations(cm, p), lat, empty=empty, unslotted=cm.unslotted)
                if 0 < p < N and tried[p].makespan < tried[best].makespan:
                    best, moved = p, True
            if not moved:
                step //= 2
    tl = tried[best]
    tls[v] = tl
    ds = [
        Decision(
            "programs",
            f"{best} comm / {N - best} compute of {N}",
            f"cost model: roles balanced at {est * 1e3:.3f} ms on the busiest rank with {split.comm}, "
            f"timeline {tl.makespan * 1e3:.3f} ms with {best}",
        )
    ]
    if len(tls) > 1:
        ds.append(_order_decision(v, tls))
    return _Choice(Split(best, N - best), v, orders[v], tl, durations(cm, best), ds)


def schedule_costed(
    cm: CostModel,
    comm: int | None = None,
    decisions: Sequence[Decision] = (),
    refine: bool | None = None,
    variant: str | None = None,
) -> Schedule:
    """:func:`schedule` of a graph whose cost model is already built. ``comm`` fixes the
    communication programs per rank (then bulk too runs on that split); ``variant`` fixes
    the order within a step (see :func:`priority`)."""
    pl = _chosen(cm) if comm is None and refine is None and variant is None else _choose(cm, comm, refine, variant)
    sched = _finish(cm.graph, cm, pl.order, pl.split, pl.tl, pl.dur, [*decisions, *pl.decisions])
    kernels = pl.kernels or pl.split
    return replace(sched, kernel_split=(kernels.comm, kernels.compute))


def _order_decision(v: str, tls: dict) -> Decision:
    alt = ", ".join(f"{k} {tls[k].makespan * 1e3:.3f} ms" for k in BALANCE_ORDERS if k in tls)
    return Decision("order", v, f"cost model: {alt}")


def _role_intervals(tasks, order, tl: Timeline, dur, W: int):
    comm: list[list[tuple[float, float]]] = [[] for _ in range(W)]
    comp: list[list[tuple[float, float]]] = [[] for _ in range(W)]
    for u in order:
        if dur[u] > 0:
            t = tasks[u]
            (comm if t.role == "comm" else comp)[t.rank].append((float(tl.start[u]), float(tl.end[u])))
    for lst in (*comm, *comp):
        lst.sort()
    return comm, comp


def _union(a: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in a:
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _resources(tasks, split: Split | None, W: int, N: int) -> tuple[tuple[Resource, ...], list[int]]:
    """The resources of each rank and the resource each task runs on."""
    if split is None:  # unified: one resource per rank
        resources = tuple(Resource(r, r, "all", N) for r in range(W))
        return resources, [t.rank for t in tasks]
    resources = tuple(
        Resource(2 * r + k, r, role, split.comm if role == "comm" else split.compute)
        for r in range(W)
        for k, role in enumerate(("comm", "compute"))
    )
    return resources, [2 * t.rank + (t.role == "compute") for t in tasks]


def _role_times(tasks, dur: np.ndarray, W: int) -> tuple[list[float], list[float]]:
    """Per rank, the summed time of its communication tasks and of its compute tasks."""
    transport = [0.0] * W
    compute = [0.0] * W
    for t in tasks:
        if t.role == "comm":
            transport[t.rank] += float(dur[t.id])
        else:
            compute[t.rank] += float(dur[t.id])
    return transport, compute


def _fill_drain(tasks, cm, dur: np.ndarray, W: int) -> tuple[list[float], list[float]]:
    """Per rank, the communication before compute can start (fill) and after it ends (drain)."""
    # fill: the weight pushes (balance replicate), the route, the scan, the first segment's
    # dispatch and the flag that hands it to compute; drain: the returns and unpacks of each
    # owner's last non-empty segment (under the routing the timeline was made for), the
    # combine and the flag that hands them on.
    last = [-1] * W
    for t in tasks:
        if t.stage == "compute" and cm.rows[t.id] > 0:
            last[t.owner] = max(last[t.owner], t.segment)
    fill = [cm.rates.latency] * W
    drain = [cm.rates.latency] * W
    for t in tasks:
        if t.role != "comm":
            continue
        if t.stage in ("balance", "route", "scan") or (t.stage == "dispatch" and t.segment == 0):
            fill[t.rank] += float(dur[t.id])
        elif (t.stage == "combine" and t.detail != "unpack") or (
            t.stage in ("return", "combine") and t.segment == last[t.owner]
        ):
            drain[t.rank] += float(dur[t.id])
    return fill, drain


def _stage_busy(tasks, dur: np.ndarray, W: int) -> tuple[tuple[str, float], ...]:
    """Per stage (the unpacks apart from the combine), the busiest rank's time in it."""
    per_stage: dict[str, np.ndarray] = {}
    for t in tasks:
        key = t.stage if t.stage != "combine" or t.detail != "unpack" else "unpack"
        per_stage.setdefault(key, np.zeros(W))[t.rank] += dur[t.id]
    return tuple((k, float(v.max())) for k, v in per_stage.items())


def _table(tasks, order, position: list[int], res_of: list[int]) -> list[Entry]:
    """The task table: one entry per task in global order, its deps as entry indices."""
    table = []
    for i, u in enumerate(order):
        t = tasks[u]
        deps = [position[d] for d in t.deps]
        deps.sort()
        table.append(
            Entry(
                i,
                u,
                t.stage,
                t.detail,
                t.rank,
                res_of[u],
                t.segment,
                t.slot,
                t.claim,
                t.src,
                t.owner,
                t.tiles,
                tuple(deps),
                t.empty_if,
            )
        )
    return table


def _finish(tg, cm, order, split: Split | None, tl: Timeline, dur: np.ndarray, decisions) -> Schedule:
    """The Schedule of ``order`` on its timeline: resources, loads, overlap and the task table."""
    geo = tg.geometry
    W = geo.W
    N = cm.rates.sms
    tasks = tg.tasks
    resources, res_of = _resources(tasks, split, W, N)
    position = [0] * len(tasks)
    for i, u in enumerate(order):
        position[u] = i
    busy = np.zeros(len(resources))
    np.add.at(busy, np.asarray(res_of, int), dur)
    comm_iv, comp_iv = _role_intervals(tasks, order, tl, dur, W)
    transport, compute = _role_times(tasks, dur, W)
    exposed = tuple(_minus(_union(comm_iv[r]), _union(comp_iv[r])) for r in range(W))
    fill, drain = _fill_drain(tasks, cm, dur, W)
    stage_busy = _stage_busy(tasks, dur, W)
    table = _table(tasks, order, position, res_of)
    return Schedule(
        layer=tg.layer,
        strategy=geo.strategy,
        cut=geo.cut,
        S=geo.S,
        B=geo.B,
        lookahead=geo.lookahead,
        hw=cm.rates.hw,
        programs=(N, N) if split is None else (split.comm, split.compute),
        unified=split is None,
        resources=resources,
        order=tuple(order),
        position=tuple(position),
        resource_of=tuple(res_of),
        start=tuple(tl.start.tolist()),
        end=tuple(tl.end.tolist()),
        makespan=tl.makespan,
        critical_path=tl.critical_path,
        busy=tuple(busy.tolist()),
        transport=tuple(transport),
        compute=tuple(compute),
        exposed=exposed,
        fill=tuple(fill),
        drain=tuple(drain),
        stage_busy=stage_busy,
        decisions=tuple(tg.decisions) + tuple(decisions),
        table=tuple(table),
        graph=tg,
        cost=cm,
    )


# --- passes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostPass:
    """TaskGraph → CostModel: work per task under the expected routing, on one profile."""

    hw: str = "h100"
    name: str = "cost"

    def __call__(self, tg: TaskGraph) -> CostModel:
        return cost_model(tg, self.hw)


@dataclass(frozen=True)
class SchedulePass:
    """CostModel → Schedule: program split, global order, predicted timeline, task table."""

    name: str = "schedule"

    def __call__(self, cm: CostModel) -> Schedule:
        return schedule_costed(cm)


__all__ = [
    "CostPass",
    "SchedulePass",
    "empty_mask",
    "predicted_makespan",
    "schedule",
    "schedule_costed",
]


def _us(x: float) -> str:
    return f"{x * 1e6:,.1f} µs"


def report(sched: Schedule) -> str:
    """A short human-readable account of a schedule: choices, prediction, breakdown."""
    W = len(sched.transport)
    r = max(range(W), key=lambda i: (sched.transport[i] + sched.compute[i], -i)) if W else 0
    prog = (
        f"all {sched.programs[0]} programs per rank take every task"
        if sched.unified
        else f"{sched.programs[0]} communication + {sched.programs[1]} compute programs per rank"
    )
    prog += f"; split mode: {sched.kernel_split[0]} transport + {sched.kernel_split[1]} GEMM kernel programs"
    lines = [
        f"layer {sched.layer}: {sched.strategy} schedule, cut {sched.cut}, S={sched.S}, B={sched.B}, on {sched.hw}",
        f"  programs        {prog}",
        f"  makespan        {_us(sched.makespan)} predicted (critical path {_us(sched.critical_path)})",
        f"  busiest rank    r{r}: transport {_us(sched.transport[r])}, compute {_us(sched.compute[r])}, "
        f"exposed transport {_us(sched.exposed[r])}",
        "  per stage       " + ", ".join(f"{k} {_us(v)}" for k, v in sched.stage_busy if v > 0),
        f"  task table      {len(sched.table):,} tasks",
    ]
    lines += [f"  decision        {d.name} = {d.value}  ({d.why})" for d in sched.decisions]
    return "\n".join(lines)


def dump(sched: Schedule) -> str:
    """``--dump-after schedule``: the report, then the task table in global order."""
    lines = ["// " + line for line in report(sched).splitlines()]
    lines.append(f"// {'index':>7} {'resource':<10} {'start µs':>10} {'end µs':>10}  task  deps")
    res = sched.resources
    for e in sched.table:
        deps = list(e.deps) if len(e.deps) <= 8 else f"[{e.deps[0]}, ... {len(e.deps)} entries]"
        t = sched.graph.tasks[e.task]
        lines.append(
            f"   {e.index:>7} {res[e.resource].name:<10} {sched.start[e.task] * 1e6:>10.2f} "
            f"{sched.end[e.task] * 1e6:>10.2f}  {t.name}  slot={e.slot} deps={deps}"
        )
    return "\n".join(lines)


def annotate(sched: Schedule):
    """The schedule's graph as networkx, each node annotated with its predicted ``cost``
    (seconds), ``start``, ``end``, ``resource`` and global ``position``."""
    g = sched.graph.graph
    res = sched.resources
    for u in range(len(sched.order)):
        a = g.nodes[u]
        a["cost"] = sched.end[u] - sched.start[u]
        a["start"] = sched.start[u]
        a["end"] = sched.end[u]
        a["resource"] = res[sched.resource_of[u]].name
        a["position"] = sched.position[u]
    return g
