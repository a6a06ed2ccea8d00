"""The acceptance's ``nvshmem`` stage (bench/acceptance.py): one process per PE, all PEs on
the one GPU (``emulated-mp`` on the CPU in a dry run), started by ``rdepc.runtime.ranks.spawn``
and, for the user's own command, by ``torchrun``.

- ``bitwise/EXAMPLE/W``: every rank's output bitwise equal to the one-process ``emulated``
  backend on the same global inputs, in both strategies (bulk, pipelined) and both kernel
  modes, each with its own module and heap in the same W processes;
- ``kill/W``: one PE SIGKILLed mid-call: the others raise a ``KernelError`` naming the task
  they waited for within their bound, and every process exits (a process still alive at the
  launcher's limit is a hang, e.g. in NVSHMEM's finalize);
- ``rate/EXAMPLE/W``: the dispatch rate between PEs, bytes sent over the dispatch items'
  measured spans (per program, ``%globaltimer``);
- ``torchrun/W``: ``torchrun --nproc-per-node W -m rdepc run ... --check``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

SCHEDULES = ("bulk", "pipelined")
MODES = ("unified", "split")
# spin_bound: the kill check's. Natively 2^20 spins, not the runtime's 2^26: at system scope
# the default outlasted 195 s and 2^22 spins 170 s (H200, 2026-11-27, both cut off), more than a
# device call can spend on one check; the survivors' seconds to their error over these spins
# say how long the default lasts. Interpreted spins are slow: 5,000.
GPU = {"tokens": 512, "ranks": (2, 4), "examples": ("tiny", "moonlight"), "spin_bound": 1 << 20}
DRY = {"tokens": 4, "ranks": (2,), "examples": ("tiny",), "spin_bound": 5000}
KILL_AFTER = 0.3  # seconds into the victim's first call
# calls each rank makes (native): a native call of tiny takes well under a millisecond, so the
# kill must land inside a long run of calls, not after the last (interpreted calls take seconds)
KILL_CALLS = 20_000
LIMIT = 240.0  # seconds a launch of W processes may take before it is ended (and called a hang)
# the kill check's: short enough to end inside a lease's step (bench/lease.py), where the
# survivors' progress records (rdepc.per_rank.Progress) say where each one was
KILL_LIMIT = 100.0


def run(stage, device: str) -> None:
    from bench.acceptance import run_planned

    run_planned(stage, plan(stage.dry_run), device)


def plan(dry: bool) -> list:
    """The stage's checks, each with what it launches: every rank's process its variants
    (the stage's T', each rank's own launch), and the one-process ``emulated`` backend the
    bitwise checks compare with (``reference``, on the GPU too)."""
    from bench.acceptance import Planned

    cfg = DRY if dry else GPU
    backend = "emulated-mp" if dry else "nvshmem"
    tokens = cfg["tokens"]
    out = []
    for W in cfg["ranks"]:
        for name in cfg["examples"]:
            pairs = [(s, m) for s in SCHEDULES for m in MODES] + [("bulk", "phased")]
            runs = tuple(variant(name, W, tokens, backend, s, m) for s, m in pairs)
            refs = tuple(dict.fromkeys(reference(v) for v in runs))
            out.append(Planned(f"bitwise/{name}/W{W}", bitwise, (runs, W, tokens), runs + refs))
        runs = (variant("tiny", W, tokens, backend),)
        out.append(Planned(f"kill/W{W}", kill, (runs, W, cfg["spin_bound"]), runs))
        for name in cfg["examples"]:
            runs = (variant(name, W, tokens, backend, pass_="profile"),)
            out.append(Planned(f"rate/{name}/W{W}", rate, (runs, W), runs))
        runs = (variant("tiny", W, tokens, backend, overrides={"W": W, "T": tokens}),)  # as `-D W=.. -D T=..` sets
        out.append(Planned(f"torchrun/W{W}", torchrun, (runs, W), runs))
    return out


def variant(name: str, W: int, tokens: int, backend: str, schedule=None, mode=None, pass_="forward", overrides=None):
    """A launch of example ``name`` on W ranks at T' = ``tokens`` (``acceptance.Variant``);
    ``mode`` None: the default kernel mode (``default_mode``: split on a GPU)."""
    from bench.acceptance import Variant
    from rdepc.ir.contract import default_mode

    ov = _overrides(name, W, tokens) if overrides is None else overrides
    mode = mode or default_mode(backend == "nvshmem")
    return Variant(_path(name), tuple(ov.items()), schedule, mode, pass_, backend)


def reference(v):
    """The one-process launch a bitwise check compares ``v``'s ranks with."""
    from dataclasses import replace

    return replace(v, mode="unified", backend="emulated")


def _overrides(name: str, W: int, tokens: int) -> dict:
    from bench.accept_correct import DRY as NARROW

    narrowed = {k: v for k, v in NARROW[name].items() if k not in ("W", "T")}
    return narrowed | {"W": W, "T": tokens}


def _path(name: str) -> str:
    from bench.acceptance import ROOT

    return str(ROOT / "examples" / f"{name}.rdep")


def _error(e) -> dict:
    """A picklable account of a rank's exception (a KernelError carries its record)."""
    return {"type": type(e).__name__, "message": str(e), "record": getattr(e, "record", None)}


# ----------------------------------------------------------------------------- in each rank
def rank_cases(rank: int, W: int, cases: list) -> list[dict]:
    """per_rank.run_case for each case in turn; what comes back is plain data."""
    from rdepc.per_rank import run_case

    out = []
    for case in cases:
        r = run_case(case, rank, W)
        if "error" in r:
            r["error"] = _error(r["error"])
        r.pop("stats", None)
        out.append(r)
    return out


def rank_rate(rank: int, W: int, v, device: str) -> dict:
    """One profiled call of variant ``v`` on this rank: its dispatch bytes and the dispatch items' spans."""
    import torch
    from rdepc.passes.transport import transport_bytes
    from rdepc.runtime.profile import STAGE_OF
    from rdepc.runtime.tensors import TORCH_DTYPES

    from rdepc.ir.contract import KINDS
    from rdepc.reference import random_inputs

    layer = v.layer()
    spec, sh = layer.spec, layer.shapes
    m = layer.module(v.backend, device, schedule=v.schedule, mode=v.mode, profile=v.pass_ == "profile")
    T, H, F, E, K = (sh[k] for k in ("T", "H", "F", "E", "K"))
    dt = TORCH_DTYPES[spec.precision.dtype.value]
    x, ids, gates, wg, wu, wd = random_inputs(W, T, H, F, E, K, seed=0, dtype=dt, gated=spec.expert.gated)
    mine = list(m.local_experts)
    args = [x[rank], ids[rank], gates[rank], None if wg is None else wg[mine], wu[mine], wd[mine]]
    args = [None if a is None else a.contiguous().to(m.device) for a in args]
    m(*args)  # warm (compiles natively), then the measured call
    m(*args)
    m.synchronize()
    st = m.last_stats
    sent, back = int(st["dispatched_rows"].sum()), int(st["returned_rows"].sum())
    out_bytes, _ = transport_bytes(spec, sent, int(st["accepted"].sum()), back)
    prof = m.last_profile
    spans = [
        end - start
        for entry, start, end in prof["events"]
        if STAGE_OF[KINDS[m.contract.table[entry].kind]][0] == "dispatch"
    ]
    torch.cuda.synchronize() if m.device.type == "cuda" else None
    return {"rank": rank, "rows": sent, "bytes": int(out_bytes), "clock": prof["clock"], "dispatch_spans": spans}


# ----------------------------------------------------------------------------- the checks
def _spawn(fn, W: int, *args, limit: float = LIMIT):
    from rdepc.runtime import ranks

    return ranks.spawn(fn, W, *args, timeout=limit)


def bitwise(check, variants, W: int, tokens: int, device: str, dry: bool) -> None:
    import torch
    from rdepc.runtime.tensors import TORCH_DTYPES

    from rdepc.per_rank import Case
    from rdepc.reference import random_inputs

    check.figure("overrides", dict(variants[0].overrides))
    cases = [
        Case(v.file, overrides=v.overrides, backend=v.backend, device=device, schedule=v.schedule, mode=v.mode,
             routing="zipf:1.0", keep_output=True)
        for v in variants
    ]  # fmt: skip
    t0 = time.perf_counter()
    per_rank = _spawn(rank_cases, W, cases)
    check.figure("seconds", round(time.perf_counter() - t0, 1))
    # the one-process backend on the same global inputs (drawn on the CPU, as each rank draws them)
    layer = variants[0].layer()
    sh, spec = layer.shapes, layer.spec
    one_device = "cpu" if device == "cpu" else "cuda"
    dt = TORCH_DTYPES[spec.precision.dtype.value]
    inputs = random_inputs(W, tokens, sh["H"], sh["F"], sh["E"], sh["K"], routing="zipf:1.0", seed=0, dtype=dt,
                           gated=spec.expert.gated)  # fmt: skip
    inputs = [None if t is None else t.to(one_device) for t in inputs]
    results = {}
    for i, (case, v) in enumerate(zip(cases, variants, strict=True)):
        key = f"{case.schedule} {case.mode}"
        ref = reference(v)
        m = ref.layer().module(ref.backend, one_device, schedule=ref.schedule, mode=ref.mode)
        want = m(*inputs).cpu()
        m.synchronize()
        same, errors = [], []
        for rank in range(W):
            r = per_rank[rank][i]
            if "error" in r:
                errors.append(f"rank {rank}: {r['error']['message']}"[:300])
                same.append(False)
                continue
            same.append(bool(torch.equal(r["y"], want[rank])))
            check.expect(r.get("accepted_same", True), f"{key}: rank {rank}'s accepted set differs from the reference")
        results[key] = {
            "bitwise": same,
            "errors": errors,
            "max_rel_err": max(r[i].get("error_rel", 0) for r in per_rank),
        }
        check.expect(all(same), f"{key}: ranks {[r for r, s in enumerate(same) if not s]} differ from emulated")
        check.figure("cases", results)


def kill(check, variants, W: int, spin_bound: int | None, device: str, dry: bool) -> None:
    """The last rank SIGKILLed KILL_AFTER s into its run of calls of tiny."""
    import shutil
    import tempfile

    from rdepc.runtime.ranks import RanksError

    from rdepc.per_rank import Case, Progress

    (v,) = variants
    victim = W - 1
    scratch = tempfile.mkdtemp(prefix="rdepc-kill-")
    case = Case(v.file, overrides=v.overrides, backend=v.backend, device=device, schedule=v.schedule, mode=v.mode,
                kill=(victim, KILL_AFTER), calls=3 if dry else KILL_CALLS, spin_bound=spin_bound,
                progress=f"{scratch}/progress")  # fmt: skip
    check.figure("victim", victim)
    check.figure("spin_bound", spin_bound or "the runtime's default")
    t0 = time.perf_counter()
    error = None
    try:
        per_rank = _spawn(rank_cases, W, [case], limit=KILL_LIMIT)
    except RanksError as e:
        error, per_rank = e, e.results
    seconds = check.figure("seconds_all_exited", round(time.perf_counter() - t0, 1))
    # where each rank was last (calls made, in or between calls, its error): what shows a hang's place
    check.figure("progress", Progress.read(f"{scratch}/progress", W))
    shutil.rmtree(scratch, ignore_errors=True)
    message = str(error) if error else ""
    hung = "did not finish within" in message
    check.figure("launcher", message.splitlines()[0][:300] if message else "no error")
    check.figure("hung", hung)
    check.expect(error is not None, "the launch with a killed rank did not fail")
    check.expect(not hung, f"processes still alive after {KILL_LIMIT:g} s (NVSHMEM finalize or a wait that never ends)")
    check.expect(f"rank {victim}" in message, f"the launcher does not name rank {victim}: {message[:200]}")
    survivors = {}
    for rank in range(W):
        if rank == victim:
            continue
        r = (per_rank[rank] or [None])[0] if per_rank else None
        if r is None:
            survivors[rank] = {"result": None, "why": (getattr(error, "failures", {}) or {}).get(rank)}
            check.expect(False, f"rank {rank} returned no result")
            continue
        err = r.get("error")
        survivors[rank] = {"error": err and err["message"][:300], "seconds_to_error": r.get("error_after")}
        check.expect(err is not None and err["type"] == "KernelError", f"rank {rank} raised no KernelError")
        if err and err.get("record"):
            rec = err["record"]
            survivors[rank] |= {
                "task": rec.get("task"),
                "waited_for": rec.get("flag_task"),
                "of_rank": rec.get("flag_rank"),
            }
    check.figure("survivors", survivors)
    check.figure("seconds", seconds)


def rate(check, variants, W: int, device: str, dry: bool) -> None:
    (v,) = variants
    per_rank = _spawn(rank_rate, W, v, device)
    rates = {}
    for r in per_rank:
        busy = sum(r["dispatch_spans"])
        timed = r["clock"] == "globaltimer" and busy > 0
        rates[r["rank"]] = {
            "rows": r["rows"], "bytes": r["bytes"], "dispatch_items": len(r["dispatch_spans"]),
            "busy_ns": busy if timed else None,
            "gb_per_s_per_program": r["bytes"] / busy if timed else None,  # bytes per ns = GB/s
        }  # fmt: skip
        check.expect(r["rows"] > 0, f"rank {r['rank']} dispatched no rows")
    check.figure("clock", per_rank[0]["clock"])
    check.figure("ranks", rates)
    got = [v["gb_per_s_per_program"] for v in rates.values() if v["gb_per_s_per_program"] is not None]
    check.figure("gb_per_s_per_program_min", min(got) if got else None)


def torchrun(check, variants, W: int, device: str, dry: bool) -> None:
    """The user's command: torchrun, one process per rank, rdepc run --check (the example's
    own schedule, unified: the command's defaults)."""
    from bench.acceptance import example_path
    from rdepc.toolchain import package_home

    (v,) = variants
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(W)]
    argv += ["-m", "rdepc", "run", str(example_path(v.file)), "--backend", v.backend, "--check"]
    argv += [a for k, n in v.overrides for a in ("-D", f"{k}={n}")]
    argv += ["--schedule", v.schedule] if v.schedule else []
    argv += ["--mode", v.mode] if v.mode else []
    if dry:
        argv += ["--device", "cpu"]
    check.figure("command", " ".join(argv[1:]))
    home = check.figure("cwd", package_home())
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        # the ranks' `-m rdepc` imports the rdepc this process runs, not the tree's rdepc/ the
        # working folder may hold (an installed wheel's has its subpackages; the tree's has not)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=LIMIT, env=env, cwd=home)
    except subprocess.TimeoutExpired:
        check.expect(False, f"torchrun did not finish within {LIMIT:g} s")
        return
    check.figure("seconds", round(time.perf_counter() - t0, 1))
    check.figure("returncode", done.returncode)
    tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
    check.figure("output_tail", tail)
    check.expect(done.returncode == 0, f"torchrun exited {done.returncode}: {tail[-1] if tail else ''}")
    check.expect("check passed" in done.stdout, "rdepc run did not say 'check passed'")
