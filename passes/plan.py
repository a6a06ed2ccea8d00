"""The planner: capacity, memory, transport and padding arithmetic for one layer.

``plan(spec, options)`` is a pure function of a checked :class:`LayerSpec` and returns a
frozen :class:`Plan`. Every figure is a sympy expression in named symbols (``W``, ``T``,
``K``, ``E``, ``H``, ``F``, ``S``, ``B``, ``L``, ``f``, ...) built with ``sympy.Symbol``,
then evaluated at the spec's values, so ``rdepc plan --symbolic`` can print the formula
behind every number. The only constants are byte sizes, the RDEP paper's formula
constants (cited where they enter), hardware-profile values (with their source, from
:mod:`rdepc.passes.hardware`), and the two layout constants of rdepc itself: the buffer
alignment of docs/memory.md (``ALIGN``) and the grouped-GEMM tile height (``BM``).

The parts live beside it, one role each: the symbols and their evaluation
(:mod:`rdepc.passes.plan_symbols`), the report's records and JSON
(:mod:`rdepc.passes.plan_records`), the capacity analysis (:mod:`rdepc.passes.capacity`),
the symmetric heap of docs/memory.md (:mod:`rdepc.passes.symmetric`, which the memory-plan
pass is checked against), transport and dedup (:mod:`rdepc.passes.transport`), the padding
of a sampled routing (:mod:`rdepc.passes.padding`) and the ``--probs`` parser
(:mod:`rdepc.passes.probs`). ``schedule auto`` is resolved by compile's resolve pass
(:func:`rdepc.passes.resolve.resolve_strategy`), on the scheduler's cost model. numpy is
imported only to sample a routing (``--routing``) and by that scheduler (``schedule auto``,
or a segmented schedule without a segment statement, or a bulk one's GEMM lowering, compared
on its cost model as compile compares it). Neither torch nor triton is imported.
"""

from __future__ import annotations

import sympy as sp
from rdepc.passes.balance_plan import balance_plan
from rdepc.passes.capacity import capacity_plan
from rdepc.passes.compute_plan import compute_plan
from rdepc.passes.hardware import profile
from rdepc.passes.padding import padding_plan
from rdepc.passes.plan_records import Figure, MemoryFigures, Plan, PlanOptions, Pooling, TrainingState, Verdict
from rdepc.passes.plan_symbols import (
    CTX_BYTES_PER_ROW,
    MU_DEF,
    PAPER_TENSORS,
    SEGMENTED,
    B,
    B_eff,
    D_dense,
    E,
    E_max,
    E_min,
    Env,
    F,
    F_gpu,
    H,
    K,
    L,
    L_all,
    L_dense,
    P,
    R_max,
    S,
    T,
    V,
    W,
    a,
    cap_e,
    d,
    mu,
    number,
    spec_values,
    t_b,
)
from rdepc.passes.replicate import physical_layer
from rdepc.passes.resolve import resolve, resolve_strategy
from rdepc.passes.symmetric import symmetric_figures
from rdepc.passes.transport import dedup_plan, transport_plan

from rdepc.diagnostics import SpecError
from rdepc.ir.balance import slot_elems
from rdepc.ir.sizes import BM, kept_columns
from rdepc.ir.spec import LayerSpec

# --- the planner -----------------------------------------------------------------------


