"""The torch side of a layer — the router statement and the shared experts' gate: elaboration,
the runtime router against the reference's per-token one, its losses, a DeepSeek-V3-style
router, a logit bias and a gated shared expert through RDEPMoE's compiled kernels."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rdepc.runtime import router as R
from rdepc.runtime.tensors import max_relative_error
from tolerance import assert_close, bound, reorder_bound, unit_roundoff

import rdepc
from rdepc.api import Layer, SpecError, elaborate_layer
from rdepc.diagnostics import Severity
from rdepc.ir.spec import Router
from rdepc.parser import parse_text
from rdepc.reference import reference_for, route, shared_experts

MIXTRAL = "router softmax, renormalize"
QWEN3_UNNORMALISED = "router softmax"
DEEPSEEK = "router sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5"
DEEPSEEK_V2 = "router softmax, groups 4, top_groups 2, group_score max, scale 16"
GPT_OSS = "router softmax, logit_bias, renormalize"


def text(
    router: str = "", W: int = 2, T: int = 8, E: int = 8, K: int = 3, dtype: str = "fp32", shared="",
    expert="swiglu(ffn = 32)",
) -> str:  # fmt: skip
    return (
        "layer t {\n"
        f"  shape     ranks {W}, tokens {T}, hidden 32, experts {E}, top {K}\n"
        f"  expert    {expert}\n"
        f"  dtype     {dtype}\n"
        f"  {router}\n"
        "  schedule  bulk\n"
        f"{shared}"
        "}\n"
    )


def spec_of(router: str, **kw):
    spec, _ = elaborate_layer(parse_text(text(router, **kw), "r.rdep"), None, {})
    return spec


def test_without_a_router_statement_a_layer_routes_softmax_renormalised():
    assert spec_of("").router == Router(score="softmax", renormalize=True)


def test_the_deepseek_router_elaborates():
    r = spec_of(DEEPSEEK + ", aux_loss 0.001, z_loss 1").router
    assert (r.score, r.renormalize, r.bias, r.groups, r.top_groups) == ("sigmoid", True, True, 4, 2)
    assert (float(r.scale), float(r.aux_loss), float(r.z_loss)) == (2.5, 0.001, 1.0)
    assert (r.group_score, r.logit_bias) == ("top2", False)


def test_the_deepseek_v2_and_gpt_oss_routers_elaborate():
    r = spec_of(DEEPSEEK_V2).router
    assert (r.score, r.renormalize, r.groups, r.top_groups, r.group_score, float(r.scale)) == (
        "softmax", False, 4, 2, "max", 16.0
    )  # fmt: skip
    assert spec_of("router softmax, groups 4, top_groups 2, group_score top2").router.group_score == "top2"
    r = spec_of(GPT_OSS).router
    assert (r.score, r.logit_bias, r.bias, r.renormalize) == ("softmax", True, False, True)
    assert spec_of("router softmax, bias, renormalize, norm_min 1e-12").router.norm_min == Fraction(1, 10**12)
    assert spec_of("router softmax, renormalize, norm_min 2.5E+1").router.norm_min == 25
    assert spec_of(MIXTRAL).router.norm_min is None
    with pytest.raises(SpecError):  # an exponent of three digits is not a number: 1e-100 would be one
        spec_of("router softmax, renormalize, norm_min 1e-100")


@pytest.mark.parametrize(
    ("router", "message", "col"),
    [
        ("router renormalize", "'router' needs its score function: softmax or sigmoid", 3),
        ("router softmax, sigmoid", "'router' gives both softmax and sigmoid; choose one", 3),
        ("router softmax, groups 4", "router groups needs top_groups", 19),
        ("router softmax, groups 3, top_groups 1", "router groups 3 does not divide the 8 experts", 26),
        ("router softmax, groups 4, top_groups 5", "router top_groups 5 is more than the 4 groups", 40),
        ("router softmax, groups 4, top_groups 1", "top 3 cannot be picked from 1 group(s) of 2 experts", 40),
        ("router softmax, scale 0", "router scale must be positive, got 0", 25),
        ("router softmax, aux_loss -1", "router aux_loss must be zero or more, got -1", 28),
        ("router softmax, z_los 1", "unknown option 'z_los' in 'router'", 19),
        (
            "router softmax, group_score max",
            "router group_score needs groups and top_groups: it scores the groups a token picks from",
            19,
        ),
        (
            "router softmax, groups 4, top_groups 2, group_score sum",
            "router group_score must be one of top2, max; got sum",
            55,
        ),
        ("router softmax, group_score", "'group_score' in 'router' needs a value", 19),
        ("router softmax, logit_bias 1", "'logit_bias' in 'router' takes no value", 19),
        ("router softmax, logit_bais", "unknown option 'logit_bais' in 'router'", 19),
        (
            "router softmax, norm_min 0.1",
            "router norm_min needs renormalize: it floors the sum the K gates are divided by",
            19,
        ),
        ("router softmax, renormalize, norm_min 0", "router norm_min must be positive, got 0", 41),
    ],
)
def test_router_errors_point_at_the_statement(router, message, col):
    with pytest.raises(SpecError) as err:
        spec_of(router)
    d = err.value.diagnostics[0]
    assert d.message == message
    assert (d.span.line, d.span.col) == (5, col)


ROUTERS = [
    MIXTRAL,
    QWEN3_UNNORMALISED,
    DEEPSEEK,
    "router sigmoid, groups 2, top_groups 1",
    DEEPSEEK_V2,
    "router sigmoid, bias, groups 4, top_groups 2, group_score max, renormalize",
    GPT_OSS,
    "router sigmoid, logit_bias, bias, groups 4, top_groups 2, group_score max, scale 2",
    "router softmax, bias, renormalize, norm_min 0.97",  # Ernie-4.5's floor, binding for some tokens here
]


def gate_bound(x, weight, r, K: int, bias=None, logit_bias=None) -> torch.Tensor:
    """How far two routers' gates may differ: the logit's sum over H, then the score's exp (or
    sigmoid), its sum over E, the group choice, the renormalisation over K and the scale."""
    E, H = weight.shape
    return bound(lambda x, w, lb: route(x, w, r, K, bias, lb)[1], (x, weight, logit_bias), H + E + K + 8)


@pytest.mark.parametrize("router", ROUTERS)
def test_the_runtime_router_matches_the_per_token_reference(router):
    r = spec_of(router).router
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(40, 32, generator=g), torch.randn(8, 32, generator=g)
    bias = torch.randn(8, generator=g) * 0.1 if r.bias else None
    logit_bias = torch.randn(8, generator=g) if r.logit_bias else None
    ids, gates, logits = R.route(x, weight, r, 3, bias, logit_bias=logit_bias)
    want_ids, want_gates = route(x, weight, r, 3, bias, logit_bias)
    assert torch.equal(ids, want_ids)
    assert_close(gates, want_gates, gate_bound(x, weight, r, 3, bias, logit_bias), "gates")
    want_logits = x @ weight.T + (0 if logit_bias is None else logit_bias)
    logit_bound = bound(lambda x, w, lb: x @ w.T + (0 if lb is None else lb), (x, weight, logit_bias), 33)
    assert_close(logits, want_logits, logit_bound, "logits")
    sums = gates.sum(-1)
    if r.norm_min is not None:  # divided by max(sum, norm_min): where the floor binds, the sum stays below 1
        assert (sums <= 1 + 1e-6).all() and (sums < 0.99).any() and (sums > 1 - 1e-6).any()
    elif r.renormalize:  # K gates divided by their sum, scaled and summed: each rounding moves the sum by u·scale
        scale = torch.full_like(sums, float(r.scale))
        assert_close(sums, scale, reorder_bound(unit_roundoff(torch.float32) * scale, 2 * 3 + 2, scale), "sums")
    elif r.score == "softmax":
        assert (sums < float(r.scale)).all()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    groups=st.sampled_from([2, 4]),
    size=st.integers(1, 3),
    data=st.data(),
    options=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.sampled_from(["top2", "max"])),
    seed=st.integers(0, 2**16),
)
def test_every_router_rule_matches_the_reference(groups, size, data, options, seed):
    """Any score, bias, logit bias and group rule: the runtime's ids and gates are the per-token
    reference's (continuous random inputs: no ties)."""
    sigmoid, bias, logit_bias, group_score = options
    E = groups * size
    M = data.draw(st.integers(1, groups), label="top_groups")
    K = data.draw(st.integers(1, M * size), label="K")
    r = Router(
        score="sigmoid" if sigmoid else "softmax", bias=bias, logit_bias=logit_bias, groups=groups, top_groups=M,
        group_score=group_score,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(6, 16, generator=g), torch.randn(E, 16, generator=g) / 4  # no sigmoid saturates to 1
    b = torch.randn(E, generator=g) * 0.1 if bias else None
    lb = torch.randn(E, generator=g) if logit_bias else None
    ids, gates, _ = R.route(x, weight, r, K, b, logit_bias=lb)
    want_ids, want_gates = route(x, weight, r, K, b, lb)
    assert torch.equal(ids, want_ids)
    assert_close(gates, want_gates, gate_bound(x, weight, r, K, b, lb), "gates")


def test_zero_tokens_route_to_empty_tensors():
    r = spec_of(DEEPSEEK).router
    x, weight = torch.zeros(0, 32), torch.randn(8, 32)
    for ids, gates in (route(x, weight, r, 3, torch.zeros(8)), R.route(x, weight, r, 3, torch.zeros(8))[:2]):
        assert ids.shape == gates.shape == (0, 3) and ids.dtype == torch.int64


def test_group_limited_routing_picks_only_from_the_best_groups():
    r = spec_of("router sigmoid, groups 4, top_groups 1", K=2).router
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 0.0, 0.0, 9.0, -9.0]])  # group 1 sums best (5+4 > 9-9)
    ids, _, _ = R.route(None, torch.empty(8, 1), r, 2, logits=logits)
    assert ids.tolist() == [[2, 3]]  # not expert 6, the best alone: its group is not chosen


