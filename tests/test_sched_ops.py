"""The scheduling work a GEMM tile costs, counted under the interpreter (bench/sched_ops.py):
split mode's GEMM kernel binds a tile with a handful of global operations once its entry is
open; the unified kernel pays its ticket, search, table row and every dependency for each.
The slots a routing leaves empty cost split mode's GEMM kernel one signal per entry, the
segments it leaves empty a run of entries counted done at once (GEMM entries in the GEMM
kernel, moves in the transport kernel)."""

from __future__ import annotations

import sys

import torch
from conftest import ROOT, tiny_segmented

import rdepc
from rdepc.reference import random_inputs


def test_a_gemm_tile_costs_a_handful_of_global_operations_in_split_mode():
    sys.path.insert(0, str(ROOT))
    from bench.sched_ops import count

    tiny = ("examples/tiny.rdep", {"T": 64})  # a few m-tiles per GEMM entry; one GEMM program takes them all
    unified, split = (count(mode, "bulk", tiny, programs=2) for mode in ("unified", "split"))
    assert unified["tiles"] == split["tiles"] > 0
    # steady state: first item load, error word, 4 words of the m-tile table, GEMM2's m-tile wait, signals
    assert split["median"] <= 10, split
    assert unified["median"] >= 3 * split["median"] and unified["mean"] > split["mean"], (unified, split)
    # the m-tile slots the routing leaves empty: one signal per program and entry at most,
    # not one turn of the loop (and two signals) per slot
    empty = split["gemm_items"] - split["tiles"]
    assert 0 < split["empty_signals"] <= 2 * split["gemm_entries"] < empty, split
    # the unified kernel takes the untaken tickets of an entry at its first empty slot: a
    # ticket per item and one past them per program before, far fewer now
    assert unified["tickets"] <= unified["items"] - empty // 2, unified


def test_empty_segments_cost_a_run_not_a_turn_each(tmp_path):
    """A pipelined owner has segments for every row choosing it; an owner's rows fill them in
    order, so under a uniform routing most GEMM entries are of segments without rows. Split
    mode's GEMM kernel counts a run of them done in one vector signal per program and 64
    positions (each entry by the program whose items include its first), and its transport
    kernel the moves of those segments (``take_empty_run``: their tickets at once); each
    stamps the items it counts done in a profiled call, and the call computes bitwise what
    the unified kernel does, in calls whose empty segments differ."""
    sys.path.insert(0, str(ROOT))
    from bench.sched_ops import count

    path = tiny_segmented(tmp_path, rows=16)  # 8 segments an owner, about 2 of them filled
    split = count("split", "pipelined", (str(path), {}), programs=2)
    dead = split["empty_segment_entries"]
    assert dead >= split["gemm_entries"] // 2, split
    # the entries with rows take at most one signal per program (at its first empty slot);
    # the empty segments' entries a few runs' in all, not one per program and entry
    assert split["empty_signals"] <= 2 * (split["gemm_entries"] - dead) + 8 < 2 * split["gemm_entries"], split
    assert split["empty_signals"] < dead, split
    # the transport kernel's moves of those segments likewise: a run of moves without rows
    # takes its tickets at once (one a move and one past them per program before; how many
    # runs depends on how far the transport's program is ahead of the GEMMs)
    assert split["tickets"] < split["items"], split
    layer = rdepc.load(path)
    calls = [random_inputs(4, 16, 64, 128, 8, 2, seed=s, routing=r) for s, r in ((0, "uniform"), (1, "zipf:1.5"))]
    outs = {}
    for mode in ("unified", "split"):
        m = layer.module(schedule="pipelined", mode=mode, programs=2, profile=mode == "split")
        outs[mode] = [m(*calls[0][:6])]
        if mode == "split":  # the first call's stamps (ticks from 0): the run stamps each item it counts done
            stamps = m.private["profile"].view(-1, 2).tolist()[: m.work.n_items]
            assert all(start <= end and end > 0 for start, end in stamps)
            gemm = m.last_profile["kernels"][1]["kinds"]
            tiles = sum(m.last_stats["m_tiles"].tolist())
            assert gemm["gemm1"]["ran"] == tiles * -(-layer.shapes["F"] // m.tiles.block_f) < gemm["gemm1"]["items"]
            moves = m.last_profile["kernels"][0]["kinds"]
            assert sum(moves[k]["ran"] - moves[k]["items"] for k in ("dispatch", "return")) < 0, moves
        outs[mode] += [m(*inputs[:6]) for inputs in calls[1:]]
    assert all(torch.equal(a, b) for a, b in zip(outs["unified"], outs["split"], strict=True))
