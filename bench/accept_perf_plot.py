"""The perf stage's picture (bench/acceptance.py --plot): per case, each method's forward and
forward+backward time, rdepc's best beside the baselines, and the best's stages."""

from __future__ import annotations

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
