"""rdepc.hf.swap against transformers' own sparse MoE blocks (small random configs, CPU)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import subprocess
import sys

import hf_families as fam
import pytest
import torch
from conftest import HANG_S, ROOT
from safetensors.torch import load_file
from tolerance import NARROWINGS, assert_close, bound, layer_chain, reorder_bound, spread

import rdepc
from rdepc.hf import RDEPBlock, SwapError, swap, unswap
from rdepc.reference import route

transformers = fam.import_transformers()
if transformers is None:
    pytest.skip("transformers is not installed", allow_module_level=True)
SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def spec_file(tmp_path, router: str, E: int = 4, K: int = 2, F: int = 32, dtype: str = "fp32", extra: str = ""):
    path = tmp_path / "m.rdep"
    path.write_text(
        "layer m {\n"
        f"  shape  ranks 2, tokens 8, hidden 32, experts {E}, top {K}\n"
        f"  expert swiglu(ffn = {F})\n"
        f"  dtype  {dtype}\n"
        f"  router {router}\n"
        f"{extra}"
        "  schedule bulk\n"
        "}\n"
    )
    return path


def case_spec(tmp_path, case: fam.Case, **kw):
    path = tmp_path / "case.rdep"
    path.write_text(fam.spec_text(case, **kw))
    return path


def logits_before_and_after(model, spec, tokens=None):
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)) if tokens is None else tokens
    with torch.no_grad():
        want = model(tokens).logits
        names = swap(model, spec)
        got = model(tokens).logits
    return names, want, got


def relative(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


class Float64Mode(torch.overrides.TorchFunctionMode):
    """Every fp32 a module asks for made fp64 (``.float()``, ``.to(torch.float32)``, a
    ``dtype=torch.float32``): a block that computes in fp32 whatever its input (the privacy
    filter's) would leave its float64 twin's roundings in fp32, and the bound blind to them.
    Active where the twin's input (or, for a model, its weights) is fp64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def float64_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a transformers module, its experts run by transformers' eager loop (its
    grouped GEMMs take no float64), under :class:`Float64Mode`: what tests/tolerance.py's
    bounds re-run."""
    twin = copy.deepcopy(module).double()
    for m in twin.modules():
        if hasattr(getattr(m, "config", None), "_experts_implementation"):
            m.config._experts_implementation = "eager"
    forward = twin.forward

    def forward64(x, *args, **kwargs):  # tolerance.spread runs it in fp32 too: as the block runs
        held = x if x.is_floating_point() else next(twin.parameters())  # a model's input: token ids
        with Float64Mode() if held.dtype == torch.float64 else contextlib.nullcontext():
            return forward(x, *args, **kwargs)

    twin.forward = forward64
    return twin


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name, detached: its inputs besides x."""
    return {n: t.detach() for n, t in (*module.named_parameters(), *module.named_buffers())}


def logits_bound(model, tokens, chain: int, dtype=torch.float32) -> torch.Tensor:
    """The bound (tests/tolerance.py) of ``model``'s logits for ``tokens`` computed another way."""
    twin = float64_twin(model)

    def logits(state):
        with torch.no_grad():
            return torch.func.functional_call(twin, state, (tokens,)).logits

    return bound(logits, (state_of(model),), chain, dtype)


def moe_chain(H: int, F: int, K: int, E: int, shared: int = 0) -> int:
    """An MoE block's chain: the layer's, its shared experts' F, its router's dot over H and its
    scores over E."""
    return layer_chain(H, F, K, extra=shared + H + E)


def mixtral(dtype=torch.float32, layers: int = 2):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        **(SMALL | {"num_hidden_layers": layers}), intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    )
    return transformers.MixtralForCausalLM(cfg).eval().to(dtype)


def deepseek_v3():
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        **(SMALL | {"num_key_value_heads": 4}), intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=0,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.2)  # transformers zeroes it: every token would tie
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    return model


DEEPSEEK_V3 = "sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5"
DEEPSEEK_V3_SHARED = "  shared 1 x swiglu(ffn = 16)\n"


# ----------------------------------------------------------------------------- every family
def rdep_grads(block: RDEPBlock) -> dict[str, torch.Tensor]:
    """A swapped block's gradients under the transformers block's names and layouts."""
    gate = block.router_module
    out = {f"{block.hf_gate}.{n}": p.grad for n, p in gate.named_parameters() if p.grad is not None}
    return out | block.hf_layout(lambda p: p.grad)


