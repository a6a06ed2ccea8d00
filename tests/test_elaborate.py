"""Elaboration: the corpus of malformed specs, and what a checked spec means."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import sympy
from conftest import ROOT
from rdepc.passes.elaborate import elaborate

from rdepc import syntax as S
from rdepc.diagnostics import Diagnostic, Severity, SpecError
from rdepc.ir.exact import Poly
from rdepc.ir.spec import Dtype
from rdepc.parser import parse_file, parse_text

CORPUS = sorted((ROOT / "tests" / "corpus").glob("*.rdep"))
EXPECT = re.compile(r"# expect(?: (?P<sev>warning|note))?: (?P<line>\d+):(?P<col>\d+): (?P<msg>.+)")


def spec_of(text: str, sympy: bool = True, **overrides):
    specs, diags = elaborate(parse_text(text, "t.rdep"), overrides=overrides, sympy=sympy)
    diags.check()
    (spec,) = specs
    return spec, diags


def errors_of(text: str, sympy: bool = True, **overrides) -> list[Diagnostic]:
    with pytest.raises(SpecError) as info:
        spec_of(text, sympy, **overrides)
    return [d for d in info.value.diagnostics if d.severity is Severity.ERROR]


def where(diags) -> list[tuple[int, int, str]]:
    return [(d.span.line, d.span.col, d.message) for d in diags]


def spec_text(*stmts: str, ranks="8", tokens="4096", hidden="2048", experts="64", top="6", pre="") -> str:
    return (
        pre
        + "layer m {\n"
        + f"  shape     ranks {ranks}, tokens {tokens}, hidden {hidden}, experts {experts}, top {top}\n"
        + "  expert    swiglu(ffn = 1408)\n"
        + "".join(s + "\n" for s in stmts)
        + "}\n"
    )


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
    assert ("a route_row encoding other than eq. 7" in dict(spec.features())) is not eq7


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
    assert "symbolic tokens" in dict(spec.features())
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


# ------------------------------------------------------------------- statements


def test_defaults():
    spec, diags = spec_of(spec_text())
    assert diags.items == []
    assert spec.shared is None
    assert (spec.precision.dtype, spec.precision.dispatch, spec.precision.dispatch_scale) == (Dtype.BF16,) * 2 + (None,)
    assert spec.model.moe_layers == 1
    assert spec.segment is None
    assert (spec.schedule, spec.transport, spec.dedup) == ("auto", "emulated", False)
    assert spec.features() == ()


@pytest.mark.parametrize(
    ("arg", "dedup"), [("", False), (", dedup", True), (", dedup on", True), (", dedup off", False)]
)
def test_transport_dedup_forms(arg, dedup):
    """Regression: 'dedup' is both a flag and an option; both forms were rejected."""
    spec, _ = spec_of(spec_text(f"  transport nvshmem{arg}"))
    assert (spec.transport, spec.dedup) == ("nvshmem", dedup)
    assert ("dedup of rows a token sends to one rank" in dict(spec.features())) is dedup


def test_every_statement():
    text = spec_text(
        "  shared    2 x gelu(ffn = 512)",
        "  dtype     fp16, dispatch fp8_e4m3, scale row",
        "  model     moe_layers 27, layers 30, dense_layers 3, dense_ffn 8192, vocab 1000",
        "  route_row id = (rank * 4096 + token) * 6 + slot",
        "  sideband  row_id, local_expert, gate, scale",
        "  owner     balanced",
        "  capacity  factor 2, drop lowest_gate, weights zero",
        "  segment   rows 1024, buffers 4, cut expert",
        "  schedule  deep",
        "  transport emulated",
    )
    spec, diags = spec_of(text)
    assert diags.items == []
    assert (spec.shared.count, spec.shared.fn.act, spec.shared.fn.F, spec.shared.fn.gated) == (2, "gelu", 512, False)
    assert (spec.precision.dtype, spec.precision.dispatch) == (Dtype.FP16, Dtype.FP8_E4M3)
    assert (spec.model.moe_layers, spec.model.layers, spec.model.dense_layers) == (27, 30, 3)
    assert (spec.model.dense_ffn, spec.model.vocab) == (8192, 1000)
    assert (spec.capacity.policy, spec.capacity.factor, spec.capacity.drop) == ("factor", 2, "lowest_gate")
    assert spec.capacity.weights == "zero"
    assert (spec.segment.rows, spec.segment.buffers, spec.segment.cut) == (1024, 4, "expert")
    assert dict(spec.features()) == {
        "fp8 dispatch": "dtype.dispatch",
        "drop lowest_gate": "capacity.drop",
        "shared experts": "shared",
    }
    # spans: an option's own span, else its statement's, else the layer's name
    assert (spec.span_of("capacity.drop").line, spec.span_of("capacity.drop").col) == (10, 23)
    assert spec.span_of("segment.nothing") == spec.span_of("segment")
    assert spec.span_of("no.such") == spec.span


BULK_HINT = (
    "drop the segment statement, or use 'schedule pipelined' (a segmented --schedule on the command line still uses it)"
)


@pytest.mark.parametrize("use_sympy", [False, True], ids=["check", "sympy"])
@pytest.mark.parametrize(
    ("stmts", "pre", "S"),
    [
        # dropless: the busiest owner's worst case, W·T·min(K, E_loc) = 8·4096·min(6, 8)
        ((), "", "196608"),
        # a binding capacity caps it, E_loc·cap_e = 8·100; the segment is not below it under bulk
        (("  capacity  rows 100",), "", "800"),
        (("  capacity  factor 1.25",), "", "30720"),  # 8·ceil(1.25·8·4096·6/64)
        ((), "param T <= 8192\n", "393216 with T at its bound"),
    ],
)
def test_bulk_ignores_the_segment_statement(stmts, pre, S, use_sympy):
    """Bulk runs each owner's rows as one segment sized for its worst case
    (passes.graph.geometry): the segment statement's S and B are said to be unused."""
    tokens = "T" if pre else "4096"
    text = spec_text(*stmts, "  segment   rows 4096, buffers 2", "  schedule  bulk", tokens=tokens, pre=pre)
    spec, diags = spec_of(text, use_sympy)
    (w,) = diags.items
    line = 4 + len(stmts) + (1 if pre else 0)
    assert (w.severity, w.span.line, w.span.col) == (Severity.WARNING, line, 3)
    assert w.message == (
        f"schedule bulk ignores the segment statement: each owner's rows move as one segment (S = {S}, B = 1), "
        "not in 4096-row segments through 2 buffers"
    )
    assert w.hint == BULK_HINT
    if use_sympy:  # the S it names is the one the graph builds
        from rdepc.passes.graph import geometry

        geo = geometry(spec, "bulk")
        assert (geo.S, geo.B, max(geo.segments)) == (int(S.split()[0]), 1, 1)


