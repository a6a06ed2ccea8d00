"""The device half of each transport, as the emitter writes it into a generated file: a
banner, the memory scope of signals and waits (``SCOPE``), and five device functions with
one contract, so the kernel body is the same whatever moves the bytes —

``peer(heap, rank)``
    the base address of ``rank``'s slice of the symmetric heap (a ``uint8`` pointer; the
    kernel adds the memory plan's byte offsets and casts to typed views);
``peer_in(heap, rank, stride)``
    the same for another symmetric allocation whose slices lie ``stride`` bytes apart
    (the balance plan's; NVSHMEM ignores the stride);
``put(ptr, value, mask)``
    a store into a peer's slice (or one's own);
``signal(flag)``
    release one unit on a done flag: every store the program made before is visible to
    whoever acquires it;
``wait(flag, target, bound, stop)``
    acquire-spin until ``flag >= target``, ``bound`` spins have passed or the word at
    ``stop`` (the call's error code) is set; returns the value last seen (``>= target``
    when reached), which an expired wait reports.

``peer`` and ``put`` come from ``device/heap.py`` (the emulated transports: one address
space) or ``device/nvshmem.py``; ``signal`` and ``wait`` from ``device/signals.py``. The
host half (allocating the heap, launching) is ``rdepc.runtime.transport``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rdepc.codegen.device import include

RULE = "# " + "-" * 87


@dataclass(frozen=True)
class DeviceTransport:
    banner: str  # what moves the bytes, for the generated file's reader
    heap: str  # the device module with peer and put
    scope: str  # memory scope of signals and waits
    why: str  # why that scope
    imports: str = ""  # Python imports the device functions need beyond triton's


DEVICE_TRANSPORTS = {
    "emulated": DeviceTransport(
        "Transport: emulated. One process holds all W ranks; the symmetric heap is one uint8\n"
        "tensor [W, HEAP_BYTES]; a put is a store into a peer's slice, a signal a release atomic.",
        "heap",
        "gpu",
        "every rank on one device",
    ),
    "emulated-mp": DeviceTransport(
        "Transport: emulated-mp. One process per rank; the symmetric heap of all ranks is one uint8\n"
        "[W, HEAP_BYTES] file in shared memory that every process maps; signals cross processes.",
        "heap",
        "sys",
        "they cross processes",
    ),
    "nvshmem": DeviceTransport(
        "Transport: nvshmem. One process per rank; the symmetric heap is one NVSHMEM allocation\n"
        "per PE; a peer's copy is reached through nvshmem_ptr (NVLink: plain loads and stores), a\n"
        "signal a release atomic at system scope.",
        "nvshmem",
        "sys",
        "the ranks are separate processes",
        "from triton.language import core  # core.extern for nvshmem_ptr",
    ),
}


def imports(name: str) -> str:
    return DEVICE_TRANSPORTS[name].imports


def source(name: str) -> str:
    """Transport ``name``'s section of a generated file."""
    t = DEVICE_TRANSPORTS[name]
    banner = "\n".join("# " + line for line in t.banner.split("\n"))
    return (
        f"{RULE}\n{banner}\n{RULE}\n"
        f'SCOPE = tl.constexpr("{t.scope}")  # memory scope of signals and waits: {t.why}\n\n\n'
        + include(t.heap)
        + "\n\n\n"
        + include("signals")
        + "\n"
    )


__all__ = ["DEVICE_TRANSPORTS", "DeviceTransport", "imports", "source"]