@pytest.mark.parametrize("name", list(fam.CASES))
def test_every_family_is_swapped_with_equal_outputs_and_gradients(name):
    """swap without a spec (rdepc.hf.spec_for writes it from the block) gives transformers'
    outputs and gradients; the spec it writes is the hand-written one's layer (below). The
    probe's comparison (a forward) is this test's, with the derived bounds and the gradients
    too, so swap skips it here (the probe's own test: test_a_registered_block_is_swapped_...;
    swaps of whole models below run it)."""
    case = fam.CASES[name]
    holder = fam.block(transformers, case)
    original = copy.deepcopy(holder.mlp)
    assert swap(holder, ranks=2, tokens=8, verify=False) == ["mlp"] and isinstance(holder.mlp, RDEPBlock)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, 4, fam.H, generator=g), torch.randn(2, 4, fam.H, generator=g)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = original(xa), holder.mlp(xb)
    if isinstance(ya, tuple):  # GPT-OSS, Llama-4: (output, its router's scores or logits), and so the swapped block
        assert isinstance(yb, tuple) and torch.equal(yb[1], ya[1])
        ya, yb = ya[0], yb[0]
    assert yb.shape == ya.shape  # Llama-4's block returns its tokens flattened, [N, H]
    (ya * dy.reshape(ya.shape)).sum().backward()
    (yb * dy.reshape(yb.shape)).sum().backward()
    want, got = fam.expert_grads(original), rdep_grads(holder.mlp)
    assert set(got) == set(want) and any(k.startswith(("gate.", "router.")) for k in want)
    twin = float64_twin(original)

    def transformers_block(x, dy, state):  # y and the gradients of sum(y · dy), by transformers' block
        x = x.detach().clone().requires_grad_(True)
        leaves = {n: t.detach().clone().requires_grad_(n in want) for n, t in state.items()}
        y = torch.func.functional_call(twin, leaves, (x,))
        y = y[0] if isinstance(y, tuple) else y
        (y * dy.reshape(y.shape)).sum().backward()
        return {"y": y.detach(), "x": x.grad} | {n: leaves[n].grad for n in want}

    sigma = spread(transformers_block, (x, dy, state_of(original)))
    m = holder.mlp.moe
    shared = 0 if m.shared_up is None else m.shared_up.shape[0] * m.shared_up.shape[2]
    chain = moe_chain(fam.H, case.F, case.K, case.E, shared)
    assert_close(yb, ya, reorder_bound(sigma["y"], chain, ya), "y")
    chain += 2 * 4 * case.K  # a gradient of a weight: the N·K rows it sums
    assert_close(xb.grad, xa.grad, reorder_bound(sigma["x"], chain, xa.grad), "x")
    for k in want:
        assert_close(got[k], want[k], reorder_bound(sigma[k], chain, want[k]), k)


def _layer_terms(layer) -> tuple:
    sp = layer.spec
    shared = None if sp.shared is None else (sp.shared.fn.act, sp.shared.count * int(sp.shared.fn.F), sp.shared.gate)
    e = sp.expert
    return (layer.shapes, e.act, e.limit, e.alpha, e.bias, sp.gate_on, sp.router, shared, sp.precision.dtype)


@pytest.mark.parametrize("name", list(fam.CASES))
def test_the_written_spec_is_the_hand_written_ones_layer_with_its_sources(tmp_path, name):
    """spec_for's text for each family's block loads to the layer of the spec a person wrote for
    it (sizes, expert function, router, shared experts, dtype), and says where each value came
    from; the hand-written spec is accepted by swap as before."""
    case = fam.CASES[name]
    holder = fam.block(transformers, case)
    text = rdepc.hf.spec_for(holder, ranks=2, tokens=8)
    written = rdepc.api.load_text(text)
    hand = rdepc.load(case_spec(tmp_path, case))
    assert _layer_terms(written) == _layer_terms(hand)
    assert "# hidden: config.hidden_size" in text or "# hidden: experts." in text  # or an expert tensor
    assert text.count("\n  # ") == len([ln for ln in text.splitlines() if ln.startswith("  ") and "#" not in ln])
    assert swap(holder, case_spec(tmp_path, case), verify=False) == ["mlp"]  # equal outputs: the test above


def test_a_model_with_two_kinds_of_block_gets_a_layer_each_and_its_model_statement(tmp_path):
    """A model whose MoE blocks differ (here one block's experts resized) is written as one
    layer per kind, each with its blocks listed and the model's layer count; swap without a
    spec gives each block its own layer."""
    model = mixtral()
    layers = model.model.layers
    text = rdepc.hf.spec_for(model, ranks=2, tokens=8)
    assert "layer mixtral {" in text and "model    moe_layers 2, layers 2, vocab 64" in text
    assert "# Mixtral (MixtralSparseMoeBlock): model.layers.0.mlp, model.layers.1.mlp" in text
    layers[1].mlp.experts.gate_up_proj = torch.nn.Parameter(torch.randn(4, 16, 32))
    layers[1].mlp.experts.down_proj = torch.nn.Parameter(torch.randn(4, 32, 8))
    layers[1].mlp.experts.intermediate_dim = 8
    text = rdepc.hf.spec_for(model, ranks=2, tokens=8)
    assert "layer mixtral_1 {" in text and "layer mixtral_2 {" in text and "ffn = 8" in text
    assert swap(model, ranks=2, tokens=8) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert [b.moe.F for b in (layers[0].mlp, layers[1].mlp)] == [32, 8]


