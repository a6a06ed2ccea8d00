"""Specs as text and what elaborating them gives, for tests/test_elaborate*.py."""

from __future__ import annotations

import pytest
from rdepc.passes.elaborate import elaborate

from rdepc.diagnostics import Diagnostic, Severity, SpecError
from rdepc.parser import parse_text


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
