"""RDEPMoE: a drop-in ``torch.nn.Module`` MoE block that runs rdepc's compiled kernels.

    moe = rdepc.RDEPMoE("examples/tiny.rdep", device="cpu")
    y = moe(x)  # x [W, T', H] -> y [W, T', H]

On a per-rank backend (``backend="emulated-mp"`` or ``"nvshmem"``, one process per rank)
each rank builds its own block: ``x`` [T', H] are its own tokens, and it holds only its
own experts (``experts``: their global ids, in local order) — ``w_gate`` / ``w_up``
[E_loc, H, F], ``w_down`` [E_loc, F, H]. With one seed every rank draws the same router
and shared experts, and its experts' rows of the same full weights.

Semantics, in order:

1. router: ``logits = x @ router`` (``router`` [H, E], in fp32), ``p = softmax(logits)``
   over the E experts, the top-K of ``p`` per token (ids and values, in descending order of
   ``p``), the K values renormalized to sum 1: the gates ``g``;
2. routed experts: the compiled layer (``Layer.module``), ``sum_k g'_k f_{e_k}(x)`` with the
   spec's capacity policy — never the reference operator;
3. shared experts (the spec's ``shared N x act(ffn = F)``): computed densely on the
   front-end rank, replicated, and added.

Experts are ``nn.Parameter``s: a gated expert's ``w_gate_up`` [E, H, F, 2] (gate and up
interleaved, the operand GEMM1 reads: ``w_gate`` and ``w_up`` are its two halves, views),
gelu and relu experts' ``w_up`` [E, H, F] (``w_gate`` None), ``w_down`` [E, F, H], and
``shared_gate`` / ``shared_up`` [N, H, F_s], ``shared_down`` [N, F_s, H]. The compiled
kernels are bound to the device given at construction; build the block on the device it
runs on. The block trains: the router through the gates and the shared experts in plain
torch, the routed experts through the compiled backward kernels (``RDEPModule``).
"""

from __future__ import annotations

import math

import torch
from rdepc.runtime.module import TORCH_DTYPES
from torch import nn
from torch.nn import functional as F_


def _ffn(x: torch.Tensor, w_gate, w_up, w_down, act: str) -> torch.Tensor:
    if act == "swiglu":
        return (F_.silu(x @ w_gate) * (x @ w_up)) @ w_down
    if act == "gelu":
        return F_.gelu(x @ w_up, approximate="none") @ w_down
    return F_.relu(x @ w_up) @ w_down


class RDEPMoE(nn.Module):
    """An MoE block whose routed experts run the kernels rdepc compiled from a spec."""

    def __init__(
        self,
        spec,
        *,
        layer: str | None = None,
        backend: str = "emulated",
        device=None,
        schedule: str | None = None,
        generator: torch.Generator | None = None,
        module_options: dict | None = None,
        **overrides,
    ):
        super().__init__()
        from rdepc.api import Layer, load

        self.layer = spec if isinstance(spec, Layer) else load(spec, layer, **overrides)
        s = self.layer.spec
        sh = self.layer.shapes
        self.W, self.T, self.H, self.F, self.E, self.K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
        self.act = s.expert.act
        self.kernels = self.layer.module(backend, device, schedule=schedule, **(module_options or {}))
        kw = {"device": self.kernels.device, "dtype": TORCH_DTYPES[s.precision.dtype.value]}  # nvshmem: its GPU
        # Per-rank backends: this rank's experts only (``experts``, global ids in local order).
        self.experts = self.kernels.local_experts
        n_exp = len(self.experts)
        self.router = nn.Parameter(torch.empty(self.H, self.E, **kw))
        gated = s.expert.gated
        if gated:  # w_gate and w_up: its halves (__getattr__)
            self.w_gate_up = nn.Parameter(torch.empty(n_exp, self.H, self.F, 2, **kw))
        else:
            self.w_gate = None
            self.w_up = nn.Parameter(torch.empty(n_exp, self.H, self.F, **kw))
        self.w_down = nn.Parameter(torch.empty(n_exp, self.F, self.H, **kw))
        self.shared_act = None
        self.shared_gate = self.shared_up = self.shared_down = None
        if s.shared is not None:
            n, Fs = s.shared.count, int(s.shared.fn.F)
            self.shared_act = s.shared.fn.act
            if s.shared.fn.gated:
                self.shared_gate = nn.Parameter(torch.empty(n, self.H, Fs, **kw))
            self.shared_up = nn.Parameter(torch.empty(n, self.H, Fs, **kw))
            self.shared_down = nn.Parameter(torch.empty(n, Fs, self.H, **kw))
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal weights scaled by 1/sqrt(fan_in), drawn in fp32 on the CPU (deterministic
        with a seeded ``generator``). Expert weights are drawn for all E experts and each rank
        keeps its own: with one seed, every rank's block is a slice of the same layer."""
        experts = ("w_gate_up", "w_up", "w_down")
        for name, p in self.named_parameters():
            for w in (p[..., 0], p[..., 1]) if name == "w_gate_up" else (p,):  # gate, then up
                fan_in = w.shape[-2]
                shape = (self.E, *w.shape[1:]) if name in experts else w.shape
                full = torch.randn(shape, generator=generator) / math.sqrt(fan_in)
                w.copy_((full[list(self.experts)] if name in experts else full).to(w.dtype))

    def __getattr__(self, name: str):
        params = self.__dict__.get("_parameters", {})
        if name in ("w_gate", "w_up") and "w_gate_up" in params:  # a gated expert's halves: views
            return params["w_gate_up"][..., 0 if name == "w_gate" else 1]
        return super().__getattr__(name)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [..., T', K] int64, gates [..., T', K] fp32): softmax over E, top-K, sum 1."""
        probs = torch.softmax(x.float() @ self.router.float(), dim=-1)
        top, ids = probs.topk(self.K, dim=-1)
        return ids, top / top.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, gates = self.route(x)
        y = self.kernels(x, ids, gates, self.w_gate, self.w_up, self.w_down)
        if self.shared_act is not None:
            for j in range(self.shared_up.shape[0]):
                gate = None if self.shared_gate is None else self.shared_gate[j]
                y = y + _ffn(x, gate, self.shared_up[j], self.shared_down[j], self.shared_act)
        return y

    @property
    def last_stats(self) -> dict | None:
        return self.kernels.last_stats

    def extra_repr(self) -> str:
        shared = "" if self.shared_act is None else f", shared {self.shared_up.shape[0]} x {self.shared_act}"
        return (
            f"{self.layer.spec.name}: W={self.W} T<={self.T} H={self.H} F={self.F} E={self.E} K={self.K}, "
            f"{self.act}{shared}, {self.kernels.transport.name} on {self.kernels.device}"
        )


__all__ = ["RDEPMoE"]