@pytest.mark.parametrize(
    "stmts",
    [
        ("  segment   rows 4096, buffers 2",),  # auto
        ("  segment   rows 4096, buffers 2", "  schedule  pipelined"),
        ("  segment   rows 4096, buffers 3", "  schedule  deep"),
        ("  schedule  bulk",),
    ],
)
def test_segment_statement_used_no_warning(stmts):
    _, diags = spec_of(spec_text(*stmts))
    assert diags.items == []


@pytest.mark.parametrize(
    ("stmt", "message"),
    [
        ("  dtype bf16, fp16", "'dtype' names more than one compute dtype"),
        ("  dtype bf16, scale row", "a dispatch scale is only used with fp8 dispatch"),
        ("  dtype bf16, dispatch int8", "dispatch dtype must be one of bf16, fp16, fp32, fp8_e4m3; got int8"),
        ("  model layers 3", "'model' needs moe_layers"),
        ("  model moe_layers 5, layers 3", "moe_layers 5 is more than the model's 3 layers"),
        ("  shared 65 x swiglu(ffn = 8)", "shared expert count = 65 is beyond what rdepc supports (64)"),
        ("  shared", "'shared' needs the shared experts"),
        ("  expert swiglu(ffn = 8)", "duplicate 'expert' statement"),
        ("  owner", "'owner' needs one of: balanced, map { ... }"),
        ("  owner map 3", "owner map needs { rank: experts; ... }"),
        ("  capacity", "'capacity' needs one of: dropless, factor F, rows N"),
        (
            "  capacity dropless, drop random",
            "drop policy must be one of round_robin, arrival, lowest_gate; got random",
        ),
        ("  capacity factor [1]", "capacity factor must be a number or an integer expression"),
        ("  segment rows 64, buffers 65", "segment buffers = 65 is beyond what rdepc supports (64)"),
        ("  segment rows 64, cut diagonal", "cut must be one of auto, expert, source; got diagonal"),
        ("  schedule", "'schedule' needs one of: auto, bulk, pipelined, deep"),
        ("  schedule bulk, deep", "'schedule' needs one of: auto, bulk, pipelined, deep"),
        ("  transport emulated, nvshmem", "'transport' needs one of: emulated, nvshmem"),
        ("  route_row slot", "'route_row' needs id = ..."),
        ("  route_row id = swiglu(ffn = 3)", "route_row id must be an integer expression"),
        ("  sideband row_id, size", "unknown option 'size' in 'sideband'"),
        ("  capacity rows 4, rows 5", "'rows' given twice in 'capacity'"),
        ("  capacity factor", "'factor' in 'capacity' needs a value"),
        ("  capacity dropless 3", "'dropless' in 'capacity' takes no value"),
        ("  segment rows 64, [1]", "unexpected argument to 'segment'"),
        ("  activations", "'activations' needs a policy for the pre-activations or the input rows"),
        ("  activations input maybe", "activations input must be one of keep, resend; got maybe"),
        ("  activations pre maybe", "activations pre must be one of keep, recompute; got maybe"),
        ("  activations x recompute", "unknown option 'x' in 'activations'"),
    ],
)
def test_statement_errors(stmt, message):
    errors = errors_of(spec_text(stmt))
    assert any(d.message == message for d in errors), [d.message for d in errors]
    assert all(d.span.line == 4 for d in errors)


