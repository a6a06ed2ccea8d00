"""The acceptance's ``perf`` and ``tune`` stages (bench/acceptance.py).

``perf``: per case, rdepc in each strategy and kernel mode tried (its best kept) against
sort + ``torch._grouped_mm``, ``torch._grouped_mm`` alone on pre-sorted rows and the dense
roof on as many rows (bench/moe_bench.py's timing and baselines), forward and
forward+backward; the per-stage spans of one profiled call of each candidate (the best's
``stages``, the others' ``stages_others``) and of the best's backward (``backward_stages``),
and how each launch of those calls spent its time (``kernels``, ``kernels_others``,
``backward_kernels``: per task kind its items and their time; for the GEMM kernel, per
program the time its items ran against the time it waited — runtime.profile.kernel_summary);
the host's share of a call (event time minus the kernel's span), the time a call takes to
return and where it goes (``host_profile``). The issue's
speed targets are recorded beside the figures (``targets``); a check fails on wrong
results, never on speed (speed is read from the figures, not asserted under a time limit).

rdepc takes GEMM1's operand as its MoE module keeps it (gate and up interleaved, one tensor,
``rdepc.moe.MoE.w_gate_up``) through ``RDEPModule.routed``, made once before the timing; the
baselines take their separate weights. (Through ``module(x, ids, gates, w_gate, w_up,
w_down)`` with separate weights a call interleaves them first: for moonlight's 64 experts
1.5 GB of copying a call.)

``tune``: ``rdepc tune`` (runtime.tune.tune_layer) on moonlight at the perf stage's first
case (T' = 4096, bulk), and the record it writes: a perf stage run after it launches the tiles
it chose.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from bench.accept_correct import DRY, FIT, fp32, free_bytes, load, own, tolerance, train_rows_bytes, variant
from bench.accept_perf_ratios import KEY_SORT, KEY_STRONG, Forward, perf_ratios, perf_targets

# (example, T' per rank, routing, W): the GPU cases, then the dry run's (narrowed) ones. W 1:
# the layer on one GPU as its only rank, no emulation, on as many route rows as the W = 8
# case beside it (8 x 4096 tokens): what a one-GPU user compares.
GPU_CASES = (
    ("moonlight", 4096, "uniform", None),
    ("qwen3_30b_a3b", 4096, "uniform", None),
    ("moonlight", 32768, "uniform", 1),
    ("moonlight", 4096, "zipf:1.2", None),
    ("moonlight", 128, "uniform", None),  # decode-like: few tokens per rank
)
DRY_CASES = (("tiny", 8, "zipf:1.2", None), ("tiny", 16, "uniform", 1))
REPS, WARMUP = 10, 3


def run_perf(stage, device: str) -> None:
    from bench.acceptance import run_planned

    run_planned(stage, plan_perf(stage.dry_run), device)


def plan_perf(dry: bool) -> list:
    """The perf checks, each with what it launches: every candidate (:func:`candidates`) in
    each pass, since which is fastest (profiled, and run forward+backward) is known only then."""
    from bench.acceptance import Planned

    out = []
    for name, tokens, routing, W in DRY_CASES if dry else GPU_CASES:
        at = None if dry and W is None else tokens
        narrow = None if W is None else {"W": W, "T": tokens}
        runs = tuple(
            variant(name, dry, s, m, p, tokens=at, narrow=narrow, gemm=g)
            for s, m, g in candidates(name, at, dry, narrow)
            for p in PASSES
        )  # fmt: skip
        label = f"perf/{name}/T{tokens}/{routing}" + ("" if W is None else f"/W{W}")
        out.append(Planned(label, perf_case, (name, tokens, routing, runs), runs))
    return out


def run_tune(stage, device: str) -> None:
    stage.run("tune/moonlight", tune_case, device, stage.dry_run, stage.deadline, stage.out)


# a candidate's call; the fastest's profiled call, under autograd, and profiled under autograd
PASSES = ("forward", "profile", "train", "profile_train")


def candidates(name: str, tokens: int | None, dry: bool, narrow: dict | None = None) -> list[tuple[str, str, str]]:
    """(schedule, mode, GEMM lowering): bulk in split and phased mode with the Triton GEMM
    kernel and in phased mode with the library's grouped GEMM (the transport, the GEMMs and
    the transport again, each on every SM), the segmented strategies in split mode, bulk in
    unified mode (the one kernel of before the split, timed in the same run). A dry run:
    the layer's own strategy in split mode, another in unified (the interpreter runs split
    mode's programs as threads: slow), bulk in phased mode with either lowering. One rank
    (``narrow`` W 1) has nothing to overlap: bulk only."""
    one_rank = bool(narrow and narrow.get("W") == 1)
    if dry and not one_rank:
        mine = own(name, dry, tokens=tokens)
        other = "bulk" if mine != "bulk" else "pipelined"
        return [(mine, "split", "triton"), (other, "unified", "triton"), ("bulk", "phased", "triton"),
                ("bulk", "phased", "library")]  # fmt: skip
    bulk = [("bulk", "split", "triton"), ("bulk", "phased", "triton"), ("bulk", "phased", "library")]
    if one_rank:
        return bulk
    return [*bulk, ("pipelined", "split", "triton"), ("deep", "split", "triton"), ("bulk", "unified", "triton")]


def method(schedule: str, mode: str, gemm: str) -> str:
    """An rdepc candidate's name in the figures: ``rdepc bulk phased`` (``... library``)."""
    return f"rdepc {schedule} {mode}" + (" library" if gemm == "library" else "")


