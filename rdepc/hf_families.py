"""The table of transformers (5.x) sparse MoE blocks that :mod:`rdepc.hf` swaps, and of those
it refuses. Each mapped block becomes an ``RDEPBlock`` that keeps the block's router module
(``gate``) and routes from its logits as the spec's ``router`` says:

============== =========================== =========================================== ==================
family         block class                 spec ``router``                             shared experts
============== =========================== =========================================== ==================
Mixtral        MixtralSparseMoeBlock       softmax, renormalize                        none
Qwen3-MoE      Qwen3MoeSparseMoeBlock      softmax (renormalize: ``norm_topk_prob``)   none
OLMoE          OlmoeSparseMoeBlock         softmax (renormalize: ``norm_topk_prob``)   none
Qwen2-MoE      Qwen2MoeSparseMoeBlock      softmax (renormalize: ``norm_topk_prob``)   ``shared_expert``,
                                                                                       gate sigmoid
Qwen3-Next     Qwen3NextSparseMoeBlock     softmax (renormalize: ``norm_topk_prob``)   ``shared_expert``,
                                                                                       gate sigmoid
DeepSeek-V2    DeepseekV2Moe               ``greedy``: softmax, scale S;               ``shared_experts``
                                           ``group_limited_greedy``: softmax, groups
                                           G, top_groups M, group_score max, scale S
DeepSeek-V3    DeepseekV3MoE               sigmoid, bias, groups G, top_groups M,      ``shared_experts``
                                           (renormalize), scale S
GLM-4-MoE      Glm4MoeMoE                  as DeepSeek-V3                              ``shared_experts``
Ernie-4.5-MoE  Ernie4_5_MoeSparseMoeBlock  softmax, bias, renormalize (the bias:       ``shared_experts``
                                           ``gate.moe_statics``)                       or none
HunYuan-MoE-V1 HunYuanMoEV1Moe             softmax, renormalize (the weight:           ``shared_mlp``
               (``HunYuanMoEV1Gate``)      ``gate.wg.weight``)
GPT-OSS        GptOssMLP                   softmax, logit_bias, renormalize            none
Llama-4        Llama4TextMoe               sigmoid (and ``expert ..., gate input``)    ``shared_expert``
MiniMax        MiniMaxSparseMoeBlock       as Mixtral                                  none
Jamba          JambaSparseMoeBlock         softmax (router at ``router``)              none
GraniteMoE     GraniteMoeMoE               softmax, renormalize (the softmax of the    none
                                           top-K logits; router at ``router``)
GraniteShared  GraniteMoeSharedMoE         as GraniteMoE                               none (the layer's
                                                                                       ``shared_mlp``)
GraniteHybrid  GraniteMoeHybridMoE         as GraniteMoE                               as GraniteShared
FlexOlmo       FlexOlmoSparseMoeBlock      as OLMoE                                    none
Qwen3-VL-MoE   Qwen3VLMoeTextSparseMoeBlock softmax, renormalize                       none
Qwen3.5-MoE    Qwen3_5MoeSparseMoeBlock    softmax, renormalize                        as Qwen3-Next
GLM-4V-MoE     Glm4vMoeTextMoE             as DeepSeek-V3                              ``shared_experts``
dots.llm1      Dots1MoE                    as DeepSeek-V3                              ``shared_experts``
DeepSeek-OCR-2 DeepseekOcr2TextMoe         as DeepSeek-V2                              ``shared_experts``
============== =========================== =========================================== ==================

DeepSeek-V3's block under other names maps as it does: Kimi-Linear, EXAONE-MoE,
GLM-4-MoE-Lite, DeepSeek-V3.2, MiMo-V2-Flash (no shared experts), Solar-Open, GLM-MoE-DSA,
MiniCPM-5-MoE and Bailing-Hybrid (their routers' weights held, and logits computed, in fp32;
Bailing-Hybrid's block only where its experts and shared MLP are unclamped, as Step-3.7's),
A.X-K2 (without ``num_group``: no groups; with groups leaving some out it is refused, as it
scores their experts 0.0, not -inf, which a negative selection bias can put above the kept
ones) and dots3-note's text block (``Dots3NoteTextMoE``); DeepSeek-V2's:
Unlimited-OCR's text block; GraniteMoE's: GraniteMoE-SWA's. Qwen3-MoE's router (softmax,
renormalize: ``norm_topk_prob``) under other names: Qwen3-Omni-MoE's thinker block and Mellum's
(no shared experts), Qwen3-Omni-MoE's talker block and Qwen4-Exp's text block (Qwen2-MoE's
gated ``shared_expert``), Lara-Mini's (its ``shared_expert`` ungated, added in full).

More rows are :mod:`rdepc.hf_families_more`'s (MiniMax-M2, LFM2-MoE, AFMoE, DBRX, Aria), which
:data:`FAMILIES` takes in; both tables are written in :mod:`rdepc.hf_parts`' terms (Part,
Family, the shared Parts and the router rules).

The blocks transformers ships that swap refuses are :data:`UNMAPPED`'s rows, each with why.

S is the gate's ``routed_scaling_factor``, G and M its ``num_group`` and ``topk_group``
(``groups G, top_groups G`` limits nothing: it is the spec without groups), and the bias the
gate's ``e_score_correction_bias``, read at every call (it follows ``model.to(...)`` and the
training loop's in-place updates). The experts are fused (``gate_up_proj`` [E, 2F, H],
``down_proj`` [E, H, F], SiLU-gated: the spec's ``swiglu(ffn = F)``); the one shared MLP of
width F_s is the spec's ``shared N x swiglu(ffn = F_s / N)`` for any N dividing it, and Qwen's
``shared_expert_gate`` (``Linear(H, 1)``, scaling that MLP's output by its sigmoid) the
spec's ``gate sigmoid``.

GPT-OSS (``GptOssMLP``) keeps its router at ``router`` (a ``Linear`` with a bias: the spec's
``softmax, logit_bias, renormalize``, top-K of the logits then a softmax over them), its
experts in another layout (``gate_up_proj`` [E, H, 2F] with gate and up interleaved, as
rdepc's ``w_gate_up``, ``down_proj`` [E, F, H]) with biases (``gate_up_proj_bias`` [E, 2F],
``down_proj_bias`` [E, H]: the spec's ``bias``) and its clamped SwiGLU (``limit``, ``alpha``:
the spec's ``clamped_swiglu(ffn = F, limit = 7, alpha = 1.702)``), and returns the router's
top-K scores beside its output, as the block does.

Llama-4 (``Llama4TextMoe``) scales each expert's input, not its output, by a sigmoid of its
top-K logit: the spec's ``expert swiglu(ffn = F), gate input`` with ``router sigmoid``. Its
router (``router``, an ``nn.Linear`` without bias) returns (scores, logits), its experts hold
``gate_up_proj`` [E, H, 2F] (gate columns, then up) and ``down_proj`` [E, F, H], its one
shared MLP (``shared_expert``) is ungated, and the block returns its output with the tokens
flattened ([N, H]) and its router's logits beside it.

Refused by their router rule, because the spec language cannot express it: a DeepSeek-V2
``topk_method`` other than ``greedy`` and ``group_limited_greedy``. (Ernie-4.5's
``moe_norm_min``, the floor of the sum its gates are divided by, is the spec's ``norm_min``.)
"""

