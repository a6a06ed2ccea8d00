"""One short GPU lease, one command: the checks no lease has reached yet, in the order
docs/gpu.md's "What the next lease has to confirm" gives, under one deadline.

    RDEPC_COMMIT=<sha> python3 bench/lease.py --out $OUT --deadline 540    # on the GPU machine
    python bench/lease.py --plan                                             # the steps, in order
    python bench/lease.py --dry-run --out build/lease --steps 1              # CPU: the interpreter

A lease is 15 minutes of device time, machine start included: one call of ~9 minutes
carries what a stage-per-command run (docs/gpu.md) would need four for. Each step (``STEPS``)
is either a subset of an acceptance stage (``acceptance.py --stage S --only ... --budget B``,
records in ``OUT/N-STAGE/``) or one command (a ``rdepc run --check``, a bench), each in a
process of its own, killed at the smaller of its cap and the time left; a step that would
start with under ``MIN_LEFT`` seconds left is recorded as skipped. ``OUT/lease.json`` holds
every step's command, seconds, exit status and the tail of its output, written after each
step; ``OUT/summary.md`` the acceptance's report of every stage's records; and
``OUT/lease.tar.gz`` all of it (a device call brings back a few files only). Commands run in
a scratch folder, examples by absolute path: in the tree's root its ``rdepc/`` would shadow
the installed wheel. A dry run runs the acceptance steps under the interpreter (their own
``--dry-run``) and records the GPU-only commands as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MIN_LEFT = 20.0  # seconds: less than a step's start-up (imports, a prewarm's first builds)
TAIL = 4000  # characters of a step's output kept in lease.json


@dataclass(frozen=True)
class Step:
    """One step: ``stage`` and ``only`` (globs) for a subset of an acceptance stage, run
    with ``--budget budget``; or ``command`` (``{ROOT}``, ``{OUT}`` and ``{PY}`` filled in),
    which needs a GPU. ``cap``: seconds after which its process is killed."""

    why: str
    cap: float
    stage: str | None = None
    only: tuple[str, ...] = ()
    budget: float | None = None
    command: tuple[str, ...] = field(default=())
    tiles: str | None = None  # an acceptance stage's --tiles (a record under bench/results), natively

    def argv(self, out: Path, index: int, dry: bool) -> list[str]:
        if self.stage:
            argv = [sys.executable, str(HERE / "acceptance.py"), "--stage", self.stage]
            argv += ["--out", str(out / f"{index}-{self.stage}")]
            argv += [a for g in self.only for a in ("--only", g)]
            argv += ["--budget", str(self.budget)] if self.budget else []
            argv += ["--tiles", str(ROOT / self.tiles)] if self.tiles and not dry else []
            return argv + (["--dry-run"] if dry else [])
        fill = {"ROOT": str(ROOT), "OUT": str(out), "PY": sys.executable}
        return [a.format(**fill) for a in self.command]


TUNED_1128 = "bench/results/h200-2026-11-28-lease/b-tune.json"  # moonlight's tiles, tuned on an H200

STEPS = (
    Step(
        "the library GEMM lowering against the Triton one and both baselines, on the tiles the 2026-11-28 lease "
        "tuned (no re-tuning): moonlight and qwen3_30b_a3b at T' = 4096 (W = 8 emulated) and moonlight on one GPU "
        "as its only rank (W = 1, T' = 32768: as many route rows), forward and forward+backward, bulk in split and "
        "phased mode x triton / library, sort + _grouped_mm and the fused grouped_mm a careful user writes; a "
        "call replayed from a CUDA graph beside eager calls (its host work gone), the route's span, the "
        "backward's stages (targets: moonlight forward <= 8.5 ms, >= 1.4x sort + _grouped_mm, faster than the "
        "fused one; fwd+bwd <= 24 ms, >= 1.25x; replay within 0.1 ms of the kernel span; route <= 0.1 ms)",
        cap=260,
        stage="perf",
        only=("perf/moonlight/T4096/uniform", "perf/qwen3_30b_a3b/T4096/uniform", "perf/moonlight/T32768/uniform/W1"),
        budget=240,
        tiles=TUNED_1128,
    ),
    Step(
        "the library lowering natively correct: moonlight, qwen3_30b_a3b and deepseek_v3 (fp8 rows with scales) "
        "against the reference forward, moonlight backward, bitwise across calls; captured into a CUDA graph "
        "and replayed (tiny, every mode and both lowerings)",
        cap=120,
        stage="correct",
        only=("library/*", "library_backward/moonlight", "cuda_graph/tiny"),
        budget=100,
    ),
    Step(
        "tile sizes tuned where perf measures (moonlight, T' = 4096, bulk), every candidate prewarmed first "
        "(the last lease: 63 of 63 timed, GEMM2 256 wide and 4 stages 13.87 ms against the defaults' 16.29)",
        cap=150,
        stage="tune",
        budget=130,
    ),
    Step(
        "perf's moonlight case with the tiles just tuned, bulk in phased mode too (the transport, the GEMMs and "
        "the transport again, each on all 132 SMs: the last lease's bulk split ran its GEMMs on 101 SMs, 9.0 ms, "
        "and its dispatch on 31, 1.33 ms against unified's 0.52 on all), the route in chunks of 256 tokens (the last "
        "lease's: 0.85 ms, one program a rank), forward+backward: its backward now "
        "launches the tuned tiles narrowed to fit (Tiles.for_backward; the last lease's ran out of shared "
        "memory); where the backward's time goes (backward_stages) and a call's host time (host_profile; the "
        "launcher now runs each build itself: on a 2-core CPU a split call's host work 311 -> 119 us), each method "
        "also with its calls issued back to back (back_to_back_ms); pipelined split with its GEMM kernel and now its "
        "transport kernel counting the empty segments' entries done in runs (stages_others: the last lease's "
        "3,072 pipelined dispatch items ran 52.6 ms in all against bulk's 8.7); the transport's moves loading 64 KB "
        "a program before they store (16 KB before: the dispatch stage's 1.33 ms; the backward's dispatch, return and "
        "unpack too, its combine 34 -> 21 loads ahead), a training forward's combine "
        "loading every slot before it keeps one (K round trips a step before) and its GEMM kernel copying the input "
        "rows it keeps (the backward: its dO rows) 64 KB a step (16 KB before, a round trip each)",
        cap=110,
        stage="perf",
        only=("perf/moonlight/T4096/uniform",),
        budget=90,
    ),
    Step(
        "how fast this machine's CPU runs a call's host work (bench/host_path.py --module-only: moonlight, every "
        "mode; 84-93 us a call on the project's 2-core CPU): whether the last lease's 2.1 ms was the host's speed",
        cap=60,
        command=("{PY}", "{ROOT}/bench/host_path.py", "--module-only", "--reps", "300", "--out", "{OUT}/host-path"),
    ),
    Step(
        "phased mode natively: moonlight forward and backward bitwise every other schedule and mode, against the "
        "reference; captured into a CUDA graph and replayed",
        cap=100,
        stage="correct",
        only=("forward/moonlight", "backward/moonlight", "cuda_graph/tiny"),
        budget=80,
    ),
    Step(
        "a PE killed: every process exits (the last lease: the survivor raised in 0.03 s, then its exit hung in "
        "NVSHMEM's finalize; its expired wait, on its own rank's scan, now marks the peers lost)",
        cap=130,
        stage="nvshmem",
        only=("kill/W2",),
        budget=110,
    ),
    Step(
        "the balance solver's time at nvl72_e128's shape, rewritten since the last lease timed it at 69-97 ms "
        "(it spilled: 4,424 B of stack; now 16 B)",
        cap=150,
        command=(
            "{PY}",
            "{ROOT}/bench/balance.py",
            "--device-plan",
            "cuda",
            "--shapes",
            "nvl72_e128",
            "--out",
            "{OUT}/balance",
        ),
    ),
)


def plan_text() -> str:
    lines = []
    for i, s in enumerate(STEPS, 1):
        what = f"--stage {s.stage} " + " ".join(f"--only '{g}'" for g in s.only) if s.stage else " ".join(s.command)
        lines.append(f"{i}. [{s.cap:g} s] {s.why}\n   {what}")
    return "\n".join(lines) + "\n"


def run(out: Path, deadline: float, dry: bool, steps: list[int]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    record = {"deadline_s": deadline, "dry_run": dry, "commit": os.environ.get("RDEPC_COMMIT"), "steps": []}
    ok = True
    with tempfile.TemporaryDirectory() as scratch:
        for i in steps:
            step = STEPS[i - 1]
            argv = step.argv(out, i, dry)
            entry = {"step": i, "why": step.why, "argv": argv}
            left = deadline - (time.monotonic() - start)
            if dry and not step.stage:
                entry |= {"status": "skipped", "reason": "a dry run: the command needs a GPU"}
            elif left < MIN_LEFT:
                entry |= {"status": "skipped", "reason": f"{left:.0f} s left of the deadline"}
            else:
                print(f"[lease] step {i}: {step.why} (up to {min(step.cap, left):.0f} s)", flush=True)
                entry |= _run_step(argv, min(step.cap, left), scratch if not step.stage else str(ROOT))
                ok = ok and entry["status"] == "pass"
                print(f"[lease] step {i}: {entry['status']} ({entry['seconds']} s)", flush=True)
            record["steps"].append(entry)
            (out / "lease.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    from bench.acceptance import report

    summary = [report(d) for d in sorted(out.iterdir()) if d.is_dir() and any(d.glob("*.json"))]
    (out / "summary.md").write_text("\n".join(summary), encoding="utf-8")
    with tarfile.open(out / "lease.tar.gz", "w:gz") as tar:
        for p in sorted(out.iterdir()):
            if p.name != "lease.tar.gz":
                tar.add(p, arcname=p.name)
    return 0 if ok else 1


def _run_step(argv: list[str], limit: float, cwd: str) -> dict:
    t0 = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=limit)
        status = "pass" if done.returncode == 0 else "fail"
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        status, code = "cut off", None
        text = _text(e.stdout) + _text(e.stderr) + f"\n[lease] killed after {limit:.0f} s"
    except OSError as e:  # torchrun or the interpreter missing
        status, code, text = "error", None, f"{type(e).__name__}: {e}"
    return {"status": status, "returncode": code, "seconds": round(time.monotonic() - t0, 1), "tail": text[-TAIL:]}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the directory for lease.json, summary.md, lease.tar.gz and each step's records")
    ap.add_argument("--deadline", type=float, default=540, help="seconds for all the steps (default 540)")
    ap.add_argument("--steps", type=int, nargs="+", help="these steps only (1-based, as --plan numbers them)")
    ap.add_argument("--dry-run", action="store_true", help="the acceptance steps on the CPU, the commands skipped")
    ap.add_argument("--plan", action="store_true", help="print the steps and exit")
    args = ap.parse_args(argv)
    if args.plan:
        print(plan_text(), end="")
        return 0
    if not args.out:
        ap.error("--out DIR is needed (or --plan)")
    steps = args.steps or list(range(1, len(STEPS) + 1))
    bad = [s for s in steps if not 1 <= s <= len(STEPS)]
    if bad:
        ap.error(f"no step {bad[0]}: there are {len(STEPS)} (--plan lists them)")
    return run(Path(args.out), args.deadline, args.dry_run, steps)


if __name__ == "__main__":
    sys.path.append(str(ROOT))  # `from bench import ...` as a script; an installed rdepc stays first
    sys.exit(main())
