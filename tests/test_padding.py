"""Padding and ragged ranks: a slot with expert id -1 routes nowhere (no route row, no
capacity, its gate counts as 0), ``tokens=`` gives each rank of the one-process backend its
own T' (the capacity follows their total), and ``RDEPMoE(mask=...)`` turns padding tokens
into such slots, with y = 0 and no share of the router's losses. Kernels against
``rdepc.reference``, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import block_parameters, block_reference
from rdepc.runtime import router as R
from tolerance import assert_close, bound, bounds, layer_chain

from rdepc.api import Layer, elaborate_layer
from rdepc.ir.contract import Tiles
from rdepc.moe import RDEPMoE
from rdepc.parser import parse_text
from rdepc.reference import random_inputs, reference_for

TILES = Tiles(bm=16, block_h=32, block_f=32, block_r=64, block_k=32)
NAMES = ("x", "topk_weights", "w_gate", "w_up", "w_down")
CHAIN = layer_chain(32, 32, 2)  # the layers below: H = F = 32, K = 2


pytestmark = pytest.mark.usefixtures("fresh_cache")


def layer(capacity: str = "factor 0.75", extra: str = "", W: int = 3, T: int = 10, E: int = 6, K: int = 2) -> Layer:
    text = (
        f"param T = {T}\n"
        "layer pad {\n"
        f"  shape     ranks {W}, tokens T, hidden 32, experts {E}, top {K}\n"
        "  expert    swiglu(ffn = 32)\n"
        "  dtype     fp32\n"
        f"  capacity  {capacity}\n"
        f"{extra}"
        "  segment   rows 8, buffers 2\n"
        "  schedule  pipelined\n"
        "}\n"
    )
    spec, _ = elaborate_layer(parse_text(text, "pad.rdep"), None, {})
    return Layer(spec)


def padded_inputs(lay: Layer, seed: int = 1):
    sh = lay.shapes
    inp = random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], routing="zipf:1.2", seed=seed)
    ids = inp.topk_ids.clone()
    ids[0, 3, :] = -1  # a padding token
    ids[1, 2, 1] = -1  # one slot that routes nowhere
    g = inp.topk_weights.clone()
    g[0, 3, 0] = float("nan")  # a padding slot's gate is never read
    return inp._replace(topk_ids=ids, topk_weights=g)


@pytest.mark.parametrize("schedule", ["bulk", "pipelined"])
def test_ragged_ranks_and_padding_slots_match_the_reference(schedule):
    lay = layer()
    inp = padded_inputs(lay)
    tokens = [10, 4, 7]
    ref, accepted = reference_for(lay.spec)(*inp, tokens=tokens)
    m = lay.module(schedule=schedule, tiles=TILES)
    y = m(*inp, tokens=tokens)
    st = m.last_stats
    assert torch.equal(st["accepted"], accepted)
    assert_close(y, ref, bound(reference_for(lay.spec), inp, CHAIN, tokens=tokens), "y")
    assert st["capacity"] == math.ceil(0.75 * sum(tokens) * 2 / 6)  # the tokens brought, not W * T'
    assert not y[1, 4:].any() and not y[2, 7:].any() and not y[0, 3].any()
    assert not accepted[1, 4:].any() and not accepted[0, 3].any() and not accepted[1, 2, 1]
    routed = int(st["received_per_expert"].sum())
    assert routed == 10 * 2 - 2 + 4 * 2 - 1 + 7 * 2  # padding and -1 slots are no route rows
    assert int(st["dropped_per_source"].sum()) == st["dropped_rows"] > 0


def test_a_rank_that_brings_nothing():
    lay = layer("dropless")
    inp = padded_inputs(lay)
    ref, _ = reference_for(lay.spec)(*inp, tokens=[0, 10, 10])
    y = lay.module(tiles=TILES)(*inp, tokens=[0, 10, 10])
    assert not y[0].any()
    assert_close(y, ref, bound(reference_for(lay.spec), inp, CHAIN, tokens=[0, 10, 10]), "y")


def grads(fn, inputs, dy, **kw):
    x, ids, g, wg, wu, wd = inputs
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, g, wg, wu, wd)]
    out = fn(leaves[0], ids, *leaves[1:], **kw)
    y = out[0] if isinstance(out, tuple) else out
    (y * dy).sum().backward()
    return {n: t.grad for n, t in zip(NAMES, leaves, strict=True)}


def test_padding_gets_no_gradient_and_the_rest_matches_autograd():
    lay = layer("factor 0.75")
    inp = padded_inputs(lay)
    inp = inp._replace(topk_weights=torch.nan_to_num(inp.topk_weights, nan=0.3))  # autograd through the reference
    tokens = [10, 6, 8]
    dy = torch.randn(inp.x.shape, generator=torch.Generator().manual_seed(7))
    want = grads(reference_for(lay.spec), inp, dy, tokens=tokens)
    got = grads(lay.module(tiles=TILES), inp, dy, tokens=tokens)

    def reference_grads(inp, dy):
        return grads(reference_for(lay.spec), inp, dy, tokens=tokens)

    limits = bounds(reference_grads, (inp, dy), layer_chain(32, 32, 2, extra=3 * 10 * 2))  # and the W·T·K rows
    for name, w in want.items():
        assert_close(got[name], w, limits[name], name)
    assert not got["x"][1, 6:].any() and not got["x"][0, 3].any()
    assert not got["topk_weights"][0, 3].any() and got["topk_weights"][1, 2, 1] == 0


def test_tokens_errors():
    lay = layer("dropless")
    inp = padded_inputs(lay)
    m = lay.module(tiles=TILES)
    with pytest.raises(
        ValueError, match=r"tokens must give each of the W=3 ranks a count in \[0, T'=10\], got \[1, 2\]"
    ):
        m(*inp, tokens=[1, 2])
    with pytest.raises(ValueError, match=r"a count in \[0, T'=10\], got \[1, 11, 0\]"):
        m(*inp, tokens=[1, 11, 0])
    with pytest.raises(ValueError, match=r"tokens must be W=3 ints on the host"):
        m(*inp, tokens=torch.tensor([1.0, 2.0, 3.0]))
    assert m(*inp, tokens=torch.tensor([1, 2, 3])).shape == inp.x.shape  # a CPU int tensor is host data


# ------------------------------------------------------------------ RDEPMoE


def block(capacity: str = "dropless", extra: str = "") -> RDEPMoE:
    lay = layer(capacity, extra + "  shared    1 x swiglu(ffn = 16)\n", T=8, E=4)
    return RDEPMoE(lay, module_options={"tiles": TILES}, generator=torch.Generator().manual_seed(0))


def test_masked_tokens_get_zero_and_leave_the_others_as_they_were():
    moe = block(extra="  router    softmax, renormalize, aux_loss 0.01, z_loss 0.001\n")
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, 0] = False
    with torch.no_grad():
        y_all = moe(x)
        y, out = moe(x, mask=mask, router_outputs=True)
    assert not y[~mask].any()
    # dropless: tokens are independent. The layer's chain, the shared expert's F = 16, the router's
    # dot over H = 32 and softmax over E = 4
    limit = bound(block_reference(moe), (x, block_parameters(moe)), layer_chain(32, 32, 2, extra=16 + 32 + 4))
    assert_close(y[mask], y_all[mask], limit[mask], "unmasked tokens")
    assert int(moe.last_stats["received_per_expert"].sum()) == int(mask.sum()) * 2
    real = out.logits[mask]
    ids = moe.route(x).ids[mask]
    aux = R.aux_loss(real, ids, moe.layer.spec.router)
    n = int(mask.sum())  # the losses' sums over the real tokens and the E = 4 experts, 8 pointwise steps

    def aux_of(logits):
        return 0.01 * R.aux_loss(logits, ids, moe.layer.spec.router)

    def z_of(logits):  # R.z_loss's formula, in the logits' dtype (R.z_loss takes them to fp32)
        return 0.001 * torch.logsumexp(logits, -1).square().mean()

    assert_close(out.aux_loss, 0.01 * aux, bound(aux_of, (real,), n + 4 + 8), "aux_loss")
    assert_close(out.z_loss, 0.001 * R.z_loss(real), bound(z_of, (real,), 4 + n + 8), "z_loss")


def test_a_mask_on_flat_tokens_and_its_errors():
    moe = block()
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(2))
    mask = torch.arange(24) % 5 != 0
    with torch.no_grad():
        y = moe(x, mask=mask)
    assert y.shape == (24, 32) and not y[~mask].any() and y[mask].abs().min() > 0
    with pytest.raises(ValueError, match=r"rdepc layer pad: mask must be shaped \(24,\), got \(3, 8\)"):
        moe(x, mask=mask.reshape(3, 8))


def test_tokens_through_the_block_set_the_capacity():
    moe = block("factor 1.0")
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = moe(x, tokens=[8, 2, 5])
    assert not y[1, 2:].any() and not y[2, 5:].any() and y[0].abs().min() > 0
    assert moe.last_stats["capacity"] == math.ceil(15 * 2 / 4)
