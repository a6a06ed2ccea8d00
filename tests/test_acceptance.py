"""bench/acceptance.py keeps working: its dry run (every stage on the CPU under the Triton
interpreter, at tiny shapes) passes and writes a record per stage whose checks all pass; the
records survive a check that raises, a spent budget and a stage killed midway; the report
summarises what a directory holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import HANG_S, ROOT

sys.path.insert(0, str(ROOT))
from bench import acceptance

ENV_KEYS = {"device", "driver", "torch", "triton", "nvshmem", "python", "date", "commit"}


def test_the_dry_run_of_every_stage_passes(tmp_path):
    out = tmp_path / "acc"
    cmd = [sys.executable, "bench/acceptance.py", "--stage", "all", "--dry-run", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2 * HANG_S)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    names = {}
    for stage in acceptance.STAGES:
        rec = json.loads((out / f"{stage}.json").read_text())
        assert rec["stage"] == stage and rec["dry_run"] and rec["complete"] and rec["finished"]
        assert rec["environment"].keys() >= ENV_KEYS
        assert rec["environment"]["commit"] != "unknown"
        bad = [c for c in rec["checks"] if c["status"] != "pass"]
        assert not bad, bad
        assert rec["summary"] == {"pass": len(rec["checks"]), "fail": 0, "error": 0, "skipped": 0}
        names[stage] = [c["name"] for c in rec["checks"]]
    assert names["correct"] == [
        "prewarm", "forward/tiny", "forward/moonlight", "backward/tiny", "fp8/deepseek_v3",
        "dedup/deepseek_v3", "library/tiny", "library_backward/tiny", "cuda_graph/tiny", "withheld/tiny",
    ]  # fmt: skip
    assert names["nvshmem"] == ["prewarm", "bitwise/tiny/W2", "kill/W2", "rate/tiny/W2", "torchrun/W2"]
    assert names["perf"] == ["prewarm", "perf/tiny/T8/zipf:1.2", "perf/tiny/T16/uniform/W1"]
    assert names["tune"] == ["tune/moonlight"]
    correct = {c["name"]: c["figures"] for c in json.loads((out / "correct.json").read_text())["checks"]}
    # the prewarm lists what the checks launch, and under the interpreter compiles nothing
    stages = ("correct", "nvshmem", "perf")
    warm = {s: json.loads((out / f"{s}.json").read_text())["checks"][0]["figures"] for s in stages}
    assert all(w["compiled"] == 0 and w["dry_run"] and w["launches"] >= w["variants"] > 0 for w in warm.values())
    # forward: tiny 7 (3 schedules × 2 modes, bulk phased), moonlight 2; backward tiny 3; fp8 1; dedup
    # 2 + 1; the library's forward and backward 2; withheld 1 (cuda_graph's are forward's and the library's)
    assert warm["correct"]["variants"] == 7 + 2 + 3 + 1 + 3 + 2 + 1
    # T8: 4 candidates × 4 passes, 6 calls (two under autograd: the forward, the backward): the split
    # candidate's two kernels each, the unified one's one, the phased ones' two (the transport kernel
    # launched twice, one build; the library's GEMM kernel waiting and signalling); W1: bulk's 3
    assert warm["perf"]["variants"] == 4 * 4 + 3 * 4
    assert warm["perf"]["launches"] == (6 * 2 + 6 + 6 * 2 + 6 * 2) + (6 * 2 + 6 * 2 + 6 * 2)
    # per rank: 5 bitwise cases (2 unified, 2 split and 1 phased: two kernels each), kill's (and
    # torchrun's) call, a profiled call; the reference's 2 in one process
    assert warm["nvshmem"]["launches"] == 2 * (2 * 1 + 2 * 2 + 2 + 1 + 1) + 2
    # 3 strategies × 2 modes, bulk phased
    assert len(correct["forward/tiny"]["runs"]) == 7 and correct["forward/tiny"]["bitwise"]
    assert correct["withheld/tiny"]["recovered_bitwise"] and "error" in correct["withheld/tiny"]
    assert correct["cuda_graph/tiny"]["captured"] is False  # the CPU captures nothing: said so
    perf = json.loads((out / "perf.json").read_text())["checks"][1]["figures"]  # after the prewarm
    baselines = {"sort + torch._grouped_mm", "fused grouped_mm (torchtitan)", "torch._grouped_mm alone", "dense roof"}
    assert baselines <= perf["methods"].keys() and "rdepc bulk phased library" in perf["methods"]
    assert "fused grouped_mm (torchtitan) fwd+bwd" in perf["methods"]
    assert any(k.endswith("fwd+bwd") and k.startswith("rdepc") for k in perf["methods"])
    assert all(m["back_to_back_ms"] > 0 for m in perf["methods"].values() if "ms" in m)  # the host running ahead
    assert perf["ratios"]["speedup_vs_sort_grouped_mm_back_to_back"] > 0
    assert {"route", "dispatch", "compute", "return", "combine"} <= perf["stages"].keys()
    assert {"dispatch", "compute", "wgrad", "combine"} <= perf["backward_stages"].keys()
    launches = [k for ks in (perf["kernels"], *perf["kernels_others"].values()) for k in ks]
    assert any(k["kernel"] == "rdep_gemm" and k["busy_share"] > 0 for k in launches)  # split's GEMM programs
    assert any("wgrad" in k["kinds"] for k in perf["backward_kernels"])
    assert perf["host_overhead_ms"] is None and perf["stage_clock"] == "logical"  # no durations on the CPU
    # forward+backward sized to the free memory: tiny fits at its T', and the ratio says so
    assert perf["fwd_bwd_tokens"] == 8 == perf["ratios"]["fwd_bwd_tokens"] and perf["fwd_bwd_memory"]["tried"]
    assert correct["backward/tiny"]["narrowed"].startswith("no: ") and correct["backward/tiny"]["memory"]["fits"]
    assert correct["backward/tiny"]["overrides"] == {"W": 2, "T": 8}
    ranks = {c["name"]: c["figures"] for c in json.loads((out / "nvshmem.json").read_text())["checks"]}
    assert all(all(v["bitwise"]) for v in ranks["bitwise/tiny/W2"]["cases"].values())
    assert len(ranks["bitwise/tiny/W2"]["cases"]) == 5  # 2 strategies × 2 modes, bulk phased
    assert not ranks["kill/W2"]["hung"] and ranks["kill/W2"]["survivors"]["0"]["error"]  # JSON keys are strings
    tune = json.loads((out / "tune.json").read_text())["checks"][0]["figures"]
    assert tune["timed"] == tune["candidates"] == 2 and tune["record"]["tiles"] == tune["best"]
    report = subprocess.run(
        [sys.executable, "bench/acceptance.py", "--report", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    for stage in acceptance.STAGES:
        assert f"\n| {stage} | yes | " in report.stdout
    assert "| forward/tiny | pass |" in report.stdout
    assert acceptance.main(["--plot", str(out)]) == 0 and (out / "perf.png").stat().st_size > 0


def _stage(tmp_path, **kw):
    opts = {"dry_run": True, "budget": 100.0, "only": [], "device": "cpu"} | kw
    return acceptance.Stage("correct", tmp_path, **opts)


_OPEN_A_STAGE = """
import sys
from pathlib import Path

