"""The generated kernels running under the Triton interpreter (TRITON_INTERPRET=1, set by
the runtime only while it imports and launches them), checked against rdepc.reference.

Small shapes, large tiles, few programs: the interpreter costs ~0.4 ms per program and
1–3 ms per tl.dot. Every spec here is compiled for the bulk schedule and the emulated
backend; the hypothesis profile is the deterministic "ci" one (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rdepc.runtime.module import RDEPModule
from rdepc.runtime.tensors import TORCH_DTYPES
from runtime_run import BIG, SMALL, Run
from tolerance import NARROWINGS, assert_close, bound, layer_chain

from rdepc.api import Layer, elaborate_layer
from rdepc.ir.contract import Tiles, mode_kernels
from rdepc.parser import parse_text
from rdepc.reference import random_inputs, reference_for

pytestmark = pytest.mark.usefixtures("module_cache")


def routing_ids(run: Run, spec, tokens: int) -> torch.Tensor | None:
    """topk_ids for the routings random_inputs does not draw: "skip" (the last owner
    receives nothing, when top-K allows it). None: use random_inputs' own."""
    if run.routing != "skip":
        return None
    rng = random.Random(run.seed)
    last = max(spec.ownership.owner)
    pool = [e for e in range(run.E) if spec.ownership.owner[e] != last]
    pool = pool if len(pool) >= run.K else list(range(run.E))
    ids = [[rng.sample(pool, run.K) for _ in range(tokens)] for _ in range(run.W)]
    return torch.tensor(ids, dtype=torch.int64)


def execute(run: Run, module: RDEPModule | None = None):
    """(module, inputs, y, ref, accepted_ref) for one call of ``run``."""
    spec = run.spec()
    if module is None:
        module = Layer(spec).module(tiles=run.tiles, programs=run.programs)
    tokens = run.T if run.tokens is None else run.tokens
    kind = "uniform" if run.routing == "skip" else run.routing
    dtype = TORCH_DTYPES[run.dtype]
    inputs = random_inputs(
        run.W, tokens, run.H, run.F, run.E, run.K, routing=kind, seed=run.seed, dtype=dtype, gated=run.act == "swiglu"
    )
    ids = routing_ids(run, spec, tokens)
    if ids is not None:
        inputs = inputs._replace(topk_ids=ids)
    y = module(*inputs)
    fp32 = [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs]
    ref, accepted = reference_for(spec)(*fp32)
    return module, inputs, y, ref, accepted


def check_run(run: Run, module=None):
    module, inputs, y, ref, accepted = execute(run, module)
    p = module.contract
    W, K, E = p.W, p.K, p.E
    tokens = inputs.x.shape[1]
    st_ = module.last_stats
    fp32 = [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs]
    # fp16 and bf16 layers round their intermediates in their dtype: the bound in its unit roundoff
    dt = TORCH_DTYPES[run.dtype]
    chain = layer_chain(run.H, run.F, run.K) if dt == torch.float32 else NARROWINGS
    limit = bound(reference_for(run.spec()), fp32, chain, dt)
    assert_close(y, ref, limit, str(run))
    assert y.dtype == inputs.x.dtype and y.shape == inputs.x.shape
    assert torch.equal(st_["accepted"], accepted), "the accepted set differs from the reference's"
    # Accounting (eqs. 10, 12, minus drops) and the per-expert counts of the accepted set.
    ids = inputs.topk_ids
    want = torch.bincount(ids[accepted].flatten(), minlength=E)
    assert torch.equal(st_["rows_per_expert"], want)
    assert torch.equal(st_["received_per_expert"], torch.bincount(ids.flatten(), minlength=E))
    assert int(st_["rows_per_expert"].sum()) == W * tokens * K - st_["dropped_rows"]
    assert int(st_["rows_per_owner"].sum()) == int(st_["rows_per_expert"].sum())
    assert st_["launches"] == len(mode_kernels(module.mode))  # unified one kernel, split two
    # Padding-free: each owner ran exactly sum_e ceil(m_e / BM) m-tiles.
    bm = module.tiles.bm
    for q in range(W):
        mine = [e for e in range(E) if p.owner[e] == q]
        assert int(st_["m_tiles"][q]) == sum(math.ceil(int(want[e]) / bm) for e in mine)
    check_placement(module, inputs)
    return module


