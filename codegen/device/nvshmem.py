"""The nvshmem transport's heap: one NVSHMEM symmetric allocation per PE; a peer's copy is
reached through ``nvshmem_ptr`` (NVLink peers are load/store addressable).

``nvshmem_ptr`` is declared as an extern over NVSHMEM's device bitcode
(``libnvshmem_device``), which Triton links when the launch or the compile names it in
``extern_libs`` (:data:`rdepc.toolchain.EXTERN_LIB`). It has no interpreter implementation:
these functions run natively only."""

import triton
import triton.language as tl
from triton.language import core


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
    at = nvshmem_ptr(heap.to(tl.int64), tl.cast(rank, tl.int32))
    # As our copy plus a multiple of 16 bytes (the runtime passes a 16-byte aligned heap, and
    # every peer's copy is as aligned): so told, the compiler moves rows to and from it 16
    # bytes a load or store, not 2 (it reads no alignment through an integer made a pointer)
    return heap + (((at - heap.to(tl.int64)) >> 4) << 4)


@triton.jit
def peer_in(heap, rank, stride):
    """Base of rank ``rank``'s copy of another symmetric allocation (``stride``: the emulated
    transports' slice stride; NVSHMEM finds the copy itself)."""
    return nvshmem_ptr(heap.to(tl.int64), tl.cast(rank, tl.int32)).to(tl.pointer_type(tl.uint8))


@triton.jit
def put(ptr, value, mask):
    """A store into a peer's copy of the heap (or our own): NVLink makes it a plain store."""
    tl.store(ptr, value, mask=mask)
