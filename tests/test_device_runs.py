"""kernel.py's ``take_empty_run`` under the interpreter, on a task table built here: which
entries a run of moves without rows counts done, the tickets it takes and what it leaves
(the kernels file: tests/device_kernels.py)."""

from __future__ import annotations

import torch
from device_kernels import BASE, launch

COL = {c[2:].lower(): v for c, v in BASE.items() if c.startswith("C_")}
W, E_MAX, S = BASE["W"], BASE["E_MAX"], BASE["S"]
TARGET = 2  # the call: an entry is done at TARGET × its items
BASE_TICKET = 100  # the call's first ticket on the counter


def runs_on(row: dict) -> int:
    """The rank that runs a move: its source (dispatch, unpack) or its owner (return)."""
    return row["owner"] if row["kind"] == "return" else row["src"]


def build(rows: list[dict], deps: list[int], queue: list[int]):
    """The tensors take_empty_run reads for a table of ``rows`` (kind, src, owner,
    segment, items, deps as a list), ``queue`` its positions' entries; every entry's done
    counter at the previous call's end (not done in this one), but those a row marks
    ``done`` (this call's). Every (source, owner) piece holds rows 0-9 of its owner (segment
    0 only), published in the source's slice and kept in the owner's split table alike."""
    heap = torch.zeros((W, BASE["HEAP_BYTES"]), dtype=torch.uint8)
    table = torch.zeros((len(rows), len(COL)), dtype=torch.int32)
    for i, r in enumerate(rows):
        kind = BASE[f"KIND_{r['kind'].upper()}"]
        rank = runs_on(r)
        values = dict(kind=kind, rank=rank, src=r["src"], owner=r["owner"], segment=r["segment"], claim=-1)
        values |= dict(items=r["items"], dep_start=r["dep_start"], dep_count=r["dep_count"], guard=-1, flag=i)
        for c, v in values.items():
            table[i, COL[c]] = v
        flags = heap[rank, BASE["FLAGS"] :].view(torch.int64)
        flags[i] = (TARGET - 1 + r.get("done", 0)) * r["items"]
    for r in range(W):
        words = heap[r].view(torch.int32)
        words[BASE["ADMITTED"] // 4 :][: W * E_MAX] = 10  # 10 rows in the first span: segment 0 only (S = 24)
    recv = torch.zeros((W, W, E_MAX, 2), dtype=torch.int32)
    recv[..., 0, 1] = 10
    positions = [-1] * len(rows)
    for p, e in enumerate(queue):
        positions[e] = p
    first = [0]
    for e in queue:
        first.append(first[-1] + rows[e]["items"])
    tables = [torch.tensor(v, dtype=torch.int32) for v in (deps or [0], queue, positions, first)]
    return heap, table.reshape(-1), *tables, recv.reshape(-1)


def move(kind: str, src: int, owner: int, segment: int, items: int = 1, on=(), **flags) -> dict:
    return dict(kind=kind, src=src, owner=owner, segment=segment, items=items, on=list(on), **flags)


def counters(heap, rows) -> list[int]:
    """Each entry's done counter less the previous call's: what this call counted."""
    out = []
    for i, r in enumerate(rows):
        out.append(int(heap[runs_on(r), BASE["FLAGS"] :].view(torch.int64)[i]) - (TARGET - 1) * r["items"])
    return out


def take(kernels, rows: list[dict], queue: list[int], counter: int):
    """take_empty_run at queue position 0, whose item 0 ran, with ``counter`` tickets of the
    call taken: (what it counts toward that entry's own signal, what each entry's counter
    gained, the tickets taken after it, the items stamped, every position's first item)."""
    deps = []
    for r in rows:
        r["dep_start"], r["dep_count"] = len(deps), len(r["on"])
        deps += r["on"]
    heap, table, deps_t, queue_t, positions, first, recv = build(rows, deps, queue)
    ctl = torch.zeros(32, dtype=torch.int64)
    ctl[BASE["CTL_TICKETS"]] = BASE_TICKET + counter
    ctl[BASE["CTL_CLOCK"]] = 7
    profile = torch.zeros(2 * int(first[-1]), dtype=torch.int64)
    out = torch.zeros(1, dtype=torch.int64)
    launch(kernels().empty_run, (1,), heap, table, deps_t, queue_t, positions, first, recv, ctl, profile, 0,
           len(queue), BASE_TICKET, TARGET, out)  # fmt: skip
    stamped = [k for k in range(int(first[-1])) if profile[2 * k] != 0]
    return int(out[0]), counters(heap, rows), int(ctl[BASE["CTL_TICKETS"]]) - BASE_TICKET, stamped, first.tolist()


def table_of_moves():
    """Queue 0-7: an empty dispatch (2 items; its item 0 run), then moves without rows that
    join — one waiting for the first (in the run), a return waiting for an entry done this
    call outside the queue, an unpack waiting for that return, one waiting for an entry of
    the previous call — then a dispatch waiting for an entry not done yet (the run ends
    there), and two more empty moves after it. Entries 8 (done) and 9 (not yet) are outside the
    queue (another rank's)."""
    rows = [
        move("dispatch", 0, 1, 1, items=2),
        move("dispatch", 1, 2, 1, on=[0]),
        move("return", 0, 1, 1, items=2, on=[8]),
        move("unpack", 0, 1, 1, on=[2]),
        move("dispatch", 2, 3, 2, on=[-1]),
        move("dispatch", 3, 0, 2, on=[9]),
        move("dispatch", 1, 0, 3),
        move("unpack", 2, 0, 1),
        move("dispatch", 0, 2, 0, done=1),  # 8: done this call
        move("dispatch", 1, 3, 0),  # 9: not yet
    ]
    return rows, list(range(8))


def test_a_run_counts_the_empty_moves_whose_dependencies_are_done_or_in_it(kernels):
    """From an empty dispatch at position 0 whose first item ran: the entries at positions
    1-4 join the run (their dependencies done this call, of the previous call, or entries of
    the run before them); position 5 waits for an entry not done and ends it, so 5-7 stay
    for their own tickets. The program takes the tickets to the run's end at once, counts
    the first entry's rest toward its own signal and signals each other entry of the run its
    items; the items it took are stamped."""
    rows, queue = table_of_moves()
    own, done, counter, stamped, first = take(kernels, rows, queue, counter=1)
    assert own == 1  # entry 0's second item
    assert done == [0, 1, 2, 1, 1, 0, 0, 0, 1, 0]
    assert counter == first[5] and stamped == list(range(1, first[5]))


def test_a_run_leaves_the_tickets_other_programs_took(kernels):
    """Other programs took tickets up to the middle of the return at position 2: they run
    those items themselves; this program counts only the items past them."""
    rows, queue = table_of_moves()
    took = 4  # entry 0's two items, entry 1's, the return's first
    own, done, counter, stamped, first = take(kernels, rows, queue, counter=took)
    assert first[2] < took < first[3]
    assert own == 0 and done == [0, 0, 1, 1, 1, 0, 0, 0, 1, 0]
    assert counter == first[5] and stamped == list(range(took, first[5]))


def test_a_move_with_rows_or_a_kind_that_is_no_move_ends_a_run(kernels):
    """A dispatch of segment 0 (rows 0-9 are there) ends the run, as does a combine and an
    entry with more dependencies than a run looks at (4)."""
    for stop in (
        move("dispatch", 1, 2, 0),
        dict(move("dispatch", 1, 2, 1), kind="combine"),
        move("dispatch", 1, 2, 1, on=[-1] * 5),
    ):
        rows = [move("dispatch", 0, 1, 1, items=2), move("return", 1, 1, 2), stop, move("dispatch", 2, 3, 1)]
        own, done, counter, _, first = take(kernels, rows, list(range(4)), counter=1)
        assert own == 1 and done == [0, 1, 0, 0] and counter == first[2], stop