def check_placement(module: RDEPModule, inputs) -> None:
    """Every accepted row sits in its owner's payload at the slot of the routing context,
    with a row_id that decodes to its own (rank, token, slot), its local expert and its x."""
    p = module.contract
    ctx = module.last_context
    off = dict(p.heap)
    tokens = inputs.x.shape[1]
    c, a_rank, a_token, a_slot = p.row_id_radix(tokens)
    assert torch.equal(ctx.slot >= 0, ctx.accepted)
    heap = module.heap.cpu()
    wire = TORCH_DTYPES[p.dispatch]
    for r, t, k in ctx.accepted.nonzero().tolist():
        e = int(inputs.topk_ids[r, t, k])
        q, slot = p.owner[e], int(ctx.slot[r, t, k])
        rank_heap = heap[q]
        row_id = int(
            rank_heap[off["sideband_row_id"] + 8 * slot : off["sideband_row_id"] + 8 * slot + 8].view(torch.int64)
        )
        assert row_id == c + a_rank * r + a_token * t + a_slot * k  # the spec's (injective) encoding
        if "sideband_local_expert" in off:
            at = off["sideband_local_expert"] + 4 * slot
            assert int(rank_heap[at : at + 4].view(torch.int32)) == p.local[e]
        nbytes = wire.itemsize * p.H
        row = rank_heap[off["payload"] + slot * nbytes : off["payload"] + (slot + 1) * nbytes].view(wire)
        assert torch.equal(row, inputs.x[r, t].to(wire))


@st.composite
def runs(draw) -> Run:
    W = draw(st.integers(1, 3))
    per = draw(st.integers(1, 2))
    E = W * per + (draw(st.integers(0, 1)) if W > 1 else 0)
    owner = "balanced"
    if W > 1 and draw(st.booleans()):  # non-uniform: rank 0 owns more, maybe the last rank none
        idle = W > 2 and draw(st.booleans())
        ranks = list(range(W - 1 if idle else W))
        first = draw(st.integers(1, E - len(ranks) + 1))
        assign = {q: [] for q in ranks}
        assign[0] = list(range(first))
        for i, e in enumerate(range(first, E)):
            assign[ranks[1 + i % (len(ranks) - 1)] if len(ranks) > 1 else 0].append(e)
        owner = "map { " + "; ".join(f"{q}: {', '.join(map(str, es))}" for q, es in assign.items() if es) + " }"
    K = draw(st.integers(1, min(E, 3)))
    T = draw(st.integers(1, 24))
    capacity = draw(st.sampled_from(["dropless", "factor 1.0", "factor 0.5", "rows 2", "factor 0.75, weights zero"]))
    return Run(
        W=W,
        E=E,
        K=K,
        T=T,
        tokens=draw(st.integers(1, T)),
        H=draw(st.sampled_from([32, 64])),
        F=draw(st.sampled_from([32, 64])),
        capacity=capacity,
        owner=owner,
        act=draw(st.sampled_from(["swiglu", "swiglu", "gelu", "relu"])),
        routing=draw(st.sampled_from(["uniform", "zipf:1.5", "hot", "one", "skip"])),
        seed=draw(st.integers(0, 2**16)),
        tiles=draw(st.sampled_from([BIG, SMALL])),
        programs=draw(st.sampled_from([1, 2, 3])),
    )


