"""The ``nvshmem`` transport: one process per rank, a symmetric heap from NVSHMEM, and
device calls into NVSHMEM's bitcode from stock Triton.

Design, in brief:

Device half (``NVSHMEM_DEVICE``, kept with the other transports in ``rdepc.runtime.transport``)
    The same four functions as the emulated transport (``peer``, ``put``, ``signal``,
    ``wait``; see ``rdepc.runtime.transport``), so a kernel body does not change with the
    transport. ``peer`` is ``nvshmem_ptr``: inside one NVLink domain a peer's copy of the
    symmetric heap is load/store addressable, so a put stays a plain ``tl.store`` (many
    programs storing rows is where the bandwidth comes from; one ``putmem`` block call is
    slow). Signals and waits are the emulated ones at *system* scope, because the ranks are
    separate processes. ``nvshmem_ptr`` is declared here as a Triton extern over the
    ``libnvshmem_device`` bitcode; Triton links the part of it the kernels call when
    ``extern_libs`` names it (``rdepc.toolchain.nvshmem_library``), which works without a GPU,
    so CI compiles these kernels too.

Host half (:class:`NvshmemWorld`, :class:`NvshmemLauncher`)
    Run under ``torchrun``: ``NvshmemWorld.start()`` joins (or starts) a gloo process group,
    picks the GPU, shares NVSHMEM's unique id from rank 0 and initialises NVSHMEM through
    nvshmem4py; ``alloc_heap`` hands out the zeroed symmetric heap; ``launcher()`` gives an
    ``NvshmemLauncher``, which links the bitcode and registers every compiled module with
    NVSHMEM (``module_init``) before its first launch, filling the device state
    ``nvshmem_ptr`` reads.

Importing this module imports neither torch, triton nor nvshmem: everything heavy is
imported inside the functions that need it, so the CPU-only parts of rdepc (and CI) can
import it freely.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import re
import sys
import threading

# launch.py imports neither torch nor triton at import time either.
from rdepc.runtime.launch import Launcher
from rdepc.runtime.ranks import HOST_TIMEOUT

from rdepc.toolchain import INSTALL_HINT, NvshmemUnavailable, nvshmem_extern_libs, nvshmem_library, one_line


class NvshmemWorld:
    """This process's place in the NVSHMEM job: one per process (NVSHMEM is initialised
    once), made by :meth:`start`. It knows its ``rank``, the ``world`` size and its CUDA
    ``device``, hands out symmetric heaps (:meth:`alloc_heap`) and frees them, then
    finalises NVSHMEM, at exit."""

    _instance: NvshmemWorld | None = None
    _lock = threading.Lock()

    def __init__(self, rank: int, world: int, device_index: int):
        """Use :meth:`start`; this only records what it found."""
        self._rank, self._world, self._index = rank, world, device_index
        self._tensors: list = []  # every symmetric tensor handed out, freed by finalize
        self._modules: dict[int, object] = {}  # id -> compiled kernel registered with NVSHMEM (held: ids)
        self._finalized = False
        self._lost: str | None = None  # why a peer may be gone (peers_lost)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world(self) -> int:
        return self._world

    @property
    def device(self):
        import torch

        return torch.device("cuda", self._index)

    @classmethod
    def start(cls) -> NvshmemWorld:
        """The process's world, initialising NVSHMEM on first call (later calls return the
        same world). Raises :class:`NvshmemUnavailable` with one line when it cannot."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls._boot()
            return cls._instance

    @classmethod
    def _boot(cls) -> NvshmemWorld:
        import torch

        # Checks run cheapest and most likely first, so a CPU machine gets the GPU message.
        if not torch.cuda.is_available():
            raise NvshmemUnavailable(
                "rdepc: the nvshmem backend needs a CUDA GPU; none is visible (torch.cuda.is_available() "
                "is False): use --backend emulated or emulated-mp on a CPU"
            )
        try:
            import nvshmem.core as nc
        except (ImportError, OSError) as e:
            raise NvshmemUnavailable(
                f"rdepc: the nvshmem backend needs nvshmem4py ({one_line(e)}): {INSTALL_HINT}"
            ) from e
        nvshmem_library()  # fail here, not at the first launch, when the bitcode is missing (and cut it once)

        import torch.distributed as dist

        if not dist.is_initialized():
            if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
                # gloo, not NCCL: it only carries the unique id and host barriers, and NCCL
                # refuses two ranks on one GPU, which is how single-GPU tests run.
                dist.init_process_group("gloo", init_method="env://", timeout=HOST_TIMEOUT)
            else:
                raise NvshmemUnavailable(
                    "rdepc: the nvshmem backend runs one process per rank: run under torchrun "
                    "--nproc-per-node W (no torch.distributed group and no RANK/WORLD_SIZE/MASTER_ADDR here)"
                )
        rank, world = dist.get_rank(), dist.get_world_size()
        # Several PEs may share one GPU (NVSHMEM's multi-process-per-GPU mode), so wrap around.
        index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        try:
            try:
                from cuda.core import Device
            except ImportError:  # cuda-core before 0.4 kept it under experimental
                from cuda.core.experimental import Device
            device = Device(index)
            device.set_current()
            box = [nc.get_unique_id(empty=rank != 0)]  # only rank 0 makes a real id
            dist.broadcast_object_list(box, src=0)
            nc.init(device=device, uid=box[0], rank=rank, nranks=world, initializer_method="uid")
        except Exception as e:
            raise NvshmemUnavailable(f"rdepc: NVSHMEM init failed on rank {rank}: {one_line(e)}") from e
        self = cls(rank, world, index)
        atexit.register(self.finalize)
        return self

    def launcher(self) -> NvshmemLauncher:
        """A new launcher (its own ``launches`` count) for kernels of this world."""
        return NvshmemLauncher(self)

    def alloc_heap(self, nbytes: int):
        """One symmetric ``uint8`` tensor of exactly ``nbytes``, zeroed on every PE before
        any peer can write into it. Collective: every PE calls it with the same size, in the
        same order. Checks every peer's copy is load/store reachable (what ``peer`` needs)."""
        import nvshmem.bindings
        import torch
        from nvshmem.core.interop import torch as nt

        if self._finalized:
            raise RuntimeError("rdepc: NVSHMEM is finalized in this process")
        if nbytes <= 0:
            raise ValueError(f"rdepc: a symmetric heap needs a positive size, not {nbytes}")
        heap = nt.tensor((nbytes,), dtype=torch.uint8)
        self._tensors.append(heap)
        heap.zero_()
        self.barrier()  # zeroed everywhere before a fast peer's first put
        for pe in range(self._world):
            # The host twin of the kernel's nvshmem_ptr: 0 means no load/store path (another
            # node, or P2P not available), where ``peer`` would hand the kernel NULL.
            if not nvshmem.bindings.ptr(int(heap.data_ptr()), pe):
                raise NvshmemUnavailable(
                    f"rdepc: rank {self._rank} cannot load/store rank {pe}'s symmetric heap (nvshmem_ptr is NULL): "
                    "the nvshmem backend needs every rank in one NVLink domain"
                )
        return heap

    def barrier(self) -> None:
        """Every PE's work so far is done before any PE goes on: this stream is synchronised,
        then a host barrier over the process group. A host barrier rather than NVSHMEM's
        on-stream one: it is what the probes ran with several PEs on one GPU."""
        import torch
        import torch.distributed as dist

        torch.cuda.current_stream(self._index).synchronize()
        dist.barrier()

    def peers_lost(self, why: str) -> None:
        """A kernel's wait on a peer's flag failed (``why``): the peer may have died, and
        finalize's collective steps would wait for it forever."""
        self._lost = self._lost or why

    def finalize(self) -> None:
        """Free every symmetric tensor handed out, then finalise NVSHMEM (at exit; once).
        Freeing is collective, so every PE frees the same tensors in the same order. After
        :meth:`peers_lost` neither is done (a PE that is gone never joins them): the process
        exits and the driver reclaims the memory."""
        if self._finalized:
            return
        self._finalized = True
        if self._lost is not None:
            print(f"rdepc: rank {self._rank} skips NVSHMEM's finalize, a collective: {self._lost}", file=sys.stderr)
            return
        import nvshmem.core as nc
        import torch
        from nvshmem.core.interop import torch as nt

        torch.cuda.synchronize(self._index)  # no kernel may still use a heap being freed
        while self._tensors:
            nt.free_tensor(self._tensors.pop(0))
        nc.finalize()


