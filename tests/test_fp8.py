"""fp8 e4m3 dispatch: rows quantised at the front-end with one fp32 scale per row
(``scale row``) or per 128 columns (``scale block``), the scales in the sideband, GEMM1
applying them (the device functions: tests/test_device.py). The layer matches ``rdepc.reference`` on
the same quantised rows within its bound (tests/tolerance.py, in bf16's unit roundoff), and the
unquantised operator within the bound docs/fp8.md states; bitwise across schedules, forward and
backward."""

from __future__ import annotations

import pytest
import torch
from conftest import GRAD_NAMES, grads_in, layer_bound, layer_grad_bounds
from tolerance import assert_close, reorder_bound

from rdepc.api import Layer, elaborate_layer
from rdepc.ir.contract import Tiles
from rdepc.parser import parse_text
from rdepc.reference import FP8_MAX, fp8_dispatch, random_inputs, reference_for

TILES = Tiles(bm=16, block_h=32, block_f=32, block_r=64, block_k=32)
FP8_BOUND = 0.1  # against the unquantised operator (docs/fp8.md)


pytestmark = pytest.mark.usefixtures("fresh_cache")


def layer(scale: str, H: int = 160, capacity: str = "dropless", W: int = 2, E: int = 4, K: int = 2) -> Layer:
    text = (
        "layer f8 {\n"
        f"  shape     ranks {W}, tokens 12, hidden {H}, experts {E}, top {K}\n"
        "  expert    swiglu(ffn = 32)\n"
        f"  dtype     bf16, dispatch fp8_e4m3, scale {scale}\n"
        f"  capacity  {capacity}\n"
        "  segment   rows 8, buffers 2\n"
        "  schedule  pipelined\n"
        "}\n"
    )
    spec, _ = elaborate_layer(parse_text(text, "f8.rdep"), None, {})
    return Layer(spec)


def inputs(lay: Layer, routing: str = "uniform", seed: int = 0):
    sh = lay.shapes
    return random_inputs(
        sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], routing=routing, seed=seed, dtype=torch.bfloat16
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / (float(b.float().abs().max()) or 1.0)


# ------------------------------------------------------------------------ the quantiser


@pytest.mark.parametrize("scale", ["row", "block"])
def test_fp8_round_trip_error_is_within_e4m3s_half_ulp(scale):
    """|x̂ - x| <= 2^-4 |x| (3 mantissa bits, round to nearest) for normal values, <= s·2^-10
    below e4m3's smallest normal; a row's (block's) largest magnitude is exact."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 300, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    x[3] = 0.0  # an all-zero row gets scale 1 and stays 0
    xh = fp8_dispatch(x, scale)
    step = 300 if scale == "row" else 128
    for c in range(0, 300, step):
        part, got = x[:, c : c + step], xh[:, c : c + step]
        s = part.abs().amax(dim=1, keepdim=True) / FP8_MAX
        bound = torch.maximum(part.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)
        assert bool(((got - part).abs() <= bound).all())
        big = part.abs().argmax(dim=1, keepdim=True)
        # 448 · s with s = amax / 448: amax off by the roundings of s and of the product, within 2u
        want = part.gather(1, big)
        assert_close(got.gather(1, big), want, reorder_bound(0, 2, want), "amax")
    assert not xh[3].any()
    block = fp8_dispatch(x, "block")
    assert float((block - x).abs().max()) <= float((fp8_dispatch(x, "row") - x).abs().max())


# ------------------------------------------------------------------------ the layer


@pytest.mark.parametrize(
    ("scale", "capacity", "routing"),
    [("row", "dropless", "uniform"), ("block", "factor 0.75", "zipf:1.2")],
    ids=["row-dropless", "block-capacity"],
)
def test_fp8_layer_matches_the_reference_on_quantised_rows_in_every_schedule(scale, capacity, routing):
    lay = layer(scale, capacity=capacity)
    inp = inputs(lay, routing)
    f32 = [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inp]
    ref, accepted = reference_for(lay.spec)(*f32)
    exact, _ = reference_for(lay.spec, dispatch_rounding=False)(*f32)
    limit = layer_bound(lay, inp, torch.bfloat16)  # bf16 rounds its intermediates in bf16
    outs = {}
    for strategy in ("bulk", "pipelined", "deep"):
        m = lay.module(schedule=strategy, tiles=TILES)
        y = m(*inp)
        assert torch.equal(m.last_stats["accepted"], accepted), strategy
        assert_close(y, ref, limit, strategy)
        assert rel(y, exact) <= FP8_BOUND, f"{strategy}: {rel(y, exact):.3g} against the unquantised operator"
        outs[strategy] = y
    assert torch.equal(outs["pipelined"], outs["bulk"]) and torch.equal(outs["deep"], outs["bulk"])
    # the quantisation is visible: the layer is closer to the quantised reference
    assert rel(outs["bulk"], ref) < rel(outs["bulk"], exact)


def test_fp8_scales_are_in_the_sideband_at_the_rows_places():
    """After a bulk call every owner's payload row r holds e4m3 values whose dequantised
    row (times the scales at sideband row r) is fp8_dispatch of the token's x."""
    lay = layer("block", H=160)
    m = lay.module(schedule="bulk", tiles=TILES)
    inp = inputs(lay)
    m(*inp)
    p = m.contract
    heap = m.heap.view(p.W, -1)
    n = p.B * p.S
    x_hat = fp8_dispatch(inp.x.float(), "block")
    checked = 0
    for q in range(p.W):
        payload = heap[q, p.offset("payload") : p.offset("payload") + n * p.H].view(torch.float8_e4m3fn)
        scales = heap[q, p.offset("sideband_scale") : p.offset("sideband_scale") + n * p.scales * 4].view(torch.float32)
        ids = heap[q, p.offset("sideband_row_id") : p.offset("sideband_row_id") + n * 8].view(torch.int64)
        rows = int(m.last_stats["rows_per_owner"][q])
        deq = payload.view(n, p.H)[:rows].float() * scales.view(n, p.scales)[:rows].repeat_interleave(128, 1)[:, : p.H]
        for j in range(rows):
            rid = int(ids[j])
            r, t = rid // (12 * p.K), rid // p.K % 12  # eq. 7
            assert torch.equal(deq[j], x_hat[r, t]), (q, j)
            checked += 1
    assert checked == p.W * 12 * p.K  # dropless: every route row


def test_fp8_backward_matches_autograd_through_the_quantised_reference():
    """The gradient passes straight through the quantisation; the weight gradients use the
    dequantised rows the forward computed with."""
    lay = layer("row", H=64)
    inp = inputs(lay)
    dy = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).float()
    want = grads_in(reference_for(lay.spec), inp, dy, torch.float32)
    limits = layer_grad_bounds(lay, inp, dy, torch.bfloat16)
    got_by = {}
    for strategy in ("bulk", "deep"):
        got = grads_in(lay.module(schedule=strategy, tiles=TILES), inp, dy, torch.bfloat16)
        for n in GRAD_NAMES:
            assert_close(got[n], want[n], limits[n], f"{strategy}: d{n}")
        got_by[strategy] = got
    assert all(torch.equal(got_by["deep"][n], got_by["bulk"][n]) for n in GRAD_NAMES)
