"""The acceptance's ``correct`` stage (bench/acceptance.py): every example on one device,
all W ranks emulated there (``emulated`` backend), in the examples' own dtypes.

On a GPU the examples run at T' = ``GPU_TOKENS`` per rank; in a dry run (CPU, Triton
interpreter) narrowed through their own parameters, as ``tests/test_examples.py`` runs them.
"""

from __future__ import annotations

import time

SCHEDULES = ("bulk", "pipelined", "deep")
MODES = ("unified", "split")
# phased mode runs a schedule whose GEMMs wait for no return (rdepc.ir.contract.phase_queues): bulk
PHASED = (("bulk", "phased"),)
# the library GEMM lowering's own checks on a GPU: bf16 at two shapes, fp8 rows with scales
LIBRARY_EXAMPLES = ("moonlight", "qwen3_30b_a3b", "deepseek_v3")
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
# bulk, unified (the interpreter runs split mode's programs as threads: slow).
DRY_FULL = ("tiny",)
# The share of the free memory a check plans to fill: the caching allocator's rounding and
# the transients its estimate leaves out take the rest.
FIT = 0.85
NARROWED = ("E", "F")  # what a backward check too large for the free memory halves, in this order


def run(stage, device: str) -> None:
    from bench.acceptance import run_planned

    run_planned(stage, plan(stage.dry_run, device), device)


def plan(dry: bool, device: str | None = None) -> list:
    """The stage's checks in order, each with the variants it launches (the prewarm's list).
    The backward checks are sized to the memory ``device`` has free now (:func:`fit_backward`)."""
    from bench.acceptance import Planned

    examples = DRY_EXAMPLES if dry else EXAMPLES
    room = free_bytes(device or ("cpu" if dry else "cuda"))
    out = []
    for name in examples:
        runs = tuple(variant(name, dry, s, m) for s, m in matrix(name, dry))
        out.append(Planned(f"forward/{name}", forward, (runs,), runs))
    for name in ("tiny",) if dry else examples:
        fit = fit_backward(name, dry, None, room)
        runs = trained(name, dry, fit=fit)
        out.append(Planned(f"backward/{name}", backward, (runs, fit), runs))
    runs = (variant("deepseek_v3", dry),)  # its own schedule
    out.append(Planned("fp8/deepseek_v3", fp8, (runs,), runs))
    runs = tuple(variant("deepseek_v3", dry, s, edit="dedup") for s in ("bulk", "deep"))
    fit = fit_backward("deepseek_v3", dry, "dedup", room)
    grads = trained("deepseek_v3", dry, "dedup", fit)
    out.append(Planned("dedup/deepseek_v3", dedup, (runs, grads, fit), runs + grads))
    for name in ("tiny",) if dry else LIBRARY_EXAMPLES:  # the library GEMM lowering: bulk, phased
        runs = (variant(name, dry, "bulk", gemm="library"),)
        out.append(Planned(f"library/{name}", forward, (runs,), runs))
        fit = fit_backward(name, dry, None, room)
        runs = (variant(name, dry, "bulk", pass_="train", narrow=fit["narrowed"] if fit else None, gemm="library"),)
        out.append(Planned(f"library_backward/{name}", backward, (runs, fit), runs))
    for name in ("tiny",) if dry else ("qwen3_30b_a3b", "tiny"):
        pairs = (("bulk", None),) if dry else (("bulk", "split"), ("pipelined", "split"), ("bulk", "unified"))
        pairs += () if dry else PHASED
        runs = (*(variant(name, dry, s, m) for s, m in pairs), variant(name, dry, "bulk", gemm="library"))
        out.append(Planned(f"cuda_graph/{name}", cuda_graph, (runs,), runs))
    for name in ("tiny",) if dry else ("tiny", "moonlight"):
        runs = (variant(name, dry),) if dry else (variant(name, dry), variant(name, dry, mode="unified"))
        out.append(Planned(f"withheld/{name}", withheld, (runs,), runs))
    return out


