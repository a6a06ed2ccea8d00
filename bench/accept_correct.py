"""The acceptance's ``correct`` stage (bench/acceptance.py): every example on one device,
all W ranks emulated there (``emulated`` backend), in the examples' own dtypes.

On a GPU the examples run at T' = ``GPU_TOKENS`` per rank; in a dry run (CPU, Triton
interpreter) narrowed through their own parameters, as ``tests/test_examples.py`` runs them.
"""

from __future__ import annotations

import time

SCHEDULES = ("bulk", "pipelined", "deep")
MODES = ("unified", "role-split")
GRAD_NAMES = ("x", "topk_weights", "w_gate", "w_up", "w_down")
ROUTING = "zipf:1.0"  # skewed: owners' loads differ, capacity policies drop

# In the order they run: what a short budget must not leave out comes first. A dry run takes
# tiny and moonlight (every interpreted call costs seconds; the code path is the same).
EXAMPLES = ("tiny", "moonlight", "qwen3_30b_a3b", "deepseek_v3", "mixtral_8x7b", "nvl72_e128")
DRY_EXAMPLES = ("tiny", "moonlight")
GPU_TOKENS = {"nvl72_e128": 64}  # T' per rank on a GPU (default 256): 72 emulated ranks on one device
# Dry run: the examples' parameters narrowed to two ranks and a few tokens.
DRY = {
    "tiny": {"W": 2, "T": 8},
    "moonlight": {"W": 2, "T": 4, "H": 64, "F": 64},
    "qwen3_30b_a3b": {"W": 2, "T": 4, "H": 64, "F": 64},
    "deepseek_v3": {"W": 2, "T": 4, "E": 16, "H": 128, "F": 64},
    "mixtral_8x7b": {"W": 2, "T": 4, "H": 64, "F": 64},
    "nvl72_e128": {"W": 2, "T": 2, "H": 64, "F": 64},
}
# Dry run: the full strategy × mode matrix for tiny; the others in their own schedule and
# bulk, unified (the interpreter runs role-split's programs as threads: slow).
DRY_FULL = ("tiny",)


def run(stage, device: str) -> None:
    dry = stage.dry_run
    examples = DRY_EXAMPLES if dry else EXAMPLES
    for name in examples:
        stage.run(f"forward/{name}", forward, name, device, dry)
    for name in ("tiny",) if dry else examples:
        stage.run(f"backward/{name}", backward, name, device, dry)
    stage.run("fp8/deepseek_v3", fp8, device, dry)
    stage.run("dedup/deepseek_v3", dedup, device, dry)
    for name in ("tiny",) if dry else ("qwen3_30b_a3b", "tiny"):
        stage.run(f"cuda_graph/{name}", cuda_graph, name, device, dry)
    for name in ("tiny",) if dry else ("tiny", "moonlight"):
        stage.run(f"withheld/{name}", withheld, name, device, dry)


# ----------------------------------------------------------------------------- helpers
def load(name: str, dry: bool, text_edit=None, tokens: int | None = None):
    """The example as a Layer: narrowed (dry run) or at the GPU's T' (``tokens``: another T')."""
    from bench.acceptance import ROOT
    from rdepc.api import Layer, elaborate_layer
    from rdepc.parser import parse_text

    path = ROOT / "examples" / f"{name}.rdep"
    text = path.read_text(encoding="utf-8")
    if text_edit is not None:
        text = text_edit(text)
    overrides = dict(DRY[name]) if dry else {"T": tokens or GPU_TOKENS.get(name, 256)}
    spec, warnings = elaborate_layer(parse_text(text, str(path.relative_to(ROOT))), None, overrides)
    return Layer(spec, warnings)


def inputs_for(layer, device: str, seed: int = 0):
    from rdepc.runtime.module import TORCH_DTYPES

    from rdepc.reference import random_inputs

    sh, spec = layer.shapes, layer.spec
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    dtype = TORCH_DTYPES[spec.precision.dtype.value]
    return random_inputs(
        W, T, H, F, E, K, routing=ROUTING, seed=seed, dtype=dtype, gated=spec.expert.gated, device=device
    )


def fp32(inputs):
    return [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs]


def tolerance(layer) -> float:
    from rdepc.cli import TOLERANCE

    return TOLERANCE[layer.spec.precision.dtype.value]


def matrix(name: str, layer, dry: bool) -> list[tuple[str, str]]:
    """(schedule, mode) pairs a forward check runs: all of them, except in a dry run."""
    if not dry or name in DRY_FULL:
        return [(s, m) for s in SCHEDULES for m in MODES]
    own = layer.compile().kernel.strategy
    return [(own, "unified"), ("bulk" if own != "bulk" else "deep", "unified")]


def settled(module, fn):
    """fn(), then the module's recorded errors (a native call raises them at synchronize)."""
    out = fn()
    module.synchronize()
    return out


def same_accepted(a, b) -> bool:
    import torch

    return bool(torch.equal(a.cpu().bool(), b.cpu().bool()))


