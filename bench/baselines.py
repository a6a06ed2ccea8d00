"""What a user would otherwise write: the routed MoE layer in plain PyTorch, on the same
global inputs as ``rdepc`` ([W, T', H] tokens, [W, T', K] ids and gates, [E, ...] weights).

Each baseline computes the dropless operator y_t = Σ_k g_tk f_{e_tk}(x_t) (eq. 4), so its
output is checked against the reference before it is timed (``sort_grouped_mm``, the
twenty lines of the docs' comparison; ``grouped_mm_fused``, a careful user's); ``grouped_gemms`` and
``dense_roof`` are pieces (the expert GEMMs alone, and cuBLAS on as many rows), timed for
comparison, not layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_


def act_fn(act: str, gate, up):
    if act == "swiglu":
        return F_.silu(gate) * up
    return F_.gelu(up, approximate="none") if act == "gelu" else F_.relu(up)


def sort_rows(ids: torch.Tensor, E: int):
    """Route rows sorted by expert (stable: ascending row id within an expert): the order,
    each sorted row's token, and the grouped GEMM's int32 end offsets per expert."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    K = ids.shape[-1]
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    return order, order // K, offs


def grouped_ffn(xs, offs, w_gate, w_up, w_down, act: str):
    """The experts over rows already sorted by expert: three (or two) grouped GEMMs."""
    up = torch._grouped_mm(xs, w_up, offs=offs)
    gate = torch._grouped_mm(xs, w_gate, offs=offs) if w_gate is not None else None
    return torch._grouped_mm(act_fn(act, gate, up).to(xs.dtype), w_down, offs=offs)


def sort_grouped_mm(x, ids, gates, w_gate, w_up, w_down, act: str = "swiglu"):
    """Sort route rows by expert, ``torch._grouped_mm`` over the groups, weight by the gates
    and scatter back with ``index_add_``: about twenty lines, dropless."""
    W, T, H = x.shape
    order, token, offs = sort_rows(ids, w_up.shape[0])
    out = grouped_ffn(x.reshape(-1, H)[token], offs, w_gate, w_up, w_down, act)
    weighted = out.float() * gates.reshape(-1)[order, None]
    y = torch.zeros(W * T, H, dtype=torch.float32, device=x.device).index_add_(0, token, weighted)
    return y.to(x.dtype).reshape(W, T, H)


def fuse_gate_up(w_gate, w_up):
    """[E, H, 2F]: gate's columns then up's, the one GEMM1 operand a fused layer holds (made
    once, as a parameter is)."""
    return torch.cat([w_gate, w_up], dim=-1).contiguous()


def grouped_mm_fused(x, ids, gates, w_gate_up, w_down, act: str = "swiglu"):
    """What a careful PyTorch user writes today (torchtitan's MoE): rows sorted by expert, one
    grouped GEMM over gate and up fused ([E, H, 2F]; [E, H, F] for an ungated expert), the
    activation, the down projection, then each token's output the gate-weighted sum of its
    K rows gathered back — in the layer's dtype throughout, no fp32 temporary, no scatter."""
    W, T, H = x.shape
    K = ids.shape[-1]
    order, token, offs = sort_rows(ids, w_gate_up.shape[0])
    h = torch._grouped_mm(x.reshape(-1, H)[token], w_gate_up, offs=offs)
    F = w_down.shape[1]
    a = act_fn(act, h[:, :F], h[:, F:]) if h.shape[1] == 2 * F else act_fn(act, None, h)
    out = torch._grouped_mm(a.to(x.dtype), w_down, offs=offs)
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel(), device=order.device)  # each route row's sorted place
    rows = out[where].view(W * T, K, H)
    return (rows * gates.reshape(W * T, K, 1).to(x.dtype)).sum(1).reshape(W, T, H)


def per_expert_loop(x, ids, gates, w_gate, w_up, w_down, act: str = "swiglu"):
    """One plain matmul chain per expert over the rows that chose it."""
    W, T, H = x.shape
    xf, flat, g = x.reshape(-1, H), ids.reshape(-1), gates.reshape(-1)
    K = ids.shape[-1]
    y = torch.zeros(W * T, H, dtype=torch.float32, device=x.device)
    for e in range(w_up.shape[0]):
        rows = (flat == e).nonzero().squeeze(1)
        if rows.numel():
            xe = xf[rows // K]
            gate = xe @ w_gate[e] if w_gate is not None else None
            out = act_fn(act, gate, xe @ w_up[e]).to(x.dtype) @ w_down[e]
            y.index_add_(0, rows // K, out.float() * g[rows, None])
    return y.to(x.dtype).reshape(W, T, H)


def grouped_gemms(xs, offs, w_gate, w_up, w_down, act: str = "swiglu"):
    """The expert GEMMs alone, on pre-sorted rows: what the compute stage must match."""
    return grouped_ffn(xs, offs, w_gate, w_up, w_down, act)


def dense_roof(xs, w_in, w_down):
    """Dense GEMMs on as many rows: ``xs @ [H, 2F]`` then ``h @ [F, H]`` (cuBLAS's ceiling)."""
    h = xs @ w_in
    return h[:, : w_down.shape[0]] @ w_down


__all__ = [
    "dense_roof",
    "fuse_gate_up",
    "grouped_gemms",
    "grouped_mm_fused",
    "per_expert_loop",
    "sort_grouped_mm",
    "sort_rows",
]