def plan(spec: LayerSpec, options: PlanOptions | None = None) -> Plan:
    opts = options or PlanOptions()
    hw = profile(opts.hw)
    if not 0 < opts.overflow < 1:
        raise ValueError(f"overflow target must be in (0, 1), got {opts.overflow}")
    # what compile builds: under balance replicate the physical layer, whose slots are experts
    # of their ranks (its buffers are what a module allocates); the load figures stay the spec's
    layer = physical_layer(spec)
    strategy_asked = "bulk" if opts.gemm == "library" and opts.strategy in (None, "auto") else opts.strategy
    resolved = resolve_strategy(layer, strategy_asked, opts.hw)  # auto: the scheduler's choice, as compile
    strategy, rows, buffers = resolved.strategy, resolved.S, resolved.B
    if strategy in SEGMENTED and spec.segment is None and rows is None:
        # No segment statement: the S and B the resolve pass chooses on this profile, as compile's does.
        choice = resolve(layer, strategy, hw=opts.hw)
        rows, buffers = choice.S, choice.B
    values = spec_values(spec, strategy, rows, buffers)
    rates = {F_gpu: hw.flops.value, B_eff: hw.link.value, t_b: hw.barrier_per_peer.value, P: opts.overflow}
    values.update(rates)
    policy = spec.capacity.policy
    env = Env(values, policy)
    mem_env = env if layer is spec else Env(spec_values(layer, strategy, rows, buffers) | rates, policy)
    Wv = values[W]
    per_rank = spec.ownership.experts_per_rank(Wv)
    warnings: list[str] = [resolved.note] if resolved.note else []

    pooling = _pooling(env, per_rank)
    mu_v = pooling.mu.value

    capacity = capacity_plan(env, opts, values, spec, warnings)

    memory = _memory(env, mem_env, spec, layer, strategy)
    sym, resend = memory.plan, spec.input_activations == "resend"

    transport = transport_plan(env, strategy, resend, spec.precision.backward_fp8)
    if transport.min_ffn.value > values[F]:
        warnings.append(
            f"expert ffn {values[F]} is below {transport.min_ffn.value:.0f}, the width at which grouped-GEMM "
            f"compute hides transport on {hw.name} (Table 5 rule): transport will show"
        )

    padding = None
    if opts.routing is not None:
        seg_rows = sym.S.value if strategy in SEGMENTED else None
        padding = padding_plan(spec, opts, values, per_rank, seg_rows, env.values[cap_e])

    warnings += _load_warnings(env, strategy, per_rank, mu_v)
    too_big = _too_big(layer, strategy)
    warnings += [] if too_big else _choice_warnings(layer, strategy_asked, opts)
    verdicts = _verdicts(hw, memory)
    if not verdicts[0].fits:
        warnings.append(f"the symmetric heap with a private ring per layer does not fit {hw.name}'s HBM")
    if not verdicts[-1].fits:
        warnings.append(f"the routed-layer memory together does not fit {hw.name}'s HBM")

    return Plan(
        spec.name,
        spec.file,
        hw,
        strategy,
        spec.shape.T_bound,
        f"{spec.precision.dtype.value}, dispatch {spec.precision.dispatch.value}",
        tuple((str(k), number(v)) for k, v in env.values.items()),
        pooling,
        capacity,
        memory,
        transport,
        dedup_plan(env, spec, per_rank),
        padding,
        verdicts,
        tuple(warnings),
        balance_plan(env, spec, opts),
        compute_plan(env, spec),
        lowering := gemm_lowering(layer, strategy, opts),
        too_big or projection(layer, strategy, lowering[0], opts),
    )


def _load_warnings(env: Env, strategy: str, per_rank, mu_v: float) -> list[str]:
    """Loads too small for the schedule: a segment the least-loaded owner does not fill, and
    fewer rows per expert than one m-tile."""
    out: list[str] = []
    if strategy in SEGMENTED:
        fewest = min(k for k in per_rank if k > 0)
        low = min(fewest * mu_v, env.values[R_max])
        if env.values[S] > low:
            out.append(
                f"segment of {env.values[S]} rows is larger than the expected load of an owner with {fewest} "
                f"expert(s) ({_g(low)} rows): that owner fills less than one segment, nothing overlaps"
            )
    if mu_v < BM:
        out.append(
            f"mu = {_g(mu_v)} rows per expert is below one {BM}-row tile: expert GEMMs launch mostly padding "
            f"(pool more ranks or tokens)"
        )
    return out


def _pooling(env: Env, per_rank) -> Pooling:
    """Rows per expert and per owner under uniform routing (DP = W)."""
    return Pooling(
        env.fig("mu", MU_DEF, "rows", "mean rows per expert, W·T·K/E (eq. 2 with DP = W)"),
        env.fig("mu_replica", T * K / E, "rows", "rows per expert from one replica, T·K/E"),
        env.fig("cv_uniform", sp.sqrt((1 - K / E) / mu), "frac", "CV of rows per expert, uniform routing (eq. 14)"),
        per_rank,
        env.fig("owners.E_min", E_min, "", "fewest experts one rank owns"),
        env.fig("owners.E_max", E_max, "", "most experts one rank owns"),
        env.fig(
            "owners.asymmetry",
            E_max / E_min if min(per_rank) > 0 else sp.oo,
            "x",
            "owner-load asymmetry under equal per-expert traffic, E_max/E_min",
        ),
        env.fig("owners.expected_load_max", E_max * mu, "rows", "expected rows at the busiest owner, E_max·μ"),
    )


