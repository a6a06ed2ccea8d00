"""The hierarchical task graph of one MoE layer, built over capacity bounds.

Routing is known only at run time, but capacity bounds it (docs/ARCHITECTURE.md, decision 1):
owner q's worst case with distinct top-K is ``W·T·min(K, E_loc(q))`` rows, capped by
``Σ cap_e`` under a binding capacity (R_q); it runs ``ceil(R_q / S)`` segments; a
padding-free segment, its m-tiles aligned to each expert's rows, needs at most
``ceil(min(R_q, S)/BM) + 2·E_loc(q) − 1`` m-tiles when segments cut an owner's rows, else
``ceil(R_q/BM) + E_loc(q) − 1`` (:func:`rdepc.ir.sizes.m_tile_slots`, the kernel's rule). The graph has
one task per (rank, segment, stage) — per (source, owner, segment) for the transport
stages — carrying those bounds, and a predicate under which the task is empty at run
time. It never has a node per tile (``expand_tiles`` does that, for small specs only).

Stages (RDEP section 3.4, Listing 1):

======== =========================== ======================================================
stage    one task per                what it does
======== =========================== ======================================================
balance  load r (balance replicate)  r's rows per home expert into every rank's load table
balance  solve q                     after every rank's load: the call's plan from q's copy
                                     (every rank derives the same, UltraEP's Algorithm 1)
balance  reroute r                   r's route rows' physical experts under the plan (its
                                     route waits for it)
balance  push r                      after r's solve: r's home experts' operands into every
                                     slot the call's plan gave them, on the slots' ranks
balance  receive q                   after every rank's push: q's N slots copied into the
                                     call's [N, P] operand (every gemm1 of q waits for it)
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

Here: the bounds (:func:`geometry`), the scheduler's candidates and the task-table size
check, and the pass's dump. The tasks themselves are built by :mod:`rdepc.passes.tasks`
(with the networkx and tile-level views); what one routing puts in each task is
:mod:`rdepc.passes.loads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from rdepc.passes.tasks import build_tasks

from rdepc.diagnostics import Diagnostics
from rdepc.ir import sizes
from rdepc.ir.balance import slot_elems
from rdepc.ir.graph import MAX_TASKS, Decision, Geometry, TaskGraph
from rdepc.ir.sizes import BM
from rdepc.ir.spec import LayerSpec

STRATEGIES = ("bulk", "pipelined", "deep")
CUTS = ("expert", "source")
# S the scheduler tries for a segmented strategy when the spec has no segment statement
SEGMENT_CANDIDATES = (1024, 2048, 4096, 8192, 16384)


def spec_int(expr, spec: LayerSpec) -> int:
    """A spec size as an int, T at its bound when symbolic (the one home of this rule: the
    planner's figures read it too)."""
    free = getattr(expr, "free_symbols", None)
    if free:
        expr = expr.subs(spec.shape.T, spec.shape.T_max)
    return int(expr)


def cap_per_expert(spec: LayerSpec) -> int | None:
    """cap_e the buffers are sized for: the largest any call may have, T' in 1..T (a
    ``capacity rows`` expression may fall as T' grows); None when dropless."""
    cap, sh = spec.capacity, spec.shape
    rows = max_over_tokens(cap.rows, spec) if cap.policy == "rows" else None
    # a factor's cap_e grows with T': its largest is at T
    return sizes.cap_e(cap.policy, int(sh.W), sh.T_max, spec_int(sh.K, spec), spec_int(sh.E, spec), cap.factor, rows)


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
    W, T, H, E, K = int(sh.W), sh.T_max, spec_int(sh.H, spec), spec_int(sh.E, spec), spec_int(sh.K, spec)
    F = spec_int(spec.expert.F, spec)
    per = spec.ownership.experts_per_rank(W)
    cap = cap_per_expert(spec)
    R = owner_rows(W, T, K, per, cap)
    if strategy != "bulk":
        seg = spec.segment
        if S is None:
            if seg is None:
                raise ValueError(f"strategy '{strategy}' needs segment rows: the spec has no segment statement")
            S = spec_int(seg.rows, spec)
        if B is None:
            B = spec_int(seg.buffers, spec) if seg is not None else sizes.DEFAULT_BUFFERS[strategy]
    S_, B_, segs = segmentation(R, strategy, S, B, spec.dedup)
    L = sizes.lookahead(strategy, B)  # B as given, before dedup raises it
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
        m_slots=sizes.m_tile_slots(R, per, S_),
        token_tiles=sizes.token_tiles(T),
        slots=spec.balance.slots if spec.balance.kind == "replicate" else 0,
        slot_bytes=slot_elems(spec.expert.matrices, H, F, spec.expert.bias) * spec.precision.dtype.bytes,
    )


def owner_rows(W: int, T: int, K: int, experts: Sequence[int], cap: int | None) -> tuple[int, ...]:
    """R_q of every owner (:func:`rdepc.ir.sizes.owner_rows`)."""
    return tuple(sizes.owner_rows(W, T, K, e, cap) for e in experts)


