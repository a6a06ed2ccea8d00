"""``dedup``: one payload row per (token, owner), out and back (codegen/device: dispatch.py, returns.py, combine.py).

Under the interpreter: parity with the reference over random small specs and routings
(every schedule, bf16 and fp32, fp8 rows with row and block scales, capacity drops, the
return ring), the rows the kernels counted against the distinct (token, owner) pairs of the
accepted set, results bitwise identical across schedules and kernel modes, the bytes
against the planner's prediction; the backward's gradients against autograd through the
reference, and its payload one dL/dy row per (token, owner).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GRAD_NAMES, ROOT, grads_in, layer_bound, layer_grad_bounds
from hypothesis import given, settings
from hypothesis import strategies as st
from rdepc.passes.transport import transport_bytes
from rdepc.runtime.tensors import TORCH_DTYPES
from tolerance import assert_close

from rdepc.api import Layer, elaborate_layer
from rdepc.parser import parse_text
from rdepc.reference import owner_pairs, random_inputs, reference_for


def _layer(
    W=4,
    T=16,
    K=3,
    E=8,
    dtype="fp32",
    dispatch=None,
    capacity="dropless",
    rows=32,
    schedule="bulk",
    sideband="row_id, local_expert, gate",
) -> Layer:
    disp = f", dispatch {dispatch}" if dispatch else ""
    if dispatch and "fp8" in dispatch:
        sideband += ", scale"
    text = f"""layer dd {{
  shape     ranks {W}, tokens {T}, hidden 128, experts {E}, top {K}
  expert    swiglu(ffn = 64)
  dtype     {dtype}{disp}
  sideband  {sideband}
  owner     balanced
  capacity  {capacity}
  segment   rows {rows}, buffers 2
  schedule  {schedule}
  transport emulated, dedup
}}
"""
    spec, warnings = elaborate_layer(parse_text(text, "dd.rdep"), None, {})
    return Layer(spec, warnings)


def _run(layer: Layer, routing="uniform", seed=0, **options):
    spec = layer.spec
    sh = layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    dtype = spec.precision.dtype.value
    inputs = random_inputs(W, T, H, F, E, K, routing=routing, seed=seed, dtype=TORCH_DTYPES[dtype], gated=True)
    kernels = layer.module("emulated", "cpu", **options)
    with torch.no_grad():
        y = kernels(*inputs)
    return kernels, inputs, y


def _check(layer: Layer, routing="uniform", seed=0, **options):
    """The layer against the reference on the same (fp8-rounded) inputs, and its transport
    counts against the accepted set's distinct (token, owner) pairs."""
    spec = layer.spec
    kernels, inputs, y = _run(layer, routing, seed, **options)
    f32 = [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs]
    ref, accepted = reference_for(spec)(*f32)
    st = kernels.last_stats
    assert torch.equal(st["accepted"], accepted)
    assert_close(y, ref, layer_bound(layer, inputs, TORCH_DTYPES[spec.precision.dtype.value]), "y")
    pairs = owner_pairs(inputs.topk_ids, st["accepted"], spec.ownership.owner)
    assert int(st["dispatched_rows"].sum()) == pairs == int(st["returned_rows"].sum())
    return kernels, inputs, y


@st.composite
def layers(draw):
    dtype = draw(st.sampled_from(["fp32", "bf16"]))
    dispatch = None
    if dtype == "bf16":
        dispatch = draw(st.sampled_from([None, "fp8_e4m3, scale row", "fp8_e4m3, scale block"]))
    return dict(
        W=draw(st.integers(2, 4)),
        T=draw(st.sampled_from([8, 16])),
        K=draw(st.integers(2, 4)),
        dtype=dtype,
        dispatch=dispatch,
        capacity=draw(st.sampled_from(["dropless", "factor 0.75, drop arrival", "factor 1.0, drop lowest_gate"])),
        rows=draw(st.sampled_from([8, 16, 32])),
        schedule=draw(st.sampled_from(["bulk", "pipelined", "deep"])),
    )


@settings(max_examples=3, deadline=None, derandomize=True)
@given(args=layers(), routing=st.sampled_from(["uniform", "zipf:1.2", "hot"]), seed=st.integers(0, 3))
def test_dedup_matches_the_reference_and_sends_one_row_per_token_and_owner(args, routing, seed):
    _check(_layer(**args), routing, seed)


