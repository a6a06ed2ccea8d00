"""Padding under one sampled routing (``rdepc plan --routing``): eq. 19's ρ when every group
is padded to the tallest, and rdepc's padding-free tiling (each expert's rows in a segment
rounded up to the tile height only). numpy is imported only to sample the routing."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rdepc.passes.plan_records import Figure, PaddingPlan, PlanOptions
from rdepc.passes.plan_symbols import E, K, T, W
from rdepc.passes.sampled_routing import sample_routing

from rdepc.ir.sizes import BM
from rdepc.ir.spec import LayerSpec


def rho_tallest(counts: Sequence[int]) -> float:
    """eq. 19: launched/useful rows when every group is padded to the tallest (E_loc·max / Σ)."""
    total = sum(counts)
    if total == 0:
        return 1.0
    return len(counts) * max(counts) / total


def tiled_rows(counts: Sequence[int], rows: int | None = None, tile: int = BM) -> int:
    """Rows launched by rdepc's padding-free tiling: the owner's rows, expert after expert,
    cut into segments of ``rows`` (None: one bulk segment); within a segment each expert's
    piece is rounded up to the tile height only."""
    launched = 0
    if rows is None:
        return sum(-(-m // tile) * tile for m in counts)
    pos = 0  # rows already placed in the current segment
    for m in counts:
        left = m
        while left > 0:
            piece = min(left, rows - pos)
            launched += -(-piece // tile) * tile
            left -= piece
            pos = (pos + piece) % rows
    return launched


def rho_tiled(counts: Sequence[int], rows: int | None = None, tile: int = BM) -> float:
    total = sum(counts)
    return tiled_rows(counts, rows, tile) / total if total else 1.0


def padding_plan(
    spec: LayerSpec, opts: PlanOptions, values: dict, per_rank, seg_rows: int | None, cap: float
) -> PaddingPlan:
    import numpy as np

    routing = opts.routing
    if routing not in ("uniform", "zipf"):
        raise ValueError(f"unknown routing '{routing}' (uniform or zipf:ALPHA)")
    m, pairs = sample_routing(
        values[W], values[T], values[E], values[K], routing, opts.alpha, opts.seed, spec.ownership.owner
    )
    tokens = values[W] * values[T]
    # routing statistics on the routed rows M_e; owner loads and padding on the admitted rows
    admitted = [int(x) if math.isinf(cap) else min(int(x), int(cap)) for x in m]
    dropped = int(m.sum()) - sum(admitted)
    groups: list[list[int]] = [[] for _ in per_rank]
    for e, q in enumerate(spec.ownership.owner):
        groups[q].append(admitted[e])
    useful = sum(admitted)
    launched_tallest = sum(len(g) * max(g) for g in groups if g)
    launched_tiled = sum(tiled_rows(g, seg_rows) for g in groups if g)
    rhos = [rho_tallest(g) for g in groups if g and sum(g)]
    mean = float(m.mean())
    key = "padding"
    how = "uniform" if routing == "uniform" else f"zipf alpha={opts.alpha:g}"
    return PaddingPlan(
        routing,
        opts.alpha,
        opts.seed,
        tuple(int(x) for x in m),
        Figure(f"{key}.mu", None, mean, "rows", f"mean rows per expert, one sampled {how} routing"),
        Figure(f"{key}.cv", None, float(m.std() / mean) if mean else 0.0, "frac", "std/mean of rows per expert"),
        Figure(f"{key}.p10", None, float(np.percentile(m, 10)), "rows", "10th-percentile rows per expert"),
        Figure(f"{key}.dropped", None, dropped, "rows", "rows over cap_e, dropped by the capacity policy"),
        Figure(f"{key}.max_owner_load", None, max(sum(g) for g in groups), "rows", "admitted rows, busiest owner"),
        Figure(
            f"{key}.rho_tallest",
            None,
            launched_tallest / useful if useful else 1.0,
            "x",
            "eq. 19 over all owners: Σ_q E_loc(q)·max_j m_qj / Σ m (padded to the tallest group)",
        ),
        Figure(f"{key}.rho_tallest_max", None, max(rhos) if rhos else 1.0, "x", "eq. 19, the worst owner"),
        Figure(
            f"{key}.rho_tiled",
            None,
            launched_tiled / useful if useful else 1.0,
            "x",
            f"rdepc's padding-free tiling: each expert's rows in a segment rounded up to BM = {BM} only",
        ),
        Figure(f"{key}.owners_per_token", None, pairs / tokens, "", "distinct owners of a token's K experts, mean"),
        Figure(
            f"{key}.redundant",
            None,
            1 - pairs / (tokens * values[K]),
            "frac",
            "routed rows that repeat a (token, owner) pair: what dedup does not send",
        ),
    )
