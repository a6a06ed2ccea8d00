"""The resolve pass: the strategy, the segment cut, S and B a layer is built with, decided
once, each with its reason. Every later stage reads its :class:`Resolution`: the graph pass
builds that one graph, and ``rdepc plan`` (:func:`resolve_strategy`) and ``rdepc viz``
plan and draw what compile builds.

The precedence is the command line (``--schedule``, ``--cut``) over the spec's
``schedule`` and ``segment ..., cut`` statements over the cost model; a library GEMM
lowering asked for fixes bulk. Where the cost model decides, every candidate (strategy ×
cut × S, :func:`rdepc.passes.graph.candidates`) is built and its makespan predicted on the
hardware profile; the least wins, ties going to the earlier strategy. Without a segment
statement a segmented strategy's S and B are the cost model's choice too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from rdepc.passes.graph import STRATEGIES, GraphPass, candidates, graph_of

from rdepc.diagnostics import SpecError, UsageError, layer_prefix
from rdepc.ir import sizes
from rdepc.ir.graph import Decision, Schedule, TaskGraph
from rdepc.ir.spec import LayerSpec


@dataclass(frozen=True, slots=True)
class Resolution:
    """What the layer is built with: the strategy, the cut, and S and B where the cost model
    chose them (None: the segment statement's, or bulk); the decisions with their reasons;
    for a plan, why compile's own choice could not be used (``note``)."""

    strategy: str
    cut: str = "expert"
    S: int | None = None
    B: int | None = None
    decisions: tuple[Decision, ...] = ()
    note: str | None = None


@dataclass(frozen=True)
class ResolvePass:
    """LayerSpec → Resolution."""

    strategy: str | None = None  # --schedule
    cut: str | None = None  # --cut
    hw: str = "h100"
    gemm: str | None = None  # --gemm: the library lowering runs bulk
    name: str = "resolve"

    def __call__(self, spec: LayerSpec) -> Resolution:
        return resolve(spec, self.strategy, self.cut, self.hw, self.gemm)


def resolve(
    spec: LayerSpec, strategy: str | None = None, cut: str | None = None, hw: str = "h100", gemm: str | None = None
) -> Resolution:
    """Strategy, cut, S and B: command line over spec over the cost model (``gemm``: the
    command line's ``--gemm``; the library lowering runs bulk)."""
    return _choose(spec, strategy, cut, hw, gemm)[0]


def resolve_strategy(spec: LayerSpec, strategy: str | None = None, hw: str = "h100") -> Resolution:
    """The strategy ``rdepc plan`` plans for, as compile resolves it: ``strategy`` (else the
    spec's ``schedule``) when it is bulk, pipelined or deep; for ``auto``, :func:`resolve`'s
    choice on the profile ``hw``. When compile could build none of the candidates (too many
    tasks), the plan falls back to segmented iff the spec has a segment statement, and says
    so in ``note``."""
    s = strategy or spec.schedule
    if s not in (*STRATEGIES, "auto"):
        raise ValueError(f"unknown strategy '{s}' (known: auto, {', '.join(STRATEGIES)})")
    if s != "auto":
        return Resolution(s)
    try:
        return resolve(spec, "auto", hw=hw)
    except SpecError as e:
        fallback = "pipelined" if spec.segment is not None else "bulk"
        why = e.diagnostics[0].message if e.diagnostics else str(e)
        return Resolution(fallback, note=f"schedule auto planned as {fallback}: compile cannot choose ({why})")


def build_for(
    spec: LayerSpec, strategy: str | None = None, cut: str | None = None, hw: str = "h100", gemm: str | None = None
) -> TaskGraph:
    """The graph of ``spec`` with every choice resolved: the resolve pass, then the graph pass."""
    return GraphPass()(spec, resolve(spec, strategy, cut, hw, gemm))


def dump(res: Resolution) -> str:
    """``--dump-after resolve``: what the layer is built with, then each decision and why."""
    lines = ["// what the layer is built with, and why"]
    lines += [f"{d.name} = {d.value}  ({d.why})" for d in res.decisions]
    return "\n".join(lines)


# A command weighs the same candidates more than once (plan: the spec's schedule against
# auto's, the projection; compile: the resolve pass, then the schedule pass): graphs and
# their makespans are immutable, so each is built once per process (a few kept).
@lru_cache(maxsize=8)
def quick_makespan(tg: TaskGraph, hw: str) -> float:
    """The predicted makespan of ``tg`` as :func:`rdepc.passes.schedule.schedule` would find
    it, without building the task table: what the strategy and cut choices compare."""
    from rdepc.passes.cost import cost_model
    from rdepc.passes.schedule import predicted_makespan

    return predicted_makespan(cost_model(tg, hw))


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f} ms"


