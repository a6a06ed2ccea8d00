"""The vocabulary the tables of :mod:`rdepc.hf_families` and :mod:`rdepc.hf_families_more`
are written in: :class:`Part` (a submodule swap knows, and what its children, parameters,
buffers and attributes must be), :class:`Family` (one block class: its Parts, its router rule
in spec terms, where its gate, bias and shared experts are), the Parts most blocks share, and
the router rules (each a function of the gate, or the block, to the spec's router terms or to
the reason it cannot be expressed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction

from torch import nn

ANY = object()  # an attribute whose value swap does not read (or reads through the router rule)
SILU = ("SiLU", "SiLUActivation", "silu")  # the module classes, and torch's function (LFM2-MoE's experts)


@dataclass(frozen=True)
class Part:
    """A submodule swap knows: its class, and the children, parameters, buffers and plain
    attributes it may have, each name mapped to the value it must have (or ANY, or a OneOf of
    values; a child to its Part). ``classes`` None: any class, not looked into (an activation,
    compared with the spec)."""

    classes: tuple[str, ...] | None
    children: dict[str, Part] = field(default_factory=dict)
    params: dict[str, object] = field(default_factory=dict)
    buffers: dict[str, object] = field(default_factory=dict)
    attrs: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class OneOf:
    """An attribute's values a Part accepts, each computing the same (no clamp: None, or inf)."""

    values: tuple

    def __repr__(self) -> str:
        return " or ".join(map(repr, self.values))


_ACT = Part(None)
# Experts held as gate_up_proj [E, H, 2F] and down_proj [E, F, H], with biases, computing GPT-OSS's clamped
# SwiGLU: GPT-OSS's with gate and up interleaved, the privacy filter's with the gate half, then the up half.
BIASED_LAYOUTS = ("gpt_oss", "gpt_oss_halves")
# Fused experts (gate_up_proj [E, 2F, H], down_proj [E, H, F]) computing that clamped SwiGLU without biases,
# its limit and alpha at swiglu_limit and swiglu_alpha (MiniMax-M3-VL's).
CLAMPED_FUSED = "fused_clamped"
_LINEAR = Part(("Linear",), params={"weight": ANY, "bias": None}, attrs={"in_features": ANY, "out_features": ANY})
_EXPERT_LAYOUT = {"has_gate": True, "has_bias": False, "has_post_expert_norm": False, "is_transposed": False}


def _mlp(cls: str) -> Part:
    children = {"gate_proj": _LINEAR, "up_proj": _LINEAR, "down_proj": _LINEAR, "act_fn": _ACT}
    return Part((cls,), children, attrs={"config": ANY, "hidden_size": ANY, "intermediate_size": ANY})


def _experts(cls: str) -> Part:
    attrs = {"num_experts": ANY, "hidden_dim": ANY, "intermediate_dim": ANY, "config": ANY}
    attrs |= _EXPERT_LAYOUT | {"is_concatenated": True}  # the attributes transformers' expert kernels read
    return Part((cls,), {"act_fn": _ACT}, params={"gate_up_proj": ANY, "down_proj": ANY}, attrs=attrs)


# Step-3.7's and Bailing-Hybrid's experts and shared MLP clamp SwiGLU after the activation on the layers their config
# names (SiLU(g) capped at L, u clamped to ±L), a function the spec language lacks: mapped only on the layers without
# a limit (None; inf in transformers 5.24's Step-3.7, a clamp that changes nothing). limit_after_act (the clamp's
# order) is read only with a limit.
def _unclamped(part: Part) -> Part:
    return replace(part, attrs=part.attrs | {"limit": OneOf((None, math.inf)), "limit_after_act": ANY})


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


def _axk2(gate) -> dict | str:
    # Its left-out groups score 0.0, not DeepSeek-V3's -inf: beside sigmoid + bias scores, which a
    # negative selection bias brings below 0, a left-out expert may then be chosen.
    if gate.num_group is not None and gate.topk_group < gate.num_group:
        return (
            f"num_group {gate.num_group}, topk_group {gate.topk_group}: it scores its left-out groups' experts 0.0, "
            "above kept ones a negative selection bias brings below 0 (the spec's groups leave them out at -inf), "
            "and the spec language has no term for that"
        )
    return _deepseek_v3(gate)


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
    are the block's attributes, not the router's (DBRX). ``shared_fused``: the shared MLP holds
    its gate and up projections as one ``gate_up_proj`` (``Linear(H, 2·F_s)``, gate rows then
    up) and computes a clamped SwiGLU (MiniMax-M3-VL's)."""

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
    shared_fused: bool = False


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
    layout (the Family's ``experts``); ``shared`` (its name, its MLP's class or Part);
    ``params`` and ``buffers`` the block's own; ``more`` the Family's other fields."""
    children = {gate_name: gate, "experts": experts if isinstance(experts, Part) else _experts(experts)}
    if shared is not None:
        children[shared[0]] = shared[1] if isinstance(shared[1], Part) else _mlp(shared[1])
    if shared_gate is not None:
        children[shared_gate] = _LINEAR
    part = Part((block,), children, params or {}, buffers or {}, attrs or {})
    shared_name = None if shared is None else shared[0]
    return Family(name, part, router, bias, shared_name, shared_gate, gate=gate_name, experts=layout, **more)


def _softmax(gate) -> dict:  # the top-K softmax scores as they are (Jamba)
    return router_terms("softmax", False)
