"""The hierarchical task graph of one MoE layer, built over capacity bounds.

Routing is known only at run time, but capacity bounds it (docs/ARCHITECTURE.md, decision 1):
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
# S the scheduler tries for a segmented strategy when the spec has no segment statement
SEGMENT_CANDIDATES = (1024, 2048, 4096, 8192, 16384)


def _int(expr, spec: LayerSpec) -> int:
    """A spec size as an int, T at its bound when symbolic."""
    free = getattr(expr, "free_symbols", None)
    if free:
        expr = expr.subs(spec.shape.T, spec.shape.T_max)
    return int(expr)


def cap_per_expert(spec: LayerSpec) -> int | None:
    """cap_e the buffers are sized for: the largest any call may have, T' in 1..T (a
    ``capacity rows`` expression may fall as T' grows); None when dropless."""
    cap = spec.capacity.rows_per_expert(spec.shape)
    if cap is None:
        return None
    return max_over_tokens(cap, spec) if spec.capacity.policy == "rows" else _int(cap, spec)  # factor grows with T


def max_over_tokens(expr, spec: LayerSpec) -> int:
    """The largest value of ``expr`` (at most quadratic in T, elaboration's rule) over T in
    1..T_max; ``expr`` itself when it does not depend on T."""
    if not getattr(expr, "free_symbols", None):
        return int(expr)
    import sympy as sp

    T, hi = spec.shape.T, spec.shape.T_max
    points = {1, hi}
    poly = sp.Poly(expr, T)
    if poly.degree() == 2:
        a, b, _ = poly.all_coeffs()
        vertex = -b / (2 * a)
        if 1 <= vertex <= hi:
            points |= {int(sp.floor(vertex)), int(sp.ceiling(vertex))}
    return max(int(expr.subs(T, t)) for t in points)


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
    R = owner_rows(W, T, K, per, cap)
    if strategy != "bulk":
        seg = spec.segment
        if S is None:
            if seg is None:
                raise ValueError(f"strategy '{strategy}' needs segment rows: the spec has no segment statement")
            S = _int(seg.rows, spec)
        if B is None:
            B = _int(seg.buffers, spec) if seg is not None else (2 if strategy == "pipelined" else 3)
    S_, B_, segs = segmentation(R, strategy, S, B, spec.dedup)
    L = 1 if strategy in ("bulk", "pipelined") else max(1, int(B) - 1)  # B as given, before dedup raises it
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


def owner_rows(W: int, T: int, K: int, experts: Sequence[int], cap: int | None) -> tuple[int, ...]:
    """R_q: rows owner q may hold, its worst case with distinct top-K capped by Σ cap_e."""
    return tuple(W * T * min(K, e) if cap is None else min(W * T * min(K, e), e * cap) for e in experts)


