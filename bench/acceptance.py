"""The acceptance: one command per stage turns a lent GPU into evidence (docs/gpu.md).

    python bench/acceptance.py --stage correct --out bench/results/DEVICE-DATE   # on a GPU, < 8 min a stage
    python bench/acceptance.py --stage all --dry-run --out build/acceptance      # CPU: the interpreter, tiny shapes
    python bench/acceptance.py --report bench/results/DEVICE-DATE                # the summary table
    python bench/acceptance.py --plot bench/results/DEVICE-DATE                  # perf.png from perf.json

Stages (``all``: them in order, for a machine without a per-command limit):

- ``correct``: every example natively, all W ranks emulated on the one device: forward
  against the reference (accepted set identical) and bitwise across strategies and kernel
  modes; backward gradients against autograd through the reference; fp8 and dedup; a call
  captured in a CUDA graph and replayed with new inputs; a withheld task giving a
  ``KernelError`` within its bound, and the next call recovering.
- ``nvshmem``: one process per PE (``emulated-mp`` in a dry run): every rank bitwise equal
  to the one-process ``emulated`` backend, a PE killed mid-call, the dispatch rate.
- ``perf``: rdepc against sort + ``torch._grouped_mm``, ``torch._grouped_mm`` alone and the
  dense roof, forward and forward+backward, per-stage spans, host overhead per call.
- ``tune``: ``rdepc tune`` on moonlight, and the record it writes.

Each stage first compiles, in parallel processes (one per core, at most 16), every build of
the generated kernel its checks will launch into Triton's on-disk cache (check ``prewarm``),
so that no check waits for Triton's JIT to compile a variant (~10-40 s of one core each)
serially; a dry run only lists them. The list of what a stage launches (:class:`Variant`:
example, schedule, kernel mode, pass) is made once per stage (its ``plan``) and drives both
the prewarm and the checks.

Each stage writes ``OUT/STAGE.json`` after every check (environment, every check with its
figures and verdict), so a stage killed at its limit leaves what it measured. Checks past
``--budget`` seconds are recorded as skipped, not run. ``--dry-run`` runs every stage on the
CPU under the Triton interpreter at tiny shapes: the same code paths and JSON fields (CI).
"""

from __future__ import annotations

import argparse
import contextvars
import datetime as dt
import fnmatch
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STAGES = ("correct", "nvshmem", "perf", "tune")
STATUSES = ("pass", "fail", "error", "skipped")
ALWAYS = ("prewarm",)  # checks a run makes whatever --only selects (prewarm: for the checks selected)
TILES: contextvars.ContextVar = contextvars.ContextVar("tiles", default=None)  # --tiles: every module's


def given_tiles(path: Path):
    """The Tiles a ``--tiles`` file holds: a Tiles' fields, an ``rdepc tune`` record (``tiles``)
    or an acceptance tune stage's record (its tune check's ``best``)."""
    from rdepc.ir.contract import Tiles

    rec = json.loads(path.read_text(encoding="utf-8"))
    if "checks" in rec:
        rec = next(c["figures"]["best"] for c in rec["checks"] if c["name"].startswith("tune/"))
    return Tiles(**rec.get("tiles", rec))


PREWARM_PROCESSES = 16  # at most: one per core of the GPU machines


class Check:
    """One check's figures and verdicts: ``expect`` records a failed condition without
    stopping the check, so everything it measured is kept."""

    def __init__(self, name: str):
        self.name = name
        self.figures: dict = {}
        self.failures: list[str] = []

    def figure(self, key: str, value):
        self.figures[key] = value
        return value

    def expect(self, ok: bool, message: str) -> bool:
        if not ok:
            self.failures.append(message)
        return bool(ok)


