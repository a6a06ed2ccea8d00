"""The syntax tree of a .rdep file: what was written, with a span on every node.

Nothing here knows what a keyword means; :mod:`rdepc.passes.elaborate` gives the tree
its meaning. Expressions stay unevaluated so that elaboration can build sympy objects
from them directly (user text is never passed to ``eval`` or ``sympify``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rdepc.diagnostics import Span


@dataclass(frozen=True, slots=True)
class Num:
    text: str
    span: Span


@dataclass(frozen=True, slots=True)
class Name:
    id: str
    span: Span


@dataclass(frozen=True, slots=True)
class BinOp:
    op: str  # one of + - * / // %
    lhs: Expr
    rhs: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Neg:
    operand: Expr
    span: Span


Expr = Num | Name | BinOp | Neg


@dataclass(frozen=True, slots=True)
class KwArg:
    name: str
    name_span: Span
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Call:
    fn: str
    fn_span: Span
    kwargs: tuple[KwArg, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class CountCall:
    count: Expr
    call: Call
    span: Span


@dataclass(frozen=True, slots=True)
class ListVal:
    items: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Range:
    lo: Expr
    hi: Expr  # exclusive, as Python's range
    span: Span


@dataclass(frozen=True, slots=True)
class MapEntry:
    key: Expr
    members: tuple[Expr | Range, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class MapVal:
    entries: tuple[MapEntry, ...]
    span: Span


Value = Expr | Call | CountCall | ListVal | MapVal


@dataclass(frozen=True, slots=True)
class Flag:
    name: str
    span: Span


@dataclass(frozen=True, slots=True)
class Keyed:
    name: str
    name_span: Span
    value: Value
    span: Span


@dataclass(frozen=True, slots=True)
class Positional:
    value: Value
    span: Span


Arg = Flag | Keyed | Positional


@dataclass(frozen=True, slots=True)
class Stmt:
    keyword: str
    keyword_span: Span
    args: tuple[Arg, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class ParamDecl:
    name: str
    name_span: Span
    value: Expr | None  # ``param N = expr``
    bound: Expr | None  # ``param N <= expr``: symbolic, bounded above
    span: Span


@dataclass(frozen=True, slots=True)
class LayerDecl:
    name: str
    name_span: Span
    stmts: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Module:
    file: str
    text: str
    params: tuple[ParamDecl, ...]
    layers: tuple[LayerDecl, ...]

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The layers' names, each once: a name defined twice is one layer the user can ask
        for (elaboration reports the duplicate), not two to choose between."""
        return tuple(dict.fromkeys(layer.name for layer in self.layers))


def unparse(e: Expr) -> str:
    """Print an expression back as the user would have written it (fully bracketed)."""
    match e:
        case Num(text=t):
            return t
        case Name(id=i):
            return i
        case Neg(operand=o):
            return f"-{unparse(o)}"
        case BinOp(op=op, lhs=lhs, rhs=rhs):
            return f"({unparse(lhs)} {op} {unparse(rhs)})"
    raise TypeError(e)