def _ms(fn, device, reps: int, warmup: int) -> dict:
    import torch

    from bench.moe_bench import timeit

    return timeit(fn, torch.device(device), reps, warmup)


def graph_replay_ms(call, device: str, reps: int, warmup: int) -> dict | None:
    """A call captured in a CUDA graph, its replays timed (min / median / max ms): the call's
    device work without the host's. None on the CPU (nothing is captured)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return _ms(graph.replay, device, reps, warmup)


HOST_TOP = 15  # functions of a call's host profile kept


def host_profile(call, reps: int) -> list[dict]:
    """Where a call's host time goes: ``reps`` calls under cProfile (nothing waits for the
    device), the functions with the most time of their own, per call."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        call()
    prof.disable()
    # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = pstats.Stats(prof).stats.items()
    top = sorted(rows, key=lambda kv: -kv[1][2])[:HOST_TOP]
    return [
        {"function": f"{Path(f).name}:{line}({name})", "calls": n / reps, "own_ms": own * 1e3 / reps,
         "cumulative_ms": cum * 1e3 / reps}
        for (f, line, name), (_, n, own, cum, _) in top
    ]  # fmt: skip


class _Case(NamedTuple):
    """A perf case: its layer, its inputs, rdepc's GEMM1 operand and the reference's output."""

    layer: object
    inputs: tuple  # x, ids, gates, w_gate, w_up, w_down
    operand: object
    ref: object
    tol: float
    rows: int
    useful: int  # a forward's useful flops
    act: str
    dtype: object

    def call(self, module, rows=None):
        """``module``'s call on ``rows`` (x, ids, gates: the case's unless given)."""
        rows, w_up, wd = self.inputs[:3] if rows is None else rows, self.operand, self.inputs[5]
        return lambda: module.routed(*rows, w_up, wd)


def _case(layer, routing: str, device: str) -> _Case:
    """The case's inputs (seed 0) on ``device`` and what rdepc and the checks read beside them."""
    from rdepc.runtime.tensors import TORCH_DTYPES, gemm1_operand

    from rdepc.reference import random_inputs, reference_for

    spec, sh = layer.spec, layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    act, dtype = spec.expert.act, TORCH_DTYPES[spec.precision.dtype.value]
    inputs = random_inputs(
        W, T, H, F, E, K, routing=routing, seed=0, dtype=dtype, gated=spec.expert.gated, device=device
    )
    _, _, _, wg, wu, _ = inputs
    # rdepc reads GEMM1's operand as its MoE module keeps it (``w_gate_up`` [E, H, F, 2], gate
    # and up interleaved), made here once; the baselines take the separate weights they read
    operand = gemm1_operand(wg, wu) if wg is not None else wu
    ref, _ = reference_for(spec)(*fp32(inputs))
    tol = tolerance(layer)
    rows = W * T * K
    useful = 2 * (3 if spec.expert.gated else 2) * H * F * rows
    return _Case(layer, inputs, operand, ref, tol, rows, useful, act, dtype)


