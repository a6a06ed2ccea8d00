"""``rdepc plan --probs FILE``: per-expert selection probabilities, parsed with a diagnostic
at each bad entry."""

from __future__ import annotations

import json
import re

from rdepc.diagnostics import Diagnostics, Span


def parse_probs(text: str, file: str, experts: int) -> tuple[float, ...]:
    """``--probs FILE``: E probabilities p_e in [0, 1], one per expert in expert order, either
    as numbers separated by commas or whitespace ('#' starts a comment that runs to the end of
    the line), or as a JSON array of numbers (a file whose first non-blank character is '[').
    Raises SpecError with a diagnostic at each bad entry; a JSON syntax error at the line and
    column ``json`` reports. Nothing in the file is evaluated."""
    diags = Diagnostics({file: text})
    entries = _json_entries(text, file, diags) if text.lstrip().startswith("[") else _plain_entries(text, file)
    out: list[float] = []
    for tok, span, v in entries:
        if v is None or isinstance(v, bool) or not isinstance(v, int | float):
            diags.error(f"'{tok}' is not a number", span)
        elif not 0 <= v <= 1:  # NaN too; an int compares without a float conversion that may overflow
            diags.error(f"probability {tok} is outside [0, 1]", span)
        else:
            out.append(float(v))
    if not diags.errors and len(out) != experts:
        diags.error(
            f"expected {experts} probabilities (one per expert), found {len(out)}",
            Span(file, 1, 1, 1, 1),
        )
    diags.check()
    return tuple(out)


_PROB = re.compile(r"[^\s,]+")
_JSON_BLANK = re.compile(r"[ \t\n\r]*")  # json's whitespace, no more


def _plain_entries(text: str, file: str) -> list[tuple[str, Span, object]]:
    """(token, span, value or None) per entry of the plain format."""
    entries: list[tuple[str, Span, object]] = []
    for ln, line in enumerate(text.split("\n"), 1):  # lines as diagnostics count them
        for m in _PROB.finditer(line.split("#", 1)[0]):
            try:
                v: object = float(m.group())
            except ValueError:
                v = None
            entries.append((m.group(), Span(file, ln, m.start() + 1, ln, m.end() + 1), v))
    return entries


def _json_entries(text: str, file: str, diags: Diagnostics) -> list[tuple[str, Span, object]]:
    """(token, span, value) per element of a JSON array; a syntax error becomes one diagnostic."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        diags.error(f"invalid JSON: {e.msg}", Span(file, e.lineno, e.colno, e.lineno, e.colno + 1))
        return []
    # Well-formed: walk the array once more, element by element, for each one's position.
    decoder = json.JSONDecoder()
    entries: list[tuple[str, Span, object]] = []
    i = _JSON_BLANK.match(text, _JSON_BLANK.match(text).end() + 1).end()  # past '['
    while text[i] != "]":
        v, end = decoder.raw_decode(text, i)
        tok = {list: "[...]", dict: "{...}"}.get(type(v), text[i:end])  # one line, whatever the element spans
        entries.append((tok, _span_of(text, file, i, end), v))
        i = _JSON_BLANK.match(text, end).end()
        if text[i] == ",":
            i = _JSON_BLANK.match(text, i + 1).end()
    return entries


def _span_of(text: str, file: str, start: int, end: int) -> Span:
    """The span of ``text[start:end]``, lines and columns counted from 1 as json counts them."""

    def at(pos: int) -> tuple[int, int]:
        return text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)

    return Span(file, *at(start), *at(end))
