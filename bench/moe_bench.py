"""Benchmark rdepc's layer against what users would otherwise write (a script, not a test).

    python bench/moe_bench.py --config gpu   --out bench/results/h100   # on a GPU machine
    python bench/moe_bench.py --config smoke --out build/bench          # CPU: the interpreter

For every case — an example layer at some T', a routing — it times, on the same global
inputs (all W ranks emulated on one device):

- ``rdepc STRATEGY MODE``: the compiled layer (``emulated`` backend), per strategy and
  kernel mode, with the measured per-stage spans of one profiled call;
- ``sort + torch._grouped_mm``: rows sorted by expert, grouped GEMMs, ``index_add_``;
- ``per-expert loop``: one matmul chain per expert;
- ``torch._grouped_mm alone``: the expert GEMMs on pre-sorted rows (the compute stage's target);
- ``dense roof``: dense GEMMs on as many rows.

Every layer's output is compared with the reference operator before it is timed (its max
relative error is in the results). Times are min / median / max over ``reps`` calls after
``warmup`` (CUDA events on a GPU; wall clock on the CPU, where the interpreter makes them
a smoke test of the script, not a measurement). Useful TFLOPS = 2·(GEMMs per row)·H·F·rows
/ median. Writes ``OUT.json`` (with device, driver, torch, triton, date) and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Case:
    example: str  # examples/NAME.rdep
    tokens: int  # T' per rank (the spec's T is raised to it when smaller)
    routing: str
    schedules: tuple[str, ...] = ("bulk", "pipelined")
    modes: tuple[str, ...] = ("unified",)
    sweep: bool = False  # part of the rows-per-expert sweep


def _sweep(example: str, W: int, E: int, K: int, mus: tuple[int, ...], routings: tuple[str, ...], **kw) -> list[Case]:
    """T' giving μ = W·T'·K/E rows per expert, for each μ and routing."""
    return [Case(example, mu * E // (W * K), r, sweep=True, **kw) for mu in mus for r in routings]


ROUTINGS = ("uniform", "zipf:0.5", "zipf:1.0", "zipf:1.5")
CONFIGS = {
    # CPU, Triton interpreter: every method and the plot, in seconds (CI runs it).
    "smoke": dict(
        cases=[Case("tiny", 16, "zipf:1.0"), *_sweep("tiny", 4, 8, 2, (4, 8), ("uniform",), schedules=("bulk",))],
        reps=1,
        warmup=0,
    ),
    # One GPU: the shapes and the μ sweep (384 … 6,144 rows per expert).
    "gpu": dict(
        cases=[Case("moonlight", 4096, r, modes=("unified", "split")) for r in ROUTINGS]
        + [Case("qwen3_30b_a3b", 4096, "uniform"), Case("mixtral_8x7b", 4096, "uniform")]
        + _sweep("moonlight", 8, 64, 6, (384, 768, 1536, 3072, 6144), ROUTINGS),
        reps=10,
        warmup=3,
    ),
}


def timeit(fn, device, reps: int, warmup: int) -> dict:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"min": times[0], "median": times[len(times) // 2], "max": times[-1]}


def back_to_back(fn, device, reps: int) -> float:
    """ms per call of ``reps`` calls issued one after another without waiting for any (after
    one call waited for): the host runs ahead as in a training step, and a call's host work
    hides behind the device's work of the calls before it. ``timeit`` waits for each call:
    there a call's host work before its first kernel adds to its time."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def stages(module, events, backward: bool = False) -> dict:
    """Per stage (and per GEMM of the compute stage): first start, last end and the sum of
    entry spans, from a measured profile (``backward``: of a backward, its table's entries)."""
    from rdepc.runtime.profile import STAGE_OF

    from rdepc.ir.contract import KINDS

    table = module.contract.bwd_table if backward else module.contract.table
    out: dict[str, dict] = {}
    for entry, start, end in events:
        stage, detail = STAGE_OF[KINDS[table[entry][0]]]
        for key in (stage, detail) if stage == "compute" else (stage,):
            s = out.setdefault(key, {"from": start, "to": end, "sum": 0})
            s["from"], s["to"], s["sum"] = min(s["from"], start), max(s["to"], end), s["sum"] + end - start
    first = min((s["from"] for s in out.values()), default=0)
    return {k: {"from": v["from"] - first, "to": v["to"] - first, "sum": v["sum"]} for k, v in out.items()}


