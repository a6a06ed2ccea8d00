"""The task table's encoding and the queues a call's launches take.

What the lowering writes, the kernels read and the runtime launches by: the task kinds and a
table row's columns, the kernel modes and the kernels each launches, the work items of
every entry queued per launch (:class:`Work`, built by ``KernelContract.work``), and the
``queues`` table each launch reads its own queue from (:func:`queue_records`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from rdepc.diagnostics import layer_prefix

# Task kinds of the generated kernel, one device function each.
KINDS = (
    "route", "scan", "dispatch", "gemm1", "gemm2", "return", "unpack", "combine_wait", "combine", "wgrad", "push",
    "receive", "load", "solve", "reroute",
)  # fmt: skip
# The kinds split mode's GEMM kernel (``rdep_gemm``) runs; the transport kernel runs the others.
GEMM_KINDS = frozenset(KINDS.index(k) for k in ("gemm1", "gemm2", "wgrad"))


class Row(NamedTuple):
    """One task-table row (int32 columns, in this order: :data:`COLUMNS`, the kernel's C_*)."""

    kind: int  # the task kind, an index of KINDS
    rank: int  # the rank that runs the entry
    src: int  # the front-end whose rows it moves (-1: none)
    owner: int  # the owner whose experts they are (-1: none)
    segment: int  # the owner's segment
    claim: int  # the return-ring claim (return, unpack) or the token tile (combine)
    items: int  # the entry's work items (filled by ``KernelContract.work``)
    dep_start: int  # its dependencies: ``deps[dep_start : dep_start + dep_count]``
    dep_count: int
    guard: int  # the entry whose offsets a GEMM's m-tile table reads (its owner's scan), or -1
    resource: int  # the scheduler's resource: 2·rank + role (0 communication, 1 compute)
    flag: int  # its done counter in the ``flags`` words of its rank's heap slice


COLUMNS = Row._fields
# Kernel modes: one kernel that runs every task (``unified``); the transport kernel and the
# GEMM kernel launched side by side (``split``); or one after another on one stream, each
# with every program (``phased``: the transport's entries before the GEMMs, the GEMMs, the
# transport's entries after them).
MODES = ("unified", "split", "phased")


# The kernel mode a module runs when none is asked for. On a GPU, split: bitwise the unified
# kernel's forward and backward in every example, its CUDA graph replays and a withheld task
# ends its call (H200, bench/results/h200-2026-11-27-lease/), and moonlight at T' = 4096 takes
# 18.5 ms against the unified kernel's 21.4. Under the interpreter, unified: split mode's
# programs are threads, its waiters polling for the GIL (tiny: 1.06 s of CPU a call against 0.96;
# 3.3 s before each poll gave the GIL up, runtime.interpreting.polls_yield).
NATIVE_MODE = "split"
INTERPRETED_MODE = "unified"


def default_mode(native: bool) -> str:
    """The kernel mode of a module (``native``: on a GPU) when none is asked for."""
    return NATIVE_MODE if native else INTERPRETED_MODE


@dataclass(frozen=True)
class Work:
    """The task table with each entry's work items, under one choice of tiles, and its
    queues: entries grouped by queue, one per launch of a call (unified mode: one; split
    mode: the transport kernel's, then the GEMM kernel's; phased: the transport kernel's
    before the GEMMs, the GEMM kernel's, the transport kernel's after), each queue in the
    table's order."""

    mode: str
    table: tuple[tuple[int, ...], ...]
    queue: tuple[int, ...]  # entries, queue after queue
    first_item: tuple[int, ...]  # [entries + 1]: first work item of each queue position
    bounds: tuple[tuple[int, int], ...]  # per queue: its [first, last) positions in ``queue``
    m_slots: tuple[int, ...]  # m-tile slots per owner and segment (KernelContract.work)

    @property
    def n_items(self) -> int:
        return self.first_item[-1]

    @property
    def n_entries(self) -> int:
        return len(self.table)

    def positions(self) -> tuple[int, ...]:
        """The queue position of every entry (-1: in none of this process's queues), the
        ``queue_pos`` table: where a kernel tells whether a dependency is one of the entries
        it is counting done (``take_empty_run``)."""
        out = [-1] * len(self.table)
        for pos, i in enumerate(self.queue):
            out[i] = pos
        return tuple(out)

    def entry_items(self) -> list[tuple[int, int]]:
        """(first work item, items) of every entry, in table order."""
        out = [(0, 0)] * len(self.table)
        for pos, i in enumerate(self.queue):
            out[i] = (self.first_item[pos], self.first_item[pos + 1] - self.first_item[pos])
        return out


def mode_kernels(mode: str) -> list[tuple[str, dict[str, bool]]]:
    """The kernels a call launches in ``mode``, in launch order, each with the constexprs the
    mode sets: unified, ``rdep_layer`` with every task; split, ``rdep_layer`` as the
    transport kernel (no GEMM tasks), then ``rdep_gemm``; phased, the transport kernel, the
    GEMM kernel, the transport kernel again. Launch i runs queue i of ``Work``."""
    if mode == "unified":
        return [("rdep_layer", {"GEMMS": True})]
    if mode == "split":
        return [("rdep_layer", {"GEMMS": False}), ("rdep_gemm", {})]
    if mode == "phased":
        return [("rdep_layer", {"GEMMS": False}), ("rdep_gemm", {}), ("rdep_layer", {"GEMMS": False})]
    raise ValueError(f"unknown kernel mode '{mode}' (known: {', '.join(MODES)})")


def concurrent(mode: str) -> bool:
    """Whether a call's launches must run at once (split mode: its kernels wait on each
    other) rather than one after another on one stream."""
    return mode == "split"


# Words of one queue's record in the ``queues`` table; a launch reads the record its
# ``queues`` argument starts at (launch i: queue i's, QUEUE_WORDS·i words in: 16-byte aligned).
QUEUE_WORDS = 8


def queue_records(work: Work, per_queue: tuple[int, ...]) -> tuple[int, ...]:
    """The ``queues`` table: per queue its first and last positions in ``work.queue``, its
    programs, and for a queue whose kernel takes tickets (``rdep_layer``'s; the others: 0, 0)
    the tickets that kernel's earlier launches of the call take and the tickets of all its
    launches of a call — every program takes one past its queue's items, so a launch with P
    programs and n items takes n + P. The kernel's first ticket of a call is then
    (epoch − 1)·(tickets a call) + (tickets before) on the one counter, whichever launch."""
    kernels = [k for k, _ in mode_kernels(work.mode)]
    taken = [
        work.first_item[hi] - work.first_item[lo] + n if kernel == "rdep_layer" else 0
        for (lo, hi), n, kernel in zip(work.bounds, per_queue, kernels, strict=True)
    ]
    out: list[int] = []
    for q, ((lo, hi), n, kernel) in enumerate(zip(work.bounds, per_queue, kernels, strict=True)):
        tickets = (sum(taken[:q]), sum(taken)) if kernel == "rdep_layer" else (0, 0)
        out += [lo, hi, n, *tickets] + [0] * (QUEUE_WORDS - 5)
    return tuple(out)


def phase_queues(layer: str, names, table, deps: tuple[int, ...], mine: list[int]) -> list[list[int]]:
    """Phased mode's queues of the entries ``mine`` of ``table`` (its entries' ``names``;
    ``deps`` the table's dependency list): the transport's entries that wait (through any
    chain of dependencies or their guard) for no GEMM entry, the GEMM entries, the
    transport's other entries — each in the table's order. A GEMM entry that waits for one
    of the last kind (a schedule whose GEMMs wait for returns: a ring of buffers reused
    within the call) cannot run in phases: a ValueError names it. A dependency on the
    previous call is always met (its launches have ended)."""
    is_gemm = [row.kind in GEMM_KINDS for row in table]
    after = [False] * len(table)  # waits for a GEMM entry (or is one)
    for i, row in enumerate(table):
        start, count, guard = row.dep_start, row.dep_count, row.guard
        waits = [d for d in deps[start : start + count] if d >= 0] + ([guard] if guard >= 0 else [])
        if is_gemm[i]:
            late = [d for d in waits if after[d] and not is_gemm[d]]
            if late:
                raise ValueError(
                    f"{layer_prefix(layer)}: phased mode runs the transport's work after the GEMMs in a "
                    f"launch of its own, but {names[i]} waits for {names[late[0]]}, which waits for a GEMM: "
                    "use split or unified mode for this schedule"
                )
        after[i] = is_gemm[i] or any(after[d] for d in waits)
    return [
        [i for i in mine if not is_gemm[i] and not after[i]],
        [i for i in mine if is_gemm[i]],
        [i for i in mine if not is_gemm[i] and after[i]],
    ]


__all__ = [
    "COLUMNS",
    "GEMM_KINDS",
    "INTERPRETED_MODE",
    "KINDS",
    "MODES",
    "NATIVE_MODE",
    "QUEUE_WORDS",
    "Row",
    "Work",
    "concurrent",
    "default_mode",
    "mode_kernels",
    "phase_queues",
    "queue_records",
]
