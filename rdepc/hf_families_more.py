"""More rows of :data:`rdepc.hf_families.FAMILIES` (:data:`MORE`, which that table takes in),
written in :mod:`rdepc.hf_parts`' terms:

============== =========================== =========================================== ==================
family         block class                 spec ``router``                             shared experts
============== =========================== =========================================== ==================
MiniMax-M2     MiniMaxM2SparseMoeBlock     sigmoid, bias, renormalize (the bias: the   none
                                           block's ``e_score_correction_bias``)
LFM2-MoE       Lfm2MoeSparseMoeBlock       sigmoid (bias: the block's ``expert_bias``, none
                                           with ``use_expert_bias``), scale S; only
                                           without ``norm_topk_prob`` (below)
AFMoE          AfmoeSparseMoeBlock         sigmoid, bias, renormalize, scale           ``shared_experts``
                                           ``route_scale`` (the bias: the block's
                                           ``expert_bias``; router at ``router``)
DBRX           DbrxFFN                     softmax, renormalize (its                   none
                                           ``moe_normalize_expert_weights`` 1; none:
                                           softmax; router at ``router``)
Aria (text)    AriaTextMoELayer            softmax, renormalize (the softmax of the    ``shared_experts``
                                           top-K logits; router at ``router``)
Mistral-4      Mistral4MoE                 softmax, groups G, top_groups M,            ``shared_experts``
                                           (renormalize: ``norm_topk_prob``), scale S
MistralLarge4  MistralLarge4TextMoE        softmax, groups G, top_groups M,            ``shared_experts``
(text)                                     renormalize, scale S
Flint          FlintSparseMoeBlock         sigmoid (renormalize: ``norm_topk_prob``)   ``shared_expert``,
                                                                                       ungated
HY-V3          HYV3MoE                     sigmoid, bias, renormalize, scale S (the    ``shared_experts``
                                           bias: the block's
                                           ``e_score_correction_bias``)
dots3-note     Dots3NoteVisionMoE          as HY-V3                                    none
(vision)
Beam           BeamMoE                     as DeepSeek-V3 (S: the block's              none
                                           ``routed_scaling_factor``)
Laguna         LagunaSparseMoeBlock        sigmoid, bias, renormalize, scale S (S: the ``shared_experts``
                                           block's ``routed_scaling_factor``); only
                                           without ``router_logit_softcapping``
Step-3.7       Step3p7SparseMoeBlock       as Laguna; only where its experts and       ``shared_experts``
                                           shared MLP are unclamped (``limit`` None)
MiniMax-M3-VL  MiniMaxM3VLSparseMoeBlock   sigmoid, bias, renormalize, scale S (S: the ``shared_experts``,
               (its text model's)          block's ``routed_scaling_factor``)          ungated
privacy filter OpenAIPrivacyFilterMLP      as GPT-OSS, scale N/K (N: the block's       none
                                           ``num_experts``, K: its router's ``top_k``)
============== =========================== =========================================== ==================

Mistral-4's groups are DeepSeek-V3's (a group scores the sum of its two best), over the
softmax scores, without a selection bias (G, M, S: the router's ``num_group``, ``topk_group``,
``routed_scaling_factor``); HY-V3's and dots3-note's vision block's S is their router's
``router_scaling_factor``. Beam, Laguna and Step-3.7 scale the experts' sum by the block's
own ``routed_scaling_factor`` (the spec's ``scale``: the same product, gate by gate), so their
router rule reads the block, and top-K its router. Laguna's router keeps its selection bias as
a parameter without gradient (``gate.e_score_correction_bias``); Step-3.7's experts and shared
MLP clamp their SwiGLU on the layers its ``swiglu_limits`` and ``swiglu_limits_shared`` name
(SiLU(g) capped at L, u clamped to ±L), an expert function the spec language lacks: those
blocks are refused (``experts.limit``, ``shared_experts.limit``: L, where an unclamped layer's
is None, or inf in transformers 5.24).

MiniMax-M3-VL's experts and shared MLP compute GPT-OSS's clamped SwiGLU without biases (the
spec's ``clamped_swiglu(ffn = F, limit = L, alpha = a)`` and ``shared clamped_swiglu(...)``,
L and a its ``swiglu_limit`` and ``swiglu_alpha``); its experts are fused, and its shared
MLP holds gate and up as one ``gate_up_proj`` (``Linear(H, 2·F_s)``, gate rows then up).

OpenAI's privacy filter is GPT-OSS's block computed in fp32 whatever the model's dtype (the
spec computes in the model's: a bf16 model's block is probed within bf16's tolerance): its
router divides GPT-OSS's gates by top-K and the block multiplies the experts' sum by
``num_experts`` (the same K, from the config), so the spec's scale is their ratio; its experts
hold ``gate_up_proj`` [E, H, 2F] and its bias [E, 2F] with the gate half first, then the up
half (GPT-OSS's interleave them), and compute GPT-OSS's clamped SwiGLU.

MiniMax-M2, LFM2-MoE, AFMoE, HY-V3 and dots3-note's vision block keep their selection bias
in the block, not in its router, and pass it to the router as its second argument; the
swapped block holds that tensor under the same name (a buffer, or AFMoE's parameter), so it
is in the state dict, follows ``model.to(...)`` and is the one the training loop updates.
AFMoE's router takes the tokens as the block got them ([B, S, H]) and holds its weight in
``router.gate`` (a ``Linear`` without bias).

DBRX's router (``router``, a ``DbrxRouter`` holding a ``Linear`` at ``layer``) returns its
logits alone, its top-K and its ``moe_normalize_expert_weights`` p are the block's, and its
experts are held as ``experts.mlp.w1`` (gate), ``v1`` (up) and ``w2`` (down, [F, H] an
expert), each [E·F, H], expert e's rows e·F onward.

Aria's experts are held in Llama-4's layout (``gate_up_proj`` [E, H, 2F], gate columns then
up, ``down_proj`` [E, F, H]); its shared MLP, of ``moe_num_shared_experts`` times the experts'
width, is the spec's ``shared N x swiglu(ffn = F)``.

Refused by their router rule, for want of a term in the spec language: Laguna with a
``router_logit_softcapping`` c, whose logits are c·tanh(z/c) before the sigmoid; DBRX with a
p other than 1 (or none), which divides the top-K gates by their p-norm (``renormalize`` is
the 1-norm), and LFM2-MoE with ``norm_topk_prob``, which divides them by their sum plus 1e-6
(``renormalize`` divides by the sum; ``norm_min m`` by max(sum, m)).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from rdepc.hf_parts import (
    _ACT,
    _GPT_OSS_EXPERTS,
    _GPT_OSS_ROUTER,
    _LINEAR,
    ANY,
    CLAMPED_FUSED,
    Part,
    _experts,
    _family,
    _gate,
    _mlp,
    _softmax_renormalized,
    _unclamped,
    router_terms,
)  # fmt: skip


def _minimax_m2(gate) -> dict:
    return router_terms("sigmoid", True, True)


def _lfm2(gate) -> dict | str:
    if gate.norm_topk_prob:
        return (
            "norm_topk_prob True: it divides the top-K gates by their sum + 1e-6, and the spec language has no "
            "term for that epsilon (renormalize divides by the sum, norm_min m by max(sum, m))"
        )
    return router_terms("sigmoid", False, bool(gate.use_expert_bias), scale=gate.routed_scaling_factor)


def _afmoe(gate) -> dict:  # its 1e-20 in the sum, as DeepSeek-V3's, changes no fp32 gate
    return router_terms("sigmoid", True, True, scale=gate.route_scale)


def _dbrx(block) -> dict | str:  # the block's p: the top-K softmax scores divided by their p-norm
    p = block.moe_normalize_expert_weights
    if p is None:
        return router_terms("softmax", False)
    if p == 1:  # the scores are positive: their 1-norm is their sum
        return router_terms("softmax", True)
    return (
        f"moe_normalize_expert_weights {p}: it divides the top-K gates by their {p:g}-norm, and the spec "
        "language has no term for it (renormalize divides by their sum, the 1-norm)"
    )


def _mistral4(gate) -> dict:  # DeepSeek-V3's groups, over the softmax scores, without a selection bias
    groups = (gate.num_group, gate.topk_group)
    return router_terms("softmax", bool(gate.norm_topk_prob), groups=groups, scale=gate.routed_scaling_factor)


def _mistral_large4(gate) -> dict:  # Mistral-4's, always renormalised
    return router_terms("softmax", True, groups=(gate.num_group, gate.topk_group), scale=gate.routed_scaling_factor)


def _sigmoid_norm_topk(gate) -> dict:  # Flint: no selection bias
    return router_terms("sigmoid", bool(gate.norm_topk_prob))


def _sigmoid_bias_scaled(gate) -> dict:  # its 1e-20 in the sum, as DeepSeek-V3's, changes no fp32 gate
    return router_terms("sigmoid", True, True, scale=gate.router_scaling_factor)


def _beam(block) -> dict:  # DeepSeek-V3's router; its scale the block's, on the experts' sum
    g = block.gate
    groups = (g.num_group, g.topk_group)
    return router_terms("sigmoid", bool(g.norm_topk_prob), True, groups, block.routed_scaling_factor)


def _laguna(block) -> dict | str:  # the scale is the block's, on the experts' sum
    cap = block.gate.router_logit_softcapping
    if cap > 0:
        return (
            f"a router whose logits are soft-capped (gate.router_logit_softcapping {cap:g}: c·tanh(z/c) before the "
            "sigmoid), and the spec language has no term for it"
        )
    return router_terms("sigmoid", True, True, scale=block.routed_scaling_factor)


def _step3p7(block) -> dict:  # the scale is the block's, on the experts' sum
    return router_terms("sigmoid", True, True, scale=block.routed_scaling_factor)


def _minimax_m3(block) -> dict:  # MiniMax-M2's router; its scale the block's, on the experts' sum
    return router_terms("sigmoid", True, True, scale=block.routed_scaling_factor)


def _privacy_filter(block) -> dict:  # GPT-OSS's gates over top_k, the experts' sum times the block's num_experts
    return router_terms("softmax", True, logit_bias=True, scale=Fraction(block.num_experts, block.router.top_k))


_DBRX_ROUTER = Part(("DbrxRouter",), {"layer": _LINEAR}, attrs={"hidden_size": ANY, "moe_jitter_eps": None})
_DBRX_EXPERTS = Part(
    ("DbrxExperts",),
    {
        "mlp": Part(
            ("DbrxExpertGLU",),
            {"activation_fn": _ACT},
            params=dict.fromkeys(("w1", "v1", "w2"), ANY),
            attrs=dict.fromkeys(("hidden_size", "ffn_hidden_size", "moe_num_experts"), ANY),
        )
    },
    attrs=dict.fromkeys(("hidden_size", "ffn_hidden_size", "num_experts"), ANY),
)

# Aria's experts: Llama-4's layout (gate_up_proj [E, H, 2F], gate columns then up; down_proj [E, F, H]).
_ARIA_EXPERTS = replace(_experts("AriaExperts"), attrs=_experts("AriaExperts").attrs | {"is_transposed": True})

_GROUPED = ("hidden_dim", "routed_scaling_factor", "num_group", "topk_group")

_LAGUNA_ROUTER = Part(
    ("LagunaTopKRouter",),
    params={"weight": ANY, "e_score_correction_bias": ANY},  # the selection bias: a parameter without gradient
    attrs=dict.fromkeys(("top_k", "num_experts", "hidden_dim", "router_logit_softcapping"), ANY),
)

# Step-3.7's experts and shared MLP clamp SwiGLU on the layers swiglu_limits and swiglu_limits_shared name: see
# _unclamped.
_STEP3P7_EXPERTS = _unclamped(_experts("Step3p7Experts"))
_STEP3P7_SHARED = _unclamped(_mlp("Step3p7MLP"))

# OpenAI's privacy filter: GPT-OSS's router and experts (in fp32 whatever the input's dtype), gate and up in halves.
_PRIVACY_FILTER_ROUTER = replace(_GPT_OSS_ROUTER, classes=("OpenAIPrivacyFilterTopKRouter",))
_PRIVACY_FILTER_EXPERTS = Part(
    ("OpenAIPrivacyFilterExperts",),
    params=_GPT_OSS_EXPERTS.params,
    attrs=dict.fromkeys(("intermediate_size", "num_experts", "hidden_size", "alpha", "limit", "config"), ANY)
    | {"has_gate": True, "has_bias": True, "has_post_expert_norm": False, "is_transposed": True}
    | {"is_concatenated": True},  # the layout transformers' expert kernels read: the gate half, then up
)

# MiniMax-M3-VL's experts and shared MLP: SwiGLU clamped as GPT-OSS's (its limit and alpha at swiglu_limit and
# swiglu_alpha; the experts' limit is a copy their forward does not read), the experts fused, the shared MLP's gate
# and up one Linear(H, 2·F_s), gate rows then up.
_MINIMAX_M3_EXPERTS = Part(
    ("MiniMaxM3VLExperts",),
    params={"gate_up_proj": ANY, "down_proj": ANY},
    attrs=dict.fromkeys(("num_experts", "hidden_dim", "intermediate_dim", "limit", "swiglu_alpha", "swiglu_limit"), ANY)
    | {"config": ANY, "has_gate": True, "has_bias": False, "has_post_expert_norm": False, "is_transposed": False}
    | {"is_concatenated": True},
)
_MINIMAX_M3_SHARED = Part(
    ("MiniMaxM3VLDenseMLP",),
    {"gate_up_proj": _LINEAR, "down_proj": _LINEAR},
    attrs=dict.fromkeys(("swiglu_alpha", "swiglu_limit"), ANY),
)

_AFMOE_ROUTER = Part(
    ("AfmoeTokenChoiceRouter",),
    {"gate": _LINEAR},
    attrs=dict.fromkeys(("config", "top_k", "num_experts", "route_scale"), ANY),
)

MORE = (
    _family(
        "MiniMax-M2", "MiniMaxM2SparseMoeBlock",
        gate=_gate("MiniMaxM2TopKRouter", "hidden_dim"),
        experts="MiniMaxM2Experts",
        router=_minimax_m2,
        attrs={"top_k": ANY, "jitter_noise": 0},
        buffers={"e_score_correction_bias": ANY},
        block_bias="e_score_correction_bias",
    ),
    _family(
        "LFM2-MoE", "Lfm2MoeSparseMoeBlock",
        gate=_gate("Lfm2MoeTopKRouter", "hidden_dim", "norm_topk_prob", "routed_scaling_factor", "use_expert_bias"),
        experts="Lfm2MoeExperts",
        router=_lfm2,
        attrs={"use_expert_bias": ANY},
        buffers={"expert_bias": ANY},  # none without use_expert_bias
        block_bias="expert_bias",
    ),
    _family(
        "AFMoE", "AfmoeSparseMoeBlock",
        gate=_AFMOE_ROUTER,
        experts="AfmoeExperts",
        router=_afmoe,
        shared=("shared_experts", "AfmoeMLP"),
        attrs={"config": ANY},
        params={"expert_bias": ANY},  # a parameter without gradient
        gate_name="router",
        block_bias="expert_bias",
        router_flat=False,
    ),
    _family(
        "DBRX", "DbrxFFN",
        gate=_DBRX_ROUTER,
        experts=_DBRX_EXPERTS,
        router=_dbrx,
        attrs={"moe_normalize_expert_weights": ANY, "top_k": ANY},
        gate_name="router",
        layout="dbrx",
        logits=None,
        rule_reads="block",
    ),
    _family(
        "Aria (text)", "AriaTextMoELayer",  # the softmax of the top-K logits: the top-K softmax scores renormalised
        gate=_gate("AriaTextTopKRouter"),
        experts=_ARIA_EXPERTS,
        router=_softmax_renormalized,
        shared=("shared_experts", "AriaSharedExpertsMLP"),
        gate_name="router",
        layout="llama4",
    ),
    _family(
        "Mistral-4", "Mistral4MoE",
        gate=_gate("Mistral4TopkRouter", *_GROUPED, "norm_topk_prob"),
        experts="Mistral4Experts",
        router=_mistral4,
        shared=("shared_experts", "Mistral4MLP"),
        attrs={"config": ANY},
    ),
    _family(
        "Mistral-Large-4 (text)", "MistralLarge4TextMoE",  # its router's weight held, and its logits computed, in fp32
        gate=_gate("MistralLarge4TextTopkRouter", *_GROUPED),
        experts="MistralLarge4TextExperts",
        router=_mistral_large4,
        shared=("shared_experts", "MistralLarge4TextMLP"),
        attrs={"config": ANY},
    ),
    _family(
        "Flint", "FlintSparseMoeBlock",
        gate=_gate("FlintTopKRouter", "hidden_dim", "norm_topk_prob"),
        experts="FlintExperts",
        router=_sigmoid_norm_topk,
        shared=("shared_expert", "FlintMLP"),  # ungated, added in full
    ),
    _family(
        "HY-V3", "HYV3MoE",
        gate=_gate("HYV3TopKRouter", "hidden_dim", "router_scaling_factor"),
        experts="HYV3Experts",
        router=_sigmoid_bias_scaled,
        shared=("shared_experts", "HYV3MLP"),
        attrs={"top_k": ANY, "enable_moe_fp32_combine": ANY},  # the sum with the shared MLP's output in fp32
        buffers={"e_score_correction_bias": ANY},
        block_bias="e_score_correction_bias",
    ),
    _family(
        "dots3-note (vision)", "Dots3NoteVisionMoE",
        gate=_gate("Dots3NoteVisionTopKRouter", "hidden_dim", "router_scaling_factor"),
        experts="Dots3NoteExperts",
        router=_sigmoid_bias_scaled,
        buffers={"e_score_correction_bias": ANY},
        block_bias="e_score_correction_bias",
    ),
    _family(
        "Beam", "BeamMoE",
        gate=_gate("BeamTopKRouter", "hidden_dim", "num_group", "topk_group", "norm_topk_prob",
                   buffers={"e_score_correction_bias": ANY}),
        experts="BeamExperts",  # SwiGLU in fp32, cast back: in an fp32 block, the spec's
        router=_beam,
        attrs={"routed_scaling_factor": ANY},
        bias="e_score_correction_bias",
        rule_reads="block",
    ),
    _family(
        "Laguna", "LagunaSparseMoeBlock",
        gate=_LAGUNA_ROUTER,
        experts="LagunaExperts",
        router=_laguna,
        shared=("shared_experts", "LagunaMLP"),
        attrs={"routed_scaling_factor": ANY},
        bias="e_score_correction_bias",
        rule_reads="block",
    ),
    _family(
        "Step-3.7", "Step3p7SparseMoeBlock",
        gate=_gate("Step3p7TopKRouter", "hidden_dim", buffers={"e_score_correction_bias": ANY}),
        experts=_STEP3P7_EXPERTS,
        router=_step3p7,
        shared=("shared_experts", _STEP3P7_SHARED),
        attrs={"routed_scaling_factor": ANY},
        bias="e_score_correction_bias",
        rule_reads="block",
    ),
    _family(
        "MiniMax-M3-VL", "MiniMaxM3VLSparseMoeBlock",
        gate=_gate("MiniMaxM3VLTopKRouter", "hidden_dim", buffers={"e_score_correction_bias": ANY}),
        experts=_MINIMAX_M3_EXPERTS,
        router=_minimax_m3,
        shared=("shared_experts", _MINIMAX_M3_SHARED),  # ungated, added in full
        attrs={"routed_scaling_factor": ANY},
        bias="e_score_correction_bias",
        layout=CLAMPED_FUSED,
        rule_reads="block",
        shared_fused=True,
    ),
    _family(
        "OpenAI privacy filter", "OpenAIPrivacyFilterMLP",
        gate=_PRIVACY_FILTER_ROUTER,
        experts=_PRIVACY_FILTER_EXPERTS,
        router=_privacy_filter,
        attrs={"num_experts": ANY},  # top-K: the scale of its experts' sum
        gate_name="router",
        layout="gpt_oss_halves",
        returns_router=True,
        rule_reads="block",
    ),
)  # fmt: skip
