"""Compiler-style diagnostics: ``file:line:col: error: message``, the source line, a caret.

Every problem with an input becomes a :class:`Diagnostic`; stages collect them in a
:class:`Diagnostics` and raise :class:`SpecError` once a stage has finished, so one run
reports every error it can find instead of stopping at the first.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """A region of a source file; lines and columns count from 1, ``end_col`` is exclusive."""

    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def to_json(self) -> str:
        return str(self)


class Severity(enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    NOTE = "note"


@dataclass(frozen=True, slots=True)
class Diagnostic:
    severity: Severity
    message: str
    span: Span | None = None
    hint: str | None = None

    def render(self, sources: Mapping[str, str] | None = None, color: bool = False) -> str:
        where = f"{self.span}: " if self.span else "rdepc: "
        sev = self.severity.value
        if color:
            code = {"error": "31", "warning": "35", "note": "36"}[sev]
            sev = f"\x1b[1;{code}m{sev}\x1b[0m"
        lines = [f"{where}{sev}: {self.message}"]
        text = (sources or {}).get(self.span.file) if self.span else None
        if text is not None:
            lines += _excerpt(text, self.span)
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


def _excerpt(text: str, span: Span) -> list[str]:
    # Split at '\n' only, as the parser counts lines (not at '\x0c', '\x85', '\u2028', ...).
    src_lines = [t.removesuffix("\r") for t in text.split("\n")]
    if src_lines[-1] == "":  # the final newline ends the last line; it does not start one
        src_lines.pop()
    if not 1 <= span.line <= len(src_lines):
        return []
    line = src_lines[span.line - 1].expandtabs(1)
    width = span.end_col - span.col if span.end_line == span.line else len(line) - span.col + 1
    width = max(1, min(width, len(line) - span.col + 1))
    gutter = f"{span.line:>5} | "
    return [gutter + line, " " * (len(gutter) - 2) + "| " + " " * (span.col - 1) + "^" + "~" * (width - 1)]


class UsageError(ValueError):
    """A bad request from the caller (not a problem in the spec file itself)."""


class SpecError(Exception):
    """Raised when an input has errors; carries every diagnostic found so far."""

    def __init__(self, diagnostics: Iterable[Diagnostic], sources: Mapping[str, str] | None = None):
        self.diagnostics = tuple(diagnostics)
        self.sources = dict(sources or {})
        super().__init__(self.render())

    def render(self, color: bool = False) -> str:
        return "\n".join(d.render(self.sources, color) for d in self.diagnostics)


class Diagnostics:
    """A collector that stages append to; ``check()`` raises if any error was recorded."""

    def __init__(self, sources: Mapping[str, str] | None = None):
        self.items: list[Diagnostic] = []
        self.sources = dict(sources or {})

    def error(self, message: str, span: Span | None = None, hint: str | None = None) -> None:
        self.items.append(Diagnostic(Severity.ERROR, message, span, hint))

    def warning(self, message: str, span: Span | None = None, hint: str | None = None) -> None:
        self.items.append(Diagnostic(Severity.WARNING, message, span, hint))

    def note(self, message: str, span: Span | None = None, hint: str | None = None) -> None:
        self.items.append(Diagnostic(Severity.NOTE, message, span, hint))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity is Severity.ERROR]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity is not Severity.ERROR]

    def check(self) -> None:
        if self.errors:
            raise SpecError(sorted(self.items, key=_order), self.sources)


def _order(d: Diagnostic) -> tuple:
    return (d.span.file, d.span.line, d.span.col) if d.span else ("", 0, 0)


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """A hint naming the closest choice, or listing them all when none is close."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if choices and len(choices) <= 12:
        return "expected one of: " + ", ".join(f"'{c}'" for c in choices)
    return None


def layer_prefix(layer: str) -> str:
    """How every error raised while a layer is built or run names it: ``rdepc layer NAME``."""
    return f"rdepc layer {layer}"


def owning(ranks: int, what: str | int) -> str:
    """``N ranks own WHAT``, in the singular for one rank."""
    return f"1 rank owns {what}" if ranks == 1 else f"{ranks} ranks own {what}"
