"""The ``rdepc`` command line: the argument parser and :func:`main`, which runs a command
(one module each under ``rdepc.commands``) and turns what goes wrong into an exit status.

Exit codes: 0 success, 1 a problem with an input file (diagnostics printed as
``file:line:col: error: ...``), 2 bad command-line usage. Never a traceback, unless
``--debug`` asks for one. ``check``, ``plan`` and ``viz`` import neither torch nor triton.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from rdepc import __version__
from rdepc.api import UsageError
from rdepc.commands import common
from rdepc.commands.cache import cmd_cache_clear, cmd_cache_info
from rdepc.commands.check import cmd_check
from rdepc.commands.compile import cmd_compile
from rdepc.commands.from_hf import cmd_from_hf
from rdepc.commands.plan import cmd_plan
from rdepc.commands.run import cmd_run
from rdepc.commands.tune import cmd_tune
from rdepc.commands.viz import cmd_viz
from rdepc.diagnostics import SpecError
from rdepc.ir.contract import MODES
from rdepc.runtime.transport import TRANSPORTS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rdepc",
        description="Compile sparse MoE layer specs (.rdep) into overlapped expert-parallel kernels.",
    )
    ap.add_argument("--version", action="version", version=f"rdepc {__version__}")
    ap.add_argument("--debug", action="store_true", help="show Python tracebacks for internal errors")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_check(sub)
    _add_compile(sub)
    _add_run(sub)
    _add_tune(sub)
    _add_plan(sub)
    _add_viz(sub)
    _add_from_hf(sub)
    _add_cache(sub)
    return ap


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="parse and check specs", description="Parse and check .rdep specs.")
    common.spec_options(p, several_files=True)
    p.add_argument("--werror", action="store_true", help="treat warnings as errors")
    p.set_defaults(func=cmd_check)


def _add_compile(sub) -> None:
    p = sub.add_parser(
        "compile",
        help="compile a layer",
        description="Compile one layer: writes the elaborated spec as JSON (LAYER.spec.json), the generated Triton "
        "kernels (LAYER_kernels.py), their contract (LAYER.contract.json) and an importable module (LAYER.py).",
    )
    common.spec_options(p)
    p.add_argument("-o", dest="out", metavar="DIR", help="output directory (default: build/LAYER)")
    p.add_argument("--dump-after", action="append", default=[], metavar="PASS", help="print the IR after PASS")
    p.add_argument("--time-passes", action="store_true", help="print each pass's time")
    p.add_argument(
        "--verify-each",
        action="store_true",
        help="check the graph's and the schedule's invariants after their passes (the memory plan's always are)",
    )
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
    common.schedule_options(p)
    p.set_defaults(func=cmd_compile)


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run a compiled layer on random inputs against the reference",
        description="Compile one layer, run it on random inputs (rdepc.reference.random_inputs) and compare the "
        "result with the reference operator (rdepc.reference, in fp32 on the same rounded inputs): prints the max "
        "relative error max|y - ref| / max|ref| and the run's statistics. On --device cpu the kernels run under "
        "the Triton interpreter.",
    )
    common.spec_options(p)
    p.add_argument("--backend", default="emulated", metavar="NAME", help="transport backend (default: emulated)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: the Triton interpreter (default)")
    p.add_argument(
        "--routing",
        default="uniform",
        type=common.run_routing,
        metavar="uniform|zipf:A|hot|one",
        help="how tokens pick experts (default: uniform)",
    )
    p.add_argument("--seed", type=common.seed, default=0, metavar="N", help="seed of the random inputs (default: 0)")
    p.add_argument(
        "--schedule", choices=["auto", "bulk", "pipelined", "deep"], help="override the spec's schedule statement"
    )
    p.add_argument(
        "--mode",
        choices=list(MODES),
        help="kernel mode: unified (one kernel, any program runs any task; the default on cpu), split (a "
        "transport kernel and a GEMM kernel side by side, every program of both running at once: the default on "
        "cuda; on cpu one interpreter thread per program) or phased (the transport kernel, the GEMM kernel, the "
        "transport kernel again, one after another, each on every SM: nothing overlaps)",
    )
    p.add_argument(
        "--comm-programs",
        type=int,
        metavar="N",
        help="split mode: the transport kernel's programs, the rest of the GPU's the GEMM kernel's "
        "(default: the schedule's split of communication and compute)",
    )
    common.gemm_option(p)
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


def _add_tune(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="choose a layer's tile sizes on a GPU and record them",
        description="Run the compiled layer natively with every candidate tile size that fits the GPU's shared "
        "memory (emulated backend, uniform routing), time each, and record the fastest beside the layer's kernel "
        "plan, keyed by plan, device and triton version; native runs of that plan then use it.",
    )
    common.spec_options(p)
    p.add_argument("--device", default="cuda", choices=["cuda"], help="the GPU to tune on (default: cuda)")
    p.add_argument(
        "--schedule", choices=["auto", "bulk", "pipelined", "deep"], help="override the spec's schedule statement"
    )
    p.add_argument("--mode", choices=list(MODES), help="kernel mode (default: split, the native default)")
    p.add_argument("--tokens", type=int, metavar="T'", help="tokens per rank (default: the spec's T)")
    p.add_argument("--reps", type=int, default=10, metavar="N", help="timed calls per candidate (default: 10)")
    p.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="stop timing candidates after this long (the fastest so far is kept)",
    )
    p.set_defaults(func=cmd_tune)


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity, memory, transport and padding arithmetic of a layer",
        description="Plan one layer: pooling, capacity and overflow bounds, symmetric memory (the paper's "
        "Table 4 convention and rdepc's own heap, docs/memory.md), routing context, transport and padding, "
        "each figure a formula evaluated at the spec's sizes.",
    )
    common.spec_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes as integers)")
    p.add_argument("--symbolic", action="store_true", help="also print the formula behind every figure")
    common.hw_option(p)
    common.gemm_option(p)
    p.add_argument(
        "--overflow",
        type=common.probability,
        default=1e-6,
        metavar="P",
        help="target probability that any expert overflows its capacity (default: 1e-6)",
    )
    common.sampled_routing(p, "sample one routing (numpy) and report rows per expert and padding")
    p.add_argument(
        "--probs",
        metavar="FILE",
        help="E per-expert selection probabilities p_e, separated by commas or whitespace ('#' comments) or as a "
        "JSON array (Poisson-binomial bound, eq. 18)",
    )
    p.set_defaults(func=cmd_plan)


def _add_viz(sub) -> None:
    p = sub.add_parser(
        "viz",
        help="draw a layer's predicted schedule (trace, Gantt chart, graph)",
        description="Schedule one layer and write its predicted timeline as Chrome/Perfetto trace JSON "
        "(--trace), a Gantt chart (--png) and its task graph as Graphviz DOT (--dot); prints a summary.",
    )
    common.spec_options(p)
    common.schedule_options(p)
    p.add_argument("--trace", metavar="OUT.json", help="write the timeline as Chrome/Perfetto trace-event JSON")
    p.add_argument("--png", metavar="OUT.png", help="write a Gantt chart (needs matplotlib)")
    p.add_argument("--dot", metavar="OUT.dot", help="write the task graph as Graphviz DOT")
    p.add_argument(
        "--tasks", action="store_true", help="with --dot: every task (default: one node per rank, stage and segment)"
    )
    p.add_argument("--full", action="store_true", help="with --dot: the tile-level graph (small specs only)")
    p.add_argument("--empty", action="store_true", help="with --trace: also tasks predicted to be empty")
    p.add_argument("--ranks", type=int, default=8, metavar="N", help="with --png: at most N ranks (default: 8)")
    common.sampled_routing(p, "predict under one sampled routing (numpy, as plan's) instead of the expected one")
    p.set_defaults(func=cmd_viz)


def _add_from_hf(sub) -> None:
    p = sub.add_parser(
        "from-hf",
        help="write the spec of a transformers model's MoE blocks from its config",
        description="Write the .rdep spec of every distinct MoE block of a transformers model, each value commented "
        "with where it came from, from the model's config alone (offline: a checkpoint directory or its "
        "config.json; the model is built on the meta device, no weight is read). Needs transformers.",
    )
    p.add_argument("model", metavar="MODEL_DIR_OR_CONFIG", help="a model directory holding config.json, or the file")
    p.add_argument("--ranks", type=int, default=8, metavar="W", help="ranks the layer runs on (param W; default 8)")
    p.add_argument(
        "--tokens", type=int, default=4096, metavar="T", help="tokens per rank in one call (param T; default 4096)"
    )
    p.add_argument("-o", dest="out", metavar="FILE", help="write the spec to FILE (default: print it)")
    p.set_defaults(func=cmd_from_hf)


def _add_cache(sub) -> None:
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


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as e:
        common.print_diags(e.diagnostics, e.sources)
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
