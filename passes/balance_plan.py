"""The planner's figures for ``balance replicate``: what the N redundant slots cost in
memory (the runtime's layout: :func:`rdepc.ir.balance.exchange_regions`), and, under one
sampled routing (``--routing``), the owner imbalance (max/mean of per-rank rows) before and
after the replication solver's plan for that routing's exact load
(:func:`rdepc.ir.balance.solve`, the plan every rank would derive), the busiest rank's
routed GEMM time both ways, and the replicas' weights the plan moves."""

from __future__ import annotations

import sympy as sp
from rdepc.passes.plan_records import BalancePlan, PlanOptions
from rdepc.passes.plan_symbols import B_eff, E, Env, F, F_gpu, Figure, H, K, T, W, a, t_b
from rdepc.passes.sampled_routing import source_counts

from rdepc.ir.balance import exchange_regions, imbalance, owner_loads, push_seconds, slot_elems, solve
from rdepc.ir.spec import LayerSpec

N = sp.Symbol("N", positive=True, integer=True)  # redundant expert slots per rank


def balance_plan(env: Env, spec: LayerSpec, opts: PlanOptions) -> BalancePlan | None:
    b = spec.balance
    if b.kind == "none":
        return None
    env.values[N], env.exact[N] = b.slots, sp.Integer(b.slots)
    mats, bias = spec.expert.matrices, spec.expert.bias
    words = f"N·({mats}·H·F + biases)·a" if bias else f"N·{mats}·H·F·a"
    words += " (gate, up, down)" if mats == 3 else " (up, down)"
    slot = slot_elems(mats, H, F, bias)
    slot_bytes = env.fig("balance.slot_bytes", N * slot * a, "B", f"{words}: N replicas' weights per rank")
    v = env.values
    _, stride = exchange_regions(v[W], v[E], b.slots, slot_elems(mats, v[H], v[F], bias), v[a])
    exchange = Figure(
        "balance.exchange_bytes",
        None,
        stride,
        "B",
        "one process per rank: a symmetric allocation of its own (counters, W·E loads, N weight and N gradient slots)",
    )
    before = after = replicas = None
    times: tuple[Figure | None, ...] = (None,) * 4
    if opts.routing is not None:
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
        times = _times(env, spec, load, plan, used)
    return BalancePlan(b.slots, b.min_rows, slot_bytes, exchange, before, after, replicas, *times)


def _times(env: Env, spec: LayerSpec, load, plan, used: int) -> tuple[Figure, ...]:
    """The busiest rank's routed forward GEMMs at F_gpu before and after the plan, the
    replicas' weights moved per call, and the busiest rank's pushes alone at B_eff, then one
    flag (:func:`rdepc.ir.balance.push_seconds`; in the layer they share the links with its
    dispatch, as ``rdepc viz`` draws them)."""

    v = env.values
    per_row = 2 * spec.expert.matrices * v[H] * v[F]
    flops = float(v[F_gpu])
    how = f"rows of the busiest rank × {2 * spec.expert.matrices}·H·F FLOPs at F_gpu"
    before = int(owner_loads(load, spec.ownership.owner).max())
    after = int(plan.rank_loads.max())
    expert = int(slot_elems(spec.expert.matrices, v[H], v[F], spec.expert.bias) * v[a])
    moved, seconds = push_seconds(plan.slots, spec.ownership.owner, expert, float(v[B_eff]), float(v[t_b]))
    link = int(moved.max())  # the busiest rank's pushes, out or in
    return (
        Figure("balance.time_before", None, before * per_row / flops, "s", f"{before} {how}, without replication"),
        Figure("balance.time_after", None, after * per_row / flops, "s", f"{after} {how}, with the plan"),
        Figure("balance.weight_bytes", None, used * expert, "B", "the replicas' weights, moved every call"),
        Figure(
            "balance.weight_time",
            None,
            float(seconds.max()),
            "s",
            f"the busiest rank's {link // expert} replica pushes (sent or received) alone at B_eff + t_b",
        ),
    )
