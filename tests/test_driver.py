"""The driver: pass order, --dump-after, --time-passes, and "not supported yet"."""

import io

import pytest

from rdepc.diagnostics import SpecError
from rdepc.driver import Options, Pass, compile_file


def test_unsupported_feature_is_reported_at_its_construct(root, monkeypatch):
    monkeypatch.chdir(root)
    lacks_fp8 = Pass("lowering", lambda spec: spec, unsupported=frozenset({"fp8 dispatch"}))
    with pytest.raises(SpecError) as e:
        compile_file("examples/deepseek_v3.rdep", Options(), passes=[lacks_fp8])
    (d,) = e.value.diagnostics
    assert d.message == "not supported yet: fp8 dispatch (the 'lowering' stage does not implement it)"
    text = (root / "examples/deepseek_v3.rdep").read_text().splitlines()
    assert "fp8_e4m3" in text[d.span.line - 1][d.span.col - 1 :]


def test_pass_without_the_feature_runs(root, monkeypatch):
    monkeypatch.chdir(root)
    seen = []
    ok = Pass("lowering", lambda spec: seen.append(spec.name) or spec, unsupported=frozenset({"fp8 dispatch"}))
    result = compile_file("examples/tiny.rdep", Options(), passes=[ok])
    assert seen == ["tiny"]
    assert list(result.times) == ["parse", "elaborate", "lowering"]


def test_dump_after_and_time_passes(root, monkeypatch):
    monkeypatch.chdir(root)
    out = io.StringIO()
    p = Pass("count", lambda spec: {"experts": int(spec.shape.E)})
    compile_file("examples/tiny.rdep", Options(dump_after=("count",), time_passes=True), out=out, passes=[p])
    text = out.getvalue()
    assert "// ----- IR after count" in text
    assert '"experts": 8' in text
    assert "// pass timings" in text and "count" in text.split("// pass timings")[1]