# ----------------------------------------------------------------------------- helpers
def overrides(name: str, dry: bool, tokens: int | None = None) -> dict:
    """The example's parameters as the stage runs it: narrowed (dry run) or at the GPU's T'
    (``tokens``: another T')."""
    return dict(DRY[name]) if dry else {"T": tokens or GPU_TOKENS.get(name, 256)}


def variant(
    name: str, dry: bool, schedule=None, mode=None, pass_="forward", edit=None, tokens=None, narrow=None, gemm="triton"
):
    """A launch of example ``name`` on the one-process backend (``acceptance.Variant``);
    ``narrow``: parameters replaced on top of the stage's (a check sized to the free memory);
    ``mode`` None: the default kernel mode (``default_mode``: split on a GPU; phased for the
    library GEMM lowering, ``gemm``)."""
    from bench.acceptance import Variant
    from rdepc.ir.contract import default_mode

    ov = tuple((overrides(name, dry, tokens) | (narrow or {})).items())
    mode = mode or ("phased" if gemm == "library" else default_mode(not dry))
    return Variant(f"examples/{name}.rdep", ov, schedule, mode, pass_, "emulated", edit, gemm)


def load(name: str, dry: bool, edit: str | None = None, tokens: int | None = None):
    """The example as a Layer: narrowed (dry run) or at the GPU's T' (``tokens``: another T');
    ``edit``: a text edit of it (``acceptance.EDITS``)."""
    return variant(name, dry, edit=edit, tokens=tokens).layer()


def own(name: str, dry: bool, edit: str | None = None, tokens: int | None = None) -> str:
    """The example's own schedule, as its generated kernel names it."""
    return load(name, dry, edit, tokens).compile(interpret=dry).kernel.strategy


def trained(name: str, dry: bool, edit: str | None = None, fit: dict | None = None) -> tuple:
    """What a backward check runs: a call under autograd and its backward, in every schedule
    and kernel mode (a dry run: the example's own schedule, except in DRY_FULL, unified: the
    interpreter runs split mode's programs as threads, slowly); ``fit``: narrowed as
    :func:`fit_backward` found it fits."""
    schedules = SCHEDULES if not dry or name in DRY_FULL else (own(name, dry, edit),)
    modes = ("unified",) if dry else MODES
    narrow = fit["narrowed"] if fit else None
    pairs = [(s, m) for s in schedules for m in modes] + ([] if dry else list(PHASED))
    return tuple(variant(name, dry, s, m, "train", edit, narrow=narrow) for s, m in pairs)


# ----------------------------------------------------------------------------- memory
def free_bytes(device: str) -> int | None:
    """Bytes a new allocation on ``device`` may take (the runtime's own measure: a GPU's free
    memory, the host's available memory); None where it cannot be known."""
    from rdepc.runtime.memory import free_memory

    free = free_memory(device)
    return None if free is None else free[0]


def train_rows_bytes(contract) -> int:
    """The rows a call under autograd and its backward allocate beside the module's own
    buffers: the owner-row buffers (the runtime's ``owner_row_buffers``), [owners, R_MAX,
    columns] in the layer's dtype each, and without dedup saved_out per (token, slot)."""
    from rdepc.runtime.heap import owner_row_buffers
    from rdepc.runtime.tensors import TORCH_DTYPES

    p = contract
    columns = sum(owner_row_buffers(p, backward=False).values()) + sum(owner_row_buffers(p, backward=True).values())
    owners = 1 if p.per_rank else p.W  # owner_row_block: one block per owner this process runs
    saved_out = 0 if p.dedup else owners * p.T * p.K * p.H
    return (owners * p.R_MAX * columns + saved_out) * TORCH_DTYPES[p.dtype].itemsize


