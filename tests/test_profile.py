"""``rdepc run --profile``: the measured timeline as Chrome trace JSON, in the shape of the
predicted one (``rdepc viz --trace``), and in an order that respects the task graph."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
from conftest import ROOT, tiny_segmented
from rdepc.runtime.profile import measured_trace

import rdepc
from rdepc import cli, viz
from rdepc.driver import generate_spec
from rdepc.ir.contract import COLUMNS

TINY = ROOT / "examples" / "tiny.rdep"
COL = {c: i for i, c in enumerate(COLUMNS)}


@pytest.fixture(autouse=True, scope="module")
def _no_color(module_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NO_COLOR", "1")
        yield


def cli_main(*argv: str) -> tuple[int, str, str]:
    """rdepc.cli.main in-process: (status, stdout, stderr), never a traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(list(argv))
        except SystemExit as e:
            status = e.code
    assert "Traceback" not in out.getvalue() + err.getvalue()
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module", params=["bulk", "pipelined"])
def profiled(request, tmp_path_factory):
    """tiny run once per schedule with --profile: (schedule, stdout, trace, kernel contract, predicted schedule)."""
    strategy = request.param
    where = tmp_path_factory.mktemp("profile")
    path = where / "p.json"
    spec = TINY if strategy == "bulk" else tiny_segmented(where)  # pipelined: 4 segments per owner
    status, out, err = cli_main("run", str(spec), "--schedule", strategy, "--profile", str(path), "--check")
    assert status == 0, out + err
    trace = json.loads(path.read_text(encoding="utf-8"))
    layer = rdepc.load(spec)
    plan = layer.compile(schedule=strategy).kernel  # the cache entry the run used
    generated = generate_spec(layer.spec, strategy)
    assert generated.kernel.names == plan.names and generated.kernel.tasks == plan.tasks
    return strategy, out, trace, plan, generated.schedule


