"""The driver: pass order, --dump-after, --time-passes."""

import io

from rdepc.driver import Options, Pass, compile_file


def test_dump_after_and_time_passes(root, monkeypatch):
    monkeypatch.chdir(root)
    out = io.StringIO()
    p = Pass("count", lambda spec: {"experts": int(spec.shape.E)})
    compile_file("examples/tiny.rdep", Options(dump_after=("count",), time_passes=True), out=out, passes=[p])
    text = out.getvalue()
    assert "// ----- IR after count" in text
    assert '"experts": 8' in text
    assert "// pass timings" in text and "count" in text.split("// pass timings")[1]


def test_the_resolve_pass_decides_once_and_the_graph_and_plan_read_it(root, monkeypatch):
    """compile's resolve pass decides the strategy, cut, S and B, each with its reason
    (--dump-after resolve); the graph pass builds that one graph with those decisions, and
    rdepc plan plans the same strategy, S and B. Asked for: tiny pipelined, whose S and B
    the cost model chooses (no segment statement); chosen: qwen3_30b_a3b under schedule auto."""
    from rdepc.passes.plan import plan
    from rdepc.passes.plan_records import PlanOptions

    from rdepc.driver import spec_passes

    monkeypatch.chdir(root)
    assert [p.name for p in spec_passes()][:3] == ["replicate", "resolve", "graph"]
    for f, schedule, why in (
        ("examples/tiny.rdep", "pipelined", "  (cost model: no segment statement)"),
        ("examples/qwen3_30b_a3b.rdep", "auto", "  (spec: segment statement)"),
    ):
        o = Options(dump_after=("resolve",), schedule=schedule)
        out = io.StringIO()
        res = compile_file(f, o, out=out, passes=spec_passes(o)[:3])
        chosen, tg = res.outputs["resolve"], res.outputs["graph"]
        geo = tg.geometry
        text = out.getvalue().split("// ----- IR after resolve\n")[1].splitlines()
        assert text[1:] == [f"{d.name} = {d.value}  ({d.why})" for d in chosen.decisions]
        assert f"segment = S={geo.S}, B={geo.B}{why}" in text
        assert (geo.strategy, geo.cut, tg.decisions) == (chosen.strategy, chosen.cut, chosen.decisions)
        p = plan(res.spec, PlanOptions(strategy=schedule))
        assert (p.strategy, p.memory.plan.S.value, p.memory.plan.B.value) == (geo.strategy, geo.S, geo.B)
    assert text[1].startswith("strategy = deep  (cost model: deep cut source: ") and "bulk: " in text[1]


def test_verify_each_checks_the_graph_and_the_schedule_between_passes(root, monkeypatch):
    """--verify-each runs the graph's and the schedule's verifiers (rdepc.passes.verify) after
    their passes: a sound compile passes them, and a schedule whose order is not topological,
    or a graph with a cycle, stops the driver before the next pass, naming the invariant."""
    from dataclasses import replace

    import pytest
    from rdepc.passes.verify import graph_problems, schedule_problems

    from rdepc.driver import spec_passes

    monkeypatch.chdir(root)
    o = Options(verify_each=True, schedule="pipelined")
    passes = spec_passes(o)
    assert all(p.verify is not None for p in passes if p.name in ("graph", "schedule", "memplan"))
    assert all(p.verify is None for p in spec_passes() if p.name in ("graph", "schedule"))
    res = compile_file("examples/tiny.rdep", o, out=io.StringIO(), passes=passes[:5])
    sched, tg = res.outputs["schedule"], res.outputs["graph"]
    assert schedule_problems(sched) == [] and graph_problems(tg) == []
    order = tuple(reversed(sched.order))
    position = tuple(sorted(range(len(order)), key=order.__getitem__))
    backwards = replace(sched, order=order, position=position)
    assert any("is ordered before its input" in p for p in schedule_problems(backwards))
    stale = ["the tasks' positions are not their places in the global order"]
    assert schedule_problems(replace(sched, order=order)) == stale
    first = next(t for t in tg.tasks if t.deps)
    loop = tuple(replace(t, deps=(*t.deps, first.id)) if t.id == first.deps[0] else t for t in tg.tasks)
    (cycle,) = graph_problems(replace(tg, tasks=loop))
    assert cycle.startswith("the graph has a cycle: ") and cycle.endswith(" of its tasks are on it or wait on it")
    broken = [replace(p, run=lambda cm, p=p: replace(p.run(cm), order=order, position=position))
              if p.name == "schedule" else p for p in passes[:5]]  # fmt: skip
    with pytest.raises(AssertionError, match="the schedule pass's output violates its invariants"):
        compile_file("examples/tiny.rdep", o, out=io.StringIO(), passes=broken)