from __future__ import annotations

from rdepc.hf_families_more import MORE
from rdepc.hf_parts import (
    _GPT_OSS_EXPERTS,
    _GPT_OSS_ROUTER,
    _LINEAR,
    _LLAMA4_EXPERTS,
    _LLAMA4_ROUTER,
    _LLAMA4_SHARED,
    ANY,
    SILU,
    Family,
    Part,
    _axk2,
    _deepseek_v2,
    _deepseek_v3,
    _ernie,
    _experts,
    _family,
    _gate,
    _mlp,
    _sigmoid,
    _softmax,
    _softmax_logit_bias,
    _softmax_norm_topk,
    _softmax_renormalized,
    _unclamped,
    router_terms,
)  # fmt: skip

_GPT_OSS = Family(
    "GPT-OSS",
    Part(("GptOssMLP",), {"router": _GPT_OSS_ROUTER, "experts": _GPT_OSS_EXPERTS}),
    _softmax_logit_bias,
    gate="router",
    experts="gpt_oss",
    returns_router=True,
)

_LLAMA4 = Family(
    "Llama-4",
    Part(
        ("Llama4TextMoe",),
        {"router": _LLAMA4_ROUTER, "experts": _LLAMA4_EXPERTS, "shared_expert": _LLAMA4_SHARED},
        attrs=dict.fromkeys(("top_k", "hidden_dim", "num_experts"), ANY),
    ),
    _sigmoid,
    shared="shared_expert",
    gate="router",
    logits=1,
    experts="llama4",
    gate_on="input",
    returns_router=True,
    flat=True,
)


