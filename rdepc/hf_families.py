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
Bailing-Hybrid (its router's weight held, and its logits computed, in fp32).

More rows are :mod:`rdepc.hf_families_more`'s (MiniMax-M2, LFM2-MoE, AFMoE, DBRX, Aria), which builds them
from this module's Parts and adds them to :data:`FAMILIES`.

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

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from torch import nn

ANY = object()  # an attribute whose value swap does not read (or reads through the router rule)
SILU = ("SiLU", "SiLUActivation", "silu")  # the module classes, and torch's function (LFM2-MoE's experts)


@dataclass(frozen=True)
class Part:
    """A submodule swap knows: its class, and the children, parameters, buffers and plain
    attributes it may have, each name mapped to the value it must have (or ANY; a child to its
    Part). ``classes`` None: any class, not looked into (an activation, compared with the spec)."""

    classes: tuple[str, ...] | None
    children: dict[str, Part] = field(default_factory=dict)
    params: dict[str, object] = field(default_factory=dict)
    buffers: dict[str, object] = field(default_factory=dict)
    attrs: dict[str, object] = field(default_factory=dict)


_ACT = Part(None)
_LINEAR = Part(("Linear",), params={"weight": ANY, "bias": None}, attrs={"in_features": ANY, "out_features": ANY})
_EXPERT_LAYOUT = {"has_gate": True, "has_bias": False, "has_post_expert_norm": False, "is_transposed": False}


def _mlp(cls: str) -> Part:
    children = {"gate_proj": _LINEAR, "up_proj": _LINEAR, "down_proj": _LINEAR, "act_fn": _ACT}
    return Part((cls,), children, attrs={"config": ANY, "hidden_size": ANY, "intermediate_size": ANY})


def _experts(cls: str) -> Part:
    attrs = {"num_experts": ANY, "hidden_dim": ANY, "intermediate_dim": ANY, "config": ANY}
    attrs |= _EXPERT_LAYOUT | {"is_concatenated": True}  # the attributes transformers' expert kernels read
    return Part((cls,), {"act_fn": _ACT}, params={"gate_up_proj": ANY, "down_proj": ANY}, attrs=attrs)


_GPT_OSS_ROUTER = Part(
    ("GptOssTopKRouter",),
    params={"weight": ANY, "bias": ANY},
    attrs=dict.fromkeys(("top_k", "num_experts", "hidden_dim"), ANY),
)
_GPT_OSS_EXPERTS = Part(
    ("GptOssExperts",),
    params=dict.fromkeys(("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), ANY),
    attrs=dict.fromkeys(("intermediate_size", "num_experts", "hidden_size", "alpha", "limit", "config"), ANY)
    | {"has_gate": True, "has_bias": True, "has_post_expert_norm": False, "is_transposed": True}
    | {"is_concatenated": False},  # the layout transformers' expert kernels read: gate and up interleaved
)


_LLAMA4_ROUTER = Part(
    ("Llama4Router",),
    params={"weight": ANY, "bias": None},
    attrs=dict.fromkeys(("in_features", "out_features", "num_experts", "top_k"), ANY),
)
_LLAMA4_EXPERTS = Part(
    ("Llama4TextExperts",),
    {"act_fn": _ACT},
    params={"gate_up_proj": ANY, "down_proj": ANY},
    attrs=dict.fromkeys(("num_experts", "intermediate_size", "hidden_size", "expert_dim"), ANY),
)
_LLAMA4_SHARED = Part(
    ("Llama4TextMLP",),
    {"gate_proj": _LINEAR, "up_proj": _LINEAR, "down_proj": _LINEAR, "activation_fn": _ACT},
    attrs={"config": ANY},
)


def _gate(cls: str, *attrs: str, **parts) -> Part:
    known = dict.fromkeys(("top_k", "num_experts", *attrs), ANY)
    return Part((cls,), params={"weight": ANY}, attrs=known, **parts)


# --------------------------------------------------------------------- the routers, in spec terms
def router_terms(
    score: str,
    renormalize: bool,
    bias: bool = False,
    groups=(1, 1),
    scale=1,
    group_score="top2",
    logit_bias=False,
    norm_min=None,
) -> dict:
    """A router rule as the spec's ``router`` options, normalised so that equal routing compares
    equal: ``groups G, top_groups G`` (or more) keeps every group, so it is no groups at all."""
    g, m = groups
    if (m or 1) >= (g or 1):
        g, m, group_score = 1, 1, "top2"  # no group is ever left out: how groups score does not matter
    return {
        "score": score,
        "logit_bias": logit_bias,
        "bias": bias,
        "groups": g,
        "top_groups": m,
        "group_score": group_score,
        "renormalize": renormalize,
        "norm_min": None if norm_min is None else Fraction(str(norm_min)),
        "scale": Fraction(str(scale)),
    }


def _softmax_renormalized(gate) -> dict:
    return router_terms("softmax", True)


def _softmax_logit_bias(gate) -> dict:  # GPT-OSS: softmax over the top-K logits (bias included)
    return router_terms("softmax", True, logit_bias=True)


def _sigmoid(gate) -> dict:  # Llama-4: the sigmoid of the top-K logits, as they are
    return router_terms("sigmoid", False)


def _softmax_norm_topk(gate) -> dict:
    return router_terms("softmax", bool(gate.norm_topk_prob))


def _deepseek_v2(gate) -> dict | str:
    method = gate.topk_method
    if method == "greedy":  # the top-K softmax scores, never renormalised
        return router_terms("softmax", False, scale=gate.routed_scaling_factor)
    if method == "group_limited_greedy":  # a group scores its best expert; the others are masked to 0
        groups = (gate.num_group, gate.topk_group)
        return router_terms("softmax", False, groups=groups, scale=gate.routed_scaling_factor, group_score="max")
    return f"topk_method {method!r}, which rdepc.hf does not map"


def _deepseek_v3(gate) -> dict:
    groups = (gate.num_group, gate.topk_group)
    return router_terms("sigmoid", bool(gate.norm_topk_prob), True, groups, gate.routed_scaling_factor)


def _ernie(gate) -> dict:
    # The gates are divided by max(their sum, norm_min); with the selection bias choosing, the
    # chosen scores may sum to anything, so the floor is part of the rule for every norm_min.
    return router_terms("softmax", True, True, norm_min=gate.norm_min or None)


@dataclass(frozen=True)
class Family:
    """How swap maps one transformers block class: everything the block may hold (its gate's
    and experts' classes among it), its gate's rule in the spec's router terms (or why there is
    none), where the gate keeps its selection bias, the block its shared MLP and the gate that
    scales that MLP's output (``shared_gate``: a ``Linear(H, 1)``, through a sigmoid); the
    gate's name in the block, which of its outputs are the logits (``logits``), the experts'
    layout (``fused``: ``gate_up_proj`` [E, 2F, H], gate rows then up rows, ``down_proj``
    [E, H, F], SiLU; ``gpt_oss`` and ``llama4``: see the module docstring), where the gate
    scales the experts (``gate_on``: the spec's ``expert ..., gate``), whether the block
    returns its router's second output beside its own (GPT-OSS: the top-K scores; Llama-4:
    the logits) and whether it returns its output with the tokens flattened, [N, H] (``flat``:
    Llama-4). ``block_bias``: the block's own tensor that is the selection bias (MiniMax-M2,
    LFM2-MoE, AFMoE), passed to the router as its second argument; ``router_flat`` False: the
    router takes the tokens as the block got them (AFMoE's: [B, S, H]); ``logits`` None: the
    router returns its logits alone (DBRX); ``rule_reads`` "block": the router rule, and top-K,
    are the block's attributes, not the router's (DBRX)."""

    name: str
    block: Part
    router: Callable[[nn.Module], dict | str]
    bias: str | None = None
    shared: str | None = None
    shared_gate: str | None = None
    gate: str = "gate"
    logits: int | None = 0
    experts: str = "fused"
    gate_on: str = "output"
    returns_router: bool = False
    flat: bool = False
    block_bias: str | None = None
    router_flat: bool = True
    rule_reads: str = "gate"


def _family(
    name,
    block,
    *,
    gate,
    experts,
    router,
    shared=None,
    shared_gate=None,
    attrs=None,
    bias=None,
    gate_name="gate",
    params=None,
    buffers=None,
    layout="fused",
    **more,
) -> Family:
    """A row: ``experts`` the experts' class (fused, SiLU-gated) or their Part, ``layout`` their
    layout (the Family's ``experts``); ``params`` and ``buffers`` the block's own; ``more`` the
    Family's other fields."""
    children = {gate_name: gate, "experts": experts if isinstance(experts, Part) else _experts(experts)}
    if shared is not None:
        children[shared[0]] = _mlp(shared[1])
    if shared_gate is not None:
        children[shared_gate] = _LINEAR
    part = Part((block,), children, params or {}, buffers or {}, attrs or {})
    shared_name = None if shared is None else shared[0]
    return Family(name, part, router, bias, shared_name, shared_gate, gate=gate_name, experts=layout, **more)


def _softmax(gate) -> dict:  # the top-K softmax scores as they are (Jamba)
    return router_terms("softmax", False)


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
    ("Bailing-Hybrid", "BailingHybrid", "BailingHybridMoE", True),  # left-out groups masked to -inf: the spec's
):
    FAMILIES[_block] = _family(
        _name, _block,
        gate=_gate(f"{_prefix}TopkRouter", *_V3_GATE, buffers={"e_score_correction_bias": ANY}),
        experts=f"{_prefix}Experts",
        router=_deepseek_v3,
        shared=("shared_experts", f"{_prefix}MLP") if _shared else None,
        attrs=_CONFIG,
        bias="e_score_correction_bias",
    )  # fmt: skip
FAMILIES["DeepseekOcr2TextMoe"] = _family(  # DeepSeek-V2's block: greedy or group-limited top-K
    "DeepSeek-OCR-2 (text)", "DeepseekOcr2TextMoe",
    gate=_gate("DeepseekOcr2TextTopkRouter", "hidden_dim", "routed_scaling_factor", "topk_method", "num_group",
               "topk_group"),
    experts="DeepseekOcr2TextExperts",
    router=_deepseek_v2,
    shared=("shared_experts", "DeepseekOcr2TextMLP"),
    attrs=_CONFIG,
)  # fmt: skip

# The routed-MoE blocks transformers ships that swap does not map, each with why: what the
# spec language cannot say, or that nobody has compared the block with the table yet (its
# router rule and layout unread: mapping one is a row above and a case in the tests). A block
# class in neither table fails tests/test_hf.py's scan of transformers, so none is missed.
NOT_COMPARED = "not yet compared with the table: its router rule and weight layout are unread"
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
} | dict.fromkeys(
    (
        "AXK1MoE", "AXK2MoE", "BeamMoE",
        "DeepseekV4SparseMoeBlock", "DogeCDMoE", "Dots3NoteTextMoE",
        "Dots3NoteVisionMoE", "Ernie4_5_VLMoeMoeBlock", "Ernie4_5_VLMoeSparseMoeBlock",
        "FlintSparseMoeBlock", "Glm5NextTextMoE",
        "GraniteMoeSWAMoE", "HYV3MoE", "HYV4MoE", "HYV4VLMoE", "Inkling2LoopSparseMoeBlock",
        "Inkling2SparseMoeBlock", "InklingMoE", "Kolibri1SparseMoeBlock", "LagunaSparseMoeBlock",
        "LaraMiniSparseMoeBlock", "LongcatFlashMoE", "MellumSparseMoeBlock",
        "MiniMaxM3VLSparseMoeBlock", "Mistral4MoE",
        "MistralLarge4TextMoE", "MuseSparkMoE", "NemotronHMoE", "OpenAIPrivacyFilterMLP",
        "Qwen3OmniMoeTalkerTextSparseMoeBlock", "Qwen3OmniMoeThinkerTextSparseMoeBlock", "Qwen4ExpTextSparseMoeBlock",
        "Step3p7SparseMoeBlock", "UnlimitedOcrTextMoe", "ZayaSparseMoeBlock",
    ),
    NOT_COMPARED,
)  # fmt: skip

# More rows, built from the Parts and helpers above (rdepc.hf_families_more): they join FAMILIES.
from rdepc import hf_families_more  # noqa: E402, F401

__all__ = ["ANY", "FAMILIES", "NOT_COMPARED", "SILU", "UNMAPPED", "Family", "Part", "router_terms"]