def test_expert_function_errors():
    def msgs(call):
        return [d.message for d in errors_of(spec_text().replace("swiglu(ffn = 1408)", call))]

    assert msgs("swiglu()") == ["swiglu needs its ffn width"]
    assert msgs("swiglu(ffn = 8, ffn = 9)") == ["'ffn' given twice to swiglu"]
    assert msgs("relu(width = 8)") == ["relu needs its ffn width", "unknown argument 'width' to relu"]
    assert msgs("[8]") == ["'expert' needs the expert function"]
    assert msgs("swiglu(ffn = 8), [8]") == ["unexpected argument to 'expert'"]
    assert msgs("ffn 8") == ["'expert' needs the expert function", "unknown option 'ffn' in 'expert'"]
    assert msgs("swiglu(ffn = 1408.5)") == ["expert ffn width must be a whole number, got 2817/2"]
    assert msgs("swiglu(ffn = 8, limit = 7)") == ["unknown argument 'limit' to swiglu"]
    assert msgs("clamped_swiglu(ffn = 8, limit = 0)") == ["clamped_swiglu limit must be a positive number, got 0"]
    assert msgs("clamped_swiglu(ffn = 8, alpha = -1)") == ["clamped_swiglu alpha must be a positive number, got -1"]
    assert msgs("clamped_swiglu(ffn = 8, limit = 1, limit = 2)") == ["'limit' given twice to clamped_swiglu"]
    assert msgs("clamp_swiglu(ffn = 8)") == ["unknown expert function 'clamp_swiglu'"]


def test_clamped_swiglu_takes_its_numbers_or_gpt_oss_defaults():
    def expert(call):
        specs, diags = elaborate(parse_text(spec_text().replace("swiglu(ffn = 1408)", call)))
        assert not diags.errors, [d.message for d in diags.errors]
        return specs[0].expert

    e = expert("clamped_swiglu(ffn = 64, limit = 6.5, alpha = 1.5)")
    assert (e.act, e.F, e.limit, e.alpha, e.gated, e.matrices) == ("clamped_swiglu", 64, 6.5, 1.5, True, 3)
    e = expert("clamped_swiglu(ffn = 64)")
    assert (float(e.limit), float(e.alpha)) == (7.0, 1.702)
    assert expert("swiglu(ffn = 64)").limit is None and not expert("swiglu(ffn = 64)").bias
    assert expert("clamped_swiglu(ffn = 64), bias").bias and expert("relu(ffn = 64), bias").bias
    errors = errors_of(spec_text().replace("swiglu(ffn = 1408)", "swiglu(ffn = 8), biases"))
    assert [(d.message, d.hint) for d in errors] == [("unknown option 'biases' in 'expert'", "did you mean 'bias'?")]


def test_layer_selection_and_duplicates():
    text = spec_text().replace("layer m", "layer a") + spec_text().replace("layer m", "layer b")
    module = parse_text(text)
    specs, diags = elaborate(module)
    assert [s.name for s in specs] == ["a", "b"] and not diags.errors
    specs, _ = elaborate(module, layer="b")
    assert [s.name for s in specs] == ["b"]
    text = spec_text() + spec_text()
    specs, diags = elaborate(parse_text(text))
    assert where(diags.errors) == [(5, 7, "duplicate layer 'm'")]
    assert diags.errors[0].hint == "first defined at <string>:1:7"


def test_errors_of_every_layer_are_reported():
    text = spec_text("  schedule fast").replace("layer m", "layer a") + spec_text("  capacity factr 2").replace(
        "layer m", "layer b"
    )
    errors = errors_of(text)
    assert [(d.span.line, d.message) for d in errors if d.message.startswith("unknown option")] == [
        (4, "unknown option 'fast' in 'schedule'"),
        (9, "unknown option 'factr' in 'capacity'"),
    ]


def test_no_exact_duplicate_diagnostics():
    text = spec_text("  owner map { 0: 0..40, 39; 1: 32..64, 7 }", ranks="2")
    errors = errors_of(text)
    assert len({(d.span, d.message) for d in errors}) == len(errors) == 3


def test_check_mode_never_imports_sympy_objects():
    spec, _ = spec_of(spec_text("  capacity factor 1.25"), sympy=False)
    assert isinstance(spec.capacity.factor, Poly)
    assert spec.capacity.factor.value == Fraction(5, 4)


