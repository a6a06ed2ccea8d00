"""Elaboration of the ``router`` statement: how a token picks its K experts and their gates.

    router softmax, renormalize                                            # Mixtral, Qwen3 norm_topk_prob
    router sigmoid, bias, groups 8, top_groups 4, renormalize, scale 2.5   # DeepSeek-V3
    router softmax, groups 8, top_groups 3, group_score max, scale 16      # DeepSeek-V2
    router softmax, logit_bias, renormalize                                # GPT-OSS
    router softmax, renormalize, aux_loss 0.01, z_loss 0.001
    router softmax, bias, renormalize, norm_min 1e-12                      # Ernie-4.5 (moe_norm_min)

Without the statement a layer routes as ``router softmax, renormalize``. The semantics are
in docs/language.md; ``RDEPMoE.route`` and ``rdepc.reference.route`` implement them.
"""

from __future__ import annotations

from fractions import Fraction

from rdepc import syntax as S
from rdepc.ir.spec import Router, Shape

SCORES = ("softmax", "sigmoid")
FLAGS = (*SCORES, "renormalize", "bias", "logit_bias")
KEYED = ("groups", "top_groups", "group_score", "scale", "norm_min", "aux_loss", "z_loss")
GROUP_SCORES = ("top2", "max")  # the first is the default


def elaborate_router(layer, st: S.Stmt | None, shape: Shape) -> Router | None:
    """The statement's Router, or None after reporting its errors on ``layer.diags``.

    ``layer`` is the elaborator's per-layer context (``args``, ``expr``, ``size``, ``diags``).
    """
    if st is None:
        return Router()
    d = layer.diags
    opts, _ = layer.args(st, keyed=KEYED, flags=FLAGS)
    scores = [s for s in SCORES if s in opts]
    if len(scores) != 1:
        msg = "'router' needs its score function: softmax or sigmoid"
        if scores:
            msg = "'router' gives both softmax and sigmoid; choose one"
        d.error(msg, st.keyword_span, "e.g. 'router softmax, renormalize'")
        return None
    E, K = int(shape.E.value), int(shape.K.value)
    numbers = _router_numbers(layer, opts)
    if numbers is None:
        return None
    if "norm_min" in opts and "renormalize" not in opts:
        d.error(
            "router norm_min needs renormalize: it floors the sum the K gates are divided by",
            opts["norm_min"].span,
            "e.g. 'router softmax, bias, renormalize, norm_min 1e-12'",
        )
        return None
    grouping = _router_groups(layer, opts, E, K)
    if grouping is None:
        return None
    groups, top_groups, group_score = grouping
    return Router(
        score=scores[0],
        renormalize="renormalize" in opts,
        norm_min=numbers.get("norm_min"),
        bias="bias" in opts,
        groups=groups,
        top_groups=top_groups,
        group_score=group_score,
        logit_bias="logit_bias" in opts,
        scale=numbers.get("scale", Fraction(1)),
        aux_loss=numbers.get("aux_loss"),
        z_loss=numbers.get("z_loss"),
    )


def _router_numbers(layer, opts: dict) -> dict[str, Fraction] | None:
    """The router's numeric options given (scale, norm_min, aux_loss, z_loss), or None after
    reporting one that is not a number in its range."""
    d = layer.diags
    numbers: dict[str, Fraction] = {}
    for name, lowest in (("scale", None), ("norm_min", None), ("aux_loss", 0), ("z_loss", 0)):
        if name not in opts:
            continue
        v, span = layer.expr(opts[name], f"router {name}")
        if v is None:
            return None
        if not v.is_const:
            d.error(f"router {name} must be a number, got {v}", span)
            return None
        if (lowest is None and v.value <= 0) or (lowest is not None and v.value < lowest):
            d.error(f"router {name} must be {'positive' if lowest is None else 'zero or more'}, got {v}", span)
            return None
        numbers[name] = Fraction(v.value)
    return numbers


def _router_groups(layer, opts: dict, E: int, K: int) -> tuple[int, int, str] | None:
    """groups, top_groups and group_score (1, 1 and the first score without groups), or None
    after reporting why they cannot be."""
    d = layer.diags
    groups = top_groups = 1
    group_score = GROUP_SCORES[0]
    if "group_score" in opts:
        group_score = layer.choice(opts["group_score"], GROUP_SCORES, "router group_score")
        if group_score is None:
            return None
        if "groups" not in opts:
            d.error(
                "router group_score needs groups and top_groups: it scores the groups a token picks from",
                opts["group_score"].span,
                "e.g. 'groups 8, top_groups 3, group_score max'",
            )
            return None
    if ("groups" in opts) != ("top_groups" in opts):
        given, missing = ("groups", "top_groups") if "groups" in opts else ("top_groups", "groups")
        d.error(f"router {given} needs {missing}", opts[given].span, "e.g. 'groups 8, top_groups 4'")
        return None
    if "groups" in opts:
        g = layer.size(opts["groups"], "router groups")
        tg = layer.size(opts["top_groups"], "router top_groups")
        if g is None or tg is None:
            return None
        groups, top_groups = int(g.value), int(tg.value)
        if E % groups:
            d.error(f"router groups {groups} does not divide the {E} experts", opts["groups"].value.span)
            return None
        if top_groups > groups:
            d.error(f"router top_groups {top_groups} is more than the {groups} groups", opts["top_groups"].value.span)
            return None
        if top_groups * (E // groups) < K:
            d.error(
                f"top {K} cannot be picked from {top_groups} group(s) of {E // groups} experts",
                opts["top_groups"].value.span,
                f"top_groups must be at least {-(-K // (E // groups))}",
            )
            return None
    return groups, top_groups, group_score
