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
