"""Checks of a built LayerSpec, warnings and notes but one: ownership, capacity against
segments, schedules against buffers, dtypes, where compile will stop (a task table over
MAX_TASKS), and the error of a ``gemm library`` the library lowering cannot serve: functions over the
elaborator's per-layer context ``layer``, reporting on ``layer.diags``."""

from __future__ import annotations

from rdepc.passes.graph import fewest_tasks, too_many_tasks
from rdepc.passes.statements import ranges

from rdepc.diagnostics import owning
from rdepc.ir import sizes
from rdepc.ir.graph import MAX_TASKS
from rdepc.ir.lowering import library_refusals
from rdepc.ir.spec import LayerSpec


def spec_cap_e(layer, spec: LayerSpec) -> int | None:
    """cap_e the buffers are sized for, as ``passes.graph.cap_per_expert`` (a ``capacity
    rows`` expression at its largest over the tokens a call may bring), from exact sizes."""
    sh, cap = spec.shape, spec.capacity
    W, T, K, E = int(sh.W.value), sh.T_max, int(sh.K.value), int(sh.E.value)
    rows = int(layer.most(cap.rows)) if cap.policy == "rows" else None
    return sizes.cap_e(cap.policy, W, T, K, E, cap.factor.value if cap.policy == "factor" else None, rows)


def task_table_note(layer, spec: LayerSpec) -> None:
    """A note where compile will stop: the graph stage builds no task table over
    MAX_TASKS tasks, whichever strategy, S and B the scheduler may choose (as compile
    says it, "not supported yet", for a layer the language allows)."""
    sh = spec.shape
    W, T, K = int(sh.W.value), sh.T_max, int(sh.K.value)
    cap_e = spec_cap_e(layer, spec)
    seg = None if spec.segment is None else (int(spec.segment.rows.value), int(spec.segment.buffers.value))
    per = spec.ownership.experts_per_rank(W)
    n, strategy, S, segments = fewest_tasks(
        W, T, K, per, cap_e, spec.schedule, seg, spec.dedup, spec.balance.kind == "replicate"
    )
    if n > MAX_TASKS:
        what, key, hint = too_many_tasks(W, T, n, strategy, S, segments, seg is not None)
        layer.diags.note(f"not supported yet: {what} (compile and run stop here)", spec.span_of(key), hint)


def library_check(layer, spec: LayerSpec) -> bool:
    """``schedule ..., gemm library`` on a layer the library lowering does not run is an
    error at the option, naming each construct in the way (an auto schedule is bulk's)."""
    if spec.gemm != "library":
        return True
    strategy = "bulk" if spec.schedule == "auto" else spec.schedule
    why = library_refusals(strategy)
    for reason in why:
        layer.diags.error(f"the library GEMM lowering cannot run this layer: {reason}", spec.span_of("schedule.gemm"))
    return not why


def warn(layer, spec: LayerSpec) -> None:
    sh, d = spec.shape, layer.diags
    W, E = int(sh.W.value), int(sh.E.value)
    per = spec.ownership.experts_per_rank(W)
    if min(per) == 0:
        idle = [q for q in range(W) if per[q] == 0]
        verb = "owns" if len(idle) == 1 else "own"
        d.warning(f"{ranges(idle, 'rank')} {verb} no experts", spec.span_of("owner"))
    elif spec.ownership.policy == "balanced" and E % W:
        hi, lo = max(per), min(per)
        d.note(
            f"non-uniform ownership: {owning(per.count(hi), f'{hi} experts')} and "
            f"{per.count(lo)} {'owns' if per.count(lo) == 1 else 'own'} {lo}"
            f" ({hi / lo:.3g}x owner-load asymmetry under equal per-expert traffic)",
            spec.span_of("owner") if "owner" in dict(spec.spans) else spec.span_of("shape.experts"),
        )
    cap = spec.capacity
    if cap.policy == "factor" and cap.factor.value < 1:
        d.warning(
            f"capacity factor {cap.factor} drops rows even when routing is perfectly balanced",
            spec.span_of("capacity.factor"),
        )
    seg = spec.segment
    cap_e = spec_cap_e(layer, spec)
    if seg is not None and cap_e is not None and spec.schedule != "bulk":  # bulk: warned below
        fewest = cap_e * min(per)
        if min(per) and fewest < seg.rows.value:
            d.warning(
                f"capacity is below one segment: an owner with {min(per)} expert(s) admits at most "
                f"{fewest} rows, less than the {seg.rows}-row segment",
                spec.span_of("segment.rows"),
            )
    if seg is not None and spec.schedule == "bulk":
        # As passes.graph.geometry sizes bulk: one segment per owner, S the busiest owner's
        # worst case (distinct top-K, capped by capacity), T at its bound.
        rows = [sizes.owner_rows(W, sh.T_max, int(sh.K.value), e, cap_e) for e in per]
        at_bound = " with T at its bound" if sh.symbolic else ""
        d.warning(
            f"schedule bulk ignores the segment statement: each owner's rows move as one segment "
            f"(S = {sizes.bulk_rows(rows)}{at_bound}, B = 1), not in {seg.rows}-row segments "
            f"through {seg.buffers} buffers",
            spec.span_of("segment"),
            "drop the segment statement, or use 'schedule pipelined' "
            "(a segmented --schedule on the command line still uses it)",
        )
    if seg is not None:
        if spec.schedule == "pipelined" and seg.buffers.value < 2:
            d.warning(
                "pipelined with one buffer cannot overlap: dispatch waits for each compute",
                spec.span_of("segment.buffers"),
            )
        if spec.schedule == "deep" and seg.buffers.value < sizes.DEEP_BUFFERS:
            d.warning(
                f"deep with {seg.buffers} buffer(s) is no deeper than pipelined; deep wants buffers > 2",
                spec.span_of("segment.buffers"),
            )
    if spec.schedule in ("pipelined", "deep") and seg is None:
        d.warning(
            f"schedule {spec.schedule} without a 'segment' statement: rdepc chooses S and B",
            spec.span_of("schedule"),
        )
    if spec.precision.dispatch.bytes > spec.precision.dtype.bytes:
        d.warning(
            f"dispatch {spec.precision.dispatch.value} is wider than dtype {spec.precision.dtype.value}",
            spec.span_of("dtype.dispatch"),
        )
