"""The cost model held against the committed GPU measurements: for every profiled method of
every perf record (bench/calibration.py), each stage's predicted span against the measured
one, and the whole call's, with the model evaluated as the leases ran — W ranks emulated on
one GPU (``passes/cost.py: rates("h200/8")``: each rank 1/W of the GPU's SMs, FLOP/s and HBM
bandwidth, a row to a peer one HBM read and write).

    python bench/model_error.py --out bench/results/model-error      # JSON and a plot
    python bench/model_error.py --out build/me --only moonlight/128   # a subset (CI's dry run)

Writes ``OUT/model-error.json`` (per row: the case, the method, per stage measured ms,
predicted ms and their ratio; the call's; the summary: each stage's ratios' range; under
``current``, the newest row of each case and method (:func:`current`) held to :data:`BOUND`
by :func:`replay`, every comparison outside it a named gap (:data:`GAPS`) or unexplained; the
rankings: per record, case and mode, the strategies in measured order beside the model's) and
``OUT/model-error.png`` (the current rows' predicted against measured, log-log, per stage).
tests/test_bench.py replays the same comparisons in CI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROFILE = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100"}  # device name -> hardware profile
STAGES = ("route", "scan", "dispatch", "compute", "return", "combine")


def predict(example: str, T: int, W: int, strategy: str, mode: str, hw: str, cache: dict) -> dict:
    """{stage: predicted span ms} (its first task's start to its last one's end, every rank),
    and ``call``: the makespan plus the host's part (``passes.hardware.host_seconds`` of the
    W·T'·K rows the one process checks), of ``example`` at T' = ``T`` under ``strategy`` in
    kernel ``mode`` on ``W`` ranks emulated on one GPU of profile ``hw``. Bulk in split mode
    runs on the schedule's kernel split; unified and phased on every program."""
    key = (example, T, W, strategy, mode == "split", hw)
    if key not in cache:
        from rdepc.passes.hardware import host_seconds
        from rdepc.passes.resolve import build_for
        from rdepc.passes.schedule import schedule

        import rdepc

        emulated = f"{hw}/{W}"
        spec = rdepc.load(ROOT / "examples" / f"{example}.rdep", T=T, W=W).spec
        tg = build_for(spec, strategy, None, emulated)
        sched = schedule(tg, emulated)
        if mode == "split" and sched.unified:
            sched = schedule(tg, emulated, comm=sched.kernel_split[0])
        host = host_seconds(W * T * tg.geometry.K)
        cache[key] = {name: t * 1e3 for name, t in sched.stage_spans().items()} | {
            "call": (sched.makespan + host) * 1e3
        }
    return cache[key]


def compare(rows, only: list[str] | None = None) -> list[dict]:
    """Per profiled row: its case and method, and per stage (and the call) measured and
    predicted ms and predicted / measured."""
    cache: dict = {}
    out = []
    for r in rows:
        case = f"{r.example}/{r.T}/{r.routing}"
        if not r.stages or r.device not in PROFILE or (only and not any(o in case for o in only)):
            continue
        pred = predict(r.example, r.T, r.W, r.strategy, r.mode, PROFILE[r.device], cache)
        measured = {s: r.stages[s] for s in STAGES if s in r.stages} | {"call": r.call_ms}
        out.append(
            {
                "source": r.source,
                "commit": r.commit,
                "device": r.device,
                "case": case,
                "method": f"{r.strategy} {r.mode}" + (" library" if r.gemm == "library" else ""),
                "stages": {
                    s: {
                        "measured_ms": m,
                        "predicted_ms": pred.get(s),
                        "predicted_over_measured": None if not pred.get(s) or not m else pred[s] / m,
                    }
                    for s, m in measured.items()
                },
            }
        )
    return out


def current(rows) -> list:
    """Of every (device, case, method), the newest record's row (records in path order: a
    lease's directory is named by its date): the kernels the model describes today. Older
    rows stay in the table as the history of what changed."""
    latest = {}
    for r in rows:
        latest[(r.device, r.example, r.T, r.W, r.routing, r.strategy, r.mode, r.gemm)] = r
    return list(latest.values())


