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
from dataclasses import asdict, replace
from pathlib import Path

from bench.accept_correct import DRY, FIT, fp32, free_bytes, load, own, tolerance, train_rows_bytes, variant

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


def perf_case(check, name: str, tokens: int, routing: str, variants, device: str, dry: bool) -> None:
    import torch
    from rdepc.runtime.memory import human
    from rdepc.runtime.tensors import TORCH_DTYPES, gemm1_operand, max_relative_error

    from bench import baselines as bl
    from bench.moe_bench import back_to_back, stages
    from rdepc.reference import random_inputs, reference_for

    reps, warmup = (1, 0) if dry else (REPS, WARMUP)
    calls = [v for v in variants if v.pass_ == "forward"]  # the candidates; the fastest is profiled and trained
    layer = calls[0].layer()
    spec, sh = layer.spec, layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    act, dtype = spec.expert.act, TORCH_DTYPES[spec.precision.dtype.value]
    inputs = random_inputs(
        W, T, H, F, E, K, routing=routing, seed=0, dtype=dtype, gated=spec.expert.gated, device=device
    )
    x, ids, gates, wg, wu, wd = inputs
    # rdepc reads GEMM1's operand as its MoE module keeps it (``w_gate_up`` [E, H, F, 2], gate
    # and up interleaved), made here once; the baselines take the separate weights they read
    operand = gemm1_operand(wg, wu) if wg is not None else wu

    def rdepc_call(module, rows=(x, ids, gates), w_up=operand):
        return lambda: module.routed(*rows, w_up, wd)

    ref, _ = reference_for(spec)(*fp32(inputs))
    tol = tolerance(layer)
    rows = W * T * K
    useful = 2 * (3 if spec.expert.gated else 2) * H * F * rows
    check.figure("shape", f"W={W} T'={T} H={H} F={F} E={E} K={K} {routing}")
    check.figure("rows", rows)
    times: dict[str, dict] = {}

    def timed(method: str, fn, y=None, flops: float = useful) -> dict:
        t = _ms(fn, device, reps, warmup)
        entry = {"ms": t, "tflops": flops / (t["median"] * 1e-3) / 1e12}
        entry["back_to_back_ms"] = back_to_back(fn, torch.device(device), reps)  # the host running ahead
        if y is not None:
            entry["max_rel_err"] = max_relative_error(y.float(), ref)
            check.expect(entry["max_rel_err"] <= tol, f"{method}: max relative error {entry['max_rel_err']:.3g}")
        times[method] = entry
        check.figure("methods", times)
        return entry

    # rdepc: every variant, the best kept
    modules = {}
    for v in calls:
        m = v.module(device)
        y = rdepc_call(m)()
        m.synchronize()
        modules[(v.schedule, v.mode, v.gemm)] = m
        timed(method(v.schedule, v.mode, v.gemm), rdepc_call(m), y)
    best = min(modules, key=lambda k: times[method(*k)]["ms"]["median"])
    by = {(v.schedule, v.mode, v.gemm): v for v in calls}
    check.figure("best", method(*best).removeprefix("rdepc "))
    m = modules[best]
    best_ms = times[method(*best)]["ms"]["median"]
    # the time a call takes to return (the host's work; nothing waits for the device)
    issue = []
    call = rdepc_call(m)
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        issue.append((time.perf_counter() - t0) * 1e3)
    m.synchronize()
    check.figure("call_returns_ms", sorted(issue)[len(issue) // 2])
    check.figure("host_profile", host_profile(call, reps))
    m.synchronize()
    graph_ms = graph_replay_ms(call, device, reps, warmup)  # the call without its host work
    check.figure("graph_replay_ms", graph_ms)
    # per-stage spans of one profiled call, and the host's share of a call
    prof = by[best].module(device, profile=True)
    rdepc_call(prof)()
    prof.synchronize()
    spans = stages(prof, prof.last_profile["events"])
    clock = check.figure("stage_clock", prof.last_profile["clock"])
    check.figure("stages", spans)
    check.figure("kernels", prof.last_profile["kernels"])  # per launch: per kind, and the GEMM programs' waits
    # ... and of every other candidate's: where pipelined loses to bulk, or split to unified
    others, others_kernels = {}, {}
    for key in modules:
        if key != best:
            other = by[key].module(device, profile=True)
            rdepc_call(other)()
            other.synchronize()
            name_ = method(*key).removeprefix("rdepc ")
            others[name_] = stages(other, other.last_profile["events"])
            others_kernels[name_] = other.last_profile["kernels"]
            other = None
    check.figure("stages_others", others)
    check.figure("kernels_others", others_kernels)
    if clock == "globaltimer":  # ns
        kernel_ms = max((s["to"] for s in spans.values()), default=0) / 1e6
        check.figure("kernel_span_ms", kernel_ms)
        check.figure("host_overhead_ms", best_ms - kernel_ms)
    else:  # the interpreter's logical clock orders events; it has no durations
        check.figure("kernel_span_ms", None)
        check.figure("host_overhead_ms", None)
    # the baselines, on the same rows
    timed("sort + torch._grouped_mm", lambda: bl.sort_grouped_mm(*inputs, act), bl.sort_grouped_mm(*inputs, act))
    # what a careful PyTorch user writes (torchtitan's MoE): gate and up in one operand, the
    # weighted sum a gather of each token's K rows, in the layer's dtype throughout
    fused = bl.fuse_gate_up(wg, wu) if wg is not None else wu
    strong = bl.grouped_mm_fused(x, ids, gates, fused, wd, act)
    timed("fused grouped_mm (torchtitan)", lambda: bl.grouped_mm_fused(x, ids, gates, fused, wd, act), strong)
    strong = None
    _, token, offs = bl.sort_rows(ids, E)
    xs = x.reshape(-1, H)[token]
    timed("torch._grouped_mm alone", lambda: bl.grouped_gemms(xs, offs, wg, wu, wd, act))
    w_in = torch.cat([wg[0], wu[0]], dim=1) if wg is not None else wu[0]
    timed("dense roof", lambda: bl.dense_roof(xs, w_in, wd[0]))
    # forward + backward: rdepc's best against sort + torch._grouped_mm through autograd, at
    # the largest T' whose saved rows fit (fit_train) once the other modules (each holds its
    # heap) and the baselines' rows are released
    # pipelined against bulk, each in its fastest mode: what overlapping the stages gains over not
    fastest = {
        schedule: min(times[method(*k)]["ms"]["median"] for k in modules if k[0] == schedule)
        for schedule in ("bulk", "pipelined")
        if any(k[0] == schedule for k in modules)
    }
    pipelined_over_bulk = fastest["pipelined"] / fastest["bulk"] if len(fastest) == 2 else None
    m = prof = xs = w_in = token = offs = fused = None  # released: the profiled module, the baselines' rows
    weights = sum(w.nbytes for w in (wg, wu, wd) if w is not None)
    per_token = x.nbytes // T  # x's bytes per token of every rank: dy, y and dx as many

    def make(tokens_: int, profile: bool = False):
        narrowed = tuple((dict(by[best].overrides) | {"T": tokens_}).items())
        return replace(by[best], overrides=narrowed, pass_="train").module(device, profile=profile)

    # the weights' gradients, the kernel's gradient buffers and its [Wg Wu] copy; x, dy, y, dx
    module, t, tried = fit_train(modules, best, T, make, lambda n: 3 * weights + 4 * per_token * n, device)
    check.figure("fwd_bwd_tokens", t)
    check.figure("fwd_bwd_memory", {"fit": FIT, "tried": tried})
    fwd_ms = best_ms
    part = [x, ids, gates, wg, wu, wd]
    if t != T:  # the first t tokens of every rank; the forward at t too, for the ratio
        first, last = tried[T], tried[t]
        why = (
            f"at T'={T} the forward+backward's saved rows and gradient buffers need about "
            f"{human(first['need_bytes'])} (estimated) beside the module, more than {FIT:.0%} of the "
            f"{human(first['free_bytes'])} free: timed at T'={t}"
        )
        if not last.get("fits"):
            why += ", the smallest T', though it does not fit either"
        check.figure("fwd_bwd_why", why)
        part[:3] = (a[:, :t].contiguous() for a in part[:3])
        fwd_ms = timed(f"{method(*best)} T'={t}", rdepc_call(module, part[:3]), flops=useful * t // T)
        fwd_ms = fwd_ms["ms"]["median"]
        times[f"{method(*best)} T'={t}"]["tokens"] = t
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(dtype).to(device)[:, :t].contiguous()

    def train(fn, weights=(wg, wu, wd)):
        leaves = [None if a is None else a.detach().requires_grad_(True) for a in (part[0], part[2], *weights)]

        def step():
            y = fn(leaves[0], part[1], *leaves[1:])
            y.backward(dy)

        return step

    key = f"{method(*best)} fwd+bwd"
    try:
        if module is None:
            raise torch.OutOfMemoryError(f"no module could be built down to T'={t}: {tried[t].get('error')}")
        # GEMM1's operand a leaf, as the MoE module's parameter: its gradient comes interleaved
        timed(key, train(module.routed, (operand, wd)), flops=3 * useful * t // T)
        module.synchronize()
    except torch.OutOfMemoryError as e:  # recorded: the estimate missed; the rest still runs
        times[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    times[key]["tokens"] = t
    module = None
    released(device)
    try:  # where the backward's time goes: one profiled call under autograd, its stages
        prof = make(t, profile=True)
        train(prof.routed, (operand, wd))()
        prof.synchronize()
        check.figure("backward_stages", stages(prof, prof.last_backward_profile["events"], backward=True))
        check.figure("backward_kernels", prof.last_backward_profile["kernels"])
    except torch.OutOfMemoryError as e:
        check.figure("backward_stages", {"error": f"{type(e).__name__}: {e}"[:300]})
    prof = None
    released(device)
    key_sort = "sort + torch._grouped_mm fwd+bwd"
    try:
        timed(key_sort, train(lambda *a: bl.sort_grouped_mm(*a, act)), flops=3 * useful * t // T)
    except RuntimeError as e:  # torch without _grouped_mm's backward on this device, or out of memory
        times[key_sort] = {"error": f"{type(e).__name__}: {e}"[:300]}
    times[key_sort]["tokens"] = t
    released(device)
    key_strong = "fused grouped_mm (torchtitan) fwd+bwd"
    try:  # its fused operand a leaf, as a parameter
        fused = bl.fuse_gate_up(wg, wu) if wg is not None else wu
        timed(key_strong, train(lambda *a: bl.grouped_mm_fused(*a, act), (fused, wd)), flops=3 * useful * t // T)
    except RuntimeError as e:
        times[key_strong] = {"error": f"{type(e).__name__}: {e}"[:300]}
    times[key_strong]["tokens"] = t
    fused = None
    check.figure("methods", times)
    released(device)
    # the ratios the targets are stated in (docs/gpu.md: the layer ≥ 1.4 × sort + grouped_mm, ...)
    sort_ms = times["sort + torch._grouped_mm"]["ms"]["median"]
    compute = spans.get("compute")
    ratios = {"speedup_vs_sort_grouped_mm": sort_ms / best_ms, "forward_ms": best_ms}
    ratios["speedup_vs_fused_grouped_mm"] = times["fused grouped_mm (torchtitan)"]["ms"]["median"] / best_ms
    if graph_ms is not None:
        ratios["graph_replay_ms"] = graph_ms["median"]
        if clock == "globaltimer":
            ratios["graph_replay_over_kernel_span_ms"] = graph_ms["median"] - kernel_ms
    route = spans.get("route")
    if clock == "globaltimer" and route:
        ratios["route_ms"] = (route["to"] - route["from"]) / 1e6
    # ... and with the host running ahead (calls issued without waiting): a call's host work
    # hidden behind the calls before it, as in a training step; read beside the target, not for it
    b2b = (
        times["sort + torch._grouped_mm"].get("back_to_back_ms"),
        times[method(*best)].get("back_to_back_ms"),
    )
    if all(b2b):
        ratios["speedup_vs_sort_grouped_mm_back_to_back"] = b2b[0] / b2b[1]
    if "ms" in times[key]:  # at T' = fwd_bwd_tokens, both
        ratios["fwd_bwd_over_fwd"] = times[key]["ms"]["median"] / fwd_ms
        ratios["fwd_bwd_ms"] = times[key]["ms"]["median"]
        ratios["fwd_bwd_tokens"] = t
        for name_, base in (("sort_grouped_mm", key_sort), ("fused_grouped_mm", key_strong)):
            if "ms" in times[base]:
                ratios[f"fwd_bwd_speedup_vs_{name_}"] = times[base]["ms"]["median"] / times[key]["ms"]["median"]
    if pipelined_over_bulk is not None:
        ratios["pipelined_over_bulk"] = pipelined_over_bulk
    if clock == "globaltimer" and compute:
        compute_ms = (compute["to"] - compute["from"]) / 1e6  # the compute stage's span
        ratios["compute_vs_grouped_mm"] = times["torch._grouped_mm alone"]["ms"]["median"] / compute_ms
    check.figure("ratios", ratios)
    if not dry:
        goals = {  # the library-lowering issue's, on one H200 (moonlight's absolute times; every case's ratios)
            "speedup_vs_sort_grouped_mm": (">=", 1.4),
            "speedup_vs_fused_grouped_mm": (">=", 1.0),
            "fwd_bwd_speedup_vs_sort_grouped_mm": (">=", 1.25),
            "graph_replay_over_kernel_span_ms": ("<=", 0.1),
            "route_ms": ("<=", 0.1),
        }
        if name == "moonlight" and tokens == 4096:
            goals |= {"forward_ms": ("<=", 8.5), "fwd_bwd_ms": ("<=", 24.0)}
        targets = {
            k: {"value": ratios[k], "target": f"{op} {v}", "met": ratios[k] >= v if op == ">=" else ratios[k] <= v}
            for k, (op, v) in goals.items()
            if k in ratios
        }
        for k in ("fwd_bwd_speedup_vs_sort_grouped_mm", "fwd_bwd_ms"):
            if k in targets:
                targets[k]["tokens"] = t  # the T' it was measured at
            elif k in goals:  # not measured: said so, with why
                op, v = goals[k]
                targets[k] = {"value": None, "target": f"{op} {v}", "met": None, "tokens": t}
                targets[k]["error"] = times[key].get("error")
        check.figure("targets", targets)


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


# ----------------------------------------------------------------------------- the plot
STAGE_ORDER = ("route", "scan", "dispatch", "compute", "gemm1", "gemm2", "return", "combine")


def _color(method: str, best: str) -> str:
    """rdepc's best (and its fwd+bwd) red, its other variants orange, the baselines blue."""
    return "tab:red" if method.startswith(best) else "tab:orange" if method.startswith("rdepc") else "tab:blue"


def plot_perf(record: dict, png) -> int:
    """``perf.png`` from a perf stage record: per case, the median time of each method (min to
    max as error bars; a method that did not run is named with why) and the stages of rdepc's
    profiled call as a timeline (each from its first entry's start to its last entry's end).
    Returns the cases plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cases = [c for c in record.get("checks", []) if c["figures"].get("methods")]
    if not cases:
        return 0
    fig, axes = plt.subplots(len(cases), 2, figsize=(15, 0.6 + 3.4 * len(cases)), squeeze=False)
    for (ax, gantt), c in zip(axes, cases, strict=True):
        f = c["figures"]
        methods = f["methods"]
        names = list(methods)[::-1]  # the first at the top
        best = f"rdepc {f.get('best')}"
        ms = [methods[k].get("ms") for k in names]
        med = [t["median"] if t else 0 for t in ms]
        err = [[t["median"] - t["min"] if t else 0 for t in ms], [t["max"] - t["median"] if t else 0 for t in ms]]
        colors = [_color(k, best) for k in names]
        ax.barh(range(len(names)), med, xerr=err, color=colors, capsize=3)
        labels = [k + (f" (T'={methods[k]['tokens']})" if "tokens" in methods[k] else "") for k in names]
        ax.set_yticks(range(len(names)), labels, fontsize=7)
        for i, k in enumerate(names):
            if not ms[i]:
                ax.text(0, i, f" not measured: {methods[k].get('error', '')[:70]}", va="center", fontsize=6)
        ax.set_xlabel("ms per call (median; min to max)")
        status = "" if c["status"] == "pass" else f" [{c['status']}{': ' + c['error'][:60] if c.get('error') else ''}]"
        ax.set_title(f"{c['name']}{status}\n{f.get('shape', '')}", fontsize=8)
        stages = f.get("stages") or {}
        order = sorted(stages, key=lambda k: (STAGE_ORDER.index(k) if k in STAGE_ORDER else len(STAGE_ORDER), k))
        scale, unit = (1e6, "ms") if f.get("stage_clock") == "globaltimer" else (1, "logical clock (order only)")
        for i, k in enumerate(order[::-1]):
            start, span = stages[k]["from"] / scale, (stages[k]["to"] - stages[k]["from"]) / scale
            gantt.barh(i, span, left=start, color="tab:green" if k in STAGE_ORDER[4:6] else "tab:olive")
            gantt.text(start + span, i, f" {span:.3g}", va="center", fontsize=6)
        gantt.set_yticks(range(len(order)), order[::-1], fontsize=7)
        gantt.set_xlabel(unit)
        gantt.set_title(f"{best}, one profiled call: each stage from its first start to its last end", fontsize=8)
    keys = [("tab:red", "rdepc, the fastest variant"), ("tab:orange", "rdepc, the others"), ("tab:blue", "baselines")]
    axes[0][0].legend(handles=[Patch(color=c, label=label) for c, label in keys], fontsize=7, loc="lower right")
    env = record.get("environment", {})
    fig.suptitle(f"acceptance perf: {env.get('device')}, commit {str(env.get('commit'))[:12]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return len(cases)


__all__ = ["DRY", "candidates", "plan_perf", "plot_perf", "run_perf", "run_tune"]