def test_spec_for_refuses_what_it_cannot_write_by_name():
    with pytest.raises(rdepc.UsageError, match=r"^spec_for needs ranks and tokens of at least 1, got ranks=0"):
        rdepc.hf.spec_for(mixtral(), ranks=0)
    with pytest.raises(SwapError, match="Linear has no sparse MoE block"):
        rdepc.hf.spec_for(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        (
            "mixtral",
            lambda b: setattr(b, "shared_expert_gate", torch.nn.Linear(32, 1)),
            "mlp (MixtralSparseMoeBlock) has submodule shared_expert_gate (Linear), which rdepc.hf does not map",
        ),
        (
            "mixtral",
            lambda b: setattr(b, "jitter_noise", 0.1),
            "mlp (MixtralSparseMoeBlock) has jitter_noise = 0.1, and rdepc.hf maps only 0",
        ),
        (
            "olmoe",
            lambda b: setattr(b.experts, "alpha", 1.702),
            "mlp (OlmoeSparseMoeBlock) has attribute experts.alpha = 1.702, which rdepc.hf does not map",
        ),
        (
            "deepseek_v3",
            lambda b: b.gate.register_buffer("expert_load", torch.zeros(8)),
            "mlp (DeepseekV3MoE) has buffer gate.expert_load, which rdepc.hf does not map",
        ),
        (
            "glm4_moe",
            lambda b: setattr(b.shared_experts.up_proj, "bias", torch.nn.Parameter(torch.zeros(16))),
            "mlp (Glm4MoeMoE) has parameter shared_experts.up_proj.bias, which rdepc.hf maps only when it is None",
        ),
        (
            "hunyuan_v1_moe",
            lambda b: setattr(b, "experts", torch.nn.ModuleList()),
            "mlp (HunYuanMoEV1Moe) has experts of class ModuleList, where rdepc.hf maps HunYuanMoEV1Experts",
        ),
        (
            "step3p7",
            lambda b: setattr(b.experts, "limit", 7.0),  # a layer of swiglu_limits: SwiGLU clamped at 7
            "mlp (Step3p7SparseMoeBlock) has experts.limit = 7.0, and rdepc.hf maps only None or inf",
        ),
        (
            "bailing_hybrid",
            lambda b: setattr(b.shared_experts, "limit", 16.0),  # a layer of swiglu_limits_shared
            "mlp (BailingHybridMoE) has shared_experts.limit = 16.0, and rdepc.hf maps only None or inf",
        ),
    ],
)
def test_what_the_table_does_not_know_is_refused(tmp_path, name, change, message):
    case = fam.CASES[name]
    holder = fam.block(transformers, case)
    change(holder.mlp)
    with pytest.raises(SwapError) as err:
        swap(holder, case_spec(tmp_path, case))
    assert str(err.value).startswith(message), err.value


def test_the_gpt_oss_router_is_softmax_logit_bias_renormalize(tmp_path):
    """GPT-OSS's router (softmax over the top-K logits, its bias on them) is the spec's
    'softmax, logit_bias, renormalize', routed by the reference operator one token at a time."""
    holder = fam.block(transformers, fam.CASES["gpt_oss"])
    gate = holder.mlp.router
    router = rdepc.load(spec_file(tmp_path, "softmax, logit_bias, renormalize")).spec.router
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(1))
    from test_router import gate_bound

    with torch.no_grad():
        _, want_gates, want_ids = gate(x)
        ids, gates = route(x, gate.weight, router, 2, logit_bias=gate.bias)
    assert torch.equal(ids, want_ids)
    assert_close(gates, want_gates, gate_bound(x, gate.weight.detach(), router, 2, logit_bias=gate.bias.detach()))


@pytest.mark.parametrize(
    ("name", "kw", "message"),
    [
        (
            "lfm2_moe",
            {"norm_topk_prob": True},
            "mlp (Lfm2MoeSparseMoeBlock): its router Lfm2MoeTopKRouter has norm_topk_prob True: it divides the "
            "top-K gates by their sum + 1e-6, and the spec language has no term for that epsilon",
        ),
        (
            "laguna",
            {"moe_router_logit_softcapping": 30.0},
            "mlp (LagunaSparseMoeBlock): it has a router whose logits are soft-capped "
            "(gate.router_logit_softcapping 30: c·tanh(z/c) before the sigmoid), and the spec language has no term",
        ),
        (
            "axk2",
            {"n_group": 4, "topk_group": 2},
            "mlp (AXK2MoE): its router AXK2TopkRouter has num_group 4, topk_group 2: it scores its left-out groups' "
            "experts 0.0, above kept ones a negative selection bias brings below 0",
        ),
        (
            "dbrx",
            {"ffn_config": fam.CASES["dbrx"].kw["ffn_config"] | {"moe_normalize_expert_weights": 2.0}},
            "mlp (DbrxFFN): it has moe_normalize_expert_weights 2.0: it divides the top-K gates by their 2-norm, "
            "and the spec language has no term for it",
        ),
    ],
)
def test_a_router_rule_the_spec_language_lacks_is_refused_with_why(name, kw, message):
    """A mapped family whose block, as configured, routes by a rule the spec cannot say is
    refused, by swap and spec_for alike, naming the term it lacks."""
    case = fam.CASES[name]
    case = dataclasses.replace(case, kw=case.kw | kw)
    for attempt in (lambda h: swap(h, ranks=2, tokens=8), lambda h: rdepc.hf.spec_for(h, ranks=2, tokens=8)):
        with pytest.raises(SwapError) as err:
            attempt(fam.block(transformers, case))
        assert str(err.value).startswith(message), err.value