def _memory(env: Env, mem_env: Env, spec: LayerSpec, layer: LayerSpec, strategy: str) -> MemoryFigures:
    """The paper's Table 4 symmetric memory, rdepc's heap plan (and the other strategy's, for
    comparison), the routing context, what the backward keeps, the dense weights' lower bound
    and the experts' training state. ``mem_env`` and ``layer``: the physical layer's (under
    balance replicate its slots are experts), which the heap is planned for."""
    has_seg = spec.segment is not None
    sym = symmetric_figures(mem_env, strategy, "symmetric_bytes.plan", layer)
    alt = None
    if strategy in SEGMENTED:
        alt = symmetric_figures(mem_env, "bulk", "symmetric_bytes.plan_bulk", layer)
    elif has_seg:
        alt = symmetric_figures(mem_env, "pipelined", "symmetric_bytes.plan_segmented", layer)
    saved_rows = env.fig(
        "saved_activations.rows", R_max, "rows", "the busiest owner's rows (worst case, capped by capacity)"
    )
    row_width, saved_row = _saved_row(env, spec)
    dense_params, dense_bytes = _dense_lower_bound(env)
    return MemoryFigures(
        *_paper_table4(env, has_seg),
        sym,
        alt,
        env.fig(
            "routing_context_bytes",
            CTX_BYTES_PER_ROW * L * W * T * K,
            "B",
            "eq. 20: 8 bytes (row identity, gate) per accepted route row × L layers",
        ),
        saved_rows,
        saved_row,
        env.fig("saved_activations.per_layer", R_max * row_width * a, "B", "owner rows × bytes per row, one layer"),
        env.fig("saved_activations.total", R_max * row_width * a * L, "B", "× L MoE layers"),
        env.fig(
            "saved_activations.per_layer_expected",
            sp.Min(E_max * mu, R_max) * row_width * a,
            "B",
            "the same for the expected load min(E_max·μ, R_max), one layer",
        ),
        *_saved_outputs(env, spec),
        dense_params,
        dense_bytes,
        training_state(env, spec),
    )


def _paper_table4(env: Env, has_seg: bool) -> tuple[Figure | None, ...]:
    """The paper's Table 4 symmetric bytes, bulk and segmented: per layer, for L private
    buffers, and for one buffer the layers share (the segmented ones None without a segment)."""
    bulk_pl = PAPER_TENSORS * W * T * K * H * d
    seg_pl = PAPER_TENSORS * B * S * H * d
    t4 = "Table 4: 4 routed row tensors (dispatch, return; fwd, bwd)"
    return (
        env.fig("symmetric_bytes.bulk_per_layer", bulk_pl, "B", f"{t4}, M_cap = W·T·K rows of H·d bytes"),
        env.fig("symmetric_bytes.segmented_per_layer", seg_pl, "B", f"{t4}, B·S rows of H·d bytes")
        if has_seg
        else None,
        env.fig("symmetric_bytes.bulk_total", bulk_pl * L, "B", "bulk per layer × L (a private buffer per layer)"),
        env.fig(
            "symmetric_bytes.segmented_total", seg_pl * L, "B", "segmented per layer × L (a private ring per layer)"
        )
        if has_seg
        else None,
        env.fig("symmetric_bytes.bulk_shared", bulk_pl, "B", "one buffer shared by layers run one after another"),
        env.fig("symmetric_bytes.segmented_shared", seg_pl, "B", "one ring shared by layers run one after another")
        if has_seg
        else None,
    )


def _saved_row(env: Env, spec: LayerSpec) -> tuple[sp.Expr | int, Figure]:
    """The columns of one owner row the backward keeps, and its bytes with the reason."""
    resend = spec.input_activations == "resend"
    recompute = spec.pre_activations == "recompute"
    row_width = sum(kept_columns(H, F, spec.expert.gated, recompute, resend).values())
    kept = [] if resend else ["H: input row x"]
    if not recompute:
        kept.append("2F: the gate and up pre-activations" if spec.expert.gated else "F: the pre-activation h")
    width_text = " + ".join(kept) + " (·a)" if kept else "nothing"
    why = [
        w for w, on in (("the backward sends x again", resend), ("computes the pre-activations again", recompute)) if on
    ]
    width_text += f"; {' and '.join(why)}" if why else ""
    return row_width, env.fig("saved_activations.bytes_per_row", row_width * a, "B", width_text)


