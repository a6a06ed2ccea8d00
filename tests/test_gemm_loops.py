"""The GEMM kernel's main loops as compiled for sm_90 (no GPU): moonlight's and qwen3's
``rdep_gemm`` builds against the lean grouped GEMM of ``bench/lean_gemm.py`` at the same
tiles — figures read from the SASS (``rdepc.codegen.sass``), held here so that a change
that costs the loops shows in CI. Each layer's GEMM kernel is held as generated for all
ranks in one process and for one process per rank (``emulated-mp``: a GPU's ``nvshmem``
builds differ from it by the transport kernel alone), where it reads its rows through
descriptors of its own. ``bench/gemm_loops.py`` writes the whole table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_S, ROOT
from rdepc.codegen import write_module
from rdepc.codegen.sm90 import compile_cubins

import rdepc
from rdepc.driver import generate_spec

BUILDS = [
    "rdep_gemm", "rdep_gemm.forward", "rdep_gemm.backward", "rdep_layer.backward", "rdep_transport",
    "rdep_transport.backward",
]  # fmt: skip
PER_RANK_BUILDS = ["rdep_gemm", "rdep_gemm.forward", "rdep_gemm.backward"]
_YARDSTICK = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bench.lean_gemm import compile_sass
print(json.dumps([compile_sass(2048, 2816, BN=256), compile_sass(1408, 2048, BN=128)]))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemm_loops")
    jobs = {"emulated": [], "emulated-mp": []}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for backend, named in jobs.items():
            for name in ("moonlight", "qwen3_30b_a3b"):
                out = tmp / backend / name
                out.mkdir(parents=True)
                write_module(generate_spec(rdepc.load(f"examples/{name}.rdep").spec, backend=backend), out)
                named.append((out / f"{name}_kernels.py", out / f"{name}.contract.json", out))
    finally:
        os.chdir(cwd)
    # compile_cubins' one process: beside the other test worker's, one a core on CI's 2
    results = compile_cubins(jobs["emulated"], arch=90, kernels=BUILDS)
    per_rank = compile_cubins(jobs["emulated-mp"], arch=90, kernels=PER_RANK_BUILDS)
    results += [{**r, "kernel": r["kernel"] + " (per rank)"} for r in per_rank]
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", _YARDSTICK, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=HANG_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    yard = {r["loops"][0]["shapes"][0]: r["loops"][0]["instructions"] for r in json.loads(done.stdout)}
    return results, yard


def test_the_forward_gemm_loops_run_like_the_lean_grouped_gemm(compiled):
    """Forward builds (keeping what a backward walks, and not): every GEMM loop within 10 %
    of the yardstick's instructions per iteration at its shape, its shared-memory addresses
    in uniform registers (at most one R2UR: the count of started programs, which an expired
    wait reports, costs the loops one and 3-4 instructions; three in GEMM1's loop of the
    per-rank build that saves nothing, where the call that counts a run of empty segments
    done leaves it 169 registers: 80 instructions against 79), no spill inside, one MMA
    group in flight while the next chunk loads; the kernel without stack."""
    results, yard = compiled
    assert set(yard) == {"64x256x16", "64x128x16"}
    forward = [r for r in results if r["kernel"].startswith("rdep_gemm") and "backward" not in r["kernel"]]
    assert len(forward) == 8
    for r in forward:
        assert r["stack"] == 0 and r["local_bytes"] == 0, (r["layer"], r["kernel"], r["stack"])
        assert r["ctas_per_sm"] == 1 and r["shared"] <= 227 * 1024
        shapes = sorted(loop["shapes"][0] for loop in r["loops"])
        assert shapes == ["64x128x16", "64x256x16"], (r["kernel"], shapes)  # GEMM2's loop, GEMM1's
        for loop in r["loops"]:
            where = (r["layer"], r["kernel"], loop["shapes"], loop["instructions"])
            assert loop["instructions"] <= 1.10 * yard[loop["shapes"][0]], where
            most = 3 if r["kernel"] == "rdep_gemm.forward (per rank)" else 1
            assert loop["r2ur"] <= most and loop["spill_loads"] == loop["spill_stores"] == 0, where
            assert loop["wait_depth"] >= 1 and loop["tma_loads"] == 2 and loop["hgmma"] == 4, where


def test_the_backward_gemm_loops_are_pipelined_and_spill_free(compiled):
    """The backward's GEMM work, in split mode's GEMM kernel and in the unified kernel (the
    interpreter's default): four loops — dA = dO·Wdᵀ, dX = dH·[Wg Wu]ᵀ and the two weight
    gradients — each on TMA with one barrier for both loads (``gemm_tile`` loads A before a
    transposed B), pipelined (wait depth 1), without a spill inside, within the forward's
    1.10× of the yardstick in the GEMM kernel (1.03-1.07×) and 1.16× in the unified one
    (1.03-1.08×). Stack: none in the GEMM kernel, whose gated dA epilogue runs over even and
    odd columns apart, the loads ``anchored`` to the accumulator (``paired_backward``); the
    unified kernel's 904-1,160 B are in dA's epilogue, where Triton forms the gated
    activation's backward in two layouts, the accumulator's and the stride-2 loads' (its
    registers, beside the transport code, do not hold the GEMM kernel's way), and in the
    backward combine's unrolled slots (864-1,112 B before them; 1,128-1,152 B with each
    slot's rows addressed on their own) (bench/results/gemm-loops-sm90.md)."""
    results, yard = compiled
    backward = [r for r in results if "backward" in r["kernel"] and r["loops"]]  # the transport has no GEMM
    kernels = ["rdep_gemm.backward"] * 2 + ["rdep_gemm.backward (per rank)"] * 2 + ["rdep_layer.backward"] * 2
    assert sorted(r["kernel"] for r in backward) == kernels
    for r in backward:
        split = r["kernel"].startswith("rdep_gemm")
        assert len(r["loops"]) == 4, r["loops"]
        for loop in r["loops"]:
            where = (r["layer"], r["kernel"], loop["shapes"], loop["instructions"])
            assert loop["spill_loads"] == loop["spill_stores"] == 0 and loop["wait_depth"] >= 1, where
            assert loop["tma_loads"] == 2 and loop["r2ur"] <= 1, where
            assert loop["instructions"] <= (1.10 if split else 1.16) * yard[loop["shapes"][0]], where
        assert r["stack"] <= (0 if split else 1160), (r["layer"], r["kernel"], r["stack"])


def test_the_combine_loads_every_slot_before_it_sums(compiled):
    """The transport kernel's combine (one process): per step of COMBINE_COLS columns of its
    COMBINE_TOKENS tokens, all K slots' rows are loaded before the first FMA or store waits
    for them (a loop over the slots kept one slot's rows in flight, and the stage is
    latency-bound: 2.16 ms for moonlight at T' = 4096 on an H200, 12 GB/s a program; so did
    this build's stores of each slot's rows for the backward, SAVE, before the next slot's
    loads: 4 of 24 loads ahead), without a spill. The backward's combine streams 2K + 1 rows
    a token (dL/dy, the K returned rows, the K kept outputs): at least a move step's bytes
    (MOVE_BYTES) in flight, no spill (over the slots in BLOCK_H columns it spilled 9-24 loads
    a slot and step, with 216-336 B of stack; with the backward's moves 16 KB a step, it
    held 34-36 loads ahead, 136-144 KB, and the moves a quarter of a step)."""
    from rdepc.ir.contract import Tiles
    from rdepc.ir.sizes import BM as COMBINE_TOKENS  # the generated COMBINE_TOKENS (KernelContract.combine_tokens)
    from rdepc.ir.sizes import MOVE_BYTES, combine_cols

    results, _ = compiled
    for kernel in ("rdep_transport", "rdep_transport.backward"):
        transport = [r for r in results if r["kernel"] == kernel]
        assert sorted(r["layer"] for r in transport) == ["moonlight", "qwen3_30b_a3b"]
        for r in transport:
            sh = rdepc.load(ROOT / "examples" / f"{r['layer']}.rdep").shapes
            K, threads = sh["K"], 32 * Tiles.default(sh["H"], sh["F"], "bf16", interpret=False).num_warps
            cols = combine_cols(K)
            per_slot = COMBINE_TOKENS * cols * 2 // (threads * 16)  # bf16 rows, 16-byte loads
            if kernel == "rdep_transport":  # one FMA per slot and element: g'·out
                combine = [loop for loop in r["sum_loops"] if loop["ffma"] == K * COMBINE_TOKENS * cols // threads]
            else:  # dL/dx and dL/dg' (dL/dy · out): K returned rows, K kept outputs and dL/dy a step
                combine = [loop for loop in r["sum_loops"] if loop["loads"] == (2 * K + 1) * per_slot]
            assert len(combine) == 1, (r["layer"], kernel, r["sum_loops"])
            where = (r["layer"], kernel, combine[0])
            if kernel == "rdep_transport":
                assert combine[0]["loads_ahead"] >= K * per_slot, where
            else:
                assert combine[0]["loads_ahead"] * 16 * threads >= MOVE_BYTES, where
            assert combine[0]["spill_loads"] == combine[0]["spill_stores"] == 0, where


def test_the_transport_moves_load_a_whole_step_before_they_store(compiled):
    """The transport kernel's moves (dispatch, return and, with a return ring, unpack: rows
    copied as they are, the backward's dispatch scaled by g'): every 16-byte load of a step
    of MOVE_BYTES (64 rows of ``move_cols`` columns) issues before the first store waits for
    one, without a spill. In BLOCK_H columns a step was 16 KB a program, one round trip
    each."""
    from rdepc.ir.contract import KernelContract, Tiles
    from rdepc.ir.sizes import MOVE_BYTES

    results, _ = compiled
    transport = [r for r in results if r["kernel"] in ("rdep_transport", "rdep_transport.backward")]
    assert sorted(r["layer"] for r in transport) == ["moonlight"] * 2 + ["qwen3_30b_a3b"] * 2
    for r in transport:
        contract = KernelContract.from_json(Path(r["cubin"]).with_name(f"{r['layer']}.contract.json").read_text())
        sh = rdepc.load(ROOT / "examples" / f"{r['layer']}.rdep").shapes
        threads = 32 * Tiles.default(sh["H"], sh["F"], "bf16", interpret=False).num_warps
        step = MOVE_BYTES // (threads * 16)
        moves = [loop for loop in r["move_loops"] if loop["loads"] == step]
        assert len(moves) == (3 if contract.ring else 2), (r["layer"], r["kernel"], r["move_loops"])
        for loop in moves:
            assert loop["loads_ahead"] == step and loop["spill_loads"] == loop["spill_stores"] == 0, (r["layer"], loop)


def test_the_gemm_kernel_copies_its_kept_rows_a_whole_step_at_a_time(compiled):
    """The GEMM kernel's row copies — a training forward's input rows kept for the backward
    (``gemm1`` under SAVE), the backward's dO rows — step KEEP_COLS columns of an m-tile's
    rows, MOVE_BYTES a step: every 16-byte load issues before the first store, without a
    spill, and the GEMM loops keep their figures (held above). In BLOCK_K columns a step
    was 16 KB, a round trip each, in the program's GEMM1 item."""
    from rdepc.ir.contract import Tiles
    from rdepc.ir.sizes import MOVE_BYTES

    results, _ = compiled
    copying = [r for r in results if r["kernel"].split()[0] in ("rdep_gemm", "rdep_gemm.backward")]
    assert len(copying) == 8, [(r["layer"], r["kernel"]) for r in copying]
    for r in copying:
        sh = rdepc.load(ROOT / "examples" / f"{r['layer']}.rdep").shapes
        step = MOVE_BYTES // (32 * Tiles.default(sh["H"], sh["F"], "bf16", interpret=False).num_warps * 16)
        where = (r["layer"], r["kernel"], r["move_loops"])
        assert [(m["loads"], m["loads_ahead"], m["spill_loads"], m["spill_stores"]) for m in r["move_loops"]] == [
            (step, step, 0, 0)
        ], where
    forward = [r for r in results if r["kernel"].split()[0] == "rdep_gemm.forward"]  # keeps nothing: copies none
    assert forward and not any(r["move_loops"] for r in forward)
