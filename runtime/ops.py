"""The layer's forward and backward as ``torch.library`` custom ops, so that ``torch.compile``
(``fullgraph=True`` included) captures a model with RDEP layers without a graph break.

    rdepc::forward(handle, x, topk_ids, gates, w_up, w_down, b_up, b_down, brought, save)
        -> [y, accepted, slot, gprime, (phys_ids, plan), *kept]
    rdepc::backward(handle, dy, x, topk_ids, accepted, slot, gprime, w_up, w_down, b_up, slots, kept)
        -> [dx, dgprime, dw_up, dw_down, (db_up, db_down), (dslots)]

``handle`` names the :class:`rdepc.runtime.RDEPModule` whose heap, task tables and kernels
the call uses (an int: what a graph can hold; the registry keeps no module alive). ``w_up``
is GEMM1's operand as the kernel reads it (a gated expert's gate and up interleaved,
[E, H, F, 2]); ``b_up`` and ``b_down`` its expert biases (None unless the spec's experts
have them; ``b_up`` laid out as GEMM1's columns, [E, F, 2] when gated). A replicated
layer one process per rank (``KernelContract.slots_in_place``) takes home experts' ids and
weights: its kernel's tasks derive the call's plan, reroute the rows and fill this rank's
redundant slots, and the forward returns the rows' physical ids (what the backward walks)
and the plan (``rdepc.ir.balance.plan_tables``), and keeps the slots' packed operands
[N, P] (``rdepc.ir.balance.slot_parts``) as ``slots``, whose gradient ``dslots`` the
backward returns and the replicas' exchange takes home (``rdepc::balance_grads``); the backward's
``x`` the forward's input (None unless ``KernelContract.backward_reads_x``). With ``save``
the forward also returns what the backward walks: the routing context (the accepted set,
each slot's place at its owner, g') and ``kept`` (the owners' rows, the routing tables, the
slots; :func:`kept_layout`). The ops are opaque to the compiler:
their fake (meta) implementations give only the outputs' shapes, from the module, and their
real ones run exactly what an eager call runs, so compiled results equal eager ones bitwise.

Autograd is registered on ``rdepc::forward``: its backward calls ``rdepc::backward`` and
takes dL/dg' through the capacity weights policy (:func:`rdepc.runtime.autograd.gate_grad`,
torch ops the compiler traces). The ops keep the module's state beside the graph (its heap,
its control words, ``last_stats``): they are not functional, and a graph must not reorder
two calls of one layer, which their data dependencies already forbid.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from rdepc.runtime.autograd import gate_grad
from rdepc.runtime.heap import keeps_outputs, owned_ranks, owner_row_buffers
from torch import Tensor

from rdepc.ir.balance import plan_elems

_MODULES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(module) -> int:
    """A new handle for ``module`` (held weakly)."""
    handle = next(_HANDLES)
    _MODULES[handle] = module
    return handle


def module_of(handle: int):
    module = _MODULES.get(handle)
    if module is None:
        raise RuntimeError(f"rdepc layer handle {handle}: its module no longer exists")
    return module


@torch.library.custom_op("rdepc::forward", mutates_args=())
def forward(
    handle: int,
    x: Tensor,
    topk_ids: Tensor,
    gates: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    b_up: Tensor | None,
    b_down: Tensor | None,
    brought: Tensor,
    save: bool,
) -> list[Tensor]:
    return module_of(handle)._forward_op(x, topk_ids, gates, w_up, w_down, b_up, b_down, brought, save)


@forward.register_fake
def _forward_fake(handle, x, topk_ids, gates, w_up, w_down, b_up, b_down, brought, save):
    layout = forward_layout(module_of(handle), x.shape[-2], save)
    return [torch.empty(shape, dtype=dtype, device=x.device) for _, shape, dtype in layout]


@torch.library.custom_op("rdepc::backward", mutates_args=())
def backward(
    handle: int,
    dy: Tensor,
    x: Tensor | None,
    topk_ids: Tensor,
    accepted: Tensor,
    slot: Tensor,
    gprime: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    b_up: Tensor | None,
    slots: Tensor | None,
    kept: list[Tensor],
) -> list[Tensor]:
    return module_of(handle)._backward_op(dy, x, topk_ids, accepted, slot, gprime, w_up, w_down, b_up, slots, kept)


@backward.register_fake
def _backward_fake(handle, dy, x, topk_ids, accepted, slot, gprime, w_up, w_down, b_up, slots, kept):
    module = module_of(handle)
    new = {"dtype": module.dtype, "device": dy.device}
    dgprime = torch.empty((*dy.shape[:-1], module.contract.K), dtype=torch.float32, device=dy.device)
    shapes = [w_up.shape, w_down.shape]
    if module.contract.bias:
        shapes += [(w_up.shape[0], *w_up.shape[2:]), (w_down.shape[0], module.contract.H)]
    shapes += [] if slots is None else [slots.shape]
    return [torch.empty(dy.shape, **new), dgprime] + [torch.empty(s, **new) for s in shapes]


def forward_layout(module, Tn: int, save: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of ``rdepc::forward``'s outputs at T' = ``Tn``: y, the routing
    context (a replicated layer one process per rank: the rows' physical ids and the plan
    too) and, with ``save``, :func:`kept_layout`."""
    p = module.contract
    lead = () if module.per_rank else (p.W,)
    out = [
        ("y", (*lead, Tn, p.H), module.dtype),
        ("accepted", (*lead, Tn, p.K), torch.bool),
        ("slot", (*lead, Tn, p.K), torch.int32),
        ("gprime", (*lead, Tn, p.K), torch.float32),
    ]
    if p.slots_in_place:
        out += [
            ("phys_ids", (Tn, p.K), torch.int64),
            ("plan", (plan_elems(p.W, p.homes, p.slots_in_place),), torch.int32),
        ]
    return out + (kept_layout(module, Tn) if save else [])


