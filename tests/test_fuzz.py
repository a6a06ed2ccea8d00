"""Property tests: whatever the input, the front end answers with a spec or with
diagnostics at real positions, never with any other exception.

(a) programs generated from the grammar itself (hypothesis.extra.lark), (b) mutations
of the examples, (c) statements generated with the right keywords and options but
random values, which reach deeper into elaboration than (a) and (b).
"""

from __future__ import annotations

import json
import re

import lark
from conftest import EXAMPLES
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark
from rdepc.grammar import grammar_text
from rdepc.passes.elaborate import elaborate

from rdepc.diagnostics import SpecError
from rdepc.ir.spec import spec_to_json
from rdepc.parser import parse_text

FILE = "gen.rdep"
TEXTS = [p.read_text(encoding="utf-8") for p in EXAMPLES]


def check_oracle(text: str) -> None:
    """Elaborates, or raises SpecError whose diagnostics all point into ``text``."""
    lines = text.split("\n")  # lines as the parser counts them: split at '\n' only

    def in_text(diagnostics) -> None:
        for d in diagnostics:
            assert d.span is not None, d
            assert d.span.file == FILE, d
            assert 1 <= d.span.line <= len(lines), (d, len(lines))
            assert 1 <= d.span.col <= len(lines[d.span.line - 1]) + 1, (d, lines[d.span.line - 1])
            d.render({FILE: text})  # rendering never fails either

    try:
        module = parse_text(text, FILE)
    except SpecError as e:
        assert e.diagnostics
        in_text(e.diagnostics)
        return
    for use_sympy in (False, True):
        specs, diags = elaborate(module, sympy=use_sympy)
        in_text(diags.items)
        try:
            diags.check()
        except SpecError as e:
            assert e.diagnostics and any(d.severity.value == "error" for d in e.diagnostics)
            continue
        assert len(specs) == len(module.layers)
        if use_sympy:
            for spec in specs:
                json.dumps(spec_to_json(spec))


# ------------------------------------------------------------ (a) from the grammar

WORDS = [
    "W", "T", "K", "L", "X", "E", "m", "shape", "expert", "shared", "dtype", "model", "route_row", "sideband",
    "owner", "capacity", "segment", "schedule", "transport", "ranks", "tokens", "hidden", "experts", "top",
    "swiglu", "gelu", "ffn", "factor", "rows", "drop", "weights", "dropless", "buffers", "map", "balanced",
    "id", "rank", "token", "slot", "bf16", "fp8_e4m3", "dispatch", "scale", "row_id", "gate", "pipelined",
    "nvshmem", "dedup", "moe_layers", "lowest_gate", "arrival", "zero",
]  # fmt: skip
NUMBERS = ["0", "1", "2", "3", "4", "6", "8", "16", "64", "4096", "1.25", "0.5", "1_0", "4611686018427387905"]


def _grammar_strategy():
    parser = lark.Lark(grammar_text(), parser="lalr", start="start")
    # Explicit strategies for every terminal: generating from the terminals' regexes is
    # slow, and tokens come out glued together ("paramW=0"); spaces around each token
    # keep them apart, so that most generated programs lex as intended.
    explicit = {
        t.name: st.just(f" {t.pattern.value} ") for t in parser.terminals if t.pattern.type == "str"
    }  # keywords and punctuation
    explicit |= {
        "NAME": st.one_of(st.sampled_from(WORDS), st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,3}", fullmatch=True)).map(
            lambda s: f" {s} "
        ),
        "NUMBER": st.one_of(st.sampled_from(NUMBERS), st.from_regex(r"[0-9]{1,3}", fullmatch=True)).map(
            lambda s: f" {s} "
        ),
        "_NL": st.sampled_from(["\n", "\n\n", "\n  # comment\n", "\r\n"]),
        "COMMENT": st.just(""),  # a comment here would swallow the rest of its line; _NL has some
        "__IGNORE_0": st.sampled_from([" ", "\t", "\x0c"]),
        "__IGNORE_1": st.sampled_from(["\\\n", "\\ \r\n"]),
    }
    names = {t.name for t in parser.terminals}
    return from_lark(parser, start="start", explicit={k: v for k, v in explicit.items() if k in names})


@settings(max_examples=150)
@given(_grammar_strategy())
def test_programs_from_the_grammar(text):
    check_oracle(text)


# ------------------------------------------------------------ (b) mutations

