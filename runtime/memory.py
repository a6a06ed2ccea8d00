"""The memory check before a layer allocates anything: free memory where its heap and
private buffers would come from, and the one-line error naming the spec statements that
size them when they do not fit (:func:`check_fits`). Imports neither torch (until asked for
a device's free memory, or the ranks' agreement) nor triton."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from rdepc.diagnostics import UsageError, layer_prefix

if TYPE_CHECKING:
    from rdepc.ir.contract import KernelContract

MEMINFO = "/proc/meminfo"  # where the host's available memory is read (Linux)


def human(n: float) -> str:
    """Bytes in binary units with one decimal: 512 B, 84.5 KiB, 212.4 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def host_available() -> int | None:
    """Bytes the host can hand out without swapping: ``MemAvailable`` (free plus reclaimable
    caches), else the free pages; None where neither is known."""
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_memory(device) -> tuple[int, str] | None:
    """Bytes a new allocation on ``device`` may take, and that figure in words for an error
    message; None where it cannot be known."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # blocks torch's caching allocator holds but no tensor uses: a new tensor reuses them
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free, f"{device} has {human(free)} free"
    avail = host_available()
    return None if avail is None else (avail, f"the host has {human(avail)} available")


class HeapSizeError(UsageError):
    """The layer's symmetric heap and private buffers do not fit the memory they would come
    from (raised by :class:`RDEPModule` before it allocates anything)."""


def heap_span(p: KernelContract, slices: int, inference: bool = False) -> int:
    """Bytes the heap of ``slices`` rank slices spans. The emulated transports' kernels find
    a peer's slice ``HEAP_BYTES`` (``p.heap_bytes``) after the one before; a module built
    for ``inference`` uses the first ``p.forward_bytes`` of each, so the last slice ends
    there. One slice (nvshmem's, per GPU) is then only that."""
    return (slices - 1) * p.heap_bytes + (p.forward_bytes if inference else p.heap_bytes)


def heap_shortfall(p: KernelContract, slices: int, private: int, room: str, inference: bool = False) -> str:
    """Why ``slices`` rank slices of the heap (``inference``: the forward's regions of each)
    plus ``private`` bytes do not fit ``room`` (the memory in words): the heap's regions and
    the spec statements that size them."""
    size = {name: n for name, _, _, n in p.layout}
    payload = size["payload"] + (0 if inference else size["bwd_payload"])
    returned = size["return"] + size["return_ids"]
    returned += 0 if inference else size["bwd_return"] + size["bwd_return_ids"]
    used = p.forward_bytes if inference else p.heap_bytes
    rest = used - payload - returned
    bulk = p.strategy == "bulk"
    r_ret = f"T·K={p.T * p.K}" if bulk else f"B·S={p.B * p.S}"
    passes = "forward only (inference)" if inference else "forward and backward"
    regions = (
        f"payload B={p.B} × S={p.S} rows {human(payload)}, return {r_ret} rows {human(returned)}, "
        f"control, sideband and ids {human(rest)}; {passes}"
    )
    heap = f"{slices} ranks × {human(p.heap_bytes)}" if slices > 1 else "this rank's slice"
    if inference and slices > 1:
        heap = f"{slices} ranks {human(p.heap_bytes)} apart, each using its first {human(used)}"
    span = heap_span(p, slices, inference)
    total = span + private
    if bulk:
        cap = f"capacity {p.capacity}"
        if p.cap_factor is not None:
            num, den = p.cap_factor
            cap += f" {num}" if den == 1 else f" {num}/{den}"
        elif isinstance(p.cap_rows, int):
            cap += f" {p.cap_rows}"
        sizing = (
            f"a bulk schedule moves each owner's rows as one segment, S = the busiest owner's rows ({p.S} with "
            f"{cap}): lower T (tokens {p.T}), set or lower a capacity factor, or move the rows in segments "
            "(segment rows S, buffers B; schedule pipelined)"
        )
    else:
        sizing = (
            f"lower S (segment rows {p.S}), B (segment buffers {p.B}) or T (tokens {p.T}: the front-end's T·K "
            "landing rows follow it)"
        )
    return (
        f"the symmetric heap needs {human(span)} ({heap}: {regions}) and the private buffers "
        f"{human(private)} more, {human(total)} in all, but {room}; {sizing}"
    )


def check_fits(
    p: KernelContract, transport, device, buffers, rank: int | None, inference: bool = False, heap: bool = True
) -> None:
    """Refuse a heap (and private ``buffers``: (name, dtype, shape)) larger than the memory
    they come from (``transport.room``), in one line naming what sizes them, before anything
    is allocated. ``inference``: the heap's forward regions only (:func:`heap_span`);
    ``heap`` false: the module allocates none (it shares another's). On a per-rank transport
    (``rank``: this process's) the ranks agree first: none goes on into the collective
    allocation a peer refused."""
    slices = transport.heap_ranks(p.W)
    private = sum(math.prod(shape) * dt.itemsize for _, dt, shape in buffers)
    room = transport.room(device)
    message = None
    span = heap_span(p, slices, inference) if heap else 0
    if room is not None and span + private > room[0]:
        name = layer_prefix(p.layer) + (f" (rank {rank} of {p.W})" if rank is not None else "")
        if heap:
            message = f"{name}: {heap_shortfall(p, slices, private, room[1], inference)}"
        else:  # the heap is another module's
            message = f"{name}: the private buffers need {human(private)}, but {room[1]}"
    if rank is not None:
        import torch.distributed as dist

        verdicts = [None] * p.W
        dist.all_gather_object(verdicts, message)
        message = next((v for v in verdicts if v), None)
    if message:
        raise HeapSizeError(message)
