"""``rdepc plan``: a layer's capacity, memory, transport and padding arithmetic
(``rdepc.passes.plan``, rendered by ``rdepc.report``). Imports neither torch nor triton."""

from __future__ import annotations

import sys
from pathlib import Path

from rdepc.api import UsageError
from rdepc.commands.common import load_spec


def cmd_plan(args) -> int:
    import json

    from rdepc.passes.plan import plan
    from rdepc.passes.plan_records import PlanOptions, to_json
    from rdepc.passes.probs import parse_probs
    from rdepc.report import render

    spec = load_spec(args)
    probs = None
    if args.probs is not None:
        try:
            text = Path(args.probs).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--probs {args.probs}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        probs = parse_probs(text, args.probs, int(spec.shape.E))
    routing, alpha = args.routing or (None, 0.0)
    gemm = None if args.gemm in (None, "auto") else args.gemm
    options = PlanOptions(args.hw, args.overflow, routing, alpha, args.seed, probs, gemm=gemm)
    result = plan(spec, options)
    if args.json:
        print(json.dumps(to_json(result, formulas=args.symbolic), indent=2))
    else:
        sys.stdout.write(render(result, symbolic=args.symbolic))
    return 0
