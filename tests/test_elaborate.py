"""Elaboration: the corpus of malformed specs, and what a checked spec means (ownership,
capacity, route rows, parameters); each statement: tests/test_elaborate_statements.py."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import sympy
from conftest import ROOT
from elaborate_text import errors_of, spec_of, spec_text, where
from rdepc.passes.elaborate import elaborate

from rdepc.diagnostics import Severity, SpecError
from rdepc.ir.exact import Poly
from rdepc.ir.spec import Dtype
from rdepc.parser import parse_file

CORPUS = sorted((ROOT / "tests" / "corpus").glob("*.rdep"))
EXPECT = re.compile(r"# expect(?: (?P<sev>warning|note))?: (?P<line>\d+):(?P<col>\d+): (?P<msg>.+)")


# --------------------------------------------------------------------------- corpus


def _expectation(path: Path):
    text = path.read_text(encoding="utf-8")
    m = EXPECT.match(text)
    assert m, f"{path.name}: the first line must be '# expect: LINE:COL: message'"
    hint = re.search(r"^# hint: (.+)$", text, re.M)
    sev = Severity(m["sev"] or "error")
    return text, sev, int(m["line"]), int(m["col"]), m["msg"], hint[1] if hint else None


def test_corpus_is_large_enough():
    kinds = [_expectation(p)[1] for p in CORPUS]
    assert kinds.count(Severity.ERROR) >= 30
    assert kinds.count(Severity.WARNING) >= 4
    assert kinds.count(Severity.NOTE) >= 1
    messages = [_expectation(p)[4] for p in CORPUS]
    assert len(set(messages)) == len(messages), "two corpus files expect the same message"


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
@pytest.mark.parametrize("use_sympy", [False, True], ids=["check", "sympy"])
def test_corpus(path, use_sympy):
    text, sev, line, col, msg, hint = _expectation(path)
    lines = text.split("\n")
    module = None
    try:
        module = parse_file(path)
        specs, diags = elaborate(module, sympy=use_sympy)
        diags.check()
    except SpecError as e:
        raised, found = True, e.diagnostics
        rendered = str(e)
    else:
        raised, found, rendered = False, diags.items, ""
    # every diagnostic has a real position in this file
    for d in found:
        assert d.span is not None and d.span.file == str(path), d
        assert 1 <= d.span.line <= len(lines), d
        assert 1 <= d.span.col <= len(lines[d.span.line - 1]) + 1, d
    hits = [d for d in found if d.severity is sev and (d.span.line, d.span.col) == (line, col) and msg in d.message]
    assert hits, f"expected {sev.value} {line}:{col}: {msg}\ngot:\n" + "\n".join(
        f"  {d.severity.value} {d.span.line}:{d.span.col}: {d.message}" for d in found
    )
    if hint is not None:
        assert any(d.hint is not None and hint in d.hint for d in hits), [d.hint for d in hits]
    if sev is Severity.ERROR:
        assert raised, "an error must raise SpecError"
        assert f"{path}:{line}:{col}: error: " in rendered
    else:
        assert not raised, f"a {sev.value} must not fail the spec: {rendered}"
        assert len(specs) == 1
        assert not any(d.severity is Severity.ERROR for d in found)


# ---------------------------------------------------------------------- ownership


def test_balanced_ownership_is_eq5_when_w_divides_e():
    spec, _ = spec_of(spec_text())
    own = spec.ownership
    assert own.policy == "balanced"
    assert own.owner == tuple(e // 8 for e in range(64))
    assert own.local == tuple(e % 8 for e in range(64))
    assert own.experts_per_rank(8) == (8,) * 8
    assert own.experts_of(3) == tuple(range(24, 32))


def test_nvl72_ownership_note():
    specs, diags = elaborate(parse_file(ROOT / "examples" / "nvl72_e128.rdep"))
    diags.check()
    (note,) = diags.items
    assert note.severity is Severity.NOTE
    assert note.message.startswith("non-uniform ownership: 56 ranks own 2 experts and 16 own 1 (2x")
    assert (note.span.line, note.span.col) == (16, 3)  # the 'owner' statement
    own = specs[0].ownership
    assert own.experts_per_rank(72) == (2,) * 56 + (1,) * 16
    for q in range(56):
        assert own.experts_of(q) == (2 * q, 2 * q + 1)
    for q in range(56, 72):
        assert own.experts_of(q) == (q + 56,)
    assert own.local == (0, 1) * 56 + (0,) * 16


def test_non_uniform_note_without_owner_statement_points_at_experts():
    _, diags = spec_of(spec_text(experts="12"))
    (note,) = diags.items
    assert note.severity is Severity.NOTE
    assert (note.span.line, note.span.col) == (2, 48)  # shape's 'experts' option
    assert "4 ranks own 2 experts and 4 own 1" in note.message


def test_owner_map_local_index_is_position_within_rank():
    spec, _ = spec_of(spec_text("  owner map { 0: 0..3, 7; 1: 3..7 }", ranks="2", experts="8", top="2"))
    assert spec.ownership.policy == "map"
    assert spec.ownership.owner == (0, 0, 0, 1, 1, 1, 1, 0)
    assert spec.ownership.local == (0, 1, 2, 0, 1, 2, 3, 3)


def test_owner_map_with_line_breaks_and_ranks_given_out_of_order():
    text = spec_text("  owner map {\n    1: 0..4\n    0: 4..8\n  }", ranks="2", experts="8", top="2")
    spec, diags = spec_of(text)
    assert spec.ownership.owner == (1,) * 4 + (0,) * 4
    assert spec.ownership.local == (0, 1, 2, 3) * 2
    assert diags.items == []


def test_idle_ranks_warning_when_experts_fewer_than_ranks():
    spec, diags = spec_of(spec_text(ranks="8", experts="4", top="2"))
    (w,) = diags.items
    assert w.severity is Severity.WARNING and w.message == "ranks 4..8 own no experts"
    assert spec.ownership.owner == (0, 1, 2, 3)


def test_large_ownership_tables_are_linear():
    """Regression: owner-local indices were computed in O(E^2) (about 25 s at E = 65536)."""
    spec, diags = spec_of(spec_text(ranks="1000", experts="65536", top="2"), sympy=False)
    per = spec.ownership.experts_per_rank(1000)
    assert per == (66,) * 536 + (65,) * 464
    local, owner = spec.ownership.local, spec.ownership.owner
    assert all(local[e] == (local[e - 1] + 1 if owner[e] == owner[e - 1] else 0) for e in range(1, 65536))
    text = spec_text("  owner map { 0: 0..65536 }", ranks="2", experts="65536", top="2")
    spec, diags = spec_of(text, sympy=False)
    assert spec.ownership.local == tuple(range(65536))
    assert [d.message for d in diags.items] == ["rank 1 owns no experts"]


def test_owner_map_reports_a_double_assignment_once():
    """Regression: one error per expert (65536 of them) rather than one per map member."""
    text = spec_text("  owner map { 0: 0..65536; 1: 0..65536 }", ranks="2", experts="65536", top="2")
    assert where(errors_of(text, sympy=False)) == [
        (4, 31, "experts 0..65536 are assigned twice (to rank 0 and rank 1)")
    ]


# ---------------------------------------------------------------------- capacity


def test_capacity_rows_per_expert():
    spec, _ = spec_of(spec_text("  capacity factor 1.25"))
    assert spec.capacity.factor == sympy.Rational(5, 4)
    assert spec.capacity.rows_per_expert(spec.shape) == math.ceil(Fraction(5, 4) * 8 * 4096 * 6 / 64) == 3840
    spec, _ = spec_of(spec_text("  capacity factor 1.1", ranks="3", experts="7"))
    assert spec.capacity.rows_per_expert(spec.shape) == math.ceil(Fraction(11, 10) * 3 * 4096 * 6 / 7)
    spec, _ = spec_of(spec_text("  capacity rows 4000"))
    assert spec.capacity.rows_per_expert(spec.shape) == 4000
    spec, _ = spec_of(spec_text("  capacity dropless"))
    assert spec.capacity.rows_per_expert(spec.shape) is None
    spec, _ = spec_of(spec_text())
    assert (spec.capacity.policy, spec.capacity.drop, spec.capacity.weights) == ("dropless", "arrival", "renormalize")


def test_dropless_options_warn():
    _, diags = spec_of(spec_text("  capacity dropless, drop arrival, weights zero"))
    assert [d.message for d in diags.items] == [
        "'drop' has no effect with dropless capacity",
        "'weights' has no effect with dropless capacity",
    ]


def test_symbolic_capacity_rows():
    spec, _ = spec_of(spec_text("  capacity rows T + 1", tokens="T", pre="param T <= 8192\n"))
    T = spec.shape.T
    assert isinstance(T, sympy.Symbol)
    assert spec.capacity.rows_per_expert(spec.shape) == T + 1
    spec, _ = spec_of(spec_text("  capacity factor 1.25", tokens="T", pre="param T <= 8192\n"))
    assert spec.capacity.rows_per_expert(spec.shape) == sympy.ceiling(sympy.Rational(5, 4) * 8 * T * 6 / 64)


@pytest.mark.parametrize(
    ("stmt", "message"),
    [
        ("  capacity rows X * T", "capacity rows must be a number, but it depends on the symbolic parameter X"),
        ("  capacity rows X + T", "capacity rows must be a number, but it depends on the symbolic parameter X"),
        ("  capacity rows X", "capacity rows must be a number, but it depends on the symbolic parameter X"),
        ("  route_row id = (rank * T + token) * 6 + slot + X", "route_row id depends on the symbolic parameter X"),
    ],
)
def test_a_second_symbolic_parameter_is_an_error_not_a_crash(stmt, message):
    """Regression: two bounded parameters in one expression raised ValueError (Poly.extremes)."""
    text = spec_text(stmt, tokens="T", pre="param T <= 64\nparam X <= 8\n")
    for mode in (False, True):
        (d,) = errors_of(text, sympy=mode)
        assert d.message.startswith(message)
        assert d.span.line == 6


def test_symbolic_tokens_must_be_one_parameter():
    (d,) = errors_of(spec_text(tokens="T + X", pre="param T <= 64\nparam X <= 8\n"))
    assert d.message == "tokens must be a number, but it depends on the symbolic parameter T, X"
    (d,) = errors_of(spec_text(tokens="2 * T", pre="param T <= 64\n"))
    assert d.message == "tokens must be a number or a bounded parameter itself"


def test_capacity_rows_cannot_use_a_symbol_the_tokens_are_not():
    (d,) = errors_of(spec_text("  capacity rows T", tokens="16", pre="param T <= 64\n"))
    assert d.message.startswith("capacity rows must be a number, but it depends on the symbolic parameter T")


# ---------------------------------------------------------------------- route rows


def test_eq7_radix():
    spec, _ = spec_of(spec_text())
    rr = spec.route_row
    assert rr.is_eq7
    assert rr.radix == (("slot", 1), ("token", 6), ("rank", 24576))
    assert rr.offset == 0
    assert rr.sideband == ("row_id", "local_expert", "gate")
    assert rr.sideband_bytes == 16
    assert rr.coefficient("rank") == 24576 and rr.coefficient("nothing") == 0


@pytest.mark.parametrize(
    ("formula", "radix", "eq7"),
    [
        ("rank * T * K + token * K + slot", (("slot", 1), ("token", 6), ("rank", 24576)), True),
        ("(slot * W + rank) * T + token", (("token", 1), ("rank", 4096), ("slot", 32768)), False),
        ("(rank * 8192 + token) * K + slot + 5", (("slot", 1), ("token", 6), ("rank", 49152)), False),
    ],
)
def test_other_injective_encodings(formula, radix, eq7):
    spec, _ = spec_of(spec_text(f"  route_row id = {formula}", pre="param W = 8\nparam T = 4096\nparam K = 6\n"))
    assert spec.route_row.radix == radix
    assert spec.route_row.is_eq7 is eq7


def test_rank_need_not_be_distinct_with_one_rank():
    spec, _ = spec_of(spec_text("  route_row id = token * 6 + slot", ranks="1"))
    assert dict(spec.route_row.radix) == {"slot": 1, "token": 6}


def test_route_row_overflow():
    text = spec_text(
        "  route_row id = (rank * 2199023255552 + token) * 8192 + slot", ranks="1024", experts="8192", top="8192"
    )
    (d,) = errors_of(text)
    assert d.message == "route_row ids overflow 64 bits at these sizes"


def test_symbolic_route_row():
    spec, _ = spec_of(spec_text(tokens="T", pre="param T <= 8192\n"))
    T = spec.shape.T
    assert spec.route_row.radix == (("slot", 1), ("token", 6), ("rank", 6 * T))
    assert spec.route_row.is_eq7
    assert spec.shape.symbolic
    # a gap: rows keyed for the bound rather than the actual T
    spec, _ = spec_of(
        spec_text("  route_row id = (rank * 8192 + token) * 6 + slot", tokens="T", pre="param T <= 8192\n")
    )
    assert dict(spec.route_row.radix)["rank"] == 49152
    (d,) = errors_of(
        spec_text("  route_row id = (rank * 4096 + token) * 6 + slot", tokens="T", pre="param T <= 8192\n")
    )
    assert "cannot prove route_row id injective" in d.message


def test_fp8_defaults_to_a_scale_in_the_sideband():
    spec, _ = spec_of(spec_text("  dtype bf16, dispatch fp8_e4m3"))
    assert spec.precision.dispatch is Dtype.FP8_E4M3 and spec.precision.dispatch_scale == "row"
    assert spec.route_row.sideband == ("row_id", "local_expert", "gate", "scale")
    spec, diags = spec_of(spec_text("  sideband gate, row_id, scale"))
    assert spec.route_row.sideband == ("row_id", "gate", "scale")  # stored in canonical order
    assert [d.message for d in diags.items] == ["'scale' is only used with fp8 dispatch; it is carried but unused"]


# ---------------------------------------------------------------------- parameters


def test_parameters_and_overrides():
    pre = "param W = 8\nparam T <= 8192\nparam K = W - 2\n"
    spec, _ = spec_of(spec_text(ranks="W", tokens="T", top="K", pre=pre))
    assert isinstance(spec.shape.T, sympy.Symbol) and spec.shape.T_bound == 8192
    assert spec.shape.K == 6
    params = {p.name: p for p in spec.params}
    assert params["T"].value is None and params["T"].bound == 8192 and not params["T"].overridden
    spec, _ = spec_of(spec_text(ranks="W", tokens="T", top="K", pre=pre), W=4, T=4096)
    assert (spec.shape.W, spec.shape.T, spec.shape.T_bound) == (4, 4096, None)
    assert spec.shape.K == 2  # parameters declared below an overridden one see its new value
    assert {p.name for p in spec.params if p.overridden} == {"W", "T"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"T": 9000}, "override T=9000 is outside 1..8192, the range 'T' was declared with"),
        ({"T": 0}, "override T=0 is outside 1..8192"),
        ({"T": Fraction(1, 2)}, "override T=1/2 is outside 1..8192"),
        ({"W": 10**30}, "override for 'W' is too large (limit 2^62)"),
        ({"Q": 3}, "override for undeclared parameter Q (declared: W, T)"),
    ],
)
def test_bad_overrides(overrides, message):
    text = spec_text(ranks="W", tokens="T", pre="param W = 8\nparam T <= 8192\n")
    errors = errors_of(text, **overrides)
    assert any(message in d.message for d in errors), [d.message for d in errors]
    assert not any("unknown name" in d.message for d in errors)


def test_a_broken_parameter_does_not_cascade():
    """Regression: every use of a parameter whose declaration failed said 'unknown name'."""
    text = spec_text(ranks="W", tokens="T", pre="param W = 1 / 0\nparam T <= 0\n")
    assert where(errors_of(text)) == [
        (1, 15, "division by zero ('/' by 0)"),
        (2, 12, "bound of 'T' must be a positive whole number, got 0"),
    ]
    assert where(errors_of(spec_text(ranks="W", pre="param W = W\n"))) == [(1, 11, "unknown name 'W'")]


def test_expression_arithmetic_is_exact():
    pre = "param A = 7 // 2\nparam B = -7 // 2\nparam C = -7 % 3\nparam D = 1.25 * 4\nparam E = 4096 / 3 * 3\n"
    spec, _ = spec_of(spec_text(ranks="A", hidden="E", top="D", experts="C + 62", tokens="-B", pre=pre))
    assert (spec.shape.W, spec.shape.T, spec.shape.K, spec.shape.E, spec.shape.H) == (3, 4, 5, 64, 4096)


def test_sizes_are_sympy_integers_or_exact_polys():
    spec, _ = spec_of(spec_text())
    assert all(isinstance(getattr(spec.shape, k), sympy.Integer) for k in "WTHEK")
    assert isinstance(spec.expert.F, sympy.Integer)
    spec, _ = spec_of(spec_text(), sympy=False)
    assert all(isinstance(getattr(spec.shape, k), Poly) for k in "WTHEK")
    assert int(spec.shape.H) == 2048