_V3_GATE = ("hidden_dim", "routed_scaling_factor", "num_group", "topk_group", "norm_topk_prob")
_CONFIG = {"config": ANY}

FAMILIES: dict[str, Family] = {
    f.block.classes[0]: f
    for f in (
        _family(
            "Mixtral", "MixtralSparseMoeBlock",
            gate=_gate("MixtralTopKRouter", "hidden_dim"),
            experts="MixtralExperts",
            router=_softmax_renormalized,
            attrs={"top_k": ANY, "jitter_noise": 0},  # jitter: noise on the input in training
        ),
        _family(
            "Qwen3-MoE", "Qwen3MoeSparseMoeBlock",
            gate=_gate("Qwen3MoeTopKRouter", "hidden_dim", "norm_topk_prob"),
            experts="Qwen3MoeExperts",
            router=_softmax_norm_topk,
        ),
        _family(
            "OLMoE", "OlmoeSparseMoeBlock",
            gate=_gate("OlmoeTopKRouter", "hidden_dim", "norm_topk_prob"),
            experts="OlmoeExperts",
            router=_softmax_norm_topk,
        ),
        _family(
            "Qwen2-MoE", "Qwen2MoeSparseMoeBlock",
            gate=_gate("Qwen2MoeTopKRouter", "hidden_dim", "norm_topk_prob"),
            experts="Qwen2MoeExperts",
            router=_softmax_norm_topk,
            shared=("shared_expert", "Qwen2MoeMLP"),
            shared_gate="shared_expert_gate",
        ),
        _family(
            "Qwen3-Next", "Qwen3NextSparseMoeBlock",
            gate=_gate("Qwen3NextTopKRouter", "hidden_dim", "norm_topk_prob"),
            experts="Qwen3NextExperts",
            router=_softmax_norm_topk,
            shared=("shared_expert", "Qwen3NextMLP"),
            shared_gate="shared_expert_gate",
        ),
        _family(
            "DeepSeek-V2", "DeepseekV2Moe",
            gate=_gate("DeepseekV2TopkRouter", "hidden_dim", "routed_scaling_factor", "topk_method", "num_group",
                       "topk_group"),
            experts="DeepseekV2Experts",
            router=_deepseek_v2,
            shared=("shared_experts", "DeepseekV2MLP"),
            attrs=_CONFIG,
        ),
        _family(
            "DeepSeek-V3", "DeepseekV3MoE",
            gate=_gate("DeepseekV3TopkRouter", *_V3_GATE, buffers={"e_score_correction_bias": ANY}),
            experts="DeepseekV3Experts",
            router=_deepseek_v3,
            shared=("shared_experts", "DeepseekV3MLP"),
            attrs=_CONFIG,
            bias="e_score_correction_bias",
        ),
        _family(
            "Ernie-4.5-MoE", "Ernie4_5_MoeSparseMoeBlock",
            gate=_gate("Ernie4_5_MoeTopKRouter", "norm_min", children={
                "moe_statics": Part(("Ernie4_5_MoeStatics",), params={"e_score_correction_bias": ANY}),
            }),
            experts="Ernie4_5_MoeExperts",
            router=_ernie,
            shared=("shared_experts", "Ernie4_5_MoeMLP"),  # None without moe_num_shared_experts
            attrs=dict.fromkeys(("hidden_dim", "num_experts", "top_k"), ANY),
            bias="moe_statics.e_score_correction_bias",  # [1, E]
        ),
        _family(
            "HunYuan-MoE-V1", "HunYuanMoEV1Moe",
            gate=Part(("HunYuanMoEV1Gate",), {"wg": _LINEAR},
                      attrs=dict.fromkeys(("config", "layer_idx", "num_experts", "top_k"), ANY)),
            experts="HunYuanMoEV1Experts",
            router=_softmax_renormalized,
            shared=("shared_mlp", "HunYuanMoEV1MLP"),
            attrs=_CONFIG,
        ),
        _GPT_OSS,
        _LLAMA4,
        # Blocks shaped as one above, under their own class names (each probed and tested as the others).
        _family(
            "MiniMax", "MiniMaxSparseMoeBlock",
            gate=_gate("MiniMaxTopKRouter", "hidden_dim"),
            experts="MiniMaxExperts",
            router=_softmax_renormalized,
            attrs={"top_k": ANY, "jitter_noise": 0},
        ),
        _family(
            "Jamba", "JambaSparseMoeBlock",
            gate=_gate("JambaTopKRouter", "hidden_dim"),
            experts="JambaExperts",
            router=_softmax,
            attrs=dict.fromkeys(("hidden_dim", "ffn_dim", "num_experts", "top_k"), ANY),
            gate_name="router",
        ),
        _family(
            "FlexOlmo", "FlexOlmoSparseMoeBlock",
            gate=_gate("FlexOlmoTopKRouter", "hidden_dim", "norm_topk_prob"),
            experts="FlexOlmoExperts",
            router=_softmax_norm_topk,
        ),
        _family(
            "Qwen3-VL-MoE (text)", "Qwen3VLMoeTextSparseMoeBlock",
            gate=_gate("Qwen3VLMoeTextTopKRouter", "hidden_dim"),
            experts="Qwen3VLMoeTextExperts",
            router=_softmax_renormalized,
        ),
        _family(
            "Qwen3.5-MoE", "Qwen3_5MoeSparseMoeBlock",
            gate=_gate("Qwen3_5MoeTopKRouter", "hidden_dim"),
            experts="Qwen3_5MoeExperts",
            router=_softmax_renormalized,
            shared=("shared_expert", "Qwen3_5MoeMLP"),
            shared_gate="shared_expert_gate",
        ),
    )
}  # fmt: skip