class Stage:
    """A stage's record, ``OUT/NAME.json``, rewritten (atomically) after every check."""

    def __init__(self, name: str, out: Path, *, dry_run: bool, budget: float, only: list[str], device: str):
        self.name, self.out, self.dry_run, self.only = name, out, dry_run, only
        self.started = time.monotonic()
        self.deadline = self.started + budget
        self.record = {
            "stage": name,
            "dry_run": dry_run,
            "environment": environment(device),
            "budget_s": budget,
            "only": only,
            "started": now(),
            "finished": None,
            "complete": False,
            "checks": [],
            "summary": dict.fromkeys(STATUSES, 0),
            "full_run": False,  # some run of this stage went through without --only
        }
        out.mkdir(parents=True, exist_ok=True)
        self._merge()
        self._write()

    def _merge(self) -> None:
        """Keep the checks of an earlier run of this stage on the same tree (``--only`` after a
        budget ran out): a check run again replaces its old entry."""
        try:
            old = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return
        same = (
            old.get("dry_run") == self.dry_run
            and old.get("environment", {}).get("commit") == (self.record["environment"]["commit"])
        )
        if not same or old.get("environment", {}).get("commit") == "unknown":
            return
        self.record["checks"] = list(old.get("checks", []))
        self.record["full_run"] = bool(old.get("full_run"))

    @property
    def path(self) -> Path:
        return self.out / f"{self.name}.json"

    def _write(self) -> None:
        checks = self.record["checks"]
        self.record["summary"] = {s: sum(c["status"] == s for c in checks) for s in STATUSES}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1, default=str) + "\n", encoding="utf-8")
        tmp.replace(self.path)

    def wanted(self, name: str) -> bool:
        return not self.only or name in ALWAYS or any(fnmatch.fnmatchcase(name, p) for p in self.only)

    def run(self, name: str, fn, *args, **kwargs) -> Check | None:
        """Run check ``name`` (``fn(check, *args, **kwargs)``) unless ``--only`` leaves it out
        or the budget is spent; record it either way."""
        if not self.wanted(name):
            return None
        check = Check(name)
        entry = {"name": name, "status": "skipped", "seconds": 0.0, "figures": check.figures, "failures": []}
        if time.monotonic() > self.deadline:
            entry["failures"] = [f"not run: the stage's budget of {self.record['budget_s']:g} s was spent"]
            return self._add(entry, check)
        print(f"[{self.name}] {name} ...", flush=True)
        t0 = time.monotonic()
        try:
            fn(check, *args, **kwargs)
            entry["status"] = "fail" if check.failures else "pass"
        except Exception as e:  # recorded with what was measured before it; the next check runs
            entry["status"] = "error"
            entry["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            entry["traceback"] = traceback.format_exc()[-3000:]
        entry["seconds"] = round(time.monotonic() - t0, 3)
        entry["failures"] = check.failures
        return self._add(entry, check)

    def _add(self, entry: dict, check: Check) -> Check:
        kept = [c for c in self.record["checks"] if c["name"] != entry["name"]]
        self.record["checks"] = [*kept, entry]
        self._write()
        why = entry.get("error") or "; ".join(entry["failures"])
        print(f"[{self.name}] {entry['name']}: {entry['status']} ({entry['seconds']:.1f} s){' ' + why if why else ''}")
        return check

    def finish(self) -> bool:
        self.record["finished"] = now()
        self.record["seconds"] = round(time.monotonic() - self.started, 1)
        self.record["full_run"] = self.record["full_run"] or not self.only
        self._write()
        s = self.record["summary"]
        self.record["complete"] = s["skipped"] == 0 and self.record["full_run"]
        self._write()
        print(f"[{self.name}] {', '.join(f'{v} {k}' for k, v in s.items())}; wrote {self.path}", flush=True)
        return s["fail"] == s["error"] == 0


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def environment(device: str) -> dict:
    """moe_bench's environment (device, driver, torch, triton, python, date) with the git
    commit, whether the tree had changes, and the NVSHMEM packages."""
    from importlib import metadata

    import torch

    from bench.moe_bench import environment as bench_environment

    env = bench_environment(torch.device(device))
    for name in ("nvidia-nvshmem-cu13", "nvshmem4py-cu13", "nvidia-nvshmem-cu12", "nvshmem4py-cu12"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    env["nvshmem"] = next((env[k] for k in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12") if k in env), None)

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    # RDEPC_COMMIT, set by whoever packed the wheel, names the tree: a copy on the GPU machine
    # may carry a .git of another commit than the wheel's, or none
    packed = os.environ.get("RDEPC_COMMIT")
    commit = "" if packed else git("rev-parse", "HEAD")
    env["commit"] = packed or commit or "unknown"
    env["tree_changed"] = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    return env


# ----------------------------------------------------------------------------- what a stage launches
@dataclass(frozen=True)
class Variant:
    """One way a check launches the generated kernel: the example (``file`` as the check
    names it, ``edit`` a text edit of it from ``EDITS``, ``overrides`` of its parameters),
    the schedule (None: the layer's own), the kernel mode, the pass (``forward`` a call
    without autograd, ``train`` a call under autograd and its backward, ``profile`` a
    profiled call: ``rdepc.codegen.prewarm.PASSES``) and the backend (a per-rank one: every
    rank's process launches it)."""

    file: str
    overrides: tuple[tuple[str, int], ...]
    schedule: str | None = None
    mode: str = "unified"  # the stages' variant() helpers give rdepc.ir.contract.default_mode where none is asked
    pass_: str = "forward"
    backend: str = "emulated"
    edit: str | None = None
    gemm: str = "triton"  # the expert GEMMs' lowering (rdepc.ir.lowering): the library's runs phased

    def layer(self):
        """The example as a Layer (one per example, edit and overrides in this process)."""
        return _layer(self.file, self.overrides, self.edit)

    @property
    def label(self) -> str:
        sizes = ",".join(f"{k}={v}" for k, v in self.overrides)
        edit = f"+{self.edit}" if self.edit else ""
        gemm = " library" if self.gemm == "library" else ""
        return f"{Path(self.file).stem}{edit}[{sizes}] {self.backend} {self.schedule or 'own'}{gemm}"

    def requests(self, *, interpret: bool, sms: int, device_name: str | None) -> list[dict]:
        """rdepc.codegen.prewarm.prewarm's requests for this variant's native launches: the
        generated file a module of it runs (from rdepc's cache), the tiles it launches with
        (``rdepc tune``'s record for ``device_name``, or the defaults), a GPU of ``sms`` SMs.
        ValueError where the module refuses the launch. ``interpret``: the cache entry of an
        interpreted module (a dry run lists what it would prewarm without generating twice)."""
        from rdepc.codegen.prewarm import launch_requests
        from rdepc.runtime import tune

        gemm = "library" if self.gemm == "library" else None
        compiled = self.layer().compile(schedule=self.schedule, backend=self.backend, interpret=interpret, gemm=gemm)
        plan = compiled.kernel
        tiles, _ = tune.launch_tiles(plan, device_name, interpret=False)  # as a native RDEPModule picks them
        tiles = TILES.get() or tiles
        return launch_requests(compiled.kernels_path, compiled.directory / "contract.json", mode=self.mode,
                               pass_=self.pass_, tiles=tiles, sms=sms, label=self.label, gemm=self.gemm)  # fmt: skip

    def module(self, device: str, **options):
        """A module of this variant on ``device`` (its schedule, mode and lowering; the stage's
        ``--tiles`` where given)."""
        gemm = {"gemm": "library"} if self.gemm == "library" else {}
        tiles = {"tiles": TILES.get()} if TILES.get() is not None else {}
        return self.layer().module(self.backend, device, schedule=self.schedule, mode=self.mode,
                                   **(gemm | tiles | options))  # fmt: skip


def example_path(file: str) -> Path:
    """A variant's example file as an absolute path (``file`` relative: to the source tree)."""
    return Path(file) if Path(file).is_absolute() else ROOT / file


@functools.cache
def _layer(file: str, overrides: tuple, edit: str | None):
    from rdepc.api import Layer, elaborate_layer
    from rdepc.parser import parse_text

    text = example_path(file).read_text(encoding="utf-8")
    if edit is not None:
        text = EDITS[edit](text)
    spec, warnings = elaborate_layer(parse_text(text, file), None, dict(overrides))
    return Layer(spec, warnings)


def _dedup(text: str) -> str:
    old = "transport nvshmem"
    if old not in text:
        raise ValueError(f"the example no longer says '{old}': update the acceptance's dedup edit")
    return text.replace(old, "transport nvshmem, dedup")


EDITS = {"dedup": _dedup}  # text edits of an example a check runs (dedup: deepseek_v3 under dedup)


class Planned(NamedTuple):
    """A check of a stage's plan: ``fn(check, *args, device, dry)``, and what it launches."""

    name: str
    fn: object
    args: tuple
    variants: tuple[Variant, ...]


def run_planned(stage, planned: list[Planned], device: str) -> None:
    """The stage's ``prewarm`` (what the checks selected will launch), then its checks."""
    chosen = [p for p in planned if stage.wanted(p.name)]
    if chosen:
        stage.run("prewarm", prewarm, [v for p in chosen for v in p.variants], device, stage.dry_run, stage.deadline)
    for p in planned:
        stage.run(p.name, p.fn, *p.args, device, stage.dry_run)


def prewarm(check, variants: list[Variant], device: str, dry: bool, deadline: float) -> None:
    """Every build the variants' native launches need compiled into Triton's cache, in
    parallel processes (rdepc.codegen.prewarm.prewarm): each once, those already there not
    again. A dry run lists them and compiles nothing (the interpreter compiles nothing)."""
    from rdepc.ir.contract import H100_SMS

    unique = list(dict.fromkeys(variants))
    if dry:
        sms, name = H100_SMS, None
    else:
        import torch

        sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
        name = torch.cuda.get_device_name(torch.device(device))
    requests, refused = [], []
    for v in unique:
        try:
            requests += v.requests(interpret=dry, sms=sms, device_name=name)
        except ValueError as e:  # the module refuses it too: nothing launches
            refused.append(f"{v.label} {v.mode}: {e}"[:300])
    check.figure("variants", len(unique))
    check.figure("launches", len(requests))
    check.figure("refused", refused)  # launches a module refuses (a split the GPU cannot hold at once)
    if dry:
        check.figure("compiled", 0)
        check.figure("dry_run", "nothing compiled: under the interpreter nothing is")
        return
    from rdepc.codegen import prewarm as warm

    processes = check.figure("processes", max(1, min(PREWARM_PROCESSES, os.cpu_count() or 1)))
    t0 = time.monotonic()
    results = warm.prewarm(requests, processes, timeout=max(60.0, deadline - time.monotonic()))
    check.figure("seconds", round(time.monotonic() - t0, 1))
    summary = warm.prewarm_summary(results)
    for k in ("builds", "compiled", "cached", "duplicate", "failed", "not run", "compile_seconds", "longest_seconds"):
        check.figure(k.replace(" ", "_"), summary[k])
    check.figure("failures", summary["failures"])
    check.figure("builds_list", [{k: r.get(k) for k in ("label", "status", "seconds")} for r in results])
    check.expect(not summary["failed"], f"{summary['failed']} builds failed: {'; '.join(summary['failures'])[:600]}")
    check.expect(not summary["not run"], f"{summary['not run']} builds not compiled before the timeout")


# ----------------------------------------------------------------------------- the report
def report(directory: Path) -> str:
    """A markdown summary of every stage record in ``directory``."""
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            records.append({"stage": path.stem, "unreadable": str(e)})
            continue
        if isinstance(rec, dict) and rec.get("stage") in STAGES:
            records.append(rec)
    order = {s: i for i, s in enumerate(STAGES)}
    records.sort(key=lambda r: order.get(r["stage"], len(order)))
    if not records:
        return f"no stage records (STAGE.json) in {directory}\n"
    env = next((r["environment"] for r in records if "environment" in r), {})
    lines = [f"# Acceptance: {directory.name}", ""]
    lines.append(
        f"{env.get('device')}, driver {env.get('driver')}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"nvshmem {env.get('nvshmem')}, Python {env.get('python')}, commit {str(env.get('commit'))[:12]}"
    )
    lines += [
        "",
        "| stage | dry run | pass | fail | error | skipped | complete | seconds | finished |",
        "|---" * 9 + "|",
    ]
    for r in records:
        if "unreadable" in r:
            lines.append(f"| {r['stage']} | unreadable: {r['unreadable']} |||||||")
            continue
        s = r["summary"]
        fin = r["finished"] or "killed before the end"
        lines.append(
            f"| {r['stage']} | {'yes' if r['dry_run'] else 'no'} | {s['pass']} | {s['fail']} | {s['error']} | "
            f"{s['skipped']} | {'yes' if r['complete'] else 'no'} | {r.get('seconds', '')} | {fin} |"
        )
    for r in records:
        if "unreadable" in r:
            continue
        lines += ["", f"## {r['stage']}", "", "| check | status | s | figures |", "|---|---|---|---|"]
        for c in r["checks"]:
            why = c.get("error") or "; ".join(c["failures"])
            figs = _brief(c["figures"])
            lines.append(f"| {c['name']} | {c['status']} | {c['seconds']:.1f} | {figs}{' — ' + why if why else ''} |")
    return "\n".join(lines) + "\n"


def plot(directory: Path) -> int:
    """``directory/perf.png`` from ``directory/perf.json`` (accept_perf_plot.plot_perf); 2 where
    there is no perf record or no case in it."""
    from bench.accept_perf_plot import plot_perf

    path = directory / "perf.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        print(f"acceptance: --plot {directory}: no perf record to plot ({e})", file=sys.stderr)
        return 2
    png = directory / "perf.png"
    if not plot_perf(record, png):
        print(f"acceptance: --plot {directory}: {path} holds no perf case", file=sys.stderr)
        return 2
    print(f"wrote {png}")
    return 0


def _brief(figures: dict, limit: int = 6) -> str:
    """The first scalar figures of a check, for a table cell."""
    out = []
    for k, v in figures.items():
        if isinstance(v, bool | int | str) or v is None:
            out.append(f"{k} {v}")
        elif isinstance(v, float):
            out.append(f"{k} {v:.4g}")
        if len(out) == limit:
            break
    return ", ".join(out).replace("|", "/")


# ----------------------------------------------------------------------------- the command
def run_stage(name: str, args) -> bool:
    from bench import accept_correct, accept_perf, accept_ranks

    device = "cpu" if args.dry_run else "cuda"
    budget = args.budget if args.budget is not None else (3600.0 if args.dry_run else 450.0)
    stage = Stage(name, Path(args.out), dry_run=args.dry_run, budget=budget, only=args.only, device=device)
    runner = {
        "correct": accept_correct.run,
        "nvshmem": accept_ranks.run,
        "perf": accept_perf.run_perf,
        "tune": accept_perf.run_tune,
    }[name]
    try:
        runner(stage, device)
    finally:
        ok = stage.finish()
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", choices=(*STAGES, "all"), help="the stage to run")
    ap.add_argument("--out", help="the directory the stage records (STAGE.json) go to")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU under the Triton interpreter, tiny shapes")
    ap.add_argument("--budget", type=float, help="seconds after which a stage's remaining checks are skipped")
    ap.add_argument("--only", action="append", default=[], help="run only checks matching this glob (repeatable)")
    ap.add_argument("--report", metavar="DIR", help="print the markdown summary of the stage records in DIR")
    ap.add_argument("--plot", metavar="DIR", help="write DIR/perf.png from DIR/perf.json (times and stage timelines)")
    ap.add_argument(
        "--tiles",
        metavar="FILE",
        help="launch every module with these tiles (JSON: a Tiles' fields, or an rdepc tune record or acceptance "
        "tune record holding them) instead of this machine's tuning record or the defaults",
    )
    args = ap.parse_args(argv)
    if args.tiles:
        try:
            TILES.set(given_tiles(Path(args.tiles)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"acceptance: --tiles {args.tiles}: {e}", file=sys.stderr)
            return 2
    if args.report or args.plot:
        if args.stage:
            ap.error("--report DIR and --plot DIR read records; they run no stage")
        for flag, given in (("--report", args.report), ("--plot", args.plot)):
            if given and not Path(given).is_dir():
                print(f"acceptance: {flag} {given}: no such directory", file=sys.stderr)
                return 2
        if args.report:
            print(report(Path(args.report)), end="")
        return plot(Path(args.plot)) if args.plot else 0
    if not args.stage or not args.out:
        ap.error("--stage STAGE and --out DIR are needed (or --report DIR, --plot DIR)")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("acceptance: no CUDA GPU here; on a CPU run --dry-run", file=sys.stderr)
            return 2
    if args.dry_run:  # Triton fixes its mode when first imported: the interpreter, before anything imports it
        os.environ["TRITON_INTERPRET"] = "1"
    stages = STAGES if args.stage == "all" else (args.stage,)
    ok = True
    for name in stages:
        ok = run_stage(name, args) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    # `from bench import ...` when run as a script; appended, so an installed rdepc (a wheel) comes first
    sys.path.append(str(ROOT))
    sys.exit(main())