def test_a_group_scores_its_best_two_or_its_best():
    logits = torch.tensor([[5.0, -9.0, 4.0, 4.0, 0.0, 0.0, -1.0, -1.0]])  # group 0's best, group 1's best two
    for rule, want in (("top2", [[2, 3]]), ("max", [[0, 1]])):
        r = spec_of(f"router sigmoid, groups 4, top_groups 1, group_score {rule}", K=2).router
        assert R.route(None, torch.empty(8, 1), r, 2, logits=logits).ids.tolist() == want, rule


def test_a_logit_bias_moves_the_scores_and_the_gates():
    r = spec_of(GPT_OSS, K=2).router
    x, weight = torch.ones(1, 1), torch.zeros(8, 1)  # every logit 0 but for the bias
    logit_bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0])
    ids, gates, logits = R.route(x, weight, r, 2, logit_bias=logit_bias)
    assert ids.tolist() == [[7, 6]] and torch.equal(logits, logit_bias[None])
    top = torch.tensor([[2.0, 1.0]])  # GPT-OSS: softmax of the top-K logits
    assert_close(gates, torch.softmax(top, -1), bound(lambda t: torch.softmax(t, -1), (top,), 8 + 2 + 8))


def test_a_bias_chooses_but_does_not_weigh():
    r = spec_of("router sigmoid, bias").router
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0])
    ids, gates, _ = R.route(None, torch.empty(8, 1), r, 3, bias, logits=logits)
    assert ids.tolist() == [[7, 0, 1]]
    assert torch.equal(gates, torch.sigmoid(logits)[:, [7, 0, 1]])


