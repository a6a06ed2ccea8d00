"""The spec's router in torch: scores, group-limited top-K, gates, and the router's losses.

Vectorised over any leading dimensions; the semantics are docs/language.md's 'router'
(checked against ``rdepc.reference.route``, a per-token loop written independently).
Nothing here synchronises with the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F_

from rdepc.ir.spec import Router


class Routing(NamedTuple):
    ids: torch.Tensor  # [..., K] int64, in descending order of the choice score
    gates: torch.Tensor  # [..., K] fp32
    logits: torch.Tensor  # [..., E] fp32


def scores(logits: torch.Tensor, router: Router) -> torch.Tensor:
    return torch.softmax(logits, dim=-1) if router.score == "softmax" else torch.sigmoid(logits)


def route(
    x: torch.Tensor | None,
    weight: torch.Tensor,
    router: Router,
    K: int,
    bias: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    logit_bias: torch.Tensor | None = None,
) -> Routing:
    """Route ``x`` [..., H] with ``weight`` [E, H] and ``logit_bias`` [E] (the spec's
    ``logit_bias``), or from given ``logits`` [..., E] (which hold any bias already), in fp32."""
    if logits is None:
        logits = F_.linear(x.float(), weight.float(), None if logit_bias is None else logit_bias.float())
    logits = logits.float()
    s = scores(logits, router)
    choice = s if bias is None else s + bias.float()
    if router.groups > 1:
        size = choice.shape[-1] // router.groups
        grouped = choice.unflatten(-1, (router.groups, size))
        if router.group_score == "max":  # DeepSeek-V2: its best expert
            group_score = grouped.amax(dim=-1)
        else:  # DeepSeek-V3: its best two
            group_score = grouped.topk(min(2, size), dim=-1).values.sum(dim=-1)
        best = group_score.topk(router.top_groups, dim=-1).indices
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter(-1, best, True)
        choice = choice.masked_fill(~kept.repeat_interleave(size, dim=-1), float("-inf"))
    ids = choice.topk(K, dim=-1).indices
    gates = s.gather(-1, ids)
    if router.renormalize:
        total = gates.sum(dim=-1, keepdim=True)
        gates = gates / (total if router.norm_min is None else total.clamp(min=float(router.norm_min)))
    if router.scale != 1:
        gates = gates * float(router.scale)
    return Routing(ids, gates, logits)


def aux_loss(logits: torch.Tensor, ids: torch.Tensor, router: Router, real: torch.Tensor | None = None) -> torch.Tensor:
    """The load-balancing loss (Switch Transformer eq. 4–6, as transformers computes it):
    E · Σ_e (route rows at e / tokens) · mean_t p_{t,e}, with p the token's scores normalised
    over the E experts; unscaled. ``real`` (bool, the tokens' shape): only these count, as
    transformers counts with an attention mask; 0 when there are none."""
    E = logits.shape[-1]
    flat = logits.reshape(-1, E)
    p = scores(flat, router)
    if router.score == "sigmoid":
        p = p / p.sum(dim=-1, keepdim=True)
    w = torch.ones(flat.shape[0], device=logits.device) if real is None else real.reshape(-1).float()
    n = w.sum().clamp(min=1)
    K = ids.shape[-1]
    ones = w.repeat_interleave(K)
    counts = torch.zeros(E, device=logits.device).scatter_add_(0, ids.reshape(-1), ones)
    return E * torch.sum(counts / n * (p * w[:, None]).sum(dim=0) / n)


def z_loss(logits: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """The router z-loss (ST-MoE eq. 5): mean over tokens (``real`` ones only) of
    logsumexp(logits)²; unscaled."""
    z = torch.logsumexp(logits.float(), dim=-1).square()
    if real is None:
        return z.mean() if z.numel() else z.sum()  # no tokens: 0, not the NaN of an empty mean
    w = real.float()
    return (z * w).sum() / w.sum().clamp(min=1)


class RouterOutputs(NamedTuple):
    logits: torch.Tensor  # [..., E] fp32, for the user's own losses
    aux_loss: torch.Tensor | None  # the spec's coefficient × aux_loss; None unless declared
    z_loss: torch.Tensor | None  # the spec's coefficient × z_loss; None unless declared


def outputs(routing: Routing, router: Router, real: torch.Tensor | None = None) -> RouterOutputs:
    aux = None
    if router.aux_loss is not None:
        aux = float(router.aux_loss) * aux_loss(routing.logits, routing.ids, router, real)
    z = None if router.z_loss is None else float(router.z_loss) * z_loss(routing.logits, real)
    return RouterOutputs(routing.logits, aux, z)


__all__ = ["RouterOutputs", "Routing", "aux_loss", "outputs", "route", "scores", "z_loss"]
