"""Ranks as processes: the process group, the shared-memory heap of ``emulated-mp``, and a
launcher that runs a function once per rank in its own OS process.

Per-rank transports (``emulated-mp``, ``nvshmem``) run one process per rank, as a user does
under ``torchrun --nproc-per-node W``. Each process joins ``torch.distributed`` (gloo: it
only carries a handful of small host messages — the heap's name, barriers, a unique id);
:func:`process_group` initialises it from torchrun's environment when needed.

:func:`shared_heap` is the symmetric heap of ``emulated-mp``: one file of W · heap_bytes
bytes in ``/dev/shm``, created by rank 0, mapped by every rank, and unlinked as soon as
all have mapped it — the mappings stay valid, and no segment is left behind however the
processes end (an error, a kill, Ctrl-C). Only a rank 0 killed between creating the file
and that unlink cannot remove it: :func:`spawn` removes what its ranks left so
(:func:`remove_heaps`; the name carries the creator's pid).

:func:`spawn` starts W processes that join one process group through a file store in a
private temporary directory, runs ``fn(rank, world, *args)`` in each, and returns their
results in rank order. The processes fork from a server that imported torch once for the
launching process (multiprocessing's ``forkserver``; a fresh interpreter each where the
platform has none), each taking the launcher's environment, working directory and
``sys.path`` as they are at the launch: torch's import, 1.8 s a process here, is paid once.
A rank that raises is reported with its traceback; a rank that dies is reported by its
exit code; a launch that outlives ``timeout`` is ended. Every child is terminated and
joined before :func:`spawn` returns or raises, Ctrl-C included.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import tempfile
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

# Host collectives (the heap's name, barriers) are bounded too: a peer that died before them
# fails the others after this long rather than never (gloo's default is 30 minutes).
HOST_TIMEOUT = timedelta(minutes=5)
HEAP_PREFIX = "rdepc-heap-"  # shared-memory heaps are named HEAP_PREFIX + creator's pid + a random tag


class RanksError(RuntimeError):
    """A per-rank launch went wrong: which rank, and how."""


def process_group(want: int | None = None):
    """(rank, world size) of this process's ``torch.distributed`` group, initialising it
    (gloo) from torchrun's environment if it is not yet. ``want``: the W the layer needs."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            raise RanksError(
                "a per-rank backend runs one process per rank: start them with "
                f"`torchrun --nproc-per-node {want or 'W'} ...` (or rdepc.runtime.ranks.spawn)"
            )
        dist.init_process_group("gloo", init_method="env://", timeout=HOST_TIMEOUT)
    rank, size = dist.get_rank(), dist.get_world_size()
    if want is not None and size != want:
        raise RanksError(f"the layer has W = {want} ranks, but {size} processes were started (world size {size})")
    return rank, size


