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
