"""rdepc.reference: the plain PyTorch RDEP operator (eq. 4) and its capacity policy (3.6)."""

import math
import subprocess
import sys

import pytest
import torch
from tolerance import assert_close, bound, layer_chain, reorder_bound, spread, unit_roundoff

import rdepc
from rdepc.reference import (
    capacity_for,
    expert_fn,
    moe_reference,
    random_inputs,
    reference_for,
)
from rdepc.reference_capacity import combine_weights

# ----------------------------------------------------------------------------------------
# An independent dense formulation: one token, one slot at a time, activations by formula.
# ----------------------------------------------------------------------------------------


def _act(v, act):
    if act == "gelu":
        return 0.5 * v * (1 + torch.erf(v / math.sqrt(2.0)))
    if act == "relu":
        return torch.clamp(v, min=0)
    raise AssertionError(act)


def dense(x, ids, g, wg, wu, wd, act, accepted=None, weights="renormalize"):
    W, T, K = ids.shape
    y = torch.zeros_like(x)
    for r in range(W):
        for t in range(T):
            acc = [k for k in range(K) if accepted is None or bool(accepted[r, t, k])]
            total = sum(float(g[r, t, j]) for j in range(K))
            kept = sum(float(g[r, t, j]) for j in acc)
            for k in acc:
                w = float(g[r, t, k]) if weights == "zero" else float(g[r, t, k]) * total / kept
                e = int(ids[r, t, k])
                h = x[r, t]
                if act == "swiglu":
                    a = h @ wg[e]
                    hidden = a / (1 + torch.exp(-a)) * (h @ wu[e])
                else:
                    hidden = _act(h @ wu[e], act)
                y[r, t] += w * (hidden @ wd[e])
    return y


def rows_per_expert(ids, accepted, E):
    return [int(((ids == e) & accepted).sum()) for e in range(E)]


def sent_per_expert(ids, E):
    return [int((ids == e).sum()) for e in range(E)]


# ----------------------------------------------------------------------------------------
# Agreement with the dense formulation
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2", "hot"])
def test_dropless_matches_dense_fp32(act, routing):
    inp = random_inputs(2, 6, 16, 24, 5, 2, routing=routing, seed=3, gated=act == "swiglu")
    y, accepted = moe_reference(*inp, act=act)
    assert bool(accepted.all())
    ref = dense(*inp, act)
    assert_close(y, ref, bound(dense, (*inp, act), layer_chain(16, 24, 2)), act)
    assert y.abs().max() > 1e-2  # not trivially zero


@pytest.mark.parametrize("drop", ["arrival", "lowest_gate"])
@pytest.mark.parametrize("weights", ["renormalize", "zero"])
def test_capacity_matches_dense_fp64(drop, weights):
    inp = random_inputs(3, 5, 12, 20, 4, 2, routing="zipf:1.0", seed=11, dtype=torch.float64)
    y, accepted = moe_reference(*inp, capacity=[4, 3, 2, 1], drop=drop, weights=weights)
    assert y.dtype == torch.float64
    assert not bool(accepted.all())  # something was dropped, so the policy is exercised
    ref = dense(*inp, "swiglu", accepted=accepted, weights=weights)
    # both in float64: a reordering there, bounded by float64's unit roundoff
    limit = bound(dense, (*inp, "swiglu"), layer_chain(12, 20, 2), torch.float64, accepted=accepted, weights=weights)
    assert_close(y, ref, limit, f"{drop} {weights}")


def test_gelu_is_exact_erf_not_tanh():
    torch.manual_seed(0)
    x = torch.linspace(-4, 4, 64).reshape(8, 8)
    eye = torch.eye(8)
    out = expert_fn(x, None, eye, eye, "gelu")

    def formula(x):
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    # the identity GEMMs are exact; the formula's steps: a division, a sum, two products, and
    # erf, whose rational approximation in a vectorised kernel rounds some 16 times
    assert_close(out, formula(x), bound(formula, (x,), 4 + 16), "gelu")
    tanh = torch.nn.functional.gelu(x, approximate="tanh")
    assert (out - tanh).abs().max() > 1e-5


