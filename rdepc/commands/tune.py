"""``rdepc tune``: time every candidate tile size of a layer on a GPU and record the fastest
(``rdepc.runtime.tune``)."""

from __future__ import annotations

from rdepc.api import UsageError
from rdepc.commands.common import overrides, print_diags


def cmd_tune(args) -> int:
    from rdepc.api import Layer, elaborate_layer
    from rdepc.parser import parse_file

    module = parse_file(args.file)
    spec, warnings = elaborate_layer(module, args.layer, overrides(args))
    print_diags(warnings, {})
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
