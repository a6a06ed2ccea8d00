"""The lowering pass: which lowering the expert GEMMs take on a GPU (rdepc.ir.lowering) —
the command line's ``--gemm``, else the spec's ``schedule ..., gemm``, else the cost model's
choice between them where the library can run the layer.

The model charges the GEMMs at the share of the profile's rate each lowering was measured
to reach (``passes/hardware.py``: ``GEMM_EFFICIENCY``; the cost model's schedules at the
Triton kernel's, passes/cost.py). The library runs a bulk schedule in
phased mode: the transport's stages, then the GEMMs on every SM, then the transport's
again. The Triton GEMM kernel runs the schedule's own way: a bulk schedule in phased or
split mode, whichever the model predicts faster (split mode's GEMMs on its GEMM
programs' share). Only a bulk schedule is compared: the library does not run segments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rdepc.passes.hardware import GEMM_EFFICIENCY

from rdepc.diagnostics import UsageError, layer_prefix
from rdepc.ir.graph import Schedule
from rdepc.ir.lowering import ASKED, GEMM_LOWERINGS, library_refusals
from rdepc.ir.spec import LayerSpec


@dataclass(frozen=True)
class Lowering:
    gemm: str  # triton | library
    why: str
    predicted: tuple[tuple[str, float], ...] = ()  # (lowering, predicted forward seconds) where compared


def predicted(sched: Schedule) -> dict[str, float]:
    """Each lowering's predicted forward of a bulk ``sched`` (seconds, the busiest rank): the
    stages' sum with the GEMMs at the lowering's measured share of the rate; the Triton
    kernel's in phased mode or split mode's stages at their shares, whichever is less."""
    from rdepc.passes.cost import best_split, durations  # numpy: not for rdepc plan's refusals

    cm = sched.cost
    dur = durations(cm, None)  # every stage on every SM; the GEMMs at the Triton kernel's share of the rate
    sums: dict[int, list[float]] = {}
    for t in cm.graph.tasks:
        s = sums.setdefault(t.rank, [0.0, 0.0])  # all stages, the GEMMs
        s[0] += float(dur[t.id])
        s[1] += float(dur[t.id]) if t.stage == "compute" else 0.0

    def phased(lowering: str) -> float:
        ratio = GEMM_EFFICIENCY["triton"].value / GEMM_EFFICIENCY[lowering].value
        return max(total - gemm + gemm * ratio for total, gemm in sums.values())

    return {"library": phased("library"), "triton": min(phased("triton"), best_split(cm, False)[1])}


def decide(spec: LayerSpec, strategy: str, given: str | None, predict: Callable[[], dict[str, float]]) -> Lowering:
    """The lowering of ``spec`` under ``strategy``: ``given`` (the command line), the spec's,
    or the cost model's (see the module docstring), ``predict`` giving each lowering's
    predicted forward when they are compared."""
    if given is not None and given not in ("auto", *GEMM_LOWERINGS):
        raise UsageError(f"unknown GEMM lowering '{given}' (known: auto, {', '.join(GEMM_LOWERINGS)})")
    why_not = library_refusals(strategy)
    if given not in (None, "auto"):
        chosen, source = given, ASKED[0]
    elif spec.gemm != "auto":
        chosen, source = spec.gemm, f"{ASKED[1]} {spec.gemm}"
    else:
        chosen, source = None, ""
    if chosen == "library" and why_not:  # the spec's own request is refused at check time
        raise UsageError(f"{layer_prefix(spec.name)}: the library GEMM lowering cannot run it: {'; '.join(why_not)}")
    if chosen is not None:
        return Lowering(chosen, source)
    if why_not:
        return Lowering("triton", "the library lowering cannot run it: " + "; ".join(why_not))
    times = predict()
    best = min(GEMM_LOWERINGS, key=lambda k: (times[k], GEMM_LOWERINGS.index(k)))
    shares = ", ".join(f"{k} {GEMM_EFFICIENCY[k].value:.0%}" for k in GEMM_LOWERINGS)
    why = (
        f"cost model: {' against '.join(f'{k} {_time(times[k])}' for k in sorted(times, key=times.get))} "
        f"predicted (the GEMMs at their measured share of the rate: {shares})"
    )
    return Lowering(best, why, tuple(sorted(times.items())))


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"


@dataclass(frozen=True)
class LoweringPass:
    """Schedule → Lowering."""

    gemm: str | None = None  # --gemm
    name: str = "lowering"

    def __call__(self, sched: Schedule) -> Lowering:
        return decide(sched.graph.spec, sched.strategy, self.gemm, lambda: predicted(sched))


def lowering_line(sched: Schedule, given: str | None = None) -> str:
    """The lowering decision as ``viz`` prints it: ``gemm = L  (why)``."""
    lo = decide(sched.graph.spec, sched.strategy, given, lambda: predicted(sched))
    return f"gemm = {lo.gemm}  ({lo.why})"


def dump(lo: Lowering) -> str:
    """``--dump-after lowering``."""
    lines = [f"gemm = {lo.gemm} ({lo.why})"]
    lines += [f"  predicted {k}: {_time(v)}" for k, v in lo.predicted]
    return "\n".join(lines)


__all__ = ["Lowering", "LoweringPass", "decide", "dump", "lowering_line", "predicted"]
