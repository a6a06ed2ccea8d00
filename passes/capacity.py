"""The capacity analysis of ``rdepc plan``: the overflow bound of a capacity (eq. 16 and
its (2+β) Chernoff form, union-bounded over the experts), the capacity that meets a target
(closed form and bisection), and eq. 18 with per-expert probabilities (``--probs``)."""

from __future__ import annotations

import math

import sympy as sp
from rdepc.passes.plan_records import CapacityPlan, Figure, PlanOptions, SkewBound
from rdepc.passes.plan_symbols import (
    E,
    Env,
    K,
    P,
    T,
    W,
    beta,
    cap_e,
    cap_expr,
    mu,
    p,
    rows_per_owner_expr,
    worst_owner_load_expr,
)

from rdepc.ir.spec import LayerSpec


def union_bound_expr() -> sp.Expr:
    """eq. 16 for 0 < β ≤ 1, and the (2+β) Chernoff form beyond, union-bounded over E experts."""
    return sp.Piecewise(
        (E * sp.exp(-mu * beta**2 / 3), beta <= 1),
        (E * sp.exp(-mu * beta**2 / (2 + beta)), True),
    )


def beta_needed_expr() -> sp.Expr:
    """The smallest β with union bound = P, solved in closed form on each branch."""
    c = sp.log(E / P)
    return sp.Piecewise(
        (sp.sqrt(3 * c / mu), 3 * c / mu <= 1),
        ((c + sp.sqrt(c**2 + 8 * c * mu)) / (2 * mu), True),
    )


def chernoff_union_bound(mu: float, b: float, experts: int) -> float:
    """E·exp(−μβ²/3) for 0 < β ≤ 1 (eq. 16), E·exp(−μβ²/(2+β)) for β > 1; raw (may exceed 1)."""
    if b <= 1:
        return experts * math.exp(-mu * b * b / 3)
    return experts * math.exp(-mu * b * b / (2 + b))


def bisect_decreasing(fn, target: float, lo: float = 0.0, hi: float = 1.0, iters: int = 200) -> float:
    """The smallest x ≥ lo with fn(x) ≤ target, for fn decreasing (hi doubled until it holds)."""
    while fn(hi) > target:
        lo, hi = hi, hi * 2
        if hi > 1e12:
            raise ValueError("no solution below 1e12")
    for _ in range(iters):
        mid = (lo + hi) / 2
        if fn(mid) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * max(1.0, hi):
            break
    return hi


def capacity_plan(env: Env, opts: PlanOptions, values: dict, spec: LayerSpec, warnings: list[str]) -> CapacityPlan:
    """The capacity part of the plan: cap_e, the rows the busiest owner may admit, the overflow
    bound of the capacity and the capacity that meets ``opts.overflow``; warns when it is short."""
    policy = spec.capacity.policy
    cap_fig, worst, rpo = _admission(env, spec)
    bounded = policy != "dropless" and rpo.value < worst.value
    # the inverse first (beta still free): bisection on the same bound; the closed form is the formula
    factor_needed, rows_needed = _needed_for_target(env, opts)
    beta_fig, union_fig, bound_fig, branch = _overflow_bound(env, policy)
    skew = skew_bound(env, opts, values, spec, warnings) if opts.probs is not None else None
    capacity = CapacityPlan(
        policy,
        cap_fig,
        worst,
        rpo,
        bounded,
        beta_fig,
        union_fig,
        bound_fig,
        branch,
        opts.overflow,
        factor_needed,
        rows_needed,
        skew,
    )
    if policy != "dropless" and bound_fig.value > opts.overflow:
        warnings.append(
            f"capacity too small for the overflow target: cap_e = {cap_fig.value} rows gives an overflow bound of "
            f"{bound_fig.value:.3g} > {opts.overflow:g}; the bound needs factor >= {factor_needed.value:.4g} "
            f"(cap_e >= {rows_needed.value} rows)"
        )
    return capacity


def _admission(env: Env, spec: LayerSpec) -> tuple[Figure | None, Figure, Figure]:
    """cap_e (None when dropless), the busiest owner's worst-case load and the rows it may admit."""
    policy = spec.capacity.policy
    cap_fig = (
        None
        if policy == "dropless"
        else env.fig(
            "capacity.rows_per_expert",
            cap_expr(policy),
            "rows",
            "cap_e = ceil(f·μ)"
            if policy == "factor"
            else "cap_e = the spec's capacity rows" + (", the largest over T' <= T" if spec.shape.symbolic else ""),
        )
    )
    worst = env.fig(
        "capacity.worst_owner_load",
        worst_owner_load_expr(),
        "rows",
        "busiest owner, distinct top-K: every token sends it min(K, E_max) rows",
    )
    rpo = env.fig(
        "capacity.rows_per_owner",
        rows_per_owner_expr(policy),
        "rows",
        "rows the busiest owner may admit: worst case"
        + (" (dropless: unbounded by policy)" if policy == "dropless" else ", capped at E_max·cap_e"),
    )
    return cap_fig, worst, rpo


