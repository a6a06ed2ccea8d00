"""The kernel interface declared once (rdepc.ir.interface): what is declared there reaches
the emitted constants, the device stand-ins, the lowering's buffers and the runtime's reader."""

from __future__ import annotations

import ast

import pytest
import torch
from conftest import TINY
from rdepc.codegen import emit
from rdepc.codegen.device import HERE
from rdepc.runtime.stats import call_stats

import rdepc
from rdepc.driver import generate_spec
from rdepc.ir import interface
from rdepc.ir.interface import Column, stats_columns, stats_constants


def contract():
    return generate_spec(rdepc.load(TINY).spec, schedule="bulk").kernel


def stand_ins() -> dict[str, int]:
    """layout.py's ST_* stand-ins and its E_MAX: name → the int in tl.constexpr(...)."""
    tree = ast.parse((HERE / "layout.py").read_text(encoding="utf-8"))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.startswith("ST_") or name == "E_MAX":
                out[name] = node.value.args[0].value
    return out


def test_the_device_stand_ins_are_the_declared_columns():
    have = stand_ins()
    want = {name: value for name, value, _ in stats_constants(have.pop("E_MAX"))}
    assert have == want


def test_the_emitted_constants_are_the_declared_columns():
    p = contract()
    block = emit.constants(p)
    at = stats_columns(p.E_MAX)
    assert f"ST_ADMITTED = tl.constexpr({p.E_MAX})  # rows admitted per local expert," in block
    assert f"ST_COLS = tl.constexpr({at['cols']})\n" in block
    assert {n: s for n, _, s in p.private}["stats"] == (p.W, at["cols"])


def test_a_column_declared_once_reaches_the_kernel_the_buffer_and_the_reader(monkeypatch):
    """A column put first in STATS, with no other edit: the emitted constants name it and move
    every other column on, the lowering's stats buffer grows by it, and the runtime's reader
    finds each statistic at its new place."""
    before = contract()
    cols = stats_columns(before.E_MAX)["cols"]
    monkeypatch.setattr(interface, "STATS", (Column("probe", False, "a column for this test"), *interface.STATS))
    p = contract()
    block = emit.constants(p)
    assert "ST_PROBE = tl.constexpr(0)  # stats [W, ST_COLS]: a column for this test," in block
    assert "ST_ARRIVED = tl.constexpr(1)  # rows arrived per local expert," in block
    assert f"ST_COLS = tl.constexpr({cols + 1})\n" in block
    assert {n: s for n, _, s in p.private}["stats"] == (p.W, cols + 1)
    at = stats_columns(p.E_MAX)
    stats = torch.zeros(p.W, at["cols"], dtype=torch.int32)
    stats[:, at["probe"]] = -7  # read as nothing the reader reports
    for q in range(p.W):
        stats[q, at["arrived"] : at["arrived"] + p.E_MAX] = torch.arange(p.E_MAX) + 10 * q + 3
        stats[q, at["admitted"] : at["admitted"] + p.E_MAX] = torch.arange(p.E_MAX) + 10 * q + 1
        stats[q, at["mtiles"]], stats[q, at["cap"]] = q + 5, 9
        stats[q, at["sent"]], stats[q, at["returned"]] = 100 + q, 200 + q
    ids = torch.zeros(p.W, p.T, p.K, dtype=torch.long)
    got = call_stats(p, stats, ids, torch.ones_like(ids, dtype=torch.bool), launches=1)
    want_admitted = torch.tensor([10 * p.owner[e] + 1 + p.local[e] for e in range(p.E)])
    assert torch.equal(got["rows_per_expert"], want_admitted)
    assert torch.equal(got["dropped_per_expert"], torch.full((p.E,), 2))
    assert got["capacity"] == 9
    assert got["m_tiles"].tolist() == [q + 5 for q in range(p.W)]
    assert got["dispatched_rows"].tolist() == [100 + q for q in range(p.W)]
    assert got["returned_rows"].tolist() == [200 + q for q in range(p.W)]


@pytest.mark.parametrize("E_MAX", [1, 2, 64])
def test_the_columns_tile_a_row(E_MAX):
    at = stats_columns(E_MAX)
    widths = [E_MAX if c.per_expert else 1 for c in interface.STATS]
    assert [at[c.name] for c in interface.STATS] == [sum(widths[:i]) for i in range(len(widths))]
    assert at["cols"] == sum(widths) == 2 * E_MAX + 4
