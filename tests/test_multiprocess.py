"""The emulated-mp backend: one OS process per rank, the heap in shared memory, the real
concurrent protocol under the Triton interpreter.

Each rank's output equals the one-process ``emulated`` backend's bitwise (and the
reference within tolerance) for W = 3 and 4 (W = 2 through RDEPMoE and torchrun), both
kernel modes, bulk and pipelined, several seeds and routings, with random start delays
per rank; ranks may bring different T' (zero included); a rank killed mid-call makes every
other rank fail within its bound with a KernelError naming the dead rank; no process or
shared-memory segment outlives a launch, Ctrl-C included. Starting W processes costs a
few seconds (each imports torch and triton), so one launch runs several cases.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, ROOT, block_parameters, block_reference, growing_bounds, orphan_heaps, tiny_segmented
from rdepc.runtime import ranks
from rdepc.runtime.module import KernelError
from tolerance import assert_close, layer_chain
from tolerance import bound as derived_bound  # `bound` names the hang bounds below

import rdepc
from rdepc.per_rank import Case, Job, Progress, run_rank
from rdepc.reference import random_inputs, reference_for

TINY = str(ROOT / "examples" / "tiny.rdep")  # fp32, dropless, H=64, F=128, E=8, K=2, T=16
RDEPC = str(Path(sys.executable).with_name("rdepc"))


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test: no shared-memory heap and no rank process outlives it."""
    before = orphan_heaps()
    yield
    assert orphan_heaps() <= before, f"shared-memory heaps left behind: {orphan_heaps() - before}"
    import multiprocessing

    assert not multiprocessing.active_children()


def emulated(W: int, case: Case) -> torch.Tensor:
    """The one-process backend's output [W, T', H] for the same global inputs."""
    layer = rdepc.load(case.file, W=W)
    sh = layer.shapes
    m = layer.module("emulated", "cpu", schedule=case.schedule, mode="unified")
    T = sh["T"] if case.tokens is None else case.tokens
    inputs = random_inputs(W, T, sh["H"], sh["F"], sh["E"], sh["K"], routing=case.routing, seed=case.seed)
    return m(*inputs)


