"""Transports: who owns put, signal, wait and their memory scope.

A transport has two halves. Its *device* half is Triton source the code generator pastes
into every generated kernel file: four ``@triton.jit`` functions with one contract, so the
kernel body is the same whatever moves the bytes —

``peer(heap, rank)``
    the base address of ``rank``'s slice of the symmetric heap (a ``uint8`` pointer; the
    kernel adds the memory plan's byte offsets and casts to typed views);
``put(ptr, value, mask)``
    a store into a peer's slice (or one's own);
``signal(flag)``
    release one unit on a done flag: every store the program made before is visible to
    whoever acquires it;
``wait(flag, target, bound)``
    acquire-spin until ``flag >= target`` or ``bound`` spins have passed; returns the value
    last seen (``>= target`` when reached), which an expired wait reports.

Its *host* half allocates the heap. Only ``emulated`` exists today:

``emulated``
    One process holds all W ranks. The symmetric heap is one ``uint8`` tensor
    ``[W, heap_bytes]`` laid out by the memory plan; a peer's slice is ``heap + rank ·
    heap_bytes`` (int64: slices may exceed 2 GiB), a put is a plain store into it, a
    signal an integer atomic with release semantics after a ``tl.debug_barrier()`` (a
    scalar atomic is executed by one thread and would not order the other warps' stores),
    a wait an acquire spin followed by a barrier. Memory scope ``gpu``: every rank is on
    the same device. Runs under ``TRITON_INTERPRET=1`` on a CPU and natively on one GPU.

The later ``nvshmem`` backend keeps the contract with ``peer`` as ``nvshmem_ptr`` (NVLink
peers are load/store addressable), signals and waits at system scope or through
``nvshmemx_signal_op`` / ``nvshmem_signal_wait_until``, one process per rank. This module
imports neither torch nor triton at import time.
"""

from __future__ import annotations

from dataclasses import dataclass

EMULATED_DEVICE = '''
# ---------------------------------------------------------------------------------------
# Transport: emulated. One process holds all W ranks; the symmetric heap is one uint8
# tensor [W, HEAP_BYTES]; a put is a store into a peer's slice, a signal a release atomic.
# ---------------------------------------------------------------------------------------
SCOPE = tl.constexpr("gpu")  # memory scope of signals and waits: every rank on one device


@triton.jit
def peer(heap, rank):
    """Base of rank ``rank``'s slice of the symmetric heap (int64: slices may exceed 2 GiB)."""
    return heap + tl.cast(rank, tl.int64) * HEAP_BYTES


@triton.jit
def put(ptr, value, mask):
    """A store into a peer's slice of the heap (or our own)."""
    tl.store(ptr, value, mask=mask)


@triton.jit
def signal(flag):
    """Release one unit on ``flag``. The barrier comes first: a scalar atomic is executed by
    one thread, so without it the other warps' stores would not be ordered before it."""
    tl.debug_barrier()
    tl.atomic_add(flag, 1, sem="release", scope=SCOPE)


@triton.jit
def wait(flag, target, bound):
    """Acquire-spin until ``flag`` >= ``target``, at most ``bound`` spins; the value last
    seen. The barrier after it lets every warp of the program see what the acquire made
    visible."""
    seen = tl.atomic_add(flag, 0, sem="acquire", scope=SCOPE)
    spins = 0
    while (seen < target) & (spins < bound):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope=SCOPE)
        spins += 1
    tl.debug_barrier()
    return seen
'''


@dataclass(frozen=True)
class Transport:
    """The interface: a name, the memory scope of its signals, its device source (the four
    functions above) and, on the host, the symmetric heap it allocates."""

    name: str
    scope: str
    device_source: str
    processes: str  # "one" (all ranks in one process) or "per-rank"

    def allocate_heap(self, W: int, heap_bytes: int, device):
        raise NotImplementedError(f"transport {self.name}: no host side yet")


@dataclass(frozen=True)
class Emulated(Transport):
    name: str = "emulated"
    scope: str = "gpu"
    device_source: str = EMULATED_DEVICE
    processes: str = "one"

    def allocate_heap(self, W: int, heap_bytes: int, device):
        """The symmetric heap of all W ranks: one zeroed uint8 tensor [W, heap_bytes]."""
        import torch

        return torch.zeros((W, heap_bytes), dtype=torch.uint8, device=device)


TRANSPORTS: dict[str, Transport] = {"emulated": Emulated()}
PLANNED = ("emulated-mp", "nvshmem")  # named by ARCHITECTURE.md, not built yet


def get(name: str) -> Transport:
    """The transport called ``name``; a clear error for the planned ones not built yet."""
    if name in TRANSPORTS:
        return TRANSPORTS[name]
    if name in PLANNED:
        raise NotImplementedError(
            f"not supported yet: the '{name}' backend (rdepc runs the emulated backend today: "
            "module(backend='emulated'))"
        )
    raise ValueError(f"unknown backend '{name}' (known: {', '.join([*TRANSPORTS, *PLANNED])})")


__all__ = ["PLANNED", "TRANSPORTS", "Emulated", "Transport", "get"]