def test_a_block_class_outside_the_table_is_refused(tmp_path):
    class MyMoe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(32, 4)
            self.experts = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(4)])

    holder = torch.nn.Sequential(torch.nn.Linear(32, 32), MyMoe())
    with pytest.raises(SwapError, match=r"^1 \(MyMoe\) has experts, but MyMoe is not a block class rdepc.hf maps"):
        swap(holder, spec_file(tmp_path, "softmax"))


@pytest.mark.parametrize(
    ("name", "kw", "message"),
    [
        ("deepseek_v2_greedy", {"router": "softmax, renormalize, scale 1.5"}, "has router renormalize False, but"),
        ("deepseek_v2_greedy", {"router": "softmax"}, "has router scale 1.5, but layer 'm' ("),
        ("deepseek_v3", {"router": "sigmoid, groups 4, top_groups 2, renormalize, scale 2.5"}, "has router bias True"),
        ("ernie4_5_moe", {"router": "softmax, renormalize"}, "has router bias True, but"),
        ("deepseek_v3", {"shared": "shared 2 x swiglu(ffn = 16)"}, "has shared 1 x swiglu(ffn = 16), but layer 'm' ("),
        ("hunyuan_v1_moe", {"shared": ""}, "has shared 1 x swiglu(ffn = 16), but layer 'm' ("),
        ("mixtral", {"F": 32}, "has ffn 16, but layer 'm' ("),
        ("mixtral", {"router": "softmax, logit_bias, renormalize"}, "has router logit_bias False, but layer 'm' ("),
        (
            "deepseek_v2_group_limited",
            {"router": "softmax, groups 4, top_groups 2"},
            "has router group_score max, but layer 'm' (",
        ),
        (
            "qwen2_moe",
            {"shared": "shared swiglu(ffn = 16)"},
            "has shared 1 x swiglu(ffn = 16), gate sigmoid, but layer 'm' (",
        ),
        ("deepseek_v3", {"shared": "shared swiglu(ffn = 16), gate sigmoid"}, "has shared 1 x swiglu(ffn = 16), but"),
    ],
)
def test_a_spec_that_disagrees_with_a_family_names_both(tmp_path, name, kw, message):
    case = fam.CASES[name]
    with pytest.raises(SwapError) as err:
        swap(fam.block(transformers, case), case_spec(tmp_path, dataclasses.replace(case, **kw)))
    assert message in str(err.value), err.value


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"F": 64}, "model.layers.0.mlp (MixtralSparseMoeBlock) has ffn 32, but layer 'm' ("),
        ({"router": "softmax"}, "has router renormalize True, but layer 'm' ("),
        ({"router": "sigmoid, renormalize"}, "has router score softmax, but layer 'm' ("),
        ({"E": 8}, "has experts 4, but layer 'm' ("),
    ],
)
def test_a_spec_that_disagrees_with_the_model_names_both(tmp_path, kw, message):
    kw = {"router": "softmax, renormalize", **kw}
    with pytest.raises(SwapError) as err:
        swap(mixtral(), spec_file(tmp_path, kw.pop("router"), **kw))
    assert message in str(err.value) and "m.rdep) says" in str(err.value)


def test_a_model_without_moe_blocks_is_an_error(tmp_path):
    with pytest.raises(SwapError, match="Linear has no sparse MoE block"):
        swap(torch.nn.Linear(2, 2), spec_file(tmp_path, "softmax"))


# ----------------------------------------------------------------------------- whole models
def test_a_swapped_mixtral_gives_the_same_logits(tmp_path):
    model = mixtral()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    limit = logits_bound(model, tokens, 2 * moe_chain(32, 32, 2, 4))  # the two models differ in 2 MoE blocks
    names, want, got = logits_before_and_after(model, spec_file(tmp_path, "softmax, renormalize"), tokens)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert isinstance(model.model.layers[0].mlp, rdepc.hf.RDEPBlock)
    assert_close(got, want, limit, "logits")
    # transformers still records the router logits: its auxiliary loss works on the swapped model.
    out = model(torch.randint(0, 64, (2, 8)), output_router_logits=True)
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)


@pytest.mark.parametrize("build", [mixtral, deepseek_v3])
def test_a_swapped_models_parameters_keep_their_transformers_names_for_optimizer_groups(build):
    """rdepc.hf.named_parameters names every parameter of a swapped model as the model named
    it before the swap (experts, shared experts, router), each once, each the swapped model's
    own: optimizer groups built by name (here: decay all but the routers) group the same."""
    model = build()
    before = [n for n, _ in model.named_parameters()]
    swap(model, ranks=2, tokens=8, verify=False)
    named = rdepc.hf.named_parameters(model)
    assert sorted(n for n, _ in named) == sorted(before)
    assert {id(p) for _, p in named} == {id(p) for p in model.parameters()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in named)
    assert any(".moe." in n for n, _ in model.named_parameters())  # torch's own names are rdepc's
    routers = [p for n, p in named if n.endswith(".mlp.gate.weight")]
    assert [id(p) for p in routers] == [id(layer.mlp.gate.weight) for layer in model.model.layers]


