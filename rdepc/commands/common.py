"""What several commands share: the options they have in common and the types that parse
their values, the printing of diagnostics, the ``-D`` overrides and loading a spec's layer."""

from __future__ import annotations

import argparse
import os
import sys

from rdepc.api import parse_override


def _color(stream) -> bool:
    return stream.isatty() and os.environ.get("NO_COLOR") is None


def print_diags(diags, sources) -> None:
    color = _color(sys.stderr)
    for d in diags:
        print(d.render(sources, color), file=sys.stderr)


def overrides(args) -> dict:
    return dict(parse_override(d) for d in args.defines)


def load_spec(args):
    """Parse and check ``args.file``'s chosen layer; print its warnings with their source lines."""
    from rdepc.api import elaborate_layer
    from rdepc.parser import parse_file

    module = parse_file(args.file)
    spec, warnings = elaborate_layer(module, args.layer, overrides(args))
    print_diags(warnings, {module.file: module.text})
    return spec


# ------------------------------------------------------------------ options


def spec_options(p: argparse.ArgumentParser, several_files: bool = False) -> None:
    """The spec file(s), --layer and -D: every command that reads a spec takes them."""
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


def sampled_routing(p: argparse.ArgumentParser, what: str) -> None:
    """--routing uniform|zipf:ALPHA and --seed, as plan and viz sample a routing."""
    p.add_argument("--routing", type=routing, metavar="uniform|zipf:ALPHA", help=what)
    p.add_argument("--seed", type=seed, default=0, metavar="N", help="seed of the sampled routing (default: 0)")


def hw_option(p: argparse.ArgumentParser) -> None:
    from rdepc.passes.hardware import HW_HELP, profile  # plain data: no sympy, no torch

    def hw(name: str) -> str:
        try:
            profile(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return name

    p.add_argument("--hw", default="h100", type=hw, metavar="PROFILE", help=HW_HELP)


def schedule_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--schedule",
        choices=["auto", "bulk", "pipelined", "deep"],
        help="override the spec's schedule statement (auto: the cost model chooses)",
    )
    p.add_argument(
        "--cut", choices=["auto", "expert", "source"], help="override the segment statement's cut (segments by)"
    )
    hw_option(p)
    gemm_option(p)


def gemm_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gemm",
        choices=["auto", "triton", "library"],
        help="the expert GEMMs' lowering: the Triton GEMM kernel, or torch's grouped GEMM between the transport "
        "kernel's launches (phased mode, bulk schedules); overrides the spec's 'schedule ..., gemm' (auto: the cost "
        "model chooses; under the interpreter triton unless asked)",
    )


def probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a probability in (0, 1)")
    return v


def _zipf(text: str) -> float | None:
    """ALPHA of ``zipf:ALPHA`` (a finite number >= 0), else None."""
    kind, colon, alpha = text.partition(":")
    if kind != "zipf" or not colon:
        return None
    try:
        a = float(alpha)
    except ValueError:
        return None
    return a if a >= 0 and a == a and a != float("inf") else None


def routing(text: str) -> tuple[str, float]:
    if text == "uniform":
        return "uniform", 0.0
    a = _zipf(text)
    if a is not None:
        return "zipf", a
    raise argparse.ArgumentTypeError(f"{text!r}: expected uniform or zipf:ALPHA with ALPHA >= 0")


def run_routing(text: str) -> str:
    if text in ("uniform", "hot", "one") or _zipf(text) is not None:
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected uniform, zipf:ALPHA with ALPHA >= 0, hot or one")


def seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return v