def backward_bytes(layer, dry: bool) -> int:
    """Bytes the backward check holds at its peak, estimated. Per weight element: the inputs
    in the layer's dtype (d bytes), then the larger of the reference's phase (its fp32 copy
    and that copy's gradient: 8) and the strategies' (the reference's gradients, the first
    strategy's kept for the bitwise comparison and the one being made, in fp32: 12; that one
    in the dtype and the module's weight-shaped buffers, its [Wg Wu] copy and gradient
    buffers: 3d). Per routed row the reference's fp32 activations (x, out and the slot's
    [W, T', H] sums: 5H; gate, up, act: 3F) and their gradients; the module's saved rows."""
    from rdepc.runtime.tensors import TORCH_DTYPES

    sh, spec = layer.shapes, layer.spec
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    gated = spec.expert.gated
    d = TORCH_DTYPES[spec.precision.dtype.value].itemsize
    weights = (3 if gated else 2) * E * H * F
    rows = W * T * K * (5 * H + (3 if gated else 2) * F) * 4 * 2
    reference = 8 * weights + rows
    strategies = (12 + 3 * d) * weights + train_rows_bytes(layer.compile(interpret=dry).kernel)
    return d * weights + max(reference, strategies)


def fit_backward(name: str, dry: bool, edit: str | None, room: int | None) -> dict:
    """The parameters a backward check of ``name`` runs at to fit ``room`` free bytes (None:
    unknown, the example as the stage runs it): its E halved, as ``-D E=..`` narrows it, and
    where E is no parameter or the example takes no smaller one its F, until
    :func:`backward_bytes` fits FIT × room (where none does, the narrowest the example
    takes). E first: the experts' GEMMs keep their shapes. Returns ``narrowed`` (the
    parameters replaced: none when it fits as it is), the free bytes, the estimate at each
    (E, F) tried and why, in words."""
    from rdepc.runtime.memory import human

    from rdepc.diagnostics import SpecError

    def shape(n: dict) -> str:
        return " ".join(f"{k}={n.get(k, full[k])}" for k in NARROWED)

    def estimate(n: dict) -> int | None:
        try:
            need[shape(n)] = backward_bytes(variant(name, dry, edit=edit, narrow=n or None).layer(), dry)
        except (SpecError, ValueError):  # not a parameter, or a value the example refuses
            return None
        return need[shape(n)]

    full = variant(name, dry, edit=edit).layer().shapes
    need: dict[str, int] = {}
    narrowed: dict[str, int] = {}
    bytes_ = estimate(narrowed)
    for k in NARROWED:
        while room is not None and bytes_ > FIT * room and narrowed.get(k, full[k]) >= 2:
            trial = narrowed | {k: narrowed.get(k, full[k]) // 2}
            got = estimate(trial)
            if got is None:
                break
            narrowed, bytes_ = trial, got
    fits = room is None or bytes_ <= FIT * room
    at = shape({})
    if room is None:
        why = f"the free memory is unknown: run at {at}, estimated {human(need[at])}"
    else:
        why = f"at {at} the check needs about {human(need[at])} (estimated); {FIT:.0%} of the {human(room)} free is "
        why += human(FIT * room)
        if narrowed:
            why += f": run at {shape(narrowed)} ({human(bytes_)})"
        if not fits:
            why += ", the narrowest the example takes, though it does not fit either"
    return {"narrowed": narrowed, "fits": fits, "free_bytes": room, "need_bytes": need, "why": why}


def inputs_for(layer, device: str, seed: int = 0):
    from rdepc.runtime.tensors import TORCH_DTYPES

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
    from rdepc.commands.run import TOLERANCE

    return TOLERANCE[layer.spec.precision.dtype.value]


def matrix(name: str, dry: bool) -> list[tuple[str, str]]:
    """(schedule, mode) pairs a forward check runs: every schedule in unified and split mode
    and bulk in phased mode, except in a dry run."""
    if not dry or name in DRY_FULL:
        return [(s, m) for s in SCHEDULES for m in MODES] + list(PHASED)
    mine = own(name, dry)
    return [(mine, "unified"), ("bulk" if mine != "bulk" else "deep", "unified")]


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
def forward(check, variants, device: str, dry: bool) -> None:
    """Against the reference (accepted set identical), then bitwise across strategies and modes."""
    import torch
    from rdepc.runtime.tensors import max_relative_error

    from rdepc.reference import reference_for

    layer = variants[0].layer()
    inputs = inputs_for(layer, device)
    ref, accepted_ref = reference_for(layer.spec)(*fp32(inputs))
    tol = tolerance(layer)
    sh = layer.shapes
    check.figure("shape", " ".join(f"{k}={sh[k]}" for k in ("W", "T", "H", "F", "E", "K")))
    check.figure("dtype", layer.spec.precision.dtype.value)
    check.figure("tolerance", tol)
    first = None
    runs = {}
    for v in variants:
        key = f"{v.schedule} {v.mode}" + (" library" if v.gemm == "library" else "")
        try:
            m = v.module(device)
        except ValueError as e:  # a split this GPU cannot hold at once: refused, not run (recorded)
            if "runs every program at once" not in str(e):
                raise
            runs[key] = {"refused": str(e)}
            check.figure("runs", runs)
            continue
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
    ran = [r for r in runs.values() if "refused" not in r]
    check.expect(bool(ran), "the GPU refused every configuration")
    check.figure("max_rel_err", max((r["max_rel_err"] for r in ran), default=None))
    check.figure("bitwise", all(r.get("bitwise_as_first", True) for r in ran))
    check.figure("refused", sorted(k for k, r in runs.items() if "refused" in r))


def backward(check, variants, fit: dict | None, device: str, dry: bool) -> None:
    """Gradients of x, the gates and the weights against autograd through the reference (fp32),
    and bitwise across strategies; ``fit``: how the example was narrowed to fit the free
    memory (:func:`fit_backward`), recorded with the overrides it ran at."""
    import torch
    from rdepc.runtime.tensors import TORCH_DTYPES, max_relative_error

    from rdepc.reference import reference_for

    layer = variants[0].layer()
    sh = layer.shapes
    check.figure("shape", " ".join(f"{k}={sh[k]}" for k in ("W", "T", "H", "F", "E", "K")))
    check.figure("overrides", dict(variants[0].overrides))  # as `-D NAME=VALUE`: exactly what ran
    if fit is not None:
        narrowed = ", ".join(f"{k}={v}" for k, v in fit["narrowed"].items())
        check.figure("narrowed", f"{narrowed or 'no'}: {fit['why']}")
        check.figure("memory", {k: fit[k] for k in ("fits", "free_bytes", "need_bytes")})
    inputs = inputs_for(layer, device)
    tol = 3 * tolerance(layer)  # gradients: more rounded steps than the forward
    dtype = TORCH_DTYPES[layer.spec.precision.dtype.value]
    y_shape = inputs[0].shape
    dy = torch.randn(y_shape, generator=torch.Generator().manual_seed(7)).to(dtype).float().to(device)
    want = grads_in(reference_for(layer.spec), fp32(inputs), dy, torch.float32)
    check.figure("tolerance", tol)
    first = None
    errs = {}
    for v in variants:
        schedule = f"{v.schedule} {v.mode}" + (" library" if v.gemm == "library" else "")
        m = v.module(device)
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
        del got  # before the next strategy's: the first's (kept) and the one being made at most
    check.figure("worst", max(e for per in errs.values() for e in per.values()))


def fp8(check, variants, device: str, dry: bool) -> None:
    """deepseek_v3's fp8 e4m3 dispatch: against the reference that sees the quantised rows,
    the error from the unquantised operator, and the backward."""
    from rdepc.runtime.tensors import max_relative_error

    from rdepc.reference import reference_for

    (v,) = variants
    layer = v.layer()
    check.expect(layer.spec.precision.dispatch_scale is not None, "deepseek_v3 no longer dispatches fp8")
    inputs = inputs_for(layer, device)
    m = v.module(device)
    y = settled(m, lambda: m(*inputs))
    quantised, _ = reference_for(layer.spec)(*fp32(inputs))
    exact, _ = reference_for(layer.spec, dispatch_rounding=False)(*fp32(inputs))
    err = check.figure("max_rel_err", max_relative_error(y.float(), quantised))
    check.figure("from_unquantised", max_relative_error(y.float(), exact))
    check.expect(err <= tolerance(layer), f"max relative error {err:.3g} against the quantised reference")
    check.figure("scales_per_row", layer.spec.route_row.scales)


def dedup(check, variants, grads, fit: dict | None, device: str, dry: bool) -> None:
    """deepseek_v3 under dedup (``variants``: its calls; ``grads``: the backward check's,
    narrowed as ``fit`` says): one payload row per (token, owner); forward and backward."""
    import torch
    from rdepc.runtime.tensors import max_relative_error

    from rdepc.reference import owner_pairs, reference_for

    layer = variants[0].layer()
    inputs = inputs_for(layer, device)
    ref, accepted_ref = reference_for(layer.spec)(*fp32(inputs))
    ys = {}
    for v in variants:
        schedule = v.schedule
        m = v.module(device)
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
    (a, ya), (b, yb) = list(ys.items())[:2]
    check.expect(torch.equal(ya, yb), f"{a} and {b} differ")
    sub = type(check)("backward")
    backward(sub, grads, fit, device, dry)
    check.figure("backward", sub.figures)
    check.failures += [f"backward: {f}" for f in sub.failures]


def cuda_graph(check, variants, device: str, dry: bool) -> None:
    """A call captured in a CUDA graph, replayed with new inputs copied into its input
    buffers: bitwise the eager calls. On the CPU (dry run) nothing is captured: the same
    static-buffer calls run eagerly."""
    import torch

    layer = variants[0].layer()
    captured = check.figure("captured", device == "cuda")
    for v in variants:
        schedule = f"{v.schedule} {v.mode}" + (" library" if v.gemm == "library" else "")
        m = v.module(device)
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


def withheld(check, variants, device: str, dry: bool) -> None:
    """A task withheld (its producer lost): the call fails with a KernelError within the
    wait's bound, naming the task; the next call is bitwise a clean one."""
    import torch
    from rdepc.runtime.module import KernelError

    from rdepc.per_rank import waited_on

    layer = variants[0].layer()
    inputs = inputs_for(layer, device)
    for i, v in enumerate(variants):  # the default mode's figures by their names, another mode's after it

        def fig(name: str, value, mode=v.mode, first=i == 0):
            return check.figure(name if first else f"{mode}: {name}", value)

        m = v.module(device)
        clean = settled(m, lambda m=m: m(*inputs))
        plan = m.contract
        # an entry of rank 1 that rank 0 waits for: a dependent's wait must expire
        entry = fig("withheld_entry", waited_on(plan, 1)[0])
        fig("withheld_task", plan.names[entry])
        fig("spin_bound", m.spin_bound)
        m.withhold(entry)
        t0 = time.perf_counter()
        error = None
        try:
            settled(m, lambda m=m: m(*inputs))
        except KernelError as e:
            error = e
        fig("seconds_to_error", round(time.perf_counter() - t0, 3))
        check.expect(error is not None, f"{v.mode}: the call with a withheld task did not fail")
        if error is not None:
            fig("error", str(error).splitlines()[0][:300])
        again = settled(m, lambda m=m: m(*inputs))
        fig("recovered_bitwise", bool(torch.equal(again, clean)))
        check.expect(torch.equal(again, clean), f"{v.mode}: the call after the failure is not bitwise a clean call")
