"""Pictures of a schedule: Chrome/Perfetto trace JSON, a Gantt chart, and the graph as DOT.

``rdepc viz FILE --trace out.json --png out.png --dot out.dot``. This module imports
neither torch nor triton; matplotlib is imported only to draw the PNG.

* Trace: one complete event (``ph: "X"``) per task that takes time, ``pid`` = rank,
  ``tid`` = the rank's communication or compute programs, ``ts``/``dur`` in µs, the stage
  as the first word of the name (``route``, ``scan``, ``dispatch``, ``compute``, ``return``,
  ``combine``) and the segment, slot, rows, owner and source in ``args``. Open it in
  https://ui.perfetto.dev or chrome://tracing.
* PNG: per rank, one row for its communication programs and one for its compute programs;
  bars coloured by stage, compute bars labelled with their segment, exposed transport (data
  moving while nothing computes) marked in red, and the bulk schedule's makespan as a
  dashed line when given.
* DOT: the hierarchical graph, one cluster per rank, buffer-reuse (write-after-read) edges
  dashed red; with ``full`` the tile-level expansion (small specs only).
"""

from __future__ import annotations

import json
from pathlib import Path

from rdepc.ir.graph import Schedule, TaskGraph
from rdepc.ir.trace import rank_metadata

STAGE_COLORS = {
    "plan": "#bcbd22",
    "route": "#8c8c8c",
    "scan": "#9467bd",
    "dispatch": "#1f77b4",
    "gemm1": "#ff7f0e",
    "gemm2": "#ffbb78",
    "return": "#2ca02c",
    "unpack": "#17becf",
    "combine": "#8c564b",
    "push": "#e377c2",
    "receive": "#f7b6d2",
}
STAGE_WORDS = {
    "plan": "plan: the loads exchanged, the replication plan solved, rows rerouted",
    "route": "route: order each rank's token rows by owner",
    "scan": "scan: owners agree on exact write offsets",
    "dispatch": "dispatch: send rows to the GPU owning their expert",
    "gemm1": "GEMM1: gate and up projection, activation fused",
    "gemm2": "GEMM2: down projection",
    "return": "return: send expert outputs back",
    "unpack": "unpack: free a return slot (copy rows out)",
    "combine": "combine: gate-weighted sum per token",
    "push": "push: a home's hot experts' weights into their replicas' slots",
    "receive": "receive: a rank's slots copied in once every push has landed",
}


def _color_key(t) -> str:
    return _key(t.stage, t.detail)


def _key(stage: str, detail: str) -> str:
    if detail in ("load", "solve", "reroute"):  # balance replicate's plan, one colour
        return "plan"
    return detail if detail in ("unpack", "gemm1", "gemm2", "push", "receive") else stage


def _tid(sched: Schedule, t) -> int:
    return 0 if sched.unified or t.role == "comm" else 1


def trace(sched: Schedule, empty: bool = False) -> dict:
    """The predicted schedule as Chrome trace-event JSON (a dict)."""
    tg = sched.graph
    if sched.unified:
        names = [(0, f"all programs ({sched.programs[0]})")]
    else:
        names = [(0, f"communication ({sched.programs[0]} programs)"), (1, f"compute ({sched.programs[1]} programs)")]
    events = rank_metadata(tg.geometry.W, names)
    rows = sched.cost.rows
    skipped = 0
    for i, u in enumerate(sched.order):
        t = tg.tasks[u]
        dur = sched.end[u] - sched.start[u]
        if dur <= 0 and not empty:
            skipped += 1
            continue
        args = {"task": u, "index": i, "rows": rows[u], "rows_bound": t.rows}
        for key in ("segment", "slot", "claim", "owner", "src"):
            v = getattr(t, key)
            if v >= 0:
                args["source" if key == "src" else key] = v
        if t.detail:
            args["detail"] = t.detail
        if t.empty_if:
            args["empty_if"] = t.empty_if
        events.append(
            {
                "name": t.name,
                "cat": t.stage,
                "ph": "X",
                "pid": t.rank,
                "tid": _tid(sched, t),
                "ts": sched.start[u] * 1e6,
                "dur": dur * 1e6,
                "args": args,
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "layer": sched.layer,
            "strategy": sched.strategy,
            "cut": sched.cut,
            "S": sched.S,
            "B": sched.B,
            "hw": sched.hw,
            "programs": list(sched.programs),
            "makespan_us": sched.makespan * 1e6,
            "exposed_transport_us": sched.exposed_max * 1e6,
            "tasks": len(sched.order),
            "tasks_not_shown_empty": skipped,
            "decisions": [f"{d.name} = {d.value} ({d.why})" for d in sched.decisions],
        },
    }


