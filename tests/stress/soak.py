"""A multi-process soak of the per-rank backends (``emulated-mp`` on the CPU, ``nvshmem`` on GPUs).

    .venv/bin/python tests/stress/soak.py --runs 1000 --seed 0 [--jobs N] [--json PATH]
                                          [--backend emulated-mp|nvshmem]

Runs at least ``--runs`` seeded collective calls of small layers (examples/tiny.rdep and
segmented variants of it, T = 4) over W = 2..4 ranks, one OS process per rank: every
schedule strategy (bulk, pipelined, deep), both kernel modes (unified, split), random
routings (uniform, zipf, hot, all rows to one expert or one owner), ranks with no tokens,
random start delays, several calls per case, and a fault in about one case in six: a rank
SIGKILLed mid-call (``kill``) or at a random moment of a job's last case (``lost``: loading
the layer, in a host collective, creating the heap), a rank stalled past its peers' spin
bound (``stall``), or a task withheld (``withhold``).

Cases are grouped into jobs (one set of W processes runs all of a job's cases: starting
them costs seconds). Each job runs in a worker process of its own session under a
wall-clock bound: past it, the session is killed and the job counts as a hang. After each
job: rank processes still alive in its session are leaked processes, and shared-memory
heaps named after its ranks' pids (``/dev/shm/rdepc-heap-PID-*``) still there are leaked
segments.

Counted: calls, checks passed (each rank's slice against the reference operator),
KernelErrors (each must name the rank that raised it and its task, and must come from a
case with a fault), other errors, hangs, leaks. Exits 1 on any hang, leak, unexpected or
unnamed KernelError, other error or failed check; 2 on bad usage (``--backend nvshmem``
without a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rdepc.runtime.ranks import HEAP_PREFIX
from soak_tally import Tally, tally_job

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.rdep"
SHM = Path("/dev/shm")

# (variant, schedule, weight): the spec files build_specs writes, and the strategy each runs
VARIANTS = (
    ("tiny", "bulk", 4),
    ("tiny-cap", "bulk", 1),  # a capacity policy (drops), checked with equal T' on every rank
    ("seg8", "pipelined", 1),  # 8-row segments through 2 buffers: 2 to 4 segments per owner
    ("seg8", "deep", 1),
    ("seg16", "pipelined", 2),  # 16-row segments: 1 to 2 per owner, cheaper under the interpreter
    ("seg16", "deep", 1),
    ("seg16-b1", "pipelined", 1),  # one buffer: a return ring
    ("seg16-b1", "deep", 1),
)
ROUTINGS = ("uniform", "zipf:1.0", "zipf:1.5", "hot", "one")
MODES = ("unified", "split", "phased")  # phased: bulk only (a segmented schedule's GEMMs may wait for returns)
FAULTS = ("kill", "lost", "stall", "withhold")
# pessimistic seconds per collective call by W (2 CPU cores, interpreter), for the job's bound
CALL_S = {"emulated-mp": {2: 6.0, 3: 10.0, 4: 16.0}, "nvshmem": {2: 30.0, 3: 30.0, 4: 30.0}}


# ----------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class JobPlan:
    index: int
    W: int
    cases: tuple  # of rdepc.per_rank.Case
    delays: tuple[float, ...]  # each rank's start delay (ranks.spawn)
    backend: str = "emulated-mp"
    # (rank, seconds): that rank is SIGKILLed this long after the last case starts, wherever it
    # is (loading the layer, in a host collective, creating the heap, in the call)
    lost: tuple[int, float] | None = None

    @property
    def calls(self) -> int:
        return sum(c.calls for c in self.cases)

    def bound(self, parallel: int) -> float:
        """Seconds the job may take before it counts as a hang."""
        per_call = CALL_S[self.backend][self.W]
        work = sum(c.calls * (per_call + c.max_delay) + (c.stall[1] if c.stall else 0) for c in self.cases)
        start = 120.0 if self.backend == "emulated-mp" else 300.0
        return (start + max(self.delays, default=0) + work) * max(1, parallel)

    def fault(self, i: int) -> tuple[str, int] | None:
        """(kind, rank) of the fault case ``i`` injects, or None."""
        if self.lost is not None and i == len(self.cases) - 1:
            return "lost", self.lost[0]
        return fault_of(self.cases[i])


def fault_of(case) -> tuple[str, int] | None:
    """(kind, rank) of the fault a case injects, or None."""
    for kind in ("kill", "stall", "withhold"):  # Case's own; "lost" is the job's (JobPlan.lost)
        v = getattr(case, kind)
        if v is not None:
            return kind, v[0]
    return None


def build_specs(directory: Path) -> dict[str, str]:
    """The spec files of VARIANTS, written into ``directory``: their paths by variant."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_segmented

    text = TINY.read_text(encoding="utf-8")
    cap = directory / "tiny_cap.rdep"
    assert "capacity  dropless" in text, "examples/tiny.rdep is no longer dropless: update the soak's variants"
    cap.write_text(text.replace("capacity  dropless", "capacity  factor 1.0, drop arrival, weights renormalize"))
    return {
        "tiny": str(TINY),
        "tiny-cap": str(cap),
        "seg8": str(tiny_segmented(directory, rows=8, buffers=2)),
        "seg16": str(tiny_segmented(directory, rows=16, buffers=2)),
        "seg16-b1": str(tiny_segmented(directory, rows=16, buffers=1)),
    }


