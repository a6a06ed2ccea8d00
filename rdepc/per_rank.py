"""One rank's share of a run on a per-rank backend (``emulated-mp``, ``nvshmem``).

Every rank draws the same global inputs (same seed, drawn on the CPU), keeps its own
tokens and its own experts' weights, runs its module and checks its slice of the output
against the reference operator over the global inputs. :func:`run_rank` is what ``rdepc
run --backend B`` does in each process — under ``torchrun``, or in the processes
:func:`rdepc.runtime.ranks.spawn` starts for ``emulated-mp`` — and what the tests run;
``rdepc.commands.run`` prints the ranks' results.

A :class:`Job` may hold several cases, run one after another by the same processes (each
with a fresh module and heap): starting W processes costs seconds, a small case less.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Case:
    """One run: the layer, how it is compiled and run, its inputs, and fault injection."""

    file: str
    layer: str | None = None
    overrides: tuple[tuple[str, int], ...] = ()
    backend: str = "emulated-mp"
    device: str = "cpu"
    schedule: str | None = None
    mode: str | None = None  # the kernel mode (None: rdepc.ir.contract.default_mode)
    gemm: str | None = None  # the GEMMs' lowering (None: rdepc.ir.lowering.choose_gemm's)
    routing: str = "uniform"
    seed: int = 0
    tokens: int | None = None  # T' of every rank (default: the spec's T)
    rank_tokens: tuple[int, ...] | None = None  # T'_r per rank (ranks may differ)
    calls: int = 1
    spin_bound: int | None = None
    max_delay: float = 0.0  # each rank sleeps up to this long (seeded) before each call
    kill: tuple[int, float] | None = None  # (rank, seconds into its first call): SIGKILL it there
    # (rank, seconds): that rank sleeps this long before its first call, past its peers' spin bound
    stall: tuple[int, float] | None = None
    # (rank, k): in its first call that rank withholds the k-th (mod their number) of its
    # task-table entries that another rank waits for (waited_on): a producer lost mid-call
    withhold: tuple[int, int] | None = None
    keep_output: bool = False  # return y (bitwise comparisons in tests)
    # a file this rank keeps its progress in as it runs (``{progress}.{rank}.json``: calls made,
    # seconds, where it is), which a launcher that gives up on the rank still reads (Progress)
    progress: str | None = None


@dataclass(frozen=True)
class Job:
    cases: tuple[Case, ...] = field(default_factory=tuple)


def _token_counts(case: Case, W: int, T: int) -> list[int]:
    """T'_r of every rank (each keeps a prefix of its row of the global inputs)."""
    if case.rank_tokens is not None:
        if len(case.rank_tokens) != W:
            raise ValueError(f"rank_tokens needs one T' per rank ({W}), got {len(case.rank_tokens)}")
        return list(case.rank_tokens)
    return [T if case.tokens is None else case.tokens] * W