def test_clamped_swiglu_is_gpt_oss_activation_and_gradient():
    """expert_fn's clamped_swiglu against transformers' GPT-OSS experts (gate and up
    interleaved in one [H, 2F] matrix, as GptOssExperts holds them; biases zero), output and
    gradients; and its defaults are GPT-OSS's limit 7 and alpha 1.702."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    cfg = gpt_oss.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=1, swiglu_limit=0.5)
    experts = gpt_oss.GptOssExperts(cfg)
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(1, 8, 12, generator=gen)
    down = torch.randn(1, 6, 8, generator=gen)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        experts.gate_up_proj_bias.zero_()
        experts.down_proj_bias.zero_()
    x = torch.randn(10, 8, generator=gen, requires_grad=True)
    want = experts._apply_gate(x @ experts.gate_up_proj[0]) @ experts.down_proj[0]
    wg, wu = gate_up[0, :, 0::2].clone().requires_grad_(), gate_up[0, :, 1::2].clone().requires_grad_()
    got = expert_fn(x, wg, wu, down[0], "clamped_swiglu", limit=0.5, alpha=cfg.swiglu_alpha)
    dy = torch.randn(want.shape, generator=gen)

    def transformers_expert(x, gate_up, down, dy):  # transformers' expert, output and gradients (float64 in float64)
        x, gate_up = x.detach().clone().requires_grad_(), gate_up.detach().clone().requires_grad_()
        y = experts._apply_gate(x @ gate_up) @ down
        return {"y": y, **dict(zip(("x", "gate_up"), torch.autograd.grad(y, (x, gate_up), dy), strict=True))}

    sigma = spread(transformers_expert, (x, gate_up[0], down[0], dy))
    chain = 8 + 6 + 8  # H = 8, F = 6, the activation's pointwise steps
    assert_close(got, want, reorder_bound(sigma["y"], chain, want), "y")
    (dx_want, dgu) = torch.autograd.grad(want, (x, experts.gate_up_proj), dy)
    dx, dwg, dwu = torch.autograd.grad(got, (x, wg, wu), dy)
    assert_close(dx, dx_want, reorder_bound(sigma["x"], chain, dx_want), "dx")
    limit = reorder_bound(sigma["gate_up"], chain + 10, dgu[0])  # a weight's gradient also sums the 10 rows
    assert_close(torch.stack((dwg, dwu), dim=-1).reshape(8, 12), dgu[0], limit, "dgate_up")
    pre = x @ gate_up[0]
    assert (pre[:, 0::2] > 0.5).any() and (pre[:, 1::2].abs() > 0.5).any()  # both clamps are exercised
    default = gpt_oss.GptOssConfig()
    x0 = torch.linspace(-12, 12, 48).reshape(6, 8)
    eye = torch.eye(8)
    limited = expert_fn(x0, eye, eye, eye, "clamped_swiglu", default.swiglu_limit, default.swiglu_alpha)
    torch.testing.assert_close(expert_fn(x0, eye, eye, eye, "clamped_swiglu"), limited, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------
# The accepted set
# ----------------------------------------------------------------------------------------


def test_dropless_accepts_everything_and_big_capacity_is_dropless():
    inp = random_inputs(2, 8, 8, 8, 4, 3, routing="hot", seed=1)
    y0, a0 = moe_reference(*inp)
    y1, a1 = moe_reference(*inp, capacity=2 * 8 * 3)  # every row fits
    assert a0.shape == (2, 8, 3) and a0.dtype == torch.bool and bool(a0.all())
    assert bool(a1.all())
    assert torch.equal(y0, y1)


def test_arrival_cap_one_admits_smallest_row_id():
    W, T, K, E = 2, 6, 2, 4
    inp = random_inputs(W, T, 8, 8, E, K, seed=5)
    ids = inp.topk_ids
    # eq. 7 by default: the first row in (rank, token, slot) order.
    _, acc = moe_reference(*inp, capacity=1, drop="arrival")
    for e in range(E):
        rows = [(r, t, k) for r in range(W) for t in range(T) for k in range(K) if ids[r, t, k] == e]
        kept = [(r, t, k) for (r, t, k) in rows if acc[r, t, k]]
        assert kept == rows[:1]
    # A custom (permuted) identity: the smallest of *its* ids wins.
    perm = torch.randperm(W * T * K, generator=torch.Generator().manual_seed(9)).tolist()

    def rid(r, t, k):
        return 1000 + perm[(r * T + t) * K + k]

    _, acc = moe_reference(*inp, capacity=1, drop="arrival", row_id=rid)
    for e in range(E):
        rows = [(r, t, k) for r in range(W) for t in range(T) for k in range(K) if ids[r, t, k] == e]
        kept = [(r, t, k) for (r, t, k) in rows if acc[r, t, k]]
        assert kept == [min(rows, key=lambda q: rid(*q))]
    assert int(acc.sum()) == sum(1 for c in sent_per_expert(ids, E) if c)


def _one_expert_inputs(gates):
    """W=1, K=1, every token to expert 0 of E=1, with the given gates."""
    T = len(gates)
    H = F = 4
    return (
        torch.ones(1, T, H),
        torch.zeros(1, T, 1, dtype=torch.int64),
        torch.tensor(gates, dtype=torch.float32).reshape(1, T, 1),
        None,
        torch.eye(H).expand(1, H, F).clone(),
        torch.eye(F).expand(1, F, H).clone(),
    )


def test_lowest_gate_admits_highest_gates_ties_by_row_id():
    inp = _one_expert_inputs([0.5, 0.7, 0.5, 0.7, 0.1])
    _, acc = moe_reference(*inp, act="relu", capacity=3, drop="lowest_gate")
    assert acc.flatten().tolist() == [True, True, False, True, False]
    # Reverse the identity: the tie among the 0.5 gates now goes to token 2.
    _, acc = moe_reference(*inp, act="relu", capacity=3, drop="lowest_gate", row_id=lambda r, t, k: 100 - t)
    assert acc.flatten().tolist() == [False, True, True, True, False]
    # Ties among the admitted top gates too: capacity 1 picks the 0.7 with the smaller row_id.
    _, acc = moe_reference(*inp, act="relu", capacity=1, drop="lowest_gate")
    assert acc.flatten().tolist() == [False, True, False, False, False]
    # Arrival ignores the gates.
    _, acc = moe_reference(*inp, act="relu", capacity=3, drop="arrival")
    assert acc.flatten().tolist() == [True, True, True, False, False]


@pytest.mark.parametrize("drop", ["arrival", "lowest_gate"])
@pytest.mark.parametrize(("routing", "seed"), [("hot", 0), ("zipf:1.5", 1), ("uniform", 2), ("one", 3)])
def test_capacity_bound_and_conservation(drop, routing, seed):
    W, T, K, E = 3, 7, 2, 6
    inp = random_inputs(W, T, 4, 4, E, K, routing=routing, seed=seed)
    caps = [1, 2, 3, 4, 5, 6]
    _, acc = moe_reference(*inp, capacity=caps, drop=drop)
    sent = sent_per_expert(inp.topk_ids, E)
    kept = rows_per_expert(inp.topk_ids, acc, E)
    assert sum(sent) == W * T * K  # eq. 24
    assert all(k <= c for k, c in zip(kept, caps, strict=True))
    assert kept == [min(s, c) for s, c in zip(sent, caps, strict=True)]  # an owner admits all it can
    dropped = sum(max(0, s - c) for s, c in zip(sent, caps, strict=True))
    assert dropped > 0
    assert sum(kept) == W * T * K - dropped == int(acc.sum())


# ----------------------------------------------------------------------------------------
# Combine weights
# ----------------------------------------------------------------------------------------


def _scaled_experts(scales, H=4):
    """relu experts f_e(x) = c_e · x on x ≥ 0: w_up = I, w_down = c_e I."""
    E = len(scales)
    w_up = torch.eye(H).expand(E, H, H).clone()
    w_down = torch.stack([c * torch.eye(H) for c in scales])
    return w_up, w_down


def test_renormalization_by_hand():
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    ids = torch.tensor([[[0, 1, 2]]])
    g = torch.tensor([[[0.5, 0.3, 0.2]]])
    w_up, w_down = _scaled_experts([2.0, 3.0, 5.0])
    # Expert 1 admits nothing: slot 1 is dropped; survivors 0.5 and 0.2 are scaled by 1.0 / 0.7.
    y, acc = moe_reference(x, ids, g, None, w_up, w_down, act="relu", capacity=[1, 0, 1])
    assert acc.flatten().tolist() == [True, False, True]
    gp = combine_weights(g, acc)
    # g in fp32 is 0.3 and 0.2 rounded: the values by hand are of the exact decimals. Two sums of
    # at most three gates, their quotient and a product
    assert_close(gp, torch.tensor([[[0.5 / 0.7, 0.0, 0.2 / 0.7]]]), bound(combine_weights, (g, acc), 3 + 3 + 2))

    def layer(g, x, **kw):
        return moe_reference(x, ids, g, None, w_up, w_down, act="relu", **kw)

    chain = layer_chain(4, 4, 3)
    assert_close(y, (0.5 / 0.7 * 2.0 + 0.2 / 0.7 * 5.0) * x, bound(layer, (g, x), chain, capacity=[1, 0, 1]))
    # weights zero: survivors unchanged.
    yz, _ = moe_reference(x, ids, g, None, w_up, w_down, act="relu", capacity=[1, 0, 1], weights="zero")
    assert_close(yz, (0.5 * 2.0 + 0.2 * 5.0) * x, bound(layer, (g, x), chain, capacity=[1, 0, 1], weights="zero"))
    # dropless: eq. 4 itself.
    y4, _ = moe_reference(x, ids, g, None, w_up, w_down, act="relu")
    assert_close(y4, (0.5 * 2.0 + 0.3 * 3.0 + 0.2 * 5.0) * x, bound(layer, (g, x), chain))


def test_token_with_every_slot_dropped_gets_zero():
    x = torch.ones(1, 3, 4)
    ids = torch.tensor([[[0, 1], [0, 1], [2, 3]]])
    g = torch.full((1, 3, 2), 0.5)
    w_up, w_down = _scaled_experts([1.0, 1.0, 1.0, 1.0])
    # Experts 0 and 1 take one row each: token 0's; token 1 loses both slots.
    y, acc = moe_reference(x, ids, g, None, w_up, w_down, act="relu", capacity=1)
    assert acc[0].tolist() == [[True, True], [False, False], [True, True]]
    assert torch.equal(y[0, 1], torch.zeros(4))
    assert not torch.isnan(y).any()
    # 0.5 · 1 + 0.5 · 1, renormalised by 1.0 / 1.0: every step exact
    assert torch.equal(y[0, 0], torch.ones(4)) and torch.equal(y[0, 2], torch.ones(4))
    # Capacity 0: nothing survives anywhere.
    y0, acc0 = moe_reference(*random_inputs(2, 4, 8, 8, 4, 2, seed=2), capacity=0)
    assert not bool(acc0.any())
    assert torch.equal(y0, torch.zeros_like(y0))


def test_zero_vs_renormalize():
    inp = random_inputs(2, 8, 8, 12, 4, 3, routing="hot", seed=7)
    yr, acc = moe_reference(*inp, capacity=5, weights="renormalize")
    yz, acc_z = moe_reference(*inp, capacity=5, weights="zero")
    assert torch.equal(acc, acc_z)
    full = acc.all(dim=-1)
    partial = acc.any(dim=-1) & ~full
    assert bool(full.any()) and bool(partial.any())
    # Fully accepted tokens: the two modes agree (Σg / Σg is 1 exactly: the same sum, bitwise); partly
    # dropped ones differ by Σg / Σ_acc g.
    assert torch.equal(yr[full], yz[full])

    def rescaled(x, ids, g, wg, wu, wd):  # weights zero, then the token's Σg / Σ_acc g
        ratio = g.sum(-1) / torch.where(acc, g, 0).sum(-1)
        return moe_reference(x, ids, g, wg, wu, wd, capacity=5, weights="zero")[0] * ratio[..., None]

    want = rescaled(*inp)
    limit = bound(rescaled, inp, layer_chain(8, 12, 3, extra=3 + 3 + 2))  # and the ratio's two sums, quotient, product
    assert_close(yr[partial], want[partial], limit[partial], "renormalize")
    assert (yr[partial] - yz[partial]).abs().max() > 1e-3
    ref = dense(*inp, "swiglu", accepted=acc, weights="zero")
    limit = bound(dense, (*inp, "swiglu"), layer_chain(8, 12, 3), accepted=acc, weights="zero")
    assert_close(yz, ref, limit, "zero")


# ----------------------------------------------------------------------------------------
# dtypes, determinism, errors
# ----------------------------------------------------------------------------------------


def test_bf16_computes_in_fp32_and_returns_bf16():
    inp = random_inputs(2, 4, 16, 16, 4, 2, seed=4, dtype=torch.bfloat16)
    y, _ = moe_reference(*inp)
    assert y.dtype == torch.bfloat16
    up = [None if t is None else (t.float() if t.is_floating_point() else t) for t in inp]
    y32, _ = moe_reference(*up)
    assert torch.equal(y, y32.to(torch.bfloat16))


def test_deterministic():
    a = random_inputs(3, 9, 16, 20, 6, 2, routing="zipf:1.5", seed=42)
    b = random_inputs(3, 9, 16, 20, 6, 2, routing="zipf:1.5", seed=42)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)
    c = random_inputs(3, 9, 16, 20, 6, 2, routing="zipf:1.5", seed=43)
    assert not torch.equal(a.x, c.x)
    for kw in ({}, {"capacity": 4, "drop": "lowest_gate"}, {"capacity": 3, "weights": "zero"}):
        y1, a1 = moe_reference(*a, **kw)
        y2, a2 = moe_reference(*b, **kw)
        assert torch.equal(y1, y2) and torch.equal(a1, a2)


def test_bad_arguments():
    inp = random_inputs(2, 3, 4, 4, 3, 2, seed=0)
    with pytest.raises(ValueError, match="activation"):
        moe_reference(*inp, act="tanh")
    with pytest.raises(ValueError, match="not gated"):
        moe_reference(*inp, act="gelu")
    with pytest.raises(ValueError, match="w_gate"):
        moe_reference(inp.x, inp.topk_ids, inp.topk_weights, None, inp.w_up, inp.w_down)
    with pytest.raises(ValueError, match="one value per expert"):
        moe_reference(*inp, capacity=[1, 2])
    with pytest.raises(ValueError, match="injective"):
        moe_reference(*inp, capacity=1, row_id=lambda r, t, k: r * 3 + t)
    with pytest.raises(ValueError, match="drop policy"):
        moe_reference(*inp, capacity=1, drop="random")
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        moe_reference(inp.x, inp.topk_ids + 1, *inp[2:])
    with pytest.raises(ValueError, match="owner"):
        moe_reference(*inp, owner=(0, 1, 2))


# ----------------------------------------------------------------------------------------
# random_inputs
# ----------------------------------------------------------------------------------------


def test_random_inputs_routing():
    W, T, E, K = 4, 64, 8, 3
    for routing in ("uniform", "zipf:1.0", "hot", "one"):
        inp = random_inputs(W, T, 16, 32, E, K, routing=routing, seed=0)
        ids = inp.topk_ids
        assert ids.dtype == torch.int64 and ids.shape == (W, T, K)
        assert all(len(set(row)) == K for row in ids.reshape(-1, K).tolist())  # distinct per token
        g = inp.topk_weights
        # a softmax over K logits (its sum of K, a division) and the sum of its K gates, each
        # rounding spreading at most u · 1 (as test_router's sums)
        one = torch.ones(W, T)
        assert_close(g.sum(-1), one, reorder_bound(unit_roundoff(torch.float32) * one, 2 * K + 2, one), routing)
        assert bool((g[..., :-1] >= g[..., 1:]).all())
        y, _ = moe_reference(*inp)
        assert 0.05 < float(y.std()) < 5  # O(1)
    counts = sent_per_expert(random_inputs(W, T, 4, 4, E, K, routing="zipf:1.5").topk_ids, E)
    assert counts[0] > 2 * counts[-1]
    hot = random_inputs(W, T, 4, 4, E, K, routing="hot").topk_ids
    assert (hot.sort(-1).values == torch.arange(K)).all(-1).float().mean() > 0.75
    one = random_inputs(W, T, 4, 4, E, 1, routing="one").topk_ids
    assert bool((one == 0).all())
    assert random_inputs(1, 2, 4, 4, 4, 2, gated=False).w_gate is None
    with pytest.raises(ValueError, match="routing"):
        random_inputs(1, 2, 4, 4, 4, 2, routing="pareto")


# ----------------------------------------------------------------------------------------
# From a spec
# ----------------------------------------------------------------------------------------


def test_reference_for_tiny(root):
    layer = rdepc.load(root / "examples" / "tiny.rdep")
    s = layer.shapes
    fn = reference_for(layer)
    inp = random_inputs(s["W"], s["T"], s["H"], s["F"], s["E"], s["K"], seed=0)
    y, acc = fn(*inp)
    assert bool(acc.all())
    y2, _ = moe_reference(*inp)
    assert torch.equal(y, y2)
    y3, _ = reference_for(layer.spec)(*inp)
    assert torch.equal(y, y3)
    with pytest.raises(ValueError, match="x must be"):
        fn(*random_inputs(s["W"] + 1, 4, s["H"], s["F"], s["E"], s["K"]))


SPEC = """\
param W = 4
param T <= 64
param K = 2
layer sym {{
  shape     ranks W, tokens T, hidden 8, experts 8, top K
  expert    {act}(ffn = 8)
  dtype     fp32
  model     moe_layers 1
  route_row id = {route}
  sideband  row_id, local_expert, gate
  owner     balanced
  capacity  {capacity}
  segment   rows 32, buffers 2
  schedule  bulk
  transport emulated
}}
"""


def _spec(tmp_path, act="swiglu", route="(rank * T + token) * K + slot", capacity="dropless"):
    p = tmp_path / "layer.rdep"
    p.write_text(SPEC.format(act=act, route=route, capacity=capacity))
    return rdepc.load(p)


@pytest.mark.parametrize(("T", "cap"), [(10, 15), (11, 17), (64, 96)])
def test_reference_for_factor_capacity_at_actual_tokens(tmp_path, T, cap):
    layer = _spec(tmp_path, act="gelu", capacity="factor 1.5, drop lowest_gate, weights zero")
    assert capacity_for(layer.spec, T) == cap == math.ceil(1.5 * 4 * T * 2 / 8)
    inp = random_inputs(4, T, 8, 8, 8, 2, routing="one", seed=1, gated=False)  # experts 0, 1 get W·T rows
    y, acc = reference_for(layer)(*inp)
    assert rows_per_expert(inp.topk_ids, acc, 8)[:2] == [min(cap, 4 * T)] * 2
    y2, acc2 = moe_reference(*inp, act="gelu", capacity=cap, drop="lowest_gate", weights="zero")
    assert torch.equal(acc, acc2) and torch.equal(y, y2)
    with pytest.raises(ValueError, match="exceed"):
        reference_for(layer)(*random_inputs(4, 65, 8, 8, 8, 2, gated=False))


def test_reference_for_uses_the_spec_route_row(tmp_path):
    # Token-major identity: arrival admits token 0 of every rank before token 1 of any.
    layer = _spec(tmp_path, act="relu", route="(slot * T + token) * W + rank", capacity="rows 6, drop arrival")
    assert not layer.spec.route_row.is_eq7
    inp = random_inputs(4, 5, 8, 8, 8, 2, routing="one", seed=0, gated=False)
    _, acc = reference_for(layer)(*inp)
    want = torch.zeros(4, 5, 2, dtype=torch.bool)
    want[:, 0, :] = True  # 4 ranks × token 0
    want[:2, 1, :] = True  # then ranks 0, 1 of token 1
    assert torch.equal(acc, want)
    # eq. 7 (rank-major) would have admitted 6 tokens of rank 0 and 1 — a different set.
    _, acc7 = moe_reference(*inp, act="relu", capacity=6, drop="arrival")
    assert not torch.equal(acc, acc7)
    assert bool(acc7[0].all()) and int(acc7[1].sum()) == 2


def test_import_rdepc_does_not_import_torch_or_reference():
    code = "import sys, rdepc; assert 'torch' not in sys.modules and 'rdepc.reference' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_random_weights_are_the_same_drawn_in_threads_or_not(monkeypatch):
    """Each expert's matrix has a generator of its own, so how the draws are spread over
    threads cannot change a value; and another seed or tensor name gives other values."""
    import rdepc.reference as reference

    serial = reference.random_inputs(2, 3, 16, 8, 6, 2, seed=5)
    monkeypatch.setattr(reference, "PARALLEL_DRAW", 0)  # every draw through the thread pool
    threaded = reference.random_inputs(2, 3, 16, 8, 6, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(serial, threaded, strict=True))
    other = reference.random_inputs(2, 3, 16, 8, 6, 2, seed=6)
    assert not torch.equal(serial.w_up, other.w_up) and not torch.equal(serial.w_up[:, :8], serial.w_gate[:, :8])
    assert torch.equal(serial.x, reference.random_inputs(2, 3, 16, 8, 6, 2, seed=5, gated=False).x)