def test_the_return_ring_under_dedup():
    """Capacity 0.5 keeps an owner's rows below T·K: the segments' B·S rows cannot hold a
    front-end's T·K returns, so returns rotate through a ring and are unpacked; a place where
    no token returns carries row_id -1 and is skipped."""
    layer = _layer(dtype="bf16", capacity="factor 0.5, drop arrival, weights renormalize", rows=8, schedule="pipelined")
    kernels, _, _ = _check(layer, "zipf:1.2")
    assert kernels.contract.ring and "live = live & (rid >= 0)" in kernels.source


def test_dedup_is_bitwise_identical_across_schedules_and_modes():
    """Every strategy, and the split kernel mode (bulk: few entries, as the interpreter
    runs its programs one at a time)."""
    ys = []
    for schedule, mode in (("bulk", "unified"), ("pipelined", "unified"), ("deep", "unified"), ("bulk", "split")):
        _, _, y = _run(_layer(dtype="bf16", T=8, rows=16, schedule=schedule), "zipf:1.2", mode=mode)
        ys.append(y)
    assert all(torch.equal(ys[0], y) for y in ys[1:])


def test_dedup_keeps_every_segment_resident():
    """A token's rows at an owner span its local experts' segments: B rises to the busiest
    owner's segments, and GEMM1 of a segment waits for every earlier segment's dispatches."""
    from rdepc.passes.graph import build_graph

    layer = _layer(rows=8, schedule="pipelined")
    tg = build_graph(layer.spec, "pipelined")
    geo = tg.geometry
    assert geo.B == max(geo.segments) > 2 and max(geo.rows_max) <= geo.B * geo.S
    by_id = {t.id: t for t in tg.tasks}
    for t in tg.tasks:
        if t.stage == "compute" and t.detail == "gemm1":
            segs = {by_id[d].segment for d in t.deps if by_id[d].stage == "dispatch"}
            assert segs == set(range(t.segment + 1))
        if t.stage == "return":
            segs = {by_id[d].segment for d in t.deps if by_id[d].stage == "compute"}
            assert segs == set(range(t.segment + 1))


def test_dedup_bytes_against_the_planner(tmp_path, capsys):
    """The rows the kernels moved, priced by the planner's byte model, against its uniform
    prediction: within 3 % on one uniform routing of 64 tokens of K = 3 over 4 owners."""
    from rdepc import cli

    text = """layer dd {
  shape     ranks 4, tokens 16, hidden 128, experts 8, top 3
  expert    swiglu(ffn = 64)
  dtype     fp32
  sideband  row_id, local_expert, gate
  capacity  dropless
  transport emulated, dedup
}
"""
    spec, warnings = elaborate_layer(parse_text(text, "dd.rdep"), None, {})
    kernels, _, _ = _check(Layer(spec, warnings))
    st = kernels.last_stats
    sent, back = int(st["dispatched_rows"].sum()), int(st["returned_rows"].sum())
    accepted = int(st["accepted"].sum())
    out, ret = transport_bytes(spec, sent, accepted, back)
    assert out == sent * 128 * 4 + accepted * (16 + 8) and ret == back * 128 * 4  # fp32 rows, sideband + links
    path = tmp_path / "dd.rdep"
    path.write_text(text, encoding="utf-8")
    assert cli.main(["plan", str(path), "--json"]) == 0
    dd = json.loads(capsys.readouterr().out)["dedup"]
    assert dd["enabled"] is True
    assert out / 4 == pytest.approx(dd["dispatch_send"], rel=0.03)  # the plan's figures are per front-end
    assert ret / 4 == pytest.approx(dd["return_recv"], rel=0.03)


def test_dedup_trains_in_bf16_with_fp8_rows():
    """bf16 with fp8 row-scaled dispatch, capacity drops: every gradient within its bound (in
    bf16's unit roundoff) of autograd through the (quantising) reference on the same bf16 inputs, and
    bitwise the same in bulk and deep. (On the unrounded fp32 inputs the reference's e4m3
    rounding of x differs from the layer's in halfway cases: 2-8 % of the largest weight
    gradient, whatever the layer computes.)"""
    # arrival drops here; round_robin's are checked in fp32 below
    capacity = "factor 0.75, drop arrival"
    layer = _layer(W=2, T=12, K=3, E=8, dtype="bf16", dispatch="fp8_e4m3, scale row", capacity=capacity)
    sh = layer.shapes
    inputs = random_inputs(
        sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], routing="zipf:1.5", seed=3, dtype=torch.bfloat16
    )
    dy = torch.randn(sh["W"], sh["T"], sh["H"], generator=torch.Generator().manual_seed(7)).bfloat16().float()
    want = grads_in(reference_for(layer.spec), inputs, dy, torch.float32)
    limits = layer_grad_bounds(layer, inputs, dy, torch.bfloat16)
    got = {}
    for schedule in ("bulk", "deep"):
        got[schedule] = grads_in(layer.module("emulated", "cpu", schedule=schedule), inputs, dy, torch.bfloat16)
        for n, w in want.items():
            assert_close(got[schedule][n], w, limits[n], f"{schedule}: d{n}")
    assert all(torch.equal(got["deep"][n], got["bulk"][n]) for n in want)


