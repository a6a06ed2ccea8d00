"""Spec fuzzing at scale: the properties of tests/test_spec_fuzz.py over thousands of specs.

    .venv/bin/python tests/stress/fuzz_specs.py --count 10000 --seed 0 [--jobs N] [--json PATH]
                                                [--out DIR] [--plan-every K] [--viz-every K] [--png-every K]

Draws ``--count`` specs from tests/spec_mutate.py (valid and near-valid, half each),
reproducibly for a ``--seed``: hypothesis draws them in this process, under that seed,
before any is run. Each spec goes through ``rdepc check`` and ``rdepc compile`` (as
``rdepc.cli.main`` on a file); every ``--plan-every``-th also through ``rdepc plan``, every
``--viz-every``-th through ``rdepc viz --dot --trace`` and every ``--png-every``-th with
``--png``. A spec whose scheduler would build more than ``LARGE`` tasks in all is only
checked (compiling it is legal and slow). The three properties are asserted on each: no
internal error, check/compile agreement, and the plan invariants (on whatever compiled).

Prints a progress line every few seconds, then the counts: specs, valid and near-valid,
accepted by check, compiled, refused "not supported yet" (by construct), rejected (by
diagnostic, numbers and names folded), usage errors, what went through which stage, the
failures of each property, and the time. Each failure is saved with its spec under
``--out`` (default: a temporary directory). ``--json PATH`` writes the same as JSON.
Exits 1 on any failure (internal error, disagreement, broken invariant, a crash of the
oracle itself, or a spec over the time limit).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import test_spec_fuzz as F  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from spec_gen import GenSpec  # noqa: E402
from spec_mutate import any_specs  # noqa: E402

TIME_LIMIT = 120  # seconds per spec: beyond it the spec counts as a failure (a hang)


CHUNK = 100  # specs drawn under one hypothesis seed; chunk k of seed s is the same whatever --jobs is


def draw_chunk(seed_: int, chunk: int, count: int) -> list[GenSpec]:
    """Specs ``chunk * CHUNK`` .. ``+ count`` of the draw for ``seed_``: hypothesis under a seed
    made of both, so that workers draw their chunks in parallel and the specs stay the same."""
    out: list[GenSpec] = []

    @seed(seed_ * 1_000_003 + chunk)
    @settings(
        max_examples=count,
        database=None,
        derandomize=False,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(any_specs())
    def collect(gs):
        out.append(gs)

    collect()
    return out[:count]


def fold(message: str) -> str:
    """A diagnostic message with its numbers and quoted names folded, to count it by kind."""
    m = re.sub(r"'[^']*'", "'_'", message)
    m = re.sub(r"-?\d[\d,_]*(\.\d+)?(/\d+)?", "N", m)
    m = re.sub(r"\b[A-Za-z_]\w* = N\b", "X = N", m)
    return m[:90]


# ---------------------------------------------------------------------------- worker

_WORK: Path | None = None


def _init(out_root: str) -> None:
    global _WORK
    _WORK = Path(tempfile.mkdtemp(prefix=f"w{os.getpid()}-", dir=out_root))
    signal.signal(signal.SIGALRM, _alarm)


class _TimeLimitError(Exception):
    pass


def _alarm(signum, frame):
    raise _TimeLimitError


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def stages_of(i: int, args) -> tuple[tuple[str, ...], bool]:
    """The commands spec ``i`` goes through, and whether viz draws a PNG."""
    commands = ["check", "compile"]
    if i % args.plan_every == 0:
        commands.insert(1, "plan")
    if i % args.viz_every == (1 % args.viz_every):
        commands.append("viz")
    return tuple(commands), "viz" in commands and i % args.png_every == 1 % args.png_every


def run_chunk(job: tuple[int, int, argparse.Namespace, str]) -> list[dict]:
    """Draw one chunk and examine its specs; failing specs are saved under ``out``."""
    chunk, count, args, out = job
    results = []
    t0 = time.process_time()
    specs = draw_chunk(args.seed, chunk, count)
    draw = (time.process_time() - t0) / max(len(specs), 1)
    for j, gs in enumerate(specs):
        i = chunk * CHUNK + j
        commands, png = stages_of(i, args)
        r = examine(i, gs, commands, png)
        for kind, message, detail in r["failures"]:
            base = Path(out) / f"{kind}-{i:06d}"
            base.with_suffix(".rdep").write_text(gs.text, encoding="utf-8")
            base.with_suffix(".txt").write_text(
                f"kind: {gs.kind}\nmutation: {gs.mutation}\noptions: {' '.join(gs.options())}\n"
                f"failure: {kind}: {message}\n\n{detail}\n",
                encoding="utf-8",
            )
            r["saved"] = str(base.with_suffix(".rdep"))
        r["text_hash"] = hashlib.sha256(gs.text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        r["draw"] = draw
        results.append(r)
    return results


def examine(i: int, gs: GenSpec, commands: tuple[str, ...], png: bool) -> dict:
    """Run one spec through its commands and the three properties; what happened."""
    kind = re.split(r"[ ;]", gs.mutation)[0]  # the last mutation's kind
    r: dict = {"i": i, "kind": gs.kind, "mutation": kind, "failures": [], "png": False}
    t0, c0 = time.perf_counter(), time.process_time()
    signal.alarm(TIME_LIMIT)
    try:
        o = F.run_spec(gs, _WORK, commands, png=png, variant=i)
        r["skipped"] = o.skipped
        r["stages"] = list(o.runs)
        r["png"] = png and "viz" in o.runs
        r["status"] = {cmd: run.status for cmd, run in o.runs.items()}
        check = o.runs["check"]
        r["accepted"] = check.status == 0
        if check.status == 1:
            errors = [m["msg"] for m in F.diagnostics(o, check) if m["sev"] == "error"]
            usage = [ln for ln in check.err.splitlines() if ln.startswith("rdepc: error:")]
            r["rejected"] = fold(errors[0] if errors else usage[0] if usage else "(no diagnostic)")
        comp = o.runs.get("compile")
        if comp is not None and comp.status == 1 and check.status == 0:
            r["not_supported"] = F.not_supported(o, comp)
        for name, prop in (
            ("internal", F.assert_no_internal_error),
            ("agreement", F.assert_agreement),
            ("invariant", F.assert_invariants if o.result is not None else None),
        ):
            if prop is None:
                continue
            try:
                prop(o)
            except AssertionError as e:
                r["failures"].append((name, _first_line(e), traceback.format_exc()))
        if gs.kind == "valid" and not r["accepted"]:
            r["failures"].append(("invariant", "a valid spec is rejected by check", check.err))
        r["compiled"] = o.result is not None
    except _TimeLimitError:
        r["failures"].append(("timeout", f"over {TIME_LIMIT} s", ""))
    except Exception as e:  # the oracle itself broke: reported as a failure, with its traceback
        r["failures"].append(("oracle", f"{type(e).__name__}: {_first_line(e)}", traceback.format_exc()))
    finally:
        signal.alarm(0)
    r["seconds"] = time.perf_counter() - t0
    r["cpu"] = time.process_time() - c0
    return r


# ------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1000, help="specs to draw (default: 1000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draw (default: 0)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all CPUs)")
    ap.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    ap.add_argument("--out", metavar="DIR", help="where failing specs are saved (default: a temporary directory)")
    ap.add_argument("--plan-every", type=int, default=2, metavar="K", help="rdepc plan on every K-th spec (2)")
    ap.add_argument("--viz-every", type=int, default=2, metavar="K", help="rdepc viz on every K-th spec (2)")
    ap.add_argument("--png-every", type=int, default=200, metavar="K", help="viz --png on every K-th spec (200)")
    args = ap.parse_args(argv)
    if args.count < 1 or args.jobs < 1 or min(args.plan_every, args.viz_every, args.png_every) < 1:
        ap.error("--count, --jobs and the --*-every options must be positive")
    out = Path(args.out or tempfile.mkdtemp(prefix="rdepc-fuzz-specs-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="work-", dir=out))

    t_start = time.perf_counter()
    chunks = [(k, min(CHUNK, args.count - k * CHUNK), args, str(out)) for k in range(-(-args.count // CHUNK))]
    print(
        f"{args.count} specs (seed {args.seed}), drawn and run in {len(chunks)} chunks on {args.jobs} process(es)",
        flush=True,
    )
    results: list[dict] = []
    last = time.perf_counter()
    n_fail = 0
    ctx = mp.get_context("fork")
    with ctx.Pool(args.jobs, initializer=_init, initargs=(str(work),)) as pool:
        for batch in pool.imap_unordered(run_chunk, chunks):
            results += batch
            for r in batch:
                n_fail += bool(r["failures"])
                for kind, message, _ in r["failures"]:
                    print(f"FAIL {kind} spec {r['i']}: {message} ({r['saved']})", flush=True)
            now = time.perf_counter()
            if now - last >= 5 or len(results) == args.count:
                last = now
                acc = sum(1 for x in results if x.get("accepted"))
                comp = sum(1 for x in results if x.get("compiled"))
                print(
                    f"[{len(results):>6}/{args.count}] {100 * len(results) / args.count:5.1f} %  "
                    f"{now - t_start:7.1f} s  accepted {acc}  compiled {comp}  failures {n_fail}",
                    flush=True,
                )
    wall = time.perf_counter() - t_start
    summary = summarize(results, args, wall, out)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 1 if summary["failures"]["total"] else 0


def summarize(results: list[dict], args, wall: float, out: Path) -> dict:
    n = len(results)
    kinds = Counter(r["kind"] for r in results)
    stages = Counter(s for r in results for s in r.get("stages", ()))
    failures = Counter(k for r in results for k, _, _ in r["failures"])
    rejected = Counter(r["rejected"] for r in results if "rejected" in r)
    refused = Counter(c for r in results for c in r.get("not_supported") or ())
    status = {
        cmd: dict(sorted(Counter(str(r["status"][cmd]) for r in results if cmd in r.get("status", {})).items()))
        for cmd in ("check", "plan", "compile", "viz")
    }
    return {
        "specs": n,
        "seed": args.seed,
        "jobs": args.jobs,
        "valid": kinds["valid"],
        "near_valid": kinds["near-valid"],
        "mutations": dict(Counter(r["mutation"] for r in results if r["kind"] == "near-valid").most_common()),
        "accepted_by_check": sum(1 for r in results if r.get("accepted")),
        "accepted_near_valid": sum(1 for r in results if r.get("accepted") and r["kind"] == "near-valid"),
        "compiled": sum(1 for r in results if r.get("compiled")),
        "not_supported_yet": dict(refused.most_common()),
        "rejected_by_check": sum(rejected.values()),
        "rejected_by_diagnostic": dict(rejected.most_common()),
        "usage_errors_at_check": sum(1 for r in results if r.get("status", {}).get("check") == 2),
        "skipped_large": sum(1 for r in results if r.get("skipped")),
        "stages": {s: stages[s] for s in ("check", "plan", "compile", "viz")},
        "png": sum(1 for r in results if r.get("png")),
        "distinct_texts": len({(r["text_hash"]) for r in results}),
        "exit_status": status,
        "slowest": [
            {"spec": r["i"], "seconds": round(r["seconds"], 2), "kind": r["kind"], "mutation": r["mutation"]}
            for r in sorted(results, key=lambda r: -r["seconds"])[:5]
        ],
        "failures": {
            "total": sum(failures.values()),
            "internal": failures["internal"],
            "agreement": failures["agreement"],
            "invariant": failures["invariant"],
            "oracle": failures["oracle"],
            "timeout": failures["timeout"],
            "saved_in": str(out),
        },
        "seconds": {
            "wall": round(wall, 1),
            "cpu": round(sum(r["cpu"] + r["draw"] for r in results), 1),
            "draw_cpu": round(sum(r["draw"] for r in results), 1),
            "per_spec_mean": round(sum(r["seconds"] for r in results) / max(n, 1), 4),
            "per_spec_cpu_mean": round(sum(r["cpu"] for r in results) / max(n, 1), 4),
            "per_spec_max": round(max((r["seconds"] for r in results), default=0.0), 2),
        },
    }


def print_summary(s: dict) -> None:
    n = s["specs"]

    def pct(k: int) -> str:
        return f"{k:>6} ({100 * k / max(n, 1):5.1f} %)"

    print(f"\nspecs                 {n} (seed {s['seed']}, {s['jobs']} process(es); {s['distinct_texts']} distinct)")
    print(f"  valid               {pct(s['valid'])}")
    print(f"  near-valid          {pct(s['near_valid'])}  mutations: {s['mutations']}")
    print(f"accepted by check     {pct(s['accepted_by_check'])}  (near-valid among them: {s['accepted_near_valid']})")
    print(f"compiled              {pct(s['compiled'])}")
    print(f"not supported yet     {sum(s['not_supported_yet'].values()):>6}  {s['not_supported_yet'] or ''}")
    print(f"rejected by check     {pct(s['rejected_by_check'])}")
    for msg, k in list(s["rejected_by_diagnostic"].items())[:25]:
        print(f"  {k:>6}  {msg}")
    if len(s["rejected_by_diagnostic"]) > 25:
        print(f"  ... {len(s['rejected_by_diagnostic']) - 25} more kinds")
    print(f"usage errors (check)  {pct(s['usage_errors_at_check'])}")
    print(f"only checked (large)  {pct(s['skipped_large'])}")
    st = s["stages"]
    print(
        f"through each stage    check {st['check']}, plan {st['plan']}, compile {st['compile']}, viz {st['viz']} "
        f"(png {s['png']})"
    )
    print(f"exit status           {s['exit_status']}")
    slow = ", ".join(
        f"#{x['spec']} {x['seconds']} s ({x['kind']} {x['mutation']})".replace(" )", ")") for x in s["slowest"]
    )
    print(f"slowest               {slow}")
    f = s["failures"]
    print(
        f"failures              {f['total']}: internal errors {f['internal']}, agreement {f['agreement']}, "
        f"invariants {f['invariant']}, oracle {f['oracle']}, over the time limit {f['timeout']}"
        + (f" (saved in {f['saved_in']})" if f["total"] else "")
    )
    t = s["seconds"]
    print(
        f"time                  {t['wall']:.1f} s wall, {t['cpu']:.1f} s CPU in the workers ({t['draw_cpu']:.1f} s of "
        f"it drawing); per spec {t['per_spec_mean'] * 1e3:.0f} ms wall ({t['per_spec_cpu_mean'] * 1e3:.0f} ms CPU) "
        f"on average, {t['per_spec_max']:.1f} s at most"
    )


if __name__ == "__main__":
    sys.exit(main())