@dataclass
class _Bench:
    """A case being measured, and its timings so far (the ``methods`` figure)."""

    check: object
    case: _Case
    device: str
    reps: int
    warmup: int
    times: dict[str, dict] = field(default_factory=dict)

    def timed(self, method: str, fn, y=None, flops: float | None = None) -> dict:
        """``fn`` timed as ``method`` (``flops``: a forward's unless given), its output ``y`` checked."""
        import torch
        from rdepc.runtime.tensors import max_relative_error

        from bench.moe_bench import back_to_back

        flops = self.case.useful if flops is None else flops
        t = _ms(fn, self.device, self.reps, self.warmup)
        entry = {"ms": t, "tflops": flops / (t["median"] * 1e-3) / 1e12}
        entry["back_to_back_ms"] = back_to_back(fn, torch.device(self.device), self.reps)  # the host running ahead
        if y is not None:
            entry["max_rel_err"] = max_relative_error(y.float(), self.case.ref)
            ok = entry["max_rel_err"] <= self.case.tol
            self.check.expect(ok, f"{method}: max relative error {entry['max_rel_err']:.3g}")
        self.times[method] = entry
        self.check.figure("methods", self.times)
        return entry

    def median(self, method: str) -> float:
        """``method``'s median time (ms)."""
        return self.times[method]["ms"]["median"]


def perf_case(check, name: str, tokens: int, routing: str, variants, device: str, dry: bool) -> None:
    reps, warmup = (1, 0) if dry else (REPS, WARMUP)
    calls = [v for v in variants if v.pass_ == "forward"]  # the candidates; the fastest is profiled and trained
    case = _case(calls[0].layer(), routing, device)
    W, T, H, F, E, K = (case.layer.shapes[k] for k in ("W", "T", "H", "F", "E", "K"))
    check.figure("shape", f"W={W} T'={T} H={H} F={F} E={E} K={K} {routing}")
    check.figure("rows", case.rows)
    b = _Bench(check, case, device, reps, warmup)
    # rdepc: every variant, the best kept
    modules = {}
    for v in calls:
        m = v.module(device)
        y = case.call(m)()
        m.synchronize()
        modules[(v.schedule, v.mode, v.gemm)] = m
        b.timed(method(v.schedule, v.mode, v.gemm), case.call(m), y)
    best = min(modules, key=lambda k: b.median(method(*k)))
    by = {(v.schedule, v.mode, v.gemm): v for v in calls}
    check.figure("best", method(*best).removeprefix("rdepc "))
    m = modules[best]
    best_ms = b.median(method(*best))
    call = case.call(m)
    graph_ms = _host_work(b, m, call)
    # per-stage spans of one profiled call, and the host's share of a call
    prof = by[best].module(device, profile=True)
    spans, clock = _profiled_stages(b, prof, modules, best, by)
    if clock == "globaltimer":  # ns
        kernel_ms = max((s["to"] for s in spans.values()), default=0) / 1e6
        check.figure("kernel_span_ms", kernel_ms)
        check.figure("host_overhead_ms", best_ms - kernel_ms)
    else:  # the interpreter's logical clock orders events; it has no durations
        kernel_ms = None
        check.figure("kernel_span_ms", None)
        check.figure("host_overhead_ms", None)
    _baselines(b)
    # pipelined against bulk, each in its fastest mode: what overlapping the stages gains over not
    fastest = {
        schedule: min(b.median(method(*k)) for k in modules if k[0] == schedule)
        for schedule in ("bulk", "pipelined")
        if any(k[0] == schedule for k in modules)
    }
    pipelined_over_bulk = fastest["pipelined"] / fastest["bulk"] if len(fastest) == 2 else None
    m = prof = call = y = None  # released: the profiled module; the best one is left to fit_train to release
    t, fwd_ms = _fwd_bwd(b, modules, best, by[best], best_ms)
    fwd = Forward(method(*best), best_ms, graph_ms, spans, clock, kernel_ms)
    ratios = check.figure("ratios", perf_ratios(b.times, fwd, t, fwd_ms, pipelined_over_bulk))
    if not dry:
        check.figure("targets", perf_targets(name, tokens, ratios, t, b.times[f"{fwd.method} fwd+bwd"]))


