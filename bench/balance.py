"""Owner imbalance with and without exact-load replication (``balance replicate``), from the
replication solver's NumPy reference (``rdepc.ir.balance.solve``) over sampled routings.

    python bench/balance.py --out bench/results/balance-cpu

For each layer shape, routing and number of redundant slots N per rank: the owner imbalance
(max/mean of per-rank rows) of the sampled load before and after the solver's plan, the
replicas it placed and the solver's time in NumPy on this CPU (median of ``--reps``). The
loads are what ``rdepc plan --routing`` samples (``passes.sampled_routing.source_counts``,
token n of the W·T belongs to rank n // T).

``--timeline HW`` also predicts the layer's makespan on hardware profile HW (the cost
model and scheduler ``rdepc viz --routing`` runs) three ways: the physical layer under the
plan with the plan's load, solve and reroute and its weight pushes as tasks of the layer
(what the kernels run one process per rank), the same layer with the solve and the pushes
launched before it (its makespan plus the solve, ``rdepc.ir.balance.solve_seconds``, plus
the busiest rank's pushes alone, ``rdepc.ir.balance.push_seconds``: the design the tasks
replaced), and the layer without replication.

``--device-plan cpu|cuda`` also runs the generated ``balance_solve`` kernel on each load
(a layer of the shape's W, T, E, K and ownership with ``balance replicate``): whether its
plan equals the reference's table for table, and its time (cuda: CUDA events, median of
``--reps`` after a warm-up; cpu: the Triton interpreter's wall time, which says nothing
about a GPU). Writes OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # `from bench import ...`; an installed rdepc stays first

from bench.moe_bench import write_results  # noqa: E402
from rdepc.ir.spec import Balance  # noqa: E402

# the examples, at their own T' (nvl72_e128 at 256 tokens a rank), with their ownership maps
SHAPES = (("moonlight", None), ("qwen3_30b_a3b", None), ("nvl72_e128", 256))
ROUTINGS = ("uniform", "zipf:1.0", "zipf:1.2", "zipf:1.5", "zipf:2.0")


def device_solver(shape: dict, slots: int, min_rows: int, device: str):
    """``solve(load) -> (plan tables, ms)``: the generated balance_solve kernel of a layer of
    ``shape`` (balanced ownership, dropless: what the solver reads) on ``device``."""
    import tempfile

    import torch
    from rdepc.runtime.launch import Launcher

    import rdepc
    from rdepc.compiled import compile_layer
    from rdepc.toolchain import import_kernels

    W, T, E, K = (shape[k] for k in "WTEK")
    text = (
        f"layer b {{\n  shape ranks {W}, tokens {T}, hidden 64, experts {E}, top {K}\n  expert swiglu(ffn = 64)\n"
        f"  dtype fp32\n  balance replicate(slots = {slots}, min_rows = {min_rows})\n}}\n"
    )
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "b.rdep").write_text(text)
        interpret = device == "cpu"
        compiled = compile_layer(rdepc.load(Path(d) / "b.rdep").spec, interpret=interpret)
    kernels = import_kernels(compiled.kernels_path, interpret)
    launch = Launcher(interpret)
    owner = torch.tensor(compiled.kernel.owner[:E], dtype=torch.int32, device=device)

    def solve(load, reps: int):
        i32 = {"dtype": torch.int32, "device": device}
        out = {"phys": torch.empty((E, W), **i32), "cum": torch.empty((W, E, W), **i32)}
        out |= {"slots": torch.empty((W, slots), **i32), "loads": torch.empty((2, W), **i32)}
        args = (torch.tensor(load, **i32), owner, out["phys"], out["cum"], out["slots"], out["loads"])
        times = []
        for _ in range(reps + (device == "cuda")):  # cuda: the first builds the kernel
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch([(kernels.balance_solve, (1,), args, {})])
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                launch([(kernels.balance_solve, (1,), args, {})])
                times.append(1e3 * (time.perf_counter() - t0))
        times = times[1:] if device == "cuda" else times
        return {k: v.cpu().numpy() for k, v in out.items()}, sorted(times)[len(times) // 2]

    return solve


def case(shape: dict, owner, routing: str, slots: int, min_rows: int, seed: int, reps: int, on_device=None) -> dict:
    import numpy as np
    from rdepc.passes.sampled_routing import source_counts

    from rdepc.ir.balance import imbalance, owner_loads, solve

    name, _, a = routing.partition(":")
    W, T, E, K = (shape[k] for k in "WTEK")
    load = np.asarray(source_counts(W, T, E, K, name, float(a or 0), seed), dtype=np.int64)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan = solve(load, owner, slots, min_rows)
        times.append(time.perf_counter() - t0)
    out = {
        "routing": routing,
        "slots": slots,
        "min_rows": min_rows,
        "before": imbalance(owner_loads(load, owner)),
        "after": imbalance(plan.rank_loads),
        "replicas": int((plan.slots >= 0).sum()),
        "solve_ms": 1e3 * sorted(times)[len(times) // 2],
    }
    if on_device is not None:
        got, ms = on_device(load, reps)
        same = (got["slots"] == plan.slots).all() and (got["cum"] == np.cumsum(plan.split, axis=2)).all()
        out |= {"device_plan_equal": bool(same and (got["loads"][1] == plan.rank_loads).all()), "device_solve_ms": ms}
    return out


def makespans(spec, routing: str, seed: int, hw: str) -> dict:
    """Predicted makespans (µs) of the layer ``spec`` (with ``balance replicate``) under one
    sampled routing: its plan and weight pushes as tasks of the layer; the plan's solve and
    the pushes launched before it (the design the tasks replaced); the layer without
    replication; and the busiest rank's pushes alone."""
    from rdepc.passes.replicate import physical_counts, physical_layer, without_replication
    from rdepc.passes.resolve import build_for
    from rdepc.passes.sampled_routing import source_counts
    from rdepc.passes.schedule import schedule

    from rdepc.ir.balance import push_seconds, slot_elems, solve_seconds

    name, _, a = routing.partition(":")
    W, T, E, K = int(spec.shape.W), spec.shape.T_max, int(spec.shape.E), int(spec.shape.K)
    counts = source_counts(W, T, E, K, name, float(a or 0), seed)
    phys, plan = physical_counts(spec, counts)
    held = [[int(e) for e in row] for row in plan.slots]
    layer = build_for(physical_layer(spec), None, None, hw)
    strategy = layer.geometry.strategy
    tasks = schedule(layer, hw, counts=phys, held=held)
    # the same physical layer without its balance tasks (no balance statement: its slots stay experts)
    bare = schedule(build_for(without_replication(physical_layer(spec)), strategy, None, hw),
                    hw, counts=phys)  # fmt: skip
    geo = layer.geometry
    expert = slot_elems(spec.expert.matrices, geo.H, geo.F, spec.expert.bias) * geo.a
    _, alone = push_seconds(plan.slots, spec.ownership.owner, expert, bare.cost.rates.link, bare.cost.rates.latency)
    plain = schedule(build_for(without_replication(spec), strategy, None, hw), hw, counts=counts)
    us = 1e6
    return {
        "hw": hw,
        "strategy": strategy,
        "pushes_as_tasks_us": tasks.makespan * us,
        "pushes_before_us": (
            bare.makespan + solve_seconds(geo.homes, int((plan.slots >= 0).sum())) + float(alone.max())
        )
        * us,
        "no_replication_us": plain.makespan * us,
        "busiest_pushes_us": float(alone.max()) * us,
        "order": next(d.value for d in tasks.decisions if d.name == "order"),
    }


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = results["shapes"]
    timed = any("timeline" in c for s in shapes for c in s["cases"])
    fig, axes = plt.subplots(1 + timed, len(shapes), figsize=(5.2 * len(shapes), 4 + 4 * timed), squeeze=False)
    for ax, shape in zip(axes[1], shapes, strict=True) if timed else ():
        x = list(range(len(ROUTINGS)))
        for k, n in enumerate(sorted({r["slots"] for r in shape["cases"] if "timeline" in r})):
            tl = [
                next(r["timeline"] for r in shape["cases"] if r["routing"] == ro and r["slots"] == n) for ro in ROUTINGS
            ]
            style = {"color": f"C{k}", "marker": "o"}
            ax.plot(
                x,
                [t["pushes_as_tasks_us"] for t in tl],
                "-",
                label=f"N = {n}: plan and pushes as tasks of the layer",
                **style,
            )
            ax.plot(
                x,
                [t["pushes_before_us"] for t in tl],
                ":",
                label=f"N = {n}: solve and pushes launched before it",
                **style,
            )
        ax.plot(x, [next(r["timeline"] for r in shape["cases"] if r["routing"] == ro and "timeline" in r)
                    ["no_replication_us"] for ro in ROUTINGS], "k-o", label="no replication")  # fmt: skip
        ax.set_xticks(x, ROUTINGS, rotation=30)
        ax.set_ylabel(f"predicted makespan, µs ({results['environment'].get('timeline_hw')})")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    for ax, shape in zip(axes[0], shapes, strict=True):
        rows = shape["cases"]
        x = list(range(len(ROUTINGS)))
        before = [next(r["before"] for r in rows if r["routing"] == ro) for ro in ROUTINGS]
        ax.plot(x, before, "k-o", label="no replication")
        for n in sorted({r["slots"] for r in rows}):
            after = [next(r["after"] for r in rows if r["routing"] == ro and r["slots"] == n) for ro in ROUTINGS]
            ax.plot(x, after, "-o", label=f"N = {n} slot{'s' if n > 1 else ''} per rank")
        ax.axhline(1.05, color="grey", ls=":", lw=1, label="1.05")
        ax.set_xticks(x, ROUTINGS, rotation=30)
        ax.set_yscale("log")  # the balanced lines sit near 1, the unbalanced ones up to 20x
        ax.set_yticks([1, 1.25, 1.5, 2, 3, 5, 10, 20], ["1", "1.25", "1.5", "2", "3", "5", "10", "20"])
        ax.set_ylabel("owner imbalance, max/mean rows (log)")
        ax.set_title(f"{shape['name']}: W={shape['W']} E={shape['E']} K={shape['K']} T'={shape['T']}")
        ax.legend(fontsize=8)
    what = "; makespans predicted by rdepc's cost model" if timed else ""
    fig.suptitle(f"exact-load replication (the solver's NumPy reference), one sampled routing each{what}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="build/balance", help="writes OUT.json and OUT.png")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4], help="redundant slots per rank")
    ap.add_argument("--min-rows", type=int, default=64, help="the fewest rows a replica carries")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5, help="solver runs timed per case (median)")
    ap.add_argument("--device-plan", choices=("cpu", "cuda"), help="also run the generated solver kernel there")
    ap.add_argument("--shapes", nargs="+", choices=[n for n, _ in SHAPES], help="these shapes only")
    ap.add_argument("--timeline", metavar="HW", help="also the predicted makespans on this hardware profile")
    args = ap.parse_args(argv)
    import numpy as np

    env = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "python": platform.python_version()}
    env |= {"numpy": np.__version__, "machine": platform.machine(), "processor": platform.processor()}
    results = {"environment": env, "shapes": []}
    import rdepc

    if args.timeline:
        env["timeline_hw"] = args.timeline
    if args.device_plan == "cuda":
        import torch

        env |= {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, tokens in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        layer = rdepc.load(ROOT / "examples" / f"{name}.rdep", **({"T": tokens} if tokens else {}))
        shape = {k: layer.shapes[k] for k in "WTEK"}
        owner = np.asarray(layer.spec.ownership.owner, dtype=np.int64)
        cases = []
        for n in args.slots:
            on_device = device_solver(shape, n, args.min_rows, args.device_plan) if args.device_plan else None
            for routing in ROUTINGS:
                c = case(shape, owner, routing, n, args.min_rows, args.seed, args.reps, on_device)
                if args.timeline:
                    spec = rdepc.load(ROOT / "examples" / f"{name}.rdep", **({"T": tokens} if tokens else {})).spec
                    spec = dataclasses.replace(spec, balance=Balance("replicate", n, args.min_rows))
                    c["timeline"] = makespans(spec, routing, args.seed, args.timeline)
                cases.append(c)
                dev = ""
                if on_device is not None:
                    same = "equal" if c["device_plan_equal"] else "DIFFERS"
                    dev = f"; device plan {same}, {c['device_solve_ms']:.3f} ms on {args.device_plan}"
                if args.timeline:
                    t = c["timeline"]
                    dev += f"; predicted {t['pushes_as_tasks_us']:,.1f} µs with the plan and pushes as tasks, "
                    dev += f"{t['pushes_before_us']:,.1f} launched before, {t['no_replication_us']:,.1f} without"
                print(f"{name} {routing:9} N={n}: {c['before']:.3f} -> {c['after']:.3f}, "
                      f"{c['replicas']} replicas, solve {c['solve_ms']:.2f} ms{dev}", flush=True)  # fmt: skip
        cases.sort(key=lambda c: (ROUTINGS.index(c["routing"]), c["slots"]))
        results["shapes"].append({"name": name, **shape, "cases": cases})
    write_results(results, Path(args.out), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
