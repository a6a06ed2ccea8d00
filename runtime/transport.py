"""Transports, host half: how many processes hold the ranks, and where the heap lives.

A transport has two halves. Its *device* half — ``peer``, ``put``, ``signal``, ``wait`` — is
written into every generated kernel file by the code generator (``rdepc.codegen.transport``).
Its *host* half allocates the heap. Three exist:

``emulated``
    One process holds all W ranks. The symmetric heap is one ``uint8`` tensor
    ``[W, heap_bytes]`` laid out by the memory plan; a peer's slice is ``heap + rank ·
    heap_bytes`` (int64: slices may exceed 2 GiB), a put is a plain store into it, a
    signal an integer atomic with release semantics after a ``tl.debug_barrier()`` (a
    scalar atomic is executed by one thread and would not order the other warps' stores),
    a wait an acquire spin followed by a barrier. Memory scope ``gpu``: every rank is on
    the same device. Runs under ``TRITON_INTERPRET=1`` on a CPU and natively on one GPU.

``emulated-mp``
    One process per rank (``rdepc.runtime.ranks`` starts them, or ``torchrun``). The heap of
    all W ranks is one file in shared memory (``/dev/shm``) that every process maps: the
    same ``[W, heap_bytes]`` layout and ``peer`` as ``emulated``, so the kernel body is the
    same, but each process runs only its rank's entries, and its signals and waits cross
    processes (scope ``sys``; the interpreter's atomics are real atomics on the shared
    pages). The file is unlinked as soon as every rank has mapped it: nothing outlives the
    processes, whatever way they end.
``nvshmem``
    One process per GPU rank under ``torchrun``; the heap is one symmetric allocation per
    rank, ``peer`` is ``nvshmem_ptr`` (NVLink peers are load/store addressable), signals and
    waits at system scope (``rdepc.runtime.nvshmem``).

The done flags every wait reads are symmetric: each rank's in its own slice (``flags``).

A module built for inference allocates the forward's prefix of each slice only
(``allocate_heap``'s ``used``): on ``nvshmem`` that is the whole allocation; on the emulated
transports, whose ``peer`` steps ``HEAP_BYTES`` from one slice to the next (a constant of the
generated kernels), the last slice ends there and the others keep their strides.

Before a module allocates its heap it asks its transport how many rank slices this
process allocates (``heap_ranks``) and how much memory they may take (``room``): free
memory on the device (CUDA: the driver's free bytes plus torch's cached free blocks; CPU:
the host's ``MemAvailable``, and for ``emulated-mp`` no more than ``/dev/shm`` has free;
``nvshmem``: the GPU's whole memory), so that a heap larger than the device is a one-line
error rather than an allocator failure, a SIGBUS or the kernel's OOM killer.

This module imports neither torch nor triton at import time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rdepc.runtime.memory import free_memory, human

from rdepc.ir.contract import TRANSPORT_PROCESSES


@dataclass(frozen=True)
class Transport:
    """The interface: a name, and whether it runs all ranks in ``one`` process or one
    process ``per-rank`` (the kernel contract's ``TRANSPORT_PROCESSES``)."""

    name: str
    processes: str  # "one" (all ranks in one process) or "per-rank"

    @property
    def per_rank(self) -> bool:
        return self.processes == "per-rank"

    def heap_ranks(self, W: int) -> int:
        """Rank slices of the heap this process allocates."""
        return W

    def room(self, device) -> tuple[int, str] | None:
        """The memory the heap is allocated from: bytes and their description (see
        :func:`free_memory`); None when unknown, and the module does not check."""
        return free_memory(device)

    def allocate_heap(self, W: int, heap_bytes: int, device, used: int | None = None):
        """The heap the kernel's ``heap`` argument points at, zeroed (collective on a per-rank
        transport: every rank calls it). ``used``: the bytes of each slice the module uses,
        a prefix (a module built for inference: the forward's regions); default all."""
        raise NotImplementedError

    def peers_lost(self, why: str) -> None:
        """A wait on another process's flag failed (``why``): that peer may be gone, and
        nothing collective may wait for it any more. Nothing to do where ranks share one
        process."""

    def launcher(self, interpret: bool, concurrent: bool):
        """What launches a call's kernels: Triton's own launches, or under the interpreter with
        ``concurrent`` programs (split mode) one thread per program of every kernel."""
        from rdepc.runtime.launch import ConcurrentInterpreter, Launcher

        return ConcurrentInterpreter(True) if interpret and concurrent else Launcher(interpret)


@dataclass(frozen=True)
class Emulated(Transport):
    name: str = "emulated"
    processes: str = TRANSPORT_PROCESSES["emulated"]

    def allocate_heap(self, W: int, heap_bytes: int, device, used: int | None = None):
        """The symmetric heap of all W ranks: one zeroed uint8 tensor [W, heap_bytes], or with
        ``used`` the [W, used] prefixes of the slices (:func:`strided_slices`)."""
        import torch

        if used is None or used == heap_bytes:
            return torch.zeros((W, heap_bytes), dtype=torch.uint8, device=device)
        flat = torch.zeros((W - 1) * heap_bytes + used, dtype=torch.uint8, device=device)
        return strided_slices(flat, W, heap_bytes, used)


@dataclass(frozen=True)
class EmulatedMP(Transport):
    name: str = "emulated-mp"
    processes: str = TRANSPORT_PROCESSES["emulated-mp"]

    def room(self, device) -> tuple[int, str] | None:
        """The host's available memory, or the shared-memory file system's free space when
        that is less: the heap is one file there (a page that cannot be backed would be a
        SIGBUS at its first store)."""
        from rdepc.runtime.ranks import _shm_dir

        host = free_memory(device)
        try:
            st = os.statvfs(_shm_dir())
        except OSError:
            return host
        shm = st.f_bavail * st.f_frsize
        if host is None or shm < host[0]:
            return shm, f"{_shm_dir()} has {human(shm)} free"
        return host

    def allocate_heap(self, W: int, heap_bytes: int, device, used: int | None = None):
        """Every rank's slice, [W, heap_bytes] (with ``used``: [W, used], as ``emulated``), in
        one shared-memory file all ranks map."""
        from rdepc.runtime.ranks import shared_heap

        return shared_heap(W, heap_bytes, used)


@dataclass(frozen=True)
class Nvshmem(Transport):
    name: str = "nvshmem"
    processes: str = TRANSPORT_PROCESSES["nvshmem"]

    def heap_ranks(self, W: int) -> int:
        return 1  # this rank's copy

    def room(self, device) -> tuple[int, str] | None:
        """The GPU's whole memory: the heap comes out of NVSHMEM's own symmetric reservation,
        which the driver may already count as used, so only a heap larger than the device is
        known not to fit."""
        import torch

        _, total = torch.cuda.mem_get_info(device)
        return total, f"{torch.device(device)} has {human(total)} in all"

    def allocate_heap(self, W: int, heap_bytes: int, device, used: int | None = None):
        """This rank's copy, [heap_bytes] (with ``used``: [used]), one NVSHMEM symmetric
        allocation; peers through nvshmem_ptr, which needs no stride between them."""
        from rdepc.runtime.nvshmem import NvshmemWorld

        return NvshmemWorld.start().alloc_heap(heap_bytes if used is None else used)

    def peers_lost(self, why: str) -> None:
        from rdepc.runtime.nvshmem import NvshmemWorld

        NvshmemWorld.start().peers_lost(why)

    def launcher(self, interpret: bool, concurrent: bool):
        """Links NVSHMEM's bitcode and registers each compiled kernel with NVSHMEM."""
        from rdepc.runtime.nvshmem import NvshmemWorld

        return NvshmemWorld.start().launcher()


def strided_slices(flat, W: int, heap_bytes: int, used: int):
    """``flat`` ((W - 1)·heap_bytes + used bytes) as [W, used]: each rank's slice where the
    kernels' ``peer`` finds it, ``heap_bytes`` (their compiled ``HEAP_BYTES``) after the one
    before, and its first ``used`` bytes. The last slice ends there; the tails of the others
    lie between the slices, allocated but never read."""
    return flat.as_strided((W, used), (heap_bytes, 1))


TRANSPORTS: dict[str, Transport] = {"emulated": Emulated(), "emulated-mp": EmulatedMP(), "nvshmem": Nvshmem()}


def module_device(backend: str, device):
    """Where a module on ``backend`` runs: ``device`` (default: the CPU) as the backend allows
    it; on nvshmem the GPU NVSHMEM picked for this rank when it started."""
    import torch

    if backend == "nvshmem":  # NVSHMEM picks this rank's GPU when it starts
        from rdepc.runtime.nvshmem import NvshmemWorld

        world = NvshmemWorld.start()
        asked = None if device is None else torch.device(device)
        if asked is not None and (asked.type != "cuda" or asked.index not in (None, world.device.index)):
            raise ValueError(f"the nvshmem backend runs rank {world.rank} on {world.device}")
        device = world.device
    device = torch.device(device if device is not None else "cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device}: the emulated backend runs on 'cpu' (Triton interpreter) or 'cuda'")
    if backend == "emulated-mp" and device.type != "cpu":
        raise ValueError("the emulated-mp backend runs on 'cpu' (its heap is host shared memory): use nvshmem on GPUs")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def get(name: str) -> Transport:
    """The transport called ``name``."""
    if name in TRANSPORTS:
        return TRANSPORTS[name]
    raise ValueError(f"unknown backend '{name}' (known: {', '.join(TRANSPORTS)})")


__all__ = ["TRANSPORTS", "Emulated", "EmulatedMP", "Nvshmem", "Transport", "get", "module_device"]