def grads_in(fn, inputs, dy, dtype) -> dict:
    """{name: fp32 gradient} of sum(y · dy) through ``fn`` (a module or the reference), x
    and the weights in ``dtype``, the gates in fp32 (tests/conftest.py's recipe)."""
    x, ids, g, wg, wu, wd = inputs
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in (x, wg, wu, wd)]
    gates = g.detach().float().requires_grad_(True)
    y = fn(leaves[0], ids, gates, *leaves[1:])
    y = y[0] if isinstance(y, tuple) else y
    (y.float() * dy).sum().backward()
    named = zip(GRAD_NAMES, (leaves[0], gates, *leaves[1:]), strict=True)
    return {n: t.grad.float() for n, t in named if t is not None}


# ----------------------------------------------------------------------------- the checks
def forward(check, name: str, device: str, dry: bool) -> None:
    """Against the reference (accepted set identical), then bitwise across strategies and modes."""
    import torch
    from rdepc.runtime.module import max_relative_error

    from rdepc.reference import reference_for

    layer = load(name, dry)
    inputs = inputs_for(layer, device)
    ref, accepted_ref = reference_for(layer.spec)(*fp32(inputs))
    tol = tolerance(layer)
    sh = layer.shapes
    check.figure("shape", " ".join(f"{k}={sh[k]}" for k in ("W", "T", "H", "F", "E", "K")))
    check.figure("dtype", layer.spec.precision.dtype.value)
    check.figure("tolerance", tol)
    first = None
    runs = {}
    for schedule, mode in matrix(name, layer, dry):
        key = f"{schedule} {mode}"
        m = layer.module("emulated", device, schedule=schedule, mode=mode)
        t0 = time.perf_counter()
        y = settled(m, lambda m=m: m(*inputs))
        seconds = time.perf_counter() - t0
        st = m.last_stats
        run = {"seconds_first_call": round(seconds, 3), "accepted": int(st["accepted"].sum())}
        run["dropped"] = int(st["dropped_rows"])
        run["max_rel_err"] = max_relative_error(y.float(), ref)
        run["accepted_same"] = same_accepted(st["accepted"], accepted_ref)
        check.expect(run["max_rel_err"] <= tol, f"{key}: max relative error {run['max_rel_err']:.3g} > {tol:g}")
        check.expect(run["accepted_same"], f"{key}: the accepted set differs from the reference's")
        if first is None:
            first = (key, y)
        else:
            run["bitwise_as_first"] = bool(torch.equal(y, first[1]))
            check.expect(run["bitwise_as_first"], f"{key}: not bitwise equal to {first[0]}")
        runs[key] = run
        check.figure("runs", runs)
    check.figure("max_rel_err", max(r["max_rel_err"] for r in runs.values()))
    check.figure("bitwise", all(r.get("bitwise_as_first", True) for r in runs.values()))


def backward(check, name: str, device: str, dry: bool, text_edit=None) -> None:
    """Gradients of x, the gates and the weights against autograd through the reference (fp32),
    and bitwise across strategies."""
    import torch
    from rdepc.runtime.module import TORCH_DTYPES, max_relative_error

    from rdepc.reference import reference_for

    layer = load(name, dry, text_edit)
    inputs = inputs_for(layer, device)
    tol = 3 * tolerance(layer)  # gradients: more rounded steps than the forward
    dtype = TORCH_DTYPES[layer.spec.precision.dtype.value]
    y_shape = inputs[0].shape
    dy = torch.randn(y_shape, generator=torch.Generator().manual_seed(7)).to(dtype).float().to(device)
    want = grads_in(reference_for(layer.spec), fp32(inputs), dy, torch.float32)
    check.figure("tolerance", tol)
    schedules = SCHEDULES if not dry or name in DRY_FULL else (layer.compile().kernel.strategy,)
    first = None
    errs = {}
    for schedule in schedules:
        m = layer.module("emulated", device, schedule=schedule)
        got = settled(m, lambda m=m: grads_in(m, inputs, dy, dtype))
        errs[schedule] = {n: max_relative_error(got[n], want[n]) for n in got}
        for n, e in errs[schedule].items():
            check.expect(e <= tol, f"{schedule}: d{n} max relative error {e:.3g} > {tol:g}")
        if first is None:
            first = (schedule, got)
        else:
            same = all(torch.equal(got[n], first[1][n]) for n in got)
            check.expect(same, f"{schedule}: gradients not bitwise equal to {first[0]}'s")
        check.figure("max_rel_err", errs)
    check.figure("worst", max(e for per in errs.values() for e in per.values()))


def fp8(check, device: str, dry: bool) -> None:
    """deepseek_v3's fp8 e4m3 dispatch: against the reference that sees the quantised rows,
    the error from the unquantised operator, and the backward."""
    from rdepc.runtime.module import max_relative_error

    from rdepc.reference import reference_for

    layer = load("deepseek_v3", dry)
    check.expect(layer.spec.precision.dispatch_scale is not None, "deepseek_v3 no longer dispatches fp8")
    inputs = inputs_for(layer, device)
    m = layer.module("emulated", device)
    y = settled(m, lambda: m(*inputs))
    quantised, _ = reference_for(layer.spec)(*fp32(inputs))
    exact, _ = reference_for(layer.spec, dispatch_rounding=False)(*fp32(inputs))
    err = check.figure("max_rel_err", max_relative_error(y.float(), quantised))
    check.figure("from_unquantised", max_relative_error(y.float(), exact))
    check.expect(err <= tolerance(layer), f"max relative error {err:.3g} against the quantised reference")
    check.figure("scales_per_row", layer.spec.route_row.scales)


