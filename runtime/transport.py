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

# signal and wait: the same on every transport, at the transport's SCOPE.
SIGNALS = '''
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

RULE = "# " + "-" * 87


def _emulated_device(banner: str, scope: str, why: str) -> str:
    """The device half of both emulated transports: the heap of all ranks is one ``[W,
    HEAP_BYTES]`` array in one address space, so a peer is an offset and a put a store."""
    return (
        f"""
{RULE}
{banner}
{RULE}
SCOPE = tl.constexpr("{scope}")  # memory scope of signals and waits: {why}
"""
        + '''

@triton.jit
def peer(heap, rank):
    """Base of rank ``rank``'s slice of the symmetric heap (int64: slices may exceed 2 GiB)."""
    return heap + tl.cast(rank, tl.int64) * HEAP_BYTES


@triton.jit
def put(ptr, value, mask):
    """A store into a peer's slice of the heap (or our own)."""
    tl.store(ptr, value, mask=mask)

'''
        + SIGNALS
    )


EMULATED_DEVICE = _emulated_device(
    "# Transport: emulated. One process holds all W ranks; the symmetric heap is one uint8\n"
    "# tensor [W, HEAP_BYTES]; a put is a store into a peer's slice, a signal a release atomic.",
    "gpu",
    "every rank on one device",
)
EMULATED_MP_DEVICE = _emulated_device(
    "# Transport: emulated-mp. One process per rank; the symmetric heap of all ranks is one uint8\n"
    "# [W, HEAP_BYTES] file in shared memory that every process maps; signals cross processes.",
    "sys",
    "they cross processes",
)


# nvshmem_ptr is declared as an extern over NVSHMEM's device bitcode (libnvshmem_device),
# which Triton links when the launch or compile names it in extern_libs (rdepc.runtime.nvshmem).
NVSHMEM_DEVICE = (
    '''
# ---------------------------------------------------------------------------------------
# Transport: nvshmem. One process per rank; the symmetric heap is one NVSHMEM allocation
# per PE; a peer's copy is reached through nvshmem_ptr (NVLink: plain loads and stores), a
# signal a release atomic at system scope.
# ---------------------------------------------------------------------------------------
SCOPE = tl.constexpr("sys")  # memory scope of signals and waits: the ranks are separate processes


@core.extern
def nvshmem_ptr(ptr, pe, _semantic=None):
    """void *nvshmem_ptr(const void *ptr, int pe), from libnvshmem_device: the address at which
    this PE loads and stores ``pe``'s copy of the symmetric object at ``ptr``. Pointers cross
    as int64 (a pointer type cannot key the dispatch table); not pure: it reads NVSHMEM's
    device state."""
    return core.extern_elementwise(
        "libnvshmem_device",
        "",
        [ptr, pe],
        {(core.int64, core.int32): ("nvshmem_ptr", core.int64)},
        is_pure=False,
        _semantic=_semantic,
    )


@triton.jit
def peer(heap, rank):
    """Base of rank ``rank``'s copy of the symmetric heap. nvshmem_ptr is NULL for a peer
    that is not load/store reachable; the host checks every peer is before the first launch."""
    return nvshmem_ptr(heap.to(tl.int64), tl.cast(rank, tl.int32)).to(tl.pointer_type(tl.uint8))


@triton.jit
def put(ptr, value, mask):
    """A store into a peer's copy of the heap (or our own): NVLink makes it a plain store."""
    tl.store(ptr, value, mask=mask)

'''
    + SIGNALS
)


@dataclass(frozen=True)
class Transport:
    """The interface: a name, the memory scope of its signals, its device source (the four
    functions above), whether it runs all ranks in ``one`` process or one process
    ``per-rank``, and the Python imports its device source needs beyond triton's."""

    name: str
    scope: str
    device_source: str
    processes: str  # "one" (all ranks in one process) or "per-rank"
    imports: str = ""

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

    def allocate_heap(self, W: int, heap_bytes: int, device):
        """The heap the kernel's ``heap`` argument points at, zeroed (collective on a per-rank
        transport: every rank calls it)."""
        raise NotImplementedError

    def launcher(self, interpret: bool, concurrent: bool):
        """What launches the kernel: Triton's own launch, or under the interpreter with
        ``concurrent`` programs (role-split) one thread per program."""
        from rdepc.runtime.launch import ConcurrentInterpreter, Launcher

        return ConcurrentInterpreter(True) if interpret and concurrent else Launcher(interpret)


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


@dataclass(frozen=True)
class EmulatedMP(Transport):
    name: str = "emulated-mp"
    scope: str = "sys"
    device_source: str = EMULATED_MP_DEVICE
    processes: str = "per-rank"

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

    def allocate_heap(self, W: int, heap_bytes: int, device):
        """Every rank's slice, [W, heap_bytes], in one shared-memory file all ranks map."""
        from rdepc.runtime.ranks import shared_heap

        return shared_heap(W, heap_bytes)


@dataclass(frozen=True)
class Nvshmem(Transport):
    name: str = "nvshmem"
    scope: str = "sys"
    device_source: str = NVSHMEM_DEVICE
    processes: str = "per-rank"
    imports: str = "from triton.language import core"  # core.extern for nvshmem_ptr

    def heap_ranks(self, W: int) -> int:
        return 1  # this rank's copy

    def room(self, device) -> tuple[int, str] | None:
        """The GPU's whole memory: the heap comes out of NVSHMEM's own symmetric reservation,
        which the driver may already count as used, so only a heap larger than the device is
        known not to fit."""
        import torch

        _, total = torch.cuda.mem_get_info(device)
        return total, f"{torch.device(device)} has {human(total)} in all"

    def allocate_heap(self, W: int, heap_bytes: int, device):
        """This rank's copy, [heap_bytes], one NVSHMEM symmetric allocation; peers through
        nvshmem_ptr."""
        from rdepc.runtime.nvshmem import NvshmemWorld

        return NvshmemWorld.start().alloc_heap(heap_bytes)

    def launcher(self, interpret: bool, concurrent: bool):
        """Links NVSHMEM's bitcode and registers each compiled kernel with NVSHMEM."""
        from rdepc.runtime.nvshmem import NvshmemWorld

        return NvshmemWorld.start().launcher()


TRANSPORTS: dict[str, Transport] = {"emulated": Emulated(), "emulated-mp": EmulatedMP(), "nvshmem": Nvshmem()}


def get(name: str) -> Transport:
    """The transport called ``name``."""
    if name in TRANSPORTS:
        return TRANSPORTS[name]
    raise ValueError(f"unknown backend '{name}' (known: {', '.join(TRANSPORTS)})")


__all__ = ["TRANSPORTS", "Emulated", "EmulatedMP", "Nvshmem", "Transport", "get"]
