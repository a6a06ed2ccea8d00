"""Tiny random transformers MoE blocks of every family transformers 5.x ships, for test_hf.py:
each with the spec that describes it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

H = 32  # hidden size of every block here


def import_transformers():
    """transformers with its models imported (it imports Triton too, in the mode conftest.py
    fixed). None when missing."""
    try:
        import transformers

        for model in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
            getattr(transformers, model)  # transformers imports lazily: import the models now
        return transformers
    except ImportError:
        return None


@dataclass(frozen=True)
class Case:
    """One family's block: ``module`` (transformers.models.<module>), its config class and
    keywords, its block class; the spec's router, E, K, F, shared line and expert function."""

    module: str
    config: str
    block: str
    kw: dict = field(default_factory=dict)
    router: str = "softmax, renormalize"
    E: int = 4
    K: int = 2
    F: int = 16
    shared: str = ""
    expert: str = "swiglu(ffn = {F})"


CASES = {
    "mixtral": Case(
        "mixtral", "MixtralConfig", "MixtralSparseMoeBlock",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": Case(
        "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False},
        router="softmax", E=8, K=3,
    ),
    "olmoe": Case(
        "olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock",
        {"intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True},
        E=8,
    ),
    "deepseek_v2_greedy": Case(
        "deepseek_v2", "DeepseekV2Config", "DeepseekV2Moe",
        {"moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2,
         "routed_scaling_factor": 1.5, "topk_method": "greedy"},
        router="softmax, scale 1.5", shared="shared 2 x swiglu(ffn = 16)",
    ),
    "deepseek_v3": Case(
        "deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE",
        {"moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
        router="sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5", E=8,
        shared="shared 1 x swiglu(ffn = 16)",
    ),
    "glm4_moe": Case(
        "glm4_moe", "Glm4MoeConfig", "Glm4MoeMoE",
        {"moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "norm_topk_prob": False},
        router="sigmoid, bias, scale 1", shared="shared swiglu(ffn = 16)",
    ),
    "ernie4_5_moe": Case(
        "ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1},
        router="softmax, bias, renormalize, norm_min 1e-12", shared="shared swiglu(ffn = 16)",
    ),
    "ernie4_5_moe_unshared": Case(
        "ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 0},
        router="softmax, bias, renormalize, norm_min 1e-12",
    ),
    "hunyuan_v1_moe": Case(
        "hunyuan_v1_moe", "HunYuanMoEV1Config", "HunYuanMoEV1Moe",
        {"intermediate_size": 16, "num_experts": 4, "moe_topk": 2}, shared="shared swiglu(ffn = 16)",
    ),
    "deepseek_v2_group_limited": Case(
        "deepseek_v2", "DeepseekV2Config", "DeepseekV2Moe",
        {"moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 1,
         "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},  # K > M: the groups limit
        router="softmax, groups 4, top_groups 2, group_score max", E=8, K=3, shared="shared swiglu(ffn = 16)",
    ),
    "qwen2_moe": Case(
        "qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "num_experts_per_tok": 2},
        router="softmax", shared="shared swiglu(ffn = 16), gate sigmoid",
    ),
    "qwen3_next": Case(
        "qwen3_next", "Qwen3NextConfig", "Qwen3NextSparseMoeBlock",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "num_experts_per_tok": 2},
        shared="shared 2 x swiglu(ffn = 8), gate sigmoid",  # one gate over the N experts' sum
    ),
    "gpt_oss": Case(
        "gpt_oss", "GptOssConfig", "GptOssMLP",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 1.0},
        router="softmax, logit_bias, renormalize",
        expert="clamped_swiglu(ffn = {F}, limit = 1), bias",  # a limit the random weights' rows pass
    ),
    "llama4": Case(
        "llama4", "Llama4TextConfig", "Llama4TextMoe",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        router="sigmoid", shared="shared swiglu(ffn = 16)",
        expert="swiglu(ffn = {F}), gate input",  # the sigmoid of the top-K logits scales the expert's input
    ),
    "minimax": Case(
        "minimax", "MiniMaxConfig", "MiniMaxSparseMoeBlock",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "jamba": Case(
        "jamba", "JambaConfig", "JambaSparseMoeBlock",
        {"intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}, router="softmax",
    ),
    "granitemoe": Case(
        "granitemoe", "GraniteMoeConfig", "GraniteMoeMoE",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "granitemoeshared": Case(
        "granitemoeshared", "GraniteMoeSharedConfig", "GraniteMoeSharedMoE",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 16},
    ),
    "granitemoehybrid": Case(
        "granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridMoE",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "mamba_n_heads": 8},
    ),
    "flex_olmo": Case(
        "flex_olmo", "FlexOlmoConfig", "FlexOlmoSparseMoeBlock",
        {"intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
        router="softmax", E=8,
    ),
    "qwen3_vl_moe": Case(
        "qwen3_vl_moe", "Qwen3VLMoeTextConfig", "Qwen3VLMoeTextSparseMoeBlock",
        {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_5_moe": Case(
        "qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "num_experts_per_tok": 2},
        shared="shared swiglu(ffn = 16), gate sigmoid",
    ),
    "dots1": Case(
        "dots1", "Dots1Config", "Dots1MoE",
        {"moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "norm_topk_prob": False},
        router="sigmoid, bias", shared="shared swiglu(ffn = 16)",
    ),
}  # fmt: skip

# DeepSeek-V3's block under other names (rdepc.hf_families), one config for all: each reads its own keys.
_V3_CLONE = {
    "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "intermediate_size": 64,
}  # fmt: skip
for _module, _config, _block, _shared in (
    ("glm4v_moe", "Glm4vMoeTextConfig", "Glm4vMoeTextMoE", True),
    ("kimi_linear", "KimiLinearConfig", "KimiLinearMoE", True),
    ("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeSparseMoEBlock", True),
    ("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteMoE", True),
    ("deepseek_v32", "DeepseekV32Config", "DeepseekV32MoE", True),
    ("mimo_v2_flash", "MiMoV2FlashConfig", "MiMoV2FlashMoE", False),
    ("solar_open", "SolarOpenConfig", "SolarOpenMoE", True),
    ("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaMoE", True),
    ("minicpm5_moe", "MiniCPM5MoeConfig", "MiniCPM5MoeMoE", True),
    ("bailing_hybrid", "BailingHybridConfig", "BailingHybridMoE", True),
):
    CASES[_module] = Case(
        _module,
        _config,
        _block,
        _V3_CLONE,
        router="sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5",
        E=8,
        shared="shared 1 x swiglu(ffn = 16)" if _shared else "",
    )
# A.X-K2 as its light checkpoints route, without groups (with them it is refused: test_hf)
CASES["axk2"] = Case(
    "axk2",
    "AXK2Config",
    "AXK2MoE",
    _V3_CLONE | {"n_group": None, "topk_group": None},
    router="sigmoid, bias, renormalize, scale 2.5",
    E=8,
    shared="shared 1 x swiglu(ffn = 16)",
)
CASES["dots3_note"] = Case(
    "dots3_note", "Dots3NoteTextConfig", "Dots3NoteTextMoE",
    _V3_CLONE | {"shared_experts_intermediate_size": 8, "n_shared_experts": 2},
    router="sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5", E=8,
    shared="shared 2 x swiglu(ffn = 8)",
)  # fmt: skip
for _module, _config, _block, _more in (
    ("deepseek_ocr2", "DeepseekOcr2TextConfig", "DeepseekOcr2TextMoe", {}),
    ("unlimited_ocr", "UnlimitedOcrTextConfig", "UnlimitedOcrTextMoe", {"num_attention_heads": 4}),
):
    CASES[_module] = Case(
        _module,
        _config,
        _block,
        _V3_CLONE | {"topk_method": "greedy"} | _more,
        router="softmax, scale 2.5",
        E=8,
        shared="shared 1 x swiglu(ffn = 16)",
    )

# Qwen3-MoE's and Qwen2-MoE's blocks under other names (rdepc.hf_families), and GraniteMoE's.
CASES |= {
    "qwen3_omni_moe_thinker": Case(
        "qwen3_omni_moe", "Qwen3OmniMoeTextConfig", "Qwen3OmniMoeThinkerTextSparseMoeBlock",
        {"moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False},
        router="softmax", E=8, K=3,
    ),
    "qwen3_omni_moe_talker": Case(
        "qwen3_omni_moe", "Qwen3OmniMoeTalkerTextConfig", "Qwen3OmniMoeTalkerTextSparseMoeBlock",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "norm_topk_prob": True},
        shared="shared swiglu(ffn = 16), gate sigmoid",
    ),
    "mellum": Case(
        "mellum", "MellumConfig", "MellumSparseMoeBlock",
        {"moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True},
        E=8,
    ),
    "qwen4_exp": Case(
        "qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpTextSparseMoeBlock",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "norm_topk_prob": False},
        router="softmax", shared="shared swiglu(ffn = 16), gate sigmoid",
    ),
    "lara_mini": Case(
        "lara_mini", "LaraMiniConfig", "LaraMiniSparseMoeBlock",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "norm_topk_prob": True},
        shared="shared swiglu(ffn = 16)",
    ),
    "granitemoe_swa": Case(
        "granitemoe_swa", "GraniteMoeSWAConfig", "GraniteMoeSWAMoE",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}  # fmt: skip

# rdepc.hf_families_more's rows: a selection bias held by the block, passed to its router.
CASES |= {
    "minimax_m2": Case(
        "minimax_m2", "MiniMaxM2Config", "MiniMaxM2SparseMoeBlock",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        router="sigmoid, bias, renormalize",
    ),
    "lfm2_moe": Case(
        "lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
         "routed_scaling_factor": 2.5},
        router="sigmoid, bias, scale 2.5",
    ),
    "lfm2_moe_unbiased": Case(
        "lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
         "use_expert_bias": False},
        router="sigmoid",
    ),
    "afmoe": Case(
        "afmoe", "AfmoeConfig", "AfmoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 2,
         "route_scale": 2.5},
        router="sigmoid, bias, renormalize, scale 2.5", shared="shared 2 x swiglu(ffn = 16)",
    ),
    "dbrx": Case(
        "dbrx", "DbrxConfig", "DbrxFFN",
        {"d_model": H, "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2}},
    ),
    "dbrx_unnormalized": Case(
        "dbrx", "DbrxConfig", "DbrxFFN",
        {"d_model": H, "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2,
                        "moe_normalize_expert_weights": None}},
        router="softmax",
    ),
    "aria": Case(
        "aria", "AriaTextConfig", "AriaTextMoELayer",
        {"intermediate_size": 16, "moe_num_experts": 4, "moe_topk": 2, "moe_num_shared_experts": 2},
        shared="shared 2 x swiglu(ffn = 16)",
    ),
    "mistral4": Case(
        "mistral4", "Mistral4Config", "Mistral4MoE",
        {"moe_intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True},
        router="softmax, groups 4, top_groups 2, renormalize, scale 2.5", E=8, shared="shared swiglu(ffn = 16)",
    ),
    "mistral_large4": Case(
        "mistral_large4", "MistralLarge4TextConfig", "MistralLarge4TextMoE",
        {"moe_intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 2,
         "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5},
        router="softmax, groups 4, top_groups 2, renormalize, scale 1.5", E=8, K=3,
        shared="shared 2 x swiglu(ffn = 16)",
    ),
    "flint": Case(
        "flint", "FlintConfig", "FlintSparseMoeBlock",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "norm_topk_prob": True},
        router="sigmoid, renormalize", shared="shared swiglu(ffn = 16)",
    ),
    "hy_v3": Case(
        "hy_v3", "HYV3Config", "HYV3MoE",
        {"moe_intermediate_size": 16, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
         "num_shared_experts": 1, "router_scaling_factor": 2.5},
        router="sigmoid, bias, renormalize, scale 2.5", shared="shared swiglu(ffn = 16)",
    ),
    "dots3_note_vision": Case(
        "dots3_note", "Dots3NoteVisionConfig", "Dots3NoteVisionMoE",
        {"moe_intermediate_size": 16, "pyramid_num_routed": [4], "num_experts_per_tok": 2,
         "router_scaling_factor": 2.5, "adapter_in_dim": H, "num_attention_heads": 4},
        router="sigmoid, bias, renormalize, scale 2.5",
    ),
    "beam": Case(
        "beam", "BeamConfig", "BeamMoE",
        {"moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
         "routed_scaling_factor": 2.5, "norm_topk_prob": True},
        router="sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5", E=8,
    ),
    "laguna": Case(
        "laguna", "LagunaConfig", "LagunaSparseMoeBlock",
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_routed_scaling_factor": 2.5},
        router="sigmoid, bias, renormalize, scale 2.5", shared="shared swiglu(ffn = 16)",
    ),
    "step3p7": Case(
        "step3p7", "Step3p7TextConfig", "Step3p7SparseMoeBlock",
        {"moe_intermediate_size": 16, "share_expert_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_router_scaling_factor": 2.5, "num_attention_heads": 4, "head_dim": 8},
        router="sigmoid, bias, renormalize, scale 2.5", shared="shared swiglu(ffn = 16)",
    ),
    "minimax_m3_vl": Case(  # its text model's block: clamped SwiGLU experts and shared MLP, gate and up fused
        "minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLSparseMoeBlock",
        {"intermediate_size": 16, "shared_intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
         "swiglu_limit": 1.0, "routed_scaling_factor": 2.5, "num_attention_heads": 4, "head_dim": 8},
        router="sigmoid, bias, renormalize, scale 2.5", expert="clamped_swiglu(ffn = {F}, limit = 1)",
        shared="shared clamped_swiglu(ffn = 16, limit = 1)",
    ),
    "privacy_filter": Case(  # GPT-OSS's block in fp32, its gates over K and its sum times K: the spec's scale 1
        "openai_privacy_filter", "OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterMLP",
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 1.0,
         "num_attention_heads": 4, "head_dim": 8},
        router="softmax, logit_bias, renormalize",
        expert="clamped_swiglu(ffn = {F}, limit = 1), bias",
    ),
}  # fmt: skip


def spec_text(case: Case, tokens: int = 8, dtype: str = "fp32") -> str:
    shared = f"  {case.shared}\n" if case.shared else ""
    return (
        "layer m {\n"
        f"  shape  ranks 2, tokens {tokens}, hidden {H}, experts {case.E}, top {case.K}\n"
        f"  expert {case.expert.format(F=case.F)}\n"
        f"  dtype  {dtype}\n"
        f"  router {case.router}\n"
        f"{shared}"
        "  schedule bulk\n"
        "}\n"
    )


def randomize(module: nn.Module, seed: int = 0) -> None:
    """Every parameter and floating buffer drawn N(0, 0.3²) (a selection bias N(0, 0.05²)):
    transformers leaves expert weights empty and zeroes routers, where every token would tie."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            std = 0.05 if "bias" in name else 0.3
            t.copy_(torch.randn(t.shape, generator=g) * std)


def installed(transformers, case: Case) -> bool:
    """Whether the installed transformers ships the case's model (a family mapped since may be newer)."""
    return (Path(transformers.__file__).parent / "models" / case.module).is_dir()


def block(transformers, case: Case, seed: int = 0) -> nn.Module:
    """The family's block, alone, with random weights, in a holder module at ``mlp``; a skip
    when the installed transformers has no such model."""
    if not installed(transformers, case):
        pytest.skip(f"transformers {transformers.__version__} has no {case.module}")
    modeling = importlib.import_module(f"transformers.models.{case.module}.modeling_{case.module}")
    config = getattr(modeling, case.config, None) or getattr(transformers, case.config)
    config = config(hidden_size=H, **case.kw)
    cls = getattr(modeling, case.block)
    made = cls(config, layer_idx=0) if "layer_idx" in cls.__init__.__code__.co_varnames else cls(config)
    randomize(made, seed)
    holder = nn.Module()
    holder.mlp = made
    return holder


def expert_grads(block: nn.Module) -> dict[str, torch.Tensor]:
    """A transformers block's gradients by its own names: the input's is separate."""
    return {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
