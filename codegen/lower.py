"""Lowering: a bulk Schedule and its MemoryPlan → the kernel plan the generated code runs.

The kernel plan (:class:`KernelPlan`) is plain data — ints, strings and lists, written to
JSON beside the generated kernels — holding everything the persistent kernel and its host
side need: the layer's sizes, the symmetric-heap layout of the memory plan, the ownership
tables, the capacity rule, the tile sizes, and the task table.

The task table is the scheduler's own (``Schedule.table``), consumed as is: one row per
task, in the scheduler's global topological order, with its dependencies. What lowering
adds is the expansion of each task into **work items**, the unit a persistent program takes
with one ticket (ARCHITECTURE.md, decision 1: "expand tiles only into the kernel's task
table"):

============== ====================================================================
task           work items
============== ====================================================================
route r        1 (the per-expert prefix count over r's rows is sequential)
scan q         1
dispatch r→q   ⌈rows r may send q / rows_per_item⌉, each striding over row blocks
compute q      the m-tile slots of owner q: ⌈R_q / BM⌉ + E_loc(q) − 1, each bound at
               run time to (local expert, rows) — padding-free grouped GEMM
return q→r     as dispatch
combine wait r 1 (no work: it only joins the returns into rank r)
combine tile   1 (the scheduler's token tiles of ``rdepc.ir.graph.BM`` tokens)
============== ====================================================================

A task's done flag counts its finished items; a dependent waits until the count reaches
``epoch × items``. Items are numbered in table order, so the ticket order is the
scheduler's topological order refined by item index — still topological, which is what
makes the persistent kernel deadlock-free even when its programs run one at a time.

Compute items also carry a *guard*: the scan of their owner. An m-tile slot first waits
for that scan (which fixes how many rows each local expert holds); a slot that is empty
under the routing skips its W dispatch dependencies and finishes at once (the task
graph's ``empty_if`` predicate, evaluated per tile).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from rdepc import __version__
from rdepc.ir.graph import BM as COMBINE_TOKENS
from rdepc.ir.graph import MemoryPlan, Schedule
from rdepc.ir.spec import LayerSpec

# Task kinds of the generated kernel, one device function each.
KINDS = ("route", "scan", "dispatch", "compute", "return", "combine_wait", "combine")
# Columns of one task-table row (int32).
COLUMNS = ("kind", "rank", "src", "owner", "segment", "tile", "items", "dep_start", "dep_count", "guard")
# Error codes a program writes into the control block before it stops.
ERRORS = {1: "wait expired", 2: "owner overflow", 3: "row_id decodes to another rank"}
# Layout of the private control block (int64): ticket counter, error record, then done flags.
CONTROL = ("ticket", "err_code", "err_entry", "err_info", "err_rank", "err_epoch")
CTL_DONE = 8  # first done flag (the error record is padded to 8 words)
INT32_MAX = 2**31 - 1


def next_pow2(n: int, least: int = 2) -> int:
    p = least
    while p < n:
        p *= 2
    return p


@dataclass(frozen=True, slots=True)
class Tiles:
    """Tile sizes of the generated kernel (constexprs at launch; not part of the source).

    ``bm`` rows per m-tile of the grouped GEMM; ``block_h`` / ``block_f`` the hidden / ffn
    chunks (GEMM1 is [bm, block_h] x [block_h, block_f], GEMM2 [bm, block_f] x [block_f,
    block_h]); ``block_r`` rows per dispatch/return block; ``rows_per_item`` rows one
    dispatch or return work item moves at most (more rows: more items, striding);
    ``num_warps`` for native launches."""

    bm: int = 64
    block_h: int = 64
    block_f: int = 128
    block_r: int = 64
    rows_per_item: int = 1 << 30
    num_warps: int = 4

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"tile size {f.name} must be a positive int, got {v!r}")
        for name in ("bm", "block_h", "block_f", "block_r"):
            v = getattr(self, name)
            if v & (v - 1) or v < 16:
                raise ValueError(f"tile size {name} must be a power of two >= 16, got {v}")

    @staticmethod
    def default(H: int, F: int, dtype: str, interpret: bool) -> Tiles:
        """Interpreter: few, large tiles (it costs ~0.4 ms per program and 1–3 ms per tl.dot,
        almost independent of the tile's size). Native: tiles whose operands fit an H100's
        shared memory with room for software pipelining."""
        if interpret:
            return Tiles(64, min(128, next_pow2(H, 16)), min(128, next_pow2(F, 16)), 64, 1 << 30, 4)
        if dtype == "fp32":
            return Tiles(64, 32, 64, 64, 4096, 4)
        return Tiles(128, 64, 64, 64, 4096, 4)


@dataclass(frozen=True)
class KernelPlan:
    """Everything the generated kernel and its host side need, as plain data."""

    layer: str
    file: str
    rdepc: str
    strategy: str
    decisions: tuple[str, ...]
    transport: str  # the backend the kernels were generated for
    spec_transport: str  # the spec's transport statement (the eventual target)
    # sizes (T at its bound)
    W: int
    T: int
    H: int
    F: int
    E: int
    K: int
    E_MAX: int
    S: int
    act: str
    dtype: str  # compute dtype: weights, activations, returned rows
    dispatch: str  # payload dtype on the wire
    sideband: tuple[str, ...]
    symbolic_tokens: bool  # row ids and capacity use the call's T' (param T <= bound)
    # capacity: policy, factor (p, q), rows (int, or one per T' when T is symbolic), weights (drop: arrival)
    capacity: str
    cap_factor: tuple[int, int] | None
    cap_rows: int | tuple[int, ...] | None
    weights: str
    # ownership tables
    owner: tuple[int, ...]  # π(e)
    local: tuple[int, ...]  # λ(e)
    n_local: tuple[int, ...]  # E_loc(q)
    weight_of: tuple[int, ...]  # [W, E_MAX]: expert weight index of (q, λ) (emulated: e)
    order: tuple[int, ...]  # experts sorted by (owner, local)
    owner_first: tuple[int, ...]  # [W + 1]: position in ``order`` of q's first expert
    rows_max: tuple[int, ...]  # R_q: rows owner q may admit (the plan's bound)
    from_one: tuple[int, ...]  # rows one source may send owner q (distinct top-K, capacity)
    # the symmetric heap (one rank's slice) and the private buffers
    heap_bytes: int
    heap: tuple[tuple[str, int], ...]  # name → byte offset
    layout: tuple[tuple[str, str, int, int], ...]  # the memory plan's forward buffers: (name, region, offset, size)
    private: tuple[tuple[str, str, tuple[int, ...]], ...]  # per-rank private buffers: (name, dtype, shape)
    # the task table: the scheduler's entries in its global order (``items`` filled by work())
    table: tuple[tuple[int, ...], ...]  # rows of COLUMNS
    deps: tuple[int, ...]
    names: tuple[str, ...]  # task names, for error messages
    combine_tokens: int = COMBINE_TOKENS
    options: tuple[tuple[str, str], ...] = ()  # the codegen options it was generated with

    @property
    def n_entries(self) -> int:
        return len(self.table)

    def work(self, tiles: Tiles) -> Work:
        """The work items of every entry under ``tiles`` (see the module docstring)."""
        m_slots = tuple(-(-r // tiles.bm) + n - 1 if n else 0 for r, n in zip(self.rows_max, self.n_local, strict=True))

        def split(rows: int) -> int:
            return max(1, min(-(-rows // tiles.rows_per_item), -(-rows // tiles.block_r)))

        col = {c: i for i, c in enumerate(COLUMNS)}
        table, first = [], [0]
        for row in self.table:
            kind = KINDS[row[col["kind"]]]
            owner = row[col["owner"]]
            items = 1
            if kind in ("dispatch", "return"):
                items = split(self.from_one[owner])
            elif kind == "compute":
                items = m_slots[owner]
            table.append((*row[: col["items"]], items, *row[col["items"] + 1 :]))
            first.append(first[-1] + items)
        return Work(tuple(table), tuple(first), m_slots)

    @property
    def gated(self) -> bool:
        return self.act == "swiglu"

    def offset(self, name: str) -> int:
        return dict(self.heap)[name]

    def cap_at(self, T: int) -> int | None:
        """cap_e for a call with T' = ``T`` tokens per rank (None: dropless). The factor
        policy is ⌈f·W·T'·K/E⌉ at the call's T', as rdepc.reference.capacity_for."""
        if self.capacity == "dropless":
            return None
        if self.capacity == "factor":
            p, q = self.cap_factor
            return -(-p * self.W * T * self.K // (q * self.E))
        if isinstance(self.cap_rows, tuple):
            return self.cap_rows[T]
        return self.cap_rows

    def row_id_radix(self, T: int) -> tuple[int, int]:
        """(rank, token) coefficients of eq. 7 at a call with T' tokens: (T·K, K), with the
        spec's T, or T' when the spec's T is symbolic."""
        t = max(T, 1) if self.symbolic_tokens else self.T
        return t * self.K, self.K

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> KernelPlan:
        d = json.loads(text)
        for f in fields(KernelPlan):
            v = d.get(f.name)
            if isinstance(v, list):
                d[f.name] = _tuples(v)
        return KernelPlan(**d)


@dataclass(frozen=True)
class Work:
    """The task table with each entry's work items, under one choice of tiles."""

    table: tuple[tuple[int, ...], ...]
    first_item: tuple[int, ...]  # [entries + 1]: first work item of each entry
    m_slots: tuple[int, ...]  # m-tile slots per owner: ceil(R_q / bm) + E_loc(q) - 1

    @property
    def n_items(self) -> int:
        return self.first_item[-1]

    @property
    def n_entries(self) -> int:
        return len(self.table)


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _kind(stage: str, detail: str) -> int:
    if stage == "combine":
        if detail == "unpack":
            raise ValueError("the code generator implements the bulk schedule only (no return ring to unpack)")
        return KINDS.index("combine_wait" if detail == "wait" else "combine")
    return KINDS.index(stage)


def lower(spec: LayerSpec, sched: Schedule, mp: MemoryPlan, transport: str = "emulated") -> KernelPlan:
    """The kernel plan of ``spec`` scheduled as ``sched`` (bulk) with heap ``mp``."""
    if sched.strategy != "bulk" or sched.B != 1:
        raise ValueError(f"the code generator implements the bulk schedule only, got '{sched.strategy}'")
    geo = sched.graph.geometry
    W, T, H, F, E, K, S = geo.W, geo.T, geo.H, geo.F, geo.E, geo.K, geo.S
    E_MAX = max(geo.experts)
    owner, local = geo.owner, geo.local
    weight_of = [0] * (W * E_MAX)
    for e in range(E):
        weight_of[owner[e] * E_MAX + local[e]] = e
    order = sorted(range(E), key=lambda e: (owner[e], local[e]))
    owner_first, pos = [], 0
    for q in range(W):
        owner_first.append(pos)
        pos += geo.experts[q]
    owner_first.append(E)
    # Rows one source may send one owner (distinct top-K), capped by the owner's capacity.
    from_one = tuple(min(T * min(K, geo.experts[q]), geo.rows_max[q]) for q in range(W))
    scan_of = {e.rank: e.index for e in sched.table if e.stage == "scan"}
    table, deps, names = [], [], []
    for e in sched.table:
        kind = _kind(e.stage, e.detail)
        guard = scan_of[e.owner] if KINDS[kind] == "compute" else -1
        tile = e.claim if KINDS[kind] == "combine" else -1
        if any(d >= e.index for d in e.deps):
            raise ValueError(f"task table entry {e.index} depends on a later entry: the order is not topological")
        table.append((kind, e.rank, e.src, e.owner, e.segment, tile, 0, len(deps), len(e.deps), guard))
        deps.extend(e.deps)
        names.append(sched.graph.tasks[e.task].name)

    buf = {b.name: b for b in mp.buffers}
    heap = [(n, buf[n].offset) for n in ("barrier", "counts", "offsets", "admitted", "flags", "credits")]
    heap += [("payload", buf["payload"].offset), ("return", buf["return"].offset)]
    sb = buf["sideband"].offset
    for f in spec.route_row.sideband:  # structure of arrays, fields in the spec's (canonical) order
        heap.append((f"sideband_{f}", sb))
        sb += S * {"row_id": 8, "local_expert": 4, "gate": 4, "scale": 4}[f]
    layout = tuple((b.name, b.region, b.offset, b.size) for b in mp.buffers if not b.region.startswith("bwd"))
    E_PAD = next_pow2(E)
    adt = spec.precision.dtype.value
    private = (
        ("rowpos", "int32", (W, T * K)),  # position of each route row within its (source, expert) run
        ("sorted_rows", "int32", (W, T * K)),  # each source's rows bucketed by (owner, local expert)
        ("route_scratch", "int32", (W, 2 * E_PAD + 2)),
        ("send", "int32", (W, W, 2)),  # (first bucketed row, rows) per (source, owner)
        ("recv", "int32", (W, W, E_MAX, 2)),  # the owner's split table: (payload offset, admitted)
        ("group", "int32", (W, E_MAX, 2)),  # (first payload row, rows) per (owner, local expert)
        ("hbuf", adt, (W, S, F)),  # silu(x·Wg) ⊙ (x·Wu) per payload row: GEMM1 → GEMM2
        ("staging", adt, (W, S, H)),  # expert outputs per payload row (memory plan: private staging)
        ("stats", "int32", (W, 2 * E_MAX + 1)),  # rows arrived, admitted per local expert; m-tiles run
        ("ctl", "int64", (CTL_DONE + len(table),)),  # ticket, error record, done flags per entry
    )
    cap = spec.capacity
    cap_factor = cap_rows = None
    if cap.policy == "factor":
        cap_factor = (int(cap.factor.p), int(cap.factor.q))
    elif cap.policy == "rows":
        if spec.shape.symbolic:
            cap_rows = tuple(int(cap.rows.subs(spec.shape.T, t)) for t in range(T + 1))
        else:
            cap_rows = int(cap.rows)
    return KernelPlan(
        layer=spec.name,
        file=spec.file,
        rdepc=__version__,
        strategy=sched.strategy,
        decisions=tuple(f"{d.name} = {d.value} ({d.why})" for d in sched.decisions),
        transport=transport,
        spec_transport=spec.transport,
        W=W,
        T=T,
        H=H,
        F=F,
        E=E,
        K=K,
        E_MAX=E_MAX,
        S=S,
        act=spec.expert.act,
        dtype=adt,
        dispatch=spec.precision.dispatch.value,
        sideband=tuple(spec.route_row.sideband),
        symbolic_tokens=spec.shape.symbolic,
        capacity=cap.policy,
        cap_factor=cap_factor,
        cap_rows=cap_rows,
        weights=cap.weights,
        owner=tuple(owner),
        local=tuple(local),
        n_local=tuple(geo.experts),
        weight_of=tuple(weight_of),
        order=tuple(order),
        owner_first=tuple(owner_first),
        rows_max=tuple(geo.rows_max),
        from_one=from_one,
        heap_bytes=mp.regions()["total"],
        heap=tuple(heap),
        layout=layout,
        private=private,
        table=tuple(table),
        deps=tuple(deps),
        names=tuple(names),
    )


__all__ = ["COLUMNS", "CONTROL", "CTL_DONE", "ERRORS", "INT32_MAX", "KINDS", "KernelPlan", "Tiles", "Work", "lower"]
