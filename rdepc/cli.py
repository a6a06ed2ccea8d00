"""The ``rdepc`` command line.

Exit codes: 0 success, 1 a problem with an input file (diagnostics printed as
``file:line:col: error: ...``), 2 bad command-line usage. Never a traceback, unless
``--debug`` asks for one. ``check`` imports neither torch nor triton.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from rdepc import __version__
from rdepc.api import UsageError, parse_override
from rdepc.codegen import UNSUPPORTED
from rdepc.diagnostics import Severity, SpecError
from rdepc.runtime.transport import TRANSPORTS


def _color(stream) -> bool:
    return stream.isatty() and os.environ.get("NO_COLOR") is None


def _print_diags(diags, sources) -> None:
    color = _color(sys.stderr)
    for d in diags:
        print(d.render(sources, color), file=sys.stderr)


def _common(p: argparse.ArgumentParser, several_files: bool = False) -> None:
    if several_files:
        p.add_argument("files", nargs="+", metavar="FILE", help=".rdep spec files")
    else:
        p.add_argument("file", metavar="FILE", help="a .rdep spec file")
    p.add_argument("--layer", metavar="NAME", help="the layer to use when the file defines several")
    p.add_argument(
        "-D",
        dest="defines",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a named parameter (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rdepc",
        description="Compile sparse MoE layer specs (.rdep) into overlapped expert-parallel kernels.",
    )
    ap.add_argument("--version", action="version", version=f"rdepc {__version__}")
    ap.add_argument("--debug", action="store_true", help="show Python tracebacks for internal errors")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("check", help="parse and check specs", description="Parse and check .rdep specs.")
    _common(p, several_files=True)
    p.add_argument("--werror", action="store_true", help="treat warnings as errors")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "compile",
        help="compile a layer",
        description="Compile one layer: writes the elaborated spec as JSON (LAYER.spec.json), the generated Triton "
        "kernels (LAYER_kernels.py), their plan (LAYER.plan.json) and an importable module (LAYER.py).",
    )
    _common(p)
    p.add_argument("-o", dest="out", metavar="DIR", help="output directory (default: build/LAYER)")
    p.add_argument("--dump-after", action="append", default=[], metavar="PASS", help="print the IR after PASS")
    p.add_argument("--time-passes", action="store_true", help="print each pass's time")
    p.add_argument(
        "--target",
        choices=["sm_90"],
        help="also compile every kernel to a cubin for this GPU (LAYER.KERNEL.sm_90.cubin; no GPU needed)",
    )
    p.add_argument(
        "--backend",
        default="emulated",
        choices=list(TRANSPORTS),
        help="the transport the kernels are generated for (default: emulated; nvshmem links NVSHMEM's bitcode)",
    )
    _schedule_options(p)
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser(
        "run",
        help="run a compiled layer on random inputs against the reference",
        description="Compile one layer, run it on random inputs (rdepc.reference.random_inputs) and compare the "
        "result with the reference operator (rdepc.reference, in fp32 on the same rounded inputs): prints the max "
        "relative error max|y - ref| / max|ref| and the run's statistics. On --device cpu the kernels run under "
        "the Triton interpreter.",
    )
    _common(p)
    p.add_argument("--backend", default="emulated", metavar="NAME", help="transport backend (default: emulated)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: the Triton interpreter (default)")
    p.add_argument(
        "--routing",
        default="uniform",
        type=_run_routing,
        metavar="uniform|zipf:A|hot|one",
        help="how tokens pick experts (default: uniform)",
    )
    p.add_argument("--seed", type=_seed, default=0, metavar="N", help="seed of the random inputs (default: 0)")
    p.add_argument(
        "--schedule", choices=["auto", "bulk", "pipelined", "deep"], help="override the spec's schedule statement"
    )
    p.add_argument(
        "--mode",
        choices=["unified", "role-split"],
        default="unified",
        help="kernel mode: unified (any program runs any task; default) or role-split (communication and compute "
        "programs per rank, as scheduled, running concurrently: on cpu one interpreter thread per program)",
    )
    p.add_argument("--tokens", type=int, metavar="T'", help="tokens per rank (default: the spec's T)")
    p.add_argument("--check", action="store_true", help="exit 1 unless the result matches the reference")
    p.add_argument(
        "--tol",
        type=float,
        metavar="X",
        help="max relative error --check accepts (default: 1e-5 for fp32, 5e-3 for fp16, 2e-2 for bf16)",
    )
    p.add_argument(
        "--profile",
        metavar="OUT.json",
        help="write the call's measured timeline as Chrome/Perfetto trace-event JSON, in the shape of viz --trace "
        "(one event per task-table entry; on cpu a logical clock that orders the tasks, on cuda %%globaltimer)",
    )
    p.set_defaults(func=cmd_run)

    from rdepc.passes.hardware import PROFILES  # plain data: no sympy, no torch

    p = sub.add_parser(
        "tune",
        help="choose a layer's tile sizes on a GPU and record them",
        description="Run the compiled layer natively with every candidate tile size that fits the GPU's shared "
        "memory (emulated backend, uniform routing), time each, and record the fastest beside the layer's kernel "
        "plan, keyed by plan, device and triton version; native runs of that plan then use it.",
    )
    _common(p)
    p.add_argument("--device", default="cuda", choices=["cuda"], help="the GPU to tune on (default: cuda)")
    p.add_argument(
        "--schedule", choices=["auto", "bulk", "pipelined", "deep"], help="override the spec's schedule statement"
    )
    p.add_argument(
        "--mode", choices=["unified", "role-split"], default="unified", help="kernel mode (default: unified)"
    )
    p.add_argument("--tokens", type=int, metavar="T'", help="tokens per rank (default: the spec's T)")
    p.add_argument("--reps", type=int, default=10, metavar="N", help="timed calls per candidate (default: 10)")
    p.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="stop timing candidates after this long (the fastest so far is kept)",
    )
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser(
        "plan",
        help="capacity, memory, transport and padding arithmetic of a layer",
        description="Plan one layer: pooling, capacity and overflow bounds, symmetric memory (the paper's "
        "Table 4 convention and rdepc's own heap, docs/memory.md), routing context, transport and padding, "
        "each figure a formula evaluated at the spec's sizes.",
    )
    _common(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes as integers)")
    p.add_argument("--symbolic", action="store_true", help="also print the formula behind every figure")
    p.add_argument("--hw", default="h100", choices=list(PROFILES), help="hardware profile (default: h100)")
    p.add_argument(
        "--overflow",
        type=_probability,
        default=1e-6,
        metavar="P",
        help="target probability that any expert overflows its capacity (default: 1e-6)",
    )
    _sampled_routing(p, "sample one routing (numpy) and report rows per expert and padding")
    p.add_argument(
        "--probs",
        metavar="FILE",
        help="E per-expert selection probabilities p_e, separated by commas or whitespace ('#' comments) or as a "
        "JSON array (Poisson-binomial bound, eq. 18)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "viz",
        help="draw a layer's predicted schedule (trace, Gantt chart, graph)",
        description="Schedule one layer and write its predicted timeline as Chrome/Perfetto trace JSON "
        "(--trace), a Gantt chart (--png) and its task graph as Graphviz DOT (--dot); prints a summary.",
    )
    _common(p)
    _schedule_options(p)
    p.add_argument("--trace", metavar="OUT.json", help="write the timeline as Chrome/Perfetto trace-event JSON")
    p.add_argument("--png", metavar="OUT.png", help="write a Gantt chart (needs matplotlib)")
    p.add_argument("--dot", metavar="OUT.dot", help="write the task graph as Graphviz DOT")
    p.add_argument(
        "--tasks", action="store_true", help="with --dot: every task (default: one node per rank, stage and segment)"
    )
    p.add_argument("--full", action="store_true", help="with --dot: the tile-level graph (small specs only)")
    p.add_argument("--empty", action="store_true", help="with --trace: also tasks predicted to be empty")
    p.add_argument("--ranks", type=int, default=8, metavar="N", help="with --png: at most N ranks (default: 8)")
    _sampled_routing(p, "predict under one sampled routing (numpy, as plan's) instead of the expected one")
    p.set_defaults(func=cmd_viz)

    p = sub.add_parser(
        "cache",
        help="inspect or clear the compilation cache",
        description="The compilation cache ($RDEPC_CACHE_DIR, default ~/.cache/rdepc): generated kernels and their "
        "plan, one verified entry per spec and options. Every read checks an entry's files against the digests it "
        "recorded, and rebuilds one that fails, with a warning.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    a = actions.add_parser(
        "info",
        help="where the cache is, its entries and their size, and how many fail verification",
        description="Print where the cache is and what chose it, its entries and their total size, and those that "
        "fail verification (rebuilt on their next use).",
    )
    a.set_defaults(func=cmd_cache_info)
    a = actions.add_parser(
        "clear",
        help="remove every cache entry",
        description="Remove every entry of the cache and print how many and the space freed. Nothing else in the "
        "directory is removed (other files, tuning records).",
    )
    a.set_defaults(func=cmd_cache_clear)
    return ap


def _sampled_routing(p: argparse.ArgumentParser, what: str) -> None:
    """--routing uniform|zipf:ALPHA and --seed, as plan and viz sample a routing."""
    p.add_argument("--routing", type=_routing, metavar="uniform|zipf:ALPHA", help=what)
    p.add_argument("--seed", type=_seed, default=0, metavar="N", help="seed of the sampled routing (default: 0)")


def _schedule_options(p: argparse.ArgumentParser) -> None:
    from rdepc.passes.hardware import PROFILES  # plain data: no sympy, no torch

    p.add_argument(
        "--schedule",
        choices=["auto", "bulk", "pipelined", "deep"],
        help="override the spec's schedule statement (auto: the cost model chooses)",
    )
    p.add_argument(
        "--cut", choices=["auto", "expert", "source"], help="override the segment statement's cut (segments by)"
    )
    p.add_argument("--hw", default="h100", choices=list(PROFILES), help="hardware profile (default: h100)")


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a probability in (0, 1)")
    return v


def _routing(text: str) -> tuple[str, float]:
    if text == "uniform":
        return "uniform", 0.0
    kind, colon, alpha = text.partition(":")
    if kind == "zipf" and colon:
        try:
            a = float(alpha)
        except ValueError:
            a = -1.0
        if a >= 0 and a == a and a != float("inf"):
            return "zipf", a
    raise argparse.ArgumentTypeError(f"{text!r}: expected uniform or zipf:ALPHA with ALPHA >= 0")


def _run_routing(text: str) -> str:
    if text in ("uniform", "hot", "one"):
        return text
    kind, colon, alpha = text.partition(":")
    if kind == "zipf" and colon:
        try:
            a = float(alpha)
        except ValueError:
            a = -1.0
        if a >= 0 and a == a and a != float("inf"):
            return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected uniform, zipf:ALPHA with ALPHA >= 0, hot or one")


def _seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return v


def _overrides(args) -> dict:
    return dict(parse_override(d) for d in args.defines)


def cmd_check(args) -> int:
    from rdepc.parser import parse_file
    from rdepc.passes.elaborate import elaborate

    overrides = _overrides(args)
    status = 0
    for f in args.files:
        try:
            module = parse_file(f)
        except SpecError as e:
            _print_diags(e.diagnostics, e.sources)
            status = 1
            continue
        if args.layer is not None and args.layer not in module.layer_names:
            raise UsageError(f"{f} has no layer '{args.layer}' (it has: {', '.join(module.layer_names)})")
        declared = {p.name for p in module.params}
        unknown = sorted(set(overrides) - declared)
        if unknown:
            raise UsageError(f"no parameter {', '.join(unknown)} in {f} (declared: {', '.join(sorted(declared))})")
        specs, diags = elaborate(module, args.layer, overrides, sympy=False)
        for s in specs:  # what check accepts but compile stops at: said here too, so the two agree
            for feature, key in s.features():
                if feature in UNSUPPORTED:
                    diags.note(f"not supported yet: {feature} (compile and run stop here)", s.span_of(key))
        _print_diags(sorted(diags.items, key=_pos), diags.sources)
        if diags.errors or (args.werror and any(d.severity is Severity.WARNING for d in diags.items)):
            status = 1
            continue
        for s in specs:
            t = f"<={s.shape.T_max}" if s.shape.symbolic else f"={s.shape.T}"  # a bounded T as T<=8192
            dims = f"W={s.shape.W} T{t} H={s.shape.H} E={s.shape.E} K={s.shape.K}"
            print(f"{f}: layer {s.name}: ok ({dims}, {s.expert.act} F={s.expert.F})")
    return status


def _pos(d):
    return (d.span.line, d.span.col) if d.span else (0, 0)


def cmd_compile(args) -> int:
    from rdepc.driver import PASS_NAMES, Options, compile_file, dump_json, spec_passes

    known = list(PASS_NAMES) + [p.name for p in spec_passes()]
    for name in args.dump_after:
        if name not in known:
            raise UsageError(f"--dump-after {name}: no such pass (passes: {', '.join(known)})")
    opts = Options(
        args.layer,
        _overrides(args),
        tuple(args.dump_after),
        args.time_passes,
        schedule=args.schedule,
        cut=args.cut,
        hw=args.hw,
        backend=args.backend,
    )
    # sys.stdout as it is now: compile_file's default was bound when rdepc.driver was imported
    result = compile_file(args.file, opts, sys.stdout)
    generated = result.outputs["codegen"]
    _print_diags(result.warnings, {})
    out = Path(args.out or Path("build") / result.spec.name)
    target = out / f"{result.spec.name}.spec.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(dump_json(result.spec) + "\n", encoding="utf-8")
        tmp.replace(target)
        from rdepc.codegen import write_module

        wrote = [target, *write_module(generated, out)]
    except OSError as e:  # -o names a file, an unwritable place, ...
        print(f"rdepc: error: cannot write {e.filename or target}: {e.strerror or e}", file=sys.stderr)
        return 1
    if args.target:
        from rdepc.codegen.sm90 import compile_cubins

        name = result.spec.name
        for r in compile_cubins([(out / f"{name}_kernels.py", out / f"{name}.plan.json", out)], arch=90):
            wrote.append(Path(r["cubin"]))
            mma = ", ".join(r["wgmma_shapes"]) or "no wgmma"
            sp, at = r["specialization"], r["launch"]
            aligned = "" if sp["aligned_pointers"] == sp["pointers"] else f"{sp['aligned_pointers']} of "
            ones = "".join(f", {n}=1 constant" for n in sp["constexpr_ones"])
            print(
                f"compiled {r['kernel']} for {r['target']} in {r['seconds']:.1f} s: {r['bytes']:,} bytes, "
                f"{r['shared']:,} bytes of shared memory, {r['registers']} registers, {r['stack']:,} bytes of "
                f"stack and {r['local_bytes']:,} bytes of local memory (spills) per thread; GEMMs: {mma}, "
                f"{'TMA' if r['tma'] else 'no TMA'}; as launched: {aligned}pointers 16-byte aligned, "
                f"T'={at['n_tokens']}, {at['n_programs']} programs{ones}"
            )
    for path in wrote:
        print(f"wrote {path}")
    return 0


TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 2e-2}


def cmd_run(args) -> int:
    import time

    from rdepc.api import INTERPRETER, Layer, elaborate_layer, require_cuda
    from rdepc.driver import backend_warnings
    from rdepc.parser import parse_file

    if args.device == "cuda":  # before any work: torch's own assertion would surface mid-build
        require_cuda("--device cuda", f"--device cpu ({INTERPRETER})")
    if args.profile is not None:  # before the run, which may take long: a path that cannot be written
        _check_writable("--profile", args.profile)
    module = parse_file(args.file)
    spec, warnings = elaborate_layer(module, args.layer, _overrides(args))
    _print_diags(warnings + backend_warnings(spec, args.backend), {})
    layer = Layer(spec, warnings)
    sh = layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    tokens = T if args.tokens is None else args.tokens
    if not 1 <= tokens <= T:
        raise UsageError(f"--tokens {tokens}: expected 1 <= T' <= {T} (the spec's T)")
    from rdepc.runtime import transport

    try:
        transport.get(args.backend)
    except (NotImplementedError, ValueError) as e:
        raise UsageError(f"--backend {args.backend}: {e}") from None
    import torch

    if transport.get(args.backend).per_rank:
        return _run_per_rank(args, layer, tokens)
    from rdepc.passes.routing import owners_per_token_expr
    from rdepc.reference import owner_pairs, random_inputs, reference_for
    from rdepc.runtime.module import TORCH_DTYPES, max_relative_error

    options = {"mode": args.mode} | ({"profile": True} if args.profile is not None else {})
    kernels = layer.module(args.backend, args.device, schedule=args.schedule, **options)
    dtype_name = spec.precision.dtype.value
    inputs = random_inputs(
        W,
        tokens,
        H,
        F,
        E,
        K,
        routing=args.routing,
        seed=args.seed,
        dtype=TORCH_DTYPES[dtype_name],
        gated=spec.expert.gated,
        device=args.device,
    )
    t0 = time.perf_counter()
    y = kernels(*inputs)
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    as_fp32 = [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs]
    ref, accepted_ref = reference_for(spec)(*as_fp32)
    err = max_relative_error(y, ref)
    st = kernels.last_stats
    same = bool(torch.equal(st["accepted"].cpu(), accepted_ref.cpu()))
    tol = TOLERANCE[dtype_name] if args.tol is None else args.tol
    n_rows = W * tokens * K
    where = f"{args.device} (Triton interpreter)" if kernels.interpret else args.device
    cap = "dropless" if st["capacity"] is None else f"cap_e = {st['capacity']} rows per expert"
    backend = f"{kernels.transport.name} backend on {where}, {kernels.plan.strategy} schedule"
    print(f"layer {spec.name} ({spec.file}): {backend}")
    shape = f"W={W} T'={tokens} H={H} F={F} E={E} K={K}"
    print(f"  inputs          {shape}, {dtype_name}, routing {args.routing}, seed {args.seed}")
    print(f"  max rel. error  {err:.3g}  (max|y - ref| / max|ref|, rdepc.reference in fp32; tolerance {tol:g})")
    if spec.precision.dispatch_scale is not None:  # the reference above saw the rows fp8 dispatch sends
        exact, _ = reference_for(spec, dispatch_rounding=False)(*as_fp32)
        scales = f"{spec.route_row.scales} fp32 scale{'s' if spec.route_row.scales > 1 else ''} per row"
        print(
            f"  fp8 dispatch    e4m3 rows, {scales}; {max_relative_error(y, exact):.3g} from the unquantised operator"
        )
    accepted = int(st["accepted"].sum())
    agree = "matches the reference" if same else "DIFFERS from the reference"
    print(f"  accepted set    {agree} ({accepted} of {n_rows} route rows accepted)")
    pairs = owner_pairs(inputs.topk_ids, st["accepted"], spec.ownership.owner)
    uniform = float(owners_per_token_expr(E, K, spec.ownership.experts_per_rank(W))) / K
    print(
        f"  redundancy      {accepted - pairs} of {accepted} accepted route rows repeat a (token, owner) pair "
        f"({100 * (1 - pairs / max(accepted, 1)):.1f} %; uniform routing: {100 * (1 - uniform):.1f} %), "
        f"rows dedup {'does' if spec.dedup else 'would'} not send"
    )
    sent, back = int(st["dispatched_rows"].sum()), int(st["returned_rows"].sum())
    want = pairs if spec.dedup else accepted  # rows the transport must have moved with their data
    moved = _moved(spec, sent, accepted, back)
    print(f"  transport       {moved}{'' if sent == back == want else f' (MISMATCH: expected {want} each way)'}")
    print(f"  rows per expert {st['rows_per_expert'].tolist()}")
    print(f"  rows per owner  {st['rows_per_owner'].tolist()}")
    print(f"  dropped rows    {st['dropped_rows']} ({cap})")
    if st["dropped_rows"]:
        order = f"drop {spec.capacity.drop}"
        print(f"  dropped per src {st['dropped_per_source'].tolist()} per front-end rank ({order})")
    print(f"  m-tiles         {st['m_tiles'].tolist()} per owner (BM = {kernels.tiles.bm}, padding-free)")
    t = kernels.tiles
    print(
        f"  tiles           BM {t.bm}, F-block {t.block_f}, H-block {t.block_h}, K-chunk {t.block_k}, "
        f"{t.num_warps} warps, {t.num_stages} stages: {kernels.tiles_source}"
    )
    print(
        f"  kernel          {st['launches']} launch, {kernels.mode} mode, grid ({kernels.grid},), "
        f"{kernels.work.n_items} work items "
        f"over {kernels.work.n_entries} task-table entries, {elapsed:.2f} s"
    )
    if args.profile is not None:
        from rdepc.runtime.profile import write_measured_trace

        prof = kernels.last_profile
        try:
            programs = kernels.grid if kernels.mode == "unified" else kernels.per_queue[:2]
            path = write_measured_trace(kernels.plan, prof, args.profile, programs=programs)
        except OSError as e:
            print(f"rdepc: error: cannot write {e.filename or args.profile}: {e.strerror or e}", file=sys.stderr)
            return 1
        clock = "logical clock: an order, not durations" if prof["clock"] == "logical" else "%globaltimer"
        print(f"  profile         {len(prof['events'])} task events ({clock}) → {path}")
    if not args.check:
        return 0
    if err <= tol and same and sent == back == want:
        print("check passed")
        return 0
    why = [] if sent == back == want else [f"the transport moved {sent} rows out and {back} back, not {want}"]
    if not err <= tol:
        why.append(f"max relative error {err:.3g} > {tol:g}")
    if not same:
        why.append("the accepted set differs from the reference's")
    print(f"check FAILED: {'; '.join(why)}")
    return 1


def _check_writable(option: str, path: str) -> None:
    """UsageError unless ``path`` can be written as a file: checked before a long run, not after it."""
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{option} {path}: is a directory (expected a file name, e.g. OUT.json)")
    parent = out.parent
    if not parent.exists():
        raise UsageError(f"{option} {path}: no such directory {parent}")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is not a directory")
    if out.exists() and not os.access(out, os.W_OK):
        raise UsageError(f"{option} {path}: permission denied (the file is not writable)")
    if not out.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: permission denied (cannot create files in {parent})")


def _moved(spec, sent: int, accepted: int, back: int) -> str:
    """What the transport moved: its rows and bytes out and back (``passes.transport.transport_bytes``)."""
    from rdepc.passes.transport import transport_bytes
    from rdepc.report import fmt_bytes

    out, ret = transport_bytes(spec, sent, accepted, back)
    rows = f"{sent} payload rows out for {accepted} accepted route rows, {back} back: "
    rows += f"{fmt_bytes(out)} out, {fmt_bytes(ret)} back"
    if spec.dedup:
        return f"{rows} (dedup: {100 * (1 - sent / max(accepted, 1)):.1f} % fewer rows)"
    return rows


def _run_per_rank(args, layer, tokens: int) -> int:
    """``rdepc run`` on a per-rank backend: under torchrun this process is one rank; without
    it, ``emulated-mp`` starts its W processes itself (``nvshmem`` needs torchrun's GPUs)."""
    import os

    import torch

    from rdepc.runtime import per_rank, ranks
    from rdepc.runtime.nvshmem import NvshmemUnavailable

    spec, W = layer.spec, layer.shapes["W"]
    gpu = args.backend == "nvshmem"
    if gpu and not torch.cuda.is_available():
        raise UsageError("--backend nvshmem needs a CUDA GPU and none is visible (on a CPU: --backend emulated-mp)")
    if not gpu and args.device != "cpu":
        raise UsageError("--backend emulated-mp runs on --device cpu (its heap is host shared memory)")
    if args.profile is not None:
        raise UsageError(f"--profile: not supported yet with the per-rank backend {args.backend} (use emulated)")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not torchrun and gpu:
        raise UsageError(
            f"--backend nvshmem runs one process per GPU rank: torchrun --nproc-per-node {W} -m rdepc run ..."
        )
    case = per_rank.Case(
        file=str(layer.spec.file),
        layer=spec.name,
        overrides=tuple(_overrides(args).items()),
        backend=args.backend,
        device="cuda" if gpu else "cpu",
        schedule=args.schedule,
        mode=args.mode,
        routing=args.routing,
        seed=args.seed,
        tokens=tokens,
    )
    job = per_rank.Job((case,))
    tol = TOLERANCE[spec.precision.dtype.value] if args.tol is None else args.tol
    try:
        if torchrun:
            rank, _ = ranks.process_group(W)
            results = per_rank.run_rank(rank, W, job)
        else:
            print(f"starting {W} rank processes ({args.backend}, Triton interpreter) ...", flush=True)
            results = [r[0] for r in ranks.spawn(per_rank.run_rank, W, job)]
    except (ranks.RanksError, NvshmemUnavailable) as e:  # a rank could not run (kernel errors: per rank below)
        print(f"rdepc: error: {str(e).splitlines()[0].removeprefix('rdepc: ')}", file=sys.stderr)
        return 1
    where = "cuda (one process per GPU rank)" if gpu else "cpu (Triton interpreter, one process per rank)"
    print(f"layer {spec.name} ({spec.file}): {args.backend} backend on {where}, {args.mode} mode")
    print(f"  inputs          W={W} T'={tokens}, routing {args.routing}, seed {args.seed}; each rank checks its slice")
    lines, ok = per_rank.report(results, tol)
    print("\n".join(lines))
    if not args.check:
        return 0
    print("check passed" if ok else "check FAILED")
    return 0 if ok else 1


def _load_spec(args):
    """Parse and check ``args.file``'s chosen layer; print its warnings with their source lines."""
    from rdepc.api import elaborate_layer
    from rdepc.parser import parse_file

    module = parse_file(args.file)
    spec, warnings = elaborate_layer(module, args.layer, _overrides(args))
    _print_diags(warnings, {module.file: module.text})
    return spec


def cmd_tune(args) -> int:
    from rdepc.api import Layer, elaborate_layer
    from rdepc.parser import parse_file

    module = parse_file(args.file)
    spec, warnings = elaborate_layer(module, args.layer, _overrides(args))
    _print_diags(warnings, {})
    layer = Layer(spec, warnings)
    T = layer.shapes["T"]
    if args.tokens is not None and not 1 <= args.tokens <= T:
        raise UsageError(f"--tokens {args.tokens}: expected 1 <= T' <= {T} (the spec's T)")
    if args.reps < 1:
        raise UsageError(f"--reps {args.reps}: expected at least 1")
    if args.budget is not None and not args.budget > 0:
        raise UsageError(f"--budget {args.budget}: expected a positive number of seconds")
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (tuning measures native kernels on a GPU)")
    from rdepc.runtime.tune import tune_layer

    print(f"tuning layer {spec.name} ({spec.file}) on {torch.cuda.get_device_name()}:")
    best, results, path = tune_layer(
        layer, args.device, schedule=args.schedule, mode=args.mode, tokens=args.tokens, reps=args.reps,
        progress=lambda line: print(line, flush=True), budget=args.budget,
    )  # fmt: skip
    ms = min(r["ms"] for r in results if "ms" in r)
    print(f"fastest: {best} at {ms:.3f} ms; recorded in {path}")
    return 0


def cmd_viz(args) -> int:
    from rdepc.passes.schedule import build_for, report, schedule

    spec = _load_spec(args)
    if args.ranks < 1:
        raise UsageError(f"--ranks {args.ranks}: expected a positive number")
    tg = build_for(spec, args.schedule, args.cut, args.hw)
    counts = None
    if args.routing:  # strategy and cut as compile resolves them; split, order and timeline under this routing
        from rdepc.passes.routing import source_counts

        geo = tg.geometry
        counts = source_counts(geo.W, geo.T, geo.E, geo.K, *args.routing, args.seed)
        per_expert = [sum(c) for c in zip(*counts, strict=True)]
        name = "uniform" if args.routing[0] == "uniform" else f"zipf alpha={args.routing[1]:g}"
        print(
            f"routing: {name}, seed {args.seed}, one sampled routing (rows per expert {min(per_expert):,} to "
            f"{max(per_expert):,}, mean {sum(per_expert) / len(per_expert):,.1f}, before capacity)"
        )
    sched = schedule(tg, args.hw, counts=counts)
    print(report(sched))
    from rdepc import viz

    wrote = []
    try:
        if args.trace:
            wrote.append(viz.write_trace(sched, args.trace, empty=args.empty))
        if args.png:
            bulk = None
            if sched.strategy != "bulk":
                bulk = schedule(build_for(spec, "bulk", None, args.hw), args.hw, counts=counts)
                print(f"  bulk            {bulk.makespan * 1e6:,.1f} µs predicted (no overlap), for comparison")
            wrote.append(viz.write_png(sched, args.png, bulk=bulk, max_ranks=args.ranks))
        if args.dot:
            try:
                level = "tiles" if args.full else "tasks" if args.tasks else "stages"
                wrote.append(viz.write_dot(sched.graph, args.dot, sched=sched, level=level))
            except ValueError as e:  # --full on a spec too large for a tile graph
                raise UsageError(f"--dot --full: {e}") from None
    except BrokenPipeError:
        raise
    except OSError as e:
        print(f"rdepc: error: cannot write {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 1
    for path in wrote:
        print(f"wrote {path}")
    return 0


def cmd_plan(args) -> int:
    import json

    from rdepc.passes.plan import plan
    from rdepc.passes.plan_records import PlanOptions, to_json
    from rdepc.passes.probs import parse_probs
    from rdepc.report import render

    spec = _load_spec(args)
    probs = None
    if args.probs is not None:
        try:
            text = Path(args.probs).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--probs {args.probs}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        probs = parse_probs(text, args.probs, int(spec.shape.E))
    routing, alpha = args.routing or (None, 0.0)
    options = PlanOptions(args.hw, args.overflow, routing, alpha, args.seed, probs)
    result = plan(spec, options)
    if args.json:
        print(json.dumps(to_json(result, formulas=args.symbolic), indent=2))
    else:
        sys.stdout.write(render(result, symbolic=args.symbolic))
    return 0


def cmd_cache_info(args) -> int:
    from rdepc.runtime import cache

    i = cache.info()
    print(f"compilation cache {i.directory} ({i.chosen_by})")
    if not i.exists:
        print("  entries         0 (the directory does not exist yet)")
        return 0
    print(f"  entries         {i.entries}, {cache.human_size(i.size)}")
    if not i.damaged:
        print(f"  verification    {'every entry verifies' if i.entries else 'nothing to verify'}")
    else:
        print(f"  verification    {len(i.damaged)} of {i.entries} fail (rebuilt on their next use):")
        for path, problem in i.damaged:
            print(f"    {path}: {problem}")
    if i.tuning_records:
        print(f"  tuning records  {i.tuning_records} (rdepc tune; cache clear keeps them)")
    return 0


def cmd_cache_clear(args) -> int:
    from rdepc.runtime import cache

    removed, freed = cache.clear()
    what = "entry" if removed == 1 else "entries"
    print(f"removed {removed} {what} from {cache.cache_dir()}, freed {cache.human_size(freed)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as e:
        _print_diags(e.diagnostics, e.sources)
        return 1
    except UsageError as e:
        print(f"rdepc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rdepc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (rdepc ... | head): not an internal error
        with contextlib.suppress(OSError, ValueError):  # so that the flush at exit does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # an internal error: report it as one, never as a bare traceback
        if args.debug:
            raise
        print(f"rdepc: internal error: {type(e).__name__}: {e} (run with --debug for a traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