sys.path.insert(0, ".")
from bench import acceptance
from rdepc.toolchain import triton_mode

acceptance.Stage("correct", Path(sys.argv[1]), dry_run=True, budget=100.0, only=[], device="cpu")
print(triton_mode())
"""


def test_opening_a_stage_leaves_tritons_mode_to_its_checks(tmp_path):
    """A stage's record (its environment: versions, device) imports no Triton language, so
    the checks after it still choose Triton's mode. In a process of its own: this one's mode
    is fixed (conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", _OPEN_A_STAGE, str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["None"]


def test_a_check_that_raises_is_recorded_with_its_figures_and_the_next_runs(tmp_path):
    stage = _stage(tmp_path)

    def broken(check):
        check.figure("measured", 3)
        raise ValueError("bad\nsecond line")

    def failing(check):
        check.expect(1 == 2, "one is not two")
        check.expect(True, "never recorded")

    stage.run("a", broken)
    rec = json.loads(stage.path.read_text())  # written after each check
    assert rec["checks"][0]["status"] == "error" and rec["checks"][0]["error"] == "ValueError: bad"
    assert rec["checks"][0]["figures"] == {"measured": 3} and "Traceback" in rec["checks"][0]["traceback"]
    stage.run("b", failing)
    stage.run("c", lambda check: check.figure("x", 1.5))
    assert stage.finish() is False
    rec = json.loads(stage.path.read_text())
    assert [c["status"] for c in rec["checks"]] == ["error", "fail", "pass"]
    assert rec["checks"][1]["failures"] == ["one is not two"]
    assert rec["summary"] == {"pass": 1, "fail": 1, "error": 1, "skipped": 0} and rec["complete"]


def test_a_spent_budget_skips_and_only_selects(tmp_path):
    stage = _stage(tmp_path, budget=0.0, only=["forward/*"])
    ran = []
    stage.run("forward/tiny", lambda check: ran.append(1))
    assert stage.run("backward/tiny", lambda check: ran.append(2)) is None  # not selected: not recorded
    assert stage.finish() is True and not ran
    rec = json.loads(stage.path.read_text())
    assert [(c["name"], c["status"]) for c in rec["checks"]] == [("forward/tiny", "skipped")]
    assert "budget" in rec["checks"][0]["failures"][0] and not rec["complete"]


def test_a_killed_stage_leaves_its_record_and_the_report_says_so(tmp_path):
    stage = _stage(tmp_path)
    stage.run("forward/tiny", lambda check: check.figure("max_rel_err", 1e-7))
    (tmp_path / "notes.json").write_text("[]")  # not a stage record: ignored
    text = acceptance.report(tmp_path)  # never finished: as a stage killed at its limit leaves it
    assert "| correct | yes | 1 | 0 | 0 | 0 | no |" in text and "killed before the end" in text
    assert "| forward/tiny | pass | " in text and "max_rel_err 1e-07" in text
    (tmp_path / "empty").mkdir()
    assert acceptance.report(tmp_path / "empty").startswith("no stage records")


def test_a_second_run_with_only_replaces_its_checks_and_keeps_the_rest(tmp_path):
    first = _stage(tmp_path)
    first.run("forward/tiny", lambda check: check.expect(False, "broken"))
    first.run("backward/tiny", lambda check: check.figure("worst", 0.0))
    assert first.finish() is False
    again = _stage(tmp_path, only=["forward/*"])  # the same tree: its checks merge into the record
    again.run("forward/tiny", lambda check: check.figure("max_rel_err", 0.0))
    assert again.finish() is True
    rec = json.loads(again.path.read_text())
    assert [(c["name"], c["status"]) for c in rec["checks"]] == [("backward/tiny", "pass"), ("forward/tiny", "pass")]
    assert rec["complete"] and rec["summary"]["pass"] == 2


def test_a_backward_check_too_large_for_the_free_memory_runs_narrowed(monkeypatch):
    from bench import accept_correct as ac

    monkeypatch.setattr(ac, "backward_bytes", lambda layer, dry: layer.shapes["E"] * layer.shapes["F"])
    fit = ac.fit_backward("deepseek_v3", True, None, 700)  # narrowed: E=16 F=64, 1024 bytes > 0.85 × 700
    # E=8 leaves fewer than top 8 experts in its top 4 groups (refused): F is halved instead
    assert fit["narrowed"] == {"F": 32} and fit["fits"] and fit["need_bytes"] == {"E=16 F=64": 1024, "E=16 F=32": 512}
    assert "run at E=16 F=32" in fit["why"]
    assert dict(ac.variant("deepseek_v3", True, narrow=fit["narrowed"]).overrides)["F"] == 32
    assert ac.fit_backward("deepseek_v3", True, None, 2000)["narrowed"] == {}
    assert not ac.fit_backward("deepseek_v3", True, None, 1)["fits"]  # the narrowest it takes, said not to fit


def test_forward_backward_is_timed_at_the_largest_tokens_that_fit(monkeypatch):
    from bench import accept_perf

    class Module:
        def __init__(self, tokens):
            self.contract = tokens

    monkeypatch.setattr(accept_perf, "train_rows_bytes", lambda contract: 100 * contract)
    monkeypatch.setattr(accept_perf, "free_bytes", lambda device: 1000)  # 850 plannable
    modules = {"bulk": Module(64), "deep": Module(64)}
    module, t, tried = accept_perf.fit_train(modules, "bulk", 64, Module, lambda n: 0, "cpu")
    assert t == 8 == module.contract and list(tried) == [64, 32, 16, 8] and not modules  # all let go
    assert tried[8]["fits"] and not tried[16]["fits"] and tried[64]["need_bytes"] == 6400
    given = Module(4)
    module, t, _ = accept_perf.fit_train({"bulk": given}, "bulk", 4, Module, lambda n: 0, "cpu")
    assert t == 4 and module is given  # fits as it is: the module it was given


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--stage", "correct"], 2),
        (["--report", "/nonexistent"], 2),
        (["--report", ".", "--stage", "perf"], 2),
        (["--plot", "/nonexistent"], 2),
        (["--plot", "."], 2),  # no perf.json here
    ],
)
def test_usage_errors(argv, code, capsys):
    try:
        got = acceptance.main(argv)
    except SystemExit as e:
        got = e.code
    assert got == code