def plan_jobs(runs: int, seed: int, specs: dict[str, str], backend: str = "emulated-mp") -> list[JobPlan]:
    """Jobs whose cases run at least ``runs`` collective calls (a faulted case counted as one:
    its fault ends it), all drawn from ``seed``."""
    jobs, total = [], 0
    while total < runs:
        job = random_job(len(jobs), random.Random(f"rdepc-soak-{seed}-{len(jobs)}"), specs, backend)
        jobs.append(job)
        total += sum(1 if job.fault(i) else c.calls for i, c in enumerate(job.cases))
    return jobs


def random_job(index: int, rng: random.Random, specs: dict[str, str], backend: str) -> JobPlan:
    W = rng.choice((2, 3, 4))
    n = rng.randint(6, 10)
    cases, lost = [], None
    for i in range(n):
        fault = None
        if i == n - 1:  # a killed rank only in a job's last case: its process is gone after it
            fault = rng.choices(("kill", "lost", None), weights=(25, 12, 63))[0]
        elif rng.random() < 0.14:
            fault = rng.choice(("stall", "withhold"))
        if fault == "lost":
            lost = (rng.randrange(W), round(rng.uniform(0.0, 2.0), 3))
        cases.append(random_case(rng, specs, W, backend, fault))
    delays = tuple(round(rng.uniform(0, 0.3), 3) for _ in range(W))
    return JobPlan(index, W, tuple(cases), delays, backend, lost)


def random_case(rng: random.Random, specs: dict[str, str], W: int, backend: str, fault: str | None):
    from rdepc.per_rank import Case

    variant, schedule = rng.choices([v[:2] for v in VARIANTS], weights=[v[2] for v in VARIANTS])[0]
    T = 4  # interpreted calls cost by tasks and segments; T' varies below
    routing = rng.choice(ROUTINGS)
    K = rng.choice((1, 2)) if routing == "one" else 2  # K = 1: every row to expert 0
    overrides = (("W", W), ("T", T), ("K", K))
    tokens, rank_tokens = None, None
    if variant != "tiny-cap" and rng.random() < 0.35:  # ragged ranks, at least one with no tokens
        counts = [rng.randint(0, T) for _ in range(W)]
        counts[rng.randrange(W)] = 0
        if rng.random() < 0.1:
            counts = [0] * W
        rank_tokens = tuple(counts)
    else:
        tokens = rng.choice((T, rng.randint(1, T)))
    options = {}
    if fault is not None:
        rank = rng.randrange(W)
        # small bounds, so a fault trips its peers' waits quickly (an interpreted spin takes ~0.3 ms)
        options["spin_bound"] = rng.choice((500, 1000, 2000)) if backend == "emulated-mp" else 1 << 20
        if fault == "kill":
            options["kill"] = (rank, round(rng.uniform(0.05, 0.6), 3))
        elif fault == "lost":
            pass  # JobPlan.lost: soak_rank kills it
        elif fault == "stall":
            # past the bound: an interpreted spin takes 0.3 ms, up to ~1 ms on a loaded 2-core machine
            options["stall"] = (rank, options["spin_bound"] / 1000 + 1.5 if backend == "emulated-mp" else 3.0)
        else:
            options["withhold"] = (rank, rng.randrange(64))
    mode = rng.choice(MODES)
    if mode == "phased" and schedule != "bulk":
        mode = "split"
    return Case(
        specs[variant],
        overrides=overrides,
        backend=backend,
        device="cpu" if backend == "emulated-mp" else "cuda",
        schedule=schedule,
        mode=mode,
        routing=routing,
        seed=rng.randrange(2**31),
        tokens=tokens,
        rank_tokens=rank_tokens,
        calls=rng.choice((1, 2, 3, 3)),
        max_delay=rng.choice((0.0, 0.05, 0.2)),
        **options,
    )


