"""The ``rdepc`` command line.

Exit codes: 0 success, 1 a problem with an input file (diagnostics printed as
``file:line:col: error: ...``), 2 bad command-line usage. Never a traceback, unless
``--debug`` asks for one. ``check`` imports neither torch nor triton.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rdepc import __version__
from rdepc.api import UsageError, parse_override
from rdepc.diagnostics import SpecError


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
        "compile", help="compile a layer", description="Compile one layer; writes the elaborated spec as JSON."
    )
    _common(p)
    p.add_argument("-o", dest="out", metavar="DIR", help="output directory (default: build/LAYER)")
    p.add_argument("--dump-after", action="append", default=[], metavar="PASS", help="print the IR after PASS")
    p.add_argument("--time-passes", action="store_true", help="print each pass's time")
    p.set_defaults(func=cmd_compile)
    return ap


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
        _print_diags(sorted(diags.items, key=_pos), diags.sources)
        if diags.errors or (args.werror and diags.items):
            status = 1
            continue
        for s in specs:
            t = f"{s.shape.T}" + (f"<={s.shape.T_max}" if s.shape.symbolic else "")
            dims = f"W={s.shape.W} T={t} H={s.shape.H} E={s.shape.E} K={s.shape.K}"
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
    opts = Options(args.layer, _overrides(args), tuple(args.dump_after), args.time_passes)
    result = compile_file(args.file, opts)
    _print_diags(result.warnings, {})
    out = Path(args.out or Path("build") / result.spec.name)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{result.spec.name}.spec.json"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(dump_json(result.spec) + "\n", encoding="utf-8")
    tmp.replace(target)
    print(f"wrote {target}")
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
    except Exception as e:  # an internal error: report it as one, never as a bare traceback
        if args.debug:
            raise
        print(f"rdepc: internal error: {type(e).__name__}: {e} (run with --debug for a traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
