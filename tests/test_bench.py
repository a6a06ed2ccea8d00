"""bench/moe_bench.py keeps working: its CPU smoke configuration runs every method, checks
every layer against the reference, and writes its JSON and plot (timings under the
interpreter are not measurements: nothing here asserts a speed)."""

from __future__ import annotations

import json
import sys

import torch
from conftest import ROOT
from tolerance import assert_close, bound, layer_chain

sys.path.insert(0, str(ROOT))
from bench import moe_bench


def test_smoke_configuration_runs_every_method(tmp_path, monkeypatch):
    from rdepc.runtime import tensors

    import rdepc
    from rdepc.reference import random_inputs, reference_for

    compared = []  # what the script compares, in its order: a layer's output and the reference's
    relative = tensors.max_relative_error
    monkeypatch.setattr(tensors, "max_relative_error", lambda y, ref: compared.append((y, ref)) or relative(y, ref))
    out = tmp_path / "smoke"
    assert moe_bench.main(["--config", "smoke", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    env = results["environment"]
    assert {"device", "driver", "torch", "triton", "python", "date"} <= env.keys()
    cases = {(r["example"], r["T"], r["routing"]) for r in results["runs"]}
    assert cases == {("tiny", 16, "zipf:1.0"), ("tiny", 4, "uniform"), ("tiny", 8, "uniform")}
    methods = {r["method"] for r in results["runs"]}
    assert methods == {
        "rdepc bulk unified",
        "rdepc pipelined unified",
        "sort + torch._grouped_mm",
        "per-expert loop",
        "torch._grouped_mm alone",
        "dense roof",
    }
    checked = iter(compared)
    reference, limits = reference_for(rdepc.load(ROOT / "examples" / "tiny.rdep")), {}
    for r in results["runs"]:
        assert r["ms"]["min"] <= r["ms"]["median"] <= r["ms"]["max"]
        assert r["rows"] == 4 * r["T"] * 2 and r["mu"] == r["rows"] / 8
        if r["method"].startswith(("rdepc", "sort", "per-expert")):  # whole layers: checked before timed
            y, ref = next(checked)
            assert r["max_rel_err"] == relative(y, ref), r
            inputs = random_inputs(4, r["T"], 64, 128, 8, 2, routing=r["routing"], seed=0)  # what the script drew
            assert torch.equal(ref, reference(*inputs)[0])
            key = (r["T"], r["routing"])
            if key not in limits:
                limits[key] = bound(reference, inputs, layer_chain(64, 128, 2))
            assert_close(y, ref, limits[key], f"{r['method']} at T' {r['T']}, {r['routing']}")
        if r["method"].startswith("rdepc"):
            assert {"route", "scan", "dispatch", "compute", "return", "combine"} <= r["stages"].keys()
            assert r["stage_clock"] == "logical"
    assert sum(r["sweep"] for r in results["runs"]) == 2 * 5  # two μ, five methods each (bulk only)


def test_bench_scripts_leave_an_installed_rdepc_first():
    # On a GPU machine rdepc is a wheel; the tree's rdepc/ before it on sys.path lacks the
    # packages the wheel maps in (rdepc.grammar, rdepc.runtime, ...).
    for script in sorted((ROOT / "bench").glob("*.py")):
        assert "sys.path.insert(0" not in script.read_text(encoding="utf-8"), script.name


def test_a_lease_runs_its_steps_in_order_and_packs_what_they_wrote(tmp_path, capsys):
    import tarfile

    from bench import lease

    assert lease.main(["--plan"]) == 0
    plan = capsys.readouterr().out
    # the library lowering's perf and correctness first, on the tiles the last tuning lease chose
    assert plan.startswith("1. [260 s] the library GEMM lowering") and "perf/moonlight/T32768/uniform/W1" in plan
    assert (
        plan.index("--only 'library/*'") < plan.index("--stage tune") < plan.index("kill/W2") < plan.index("balance.py")
    )
    native = lease.STEPS[0].argv(tmp_path, 1, dry=False)
    assert native[native.index("--tiles") + 1] == str(ROOT / lease.TUNED_1128)
    assert "--tiles" not in lease.STEPS[0].argv(tmp_path, 1, dry=True)  # the interpreter keeps its own tiles
    # the last step needs a GPU (skipped in a dry run); step 3 is the tune stage under the interpreter
    last = len(lease.STEPS)
    assert lease.main(["--dry-run", "--out", str(tmp_path), "--steps", str(last), "3"]) == 0
    record = json.loads((tmp_path / "lease.json").read_text())
    assert [(s["step"], s["status"]) for s in record["steps"]] == [(last, "skipped"), (3, "pass")]
    assert (tmp_path / "3-tune" / "tune.json").is_file() and "| tune |" in (tmp_path / "summary.md").read_text()
    with tarfile.open(tmp_path / "lease.tar.gz") as tar:
        assert {"lease.json", "summary.md", "3-tune/tune.json"} <= set(tar.getnames())
    assert lease.main(["--dry-run", "--out", str(tmp_path), "--deadline", "5", "--steps", "1"]) == 0
    assert json.loads((tmp_path / "lease.json").read_text())["steps"][0]["status"] == "skipped"  # under MIN_LEFT


def test_the_host_path_bench_records_one_calls_launches(tmp_path):
    """bench/host_path.py's module side (what a lease runs, --module-only): a split call's
    host time, and its two launches saved as a native launch would take them."""
    import torch

    from bench import host_path

    row = host_path.module_side("split", 3, tmp_path / "calls.pt")
    assert row["kernels"] == ["rdep_layer", "rdep_gemm"] and row["module_us"] > 0
    saved = torch.load(tmp_path / "calls.pt", weights_only=False)
    assert [(name, meta["CAST_F32"]) for name, _, _, meta in saved["launches"]] == [
        ("rdep_layer", False),
        ("rdep_gemm", False),
    ]
    assert all(len(grid) == 1 and grid[0] > 1 for _, grid, _, _ in saved["launches"])  # an H100's programs


def test_a_stage_takes_the_tiles_a_tuning_lease_recorded():
    from bench.acceptance import given_tiles
    from rdepc.ir.contract import Tiles

    tiles = given_tiles(ROOT / "bench/results/h200-2026-11-28-lease/b-tune.json")
    assert tiles == Tiles(bm=128, block_h=256, block_f=128, block_r=64, rows_per_item=4096, num_warps=8, block_k=64,
                          num_stages=4)  # fmt: skip


def test_the_committed_leases_are_one_table_the_model_is_held_against(tmp_path):
    """bench/calibration.py reads every perf record under bench/results (each rdepc method's
    call and, where profiled, its stages); bench/model_error.py sets the model's prediction
    beside each profiled row, and draws them."""
    from bench import model_error
    from bench.calibration import load

    rows = load()
    assert len(rows) >= 64 and sum(1 for r in rows if r.stages) >= 31
    assert {r.device for r in rows} == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    moon = [
        r
        for r in rows
        if (r.example, r.T, r.commit, r.strategy, r.mode) == ("moonlight", 4096, "46c6da4", "bulk", "split")
    ]
    assert moon and moon[0].stages["compute"] == (12709376 - 2459360) / 1e6  # the 2026-11-28 lease's a-perf.json
    assert model_error.main(["--out", str(tmp_path), "--only", "moonlight/128/"]) == 0
    record = json.loads((tmp_path / "model-error.json").read_text())
    assert record["rows"] and all(r["case"] == "moonlight/128/uniform" for r in record["rows"])
    assert all(s["predicted_ms"] > 0 for r in record["rows"] for s in r["stages"].values())
    assert (tmp_path / "model-error.png").stat().st_size > 0


def test_the_model_ranks_the_strategies_as_the_leases_measured():
    """For every committed record, case and kernel mode that timed two strategies or more, the
    cost model's fastest at the emulation's rates (W ranks on one GPU) is the measured fastest,
    unless the measured two are within bench/model_error.py's TIE of each other, or the mode's
    ranking is a named gap of the model (GAPS) that still holds."""
    from bench.calibration import load
    from bench.model_error import GAPS, rankings

    ranked = rankings(load())
    decided = [k for k in ranked if not k["tie"]]
    assert len(decided) >= 13, ranked
    wrong = [(k["source"], k["case"], k["measured_ms"], k["predicted_ms"]) for k in decided if not k["agrees"]]
    unnamed = [
        w
        for w, k in zip(wrong, [k for k in decided if not k["agrees"]], strict=True)
        if ("ranking", k["mode"]) not in GAPS
    ]
    assert not unnamed, unnamed
    assert any(not k["agrees"] and k["mode"] == "split" for k in decided) == (("ranking", "split") in GAPS)
    assert all(k["agrees"] for k in decided if k["mode"] == "unified")


def test_the_model_replays_every_committed_case_within_its_bounds_or_names_the_gap():
    """The newest record of every case and method, replayed: each stage's predicted span within
    25 % of the measured one and the call within 20 %, or the comparison a gap the model names
    (bench/model_error.py GAPS, with why); a named gap no comparison shows any more fails too,
    so the table shrinks as the model learns. The bulk split forward (the fastest method every
    lease measured) is held at moonlight's 4,096-token cases on every stage but the scan and
    the returns."""
    from bench.calibration import load
    from bench.model_error import compare, current, replay

    rows = current(load())
    assert len(rows) < len(load())
    verdicts = replay(compare(rows))
    assert not verdicts["fails"], verdicts["fails"]
    assert not verdicts["closed"], verdicts["closed"]
    held = {(case, method, stage) for case, method, stage, _ in verdicts["holds"]}
    for case in ("moonlight/4096/uniform", "moonlight/4096/zipf:1.2"):
        for stage in ("route", "dispatch", "compute", "combine", "call"):
            assert (case, "bulk split", stage) in held, (case, stage)
    assert len(verdicts["holds"]) >= 30


def test_schedule_auto_chooses_what_was_measured_fastest_on_the_emulation_and_overlap_on_a_node():
    """On the leases' emulation (h200/8) bulk measured fastest for moonlight and qwen3_30b_a3b
    at 4,096 tokens per rank, and auto chooses it; on a node of eight H200s (h200) the model
    predicts overlap pays for moonlight, and auto chooses pipelined there. The spec's fixed
    schedule predicted slower is a warning."""
    from rdepc.passes.resolve import choice_warnings, resolve

    import rdepc

    for example in ("moonlight", "qwen3_30b_a3b"):
        spec = rdepc.load(f"examples/{example}.rdep", T=4096, W=8).spec
        assert resolve(spec, "auto", hw="h200/8").strategy == "bulk"
        (w,) = choice_warnings(spec, hw="h200/8")
        assert f"schedule {spec.schedule} (spec: schedule {spec.schedule}) is predicted" in w
        assert "'schedule auto' would choose bulk" in w
    moon = rdepc.load("examples/moonlight.rdep").spec
    assert resolve(moon, "auto", hw="h200").strategy == "pipelined"
    assert choice_warnings(moon, hw="h200") == []
    assert choice_warnings(moon, hw="h200/8", gemm="library") == []  # the library lowering fixed bulk
    assert choice_warnings(moon, "deep", hw="h200") == [
        "deep with 2 buffers (command line --schedule) is no deeper than pipelined"
    ]


def test_an_emulated_profile_is_a_share_of_its_gpu(main):
    """--hw NAME/N: each of N ranks has 1/N of the GPU's FLOP/s, memory and bandwidth, a peer's
    row an HBM read and write; an unknown profile or N is a usage error naming the known ones."""
    from rdepc.passes.cost import rates
    from rdepc.passes.hardware import profile

    p, one = profile("h200/8"), profile("h200")
    assert p.flops.value == one.flops.value / 8 and p.hbm.value == one.hbm.value / 8
    assert p.link.value == one.hbm_bw.value / 16 and p.flops.kind == "derived"
    r = rates("h200/8")
    assert (r.sms, r.hbm, r.link) == (16, one.hbm_bw.value / 8, one.hbm_bw.value / 16)
    rc, out, _ = main("plan", "examples/tiny.rdep", "--hw", "h200/8")
    assert rc == 0 and "h200/8" in out
    rc, _, err = main("viz", "examples/tiny.rdep", "--hw", "h9")
    assert rc == 2 and "argument --hw: unknown hardware profile 'h9' (known: h100, h200, b200, gb300, or NAME/N)" in err
    for bad in ("h200/0", "h200/x"):
        rc, _, err = main("viz", "examples/tiny.rdep", "--hw", bad)
        assert rc == 2 and f"'{bad}': N in NAME/N must be a positive whole number of ranks" in err