# GraniteMoE's block under other names: softmax over the top-K logits (the top-K softmax scores
# renormalised), router at ``router``. GraniteMoE-Shared's shared MLP (``shared_mlp``) is the
# decoder layer's, added beside the block's output: no part of the block, it stays transformers'.
for _name, _prefix in (
    ("GraniteMoE", "GraniteMoe"),
    ("GraniteMoE-Shared", "GraniteMoeShared"),
    ("GraniteMoE-Hybrid", "GraniteMoeHybrid"),
    ("GraniteMoE-SWA", "GraniteMoeSWA"),
):
    FAMILIES[f"{_prefix}MoE"] = _family(
        _name, f"{_prefix}MoE",
        gate=_gate(f"{_prefix}TopKRouter"),
        experts=f"{_prefix}Experts",
        router=_softmax_renormalized,
        attrs={"input_size": ANY},
        gate_name="router",
    )  # fmt: skip


# DeepSeek-V3's block under other names: the same router (sigmoid, selection bias, groups,
# renormalize, scale), experts and shared experts (MiMo-V2-Flash's: none), one row each.
def _v3_clone(
    name: str,
    prefix: str,
    block: str,
    shared: bool | Part = True,
    experts: str | Part | None = None,
    router=_deepseek_v3,
) -> Family:
    return _family(
        name, block,
        gate=_gate(f"{prefix}TopkRouter", *_V3_GATE, buffers={"e_score_correction_bias": ANY}),
        experts=experts or f"{prefix}Experts",
        router=router,
        shared=("shared_experts", shared if isinstance(shared, Part) else f"{prefix}MLP") if shared else None,
        attrs=_CONFIG,
        bias="e_score_correction_bias",
    )  # fmt: skip


for _name, _prefix, _block, _shared in (
    ("GLM-4-MoE", "Glm4Moe", "Glm4MoeMoE", True),
    ("GLM-4V-MoE (text)", "Glm4vMoeText", "Glm4vMoeTextMoE", True),
    ("dots.llm1", "Dots1", "Dots1MoE", True),
    ("Kimi-Linear", "KimiLinear", "KimiLinearMoE", True),
    ("EXAONE-MoE", "ExaoneMoe", "ExaoneMoeSparseMoEBlock", True),
    ("GLM-4-MoE-Lite", "Glm4MoeLite", "Glm4MoeLiteMoE", True),
    ("DeepSeek-V3.2", "DeepseekV32", "DeepseekV32MoE", True),
    ("MiMo-V2-Flash", "MiMoV2Flash", "MiMoV2FlashMoE", False),
    ("Solar-Open", "SolarOpen", "SolarOpenMoE", True),
    ("GLM-MoE-DSA", "GlmMoeDsa", "GlmMoeDsaMoE", True),
    ("MiniCPM-5-MoE", "MiniCPM5Moe", "MiniCPM5MoeMoE", True),  # its router's logits in fp32, autocast or not
):
    FAMILIES[_block] = _v3_clone(_name, _prefix, _block, _shared)
