"""The Python API: rdepc.parse, rdepc.load, Layer, SpecError, UsageError."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from pathlib import Path

import pytest
import sympy
from conftest import ROOT

import rdepc
from rdepc import syntax as S
from rdepc.api import parse_override
from rdepc.diagnostics import Severity, Span

MOONLIGHT = ROOT / "examples" / "moonlight.rdep"
NVL72 = ROOT / "examples" / "nvl72_e128.rdep"
TINY = ROOT / "examples" / "tiny.rdep"

SYMBOLIC = """param T <= 8192
layer sym {
  shape  ranks 8, tokens T, hidden 2048, experts 64, top 6
  expert swiglu(ffn = 1408)
  capacity factor 1.25
}
"""

TWO_LAYERS = """param W = 8
layer small {
  shape  ranks W, tokens 1024, hidden 512, experts 16, top 2
  expert swiglu(ffn = 256)
}
layer wide {
  shape  ranks W, tokens 4096, hidden 2048, experts 64, top 6
  expert swiglu(ffn = 1408)
}
"""


def write(tmp_path: Path, text: str, name: str = "spec.rdep") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_public_names():
    assert set(rdepc.__all__) >= {"Layer", "SpecError", "UsageError", "load", "parse", "__version__"}
    assert issubclass(rdepc.UsageError, ValueError)
    assert rdepc.__version__.count(".") == 2


# ------------------------------------------------------------------------- parse


def test_parse_text_path_and_string_path():
    text = TINY.read_text(encoding="utf-8")
    from_text = rdepc.parse(text)
    assert isinstance(from_text, S.Module) and from_text.file == "<string>"
    from_path = rdepc.parse(TINY)
    assert from_path.file == str(TINY)
    from_str = rdepc.parse(str(TINY))
    assert from_str.file == str(TINY)
    assert [x.name for x in from_text.layers] == [x.name for x in from_path.layers] == ["tiny"]
    assert from_text.params == _refile(from_path.params, "<string>")
    assert from_text.layers == _refile(from_path.layers, "<string>")


def _refile(node, file):
    """The same node as if parsed from another file (positions kept)."""
    if isinstance(node, Span):
        return dataclasses.replace(node, file=file)
    if isinstance(node, tuple):
        return tuple(_refile(x, file) for x in node)
    if dataclasses.is_dataclass(node):
        return dataclasses.replace(
            node, **{f.name: _refile(getattr(node, f.name), file) for f in dataclasses.fields(node)}
        )
    return node


def test_parse_a_one_line_spec_longer_than_a_file_name():
    """Regression: a long one-line string made Path.is_file() raise OSError (name too long)."""
    module = rdepc.parse("layer m { }" * 1000)
    assert module.file == "<string>" and len(module.layers) == 1000


def test_parse_errors_raise_spec_error():
    with pytest.raises(rdepc.SpecError) as info:
        rdepc.parse("layer m {\n  shape ranks 8 $\n}\n")
    (d,) = info.value.diagnostics
    assert (d.severity, d.span.line, d.span.col) == (Severity.ERROR, 2, 17)
    assert str(info.value).startswith("<string>:2:17: error: unexpected character '$'")
    with pytest.raises(rdepc.SpecError, match="no such file"):
        rdepc.parse(Path("no/such/file.rdep"))


def test_parse_a_mistyped_path_says_no_such_file():
    """Regression: a one-line string naming a missing .rdep file was parsed as spec text
    ("unexpected 'examples'")."""
    with pytest.raises(rdepc.SpecError) as info:
        rdepc.parse("examples/tinyy.rdep")
    assert str(info.value) == "examples/tinyy.rdep:1:1: error: no such file"


# -------------------------------------------------------------------------- load


def test_load_shapes():
    layer = rdepc.load(MOONLIGHT)
    assert isinstance(layer, rdepc.Layer)
    assert layer.shapes == {"W": 8, "T": 4096, "H": 2048, "F": 1408, "E": 64, "K": 6}
    assert set(layer.shapes) == {"W", "T", "H", "F", "E", "K"}
    assert all(type(v) is int for v in layer.shapes.values())
    assert layer.spec.name == "moonlight"
    assert layer.warnings == ()
    assert repr(layer) == "<rdepc.Layer moonlight W=8, T=4096, H=2048, F=1408, E=64, K=6>"
    assert rdepc.load(str(MOONLIGHT)).shapes == layer.shapes


def test_sizes_are_sympy_objects():
    spec = rdepc.load(MOONLIGHT).spec
    for k in ("W", "T", "H", "E", "K"):
        assert isinstance(getattr(spec.shape, k), sympy.Integer), k
    assert isinstance(spec.expert.F, sympy.Integer)
    assert spec.shape.H == 2048


def test_override_changes_tokens_and_route_row_radix():
    base = rdepc.load(MOONLIGHT)
    layer = rdepc.load(MOONLIGHT, T=8192)
    assert layer.shapes["T"] == 8192 and layer.spec.shape.T == 8192
    assert dict(base.spec.route_row.radix)["rank"] == 4096 * 6
    assert layer.spec.route_row.radix == (("slot", 1), ("token", 6), ("rank", 8192 * 6))
    overridden = {p.name for p in layer.spec.params if p.overridden}
    assert overridden == {"T"} and {p.name for p in layer.spec.params} == {"W", "T", "K", "L", "H", "F"}
    # a decimal override is exact; a non-whole size is an error
    assert rdepc.load(MOONLIGHT, T=4096.0).shapes["T"] == 4096
    with pytest.raises(rdepc.SpecError, match="tokens must be a whole number, got 8193/2"):
        rdepc.load(MOONLIGHT, T=4096.5)


def test_override_from_the_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    layer = rdepc.load("examples/moonlight.rdep", T=8192, K=4)
    assert layer.shapes["T"] == 8192 and layer.shapes["K"] == 4
    assert layer.spec.route_row.radix == (("slot", 1), ("token", 4), ("rank", 8192 * 4))
    assert layer.spec.file == "examples/moonlight.rdep"


@pytest.mark.parametrize("value", ["4096", object(), [1], float("inf"), float("nan"), True, 1j])
def test_override_values_that_are_not_numbers(value):
    """Regression: these raised ValueError/TypeError from deep inside elaboration (or, for
    True, silently meant 1)."""
    with pytest.raises(rdepc.UsageError, match="expected a whole or decimal number"):
        rdepc.load(MOONLIGHT, T=value)


def test_huge_override_is_a_spec_error():
    with pytest.raises(rdepc.SpecError, match=r"override for 'T' is too large \(limit 2\^62\)"):
        rdepc.load(MOONLIGHT, T=10**30)


def test_override_of_undeclared_parameter():
    with pytest.raises(rdepc.UsageError, match=r"no parameter Q, Z in .*moonlight.rdep \(declared: F, H, K, L, T, W\)"):
        rdepc.load(MOONLIGHT, Q=1, Z=2)


def test_layer_choice(tmp_path):
    path = write(tmp_path, TWO_LAYERS)
    with pytest.raises(rdepc.UsageError) as info:
        rdepc.load(path)
    assert "defines 2 layers (small, wide)" in str(info.value)
    assert rdepc.load(path, layer="small").shapes["E"] == 16
    assert rdepc.load(path, layer="wide", W=4).shapes == {"W": 4, "T": 4096, "H": 2048, "F": 1408, "E": 64, "K": 6}
    with pytest.raises(rdepc.UsageError, match=r"has no layer 'nope' \(it has: small, wide\)"):
        rdepc.load(path, layer="nope")
    with pytest.raises(rdepc.UsageError, match="no layer 'small'"):
        rdepc.load(MOONLIGHT, layer="small")


def test_spec_error_carries_diagnostics(tmp_path):
    path = write(tmp_path, "layer m {\n  shape ranks 8, tokens 0, hidden 64, experts 4, top 9\n  expert swiglu()\n}\n")
    with pytest.raises(rdepc.SpecError) as info:
        rdepc.load(path)
    err = info.value
    assert [(d.span.line, d.span.col, d.message) for d in err.diagnostics] == [
        (2, 25, "tokens must be positive, got 0"),
        (3, 10, "swiglu needs its ffn width"),
    ]
    assert err.sources == {str(path): path.read_text(encoding="utf-8")}
    assert str(err) == err.render()
    assert f"{path}:2:25: error: tokens must be positive, got 0\n    2 |" in str(err)


def test_warnings_are_returned_not_raised():
    layer = rdepc.load(NVL72)
    (note,) = layer.warnings
    assert note.severity is Severity.NOTE and "56 ranks own 2 experts and 16 own 1" in note.message


def test_nvl72_ownership_and_capacity():
    spec = rdepc.load(NVL72).spec
    W, E = int(spec.shape.W), int(spec.shape.E)
    assert (W, E) == (72, 128)
    own = spec.ownership
    for q in range(56):
        assert own.experts_of(q) == (2 * q, 2 * q + 1)
        assert [own.local[e] for e in own.experts_of(q)] == [0, 1]
    for q in range(56, 72):
        assert own.experts_of(q) == (56 + q,)
        assert own.local[56 + q] == 0
    cap = spec.capacity.rows_per_expert(spec.shape)
    assert cap == math.ceil(Fraction(5, 4) * 72 * 4096 * 6 / 128) == 17280
    assert isinstance(cap, sympy.Integer)


def test_explicit_owner_map(tmp_path):
    text = (
        "layer m {\n  shape ranks 2, tokens 16, hidden 64, experts 8, top 2\n  expert swiglu(ffn = 64)\n"
        "  owner map { 0: 0..4; 1: 4..8 }\n}\n"
    )
    own = rdepc.load(write(tmp_path, text)).spec.ownership
    assert own.policy == "map"
    assert own.owner == (0, 0, 0, 0, 1, 1, 1, 1)
    assert own.local == (0, 1, 2, 3, 0, 1, 2, 3)


def test_symbolic_parameter(tmp_path):
    path = write(tmp_path, SYMBOLIC)
    layer = rdepc.load(path)
    spec = layer.spec
    assert layer.shapes["T"] == 8192  # the bound
    assert isinstance(spec.shape.T, sympy.Symbol) and spec.shape.T.name == "T"
    assert spec.shape.T.is_integer and spec.shape.T.is_positive
    assert spec.shape.T_bound == 8192 and spec.shape.symbolic
    cap = spec.capacity.rows_per_expert(spec.shape)
    assert cap.free_symbols == {spec.shape.T}
    assert cap.subs(spec.shape.T, 4096) == 3840
    concrete = rdepc.load(path, T=4096)
    assert concrete.spec.shape.T == 4096 and isinstance(concrete.spec.shape.T, sympy.Integer)
    assert concrete.spec.shape.T_bound is None and not concrete.spec.shape.symbolic
    assert concrete.spec.capacity.rows_per_expert(concrete.spec.shape) == 3840
    with pytest.raises(rdepc.SpecError) as info:
        rdepc.load(path, T=9000)
    (d,) = info.value.diagnostics
    assert d.message == "override T=9000 is outside 1..8192, the range 'T' was declared with"
    assert (d.span.line, d.span.col) == (1, 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("T=4096", ("T", 4096)),
        ("T=4_096", ("T", 4096)),
        ("f=1.25", ("f", Fraction(5, 4))),
        ("T=-3", ("T", -3)),
        ("T=1e3", ("T", 1000)),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["T", "=3", "1T=3", "T=", "T=abc", "T=1/0", "T=inf", "T=nan", "T=0x10"])
def test_parse_override_rejects(text):
    with pytest.raises(rdepc.UsageError, match=r"^-D "):
        parse_override(text)
