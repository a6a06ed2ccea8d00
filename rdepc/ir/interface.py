"""Parts of the interface between a generated kernel and its host side, each declared once.

:data:`STATS` is the statistics buffer's columns (``stats`` [W, ST_COLS] int32, one row per
owner), in order. From it come the ``ST_*`` constants the emitter writes into every kernel
file, the buffer's shape in the lowering's private buffers, and the offsets the runtime's
statistics reader indexes: a column added here reaches all three.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """One statistics column: its constant is ``ST_<NAME>``; ``per_expert`` columns take
    E_MAX places (one per local expert), the others one."""

    name: str
    per_expert: bool
    doc: str


STATS = (
    Column("arrived", True, "rows arrived per local expert"),
    Column("admitted", True, "rows admitted per local expert"),
    Column("mtiles", False, "m-tiles the grouped GEMM ran"),
    Column("cap", False, "the capacity cap_e the scan applied"),
    Column("sent", False, "payload rows this rank dispatched with their data"),
    Column("returned", False, "rows it returned with their data"),
)


def stats_columns(E_MAX: int) -> dict[str, int]:
    """Each column's first place in a row of ``stats``, by name, and ``cols``: the row's length."""
    at, places = {}, 0
    for c in STATS:
        at[c.name] = places
        places += E_MAX if c.per_expert else 1
    return at | {"cols": places}


def stats_constants(E_MAX: int) -> list[tuple[str, int, str]]:
    """The ``ST_*`` constants a kernel file holds: (name, value, comment), ``ST_COLS`` last."""
    at, last = stats_columns(E_MAX), len(STATS) - 1
    lead = "stats [W, ST_COLS]: "
    named = [
        (f"ST_{c.name.upper()}", at[c.name], (lead if i == 0 else "") + c.doc + ("," if i < last else ""))
        for i, c in enumerate(STATS)
    ]
    return [*named, ("ST_COLS", at["cols"], "")]


__all__ = ["STATS", "Column", "stats_columns", "stats_constants"]