# Bailing-Hybrid: left-out groups masked to -inf, as the spec's; on the layers its swiglu_limits and
# swiglu_limits_shared name, its experts and shared MLP clamp SwiGLU (refused: see _unclamped).
FAMILIES["BailingHybridMoE"] = _v3_clone(
    "Bailing-Hybrid", "BailingHybrid", "BailingHybridMoE",
    shared=_unclamped(_mlp("BailingHybridMLP")), experts=_unclamped(_experts("BailingHybridExperts")),
)  # fmt: skip
# A.X-K2: without num_group (the light checkpoints) no groups; with groups leaving some out, refused
FAMILIES["AXK2MoE"] = _v3_clone("A.X-K2", "AXK2", "AXK2MoE", router=_axk2)
# dots3-note's text block: its experts' class is the model's, not the text model's.
FAMILIES["Dots3NoteTextMoE"] = _v3_clone("dots3-note (text)", "Dots3NoteText", "Dots3NoteTextMoE",
                                         experts="Dots3NoteExperts")  # fmt: skip

# DeepSeek-V2's block under other names: greedy or group-limited top-K.
for _name, _prefix, _block in (
    ("DeepSeek-OCR-2 (text)", "DeepseekOcr2Text", "DeepseekOcr2TextMoe"),
    ("Unlimited-OCR (text)", "UnlimitedOcrText", "UnlimitedOcrTextMoe"),
):
    FAMILIES[_block] = _family(
        _name, _block,
        gate=_gate(f"{_prefix}TopkRouter", "hidden_dim", "routed_scaling_factor", "topk_method", "num_group",
                   "topk_group"),
        experts=f"{_prefix}Experts",
        router=_deepseek_v2,
        shared=("shared_experts", f"{_prefix}MLP"),
        attrs=_CONFIG,
    )  # fmt: skip

# Qwen3-MoE's block under other names (norm_topk_prob: renormalize), with Qwen2-MoE's shared
# expert and its sigmoid gate where the block has them (``shared_gate``), or that expert ungated.
for _name, _prefix, _block, _shared in (
    ("Qwen3-Omni-MoE (thinker)", "Qwen3OmniMoeThinkerText", "Qwen3OmniMoeThinkerTextSparseMoeBlock", None),
    ("Qwen3-Omni-MoE (talker)", "Qwen3OmniMoeTalkerText", "Qwen3OmniMoeTalkerTextSparseMoeBlock", "gated"),
    ("Mellum", "Mellum", "MellumSparseMoeBlock", None),
    ("Qwen4-Exp (text)", "Qwen4ExpText", "Qwen4ExpTextSparseMoeBlock", "gated"),
    ("Lara-Mini", "LaraMini", "LaraMiniSparseMoeBlock", "ungated"),  # its router's logits in fp32
):
    FAMILIES[_block] = _family(
        _name, _block,
        gate=_gate(f"{_prefix}TopKRouter", "hidden_dim", "norm_topk_prob"),
        experts=f"{_prefix}Experts",
        router=_softmax_norm_topk,
        shared=None if _shared is None else ("shared_expert", f"{_prefix}MLP"),
        shared_gate="shared_expert_gate" if _shared == "gated" else None,
    )  # fmt: skip

