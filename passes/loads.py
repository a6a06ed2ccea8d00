"""Loads: what one routing puts in each task of a graph, at the level of row counts: the
expected routing, the owners' admission under capacity, the cut of every owner's admitted
rows into segments, and the rows each task then moves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rdepc.ir import sizes
from rdepc.ir.graph import Geometry, TaskGraph


@dataclass(frozen=True, slots=True)
class Load:
    """Rows each task moves under one routing (count level): ``sent[(r, q, s)]`` rows from
    source r in segment s of owner q; ``experts[(q, s)]`` rows per local expert."""

    admitted: tuple[tuple[int, ...], ...]  # [source][expert]
    sent: dict
    experts: dict

    def seg_rows(self, q: int, s: int) -> int:
        return sum(self.experts.get((q, s), {}).values())

    def m_tiles(self, q: int, s: int) -> int:
        return sizes.m_tiles(self.experts.get((q, s), {}).values())


def expected_counts(geo: Geometry) -> list[list[int]]:
    """The expected routing as whole rows: each source spreads its T·K rows over the E
    experts as evenly as possible (uniform routing's mean, eq. 9), the remainders rotated
    so that every expert gets the same total up to one row per source."""
    W, E, TK = geo.W, geo.E, geo.T * geo.K
    base, extra = divmod(TK, E)
    out = []
    for r in range(W):
        row = [base] * E
        for j in range(extra):
            row[(r * extra + j) % E] += 1
        out.append(row)
    return out


def admit(geo: Geometry, counts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Rows per (source, expert) an owner admits, from counts alone. ``drop round_robin``
    admits by token index first, so with each source's rows spread over its tokens every
    source keeps the same fraction cap_e / arrived (largest remainders, ties to the lower
    rank, round the shares to rows); otherwise capacity in source order (drop arrival with
    eq. 7's row_id, whose most significant digit is the rank; lowest_gate needs the gates)."""
    if geo.cap_e is None:
        return [list(row) for row in counts]
    if geo.drop == "round_robin":
        return _admit_shares(geo.cap_e, counts)
    left = [geo.cap_e] * geo.E
    out = []
    for row in counts:
        a = [min(c, left[e]) for e, c in enumerate(row)]
        for e, x in enumerate(a):
            left[e] -= x
        out.append(a)
    return out


def _admit_shares(cap: int, counts: Sequence[Sequence[int]]) -> list[list[int]]:
    out = [list(row) for row in counts]
    for e in range(len(counts[0]) if counts else 0):
        arrived = sum(row[e] for row in counts)
        if arrived <= cap:
            continue
        share = [row[e] * cap // arrived for row in counts]
        order = sorted(range(len(counts)), key=lambda r: (-(counts[r][e] * cap % arrived), r))
        for r in order[: cap - sum(share)]:
            share[r] += 1
        for r, a in enumerate(share):
            out[r][e] = a
    return out


def receive_runs(geo: Geometry, q: int) -> list[tuple[int, int]]:
    """(source, expert) runs in owner q's receive order: by (local expert, source) when
    cut by expert; by (source, local expert) when cut by source. Sources are taken in
    rotated order, q first, so that in any one step the owners wait on different sources
    (no incast onto one source's link)."""
    mine = sorted((geo.local[e], e) for e in range(geo.E) if geo.owner[e] == q)
    W = geo.W
    if geo.cut == "expert":
        return [((q + k) % W, e) for _, e in mine for k in range(W)]
    return [((q + k) % W, e) for k in range(W) for _, e in mine]


def segment_load(geo: Geometry, admitted: Sequence[Sequence[int]]) -> Load:
    """Cut every owner's admitted rows, in receive order, into segments of S rows."""
    S = geo.S
    sent: dict[tuple[int, int, int], int] = {}
    experts: dict[tuple[int, int], dict[int, int]] = {}
    for q in range(geo.W):
        pos = 0
        for r, e in receive_runs(geo, q):
            n = admitted[r][e]
            lam = geo.local[e]
            while n > 0:
                s = pos // S
                take = min(n, (s + 1) * S - pos)
                sent[(r, q, s)] = sent.get((r, q, s), 0) + take
                d = experts.setdefault((q, s), {})
                d[lam] = d.get(lam, 0) + take
                pos += take
                n -= take
    return Load(tuple(tuple(a) for a in admitted), sent, experts)


def task_rows(tg: TaskGraph, load: Load) -> list[int]:
    """Rows each task moves under ``load``."""
    geo = tg.geometry
    rows = []
    for t in tg.tasks:
        match t.stage:
            case "dispatch":
                n = load.sent.get((t.src, t.owner, t.segment), 0)
            case "return":
                n = load.sent.get((t.src, t.owner, t.segment), 0)
            case "compute":
                n = load.seg_rows(t.owner, t.segment)
            case "combine" if t.detail == "unpack":
                n = load.sent.get((t.src, t.owner, t.segment), 0)
            case "route":
                n = geo.T * geo.K
            case "combine" if t.detail == "tile":
                n = t.rows
            case _:
                n = 0
        rows.append(n)
    return rows


def mtiles_bound_ok(geo: Geometry, load: Load) -> bool:
    """Every (owner, segment) of ``load`` fits its m-tile slots and its S rows."""
    for (q, s), d in load.experts.items():
        rows = sum(d.values())
        if rows > geo.S or s >= geo.segments[q]:
            return False
        if sizes.m_tiles(d.values()) > geo.m_slots[q]:
            return False
    return True
