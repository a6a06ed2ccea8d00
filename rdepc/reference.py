"""A plain PyTorch reference of the RDEP operator, for users and tests.

This is the *meaning* of one sparse MoE layer, written as simply as possible and sharing
no code with the compiler (``rdepc.passes``), its code generator (``rdepc.codegen``) or its
runtime (``rdepc.runtime``): compiled kernels are checked against it, so it must not be
able to inherit their mistakes. Nothing here is distributed; the W front-end ranks are
just the leading dimension of the tensors.

The operator (RDEP section 3.1, eq. 4): on rank r, token t with activation x_t and router
output (I_t, g_t) over K slots,

    y_t = Σ_k g'_{t,k} f_{I_{t,k}}(x_t)

where f_e is expert e and g' are the combine weights after the capacity policy (section
3.6). With the gate on the expert's input (``gate="input"``, Llama-4) it is
y_t = Σ_k f_{I_{t,k}}(g'_{t,k}·x_t), the scaled row rounded to x's dtype as a model that
computes in that dtype rounds it. Without capacity (dropless) g' = g and every route row is accepted. With a capacity
cap_e, the owner of expert e admits at most cap_e of the rows sent to e:

* ``drop="round_robin"``: rows are admitted by token index first; among the rows of token
  index t the ranks take turns starting at rank t mod W; then by slot. No rank drops first:
  under a skewed routing the drops spread over the ranks;
* ``drop="arrival"``: rows are admitted in ascending row_id order (the route-row identity,
  by default eq. 7: ``((r·T')+t)·K+k``, so rank 0's rows first and rank W−1's dropped first);
* ``drop="lowest_gate"``: the highest gates are admitted first, so the lowest are dropped;
  equal gates are admitted in ascending row_id order.

A slot whose expert id is -1 routes nowhere (padding): it is no route row, takes no capacity,
and its gate counts as 0 everywhere below; a token whose slots are all -1 gets y_t = 0.

Dropped slots get weight 0. ``weights="renormalize"`` rescales the surviving weights of a
token so that they keep its original total, g'_{t,k} = g_{t,k} · Σ_j g_{t,j} / Σ_{j
accepted} g_{t,j}; a token none of whose slots survive gets y_t = 0. ``weights="zero"``
leaves the surviving weights as they were.

``import rdepc`` does not import this module (it needs torch, and ``rdepc check`` must not):
``from rdepc.reference import moe_reference``.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F_

from rdepc.ir.sizes import SCALE_BLOCK
from rdepc.ir.spec import CLAMPED_SWIGLU, is_gated
from rdepc.reference_capacity import RowId, accepted_rows, combine_weights

ACTS = ("swiglu", "clamped_swiglu", "gelu", "relu")
GATES = ("output", "input")
ROUTINGS = ("uniform", "zipf:A", "hot", "one")


# ----------------------------------------------------------------------------------------
# The operator
# ----------------------------------------------------------------------------------------


def expert_fn(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    limit: float | None = None,
    alpha: float | None = None,
    biases: tuple | None = None,
):
    """One expert on rows ``x`` [N, H]: swiglu (silu(x·Wg) ⊙ x·Wu)·Wd; clamped_swiglu
    (GPT-OSS) with g = min(x·Wg, limit), u = x·Wu clamped to ±limit: ((u + 1) ⊙ g ⊙
    σ(alpha·g))·Wd (``limit`` and ``alpha`` default to GPT-OSS's 7 and 1.702); or act(x·Wu)·Wd.
    ``biases`` (b_gate [F] or None, b_up [F], b_down [H]): added after each projection."""
    bg, bu, bd = biases or (None, None, None)

    def proj(w, b):
        return x @ w if b is None else x @ w + b

    if act == "swiglu":
        h = F_.silu(proj(w_gate, bg)) * proj(w_up, bu)
    elif act == "clamped_swiglu":
        limit = float(CLAMPED_SWIGLU["limit"] if limit is None else limit)
        alpha = float(CLAMPED_SWIGLU["alpha"] if alpha is None else alpha)
        gate = proj(w_gate, bg).clamp(max=limit)
        up = proj(w_up, bu).clamp(min=-limit, max=limit)
        h = (up + 1) * gate * torch.sigmoid(gate * alpha)
    elif act == "gelu":
        h = F_.gelu(proj(w_up, bu), approximate="none")
    elif act == "relu":
        h = F_.relu(proj(w_up, bu))
    else:
        raise ValueError(f"unknown activation {act!r}; expected one of {', '.join(ACTS)}")
    return h @ w_down if bd is None else h @ w_down + bd


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    router,
    K: int,
    bias: torch.Tensor | None = None,
    logit_bias: torch.Tensor | None = None,
):
    """The router of docs/language.md, one token at a time: ``x`` [N, H], ``weight`` [E, H],
    ``router`` a spec's :class:`rdepc.ir.spec.Router`. Returns (ids [N, K], gates [N, K]) in fp32
    (float64 if ``x`` is float64).

    Per token: logits z = W·x (+ ``logit_bias``); scores s = softmax(z) or sigmoid(z); a choice
    score c = s (+ bias); with G groups, each group's score is the sum of its two best c
    (``group_score top2``) or its best c (``max``), and only the experts of the ``top_groups``
    best groups may be chosen; the K best c are chosen; their gates are their s, divided by
    their sum when ``renormalize``, times ``scale``.
    """
    E = weight.shape[0]
    ct = torch.promote_types(x.dtype, torch.float32)
    ids, gates = [], []
    for xt in x.to(ct):
        z = weight.to(ct) @ xt
        if logit_bias is not None:
            z = z + logit_bias.to(ct)
        s = torch.softmax(z, dim=0) if router.score == "softmax" else torch.sigmoid(z)
        c = s if bias is None else s + bias.to(ct)
        allowed = list(range(E))
        if router.groups > 1:
            size = E // router.groups
            counted = 1 if router.group_score == "max" else 2
            best = [sorted(c[g * size : (g + 1) * size].tolist(), reverse=True)[:counted] for g in range(router.groups)]
            group_rank = sorted(range(router.groups), key=lambda g: -sum(best[g]))
            allowed = [e for g in sorted(group_rank[: router.top_groups]) for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -c[e].item())[:K]
        g = s[chosen]
        if router.renormalize:
            g = g / (g.sum() if router.norm_min is None else g.sum().clamp(min=float(router.norm_min)))
        ids.append(chosen)
        gates.append(g * float(router.scale))
    if not gates:  # no tokens
        return torch.zeros((0, K), dtype=torch.int64), torch.zeros((0, K), dtype=ct)
    return torch.tensor(ids, dtype=torch.int64).reshape(-1, K), torch.stack(gates).reshape(-1, K)


def shared_experts(
    x: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    act: str,
    gate: torch.Tensor | None = None,
    limit: float | None = None,
    alpha: float | None = None,
) -> torch.Tensor:
    """The spec's shared experts on every token of ``x`` [..., H]: the sum over the N experts
    (``w_gate`` and ``w_up`` [N, H, F_s] — ``w_gate`` None unless swiglu —, ``w_down``
    [N, F_s, H]) of each one's output; with ``shared ..., gate sigmoid`` that sum times
    sigmoid(x · ``gate``ᵀ) per token (``gate`` [1, H]). In x's dtype, computed in fp32."""
    ct = torch.promote_types(x.dtype, torch.float32)
    rows = x.reshape(-1, x.shape[-1]).to(ct)
    total = torch.zeros_like(rows)
    for j in range(w_up.shape[0]):
        wg = None if w_gate is None else w_gate[j].to(ct)
        total = total + expert_fn(rows, wg, w_up[j].to(ct), w_down[j].to(ct), act, limit, alpha)
    if gate is not None:
        total = total * torch.sigmoid(rows @ gate.to(ct).reshape(-1, 1))
    return total.reshape(x.shape).to(x.dtype)


FP8_MAX = 448.0  # the largest finite fp8 e4m3 (e4m3fn) value


def fp8_dispatch(x: torch.Tensor, scale: str = "row", block: int = SCALE_BLOCK) -> torch.Tensor:
    """``x`` [..., H] as an owner receives it under fp8 dispatch, dequantised, in fp32.

    Each row (``scale="row"``) or each run of ``block`` columns of a row (``"block"``) gets
    the scale s = amax / 448 (1 when it is all zero), is divided by it, clamped to ±448
    and rounded to nearest even in e4m3; the owner computes with q · s. The gradient passes
    straight through the rounding (d q·s / dx = 1), as the compiled backward takes it.
    """
    if scale not in ("row", "block"):
        raise ValueError(f"unknown fp8 scale {scale!r}; expected row or block")
    xf = x.to(torch.float32)
    H = xf.shape[-1]
    step = H if scale == "row" else block
    out = torch.empty_like(xf)
    for c in range(0, H, step):
        part = xf[..., c : c + step]
        amax = part.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (part / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        out[..., c : c + step] = q * s
    return xf + (out - xf).detach()


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    act: str = "swiglu",
    act_limit: float | None = None,
    act_alpha: float | None = None,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    capacity: int | Sequence[int] | None = None,
    drop: str = "round_robin",
    weights: str = "renormalize",
    owner: Sequence[int] | None = None,
    row_id: RowId | None = None,
    gate: str = "output",
    dispatch: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RDEP operator (eq. 4) with the capacity policy of section 3.6.

    x [W, T', H]; topk_ids [W, T', K] (int, in [0, E), or -1: no expert); topk_weights [W, T', K];
    w_gate [E, H, F] (``None`` unless the expert is gated: swiglu, clamped_swiglu), w_up
    [E, H, F], w_down [E, F, H]; ``act_limit`` and ``act_alpha``: clamped_swiglu's (``expert_fn``);
    ``b_gate``, ``b_up`` [E, F] and ``b_down`` [E, H]: expert biases (all None: none).
    ``capacity``: ``None`` for dropless, else cap_e for every expert or one per expert.
    ``owner``: the owner rank π(e) of each expert; it is only checked (length E, ranks in
    [0, W)) — where an expert lives does not change the operator, which is the point.
    ``row_id``: a callable (r, t, k) → int, injective; eq. 7 by default. ``gate``: where
    g' scales expert e, ``"output"`` (eq. 4) or ``"input"``. ``dispatch``: what the experts'
    input rows go through on the wire (e.g. :func:`fp8_dispatch`), applied to x, or under
    ``gate="input"`` to each scaled row; None: nothing.

    Returns ``(y, accepted)``: y [W, T', H] in x's dtype and the accepted set [W, T', K]
    (bool). Computes in float32 (float64 if x is float64); deterministic.
    """
    W, T, H, K, E, F = _operand_shapes(x, topk_ids, topk_weights, w_gate, w_up, w_down, act, gate, owner)

    ct = torch.promote_types(x.dtype, torch.float32)
    sent = dispatch or (lambda rows: rows)
    xf = sent(x).to(ct) if gate == "output" else x.to(ct)
    g = torch.where(topk_ids.to(x.device) >= 0, topk_weights.to(ct), 0)  # no expert: the gate counts as 0
    wg = None if w_gate is None else w_gate.to(ct)
    wu, wd = w_up.to(ct), w_down.to(ct)
    _check_biases(b_gate, b_up, b_down, act, (E, F, H))

    def biases(e: int):
        if b_up is None:
            return None
        return (None if b_gate is None else b_gate[e].to(ct), b_up[e].to(ct), b_down[e].to(ct))

    accepted = accepted_rows(topk_ids, g, capacity, num_experts=E, drop=drop, row_id=row_id)
    accepted = accepted.to(x.device)
    gp = combine_weights(g, accepted, weights)

    # Sum over slots in a fixed order; each (slot, expert) is one GEMM over the accepted rows
    # that chose it, written by plain indexing (no atomics, so the result is deterministic).
    y = torch.zeros((W, T, H), dtype=ct, device=x.device)
    ids = topk_ids.to(x.device)
    for k in range(K):
        out_k = torch.zeros((W, T, H), dtype=ct, device=x.device)
        x_k = xf if gate == "output" else sent((xf * gp[:, :, k, None]).to(x.dtype)).to(ct)
        for e in range(E):
            mask = (ids[:, :, k] == e) & accepted[:, :, k]
            if not bool(mask.any()):
                continue
            wge = None if wg is None else wg[e]
            out_k[mask] = expert_fn(x_k[mask], wge, wu[e], wd[e], act, act_limit, act_alpha, biases(e))
        y = y + (gp[:, :, k, None] * out_k if gate == "output" else out_k)
    return y.to(x.dtype), accepted


def _operand_shapes(x, topk_ids, topk_weights, w_gate, w_up, w_down, act: str, gate: str, owner) -> tuple[int, ...]:
    """W, T', H, K, E, F of :func:`moe_reference`'s operands, each checked against the others;
    ``owner`` only checked."""
    if act not in ACTS:
        raise ValueError(f"unknown activation {act!r}; expected one of {', '.join(ACTS)}")
    if gate not in GATES:
        raise ValueError(f"unknown gate placement {gate!r}; expected one of {', '.join(GATES)}")
    if x.dim() != 3:
        raise ValueError(f"x must be [W, T, H], got shape {tuple(x.shape)}")
    W, T, H = x.shape
    if topk_ids.dim() != 3 or topk_ids.shape[:2] != (W, T):
        raise ValueError(f"topk_ids must be [W, T, K] = [{W}, {T}, K], got {tuple(topk_ids.shape)}")
    K = topk_ids.shape[2]
    if topk_weights.shape != topk_ids.shape:
        want, got = tuple(topk_ids.shape), tuple(topk_weights.shape)
        raise ValueError(f"topk_weights must be shaped like topk_ids {want}, got {got}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if w_up.dim() != 3 or w_up.shape[1] != H:
        raise ValueError(f"w_up must be [E, H={H}, F], got {tuple(w_up.shape)}")
    E, _, F = w_up.shape
    if w_down.shape != (E, F, H):
        raise ValueError(f"w_down must be [E, F, H] = [{E}, {F}, {H}], got {tuple(w_down.shape)}")
    if is_gated(act):
        if w_gate is None or w_gate.shape != w_up.shape:
            got = None if w_gate is None else tuple(w_gate.shape)
            raise ValueError(f"{act} experts need w_gate shaped like w_up {tuple(w_up.shape)}, got {got}")
    elif w_gate is not None:
        raise ValueError(f"{act} experts are not gated: pass w_gate=None")
    if topk_ids.numel() and (int(topk_ids.min()) < -1 or int(topk_ids.max()) >= E):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        raise ValueError(f"topk_ids must lie in [0, {E}) or be -1 (no expert), got [{lo}, {hi}]")
    if owner is not None:
        owner = tuple(int(q) for q in owner)
        if len(owner) != E or any(not 0 <= q < W for q in owner):
            raise ValueError(f"owner must give a rank in [0, {W}) for each of the {E} experts, got {owner}")
    return W, T, H, K, E, F


def _check_biases(b_gate, b_up, b_down, act: str, sizes: tuple[int, int, int]) -> None:
    """The expert biases come together, shaped for E, F and H (``sizes``), or not at all."""
    E, F, H = sizes
    if (b_up is None) != (b_down is None) or (b_gate is not None and b_up is None):
        raise ValueError("expert biases come together: b_up and b_down (and b_gate for a gated expert), or none")
    if b_up is not None and (b_up.shape != (E, F) or b_down.shape != (E, H)):
        raise ValueError(f"b_up must be [E, F] = [{E}, {F}] and b_down [E, H] = [{E}, {H}]")
    if b_up is not None and is_gated(act) and (b_gate is None or b_gate.shape != (E, F)):
        raise ValueError(f"{act} experts with biases need b_gate [E, F] = [{E}, {F}]")


# ----------------------------------------------------------------------------------------
# From a spec
# ----------------------------------------------------------------------------------------


def capacity_for(spec, T: int, brought: int | None = None) -> int | None:
    """cap_e of ``spec`` with T' = ``T`` tokens per rank (policy factor: ⌈f·W·T'·K/E⌉), or
    with ``brought`` tokens over all ranks when their counts differ (factor: ⌈f·n·K/E⌉; rows
    given in T: at T = ⌈n/W⌉)."""
    cap = spec.capacity
    if cap.policy == "dropless":
        return None
    import sympy as sp

    W, K, E = int(spec.shape.W), int(spec.shape.K), int(spec.shape.E)
    n = W * T if brought is None else brought
    if cap.policy == "factor":
        f = sp.Rational(cap.factor)
        return -(-int(f.p) * n * K // (int(f.q) * E))  # exact ceiling
    T = -(-n // W)
    at_T = {spec.shape.T: T} if spec.shape.symbolic else {}
    rows = cap.rows_per_expert(replace(spec.shape, T=sp.Integer(T), T_bound=None))
    return int(sp.sympify(rows).subs(at_T))


def row_id_for(spec, T: int) -> RowId:
    """The spec's route-row identity as a callable (r, t, k) → int, at T' = ``T``."""
    import sympy as sp

    rr = spec.route_row
    at_T = {spec.shape.T: T} if spec.shape.symbolic else {}
    coef = {v: int(sp.sympify(c).subs(at_T)) for v, c in rr.radix}
    off = int(sp.sympify(rr.offset).subs(at_T))
    cr, ct, ck = coef.get("rank", 0), coef.get("token", 0), coef.get("slot", 0)
    return lambda r, t, k: off + cr * r + ct * t + ck * k


def reference_for(layer_or_spec, dispatch_rounding: bool = True) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``moe_reference`` configured from a loaded layer (``rdepc.load``) or its LayerSpec.

    Reads W, E, K, H, F, the expert activation, the capacity policy (cap_e evaluated at the
    actual T' of each call), the drop and weights policies, the ownership map and the
    route-row encoding. Returns ``fn(x, topk_ids, topk_weights, w_gate, w_up, w_down, tokens=None)
    -> (y, accepted)``; ``tokens``: how many of the T' tokens each rank brings (the others are
    padding: no expert, y = 0; the capacity follows their total). With fp8 dispatch the
    experts see x (with the gate on their input, g'·x) as ``fp8_dispatch`` quantises it
    (``dispatch_rounding=False``: unquantised). Shared experts, other dispatch dtypes
    and dedup are not part of it: it is the routed operator of eq. 4, computed exactly.
    """
    spec = getattr(layer_or_spec, "spec", layer_or_spec)
    sh = spec.shape
    W, H, E, K, F = int(sh.W), int(sh.H), int(sh.E), int(sh.K), int(spec.expert.F)
    act = spec.expert.act

    def fn(x, topk_ids, topk_weights, w_gate, w_up, w_down, tokens=None, b_gate=None, b_up=None, b_down=None):
        if x.dim() != 3 or x.shape[0] != W or x.shape[2] != H:
            raise ValueError(f"{spec.name}: x must be [W={W}, T', H={H}], got {tuple(x.shape)}")
        T = x.shape[1]
        if x.shape[1] > sh.T_max:
            raise ValueError(f"{spec.name}: {T} tokens per rank exceed the spec's T = {sh.T_max}")
        if topk_ids.shape != (W, T, K):
            raise ValueError(f"{spec.name}: topk_ids must be [{W}, {T}, K={K}], got {tuple(topk_ids.shape)}")
        if w_up.shape != (E, H, F):
            raise ValueError(f"{spec.name}: w_up must be [E={E}, H={H}, F={F}], got {tuple(w_up.shape)}")
        brought = None
        if tokens is not None:
            counts = [int(n) for n in tokens]
            if len(counts) != W or not all(0 <= n <= T for n in counts):
                raise ValueError(
                    f"{spec.name}: tokens must give each of the {W} ranks a count in [0, {T}], got {counts}"
                )
            topk_ids = topk_ids.clone()
            for r, n in enumerate(counts):
                topk_ids[r, n:] = -1
            brought = sum(counts)
        dispatch = None
        if dispatch_rounding and spec.precision.dispatch_scale is not None:
            scale = spec.precision.dispatch_scale
            if spec.gate_on == "input":  # the scaled rows go on the wire, in the compute dtype first
                wire = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
                    spec.precision.dtype.value
                ]
                dispatch = lambda rows: fp8_dispatch(rows.to(wire), scale)  # noqa: E731
            else:
                x = fp8_dispatch(x, scale)
        return moe_reference(
            x,
            topk_ids,
            topk_weights,
            w_gate,
            w_up,
            w_down,
            act=act,
            act_limit=spec.expert.limit,
            act_alpha=spec.expert.alpha,
            b_gate=b_gate,
            b_up=b_up,
            b_down=b_down,
            capacity=capacity_for(spec, T, brought),
            drop=spec.capacity.drop,
            weights=spec.capacity.weights,
            owner=spec.ownership.owner,
            row_id=row_id_for(spec, T),
            gate=spec.gate_on,
            dispatch=dispatch,
        )

    fn.spec = spec
    return fn


# ----------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------


class Inputs(NamedTuple):
    """The positional arguments of :func:`moe_reference`, in order."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w_gate: torch.Tensor | None
    w_up: torch.Tensor
    w_down: torch.Tensor


def owner_pairs(topk_ids: torch.Tensor, accepted: torch.Tensor, owner: Sequence[int]) -> int:
    """Distinct (token, owner) pairs among the accepted route rows: the rows ``dedup`` sends,
    one per pair, where the accepted rows are what goes out without it. ``topk_ids`` and
    ``accepted`` are [W, T, K], on any devices (counted where ``topk_ids`` is); ``owner[e]``
    is the rank that owns expert e."""
    owner_of = torch.as_tensor(list(owner), dtype=torch.int64, device=topk_ids.device)
    hits = torch.zeros(*topk_ids.shape[:2], int(owner_of.max()) + 1, dtype=torch.int64, device=topk_ids.device)
    hits.scatter_add_(2, owner_of[topk_ids.long()], accepted.to(topk_ids.device, torch.int64))
    return int((hits > 0).sum())


def random_inputs(
    W: int,
    T: int,
    H: int,
    F: int,
    E: int,
    K: int,
    *,
    routing: str = "uniform",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    gated: bool = True,
    device: torch.device | str | None = None,
) -> Inputs:
    """Random, deterministic inputs: ``moe_reference(*random_inputs(...))`` runs.

    ``routing``: ``"uniform"`` (K distinct experts per token, uniformly), ``"zipf:A"`` (K
    distinct experts drawn with weights ∝ 1/(e+1)^A), ``"hot"`` (9 tokens in 10 pick experts
    0..K-1, the rest uniformly), ``"one"`` (slot k of every token goes to expert k, so with
    K = 1 every row goes to expert 0). Gates are a softmax over the K slots, in descending
    order, in float32. Weights are scaled by 1/sqrt(fan_in) so the outputs are O(1).
    Everything is drawn on the CPU, whatever ``device``, then cast to ``dtype`` (gates stay
    float32) and moved there: routing, gates and x from ``torch.Generator().manual_seed(seed)``,
    each expert's weight matrix from a generator of its own (:func:`expert_weights`).
    """
    if not 1 <= K <= E:
        raise ValueError(f"need 1 <= K <= E, got K={K}, E={E}")
    gen = torch.Generator().manual_seed(seed)
    N = W * T
    if routing == "uniform":
        ids = torch.multinomial(torch.ones(N, E), K, replacement=False, generator=gen)
    elif routing.startswith("zipf:"):
        try:
            a = float(routing.partition(":")[2])
        except ValueError:
            raise ValueError(f"routing {routing!r}: expected zipf:A with a number A") from None
        p = 1.0 / (torch.arange(E, dtype=torch.float64) + 1) ** a
        ids = torch.multinomial(p.expand(N, E), K, replacement=False, generator=gen)
    elif routing == "hot":
        ids = torch.multinomial(torch.ones(N, E), K, replacement=False, generator=gen)
        hot = torch.rand(N, generator=gen) < 0.9
        perm = torch.rand(N, K, generator=gen).argsort(dim=1)  # experts 0..K-1 in a random slot order
        ids = torch.where(hot[:, None], perm, ids)
    elif routing == "one":
        ids = torch.arange(K).expand(N, K).clone()
    else:
        raise ValueError(f"unknown routing {routing!r}; expected one of {', '.join(ROUTINGS)}")
    ids = ids.to(torch.int64).reshape(W, T, K)

    logits = torch.randn(W, T, K, generator=gen)
    gates = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values

    x = torch.randn(W, T, H, generator=gen).to(dtype)
    w_gate = expert_weights(seed, "w_gate", E, H, F, math.sqrt(H), dtype) if gated else None
    w_up = expert_weights(seed, "w_up", E, H, F, math.sqrt(H), dtype)
    w_down = expert_weights(seed, "w_down", E, F, H, math.sqrt(F), dtype)

    def moved(t):
        return None if t is None else t.to(device)

    return Inputs(moved(x), ids.to(device), gates.to(device), moved(w_gate), moved(w_up), moved(w_down))


# Weights below this many elements are drawn in the calling thread (the same values): a pool
# of threads costs more than small draws take.
PARALLEL_DRAW = 1 << 22


def expert_weights(seed: int, name: str, E: int, rows: int, cols: int, fan: float, dtype: torch.dtype) -> torch.Tensor:
    """[E, rows, cols] in ``dtype``: expert e's matrix is N(0, 1) / ``fan`` in float32, drawn
    on the CPU from a generator seeded by (seed, name, e), then cast. Experts are drawn in
    parallel threads, each with one matrix of float32 at a time: one generator for all of
    deepseek_v3's 11e9 weights draws them one after another, minutes on one core."""
    out = torch.empty(E, rows, cols, dtype=dtype)

    def draw(e: int) -> None:
        key = hashlib.blake2b(f"{seed}/{name}/{e}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        out[e] = torch.randn(rows, cols, generator=gen) / fan

    if E * rows * cols < PARALLEL_DRAW:
        for e in range(E):
            draw(e)
        return out
    with ThreadPoolExecutor(max_workers=max(1, min(E, os.cpu_count() or 1))) as pool:
        list(pool.map(draw, range(E)))  # list(): an exception in a thread is raised here
    return out


def random_biases(
    E: int,
    H: int,
    F: int,
    *,
    gated: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor | None]:
    """Random, deterministic expert biases for a spec whose experts have them, as keyword
    arguments of ``moe_reference`` and the compiled layer: b_gate (None unless ``gated``),
    b_up [E, F] and b_down [E, H], N(0, 1/4), drawn on the CPU from their own generator
    (``seed``), so that ``random_inputs`` draws the same with or without them."""
    gen = torch.Generator().manual_seed(1_000_003 + seed)
    out = {
        "b_gate": torch.randn(E, F, generator=gen) / 2 if gated else None,
        "b_up": torch.randn(E, F, generator=gen) / 2,
        "b_down": torch.randn(E, H, generator=gen) / 2,
    }
    return {k: None if v is None else v.to(dtype=dtype, device=device) for k, v in out.items()}


__all__ = [
    "Inputs",
    "capacity_for",
    "expert_fn",
    "expert_weights",
    "fp8_dispatch",
    "moe_reference",
    "owner_pairs",
    "random_biases",
    "random_inputs",
    "reference_for",
    "route",
    "row_id_for",
    "shared_experts",
]