def segmentation(
    R: Sequence[int], strategy: str, S: int | None, B: int | None, dedup: bool
) -> tuple[int, int, tuple[int, ...]]:
    """(S, B, segments per owner) of ``strategy``: bulk moves each owner's rows as one
    segment of the busiest owner's size; a segmented strategy cuts them into S-row segments,
    all of them resident under dedup."""
    if strategy == "bulk":
        return sizes.bulk_rows(R), 1, tuple(1 if r > 0 else 0 for r in R)
    segs = tuple(sizes.segment_count(r, int(S)) for r in R)
    if dedup:  # a token's rows at an owner span its local experts' segments: all stay resident
        B = max(int(B), *segs)
    return int(S), int(B), segs


def count_tasks(
    W: int, T: int, K: int, S: int, B: int, segments: Sequence[int], segmented: bool, balanced: bool = False
) -> int:
    """Tasks of a graph over these bounds (``task_count`` without a Geometry; ``balanced``:
    ``balance replicate``'s tasks too)."""
    return sizes.task_count(W, T, segments, sizes.return_ring(segmented, B, S, T, K), balanced)


def task_count(geo: Geometry) -> int:
    """Tasks of the graph of ``geo``, computed before building it."""
    ring = sizes.return_ring(geo.segmented, geo.B, geo.S, geo.T, geo.K)
    return sizes.task_count(geo.W, geo.T, geo.segments, ring, geo.slots > 0)


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
            if st == "deep" and fixed is None and segment[1] < sizes.DEEP_BUFFERS:
                continue  # no deeper than pipelined
            out.append((st, None, None))
        else:
            out += [(st, S, sizes.DEFAULT_BUFFERS[st]) for S in SEGMENT_CANDIDATES]
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
    balanced: bool = False,
) -> tuple[int, str, int, tuple[int, ...]]:
    """The smallest task table among the scheduler's candidates (plain ints: elaboration
    asks before any graph is built): (tasks, strategy, S, segments per owner); ``balanced``:
    with ``balance replicate``'s tasks."""
    R = owner_rows(W, T, K, experts, cap)
    best = None
    for st, S, B in candidates(schedule, segment):
        if st != "bulk" and S is None:
            S, B = segment
        S_, B_, segs = segmentation(R, st, S, B, dedup)
        n = count_tasks(W, T, K, S_, B_, segs, st != "bulk", balanced)
        if best is None or n < best[0]:
            best = (n, st, S_, segs)
    return best


def too_many_tasks(W: int, T: int, n: int, strategy: str, S: int, segments: Sequence[int], has_segment: bool):
    """(what, span key, hint) for a task table of ``n`` > MAX_TASKS tasks, naming what makes
    it large: the combine tiles of T tokens, W ranks each sending every owner its segments,
    or the segments themselves. The language allows such a layer; the graph stage does not
    build it (yet), so it is reported as "not supported yet" at that construct."""
    tiles = W * sizes.token_tiles(T)
    one_each = sizes.task_count(W, T, [min(s, 1) for s in segments], False)  # one segment per owner, no ring
    head = f"the task table would have {n:,} tasks (limit {MAX_TASKS:,}): "
    if sizes.task_count(W, T, [], False) > MAX_TASKS:
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


@lru_cache(maxsize=4)
def _built(spec: LayerSpec, strategy: str, S: int | None, B: int | None) -> TaskGraph:
    return build_graph(spec, strategy, "expert", S, B)


def graph_of(spec: LayerSpec, strategy: str, cut: str, S: int | None = None, B: int | None = None) -> TaskGraph:
    """:func:`build_graph`'s graph, its tasks built once for both cuts (a few kept): the cut
    changes which rows land in which segment, never the tasks."""
    base = _built(spec, strategy, S, B)
    return base if base.geometry.cut == cut else replace(base, geometry=replace(base.geometry, cut=cut))


@dataclass(frozen=True)
class GraphPass:
    """(LayerSpec, Resolution) → TaskGraph: the one graph of the resolve pass's strategy,
    cut, S and B, carrying its decisions."""

    name: str = "graph"

    def __call__(self, spec: LayerSpec, res) -> TaskGraph:
        return replace(graph_of(spec, res.strategy, res.cut, res.S, res.B), decisions=res.decisions)


__all__ = [
    "CUTS",
    "SEGMENT_CANDIDATES",
    "STRATEGIES",
    "GraphPass",
    "build_graph",
    "cap_per_expert",
    "check_size",
    "fewest_tasks",
    "geometry",
    "graph_of",
    "max_over_tokens",
    "owner_rows",
    "segmentation",
    "spec_int",
    "task_count",
    "too_many_tasks",
]


def dump(tg: TaskGraph) -> str:
    """``--dump-after graph``: the bounds, then one line per task (construction order)."""
    geo = tg.geometry
    lines = [
        f"// graph of layer {tg.layer}: {geo.strategy}, cut {geo.cut}, S={geo.S}, B={geo.B}, lookahead {geo.lookahead}",
        f"//   rows_max R_q  {list(geo.rows_max)}",
        f"//   segments      {list(geo.segments)}",
        f"//   m-tile slots  {list(geo.m_slots)} (ceil(min(R_q, S)/BM) + 2 E_loc - 1 when segments cut an owner's "
        f"rows, else + E_loc - 1; BM = {BM}: the planning tile; a built "
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