# The routed-MoE blocks transformers ships that swap does not map, each with why: what the
# spec language cannot say. A block class in neither table fails tests/test_hf.py's scan of
# transformers, so none is missed.
_CLAMPED = (
    "experts computing SiLU(min(g, L))·clamp(u, ±L) (swiglu_limit L), a clamped SwiGLU without clamped_swiglu's +1 "
    "and alpha, which the spec language has no function for"
)
_SOFTCAPPED = (
    "experts computing a softcapped SwiGLU (tanh caps: mlp_gate_softcap on the gate's linear factor, mlp_up_softcap "
    "on up), which the spec language has no function for"
)
_LOGIT_SELECTION_BIAS = (
    "a selection bias added to the logits (the top-K of z + b, gates sigmoid(z)), where the spec's bias is added to "
    "the scores (sigmoid(z) + b)"
)
UNMAPPED: dict[str, str] = {
    "PhimoeSparseMoeBlock": "PhiMoE's SparseMixer gates, a router rule the spec language has no terms for",
    "JetMoeMoE": "one output bias for the whole layer, which the spec language has no term for",
    "Cohere2MoeSparseMoeBlock": "the average of its shared and routed parts, which the spec language has no term for",
    "Gemma4TextDecoderLayer": "experts held by the decoder layer itself, no MoE block of their own to swap",
    "DiffusionGemmaDecoderTextLayer": "experts held by the decoder layer itself, no MoE block of their own to swap",
    "DiffusionGemmaEncoderTextLayer": "experts held by the decoder layer itself, no MoE block of their own to swap",
    "NllbMoeSparseMLP": "an encoder-decoder translation model's MoE (NLLB), not a decoder layer's",
    "VitPoseBackboneMoeMLP": "a vision backbone's per-dataset experts, not a routed MoE",
    "VitPoseNaiveMoe": "a vision backbone's per-dataset experts, not a routed MoE",
    "AXK1MoE": "an RMSNorm on the block's output (post_mlp_layernorm, after the shared experts are added), which the "
    "spec language has no term for",
    "DeepseekV4SparseMoeBlock": "scores by scoring_func (sqrtsoftplus by default), hash-routed first layers (tid2eid: "
    "experts chosen by token id) and experts clamping SwiGLU at swiglu_limit without clamped_swiglu's +1: none has a "
    "term in the spec language",
    "DogeCDMoE": "product-key retrieval over num_keys² single-neuron experts held as embeddings (down_embed, "
    "up_embed), a router rule and expert function the spec language has no terms for",
    "ErgoMoE": "non-gated ReLU² experts and shared expert (the spec's relu is not squared), each one's output "
    "RMS-normalised with a learned scale of its own before it is weighed and summed (experts.post_expert_norm, "
    "shared_experts.norm), which the spec language has no terms for",
    "Ernie4_5_VLMoeMoeBlock": "modality-isolated experts: a text and a vision set, each token routed in one by "
    "moe_mm_token_type_ids, which the spec language has no term for",
    "Ernie4_5_VLMoeSparseMoeBlock": "the text or vision half of Ernie4_5_VLMoeMoeBlock (refused), returning its "
    "output and logits flattened to 1-D for the modality split",
    "Glm5NextTextMoE": "experts and shared MLP computing SiLU(min(g, L))·clamp(u, ±L) (swiglu_limit L), a clamped "
    "SwiGLU without clamped_swiglu's +1 and alpha, which the spec language has no function for",
    "HYV4MoE": _CLAMPED,
    "HYV4VLMoE": _CLAMPED,
    "Inkling2SparseMoeBlock": _SOFTCAPPED,
    "Inkling2LoopSparseMoeBlock": _SOFTCAPPED,
    "InklingMoE": "shared experts weighted by the router too: the top-K and the shared experts' sigmoid scores "
    "normalised together, times a learned global_scale, which the spec language has no terms for",
    "Kolibri1SparseMoeBlock": _LOGIT_SELECTION_BIAS,
    "Kolibri1_1SparseMoeBlock": _LOGIT_SELECTION_BIAS,
    "LongcatFlashMoE": "zero-computation experts (zero_expert_num: a route to one returns the token itself, times its "
    "gate), which the spec language has no expert function for",
    "MuseSparkMoE": "a projection to moe_hidden_size and a centred RMSNorm before the experts and one back after "
    "(pre_expert_proj, pre_expert_norm, post_expert_proj), which the spec language has no terms for",
    "NemotronHMoE": "non-gated ReLU² experts and shared MLP (mlp_hidden_act relu2; the spec's relu is not squared) and "
    "an optional latent projection around the experts (moe_latent_size), which the spec language has no terms for",
    "ZayaSparseMoeBlock": "an MLP router over the tokens and the previous layer's router state "
    "(prev_router_hidden_states), with a skip expert, which the spec language has no router rule for",
}

FAMILIES.update({f.block.classes[0]: f for f in MORE})  # rdepc.hf_families_more's rows

__all__ = ["ANY", "FAMILIES", "SILU", "UNMAPPED", "Family", "Part", "router_terms"]
