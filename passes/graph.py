"""The hierarchical task graph of one MoE layer, built over capacity bounds.

Routing is known only at run time, but capacity bounds it (ARCHITECTURE.md, decision 1):
owner q's worst case with distinct top-K is ``W·T·min(K, E_loc(q))`` rows, capped by
``Σ cap_e`` under a binding capacity (R_q); it runs ``ceil(R_q / S)`` segments; a
padding-free segment needs at most ``ceil(S/BM) + E_loc(q) − 1`` m-tiles. The graph has
one task per (rank, segment, stage) — per (source, owner, segment) for the transport
stages — carrying those bounds, and a predicate under which the task is empty at run
time. It never has a node per tile (``expand_tiles`` does that, for small specs only).

Stages (RDEP section 3.4, Listing 1):

======== =========================== ======================================================
stage    one task per                what it does
======== =========================== ======================================================
route    front-end rank r            row order, row_id, sideband, counts per (owner, expert)
scan     owner q                     counts published (phase 1), exclusive scan per (source,
                                     local expert), capacity decision, offsets and admitted
                                     counts published back (phase 2)
dispatch (source r, owner q, seg s)  payload + sideband scatter into q's ring slot s mod B
gemm1    (owner q, segment s)        grouped up projection with the activation fused
                                     (SwiGLU: gate and up, 4·rows·H·F FLOPs) into q's private
                                     workspace slot s mod B (stage compute)
gemm2    (owner q, segment s)        grouped down projection (2·rows·H·F FLOPs) into q's
                                     private staging slot s mod B; m-tile j of it waits only
                                     for m-tile j of the segment's gemm1 (stage compute)
return   (owner q, segment s, r)     the rows of (q, s) that came from r, into a slot of r's
                                     return ring (bulk: straight to their T·K landing place)
combine  unpack (r, claim)           return ring only: copy a return slot to r's private
                                     landing by decoded row_id, freeing the slot
combine  wait r                      every row of r has landed
combine  tile (r, token tile)        y_t = Σ_k g'_tk · out_tk for BM tokens
======== =========================== ======================================================

The return ring. docs/memory.md gives each front-end ``R_ret = B·S`` rows: B slots of S
rows, claimed by (owner, segment) pairs with a credit and freed by the combine. A return
per (owner, segment) would need a slot at all W front-ends at once, so at most B owners
could return at a time (a W/B-fold slower return); the return is therefore split per
destination, as dispatch is per source (appendix A.2: "the same protocol in reverse"), and
each front-end rotates its B slots over the (owner, segment) pieces it receives, in the
global order. The flags and credits of docs/memory.md are exactly that: return-slot-filled
per (owner, slot) at the front-end, return-slot-free per (front-end, slot) at the owner.
An unpack copies a slot's rows to their (token, slot) places in the front-end's private
landing, so that the combine is the same gather as in bulk. When the ring's B·S rows hold
all T·K rows a front-end gets back (small layers), rows land at their places directly and
there is no ring to rotate.

Buffer-reuse (write-after-read) edges, the B-slot rings:

* payload ring at owner q: dispatch(·, q, s) waits for gemm1(q, s − B);
* workspace ring at owner q (GEMM1's activations, private): gemm1(q, s) waits for
  gemm2(q, s − B);
* staging ring at owner q (expert outputs, private): gemm2(q, s) waits for every
  return(q, s − B, ·);
* return ring at front-end r: the piece with claim j waits for the unpack of claim j − B.

Under ``dedup`` an owner holds one payload row per (token, owner), at the token's first
accepted slot there; its other slots point at it (sideband ``links``). Payload is
expert-contiguous, so those slots may lie in later segments: gemm1(q, s) also waits for the
dispatches of every earlier segment of q, a return(q, s, r) sums a token's outputs from every
segment up to s (it returns a token from its last slot's segment), and every segment stays
resident (B is raised to the busiest owner's segments, so no ring slot is reused).

The tasks are built in the strategy's intended global order (dispatch s, compute s − L,
return s − L − 1 in step s, with lookahead L = 1 for pipelined, B − 1 for deep); the
scheduler takes a topological order that follows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rdepc.diagnostics import Diagnostics
from rdepc.ir.graph import BM, MAX_TASKS, Decision, Geometry, Task, TaskGraph
from rdepc.ir.spec import LayerSpec

STRATEGIES = ("bulk", "pipelined", "deep")
CUTS = ("expert", "source")


def _int(expr, spec: LayerSpec) -> int:
    """A spec size as an int, T at its bound when symbolic."""
    free = getattr(expr, "free_symbols", None)
    if free:
        expr = expr.subs(spec.shape.T, spec.shape.T_max)
    return int(expr)


def cap_per_expert(spec: LayerSpec) -> int | None:
    cap = spec.capacity.rows_per_expert(spec.shape)
    return None if cap is None else _int(cap, spec)


def geometry(
    spec: LayerSpec, strategy: str, cut: str = "expert", S: int | None = None, B: int | None = None
) -> Geometry:
    """The bounds of ``spec`` under ``strategy`` (bulk, pipelined, deep) and ``cut``.
    Segmented strategies take S and B from the segment statement unless given."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy '{strategy}' (known: {', '.join(STRATEGIES)})")
    if cut not in CUTS:
        raise ValueError(f"unknown cut '{cut}' (known: {', '.join(CUTS)})")
    sh = spec.shape
    W, T, H, E, K = int(sh.W), sh.T_max, _int(sh.H, spec), _int(sh.E, spec), _int(sh.K, spec)
    F = _int(spec.expert.F, spec)
    per = spec.ownership.experts_per_rank(W)
    cap = cap_per_expert(spec)
    worst = [W * T * min(K, e) for e in per]
    R = tuple(w if cap is None else min(w, e * cap) for w, e in zip(worst, per, strict=True))
    if strategy == "bulk":
        S_, B_, L = max(max(R), 1), 1, 1
        segs = tuple(1 if r > 0 else 0 for r in R)
    else:
        seg = spec.segment
        if S is None:
            if seg is None:
                raise ValueError(f"strategy '{strategy}' needs segment rows: the spec has no segment statement")
            S = _int(seg.rows, spec)
        if B is None:
            B = _int(seg.buffers, spec) if seg is not None else (2 if strategy == "pipelined" else 3)
        S_, B_ = int(S), int(B)
        L = 1 if strategy == "pipelined" else max(1, B_ - 1)
        segs = tuple(-(-r // S_) for r in R)
        if spec.dedup:  # a token's rows at an owner span its local experts' segments: all stay resident
            B_ = max(B_, *segs)
    m_slots = tuple(-(-S_ // BM) + e - 1 if e else 0 for e in per)
    return Geometry(
        strategy=strategy,
        cut=cut,
        W=W,
        T=T,
        H=H,
        F=F,
        E=E,
        K=K,
        act=spec.expert.act,
        d=spec.precision.dispatch.bytes,
        a=spec.precision.dtype.bytes,
        sb=spec.route_row.sideband_bytes,
        dedup=spec.dedup,
        S=S_,
        B=B_,
        lookahead=L,
        owner=tuple(spec.ownership.owner),
        local=tuple(spec.ownership.local),
        experts=per,
        cap_e=cap,
        drop=spec.capacity.drop,
        rows_max=R,
        segments=segs,
        m_slots=m_slots,
        token_tiles=-(-T // BM),
    )


def task_count(geo: Geometry) -> int:
    """Tasks of the graph of ``geo``, computed before building it."""
    W = geo.W
    pieces = sum(geo.segments)
    per_piece = 2 * W + 2 + (W if geo.return_ring else 0)  # dispatch, return, gemm1, gemm2, unpack
    return 2 * W + pieces * per_piece + W + W * geo.token_tiles


def check_size(spec: LayerSpec, geo: Geometry) -> None:
    """A SpecError at the segment statement when the task table would be unreasonably large."""
    n = task_count(geo)
    if n <= MAX_TASKS:
        return
    src = {spec.file: Path(spec.file).read_text(encoding="utf-8")} if Path(spec.file).is_file() else {}
    diags = Diagnostics(src)
    key = "segment.rows" if spec.segment is not None else "shape.ranks"
    hint = (
        f"raise 'segment rows' (S = {geo.S}) so that each owner runs fewer segments"
        if geo.segmented
        else "use a segmented schedule with a 'segment' statement"
    )
    diags.error(
        f"the task table would have {n:,} tasks (limit {MAX_TASKS:,}): {max(geo.segments)} segments per owner "
        f"× W = {geo.W} sources for dispatch and return",
        spec.span_of(key),
        hint,
    )
    diags.check()


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
    seg_rows = [[min(S, R[q] - s * S) for s in range(segs[q])] for q in range(W)]
    from_one = [
        T * min(K, per[q]) if geo.cap_e is None else min(T * min(K, per[q]), per[q] * geo.cap_e) for q in range(W)
    ]
    piece = [[min(n, from_one[q]) for n in seg_rows[q]] for q in range(W)]

    route = tuple(
        add("route", "", r, "compute", -1, -1, -1, -1, -1, T * K, geo.token_tiles, T * K * (geo.sb + 8), 0, (), (), "")
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
                tiles = min(geo.m_slots[q], -(-n // BM) + per[q] - 1)
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
        add("combine", "wait", r, "compute", r, -1, -1, -1, -1, 0, 1, 0, 0, tuple(sorted(landed[r])), (), "")
        for r in range(W)
    ]
    for r in range(W):
        for tile in range(geo.token_tiles):
            n = min(BM, T - tile * BM)
            add(
                "combine",
                "tile",
                r,
                "compute",
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


def build_graph(
    spec: LayerSpec,
    strategy: str,
    cut: str = "expert",
    S: int | None = None,
    B: int | None = None,
    decisions: tuple[Decision, ...] = (),
) -> TaskGraph:
    """The task graph of ``spec`` for an explicit strategy and cut (no choices made)."""
    geo = geometry(spec, strategy, cut, S, B)
    check_size(spec, geo)
    tasks = build_tasks(geo)
    return TaskGraph(spec.name, spec.file, geo, tuple(tasks), tuple(decisions), spec)


# --- loads: what a routing puts in each task ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """Rows each task moves under one routing (count level): ``sent[(r, q, s)]`` rows from
    source r in segment s of owner q; ``experts[(q, s)]`` rows per local expert."""

    admitted: tuple[tuple[int, ...], ...]  # [source][expert]
    sent: dict
    experts: dict

    def seg_rows(self, q: int, s: int) -> int:
        return sum(self.experts.get((q, s), {}).values())

    def m_tiles(self, q: int, s: int) -> int:
        return sum(-(-n // BM) for n in self.experts.get((q, s), {}).values())


def expected_counts(geo: Geometry) -> list[list[int]]:
    """The expected routing as whole rows: each source spreads its T·K rows over the E
    experts as evenly as possible (uniform routing's mean, eq. 9), the remainders rotated
    so that every expert gets the same total up to one row per source."""
    W, E, TK = geo.W, geo.E, geo.T * geo.K
    base, extra = divmod(TK, E)
    out = []
    for r in range(W):
        row = [base] * E
        for j in range(extra):
            row[(r * extra + j) % E] += 1
        out.append(row)
    return out


def admit(geo: Geometry, counts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Rows per (source, expert) an owner admits, from counts alone. ``drop round_robin``
    admits by token index first, so with each source's rows spread over its tokens every
    source keeps the same fraction cap_e / arrived (largest remainders, ties to the lower
    rank, round the shares to rows); otherwise capacity in source order (drop arrival with
    eq. 7's row_id, whose most significant digit is the rank; lowest_gate needs the gates)."""
    if geo.cap_e is None:
        return [list(row) for row in counts]
    if geo.drop == "round_robin":
        return _admit_shares(geo.cap_e, counts)
    left = [geo.cap_e] * geo.E
    out = []
    for row in counts:
        a = [min(c, left[e]) for e, c in enumerate(row)]
        for e, x in enumerate(a):
            left[e] -= x
        out.append(a)
    return out


def _admit_shares(cap: int, counts: Sequence[Sequence[int]]) -> list[list[int]]:
    out = [list(row) for row in counts]
    for e in range(len(counts[0]) if counts else 0):
        arrived = sum(row[e] for row in counts)
        if arrived <= cap:
            continue
        share = [row[e] * cap // arrived for row in counts]
        order = sorted(range(len(counts)), key=lambda r: (-(counts[r][e] * cap % arrived), r))
        for r in order[: cap - sum(share)]:
            share[r] += 1
        for r, a in enumerate(share):
            out[r][e] = a
    return out


def receive_runs(geo: Geometry, q: int) -> list[tuple[int, int]]:
    """(source, expert) runs in owner q's receive order: by (local expert, source) when
    cut by expert; by (source, local expert) when cut by source. Sources are taken in
    rotated order, q first, so that in any one step the owners wait on different sources
    (no incast onto one source's link)."""
    mine = sorted((geo.local[e], e) for e in range(geo.E) if geo.owner[e] == q)
    W = geo.W
    if geo.cut == "expert":
        return [((q + k) % W, e) for _, e in mine for k in range(W)]
    return [((q + k) % W, e) for k in range(W) for _, e in mine]


def segment_load(geo: Geometry, admitted: Sequence[Sequence[int]]) -> Load:
    """Cut every owner's admitted rows, in receive order, into segments of S rows."""
    S = geo.S
    sent: dict[tuple[int, int, int], int] = {}
    experts: dict[tuple[int, int], dict[int, int]] = {}
    for q in range(geo.W):
        pos = 0
        for r, e in receive_runs(geo, q):
            n = admitted[r][e]
            lam = geo.local[e]
            while n > 0:
                s = pos // S
                take = min(n, (s + 1) * S - pos)
                sent[(r, q, s)] = sent.get((r, q, s), 0) + take
                d = experts.setdefault((q, s), {})
                d[lam] = d.get(lam, 0) + take
                pos += take
                n -= take
    return Load(tuple(tuple(a) for a in admitted), sent, experts)


def task_rows(tg: TaskGraph, load: Load) -> list[int]:
    """Rows each task moves under ``load``."""
    geo = tg.geometry
    rows = []
    for t in tg.tasks:
        match t.stage:
            case "dispatch":
                n = load.sent.get((t.src, t.owner, t.segment), 0)
            case "return":
                n = load.sent.get((t.src, t.owner, t.segment), 0)
            case "compute":
                n = load.seg_rows(t.owner, t.segment)
            case "combine" if t.detail == "unpack":
                n = load.sent.get((t.src, t.owner, t.segment), 0)
            case "route":
                n = geo.T * geo.K
            case "combine" if t.detail == "tile":
                n = t.rows
            case _:
                n = 0
        rows.append(n)
    return rows


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


def mtiles_bound_ok(geo: Geometry, load: Load) -> bool:
    """Every (owner, segment) of ``load`` fits its m-tile slots and its S rows."""
    for (q, s), d in load.experts.items():
        rows = sum(d.values())
        if rows > geo.S or s >= geo.segments[q]:
            return False
        if sum(-(-n // BM) for n in d.values()) > geo.m_slots[q]:
            return False
    return True


__all__ = [
    "CUTS",
    "FULL_LIMIT",
    "STRATEGIES",
    "Load",
    "admit",
    "build_graph",
    "build_tasks",
    "cap_per_expert",
    "check_size",
    "expand_tiles",
    "expected_counts",
    "geometry",
    "receive_runs",
    "segment_load",
    "task_count",
    "task_rows",
    "to_networkx",
]


def dump(tg: TaskGraph) -> str:
    """``--dump-after graph``: the bounds, then one line per task (construction order)."""
    geo = tg.geometry
    lines = [
        f"// graph of layer {tg.layer}: {geo.strategy}, cut {geo.cut}, S={geo.S}, B={geo.B}, lookahead {geo.lookahead}",
        f"//   rows_max R_q  {list(geo.rows_max)}",
        f"//   segments      {list(geo.segments)}",
        f"//   m-tile slots  {list(geo.m_slots)} (ceil(S/BM) + E_loc - 1, BM = {BM}: the planning tile; a built "
        "module picks its own, which rdepc run prints)",
        "//   return path   "
        + ("a ring of B slots, freed by unpacks" if geo.return_ring else "rows land at their (token, slot) place"),
        f"//   tasks         {len(tg.tasks)}: {tg.count()}",
    ]
    lines += [f"//   decision      {d.name} = {d.value} ({d.why})" for d in tg.decisions]
    for t in tg.tasks:
        war = f" war={list(t.war)}" if t.war else ""
        data = t.deps[: len(t.deps) - len(t.war)]
        shown = list(data) if len(data) <= 8 else f"[{data[0]}, ... {len(data)} tasks]"
        empty = f" empty_if {t.empty_if}" if t.empty_if else ""
        lines.append(
            f"{t.id:7d} {t.name:<34} rows<={t.rows} tiles<={t.tiles} bytes<={t.bytes} flops<={t.flops} "
            f"slot={t.slot} deps={shown}{war}{empty}"
        )
    return "\n".join(lines)
