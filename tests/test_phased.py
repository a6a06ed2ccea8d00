"""Phased mode: the transport kernel, the GEMM kernel and the transport kernel again, one
after another on one stream, each launch with its own queue (``phase_queues``) and every
program of the budget. Under the Triton interpreter: bitwise the unified kernel's forward
and backward, call after call; three launches a call, each reading its own queue record
and the transport's two sharing one ticket counter; a schedule whose GEMMs wait for returns
is refused before anything runs, with a one-line error from the CLI."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, tiny_segmented

from rdepc.api import load
from rdepc.ir.contract import (
    COLUMNS,
    CONTROL,
    CTL_TICKETS,
    GEMM_KINDS,
    KINDS,
    QUEUE_WORDS,
    Tiles,
    phase_queues,
    queue_records,
)
from rdepc.reference import random_inputs

KIND = COLUMNS.index("kind")
BEFORE = {"route", "scan", "dispatch", "push", "receive", "load", "solve", "reroute"}
AFTER = {"return", "unpack", "combine_wait", "combine"}


def tiny_inputs(layer, seed: int = 3):
    sh = layer.shapes
    return random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], seed=seed, gated=True)


def grads(module, inputs):
    x, ids, gates, wg, wu, wd = inputs
    leaves = [a.detach().clone().requires_grad_(True) for a in (x, gates, wg, wu, wd)]
    y = module(leaves[0], ids, leaves[1], *leaves[2:])
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    return [y.detach()] + [a.grad for a in leaves]


def test_phased_is_bitwise_the_unified_kernel_forward_and_backward():
    layer = load(TINY)
    inputs = tiny_inputs(layer)
    unified = layer.module(mode="unified")
    phased = layer.module(mode="phased")
    want, got = grads(unified, inputs), grads(phased, inputs)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    for _ in range(2):  # the next calls: tickets and done flags count on
        assert torch.equal(phased(*inputs), want[0])
    assert torch.equal(phased.last_context.gprime, unified.last_context.gprime)


def test_three_launches_a_call_each_with_its_queue_and_one_ticket_counter():
    layer = load(TINY)
    inputs = tiny_inputs(layer)
    m = layer.module(mode="phased", programs=2)
    assert m.per_queue == (2, 1, 2) and m.grid == 5  # the interpreter's GEMM launch: one program
    seen = []
    inner = m.launcher

    def record(launches):
        assert len(launches) == 1  # one at a time: each done before the next starts
        kernel, grid, _, meta = launches[0]
        seen.append((kernel.fn.__name__, grid, meta.get("GEMMS")))
        inner(launches)

    m.launcher = record
    record.launches = 0
    calls = 3
    for _ in range(calls):
        m(*inputs)
    assert seen == [("rdep_layer", (2,), False), ("rdep_gemm", (1,), None), ("rdep_layer", (2,), False)] * calls
    records = queue_records(m.work, m.per_queue)
    assert len(records) == 3 * QUEUE_WORDS
    (n0, before0, call0), (n2, before2, call2) = records[2:5], records[2 * QUEUE_WORDS + 2 : 2 * QUEUE_WORDS + 5]
    items = [m.work.first_item[hi] - m.work.first_item[lo] for lo, hi in m.work.bounds]
    assert [records[QUEUE_WORDS * q : QUEUE_WORDS * q + 2] for q in range(3)] == [tuple(b) for b in m.work.bounds]
    assert (before0, before2) == (0, items[0] + n0) and call0 == call2 == items[0] + n0 + items[2] + n2
    assert int(m.private["ctl"][CTL_TICKETS]) == calls * call0  # every launch took exactly its tickets
    assert int(m.private["ctl"][CONTROL.index("calls")]) == calls


def test_the_queues_cut_the_transport_at_the_gemms():
    contract = load(TINY).compile().kernel
    work = contract.work(Tiles(), "phased")
    queues = [[work.queue[p] for p in range(lo, hi)] for lo, hi in work.bounds]
    kinds = [{KINDS[work.table[i][KIND]] for i in q} for q in queues]
    assert kinds[0] <= BEFORE and kinds[2] <= AFTER and {KINDS.index(k) for k in kinds[1]} <= GEMM_KINDS
    assert "dispatch" in kinds[0] and "combine" in kinds[2]
    assert sorted(i for q in queues for i in q) == list(range(contract.n_entries))
    # the backward's too: the weight gradients run with the GEMMs
    bwd = contract.work(Tiles(), "phased", backward=True)
    assert sum(hi - lo for lo, hi in bwd.bounds) == len(contract.bwd_table)
    gemms = {KINDS[bwd.table[bwd.queue[p]][KIND]] for p in range(*bwd.bounds[1])}
    assert "wgrad" in gemms


def test_split_and_unified_records_take_their_tickets_as_before():
    """One launch of the ticket-taking kernel a call: its first ticket at (epoch - 1) · (items + programs)."""
    contract = load(TINY).compile().kernel
    for mode, per_queue in (("unified", (3,)), ("split", (1, 2))):
        work = contract.work(Tiles(), mode)
        records = queue_records(work, per_queue)
        lo, hi, n, before, per_call = records[:5]
        assert (before, per_call) == (0, work.first_item[hi] - work.first_item[lo] + n)
        if mode == "split":  # the GEMM kernel takes no tickets
            assert records[QUEUE_WORDS + 3 : QUEUE_WORDS + 5] == (0, 0)


def test_a_schedule_whose_gemms_wait_for_returns_is_refused(tmp_path, main):
    """Segments through one buffer: a segment's GEMM1 waits for its dispatch, which waits for
    the buffer the segment before it frees after its GEMMs — no order of three launches runs that."""
    path = tiny_segmented(tmp_path, rows=32, buffers=1)
    layer = load(path)
    with pytest.raises(ValueError, match=r"phased mode runs the transport's work after the GEMMs .* waits for"):
        layer.module(mode="phased")
    contract = layer.compile().kernel
    work = contract.work(Tiles(), "split")
    with pytest.raises(ValueError, match="use split or unified mode"):
        phase_queues(contract.layer, contract.names, work.table, contract.deps, list(range(contract.n_entries)))
    status, _, err = main("run", str(path), "--mode", "phased", "--check")
    assert status != 0 and "use split or unified mode" in err and len(err.strip().splitlines()) <= 2


def test_rdepc_run_phased_checks_and_says_how_it_launched(main):
    status, out, err = main("run", str(TINY), "--mode", "phased", "--check", "--profile", "/dev/null")
    assert status == 0, err
    assert "3 launches, phased mode, one after another: transport kernel" in out
    assert out.rstrip().endswith("check passed")


def test_phased_takes_no_transport_program_count(main):
    status, _, err = main("run", str(TINY), "--mode", "phased", "--comm-programs", "1")
    assert status != 0 and "it takes no transport-program count" in err


@pytest.mark.parametrize("kind", ["dispatch", "gemm2", "return"])
def test_a_withheld_task_of_any_launch_ends_the_call_and_the_next_one_recovers(kind):
    """A task of the first, second or third launch never signals: its dependent's wait expires
    (in the same launch or a later one), every later launch stops at its start, the host raises
    the kernel's record, and the next call — a fresh epoch — is bitwise a clean one."""
    from rdepc.runtime.module import KernelError

    layer = load(TINY)
    inputs = tiny_inputs(layer)
    m = layer.module(mode="phased")
    good = m(*inputs)
    names = m.contract.names
    victim = next(i for i, n in enumerate(names) if n.startswith(kind))
    m.withhold(victim)
    with pytest.raises(KernelError) as e:
        m(*inputs)
    assert e.value.record["flag"] == victim and e.value.record["what"] == "wait expired"
    assert torch.equal(m(*inputs), good) and m.epoch == 1
