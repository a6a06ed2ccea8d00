"""The scheduling work a GEMM tile costs, counted under the interpreter (bench/sched_ops.py):
split mode's GEMM kernel binds a tile with a handful of global operations once its entry is
open; the unified kernel pays its ticket, search, table row and every dependency for each.
The slots a routing leaves empty cost split mode's GEMM kernel one signal per entry."""

from __future__ import annotations

import sys

from conftest import ROOT


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