def _library_asked(spec: LayerSpec, gemm: str | None) -> bool:
    """The library GEMM lowering asked for: ``--gemm library``, or the spec's when not overridden."""
    return gemm == "library" or (gemm in (None, "auto") and spec.gemm == "library")


def _fixed_strategy(spec, strategy, gemm) -> tuple[str | None, str]:
    """The strategy the command line or the spec fixes and why (None: the cost model's):
    ``--schedule``, the spec's, or bulk where the library lowering is asked for."""
    if strategy is not None and strategy not in (*STRATEGIES, "auto"):
        raise ValueError(f"unknown schedule '{strategy}' (known: auto, {', '.join(STRATEGIES)})")
    # None: not given on the command line; "auto" given there: the cost model decides.
    if strategy is not None and strategy != "auto":
        fixed = (strategy, "command line --schedule")
    elif strategy is None and spec.schedule != "auto":
        fixed = (spec.schedule, f"spec: schedule {spec.schedule}")
    else:
        fixed = (None, "")
    asked = "command line --gemm library" if gemm == "library" else "spec: schedule ..., gemm library"
    if not _library_asked(spec, gemm):
        return fixed
    if fixed[0] not in (None, "bulk") and (strategy not in (None, "auto") or gemm != "library"):
        raise UsageError(
            f"{layer_prefix(spec.name)}: the library GEMM lowering ({asked}) runs bulk schedules, not {fixed[0]} "
            f"({fixed[1]})"
        )
    if fixed[0] == "bulk":
        return fixed
    aside = "" if fixed[0] is None else f"; the spec's schedule {fixed[0]} set aside"
    return "bulk", f"the library GEMM lowering runs bulk ({asked}{aside})"


def _fixed_cut(spec: LayerSpec, cut: str | None) -> tuple[str | None, str]:
    """The cut the command line or the spec's segment statement fixes and why (None: the cost model's)."""
    if cut is not None and cut not in ("auto", "expert", "source"):
        raise ValueError(f"unknown cut '{cut}' (known: auto, expert, source)")
    seg = spec.segment
    if cut is not None:
        return (None, "") if cut == "auto" else (cut, "command line --cut")
    if seg is not None and seg.cut != "auto":
        return seg.cut, f"spec: segment ..., cut {seg.cut}"
    return None, ""


# A resolution is immutable: a command that asks for it again (plan's choice warnings after its
# resolve) finds it made (a few kept).
@lru_cache(maxsize=8)
def _choose(spec, strategy, cut, hw, gemm=None) -> tuple[Resolution, TaskGraph]:
    """The resolution and its graph: each candidate built (a SpecError if none can be) and,
    when there are several, its makespan predicted."""
    seg = spec.segment
    fixed_strategy, why = _fixed_strategy(spec, strategy, gemm)
    fixed_cut, cut_why = _fixed_cut(spec, cut)
    tried = candidates(fixed_strategy, None if seg is None else (int(seg.rows), int(seg.buffers)))
    cuts = [fixed_cut] if fixed_cut else ["expert", "source"]
    keys = [(st, c, S, B) for st, S, B in tried for c in (cuts if st != "bulk" else ["expert"])]
    results: dict[tuple[str, str, int | None, int | None], float] = {}
    graphs: dict[tuple, TaskGraph] = {}
    first_error: SpecError | None = None
    for k in keys:
        try:  # too many tasks: not a candidate
            graphs[k] = graph_of(spec, *k)
        except SpecError as e:
            first_error = first_error or e
            continue
        results[k] = quick_makespan(graphs[k], hw) if len(keys) > 1 else 0.0
    if not results:
        assert first_error is not None
        raise first_error
    key = min(results, key=lambda k: (results[k], STRATEGIES.index(k[0]), k[1], k[2] or 0))
    st, c, S, B = key
    decisions = [_strategy_decision(st, why if fixed_strategy else None, results)]
    if st != "bulk":
        if fixed_cut:
            decisions.append(Decision("cut", c, cut_why))
        else:
            alt = {k[1]: v for k, v in results.items() if k[0] == st and k[2] == S}
            decisions.append(
                Decision("cut", c, "cost model: " + ", ".join(f"{k} {_ms(v)}" for k, v in sorted(alt.items())))
            )
        g = graphs[key].geometry
        src = "spec: segment statement" if S is None else "cost model: no segment statement"
        decisions.append(Decision("segment", f"S={g.S}, B={g.B}", src))
    res = Resolution(st, c if st != "bulk" else "expert", S, B, tuple(decisions))
    return res, graphs[key]


