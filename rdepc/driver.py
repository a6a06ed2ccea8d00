"""The compiler driver: the one visible list of passes, run in order.

Each pass is a pure function from one IR to the next. The driver runs each pass's verifier
on its output before the next pass runs (the memory plan's always; the graph's and the
schedule's, :mod:`rdepc.passes.verify`, with ``--verify-each``), can print any pass's output
(``--dump-after``) and time every pass (``--time-passes``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rdepc import syntax as S
from rdepc.diagnostics import Diagnostic, Diagnostics, SpecError, UsageError
from rdepc.ir.spec import LayerSpec, spec_to_json
from rdepc.parser import parse_file


def choose_layer(module: S.Module, layer: str | None) -> str:
    names = module.layer_names
    if layer is None:
        if len(names) == 1:
            return names[0]
        raise UsageError(
            f"{module.file} defines {len(names)} layers ({', '.join(names)}); choose one with --layer NAME"
        )
    if layer not in names:
        raise UsageError(f"{module.file} has no layer '{layer}' (it has: {', '.join(names)})")
    return layer


def elaborate_layer(module: S.Module, layer: str | None, overrides: dict) -> tuple[LayerSpec, tuple[Diagnostic, ...]]:
    """The chosen layer's spec and its warnings; raises :class:`SpecError` on errors."""
    from rdepc.passes.elaborate import elaborate

    name = choose_layer(module, layer)
    declared = {p.name for p in module.params}
    unknown = sorted(set(overrides) - declared)
    if unknown:
        raise UsageError(
            f"no parameter {', '.join(unknown)} in {module.file} (declared: {', '.join(sorted(declared)) or 'none'})"
        )
    specs, diags = elaborate(module, name, overrides)
    diags.check()
    return specs[0], tuple(diags.warnings)


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Any], Any]
    dump: Callable[[Any], str] | None = None
    # The passes whose outputs this one takes, in order (default: the pass before it).
    source: tuple[str, ...] = ()
    # Problems with the pass's output (an empty list when none), checked before the next pass runs.
    verify: Callable[[Any], list[str]] | None = None


@dataclass
class Options:
    layer: str | None = None
    overrides: dict = field(default_factory=dict)
    dump_after: tuple[str, ...] = ()
    time_passes: bool = False
    schedule: str | None = None  # --schedule: overrides the spec's schedule statement
    cut: str | None = None  # --cut: overrides the segment statement's cut
    hw: str = "h100"  # hardware profile of the cost model
    backend: str = "emulated"  # --backend: the transport the kernels are generated for
    gemm: str | None = None  # --gemm: overrides the spec's schedule ..., gemm
    verify_each: bool = False  # --verify-each: the graph's and the schedule's invariants checked too


@dataclass
class Result:
    spec: LayerSpec
    warnings: tuple[Diagnostic, ...]
    outputs: dict[str, Any]  # each pass's output, by pass name
    times: dict[str, float]


def dump_json(ir: Any) -> str:
    return json.dumps(_plain(ir), indent=2, default=str)


