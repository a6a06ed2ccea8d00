"""The tasks of one layer's graph, built over a :class:`Geometry` in the strategy's intended
global order (:func:`build_tasks`; the stages, rings and edges are described in
:mod:`rdepc.passes.graph`), and the graph's networkx views: one node per task
(:attr:`rdepc.ir.graph.TaskGraph.graph`) or per tile (:func:`expand_tiles`, small specs only)."""

from __future__ import annotations

from rdepc.ir import sizes
from rdepc.ir.balance import slot_chunks
from rdepc.ir.graph import Geometry, Task, TaskGraph
from rdepc.ir.sizes import BM


class _Build:
    """The tasks made so far (their ids are their places), each added by name, and the ids of
    the stages' tasks later ones depend on."""

    def __init__(self, geo: Geometry):
        self.geo = geo
        self.tasks: list[Task] = []
        W, R, S = geo.W, geo.rows_max, geo.S
        self.row_d = geo.H * geo.d + geo.sb  # one payload row on the wire, with its sideband
        self.row_a = geo.H * geo.a  # one returned row
        self.row_h = geo.F * geo.a  # one row of the GEMM1 → GEMM2 workspace
        # Rows of segment s of owner q, and rows one source may place in it.
        self.cut = sizes.segments_cut(R, S)  # segment boundaries may cut an m-tile per expert
        self.seg_rows = [[min(S, R[q] - s * S) for s in range(geo.segments[q])] for q in range(W)]
        self.piece = [[min(n, geo.from_one[q]) for n in self.seg_rows[q]] for q in range(W)]
        self.route: tuple[int, ...] = ()
        self.scan: list[int] = []
        self.receive: list[int] = []
        self.disp: dict[tuple[int, int, int], int] = {}
        self.gemm1: dict[tuple[int, int], int] = {}
        self.gemm2: dict[tuple[int, int], int] = {}
        self.ret: dict[tuple[int, int, int], int] = {}
        self.claim_of: dict[int, int] = {}
        self.unpack: dict[tuple[int, int], int] = {}
        self.landed: list[list[int]] = [[] for _ in range(W)]  # what each rank's combine waits for
        self.claims = [0] * W

    def add(
        self, stage: str, rank: int, *, detail: str = "", role: str = "comm", src: int = -1, owner: int = -1,
        segment: int = -1, slot: int = -1, claim: int = -1, rows: int = 0, tiles: int = 1, nbytes: int = 0,
        flops: int = 0, deps: tuple[int, ...] = (), war: tuple[int, ...] = (), empty_if: str = "",
    ) -> int:  # fmt: skip
        i = len(self.tasks)
        self.tasks.append(
            Task(
                id=i, stage=stage, detail=detail, rank=rank, role=role, src=src, owner=owner, segment=segment,
                slot=slot, claim=claim, rows=rows, tiles=tiles, bytes=nbytes, flops=flops, deps=deps + war, war=war,
                empty_if=empty_if,
            )
        )  # fmt: skip
        return i


def build_tasks(geo: Geometry) -> list[Task]:
    """Every task of ``geo``'s graph, in the strategy's intended global order: balance, route
    and scan, then in turn t each rank's returns of segment t - L - 1, GEMMs of t - L and
    dispatches of t (L the lookahead), then the combine."""
    b = _Build(geo)
    planned = _balance(b)
    route_bytes = geo.T * geo.K * (geo.sb + 8)
    b.route = tuple(
        b.add("route", r, rows=geo.T * geo.K, tiles=geo.token_tiles, nbytes=route_bytes, deps=planned[r])
        for r in range(geo.W)
    )
    b.scan = [b.add("scan", q, nbytes=3 * geo.W * max(geo.experts[q], 1) * 4, deps=b.route) for q in range(geo.W)]
    top = max(geo.segments, default=0)
    for t in range(top + geo.lookahead + 1):
        if t - geo.lookahead - 1 >= 0:
            _returns(b, t - geo.lookahead - 1)
        if t - geo.lookahead >= 0:
            _gemms(b, t - geo.lookahead)
        if t < top:
            _dispatches(b, t)
    _combine(b)
    return b.tasks