ODD = ["é", "∑", "\u200b", "\x00", "\ufeff", "\u2028", "\x85", "\x0c", "\r", "\t", "\\", "\\\n", "$", "#", "\n", ""]
PUNCT = ["{", "}", "(", ")", "[", "]", ",", ";", ":", "..", "=", "<=", "x", "-", "//", "%", "*"]
BIG = [
    str(10**30),
    str(2**63),
    str(2**62),
    str(2**62 + 1),
    "-1",
    "0",
    "0.5",
    "1.5",
    "2048/3",
    "1_000_000",
    "7",
    "1" * 5000,
    "0." + "1" * 5000,
    "1 + " * 600 + "1",
    "-" * 600 + "1",
]


@st.composite
def mutated(draw) -> str:
    text = draw(st.sampled_from(TEXTS))
    for _ in range(draw(st.integers(1, 3))):
        if not text:
            break
        op = draw(st.sampled_from(["delete", "insert", "number", "truncate", "dup_line", "swap", "del_line"]))
        a = draw(st.integers(0, len(text) - 1))
        if op == "delete":
            text = text[:a] + text[a + draw(st.integers(1, 20)) :]
        elif op == "insert":
            text = text[:a] + draw(st.sampled_from(ODD + PUNCT + BIG)) + text[a:]
        elif op == "truncate":
            text = text[:a]
        elif op in ("dup_line", "del_line"):
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            lines[i : i + 1] = [lines[i]] * (2 if op == "dup_line" else 0)
            text = "\n".join(lines)
        elif op == "number":
            numbers = list(re.finditer(r"[0-9][0-9_.]*", text))
            if numbers:
                m = draw(st.sampled_from(numbers))
                text = text[: m.start()] + draw(st.sampled_from(BIG)) + text[m.end() :]
        else:  # swap two tokens
            tokens = list(re.finditer(r"[^\s,]+", text))
            if len(tokens) >= 2:
                i, j = sorted(draw(st.lists(st.integers(0, len(tokens) - 1), min_size=2, max_size=2, unique=True)))
                x, y = tokens[i], tokens[j]
                text = text[: x.start()] + y[0] + text[x.end() : y.start()] + x[0] + text[y.end() :]
    return text


@settings(max_examples=800)
@given(mutated())
def test_mutated_examples(text):
    check_oracle(text)


# ------------------------------------------------------------ (c) statements


def _value():
    numbers = st.sampled_from(["0", "1", "2", "3", "8", "64", "1.25", "0.5", "-1", "4611686018427387904"])
    atom = st.one_of(numbers, st.sampled_from(["W", "T", "K", "X"]))  # as many names as numbers
    return st.recursive(
        atom,
        lambda inner: st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%"]), inner).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        max_leaves=3,
    )


ROUTES = [
    "(rank * T + token) * K + slot",
    "rank * T * K + token * K + slot",
    "(slot * W + rank) * T + token",
    "(rank * {v} + token) * K + slot",
    "((rank * T + token) * K + slot) * {v}",
    "(rank * T + token) * K + slot + {v}",
    "rank + token + slot",
    "rank * token",
    "{v} * rank + {v} * token + slot",
]


@st.composite
def statement(draw, keyword: str) -> str:
    v = _value()
    match keyword:
        case "shared":
            return f"shared {draw(v)} x {draw(st.sampled_from(['swiglu', 'gelu', 'relu']))}(ffn = {draw(v)})"
        case "dtype":
            parts = [draw(st.sampled_from(["bf16", "fp16", "fp32", "fp8_e4m3"]))]
            if draw(st.booleans()):
                parts.append("dispatch " + draw(st.sampled_from(["bf16", "fp8_e4m3", "fp32"])))
            if draw(st.booleans()):
                parts.append("scale row")
            return "dtype " + ", ".join(parts)
        case "model":
            keys = draw(st.lists(st.sampled_from(["layers", "dense_layers", "dense_ffn", "vocab"]), unique=True))
            return "model " + ", ".join([f"moe_layers {draw(v)}"] + [f"{k} {draw(v)}" for k in keys])
        case "route_row":
            return "route_row id = " + draw(st.sampled_from(ROUTES)).replace("{v}", draw(v))
        case "sideband":
            fields = draw(
                st.lists(st.sampled_from(["row_id", "local_expert", "gate", "scale"]), min_size=1, unique=True)
            )
            return "sideband " + ", ".join(fields)
        case "owner":
            if draw(st.booleans()):
                return "owner balanced"
            entries = []
            for q in range(draw(st.integers(1, 4))):
                lo = draw(st.integers(0, 9))
                members = [f"{lo}..{lo + draw(st.integers(0, 6))}"]
                if draw(st.booleans()):
                    members.append(str(draw(st.integers(0, 12))))
                entries.append(f"{draw(st.sampled_from([str(q), str(q), draw(v)]))}: {', '.join(members)}")
            return "owner map { " + "; ".join(entries) + " }"
        case "capacity":
            policy = draw(st.sampled_from(["dropless", f"factor {draw(v)}", f"rows {draw(v)}", "factor 1, rows 2"]))
            extra = draw(st.lists(st.sampled_from(["drop arrival", "drop lowest_gate", "weights zero"]), max_size=2))
            return "capacity " + ", ".join([policy, *extra])
        case "segment":
            parts = [f"rows {draw(v)}"]
            if draw(st.booleans()):
                parts.append(f"buffers {draw(v)}")
            if draw(st.booleans()):
                parts.append("cut " + draw(st.sampled_from(["auto", "expert"])))
            return "segment " + ", ".join(parts)
        case "schedule":
            return "schedule " + draw(st.sampled_from(["auto", "bulk", "pipelined", "deep"]))
        case "transport":
            return (
                "transport "
                + draw(st.sampled_from(["emulated", "nvshmem"]))
                + draw(st.sampled_from(["", ", dedup", ", dedup on", ", dedup off"]))
            )
    raise AssertionError(keyword)