def _plain(x: Any) -> Any:
    if isinstance(x, LayerSpec):
        return spec_to_json(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x) if "span" not in f.name}
    if isinstance(x, tuple | list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    return x if isinstance(x, int | float | str | bool | type(None)) else str(x)


def spec_passes(options: Options | None = None) -> list[Pass]:
    """Passes over the checked LayerSpec, in order. Later stages append here."""
    from rdepc import codegen
    from rdepc.passes import cost, graph, lowering, memplan, replicate, resolve, schedule, verify

    o = options or Options()
    checked = o.verify_each
    return [
        Pass("replicate", replicate.physical_layer, dump=replicate.dump, source=("elaborate",)),
        Pass("resolve", resolve.ResolvePass(o.schedule, o.cut, o.hw, o.gemm), dump=resolve.dump, source=("replicate",)),
        Pass(
            "graph",
            graph.GraphPass(),
            dump=graph.dump,
            source=("replicate", "resolve"),
            verify=verify.graph_problems if checked else None,
        ),
        Pass("cost", schedule.CostPass(o.hw), dump=cost.dump, source=("graph",)),
        Pass(
            "schedule",
            schedule.SchedulePass(),
            dump=schedule.dump,
            source=("cost",),
            verify=verify.schedule_problems if checked else None,
        ),
        Pass("lowering", lowering.LoweringPass(o.gemm), dump=lowering.dump, source=("schedule",)),
        Pass(
            "memplan",
            memplan.MemPlanPass(),
            dump=memplan.dump,
            source=("schedule",),
            verify=lambda mp: list(mp.problems),
        ),
        Pass(
            "codegen",
            codegen.CodegenPass(o.schedule, o.hw, o.backend),
            dump=codegen.dump,
            source=("schedule", "memplan", "lowering"),
        ),
    ]


def run_passes(
    passes: list[Pass], outputs: dict[str, Any], timed: Callable[[str, Callable[[], Any], Any], Any] | None = None
) -> Any:
    """The one pass runner: each pass in order, on the outputs of the passes it names
    (``outputs`` holds the earlier ones, "elaborate" at least, and gains each pass's),
    followed by its verifier. Returns the last
    output. ``timed(name, thunk, dump)`` runs a pass (the driver times and dumps there)."""
    spec = outputs["elaborate"]
    last: Any = spec
    for p in passes:
        args = [outputs[s] for s in p.source] if p.source else [last]
        thunk = lambda p=p, args=args: p.run(*args)  # noqa: E731
        last = timed(p.name, thunk, p.dump) if timed else thunk()
        outputs[p.name] = last
        problems = p.verify(last) if p.verify else []
        if problems:
            raise AssertionError(f"the {p.name} pass's output violates its invariants:\n  " + "\n  ".join(problems))
    return last


def generate_spec(
    spec: LayerSpec, schedule: str | None = None, hw: str = "h100", backend: str = "emulated", gemm: str | None = None
):
    """Run the passes over a checked LayerSpec up to and including codegen (the "not
    supported yet" checks included): an ``rdepc.codegen.Generated``. ``schedule`` as
    ``--schedule``, ``gemm`` as ``--gemm``, ``backend`` the transport the kernels are
    generated for."""
    options = Options(schedule=schedule, hw=hw, backend=backend, gemm=gemm)
    return run_passes(spec_passes(options), {"elaborate": spec})


def compile_file(
    path: str | Path, options: Options, out: TextIO | None = None, passes: list[Pass] | None = None
) -> Result:
    out = out or sys.stdout
    times: dict[str, float] = {}
    outputs: dict[str, Any] = {}

    def timed(name: str, fn: Callable[[], Any], dump: Callable[[Any], str] | None = None) -> Any:
        t0 = time.perf_counter()
        value = fn()
        times[name] = time.perf_counter() - t0
        outputs[name] = value
        if name in options.dump_after:
            print(f"// ----- IR after {name}", file=out)
            print((dump or _DUMPS.get(name, dump_json))(value), file=out)
        return value

    module: S.Module = timed("parse", lambda: parse_file(path))
    spec, warnings = timed("elaborate", lambda: elaborate_layer(module, options.layer, options.overrides))
    outputs["elaborate"] = spec
    warnings = (*warnings, *backend_warnings(spec, options.backend))
    run_passes(spec_passes(options) if passes is None else passes, outputs, timed)
    if options.time_passes:
        total = sum(times.values())
        print("// pass timings", file=out)
        for name, t in times.items():
            print(f"//   {name:<14} {t * 1e3:9.2f} ms", file=out)
        print(f"//   {'total':<14} {total * 1e3:9.2f} ms", file=out)
    return Result(spec, warnings, outputs, times)


def backend_warnings(spec: LayerSpec, backend: str) -> tuple[Diagnostic, ...]:
    """What only the backend a layer is built for can tell, at the spec's statement: a
    ``transport nvshmem`` layer built for an emulated backend (which ``rdepc check``, knowing
    no backend, cannot say). An unknown backend gets nothing here: its caller refuses it."""
    from rdepc.runtime.transport import TRANSPORTS  # plain data: no torch, no triton

    if spec.transport != "nvshmem" or backend == "nvshmem" or backend not in TRANSPORTS:
        return ()
    diags = Diagnostics()
    diags.warning(
        f"'transport nvshmem' compiled for the {backend} backend: rows move through the emulated symmetric heap, "
        "not NVSHMEM",
        spec.span_of("transport"),
        "--backend nvshmem builds the spec's target (one process per GPU rank, under torchrun)",
    )
    return tuple(diags.items)


def _dump_module(m: S.Module) -> str:
    lines = [f"module {m.file}"]
    lines += [f"  param {p.name} at {p.span}" for p in m.params]
    for layer in m.layers:
        lines.append(f"  layer {layer.name} at {layer.name_span}")
        lines += [f"    {st.keyword} ({len(st.args)} args) at {st.keyword_span}" for st in layer.stmts]
    return "\n".join(lines)


_DUMPS: dict[str, Callable[[Any], str]] = {
    "parse": _dump_module,
    "elaborate": lambda pair: dump_json(pair[0]),
}

PASS_NAMES = ("parse", "elaborate")

__all__ = [
    "Options",
    "Pass",
    "Result",
    "SpecError",
    "backend_warnings",
    "choose_layer",
    "compile_file",
    "dump_json",
    "elaborate_layer",
    "generate_spec",
    "run_passes",
    "spec_passes",
]