# How far a prediction may stray from a measured span (issue: each stage within 25 %, the
# call within 20 %), and what the model is known not to explain yet: per (method, stage), or
# (case, method, stage) for one case, why. ``replay`` holds every other comparison of the
# current rows to the bound, and each gap to being one still (a gap closed leaves the table).
BOUND = {"call": 0.20} | dict.fromkeys(STAGES, 0.25)
_UNIFIED = (
    "the unified kernel's GEMMs run at 0.40–0.52 of the split kernel's measured rate the model charges (13.3–17.1 ms "
    "against 9.0 for moonlight); charging that alone would rank pipelined first on the emulation, where it measured "
    "1.27× slower (its own cost is the next gap)"
)
_PIPELINED = (
    "measured, a segmented call on one GPU takes about the sum of its stages (moonlight 16.9 ms on the device against "
    "15.9 of the model's stage times, which the model's timeline overlaps into 11.3): what keeps the roles from "
    "overlapping is not in the model, and no profiled lease recorded the per-program waits that would say"
)
GAPS: dict[tuple[str, ...], str] = {
    ("ranking", "split"): (
        "in split mode bulk measured fastest (14.8–18.6 ms against pipelined's 18.9–29.9) and the model ranks "
        "pipelined first (13.4 against 15.7): " + _PIPELINED
    ),
    (
        "scan",
    ): "the scan takes 19–70 µs where the model charges two barrier sweeps (1.2 µs): its table work is not costed",
    ("bulk split", "return"): (
        "split mode's returns move each m-tile's rows as GEMM2 finishes it (the span is the GEMMs'); the model's "
        "return waits for the owner's whole segment"
    ),
    **{("bulk unified", s): _UNIFIED for s in ("dispatch", "compute", "return", "combine", "call")},
    **{(m, s): _PIPELINED for m in ("pipelined split", "deep split") for s in (*STAGES[2:], "call")},
    ("qwen3_30b_a3b/4096/uniform", "bulk split", "compute"): (
        "0.75: the GEMM's efficiency is measured on moonlight's tile shape (F 1,408) only; qwen3's F 768 ran slower"
    ),
    ("qwen3_30b_a3b/4096/uniform", "bulk split", "combine"): (
        "0.46: qwen3's K 8 combine reads 8 rows a token; the model's bytes say 0.81 ms, measured 1.75"
    ),
    **{
        ("moonlight/128/uniform", "bulk split", s): (
            "T' 128: stages of 0.03–0.6 ms, where fixed costs per launch and per flag the model does not charge weigh"
        )
        for s in ("dispatch", "compute", "combine", "call")
    },
}


def gap(case: str, method: str, stage: str) -> tuple[str, ...] | None:
    """The key of :data:`GAPS` that names ``stage`` of ``method`` on ``case`` a known gap of the
    model (the case's own, the method's, then the stage's), or None."""
    return next((k for k in ((case, method, stage), (method, stage), (stage,)) if k in GAPS), None)


def gap_note(*key: str) -> str:
    return ": a known gap" if key in GAPS else ""


def replay(compared: list[dict]) -> dict[str, list]:
    """Each comparison of ``compared`` (the current rows): ``holds`` (within :data:`BOUND`),
    ``gap`` (outside it, a known gap: :data:`GAPS`) or ``fails`` (outside it, no gap named);
    ``closed``: the gaps no comparison is outside the bound for any more."""
    out: dict[str, list] = {"holds": [], "gap": [], "fails": []}
    open_gaps = set()
    for c in compared:
        for stage, v in c["stages"].items():
            x = v["predicted_over_measured"]
            key = gap(c["case"], c["method"], stage)
            entry = (c["case"], c["method"], stage, x)
            if x is not None and abs(x - 1) <= BOUND[stage]:
                out["holds"].append(entry)
            else:
                out["gap" if key else "fails"].append(entry)
                if key:
                    open_gaps.add(key)
    out["closed"] = [k for k in GAPS if k not in open_gaps and k[0] != "ranking"]  # rankings: rankings()
    return out


# Two strategies measured within this share of each other are a tie the model may rank either
# way: one method's median moved by up to 9 % between records at the smallest case
# (moonlight/128 pipelined split: 2.43 ms at 2d97c02, 2.66 ms at 46c6da4).
TIE = 0.10


