"""The scheduling work of a GEMM tile, counted: global memory operations a GEMM work item
makes outside its tile, in the unified kernel and in split mode's GEMM kernel.

    python bench/sched_ops.py --out bench/results/sched-ops

runs a layer under the Triton interpreter with its memory operations counted (the
interpreter's loads, stores and atomics, one per operation whatever its width: a vector
load of a table row counts one, as one instruction would issue it) and splits the count at
work items: an item ends with the release of its entry's done flag, so everything from the
previous item's release up to its own — the ticket, the search for its entry, the table
row, the guard and dependency waits, the m-tile binding, the signals — is its scheduling
work. A wait counts its first poll only (its flag, then the error word: one operation
however long it spins, as in a GEMM kernel that finds its inputs ready). Only items that
ran a GEMM tile count (``expert_item`` called); what ``expert_item`` does (the tile's
operands, epilogue and stores) is left out. Unified mode counts its one
program's items; split mode the GEMM kernel's programs only (their threads). Counts depend
on the layer (W dispatches precede a GEMM1 segment), not on H or F: moonlight at its W,
narrowed to a few tokens and small H, F, runs in seconds.

Split mode also counts what the GEMM kernel spends on m-tile slots without live rows: the
signals that end no tile, and the operations before each. Both modes count the tickets
taken (unified: its own; split: the transport kernel's). The layer runs as the spec has it
and, pipelined, cut into ``SEGMENT_ROWS``-row segments, most of which a routing leaves
without rows.

Writes OUT.json (per mode and strategy: GEMM work items, tiles, operations, per tile mean,
median, least and most, tickets, the GEMM entries of empty segments, and in split mode the
empty slots' signals and operations) and OUT.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = ("examples/moonlight.rdep", {"T": 16, "H": 64, "F": 64})
# The same layer cut into segments of this many rows as well: 12 an owner, of which a uniform
# routing fills 2 (at T' = 4096 and S = 4096: 48 and 6)
SEGMENT_ROWS = 64


class Counter:
    """Counts the interpreter's memory operations per work item (module docstring)."""

    def __init__(self, heap, gemm_thread: str | None):
        self.lo = heap.data_ptr()
        self.hi = self.lo + heap.numel() * heap.element_size()
        self.gemm_thread = gemm_thread  # split: only the threads of this kernel's programs
        self.local = threading.local()
        self.lock = threading.Lock()
        self.per_tile: list[int] = []
        self.idle: list[int] = []  # what each release without a tile took (split: the GEMM kernel's empty slots)
        # the ticket counter's address (the unified or the transport kernel's), the tickets taken there
        self.ticket_at = -1
        self.tickets = 0

    def _state(self):
        st = self.local
        if not hasattr(st, "ops"):
            st.ops, st.tile, st.inside, st.last = 0, False, False, ()
        return st

    def mine(self) -> bool:
        return self.gemm_thread is None or threading.current_thread().name.startswith(self.gemm_thread)

    def op(self, name: str, ptrs=None, release: bool = False) -> None:
        addr = int(ptrs.data.reshape(-1)[0]) if ptrs is not None else -1
        if addr == self.ticket_at and name == "create_atomic_rmw":  # split: the transport kernel's
            with self.lock:
                self.tickets += 1
        if not self.mine():
            return
        st = self._state()
        if st.inside:
            return
        key = (name, addr)
        if key in st.last:  # a wait polling again (its flag, then the error word): one operation however long
            return
        st.last = (*st.last[-1:], key)
        st.ops += 1
        if release and self.lo <= addr < self.hi:  # a done flag (symmetric, in the heap): the item ends
            with self.lock:
                (self.per_tile if st.tile else self.idle).append(st.ops)
            st.ops, st.tile = 0, False

    def tile(self, fn):
        def run(*args, **kwargs):
            st = self._state()
            st.tile, st.inside = self.mine() or st.tile, True
            try:
                return fn(*args, **kwargs)
            finally:
                st.inside = False

        return run