@settings(max_examples=12)
@given(runs())
@example(Run(W=1, E=3, K=2, T=13, tokens=11))  # W = 1
@example(Run(W=3, E=3, K=2, T=9, routing="hot", tiles=SMALL))  # E_loc = 1
@example(Run(W=2, E=3, K=3, T=7, owner="map { 0: 0, 1; 1: 2 }"))  # K = E
@example(Run(W=2, E=6, K=2, T=10, routing="one"))  # empty experts (only 0 and 1 are chosen)
@example(Run(W=3, E=6, K=2, T=8, routing="skip", programs=3))  # an owner that receives nothing
@example(Run(W=1, E=2, K=1, T=35, tiles=SMALL, routing="zipf:1.2"))  # T not a multiple of the tile height
@example(Run(W=3, E=6, K=2, T=20, capacity="factor 0.5", routing="hot"))  # capacity binds
@example(Run(W=3, E=5, K=2, T=11, owner="map { 0: 0, 1, 2; 1: 3; 2: 4 }", routing="zipf:1.5"))  # non-uniform map
@example(Run(W=2, E=4, K=1, T=20, routing="one", capacity="rows 7"))  # every row to one expert, dropped
@example(Run(W=2, E=4, K=2, T=12, act="gelu", capacity="factor 0.5, weights zero", routing="hot"))
@example(Run(W=1, E=2, K=2, T=64, tiles=SMALL))  # experts of whole m-tiles (rows a multiple of BM)
def test_parity_with_the_reference(run):
    check_run(run)


@pytest.mark.parametrize(
    "run",
    [
        Run(W=2, E=4, K=2, T=12, dtype="fp16"),
        Run(W=3, E=5, K=2, T=10, dtype="fp16", capacity="factor 0.75", owner="map { 0: 0, 1, 2; 1: 3; 2: 4 }"),
        Run(W=2, E=4, K=2, T=12, dtype="bf16", H=64, F=64),
        Run(W=2, E=3, K=2, T=16, dtype="bf16", capacity="factor 0.5", routing="hot", act="relu", tiles=SMALL),
    ],
    ids=["fp16", "fp16-capacity-map", "bf16", "bf16-capacity-relu"],
)
def test_half_precision_against_an_fp32_reference(run):
    """fp16 and bf16 within their bounds (tests/tolerance.py, in the dtype's unit roundoff) of the
    fp32 reference fed the same rounded inputs."""
    check_run(run)


def test_a_narrower_wire_dtype(tmp_path):
    """dtype fp32, dispatch bf16: rows travel in bf16 and are computed in fp32."""
    run = Run(W=2, E=4, K=2, T=10)
    spec, _ = elaborate_layer(
        parse_text(run.text().replace("dtype     fp32", "dtype     fp32, dispatch bf16")), None, {}
    )
    module = Layer(spec).module()
    inputs = random_inputs(2, 10, 32, 32, 4, 2, seed=3)
    y = module(*inputs)
    rounded = inputs._replace(x=inputs.x.bfloat16().float())
    ref, _ = reference_for(spec)(*rounded)
    assert_close(y, ref, bound(reference_for(spec), rounded, layer_chain(run.H, run.F, run.K)), "y")
    check_placement(module, inputs)


def test_padding_free_m_tiles():
    """Per-expert rows [1, 10*BM] run exactly 1 + 10 m-tiles (the counter), not the
    2 x 10 of padding to the tallest group, within the plan's ceil(R/BM) + E_loc - 1 slots."""
    bm = 32
    run = Run(W=1, E=2, K=1, T=1 + 10 * bm, tiles=Tiles(bm=bm, block_h=32, block_f=32, block_r=64))
    module = Layer(run.spec()).module(tiles=run.tiles)
    inputs = random_inputs(1, run.T, run.H, run.F, 2, 1, seed=5)
    ids = torch.ones((1, run.T, 1), dtype=torch.int64)
    ids[0, 0, 0] = 0
    y = module(inputs.x, ids, *inputs[2:])
    ref, _ = reference_for(run.spec())(inputs.x, ids, *inputs[2:])
    limit = bound(reference_for(run.spec()), (inputs.x, ids, *inputs[2:]), layer_chain(run.H, run.F, 1))
    assert_close(y, ref, limit, "y")
    assert module.last_stats["rows_per_expert"].tolist() == [1, 10 * bm]
    assert int(module.last_stats["m_tiles"][0]) == 1 + 10
    assert module.work.m_slots == (math.ceil(run.T / bm) + 2 - 1,)


