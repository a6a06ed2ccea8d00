"""Schedule pictures: the Chrome/Perfetto trace, the Gantt chart, the DOT graph, the ``viz``
command, and ``compile --dump-after`` / ``--time-passes`` over the scheduling passes."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_segmented
from rdepc.passes.resolve import build_for
from rdepc.passes.schedule import schedule

import rdepc
from rdepc import viz
from rdepc.cli import main as cli_main
from rdepc.driver import Options, compile_file
from rdepc.ir.graph import STAGES


@pytest.fixture(scope="module")
def moonlight():
    spec = rdepc.load(ROOT / "examples/moonlight.rdep").spec
    return schedule(build_for(spec, hw="b200"), "b200")


def test_trace_events(moonlight):
    tr = viz.trace(moonlight)
    json.dumps(tr)  # plain JSON
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in tr["traceEvents"] if e["ph"] == "M"]
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == {f"rank {r}" for r in range(8)}
    threads = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert "communication (30 programs)" in threads or any(n.startswith("communication") for n in threads)
    assert len(xs) + tr["otherData"]["tasks_not_shown_empty"] == len(moonlight.order)
    tasks = moonlight.graph.tasks
    for e in xs:
        t = tasks[e["args"]["task"]]
        assert e["name"].split()[0] == (t.detail if t.stage in ("compute", "balance") else t.stage)
        assert t.stage in STAGES
        assert e["pid"] == t.rank and e["tid"] == (0 if t.role == "comm" else 1)
        assert e["ts"] == pytest.approx(moonlight.start[t.id] * 1e6)
        assert e["dur"] == pytest.approx((moonlight.end[t.id] - moonlight.start[t.id]) * 1e6)
        if t.segment >= 0:
            assert e["args"]["segment"] == t.segment
    assert {e["cat"] for e in xs} == set(STAGES) - {"balance"}  # no balance statement: no balance tasks
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(moonlight.makespan * 1e6)
    assert tr["otherData"]["exposed_transport_us"] == pytest.approx(moonlight.exposed_max * 1e6)


def test_dot_marks_buffer_reuse_edges(tmp_path):
    spec = rdepc.load(tiny_segmented(tmp_path)).spec
    sched = schedule(build_for(spec, "pipelined"), "h100")
    text = viz.dot(sched.graph, sched, level="tasks")
    assert text.startswith('digraph "tiny"') and text.rstrip().endswith("}")
    n_edges = sum(len(t.deps) for t in sched.graph.tasks)
    assert text.count(" -> ") == n_edges
    assert text.count("style=dashed") == sum(len(t.war) for t in sched.graph.tasks) > 0
    assert text.count("subgraph cluster_r") == 4
    full = viz.dot(sched.graph, level="tiles")
    assert full.count(" -> ") > n_edges


def test_dot_folds_tasks_into_rank_stage_segment_by_default(moonlight):
    """Moonlight's task graph has thousands of tasks; the default drawing has one node per
    (rank, stage, segment), and every task edge between two such nodes is one edge."""
    tasks = moonlight.graph.tasks

    def group(t):
        return (t.rank, viz._color_key(t), t.segment)

    text = viz.dot(moonlight.graph, moonlight)
    assert text.count("[label=") == len({group(t) for t in tasks}) < len(tasks) // 5
    assert 'label="dispatch s0 r0 (8 tasks)' in text and 'label="route r0\\nrows<=' in text
    edges = {(group(tasks[d]), group(t)) for t in tasks for d in t.deps if group(tasks[d]) != group(t)}
    assert text.count(" -> ") == len(edges)
    assert len(text) < len(viz.dot(moonlight.graph, moonlight, level="tasks")) // 2
    with pytest.raises(ValueError, match="unknown --dot level 'all'"):
        viz.dot(moonlight.graph, level="all")


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "rdepc.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_viz_command_writes_all_three(tmp_path):
    out = {k: tmp_path / f"m.{k}" for k in ("json", "png", "dot")}
    code = (
        "import sys; from rdepc.cli import main; "
        f"rc = main(['viz', 'examples/moonlight.rdep', '--hw', 'b200', '--trace', {str(out['json'])!r}, "
        f"'--dot', {str(out['dot'])!r}]); "
        "assert rc == 0; "
        "bad = [m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules]; "
        "assert not bad, bad"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "pipelined schedule" in p.stdout and f"wrote {out['json']}" in p.stdout
    assert json.loads(out["json"].read_text())["otherData"]["strategy"] == "pipelined"
    p = run("viz", "examples/moonlight.rdep", "--hw", "b200", "--png", out["png"])
    assert p.returncode == 0, p.stderr
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bulk" in p.stdout and "for comparison" in p.stdout


def test_viz_schedule_override_and_errors(tmp_path, capsys):
    assert cli_main(["viz", "examples/moonlight.rdep", "--schedule", "bulk"]) == 0
    assert "bulk schedule" in capsys.readouterr().out
    assert cli_main(["viz", "examples/moonlight.rdep", "--dot", str(tmp_path / "x.dot"), "--full"]) == 2
    assert "--full: the tile graph would have" in capsys.readouterr().err
    assert cli_main(["viz", "examples/tiny.rdep", "--trace", str(tmp_path / "no" / "x.json")]) == 1


def test_viz_routing_predicts_a_sampled_routing(tmp_path, capsys, monkeypatch):
    """--routing zipf:A: the rows per (source, expert) are the sample plan takes (same
    stream, same totals), the trace is the skewed routing's — a longer makespan than the
    expected routing's — and the same seed gives the same picture."""
    from rdepc.passes.sampled_routing import sample_routing, source_counts

    counts = source_counts(8, 64, 16, 4, "zipf", 1.2, 3)
    assert len(counts) == 8 and all(sum(row) == 64 * 4 for row in counts)
    total, _ = sample_routing(8, 64, 16, 4, "zipf", 1.2, 3, [e // 2 for e in range(16)])
    assert [sum(c) for c in zip(*counts, strict=True)] == total.tolist()

    monkeypatch.chdir(ROOT)

    def makespan(*extra: str) -> tuple[float, str]:
        path = tmp_path / f"t{len(extra)}.json"
        assert cli_main(["viz", "examples/moonlight.rdep", "--trace", str(path), *extra]) == 0
        out = capsys.readouterr().out
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        return max(e["ts"] + e["dur"] for e in events), out

    expected, out = makespan()
    assert "routing:" not in out
    skewed, out = makespan("--routing", "zipf:1.2", "--seed", "1")
    assert "routing: zipf alpha=1.2, seed 1, one sampled routing (rows per expert" in out
    assert skewed > 2 * expected
    assert makespan("--routing", "zipf:1.2", "--seed", "1") == (skewed, out)
    with pytest.raises(SystemExit) as usage:  # argparse's own usage error
        cli_main(["viz", "examples/moonlight.rdep", "--routing", "zipf"])
    assert usage.value.code == 2 and "expected uniform or zipf:ALPHA" in capsys.readouterr().err


def test_compile_dumps_and_times_every_pass():
    out = io.StringIO()
    dumps = ("graph", "cost", "schedule", "memplan")
    opts = Options(dump_after=dumps, time_passes=True, schedule="pipelined")
    r = compile_file(ROOT / "examples/tiny.rdep", opts, out)
    text = out.getvalue()
    for name in dumps:
        assert f"// ----- IR after {name}" in text
    assert "// graph of layer tiny: pipelined" in text
    assert "// cost model on h100" in text
    assert "// symmetric heap of layer tiny" in text
    timings = text.split("// pass timings")[1]
    for name in ("parse", "elaborate", *dumps):
        assert f"//   {name}" in timings
    assert r.outputs["memplan"].regions()["total"] > 0
    assert r.outputs["schedule"].strategy == "pipelined"


def test_compile_cli_accepts_schedule_options(tmp_path, capsys):
    args = ["compile", "examples/tiny.rdep", "-o", str(tmp_path), "--schedule", "bulk", "--hw", "b200"]
    rc = cli_main([*args, "--dump-after", "schedule"])
    assert rc == 0
    assert "layer tiny: bulk schedule" in capsys.readouterr().out


@pytest.mark.parametrize("limit", range(1, 10))
@pytest.mark.parametrize("transport", [[5, 4, 3, 2, 1, 6, 7, 8], [9, 4, 3, 2, 1, 6, 7, 8], [1] * 8])
def test_png_ranks_shows_exactly_n(limit, transport):
    """Regression: --ranks 2 and 3 drew one or two ranks, 7 drew five (rank 0 or the least
    loaded rank counted among the busiest). Shown: rank 0, the least loaded, the busiest."""

    class Loads:
        compute = [0] * 8

    Loads.transport = transport
    shown = viz._shown_ranks(Loads, limit)
    assert len(shown) == len(set(shown)) == min(limit, 8) and shown == sorted(shown) and shown[0] == 0
    least = max(r for r in range(8) if transport[r] == min(transport))
    busiest = [r for r in sorted(range(8), key=lambda r: (-transport[r], r)) if r not in (0, least)]
    assert limit < 2 or least in shown
    assert set(busiest[: max(0, limit - 2)]) <= set(shown)