def count(mode: str, schedule: str, layer_of: tuple[str, dict] = LAYER, programs: int | None = None) -> dict:
    """Run a layer (``layer_of``: its spec and overrides) once in ``mode`` and ``schedule``
    with its operations counted; ``programs``: the module's (default: the interpreter's)."""
    import torch

    import rdepc
    from rdepc.reference import random_inputs

    path, narrow = layer_of
    layer = rdepc.load(ROOT / path, **narrow)
    sh = layer.shapes
    m = layer.module(schedule=schedule, mode=mode, programs=programs)
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[layer.spec.precision.dtype.value])
    inputs = random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], dtype=dtype)
    m(*inputs[:6])  # a first call: what the interpreter rewrites and caches, outside the count
    counter = Counter(m.heap, "rdep_gemm" if mode == "split" else None)
    from rdepc.ir.contract import CTL_TICKETS

    ctl = m.private["ctl"]
    counter.ticket_at = ctl.data_ptr() + CTL_TICKETS * ctl.element_size()
    _run_counted(m, inputs[:6], counter)
    return _counts(m, counter, mode, schedule, sh["W"])


def _run_counted(m, inputs, counter: Counter) -> None:
    """One call of ``m`` with every load, store and atomic of the interpreter counted, and the
    operations of each expert tile."""
    from rdepc.runtime.launch import rewrite_callees
    from triton.runtime import interpreter as ti  # once the module has set Triton's mode

    builder = ti.interpreter_builder
    originals = {}

    def hook(name: str) -> None:
        real = getattr(builder, name)
        originals[name] = real
        params = list(inspect.signature(real).parameters)

        def counted(*args, **kwargs):
            given = dict(zip(params, args, strict=False)) | kwargs
            ptrs = given.get("ptr", given.get("ptrs"))
            release = any(s in str(given.get("sem", "")).upper() for s in ("RELEASE", "ACQ_REL"))
            counter.op(name, ptrs, release)
            return real(*args, **kwargs)

        setattr(builder, name, counted)

    tile_fn = m.kernels.expert_item
    rewrite_callees(tile_fn.fn)  # its callees, before the wrapper hides it from the launcher's walk
    m.kernels.expert_item = counter.tile(tile_fn)
    for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas"):
        hook(name)
    try:
        m(*inputs)
    finally:
        for name, real in originals.items():
            setattr(builder, name, real)
        m.kernels.expert_item = tile_fn


