"""A layer with ``balance replicate``: the physical layer's module, behind the balance plan.

The kernels are those of the physical layer (``rdepc.passes.replicate``: each of the W·N
redundant slots an expert of its rank). Every call, before the layer's launch and without a
host sync, the generated file's balance kernels count the load the router produced
(L[src, e]), solve the plan every rank would derive (``rdepc.ir.balance``, the same plan to
the row) and give each route row its physical expert; the weights the layer launches with
are the home experts' followed by each slot's copy of the expert it holds this call (one
gather). Route-row identity, return by id and the combine are the physical layer's, so the
outputs are those of the layer without replication, bitwise. The backward is the physical
layer's; each replica's weight gradient is added into its home expert's in rank order
(:class:`Distribute`), so expert gradients equal the layer's without replication up to the
order of that sum.

One process holds every rank (the ``emulated`` backend): the per-rank backends would need
the count exchange and the weight distribution between processes, which are not built.
"""

from __future__ import annotations

import torch
from rdepc.runtime.launch import Launcher
from rdepc.runtime.module import RDEPModule

from rdepc.ir.balance import imbalance
from rdepc.ir.contract import KernelContract


class Distribute(torch.autograd.Function):
    """[E, ...] home weights → [E + W·N, ...] physical weights: the homes', then each slot's
    copy of the expert it holds (an empty slot takes expert 0's: it gets no rows). Backward:
    a home's gradient plus its replicas', in rank order (a fixed order, no atomics)."""

    @staticmethod
    def forward(ctx, w, held, replica_of):
        ctx.save_for_backward(replica_of)
        return torch.cat((w, w.index_select(0, held.clamp(min=0))))

    @staticmethod
    def backward(ctx, grad):
        (replica_of,) = ctx.saved_tensors
        homes = replica_of.shape[0]
        slots = torch.cat((grad[homes:], grad.new_zeros((1, *grad.shape[1:]))))  # the last row: no replica
        dw = grad[:homes].clone()
        for t in range(replica_of.shape[1]):
            dw += slots.index_select(0, replica_of[:, t])
        return dw, None, None


