"""The derived tolerances (tests/tolerance.py) hold where only the order of the arithmetic
differs, and still fail for the smallest error a test must catch: one output or gradient
element off by bf16's step, dL/dy rounded to bf16, one slot's term lost, one gate off by
fp16's step."""

from __future__ import annotations

import pytest
import torch
from rdepc.runtime import router as R
from tolerance import LAMBDA, assert_close, bound, bounds, layer_chain, spread, unit_roundoff

from rdepc.api import Layer, elaborate_layer
from rdepc.parser import parse_text
from rdepc.reference import random_inputs, reference_for

W, T, H, F, E, K = 2, 8, 32, 32, 4, 2
TEXT = (
    "layer t {\n"
    f"  shape     ranks {W}, tokens {T}, hidden {H}, experts {E}, top {K}\n"
    f"  expert    swiglu(ffn = {F})\n"
    "  dtype     fp32\n"
    "  schedule  bulk\n"
    "}\n"
)
NAMES = ("x", "topk_weights", "w_gate", "w_up", "w_down")


@pytest.fixture(scope="module")
def layer():
    spec, _ = elaborate_layer(parse_text(TEXT, "t.rdep"), None, {})
    return Layer(spec)


def test_a_sum_in_any_order_is_within_its_bound_and_a_bf16_rounding_is_not():
    """σ of an fp32 sum is its sampled rounding error; every order of its terms lands within
    2λ√n·σ of the reference's, and the terms rounded to bf16 first land far outside. In bf16
    σ is the spread of rounding the terms: u·√(Σ t²/3) for uniform errors."""
    assert unit_roundoff(torch.float32) == 2.0**-24 and unit_roundoff(torch.bfloat16) == 2.0**-8
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4096, generator=g)
    limit = bound(torch.sum, (t,), 4096)
    assert float(limit) == pytest.approx(
        2 * LAMBDA * 64 * float(spread(torch.sum, (t,))[0]) + 2 * 2.0**-24 * float(t.sum().abs())
    )
    want = t.sum()
    for _ in range(50):  # other orders: permuted, pairwise, blocked, sequential
        assert_close(t[torch.randperm(4096, generator=g)].sum(), want, limit)
    assert_close(t.reshape(64, 64).sum(0).sum(), want, limit)
    assert_close(torch.tensor(sum(t.tolist()), dtype=torch.float32), want, limit)
    with pytest.raises(AssertionError, match="beyond their bound"):
        assert_close(t.bfloat16().float().sum(), want, limit)
    sigma16 = float(spread(torch.sum, (t,), torch.bfloat16)[0])
    assert sigma16 == pytest.approx(2.0**-8 * float(t.double().square().sum() / 3) ** 0.5, rel=0.35)
    with pytest.raises(AssertionError, match="not float64"):
        spread(lambda v: v.float().sum(), (t,))


def test_a_nan_or_an_element_beyond_its_bound_fails_and_is_named():
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert_close(want + 0.25, want, 0.25)  # at the bound passes
    with pytest.raises(AssertionError, match=r"1 of 4 elements beyond their bound; worst at \(1, 0\)"):
        assert_close(want + torch.tensor([[0.0, 0.0], [0.5, 0.0]]), want, 0.1, "y")
    with pytest.raises(AssertionError, match="worst at \\(0, 1\\): got nan"):
        assert_close(torch.tensor([[1.0, float("nan")], [3.0, 4.0]]), want, 1.0)


def forward(layer):
    inputs = random_inputs(W, T, H, F, E, K, seed=4)
    y = layer.module()(*inputs)
    ref = reference_for(layer.spec)
    return y, ref(*inputs)[0], bound(ref, inputs, layer_chain(H, F, K)), inputs


def test_a_layer_within_its_bound_fails_it_with_one_element_rounded_to_bf16(layer):
    y, want, limit, _ = forward(layer)
    assert_close(y, want, limit)  # the kernels against the reference: another order, within the bound
    i = int(want.abs().argmax())
    rounded = y.clone().reshape(-1)
    rounded[i] = want.reshape(-1)[i] * (1 + 2.0**-9)  # within one bf16 step of the exact value
    with pytest.raises(AssertionError, match="1 of"):
        assert_close(rounded.reshape(y.shape), want, limit)


def test_a_layer_that_loses_one_slots_smallest_term_fails(layer):
    _, want, limit, inputs = forward(layer)
    x, ids, gates, wg, wu, wd = inputs
    lost = gates.clone()
    w, t = divmod(int(gates[..., :].min(-1).values.argmin()), T)  # the token whose smaller gate is smallest
    k = int(gates[w, t].argmin())
    lost[w, t, k] = 0.0
    without, _ = reference_for(layer.spec)(x, ids, lost, wg, wu, wd)
    assert float((without - want).abs().max()) > 0
    with pytest.raises(AssertionError, match=f"worst at \\({w}, {t}, "):
        assert_close(without, want, limit)


def test_gradients_within_their_bounds_fail_with_one_element_rounded_to_bf16(layer):
    inputs = random_inputs(W, T, H, F, E, K, seed=5)
    dy = torch.randn(W, T, H, generator=torch.Generator().manual_seed(6))

    def grads_of(inp, d):
        leaves = [t.detach().clone().requires_grad_(True) for t in (inp[0], inp[2], inp[3], inp[4], inp[5])]
        x, g, wg, wu, wd = leaves
        y = reference_for(layer.spec)(x, inp[1], g, wg, wu, wd)[0]
        (y * d).sum().backward()
        return {n: t.grad for n, t in zip(NAMES, leaves, strict=True)}

    module = layer.module()
    leaves = [t.detach().clone().requires_grad_(True) for t in (inputs[0], inputs[2], inputs[3], inputs[4], inputs[5])]
    (module(leaves[0], inputs[1], *leaves[1:]) * dy).sum().backward()
    got = {n: t.grad for n, t in zip(NAMES, leaves, strict=True)}
    want = grads_of(inputs, dy)
    limits = bounds(grads_of, (inputs, dy), layer_chain(H, F, K, extra=W * T * K))
    for name in NAMES:
        assert_close(got[name], want[name], limits[name], name)
        g = got[name].clone().reshape(-1)
        i = int(want[name].abs().argmax())
        g[i] = want[name].reshape(-1)[i] * (1 + 2.0**-9)
        with pytest.raises(AssertionError, match="1 of"):
            assert_close(g.reshape(got[name].shape), want[name], limits[name], name)
    rounded = grads_of(inputs, dy.bfloat16().float())  # dL/dy sent in bf16 where fp32 is promised
    for name in NAMES:
        with pytest.raises(AssertionError, match="beyond their bound"):
            assert_close(rounded[name], want[name], limits[name], name)


def test_router_gates_within_their_bound_fail_with_one_gate_off_by_an_fp16_step():
    from test_router import gate_bound

    from rdepc.ir.spec import Router
    from rdepc.reference import route

    r = Router(score="softmax", renormalize=True)
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(40, 32, generator=g), torch.randn(8, 32, generator=g)
    _, gates, _ = R.route(x, weight, r, 3)
    _, want = route(x, weight, r, 3)
    limit = gate_bound(x, weight, r, 3)
    assert_close(gates, want, limit)
    off = gates.clone()
    off[0, 0] = want[0, 0] * (1 + 2.0**-11)
    with pytest.raises(AssertionError, match="1 of"):
        assert_close(off, want, limit)