def reference(W: int, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's output [W, T', H] over the case's global inputs, drawn as
    rdepc.per_rank.run_case draws them, and its bound (tests/tolerance.py): a rank's y is
    within it of its slice ``[rank, :T'_r]`` (dropless, or every rank bringing T')."""
    layer = rdepc.load(case.file, case.layer, **dict(case.overrides))
    sh = layer.shapes
    counts = case.rank_tokens or [sh["T"] if case.tokens is None else case.tokens] * W
    inputs = random_inputs(
        W, max(*counts, 1), sh["H"], sh["F"], sh["E"], sh["K"], routing=case.routing, seed=case.seed,
        gated=layer.spec.expert.gated,
    )  # fmt: skip
    fn = reference_for(layer.spec)
    return fn(*inputs)[0], derived_bound(fn, inputs, layer_chain(sh["H"], sh["F"], sh["K"]))


def cases(W: int, segmented: str) -> list[Case]:
    """Bulk cases on tiny, segmented ones on ``segmented`` (tiny in 32-row segments)."""
    out = []
    for i, (schedule, mode, routing) in enumerate(
        [
            ("bulk", "unified", "uniform"),
            ("pipelined", "split", "zipf:1.0"),
            ("pipelined", "unified", "hot"),
            ("bulk", "split", "one"),
            ("deep", "unified", "uniform"),
        ]
    ):
        out.append(
            Case(
                TINY if schedule == "bulk" else segmented,
                overrides=(("W", W),),
                schedule=schedule,
                mode=mode,
                routing=routing,
                seed=10 * W + i,
                tokens=16 if i % 2 == 0 else 9,
                calls=2 if i == 1 else 1,  # a second call: epochs across processes
                max_delay=0.3,
                keep_output=True,
            )
        )
    return out


@pytest.mark.parametrize("W", [3])  # an odd count; W = 2 runs in test_rdepmoe_per_rank_*, 4 in test_rdepc_run_*
def test_every_rank_matches_emulated_bitwise(W, tmp_path):
    job = Job(tuple(cases(W, str(tiny_segmented(tmp_path)))))
    results = ranks.spawn(run_rank, W, job, timeout=HANG_S, delays=[0.1 * r for r in range(W)])
    for i, case in enumerate(job.cases):
        want = emulated(W, case)
        ref, limit = reference(W, case)
        for rank in range(W):
            got = results[rank][i]
            assert "error" not in got, got["error"]
            assert len(got["calls"]) == case.calls
            assert got["accepted_same"], (case, rank)
            n = got["tokens"]
            assert_close(
                got["y"], ref[rank, :n], limit[rank, :n], f"{case.schedule} {case.mode} {case.routing}: rank {rank}"
            )
            assert torch.equal(got["y"], want[rank]), f"{case.schedule} {case.mode} {case.routing}: rank {rank}"


def test_ranks_may_bring_different_token_counts():
    """T' = 16, 0, 7: the rank with no tokens still takes part (its scans, computes and
    returns serve the others); every slice equals the reference over the same tokens."""
    counts = (16, 0, 7)
    job = Job(
        tuple(
            Case(TINY, overrides=(("W", 3),), rank_tokens=counts, mode=m, seed=3, keep_output=True)
            for m in ("unified", "split")
        )
    )
    ref, limit = reference(3, job.cases[0])  # the cases differ only in their kernel mode
    for per_case in zip(*ranks.spawn(run_rank, 3, job, timeout=HANG_S), strict=True):
        for rank, got in enumerate(per_case):
            assert got["tokens"] == counts[rank] and "error" not in got
            assert got["accepted_same"]
            assert_close(got["y"], ref[rank, : counts[rank]], limit[rank, : counts[rank]], f"rank {rank}")
        received = sum(sum(got["stats"]["received_per_expert"]) for got in per_case)
        assert received == sum(counts) * 2  # K = 2 route rows per token reach their owners


def test_capacity_follows_the_tokens_all_ranks_bring(tmp_path):
    """A capacity policy: each owner's cap_e comes from the T' every front-end published, so
    all ranks agree with the one-process backend (bitwise) and the reference."""
    text = (ROOT / "examples" / "tiny.rdep").read_text()
    assert "capacity  dropless" in text
    spec = tmp_path / "tiny_cap.rdep"
    spec.write_text(text.replace("capacity  dropless", "capacity  factor 1.0, drop arrival, weights renormalize"))
    case = Case(str(spec), overrides=(("W", 2),), routing="zipf:1.5", seed=5, tokens=12, keep_output=True)
    results = [r[0] for r in ranks.spawn(run_rank, 2, Job((case,)), timeout=HANG_S)]
    want = emulated(2, case)
    ref, limit = reference(2, case)
    for rank, got in enumerate(results):
        assert got["stats"]["capacity"] == 6  # ceil(1.0 * W * T' * K / E) = ceil(2 * 12 * 2 / 8)
        assert got["accepted_same"]
        assert_close(got["y"], ref[rank], limit[rank], f"rank {rank}")
        assert torch.equal(got["y"], want[rank])
    assert sum(got["stats"]["dropped_rows"] for got in results) > 0  # zipf 1.5 overflows expert 0


def test_a_killed_rank_fails_the_others_within_their_bound(tmp_path):
    """Rank 1 is SIGKILLed 0.3 s into its call: the others' waits expire (bounded), each
    raises a KernelError with the kernel's record, and one of them names rank 1's task;
    every rank's progress record says where it was: rank 1 in its first call, the others
    past it with their errors."""
    case = Case(TINY, overrides=(("W", 3),), spin_bound=5000, kill=(1, 0.3), progress=str(tmp_path / "p"))
    # Unbounded waits would outlive the launch's bound and fail it as "did not finish".
    with pytest.raises(ranks.RanksError, match=r"rank 1 died \(exit code -9\)") as e:
        ranks.spawn(run_rank, 3, Job((case,)), timeout=HANG_S)
    survivors = [r[0] for r in e.value.results if r is not None]
    assert [s["rank"] for s in survivors] == [0, 2]
    for s in survivors:
        err = s["error"]
        assert isinstance(err, KernelError) and err.record["code"] == 1 and err.record["rank"] == s["rank"]
        assert "waited 5000 spins for the done flag of task" in str(err)
    assert any(s["error"].record["flag_rank"] == 1 for s in survivors)
    progress = Progress.read(str(tmp_path / "p"), 3)
    assert progress[1] == {"calls": 0, "where": "in a call", "seconds": progress[1]["seconds"]}
    for rank in (0, 2):
        p = progress[rank]
        assert p["where"] == "raised" and p["calls"] == 0 and "waited 5000 spins" in p["error"], p
        assert p["after"] == pytest.approx(survivors[rank // 2]["error_after"])


def test_an_expired_wait_on_its_own_rank_still_tells_the_transport_a_peer_may_be_gone():
    """A killed peer shows first, in split mode, as the GEMM kernel's wait on its own rank's
    scan expiring (the scan waits for the dead peer's routes: kill/W2 on an H200): a per-rank
    module tells its transport, so that NVSHMEM's finalize (a collective) is skipped at exit
    instead of waiting for the dead peer there."""
    from types import SimpleNamespace

    from rdepc.runtime.module import RDEPModule
    from rdepc.runtime.records import AT

    plan = rdepc.load(TINY, W=2).compile(backend="emulated-mp").kernel
    words = [0] * len(AT)
    fields = {"err_code": 1, "err_entry": plan.names.index("gemm1 s0 r0"), "err_dep": plan.names.index("scan r0")}
    for name, value in (fields | {"err_rank": 0, "err_epoch": 1, "err_resource": 1, "err_expected": 1}).items():
        words[AT[name]] = value
    lost = []
    module = SimpleNamespace(
        contract=plan, mode="split", spin_bound=5000, per_queue=(1, 1), per_rank=True, rank=0,
        _readback=SimpleNamespace(clear=lambda: None), transport=SimpleNamespace(peers_lost=lost.append),
    )  # fmt: skip
    with pytest.raises(KernelError, match=r"gemm1 s0 r0.*scan r0\) on rank 0"):
        RDEPModule._raise_from(module, words, None, None)
    assert lost == ["a wait for scan r0 on rank 0 failed"] and "rebuild it on every rank" in module._broken


def hangs_at_exit(rank: int, world: int) -> int:
    """Returns, then (rank 1) hangs at exit, as NVSHMEM's finalize does when a PE is gone."""
    if rank == 1:
        import atexit

        atexit.register(time.sleep, 3600)
    return rank


def test_a_rank_that_reported_but_hangs_at_exit_is_told_apart_and_its_result_kept():
    for bound in growing_bounds(10):
        with pytest.raises(ranks.RanksError, match="did not finish within") as e:
            ranks.spawn(hangs_at_exit, 2, timeout=bound)
        if e.value.results == [0, 1]:  # both had reported by the bound: only rank 1's exit hung
            break
    assert str(e.value).endswith("(ranks [1] had reported their results: it was their exit that hung)")
    assert e.value.results == [0, 1] and e.value.failures == {1: "reported its result but did not exit"}


CTRL_C = """
import signal, sys, time
# Ctrl-C as in a terminal, even when the suite itself runs in the background (a shell starts
# background jobs with SIGINT ignored, and processes inherit that)
signal.signal(signal.SIGINT, signal.default_int_handler)
from rdepc.runtime import ranks
from rdepc.per_rank import Case, Job, run_rank
if __name__ == "__main__":
    case = Case(sys.argv[1], overrides=(("W", 2),), calls=10000, progress=sys.argv[2])
    ranks.spawn(run_rank, 2, Job((case,)), timeout=600)
"""


def test_ctrl_c_leaves_no_process_and_no_heap(tmp_path):
    """SIGINT to the whole process group mid-run (as a terminal's Ctrl-C): the launcher and
    its ranks exit, and the heap's name is gone (it was unlinked once every rank mapped it)."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(textwrap.dedent(CTRL_C))
    # stderr to a file, not a pipe: the ranks' KeyboardInterrupt tracebacks could fill a pipe
    # nobody reads while the test waits, and block the processes it waits for.
    log, progress = tmp_path / "stderr.log", tmp_path / "progress"

    def in_calls() -> bool:  # both ranks inside their calls, as their progress files say
        try:
            records = Progress.read(str(progress), 2).values()
            return all(r is not None and (r["where"] == "in a call" or r["calls"] >= 1) for r in records)
        except (OSError, ValueError):
            return False

    with log.open("wb") as err:
        p = subprocess.Popen([sys.executable, str(script), TINY, str(progress)], start_new_session=True, stderr=err)
    try:
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline and not in_calls() and p.poll() is None:
            time.sleep(0.2)
        assert in_calls(), "the ranks did not reach their calls; stderr ends:\n" + log.read_text()[-3000:]
        kids = _children(p.pid)
        assert len(kids) >= 3, "the ranks did not start"  # and the fork server they came from
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("the launcher outlived Ctrl-C by 60 s; its stderr ends:\n" + log.read_text()[-3000:])
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    deadline = time.monotonic() + 10  # the fork server ends when its launcher's pipe closes, under load not at once
    while (left := [k for k in kids if _alive(k)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"rank processes outlived Ctrl-C: {[_cmdline(k) for k in left]}"


def _children(pid: int) -> list[int]:
    """Every process below ``pid``: the ranks are the fork server's children (runtime.ranks._context)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [k for kid in kids for k in _children(kid)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


# Each kernel mode once through the command line, an odd world and an even one among them
# (unified and split at W = 3, one process per rank: test_every_rank_matches_emulated_bitwise)
@pytest.mark.parametrize("W, mode", [(3, "unified"), (4, "split"), (3, "phased")])
def test_rdepc_run_emulated_mp_checks_every_rank(W, mode):
    out = subprocess.run(
        [RDEPC, "run", TINY, "--backend", "emulated-mp", "-D", f"W={W}", "--mode", mode, "--check"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"emulated-mp backend on cpu (Triton interpreter, one process per rank), {mode} mode" in out.stdout
    assert [line.split()[1] for line in lines if line.startswith("  rank ")] == [str(r) for r in range(W)]
    assert all("accepted set matches" in line for line in lines if line.startswith("  rank "))
    assert lines[-1] == "check passed"


def test_rdepc_run_per_rank_errors_are_one_line():
    for argv, msg in [
        (["--backend", "nvshmem"], "--backend nvshmem needs a CUDA GPU and none is visible"),
        (["--backend", "emulated-mp", "--profile", "x.json"], "--profile: not supported yet with the per-rank"),
        (["--backend", "mpi"], "unknown backend 'mpi'"),
    ]:
        out = subprocess.run([RDEPC, "run", TINY, *argv], capture_output=True, text=True, timeout=HANG_S)
        assert out.returncode == 2 and msg in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_world_size_must_equal_W():
    """Under torchrun the processes started must be the spec's W."""
    env = dict(
        os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000)
    )
    out = subprocess.run(
        [RDEPC, "run", TINY, "--backend", "emulated-mp"], capture_output=True, text=True, timeout=HANG_S, env=env
    )
    assert out.returncode == 1
    assert "the layer has W = 4 ranks, but 1 processes were started" in out.stderr


def moe_step(moe, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """y and the gradients of sum(y · dy) (a fixed dy) for x and every parameter."""
    x = x.clone().requires_grad_(True)
    y = moe(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    (y * dy).sum().backward()
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


def moe_rank(rank: int, W: int, file: str) -> tuple[torch.Tensor, dict]:
    """One rank's RDEPMoE block on its own tokens, forward and backward (a spawned rank runs this)."""
    moe = rdepc.RDEPMoE(file, backend="emulated-mp", generator=torch.Generator().manual_seed(7), W=W)
    x = torch.randn(W, 16, 64, generator=torch.Generator().manual_seed(8))
    assert moe.w_up.shape == (len(moe.experts), 64, 128)
    y, grads = moe_step(moe, x[rank])
    return y, grads | {"experts": list(moe.experts)}


def bad_inputs_rank(rank: int, W: int, file: str) -> list[str]:
    """The errors one rank's module gives for inputs that disagree with its plan."""
    m = rdepc.load(file, W=W).module("emulated-mp")
    x, ids, gates, wg, wu, wd = random_inputs(W, 8, 64, 128, 8, 2)
    mine = list(m.local_experts)
    out = []
    for args in [
        (x, ids, gates, wg, wu, wd),  # every rank's tokens and every expert: the one-process signature
        (x[rank], ids[rank], gates[rank], wg, wu, wd),  # every expert's weights
        (x[rank], ids[rank, :, :1], gates[rank], wg[mine], wu[mine], wd[mine]),
    ]:
        try:
            m(*args)
            out.append("no error")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    m(x[rank], ids[rank], gates[rank], wg[mine], wu[mine], wd[mine])  # and the module still runs
    return out


def test_per_rank_inputs_that_disagree_with_the_plan_are_named():
    got = ranks.spawn(bad_inputs_rank, 2, TINY, timeout=HANG_S)
    for rank, (whole, weights, ids) in enumerate(got):
        assert whole == f"rdepc layer tiny (rank {rank} of 2): x must be [T', H=64], got (2, 8, 64)"
        assert weights == f"rdepc layer tiny (rank {rank} of 2): w_up must be [4, 64, 128], got (8, 64, 128)"
        assert ids == f"rdepc layer tiny (rank {rank} of 2): topk_ids must be [T', K] = [8, 2], got (8, 1)"


def test_rdepmoe_per_rank_holds_its_experts_and_matches_one_process():
    """Each rank's block holds its own experts only, routes its own tokens, and its output
    is its slice of the one-process block's (same seed: same weights), bitwise; so are the
    gradients the per-rank backward gives its tokens and its experts. The router's gradient
    is each rank's share of the one-process one (they sum to it)."""
    W = 2
    got = ranks.spawn(moe_rank, W, TINY, timeout=HANG_S)
    moe = rdepc.RDEPMoE(TINY, generator=torch.Generator().manual_seed(7), W=W)
    x = torch.randn(W, 16, 64, generator=torch.Generator().manual_seed(8))
    dy = torch.cat([torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(9)) for _ in range(W)])
    x.requires_grad_(True)
    want = moe(x)
    (want * dy).sum().backward()
    for rank, (y, grads) in enumerate(got):
        assert torch.equal(y, want[rank])
        assert torch.equal(grads["x"], x.grad[rank])
        mine = grads["experts"]
        assert torch.equal(grads["w_gate_up"], moe.w_gate_up.grad[mine])
        assert torch.equal(grads["w_down"], moe.w_down.grad[mine])
    router = sum(grads["router"] for _, grads in got)
    block = block_reference(moe)

    def router_grad(x, params, dy):
        router = params["router"].detach().clone().requires_grad_(True)
        (block(x, params | {"router": router}) * dy).sum().backward()
        return router.grad

    # tiny: the layer's chain, the router's dot over H = 64 and softmax over E = 8, and the
    # W·T·K = 64 rows its gradient sums; the ranks' shares add one sum of W = 2
    chain = layer_chain(64, 128, 2, extra=64 + 8 + 64 + 2)
    assert_close(router, moe.router.grad, derived_bound(router_grad, (x, block_parameters(moe), dy), chain), "router")


def test_under_torchrun_each_process_is_one_rank():
    """The documented launch: torchrun starts the W processes, each joins the process group
    from torchrun's environment, runs its rank and checks its slice."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    argv = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "rdepc", "run", TINY, "--backend", "emulated-mp"]
    out = subprocess.run([*argv, "-D", "W=2", "--check"], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stdout + out.stderr
    ranks_seen = sorted(line.split()[1] for line in out.stdout.splitlines() if line.startswith("  rank "))
    assert ranks_seen == ["0", "1"] and out.stdout.count("check passed") == 2


def test_a_ranks_report_is_one_write(monkeypatch):
    """Under torchrun the ranks share one stdout (unbuffered there): each rank's report goes out
    in one write, so two ranks' reports cannot interleave mid-line."""
    from types import SimpleNamespace

    from rdepc.commands.run import report

    writes = []
    monkeypatch.setattr(sys, "stdout", SimpleNamespace(write=writes.append, flush=lambda: None))
    spec = SimpleNamespace(name="tiny", file="tiny.rdep")
    assert report(spec, "how", "inputs", ["  rank 1  a", "  rank 1  b"], True, False, ["why"]) == 1
    assert writes == [
        "layer tiny (tiny.rdep): how\n  inputs          inputs\n  rank 1  a\n  rank 1  b\ncheck FAILED: why\n"
    ]