def test_the_losses_are_the_switch_and_st_moe_formulas():
    r = spec_of("router softmax, renormalize, aux_loss 0.5, z_loss 0.25").router
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    routing = R.route(None, torch.empty(8, 1), r, 3, logits=logits)
    out = R.outputs(routing, r)
    p = torch.softmax(logits, -1)
    counts = torch.zeros(8)
    for e in routing.ids.flatten().tolist():
        counts[e] += 1
    aux = lambda p: 0.5 * 8 * (counts / 2 * p.mean(0)).sum()  # noqa: E731
    z = lambda t: 0.25 * torch.logsumexp(t, -1).square().mean()  # noqa: E731
    assert_close(out.aux_loss, aux(p), bound(aux, (p,), 2 + 8 + 8), "aux_loss")
    assert_close(out.z_loss, z(logits), bound(z, (logits,), 8 + 2 + 8), "z_loss")
    assert R.outputs(routing, spec_of(MIXTRAL).router)[1:] == (None, None)


def test_balanced_routing_has_aux_loss_k():
    """E·Σ f_e·P_e with every expert equally likely and equally loaded is K, as in transformers."""
    r = spec_of("router softmax, aux_loss 1").router
    ids = torch.arange(8).reshape(4, 2).repeat(2, 1)  # 8 tokens, each expert twice
    assert_close(R.aux_loss(torch.zeros(8, 8), ids, r), torch.tensor(2.0), reorder_bound(0, 8 + 8 + 8, 2.0))


