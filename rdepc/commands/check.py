"""``rdepc check``: parse and check specs. Imports neither torch, triton nor sympy."""

from __future__ import annotations

from rdepc.api import UsageError
from rdepc.commands.common import overrides, print_diags
from rdepc.diagnostics import Severity, SpecError


def cmd_check(args) -> int:
    from rdepc.parser import parse_file
    from rdepc.passes.elaborate import elaborate

    defines = overrides(args)
    status = 0
    for f in args.files:
        try:
            module = parse_file(f)
        except SpecError as e:
            print_diags(e.diagnostics, e.sources)
            status = 1
            continue
        if args.layer is not None and args.layer not in module.layer_names:
            raise UsageError(f"{f} has no layer '{args.layer}' (it has: {', '.join(module.layer_names)})")
        declared = {p.name for p in module.params}
        unknown = sorted(set(defines) - declared)
        if unknown:
            raise UsageError(f"no parameter {', '.join(unknown)} in {f} (declared: {', '.join(sorted(declared))})")
        specs, diags = elaborate(module, args.layer, defines, sympy=False)
        print_diags(sorted(diags.items, key=_pos), diags.sources)
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