def rankings(rows, only: list[str] | None = None) -> list[dict]:
    """Per perf record and case, per kernel mode and lowering that timed two strategies or
    more: the strategies in measured order, the model's predicted calls for them, and whether
    the model's fastest is the measured fastest (``tie``: the measured fastest is within
    :data:`TIE` of the next one)."""
    cache: dict = {}
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        case = f"{r.example}/{r.T}/{r.routing}"
        if r.device in PROFILE and r.call_ms and not (only and not any(o in case for o in only)):
            key = (r.source, r.example, r.T, r.W, r.routing, r.mode, r.gemm, PROFILE[r.device])
            groups.setdefault(key, {})[r.strategy] = r.call_ms
    out = []
    for (source, example, T, W, routing, mode, gemm, hw), measured in groups.items():
        if len(measured) < 2:
            continue
        order = sorted(measured, key=measured.get)
        pred = {s: predict(example, T, W, s, mode, hw, cache)["call"] for s in order}
        out.append(
            {
                "source": source,
                "case": f"{example}/{T}/{routing}",
                "mode": mode + (" library" if gemm == "library" else ""),
                "measured_ms": {s: measured[s] for s in order},
                "predicted_ms": pred,
                "model_fastest": min(pred, key=pred.get),
                "tie": measured[order[1]] < (1 + TIE) * measured[order[0]],
                "agrees": min(pred, key=pred.get) == order[0],
            }
        )
    return out


def summary(compared: list[dict]) -> dict:
    """Per stage (and the call): how many rows, and the predicted / measured ratios' range."""
    out = {}
    for s in (*STAGES, "call"):
        ratios = [c["stages"][s]["predicted_over_measured"] for c in compared if s in c["stages"]]
        ratios = [x for x in ratios if x is not None]
        if ratios:
            out[s] = {"rows": len(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def plot(compared: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for s in (*STAGES, "call"):
        pts = [(c["stages"][s]["measured_ms"], c["stages"][s]["predicted_ms"]) for c in compared if s in c["stages"]]
        pts = [p for p in pts if p[0] and p[1]]
        if pts:
            ax.scatter(*zip(*pts, strict=True), label=s, s=18)
    lo, hi = 1e-3, 1e2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    for f in (0.75, 1.25):
        ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.6)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms", ylabel="predicted ms")
    ax.set_title("cost model against the newest lease of each case and method (±25 % dotted)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the directory for model-error.json and model-error.png")
    ap.add_argument("--only", action="append", help="cases whose EXAMPLE/T'/ROUTING contains this (repeatable)")
    args = ap.parse_args(argv)
    from bench.calibration import load

    compared = compare(load(), args.only)
    now = compare(current(load()), args.only)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"profile": "W ranks emulated on one GPU (passes/cost.py rates NAME/W)", "rows": compared}
    record["summary"] = summary(compared)
    record["current"] = {"summary": summary(now), "replay": replay(now), "bound": BOUND}
    record["gaps"] = {" / ".join(k): why for k, why in GAPS.items()}
    record["rankings"] = rankings(load(), args.only)
    (out / "model-error.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    plot(now, out / "model-error.png")
    for s, v in record["current"]["summary"].items():
        print(f"{s:9s} {v['rows']:3d} rows  predicted / measured {v['min']:.3g} to {v['max']:.3g}")
    verdicts = record["current"]["replay"]
    held, known, unexplained = (len(verdicts[k]) for k in ("holds", "gap", "fails"))
    print(f"within the bound: {held}; known gaps: {known}; unexplained: {unexplained}")
    for case, method, stage, x in verdicts["fails"]:
        print(f"  OUTSIDE {case} {method} {stage}: predicted / measured {x:.3g}")
    for k in record["rankings"]:
        verdict = "agrees" if k["agrees"] else "a tie" if k["tie"] else "disagrees" + gap_note("ranking", k["mode"])
        order = " < ".join(k["measured_ms"])
        print(f"{k['case']} {k['mode']}: measured {order}; model's fastest {k['model_fastest']} ({verdict})")
    return 0


if __name__ == "__main__":
    sys.path.append(str(ROOT))  # `from bench import ...` as a script
    sys.exit(main())
