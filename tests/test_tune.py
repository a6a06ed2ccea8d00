"""Tile sizes per layer and device (runtime/tune.py): candidates, the tuning loop, its record,
and the packed gate/up operand the tiles read."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from conftest import ROOT
from rdepc.runtime import tune
from rdepc.runtime.tensors import gate_up

import rdepc
from rdepc.ir.contract import ACC_REGISTERS, Tiles


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RDEPC_CACHE_DIR", str(tmp_path))
    return tmp_path


def plan_of(name: str, **overrides):
    return rdepc.load(ROOT / "examples" / f"{name}.rdep", **overrides).compile().kernel


@pytest.mark.parametrize("name", ["tiny", "moonlight", "mixtral_8x7b"])
def test_candidates_fit_shared_memory_and_cover_both_tile_widths(name):
    plan = plan_of(name)
    got = tune.candidates(plan)
    assert got and all(t.fits(plan) and t.shared_bytes(plan) <= 227 * 1024 * 7 // 8 for t in got)
    assert {t.bm for t in got} == {64, 128} and {t.num_warps for t in got} == {4, 8}
    assert len({t.block_f for t in got}) == (2 if plan.dtype == "fp32" else 3) and len(set(got)) == len(got)
    up = 2 if plan.gated else 1  # no tile whose accumulator would take more registers than a thread may hold
    assert all(t.bm * max(up * t.block_f, t.block_h) <= 32 * t.num_warps * ACC_REGISTERS for t in got)


def test_candidates_start_at_the_defaults_and_move_away_one_size_at_a_time():
    plan = plan_of("moonlight")
    got = tune.candidates(plan)
    base = Tiles.default(plan.H, plan.F, plan.dtype, interpret=False)
    changed = [sum(a != b for a, b in zip(asdict(t).values(), asdict(base).values(), strict=True)) for t in got]
    assert got[0] == base and changed == sorted(changed)
    assert Tiles(128, 256, 128, 64, 4096, 8, 64, 3) in got[:3]  # GEMM2's tile twice as wide: one size changed


def test_the_fastest_candidate_wins_and_failures_are_recorded():
    plan = plan_of("tiny")
    tried = [Tiles(bm=64), Tiles(bm=128), Tiles(bm=32)]
    ms = {64: 3.0, 128: 2.0}
    lines = []

    def time_tiles(t):
        if t.bm not in ms:
            raise RuntimeError("out of resources")
        return ms[t.bm]

    best, results = tune.tune(plan, time_tiles, tried, progress=lines.append)
    assert best == Tiles(bm=128)
    assert [r.get("ms") for r in results] == [3.0, 2.0, None]
    assert "RuntimeError: out of resources" in results[2]["error"]
    assert len(lines) == 3 and lines[2].startswith("  [3/3]") and "failed" in lines[2]
    with pytest.raises(RuntimeError, match="no candidate tiles ran"):
        tune.tune(plan, lambda t: 1 / 0, [Tiles()])


def test_the_tuned_tiles_are_timed_at_several_splits_and_in_phased_mode():
    plan = rdepc.load(ROOT / "examples/moonlight.rdep").compile(schedule="bulk").kernel
    tiles = Tiles.default(plan.H, plan.F, plan.dtype, interpret=False)
    tried = tune.launch_candidates(plan, tiles, 132)
    _, (comm, _) = plan.launch_grid(plan.work(tiles, "split"), 132)
    assert tried[0] == ("split", comm, "triton")  # the schedule's split first
    assert tried[-2:] == [("phased", None, "triton"), ("phased", None, "library")]  # bulk: the library's too
    comms = [c for m, c, _ in tried if m == "split"]
    assert len(set(comms)) == len(comms) == 5 and (min(comms), max(comms)) == (round(comm / 2), round(comm * 1.5))
    ms = {("split", c, "triton"): 10.0 + c - min(comms) for c in comms}
    ms |= {("phased", None, "triton"): 9.0, ("phased", None, "library"): 7.0}
    lines = []
    best, results = tune.time_launches(lambda *launch: ms[launch], tried, 132, lines.append)
    # the library wins; the fastest split is kept for a module asked for split mode
    assert best == {"mode": "phased", "comm_programs": min(comms), "gemm": "library", "programs": 132, "ms": 7.0}
    assert [r["ms"] for r in results] == [ms[t] for t in tried] and len(lines) == len(tried)
    assert f"{comm} transport programs of 132" in lines[0] and lines[-1].split("]")[1].startswith(
        " phased mode, library GEMMs"
    )  # fmt: skip
    # a failed launch is recorded, not fatal; none that runs is an error
    best, results = tune.time_launches(lambda m, c, g: 1 / 0 if m == "phased" else 5.0, tried[:1] + tried[-1:], 132)
    assert best["mode"] == "split" and "ZeroDivisionError" in results[1]["error"]
    with pytest.raises(RuntimeError, match="ran in no kernel mode"):
        tune.time_launches(lambda m, c, g: 1 / 0, tried[:1], 132)
    # a schedule whose GEMMs wait for returns (moonlight's own: 4096-row segments, 2 buffers) is
    # not tried in phased mode, nor through the library (bulk only)
    assert all(m == "split" for m, _, _ in tune.launch_candidates(plan_of("moonlight"), tiles, 132))


def test_a_spent_budget_leaves_the_remaining_candidates_not_timed():
    plan = plan_of("tiny")
    tried = [Tiles(bm=64), Tiles(bm=128), Tiles(bm=32)]
    lines = []
    best, results = tune.tune(plan, lambda t: float(t.bm), tried, progress=lines.append, budget=0.0)
    assert best == Tiles(bm=64)  # one candidate is timed whatever the budget: a record needs one
    assert [("ms" in r, "skipped" in r) for r in results] == [(True, False), (False, True), (False, True)]
    assert "budget of 0 s" in results[1]["skipped"] and lines[2].endswith("not timed (budget)")


def test_cli_tune_refuses_a_budget_that_is_not_positive(main):
    status, _, err = main("tune", "examples/tiny.rdep", "--budget", "0")
    assert status == 2 and "--budget 0.0: expected a positive number of seconds" in err


def test_a_record_is_found_for_its_plan_and_device_only(cache):
    plan = plan_of("tiny")
    best = Tiles(bm=128, block_f=64, num_stages=3)
    results = [{"tiles": asdict(best), "ms": 1.5}, {"tiles": asdict(Tiles()), "ms": 2.0}]
    path = tune.record(plan, "NVIDIA H100 80GB HBM3", best, results)
    assert path.parent == cache / "tuning" and json.loads(path.read_text())["results"] == results
    tiles, source = tune.lookup(plan, "NVIDIA H100 80GB HBM3")
    assert tiles == best and source.startswith("tuned on NVIDIA H100 80GB HBM3") and "1.500 ms" in source
    assert tune.lookup(plan, "NVIDIA H200") is None
    assert tune.lookup(plan_of("tiny", T=32), "NVIDIA H100 80GB HBM3") is None  # another plan
    path.write_text("{not json")
    assert tune.lookup(plan, "NVIDIA H100 80GB HBM3") is None  # a damaged record is ignored


def test_tune_layer_runs_every_candidate_and_records_the_fastest(cache):
    layer = rdepc.load(ROOT / "examples/tiny.rdep")
    tried = [Tiles(bm=64, block_f=64, block_k=64), Tiles(bm=32, block_f=128, block_k=128)]
    launches = [("unified", None, "triton"), ("phased", None, "triton"), ("phased", None, "library")]
    best, results, path = tune.tune_layer(layer, "cpu", tried=tried, reps=1, warmup=1, launches=launches)
    assert best in tried and all(r["ms"] > 0 for r in results) and path.is_file()
    contract = layer.compile().kernel
    assert tune.lookup(contract, "cpu (Triton interpreter)")[0] == best
    launch = tune.lookup_launch(contract, "cpu (Triton interpreter)")
    rec = json.loads(path.read_text())
    assert [(r["mode"], r["comm_programs"], r["gemm"]) for r in rec["launch_results"]] == launches
    assert launch["mode"] in ("unified", "phased") and launch["programs"] == 3 and launch["comm_programs"] is None
    assert launch["gemm"] in ("triton", "library")
    assert launch["ms"] == min(r["ms"] for r in rec["launch_results"])
    # the interpreter keeps its own tiles, whatever was recorded
    assert layer.module("emulated", "cpu").tiles_source == "the interpreter's (few, large tiles)"


def test_gate_and_up_halves_of_one_tensor_are_passed_without_a_copy():
    w = torch.randn(3, 8, 16, 2)
    packed = gate_up(w[..., 0], w[..., 1])
    assert packed.data_ptr() == w.data_ptr() and torch.equal(packed, w)
    g, u = torch.randn(3, 8, 16), torch.randn(3, 8, 16)
    fresh = gate_up(g, u)
    assert torch.equal(fresh[..., 0], g) and torch.equal(fresh[..., 1], u)
    assert torch.equal(gate_up(w[..., 1], w[..., 0]), torch.stack((w[..., 1], w[..., 0]), -1))  # swapped: a copy
    assert torch.equal(gate_up(w[1:, ..., 0], w[1:, ..., 1]), w[1:])  # a slice of experts is still a view


def test_the_moe_block_holds_gate_and_up_as_one_parameter():
    moe = rdepc.RDEPMoE(ROOT / "examples/tiny.rdep", device="cpu", generator=torch.Generator().manual_seed(0))
    names = dict(moe.named_parameters())
    assert "w_gate_up" in names and "w_gate" not in names and "w_up" not in names
    assert moe.w_gate.data_ptr() == moe.w_gate_up.data_ptr()
    assert gate_up(moe.w_gate, moe.w_up).data_ptr() == moe.w_gate_up.data_ptr()
    assert moe.w_gate.std() > 0 and not torch.equal(moe.w_gate, moe.w_up)


@pytest.mark.parametrize("name", ["tiny", "moonlight", "qwen3_30b_a3b", "deepseek_v3", "nvl72_e128"])
def test_a_backward_launches_the_defaults_as_they_are_and_tuned_tiles_narrowed_to_fit(name):
    plan = plan_of(name)
    base = Tiles.default(plan.H, plan.F, plan.dtype, interpret=False)
    assert base.fits(plan, backward=True) and base.for_backward(plan) == base
    assert tune.backward_tiles(plan, base, interpret=False) == base
    # moonlight's fastest forward tiles on an H200 (GEMM2 256 wide, 4 stages): the weight gradient's
    # [256, 2·128] tile would need 256 KiB of shared memory and 256 accumulator registers a thread
    tuned = Tiles(128, 256, 128, 64, 4096, 8, 64, 4)
    if plan.dtype != "fp32":
        assert tuned.fits(plan) and not tuned.fits(plan, backward=True)
        assert tuned.shared_bytes(plan, backward=True) == 4 * 64 * (256 + 256) * 2
        assert tuned.for_backward(plan) == Tiles(128, 256, 64, 64, 4096, 8, 64, 4)
    assert tuned.for_backward(plan).fits(plan, backward=True)
    assert tune.backward_tiles(plan, tuned, interpret=True) == tuned  # the interpreter: nothing to fit


def test_rdepc_run_names_the_backwards_tiles_where_they_are_narrowed():
    from types import SimpleNamespace

    from rdepc.commands.run import _backward_tiles

    tuned = Tiles(128, 256, 128, 64, 4096, 8, 64, 4)
    plan = plan_of("moonlight")
    assert _backward_tiles(SimpleNamespace(tiles=tuned, bwd_tiles=tuned)) == []
    (line,) = _backward_tiles(SimpleNamespace(tiles=tuned, bwd_tiles=tuned.for_backward(plan)))
    assert "backward tiles  F-block 64, H-block 256, 4 stages" in line
