"""One home per formula: rdepc.ir.sizes holds each size the passes read (cap_e, R_q, the
done counters, the task count, BM), and every user of a formula agrees with it — the graph's
geometry, elaboration's checks, the memory plan, and the planner's symbolic formulas
evaluated at the spec's values — over every example and a few capacity variants; and the
cost model's m-tile slots per segment are the kernel's (m_tile_slots)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES, ROOT, TINY, tiny_segmented
from rdepc.passes import memplan
from rdepc.passes.cost import cost_model
from rdepc.passes.elaborate import elaborate
from rdepc.passes.graph import build_graph, geometry, task_count
from rdepc.passes.loads import admit, expected_counts, segment_load
from rdepc.passes.plan import plan
from rdepc.passes.plan_symbols import Env, cap_expr, rows_per_owner_expr, spec_values, worst_owner_load_expr
from rdepc.passes.symmetric import done_counters_expr, symmetric_plan

import rdepc
from rdepc.driver import generate_spec
from rdepc.ir import sizes
from rdepc.ir.contract import Tiles, tile_slots
from rdepc.ir.sizes import BM
from rdepc.parser import parse_text

# tiny.rdep's capacity (and tokens) replaced: each policy, a capacity below the mean, an
# uneven ownership, and a ``capacity rows`` expression in a symbolic T that peaks inside 1..T.
VARIANTS = {
    "factor": {"capacity  dropless": "capacity  factor 1.25"},
    "factor_low": {"capacity  dropless": "capacity  factor 0.5, drop arrival"},
    "rows": {"capacity  dropless": "capacity  rows 40"},
    "uneven": {"experts 8": "experts 10", "capacity  dropless": "capacity  factor 1.5"},
    "rows_symbolic": {
        "param T = 16    # tokens per rank": "param T <= 64",
        "capacity  dropless": "capacity  rows 2000 + 64 * T - T * T",
    },
}


@pytest.fixture(scope="module")
def spec_files(tmp_path_factory) -> list[Path]:
    out = list(EXAMPLES)
    text = TINY.read_text(encoding="utf-8")
    directory = tmp_path_factory.mktemp("sizes")
    for name, edits in VARIANTS.items():
        t = text
        for old, new in edits.items():
            assert old in t, f"examples/tiny.rdep no longer has '{old}': update VARIANTS"
            t = t.replace(old, new)
        path = directory / f"tiny_{name}.rdep"
        path.write_text(t, encoding="utf-8")
        out.append(path)
    return out


def _strategies(spec) -> list[tuple[str, int | None, int | None]]:
    """bulk, and pipelined at the spec's segment statement (without one, S = 32, B = 2)."""
    return [("bulk", None, None), ("pipelined", None, None) if spec.segment is not None else ("pipelined", 32, 2)]


def _ints(spec):
    sh = spec.shape
    return int(sh.W), sh.T_max, int(sh.K), int(sh.E), spec.ownership.experts_per_rank(int(sh.W))


def test_cap_e_every_user_agrees(spec_files):
    policies = set()
    for path in spec_files:
        spec = rdepc.load(path).spec
        W, T, K, E, _ = _ints(spec)
        cap = spec.capacity
        policies.add(cap.policy)
        rows = None
        if cap.policy == "rows":  # the largest over the tokens a call may bring, by brute force
            rows = (
                max(int(cap.rows.subs(spec.shape.T, t)) for t in range(1, T + 1)) if spec.shape.symbolic else cap.rows
            )
        want = sizes.cap_e(cap.policy, W, T, K, E, cap.factor, rows)
        assert geometry(spec, "bulk").cap_e == want, path.name
        fig = plan(spec).capacity.rows_per_expert  # the symbolic formula, evaluated
        assert (None if fig is None else fig.value) == want, path.name
        if cap.policy == "factor":  # the spec's own expression at T
            assert int(cap.rows_per_expert(spec.shape).subs(spec.shape.T, T)) == want
        if cap.policy != "dropless":
            env = Env(spec_values(spec, "bulk"), cap.policy)
            assert env.value(cap_expr(cap.policy)) == want
    assert policies == {"dropless", "factor", "rows"}


def test_symbolic_capacity_is_the_same_rule():
    """cap_expr is capacity_rule applied to symbols: the formula the report prints."""
    assert str(cap_expr("factor")) == "ceiling(f*mu)"
    assert str(cap_expr("rows")) == "C"
    assert str(cap_expr("dropless")) == "oo"
    assert str(rows_per_owner_expr("factor")) == "Min(E_max*cap_e, T*W*Min(E_max, K))"
    assert rows_per_owner_expr("dropless") == worst_owner_load_expr()


def test_owner_rows_every_user_agrees(spec_files):
    for path in spec_files:
        spec = rdepc.load(path).spec
        W, T, K, _E, per = _ints(spec)
        geo = geometry(spec, "bulk")
        want = tuple(sizes.owner_rows(W, T, K, e, geo.cap_e) for e in per)
        assert geo.rows_max == want, path.name
        assert sizes.bulk_rows(want) == geo.S
        capacity = plan(spec).capacity
        assert capacity.rows_per_owner.value == max(want), path.name  # R_max = max_q R_q
        assert capacity.worst_owner_load.value == sizes.owner_rows(W, T, K, max(per), None)