def test_deepseek_routing_runs_through_rdepmoe_and_matches_the_reference():
    spec = spec_of(DEEPSEEK + ", aux_loss 0.01, z_loss 0.001")
    moe = rdepc.RDEPMoE(Layer(spec), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moe.router_bias.copy_(torch.linspace(-0.05, 0.05, 8))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    y, out = moe(x, router_outputs=True)
    ids, gates = route(x.reshape(-1, 32), moe.router, spec.router, 3, moe.router_bias)
    shape = (2, 8, 3)
    with torch.no_grad():
        want, _ = reference_for(spec)(x, ids.reshape(shape), gates.reshape(shape), moe.w_gate, moe.w_up, moe.w_down)
    assert max_relative_error(y.detach(), want) <= 1e-5
    assert out.logits.shape == (2, 8, 8) and out.logits.dtype == torch.float32
    # The router trains through the gates and the losses; its bias is a buffer, not a parameter.
    (y.square().sum() + out.aux_loss + out.z_loss).backward()
    assert moe.router.grad is not None and moe.router.grad.abs().sum() > 0
    assert "router_bias" not in dict(moe.named_parameters())


def test_the_router_keeps_fp32_in_a_bf16_layer():
    moe = rdepc.RDEPMoE(Layer(spec_of(MIXTRAL, dtype="bf16")), generator=torch.Generator().manual_seed(0))
    assert moe.router.dtype == torch.float32 and moe.w_down.dtype == torch.bfloat16
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    _, gates, logits = moe.route(x)
    assert gates.dtype == logits.dtype == torch.float32
    assert torch.equal(logits, x.float() @ moe.router.T)


def test_a_logit_bias_and_a_gated_shared_expert_train_through_rdepmoe_as_the_reference():
    """router_logit_bias [E] and shared_gate_proj [1, H]: fp32 / the layer's dtype parameters,
    the bias zero at first; outputs and every gradient as the reference's."""
    shared = "  shared    2 x swiglu(ffn = 16), gate sigmoid\n"
    spec = spec_of("router softmax, logit_bias, groups 4, top_groups 2, group_score max", shared=shared)
    moe = rdepc.RDEPMoE(Layer(spec), generator=torch.Generator().manual_seed(0))
    assert torch.equal(moe.router_logit_bias, torch.zeros(8)) and moe.shared_gate_proj.shape == (1, 32)
    with torch.no_grad():
        moe.router_logit_bias.copy_(torch.linspace(-1, 1, 8))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    y = moe(x)
    (y * dy).sum().backward()
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in moe.named_parameters()}
    ids, gates = route(x.reshape(-1, 32), ref["router"], spec.router, 3, None, ref["router_logit_bias"])
    wgu = ref["w_gate_up"]
    routed, _ = reference_for(spec)(
        x, ids.reshape(2, 8, 3), gates.reshape(2, 8, 3), wgu[..., 0], wgu[..., 1], ref["w_down"]
    )
    parts = (ref["shared_gate"], ref["shared_up"], ref["shared_down"])
    want = routed + shared_experts(x, *parts, "swiglu", ref["shared_gate_proj"])
    assert max_relative_error(y.detach(), want.detach()) <= 1e-5
    (want * dy).sum().backward()
    for name, p in moe.named_parameters():
        assert max_relative_error(p.grad, ref[name].grad) <= 1e-5, name
    assert ref["router_logit_bias"].grad.abs().sum() > 0 and ref["shared_gate_proj"].grad.abs().sum() > 0