def segmentation(
    R: Sequence[int], strategy: str, S: int | None, B: int | None, dedup: bool
) -> tuple[int, int, tuple[int, ...]]:
    """(S, B, segments per owner) of ``strategy``: bulk moves each owner's rows as one
    segment of the busiest owner's size; a segmented strategy cuts them into S-row segments,
    all of them resident under dedup."""
    if strategy == "bulk":
        return max(max(R, default=0), 1), 1, tuple(1 if r > 0 else 0 for r in R)
    segs = tuple(-(-r // int(S)) for r in R)
    if dedup:  # a token's rows at an owner span its local experts' segments: all stay resident
        B = max(int(B), *segs)
    return int(S), int(B), segs


def count_tasks(W: int, T: int, K: int, S: int, B: int, segments: Sequence[int], segmented: bool) -> int:
    """Tasks of a graph over these bounds (``task_count`` without a Geometry)."""
    ring = segmented and B * S < T * K  # Geometry.return_ring
    per_piece = 2 * W + 2 + (W if ring else 0)  # dispatch, return, gemm1, gemm2, unpack
    return 2 * W + sum(segments) * per_piece + W + W * -(-T // BM)


def task_count(geo: Geometry) -> int:
    """Tasks of the graph of ``geo``, computed before building it."""
    return count_tasks(geo.W, geo.T, geo.K, geo.S, geo.B, geo.segments, geo.segmented)


def candidates(schedule: str | None, segment: tuple[int, int] | None) -> list[tuple[str, int | None, int | None]]:
    """(strategy, S, B) the scheduler builds and compares for a schedule (None or "auto":
    the cost model chooses) and a segment statement's (S, B) (None: none); S and B None
    for the segment statement's own."""
    fixed = None if schedule in (None, "auto") else schedule
    out: list[tuple[str, int | None, int | None]] = []
    for st in [fixed] if fixed else STRATEGIES:
        if st == "bulk":
            out.append(("bulk", None, None))
        elif segment is not None:
            if st == "deep" and fixed is None and segment[1] < 3:
                continue  # deep with B < 3 is pipelined
            out.append((st, None, None))
        else:
            out += [(st, S, 2 if st == "pipelined" else 3) for S in SEGMENT_CANDIDATES]
    return out


def fewest_tasks(
    W: int,
    T: int,
    K: int,
    experts: Sequence[int],
    cap: int | None,
    schedule: str | None,
    segment: tuple[int, int] | None,
    dedup: bool,
) -> tuple[int, str, int, tuple[int, ...]]:
    """The smallest task table among the scheduler's candidates (plain ints: elaboration
    asks before any graph is built): (tasks, strategy, S, segments per owner)."""
    R = owner_rows(W, T, K, experts, cap)
    best = None
    for st, S, B in candidates(schedule, segment):
        if st != "bulk" and S is None:
            S, B = segment
        S_, B_, segs = segmentation(R, st, S, B, dedup)
        n = count_tasks(W, T, K, S_, B_, segs, st != "bulk")
        if best is None or n < best[0]:
            best = (n, st, S_, segs)
    return best


def too_many_tasks(W: int, T: int, n: int, strategy: str, S: int, segments: Sequence[int], has_segment: bool):
    """(what, span key, hint) for a task table of ``n`` > MAX_TASKS tasks, naming what makes
    it large: the combine tiles of T tokens, W ranks each sending every owner its segments,
    or the segments themselves. The language allows such a layer; the graph stage does not
    build it (yet), so it is reported as "not supported yet" at that construct."""
    tiles = W * -(-T // BM)
    one_each = 3 * W + tiles + sum(1 for s in segments if s) * (2 * W + 2)  # one segment per owner, no ring
    head = f"the task table would have {n:,} tasks (limit {MAX_TASKS:,}): "
    if 3 * W + tiles > MAX_TASKS:
        return head + f"W·⌈T/{BM}⌉ = {tiles:,} combine tiles", "shape.tokens", f"use fewer tokens per rank (T = {T})"
    if one_each > MAX_TASKS:
        why = f"W = {W} ranks, each sending every owner its rows and receiving its returns"
        return head + why, "shape.ranks", "use fewer ranks"
    why = f"{max(segments)} segments per owner × W = {W} sources for dispatch and return"
    if strategy == "bulk":
        return head + why, "shape.ranks", "use fewer ranks"
    if has_segment:
        return head + why, "segment.rows", f"raise 'segment rows' (S = {S}) so that each owner runs fewer segments"
    return head + why, "schedule", "add a 'segment' statement with more rows per segment"


def check_size(spec: LayerSpec, geo: Geometry) -> None:
    """A "not supported yet" SpecError at the construct that makes the task table too large."""
    n = task_count(geo)
    if n <= MAX_TASKS:
        return
    src = {spec.file: Path(spec.file).read_text(encoding="utf-8")} if Path(spec.file).is_file() else {}
    diags = Diagnostics(src)
    what, key, hint = too_many_tasks(geo.W, geo.T, n, geo.strategy, geo.S, geo.segments, spec.segment is not None)
    diags.error(f"not supported yet: {what} (the 'graph' stage does not implement it)", spec.span_of(key), hint)
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
    "SEGMENT_CANDIDATES",
    "STRATEGIES",
    "Load",
    "admit",
    "build_graph",
    "build_tasks",
    "cap_per_expert",
    "check_size",
    "expand_tiles",
    "expected_counts",
    "fewest_tasks",
    "geometry",
    "max_over_tokens",
    "owner_rows",
    "receive_runs",
    "segment_load",
    "segmentation",
    "task_count",
    "task_rows",
    "to_networkx",
    "too_many_tasks",
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