def _saved_outputs(env: Env, spec: LayerSpec) -> tuple[Figure, Figure]:
    """The bytes kept for the gate gradient, one layer and all layers."""
    # What waits for the gate gradient: the expert outputs (at the front-ends, or under dedup
    # at the owners; none with the gate on the input) and the layer's input x at its front-end
    # when the backward reads it (the gate on the input, or the input rows sent again).
    gate_input, resend = spec.gate_on == "input", spec.input_activations == "resend"
    out_rows = R_max if spec.dedup else 0 if gate_input else T * K
    out_rows += T if gate_input or resend else 0
    return (
        env.fig(
            "saved_activations.outputs_per_layer",
            out_rows * H * a,
            "B",
            "R_max·H·a: each row's expert output at its owner (dedup returns them summed), for the gate "
            "gradient, one layer"
            if spec.dedup
            else "T·H·a: the layer's input x at its front-end, for the gate gradient (the gate scales the "
            "expert's input), one layer"
            if gate_input
            else "(T·K + T)·H·a: each slot's expert output at its front-end, for the gate gradient, and the "
            "layer's input x, which the backward sends again, one layer"
            if resend
            else "T·K·H·a: each slot's expert output at its front-end, for the gate gradient, one layer",
        ),
        env.fig("saved_activations.outputs_total", out_rows * H * a * L, "B", "× L MoE layers"),
    )


def _dense_lower_bound(env: Env) -> tuple[Figure | None, Figure | None]:
    """eq. 21's replicated dense parameters and their bytes, where the spec's model gives them."""
    if env.values.get(V) is None or env.values.get(L_all) is None:
        return None, None
    dp = V * H + 4 * L_all * H**2 + 3 * L_dense * H * D_dense
    dense_params = env.fig(
        "dense_lower_bound.params",
        dp,
        "params",
        "eq. 21: V·H embeddings + 4·L·H² attention + 3·L_dense·H·D_dense dense FFN",
    )
    dense_bytes = env.fig("dense_lower_bound.bytes", dp * a, "B", "the same at the dtype, replicated on every rank")
    return dense_params, dense_bytes


def _verdicts(hw, memory: MemoryFigures) -> tuple[Verdict, ...]:
    """One verdict per memory budget against the profile's HBM, the sum of them all last."""
    sym, dense_bytes = memory.plan, memory.dense_bytes
    hbm = int(hw.hbm.value)
    budgets = [
        ("symmetric heap, rdepc plan fwd+bwd, private ring per layer", sym.private_total.value),
        ("symmetric heap, rdepc plan fwd+bwd, one shared ring", sym.shared_total.value),
        ("symmetric heap, forward only (inference), private ring per layer", sym.inference_private_total.value),
        ("paper bulk, all layers (Table 4)", memory.bulk_total.value),
    ]
    if memory.segmented_total is not None:
        budgets.append(("paper segmented, all layers (Table 4)", memory.segmented_total.value))
    budgets.append(("routing context (eq. 20)", memory.routing_context.value))
    budgets.append(("owner activations saved for backward, all layers", memory.saved_total.value))
    budgets.append(("expert outputs and x kept for the backward, all layers", memory.saved_outputs_total.value))
    if dense_bytes is not None:
        budgets.append(("replicated dense weights, lower bound (eq. 21)", dense_bytes.value))
    training = memory.training
    budgets.append(("expert weights, their gradients and AdamW state, all layers", training.total.value))
    together = sym.private_total.value + memory.routing_context.value + memory.saved_total.value
    together += memory.saved_outputs_total.value + training.total.value
    together += dense_bytes.value if dense_bytes is not None else 0
    budgets.append(
        (
            "together: private-ring heap + routing context + saved activations + expert training state"
            + (" + dense" if dense_bytes else ""),
            together,
        )
    )
    return tuple(Verdict(name, int(v), hbm, int(v) <= hbm) for name, v in budgets)


