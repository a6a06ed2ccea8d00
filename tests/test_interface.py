"""The kernel interface declared once (rdepc.ir.interface, rdepc.ir.arguments): what is
declared there reaches the emitted constants, the device stand-ins, the kernels' signatures,
the lowering's buffers and the runtime."""

from __future__ import annotations

import ast
import importlib
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, TINY
from rdepc.codegen import emit
from rdepc.runtime.stats import call_stats

import rdepc
from rdepc.driver import generate_spec
from rdepc.ir import arguments, interface
from rdepc.ir.interface import Column, Constant, constant_values, stats_columns


def stand_ins():
    """codegen/device/layout.py, imported under the interpreter as the CPU tests run it."""
    from rdepc.codegen.device import layout

    return layout


def contract():
    return generate_spec(rdepc.load(TINY).spec, schedule="bulk").kernel


def test_the_device_stand_ins_are_the_tables_values_for_tiny():
    """layout.py's stand-ins are every constant of the table at tiny's values: its contract,
    stand_in.json, still gives what compile gives tiny now (else write it again:
    ``generate_spec(rdepc.load("examples/tiny.rdep").spec).kernel.to_json()``)."""
    layout = stand_ins()
    import triton.language as tl

    want = {name: value for name, value, _ in constant_values(contract())}
    have = {name: value for name, value, _ in constant_values(layout.STAND_IN)}
    assert have == want
    for name, value in want.items():
        got = getattr(layout, name).value
        assert got == (getattr(tl, value.name) if isinstance(value, interface.Tl) else value)
    assert {n for n, v in vars(layout).items() if n.isupper() and n != "STAND_IN"} == set(want)


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


def test_a_constant_declared_once_reaches_the_kernel_the_stand_ins_and_the_runtime(monkeypatch):
    """A constant put first in CONSTANTS, with no other edit: the emitted block writes it with
    its comment, the device modules' stand-ins hold it at tiny's value, and a module of the
    layer reads it among its constants."""
    probe = Constant("PROBE", lambda p: 1000 * p.W + p.E, "a constant for this test")
    first, *rest = interface.CONSTANTS
    monkeypatch.setattr(interface, "CONSTANTS", (replace(first, constants=(probe, *first.members())), *rest))
    p = contract()
    assert "PROBE = tl.constexpr(4008)  # a constant for this test\nW = tl.constexpr(4)" in emit.constants(p)
    module = rdepc.load(TINY).module("emulated", "cpu")
    assert module.constants["PROBE"] == 4008 and module.constants["W"] == 4
    layout = stand_ins()
    try:
        assert importlib.reload(layout).PROBE.value == 4008
    finally:
        monkeypatch.undo()
        del layout.PROBE
        importlib.reload(layout)


@pytest.mark.parametrize("kernel", arguments.KERNELS)
def test_the_declared_arguments_are_the_kernels_signatures(kernel):
    """ARGUMENTS, read by kernel_args, is each device kernel's signature: its names in order,
    tl.constexpr exactly where it declares a constexpr."""
    source = {"rdep_layer": "kernel.py", "rdep_gemm": "gemm_kernel.py"}[kernel]
    tree = ast.parse((ROOT / "codegen" / "device" / source).read_text(encoding="utf-8"))
    fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == kernel)
    constexpr = [a.annotation is not None and ast.unparse(a.annotation) == "tl.constexpr" for a in fn.args.args]
    signature = list(zip([a.arg for a in fn.args.args], constexpr, strict=True))
    declared = arguments.kernel_args(contract(), kernel)
    assert signature == [(name, kind == "constexpr") for name, kind in declared]


def test_every_private_buffer_is_an_argument_or_the_backwards_own():
    names = {n for n, _ in arguments.kernel_args(contract())}
    for p in arguments.PRIVATE:
        assert (p.backward_of or p.name) in names, p.name
    backward = {p.name for p in arguments.PRIVATE if p.backward_of}
    assert backward == arguments.BACKWARD_PRIVATE == {"bwd_ctl", "bwd_tile_done"}


def test_a_private_buffer_declared_once_reaches_the_contract_and_the_module(monkeypatch, tmp_path):
    """A private buffer put last in PRIVATE, with no other edit: the lowering's contract lists
    it at its shape and a module of the layer (compiled anew: a cache of its own) allocates
    it, zeroed."""
    monkeypatch.setenv("RDEPC_CACHE_DIR", str(tmp_path))
    probe = arguments.Private("probe", "int32", lambda z: (z.W, z.E_MAX + 1), "a buffer for this test")
    monkeypatch.setattr(arguments, "PRIVATE", (*arguments.PRIVATE, probe))
    p = contract()
    assert p.private[-1] == ("probe", "int32", (p.W, p.E_MAX + 1))
    module = rdepc.load(TINY).module("emulated", "cpu")
    got = module.private["probe"]
    assert got.shape == (p.W, p.E_MAX + 1) and got.dtype == torch.int32 and not got.any()


@pytest.mark.parametrize("example", ["tiny.rdep", "moonlight.rdep"])
def test_the_memory_plans_private_buffers_are_a_ranks_part_of_the_interfaces(example):
    """The memory plan's private buffers are one rank's part of the interface's as the
    lowering sizes them: the workspace hbuf and hbuf_rid, the staging ring staging and
    staging_rid, the landing (moonlight's return ring) landing."""
    g = generate_spec(rdepc.load(ROOT / "examples" / example).spec)
    width = {"fp32": 4, "bf16": 2, "fp16": 2, "int32": 4, "int64": 8}
    part = {name: width[dtype] * torch.Size(shape[1:]).numel() for name, dtype, shape in g.kernel.private}
    want = {"workspace": part["hbuf"] + part["hbuf_rid"], "staging": part["staging"] + part["staging_rid"]}
    want |= {"landing": part["landing"]} if "landing" in part else {}
    assert {b.name: b.bytes for b in g.memory.private} == want
    assert ("landing" in want) == (example == "moonlight.rdep") == g.schedule.graph.geometry.return_ring
