"""The soak's bookkeeping (tests/stress/soak.py): each job's outcomes counted, rank by rank
and case by case, into one tally, and every failure a line of it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from soak import JobResult

TOL = 1e-5  # fp32 layers only


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)  # one line per failure
    error_after: dict = field(default_factory=dict)  # fault kind -> seconds a KernelError took to stop the call
    jobs: list = field(default_factory=list)  # one summary per job

    def fail(self, what: str) -> None:
        self.counts["failures"] += 1
        self.failures.append(what)


def named(err: dict, rank: int) -> bool:
    """Whether a KernelError names the rank that raised it and its task."""
    rec = err.get("record") or {}
    msg = err.get("message", "")
    task = rec.get("task")
    return (
        err.get("type") == "KernelError"
        and rec.get("rank") == rank
        and isinstance(task, str)
        and f"({task}) on rank {rank}" in msg
    )


def tally_job(res: JobResult, tally: Tally) -> None:
    """Count one job's outcomes into ``tally``."""
    plan, c = res.plan, tally.counts
    where = f"job {plan.index} (W={plan.W})"
    c["jobs"] += 1
    c[f"jobs W={plan.W}"] += 1
    calls_before = c["calls"]
    _tally_ending(res, tally, where)
    stopped: set[int] = set()  # ranks whose process raised or died: their later cases did not run
    for i in range(len(plan.cases)):
        case = _CaseTally(res, tally, i, where, stopped)
        for rank in range(plan.W):
            case.rank(rank)
        case.finish()
    tally.jobs.append(
        {
            "job": plan.index,
            "W": plan.W,
            "cases": len(plan.cases),
            "calls": c["calls"] - calls_before,
            "faults": [f[0] for f in map(plan.fault, range(len(plan.cases))) if f],
            "status": res.status,
            "seconds": round(res.seconds, 1),
        }
    )


def _tally_ending(res: JobResult, tally: Tally, where: str) -> None:
    """How the job ended (a hang, an error, ranks that died) and what it left behind."""
    c = tally.counts
    if res.status in ("hang", "timeout"):
        c["hangs"] += 1
        tally.fail(f"{where}: hang: {res.message}")
    elif res.status == "error":
        c["other errors"] += 1
        tally.fail(f"{where}: {res.message}\n{res.log_tail}")
    elif res.status == "ranks_error":
        died = [r for r, why in res.failures.items() if "died" in why]
        if died and res.message not in [res.failures[r] for r in died]:
            c["launch errors naming the wrong rank"] += 1
            tally.fail(f"{where}: ranks {died} died, but the launch's error says: {res.message[:300]}")
    c["leaked processes"] += len(res.leaked_processes)
    c["leaked shm segments"] += len(res.leaked_shm)
    for what in res.leaked_processes + [f"shared-memory segment {n} left behind" for n in res.leaked_shm]:
        tally.fail(f"{where}: {what}")