def test_dedup_gradients_under_round_robin_drops_are_exact_in_fp32():
    """The default drop order (round_robin) with fp8 row-scaled dispatch: fp32 gradients
    within their bounds of autograd through the quantising reference."""
    layer = _layer(W=2, T=12, K=3, E=8, dispatch="fp8_e4m3, scale row", capacity="factor 0.75")
    sh = layer.shapes
    inputs = random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], routing="zipf:1.5", seed=3)
    dy = torch.randn(sh["W"], sh["T"], sh["H"], generator=torch.Generator().manual_seed(7))
    want = grads_in(reference_for(layer.spec), inputs, dy, torch.float32)
    module = layer.module("emulated", "cpu", schedule="bulk")
    got = grads_in(module, inputs, dy, torch.float32)
    assert module.last_stats["dropped_rows"] > 0
    limits = layer_grad_bounds(layer, inputs, dy)
    for n, w in want.items():
        assert_close(got[n], w, limits[n], f"d{n}")


def test_the_dedup_backward_sends_one_dy_row_per_token_and_owner():
    """The backward payload is poisoned (NaN) after the forward: the backward fills exactly
    one row per distinct (token, owner) pair of the accepted set, every other slot reads
    its token's row through its link, and the gradients stay exact."""
    layer = _layer(W=2, T=12, K=3, E=8, capacity="factor 0.75")
    sh = layer.shapes
    inputs = random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], routing="zipf:1.5", seed=5)
    dy = torch.randn(sh["W"], sh["T"], sh["H"], generator=torch.Generator().manual_seed(7))
    want = grads_in(reference_for(layer.spec), inputs, dy, torch.float32)
    limits = layer_grad_bounds(layer, inputs, dy)
    m = layer.module("emulated", "cpu")
    x, ids, g, wg, wu, wd = inputs
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, g, wg, wu, wd)]
    y = m(leaves[0], ids, *leaves[1:])
    at, size = next((at, size) for name, _, at, size in m.contract.layout if name == "bwd_payload")
    m.heap[:, at : at + size] = 0xFF  # fp32 NaN in every byte of every owner's backward payload
    (y * dy).sum().backward()
    for n, t in zip(GRAD_NAMES, leaves, strict=True):
        assert_close(t.grad, want[n], limits[n], f"d{n}")
    rows = m.heap[:, at : at + size].view(torch.float32).view(sh["W"], -1, sh["H"])
    filled = int((~rows.isnan().all(dim=2)).sum())
    assert filled == owner_pairs(ids, m.last_stats["accepted"], m.contract.owner) < int(m.last_stats["accepted"].sum())


def test_dedup_needs_the_gate_in_the_sideband():
    from rdepc.diagnostics import SpecError

    with pytest.raises(SpecError, match="dedup needs the gate in the sideband"):
        _layer(sideband="row_id, local_expert")


def test_dedup_memory_plan_matches_the_planner():
    """Moonlight under dedup, pipelined: B rises from 2 to the busiest owner's segments in
    the memory plan and in ``rdepc plan`` alike, and the sideband carries the links."""
    from rdepc.passes.memplan import memory_plan
    from rdepc.passes.resolve import build_for
    from rdepc.passes.schedule import schedule
    from rdepc.passes.symmetric import symmetric_plan

    text = (ROOT / "examples" / "moonlight.rdep").read_text(encoding="utf-8")
    spec, _ = elaborate_layer(
        parse_text(text.replace("transport nvshmem", "transport nvshmem, dedup"), "m.rdep"), None, {}
    )
    assert spec.route_row.sideband == ("row_id", "local_expert", "gate", "links")
    sched = schedule(build_for(spec, "pipelined"), "h100")
    mp = memory_plan(sched)
    assert not mp.problems, mp.problems
    want = symmetric_plan(spec, "pipelined", rows=sched.S, buffers=sched.B)
    assert sched.B == want["B"] == -(-max(sched.graph.geometry.rows_max) // sched.S) > 2
    assert mp.regions("forward_backward") == want["forward_backward"]
