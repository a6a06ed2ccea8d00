"""The planner's figures for ``balance replicate``: what the N redundant slots cost in
memory, and, under one sampled routing (``--routing``), the owner imbalance (max/mean of
per-rank rows) before and after the replication solver's plan for that routing's exact
load (:func:`rdepc.ir.balance.solve`, the plan every rank would derive)."""

from __future__ import annotations

import sympy as sp
from rdepc.passes.plan_records import BalancePlan, PlanOptions
from rdepc.passes.plan_symbols import E, Env, F, Figure, H, K, T, W, a
from rdepc.passes.sampled_routing import source_counts

from rdepc.ir.spec import LayerSpec

N = sp.Symbol("N", positive=True, integer=True)  # redundant expert slots per rank


def balance_plan(env: Env, spec: LayerSpec, opts: PlanOptions) -> BalancePlan | None:
    b = spec.balance
    if b.kind == "none":
        return None
    env.values[N], env.exact[N] = b.slots, sp.Integer(b.slots)
    mats = spec.expert.matrices
    expert = mats * H * F * a
    words = f"{mats}·H·F·a" + (" (gate, up, down)" if mats == 3 else " (up, down)")
    slot_bytes = env.fig("balance.slot_bytes", N * expert, "B", f"N·{words}: N replicas' weights per rank")
    train = env.fig(
        "balance.slot_bytes_training", 2 * N * expert, "B", "training: the same again for the replicas' gradients"
    )
    before = after = replicas = None
    if opts.routing is not None:
        from rdepc.ir.balance import imbalance, owner_loads, solve

        v = env.values
        load = source_counts(v[W], v[T], v[E], v[K], opts.routing, opts.alpha, opts.seed)
        owner = spec.ownership.owner
        plan = solve(load, owner, b.slots, b.min_rows)
        how = "uniform" if opts.routing == "uniform" else f"zipf alpha={opts.alpha:g}"
        before = Figure(
            "balance.imbalance_before", None, imbalance(owner_loads(load, owner)), "x", f"max/mean owner rows, {how}"
        )
        after = Figure("balance.imbalance_after", None, imbalance(plan.rank_loads), "x", "the same after replication")
        used = int((plan.slots >= 0).sum())
        replicas = Figure("balance.replicas", None, used, "", f"replicas placed, of N·W = {b.slots * v[W]} slots")
    return BalancePlan(b.slots, b.min_rows, slot_bytes, train, before, after, replicas)