def _dedup(text: str) -> str:
    old = "transport nvshmem"
    if old not in text:
        raise ValueError(f"examples/deepseek_v3.rdep no longer says '{old}': update the dedup check")
    return text.replace(old, "transport nvshmem, dedup")


def dedup(check, device: str, dry: bool) -> None:
    """deepseek_v3 under dedup: one payload row per (token, owner); forward and backward."""
    import torch
    from rdepc.runtime.module import max_relative_error

    from rdepc.reference import owner_pairs, reference_for

    layer = load("deepseek_v3", dry, _dedup)
    inputs = inputs_for(layer, device)
    ref, accepted_ref = reference_for(layer.spec)(*fp32(inputs))
    ys = {}
    for schedule in ("bulk", "deep"):
        m = layer.module("emulated", device, schedule=schedule)
        ys[schedule] = settled(m, lambda m=m: m(*inputs))
        st = m.last_stats
        accepted = int(st["accepted"].sum())
        pairs = owner_pairs(inputs.topk_ids, st["accepted"], layer.spec.ownership.owner)
        sent, back = int(st["dispatched_rows"].sum()), int(st["returned_rows"].sum())
        check.figure(f"{schedule}: rows", {"accepted": accepted, "pairs": pairs, "sent": sent, "back": back})
        check.expect(sent == back == pairs, f"{schedule}: {sent} rows out and {back} back, not {pairs}")
        check.expect(same_accepted(st["accepted"], accepted_ref), f"{schedule}: accepted set differs")
        err = check.figure(f"{schedule}: max_rel_err", max_relative_error(ys[schedule].float(), ref))
        check.expect(err <= tolerance(layer), f"{schedule}: max relative error {err:.3g}")
    check.expect(torch.equal(ys["bulk"], ys["deep"]), "bulk and deep differ")
    sub = type(check)("backward")
    backward(sub, "deepseek_v3", device, dry, _dedup)
    check.figure("backward", sub.figures)
    check.failures += [f"backward: {f}" for f in sub.failures]


def cuda_graph(check, name: str, device: str, dry: bool) -> None:
    """A call captured in a CUDA graph, replayed with new inputs copied into its input
    buffers: bitwise the eager calls. On the CPU (dry run) nothing is captured: the same
    static-buffer calls run eagerly."""
    import torch

    layer = load(name, dry)
    captured = check.figure("captured", device == "cuda")
    for schedule in ("bulk",) if dry else ("bulk", "pipelined"):
        m = layer.module("emulated", device, schedule=schedule)
        make = [inputs_for(layer, device, seed=s) for s in (0, 1, 2)]
        eager = [m(*inp) for inp in make]
        m.synchronize()
        static = [None if t is None else t.clone() for t in make[0]]
        graph = out = None
        if captured:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                m(*static)  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = m(*static)
        same = []
        for inp, y in zip(make, eager, strict=True):
            for dst, src in zip(static, inp, strict=True):
                if dst is not None:
                    dst.copy_(src)
            if graph is not None:
                graph.replay()
            else:
                out = m(*static)
            m.synchronize()
            same.append(bool(torch.equal(out, y)))
        check.figure(f"{schedule}: replays bitwise", same)
        check.expect(all(same), f"{schedule}: a replay differs from its eager call")


def withheld(check, name: str, device: str, dry: bool) -> None:
    """A task withheld (its producer lost): the call fails with a KernelError within the
    wait's bound, naming the task; the next call is bitwise a clean one."""
    import torch
    from rdepc.runtime.module import KernelError
    from rdepc.runtime.per_rank import waited_on

    layer = load(name, dry)
    inputs = inputs_for(layer, device)
    m = layer.module("emulated", device)
    clean = settled(m, lambda: m(*inputs))
    plan = m.plan
    # an entry of rank 1 that rank 0 waits for: a dependent's wait must expire
    entry = check.figure("withheld_entry", waited_on(plan, 1)[0])
    check.figure("withheld_task", plan.names[entry])
    check.figure("spin_bound", m.spin_bound)
    m.withhold(entry)
    t0 = time.perf_counter()
    error = None
    try:
        settled(m, lambda: m(*inputs))
    except KernelError as e:
        error = e
    check.figure("seconds_to_error", round(time.perf_counter() - t0, 3))
    check.expect(error is not None, "the call with a withheld task did not fail")
    if error is not None:
        check.figure("error", str(error).splitlines()[0][:300])
    again = settled(m, lambda: m(*inputs))
    check.figure("recovered_bitwise", bool(torch.equal(again, clean)))
    check.expect(torch.equal(again, clean), "the call after the failure is not bitwise a clean call")