class NvshmemLauncher(Launcher):
    """Launches kernels linked against NVSHMEM's bitcode, counting them (``launches``), like
    :class:`rdepc.runtime.launch.Launcher` does natively.

    Before a compiled kernel first runs, NVSHMEM must fill the device state in its module
    (``nvshmem.core.module_init``): without it nvshmem_ptr reads an uninitialised state. So
    the first launch of each build (``prepared_key``) asks Triton for it (``warmup``) and
    registers it when it is new. Per compiled kernel, not per (kernel, constexprs): Triton
    specialises on integer arguments equal to 1 and on pointer alignment, so one kernel with
    the same constexprs can have several compiled modules (an ``epoch`` of 1 and one of 2
    give two). What is registered is kept by the world, so launchers sharing a kernel
    register it once per process."""

    def __init__(self, world: NvshmemWorld | None = None):
        super().__init__(interpret=False)
        self.world = world if world is not None else NvshmemWorld.start()
        self.extern_libs = nvshmem_extern_libs()

    def _prepare(self, kernel, grid: tuple[int, ...], args: tuple, meta: dict):
        extern = {**meta, "extern_libs": self.extern_libs}  # an option: part of Triton's cache key
        compiled = super()._prepare(kernel, grid, args, extern)
        if id(compiled) not in self.world._modules:
            self._register(compiled)
        return compiled

    def _register(self, compiled) -> None:
        from nvshmem.core import NvshmemKernelObject, module_init

        if needs_module_init(compiled.asm["ptx"]):  # loaded (Launcher._prepare): ``module`` is its CUmodule
            # nvshmem4py 0.4.1's module_init prints its status to stdout; keep stdout clean.
            with contextlib.redirect_stdout(io.StringIO()):
                module_init(NvshmemKernelObject.from_handle(compiled.module))
        self.world._modules[id(compiled)] = compiled  # held: an id is unique only while alive


def needs_module_init(ptx: str) -> bool:
    """Whether a compiled kernel holds NVSHMEM's device state, which ``module_init`` fills.
    Only what a kernel calls is linked from the bitcode: one that calls nothing of NVSHMEM's
    (``balance replicate``'s solver) has no state, and ``module_init`` fails on it ("named
    symbol not found")."""
    return re.search(r"\bnvshmemi_device_state_d\b", ptx) is not None


__all__ = ["NvshmemLauncher", "NvshmemWorld", "needs_module_init"]
