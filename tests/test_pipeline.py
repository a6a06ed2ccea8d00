"""The segmented pipeline executed: B-slot rings, epochs, bounded waits, both kernel modes.

Under the Triton interpreter (programs run one after another, in ticket order): every
strategy — bulk, pipelined, deep — gives the reference's result and bitwise the same
result as the others, over random layers, routings and B in {1, 2, 3}; a withheld
producer trips its dependent's bounded wait with the kernel's own error record and the
next call succeeds; guard bands between the heap's buffers stay intact; the heap is the
planner's size; any topological order of the task table gives the same result.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tiny_segmented
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rdepc.codegen import generate
from rdepc.codegen.lower import lower
from rdepc.passes.memplan import memory_plan
from rdepc.passes.symmetric import symmetric_plan
from rdepc.runtime.module import KernelError, RDEPModule
from tolerance import assert_close, bound, layer_chain

import rdepc
from rdepc.api import Layer, elaborate_layer
from rdepc.ir.contract import COLUMNS, CONTROL, GEMM_KINDS, Tiles
from rdepc.parser import parse_text
from rdepc.reference import random_inputs, reference_for

STRATEGIES = ("bulk", "pipelined", "deep")
TILES = Tiles(bm=16, block_h=32, block_f=32, block_r=16)  # small tiles: segments cut m-tiles


SPECS = Path()  # where the module's variant specs are written (a temporary directory)


@pytest.fixture(autouse=True, scope="module")
def _specs(module_cache, tmp_path_factory):
    global SPECS
    SPECS = tmp_path_factory.mktemp("specs")


@dataclass(frozen=True)
class Seg:
    """One segmented layer and one call."""

    W: int
    E: int
    K: int
    T: int
    S: int
    B: int
    H: int = 32
    F: int = 32
    capacity: str = "dropless"
    owner: str = "balanced"
    routing: str = "uniform"
    seed: int = 0

    def text(self) -> str:
        return (
            "layer seg {\n"
            f"  shape     ranks {self.W}, tokens {self.T}, hidden {self.H}, experts {self.E}, top {self.K}\n"
            f"  expert    swiglu(ffn = {self.F})\n"
            "  dtype     fp32\n"
            f"  owner     {self.owner}\n"
            f"  capacity  {self.capacity}\n"
            f"  segment   rows {self.S}, buffers {self.B}\n"
            "  schedule  pipelined\n"
            "}\n"
        )

    def layer(self) -> Layer:
        spec, _ = elaborate_layer(parse_text(self.text(), "seg.rdep"), None, {})
        return Layer(spec)

    def inputs(self):
        return random_inputs(self.W, self.T, self.H, self.F, self.E, self.K, routing=self.routing, seed=self.seed)


@st.composite
def segs(draw) -> Seg:
    W = draw(st.integers(1, 3))
    E = W * draw(st.integers(1, 2)) + (draw(st.integers(0, 1)) if W > 1 else 0)
    K = draw(st.integers(1, min(E, 3)))
    return Seg(
        W=W,
        E=E,
        K=K,
        T=draw(st.integers(1, 16)),
        S=draw(st.sampled_from([3, 5, 8, 16, 40])),
        B=draw(st.sampled_from([1, 2, 3])),
        capacity=draw(st.sampled_from(["dropless", "factor 1.0", "factor 0.5, weights zero", "rows 3"])),
        owner=draw(st.sampled_from(["balanced", "balanced", f"map {{ 0: 0..{E} }}"])),
        routing=draw(st.sampled_from(["uniform", "zipf:1.5"])),
        seed=draw(st.integers(0, 2**16)),
    )


def run_all(case: Seg) -> dict[str, RDEPModule]:
    layer = case.layer()
    inputs = case.inputs()
    ref, accepted = reference_for(layer.spec)(*inputs)
    limit = bound(reference_for(layer.spec), inputs, layer_chain(case.H, case.F, case.K))
    ys, modules = {}, {}
    for strategy in STRATEGIES:
        m = layer.module(schedule=strategy, tiles=TILES)
        assert m.contract.strategy == strategy and (strategy == "bulk" or m.contract.B == case.B)
        ys[strategy] = m(*inputs)
        assert_close(ys[strategy], ref, limit, f"{strategy}: {case}")
        assert torch.equal(m.last_stats["accepted"], accepted), f"{strategy}: accepted set differs for {case}"
        modules[strategy] = m
    for strategy in STRATEGIES[1:]:
        assert torch.equal(ys[strategy], ys["bulk"]), f"{strategy} is not bitwise bulk's result for {case}"
    return modules


@settings(max_examples=1)
@given(segs())
@example(Seg(W=2, E=4, K=2, T=12, S=5, B=1, routing="zipf:1.5"))  # B = 1: every segment reuses the one slot
@example(Seg(W=3, E=6, K=2, T=10, S=8, B=3, capacity="factor 0.5, weights zero"))  # deep, drops
@example(Seg(W=2, E=3, K=2, T=16, S=3, B=2, owner="map { 0: 0, 1; 1: 2 }"))  # a return ring of 6 rows
def test_every_strategy_matches_the_reference_and_each_other(case):
    modules = run_all(case)
    seg = modules["pipelined"]
    rows = case.W * case.T * case.K
    if seg.contract.B * seg.contract.S < case.T * case.K:
        assert seg.contract.ring  # returns went through the ring and its unpacks
    assert int(seg.last_stats["rows_per_expert"].sum()) == rows - seg.last_stats["dropped_rows"]


def test_tiny_every_strategy_and_B(monkeypatch):
    """tiny.rdep in segments of 32 rows, B = 2, deep (the property above runs every strategy),
    and with B = 1 and 3 slots of 8 rows, where returns go through a ring: one result,
    bitwise."""
    monkeypatch.chdir(ROOT)
    base = rdepc.load(tiny_segmented(SPECS))
    inputs = random_inputs(4, 16, 64, 128, 8, 2, seed=3)
    ref, _ = reference_for(base.spec)(*inputs)
    sh = base.shapes
    limit = bound(reference_for(base.spec), inputs, layer_chain(sh["H"], sh["F"], sh["K"]))
    runs = [(base, "deep")] + [(rdepc.load(_tiny(B)), s) for B, s in ((1, "pipelined"), (3, "deep"))]
    want = None
    for layer, strategy in runs:
        m = layer.module(schedule=strategy)
        y = m(*inputs)
        assert_close(y, ref, limit, f"{layer.spec.file} {strategy}")
        want = y if want is None else want
        assert torch.equal(y, want), f"{layer.spec.file} {strategy}"
        if layer is not base:
            assert m.contract.ring and m.contract.S == 8 and m.contract.strategy == strategy


def _tiny(B: int) -> Path:
    """tiny.rdep with B ring slots of 8 rows (B·S < T·K = 32: returns go through a ring)."""
    return tiny_segmented(SPECS, rows=8, buffers=B)


# ------------------------------------------------------------------ faults and epochs


def small(B: int = 2) -> Seg:
    """Two ranks, 8 tokens, slots of 6 rows: 3 segments per owner (B = 1: a return ring)."""
    return Seg(W=2, E=4, K=2, T=8, S=6, B=B, routing="zipf:1.2", seed=B)


def test_a_withheld_producer_trips_its_dependent_and_the_next_call_recovers():
    case = small(1)
    layer = case.layer()
    m = layer.module(schedule="pipelined", spin_bound=50)
    inputs = case.inputs()
    ref, _ = reference_for(layer.spec)(*inputs)
    limit = bound(reference_for(layer.spec), inputs, layer_chain(case.H, case.F, case.K))
    good = m(*inputs)
    names = m.contract.names
    victim = next(i for i, n in enumerate(names) if n.startswith("dispatch s1 "))
    m.withhold(victim)
    with pytest.raises(KernelError) as e:
        m(*inputs)
    rec = e.value.record
    assert rec["what"] == "wait expired" and rec["call"] == 2
    assert rec["flag"] == victim and rec["flag_task"] == names[victim]
    assert rec["task"].startswith("gemm1 s1 ") and rec["segment"] == 1  # the dispatch's consumer
    assert rec["seen"] < rec["expected"] and rec["expected"] == 2 * m.work.table[victim][6]
    assert f"waited 50 spins for the done flag of task #{victim} ({names[victim]})" in str(e.value)
    again = m(*inputs)  # re-initialised: call 1 of a fresh epoch, no stale flags
    assert m.epoch == 1 and torch.equal(again, good)
    assert_close(again, ref, limit, "after the error")
    assert torch.equal(m(*inputs), good) and m.epoch == 2


@pytest.mark.parametrize("mode", ["unified", "split"])
def test_a_launch_replayed_as_is_computes_the_next_call(mode):
    """What replaying a captured CUDA graph does: the very same launches, every argument and
    output buffer unchanged. The epoch is counted on the device, so the replay is call 3 —
    it waits for call 3's flags and takes call 3's tickets — and recomputes the output."""
    case = small(2)
    m = case.layer().module(schedule="pipelined", mode=mode)
    inputs = case.inputs()
    calls = []
    launch = m.launcher

    def record(launches):
        calls.append(launches)
        launch(launches)

    m.launcher = record
    m.launcher.launches = 0
    first, second = m(*inputs), m(*inputs)
    assert torch.equal(first, second)
    for one, two in zip(*calls, strict=True):
        scalars = [(a, b) for a, b in zip(one[2], two[2], strict=True) if not isinstance(a, torch.Tensor)]
        assert scalars and all(a == b for a, b in scalars) and one[3] == two[3], "a per-call argument"
    second.zero_()
    launch(calls[1])  # the replay, into call 2's own output buffer
    assert torch.equal(second, first)
    assert m.private["ctl"][CONTROL.index("calls")] == 3 and torch.equal(m(*inputs), first)


@pytest.mark.parametrize("B", [1])  # one slot: the returns go through the ring
def test_split_runs_both_kernels_concurrently_and_matches_unified(B):
    """Split mode under the interpreter: the transport kernel's program and the GEMM
    kernel's programs are threads that run at once — transport and GEMM work items overlap
    in time (the logical clock interleaves them) — and the result is bitwise the unified
    kernel's, forward and backward, call after call."""
    case = small(B)
    layer = case.layer()
    inputs = case.inputs()
    unified = layer.module(schedule="pipelined")
    want = unified(*inputs)
    m = layer.module(schedule="pipelined", mode="split", profile=True)
    assert m.grid == 3 and m.per_queue == (1, 2)
    for _ in range(2):
        assert torch.equal(m(*inputs), want)
    col = COLUMNS.index("kind")
    spans = {gemm: [] for gemm in (False, True)}
    for entry, start, end in m.last_profile["events"]:
        spans[m.contract.table[entry][col] in GEMM_KINDS].append((start, end))
    overlaps = sum(1 for a in spans[False] for b in spans[True] if a[0] < b[1] and b[0] < a[1])
    assert overlaps > 0, "transport and GEMM work never overlapped"
    grads = []
    for module in (unified, m):
        leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
        (module(*leaves) * torch.linspace(-1, 1, want.numel()).view(want.shape)).sum().backward()
        grads.append([t.grad for t in leaves if t.is_floating_point()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_runs_of_moves_without_rows_counted_done_by_racing_programs_stay_bitwise():
    """Split mode's transport kernel counts a run of moves without rows done at once
    (``take_empty_run``): their tickets in one step, each entry once its dependencies are
    done or in the run. With three transport programs racing for tickets, a return ring
    (B = 1) and owners whose rows fill two or three of their 8 segments, the forward is
    bitwise the unified kernel's in calls whose routings leave different segments empty,
    the backward too, and some moves were counted done without running."""
    cases = [Seg(W=4, E=8, K=2, T=4, S=4, B=1, routing=r, seed=i) for i, r in enumerate(("uniform", "zipf:1.5"))]
    layer = cases[0].layer()
    unified = layer.module(schedule="pipelined")
    split = layer.module(schedule="pipelined", mode="split", programs=4, comm_programs=3, profile=True)
    assert split.contract.ring and split.per_queue == (3, 1)
    for backward, case in zip((True, False), cases, strict=True):
        inputs = case.inputs()
        outs = []
        for module in (unified, split):
            leaves = [t.clone().requires_grad_(backward) if t.is_floating_point() else t for t in inputs]
            y = module(*leaves)
            if backward:
                (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
            outs.append([y.detach()] + [t.grad for t in leaves if backward and t.is_floating_point()])
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True)), case.routing
        moves = split.last_profile["kernels"][0]["kinds"]
        ran = sum(moves[k]["ran"] for k in ("dispatch", "return", "unpack"))
        assert ran < sum(moves[k]["items"] for k in ("dispatch", "return", "unpack")), moves  # how many: timing


# ------------------------------------------------------------------ the heap


def _module(spec, strategy: str, tmp_path: Path, guard: int = 0, order=None, **options) -> RDEPModule:
    from rdepc.passes.graph import build_graph
    from rdepc.passes.schedule import schedule

    sched = schedule(build_graph(spec, strategy), "h100")
    plan = lower(spec, sched, memory_plan(sched), guard=guard, order=order)
    path = tmp_path / f"{strategy}_{guard}_{abs(hash(order))}_kernels.py"
    path.write_text(generate(plan), encoding="utf-8")
    return RDEPModule(plan, path, **options)


def test_the_heap_is_the_planners(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    balanced = tmp_path / "m.rdep"  # balance replicate: the physical layer's heap, its slots experts of their ranks
    balanced.write_text(
        (ROOT / "examples/moonlight.rdep")
        .read_text()
        .replace("  schedule", "  balance   replicate(slots = 2, min_rows = 64)\n  schedule")
    )
    for path in (
        tiny_segmented(tmp_path),
        ROOT / "examples/moonlight.rdep",
        ROOT / "examples/qwen3_30b_a3b.rdep",
        balanced,
    ):
        spec = rdepc.load(path).spec
        name = path.stem
        for strategy in STRATEGIES:
            g = rdepc.load(path).compile(schedule=strategy).kernel
            planned = symmetric_plan(spec, strategy)["forward_backward"]["total"]
            assert g.heap_bytes == planned, f"{name} {strategy}: heap {g.heap_bytes} != plan {planned}"
    spec = rdepc.load(_tiny(2)).spec
    m = _module(spec, "pipelined", tmp_path)
    assert tuple(m.heap.shape) == (4, symmetric_plan(spec, "pipelined")["forward_backward"]["total"])


@pytest.mark.parametrize("B", [1, 2, 3])
def test_guard_bands_around_every_heap_buffer_stay_intact(tmp_path, B):
    case = small(B)
    spec = case.layer().spec
    inputs = case.inputs()
    ref, _ = reference_for(spec)(*inputs)
    limit = bound(reference_for(spec), inputs, layer_chain(case.H, case.F, case.K))
    guard = 256
    for strategy in STRATEGIES:
        m = _module(spec, strategy, tmp_path, guard=guard)
        bands = [(off - guard, off) for _, _, off, _ in m.contract.layout]
        last = m.contract.layout[-1]
        bands.append((last[2] + last[3], m.contract.heap_bytes))
        assert all(hi - lo == guard for lo, hi in bands)
        pattern = torch.tensor([0xA5, 0x5A], dtype=torch.uint8).repeat(guard // 2)
        for lo, hi in bands:
            m.heap[:, lo:hi] = pattern
        y = m(*inputs)
        assert_close(y, ref, limit, strategy)
        for (lo, hi), (name, *_rest) in zip(bands, [*m.contract.layout, ("end",)], strict=True):
            assert torch.equal(m.heap[:, lo:hi], pattern.expand(case.W, -1)), f"{strategy}: guard before {name} hit"


def test_a_shuffled_topological_order_gives_the_same_result(tmp_path):
    case = small(2)
    spec = case.layer().spec
    inputs = case.inputs()
    base = _module(spec, "pipelined", tmp_path)
    want = base(*inputs)
    from rdepc.passes.graph import build_graph
    from rdepc.passes.schedule import schedule

    table = schedule(build_graph(spec, "pipelined"), "h100").table
    rng = random.Random(0)
    for _ in range(2):
        order, placed, ready = [], set(), [e.index for e in table if not e.deps]
        waiting = {e.index: set(e.deps) for e in table}
        while ready:  # Kahn's algorithm, a random ready entry each step
            i = ready.pop(rng.randrange(len(ready)))
            order.append(i)
            placed.add(i)
            for e in table:
                if e.index not in placed and e.index not in ready and waiting[e.index] <= placed:
                    ready.append(e.index)
        assert len(order) == len(table) and order != sorted(order)
        m = _module(spec, "pipelined", tmp_path, order=tuple(order))
        assert torch.equal(m(*inputs), want)
    with pytest.raises(ValueError, match="not topological"):
        _module(spec, "pipelined", tmp_path, order=tuple(reversed(range(len(table)))))


def test_cli_runs_split(monkeypatch, capsys):
    from rdepc import cli

    monkeypatch.chdir(ROOT)
    assert cli.main(["run", str(tiny_segmented(SPECS)), "--mode", "split", "--comm-programs", "2", "--check"]) == 0
    out = capsys.readouterr().out
    assert "2 launches, split mode: transport kernel 2 programs, GEMM kernel 1" in out and "check passed" in out


def test_a_gemm_kernel_that_never_started_is_named_in_the_error():
    """Split mode needs both kernels running at once. A GEMM kernel held back (here: its
    launch dropped) leaves the transport kernel's returns waiting; the error says how many
    of the GEMM kernel's programs had started, and the next call recovers."""
    case = small(2)
    m = case.layer().module(schedule="pipelined", mode="split")
    inputs = case.inputs()
    good = m(*inputs)
    launch, bound = m.launcher, m.spin_bound
    m.spin_bound = 200  # the returns' waits give up soon

    def transport_only(launches):
        launch(launches[:1])

    m.launcher = transport_only
    m.launcher.launches = 0
    with pytest.raises(KernelError) as e:
        m(*inputs)
    assert "0 of the GEMM kernel's 2 programs had started" in str(e.value)
    assert e.value.record["gemm_programs_started"] == 0
    m.launcher, m.spin_bound = launch, bound
    assert torch.equal(m(*inputs), good)
