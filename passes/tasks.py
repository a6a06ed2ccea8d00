"""The tasks of one layer's graph, built over a :class:`Geometry` in the strategy's intended
global order (:func:`build_tasks`; the stages, rings and edges are described in
:mod:`rdepc.passes.graph`), and the graph's networkx views: one node per task
(:attr:`rdepc.ir.graph.TaskGraph.graph`) or per tile (:func:`expand_tiles`, small specs only)."""

from __future__ import annotations

from rdepc.ir import sizes
from rdepc.ir.balance import slot_chunks
from rdepc.ir.graph import Geometry, Task, TaskGraph
from rdepc.ir.sizes import BM


def build_tasks(geo: Geometry) -> list[Task]:
    """Every task of ``geo``'s graph, in the strategy's intended global order."""
    W, T, H, F, K, S, B, L = geo.W, geo.T, geo.H, geo.F, geo.K, geo.S, geo.B, geo.lookahead
    segs, R, per = geo.segments, geo.rows_max, geo.experts
    ring = geo.return_ring
    row_d = H * geo.d + geo.sb  # one payload row on the wire, with its sideband
    row_a = H * geo.a  # one returned row
    row_h = F * geo.a  # one row of the GEMM1 → GEMM2 workspace
    up = (geo.flop_coef - 2) * H * F  # GEMM1 FLOPs per row (gate and up: 4·H·F)
    down = 2 * H * F
    tasks: list[Task] = []
    append = tasks.append

    def add(
        stage, detail, rank, role, src, owner, segment, slot, claim, rows, tiles, nbytes, flops, deps, war, empty_if
    ) -> int:
        i = len(tasks)
        append(
            Task(
                i,
                stage,
                detail,
                rank,
                role,
                src,
                owner,
                segment,
                slot,
                claim,
                rows,
                tiles,
                nbytes,
                flops,
                deps + war,
                war,
                empty_if,
            )
        )
        return i

    # Rows of segment s of owner q, and rows one source may place in it.
    cut = sizes.segments_cut(R, S)  # segment boundaries may cut an m-tile per expert
    seg_rows = [[min(S, R[q] - s * S) for s in range(segs[q])] for q in range(W)]
    from_one = [sizes.owner_rows(1, T, K, per[q], geo.cap_e) for q in range(W)]  # R_q of one front-end
    piece = [[min(n, from_one[q]) for n in seg_rows[q]] for q in range(W)]

    # balance replicate: each rank's load puts its row of the load table into every rank's
    # copy; once all have landed each rank's solve derives the call's plan (every rank the
    # same) and its reroute gives its route rows their physical experts, which its route
    # reads. Each rank pushes its home experts' operands into the slots the plan gave them,
    # a chunk a work item; a rank's receive copies its N slots once every push has landed.
    # The push bytes are the mean over ranks with every slot filled: which home pushes is
    # known only at run time.
    slot_bytes = geo.slots * geo.slot_bytes
    chunks = slot_chunks(geo.slot_bytes // geo.a)  # work items of one expert's operands
    table = W * geo.homes * 4  # the load table, int32
    balanced = range(W) if geo.slots else range(0)
    loads = tuple(add("balance", "load", r, "comm", r, -1, -1, -1, -1, 0, 1, table, 0, (), (), "") for r in balanced)
    solve = [add("balance", "solve", q, "comm", -1, q, -1, -1, -1, 0, 1, table, 0, loads, (), "") for q in balanced]
    reroute = [
        add("balance", "reroute", r, "comm", r, -1, -1, -1, -1, T * K, 1, T * K * 16, 0, (solve[r],), (), "")
        for r in balanced
    ]
    items = [(per[r] - geo.slots) * chunks for r in balanced]  # its home experts' chunks
    pushes = tuple(
        add("balance", "push", r, "comm", r, -1, -1, -1, -1, 0, items[r], slot_bytes, 0, (solve[r],), (), "")
        for r in balanced
    )
    receive = [
        add("balance", "receive", q, "comm", -1, q, -1, -1, -1, 0, geo.slots * chunks, slot_bytes, 0, pushes, (), "")
        for q in balanced
    ]
    route_bytes = T * K * (geo.sb + 8)
    planned = [(reroute[r],) if reroute else () for r in range(W)]  # its rows' physical experts
    route = tuple(
        add("route", "", r, "comm", -1, -1, -1, -1, -1, T * K, geo.token_tiles, route_bytes, 0, planned[r], (), "")
        for r in range(W)
    )
    scan = [
        add("scan", "", q, "comm", -1, -1, -1, -1, -1, 0, 1, 3 * W * max(per[q], 1) * 4, 0, route, (), "")
        for q in range(W)
    ]
    disp: dict[tuple[int, int, int], int] = {}
    gemm1: dict[tuple[int, int], int] = {}
    gemm2: dict[tuple[int, int], int] = {}
    ret: dict[tuple[int, int, int], int] = {}
    claim_of: dict[int, int] = {}
    unpack: dict[tuple[int, int], int] = {}
    landed: list[list[int]] = [[] for _ in range(W)]
    claims = [0] * W
    top = max(segs, default=0)
    for t in range(top + L + 1):
        s = t - L - 1  # return segment s: pieces to every front-end, then their unpacks
        if s >= 0:
            for i in range(W):
                for q in range(W):
                    if s >= segs[q]:
                        continue
                    r = (q + i) % W
                    n = piece[q][s]
                    war = ()
                    if ring:
                        j = claims[r]
                        claims[r] += 1
                        slot = j % B
                        if j >= B:
                            war = (unpack[(r, j - B)],)
                    else:
                        j, slot = -1, -1
                    k = add(
                        "return",
                        "",
                        q,
                        "comm",
                        r,
                        q,
                        s,
                        slot,
                        j,
                        n,
                        -(-n // BM),
                        n * row_a,
                        0,
                        tuple(gemm2[(q, z)] for z in (range(s + 1) if geo.dedup else (s,))),
                        war,
                        f"back({q},{s},{r}) == 0",
                    )
                    ret[(q, s, r)] = k
                    claim_of[k] = j
                    if not ring:
                        landed[r].append(k)
                if ring:
                    for r in range(W):
                        q = (r - i) % W
                        if s >= segs[q]:
                            continue
                        k = ret[(q, s, r)]
                        j = claim_of[k]
                        n = piece[q][s]
                        u = add(
                            "combine",
                            "unpack",
                            r,
                            "comm",
                            r,
                            q,
                            s,
                            j % B,
                            j,
                            n,
                            -(-n // BM),
                            2 * n * row_a,
                            0,
                            (k,),
                            (),
                            f"back({q},{s},{r}) == 0",
                        )
                        unpack[(r, j)] = u
                        landed[r].append(u)
        s = t - L  # compute segment s: GEMM1 (up projection + activation), then GEMM2
        if s >= 0:
            for q in range(W):
                if s >= segs[q]:
                    continue
                n = seg_rows[q][s]
                # dedup: a row's payload is its token's first row at q, which may sit in an earlier segment
                deps = tuple(disp[((q - i) % W, q, z)] for z in (range(s + 1) if geo.dedup else (s,)) for i in range(W))
                deps += (receive[q],) if receive else ()  # its slots' weights
                tiles = sizes.segment_m_tiles(n, per[q], cut)  # at most geo.m_slots[q]: n <= min(R_q, S)
                empty = f"rows({q}) <= {s * S}"
                war = (gemm2[(q, s - B)],) if s >= B else ()  # its hbuf slot
                gemm1[(q, s)] = add(
                    "compute",
                    "gemm1",
                    q,
                    "compute",
                    -1,
                    q,
                    s,
                    s % B,
                    -1,
                    n,
                    tiles,
                    n * (row_d + row_h),
                    up * n,
                    deps,
                    war,
                    empty,
                )
                war = tuple(ret[(q, s - B, (q + i) % W)] for i in range(W)) if s >= B else ()  # its staging slot
                gemm2[(q, s)] = add(
                    "compute",
                    "gemm2",
                    q,
                    "compute",
                    -1,
                    q,
                    s,
                    s % B,
                    -1,
                    n,
                    tiles,
                    n * (row_h + row_a),
                    down * n,
                    (gemm1[(q, s)],),
                    war,
                    empty,
                )
        s = t  # dispatch segment s, source r to owner (r + i) mod W: a permutation per i
        if s < top:
            for i in range(W):
                for r in range(W):
                    q = (r + i) % W
                    if s >= segs[q]:
                        continue
                    n = piece[q][s]
                    war = (gemm1[(q, s - B)],) if s >= B else ()
                    disp[(r, q, s)] = add(
                        "dispatch",
                        "",
                        r,
                        "comm",
                        r,
                        q,
                        s,
                        s % B,
                        -1,
                        n,
                        -(-n // BM),
                        n * row_d,
                        0,
                        (route[r], scan[q]),
                        war,
                        f"sent({r},{q},{s}) == 0",
                    )
    waits = [
        add("combine", "wait", r, "comm", r, -1, -1, -1, -1, 0, 1, 0, 0, tuple(sorted(landed[r])), (), "")
        for r in range(W)
    ]
    for r in range(W):
        for tile in range(geo.token_tiles):
            n = min(BM, T - tile * BM)
            add(
                "combine",
                "tile",
                r,
                "comm",
                r,
                -1,
                -1,
                -1,
                tile,
                n,
                1,
                n * (K * row_a + row_a + 8 * K),
                0,
                (waits[r],),
                (),
                "",
            )
    return tasks


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