def kept_layout(module, Tn: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What a forward keeps for its backward, in order: the owners' rows (input,
    pre-activations; the expert outputs at the front-ends, or under dedup at the owners; none
    when the gate is on the expert's input), the offsets its owners published, the routing
    tables, and a replicated layer's copy of its slots one process per rank (a later call
    may refill them before this backward runs)."""
    p = module.contract
    lead = () if module.per_rank else (p.W,)
    owners = 1 if module.per_rank else p.W
    out = [(name, (owners, p.R_MAX, cols), module.dtype) for name, cols in owner_row_buffers(p, False).items()]
    if keeps_outputs(p):
        out.append(("saved_out", (*lead, Tn, p.K, p.H), module.dtype))
    lo, hi = module._published
    out.append(("published", (owned_ranks(module.heap.shape, module.per_rank), hi - lo), module.heap.dtype))
    out += [(n, tuple(module.private[n].shape), module.private[n].dtype) for n in module._routing_tables()]
    return out + ([("slots", (p.slots_in_place, p.slot_elems), module.dtype)] if p.slots_in_place else [])


def _setup_context(ctx, inputs, output) -> None:
    handle, x, topk_ids, gates, w_up, w_down, b_up, _b_down, _brought, save = inputs
    contract = module_of(handle).contract
    ctx.handle, ctx.saved, ctx.planned = handle, save, bool(contract.slots_in_place)
    x = x if contract.backward_reads_x else None
    ctx.save_for_backward(x, topk_ids, gates, w_up, w_down, b_up, *output[1:])  # b_up: recomputed pre-activations


def _forward_backward(ctx, grads):
    if not ctx.saved:
        raise RuntimeError("rdepc::forward ran without save=True: it kept nothing for a backward")
    x, topk_ids, gates, w_up, w_down, b_up, accepted, slot, gprime, *kept = ctx.saved_tensors
    module = module_of(ctx.handle)
    dy = grads[0]
    plan = None
    if ctx.planned:  # the rows' physical ids the forward's reroute gave them, and its plan
        topk_ids, plan, *kept = kept
    slots = None if plan is None else kept[-1]
    dx, dgprime, dw_up, dw_down, *rest = backward(
        ctx.handle, dy, x, topk_ids, accepted, slot, gprime, w_up, w_down, b_up, slots, kept
    )
    to_expert = (topk_ids >= 0) & (topk_ids < module.contract.E)
    dgates = gate_grad(gates, accepted, dgprime, module.contract.weights, to_expert).to(gates.dtype)
    homes = [dw_up, dw_down, *(rest[:2] if module.contract.bias else (None, None))]
    if plan is not None:  # each home expert's gradient, plus its replicas' summed in rank order
        replicated = module_of(module.balanced_by)
        summed = balance_grads(replicated.handle, replicated.slot_table(plan), rest[-1])
        parts = replicated.home_grads(summed, [None if g is None else g.shape for g in homes])
        homes = [g if r is None else g + r for g, r in zip(homes, parts, strict=True)]
    return None, dx, None, dgates, *homes, None, None


forward.register_autograd(_forward_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------- balance replicate
# A replicated layer (rdepc.runtime.balance) adds its plan and, one process per rank, the
# exchange of its slots' gradients: launches of its own around the layer's, opaque to the
# compiler too.


@torch.library.custom_op("rdepc::balance_plan", mutates_args=())
def balance_plan(handle: int, ids: Tensor, Tn: int) -> list[Tensor]:
    """With every rank in one process, this call's plan from the route rows' expert ids (-1:
    none): [physical ids, the plan] (``rdepc.ir.balance.plan_tables``; one process per rank
    the layer's own kernel derives it)."""
    return module_of(handle)._plan_op(ids, Tn)


@balance_plan.register_fake
def _balance_plan_fake(handle, ids, Tn):
    module = module_of(handle)
    n = plan_elems(module.contract.W, module.homes, module.slots)
    return [torch.empty(ids.shape, dtype=torch.int64, device=ids.device), ids.new_empty((n,), dtype=torch.int32)]


@torch.library.custom_op("rdepc::balance_grads", mutates_args=())
def balance_grads(handle: int, slots: Tensor, grad: Tensor) -> Tensor:
    """In a replicated layer's backward, one process per rank: this rank's slots' gradients
    [N, P] handed to their homes; each home expert's replicas' gradients summed in rank
    order, [E_loc, P] (zeros for an expert no slot held)."""
    return module_of(handle)._grads_op(slots, grad)


@balance_grads.register_fake
def _balance_grads_fake(handle, slots, grad):
    return grad.new_empty((module_of(handle).homes_here.shape[0], grad.shape[1]))


__all__ = [
    "backward",
    "balance_grads",
    "balance_plan",
    "forward",
    "forward_layout",
    "kept_layout",
    "module_of",
    "register",
]