def xs(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_one_event_per_entry_named_as_predicted(profiled):
    strategy, out, trace, plan, sched = profiled
    events = xs(trace)
    assert sorted(e["args"]["entry"] for e in events) == list(range(plan.n_entries))
    assert f"  profile         {plan.n_entries} task events (logical clock" in out
    predicted = {e["args"]["task"]: e for e in xs(viz.trace(sched, empty=True))}
    for e in events:
        p = predicted[e["args"]["task"]]
        assert e["args"]["task"] == plan.tasks[e["args"]["entry"]]
        assert (e["name"], e["cat"], e["pid"], e["tid"]) == (p["name"], p["cat"], p["pid"], p["tid"])
        for key in ("segment", "claim", "owner", "source", "detail"):
            assert e["args"].get(key) == p["args"].get(key), (e, p)
    other = trace["otherData"]
    assert (other["layer"], other["strategy"], other["mode"]) == ("tiny", strategy, "unified")
    assert (other["clock"], other["unit"], other["tasks"]) == ("logical", "tick", plan.n_entries)
    assert "not durations" in other["note"]
    assert [k["kernel"] for k in other["kernels"]] == ["rdep_layer"]  # the unified kernel's one launch


def test_metadata_as_predicted(profiled):
    _, _, trace, _, sched = profiled
    measured = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    predicted = [e for e in viz.trace(sched)["traceEvents"] if e["ph"] == "M"]
    assert [e for e in measured if e["name"] != "thread_name"] == [e for e in predicted if e["name"] != "thread_name"]
    assert [(e["pid"], e["tid"]) for e in measured if e["name"] == "thread_name"] == [
        (e["pid"], e["tid"]) for e in predicted if e["name"] == "thread_name"
    ]


def test_measured_order_respects_the_task_graph(profiled):
    """Every entry starts (logical clock) after every entry it depends on in this call has ended."""
    _, _, trace, plan, _ = profiled
    at = {e["args"]["entry"]: (e["args"]["clock_start"], e["args"]["clock_end"]) for e in xs(trace)}
    checked = 0
    for entry, row in enumerate(plan.table):
        first = row[COL["dep_start"]]
        for d in plan.deps[first : first + row[COL["dep_count"]]]:
            if d < 0:  # an entry of the previous call
                continue
            assert at[d][1] < at[entry][0], f"{plan.names[entry]} started before {plan.names[d]} ended"
            checked += 1
        assert at[entry][0] < at[entry][1]
    assert checked > plan.n_entries  # the graph has edges; every entry but the routes has some
    for e in xs(trace):
        assert e["ts"] == e["args"]["clock_start"] - min(s for s, _ in at.values()) and e["dur"] >= 1


def test_threads_follow_the_roles(profiled):
    """A role per thread: communication (the transport kernel's tasks, route and combine
    among them) and compute (the GEMMs), as the schedule assigned them."""
    strategy, _, trace, plan, _ = profiled
    roles = {0: {"route", "scan", "dispatch", "return", "combine"}, 1: {"compute"}}
    tids = set()
    for e in xs(trace):
        row = plan.table[e["args"]["entry"]]
        tids.add(e["tid"])
        if strategy == "bulk":
            assert e["tid"] == 0
            continue
        assert e["tid"] == row[COL["resource"]] % 2
        assert e["pid"] == row[COL["resource"]] // 2
        assert e["cat"] in roles[e["tid"]]
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    if strategy == "bulk":
        assert tids == {0} and threads == {"all programs (2)"}
    else:
        assert tids == {0, 1}
        assert {t.split()[0] for t in threads} == {"communication", "compute"}


def test_globaltimer_ns_to_us(profiled):
    _, _, _, plan, _ = profiled
    profile = {
        "clock": "globaltimer",
        "mode": "split",
        "events": [(0, 5_000_000_000, 5_000_002_500), (1, 5_000_001_000, 5_000_004_000)],
    }
    tr = measured_trace(plan, profile, programs=3)
    a, b = xs(tr)
    assert (a["ts"], a["dur"], b["ts"], b["dur"]) == (0.0, 2.5, 1.0, 3.0)
    assert (a["name"], b["name"]) == plan.names[:2]
    other = tr["otherData"]
    assert (other["clock"], other["unit"], other["span"], other["tasks"]) == ("globaltimer", "us", 4.0, 2)
    threads = {e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"transport kernel (3 programs)", "GEMM kernel (3 programs)"}  # split: a thread per kernel
    assert {e["tid"] for e in xs(tr)} <= {0, 1}
    with pytest.raises(ValueError, match="clock"):
        measured_trace(plan, {"clock": "wall", "events": []})
    with pytest.raises(ValueError, match="out of range"):
        measured_trace(plan, {"clock": "logical", "events": [(plan.n_entries, 0, 1)]})


def test_profile_path_checked_before_the_run(tmp_path):
    status, out, err = cli_main("run", str(TINY), "--profile", str(tmp_path / "no" / "p.json"))
    assert status == 2 and out == ""
    assert err == f"rdepc: error: --profile {tmp_path / 'no' / 'p.json'}: no such directory {tmp_path / 'no'}\n"
    status, out, err = cli_main("run", str(TINY), "--profile", str(tmp_path))
    assert status == 2 and "is a directory" in err and err.count("\n") == 1


@pytest.fixture
def no_run(monkeypatch):
    """Fail loudly if anything compiles or runs: the --profile path is checked before."""
    from rdepc import parser

    def refuse(*a, **k):
        raise AssertionError("the run started before --profile was checked")

    monkeypatch.setattr(parser, "parse_file", refuse)


def test_profile_path_errors_exit_2_before_anything_runs(tmp_path, no_run):
    for path, why in [
        (tmp_path / "no" / "p.json", f"no such directory {tmp_path / 'no'}"),
        (tmp_path, "is a directory (expected a file name, e.g. OUT.json)"),
    ]:
        status, out, err = cli_main("run", str(TINY), "--profile", str(path))
        assert (status, out, err) == (2, "", f"rdepc: error: --profile {path}: {why}\n")
    f = tmp_path / "file"
    f.write_text("", encoding="utf-8")
    status, out, err = cli_main("run", str(TINY), "--profile", str(f / "p.json"))
    assert (status, out, err) == (2, "", f"rdepc: error: --profile {f / 'p.json'}: {f} is not a directory\n")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes")
def test_profile_path_without_write_permission(tmp_path, no_run):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "old.json").write_text("{}", encoding="utf-8")
    ro.chmod(0o555)
    (ro / "old.json").chmod(0o444)
    try:
        status, out, err = cli_main("run", str(TINY), "--profile", str(ro / "p.json"))
        assert (status, out) == (2, "")
        assert err == f"rdepc: error: --profile {ro / 'p.json'}: permission denied (cannot create files in {ro})\n"
        status, out, err = cli_main("run", str(TINY), "--profile", str(ro / "old.json"))
        assert (status, out) == (2, "")
        assert err == f"rdepc: error: --profile {ro / 'old.json'}: permission denied (the file is not writable)\n"
    finally:
        ro.chmod(0o755)


def test_profile_write_error_is_one_line(tmp_path, monkeypatch):
    from rdepc.runtime import profile

    def refuse(plan, prof, path, programs=None):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(profile, "write_measured_trace", refuse)
    target = tmp_path / "p.json"
    status, out, err = cli_main("run", str(TINY), "--tokens", "1", "--profile", str(target))
    assert status == 1 and "max rel. error" in out
    assert err == f"rdepc: error: cannot write {target}: Permission denied\n"


def test_every_task_kind_has_its_stage_in_the_trace():
    """The measured trace names each entry's stage as the task graph does: every kind of the
    task tables has one (balance's tasks and the backward's weight gradients included), and
    it is a stage of the graph."""
    from rdepc.runtime.profile import STAGE_OF

    from rdepc.ir.contract import KINDS
    from rdepc.ir.graph import STAGES

    assert set(STAGE_OF) == set(KINDS)
    assert {stage for stage, _ in STAGE_OF.values()} <= set(STAGES)