def test_a_swapped_bf16_mixtral_stays_within_bf16_tolerance_and_trains(tmp_path):
    model = mixtral(torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    # the two models differ in 2 MoE blocks, which round their intermediates in bf16
    limit = logits_bound(model, tokens, 2 * NARROWINGS, torch.bfloat16)
    _, want, got = logits_before_and_after(model, spec_file(tmp_path, "softmax, renormalize", dtype="bf16"), tokens)
    assert_close(got, want, limit, "logits")
    model.train()
    out = model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8)))
    out.loss.backward()
    block = model.model.layers[0].mlp
    assert block.moe.w_gate_up.grad.abs().sum() > 0 and block.gate.weight.grad.abs().sum() > 0


def test_a_swapped_mixtral_generates_the_same_tokens_at_batch_1(tmp_path):
    model = mixtral(layers=1)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    want = model.generate(tokens[:1, :8], **kw)
    swap(model, spec_file(tmp_path, "softmax, renormalize"))  # ranks 2: a prefill of 8 tokens, then 1 at a time
    assert torch.equal(model.generate(tokens[:1, :8], **kw), want)


def test_the_deepseek_v3_bias_is_the_gates_buffer_through_dtype_moves_and_updates(tmp_path):
    model = deepseek_v3()
    original = copy.deepcopy(model)
    swap(model, spec_file(tmp_path, DEEPSEEK_V3, E=8, F=16, extra=DEEPSEEK_V3_SHARED))
    block, ref = model.model.layers[0].mlp, original.model.layers[0].mlp
    assert block.moe.router is None and block.moe.router_bias is None  # routes by the gate's, at each call
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(3))
    before = None
    for dtype, favoured in ((torch.float64, [0, 1]), (torch.float32, [6, 7])):
        model.to(dtype)  # the reference stays fp32: transformers' grouped experts take no fp64
        for m in (model, original):
            m.model.layers[0].mlp.gate.e_score_correction_bias[favoured] += 2.0  # every token picks these now
        with torch.no_grad():
            got, want = block(x.to(dtype)), ref(x)
        assert got.dtype == dtype and block.gate.e_score_correction_bias.dtype == dtype
        twin = float64_twin(ref)

        def transformers_block(x, state, twin=twin):
            with torch.no_grad():
                return torch.func.functional_call(twin, state, (x,))

        assert_close(got, want, bound(transformers_block, (x, state_of(ref)), moe_chain(32, 16, 2, 8, 16)), str(dtype))
        assert before is None or relative(got, before) > 1e-2  # the update moved the routing
        before = got
    assert torch.equal(
        model.state_dict()["model.layers.0.mlp.gate.e_score_correction_bias"], ref.gate.e_score_correction_bias
    )


@pytest.mark.parametrize("name", ["minimax_m2", "lfm2_moe", "afmoe", "hy_v3", "dots3_note_vision"])
def test_a_selection_bias_the_block_holds_routes_and_is_its_state(name):
    """MiniMax-M2, LFM2-MoE, AFMoE, HY-V3 and dots3-note's vision block hold their selection
    bias in the block and pass it to the router: the swapped block holds that tensor under its
    name (the state dict is the block's), routes by it as it is at each call (an update in place
    moves the routing as it moves transformers'), and unswap gives it back as it is."""
    case = fam.CASES[name]
    holder = fam.block(transformers, case)
    bias_name = rdepc.hf_families.FAMILIES[case.block].block_bias
    keys = holder.mlp.state_dict().keys()
    original = copy.deepcopy(holder.mlp)
    swap(holder, ranks=2, tokens=8)
    block = holder.mlp
    assert block.state_dict().keys() == keys and getattr(block, bias_name) is not None
    x = torch.randn(2, 4, fam.H, generator=torch.Generator().manual_seed(3))
    twin = float64_twin(original)
    before = None
    for favoured in ([0, 1], [2, 3]):
        with torch.no_grad():
            for b in (block, original):
                getattr(b, bias_name)[favoured] += 2.0  # every token picks these now
            got, want = block(x), original(x)

        def transformers_block(x, state):
            with torch.no_grad():
                return torch.func.functional_call(twin, state, (x,))

        sigma = spread(transformers_block, (x, state_of(original)))[0]
        chain = moe_chain(fam.H, case.F, case.K, case.E, 32 if case.shared else 0)
        assert_close(got, want, reorder_bound(sigma, chain, want), "y")
        assert before is None or relative(got, before) > 1e-2  # the update moved the routing
        before = got
    back = unswap(holder).mlp
    assert torch.equal(getattr(back, bias_name), getattr(original, bias_name))