def run_case(case: Case, rank: int, W: int) -> dict:
    import torch

    import rdepc
    from rdepc.reference import random_biases, random_inputs, reference_for
    from rdepc.runtime.records import KernelError
    from rdepc.runtime.tensors import TORCH_DTYPES, max_relative_error

    layer = rdepc.load(case.file, case.layer, **dict(case.overrides))
    spec = layer.spec
    sh = layer.shapes
    T, H, F, E, K = (sh[k] for k in ("T", "H", "F", "E", "K"))
    counts = _token_counts(case, W, T)
    if any(not 0 <= n <= T for n in counts):
        raise ValueError(f"every rank's T' must lie in [0, {T}], got {counts}")
    Tmax = max(counts)
    options = {"mode": case.mode, "gemm": case.gemm} | ({"spin_bound": case.spin_bound} if case.spin_bound else {})
    module = layer.module(case.backend, case.device, schedule=case.schedule, **options)
    dt = TORCH_DTYPES[spec.precision.dtype.value]
    # Global inputs [W, T'_max]: a rank with fewer tokens keeps a prefix of its row.
    x, ids, gates, wg, wu, wd = random_inputs(
        W, max(Tmax, 1), H, F, E, K, routing=case.routing, seed=case.seed, dtype=dt, gated=spec.expert.gated
    )
    mine = list(module.local_experts)
    dev = module.device
    n = counts[rank]
    args = [x[rank, :n], ids[rank, :n], gates[rank, :n], None if wg is None else wg[mine], wu[mine], wd[mine]]
    args = [None if a is None else a.contiguous().to(dev) for a in args]
    full_biases = {}
    if spec.expert.bias:
        full_biases = random_biases(E, H, F, gated=spec.expert.gated, seed=case.seed, dtype=dt)
    biases = {k: None if v is None else v[mine].contiguous().to(dev) for k, v in full_biases.items()}
    rng = random.Random(case.seed * 1000 + rank)
    out: dict = {"rank": rank, "tokens": n, "calls": [], "mode": module.mode, "gemm": module.gemm}
    if case.withhold is not None and case.withhold[0] == rank:
        victims = waited_on(module.contract, rank)
        out["withheld"] = victims[case.withhold[1] % len(victims)]
        module.withhold(out["withheld"])
    log = Progress(case.progress, rank)
    for call in range(case.calls):
        log.note(call, "between calls", force=call == 0)
        if case.max_delay:
            time.sleep(rng.uniform(0, case.max_delay))
        if call == 0 and case.stall is not None and case.stall[0] == rank:
            time.sleep(case.stall[1])
        if call == 0 and case.kill is not None and case.kill[0] == rank:
            _kill_after(case.kill[1])  # timed from the call's start, whatever delay came before
        t0 = time.perf_counter()
        log.note(call, "in a call", force=call == 0)  # the first call's at once: a rank may die in it
        try:
            y = module(*args, **biases)
        except KernelError as e:
            out["error"] = e
            out["error_after"] = time.perf_counter() - t0  # how long the failing call took to stop
            log.note(call, "raised", last=True, error=str(e).splitlines()[0][:300], after=out["error_after"])
            return out
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out["calls"].append(time.perf_counter() - t0)
    log.note(case.calls, "done", last=True)
    st = module.last_stats
    out["stats"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    out["local_experts"] = mine
    if case.keep_output:
        out["y"] = y.cpu()
    # The reference takes one T' for all ranks; dropless, a prefix of a rank's tokens is exact.
    if len(set(counts)) == 1 or spec.capacity.policy == "dropless":
        f32 = [
            None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in (x, ids, gates, wg, wu, wd)
        ]
        ref_biases = {k: v if v is None else v.float() for k, v in full_biases.items()}
        ref, accepted_ref = reference_for(spec)(*f32, **ref_biases)
        out["error_rel"] = max_relative_error(y.cpu(), ref[rank, :n])
        out["accepted_same"] = bool(torch.equal(st["accepted"].cpu(), accepted_ref[rank, :n]))
    return out


class Progress:
    """A rank's progress through its calls, kept in a file as it runs: what is left of a rank
    a launcher ended (a wait that never expired, an exit that hung) says where it was. The
    calls only note where they are; a thread writes the latest note every ``EVERY`` seconds,
    so a rank stuck inside a call still leaves that call's note; an error and the end are
    written at once."""

    EVERY = 0.25

    def __init__(self, prefix: str | None, rank: int):
        import threading

        self.path = None if prefix is None else Path(f"{prefix}.{rank}.json")
        self.t0 = time.perf_counter()
        self.record: dict | None = None
        self.written: dict | None = None
        self.done = False
        self.lock = threading.Lock()
        if self.path is not None:
            threading.Thread(target=self._keep, daemon=True).start()

    def note(self, calls: int, where: str, force: bool = False, last: bool = False, **more) -> None:
        """Where the rank is; ``force``: written now; ``last``: and the thread stops."""
        if self.path is None:
            return
        self.record = {"calls": calls, "where": where, "seconds": round(time.perf_counter() - self.t0, 3)} | more
        if force or last:
            self._write()
        self.done = self.done or last

    def _keep(self) -> None:
        while not self.done:
            time.sleep(self.EVERY)
            self._write()

    def _write(self) -> None:
        with self.lock:
            record = self.record
            if record is None or record is self.written:
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record), encoding="utf-8")
            tmp.replace(self.path)  # a reader sees the last whole record, never half of one
            self.written = record

    @staticmethod
    def read(prefix: str, W: int) -> dict[int, dict | None]:
        """Every rank's last record (None: it wrote none)."""
        out = {}
        for rank in range(W):
            f = Path(f"{prefix}.{rank}.json")
            out[rank] = json.loads(f.read_text(encoding="utf-8")) if f.exists() else None
        return out


def waited_on(plan, rank: int) -> list[int]:
    """The task-table entries ``rank`` runs that an entry of another rank depends on (in this
    call): withholding one of them makes a peer's wait expire."""
    found = set()
    for row in plan.table:
        if row.rank == rank:
            continue
        for d in plan.deps[row.dep_start : row.dep_start + row.dep_count]:
            if d >= 0 and plan.table[d].rank == rank:
                found.add(d)
    return sorted(found)


def _kill_after(seconds: float) -> None:
    """SIGKILL this process ``seconds`` from now, wherever it is: a rank lost mid-call."""
    import os
    import signal
    import threading

    threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def run_rank(rank: int, W: int, job: Job) -> list[dict]:
    """Every case of ``job`` on this rank, in order (the processes run them in step)."""
    return [run_case(case, rank, W) for case in job.cases]


__all__ = ["Case", "Job", "run_case", "run_rank", "waited_on"]