def test_a_profiled_backward_records_every_entry_after_what_it_waits_for():
    """A profiled module's backward records its own entries' spans (``last_backward_profile``),
    the forward's record left as it was: one event per backward entry with work, each after
    every backward entry it depends on in this call has ended (logical clock)."""
    import torch

    layer = rdepc.load(TINY)
    sh = layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    m = layer.module("emulated", "cpu", profile=True)
    from rdepc.reference import random_inputs

    x, ids, g, wg, wu, wd = random_inputs(W, T, H, F, E, K, gated=True)
    m(x.requires_grad_(), ids, g, wg, wu, wd).sum().backward()
    forward, backward = m.last_profile, m.last_backward_profile
    plan = m.contract
    assert {e for e, _, _ in forward["events"]} <= set(range(plan.n_entries))
    at = {entry: (start, end) for entry, start, end in backward["events"]}
    busy = [i for i, (first, n) in enumerate(m.bwd_work.entry_items()) if n]
    assert sorted(at) == busy and backward["clock"] == "logical"
    checked = 0
    for entry in busy:
        row = plan.bwd_table[entry]
        for d in plan.bwd_deps[row[COL["dep_start"]] : row[COL["dep_start"]] + row[COL["dep_count"]]]:
            if d >= 0 and d in at:
                assert at[d][1] < at[entry][0], f"{plan.bwd_names[entry]} started before {plan.bwd_names[d]} ended"
                checked += 1
    assert checked > 0 and torch.isfinite(x.grad).all()


def test_kernel_summary_divides_each_launchs_time():
    """kernel_summary, on a split call's stamps made by hand: per launch and task kind the
    items, those that took time and their time; for the GEMM kernel (program p takes items
    p, p + P, ...) per program the time its items ran, the time before and between them,
    and after its last."""
    from rdepc.runtime.profile import kernel_summary

    from rdepc.ir.queues import KINDS, Row, Work

    def row(kind):
        return Row(KINDS.index(kind), *(0,) * (len(COLUMNS) - 1))

    table = (row("dispatch"), row("gemm1"), row("gemm2"))
    # queue 0 (transport): entry 0, items 0-1; queue 1 (GEMM kernel, 2 programs): entry 1,
    # items 2-5 (the last two empty slots), entry 2, items 6-7
    work = Work("split", table, (0, 1, 2), (0, 2, 6, 8), ((0, 1), (1, 3)), (0,))
    at = [(0, 4), (1, 3), (5, 15), (6, 12), (20, 20), (14, 14), (22, 30), (16, 25)]
    transport, gemm = kernel_summary(work, at, (1, 2))
    assert transport["kernel"] == "rdep_layer" and transport["span"] == 4
    assert transport["kinds"]["dispatch"] == {
        "items": 2,
        "ran": 2,
        "busy": 6,
        "item": {"least": 2, "median": 4, "most": 4},
    }
    assert gemm["kernel"] == "rdep_gemm" and gemm["programs"] == 2 and gemm["span"] == 30 - 5
    assert gemm["kinds"]["gemm1"] == {"items": 4, "ran": 2, "busy": 16, "item": {"least": 6, "median": 10, "most": 10}}
    assert gemm["kinds"]["gemm2"]["busy"] == 8 + 9
    # program 0: items 2, 4, 6 — ran 10 + 0 + 8, its last ends at 30; program 1: items 3, 5, 7 —
    # ran 6 + 0 + 9, its last ends at 25
    assert gemm["busy"] == {"least": 15, "median": 18, "most": 18}
    assert gemm["waited"] == {"least": 5, "median": 7, "most": 7}  # (30 - 5) - 18, (25 - 5) - 15
    assert gemm["idle_after"] == {"least": 0, "median": 5, "most": 5}
    assert gemm["busy_share"] == (18 + 15) / (2 * 25)


def test_a_profiled_split_call_says_which_gemm_items_ran():
    """A profiled call's ``kernels``: split mode's two launches, the GEMM kernel's items that
    took time exactly its live m-tiles' (the empty slots counted done at once take none)."""
    import torch

    from rdepc.reference import random_inputs

    layer = rdepc.load(TINY)
    sh = layer.shapes
    m = layer.module("emulated", "cpu", mode="split", profile=True)
    m(*random_inputs(*(sh[k] for k in ("W", "T", "H", "F", "E", "K")), dtype=torch.float32)[:6])
    transport, gemm = m.last_profile["kernels"]
    assert transport["kernel"] == "rdep_layer" and gemm["kernel"] == "rdep_gemm"
    assert gemm["programs"] == m.per_queue[1] and 0 < gemm["busy_share"] <= 1
    tiles = sum(m.last_stats["m_tiles"].tolist())
    f_blocks, h_blocks = -(-sh["F"] // m.tiles.block_f), -(-sh["H"] // m.tiles.block_h)
    assert gemm["kinds"]["gemm1"]["ran"] == tiles * f_blocks < gemm["kinds"]["gemm1"]["items"]
    assert gemm["kinds"]["gemm2"]["ran"] == tiles * h_blocks