def run_case(case: Case, device, reps: int, warmup: int) -> list[dict]:
    import torch
    from rdepc.runtime.tensors import TORCH_DTYPES, max_relative_error

    import rdepc
    from bench import baselines as bl
    from rdepc.reference import random_inputs, reference_for

    path = ROOT / "examples" / f"{case.example}.rdep"
    base = rdepc.load(path)
    overrides = {"T": case.tokens} if case.tokens > base.shapes["T"] else {}
    layer = rdepc.load(path, **overrides)
    spec, sh = layer.spec, layer.shapes
    W, H, F, E, K = (sh[k] for k in ("W", "H", "F", "E", "K"))
    act, dtype = spec.expert.act, TORCH_DTYPES[spec.precision.dtype.value]
    inputs = random_inputs(
        W, case.tokens, H, F, E, K, routing=case.routing, seed=0, dtype=dtype, gated=spec.expert.gated
    )
    inputs = [None if t is None else t.to(device) for t in inputs]
    x, ids, _, wg, wu, wd = inputs
    f32 = [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs]
    ref, _ = reference_for(spec)(*f32)  # on the device, in fp32
    rows = W * case.tokens * K
    gemms = 3 if spec.expert.gated else 2
    useful = 2 * gemms * H * F * rows
    common = {"example": case.example, "W": W, "T": case.tokens, "H": H, "F": F, "E": E, "K": K}
    common |= {"routing": case.routing, "rows": rows, "mu": rows / E, "dtype": str(dtype).removeprefix("torch.")}
    common |= {"sweep": case.sweep}
    runs = []

    def add(method: str, fn, y=None):
        t = timeit(fn, device, reps, warmup)
        run = common | {"method": method, "ms": t, "tflops": useful / (t["median"] * 1e-3) / 1e12}
        if y is not None:
            run["max_rel_err"] = max_relative_error(y.float(), ref)
        runs.append(run)
        return run

    for schedule in case.schedules:
        for mode in case.modes:
            m = layer.module("emulated", device, schedule=schedule, mode=mode)
            y = m(*inputs)
            run = add(f"rdepc {schedule} {mode}", lambda m=m: m(*inputs), y)
            prof = layer.module("emulated", device, schedule=schedule, mode=mode, profile=True)
            prof(*inputs)
            run["stages"] = stages(prof, prof.last_profile["events"])
            run["stage_clock"] = prof.last_profile["clock"]
    add("sort + torch._grouped_mm", lambda: bl.sort_grouped_mm(*inputs, act), bl.sort_grouped_mm(*inputs, act))
    add("per-expert loop", lambda: bl.per_expert_loop(*inputs, act), bl.per_expert_loop(*inputs, act))
    _, token, offs = bl.sort_rows(ids, E)
    xs = x.reshape(-1, H)[token]
    add("torch._grouped_mm alone", lambda: bl.grouped_gemms(xs, offs, wg, wu, wd, act))
    w_in = torch.cat([wg[0], wu[0]], dim=1) if wg is not None else wu[0]
    add("dense roof", lambda: bl.dense_roof(xs, w_in, wd[0]))
    return runs


def write_results(results: dict, out: Path, plot) -> None:
    """OUT.json and ``plot(results, OUT.png)``, the folder made: what every bench script writes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def environment(device) -> dict:
    from importlib import metadata

    import torch

    # triton's version from its metadata: importing it would fix the process's Triton mode
    env = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "python": platform.python_version()}
    env |= {"torch": torch.__version__, "triton": metadata.version("triton"), "machine": platform.machine()}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"
        env["driver"] = None
    return env


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    cases = list(dict.fromkeys((r["example"], r["T"], r["routing"]) for r in runs if not r["sweep"]))
    sweep = [r for r in runs if r["sweep"]]
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(14 if sweep else 8, 5), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        ms = [
            next(
                (
                    r["ms"]["median"]
                    for r in runs
                    if (r["example"], r["T"], r["routing"]) == c and r["method"] == method and not r["sweep"]
                ),
                0,
            )
            for c in cases
        ]
        ax.bar([j + i * width for j in range(len(cases))], ms, width, label=method)
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(cases))], [f"{e}\nT'={t}\n{r}" for e, t, r in cases], fontsize=8
    )
    ax.set_ylabel("ms per call (median)")
    ax.set_yscale("log")
    ax.set_title(f"{results['environment']['device']}")
    ax.legend(fontsize=7)
    if sweep:
        ax = axes[0][1]
        for method in methods:
            for routing in dict.fromkeys(r["routing"] for r in sweep):
                pts = sorted(
                    (r["mu"], r["ms"]["median"]) for r in sweep if r["method"] == method and r["routing"] == routing
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"{method}, {routing}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rows per expert μ")
        ax.set_ylabel("ms per call (median)")
        ax.set_title("rows-per-expert sweep")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="smoke")
    ap.add_argument("--out", default="build/bench/smoke", help="writes OUT.json and OUT.png")
    ap.add_argument("--device", default=None, help="cpu (the Triton interpreter) or cuda (default: the config's)")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    import torch

    cfg = CONFIGS[args.config]
    device = torch.device(args.device or ("cuda" if args.config == "gpu" else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench: --config gpu needs a CUDA GPU (on a CPU: --config smoke)", file=sys.stderr)
        return 2
    reps = args.reps or cfg["reps"]
    runs = []
    for i, case in enumerate(cfg["cases"], 1):
        print(f"[{i}/{len(cfg['cases'])}] {case.example} T'={case.tokens} {case.routing}", flush=True)
        for run in run_case(case, device, reps, cfg["warmup"]):
            err = f", max rel err {run['max_rel_err']:.2g}" if "max_rel_err" in run else ""
            print(
                f"    {run['method']:<28} {run['ms']['median']:10.3f} ms  {run['tflops']:8.3f} TFLOPS{err}", flush=True
            )
            runs.append(run)
    results = {"config": args.config, "environment": environment(device), "reps": reps, "runs": runs}
    write_results(results, Path(args.out), plot)
    return 0


if __name__ == "__main__":
    sys.path.append(str(ROOT))  # `from bench import baselines` as a script; an installed rdepc first
    sys.exit(main())
