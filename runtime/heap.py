"""What a module allocates on its device, and where it reads and resets in it: the private
buffers (their sizes per process), the task tables a launch reads, the placeholders for the
other pass's pointers, the heap regions the host touches (done flags, published offsets) and
the per-owner row buffers of the backward. The symmetric heap itself comes from the
transport (``Transport.allocate_heap``); the check that all of it fits comes first
(``rdepc.runtime.memory.check_fits``)."""

from __future__ import annotations

import torch
from rdepc.runtime.tensors import INT_DTYPES, TORCH_DTYPES

from rdepc.ir.arguments import BACKWARD_PRIVATE, KERNELS, POINTEE, kernel_args
from rdepc.ir.contract import KernelContract, Work, queue_records
from rdepc.ir.sizes import kept_columns


def private_buffers(
    contract: KernelContract, per_rank: bool, inference: bool = False
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The plan's private buffers as this process allocates them: (name, dtype, shape);
    ``inference``: the forward's only (not ``BACKWARD_PRIVATE``)."""
    out = []
    for name, dt, shape in contract.private:
        if inference and name in BACKWARD_PRIVATE:
            continue
        if per_rank and name not in ("ctl", "bwd_ctl"):  # [W, ...] buffers: only this rank's row
            shape = (1, *shape[1:])
        out.append((name, TORCH_DTYPES.get(dt) or INT_DTYPES[dt], tuple(shape)))
    return out


# The private words a call counts in over calls, which the heap's done flags are read against:
# modules that share a heap (RDEPModule's ``share``) share them.
SHARED_COUNTERS = ("ctl", "tile_done", "bwd_ctl", "bwd_tile_done")
NO_BACKWARD = "it runs no backward; call it under torch.no_grad(), or build it without inference=True"


def check_sharing(module, other) -> None:
    """Refuse, in one line naming what differs, a module that would share ``other``'s heap:
    both must run the same layer on the same backend and device with the same work (the done
    flags' targets and the tickets follow the work items and the programs), and ``other``
    must hold every region ``module`` uses (a training module's backward regions)."""
    name = module._name()
    if type(other) is not type(module):
        raise ValueError(f"{name}: share takes an RDEPModule, not {type(other).__name__}")
    what = {"layer": "contract", "backend": "transport", "device": "device", "mode": "mode", "tiles": "tiles"}
    what["programs"] = "per_queue"
    for label, attr in what.items():
        if getattr(module, attr) != getattr(other, attr):
            raise ValueError(f"{name}: cannot share the heap of a module of another {label}")
    if other.inference and not module.inference:
        raise ValueError(f"{name}: cannot share the heap of a module built with inference=True")


def allocate_private(buffers, profile_words: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The private buffers, zeroed, and the ``profile`` buffer of ``profile_words`` int64."""
    private = {name: torch.zeros(shape, dtype=dt, device=device) for name, dt, shape in buffers}
    private["profile"] = torch.zeros(profile_words, dtype=torch.int64, device=device)
    return private


def task_tables(
    contract: KernelContract, work: Work, bwd_work: Work, per_queue, per_rank: bool, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The int32 tables a launch reads: the forward's (its task table and queues — per queue
    its first and last positions and its programs, ``per_queue`` —, the ownership and
    capacity tables), and those the backward's launch replaces."""
    p = contract

    def i32(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32, device=device)

    def queued(work, deps) -> dict[str, torch.Tensor]:
        return {
            "table": i32(v for row in work.table for v in row),
            "deps": i32(deps or (0,)),
            "queue": i32(work.queue),
            "queue_pos": i32(work.positions()),
            "first_item": i32(work.first_item),
            "queues": i32(queue_records(work, per_queue)),
        }

    bwd_tables = queued(bwd_work, p.bwd_deps)
    tables = queued(work, p.deps) | {
        "owner_of": i32(p.owner),
        "local_of": i32(p.local),
        "n_local": i32(p.n_local),
        "weight_of": i32(p.weight_of if not per_rank else per_rank_weights(p)),
        "order": i32(p.order),
        "owner_first": i32(p.owner_first),
        "rows_max": i32(p.rows_max),
        "caps": i32(p.caps()),
        "m_slots": i32(work.m_slots),  # m-tile slots per segment of each owner: the scan's m-tile table
    }
    return tables, bwd_tables


def local_experts(contract: KernelContract, rank: int | None, slots: bool = False) -> tuple[int, ...]:
    """The global ids of the experts whose weights a module's forward takes, in that order:
    rank ``rank``'s experts in local order (a per-rank module); with None every expert. A
    ``balance replicate`` layer's slots hold copies, not experts of their own: they count
    only with ``slots`` (what its physical layer's launches take)."""
    n = contract.E if slots else contract.homes
    if rank is None:
        return tuple(range(n))
    return tuple(sorted((e for e in range(n) if contract.owner[e] == rank), key=lambda e: contract.local[e]))


def per_rank_weights(p: KernelContract) -> list[int]:
    """``weight_of`` [W, E_MAX] one process per rank, which holds its own experts only: the
    weights by local index; where the kernels read redundant slots in place
    (``KernelContract.slots_in_place``), a rank's last N locals are its slots, slot j as -(j + 1)."""
    homes = [n - p.slots_in_place for n in p.n_local]
    return [-(i - homes[q] + 1) if homes[q] <= i < p.n_local[q] else i for q in range(p.W) for i in range(p.E_MAX)]


def placeholders(contract: KernelContract, device: torch.device) -> dict[str, torch.Tensor]:
    """What a launch passes for the other pass's pointers, by pointer type: never read, but of
    the declared type, which Triton's signature (and so the build a launch runs) takes from
    the argument."""
    return {
        kind: torch.zeros(1, dtype=getattr(torch, POINTEE[kind[1:]]), device=device)
        for kernel in KERNELS
        for _, kind in kernel_args(contract, kernel)
        if kind.startswith("*")
    }


def regions(contract: KernelContract) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """The heap words the host touches, as (start, end) or (offset, size): the forward's and
    the backward's done flags (offset, size; zeroed after a kernel error), and the words the
    backward reads from a rank's own slice (start, end): the offsets and admitted counts its
    owners published to it (adjacent buffers)."""
    sizes = {name: (at, size) for name, _, at, size in contract.layout}
    published = (sizes["offsets"][0], sizes["admitted"][0] + sizes["admitted"][1])
    return sizes["flags"], sizes["bwd_flags"], published


def owned_ranks(heap_shape, per_rank: bool) -> int:
    """How many ranks' heap slices this process owns (the rows of :func:`own_slices`), from
    the shape alone: a fake heap under torch.compile cannot be sliced."""
    return 1 if per_rank else heap_shape[0]


def own_slices(heap: torch.Tensor, per_rank: bool, rank: int | None) -> torch.Tensor:
    """The heap slices this process owns, [owned_ranks, heap_bytes]."""
    if not per_rank:
        return heap
    return heap.view(1, -1) if heap.dim() == 1 else heap[rank : rank + 1]


def owner_row_block(contract: KernelContract, per_rank: bool, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[owners, R_max, cols] rows in the layer's dtype, one block per owner this process
    runs: where the owners' rows sit for the backward, at their places among their rows."""
    owners = 1 if per_rank else contract.W
    return torch.empty((owners, contract.R_MAX, cols), dtype=dtype, device=device)


def owner_row_buffers(contract: KernelContract, backward: bool) -> dict[str, int]:
    """The owner-row buffers (:func:`owner_row_block`) a call keeping what backward walks
    allocates (``sizes.kept_columns``: saved_x unless sent again, saved_pre unless recomputed,
    and under dedup saved_out) or, with ``backward``, its backward (dh, act_rows, do_rows, and
    saved_x when the backward's dispatch sends the input rows again): name -> columns."""
    p = contract
    if backward:
        return {"dh": 2 * p.F if p.gated else p.F, "act_rows": p.F, "do_rows": p.H} | (
            {"saved_x": p.H} if p.resend else {}
        )
    return kept_columns(p.H, p.F, p.gated, p.recompute, p.resend) | ({"saved_out": p.H} if p.dedup else {})


def keeps_outputs(contract: KernelContract) -> bool:
    """Whether a call keeping what backward walks keeps each accepted slot's expert output at
    its front-end (``saved_out`` [T', K, H]) for the gate gradient: not under dedup (the owners
    keep them) nor when the gate scales the expert's input (its gradient reads x)."""
    return not contract.dedup and not contract.gate_input


def reset_control(private: dict, heap: torch.Tensor, flags: tuple[int, int], backward: bool) -> None:
    """After a kernel error in one process: the pass's control words, tile counters and done
    flags (``flags``: offset, size) zeroed. The programs stopped early, their tickets and
    flags off the count: the next call starts afresh, never on stale flags."""
    pre = "bwd_" if backward else ""
    private[pre + "ctl"].zero_()
    private[pre + "tile_done"].zero_()
    at, size = flags
    heap[:, at : at + size] = 0


__all__ = [
    "NO_BACKWARD",
    "SHARED_COUNTERS",
    "allocate_private",
    "check_sharing",
    "keeps_outputs",
    "local_experts",
    "own_slices",
    "owner_row_block",
    "owner_row_buffers",
    "placeholders",
    "private_buffers",
    "regions",
    "reset_control",
    "task_tables",
]