def write_trace(sched: Schedule, path: str | Path, empty: bool = False) -> Path:
    path = Path(path)
    path.write_text(json.dumps(trace(sched, empty)), encoding="utf-8")
    return path


def _shown_ranks(sched: Schedule, limit: int) -> list[int]:
    W = len(sched.transport)
    if limit >= W:
        return list(range(W))
    load = sorted(range(W), key=lambda r: (-(sched.transport[r] + sched.compute[r]), r))
    # rank 0, the least loaded, then the busiest: exactly ``limit`` distinct ranks
    keep = dict.fromkeys([0, load[-1], *load])
    return sorted(list(keep)[:limit])


def _exposed_intervals(sched: Schedule, r: int) -> list[tuple[float, float]]:
    tg = sched.graph
    comm, comp = [], []
    for t in tg.tasks:
        if t.rank != r:
            continue
        s, e = sched.start[t.id], sched.end[t.id]
        if e > s:
            (comm if t.role == "comm" else comp).append((s, e))
    out = []
    comp.sort()
    for s, e in sorted(comm):
        cur = s
        for cs, ce in comp:
            if ce <= cur:
                continue
            if cs >= e:
                break
            if cs > cur:
                out.append((cur, cs))
            cur = max(cur, ce)
            if cur >= e:
                break
        if cur < e:
            out.append((cur, e))
    return out


def write_png(
    sched: Schedule,
    path: str | Path,
    bulk: Schedule | None = None,
    max_ranks: int = 8,
    dpi: int = 130,
    unreplicated: Schedule | None = None,
) -> Path:
    """A Gantt chart of the predicted schedule (matplotlib, imported here only); ``bulk`` and
    ``unreplicated`` (a ``balance replicate`` layer's schedule without its replicas) are
    drawn as a line at their makespan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = _shown_ranks(sched, max_ranks)
    lanes = [(r, None) for r in ranks] if sched.unified else [(r, role) for r in ranks for role in ("comm", "compute")]
    lane_of = {key: i for i, key in enumerate(lanes)}
    us = 1e6
    layer_span = max(sched.makespan, bulk.makespan if bulk else 0.0) * us
    span = max(layer_span, unreplicated.makespan * us if unreplicated else 0.0)
    span = span or 1.0
    fig_h = 2.6 + 0.42 * len(lanes)
    fig, ax = plt.subplots(figsize=(13, fig_h))
    used = _draw_runs(ax, sched, ranks, lane_of, span)
    for r in ranks:
        lane = lane_of[(r, None if sched.unified else "comm")]
        for s, e in _exposed_intervals(sched, r):
            s, e = s * us, e * us
            ax.plot([s, e], [lane + 0.43, lane + 0.43], color="#d62728", linewidth=2.2, solid_capstyle="butt")
    _draw_makespans(ax, sched, bulk, unreplicated)
    _label_axes(ax, sched, lanes, ranks, span)
    present = [k for k in STAGE_COLORS if k in used]
    handles = [Patch(color=STAGE_COLORS[k], label=STAGE_WORDS[k]) for k in present]
    handles.append(
        matplotlib.lines.Line2D([], [], color="#d62728", linewidth=2.2, label="exposed: data moves, nothing computes")
    )
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.62 / fig_h, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def _draw_runs(ax, sched: Schedule, ranks: list[int], lane_of: dict, span: float) -> set[str]:
    """One bar per run of back-to-back tasks of one stage and segment on one lane, so that a
    segment's dispatch to eight owners reads as one block; the stages drawn."""
    us = 1e6
    per_lane: dict[int, list] = {}
    for t in sched.graph.tasks:
        if t.rank not in ranks:
            continue
        s, e = sched.start[t.id] * us, sched.end[t.id] * us
        if e <= s:
            continue
        lane = lane_of[(t.rank, None if sched.unified else t.role)]
        seg = t.segment if t.stage != "combine" or t.detail == "unpack" else -1
        per_lane.setdefault(lane, []).append([s, e, _color_key(t), seg])
    gap = span * 1e-3
    used: set[str] = set()
    for lane, items in per_lane.items():
        items.sort()
        runs: list[list] = []
        for it in items:
            last = runs[-1] if runs else None
            if last and last[2] == it[2] and last[3] == it[3] and it[0] - last[1] <= gap:
                last[1] = max(last[1], it[1])
            else:
                runs.append(list(it))
        for s, e, key, seg in runs:
            used.add(key)
            ax.barh(lane, e - s, left=s, height=0.72, color=STAGE_COLORS[key], edgecolor="white", linewidth=0.4)
            gemm = key in ("gemm1", "gemm2")
            if seg >= 0 and e - s > span * (0.03 if gemm else 0.022):
                label = f"seg {seg}" if gemm else f"s{seg}"
                color = "black" if gemm or key == "unpack" else "white"
                ax.text((s + e) / 2, lane, label, ha="center", va="center", fontsize=7, color=color)
    return used