class ReplicatedModule:
    """An RDEPModule for a ``balance replicate`` layer: the same call signatures (home
    experts' weights [E, ...], expert ids in [0, E)), the physical layer's kernels inside
    (``inner``). ``last_stats`` is the physical layer's, with the per-expert counts summed
    over each expert's instances, and ``balance``: the rows per rank before and after the
    plan, their max/mean, and the slot table (the home expert each slot held, -1 empty)."""

    def __init__(self, contract: KernelContract, kernels_path, **options):
        self.inner = RDEPModule(contract, kernels_path, **options)
        if self.inner.per_rank:
            raise ValueError(
                f"rdepc layer {contract.layer}: balance replicate runs on the emulated backend (one process holds "
                f"every rank); on {self.inner.transport.name} the ranks would exchange their loads and the replicas' "
                "weights between processes, which is not built yet"
            )
        p = contract
        self.contract = p
        self.slots, self.min_rows = p.balance
        self.homes = p.homes
        self.owner = torch.tensor(p.owner[: self.homes], dtype=torch.int32, device=self.inner.device)
        self._plan: dict[str, torch.Tensor] | None = None
        self._stats: dict | None = None
        self._launch = Launcher(self.inner.interpret)  # its own: the layer's launches are counted apart

    def __getattr__(self, name: str):  # the rest of RDEPModule's surface: the physical layer's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def routed_by(self) -> str | None:
        return self.inner.routed_by

    @routed_by.setter
    def routed_by(self, value: str | None) -> None:
        self.inner.routed_by = value

    # ------------------------------------------------------------------ the call
    def __call__(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, **kw):
        return self.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, **kw)

    def forward(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None,
                tokens=None) -> torch.Tensor:  # fmt: skip
        """As :meth:`RDEPModule.forward`, with the home experts' weights."""
        self._check_homes(w_gate, w_up, w_down, b_gate, b_up, b_down)
        ids, place = self._plan_call(topk_ids, tokens, x.shape[-2])
        return self.inner.forward(
            x, ids, topk_weights, *(place(w) for w in (w_gate, w_up, w_down)),
            b_gate=place(b_gate), b_up=place(b_up), b_down=place(b_down), tokens=tokens,
        )  # fmt: skip

    def routed(self, x, topk_ids, topk_weights, w_up, w_down, *, b_up=None, b_down=None, tokens=None) -> torch.Tensor:
        """As :meth:`RDEPModule.routed` (GEMM1's operand as the kernel reads it), home experts' weights."""
        self._check_homes(None, w_up, w_down, None, b_up, b_down)
        ids, place = self._plan_call(topk_ids, tokens, x.shape[-2])
        return self.inner.routed(
            x, ids, topk_weights, place(w_up), place(w_down), b_up=place(b_up), b_down=place(b_down), tokens=tokens
        )

    def _check_homes(self, *weights) -> None:
        for w in weights:
            if w is not None and (w.dim() == 0 or w.shape[0] != self.homes):
                raise ValueError(
                    f"rdepc layer {self.contract.layer}: expert weights and biases are given for its {self.homes} "
                    f"experts (their first dimension), got {tuple(w.shape)}"
                )

    def _plan_call(self, topk_ids, tokens, Tn: int):
        """This call's plan, on the device: the physical expert of every route row and the
        function that gives a home-expert tensor its slots' copies."""
        p, inner = self.contract, self.inner
        W, E, N = p.W, self.homes, self.slots
        dev = inner.device
        if topk_ids.dim() != 3 or topk_ids.shape[:2] != (W, Tn):
            raise ValueError(f"{inner._name()}: topk_ids must be [W={W}, T'={Tn}, K], got {tuple(topk_ids.shape)}")
        _, real = inner.padding(tokens, Tn)
        ids = topk_ids.detach().to(device=dev, dtype=torch.int64)
        if real is not None:
            ids = torch.where(real[..., None], ids, -1)
        ids = ids.contiguous()
        i32 = {"dtype": torch.int32, "device": dev}
        plan = {
            "load": torch.zeros((W, E), **i32),
            "phys": torch.empty((E, W), **i32),
            "cum": torch.empty((W, E, W), **i32),
            "slots": torch.empty((W, N), **i32),
            "loads": torch.empty((2, W), **i32),
        }
        phys_ids = torch.empty_like(ids)
        k = inner.kernels
        n = max(Tn, 0)
        flat = ids if ids.numel() else ids.new_full((1,), -1)
        out = phys_ids if ids.numel() else ids.new_empty((1,))
        self._launch([(k.balance_count, (W,), (flat, plan["load"], n), {})])
        solve = (plan["load"], self.owner, plan["phys"], plan["cum"], plan["slots"], plan["loads"])
        self._launch([(k.balance_solve, (1,), solve, {})])
        self._launch([(k.balance_reroute, (W,), (flat, out, plan["phys"], plan["cum"], n), {})])
        self._plan, self._stats = plan, None
        held = plan["slots"].reshape(-1).to(torch.int64)
        # replica_of[e, t]: the slot (0..W·N-1) holding e on rank t, W·N where t holds none
        phys = plan["phys"].to(torch.int64)
        replica_of = torch.where(phys >= E, phys - E, W * N)

        def place(w):
            return None if w is None else Distribute.apply(w, held, replica_of)

        return phys_ids.to(topk_ids.dtype) if topk_ids.dtype == torch.int32 else phys_ids, place

    # ------------------------------------------------------------------ results
    @property
    def last_plan(self) -> dict[str, torch.Tensor] | None:
        """The last call's plan as the device left it: ``load`` [W, E] (rows of each source
        for each expert), ``phys`` [E, W] (physical expert of e's instance on each rank,
        -1: none), ``cum`` [W, E, W] (each source's running split of its rows of e over the
        instances, in rank order), ``slots`` [W, N] (the expert each slot held, -1: empty),
        ``loads`` [2, W] (rows per rank before and after)."""
        return self._plan

    @property
    def last_stats(self) -> dict | None:
        st = self.inner.last_stats
        if st is None or self._plan is None:
            return st
        if self._stats is None:
            st = dict(st)
            slots = self._plan["slots"].reshape(-1).cpu()
            for key in ("rows_per_expert", "received_per_expert", "dropped_per_expert"):
                v = st[key]
                folded = v[: self.homes].clone()
                folded.index_add_(0, slots.clamp(min=0), torch.where(slots >= 0, v[self.homes :], 0).to(v.dtype))
                st[key] = folded
            before, after = self._plan["loads"].cpu().tolist()
            st["balance"] = {
                "before": before,
                "after": after,
                "imbalance_before": imbalance(before),
                "imbalance_after": imbalance(after),
                "slots": self._plan["slots"].cpu(),
            }
            self._stats = st
        return self._stats

    def __repr__(self) -> str:
        return f"<rdepc balance replicate (N={self.slots}, U={self.min_rows}) over {self.inner!r}>"


def layer_module(contract: KernelContract, kernels_path, **options):
    """The module of a compiled layer: a :class:`ReplicatedModule` when it replicates, else an RDEPModule."""
    if contract.balance[0]:
        return ReplicatedModule(contract, kernels_path, **options)
    return RDEPModule(contract, kernels_path, **options)


__all__ = ["Distribute", "ReplicatedModule", "layer_module"]
