"""A CI-sized slice of the multi-process soak (tests/stress/soak.py), its bookkeeping, and
the launcher's behaviour when a rank is lost around the shared-memory heap.

The slice runs two jobs (W = 2 and 3) of the emulated-mp backend with every schedule and
mode, an all-to-one-expert routing, ranks without tokens, and a stalled rank, a withheld
task, a rank killed mid-call and a rank lost at a random moment: no hang, no leaked process
or shared-memory segment, and KernelErrors only where a fault was injected, each naming the
rank that raised it and its task.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from conftest import HANG_S, ROOT, growing_bounds, orphan_heaps
from rdepc.runtime import ranks

from rdepc.per_rank import Case

sys.path.insert(0, str(ROOT / "tests" / "stress"))
import soak


def slice_jobs(specs: dict[str, str]) -> list[soak.JobPlan]:
    def case(variant: str, schedule: str, W: int, *, K: int = 2, **kw) -> Case:
        return Case(specs[variant], overrides=(("W", W), ("T", 4), ("K", K)), schedule=schedule, seed=len(kw), **kw)

    fault = {"spin_bound": 500, "calls": 1}
    two = (
        case("tiny", "bulk", 2, tokens=4, calls=3, max_delay=0.1, mode="phased"),
        case("seg16", "pipelined", 2, K=1, routing="one", rank_tokens=(4, 0), mode="split", calls=2),
        case("tiny", "bulk", 2, routing="zipf:1.5", tokens=3, stall=(1, 2.0), **fault),
        case("seg8", "deep", 2, routing="hot", tokens=4, calls=3, max_delay=0.1),
        case("seg16", "pipelined", 2, tokens=4, withhold=(0, 3), mode="split", **fault),
        case("tiny", "bulk", 2, routing="one", rank_tokens=(0, 3), mode="split", calls=2),
        # killed 0.02 s into its call: inside it on any machine (0.15 s on a fast one, after prewarm)
        case("tiny", "bulk", 2, tokens=4, kill=(1, 0.02), **fault),
    )
    three = (
        case("seg16", "pipelined", 3, routing="one", rank_tokens=(3, 0, 4), calls=2),
        case("tiny", "bulk", 3, tokens=4, mode="split", calls=3, max_delay=0.1),
        case("seg16", "deep", 3, tokens=2, stall=(2, 2.0), mode="split", **fault),
        case("tiny-cap", "bulk", 3, routing="zipf:1.5", tokens=4, calls=2, mode="phased"),
        case("seg16-b1", "pipelined", 3, tokens=4, withhold=(1, 0), **fault),
        case("tiny", "bulk", 3, tokens=4, calls=2, spin_bound=500),  # the job's rank 1 is lost here
    )
    return [
        soak.JobPlan(0, 2, two, (0.0, 0.2)),
        soak.JobPlan(1, 3, three, (0.1, 0.0, 0.2), lost=(1, 0.6)),
    ]


def test_soak_slice(tmp_path):
    specs = soak.build_specs(tmp_path)
    jobs = slice_jobs(specs)
    soak.prewarm(jobs)
    before = orphan_heaps()
    tally, wall = soak.run(jobs, parallel=2, progress=0, workdir=tmp_path / "work")
    print(soak.summary(tally, jobs, wall, {"backend": "emulated-mp", "seed": None, "runs": None, "jobs": 2})[0])
    c = tally.counts
    assert not tally.failures, "\n".join(tally.failures)
    assert c["hangs"] == 0 and c["leaked processes"] == 0 and c["leaked shm segments"] == 0
    assert c["other errors"] == 0 and c["checks failed"] == 0 and c["KernelErrors unexpected (no fault)"] == 0
    assert c["KernelErrors"] == c["KernelErrors naming rank and task"] > 0
    # every rank of every case without a fault: 4 cases of W = 2, 3 of W = 3 before the lost rank's
    # (a rank of a faulted case may end its call before the fault reaches it, the lost rank 0.6 s
    # into its job: its check then passes too)
    assert c["calls"] >= 22 and c["checks passed"] - c["checks passed in faulted cases"] == 4 * 2 + 3 * 3
    for kind in ("stall", "withhold"):  # deterministic: the peers' waits must expire
        assert c[f"faults {kind} tripped"] == c[f"faults {kind}"] == 2
    assert c["faults kill"] == 1 and c["faults lost"] == 1 and c["ranks killed"] >= 1
    assert c["cases all-to-one expert"] == 1 and c["cases with an empty rank"] == 3
    assert orphan_heaps() <= before


def fake(plan: soak.JobPlan, results: dict, status: str = "ok", **kw) -> soak.JobResult:
    return soak.JobResult(plan, status, kw.pop("message", None), kw.pop("failures", {}), results, 1.0, **kw)


def kernel_error(rank: int, task: str = "scan r0", flag_rank: int = 1) -> dict:
    message = f"rdepc layer tiny: ... task #2 ({task}) on rank {rank} (any task (unified) programs) waited ..."
    return {"type": "KernelError", "message": message, "record": {"rank": rank, "task": task, "flag_rank": flag_rank}}


def test_the_tally_fails_a_kernel_error_without_a_fault_and_one_that_names_no_task():
    plain = Case("x.rdep", calls=1)
    stalled = Case("x.rdep", calls=1, stall=(1, 2.0))
    plan = soak.JobPlan(0, 2, (plain, stalled), (0.0, 0.0))
    ok = {"calls": [0.5], "error_rel": 0.0, "accepted_same": True}
    unnamed = kernel_error(1) | {"message": "the kernel stopped"}
    results = {(0, 0): {"calls": [], "error": kernel_error(0)}, (1, 0): ok, (0, 1): {"calls": [], "error": unnamed}}
    results[(1, 1)] = {"calls": [], "error": kernel_error(1, flag_rank=0)}
    tally = soak.Tally()
    soak.tally_job(fake(plan, results), tally)
    c = tally.counts
    assert c["KernelErrors"] == 3 and c["KernelErrors naming rank and task"] == 2
    assert c["KernelErrors unexpected (no fault)"] == 1 and c["checks passed"] == 1
    assert c["faults stall tripped"] == 1 and c["faults stall naming the faulted rank"] == 1
    assert len(tally.failures) == 2
    assert "no fault injected" in tally.failures[0] and "does not name its rank and task" in tally.failures[1]


def test_the_tally_counts_hangs_leaks_bad_checks_and_the_wrong_dead_rank():
    plan = soak.JobPlan(3, 2, (Case("x.rdep", calls=2),), (0.0, 0.0))
    bad = {"calls": [0.5, 0.5], "error_rel": 0.5, "accepted_same": True}
    tally = soak.Tally()
    soak.tally_job(fake(plan, {(0, 0): bad}, "hang", message="outlived its bound"), tally)
    failures = {0: "rank 0 failed: RuntimeError: Connection closed by peer", 1: "rank 1 died (exit code -9) ..."}
    soak.tally_job(
        fake(plan, {}, "ranks_error", message=failures[0], failures=failures, leaked_shm=["rdepc-heap-1-x"]), tally
    )
    c = tally.counts
    assert c["hangs"] == 1 and c["checks failed"] == 1 and c["leaked shm segments"] == 1
    assert c["launch errors naming the wrong rank"] == 1 and c["other errors"] == 2  # both ranks: no result
    assert len(tally.failures) == 6


# ------------------------------------------------------------------ a rank lost around the heap
def lost_before_the_heap(rank: int, W: int) -> list[str]:
    """Rank 1 is gone before rank 0 can hand it the heap's name: rank 0's broadcast fails,
    and the file it created must go with the error. Rank 1 leaves only after the barrier,
    which rank 0 has then passed too: gone earlier, it could take rank 0's process group
    down while rank 0 is still joining it, before there is any heap."""
    ranks.barrier()
    if rank == 1:
        os._exit(3)
    try:
        ranks.shared_heap(W, 4096)
    except RuntimeError:
        return sorted(p.name for p in Path("/dev/shm").glob(f"{ranks.HEAP_PREFIX}{os.getpid()}-*"))
    return ["no error"]


def test_a_peer_lost_before_the_heap_leaves_no_segment_and_is_the_one_named():
    before = orphan_heaps()
    with pytest.raises(ranks.RanksError, match=r"^rank 1 died \(exit code 3\)") as e:
        ranks.spawn(lost_before_the_heap, 2, timeout=120)
    assert e.value.results[0] == [], e.value.failures  # rank 0 raised, and had already removed its heap
    assert set(e.value.failures) == {1} and orphan_heaps() <= before


def stuck_after_the_heap(rank: int, W: int, marker: str) -> None:
    """Rank 0 creates the heap, then never gets past handing out its name."""
    if rank == 1:
        time.sleep(600)

    def stuck(obj, src=0):
        Path(marker).write_text("created")
        time.sleep(600)

    ranks.broadcast = stuck
    ranks.shared_heap(W, 4096)


def test_a_launch_ended_by_its_timeout_removes_the_heaps_its_ranks_created(tmp_path):
    before = orphan_heaps()
    for bound in growing_bounds(8):
        marker = tmp_path / f"created-{bound:g}"
        with pytest.raises(ranks.RanksError, match="did not finish within"):
            ranks.spawn(stuck_after_the_heap, 2, str(marker), timeout=bound)
        assert orphan_heaps() <= before
        if marker.exists():  # rank 0 had created the heap when the launch was ended
            return
    pytest.fail(f"rank 0 did not reach the heap within {HANG_S} s")