def _draw_makespans(ax, sched: Schedule, bulk: Schedule | None, unreplicated: Schedule | None) -> None:
    """Each makespan as a vertical line with its label."""
    us = 1e6
    # (time, label, label height, colour, line style)
    marks = [(sched.makespan * us, "this schedule", -0.62, "#555555", ":")]
    if bulk is not None and bulk is not sched:
        marks.append((bulk.makespan * us, "bulk, no overlap", -1.1, "black", "--"))
    if unreplicated is not None:
        marks.append((unreplicated.makespan * us, "without replication", -0.86, "#9467bd", "--"))
    for at, what, y, color, style in marks:
        ax.axvline(at, color=color, linestyle=style, linewidth=1)
        ax.text(at, y, f"{what}: {at:,.0f} µs  ", ha="right", va="center", fontsize=8, color=color)


def _label_axes(ax, sched: Schedule, lanes: list, ranks: list[int], span: float) -> None:
    """The lanes' names, the time axis and the title: the schedule, its segments and programs."""
    us = 1e6
    labels = [
        f"rank {r}" if role is None else f"rank {r} · {'send/receive' if role == 'comm' else 'compute'}"
        for r, role in lanes
    ]
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_ylim(len(lanes) - 0.4, -1.4)
    ax.set_xlim(0, span * 1.02)
    ax.set_xlabel("time (µs, predicted by rdepc's cost model)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5, alpha=0.6)
    shown = "" if len(ranks) == len(sched.transport) else f"; ranks shown {ranks} of {len(sched.transport)}"
    progs = (
        f"all {sched.programs[0]} programs per GPU do every stage in turn"
        if sched.unified
        else f"{sched.programs[0]} programs per GPU send/receive while {sched.programs[1]} compute"
    )
    progs += f" (split mode: {sched.kernel_split[0]} transport + {sched.kernel_split[1]} GEMM kernel programs)"
    ax.set_title(
        f"{sched.layer} MoE layer, {sched.strategy} schedule on {sched.hw}: "
        f"predicted {sched.makespan * us:,.0f} µs"
        f", exposed transport {sched.exposed_max * us:,.0f} µs\n"
        f"segments of S={sched.S} rows, B={sched.B} buffers, cut by {sched.cut}; {progs}{shown}",
        fontsize=10,
    )


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def dot(tg: TaskGraph, sched: Schedule | None = None, level: str = "stages") -> str:
    """The graph in Graphviz DOT: one cluster per rank; write-after-read edges dashed red.
    ``level``: ``stages`` (default) one node per (rank, stage, segment) — a large layer's
    thousands of tasks fold into what a person can read; ``tasks`` every task;
    ``tiles`` the tile-level graph (see :func:`rdepc.passes.tasks.expand_tiles`)."""
    if level not in DOT_LEVELS:
        raise ValueError(f"unknown --dot level '{level}' (known: {', '.join(DOT_LEVELS)})")
    lines = [f"digraph {_q(tg.layer)} {{", "  rankdir=LR;", "  node [shape=box, style=filled, fontsize=9];"]
    if level == "tiles":
        return _dot_tiles(tg, lines)
    group = {t.id: (t.rank, _color_key(t), t.segment) if level == "stages" else t.id for t in tg.tasks}
    members: dict = {}
    for t in tg.tasks:
        members.setdefault(group[t.id], []).append(t)
    node = {g: i for i, g in enumerate(members)}
    by_rank: dict[int, list] = {}
    for g, ts in members.items():
        by_rank.setdefault(ts[0].rank, []).append(g)
    for r, groups in sorted(by_rank.items()):
        lines.append(f"  subgraph cluster_r{r} {{ label={_q(f'rank {r}')};")
        for g in groups:
            ts = members[g]
            t = ts[0]
            if level == "tasks":
                head = t.name
            else:
                seg = f" s{t.segment}" if t.segment >= 0 else ""
                kind = {"unpack": "combine unpack", "combine": "combine"}.get(_color_key(t), _color_key(t))
                head = f"{kind}{seg} r{t.rank}"
                head += f" ({len(ts)} tasks)" if len(ts) > 1 else ""
            extra = ""
            if sched is not None:
                extra = f"\\n{(max(sched.end[u.id] for u in ts) - min(sched.start[u.id] for u in ts)) * 1e6:.1f} µs"
            label = f"{head}\\nrows<={sum(u.rows for u in ts)} tiles<={sum(u.tiles for u in ts)}{extra}"
            lines.append(f'    t{node[g]} [label="{label}", fillcolor={_q(STAGE_COLORS[_color_key(t)])}];')
        lines.append("  }")
    edges: dict[tuple, bool] = {}  # (from, to) -> every edge folded into it is write-after-read
    for t in tg.tasks:
        war = set(t.war)
        for d in t.deps:
            key = (node[group[d]], node[group[t.id]])
            if key[0] != key[1]:
                edges[key] = edges.get(key, True) and d in war
    for (u, v), war in edges.items():
        lines.append(f"  t{u} -> t{v}{WAR_EDGE if war else ''};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_tiles(tg: TaskGraph, lines: list[str]) -> str:
    from rdepc.passes.tasks import expand_tiles

    g = expand_tiles(tg)
    ids = {n: i for i, n in enumerate(g.nodes)}
    by_rank: dict[int, list] = {}
    for n, a in g.nodes(data=True):
        by_rank.setdefault(a["rank"], []).append((n, a))
    for r, items in sorted(by_rank.items()):
        lines.append(f"  subgraph cluster_r{r} {{ label={_q(f'rank {r}')};")
        for n, a in items:
            shape = ", shape=point" if a["kind"] == "flag" else ""
            color = STAGE_COLORS[_key(a["stage"], a["detail"])]
            lines.append(f"    n{ids[n]} [label={_q(a['name'])}, fillcolor={_q(color)}{shape}];")
        lines.append("  }")
    for u, v, a in g.edges(data=True):
        lines.append(f"  n{ids[u]} -> n{ids[v]}{WAR_EDGE if a.get('kind') == 'war' else ''};")
    lines.append("}")
    return "\n".join(lines) + "\n"


DOT_LEVELS = ("stages", "tasks", "tiles")
WAR_EDGE = ' [style=dashed, color="#d62728"]'


def write_dot(tg: TaskGraph, path: str | Path, sched: Schedule | None = None, level: str = "stages") -> Path:
    path = Path(path)
    path.write_text(dot(tg, sched, level), encoding="utf-8")
    return path


__all__ = ["DOT_LEVELS", "STAGE_COLORS", "dot", "trace", "write_dot", "write_png", "write_trace"]
