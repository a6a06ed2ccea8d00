"""The parser: syntax tree shape, spans, error recovery, reading files, diagnostics."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import EXAMPLES

from rdepc import syntax as S
from rdepc.diagnostics import Diagnostic, Diagnostics, Severity, Span, SpecError, did_you_mean
from rdepc.parser import MAX_SYNTAX_ERRORS, parse_file, parse_text, read_source

SHAPE = "  shape ranks 8, tokens 4096, hidden 2048, experts 64, top 6\n"
EXPERT = "  expert swiglu(ffn = 1408)\n"


def layer(*stmts: str, name: str = "m") -> str:
    return f"layer {name} {{\n" + SHAPE + EXPERT + "".join(s + "\n" for s in stmts) + "}\n"


def errors_of(text: str, file: str = "t.rdep") -> list[Diagnostic]:
    with pytest.raises(SpecError) as info:
        parse_text(text, file)
    return list(info.value.diagnostics)


def where(diags: list[Diagnostic]) -> list[tuple[int, int, str]]:
    return [(d.span.line, d.span.col, d.message) for d in diags]


def text_at(text: str, span: Span) -> str:
    """The source text a single-line span covers."""
    assert span.line == span.end_line, span
    return text.split("\n")[span.line - 1][span.col - 1 : span.end_col - 1]


def nodes(x):
    """Every syntax node under x (dataclass instances), depth first."""
    if dataclasses.is_dataclass(x) and not isinstance(x, Span):
        yield x
        for f in dataclasses.fields(x):
            yield from nodes(getattr(x, f.name))
    elif isinstance(x, tuple):
        for v in x:
            yield from nodes(v)


def stmt(module: S.Module, keyword: str) -> S.Stmt:
    (st,) = [s for s in module.layers[0].stmts if s.keyword == keyword]
    return st


# ----------------------------------------------------------------------- the tree


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_parse_with_exact_spans(example):
    text = example.read_text(encoding="utf-8")
    module = parse_file(example)
    assert module.file == str(example)
    assert module.text == text
    assert module.layer_names == (example.stem,)
    # H and F (the DeepSeeks, Qwen3, GPT-OSS and Ernie also E; Qwen2-MoE, Qwen3-Next, Llama-4 and HunYuan their
    # shared FS) narrow a layer to a CPU-sized run (tests/test_examples.py)
    narrowable = {
        "tiny": [],
        "tiny_balance": [],
        "deepseek_v3": ["E", "H", "F"],
        "deepseek_v2": ["E", "H", "F"],
        "qwen2_moe": ["E", "H", "F", "FS"],
        "gpt_oss_120b": ["E", "H", "F"],
        "qwen3_next_80b_a3b": ["E", "H", "F", "FS"],
        "llama4_scout": ["E", "H", "F", "FS"],
        "ernie45_21b_a3b": ["E", "H", "F"],
        "hunyuan_a13b": ["E", "H", "F", "FS"],
        "qwen3_30b_a3b": ["E", "H", "F"],
    }.get(example.stem, ["H", "F"])
    assert [p.name for p in module.params] == ["W", "T", "K", "L", *narrowable]
    count = 0
    for n in nodes(module):
        match n:
            case S.Name(id=i, span=sp) | S.Flag(name=i, span=sp):
                assert text_at(text, sp) == i
            case S.Num(text=t, span=sp):
                assert text_at(text, sp) == t
            case S.Keyed(name=i, name_span=sp) | S.KwArg(name=i, name_span=sp) | S.Stmt(keyword=i, keyword_span=sp):
                assert text_at(text, sp) == i
            case S.Call(fn=i, fn_span=sp):
                assert text_at(text, sp) == i
            case S.LayerDecl(name=i, name_span=sp) | S.ParamDecl(name=i, name_span=sp):
                assert text_at(text, sp) == i
        count += 1
    assert count > 40


def test_statement_span_stops_at_its_last_argument():
    text = layer("  capacity  factor 1.25, drop arrival   # a comment")
    st = stmt(parse_text(text), "capacity")
    assert text_at(text, st.span) == "capacity  factor 1.25, drop arrival"


def test_argument_forms():
    text = layer(
        "  shared    2 x swiglu(ffn = 1408)",
        "  route_row id = (rank * 4096 + token) * 6 + slot",
        "  capacity  factor = 1.25, dropless",
        "  owner     map { 0: 0..4, 9; 1: 4..8 }",
        "  model     moe_layers [1, 2,]",
    )
    m = parse_text(text)
    (shared,) = stmt(m, "shared").args
    assert isinstance(shared, S.Positional) and isinstance(shared.value, S.CountCall)
    assert shared.value.count == S.Num("2", shared.value.count.span)
    assert shared.value.call.fn == "swiglu" and shared.value.call.kwargs[0].name == "ffn"
    factor, dropless = stmt(m, "capacity").args
    assert isinstance(factor, S.Keyed) and factor.name == "factor" and factor.value.text == "1.25"
    assert isinstance(dropless, S.Flag) and dropless.name == "dropless"
    (owner,) = stmt(m, "owner").args
    assert isinstance(owner.value, S.MapVal)
    e0, e1 = owner.value.entries
    assert e0.key.text == "0" and isinstance(e0.members[0], S.Range) and e0.members[1].text == "9"
    assert (e0.members[0].lo.text, e0.members[0].hi.text) == ("0", "4")
    assert e1.key.text == "1"
    (lst,) = stmt(m, "model").args
    assert isinstance(lst.value, S.ListVal) and [i.text for i in lst.value.items] == ["1", "2"]


def test_the_router_and_shared_options_are_ordinary_arguments():
    text = layer(
        "  shared    2 x swiglu(ffn = 16), gate sigmoid",
        "  router    softmax, logit_bias, groups 8, top_groups 3, group_score max",
    )
    m = parse_text(text)
    count, gate = stmt(m, "shared").args
    assert isinstance(count.value, S.CountCall)
    assert isinstance(gate, S.Keyed) and gate.name == "gate" and gate.value.id == "sigmoid"
    assert text_at(text, gate.span) == "gate sigmoid"
    args = stmt(m, "router").args
    assert [type(a).__name__ for a in args] == ["Flag", "Flag", "Keyed", "Keyed", "Keyed"]
    assert (args[1].name, args[4].name, args[4].value.id) == ("logit_bias", "group_score", "max")


def test_keyed_with_and_without_equals_is_the_same():
    a = stmt(parse_text(layer("  segment rows 4096")), "segment").args[0]
    b = stmt(parse_text(layer("  segment rows = 4096")), "segment").args[0]
    assert isinstance(a, S.Keyed) and isinstance(b, S.Keyed)
    assert (a.name, a.value.text) == (b.name, b.value.text) == ("rows", "4096")


@pytest.mark.parametrize(
    ("expr", "tree"),
    [
        ("1 + 2 * (3 - 4) // 5 % 6 - -7", "((1 + (((2 * (3 - 4)) // 5) % 6)) - -7)"),
        ("10 - 3 - 2", "((10 - 3) - 2)"),
        ("2 * 3 + 4 * 5", "((2 * 3) + (4 * 5))"),
        ("-(W + 1) * 2", "(-(W + 1) * 2)"),
        ("1_024 / 3", "(1_024 / 3)"),
        ("--2", "--2"),
    ],
)
def test_expression_precedence_and_associativity(expr, tree):
    m = parse_text(f"param X = {expr}\n" + layer())
    assert S.unparse(m.params[0].value) == tree


def test_bounded_param():
    m = parse_text("param T <= 8192\n" + layer())
    (p,) = m.params
    assert p.value is None and p.bound.text == "8192"


def test_line_continuation_and_multiline_maps():
    text = (
        "layer m {\n"
        "  shape ranks 8, tokens 4096, \\\n"
        "        hidden 2048, experts 8, top 2\n"
        "  expert swiglu(ffn = 1408)\n"
        "  owner map {\n"
        "    0: 0..4\n"
        "    # a comment between entries\n"
        "    1: 4..8\n"
        "  }\n"
        "}\n"
    )
    m = parse_text(text)
    shape = stmt(m, "shape")
    assert [a.name for a in shape.args] == ["ranks", "tokens", "hidden", "experts", "top"]
    hidden = shape.args[2]
    assert (hidden.name_span.line, hidden.name_span.col) == (3, 9)
    assert shape.span.end_line == 3
    entries = stmt(m, "owner").args[0].value.entries
    assert [e.key.span.line for e in entries] == [6, 8]


def test_crlf_and_lf_give_the_same_tree():
    lf = EXAMPLES[0].read_text(encoding="utf-8")
    a, b = parse_text(lf, "f"), parse_text(lf.replace("\n", "\r\n"), "f")
    assert a.params == b.params
    assert a.layers == b.layers


def test_comments_blank_lines_and_no_final_newline():
    text = "\n\n# leading comment\n\n" + layer().rstrip("\n") + "   # trailing"
    m = parse_text(text)
    assert m.layer_names == ("m",)
    assert m.layers[0].name_span.line == 5


def test_several_layers_and_params_in_any_order():
    text = layer(name="a") + "param W = 8\n" + layer(name="b")
    m = parse_text(text)
    assert m.layer_names == ("a", "b")
    assert [p.name for p in m.params] == ["W"]


def test_user_text_is_never_evaluated():
    m = parse_text("param X = __import__\n" + layer())
    assert m.params[0].value == S.Name("__import__", m.params[0].value.span)


# ------------------------------------------------------------------ syntax errors


def test_missing_closing_brace_points_at_end_of_last_line():
    text = "layer m {\n" + SHAPE + EXPERT
    assert where(errors_of(text)) == [(3, 28, "unexpected end of file: a layer is missing its closing '}'")]


@pytest.mark.parametrize("sep", ["\u2028", "\x85", "\x0c", "\x1c"])
def test_lines_are_counted_at_newlines_only(sep):
    """Regression: str.splitlines() also splits at U+2028, U+0085, form feed... which
    made the end-of-file error point past the last line and excerpts show the wrong line."""
    text = f"# a{sep}b\nlayer m {{\n  shape ranks 8\n"
    (d,) = errors_of(text)
    assert (d.span.line, d.span.col) == (3, 16)
    text = f"# a{sep}b\nlayer m {{\n  shape ranks 8 $\n}}\n"
    (d,) = errors_of(text)
    assert (d.span.line, d.span.col) == (3, 17)
    assert "    3 |   shape ranks 8 $\n" in d.render(errors_source(text))


def errors_source(text: str) -> dict[str, str]:
    return {"t.rdep": text}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (layer("  capacity factor 1.25 $"), [(4, 24, "unexpected character '$'")]),
        (layer("  capacity factor\x001"), [(4, 18, "unexpected character U+0000")]),
        (layer("  segment\u200b rows 4096"), [(4, 10, "unexpected character U+200B")]),
        ("layer mé {\n" + SHAPE + EXPERT + "}\n", [(1, 8, "unexpected character 'é'")]),
        ("layer m {\n  shape ranks 8 tokens 4096\n}\n", [(2, 17, "unexpected 'tokens'")]),
        ("layer m {\n  expert swiglu(ffn = 1408\n}\n", [(2, 27, "statement ends too early")]),
        ("param W = 2 ** 3\n" + layer(), [(1, 14, "unexpected '*'")]),
        ("layer m { shape ranks 1 }\n", [(1, 25, "unexpected '}'")]),
        ("layer\n", [(1, 6, "statement ends too early")]),
        ("param\n", [(1, 6, "statement ends too early")]),
        ("\ufefflayer m {\n" + SHAPE + EXPERT + "}\n", [(1, 1, "unexpected character U+FEFF")]),
    ],
)
def test_syntax_errors(text, expected):
    assert where(errors_of(text)) == expected


def test_syntax_error_hints():
    (d,) = errors_of("layer m {\n  shape ranks 8 tokens 4096\n}\n")
    assert d.hint == "one statement per line; separate arguments with ','"
    (d,) = errors_of("layer m {\n  expert swiglu(ffn = 1408\n}\n")
    assert d.hint == "expected ')' or ','"
    (d,) = errors_of("layer m {\n  shape ranks 8,\n}\n")
    assert d.message == "statement ends too early"
    assert "a name" in d.hint


def test_one_error_per_broken_line():
    text = "layer m {\n  shape ranks 8 $ $ 9 9\n  expert swiglu(ffn = 1408\n  owner map { 0 1 }\n  segment rows 4\n}\n"
    assert [(line, msg) for line, _, msg in where(errors_of(text))] == [
        (2, "unexpected character '$'"),
        (3, "statement ends too early"),
        (4, "unexpected '1'"),
    ]


def test_syntax_errors_are_capped():
    text = "layer m {\n" + "  shape $\n" * (MAX_SYNTAX_ERRORS + 10) + "}\n"
    diags = errors_of(text)
    assert len(diags) == MAX_SYNTAX_ERRORS
    assert [d.span.line for d in diags] == list(range(2, MAX_SYNTAX_ERRORS + 2))


def test_a_long_line_of_garbage_is_quick_and_reported_once():
    diags = errors_of("$" * 20000 + "\n" + layer())
    assert where(diags) == [(1, 1, "unexpected character '$'")]


@pytest.mark.parametrize("text", ["", "   \n\t\n", "\n"])
def test_empty_file(text):
    assert where(errors_of(text)) == [(1, 1, "file is empty: a spec needs at least one 'layer NAME { ... }'")]


def test_file_without_layers():
    msg = "no layer in this file: a spec needs at least one 'layer NAME { ... }'"
    assert where(errors_of("# just a comment\nparam W = 8\n")) == [(1, 1, msg)]


# --------------------------------------------------------------------- read_source


def test_read_source_failures(tmp_path):
    def one(path) -> str:
        with pytest.raises(SpecError) as info:
            read_source(path)
        (d,) = info.value.diagnostics
        assert d.severity is Severity.ERROR and (d.span.line, d.span.col) == (1, 1)
        assert str(info.value).count("\n") == 0  # a one-line message, no excerpt
        return d.message

    assert one(tmp_path / "missing.rdep") == "no such file"
    assert one(tmp_path) == "is a directory, not a .rdep file"
    (tmp_path / "nul.rdep").write_bytes(b"layer m {\x00}\n")
    assert one(tmp_path / "nul.rdep") == "not a text file (NUL byte at offset 9)"
    (tmp_path / "latin1.rdep").write_bytes("# caf\xe9\n".encode("latin-1"))
    assert one(tmp_path / "latin1.rdep") == "not UTF-8 text (invalid byte at offset 5)"
    (tmp_path / "ok.rdep").write_text(layer(), encoding="utf-8")
    assert read_source(tmp_path / "ok.rdep") == (str(tmp_path / "ok.rdep"), layer())


# --------------------------------------------------------------------- diagnostics


def test_render_excerpt_caret_and_hint():
    text = "layer m {\n\tcapacity  factr 1.25\n}\n"
    d = Diagnostic(Severity.ERROR, "unknown option 'factr'", Span("t.rdep", 2, 12, 2, 17), "did you mean 'factor'?")
    assert d.render({"t.rdep": text}) == (
        "t.rdep:2:12: error: unknown option 'factr'\n"
        "    2 |  capacity  factr 1.25\n"
        "      |            ^~~~~\n"
        "  hint: did you mean 'factor'?"
    )
    coloured = d.render({"t.rdep": text}, color=True)
    assert "\x1b[1;31merror\x1b[0m" in coloured
    assert Diagnostic(Severity.NOTE, "n").render() == "rdepc: note: n"
    # a span past the text, or a file without source, renders the header only
    assert d.render({}) == "t.rdep:2:12: error: unknown option 'factr'\n  hint: did you mean 'factor'?"
    far = Diagnostic(Severity.WARNING, "w", Span("t.rdep", 99, 1, 99, 2))
    assert far.render({"t.rdep": text}) == "t.rdep:99:1: warning: w"


def test_multiline_span_caret_runs_to_end_of_line():
    text = "abc def\nxyz\n"
    d = Diagnostic(Severity.ERROR, "m", Span("f", 1, 5, 2, 2))
    assert d.render({"f": text}).splitlines()[-1] == "      |     ^~~"


def test_spec_error_sorts_by_position_and_renders_all():
    diags = Diagnostics({"f": "a\nb\nc\n"})
    diags.error("third", Span("f", 3, 1, 3, 2))
    diags.warning("first", Span("f", 1, 1, 1, 2))
    diags.error("second", Span("f", 2, 1, 2, 2))
    with pytest.raises(SpecError) as info:
        diags.check()
    assert [d.message for d in info.value.diagnostics] == ["first", "second", "third"]
    assert str(info.value) == info.value.render()
    assert str(info.value).startswith("f:1:1: warning: first\n")
    assert [d.message for d in diags.warnings] == ["first"]
    Diagnostics().check()  # nothing recorded: no raise


def test_did_you_mean():
    assert did_you_mean("factr", ["factor", "rows", "drop"]) == "did you mean 'factor'?"
    assert did_you_mean("zzz", ["b", "a"]) == "expected one of: 'a', 'b'"
    assert did_you_mean("zzz", [f"opt{i}" for i in range(20)]) is None
    assert did_you_mean("zzz", []) is None


@pytest.mark.parametrize(
    ("expr", "col"),
    [("1 + " * 5000 + "1", 11), ("-" * 5000 + "1", 109), ("1 + (" * 5000 + "1" + ")" * 5000, 496)],
    ids=["left", "unary", "right"],
)
def test_deep_expressions_are_a_diagnostic_not_a_recursion_error(expr, col):
    """Regression: '1 + 1 + ... + 1' (500 terms, a 2 KB line) raised RecursionError."""
    assert where(errors_of(f"param X = {expr}\n" + layer())) == [
        (1, col, "expression nested too deeply (more than 100 levels)")
    ]


def test_moderately_deep_expressions_are_fine():
    m = parse_text("param X = " + "1 + " * 80 + "(" * 80 + "1" + ")" * 80 + "\n" + layer())
    assert S.unparse(m.params[0].value).count("+") == 80