def _counts(m, counter: Counter, mode: str, schedule: str, W: int) -> dict:
    """The counted call's figures: entries, items and tickets, empty segments, operations per tile."""
    ops = sorted(counter.per_tile)
    n = len(ops)
    # unified: its transport items release alike; what it skips shows in the tickets it takes
    empty = {"empty_signals": None, "empty_operations": None}
    if mode == "split":
        empty = {"empty_signals": len(counter.idle), "empty_operations": sum(counter.idle)}
    (lo, hi), takers = m.work.bounds[0], m.per_queue[0]  # the queue that takes tickets: the call's first
    from rdepc.ir.queues import GEMM_KINDS, KINDS

    gemm = [n for e, (_, n) in enumerate(m.work.entry_items()) if m.work.table[e].kind in GEMM_KINDS]
    rows = m.private["group"].view(W, -1, 2)[:, :, 1].sum(1).tolist()  # each owner's rows this call
    segmented = [KINDS.index(k) for k in ("gemm1", "gemm2")]
    dead = sum(1 for r in m.work.table if r.kind in segmented and rows[r.owner] <= r.segment * m.contract.S)
    return {
        "mode": mode,
        "schedule": schedule,
        "gemm_entries": len(gemm),
        # the queue that takes tickets (unified: every entry; split: the transport kernel's), each of its
        # programs one past its items
        "items": m.work.first_item[hi] - m.work.first_item[lo] + takers,
        "tickets": counter.tickets,
        "gemm_items": sum(gemm),
        "empty_segment_entries": dead,  # GEMM1 and GEMM2 entries of segments the routing left without rows
        **empty,
        "tiles": n,
        "operations": sum(ops),
        "mean": sum(ops) / n if n else float("nan"),
        "median": ops[n // 2] if n else None,
        "least": ops[0] if n else None,
        "most": ops[-1] if n else None,
    }


def dash(v) -> str:
    return "-" if v is None else str(v)


def taken(row: dict) -> str:
    return "-" if row["tickets"] is None else f"{row['tickets']} of {row['items']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="OUT: writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    rows = [count(mode, s) for s in ("bulk", "pipelined") for mode in ("unified", "split")]
    path, narrow = LAYER
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "moonlight_segmented.rdep"
        text = (ROOT / path).read_text(encoding="utf-8")
        spec.write_text(re.sub(r"segment\s+rows \d+", f"segment   rows {SEGMENT_ROWS}", text), encoding="utf-8")
        for mode in ("unified", "split"):
            rows.append(count(mode, "pipelined", (str(spec), narrow)) | {"schedule": f"pipelined, S {SEGMENT_ROWS}"})
    data = {"layer": path, "overrides": narrow, "segment_rows": SEGMENT_ROWS, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    lines = [
        "# Scheduling work per GEMM tile (global memory operations outside the tile, interpreter count)",
        "",
        f"{path} with {', '.join(f'{k}={v}' for k, v in narrow.items())} (W = 8 as the spec has it); "
        "`bench/sched_ops.py` says what is counted.",
        "",
        "| schedule | mode | GEMM work items | GEMM tiles run | operations | per tile: mean | median | least | most "
        "| empty slots: signals | their operations | tickets taken, of items + programs "
        "| GEMM entries of empty segments |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['schedule']} | {r['mode']} | {r['gemm_items']} | {r['tiles']} | {r['operations']} | {r['mean']:.1f} | "
        f"{r['median']} | {r['least']} | {r['most']} | {dash(r['empty_signals'])} | {dash(r['empty_operations'])} | "
        f"{taken(r)} | {r['empty_segment_entries']} of {r['gemm_entries']} |"
        for r in rows
    ]
    lines += [
        "",
        "A tile that opens its entry for its program (its first item there) also waits for the owner's scan and",
        "the entry's dependencies; the others only bind their m-tile (4 words), wait for their m-tile of GEMM1",
        "(GEMM2) and signal. The unified kernel does all of it, and its ticket and search, for every tile.",
        "",
        "GEMM work items are every m-tile slot's: the plan gives each owner slots for the worst case of its rows",
        "(dropless bulk: every token choosing it, W times what a uniform routing brings), and a slot past the",
        "routing's m-tiles runs no tile. The GEMM kernel's program counts the rest of its items in an entry done",
        "with one signal at its first empty slot (the live slots are a prefix); the empty-slot columns count",
        "those signals and the operations that led to them (split mode only: the unified kernel's transport items",
        "end alike, so they are not told apart there). A kernel that takes tickets (unified; split mode's",
        "transport kernel) takes one per item and one past its items per program; the unified kernel takes the",
        "tickets of an entry no program has taken yet at its first empty slot (the counter moved to the entry's",
        "end), the transport kernel at a move without rows those of the run of such moves after it whose",
        "dependencies are done (`take_empty_run`), which the tickets column counts.",
        "",
        f"`pipelined, S {SEGMENT_ROWS}`: the layer cut into {SEGMENT_ROWS}-row segments, 12 an owner, of which a "
        "uniform routing fills 2",
        "(moonlight at T' = 4096: 6 of 48). An owner's rows fill its segments in order: at a segment without rows",
        "the GEMM kernel counts the run of such GEMM entries after it done (a vector signal per 64 queue",
        "positions, each entry by the program whose items include its first); the last column counts the GEMM",
        "entries of segments without rows. Split mode's transport kernel counts the moves of such segments",
        "done in runs likewise; the unified kernel still takes a ticket (and its search and waits) for each.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.path.append(str(ROOT))  # an installed rdepc stays first
    sys.exit(main())
