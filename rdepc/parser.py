"""Text → :class:`rdepc.syntax.Module`, with compiler-style syntax errors.

The parser is lark's LALR(1) with positions on every node. Syntax errors do not stop at
the first one: an unexpected character is reported and blanked out, an unexpected token
is reported and skipped, and parsing goes on, so one run shows every broken line.
"""

from __future__ import annotations

import functools
from pathlib import Path

from lark import Lark, Token, Transformer, Tree, UnexpectedCharacters, UnexpectedToken, v_args

from rdepc import syntax as S
from rdepc.diagnostics import Diagnostics, Span, SpecError
from rdepc.grammar import grammar_text

MAX_SYNTAX_ERRORS = 20
# Deepest syntax tree accepted: lark's tree transformer, and elaboration after it, recurse
# once or twice per level, so a 2 KB line such as '1 + 1 + ... + 1' would otherwise
# exhaust Python's recursion limit. No real spec comes near this.
MAX_DEPTH = 100

# How a terminal is named in an error message.
_TERMINALS = {
    "NAME": "a name",
    "NUMBER": "a number",
    "_NL": "end of line",
    "$END": "end of file",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "COMMA": "','",
    "COLON": "':'",
    "SEMICOLON": "';'",
    "EQUAL": "'='",
    "PLUS": "'+'",
    "MINUS": "'-'",
    "STAR": "'*'",
    "SLASH": "'/'",
    "PERCENT": "'%'",
}


@functools.cache
def _lark() -> Lark:
    # cache=True keeps the LALR tables in a temp file: building them costs more than a check
    return Lark(grammar_text(), parser="lalr", propagate_positions=True, maybe_placeholders=False, cache=True)


def _describe(term: str, parser: Lark) -> str:
    if term in _TERMINALS:
        return _TERMINALS[term]
    pattern = parser.get_terminal(term).pattern if term in parser._terminals_dict else None
    if pattern is not None and pattern.type == "str":
        return f"'{pattern.value}'"
    return term.lower()


def _token_text(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    return f"'{tok}'"


def _span(file: str, meta_or_tok) -> Span:
    m = meta_or_tok
    return Span(file, m.line, m.column, m.end_line, m.end_column)


def _binop(op: str):
    @v_args(meta=True)
    def build(self, meta, items):
        return S.BinOp(op, items[0], items[1], self._s(meta))

    return build


class _Build(Transformer):
    """Turns lark's tree into :mod:`rdepc.syntax` nodes."""

    def __init__(self, file: str):
        super().__init__(visit_tokens=False)
        self.file = file

    def _s(self, x) -> Span:
        return _span(self.file, x)

    def _upto(self, meta, last) -> Span:
        return Span(self.file, meta.line, meta.column, last.span.end_line, last.span.end_col)

    @v_args(meta=True)
    def start(self, meta, items):
        params = tuple(i for i in items if isinstance(i, S.ParamDecl))
        layers = tuple(i for i in items if isinstance(i, S.LayerDecl))
        return params, layers

    @v_args(meta=True)
    def param_value(self, meta, items):
        name, expr = items
        return S.ParamDecl(str(name), self._s(name), expr, None, self._upto(meta, expr))

    @v_args(meta=True)
    def param_bound(self, meta, items):
        name, expr = items
        return S.ParamDecl(str(name), self._s(name), None, expr, self._upto(meta, expr))

    @v_args(meta=True)
    def layer(self, meta, items):
        name, *stmts = items
        return S.LayerDecl(str(name), self._s(name), tuple(stmts), self._s(meta))

    @v_args(meta=True)
    def stmt(self, meta, items):
        kw, *args = items
        # The statement's span ends at its last argument, not at the newline (and any
        # comment) that the grammar ends it with.
        end = args[-1].span if args else self._s(kw)
        span = Span(self.file, kw.line, kw.column, end.end_line, end.end_col)
        return S.Stmt(str(kw), self._s(kw), tuple(args), span)

    @v_args(meta=True)
    def flag(self, meta, items):
        (name,) = items
        return S.Flag(str(name), self._s(name))

    @v_args(meta=True)
    def keyed(self, meta, items):
        name, value = items
        return S.Keyed(str(name), self._s(name), value, self._s(meta))

    @v_args(meta=True)
    def positional(self, meta, items):
        return S.Positional(items[0], self._s(meta))

    @v_args(meta=True)
    def call(self, meta, items):
        fn, *kwargs = items
        return S.Call(str(fn), self._s(fn), tuple(kwargs), self._s(meta))

    @v_args(meta=True)
    def kwarg(self, meta, items):
        name, value = items
        return S.KwArg(str(name), self._s(name), value, self._s(meta))

    @v_args(meta=True)
    def count_call(self, meta, items):
        return S.CountCall(items[0], items[1], self._s(meta))

    @v_args(meta=True)
    def list(self, meta, items):
        return S.ListVal(tuple(items), self._s(meta))

    @v_args(meta=True)
    def map(self, meta, items):
        return S.MapVal(tuple(items), self._s(meta))

    @v_args(meta=True)
    def entry(self, meta, items):
        key, members = items
        return S.MapEntry(key, members, self._s(meta))

    def members(self, items):
        return tuple(items)

    @v_args(meta=True)
    def range(self, meta, items):
        return S.Range(items[0], items[1], self._s(meta))

    add = _binop("+")
    sub = _binop("-")
    mul = _binop("*")
    div = _binop("/")
    floordiv = _binop("//")
    mod = _binop("%")

    @v_args(meta=True)
    def neg(self, meta, items):
        return S.Neg(items[0], self._s(meta))

    @v_args(meta=True)
    def number(self, meta, items):
        return S.Num(str(items[0]), self._s(items[0]))

    @v_args(meta=True)
    def name(self, meta, items):
        return S.Name(str(items[0]), self._s(items[0]))


def parse_text(text: str, file: str = "<string>") -> S.Module:
    """Parse .rdep text; raises :class:`SpecError` with every syntax error found."""
    diags = Diagnostics({file: text})
    if not text.strip():
        diags.error("file is empty: a spec needs at least one 'layer NAME { ... }'", Span(file, 1, 1, 1, 1))
        diags.check()
    if not text.endswith("\n"):
        text += "\n"  # the grammar ends statements with a newline
    parser = _lark()

    # Report the first error of a line, blank out what was wrong (keeping every position)
    # and parse again: one run then shows every broken line, one error each, rather than
    # cascades of one mistake. An unexpected character is blanked alone, so that a stray
    # character in a 'layer NAME {' line does not take the layer's header with it; any
    # further error on a line already reported blanks the whole line, silently.
    work, tree = text, None
    reported: set[int] = set()
    while tree is None and len(diags.errors) < MAX_SYNTAX_ERRORS:
        try:
            tree = parser.parse(work)
            continue
        except UnexpectedCharacters as e:
            line, pos = e.line, e.pos_in_stream
            if line not in reported:
                ch = work[pos]
                shown = repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}"
                diags.error(f"unexpected character {shown}", Span(file, line, e.column, line, e.column + 1))
                new = work if work[pos] == "\n" else work[:pos] + " " + work[pos + 1 :]
            else:
                new = work
        except UnexpectedToken as e:
            if e.token.type == "$END":
                _report_token(diags, parser, e, file)
                break
            line, new = e.token.line, work
            if line not in reported:
                _report_token(diags, parser, e, file)
        reported.add(line)
        if new == work:
            new = _blank_line(work, line)
            if new == work:  # nothing left to blank: give up rather than loop
                break
        work = new
    diags.check()
    deep = _too_deep(tree)
    if deep is not None:
        line, col = getattr(deep, "line", 1), getattr(deep, "column", 1)
        span = Span(file, line, col, getattr(deep, "end_line", line), getattr(deep, "end_column", col + 1))
        diags.error(f"expression nested too deeply (more than {MAX_DEPTH} levels)", span, "split it with parameters")
        diags.check()
    params, layers = _Build(file).transform(tree)
    module = S.Module(file, text, params, layers)
    if not module.layers:
        diags.error("no layer in this file: a spec needs at least one 'layer NAME { ... }'", Span(file, 1, 1, 1, 1))
        diags.check()
    return module