def _needed_for_target(env: Env, opts: PlanOptions) -> tuple[Figure, Figure]:
    """The capacity factor and the cap_e at which the union bound meets ``opts.overflow``."""
    bn = beta_needed_expr()
    fn = sp.lambdify(beta, union_bound_expr().xreplace(env.exact), "math")
    b_needed = bisect_decreasing(fn, opts.overflow)
    factor_needed = Figure(
        "capacity.factor_needed",
        1 + bn,
        1 + b_needed,
        "x",
        f"capacity factor 1+β at which the union bound meets the target {opts.overflow:g} (bisection)",
    )
    rows_needed = Figure(
        "capacity.rows_per_expert_needed",
        sp.ceiling((1 + bn) * mu),
        math.ceil((1 + b_needed) * float(env.values[mu]) - 1e-9),
        "rows",
        "cap_e that meets the overflow target, ceil((1+β)·μ)",
    )
    return factor_needed, rows_needed


def _overflow_bound(env: Env, policy: str) -> tuple[Figure | None, Figure | None, Figure, str]:
    """The slack β of cap_e (defined in ``env``), the union bound, the overflow bound and its branch."""
    if policy == "dropless":
        bound_fig = env.fig("capacity.overflow_bound", sp.Integer(0), "prob", "dropless: every row is admitted")
        return None, None, bound_fig, "dropless"
    env.define(beta, cap_e / mu - 1)
    beta_fig = env.fig("capacity.beta", cap_e / mu - 1, "", "slack β = cap_e/μ − 1")
    beta_v = beta_fig.value
    union_fig = (
        env.fig(
            "capacity.overflow_union_bound",
            union_bound_expr(),
            "prob",
            "union bound over experts: E·exp(−μβ²/3) if β ≤ 1 (eq. 16), E·exp(−μβ²/(2+β)) beyond",
        )
        if beta_v > 0
        else None  # no slack: the tail bounds do not apply
    )
    bound_fig = env.fig(
        "capacity.overflow_bound",
        sp.Piecewise((sp.Integer(1), beta <= 0), (sp.Min(1, union_bound_expr()), True)),
        "prob",
        "P(some expert overflows cap_e), uniform independent routing, capped at 1",
    )
    branch = "beta<=0 (no slack)" if beta_v <= 0 else ("beta<=1 (eq. 16)" if beta_v <= 1 else "beta>1 (2+beta)")
    return beta_fig, union_fig, bound_fig, branch


def skew_bound(env: Env, opts: PlanOptions, values: dict, spec: LayerSpec, warnings: list[str]) -> SkewBound:
    probs = opts.probs
    Ev, Wv = values[E], values[W]
    if len(probs) != Ev:
        raise ValueError(f"--probs has {len(probs)} probabilities, the layer has {Ev} experts")
    n = Wv * values[T]
    s = sum(probs)
    if not math.isclose(s, values[K], rel_tol=1e-6, abs_tol=1e-9):
        warnings.append(f"--probs sum to {s:.6g}, not K = {values[K]} (each token picks K experts)")
    mu_e = W * T * p
    var_e = W * T * p * (1 - p)
    x = sp.Symbol("x", positive=True)
    per_expert = sp.exp(-(x**2) / (2 * (var_e + x / 3)))
    c = sp.log(E / P)
    x_needed = c / 3 + sp.sqrt(c**2 / 9 + 2 * c * var_e)
    f_bound = sp.lambdify((p, x), per_expert.subs(env.values), "math")
    f_need = sp.lambdify(p, (mu_e + x_needed).subs(env.values), "math")
    cap_v = env.values[cap_e]
    total = 0.0
    for pe in probs:
        if math.isinf(cap_v):
            continue
        xe = cap_v - n * pe
        total += 1.0 if xe <= 0 else min(1.0, f_bound(pe, xe))
    need = max(math.ceil(f_need(pe) - 1e-9) for pe in probs)
    owners: dict[int, float] = {}
    for e, pe in enumerate(probs):
        q = spec.ownership.owner[e]
        owners[q] = owners.get(q, 0.0) + n * pe
    mu_uniform = env.values[mu]
    pmax = max(probs)
    return SkewBound(
        probs,
        s,
        Figure("capacity.skew.mu_e_max", mu_e, n * pmax, "rows", "hottest expert's mean rows, W·T·max p_e"),
        Figure("capacity.skew.owner_load_max", None, max(owners.values()), "rows", "busiest owner's mean rows"),
        Figure(
            "capacity.skew.overflow_bound",
            per_expert.subs(x, cap_e - mu_e) if not math.isinf(cap_v) else sp.Integer(0),
            0.0 if math.isinf(cap_v) else min(1.0, total),
            "prob",
            "eq. 18 with x = cap_e − μ_e, σ² = W·T·p_e(1−p_e), summed over experts (1 where x ≤ 0), capped at 1",
        ),
        Figure(
            "capacity.skew.rows_per_expert_needed",
            sp.ceiling(mu_e + x_needed),
            need,
            "rows",
            "max_e ceil(μ_e + x_e), x_e solving eq. 18 = P/E",
        ),
        Figure(
            "capacity.skew.factor_needed",
            (mu_e + x_needed) / mu,
            need / mu_uniform,
            "x",
            "the same as a factor of the uniform μ",
        ),
    )
