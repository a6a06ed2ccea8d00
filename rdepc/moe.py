"""RDEPMoE: a drop-in ``torch.nn.Module`` MoE block that runs rdepc's compiled kernels.

    moe = rdepc.RDEPMoE("examples/tiny.rdep", device="cpu")
    y = moe(x)  # x [W, T', H] -> y [W, T', H]

On a per-rank backend (``backend="emulated-mp"`` or ``"nvshmem"``, one process per rank)
each rank builds its own block: ``x`` [T', H] are its own tokens, and it holds only its
own experts (``experts``: their global ids, in local order) — ``w_gate`` / ``w_up``
[E_loc, H, F], ``w_down`` [E_loc, F, H]. With one seed every rank draws the same router
and shared experts, and its experts' rows of the same full weights.

Semantics, in order:

1. router, as the spec's ``router`` statement says (docs/language.md; without one,
   ``router softmax, renormalize``): ``logits = x · routerᵀ`` in fp32 (``router`` [E, H], an
   fp32 parameter whatever the layer's dtype: its master copy; plus ``router_logit_bias`` [E],
   an fp32 parameter, when the spec says ``logit_bias``), scores (softmax or sigmoid) over the
   E experts, the top-K by score (plus ``router_bias`` [E], a buffer, when the spec says
   ``bias``; within the ``top_groups`` best groups when it says ``groups``), gates the chosen
   scores, renormalised to sum 1 and scaled when the spec says so;
2. routed experts: the compiled layer (``Layer.module``), ``sum_k g'_k f_{e_k}(x)`` with the
   spec's capacity policy — never the reference operator;
3. shared experts (the spec's ``shared N x act(ffn = F)``): computed densely on the
   front-end rank, replicated, and added; with ``gate sigmoid`` their sum is first scaled
   per token by ``sigmoid(x · shared_gate_projᵀ)`` (``shared_gate_proj`` [1, H]).

Experts are ``nn.Parameter``s: a gated expert's ``w_gate_up`` [E, H, F, 2] (gate and up
interleaved, the operand GEMM1 reads: ``w_gate`` and ``w_up`` are its two halves, views),
gelu and relu experts' ``w_up`` [E, H, F] (``w_gate`` None), ``w_down`` [E, F, H]; with
``expert ..., bias`` their biases ``b_gate_up`` [E, F, 2] (halves ``b_gate``, ``b_up``) or
``b_up`` [E, F], and ``b_down`` [E, H] (zero-initialised; None without); and
``shared_gate`` / ``shared_up`` [N, H, F_s], ``shared_down`` [N, F_s, H]. The compiled
kernels are bound to the device given at construction; build the block on the device it
runs on. The block trains: the router through the gates and the shared experts in plain
torch, the routed experts through the compiled backward kernels (``RDEPModule``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F_

from rdepc.diagnostics import layer_prefix
from rdepc.reference import expert_fn
from rdepc.runtime import router as R
from rdepc.runtime.inputs import dense
from rdepc.runtime.tensors import TORCH_DTYPES

BIASES = ("b_gate_up", "b_up", "b_down")  # the expert biases' parameters, when the spec has them


class RDEPMoE(nn.Module):
    """An MoE block whose routed experts run the kernels rdepc compiled from a spec."""

    rdepc_block = True  # how rdepc.distributed recognises the block

    def __init__(
        self,
        spec,
        *,
        layer: str | None = None,
        backend: str = "emulated",
        device=None,
        dtype: torch.dtype | None = None,
        schedule: str | None = None,
        generator: torch.Generator | None = None,
        module_options: dict | None = None,
        **overrides,
    ):
        super().__init__()
        from rdepc.api import Layer, check_device, load

        meta = _is_meta(device)
        if not meta:
            check_device(device)  # before loading and compiling
        self.layer = spec if isinstance(spec, Layer) else load(spec, layer, **overrides)
        s = self.layer.spec
        sh = self.layer.shapes
        self.W, self.T, self.H, self.F, self.E, self.K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
        self.act = s.expert.act
        self.dtype = TORCH_DTYPES[s.precision.dtype.value]  # the compute dtype: the spec's
        self.backend, self.schedule, self.module_options = backend, schedule, dict(module_options or {})
        self._kernels = None
        if meta:  # no kernels yet: built on the parameters' device at the first call
            self.experts = self._local_experts()
            where = torch.device("meta")
        else:
            self._kernels = self._build(device)
            self.experts = self._kernels.local_experts
            where = self._kernels.device  # nvshmem: its GPU
        # Per-rank backends: this rank's experts only (``experts``, global ids in local order).
        kw = {"device": where, "dtype": dtype or self.dtype}
        n_exp = len(self.experts)
        self.router = nn.Parameter(torch.empty(self.E, self.H, device=where, dtype=torch.float32))
        logit_bias = torch.zeros(self.E, device=where, dtype=torch.float32) if s.router.logit_bias else None
        self.router_logit_bias = None if logit_bias is None else nn.Parameter(logit_bias)
        self.register_buffer("router_bias", torch.zeros(self.E, device=where) if s.router.bias else None)
        gated = s.expert.gated
        if gated:  # w_gate and w_up: its halves (__getattr__)
            self.w_gate_up = nn.Parameter(torch.empty(n_exp, self.H, self.F, 2, **kw))
        else:
            self.w_gate = None
            self.w_up = nn.Parameter(torch.empty(n_exp, self.H, self.F, **kw))
        self.w_down = nn.Parameter(torch.empty(n_exp, self.F, self.H, **kw))
        if s.expert.bias:  # expert biases (GPT-OSS): b_gate and b_up halves of b_gate_up when gated
            if gated:
                self.b_gate_up = nn.Parameter(torch.empty(n_exp, self.F, 2, **kw))
            else:
                self.b_up = nn.Parameter(torch.empty(n_exp, self.F, **kw))
            self.b_down = nn.Parameter(torch.empty(n_exp, self.H, **kw))
        for name in ("b_gate_up", "b_gate", "b_up", "b_down"):  # those this block's experts have not
            if name not in self._parameters and not (gated and s.expert.bias and name in ("b_gate", "b_up")):
                setattr(self, name, None)
        self.shared_act = self._shared_act_params = None
        self.shared_gate = self.shared_up = self.shared_down = self.shared_gate_proj = None
        if s.shared is not None:
            n, Fs = s.shared.count, int(s.shared.fn.F)
            self.shared_act = s.shared.fn.act
            self._shared_act_params = (s.shared.fn.limit, s.shared.fn.alpha)
            if s.shared.fn.gated:
                self.shared_gate = nn.Parameter(torch.empty(n, self.H, Fs, **kw))
            self.shared_up = nn.Parameter(torch.empty(n, self.H, Fs, **kw))
            self.shared_down = nn.Parameter(torch.empty(n, Fs, self.H, **kw))
            if s.shared.gate is not None:  # one gate over the N experts' sum, as the models hold it
                self.shared_gate_proj = nn.Parameter(torch.empty(1, self.H, **kw))
        if not meta:
            self.reset_parameters(generator)
        from rdepc import checkpoint

        checkpoint.install(self)  # one state-dict key per expert, by global id: checkpoints reshard
        from rdepc import distributed

        distributed.mark_experts(self)  # per rank: the guard against DDP / FSDP2 over the experts

    def _build(self, device):
        """The compiled layer on ``device`` (``RDEPModule``)."""
        kernels = self.layer.module(self.backend, device, schedule=self.schedule, **self.module_options)
        kernels.routed_by = "the router: x, the router weight or the logits given hold NaN or inf for that token"
        return kernels

    def _local_experts(self) -> tuple[int, ...]:
        """The experts this block holds, without building its kernels (meta construction)."""
        from rdepc.runtime.heap import local_experts
        from rdepc.runtime.ranks import process_group
        from rdepc.runtime.transport import get

        rank = process_group(self.W)[0] if get(self.backend).per_rank else None
        return local_experts(self.layer.generated.kernel, rank)  # the ownership map: the spec's

    @property
    def kernels(self):
        """The compiled layer (``RDEPModule``), built at first use on the parameters' device
        (after meta construction, a copy or unpickling), and again if they moved."""
        where = self._materialised()
        if self._kernels is None or self._kernels.device != where:
            self._kernels = self._build(where)
        return self._kernels

    def _materialised(self) -> torch.device:
        """The parameters' device; a RuntimeError while they are on the meta device."""
        where = self.w_down.device
        if where.type == "meta":
            raise RuntimeError(
                f"{layer_prefix(self.layer.spec.name)}: its parameters are on the meta device: "
                "call to_empty(device=...) and reset_parameters() first"
            )
        return where

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_kernels": None}  # rebuilt from the spec (and the cache) at the first call

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal weights scaled by 1/sqrt(fan_in), drawn in fp32 on the CPU (deterministic
        with a seeded ``generator``). Expert weights are drawn for all E experts and each rank
        keeps its own: with one seed, every rank's block is a slice of the same layer. Expert
        biases start at zero."""
        experts = ("w_gate_up", "w_up", "w_down")
        for name, p in self.named_parameters():
            if name in ("router", "shared_gate_proj"):  # drawn [H, n] as x · w reads it, kept [n, H] (nn.Linear)
                w = torch.randn(self.H, p.shape[0], generator=generator, device="cpu") / math.sqrt(self.H)
                p.copy_(w.T.to(p.dtype))
                continue
            if name in ("router_logit_bias", *BIASES):  # zero: the router (experts) start as without them
                p.zero_()
                continue
            for w in (p[..., 0], p[..., 1]) if name == "w_gate_up" else (p,):  # gate, then up
                fan_in = w.shape[-2]
                shape = (self.E, *w.shape[1:]) if name in experts else w.shape
                full = torch.randn(shape, generator=generator, device="cpu") / math.sqrt(fan_in)
                w.copy_((full[list(self.experts)] if name in experts else full).to(w.dtype))
        if self.router_bias is not None:
            self.router_bias.zero_()

    def __getattr__(self, name: str):
        params = self.__dict__.get("_parameters", {})
        if name in ("w_gate", "w_up") and "w_gate_up" in params:  # a gated expert's halves: views
            return params["w_gate_up"][..., 0 if name == "w_gate" else 1]
        if name in ("b_gate", "b_up") and "b_gate_up" in params:  # a gated expert's bias halves: views
            return params["b_gate_up"][..., 0 if name == "b_gate" else 1]
        return super().__getattr__(name)

    def route(
        self, x: torch.Tensor, logits: torch.Tensor | None = None, router_bias: torch.Tensor | None = None
    ) -> R.Routing:
        """(ids [..., T', K] int64, gates [..., T', K] fp32, logits [..., T', E] fp32) by the
        spec's router; from ``logits`` instead of ``x · routerᵀ (+ router_logit_bias)`` when
        given, with ``router_bias`` instead of this block's when given."""
        if logits is None and self.router is None:
            raise ValueError(f"{layer_prefix(self.layer.spec.name)} has no router weight of its own: pass logits=")
        if router_bias is not None and not self.layer.spec.router.bias:  # it would choose other experts, unsaid
            raise ValueError(
                f"{layer_prefix(self.layer.spec.name)}: router_bias= given, but the spec's router has no 'bias' "
                "term: add 'bias' to its router statement, or pass none"
            )
        if router_bias is not None and tuple(router_bias.shape) not in ((self.E,), (1, self.E)):
            raise ValueError(
                f"{layer_prefix(self.layer.spec.name)}: router_bias= has shape {tuple(router_bias.shape)}, "
                f"not [E] = [{self.E}]"
            )
        bias = self.router_bias if router_bias is None else router_bias
        return R.route(x, self.router, self.layer.spec.router, self.K, bias, logits, self.router_logit_bias)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        tokens=None,
        router_outputs: bool = False,
        logits: torch.Tensor | None = None,
        router_bias: torch.Tensor | None = None,
    ):
        """``x``: any float dtype, cast to the layer's and ``y`` cast back; in one process
        [W, T', H] (rank r's tokens ``x[r]``), or [N, H] / [B, S, H] (B ≠ W) of any N ≤ W·T
        tokens, split over the W ranks in order — padded with tokens that route nowhere to
        a multiple of W, and ``y`` has x's shape; on a per-rank backend this rank's [T', H]
        (or [B, S, H], B·S ≤ T). Returns ``y``, or ``(y, RouterOutputs(logits, aux_loss,
        z_loss))`` with ``router_outputs``: the router's fp32 logits for the user's own
        losses, and the losses the spec declares (its coefficient × the loss; None when it
        declares none). ``logits``: route from these instead of this block's router (a model
        that keeps its own router module); ``router_bias`` [E]: the selection bias to use
        instead of this block's buffer.

        Padding: ``mask`` (x's shape without H; False, or 0, for padding) and, with
        [W, T', H] in one process, ``tokens`` (how many of the T' tokens each of the W
        ranks brings, a list: ranks of different lengths, the tokens past each count
        padding). A padding token routes nowhere (expert id -1), takes no capacity, gets
        y = 0 (shared experts included) and is left out of the router's losses; ``tokens``
        also sets the capacity's token count. Its row of x (and of ``logits``) is read as
        zeros, whatever it holds (NaN included): its router logits are those of a zero row,
        and no gradient reaches it."""
        ranked, n, tokens = self._as_ranks(x, tokens)  # checks x first
        shape, dtype = x.shape, x.dtype
        x = ranked.to(self.dtype)  # fp32 or autocast inputs: cast at the boundary
        if logits is not None:
            logits = self._spread(self._logits(logits, shape), n, x.shape[:-1], (self.E,))
        if mask is not None:
            mask = self._spread(self._mask(mask, shape, x), n, x.shape[:-1])
        real = self._real(mask, tokens, x)
        if real is not None:  # a padding token's contents never matter, NaN included: it reads as zeros
            x = torch.where(real[..., None], x, 0.0)
            logits = None if logits is None else torch.where(real[..., None], logits, 0.0)
        routing = self.route(x, logits, router_bias)
        ids = routing.ids if real is None else torch.where(real[..., None], routing.ids, -1)
        w_down = self.w_down.to(self.dtype)  # parameters in another dtype (master weights): compute in the spec's
        w_up = (self.w_gate_up if self.w_gate is not None else self.w_up).to(self.dtype)
        b_up = b_down = None
        if self.b_down is not None:  # expert biases: GEMM1's laid out as its operand's columns
            b_up = (self.b_gate_up if self.b_gate is not None else self.b_up).to(self.dtype)
            b_down = self.b_down.to(self.dtype)
        y = self.kernels.routed(x, ids, routing.gates, w_up, w_down, b_up=b_up, b_down=b_down, tokens=tokens)
        if self.shared_act is not None:
            shared = torch.zeros_like(y)
            for j in range(self.shared_up.shape[0]):
                gate = None if self.shared_gate is None else self.shared_gate[j].to(self.dtype)
                up, down = self.shared_up[j].to(self.dtype), self.shared_down[j].to(self.dtype)
                shared = shared + expert_fn(x, gate, up, down, self.shared_act, *self._shared_act_params)
            if self.shared_gate_proj is not None:
                shared = shared * torch.sigmoid(F_.linear(x, self.shared_gate_proj.to(self.dtype)))
            y = y + shared  # a padding token's: f(0) = 0
        y = self._unspread(y, n).reshape(shape).to(dtype)
        if not router_outputs:
            return y
        out = R.outputs(routing, self.layer.spec.router, real)
        return y, out._replace(logits=self._unspread(out.logits, n).reshape(*shape[:-1], self.E))

    def _as_ranks(self, x: torch.Tensor, tokens) -> tuple[torch.Tensor, int | None, object]:
        """``x`` as the kernels take it — [W, T', H] in one process, a rank's [T', H] per
        rank — the number of tokens it was padded from (None when it was not), and the
        tokens each rank brings (``tokens``, or those of the padding)."""
        name = layer_prefix(self.layer.spec.name)
        dense(name, "x", x)
        if not x.dtype.is_floating_point:  # token ids or a mask by mistake: never cast them silently
            raise TypeError(f"{name}: x must be a floating-point tensor (cast to {self.dtype}), got {x.dtype}")
        if x.dim() < 2:
            raise ValueError(f"{name}: x must be [..., H] with H={self.H}, got {tuple(x.shape)}")
        if x.shape[-1] != self.H:
            raise ValueError(f"x has hidden size {x.shape[-1]}, but {name} has {self.H}")
        if x.device != self._materialised():  # before the router reads it
            raise ValueError(f"{name}: x is on {x.device}, the block on {self.w_down.device}")
        if _per_rank(self.backend):  # tokens= is refused by the kernels' check, in its words
            return x.reshape(-1, self.H), None, tokens
        if x.dim() == 3 and x.shape[0] == self.W:
            return x, None, tokens
        if tokens is not None:
            raise ValueError(f"{name}: tokens= goes with x [W={self.W}, T', H]; got {tuple(x.shape)} (use mask=)")
        N = math.prod(x.shape[:-1])
        Tn = -(-N // self.W)
        if Tn > self.T:
            raise ValueError(
                f"{name}: x has {N} tokens, more than the {self.W} ranks x T={self.T} the layer takes in one call"
            )
        flat = F_.pad(x.reshape(N, self.H), (0, 0, 0, self.W * Tn - N))
        counts = [min(Tn, max(0, N - r * Tn)) for r in range(self.W)]
        return flat.reshape(self.W, Tn, self.H), N, (None if N % self.W == 0 else counts)

    def _spread(self, t: torch.Tensor, n: int | None, lead, trail=()) -> torch.Tensor:
        """``t`` (x's shape without H, then ``trail``) laid out as the ranked x's ``lead``: padded
        with zeros (False) from ``n`` tokens when x was."""
        if n is None:
            return t.reshape(*lead, *trail)
        flat = t.reshape(n, *trail)
        pad = flat.new_zeros((math.prod(lead) - n, *trail))
        return torch.cat((flat, pad)).reshape(*lead, *trail)

    def _unspread(self, t: torch.Tensor, n: int | None) -> torch.Tensor:
        """The ranked ``t`` back to the caller's tokens (the padding dropped)."""
        return t if n is None else t.reshape(-1, t.shape[-1])[:n]

    def _mask(self, mask, shape, x: torch.Tensor) -> torch.Tensor:
        """``mask`` checked: x's shape without H, on x's device."""
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(shape[:-1]):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"{layer_prefix(self.layer.spec.name)}: mask must be shaped {tuple(shape[:-1])}, got {got}"
            )
        if mask.device != x.device:
            raise ValueError(f"{layer_prefix(self.layer.spec.name)}: mask is on {mask.device}, x on {x.device}")
        return mask.bool()

    def _logits(self, logits, shape) -> torch.Tensor:
        """The given router ``logits`` checked: x's shape with E for H, on x's device."""
        name = layer_prefix(self.layer.spec.name)
        want = (*shape[:-1], self.E)
        dense(name, "logits", logits)
        if not logits.dtype.is_floating_point:
            raise TypeError(f"{name}: logits must be a floating-point tensor, got {logits.dtype}")
        if tuple(logits.shape) != want:
            raise ValueError(
                f"{name}: logits must be {list(want)} (x's shape, E={self.E} for H), got {tuple(logits.shape)}"
            )
        if logits.device != self.w_down.device:
            raise ValueError(f"{name}: logits is on {logits.device}, the block on {self.w_down.device}")
        return logits

    def _real(self, mask, tokens, x: torch.Tensor) -> torch.Tensor | None:
        """The real tokens, bool shaped like the ranked ``x`` without H; None when every token is."""
        covered = self.kernels.padding(tokens, x.shape[-2])[1]  # checks tokens as the kernels' call does
        if covered is None:
            return mask
        return covered if mask is None else mask & covered

    @property
    def last_stats(self) -> dict | None:
        return None if self._kernels is None else self._kernels.last_stats

    def extra_repr(self) -> str:
        shared = "" if self.shared_act is None else f", shared {self.shared_up.shape[0]} x {self.shared_act}"
        shared += "" if self.shared_gate_proj is None else " (sigmoid-gated)"
        return (
            f"{self.layer.spec.name}: W={self.W} T<={self.T} H={self.H} F={self.F} E={self.E} K={self.K}, "
            f"{self.act}{shared}, {self.backend} on {self.w_down.device}"
        )


def _is_meta(device) -> bool:
    """Whether the block is built on the meta device: ``device="meta"``, or none given inside
    ``with torch.device("meta")``."""
    if device is None:
        return torch.empty(0).device.type == "meta"
    try:
        return torch.device(device).type == "meta"
    except (RuntimeError, TypeError, ValueError):
        return False


def _per_rank(backend: str) -> bool:
    from rdepc.runtime.transport import get

    return get(backend).per_rank


__all__ = ["RDEPMoE"]