def _host_work(b: _Bench, m, call) -> dict | None:
    """The time a call takes to return (the host's work; nothing waits for the device), where
    that time goes, and the call's replays from a CUDA graph (None on the CPU)."""
    issue = []
    for _ in range(b.reps):
        t0 = time.perf_counter()
        call()
        issue.append((time.perf_counter() - t0) * 1e3)
    m.synchronize()
    b.check.figure("call_returns_ms", sorted(issue)[len(issue) // 2])
    b.check.figure("host_profile", host_profile(call, b.reps))
    m.synchronize()
    graph_ms = graph_replay_ms(call, b.device, b.reps, b.warmup)  # the call without its host work
    b.check.figure("graph_replay_ms", graph_ms)
    return graph_ms


def _profiled_stages(b: _Bench, prof, modules: dict, best: tuple, by: dict) -> tuple[dict, str]:
    """The per-stage spans of one call of the best's profiled module ``prof`` (returned, with
    its clock) and of every other candidate's."""
    from bench.moe_bench import stages

    b.case.call(prof)()
    prof.synchronize()
    spans = stages(prof, prof.last_profile["events"])
    clock = b.check.figure("stage_clock", prof.last_profile["clock"])
    b.check.figure("stages", spans)
    b.check.figure("kernels", prof.last_profile["kernels"])  # per launch: per kind, and the GEMM programs' waits
    # ... and of every other candidate's: where pipelined loses to bulk, or split to unified
    others, others_kernels = {}, {}
    for key in modules:
        if key != best:
            other = by[key].module(b.device, profile=True)
            b.case.call(other)()
            other.synchronize()
            name = method(*key).removeprefix("rdepc ")
            others[name] = stages(other, other.last_profile["events"])
            others_kernels[name] = other.last_profile["kernels"]
            other = None
    b.check.figure("stages_others", others)
    b.check.figure("kernels_others", others_kernels)
    return spans, clock


def _baselines(b: _Bench) -> None:
    """The baselines' forwards, on the same rows (theirs released on return)."""
    import torch

    from bench import baselines as bl

    inputs, act, E, H = b.case.inputs, b.case.act, b.case.layer.shapes["E"], b.case.layer.shapes["H"]
    x, ids, gates, wg, wu, wd = inputs
    b.timed("sort + torch._grouped_mm", lambda: bl.sort_grouped_mm(*inputs, act), bl.sort_grouped_mm(*inputs, act))
    # what a careful PyTorch user writes (torchtitan's MoE): gate and up in one operand, the
    # weighted sum a gather of each token's K rows, in the layer's dtype throughout
    fused = bl.fuse_gate_up(wg, wu) if wg is not None else wu
    strong = bl.grouped_mm_fused(x, ids, gates, fused, wd, act)
    b.timed("fused grouped_mm (torchtitan)", lambda: bl.grouped_mm_fused(x, ids, gates, fused, wd, act), strong)
    strong = None
    _, token, offs = bl.sort_rows(ids, E)
    xs = x.reshape(-1, H)[token]
    b.timed("torch._grouped_mm alone", lambda: bl.grouped_gemms(xs, offs, wg, wu, wd, act))
    w_in = torch.cat([wg[0], wu[0]], dim=1) if wg is not None else wu[0]
    b.timed("dense roof", lambda: bl.dense_roof(xs, w_in, wd[0]))


def _fwd_bwd(b: _Bench, modules: dict, best: tuple, variant, best_ms: float) -> tuple[int, float]:
    """Forward + backward: rdepc's best against sort + torch._grouped_mm through autograd, at
    the largest T' whose saved rows fit (fit_train) once the other modules (each holds its
    heap) and the baselines' rows are released. Returns that T' and the best's forward there."""
    import torch

    x, ids, gates, wg, wu, wd = b.case.inputs
    T, device, useful = b.case.layer.shapes["T"], b.device, b.case.useful
    weights = sum(w.nbytes for w in (wg, wu, wd) if w is not None)
    per_token = x.nbytes // T  # x's bytes per token of every rank: dy, y and dx as many

    def make(tokens_: int, profile: bool = False):
        narrowed = tuple((dict(variant.overrides) | {"T": tokens_}).items())
        return replace(variant, overrides=narrowed, pass_="train").module(device, profile=profile)

    # the weights' gradients, the kernel's gradient buffers and its [Wg Wu] copy; x, dy, y, dx
    module, t, tried = fit_train(modules, best, T, make, lambda n: 3 * weights + 4 * per_token * n, device)
    b.check.figure("fwd_bwd_tokens", t)
    b.check.figure("fwd_bwd_memory", {"fit": FIT, "tried": tried})
    fwd_ms, rows, at = best_ms, [x, ids, gates], f"{method(*best)} T'={t}"
    if t != T:  # the first t tokens of every rank; the forward at t too, for the ratio
        b.check.figure("fwd_bwd_why", _why_narrowed(tried, T, t))
        rows = [a[:, :t].contiguous() for a in rows]
        fwd_ms = b.timed(at, b.case.call(module, rows), flops=useful * t // T)["ms"]["median"]
        b.times[at]["tokens"] = t
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(b.case.dtype).to(device)
    dy = dy[:, :t].contiguous()
    key = f"{method(*best)} fwd+bwd"
    try:
        if module is None:
            raise torch.OutOfMemoryError(f"no module could be built down to T'={t}: {tried[t].get('error')}")
        # GEMM1's operand a leaf, as the MoE module's parameter: its gradient comes interleaved
        b.timed(key, _train_step(module.routed, rows, dy, (b.case.operand, wd)), flops=3 * useful * t // T)
        module.synchronize()
    except torch.OutOfMemoryError as e:  # recorded: the estimate missed; the rest still runs
        b.times[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    b.times[key]["tokens"] = t
    module = None
    released(device)
    _backward_stages(b, make, t, rows, dy)
    _baselines_fwd_bwd(b, t, rows, dy)
    return t, fwd_ms


def _why_narrowed(tried: dict, T: int, t: int) -> str:
    """Why the forward+backward is timed at T' = t rather than at the case's T'."""
    from rdepc.runtime.memory import human

    first, last = tried[T], tried[t]
    why = (
        f"at T'={T} the forward+backward's saved rows and gradient buffers need about "
        f"{human(first['need_bytes'])} (estimated) beside the module, more than {FIT:.0%} of the "
        f"{human(first['free_bytes'])} free: timed at T'={t}"
    )
    if not last.get("fits"):
        why += ", the smallest T', though it does not fit either"
    return why


def _train_step(fn, rows, dy, weights):
    """A call of ``fn`` on ``rows`` (x, ids, gates) under autograd and its backward (of ``dy``):
    x, the gates and ``weights`` leaves."""
    leaves = [None if a is None else a.detach().requires_grad_(True) for a in (rows[0], rows[2], *weights)]

    def step():
        y = fn(leaves[0], rows[1], *leaves[1:])
        y.backward(dy)

    return step


def _backward_stages(b: _Bench, make, t: int, rows, dy) -> None:
    """Where the backward's time goes: one profiled call under autograd, its stages."""
    import torch

    from bench.moe_bench import stages

    try:
        prof = make(t, profile=True)
        _train_step(prof.routed, rows, dy, (b.case.operand, b.case.inputs[5]))()
        prof.synchronize()
        b.check.figure("backward_stages", stages(prof, prof.last_backward_profile["events"], backward=True))
        b.check.figure("backward_kernels", prof.last_backward_profile["kernels"])
    except torch.OutOfMemoryError as e:
        b.check.figure("backward_stages", {"error": f"{type(e).__name__}: {e}"[:300]})
    prof = None
    released(b.device)


def _baselines_fwd_bwd(b: _Bench, t: int, rows, dy) -> None:
    """The baselines' forward + backward at T' = t."""
    from bench import baselines as bl

    _, _, _, wg, wu, wd = b.case.inputs
    act, flops = b.case.act, 3 * b.case.useful * t // b.case.layer.shapes["T"]
    try:
        b.timed(KEY_SORT, _train_step(lambda *a: bl.sort_grouped_mm(*a, act), rows, dy, (wg, wu, wd)), flops=flops)
    except RuntimeError as e:  # torch without _grouped_mm's backward on this device, or out of memory
        b.times[KEY_SORT] = {"error": f"{type(e).__name__}: {e}"[:300]}
    b.times[KEY_SORT]["tokens"] = t
    released(b.device)
    try:  # its fused operand a leaf, as a parameter
        fused = bl.fuse_gate_up(wg, wu) if wg is not None else wu
        b.timed(KEY_STRONG, _train_step(lambda *a: bl.grouped_mm_fused(*a, act), rows, dy, (fused, wd)), flops=flops)
    except RuntimeError as e:
        b.times[KEY_STRONG] = {"error": f"{type(e).__name__}: {e}"[:300]}
    b.times[KEY_STRONG]["tokens"] = t
    fused = None
    b.check.figure("methods", b.times)
    released(b.device)


def released(device: str) -> None:
    """Memory no longer referenced given back before the free memory is read again: objects
    in reference cycles collected, and on a GPU the caching allocator's free blocks returned."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def fit_train(modules: dict, best, tokens: int, make, fixed, device: str):
    """The module and T' the forward+backward is timed at: ``modules[best]`` at T' =
    ``tokens`` (the other modules released first: taken out of ``modules``, no reference to
    one is left here) when what a call under autograd and its backward allocate (the saved
    rows, from its contract: accept_correct.train_rows_bytes; ``fixed(T')`` bytes more) fits
    FIT × the free memory, else ``make(T')``'s at T' halved until it does (each built, and
    the last released, before the free memory is read: it counts the module's heap; at T' =
    1, whether or not it fits). Returns (module or None, T', {T': need_bytes, free_bytes and
    fits, or why none was built})."""
    import torch
    from rdepc.runtime.memory import HeapSizeError

    module = modules.pop(best)
    modules.clear()
    released(device)
    tried: dict[int, dict] = {}
    t = tokens
    while True:
        if module is not None:
            need, room = train_rows_bytes(module.contract) + fixed(t), free_bytes(device)
            fits = room is None or need <= FIT * room
            tried[t] = {"need_bytes": need, "free_bytes": room, "fits": fits}
            if fits or t < 2:
                return module, t, tried
        if t < 2:
            return None, t, tried
        module = None
        released(device)
        t //= 2
        try:
            module = make(t)
        except (HeapSizeError, torch.OutOfMemoryError) as e:  # its heap alone does not fit: halve again
            tried[t] = {"error": f"{type(e).__name__}: {e}"[:300]}


def tune_case(check, device: str, dry: bool, deadline: float, out) -> None:
    """``rdepc tune`` on moonlight as the perf stage's first case runs it (T' = 4096, bulk):
    every candidate's builds prewarmed in parallel, then each timed (those past the stage's
    budget recorded as not timed), the fastest recorded where the runtime looks it up: a
    perf stage after it launches those tiles."""
    import os

    from rdepc.runtime import tune

    tokens, schedule = (None, None) if dry else (GPU_CASES[0][1], "bulk")
    layer = load("moonlight", dry, tokens=tokens)
    plan = layer.compile(schedule=schedule, interpret=dry).kernel
    tried = tune.candidates(plan)
    if dry:  # two candidates of the interpreter's kind, in a scratch cache
        from rdepc.ir.contract import Tiles

        base = Tiles.default(layer.shapes["H"], layer.shapes["F"], plan.dtype, True)
        tried = [base, replace(base, bm=32 if base.bm != 32 else 64)]
        os.environ["RDEPC_CACHE_DIR"] = str(out / "tune-cache")
    else:
        from rdepc.commands.tune import prewarm_candidates

        left = deadline - time.monotonic()
        warm = prewarm_candidates(layer, tried, device, schedule=schedule, timeout=max(30.0, left / 2))
        check.figure("prewarm", {k: warm[k] for k in ("compiled", "cached", "failed", "not run", "seconds")})
    check.figure("shape", f"T'={layer.shapes['T']} {plan.strategy}")
    check.figure("candidates", len(tried))
    reps, warmup = (1, 0) if dry else (5, 2)
    best, results, path = tune.tune_layer(
        layer, device, schedule=schedule, reps=reps, warmup=warmup, tried=tried,
        budget=max(0.0, deadline - time.monotonic() - 30), progress=lambda line: print(line, flush=True),
    )  # fmt: skip
    timed = [r for r in results if "ms" in r]
    check.figure("timed", len(timed))
    check.figure("failed", sum("error" in r for r in results))
    check.figure("not_timed", sum("skipped" in r for r in results))
    check.figure("best", asdict(best))
    check.figure("best_ms", min(r["ms"] for r in timed))
    check.figure("record_path", str(path))
    record = json.loads(path.read_text(encoding="utf-8"))
    check.figure("record", record)
    check.expect(record["tiles"] == asdict(best), "the record does not hold the fastest tiles")
    found = tune.lookup(plan, record["device"])
    check.expect(found is not None and found[0] == best, "the runtime does not find the record it wrote")


__all__ = ["DRY", "candidates", "plan_perf", "run_perf", "run_tune"]