@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss", "llama4", "dbrx", "privacy_filter", "minimax_m3_vl"])
def test_a_block_round_trips_through_its_state_dict(tmp_path, name):
    """Qwen2-MoE's shared_expert_gate is the RDEPMoE's shared_gate_proj under the block's name;
    GPT-OSS's interleaved experts and their biases are its w_gate_up, b_gate_up, w_down, b_down;
    Llama-4's [E, H, 2F] gate_up_proj (gate columns, then up) its w_gate_up, its down_proj w_down
    (and the privacy filter's, with its biases in halves too); MiniMax-M3-VL's shared gate_up_proj
    its shared_gate and shared_up;
    DBRX's [E·F, H] w1, v1 and w2 the gate and up halves of its w_gate_up, and its w_down."""
    case = fam.CASES[name]
    holder = fam.block(transformers, case)
    want = {k: v.clone() for k, v in holder.mlp.state_dict().items()}
    swap(holder, case_spec(tmp_path, case))
    state = holder.mlp.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    other = fam.block(transformers, case, seed=1)
    assert not other.mlp.load_state_dict(state, strict=True).missing_keys
    swap(other, case_spec(tmp_path, case))
    moe = other.mlp.moe
    if name == "qwen2_moe":
        assert torch.equal(moe.shared_gate_proj, want["shared_expert_gate.weight"])
    elif name == "minimax_m3_vl":  # the shared MLP's gate_up_proj [2·F_s, H]: shared_gate's rows, then shared_up's
        fused = want["shared_experts.gate_up_proj.weight"]
        assert torch.equal(moe.shared_gate[0].T, fused[:16]) and torch.equal(moe.shared_up[0].T, fused[16:])
    elif name == "dbrx":
        for key, held in (("w1", moe.w_gate), ("v1", moe.w_up)):  # [E, H, F] -> [E·F, H]
            assert torch.equal(held.transpose(1, 2).flatten(0, 1), want[f"experts.mlp.{key}"])
        assert torch.equal(moe.w_down.flatten(0, 1), want["experts.mlp.w2"])
    elif name in ("llama4", "privacy_filter"):  # [E, H, 2F]: the gate half, then up
        assert torch.equal(moe.w_gate_up[..., 0], want["experts.gate_up_proj"][..., : case.F])
        assert torch.equal(moe.w_gate_up[..., 1], want["experts.gate_up_proj"][..., case.F :])
        assert torch.equal(moe.w_down, want["experts.down_proj"])
        if name == "privacy_filter":
            assert torch.equal(moe.b_gate, want["experts.gate_up_proj_bias"][:, : case.F])
            assert torch.equal(moe.b_down, want["experts.down_proj_bias"])
    else:
        assert torch.equal(moe.w_gate_up.flatten(2, 3), want["experts.gate_up_proj"])
        assert torch.equal(moe.b_gate, want["experts.gate_up_proj_bias"][:, 0::2])
        assert torch.equal(moe.b_down, want["experts.down_proj_bias"])
    back = unswap(other.mlp)
    assert type(back).__name__ == case.block
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)