def test_gpt_oss_experts_train_through_rdepmoe_as_the_reference():
    """clamped_swiglu with expert biases under GPT-OSS's router: the biases are parameters
    (b_gate_up [E, F, 2], its halves b_gate and b_up, and b_down [E, H]), zero at first and
    saved per expert; outputs and every gradient as the reference's."""
    spec = spec_of(GPT_OSS, expert="clamped_swiglu(ffn = 32, limit = 1), bias")
    moe = rdepc.RDEPMoE(Layer(spec), generator=torch.Generator().manual_seed(0))
    assert moe.b_gate_up.shape == (8, 32, 2) and moe.b_down.shape == (8, 32) and not moe.b_down.any()
    assert moe.b_gate.data_ptr() == moe.b_gate_up.data_ptr() and moe.b_up.shape == (8, 32)
    assert {"experts.3.b_gate_up", "experts.3.b_down"} <= set(moe.state_dict())
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in (moe.b_gate_up, moe.b_down, moe.router_logit_bias):
            p.copy_(torch.randn(p.shape, generator=gen) / 2)
    x = torch.randn(2, 8, 32, generator=gen)
    dy = torch.randn(2, 8, 32, generator=gen)
    y = moe(x)
    (y * dy).sum().backward()
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in moe.named_parameters()}
    ids, gates = route(x.reshape(-1, 32), ref["router"], spec.router, 3, None, ref["router_logit_bias"])
    wgu, bgu = ref["w_gate_up"], ref["b_gate_up"]
    want, _ = reference_for(spec)(
        x, ids.reshape(2, 8, 3), gates.reshape(2, 8, 3), wgu[..., 0], wgu[..., 1], ref["w_down"],
        b_gate=bgu[..., 0], b_up=bgu[..., 1], b_down=ref["b_down"],
    )  # fmt: skip
    assert max_relative_error(y.detach(), want.detach()) <= 1e-5
    (want * dy).sum().backward()
    for name, p in moe.named_parameters():
        assert max_relative_error(p.grad, ref[name].grad) <= 1e-5, name
    assert ref["b_gate_up"].grad.abs().sum() > 0 and ref["b_down"].grad.abs().sum() > 0


# ----------------------------------------------------------------------------- the shared gate
def shared_spec(stmt: str):
    """(spec, warnings) of a layer whose 'shared' statement, line 7, is ``stmt``."""
    return elaborate_layer(parse_text(text("router softmax", shared=f"{stmt}\n"), "r.rdep"), None, {})


def test_a_gated_shared_expert():
    spec, warnings = shared_spec("  shared    2 x swiglu(ffn = 512), gate sigmoid")
    assert warnings == () and (spec.shared.count, spec.shared.gate) == (2, "sigmoid")
    span = spec.span_of("shared.gate")
    assert (span.line, span.col, span.end_col) == (7, 36, 48)
    assert shared_spec("  shared    swiglu(ffn = 512)")[0].shared.gate is None


@pytest.mark.parametrize(
    ("stmt", "message", "col"),
    [
        ("  shared    swiglu(ffn = 8), gate", "'gate' in 'shared' needs a value", 30),
        ("  shared    swiglu(ffn = 8), gate relu", "shared gate must be one of sigmoid; got relu", 35),
        ("  shared    swiglu(ffn = 8), gate sigmoid, gate sigmoid", "'gate' given twice in 'shared'", 44),
        ("  shared    swiglu(ffn = 8), gates sigmoid", "unknown option 'gates' in 'shared'", 30),
        ("  shared    gate sigmoid", "'shared' needs the shared experts", 3),
    ],
)
def test_shared_gate_errors_point_at_the_option(stmt, message, col):
    with pytest.raises(SpecError) as info:
        shared_spec(stmt)
    (d,) = [d for d in info.value.diagnostics if d.severity is Severity.ERROR]
    assert (d.message, d.span.line, d.span.col) == (message, 7, col)
    assert f"r.rdep:7:{col}: error: {message}" in str(info.value)


def test_a_selection_bias_the_spec_does_not_say_is_refused_not_applied():
    """RDEPMoE(router_bias=...) chooses experts by it only where the spec's router says 'bias';
    elsewhere (and at a shape other than [E]) it is refused by name, never applied unsaid."""
    x, bias = torch.randn(2, 8, 32), torch.randn(8)
    plain = rdepc.RDEPMoE(Layer(spec_of(MIXTRAL)), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^rdepc layer t: router_bias= given, but the spec's router has no 'bias'"):
        plain.route(x, router_bias=bias)
    biased = rdepc.RDEPMoE(Layer(spec_of(DEEPSEEK)), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"router_bias= has shape \(7,\), not \[E\] = \[8\]"):
        biased.route(x, router_bias=bias[:7])
    moved = biased.route(x, router_bias=bias).ids
    assert torch.equal(moved, R.route(x, biased.router, biased.layer.spec.router, 3, bias).ids)