def test_elaboration_checks_use_the_same_sizes(spec_files):
    """Elaboration's exact (sympy-free) checks name the bulk S the graph builds: the tiny
    variants with a segment statement under schedule bulk warn with S = max_q R_q."""
    for path in spec_files:
        if not path.name.startswith("tiny"):
            continue
        text = path.read_text(encoding="utf-8").replace(
            "schedule  bulk", "segment   rows 4096, buffers 2\n  schedule  bulk"
        )
        _, diags = elaborate(parse_text(text, "t.rdep"), sympy=False)
        (said,) = (int(m.group(1)) for d in diags.items if (m := re.search(r"\(S = (\d+)", d.message)))
        assert said == geometry(rdepc.load(path).spec, "bulk").S, path.name


def test_done_counters_every_user_agrees(spec_files):
    for path in spec_files:
        spec = rdepc.load(path).spec
        for st, S, B in _strategies(spec):
            tg = build_graph(spec, st, S=S, B=B)
            geo = tg.geometry
            n = max(geo.segments, default=0)
            bal = geo.slots > 0
            want = sizes.done_counters(geo.W, sizes.token_tiles(geo.T), n, geo.return_ring, bal)
            assert memplan.flag_slots(geo.W, geo.T, n, geo.return_ring, bal) == want
            env = Env(spec_values(spec, st, S, B), spec.capacity.policy)
            assert env.value(done_counters_expr(st, bal)) == want, (path.name, st)
            heap = symmetric_plan(spec, st, rows=S, buffers=B)
            assert heap["buffers"]["flags"] == memplan.pad(8 * want)
            # the counters bound the tasks any one rank runs, and the graph has the tasks counted
            runs = [0] * geo.W
            for t in tg.tasks:
                runs[t.rank] += 1
            assert max(runs) <= want
            assert (
                len(tg.tasks)
                == task_count(geo)
                == sizes.task_count(geo.W, geo.T, geo.segments, geo.return_ring, geo.slots > 0)
            )


def test_m_tile_slots_every_user_agrees(spec_files):
    for path in spec_files:
        spec = rdepc.load(path).spec
        for st, S, B in _strategies(spec):
            tg = build_graph(spec, st, S=S, B=B)
            geo = tg.geometry
            assert geo.m_slots == sizes.m_tile_slots(geo.rows_max, geo.experts, geo.S), (path.name, st)
            cut = sizes.segments_cut(geo.rows_max, geo.S)
            assert cut == (st != "bulk" and max(geo.segments) > 1)
            # the m-tiles the cost model charges under the expected routing fit the slots
            load = segment_load(geo, admit(geo, expected_counts(geo)))
            flops = cost_model(tg, "h100").flops
            for t in tg.tasks:
                if t.stage == "compute":
                    assert t.tiles == sizes.segment_m_tiles(t.rows, geo.experts[t.owner], cut)
                    assert t.tiles <= geo.m_slots[t.owner]
                    m = sizes.m_tiles(load.experts.get((t.owner, t.segment), {}).values())
                    assert load.m_tiles(t.owner, t.segment) == m <= t.tiles
                    coef = geo.flop_coef - 2 if t.detail == "gemm1" else 2
                    assert flops[t.id] == coef * m * BM * geo.H * geo.F


@pytest.mark.parametrize("name", ["tiny", "tiny_segmented", "moonlight"])
def test_cost_model_m_tile_slots_are_the_kernels(name, tmp_path):
    """The graph's (the cost model's) m-tile slots are the ones the kernel contract gives each
    segment, at the planning tile BM and at every tile height the kernel may run."""
    path = tiny_segmented(tmp_path) if name == "tiny_segmented" else ROOT / "examples" / f"{name}.rdep"
    gen = generate_spec(rdepc.load(path).spec)
    geo, kernel = gen.schedule.graph.geometry, gen.kernel
    assert kernel.work(Tiles(bm=BM)).m_slots == geo.m_slots
    for bm in (16, 32, 64, 128):
        slots = sizes.m_tile_slots(geo.rows_max, geo.experts, geo.S, bm)
        assert kernel.work(Tiles(bm=bm)).m_slots == slots
        assert tile_slots(geo.rows_max, geo.experts, geo.S, bm) == max(slots)


def test_bm_has_one_home():
    assert sizes.BM is BM
    defined = [
        p.name
        for folder in ("passes", "rdepc")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "sizes.py" and re.search(r"^BM\s*=", p.read_text(encoding="utf-8"), re.M)
    ]
    assert defined == [], f"BM defined outside rdepc/ir/sizes.py: {defined}"


def test_sizes_imports_neither_torch_nor_triton_nor_sympy():
    code = "import sys, rdepc.ir.sizes; print(sorted(m for m in ('torch', 'triton', 'sympy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
