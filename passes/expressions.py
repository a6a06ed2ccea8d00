"""Parameters and expressions of a .rdep file, evaluated exactly: every value an exact
:class:`rdepc.ir.exact.Poly` built from the syntax tree (never from text), each problem a
diagnostic."""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

from rdepc import syntax as S
from rdepc.diagnostics import Diagnostics, Span, did_you_mean
from rdepc.ir.exact import Poly
from rdepc.ir.spec import ROUTE_VARS, Param

MAX_VALUE = 2**62  # beyond this a number is almost certainly a typo


def parameters(
    module: S.Module, overrides: dict, diags: Diagnostics
) -> tuple[dict[str, Poly | None], tuple[Param, ...]]:
    # A parameter whose declaration has an error maps to None: its uses fail silently
    # instead of each reporting a misleading "unknown name".
    env: dict[str, Poly | None] = {}
    out: list[Param] = []
    where: dict[str, Span] = {}
    for p in module.params:
        if p.name in where:
            diags.error(f"duplicate parameter '{p.name}'", p.name_span, f"first declared at {where[p.name]}")
            continue
        if p.name in ROUTE_VARS:
            diags.error(f"'{p.name}' is reserved for route_row expressions", p.name_span)
            continue
        if p.name == "x":  # '2 x swiglu(...)' makes x a keyword where a value may follow
            diags.error("'x' is reserved (it counts shared experts: '2 x swiglu(...)')", p.name_span)
            continue
        where[p.name] = p.name_span
        given = overrides.pop(p.name, None)
        if given is not None and abs(given) > MAX_VALUE:
            diags.error(f"override for '{p.name}' is too large (limit 2^62)", p.span)
            env[p.name] = None
            continue
        if p.bound is not None:
            bound = evaluate(p.bound, env, diags)
            if bound is None or not bound.is_whole or bound.value < 1:
                if bound is not None:
                    diags.error(f"bound of '{p.name}' must be a positive whole number, got {bound}", p.bound.span)
                env[p.name] = None
                continue
            if given is None:
                env[p.name] = Poly.var(p.name)
                out.append(Param(p.name, None, bound, False, p.span))
                continue
            value = Poly.const(given)
            if not value.is_whole or not 1 <= value.value <= bound.value:
                diags.error(
                    f"override {p.name}={value} is outside 1..{bound}, the range '{p.name}' was declared with",
                    p.span,
                )
                env[p.name] = None
                continue
            env[p.name] = value
            out.append(Param(p.name, value, bound, True, p.span))
            continue
        value = evaluate(p.value, env, diags)
        if value is None:
            env[p.name] = None
            continue
        if given is not None:
            value = Poly.const(given)
        env[p.name] = value
        out.append(Param(p.name, value, None, given is not None, p.span))
    if overrides:
        names = ", ".join(sorted(overrides))
        declared = ", ".join(p.name for p in module.params) or "none"
        diags.error(f"override for undeclared parameter {names} (declared: {declared})", Span(module.file, 1, 1, 1, 1))
    return env, tuple(out)


# ---------------------------------------------------------------------- expressions


def evaluate(e: S.Expr, env: Mapping[str, Poly | None], diags: Diagnostics) -> Poly | None:
    """The exact value of an expression node; None (and a diagnostic) on error."""
    match e:
        case S.Num(text=text):
            digits = text.replace("_", "")
            mantissa = digits.lower().partition("e")[0]
            if len(mantissa.partition(".")[0].lstrip("0")) > 19:  # > 2^62; and int() refuses > 4300 digits
                diags.error("number too large (limit 2^62)", e.span)
                return None
            try:
                f = Fraction(digits)
            except ValueError:  # thousands of decimal digits: beyond Python's int-conversion limit
                diags.error("number has too many digits", e.span)
                return None
            if abs(f) > MAX_VALUE:
                diags.error("number too large (limit 2^62)", e.span)
                return None
            return Poly.const(f)
        case S.Name(id=name):
            if name in env:
                return env[name]
            hint = did_you_mean(name, env)
            diags.error(f"unknown name '{name}'", e.span, hint)
            return None
        case S.Neg(operand=o):
            v = evaluate(o, env, diags)
            return None if v is None else -v
        case S.BinOp(op=op, lhs=lhs, rhs=rhs):
            a, b = evaluate(lhs, env, diags), evaluate(rhs, env, diags)
            if a is None or b is None:
                return None
            if op in ("/", "//", "%"):
                if not b.is_const:
                    diags.error(f"'{op}' by the symbolic {b} is not supported; divide by a number", rhs.span)
                    return None
                if b.value == 0:
                    diags.error(f"division by zero ('{op}' by {S.unparse(rhs)})", rhs.span)
                    return None
            if op in ("//", "%") and not a.is_const:
                diags.error(f"'{op}' of the symbolic {a} is not supported", lhs.span)
                return None
            if op == "*" and a.degree + b.degree > 2:
                diags.error("expressions in a bounded parameter may be at most quadratic", e.span)
                return None
            value = {
                "+": lambda: a + b,
                "-": lambda: a - b,
                "*": lambda: a * b,
                "/": lambda: a.scale(1 / b.value),
                "//": lambda: Poly.const(math.floor(a.value / b.value)),
                "%": lambda: Poly.const(a.value % b.value),
            }[op]()
            if any(abs(c) > MAX_VALUE for _, c in value.terms):
                diags.error("value too large (limit 2^62)", e.span)
                return None
            return value
    raise TypeError(e)  # pragma: no cover - the parser builds no other node
