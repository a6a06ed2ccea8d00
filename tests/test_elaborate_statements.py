"""Elaboration of each statement: defaults, every statement and option, the segment under
each schedule, statement and expert-function errors, layer selection, literal limits and what
each backward option refuses; the corpus, ownership, capacity, route rows and parameters:
tests/test_elaborate.py."""

from __future__ import annotations

from fractions import Fraction

import pytest
from elaborate_text import errors_of, spec_of, spec_text, where
from rdepc.passes.elaborate import elaborate

from rdepc import syntax as S
from rdepc.diagnostics import Severity
from rdepc.ir.exact import Poly
from rdepc.ir.spec import Dtype
from rdepc.parser import parse_text

# ------------------------------------------------------------------- statements


def test_defaults():
    spec, diags = spec_of(spec_text())
    assert diags.items == []
    assert spec.shared is None
    assert (spec.precision.dtype, spec.precision.dispatch, spec.precision.dispatch_scale) == (Dtype.BF16,) * 2 + (None,)
    assert spec.model.moe_layers == 1
    assert spec.segment is None
    assert (spec.schedule, spec.transport, spec.dedup) == ("auto", "emulated", False)


@pytest.mark.parametrize(
    ("arg", "dedup"), [("", False), (", dedup", True), (", dedup on", True), (", dedup off", False)]
)
def test_transport_dedup_forms(arg, dedup):
    """Regression: 'dedup' is both a flag and an option; both forms were rejected."""
    spec, _ = spec_of(spec_text(f"  transport nvshmem{arg}"))
    assert (spec.transport, spec.dedup) == ("nvshmem", dedup)


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