@st.composite
def layer_specs(draw) -> str:
    v = _value()
    pre = f"param W = {draw(st.sampled_from(['1', '2', '3', '4', '8']))}\n"
    pre += draw(st.sampled_from(["param T = 16\n", "param T <= 64\n", "param T <= 8192\n"]))
    pre += f"param K = {draw(st.sampled_from(['1', '2', '6']))}\n"
    pre += draw(st.sampled_from(["", "param X <= 8\n", "param X <= 8\n", "param X = 4\n"]))
    shape = "shape ranks W, tokens T, hidden 64, experts 8, top K"
    if draw(st.booleans()):
        shape = f"shape ranks {draw(v)}, tokens {draw(st.sampled_from(['T', 'X', '16']))}, hidden {draw(v)}, "
        shape += f"experts {draw(v)}, top {draw(v)}"
    body = [shape, f"expert {draw(st.sampled_from(['swiglu', 'gelu']))}(ffn = {draw(v)})"]
    optional = ["shared", "dtype", "model", "route_row", "sideband", "owner", "capacity", "segment", "schedule"]
    for kw in draw(st.lists(st.sampled_from([*optional, "transport"]), unique=True, max_size=6)):
        body.append(draw(statement(kw)))
    body = draw(st.permutations(body))
    return pre + "layer g {\n" + "".join(f"  {s}\n" for s in body) + "}\n"


@settings(max_examples=300)
@given(layer_specs())
def test_generated_statements(text):
    check_oracle(text)


@st.composite
def symbolic_specs(draw) -> str:
    """Layers whose sizes, capacity and route rows mix two bounded parameters."""
    atom = st.sampled_from(["T", "X", "1", "2", "6", "64"])
    e = st.recursive(
        atom, lambda inner: st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(" ".join), max_leaves=3
    )
    tokens = draw(st.sampled_from(["T", "X", "16", draw(e)]))
    body = [f"shape ranks 4, tokens {tokens}, hidden 64, experts 8, top 2", "expert swiglu(ffn = 64)"]
    route = draw(
        st.sampled_from(
            [
                "(rank * {} + token) * 2 + slot",
                "((rank * T + token) * 2 + slot) * {}",
                "(rank * T + token) * 2 + slot + {}",
                "{} * rank + {} * token + slot",
            ]
        )
    )
    body.append("route_row id = " + route.format(draw(e), draw(e)))
    body.append(f"capacity rows {draw(e)}")
    if draw(st.booleans()):
        body.append(f"segment rows {draw(e)}")
    body = draw(st.permutations(body))
    pre = draw(st.sampled_from(["param T <= 64\n", "param T <= 8192\n"])) + "param X <= 8\n"
    return pre + "layer s {\n" + "".join(f"  {s}\n" for s in body) + "}\n"


@settings(max_examples=200)
@given(symbolic_specs())
def test_symbolic_parameters(text):
    check_oracle(text)


def test_oracle_rejects_what_it_should():
    """The oracle itself: a spec with an error raises inside it only as SpecError."""
    check_oracle(TEXTS[0])
    check_oracle("layer m {\n  shape ranks 8 $\n}\n")
    check_oracle("")
