"""The planner's symmetric heap against docs/memory.md by hand: bulk and segmented, the
return ids, padding, capacity binding and ``schedule auto`` as compile chooses it."""

from __future__ import annotations

import pytest
import sympy as sp
from conftest import ROOT, tiny_segmented
from plan_cli import EX, TINY_SHAPE, moonlight_plan, run_json, write_spec
from rdepc.passes import plan_symbols as PS
from rdepc.passes.plan import plan
from rdepc.passes.resolve import build_for, resolve
from rdepc.passes.symmetric import symmetric_formulas, symmetric_plan

import rdepc


@pytest.fixture(scope="module")
def moonlight() -> dict:
    return moonlight_plan()


# --- the symmetric heap, docs/memory.md by hand ---------------------------------------------


def pad(n: int) -> int:
    return -(-n // 256) * 256


def test_symmetric_plan_tiny_bulk_by_hand():
    spec = rdepc.load(EX / "tiny.rdep").spec  # schedule bulk, dropless, fp32, sideband 16 B
    W, T, H, K, E_max, a, d, sb = 4, 16, 64, 2, 2, 4, 4, 16
    S = W * T * min(K, E_max)  # S_bulk, dropless: 128 rows
    B, R_ret = 1, T * K
    done = 3 + 1 + (2 * W + 2) * 1  # route, scan, combine wait, 1 token tile, W dispatches, gemm1, gemm2, W returns
    control = pad(W * 8) + 3 * pad(W * E_max * 4) + pad(done * 8)
    fwd = {
        "control": control,
        "payload": pad(B * S * H * d),
        "sideband": pad(B * S * sb),
        "return": pad(R_ret * H * a),  # + pad(return_ids) = 0: bulk rows land at their places
    }
    fwd["total"] = sum(fwd.values())
    fb = {k: v for k, v in fwd.items() if k != "total"}
    # the backward: its done counters (the forward's and a weight-gradient task), g'·dL/dy
    # rows and their row ids, dL/dx rows (no ids: bulk rows land at their places)
    fb |= {"bwd_control": pad((done + 1) * 8), "bwd_payload": pad(B * S * H * a) + pad(B * S * 8)}
    fb |= {"bwd_return": pad(R_ret * H * a)}
    fb["total"] = fwd["total"] + fb["bwd_control"] + fb["bwd_payload"] + fb["bwd_return"]
    got = symmetric_plan(spec)  # the spec's schedule: bulk
    assert (got["strategy"], got["S"], got["B"], got["R_ret"]) == ("bulk", 128, 1, 32)
    assert symmetric_plan(spec, "auto")["strategy"] == resolve(spec, "auto").strategy == "bulk"  # compile's choice
    assert (
        got["forward"] == fwd == {"control": 1280, "payload": 32768, "sideband": 2048, "return": 8192, "total": 44288}
    )
    assert got["forward_backward"] == fb
    assert fb["total"] == 86528
    assert got["buffers"]["tokens"] == 256 and got["buffers"]["flags"] == 256
    assert got["buffers"]["return_ids"] == 0


def test_symmetric_plan_tiny_segmented_by_hand(tmp_path):
    spec = rdepc.load(tiny_segmented(tmp_path)).spec
    # auto: the strategy compile's cost model chooses, segment statement or not (bulk at this size)
    assert symmetric_plan(spec, "auto")["strategy"] == resolve(spec, "auto").strategy == "bulk"
    got = symmetric_plan(spec, "pipelined")  # S = 32, B = 2 from the segment statement
    assert (got["S"], got["B"], got["R_ret"]) == (32, 2, 64)
    assert got["forward"] == {
        "control": 6 * 256,
        "payload": 2 * 32 * 64 * 4,
        "sideband": 2 * 32 * 16,
        "return": 64 * 64 * 4,
        "total": 1536 + 16384 + 1024 + 16384,
    }
    # 3 + 1 token tile + 10·n done counters, n = 4 segments: 44, and the backward's 45, padded
    assert got["forward_backward"]["bwd_control"] == got["buffers"]["bwd_flags"] == pad(45 * 8) == 512
    assert got["forward_backward"]["bwd_payload"] == 2 * 32 * 64 * 4 + 2 * 32 * 8
    assert got["forward_backward"]["bwd_return"] == 64 * 64 * 4
    assert got["forward_backward"]["total"] == 35328 + 512 + 16384 + 512 + 16384
    assert got["buffers"]["return_ids"] == 0  # B·S = 64 >= T·K = 32: rows land at their places
    assert symmetric_plan(spec, "deep") == {**got, "strategy": "deep"}


@pytest.mark.parametrize(
    ("strategy", "rows", "buffers", "ids"),
    [
        ("pipelined", 8, 2, 16 * 8),  # B·S = 16 < T·K = 32: the return ring rotates
        ("deep", 5, 3, 15 * 8),
        ("pipelined", 16, 2, 0),  # B·S = T·K
        ("deep", 32, 3, 0),
        ("bulk", None, None, 0),
    ],
)
def test_symmetric_plan_return_ids(strategy, rows, buffers, ids):
    spec = rdepc.load(EX / "tiny.rdep").spec  # T·K = 16·2 = 32
    got = symmetric_plan(spec, strategy, rows=rows, buffers=buffers)
    if ids:
        assert got["R_ret"] * 8 == ids
    assert got["buffers"]["return_ids"] == pad(ids)
    assert list(got["buffers"]).index("return_ids") == list(got["buffers"]).index("return") + 1
    for phase in ("forward", "forward_backward"):
        assert got[phase]["return"] == got["buffers"]["return"] + pad(ids)
    assert got["buffers"]["bwd_return_ids"] == pad(ids)  # the backward's return carries ids as the forward's
    assert got["forward_backward"]["bwd_return"] == got["buffers"]["bwd_return"] + pad(ids)


def test_return_ids_formula():
    fm = symmetric_formulas("pipelined")
    ids = fm["buffers"]["return_ids"]
    assert ids.has(sp.Piecewise) and ids.free_symbols == {PS.B, PS.S, PS.T, PS.K}
    at = {PS.B: 2, PS.S: 4096}
    assert ids.subs({**at, PS.T: 4096, PS.K: 6}) == 8192 * 8  # moonlight: B·S = 8192 < T·K = 24576
    assert ids.subs({**at, PS.T: 4097, PS.K: 2}) == 8192 * 8  # 8192 < 8194
    assert ids.subs({**at, PS.T: 4096, PS.K: 2}) == 0  # B·S = T·K: no ring
    assert ids.subs({**at, PS.T: 1000, PS.K: 2}) == 0
    assert ids.subs({PS.B: 3, PS.S: 5, PS.T: 16, PS.K: 2}) == 256  # 15 ids of 8 bytes, padded
    assert fm["forward"]["return"] == fm["buffers"]["return"] + ids
    assert symmetric_formulas("bulk")["buffers"]["return_ids"] == 0


def test_symmetric_plan_padding_and_overrides():
    spec = rdepc.load(EX / "tiny.rdep").spec
    got = symmetric_plan(spec, "pipelined", rows=5, buffers=3)
    # 3·5·64·4 = 3840 -> 3840; sideband 3·5·16 = 240 -> 256; flags: n = ⌈128/5⌉ = 26 segments,
    # the ring rotates (15 < 32): 3 + 1 + 10·26 + 4·26 = 368 done counters, 2944 -> 3072 bytes
    assert got["buffers"]["payload"] == 3840 and got["buffers"]["sideband"] == 256
    assert got["buffers"]["flags"] == 3072 and got["R_ret"] == 15
    assert all(v % 256 == 0 for v in got["buffers"].values())


@pytest.mark.parametrize(
    ("tokens", "segment", "want"),
    [
        (16, None, "bulk"),
        (16, "rows 32, buffers 2", "bulk"),  # a segment statement does not make auto segmented
        (1024, None, "pipelined"),  # segmented without one: S and B are the scheduler's
        (4096, "rows 2048, buffers 4", "pipelined"),
    ],
)
def test_schedule_auto_is_compiles_choice(tmp_path, capsys, tokens, segment, want):
    """``schedule auto``: rdepc plan reports the strategy, S and B that compile builds."""
    text = (ROOT / "examples" / "tiny.rdep").read_text(encoding="utf-8")
    assert "schedule  bulk" in text
    stmt = ("segment   " + segment + "\n  " if segment else "") + "schedule  auto"
    path = tmp_path / "auto.rdep"
    path.write_text(text.replace("schedule  bulk", stmt), encoding="utf-8")
    spec = rdepc.load(path, T=tokens).spec
    geo = build_for(spec).geometry  # the graph pass of compile, every choice resolved
    j = run_json(capsys, path, "-D", f"T={tokens}")
    assert j["strategy"] == geo.strategy == plan(spec).strategy == want
    assert (j["symmetric_bytes"]["plan"]["S"], j["symmetric_bytes"]["plan"]["B"]) == (geo.S, geo.B)
    assert symmetric_plan(spec)["strategy"] == want


def test_schedule_auto_falls_back_where_compile_cannot_build(tmp_path, capsys):
    text = (ROOT / "examples" / "tiny.rdep").read_text(encoding="utf-8").replace("schedule  bulk", "schedule  auto")
    path = tmp_path / "auto.rdep"
    path.write_text(text, encoding="utf-8")
    j = run_json(capsys, path, "-D", "T=100000000")  # 3,125,000 combine tiles: no task table
    assert j["strategy"] == "bulk"
    assert j["warnings"][0].startswith("schedule auto planned as bulk: compile cannot choose (not supported yet: ")


def test_symmetric_plan_capacity_binds_bulk(tmp_path):
    spec = rdepc.load(write_spec(tmp_path, TINY_SHAPE + "\ncapacity factor 1.25\nschedule bulk")).spec
    got = symmetric_plan(spec)
    # R_q = min(W·T·min(K, E_loc), E_loc·cap_e) = min(128, 2·ceil(1.25·16)) = 40
    assert got["S"] == 40 and got["forward"]["payload"] == pad(40 * 64 * 4)
    with pytest.raises(ValueError, match="segment"):
        symmetric_plan(spec, "pipelined")


def test_moonlight_plan_regions(moonlight):
    p = moonlight["symmetric_bytes"]["plan"]
    assert p["strategy"] == "pipelined" and (p["S"], p["B"]) == (4096, 2)
    assert p["forward"]["payload"] == 2 * 4096 * 2048 * 2
    assert p["forward"]["sideband"] == 2 * 4096 * 16
    # the return ring (B·S = 8192 < T·K = 24576 rows) and one int64 row id per ring row
    assert p["buffers"]["return_ids"] == 8192 * 8
    assert p["forward"]["return"] == 2 * 4096 * 2048 * 2 + 8192 * 8
    assert p["forward"]["total"] == 67_316_992 and p["forward_backward"]["total"] == 134_567_424
    assert moonlight["symmetric_bytes"]["plan_bulk"]["buffers"]["return_ids"] == 0
    # 48 segments of the busiest owner (R_max = 196,608 rows / S = 4096), ring rotating:
    # 3 + 32 token tiles + 18·48 + 8·48 = 1283 done counters
    assert p["forward"]["control"] == pad(8 * 8) + 3 * pad(8 * 8 * 4) + pad(1283 * 8)
    assert p["private_total"] == 27 * p["forward_backward"]["total"]
    assert p["shared_total"] == p["forward_backward"]["total"]
    assert moonlight["symmetric_bytes"]["plan_bulk"]["S"] == 8 * 4096 * 6