class _CaseTally:
    """One case of a job counted rank by rank: the calls it started, the KernelErrors and
    peer errors its fault raised, and whether one named the faulted rank."""

    def __init__(self, res: JobResult, tally: Tally, i: int, where: str, stopped: set[int]):
        self.res, self.tally, self.c, self.i, self.stopped = res, tally, tally.counts, i, stopped
        self.case = case = res.plan.cases[i]
        fault = res.plan.fault(i)
        self.kind, self.frank = fault if fault else (None, None)
        kind = self.kind
        self.at = f"{where} case {i} ({case.schedule}, {case.mode}, {case.routing}{', fault ' + kind if kind else ''})"
        self.started, self.kernel_errors, self.attributed, self.peer_errors = 0, 0, False, 0
        c = self.c
        c["cases"] += 1
        if kind:
            c[f"faults {kind}"] += 1
        if case.routing == "one":
            c["cases all-to-one" + (" expert" if dict(case.overrides).get("K") == 1 else " owner")] += 1
        if case.rank_tokens is not None and 0 in case.rank_tokens:
            c["cases with an empty rank"] += 1
        c[f"cases {case.schedule} {case.mode}"] += 1

    def rank(self, rank: int) -> None:
        r = self.res.results.get((rank, self.i))
        if r is None:
            self._silent(rank)
        elif "exception" in r:
            self._raised(rank, r)
        else:
            self.started = max(self.started, len(r["calls"]) + ("error" in r))
            self.c["rank-calls completed"] += len(r["calls"])
            if "error" in r:
                self._kernel_error(rank, r)
            else:
                self._check(rank, r)

    def _silent(self, rank: int) -> None:
        """A rank that reported nothing: killed by the fault, or stopped by an earlier case."""
        if rank in self.stopped or self.res.status in ("hang", "timeout"):
            return
        self.stopped.add(rank)
        why = self.res.failures.get(rank, "")
        if self.kind in ("kill", "lost") and rank == self.frank and "died (exit code -9)" in why:
            self.c["ranks killed"] += 1
            self.started = max(self.started, 1)
            return
        self.c["other errors"] += 1
        self.tally.fail(f"{self.at}: rank {rank} reported nothing: {why or self.res.message}")

    def _raised(self, rank: int, r: dict) -> None:
        self.stopped.add(rank)
        self.started = max(self.started, 1)
        if self.kind == "lost":  # a peer lost in a host collective: gloo says so
            self.c["errors after a lost peer"] += 1
            self.peer_errors += 1
            return
        self.c["other errors"] += 1
        self.tally.fail(f"{self.at}: rank {rank} raised {r['exception']}\n{r['trace']}")

    def _kernel_error(self, rank: int, r: dict) -> None:
        c, err, at = self.c, r["error"], self.at
        if err["type"] != "KernelError":
            c["other errors"] += 1
            self.tally.fail(f"{at}: rank {rank}: {err['type']}: {err['message']}")
            return
        c["KernelErrors"] += 1
        self.kernel_errors += 1
        if named(err, rank):
            c["KernelErrors naming rank and task"] += 1
        else:
            self.tally.fail(f"{at}: rank {rank}: a KernelError that does not name its rank and task: {err}")
        if self.kind is None:
            c["KernelErrors unexpected (no fault)"] += 1
            self.tally.fail(f"{at}: rank {rank}: a KernelError with no fault injected: {err['message']}")
        else:
            self.tally.error_after.setdefault(self.kind, []).append(round(r.get("error_after", 0.0), 3))
        rec = err.get("record") or {}
        withheld = {self.res.results.get((self.frank, self.i), {}).get("withheld")} - {None}
        if self.frank is not None and (rec.get("flag_rank") == self.frank or rec.get("flag") in withheld):
            self.attributed = True

    def _check(self, rank: int, r: dict) -> None:
        """A rank that ran its calls without an error: its outputs against the reference."""
        c, calls = self.c, self.case.calls
        if len(r["calls"]) != calls:
            c["checks failed"] += 1
            self.tally.fail(f"{self.at}: rank {rank} ran {len(r['calls'])} of {calls} calls without an error")
        elif "error_rel" not in r:
            c["unchecked"] += 1  # ragged T' under a capacity policy: no reference
        elif r["error_rel"] <= TOL and r["accepted_same"]:
            c["checks passed"] += 1
            c["checks passed in faulted cases"] += self.kind is not None  # ended before its fault reached it
        else:
            c["checks failed"] += 1
            self.tally.fail(f"{self.at}: rank {rank}: error {r['error_rel']:.3g}, accepted same {r['accepted_same']}")

    def finish(self) -> None:
        """The case's calls, and whether its fault tripped an error."""
        c, W = self.c, self.res.plan.W
        c["calls"] += self.started
        c[f"calls W={W}"] += self.started
        if self.kind:
            if self.kernel_errors or self.peer_errors:
                c[f"faults {self.kind} tripped"] += 1
                c[f"faults {self.kind} naming the faulted rank"] += self.attributed
            else:
                c[f"faults {self.kind} missed (no error)"] += 1