def _strategy_decision(st: str, fixed_why: str | None, results: dict) -> Decision:
    """The strategy, fixed (``fixed_why``) or the cost model's, with every candidate's makespan."""
    if fixed_why is not None:
        return Decision("strategy", st, fixed_why)
    others = ", ".join(
        f"{k[0]}{'' if k[2] is None else f' S={k[2]}'}{'' if k[0] == 'bulk' else ' cut ' + k[1]}: {_ms(v)}"
        for k, v in sorted(results.items(), key=lambda kv: kv[1])
    )
    return Decision("strategy", st, f"cost model: {others}")


# How much slower than ``schedule auto``'s choice a fixed strategy must be predicted before a
# user is warned: below it the model's ranking is within its own error on the leases.
SLOWER = 1.05


def choice_warnings(
    spec: LayerSpec, strategy: str | None = None, cut: str | None = None, hw: str = "h100", gemm: str | None = None
) -> list[str]:
    """What a user planning ``spec`` should hear about a schedule the command line or the spec
    fixed (the spec's own statement is checked where it is written, passes.spec_checks): deep
    asked with fewer than three buffers, which is pipelined; a strategy the cost model
    predicts :data:`SLOWER` or more slower on ``hw`` than the one ``schedule auto`` chooses."""
    chose = _fixed_strategy(spec, strategy, gemm)[0] is None or _library_asked(spec, gemm)
    if chose and strategy != "deep":
        return []  # the cost model chose, or the library lowering fixed bulk
    mine, tg = _choose(spec, strategy, cut, hw, gemm)
    why = next(d.why for d in mine.decisions if d.name == "strategy")
    out = []
    if strategy == "deep" and tg.geometry.B < sizes.DEEP_BUFFERS:
        out.append(f"deep with {tg.geometry.B} buffers (command line --schedule) is no deeper than pipelined")
    if chose:
        return out
    best, best_tg = _choose(spec, "auto", None, hw, gemm)
    if best.strategy != mine.strategy:
        ours, theirs = quick_makespan(tg, hw), quick_makespan(best_tg, hw)
        if ours >= SLOWER * theirs:
            out.append(
                f"schedule {mine.strategy} ({why}) is predicted {ours / theirs:.2f}x slower than {best.strategy} on "
                f"{hw} ({_ms(ours)} against {_ms(theirs)}): 'schedule auto' would choose {best.strategy}"
            )
    return out


def compare(spec: LayerSpec, hw: str = "h100", cut: str | None = None) -> dict[str, Schedule]:
    """Schedules of every strategy the spec admits (for reports and plots)."""
    from rdepc.passes.schedule import schedule

    out = {}
    for st in STRATEGIES:
        if st != "bulk" and spec.segment is None:
            continue
        if st == "deep" and spec.segment is not None and int(spec.segment.buffers) < sizes.DEEP_BUFFERS:
            continue
        out[st] = schedule(build_for(spec, st, cut, hw), hw)
    return out


__all__ = [
    "SLOWER",
    "Resolution",
    "ResolvePass",
    "build_for",
    "choice_warnings",
    "compare",
    "dump",
    "quick_makespan",
    "resolve",
    "resolve_strategy",
]