def test_a_swapped_model_round_trips_through_transformers_checkpoints(tmp_path):
    model = deepseek_v3()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits
    hf_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "hf")
    spec = spec_file(tmp_path, DEEPSEEK_V3, E=8, F=16, extra=DEEPSEEK_V3_SHARED)
    swap(model, spec)
    # The swapped model's state dict is the transformers model's: its names, layouts and values.
    state = model.state_dict()
    assert state.keys() == hf_state.keys() and all(torch.equal(state[k], hf_state[k]) for k in state)
    model.save_pretrained(tmp_path / "rdep")
    saved, written = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "rdep" / "model.safetensors"),
    )
    assert saved.keys() == written.keys() and all(torch.equal(saved[k], written[k]) for k in saved)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "rdep").eval()
    # The transformers checkpoint into swapped models: by load_state_dict, and by from_pretrained.
    fresh = transformers.DeepseekV3ForCausalLM(model.config).eval()
    swap(fresh, spec)
    assert not fresh.load_state_dict(hf_state, strict=True).missing_keys
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    swap(loaded, spec)
    limit = logits_bound(back, tokens, 2 * moe_chain(32, 16, 2, 8, 16))  # the models differ in 2 MoE blocks
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, want)
        assert_close(fresh(tokens).logits, want, limit, "fresh")
        assert_close(loaded(tokens).logits, want, limit, "loaded")
        assert unswap(fresh) is fresh and type(fresh.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
        assert torch.equal(fresh(tokens).logits, want)  # the transformers blocks again, with the weights
    assert {k: v.shape for k, v in fresh.state_dict().items()} == {k: v.shape for k, v in hf_state.items()}


def test_rdepmoe_takes_any_number_of_tokens_and_fp32_into_a_bf16_layer(tmp_path):
    moe = rdepc.RDEPMoE(
        spec_file(tmp_path, "softmax, renormalize", dtype="bf16"), generator=torch.Generator().manual_seed(0)
    )
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    y = moe(x)  # fp32 in, cast at the boundary, fp32 out
    assert y.dtype == torch.float32 and y.shape == (2, 8, 32)
    assert torch.equal(moe(x.reshape(16, 32)), y.reshape(16, 32))  # [N, H]: the W ranks' tokens in order
    assert torch.equal(moe(x.reshape(16, 32)[:15]), y.reshape(16, 32)[:15])  # padded to the W ranks


def test_triton_imported_natively_first_says_what_to_set():
    code = (
        "import triton.language, rdepc\n"
        "try:\n"
        "    rdepc.RDEPMoE('examples/tiny.rdep', device='cpu')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert "Start the process with TRITON_INTERPRET=1 in its environment" in out.stdout, out.stderr


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_hf_swap_example_runs(dtype):
    out = subprocess.run(
        [sys.executable, "examples/hf_swap.py", "--dtype", dtype],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, out.stderr
    assert "swapped 2 blocks: model.layers.0.mlp, model.layers.1.mlp" in out.stdout
    err = float(out.stdout.split("difference: ")[1].split()[0])
    assert err <= (1e-5 if dtype == "fp32" else 2e-2)


def test_the_hf_swap_example_without_transformers_says_what_to_install():
    code = "import runpy, sys\nsys.modules['transformers'] = None\nrunpy.run_path(sys.argv[1], run_name='__main__')\n"
    out = subprocess.run(
        [sys.executable, "-c", code, "examples/hf_swap.py"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "examples/hf_swap.py needs transformers, which is not installed: pip install 'transformers>=5.0'"
    ]


def test_from_hf_without_transformers_says_what_to_install(tmp_path):
    code = "import sys\nsys.modules['transformers'] = None\nfrom rdepc.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    out = subprocess.run(
        [sys.executable, "-c", code, "from-hf", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "rdepc: error: rdepc from-hf needs transformers, which is not installed: pip install 'transformers>=5.0'"
    )


def test_ernies_gate_floor_is_the_specs_norm_min_where_the_bias_makes_it_bind(tmp_path):
    """An Ernie-4.5 block whose selection bias picks experts whose scores sum below its
    moe_norm_min (transformers divides the chosen gates by clamp(sum, min=norm_min)): swapped
    with 'norm_min' it computes what transformers does; a spec without it is refused."""
    case = fam.Case(
        "ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 0,
         "moe_norm_min": 0.1},
        router="softmax, bias, renormalize, norm_min 0.1", E=8,
    )  # fmt: skip
    holder = fam.block(transformers, case)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in holder.mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        holder.mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 8, generator=g))
    original = copy.deepcopy(holder.mlp)
    x = torch.randn(2, 8, fam.H, generator=g)
    scores = torch.softmax(torch.nn.functional.linear(x.reshape(-1, fam.H), original.gate.weight), dim=-1)
    chosen = (scores + original.gate.moe_statics.e_score_correction_bias).topk(2, dim=-1).indices
    assert (scores.gather(-1, chosen).sum(-1) < 0.1).any()  # the floor binds for some token
    with pytest.raises(SwapError, match=r"has router norm_min 0\.1, but layer 'm' \(.*\) says None"):
        swap(copy.deepcopy(holder), case_spec(tmp_path, dataclasses.replace(case, router="softmax, bias, renormalize")))
    assert swap(holder, case_spec(tmp_path, case)) == ["mlp"]
    with torch.no_grad():
        want, got = original(x), holder.mlp(x)
    twin = float64_twin(original)
    sigma = spread(lambda x, state: torch.func.functional_call(twin, state, (x,)), (x, state_of(original)))[0]
    assert_close(got, want, reorder_bound(sigma, moe_chain(fam.H, case.F, case.K, case.E), want), "y")


def test_from_hf_writes_the_spec_of_a_checkpoint_directory_offline(tmp_path, main):
    """rdepc from-hf reads only a model's config (saved here, no weights), builds the model on
    the meta device and writes its MoE blocks' spec: dense first layers counted out of the
    model statement, the config's dtype kept, the result a spec rdepc check accepts."""
    cfg = transformers.DeepseekV3Config(
        **(SMALL | {"num_hidden_layers": 4, "num_key_value_heads": 4}), intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, dtype="bfloat16",
    )  # fmt: skip
    cfg.save_pretrained(tmp_path / "dsv3")
    out = tmp_path / "dsv3.rdep"
    status, said, err = main("from-hf", str(tmp_path / "dsv3" / "config.json"), "--ranks", "2", "-o", str(out))
    assert status == 0, err
    assert said == f"wrote {out}\n"
    text = out.read_text()
    assert "router   sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5" in text
    assert "model    moe_layers 3, layers 4, vocab 64" in text and "dtype    bf16" in text
    layer = rdepc.load(out)
    assert layer.shapes["W"] == 2 and layer.shapes["T"] == 4096 and layer.shapes["E"] == 8
    status, said, _ = main("check", str(out))
    assert status == 0 and "layer deepseek_v3: ok" in said
    for bad, message in (
        (tmp_path / "nowhere", "nowhere: no such file or directory (a model directory or its config.json)"),
        (tmp_path, f"{tmp_path} has no config.json"),
        (out, "dsv3.rdep: give a model directory or its config.json"),
    ):
        status, _, err = main("from-hf", str(bad))
        assert status == 2 and message in err, err


class MyMixtral(transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock):
    """A user's own block: Mixtral's, under another class name."""


def my_mixtral_holder():
    holder = fam.block(transformers, fam.CASES["mixtral"])
    holder.mlp.__class__ = MyMixtral
    return holder


@pytest.fixture
def families():
    """rdepc.hf_families.FAMILIES, as it was again after the test."""
    from rdepc.hf_families import FAMILIES

    before = dict(FAMILIES)
    yield FAMILIES
    FAMILIES.clear()
    FAMILIES.update(before)


def test_a_registered_block_is_swapped_and_a_mapping_that_computes_otherwise_is_refused_by_the_probe(families):
    """register() maps a user's block class; swap checks it as any other and runs the probe:
    a mapping whose router rule is not the block's (softmax without renormalize for Mixtral's
    renormalised top-2) passes the structural checks, and the probe refuses it with the figure;
    verify=False skips the probe (and so swaps it, wrongly: which is why it is on by default)."""
    from rdepc.hf_families import router_terms

    mixtral_family = families["MixtralSparseMoeBlock"]
    part = dataclasses.replace(mixtral_family.block, classes=("MyMixtral",))
    wrong = dataclasses.replace(mixtral_family, block=part, router=lambda gate: router_terms("softmax", False))
    rdepc.hf.register(MyMixtral, wrong)
    with pytest.raises(SwapError) as err:
        swap(my_mixtral_holder(), ranks=2, tokens=8)
    assert str(err.value).startswith("mlp (MyMixtral): on a probe of 8 tokens the swapped block's output differs")
    assert "beyond the 0.0001 float32 allows" in str(err.value)
    assert swap(my_mixtral_holder(), ranks=2, tokens=8, verify=False) == ["mlp"]
    with pytest.raises(SwapError, match="MyMixtral is mapped already"):
        rdepc.hf.register(MyMixtral, wrong)
    rdepc.hf.register("MyMixtral", dataclasses.replace(mixtral_family, block=part), replace=True)
    holder = my_mixtral_holder()
    original = copy.deepcopy(holder.mlp)
    assert swap(holder, ranks=2, tokens=8) == ["mlp"]
    x = torch.randn(2, 4, fam.H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(holder.mlp(x), original(x), 1e-5 * original(x).abs().max(), "y")
    with pytest.raises(SwapError, match=r"register\(Other\): the family's block Part must list Other"):
        rdepc.hf.register("Other", mixtral_family)


def _small_model(config: str, **kw):
    torch.manual_seed(0)
    return getattr(transformers, config.replace("Config", "ForCausalLM"))(getattr(transformers, config)(**SMALL, **kw))


def test_refusals_name_the_moe_block_list_the_mapped_families_and_a_near_twin(families):
    """A block swap does not map is refused naming it (JetMoE's JetMoeMoE, not the attention
    whose mixture of heads is called experts), with the mapped families listed and the mapped
    class nearest by name (PhiMoE: OLMoE); a class aliased in the table without its Part
    says which class it maps, not a garbled path."""
    jet = _small_model("JetMoeConfig", num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)
    with pytest.raises(SwapError) as err:
        swap(jet, ranks=2, tokens=8)
    said = str(err.value)
    assert said.startswith("model.layers.0.mlp (JetMoeMoE) has experts, but JetMoeMoE is not a block class"), said
    assert "Mapped: Mixtral (MixtralSparseMoeBlock), Qwen3-MoE (Qwen3MoeSparseMoeBlock)" in said
    phi = _small_model("PhimoeConfig", num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)
    with pytest.raises(SwapError, match=r"nearest mapped class is OlmoeSparseMoeBlock \(OLMoE\): compare the two"):
        rdepc.hf.spec_for(phi)
    families["PhimoeSparseMoeBlock"] = families["MixtralSparseMoeBlock"]
    with pytest.raises(SwapError) as err:
        swap(phi, ranks=2, tokens=8)
    assert "has the block of class PhimoeSparseMoeBlock, where rdepc.hf maps MixtralSparseMoeBlock" in str(err.value)


def test_every_routed_moe_block_transformers_ships_is_mapped_or_refused_with_its_reason():
    """The installed transformers' modeling files, read as text (nothing imported): every class
    that holds ``self.experts`` or is named as a mixture of experts (not an attention) is a row
    of rdepc.hf_families' FAMILIES or of UNMAPPED, which says why swap refuses it; a family
    transformers adds shows up here, never as a block swapped or refused in silence."""
    import re
    from pathlib import Path

    from rdepc.hf_families import FAMILIES, UNMAPPED

    found = {}
    for path in sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
        src = path.read_text(encoding="utf-8")
        for name, body in re.findall(r"^class (\w+)\([^)]*\):\n((?:(?:    .*)?\n)*)", src, re.M):
            moe = re.search(r"self\.experts\s*=", body) or re.search(r"(MoE|Moe|MoeBlock|MoEBlock)$", name)
            if moe and not re.search("Attention|Config|PreTrained", name):
                found[name] = path.parent.name
    assert len(found) >= 80 and not set(FAMILIES) & set(UNMAPPED)
    unknown = {name: model for name, model in found.items() if name not in FAMILIES and name not in UNMAPPED}
    assert not unknown, f"routed-MoE blocks neither mapped nor refused with a reason: {unknown}"
    newer = {c.block for c in fam.CASES.values() if not fam.installed(transformers, c)}  # mapped, not shipped here
    assert {name for name in found if name in FAMILIES} == set(FAMILIES) - newer and len(FAMILIES) == 56