def _too_deep(tree: Tree):
    """The meta of the first node nested deeper than MAX_DEPTH, or None (iteratively)."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return node.meta
        stack.extend((child, depth + 1) for child in reversed(node.children) if isinstance(child, Tree))
    return None


def _blank_line(text: str, line: int) -> str:
    lines = text.split("\n")
    lines[line - 1] = " " * len(lines[line - 1])
    return "\n".join(lines)


def _report_token(diags: Diagnostics, parser: Lark, e: UnexpectedToken, file: str) -> None:
    tok = e.token
    if tok.type == "$END":
        # The end of the last line. Lines are split at '\n' only, as lark counts them
        # (str.splitlines would also split at '\x0c', '\x85', '\u2028', ...).
        lines = diags.sources.get(file, "").split("\n")
        if len(lines) > 1 and lines[-1] == "":
            lines.pop()
        line, col = len(lines), len(lines[-1].rstrip("\r")) + 1
        span = Span(file, line, col, line, col + 1)
    else:
        span = Span(file, tok.line, tok.column, tok.end_line or tok.line, tok.end_column or tok.column + 1)
    expected = sorted({_describe(t, parser) for t in e.expected})
    hint = None
    if "'}'" in expected and tok.type == "$END":
        message = "unexpected end of file: a layer is missing its closing '}'"
    elif tok.type == "_NL" and expected:
        message = "statement ends too early"
        hint = "expected " + " or ".join(expected)
    else:
        message = f"unexpected {_token_text(tok)}"
        if expected:
            hint = "expected " + " or ".join(expected)
        if tok.type == "NAME" and "end of line" in expected:
            hint = "one statement per line; separate arguments with ','"
    diags.error(message, span, hint)


def read_source(path: str | Path) -> tuple[str, str]:
    """Read a spec file; every way it can fail becomes a one-line diagnostic."""
    p = Path(path)
    file = str(path)
    diags = Diagnostics()
    where = Span(file, 1, 1, 1, 1)
    if not p.exists():
        diags.error("no such file", where)
    elif p.is_dir():
        diags.error("is a directory, not a .rdep file", where)
    else:
        try:
            data = p.read_bytes()
        except OSError as e:
            diags.error(f"cannot read: {e.strerror}", where)
        else:
            nul = data.find(b"\0")
            if nul >= 0:
                diags.error(f"not a text file (NUL byte at offset {nul})", where)
            else:
                try:
                    return file, data.decode("utf-8")
                except UnicodeDecodeError as e:
                    diags.error(f"not UTF-8 text (invalid byte at offset {e.start})", where)
    diags.check()
    raise AssertionError("unreachable")


def parse_file(path: str | Path) -> S.Module:
    file, text = read_source(path)
    return parse_text(text, file)


__all__ = ["SpecError", "parse_file", "parse_text", "read_source"]
