"""The hierarchical task graph: bounds, structure, buffer-reuse edges, predicates, routing
through the segments, the size diagnostic and the tile-level expansion."""

from __future__ import annotations

import networkx as nx
import pytest
from conftest import EXAMPLES, ROOT
from hypothesis import example, given, settings
from hypothesis import strategies as st
from moe_cases import CORNERS, ROUTING_KINDS, Case, cases, counts, m_tiles, place_rows, routing
from rdepc.passes.graph import build_graph, geometry, task_count
from rdepc.passes.loads import admit, expected_counts, mtiles_bound_ok, segment_load, task_rows
from rdepc.passes.padding import tiled_rows
from rdepc.passes.tasks import expand_tiles

import rdepc
from rdepc.diagnostics import SpecError
from rdepc.ir.graph import MAX_TASKS
from rdepc.ir.sizes import BM


def test_tile_height_is_the_planners():
    assert tiled_rows([1]) == BM  # the planner's padding-free tiling launches BM-row tiles


@pytest.fixture(scope="module")
def moonlight():
    return rdepc.load(ROOT / "examples/moonlight.rdep").spec


def test_moonlight_bounds(moonlight):
    g = geometry(moonlight, "pipelined")
    assert g.rows_max == (8 * 4096 * 6,) * 8  # W·T·min(K, E_loc): dropless, distinct top-K
    assert g.segments == (48,) * 8  # ceil(196608 / 4096)
    # the kernel's rule: segments cut each owner's rows, so a boundary may split one m-tile per expert
    assert g.m_slots == (4096 // 128 + 2 * 8 - 1,) * 8
    assert g.lookahead == 1 and g.B == 2 and g.return_ring
    b = geometry(moonlight, "bulk")
    assert (b.S, b.B, b.segments) == (196608, 1, (1,) * 8)
    assert b.m_slots == (196608 // 128 + 8 - 1,) * 8  # one segment per owner: nothing cuts an m-tile


def test_nvl72_bounds_capacity_binds():
    spec = rdepc.load(ROOT / "examples/nvl72_e128.rdep").spec
    g = geometry(spec, "pipelined")
    cap = -(-5 * 72 * 4096 * 6 // (4 * 128))  # ceil(1.25 · W·T·K/E)
    assert g.cap_e == cap
    assert set(g.rows_max) == {2 * cap, cap}  # Σ cap_e binds below W·T·min(K, E_loc)
    assert g.segments.count(-(-2 * cap // 4096)) == 56 and g.segments.count(-(-cap // 4096)) == 16


def test_symbolic_tokens_use_the_bound(tmp_path):
    f = tmp_path / "sym.rdep"
    f.write_text(
        "param T <= 64\nlayer s {\n  shape ranks 2, tokens T, hidden 8, experts 4, top 2\n"
        "  expert swiglu(ffn = 8)\n  segment rows 16, buffers 2\n}\n"
    )
    g = geometry(rdepc.load(f).spec, "pipelined")
    assert g.T == 64 and g.rows_max == (2 * 64 * 2,) * 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("strategy", ["bulk", "pipelined"])
def test_examples_structure(path, strategy):
    spec = rdepc.load(path).spec
    if strategy != "bulk" and spec.segment is None:
        pytest.skip("no segment statement")
    tg = build_graph(spec, strategy)
    check_structure(tg)


def check_structure(tg):
    geo = tg.geometry
    tasks = tg.tasks
    assert len(tasks) == task_count(geo) <= MAX_TASKS
    keys = set()
    for t in tasks:
        assert all(d < t.id for d in t.deps), "built in a topological order"
        assert set(t.war) <= set(t.deps)
        key = (t.stage, t.detail, t.rank, t.src, t.owner, t.segment, t.claim)
        assert key not in keys, f"one task per (rank, segment, stage): {t.name} twice"
        keys.add(key)
    by = {(t.stage, t.detail, t.src, t.owner, t.segment): t for t in tasks}
    for t in tasks:
        if t.stage == "compute":
            q, s = t.owner, t.segment
            up = geo.flop_coef - 2 if t.detail == "gemm1" else 2
            assert t.flops == up * t.rows * geo.H * geo.F
            cut = max(geo.rows_max) > geo.S
            assert t.tiles == -(-t.rows // BM) + (2 if cut else 1) * geo.experts[q] - 1 <= geo.m_slots[q]
            assert t.rows == min(geo.S, geo.rows_max[q] - s * geo.S) > 0
            assert t.empty_if == f"rows({q}) <= {s * geo.S}"
            data = [tasks[d] for d in t.deps if d not in t.war]
            if t.detail == "gemm1":  # its segment's dispatches and, under balance replicate, its rank's receive
                slots = [u for u in data if u.stage == "balance"]
                assert [(u.detail, u.rank) for u in slots] == ([("receive", q)] if geo.slots else [])
                data = [u for u in data if u.stage != "balance"]
                assert all(u.stage == "dispatch" and (u.owner, u.segment) == (q, s) for u in data)
                assert {u.src for u in data} == set(range(geo.W))
            else:  # GEMM2: its segment's GEMM1
                assert [(u.detail, u.owner, u.segment) for u in data] == [("gemm1", q, s)]
            if s >= geo.B and t.detail == "gemm1":  # the workspace ring: GEMM1 s waits for GEMM2 s − B
                (w,) = t.war
                assert (tasks[w].detail, tasks[w].owner, tasks[w].segment) == ("gemm2", q, s - geo.B)
            elif s >= geo.B:  # the private staging ring: GEMM2 s waits for every return of s − B
                assert {tasks[d].src for d in t.war} == set(range(geo.W))
                assert all(tasks[d].stage == "return" and tasks[d].segment == s - geo.B for d in t.war)
            else:
                assert not t.war
        elif t.stage == "balance":  # the plan: loads, then every rank's solve, its reroute and push; the receives
            of = {d: {u.id for u in tasks if u.detail == d} for d in ("load", "solve", "push")}
            assert all(len(v) == geo.W for v in of.values())
            mine = {u.id for u in tasks if u.detail == "solve" and u.rank == t.rank}
            want = {"load": set(), "solve": of["load"], "reroute": mine, "push": mine, "receive": of["push"]}
            assert set(t.deps) == want[t.detail], t.name
        elif t.stage == "route" and geo.slots:  # its rows' physical experts first
            assert [(tasks[d].detail, tasks[d].rank) for d in t.deps] == [("reroute", t.rank)]
        elif t.stage == "dispatch":
            q, s = t.owner, t.segment
            assert t.slot == s % geo.B
            if s >= geo.B:  # the payload ring: dispatch of s waits for the GEMM1 of s − B
                (w,) = t.war
                assert tasks[w].detail == "gemm1" and (tasks[w].owner, tasks[w].segment) == (q, s - geo.B)
            else:
                assert not t.war
        elif t.stage == "return" and geo.return_ring:
            assert t.slot == t.claim % geo.B
            if t.claim >= geo.B:  # the return ring: claim j waits for the unpack of claim j − B
                (w,) = t.war
                u = tasks[w]
                assert (u.detail, u.src, u.claim) == ("unpack", t.src, t.claim - geo.B)
            unpack = by[("combine", "unpack", t.src, t.owner, t.segment)]
            assert t.id in unpack.deps and unpack.slot == t.slot
    claims: dict[int, list[int]] = {}
    for t in tasks:
        if t.stage == "return" and geo.return_ring:
            claims.setdefault(t.src, []).append(t.claim)
    assert all(c == list(range(len(c))) for c in claims.values()), "claims in the global order"
    g = tg.graph
    assert g.number_of_nodes() == len(tasks)
    assert g.number_of_edges() == sum(len(t.deps) for t in tasks)
    assert nx.is_directed_acyclic_graph(g)
    n_war = sum(1 for _, _, k in g.edges(data="kind") if k == "war")
    assert n_war == sum(len(t.war) for t in tasks)
    a = g.nodes[tasks[-1].id]
    assert {"rows", "tiles", "bytes", "flops", "stage", "rank", "segment", "empty_if"} <= set(a)


@settings(max_examples=100)
@given(cases(), st.sampled_from(["bulk", "pipelined", "deep"]))
@example(CORNERS["W=1"], "pipelined")
@example(CORNERS["E_loc=1"], "pipelined")
@example(CORNERS["K=E"], "deep")
@example(CORNERS["non-uniform map"], "pipelined")
@example(CORNERS["owner of nothing"], "bulk")
def test_random_graph_structure(case, strategy):
    tg = build_graph(case.spec(), strategy, case.cut)
    check_structure(tg)


def check_routing(case: Case, route) -> None:
    """Every accepted route row lands in exactly one segment of its expert's owner, within
    the graph's bounds, and the count-level load the cost model uses agrees row for row."""
    spec = case.spec()
    geo = geometry(spec, "pipelined", case.cut)
    tg = build_graph(spec, "pipelined", case.cut)
    placed = place_rows(geo, route)
    c = counts(case, route)
    actual = [[0] * case.E for _ in range(case.W)]
    for r, t, k in placed["admitted"]:
        actual[r][route[r][t][k]] += 1
    predicted = admit(geo, c)
    if geo.drop == "arrival":  # source order: exact from the counts
        assert predicted == actual
    else:  # round_robin from counts: each source's share of the same totals
        assert [sum(col) for col in zip(*predicted, strict=True)] == [sum(col) for col in zip(*actual, strict=True)]
        assert all(0 <= a <= n for pr, cr in zip(predicted, c, strict=True) for a, n in zip(pr, cr, strict=True))
    load = segment_load(geo, actual)
    assert sum(map(sum, load.admitted)) == len(placed["admitted"])
    n_rows = case.W * case.T * case.K
    assert len(placed["admitted"]) + len(placed["dropped"]) == n_rows  # eqs. 10/12, minus drops
    per_seg: dict[tuple[int, int], dict[int, int]] = {}
    sent: dict[tuple[int, int, int], int] = {}
    for (r, _t, _k), (q, s, e) in placed["where"].items():
        assert geo.owner[e] == q
        assert s < geo.segments[q], "a segment beyond the graph's bound"
        per_seg.setdefault((q, s), {}).setdefault(geo.local[e], 0)
        per_seg[(q, s)][geo.local[e]] += 1
        sent[(r, q, s)] = sent.get((r, q, s), 0) + 1
    assert sent == load.sent
    assert per_seg == load.experts
    for (q, _s), d in per_seg.items():
        assert sum(d.values()) <= geo.S
        assert m_tiles(d) <= geo.m_slots[q], "padding-free m-tile slots suffice"
    assert mtiles_bound_ok(geo, load)
    rows = task_rows(tg, load)
    for t, n in zip(tg.tasks, rows, strict=True):
        assert n <= t.rows, f"{t.name}: {n} rows over its bound {t.rows}"
        if t.stage == "compute":
            assert n == sum(per_seg.get((t.owner, t.segment), {}).values())
            empty = sum(d for (_, q, _), d in sent.items() if q == t.owner) <= t.segment * geo.S
            assert (n == 0) == empty, "compute is empty exactly when rows(q) <= s·S"
        if t.stage == "dispatch":
            assert (n == 0) == ((t.src, t.owner, t.segment) not in sent)


@settings(max_examples=150)
@given(cases(), st.sampled_from(ROUTING_KINDS), st.integers(0, 2**16))
@example(CORNERS["W=1"], "uniform", 1)
@example(CORNERS["E_loc=1"], "hot", 2)
@example(CORNERS["K=E"], "uniform", 3)
@example(CORNERS["T not a multiple of BM"], "uniform", 4)
@example(CORNERS["capacity binds"], "one", 5)
@example(CORNERS["non-uniform map"], "hot", 6)
@example(CORNERS["owner of nothing"], "skip", 7)
@example(Case(W=2, T=9, H=8, E=4, K=1, S=4), "one", 8)  # every row to one expert
@example(Case(W=3, T=6, H=8, E=6, K=2, S=4), "skip", 9)  # an owner that receives nothing
def test_routing_through_segments(case, kind, seed):
    check_routing(case, routing(case, kind, seed))


def test_expected_routing_is_balanced(moonlight):
    geo = geometry(moonlight, "pipelined")
    c = expected_counts(geo)
    assert all(sum(row) == 4096 * 6 for row in c)
    per_expert = [sum(c[r][e] for r in range(8)) for e in range(64)]
    assert max(per_expert) - min(per_expert) <= 8
    load = segment_load(geo, admit(geo, c))
    rows = [sum(load.seg_rows(q, s) for s in range(48)) for q in range(8)]
    assert rows == [8 * 4096 * 6 // 8] * 8  # 24,576 rows: 6 full segments of 48 bound
    assert max(s for (_, s) in load.experts) == 5


def test_flops_per_activation():
    for act, coef in (("swiglu", 6), ("gelu", 4), ("relu", 4)):
        tg = build_graph(Case(W=2, T=8, H=16, E=2, K=1, F=32, S=8, act=act).spec(), "pipelined")
        comp = [t for t in tg.tasks if t.stage == "compute"]
        assert comp and all(t.flops == (coef - 2 if t.detail == "gemm1" else 2) * t.rows * 16 * 32 for t in comp)
        assert sum(t.flops for t in comp) == coef * sum(t.rows for t in comp if t.detail == "gemm1") * 16 * 32


def test_too_many_tasks_is_a_diagnostic_at_the_segment_statement():
    case = Case(W=8, T=4096, H=8, E=64, K=6, S=16)
    with pytest.raises(SpecError) as e:
        build_graph(case.spec(), "pipelined")
    (d,) = e.value.diagnostics
    assert "task table would have" in d.message and "limit 2,000,000" in d.message
    assert case.text().splitlines()[d.span.line - 1].lstrip().startswith("segment")
    assert "raise 'segment rows'" in d.hint


def test_deep_with_two_buffers_is_pipelined():
    """What elaboration's 'deep with 2 buffer(s) is no deeper than pipelined' warning says:
    lookahead B − 1 = 1 is pipelined's, so the graph is the same, task for task; B = 3 is not."""
    spec = rdepc.load(ROOT / "examples/tiny.rdep").spec
    deep, pipelined = build_graph(spec, "deep", S=32, B=2), build_graph(spec, "pipelined", S=32, B=2)
    assert deep.geometry.lookahead == pipelined.geometry.lookahead == 1
    assert deep.tasks == pipelined.tasks
    assert build_graph(spec, "deep", S=32, B=3).tasks != build_graph(spec, "pipelined", S=32, B=3).tasks


def test_tile_expansion_small_only(moonlight):
    tg = build_graph(rdepc.load(ROOT / "examples/tiny.rdep").spec, "pipelined", S=32, B=2)
    g = expand_tiles(tg)
    assert g.number_of_nodes() == sum(t.tiles + 1 for t in tg.tasks)
    assert nx.is_directed_acyclic_graph(g)
    big = build_graph(moonlight, "pipelined")
    with pytest.raises(ValueError, match="tile graph would have"):
        expand_tiles(big)