def test_syntax_tree_is_not_changed_by_elaboration():
    module = parse_text(spec_text("  capacity factor 1.25"))
    before = repr(module)
    elaborate(module)
    elaborate(module, sympy=False)
    assert repr(module) == before
    assert isinstance(module.layers[0].stmts[0], S.Stmt)


@pytest.mark.parametrize(
    ("literal", "message"),
    [
        ("1" * 5000, "number too large (limit 2^62)"),
        ("0." + "1" * 5000, "number has too many digits"),
        ("4611686018427387905", "number too large (limit 2^62)"),
    ],
)
def test_long_literals_are_a_diagnostic(literal, message):
    """Regression: Fraction() of a literal over 4300 digits raised ValueError."""
    assert where(errors_of(spec_text(pre=f"param X = {literal}\n"))) == [(1, 11, message)]


def test_literal_limits_are_exact():
    spec, _ = spec_of(spec_text(pre="param X = 4611686018427387904\nparam Y = 0000000000000000000000001\n"))
    assert {p.name: p.value for p in spec.params} == {"X": 2**62, "Y": 1}


def test_pre_activations_are_kept_unless_recomputed_and_fp8_rows_refuse_recompute():
    specs, diags = elaborate(parse_text(spec_text()))
    assert specs[0].pre_activations == "keep"
    specs, diags = elaborate(parse_text(spec_text("  activations pre recompute")))
    assert not diags.errors and specs[0].pre_activations == "recompute"
    errors = errors_of(spec_text("  dtype bf16, dispatch fp8_e4m3, scale row", "  activations pre recompute"))
    assert [(d.message.split(":")[0], d.span.line, d.span.col) for d in errors] == [
        ("recomputed pre-activations need the rows GEMM1 read", 5, 19)
    ]


def test_input_rows_are_kept_unless_resent_and_neither_fp8_nor_dedup_resends():
    specs, _ = elaborate(parse_text(spec_text()))
    assert specs[0].input_activations == "keep"
    specs, diags = elaborate(parse_text(spec_text("  activations pre recompute, input resend")))
    assert not diags.errors and (specs[0].pre_activations, specs[0].input_activations) == ("recompute", "resend")
    errors = errors_of(spec_text("  dtype bf16, dispatch fp8_e4m3", "  activations input resend"))
    assert [(d.message.split(":")[0], d.span.line, d.span.col) for d in errors] == [
        ("re-sent input rows must be the rows GEMM1 read", 5, 21)
    ]
    dedup = ("  sideband  row_id, local_expert, gate", "  transport emulated, dedup", "  activations input resend")
    assert [(d.message.split(",")[0], d.span.line) for d in errors_of(spec_text(*dedup))] == [
        ("re-sent input rows go one per route row", 6)
    ]


def test_the_gate_on_the_input_refuses_dedup_and_renormalised_drops_at_their_statements():
    def where_(*stmts):
        text = spec_text(*stmts).replace("swiglu(ffn = 1408)", "swiglu(ffn = 1408), gate input")
        return [(d.message.split(" ")[0], d.span.line, d.span.col) for d in errors_of(text)]

    specs, diags = elaborate(parse_text(spec_text().replace("1408)", "1408), gate input")))
    assert not diags.errors and specs[0].gate_on == "input"
    assert where_("  sideband  row_id, local_expert, gate", "  transport emulated, dedup") == [("dedup", 5, 23)]
    assert where_("  capacity  factor 1.25") == [("with", 4, 3)]
    for ok in ("  capacity  factor 1.25, weights zero", "  capacity  dropless"):
        specs, diags = elaborate(parse_text(spec_text(ok).replace("1408)", "1408), gate input")))
        assert not diags.errors and specs[0].gate_on == "input", ok


def test_the_backward_transport_is_the_compute_dtype_or_fp8_and_not_with_dedup():
    specs, _ = elaborate(parse_text(spec_text("  dtype bf16, backward fp8_e4m3")))
    assert specs[0].precision.backward_fp8 and specs[0].precision.dispatch is Dtype.BF16
    specs, _ = elaborate(parse_text(spec_text("  dtype bf16, backward bf16")))
    assert specs[0].precision.backward is None  # the compute dtype: nothing changes
    assert where(errors_of(spec_text("  dtype bf16, backward fp16"))) == [
        (4, 24, "backward transport dtype must be one of bf16, fp8_e4m3; got fp16")
    ]
    dedup = ("  dtype bf16, backward fp8_e4m3", "  sideband row_id, local_expert, gate", "  transport emulated, dedup")
    assert [(d.message.split(":")[0], d.span.line) for d in errors_of(spec_text(*dedup))] == [
        ("an fp8 backward transport is not implemented with dedup", 4)
    ]