@pytest.mark.parametrize("mode", ["unified", "split", "phased"])
def test_a_fixed_number_of_launches_per_call_whatever_the_tokens_and_routing(mode):
    """One launch per call in unified mode, two in split mode (the transport kernel, then
    the GEMM kernel, at once), three in phased mode (the transport kernel, the GEMM kernel,
    the transport kernel, one at a time), on the grid the module sized once."""
    run = Run(W=2, E=4, K=2, T=16, capacity="factor 1.0")
    module = Layer(run.spec()).module(mode=mode)
    calls = []
    inner = module.launcher

    class Counting:
        launches = 0

        def __call__(self, launches):
            calls.append(tuple((k.__name__ if hasattr(k, "__name__") else k.fn.__name__, g) for k, g, _, _ in launches))
            inner(launches)
            Counting.launches = inner.launches

    module.launcher = Counting()
    for tokens, routing in ((16, "uniform"), (1, "hot"), (7, "one"), (16, "zipf:2")):
        check_run(dataclasses.replace(run, tokens=tokens, routing=routing), module)
    if mode == "phased":
        kernels = ("rdep_layer", "rdep_gemm", "rdep_layer")
        assert calls == [((k, (n,)),) for k, n in zip(kernels, module.per_queue, strict=True)] * 4
        return
    kernels = ("rdep_layer",) if mode == "unified" else ("rdep_layer", "rdep_gemm")
    assert calls == [tuple(zip(kernels, ((n,) for n in module.per_queue), strict=True))] * 4


def test_bitwise_deterministic_across_calls_and_modules():
    run = Run(W=2, E=4, K=2, T=12, capacity="factor 0.75", routing="hot", programs=3, tiles=SMALL)
    module, inputs, y1, _, _ = execute(run)
    y2 = module(*inputs)
    fresh = Layer(run.spec()).module(tiles=SMALL, programs=1)
    y3 = fresh(*inputs)
    assert torch.equal(y1, y2) and torch.equal(y1, y3)
    assert torch.equal(module.last_context.gprime, fresh.last_context.gprime)


def test_symbolic_tokens_use_the_calls_T():
    text = Run(W=2, E=4, K=2, T=8, capacity="factor 1.0").text().replace("tokens 8", "tokens T")
    spec, _ = elaborate_layer(parse_text("param T <= 20\n" + text), None, {})
    module = Layer(spec).module()
    for tokens in (20, 9):
        inputs = random_inputs(2, tokens, 32, 32, 4, 2, routing="hot", seed=tokens)
        y = module(*inputs)
        ref, accepted = reference_for(spec)(*inputs)
        assert_close(y, ref, bound(reference_for(spec), inputs, layer_chain(32, 32, 2)), f"T' = {tokens}")
        assert torch.equal(module.last_stats["accepted"], accepted)
        assert module.last_stats["capacity"] == math.ceil(2 * tokens * 2 / 4)
        check_placement(module, inputs)


def test_zero_tokens_still_one_launch():
    module = Layer(Run(W=2, E=4, K=2, T=8).spec()).module()
    inputs = random_inputs(2, 3, 32, 32, 4, 2)
    empty = [t[:, :0] if i < 3 else t for i, t in enumerate(inputs)]
    y = module(*empty)
    assert y.shape == (2, 0, 32) and module.last_stats["launches"] == 1
    assert module.last_stats["rows_per_expert"].tolist() == [0] * 4 and module.last_stats["dropped_rows"] == 0
    check_run(Run(W=2, E=4, K=2, T=8, tokens=3), module)  # and the next call is whole
