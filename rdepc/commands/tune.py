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
    from rdepc.runtime.tune import candidates, tune_layer

    print(f"tuning layer {spec.name} ({spec.file}) on {torch.cuda.get_device_name()}:")
    tried = candidates(layer.compile(schedule=args.schedule, interpret=False).kernel)
    warm = prewarm_candidates(layer, tried, args.device, schedule=args.schedule, mode=args.mode,
                              tokens=args.tokens, timeout=args.budget)  # fmt: skip
    print(f"  {len(tried)} candidates: {warm['compiled']} builds compiled in {warm['seconds']} s "
          f"({warm['processes']} processes), {warm['cached']} cached, {warm['failed']} failed")  # fmt: skip
    best, results, path = tune_layer(
        layer, args.device, schedule=args.schedule, mode=args.mode, tokens=args.tokens, reps=args.reps,
        tried=tried, progress=lambda line: print(line, flush=True), budget=args.budget,
    )  # fmt: skip
    ms = min(r["ms"] for r in results if "ms" in r)
    print(f"fastest: {best} at {ms:.3f} ms; recorded in {path}")
    return 0


def prewarm_candidates(
    layer, tried, device: str, *, schedule=None, mode=None, tokens=None, timeout=None, processes=None
) -> dict:
    """Every candidate's native builds compiled into Triton's cache before any is timed, in
    ``processes`` parallel processes (default one per core; ``rdepc.codegen.prewarm``): in
    the timing loop each candidate's compile would take one core 5-10 s. A candidate whose
    launch the module refuses is left to the timing, which records why. The prewarm's
    summary (``prewarm_summary``) with ``seconds`` and ``processes``."""
    import os
    import time

    import torch

    from rdepc.codegen import prewarm as warm
    from rdepc.ir.contract import default_mode

    compiled = layer.compile(schedule=schedule, interpret=False)
    sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    requests = []
    for t in tried:
        try:
            requests += warm.launch_requests(
                compiled.kernels_path, compiled.directory / "contract.json", mode=mode or default_mode(True),
                tiles=t, sms=sms, tokens=tokens, label=f"{layer.spec.name} {t}",
            )  # fmt: skip
        except ValueError:
            continue
    processes = processes or max(1, os.cpu_count() or 1)
    t0 = time.monotonic()
    results = warm.prewarm(requests, processes, timeout=timeout)
    return warm.prewarm_summary(results) | {"seconds": round(time.monotonic() - t0, 1), "processes": processes}