def broadcast(obj, src: int = 0):
    """``obj`` of rank ``src``, on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def sharing_device(per_rank: bool) -> int:
    """The rank processes that share this process's GPU (torchrun's LOCAL_WORLD_SIZE over
    the GPUs it sees, rounded up); 1 where one process holds every rank. Their kernels must
    all be resident at once, so each takes this share of the GPU's SMs."""
    if not per_rank:
        return 1
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, -(-local // max(1, torch.cuda.device_count())))


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def shared_heap(W: int, heap_bytes: int, used: int | None = None):
    """The ``[W, heap_bytes]`` symmetric heap of all ranks (uint8, zeroed), mapped by every
    rank's process; with ``used``, the ``[W, used]`` prefixes of those slices, the file
    ending where the last one does. Collective: every rank of the process group calls it."""
    import torch

    used = heap_bytes if used is None else used
    size = (W - 1) * heap_bytes + used
    rank, _ = process_group(W)
    path = None
    if rank == 0:
        path = _shm_dir() / f"{HEAP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)  # a new file reads as zeros
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
    mine = path
    try:
        # the broadcast is inside: a peer lost before it fails rank 0 here, after the file exists
        path = broadcast(str(path) if path else None)
        flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        barrier()  # every rank has mapped it: the name is no longer needed
    finally:
        if mine is not None:
            mine.unlink(missing_ok=True)
    return flat.view(W, heap_bytes) if used == heap_bytes else flat.as_strided((W, used), (heap_bytes, 1))


def remove_heaps(pid: int) -> list[str]:
    """Unlink the heaps process ``pid`` created and has not unlinked (it ended between
    creating one and every rank mapping it: a kill, a timeout); their names."""
    gone = []
    for path in _shm_dir().glob(f"{HEAP_PREFIX}{pid}-*"):
        path.unlink(missing_ok=True)
        gone.append(path.name)
    return gone


# ----------------------------------------------------------------------------- the launcher
def _context():
    """The multiprocessing context :func:`spawn` starts ranks in: ``forkserver``, its server
    importing torch before it forks (once per launching process), where the platform has it;
    else ``spawn``."""
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def _child(rank: int, world: int, store: str, fn, args, results: str, delay: float, env: dict) -> None:
    # The launcher's environment now, not the fork server's from its start (multiprocessing
    # carries the working directory and sys.path itself).
    os.environ.clear()
    os.environ.update(env)
    import torch.distributed as dist

    out = Path(results) / f"{rank}.pkl"
    try:
        if delay:
            time.sleep(delay)
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=HOST_TIMEOUT
        )
        # Every rank connected before any goes on: a rank whose fn returns at once would
        # otherwise close its connections while a slower peer's connect was still under way
        # (that peer failing with gloo's "Connection closed by peer").
        dist.barrier()
        try:
            value = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which raises it
        value = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(value))
    tmp.replace(out)
    # A forked process ends without Python's exit (os._exit): its exit handlers (NVSHMEM's
    # finalize among them) run here, once, as a fresh interpreter's would at its exit.
    atexit._run_exitfuncs()
    atexit._clear()


def spawn(fn, world: int, *args, timeout: float = 600.0, delays: list[float] | None = None) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes (:func:`_context`); their
    results in rank order. ``fn`` and ``args`` must be picklable (``fn`` a module-level
    function).
    ``delays``: seconds each rank sleeps before it joins (random start times in tests).

    Raises :class:`RanksError` naming the first rank that died or, when none did, the first
    that failed (with its traceback); its ``results`` hold what the other ranks returned
    (None for those that did not), its ``failures`` what went wrong on each rank that did
    not (rank -> message)."""
    ctx = _context()
    tmp = Path(tempfile.mkdtemp(prefix="rdepc-ranks-"))
    store, results = tmp / "store", tmp / "results"
    results.mkdir()
    procs = []
    try:
        for rank in range(world):
            delay = delays[rank] if delays else 0.0
            job = (rank, world, str(store), fn, args, str(results), delay, dict(os.environ))
            p = ctx.Process(target=_child, args=job, daemon=True)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [r for r, p in enumerate(procs) if p.is_alive()]
        out, failures, died, reported = [], {}, [], []
        for rank, p in enumerate(procs):
            f = results / f"{rank}.pkl"
            if not f.exists():
                if rank in late:
                    failures[rank] = "did not finish"
                else:
                    failures[rank] = f"rank {rank} died (exit code {p.exitcode}) before it reported a result"
                    died.append(rank)
                out.append(None)
                continue
            value = pickle.loads(f.read_bytes())
            if rank in late:  # what it returned is kept; the exit (NVSHMEM's finalize, at exit) is what hung
                failures[rank] = "reported its result but did not exit"
                reported.append(rank)
            if value[0] == "error":
                failures[rank] = f"rank {rank} failed: {value[1]}\n{value[2]}"
                out.append(None)
            else:
                out.append(value[1])
        if late:
            e = RanksError(
                f"ranks {late} did not finish within {timeout:g} s; they were ended"
                + (f" (ranks {reported} had reported their results: it was their exit that hung)" if reported else "")
            )
            e.results, e.failures = out, failures
            raise e
        if failures:
            # A rank that died is the likelier cause: its peers' host collectives then fail
            # with "connection closed" in their own words, which would otherwise come first.
            e = RanksError(failures[(died or sorted(failures))[0]])
            e.results, e.failures = out, failures
            raise e
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for p in procs:  # a rank ended between creating its heap and every rank mapping it
            if p.pid is not None:
                remove_heaps(p.pid)
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = [
    "HEAP_PREFIX",
    "RanksError",
    "barrier",
    "broadcast",
    "process_group",
    "remove_heaps",
    "shared_heap",
    "sharing_device",
    "spawn",
]
