"""rdepc.hf.swap against transformers' own sparse MoE blocks, every family (small random
configs, CPU): equal outputs and gradients, the written specs, what is refused and why, blocks a
user registers; whole models: tests/test_hf_models.py."""

from __future__ import annotations

import copy
import dataclasses

import hf_families as fam
import pytest
import torch
from hf_models import SMALL, case_spec, float64_twin, mixtral, moe_chain, spec_file, state_of
from tolerance import assert_close, reorder_bound, spread

import rdepc
from rdepc.hf import RDEPBlock, SwapError, swap
from rdepc.reference import route

transformers = fam.import_transformers()
if transformers is None:
    pytest.skip("transformers is not installed", allow_module_level=True)


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
