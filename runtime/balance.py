"""A layer with ``balance replicate``: the physical layer's module, behind the balance plan.

The kernels are those of the physical layer (``rdepc.passes.replicate``: each of the W·N
redundant slots an expert of its rank). Every call, without a host sync, the load the
router produced (L[src, e]) gives the plan every rank derives (``rdepc.ir.balance``, the
same plan to the row) and each route row its physical expert; the layer's kernels compute
each slot with a copy of the expert it holds this call. Route-row identity, return by id
and the combine are the physical layer's, so the outputs are those of the layer without
replication, bitwise. The backward is the physical layer's; each replica's weight gradient
is added into its home expert's in rank order, so expert gradients equal the layer's
without replication up to the order of that sum.

One process (``emulated``): every rank's loads and weights are at hand; the generated
file's balance kernels count, solve and reroute before the layer's launch
(``rdepc::balance_plan``) and the slots' copies are one gather (:class:`Distribute`). One
process per rank (``emulated-mp``, ``nvshmem``): the layer's own kernel does it all, as
tasks of its graph — each rank's load puts its row of L into every rank's copy of the load
table, each rank's solve derives the plan from its copy, its reroute gives its rows their
physical experts, its push puts its replicated home experts' weights into the slots'
region of the ranks that hold them and its receive copies its N slots into the call's
operand, which the GEMMs read beside the home weights (``rdepc.ir.balance.slot_parts``:
no per-call copy of the home weights) — through a symmetric allocation of the layer's own
(:class:`Exchange`); in the backward replicas hand their weight gradients to the homes,
which sum them in rank order — the same sums as one process, bitwise. The plan and the
gradients' exchange are custom ops (``rdepc::balance_plan``, ``rdepc::balance_grads``,
:mod:`rdepc.runtime.ops`), so ``torch.compile`` captures a replicated layer whole, as it
does any other.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from rdepc.runtime import ops
from rdepc.runtime.heap import local_experts, own_slices
from rdepc.runtime.module import RDEPModule
from rdepc.runtime.records import KernelError
from rdepc.runtime.stats import Readback

from rdepc.ir.balance import COUNTERS, exchange_regions, imbalance, plan_elems, plan_tables, slot_parts
from rdepc.ir.contract import KernelContract


class Distribute(torch.autograd.Function):
    """[E, ...] home weights → [E + W·N, ...] physical weights: the homes', then each slot's
    copy of the expert it holds (an empty slot takes expert 0's: it gets no rows). Backward:
    a home's gradient plus the sum of its replicas', taken in rank order (a fixed order, no
    atomics)."""

    @staticmethod
    def forward(ctx, w, held, replica_of):
        ctx.save_for_backward(replica_of)
        return torch.cat((w, w.index_select(0, held.clamp(min=0))))

    @staticmethod
    def backward(ctx, grad):
        (replica_of,) = ctx.saved_tensors
        homes = replica_of.shape[0]
        slots = torch.cat((grad[homes:], grad.new_zeros((1, *grad.shape[1:]))))  # the last row: no replica
        replicas = torch.zeros_like(grad[:homes])
        for t in range(replica_of.shape[1]):
            replicas += slots.index_select(0, replica_of[:, t])
        return grad[:homes] + replicas, None, None  # as one process per rank sums them (balance_reduce, autograd)


# what an expired wait of the exchange waited for, by the code the device stores (rdepc.codegen.device.balance.settle)
_WAITED = {
    1: "the replicas' gradients",
    2: "the homes' receipt of its slots' gradients",
}


class Exchange:
    """One process per rank: the symmetric allocation the ranks exchange through and what
    counts over its calls — each rank's arrival counters' targets, the error word of its
    waits. Modules of one layer built with ``share`` use one, so a model's replicated layers
    need one allocation, not one each: a rank's loads are put again only once every rank's
    solve has read them (the layer's load waits for the previous call's solves), a slot's
    weights only once its rank's receive has copied them out (its push waits for the
    previous call's receives), and a rank's gradient slots are written again only after
    their homes' receipts (the second counter)."""

    def __init__(self, bal: torch.Tensor, own: torch.Tensor, stride: int, at: dict[str, int], device):
        self.bal, self.own, self.stride, self.at = bal, own, stride, at
        self.expected = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)  # arrivals counted over calls
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.readback = Readback(device)  # natively: the error word on its way to the host