def training_state(env: Env, spec: LayerSpec) -> TrainingState:
    """The routed experts' training state on the busiest rank (E_max experts): their weights
    (``rdepc.ir.balance.slot_elems``: the H×F matrices and the biases of one expert), the
    gradients, in the dtype as the layer makes them, and AdamW's moments and master copy."""
    gated = spec.expert.gated
    per_expert = slot_elems(3 if gated else 2, H, F, spec.expert.bias)
    master = 4 if spec.precision.dtype.bytes < 4 else 0  # fp32 master weights under a narrower dtype
    state = 8 + master
    params = env.fig("expert_training_state.params_per_expert", per_expert, "params",
                     f"{'3' if gated else '2'} H·F matrices" + (" + biases" if spec.expert.bias else "") +
                     " of one routed expert")  # fmt: skip
    weights = env.fig("expert_training_state.weights_per_layer", E_max * per_expert * a, "B",
                      "E_max experts' weights at the dtype, one layer")  # fmt: skip
    total = env.fig("expert_training_state.weights_total", E_max * per_expert * a * L, "B", "× L MoE layers")
    grads = env.fig("expert_training_state.grads_total", E_max * per_expert * a * L, "B",
                    "their gradients, at the dtype, × L")  # fmt: skip
    why = "AdamW: two fp32 moments (8 B)" + (" and an fp32 master copy (4 B)" if master else "") + " per parameter, × L"
    opt = env.fig("expert_training_state.optimizer_total", E_max * per_expert * state * L, "B", why)
    both = env.fig("expert_training_state.total", E_max * per_expert * (2 * a + state) * L, "B",
                   "weights + gradients + optimizer state, all layers")  # fmt: skip
    return TrainingState(params, weights, total, grads, opt, both)


def gemm_lowering(layer: LayerSpec, strategy: str, opts: PlanOptions) -> tuple[str, str]:
    """The expert GEMMs' lowering ``compile`` chooses for ``layer`` under ``strategy`` and why
    (a bulk schedule's lowerings compared on its cost model, as compile's lowering pass does)."""
    from rdepc.passes.lowering import decide, predicted

    def predict() -> dict[str, float]:  # a bulk schedule's cost model (numpy): only where compared
        from rdepc.passes.resolve import build_for
        from rdepc.passes.schedule import schedule

        return predicted(schedule(build_for(layer, "bulk", None, opts.hw, opts.gemm), opts.hw))

    try:
        lo = decide(layer, strategy, opts.gemm, predict)
    except SpecError as e:  # compile cannot build the layer (not supported yet): nothing to compare
        return "triton", f"not compared: {e.diagnostics[0].message if e.diagnostics else e}"
    return lo.gemm, lo.why


def _g(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def _choice_warnings(layer: LayerSpec, strategy: str | None, opts: PlanOptions) -> list[str]:
    """The scheduler's warnings about the schedule the spec fixed (none where it cannot build
    the layer's graph: the plan says so elsewhere)."""
    from rdepc.passes.resolve import choice_warnings

    try:
        return choice_warnings(layer, strategy, None, opts.hw, opts.gemm)
    except SpecError:
        return []


def projection(layer: LayerSpec, strategy: str, gemm: str, opts: PlanOptions):
    """The layer's forward and backward per GPU predicted on the profile (passes.projection),
    or None where the scheduler cannot build its graph."""
    from rdepc.passes.projection import project
    from rdepc.passes.resolve import build_for
    from rdepc.passes.schedule import schedule

    try:
        return project(schedule(build_for(layer, strategy, None, opts.hw, opts.gemm), opts.hw), gemm)
    except SpecError:
        return None


def _too_big(layer: LayerSpec, strategy: str) -> str | None:
    """Why the plan does not schedule the layer (its projection and the schedule warnings need
    a timeline): a task graph beyond passes.projection.PLAN_TASKS; None when it does."""
    from rdepc.passes.graph import geometry, task_count
    from rdepc.passes.projection import PLAN_TASKS

    try:
        n = task_count(geometry(layer, strategy))
    except (SpecError, ValueError):
        return None  # the scheduler says why, where it is asked
    if n <= PLAN_TASKS:
        return None
    return (
        f"not computed: the {strategy} task graph has {n:,} tasks, more than the {PLAN_TASKS:,} rdepc "
        "plan schedules (rdepc viz schedules it)"
    )