def _balance(b: _Build) -> list[tuple[int, ...]]:
    """balance replicate: each rank's load puts its row of the load table into every rank's
    copy; once all have landed each rank's solve derives the call's plan (every rank the
    same) and its reroute gives its route rows their physical experts, which its route
    reads (returned: each rank's route's dependencies). Each rank pushes its home experts'
    operands into the slots the plan gave them, a chunk a work item; a rank's receive copies
    its N slots once every push has landed. The push bytes are the mean over ranks with
    every slot filled: which home pushes is known only at run time."""
    geo = b.geo
    W, TK = geo.W, geo.T * geo.K
    slot_bytes = geo.slots * geo.slot_bytes
    chunks = slot_chunks(geo.slot_bytes // geo.a)  # work items of one expert's operands
    table = W * geo.homes * 4  # the load table, int32
    balanced = range(W) if geo.slots else range(0)
    loads = tuple(b.add("balance", r, detail="load", src=r, nbytes=table) for r in balanced)
    solve = [b.add("balance", q, detail="solve", owner=q, nbytes=table, deps=loads) for q in balanced]
    reroute = [
        b.add("balance", r, detail="reroute", src=r, rows=TK, nbytes=TK * 16, deps=(solve[r],)) for r in balanced
    ]
    items = [(geo.experts[r] - geo.slots) * chunks for r in balanced]  # its home experts' chunks
    pushes = tuple(
        b.add("balance", r, detail="push", src=r, tiles=items[r], nbytes=slot_bytes, deps=(solve[r],)) for r in balanced
    )
    b.receive = [
        b.add("balance", q, detail="receive", owner=q, tiles=geo.slots * chunks, nbytes=slot_bytes, deps=pushes)
        for q in balanced
    ]
    return [(reroute[r],) if reroute else () for r in range(W)]


def _returns(b: _Build, s: int) -> None:
    """Return segment s: each owner's pieces to every front-end (a permutation per step i),
    then, with a return ring, each front-end's unpacks of what it claimed."""
    geo = b.geo
    W, B = geo.W, geo.B
    for i in range(W):
        for q in range(W):
            if s >= geo.segments[q]:
                continue
            r = (q + i) % W
            n = b.piece[q][s]
            war = ()
            if geo.return_ring:
                j = b.claims[r]
                b.claims[r] += 1
                slot = j % B
                if j >= B:
                    war = (b.unpack[(r, j - B)],)
            else:
                j, slot = -1, -1
            k = b.add(
                "return", q, src=r, owner=q, segment=s, slot=slot, claim=j, rows=n, tiles=-(-n // BM),
                nbytes=n * b.row_a, deps=tuple(b.gemm2[(q, z)] for z in (range(s + 1) if geo.dedup else (s,))),
                war=war, empty_if=f"back({q},{s},{r}) == 0",
            )  # fmt: skip
            b.ret[(q, s, r)] = k
            b.claim_of[k] = j
            if not geo.return_ring:
                b.landed[r].append(k)
        if geo.return_ring:
            for r in range(W):
                q = (r - i) % W
                if s >= geo.segments[q]:
                    continue
                k = b.ret[(q, s, r)]
                j = b.claim_of[k]
                n = b.piece[q][s]
                u = b.add(
                    "combine", r, detail="unpack", src=r, owner=q, segment=s, slot=j % B, claim=j, rows=n,
                    tiles=-(-n // BM), nbytes=2 * n * b.row_a, deps=(k,), empty_if=f"back({q},{s},{r}) == 0",
                )  # fmt: skip
                b.unpack[(r, j)] = u
                b.landed[r].append(u)


def _gemms(b: _Build, s: int) -> None:
    """Compute segment s of every owner: GEMM1 (up projection and activation), then GEMM2."""
    geo = b.geo
    W, H, F, B = geo.W, geo.H, geo.F, geo.B
    up = (geo.flop_coef - 2) * H * F  # GEMM1 FLOPs per row (gate and up: 4·H·F)
    down = 2 * H * F
    for q in range(W):
        if s >= geo.segments[q]:
            continue
        n = b.seg_rows[q][s]
        # dedup: a row's payload is its token's first row at q, which may sit in an earlier segment
        deps = tuple(b.disp[((q - i) % W, q, z)] for z in (range(s + 1) if geo.dedup else (s,)) for i in range(W))
        deps += (b.receive[q],) if b.receive else ()  # its slots' weights
        tiles = sizes.segment_m_tiles(n, geo.experts[q], b.cut)  # at most geo.m_slots[q]: n <= min(R_q, S)
        empty = f"rows({q}) <= {s * geo.S}"
        war = (b.gemm2[(q, s - B)],) if s >= B else ()  # its hbuf slot
        b.gemm1[(q, s)] = b.add(
            "compute", q, detail="gemm1", role="compute", owner=q, segment=s, slot=s % B, rows=n, tiles=tiles,
            nbytes=n * (b.row_d + b.row_h), flops=up * n, deps=deps, war=war, empty_if=empty,
        )  # fmt: skip
        war = tuple(b.ret[(q, s - B, (q + i) % W)] for i in range(W)) if s >= B else ()  # its staging slot
        b.gemm2[(q, s)] = b.add(
            "compute", q, detail="gemm2", role="compute", owner=q, segment=s, slot=s % B, rows=n, tiles=tiles,
            nbytes=n * (b.row_h + b.row_a), flops=down * n, deps=(b.gemm1[(q, s)],), war=war, empty_if=empty,
        )  # fmt: skip


def _dispatches(b: _Build, s: int) -> None:
    """Dispatch segment s, source r to owner (r + i) mod W: a permutation per step i."""
    geo = b.geo
    W, B = geo.W, geo.B
    for i in range(W):
        for r in range(W):
            q = (r + i) % W
            if s >= geo.segments[q]:
                continue
            n = b.piece[q][s]
            b.disp[(r, q, s)] = b.add(
                "dispatch", r, src=r, owner=q, segment=s, slot=s % B, rows=n, tiles=-(-n // BM), nbytes=n * b.row_d,
                deps=(b.route[r], b.scan[q]), war=(b.gemm1[(q, s - B)],) if s >= B else (),
                empty_if=f"sent({r},{q},{s}) == 0",
            )  # fmt: skip


def _combine(b: _Build) -> None:
    """Each rank's combine: a wait for every return (or unpack) landed there, then its token tiles."""
    geo = b.geo
    waits = [b.add("combine", r, detail="wait", src=r, deps=tuple(sorted(b.landed[r]))) for r in range(geo.W)]
    for r in range(geo.W):
        for tile in range(geo.token_tiles):
            n = min(BM, geo.T - tile * BM)
            b.add(
                "combine", r, detail="tile", src=r, claim=tile, rows=n,
                nbytes=n * (geo.K * b.row_a + b.row_a + 8 * geo.K), deps=(waits[r],),
            )  # fmt: skip


# --- the tile-level expansion (small specs only) ----------------------------------------

FULL_LIMIT = 200_000


def expand_tiles(tg: TaskGraph, limit: int = FULL_LIMIT):
    """A tile-level networkx DiGraph: each task's tiles (m-tile slots for compute, row tiles
    for transport) and one flag node per task that its tiles raise and its dependents'
    tiles wait on — except GEMM2's m-tile j, which waits for m-tile j of its GEMM1 only.
    Refuses (ValueError) beyond ``limit`` nodes: use the hierarchical graph."""
    import networkx as nx

    n = sum(t.tiles + 1 for t in tg.tasks)
    if n > limit:
        raise ValueError(
            f"the tile graph would have {n:,} nodes (limit {limit:,}); --full is for small specs, "
            "the hierarchical graph has one node per (rank, segment, stage)"
        )
    g = nx.DiGraph()
    for t in tg.tasks:
        flag = ("flag", t.id)
        g.add_node(flag, name=f"{t.name} done", stage=t.stage, detail=t.detail, rank=t.rank, kind="flag")
        for i in range(t.tiles):
            node = ("tile", t.id, i)
            g.add_node(node, name=f"{t.name} #{i}", stage=t.stage, detail=t.detail, rank=t.rank, kind="tile", task=t.id)
            g.add_edge(node, flag, kind="done")
            war = set(t.war)
            for d in t.deps:
                if t.detail == "gemm2" and d not in war:
                    g.add_edge(("tile", d, i), node, kind="data")
                else:
                    g.add_edge(("flag", d), node, kind="war" if d in war else "data")
    return g