class ReplicatedModule:
    """An RDEPModule for a ``balance replicate`` layer: the same call signatures (home
    experts' weights, expert ids in [0, E)), the physical layer's kernels inside
    (``inner``). ``last_stats`` is the physical layer's, with the per-expert counts summed
    over each expert's instances (one process) or counting this rank's home instances (per
    rank: its slots' rows in ``balance["slot_rows"]``), and ``balance``: the rows per rank
    before and after the plan, their max/mean, and the slot table (the home expert each
    slot held, -1 empty). ``share``: a module of this layer whose heap (``RDEPModule``'s
    ``share``) and, one process per rank, whose :class:`Exchange` this one uses."""

    def __init__(self, contract: KernelContract, kernels_path, share: ReplicatedModule | None = None, **options):
        if share is not None and not isinstance(share, ReplicatedModule):
            raise ValueError(f"{contract.layer}: share takes a module of a balance replicate layer, not {share!r}")
        self.inner = RDEPModule(contract, kernels_path, share=None if share is None else share.inner, **options)
        p = self.contract = contract
        self.slots, self.min_rows = p.balance
        self.homes = p.homes
        i32 = {"dtype": torch.int32, "device": self.device}
        self.owner = torch.tensor(p.owner[: self.homes], **i32)
        self.local_experts = local_experts(p, self.rank)
        self.parts = slot_parts(p.H, p.F, p.gated, p.bias)  # a slot's operands: name -> (offset, elements)
        self._plan: torch.Tensor | None = None  # one process: the last call's plan (per rank: the inner module's)
        self._stats: tuple | None = None  # (the inner module's statistics, the plan, what they make)
        self._launch = self.inner.transport.launcher(self.inner.interpret, concurrent=False)
        self.handle = ops.register(self)
        self.ex: Exchange | None = None
        if self.per_rank:
            self.ex = share.ex if share is not None else self._allocate_exchange()
            self.homes_here = torch.tensor(self.local_experts, dtype=torch.int32, device=self.device)
            self.inner.exchange = (self.ex.bal.view(-1), self.ex.stride)  # the balance tasks'
            self.inner.balanced_by = self.handle
        self._readback = self.ex.readback if self.ex else Readback(self.device)

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
        ws = self._homes(w_gate, w_up, w_down, b_gate, b_up, b_down)
        if self.per_rank:  # the layer's own tasks derive the plan, reroute the rows and push the slots' weights
            y = self.inner.forward(
                x, topk_ids, topk_weights, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, tokens=tokens
            )  # fmt: skip
            return y
        ids, plan = self._plan_call(topk_ids, tokens, x.shape[-2])
        w_gate, w_up, w_down, b_gate, b_up, b_down = self._physical(ws, plan)
        return self.inner.forward(
            x, ids, topk_weights, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, tokens=tokens
        )

    def routed(self, x, topk_ids, topk_weights, w_up, w_down, *, b_up=None, b_down=None, tokens=None) -> torch.Tensor:
        """As :meth:`RDEPModule.routed` (GEMM1's operand as the kernel reads it), home experts' weights."""
        ws = self._homes(w_up, w_down, b_up, b_down)
        if self.per_rank:
            y = self.inner.routed(x, topk_ids, topk_weights, *ws[:2], b_up=b_up, b_down=b_down, tokens=tokens)
            return y
        ids, plan = self._plan_call(topk_ids, tokens, x.shape[-2])
        w_up, w_down, b_up, b_down = self._physical(ws, plan)
        return self.inner.routed(x, ids, topk_weights, w_up, w_down, b_up=b_up, b_down=b_down, tokens=tokens)

    def _homes(self, *weights) -> tuple:
        n = len(self.local_experts)
        for w in weights:
            if w is not None and (w.dim() == 0 or w.shape[0] != n):
                raise ValueError(
                    f"{self.inner._name()}: expert weights and biases are given for its {n} home experts "
                    f"(their first dimension), got {tuple(w.shape)}"
                )
        return weights

    def home_grads(self, summed: torch.Tensor, shapes) -> list[torch.Tensor | None]:
        """The replicas' gradients summed per home expert, [E_loc, P], as the gradients of
        the operands the layer's push tasks put into the slots (GEMM1's, GEMM2's, the
        biases: of ``shapes``; None where there is none)."""
        names, at = ("w_up", "w_down", "b_up", "b_down"), self.parts
        part = {n: summed[:, at[n][0] : at[n][0] + at[n][1]] for n in at}
        return [None if s is None else part[n].reshape(s) for n, s in zip(names, shapes, strict=True)]

    def _physical(self, ws, plan: torch.Tensor) -> list:
        """One process: each given home-expert tensor with its slots' copies after it, for this call's plan."""
        held = self.slot_table(plan).to(torch.int64)
        phys = self.tables(plan)["phys"].to(torch.int64)
        replica_of = torch.where(phys >= self.homes, phys - self.homes, self.contract.W * self.slots)
        return [None if w is None else Distribute.apply(w, held, replica_of) for w in ws]

    def _plan_call(self, topk_ids, tokens, Tn: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One process: each route row's physical expert under this call's plan, and the plan
        (on the device)."""
        p, inner = self.contract, self.inner
        if topk_ids.dim() != 3 or tuple(topk_ids.shape[:-1]) != (p.W, Tn):
            raise ValueError(f"{inner._name()}: topk_ids must be [W={p.W}, T'={Tn}, K], got {tuple(topk_ids.shape)}")
        _, real = inner.padding(tokens, Tn)
        ids = topk_ids.detach().to(device=self.device, dtype=torch.int64)
        if real is not None:
            ids = torch.where(real[..., None], ids, -1)
        return ops.balance_plan(self.handle, ids.contiguous(), Tn)

    def tables(self, plan: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tables of a plan buffer as views (``rdepc.ir.balance.plan_tables``)."""
        at = plan_tables(self.contract.W, self.homes, self.slots)
        return {name: plan.narrow(0, o, math.prod(shape)).view(shape) for name, (o, shape) in at.items()}

    def slot_table(self, plan: torch.Tensor) -> torch.Tensor:
        """The home expert each slot of every rank holds under ``plan``, flat [W·N] (-1 empty)."""
        return self.tables(plan)["slots"].view(-1)

    def _plan_op(self, ids: torch.Tensor, Tn: int) -> list[torch.Tensor]:
        """``rdepc::balance_plan`` (every rank in one process): count the loads, solve, reroute."""
        W, E = self.contract.W, self.homes
        if self.inner._broken:
            raise RuntimeError(self.inner._broken)
        plan = torch.empty(plan_elems(W, E, self.slots), dtype=torch.int32, device=self.device)
        t = self.tables(plan)
        k = self.inner.kernels
        flat = ids if ids.numel() else ids.new_full((1,), -1)
        t["load"].zero_()
        self._run(k.balance_count, (W,), (flat, t["load"], Tn))
        self._run(k.balance_solve, (1,), (t["load"], self.owner, t["phys"], t["cum"], t["slots"], t["loads"]))
        phys_ids = torch.empty_like(flat)
        self._run(k.balance_reroute, (W,), (flat, phys_ids, t["phys"], t["cum"], Tn))
        self._plan = plan
        return [phys_ids[: ids.numel()].view(ids.shape), plan]

    def _grads_op(self, slots: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``rdepc::balance_grads``: hand the slots' gradients ``grad`` [N, P] to their homes;
        each home expert's replicas' gradients, summed in rank order."""
        k, P = self.inner.kernels, grad.shape[1]
        n = len(self.local_experts)
        mine, home = grad.contiguous(), grad.new_zeros((n, P))
        give = (self.ex.bal, self.ex.stride, self.ex.at["grads"], slots, self.owner, mine, P, self.rank)
        self._run(k.balance_give, (self.slots,), give)
        self._await("gradients", slots)
        if n:
            reduce = (self.ex.bal, self.ex.stride, self.ex.at["grads"], slots, self.homes_here, home, P)
            self._run(k.balance_reduce, (n,), reduce)
        self._await("receipts", slots)  # every home has read this rank's gradient slots
        return home

    def _run(self, kernel, grid, args) -> None:
        self._launch([(kernel, grid, args, {})])

    # ------------------------------------------------------------------ one process per rank
    def _allocate_exchange(self) -> Exchange:
        """The symmetric allocation the ranks exchange through (collective;
        :func:`rdepc.ir.balance.exchange_regions`, the planner's figure too)."""
        p = self.contract
        P = p.slot_elems
        elem = torch.empty((), dtype=self.dtype).element_size()
        at, stride = exchange_regions(p.W, self.homes, self.slots, P, elem)
        bal = self.inner.transport.allocate_heap(p.W, stride, self.device)
        return Exchange(bal, own_slices(bal, True, self.rank)[0], stride, at, self.device)

    def _await(self, counter: str, slots: torch.Tensor) -> None:
        args = (
            self.ex.bal,
            self.ex.stride,
            COUNTERS[counter],
            slots,
            self.owner,
            self.ex.expected,
            self.rank,
            self.spin_bound,
            self.ex.err,
        )
        self._run(self.inner.kernels.balance_await, (1,), args)
        self._check_err()

    def _check_err(self) -> None:
        """An expired wait of the exchange: under the interpreter read at once (host memory, no
        sync); natively the word's copy is queued behind the launches and read when it has
        landed — at the next call, at :meth:`synchronize` or when ``last_stats`` is read."""
        if self.inner.interpret:
            self._raise_err(self.ex.err.tolist())
        else:
            self._readback.queue(self.ex.err, None, None, False)

    def _raise_err(self, words: list[int], *_) -> None:
        if not words[0]:
            return
        self._readback.clear()
        what = f"the balance exchange waited {self.spin_bound} spins for {_WAITED[words[0]]} from other ranks"
        # the ranks' arrival counters no longer agree: the layer must be rebuilt on every rank
        self.inner._broken = f"{self.inner._name()}: {what} (this per-rank module is stopped: rebuild it on every rank)"
        raise KernelError(f"{self.inner._name()}: {what}", {"balance_wait": _WAITED[words[0]]})

    def settle(self, wait: bool) -> None:
        """One process per rank: an earlier call's expired exchange wait, raised once its word
        has landed (``wait``: wait for it)."""
        if self.per_rank:
            self._readback.settle(wait, self._raise_err)

    def synchronize(self) -> None:
        """As :meth:`RDEPModule.synchronize`, the exchange's waits included."""
        self.settle(wait=True)
        self.inner.synchronize()

    # ------------------------------------------------------------------ results
    @property
    def last_plan(self) -> dict[str, torch.Tensor] | None:
        """The last call's plan as the device left it: ``load`` [W, E] (rows of each source
        for each expert), ``phys`` [E, W] (physical expert of e's instance on each rank,
        -1: none), ``cum`` [W, E, W] (each source's running split of its rows of e over the
        instances, in rank order), ``slots`` [W, N] (the expert each slot held, -1: empty),
        ``loads`` [2, W] (rows per rank before and after): ``rdepc.ir.balance.plan_tables``."""
        plan = self._last_plan_buffer()
        return None if plan is None else self.tables(plan)

    def _last_plan_buffer(self) -> torch.Tensor | None:
        return self.inner.balance_plan if self.per_rank else self._plan

    @property
    def last_stats(self) -> dict | None:
        self.settle(wait=True)
        st, buffer = self.inner.last_stats, self._last_plan_buffer()
        if st is None or buffer is None:
            return st
        if self._stats is None or self._stats[0] is not st or self._stats[1] is not buffer:  # a new call
            given = st
            st = dict(st)
            plan = self.tables(buffer)
            slots = plan["slots"].cpu()
            before, after = plan["loads"].cpu().tolist()
            bl = {"before": before, "after": after, "imbalance_before": imbalance(before)}
            bl |= {"imbalance_after": imbalance(after), "slots": slots}
            for key in ("rows_per_expert", "received_per_expert", "dropped_per_expert"):
                v = st[key]
                if self.per_rank:  # this rank's instances: its home experts', then its slots'
                    n = len(self.local_experts)
                    st[key], bl[f"slot_{key.removesuffix('_per_expert')}"] = v[:n], v[n:]
                    continue
                held = slots.reshape(-1)
                folded = v[: self.homes].clone()
                folded.index_add_(0, held.clamp(min=0), torch.where(held >= 0, v[self.homes :], 0).to(v.dtype))
                st[key] = folded
            st["balance"] = bl
            self._stats = (given, buffer, st)
        return self._stats[2]

    def __repr__(self) -> str:
        return f"<rdepc balance replicate (N={self.slots}, U={self.min_rows}) over {self.inner!r}>"


def layer_module(contract: KernelContract, kernels_path, **options):
    """The module of a compiled layer: a :class:`ReplicatedModule` when it replicates, else an RDEPModule."""
    if contract.balance[0]:
        return ReplicatedModule(contract, kernels_path, **options)
    return RDEPModule(contract, kernels_path, **options)


def load_compiled(contract_path: str | Path, kernels_path: str | Path, **options):
    """The module of a compiled layer directory (``rdepc compile FILE -o DIR``): an
    RDEPModule, or a :class:`ReplicatedModule` for a ``balance replicate`` layer."""
    contract = KernelContract.from_json(Path(contract_path).read_text(encoding="utf-8"))
    return layer_module(contract, kernels_path, **options)


__all__ = ["Distribute", "Exchange", "ReplicatedModule", "layer_module", "load_compiled"]