# ----------------------------------------------------------------------------- the ranks
def soak_rank(rank: int, W: int, job, outdir: str, lost: tuple[int, float] | None = None) -> int:
    """One rank of a job (in a process ranks.spawn started): every case in turn, each one's
    result written as soon as it is known, so a rank killed later loses none."""
    from rdepc.runtime.records import KernelError

    from rdepc.per_rank import run_case

    out = Path(outdir)
    _write(out / f"{rank}.pid", os.getpid())
    for i, case in enumerate(job.cases):
        if lost is not None and lost[0] == rank and i == len(job.cases) - 1:
            threading.Timer(lost[1], os.kill, (os.getpid(), signal.SIGKILL)).start()
        try:
            r = run_case(case, rank, W)
        except BaseException as e:
            _write(out / f"{rank}-{i}.pkl", {"exception": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
            raise
        keep = ("tokens", "calls", "error_rel", "accepted_same", "withheld", "error_after")
        res = {k: r[k] for k in keep if k in r}
        if "error" in r:
            e = r["error"]
            kind = "KernelError" if isinstance(e, KernelError) else type(e).__name__
            res["error"] = {"type": kind, "message": str(e), "record": getattr(e, "record", None)}
        _write(out / f"{rank}-{i}.pkl", res)
    return len(job.cases)


def _write(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(value))
    tmp.replace(path)


def worker(infile: str, outfile: str) -> None:
    """A job's worker process: its ranks through ranks.spawn, then what they left."""
    from rdepc.runtime import ranks

    from rdepc.per_rank import Job

    spec = pickle.loads(Path(infile).read_bytes())
    job, outdir = Job(spec["cases"]), spec["dir"]
    status, message, failures = "ok", None, {}
    try:
        ranks.spawn(soak_rank, spec["W"], job, outdir, spec["lost"], timeout=spec["timeout"], delays=spec["delays"])
    except ranks.RanksError as e:
        status, message = "ranks_error", str(e)
        failures = dict(getattr(e, "failures", {}))
        if "did not finish within" in message:
            status = "timeout"
    except BaseException as e:
        status, message = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    procs = _processes()
    mine = [p for p in procs if p["ppid"] == os.getpid()]
    servers = {p["pid"] for p in mine if _helper(p["pid"])}
    # the ranks are the fork server's children, forked: their command line is the server's
    alive = [p for p in mine if p["pid"] not in servers] + [p for p in procs if p["ppid"] in servers]
    _write(Path(outfile), {"status": status, "message": message, "failures": failures, "children_alive": alive})


def _helper(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's resource tracker or fork server (runtime.ranks._context):
    they end with the worker."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"resource_tracker" in cmdline or b"forkserver" in cmdline


def _processes() -> list[dict]:
    """Every live (not zombie) process: pid, ppid, session."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] in ("Z", "X"):
            continue
        out.append({"pid": int(d.name), "ppid": int(fields[1]), "session": int(fields[3])})
    return out


# ----------------------------------------------------------------------------- one job
_LIVE: set = set()  # the workers running now (run ends them if it is interrupted)
_LIVE_LOCK = threading.Lock()


@dataclass
class JobResult:
    plan: JobPlan
    status: str  # ok, ranks_error, timeout (spawn's own bound), hang (the worker's), error
    message: str | None
    failures: dict  # rank -> what spawn said went wrong there
    results: dict  # (rank, case) -> the case's result on that rank
    seconds: float
    leaked_processes: list = field(default_factory=list)
    leaked_shm: list = field(default_factory=list)
    log_tail: str = ""


def run_job(plan: JobPlan, workdir: Path, parallel: int = 1) -> JobResult:
    """One job in a worker process of its own session, under its wall-clock bound."""
    d = workdir / f"job{plan.index:04d}"
    d.mkdir(parents=True, exist_ok=True)
    bound = plan.bound(parallel)
    infile, outfile, log = d / "job.pkl", d / "out.pkl", d / "log.txt"
    # plain values and per_rank's Cases only: the worker imports neither this module's name nor its classes
    spec = {"W": plan.W, "cases": plan.cases, "delays": list(plan.delays), "lost": plan.lost, "dir": str(d)}
    _write(infile, spec | {"timeout": max(10.0, bound - 20.0)})
    t0 = time.monotonic()
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(infile), str(outfile)],
            cwd=ROOT,
            stdout=err,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    with _LIVE_LOCK:
        _LIVE.add(proc)
    hang = False
    try:
        proc.wait(bound)
    except subprocess.TimeoutExpired:
        hang = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc)
    seconds = time.monotonic() - t0
    out = pickle.loads(outfile.read_bytes()) if outfile.exists() else None
    if hang:
        status, message, failures = "hang", f"the job outlived its bound of {bound:.0f} s: its session was killed", {}
    elif out is None:
        status, message, failures = "error", f"the worker exited {proc.returncode} without a report", {}
    else:
        status, message, failures = out["status"], out["message"], out["failures"]
    leaked = [f"rank pid {p['pid']} alive after spawn returned" for p in (out or {}).get("children_alive", [])]
    # the session's processes: none may outlive the worker (a short grace for the tracker)
    deadline = time.monotonic() + 5
    while (left := [p for p in _processes() if p["session"] == proc.pid]) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked += [f"pid {p['pid']} of the job's session alive after the job" for p in left]
    for p in left:  # not to disturb later jobs; counted already
        _kill(p["pid"])
    pids = {pickle.loads(f.read_bytes()) for f in d.glob("*.pid")}
    shm = sorted(p.name for pid in pids for p in SHM.glob(f"{HEAP_PREFIX}{pid}-*")) if SHM.is_dir() else []
    for name in shm:
        (SHM / name).unlink(missing_ok=True)
    results = {}
    for f in d.glob("*-*.pkl"):
        rank, case = (int(x) for x in f.stem.split("-"))
        results[(rank, case)] = pickle.loads(f.read_bytes())
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    return JobResult(plan, status, message, failures, results, seconds, leaked, shm, tail)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- the run
def run(
    jobs: list[JobPlan], parallel: int = 1, progress: float = 5.0, log=print, workdir: Path | None = None
) -> tuple[Tally, float]:
    """Run ``jobs`` (``parallel`` at a time) and count their outcomes; (tally, wall seconds)."""
    tally, lock, done = Tally(), threading.Lock(), threading.Event()
    total_calls = sum(j.calls for j in jobs)
    state = {"jobs": 0}
    t0 = time.monotonic()
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="rdepc-soak-")) if own else workdir

    def one(plan: JobPlan) -> None:
        res = run_job(plan, workdir, parallel)
        with lock:
            tally_job(res, tally)
            state["jobs"] += 1

    def line() -> str:
        c = tally.counts
        return (
            f"[{time.monotonic() - t0:7.1f} s] jobs {state['jobs']}/{len(jobs)}  calls {c['calls']} (planned "
            f"{total_calls})  checks {c['checks passed']}  KernelErrors {c['KernelErrors']}  failures "
            f"{c['failures']}  hangs {c['hangs']}  leaks {c['leaked processes'] + c['leaked shm segments']}"
        )

    def report() -> None:
        while not done.wait(progress):
            with lock:
                log(line())

    ticker = threading.Thread(target=report, daemon=True)
    if progress:
        ticker.start()
    pool = ThreadPoolExecutor(max_workers=parallel)
    try:
        for f in [pool.submit(one, j) for j in jobs]:
            f.result()
    except BaseException:
        # Ctrl-C or a failing job: the workers run in sessions of their own, which no terminal
        # signal reaches, so they are ended here, before the pool waits for their threads.
        with _LIVE_LOCK:
            for proc in _LIVE:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        done.set()
        if own:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    if progress:
        log(line())
    return tally, time.monotonic() - t0


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    for name in ("rdepc", "torch", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


ROWS = (
    ("jobs", "jobs"),
    ("cases", "cases"),
    ("calls", "collective calls run"),
    ("rank-calls completed", "rank calls completed"),
    ("checks passed", "checks passed (rank slices vs reference)"),
    ("checks passed in faulted cases", "  in faulted cases (before the fault)"),
    ("checks failed", "checks failed"),
    ("unchecked", "unchecked (ragged T' with capacity)"),
    ("KernelErrors", "KernelErrors (all in faulted cases)"),
    ("KernelErrors naming rank and task", "  naming their rank and task"),
    ("KernelErrors unexpected (no fault)", "  unexpected (no fault injected)"),
    ("ranks killed", "ranks killed (injected)"),
    ("errors after a lost peer", "host-collective errors after a lost peer"),
    ("launch errors naming the wrong rank", "launch errors not naming the dead rank"),
    ("other errors", "other errors"),
    ("hangs", "hangs"),
    ("leaked processes", "leaked processes"),
    ("leaked shm segments", "leaked shared-memory segments"),
)


def summary(tally: Tally, jobs: list[JobPlan], wall: float, args: dict) -> tuple[str, dict]:
    """The summary table and the JSON record of a run."""
    c = tally.counts
    faults = {
        k: {
            "injected": c[f"faults {k}"],
            "tripped": c[f"faults {k} tripped"],
            "naming the faulted rank": c[f"faults {k} naming the faulted rank"],
            "missed": c[f"faults {k} missed (no error)"],
            "seconds to KernelError (max)": max(tally.error_after.get(k, [0.0])),
        }
        for k in FAULTS
    }
    dist = {W: {"jobs": c[f"jobs W={W}"], "calls": c[f"calls W={W}"]} for W in (2, 3, 4)}
    lines = [
        f"rdepc multi-process soak: backend {args['backend']}, seed {args['seed']}, {args['runs']} calls asked, "
        f"{args['jobs']} job(s) at a time",
        "  W:       " + ", ".join(f"W={W} {d['calls']} calls in {d['jobs']} jobs" for W, d in dist.items()),
        "  covered: "
        + ", ".join(f"{k.removeprefix('cases ')} {v}" for k, v in sorted(c.items()) if k.startswith("cases ") and v),
        f"  {'outcome':<44}{'count':>8}",
    ]
    lines += [f"  {label:<44}{c[key]:>8}" for key, label in ROWS]
    for k, f in faults.items():
        lines.append(
            f"  fault {k:<38}{f['injected']:>8}   tripped {f['tripped']}, naming the faulted rank "
            f"{f['naming the faulted rank']}, missed {f['missed']}, slowest KernelError "
            f"{f['seconds to KernelError (max)']:.1f} s"
        )
    lines.append(f"  {'wall time':<44}{wall:>7.0f}s")
    ok = c["failures"] == 0
    lines.append("soak passed" if ok else f"soak FAILED: {c['failures']} failures")
    for f in tally.failures[:20]:
        lines.append("  - " + f.replace("\n", "\n    "))
    record = {
        **args,
        "passed": ok,
        "jobs_planned": len(jobs),
        "calls_planned": sum(j.calls for j in jobs),
        "W": dist,
        "outcomes": {key: c[key] for key, _ in ROWS},
        "faults": faults,
        "coverage": {k.removeprefix("cases "): v for k, v in sorted(c.items()) if k.startswith("cases ")},
        "failures": tally.failures,
        "per_job": sorted(tally.jobs, key=lambda j: j["job"]),
        "wall_seconds": round(wall, 1),
        "versions": versions(),
    }
    return "\n".join(lines), record


def gpu_check(backend: str) -> str | None:
    """Why ``backend`` cannot run here, or None."""
    if backend != "nvshmem":
        return None
    import torch

    if not torch.cuda.is_available():
        return "--backend nvshmem needs a CUDA GPU and none is visible (on a CPU: --backend emulated-mp)"
    try:
        import nvshmem.core  # noqa: F401
    except (ImportError, OSError) as e:
        return f"--backend nvshmem needs nvshmem4py ({e}): pip install 'rdepc[nvshmem]'"
    return None


def prewarm(jobs: list[JobPlan]) -> None:
    """Compile every (layer, schedule) the jobs use once, here: their ranks then find it cached."""
    import rdepc

    seen = set()
    for job in jobs:
        for case in job.cases:
            key = (case.file, case.overrides, case.schedule)
            if key not in seen:
                seen.add(key)
                rdepc.load(case.file, **dict(case.overrides)).compile(
                    schedule=case.schedule, backend=case.backend, interpret=True
                )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000, help="collective calls to run at least (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="jobs run at a time (each starts W processes)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--backend", choices=("emulated-mp", "nvshmem"), default="emulated-mp")
    ap.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines (0: none)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.jobs < 1:
        ap.error("--runs and --jobs must be positive")
    if why := gpu_check(args.backend):
        print(f"soak: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rdepc-soak-") as tmp:
        specs = build_specs(Path(tmp))
        jobs = plan_jobs(args.runs, args.seed, specs, args.backend)
        if args.backend == "emulated-mp":
            prewarm(jobs)
        print(
            f"soak: {len(jobs)} jobs, {sum(len(j.cases) for j in jobs)} cases, {sum(j.calls for j in jobs)} calls "
            f"planned, {args.jobs} at a time",
            flush=True,
        )
        try:
            tally, wall = run(jobs, args.jobs, args.progress, log=lambda s: print(s, flush=True), workdir=Path(tmp))
        except KeyboardInterrupt:
            print("soak: interrupted (the jobs under way were ended)", file=sys.stderr)
            return 130
    text, record = summary(
        tally, jobs, wall, {"backend": args.backend, "seed": args.seed, "runs": args.runs, "jobs": args.jobs}
    )
    print(text)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
