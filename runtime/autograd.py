"""The module's autograd: what a forward keeps for its backward (the routing context) and
dL/dg through the capacity weights policy. The backward itself is ``rdepc::forward``'s
registered autograd (``rdepc.runtime.ops``).

A call that needs gradients (grad mode on and an input that requires grad) keeps what the
generated backward walks — the routing tables (offsets, split tables, the accepted set, g'),
each owner's input rows and pre-activations, each accepted slot's expert output — and the
backward launches the same kernel with its ``BACKWARD`` constexpr: g'·dL/dy to the
forward's places, the expert backward and the weight gradients at the owners (summed over
each expert's rows in a fixed order: no float atomics), dL/dx rows home and summed per token
in slot order, dL/dg' = dL/dy·out, then dL/dg through the capacity weights policy on the
host (torch ops, no sync; :func:`gate_grad`). Dropped slots get no gradient; a token with
every slot dropped gets zero. Per-rank backends: every rank calls backward (it is
collective, like the forward), and gets its own tokens' and its own experts' gradients.
Under ``dedup`` the backward moves one dL/dy row per (token, owner) out and one summed dL/dx
row back, as the forward does; each slot's expert output stays at its owner, which computes
dL/dg' there and sends it home as one fp32 per slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingContext:
    """What the forward's accepted set looked like, for a backward that walks it (appendix
    A.3, condition 4): per (rank, token, slot) whether it was accepted, its row's slot in
    its owner's payload (-1 when dropped), and its combine weight g'."""

    topk_ids: torch.Tensor
    accepted: torch.Tensor
    slot: torch.Tensor
    gprime: torch.Tensor


def gate_grad(
    gates: torch.Tensor, accepted: torch.Tensor, dgprime: torch.Tensor, weights: str, routed: torch.Tensor
) -> torch.Tensor:
    """dL/dg from dL/dg' through the capacity weights policy (the combine's g'):
    ``zero`` (and dropless) g' = g on accepted slots; ``renormalize`` g'_i = A_i g_i G / S_A
    with G = sum_j g_j, S_A = sum_j A_j g_j (0 when S_A = 0), whose derivative is
    dL/dg_m = A_m dL/dg'_m G / S_A + (1 - A_m G / S_A) sum_i dL/dg'_i A_i g_i / S_A.
    The gate of a slot that routes nowhere (``routed`` false: expert id -1) is no part of
    G: it counts as 0 and gets no gradient."""
    g = gates.to(torch.promote_types(gates.dtype, torch.float32))
    g = torch.where(routed, g, 0.0)
    dgprime = dgprime.to(g.dtype)
    if weights != "renormalize":
        return torch.where(accepted, dgprime, 0.0)
    kept = torch.where(accepted, g, 0.0)
    total = g.sum(dim=-1, keepdim=True)
    survived = kept.sum(dim=-1, keepdim=True)
    ok = survived != 0
    denom = torch.where(ok, survived, 1.0)
    scale = total / denom
    through = (dgprime * kept).sum(dim=-1, keepdim=True) / denom
    dg = torch.where(accepted, dgprime * scale, 0.0) + through - torch.where(accepted, scale, 0.0) * through
    return torch.where(ok & routed, dg, 0.0)


__all__ = ["RoutingContext", "gate_grad"]
