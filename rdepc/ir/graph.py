"""The scheduled-graph IR: geometry, tasks, cost inputs, schedule, memory plan.

Frozen dataclasses, one record per level:

* :class:`Geometry` — the static bounds a graph is built over (RDEP's routing is known only
  at run time; capacity bounds it): rows an owner may hold, segments per owner, m-tile
  slots per (owner, segment).
* :class:`Task` and :class:`TaskGraph` — the hierarchical graph: one task per (rank,
  segment, stage) (per (source, owner, segment) for the transport stages) carrying its
  bounds as attributes, never one node per tile. ``TaskGraph.graph`` is the same graph as
  a networkx DiGraph.
* :class:`CostModel` — what each task costs under one routing (the expected one unless a
  routing is given), before the program split is known.
* :class:`Schedule` — resources, the program split, the global order (a topological order
  of the graph), the predicted timeline and the task table the code generator consumes.
* :class:`MemoryPlan` — every buffer of the symmetric heap at its offset, with lifetimes.

Names follow the RDEP paper: route row, owner, front-end, segment, accepted set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from rdepc.ir.sizes import owner_rows, return_ring
from rdepc.ir.spec import LayerSpec, weight_matrices

if TYPE_CHECKING:
    import networkx as nx

# The stages of one MoE layer (RDEP section 3.4, Listing 1), in pipeline order.
STAGES = ("balance", "route", "scan", "dispatch", "compute", "return", "combine")
ROLES = ("comm", "compute")
MAX_TASKS = 2_000_000  # beyond this a task table is a spec mistake, not a plan


@dataclass(frozen=True, slots=True)
class Decision:
    """One choice a pass made, and why (command line, spec, or the cost model's numbers)."""

    name: str
    value: str
    why: str


@dataclass(frozen=True, slots=True)
class Geometry:
    """The bounds one graph is built over; all plain ints (T at its bound when symbolic)."""

    strategy: str  # bulk | pipelined | deep
    cut: str  # expert | source
    W: int
    T: int
    H: int
    F: int
    E: int
    K: int
    act: str
    d: int  # dispatch dtype bytes (payload rows on the wire)
    a: int  # dtype bytes (returned rows)
    sb: int  # sideband bytes per row
    dedup: bool  # one payload row per (token, owner): every segment's rows stay resident (B >= segments)
    S: int  # rows of one ring slot (bulk: S_bulk = max_q R_q)
    B: int  # ring slots (bulk: 1)
    lookahead: int  # segments dispatch runs ahead of compute: rdepc.ir.sizes.lookahead
    owner: tuple[int, ...]  # π(e)
    local: tuple[int, ...]  # λ(e)
    experts: tuple[int, ...]  # E_loc(q)
    cap_e: int | None  # rows admitted per expert; None when dropless
    drop: str  # the capacity's admission order: round_robin | arrival | lowest_gate
    rows_max: tuple[int, ...]  # R_q: rows owner q may hold
    segments: tuple[int, ...]  # ceil(R_q / S)
    m_slots: tuple[int, ...]  # m-tiles one (q, segment) may need: rdepc.ir.sizes.m_tile_slots (the kernel's rule)
    token_tiles: int  # ceil(T / BM): combine tiles per rank
    slots: int = 0  # balance replicate: N redundant slots a rank (their weights pushed each call), else 0
    slot_bytes: int = 0  # one slot's operands (rdepc.ir.balance.slot_elems, in the layer's dtype)

    @property
    def segmented(self) -> bool:
        return self.strategy != "bulk"

    @property
    def from_one(self) -> tuple[int, ...]:
        """Rows one front-end may send each owner: its T tokens' distinct top-K rows there,
        capped by the owner's capacity (R_q of a single source, ``sizes.owner_rows``)."""
        return tuple(owner_rows(1, self.T, self.K, n, self.cap_e) for n in self.experts)

    @property
    def homes(self) -> int:
        """Home experts: the router's E, without the W·N redundant slots (``balance replicate``)."""
        return self.E - self.W * self.slots

    @property
    def return_ring(self) -> bool:
        """Returns land in a ring of B slots, claimed and freed by unpacks. When the B·S rows
        of the ring hold all T·K rows a front-end gets back, they land at their (token,
        slot) places directly, as in bulk: no claims, no unpack."""
        return return_ring(self.segmented, self.B, self.S, self.T, self.K)

    @property
    def flop_coef(self) -> int:
        """FLOPs per (row, H, F): 6 for a gated (SwiGLU) expert, 4 for gelu/relu."""
        return 2 * weight_matrices(self.act)

    @property
    def steps(self) -> int:
        return max(self.segments, default=0)

    def slot_locals(self, q: int) -> range:
        """Owner q's local experts that are its redundant slots (``balance replicate``: the
        last N, ``rdepc.passes.replicate``); empty without replication."""
        return range(self.experts[q] - self.slots, self.experts[q])


@dataclass(frozen=True, slots=True)
class Task:
    """One node of the hierarchical graph. Bounds (rows, tiles, bytes, flops) hold for
    every routing; ``empty_if`` is the run-time predicate under which the task moves nothing."""

    id: int
    stage: str  # one of STAGES
    # balance: load | solve | reroute | push | receive; compute: gemm1 | gemm2; combine: unpack | wait | tile; else ""
    detail: str
    rank: int  # the rank whose programs run it
    role: str  # comm | compute
    src: int  # front-end rank whose rows it moves (dispatch, return, unpack); -1 otherwise
    owner: int  # owner rank (dispatch, compute, return, unpack); -1 otherwise
    segment: int  # -1 when not per segment
    slot: int  # ring slot it fills or reads (see the table in docs), -1 when none
    claim: int  # return/unpack: claim index at the front-end ring; combine tile: token tile; else -1
    rows: int
    tiles: int
    bytes: int
    flops: int
    deps: tuple[int, ...]
    war: tuple[int, ...]  # the deps that are write-after-read (buffer reuse) edges
    empty_if: str  # "" when never empty

    @property
    def name(self) -> str:
        s = f" s{self.segment}" if self.segment >= 0 else ""
        match self.stage:
            case "balance":
                return f"{self.detail} r{self.rank}"
            case "route" | "scan":
                return f"{self.stage} r{self.rank}"
            case "dispatch":
                return f"dispatch{s} r{self.src}→r{self.owner}"
            case "compute":
                return f"{self.detail}{s} r{self.owner}"
            case "return":
                return f"return{s} r{self.owner}→r{self.src}"
        if self.detail == "unpack":
            return f"combine unpack{s} r{self.owner}→r{self.src}"
        if self.detail == "tile":
            return f"combine tile{self.claim} r{self.rank}"
        return f"combine wait r{self.rank}"


@dataclass(frozen=True)
class TaskGraph:
    layer: str
    file: str
    geometry: Geometry
    tasks: tuple[Task, ...]  # in construction order, which is the strategy's intended order
    # why it was built so, not what it is: the graph pass records the resolve pass's decisions
    # on the graph the resolve pass weighed, which the passes' caches then find again
    decisions: tuple[Decision, ...] = field(compare=False)
    spec: LayerSpec = field(compare=False, repr=False)

    def __hash__(self) -> int:
        # the compared fields' hash, kept: the passes' caches look graphs up by value, and
        # hashing every task again on each lookup cost more than the lookup saved on large graphs
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = hash((self.layer, self.file, self.geometry, self.tasks))
        return self.__dict__["_hash"]

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}  # a str's hash is per process

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The same graph as a networkx DiGraph (built on first use): node = task id with
        the task's bounds as attributes, edge kind "data" or "war" (buffer reuse)."""
        return to_networkx(self.tasks)

    @cached_property
    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """Every dependency as (from, to) task ids, two int64 arrays in task order: what an
        order is checked against at once."""
        lens = [len(t.deps) for t in self.tasks]
        src = np.fromiter((d for t in self.tasks for d in t.deps), dtype=np.int64, count=sum(lens))
        return src, np.repeat(np.arange(len(self.tasks), dtype=np.int64), lens)

    @cached_property
    def rank_deps(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """Each task's dependencies on its own rank's tasks and on other ranks' (a flag
        between ranks costs a latency): what a timeline walks, split once per graph."""
        tasks = self.tasks
        own = tuple(tuple(d for d in t.deps if tasks[d].rank == t.rank) for t in tasks)
        other = tuple(tuple(d for d in t.deps if tasks[d].rank != t.rank) for t in tasks)
        return own, other

    def count(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tasks:
            key = t.stage if not t.detail else f"{t.stage} {t.detail}"
            out[key] = out.get(key, 0) + 1
        return out


@dataclass(frozen=True, slots=True)
class Rates:
    """The hardware figures the cost model charges at (sources in passes/hardware.py and
    passes/cost.py)."""

    hw: str
    sms: int  # programs one rank can keep resident (one per SM)
    flops: float  # FLOP/s of grouped expert GEMMs, whole GPU
    link: float  # bytes/s one GPU injects over NVLink
    link_per_sm: float  # bytes/s one communication program moves
    hbm: float  # bytes/s of GPU memory, whole GPU
    latency: float  # seconds for a flag to become visible on another rank


@dataclass(frozen=True)
class CostModel:
    """Per-task work under one routing: expected rows, bytes over NVLink, bytes through
    local memory, FLOPs (launched m-tiles × BM rows) and expert-weight bytes; latencies."""

    graph: TaskGraph = field(repr=False)
    rates: Rates
    load: str  # "uniform" (expected routing) or "given"
    rows: tuple[int, ...]
    link_bytes: tuple[int, ...]
    mem_bytes: tuple[int, ...]
    flops: tuple[int, ...]
    weight_bytes: tuple[int, ...]
    fixed: tuple[float, ...]  # seconds that do not scale with programs (barrier sweeps)
    # balance replicate: the GEMM1 tasks none of whose m-tiles computes a slot under the
    # routing, which do not wait for their rank's receive (the kernel checks each m-tile)
    unslotted: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Resource:
    index: int
    rank: int
    role: str
    programs: int

    @property
    def name(self) -> str:
        return f"r{self.rank}.{self.role}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of the task table: the expansion the code generator consumes. Programs of
    ``resource`` take entries in ``index`` order and wait on ``deps`` (indices of earlier
    entries) before running them."""

    index: int
    task: int
    stage: str
    detail: str
    rank: int
    resource: int
    segment: int
    slot: int
    claim: int
    src: int
    owner: int
    tiles: int
    deps: tuple[int, ...]
    empty_if: str


@dataclass(frozen=True)
class Schedule:
    layer: str
    strategy: str
    cut: str
    S: int
    B: int
    lookahead: int
    hw: str
    programs: tuple[int, int]  # (communication, compute) programs per rank
    unified: bool  # every program takes every task (bulk): one resource per rank
    resources: tuple[Resource, ...]
    order: tuple[int, ...]  # task ids in global order (a topological order)
    position: tuple[int, ...]  # task id → index in ``order``
    resource_of: tuple[int, ...]  # task id → resource index
    start: tuple[float, ...]  # task id → predicted start (s)
    end: tuple[float, ...]
    makespan: float
    critical_path: float
    busy: tuple[float, ...]  # per resource
    transport: tuple[float, ...]  # per rank: time of its communication tasks
    compute: tuple[float, ...]  # per rank: time of its compute tasks
    exposed: tuple[float, ...]  # per rank: communication while no compute task runs
    fill: tuple[float, ...]  # per rank: communication of the first step (scan, first dispatch)
    drain: tuple[float, ...]  # per rank: communication of the last step (last returns)
    stage_busy: tuple[tuple[str, float], ...]  # busiest rank's time per stage
    decisions: tuple[Decision, ...]
    table: tuple[Entry, ...] = field(repr=False)
    graph: TaskGraph = field(compare=False, repr=False)
    cost: CostModel = field(compare=False, repr=False)
    # split mode's (transport, GEMM) kernel programs per rank: ``programs`` when the schedule
    # overlaps the roles; for bulk, whose stages take turns, the split that minimises their sum
    kernel_split: tuple[int, int] = (1, 1)

    @property
    def exposed_max(self) -> float:
        return max(self.exposed, default=0.0)

    def stage_spans(self) -> dict[str, float]:
        """Per stage, seconds from its first task's predicted start to its last one's end over
        every rank (tasks that take no time left out): what a profiled call measures
        (runtime/profile.py, whose ``combine`` holds the unpacks too)."""
        out: dict[str, tuple[float, float]] = {}
        for t in self.graph.tasks:
            s, e = self.start[t.id], self.end[t.id]
            if e > s:
                lo, hi = out.get(t.stage, (s, e))
                out[t.stage] = (min(lo, s), max(hi, e))
        return {k: hi - lo for k, (lo, hi) in out.items()}


@dataclass(frozen=True, slots=True)
class Buffer:
    """One buffer: its offset in the symmetric heap (or in the rank's private memory),
    bytes before padding, padded size, ring slots and when it is live (task-table indices
    and predicted seconds; None when it is not used by the forward schedule)."""

    name: str
    region: str
    offset: int
    bytes: int
    size: int
    slots: int
    slot_bytes: int
    what: str
    live: tuple[int, int] | None
    live_s: tuple[float, float] | None


@dataclass(frozen=True, slots=True)
class SlotUse:
    """One generation of one ring slot: which segment (or return claim) fills it and when."""

    ring: str  # payload | return | staging
    rank: int  # the rank holding the ring
    slot: int
    generation: int  # segment (payload, staging) or claim index (return)
    first: int  # task-table index of the first writer
    last: int  # task-table index of the last reader
    start: float
    end: float


@dataclass(frozen=True)
class MemoryPlan:
    layer: str
    strategy: str
    S: int
    B: int
    R_ret: int
    align: int
    buffers: tuple[Buffer, ...]  # the symmetric heap, in offset order
    private: tuple[Buffer, ...]  # per-rank private buffers (not symmetric), for reference
    forward: tuple[tuple[str, int], ...]  # regions and total, as docs/memory.md
    forward_backward: tuple[tuple[str, int], ...]
    uses: tuple[SlotUse, ...] = field(repr=False)
    max_live_payload: int = 0  # most payload slots any owner holds at once (predicted)
    problems: tuple[str, ...] = ()

    def regions(self, phase: str = "forward") -> dict[str, int]:
        return dict(getattr(self, phase))


def summary(x: Any) -> dict:
    """A short plain-data view of any IR above (what ``--dump-after`` prints first)."""
    if isinstance(x, TaskGraph):
        g = x.geometry
        return {
            "layer": x.layer,
            "strategy": g.strategy,
            "cut": g.cut,
            "S": g.S,
            "B": g.B,
            "lookahead": g.lookahead,
            "rows_max": list(g.rows_max),
            "segments": list(g.segments),
            "m_slots": list(g.m_slots),
            "tasks": len(x.tasks),
            "edges": sum(len(t.deps) for t in x.tasks),
            "by_stage": x.count(),
            "decisions": [f"{d.name} = {d.value} ({d.why})" for d in x.decisions],
        }
    raise TypeError(type(x).__name__)


def to_networkx(tasks: Sequence[Task]):
    """The hierarchical graph as a networkx DiGraph: node = task id with its bounds as
    attributes; edge kind "data" or "war" (buffer reuse)."""
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(
        (
            t.id,
            {
                "name": t.name,
                "stage": t.stage,
                "detail": t.detail,
                "rank": t.rank,
                "role": t.role,
                "src": t.src,
                "owner": t.owner,
                "segment": t.segment,
                "slot": t.slot,
                "claim": t.claim,
                "rows": t.rows,
                "tiles": t.tiles,
                "bytes": t.bytes,
                "flops": t.flops,
                "empty_if": t.empty_if,
            },
        )
        for t in tasks
    )
    data, war = {"kind": "data"}, {"kind": "war"}
    edges = []
    for t in tasks:
        nd = len(t.deps) - len(t.war)
        edges += [(d, t.id, data) for d in t.deps[:nd]]
        edges += [(d, t.id, war) for d in t.war]
    g.add_edges_from(edges)
    return g
