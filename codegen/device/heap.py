"""The emulated transports' heap: every rank's slice of the symmetric heap in one address
space (``emulated``: one process; ``emulated-mp``: a shared-memory file every rank's process
maps), so a peer is an offset and a put a store."""

import triton
import triton.language as tl

# Stand-in for the generated file's constant (see rdepc.codegen.device).
HEAP_BYTES = tl.constexpr(256)


@triton.jit
def peer(heap, rank):
    """Base of rank ``rank``'s slice of the symmetric heap (int64: slices may exceed 2 GiB)."""
    return heap + tl.cast(rank, tl.int64) * HEAP_BYTES


@triton.jit
def peer_in(heap, rank, stride):
    """Base of rank ``rank``'s slice of another symmetric allocation, whose slices lie
    ``stride`` bytes apart (the balance plan's: ``rdepc.runtime.balance``)."""
    return heap + tl.cast(rank, tl.int64) * stride


@triton.jit
def put(ptr, value, mask):
    """A store into a peer's slice of the heap (or our own)."""
    tl.store(ptr, value, mask=mask)
