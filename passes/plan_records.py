"""The records of one ``rdepc plan`` report (:class:`Plan` and its parts, each number a
:class:`Figure`) and their JSON form (:func:`to_json`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from rdepc.passes.hardware import HardwareProfile
from rdepc.passes.plan_symbols import SYMBOLS_DOC, Figure


@dataclass(frozen=True, slots=True)
class PlanOptions:
    hw: str = "h100"
    overflow: float = 1e-6  # target probability that any expert overflows its capacity
    routing: str | None = None  # None | "uniform" | "zipf"
    alpha: float = 0.0  # zipf exponent
    seed: int = 0
    probs: tuple[float, ...] | None = None  # per-expert selection probabilities p_e
    strategy: str | None = None  # None: the spec's schedule (auto: the scheduler's choice, as compile)
    gemm: str | None = None  # --gemm: the expert GEMMs' lowering (None: the spec's, else the compiler's choice)


@dataclass(frozen=True, slots=True)
class Pooling:
    mu: Figure
    mu_replica: Figure
    cv_uniform: Figure
    experts_per_owner: tuple[int, ...]
    e_min: Figure
    e_max: Figure
    asymmetry: Figure
    owner_load_expected: Figure


@dataclass(frozen=True, slots=True)
class SkewBound:
    """eq. 18 with per-expert probabilities p_e (each token picks expert e with prob p_e)."""

    probs: tuple[float, ...]
    sum_p: float
    mu_e_max: Figure
    owner_load_max: Figure
    overflow_bound: Figure
    rows_per_expert_needed: Figure
    factor_needed: Figure


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    policy: str
    rows_per_expert: Figure | None  # cap_e; None when dropless
    worst_owner_load: Figure
    rows_per_owner: Figure
    bounded: bool  # the capacity, not the worst case, bounds rows_per_owner
    beta: Figure | None
    overflow_union_bound: Figure | None
    overflow_bound: Figure
    overflow_branch: str
    target: float
    factor_needed: Figure
    rows_per_expert_needed: Figure
    skew: SkewBound | None


@dataclass(frozen=True, slots=True)
class SymmetricPlan:
    strategy: str
    S: Figure
    B: Figure
    R_ret: Figure
    buffers: tuple[Figure, ...]
    forward: tuple[Figure, ...]  # regions, then total
    forward_backward: tuple[Figure, ...]
    private_total: Figure
    shared_total: Figure
    inference_private_total: Figure  # the forward regions only: modules built with inference=True
    inference_shared_total: Figure

    def regions(self, phase: str) -> dict[str, int]:
        return {fig.key.rsplit(".", 1)[1]: fig.value for fig in getattr(self, phase)}


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    bulk_per_layer: Figure
    segmented_per_layer: Figure | None
    bulk_total: Figure
    segmented_total: Figure | None
    bulk_shared: Figure
    segmented_shared: Figure | None
    plan: SymmetricPlan
    alternative: SymmetricPlan | None  # the other strategy, for comparison
    routing_context: Figure
    saved_rows: Figure
    saved_row_bytes: Figure
    saved_per_layer: Figure
    saved_total: Figure
    saved_expected: Figure
    saved_outputs: Figure  # each accepted slot's expert output at its front-end (dL/dg' = dL/dy·out)
    saved_outputs_total: Figure
    dense_params: Figure | None
    dense_bytes: Figure | None
    training: TrainingState | None = None


@dataclass(frozen=True, slots=True)
class TrainingState:
    """What training keeps per rank beside the layer's buffers: the routed experts' weights
    this rank owns, their gradients and the optimizer's state (AdamW: two fp32 moments per
    parameter, and an fp32 master copy when the dtype is narrower)."""

    params_per_expert: Figure
    weights_per_layer: Figure
    weights_total: Figure
    grads_total: Figure
    optimizer_total: Figure
    total: Figure


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    what: str
    row_bytes: Figure
    send_expected: Figure
    send_worst: Figure
    recv_expected: Figure
    recv_worst: Figure
    time_expected: Figure
    time_worst: Figure


@dataclass(frozen=True, slots=True)
class TransportPlan:
    stages: tuple[Stage, ...]
    barrier: Figure
    barrier_low: Figure
    barrier_high: Figure
    barrier_segment: Figure
    segments: Figure
    barrier_layer: Figure
    segment_time: Figure | None
    min_ffn: Figure
    ffn: Figure
    ffn_margin: Figure


@dataclass(frozen=True, slots=True)
class DedupPlan:
    """What ``dedup`` saves under uniform routing: one payload row per (token, owner)
    instead of one per slot, out and back."""

    enabled: bool  # the spec's transport statement asks for it
    owners_per_token: Figure
    redundant: Figure
    dispatch_send: Figure
    return_recv: Figure
    bwd_dispatch_send: Figure
    bwd_return_recv: Figure


@dataclass(frozen=True, slots=True)
class PaddingPlan:
    """One sampled routing (numpy, deterministic by seed)."""

    routing: str
    alpha: float
    seed: int
    counts: tuple[int, ...]
    mu: Figure
    cv: Figure
    p10: Figure
    dropped: Figure
    max_owner_load: Figure
    rho_tallest: Figure
    rho_tallest_max: Figure
    rho_tiled: Figure
    owners_per_token: Figure
    redundant: Figure


@dataclass(frozen=True, slots=True)
class BalancePlan:
    """``balance replicate``: the redundant slots' memory, and (with a sampled routing) the
    owner imbalance before and after the replication solver's plan."""

    slots: int
    min_rows: int
    slot_bytes: Figure
    exchange_bytes: Figure  # per rank, one process per rank: the exchange's own symmetric allocation
    imbalance_before: Figure | None  # None: no --routing
    imbalance_after: Figure | None
    replicas: Figure | None
    # the busiest rank's routed forward GEMMs at F_gpu, without and with the plan; the
    # replicas' weights moved per call and the busiest rank's pushes at B_eff + t_b
    time_before: Figure | None = None
    time_after: Figure | None = None
    weight_bytes: Figure | None = None
    weight_time: Figure | None = None


@dataclass(frozen=True, slots=True)
class ComputePlan:
    """The expert GEMMs' FLOPs per rank and layer and their time at F_gpu: the routed experts at
    the busiest owner (expected, worst), forward and backward, and the shared experts' forward
    at a front-end."""

    routed: Figure
    routed_worst: Figure
    routed_time: Figure
    routed_worst_time: Figure
    routed_backward: Figure  # dX and dW, and GEMM1 again under recompute
    routed_backward_worst: Figure
    routed_backward_time: Figure
    routed_backward_worst_time: Figure
    shared: Figure | None  # None: no shared experts
    shared_time: Figure | None


@dataclass(frozen=True, slots=True)
class Verdict:
    budget: str
    bytes: int
    hbm: int
    fits: bool

    @property
    def margin(self) -> int:
        return self.hbm - self.bytes


@dataclass(frozen=True, slots=True)
class Plan:
    layer: str
    file: str
    hw: HardwareProfile
    strategy: str
    t_bound: int | None  # the bound T was evaluated at, when T is symbolic
    precision: str  # "bf16, dispatch fp8_e4m3", for the report
    values: tuple[tuple[str, int | float], ...]
    pooling: Pooling
    capacity: CapacityPlan
    memory: MemoryFigures
    transport: TransportPlan
    dedup: DedupPlan
    padding: PaddingPlan | None
    verdicts: tuple[Verdict, ...]
    warnings: tuple[str, ...] = field(default=())
    balance: BalancePlan | None = None
    compute: ComputePlan | None = None
    gemm: tuple[str, str] = ("triton", "")  # the expert GEMMs' lowering and why (rdepc.passes.lowering)
    projection: Any = None  # passes.projection.Projection, or why none was computed

    def figures(self) -> Iterator[Figure]:
        """Every figure of the plan, in report order."""
        yield from _walk(self)


def _walk(x: Any) -> Iterator[Figure]:
    if isinstance(x, Figure):
        yield x
    elif isinstance(x, tuple):
        for v in x:
            yield from _walk(v)
    elif is_dataclass(x) and not isinstance(x, HardwareProfile):
        for fl in fields(x):
            yield from _walk(getattr(x, fl.name))


# --- JSON ------------------------------------------------------------------------------


def jsonval(fig: Figure | None) -> Any:
    if fig is None:
        return None
    v = fig.value
    if isinstance(v, float) and math.isinf(v):
        return None
    if fig.unit == "B" and v is not None:
        return int(v)
    return v


def sym_json(s: SymmetricPlan) -> dict:
    return {
        "strategy": s.strategy,
        "S": jsonval(s.S),
        "B": jsonval(s.B),
        "R_ret": jsonval(s.R_ret),
        "buffers": {f.key.rsplit(".", 1)[1]: jsonval(f) for f in s.buffers},
        "forward": {f.key.rsplit(".", 1)[1]: jsonval(f) for f in s.forward},
        "forward_backward": {f.key.rsplit(".", 1)[1]: jsonval(f) for f in s.forward_backward},
        "private_total": jsonval(s.private_total),
        "shared_total": jsonval(s.shared_total),
        "inference_private_total": jsonval(s.inference_private_total),
        "inference_shared_total": jsonval(s.inference_shared_total),
    }


def _hw_json(hw) -> dict:
    values = hw.values().items()
    return {
        "name": hw.name,
        "description": hw.description,
        "values": {k: {"value": v.value, "unit": v.unit, "kind": v.kind, "source": v.source} for k, v in values},
    }


def _pooling_json(po) -> dict:
    j = jsonval
    return {
        "mu": j(po.mu),
        "mu_replica": j(po.mu_replica),
        "cv_uniform": j(po.cv_uniform),
        "owners": {
            "experts_per_owner": list(po.experts_per_owner),
            "E_min": j(po.e_min),
            "E_max": j(po.e_max),
            "asymmetry": j(po.asymmetry),
            "expected_load_max": j(po.owner_load_expected),
        },
    }


def _skew_json(sk) -> dict | None:
    if sk is None:
        return None
    j = jsonval
    return {
        "sum_p": sk.sum_p,
        "mu_e_max": j(sk.mu_e_max),
        "owner_load_max": j(sk.owner_load_max),
        "overflow_bound": j(sk.overflow_bound),
        "rows_per_expert_needed": j(sk.rows_per_expert_needed),
        "factor_needed": j(sk.factor_needed),
    }


def _capacity_json(cp) -> dict:
    j = jsonval
    return {
        "policy": cp.policy,
        "rows_per_expert": j(cp.rows_per_expert),
        "rows_per_owner": j(cp.rows_per_owner),
        "rows_per_owner_bounded_by_capacity": cp.bounded,
        "worst_owner_load": j(cp.worst_owner_load),
        "beta": j(cp.beta),
        "overflow_bound": j(cp.overflow_bound),
        "overflow_union_bound": j(cp.overflow_union_bound),
        "overflow_branch": cp.overflow_branch,
        "overflow_target": cp.target,
        "factor_needed": j(cp.factor_needed),
        "rows_per_expert_needed": j(cp.rows_per_expert_needed),
        "skew": _skew_json(cp.skew),
    }


def _memory_json(mem) -> dict:
    """The symmetric heap, the routing context, the saved activations and the training state."""
    j = jsonval
    tr = mem.training
    return {
        "symmetric_bytes": {
            "bulk_per_layer": j(mem.bulk_per_layer),
            "segmented_per_layer": j(mem.segmented_per_layer),
            "bulk_total": j(mem.bulk_total),
            "segmented_total": j(mem.segmented_total),
            "bulk_shared": j(mem.bulk_shared),
            "segmented_shared": j(mem.segmented_shared),
            "plan": sym_json(mem.plan),
        },
        "routing_context_bytes": j(mem.routing_context),
        "saved_activations": {
            "rows": j(mem.saved_rows),
            "bytes_per_row": j(mem.saved_row_bytes),
            "per_layer": j(mem.saved_per_layer),
            "total": j(mem.saved_total),
            "per_layer_expected": j(mem.saved_expected),
            "outputs_per_layer": j(mem.saved_outputs),
            "outputs_total": j(mem.saved_outputs_total),
        },
        "dense_lower_bound": None
        if mem.dense_params is None
        else {"params": j(mem.dense_params), "bytes": j(mem.dense_bytes)},
        "expert_training_state": None
        if tr is None
        else {
            "params_per_expert": j(tr.params_per_expert),
            "weights_per_layer": j(tr.weights_per_layer),
            "weights_total": j(tr.weights_total),
            "grads_total": j(tr.grads_total),
            "optimizer_total": j(tr.optimizer_total),
            "total": j(tr.total),
        },
    }


def _transport_json(tr) -> dict:
    j = jsonval
    stage_keys = ("row_bytes", "send_expected", "send_worst", "recv_expected", "recv_worst")
    return {
        "stages": {
            s.name: {
                "what": s.what,
                **{k: j(getattr(s, k)) for k in stage_keys},
                "time_expected_s": j(s.time_expected),
                "time_worst_s": j(s.time_worst),
            }
            for s in tr.stages
        },
        "barrier": {
            "per_barrier_s": j(tr.barrier),
            "per_barrier_range_s": [j(tr.barrier_low), j(tr.barrier_high)],
            "per_segment_s": j(tr.barrier_segment),
            "segments_per_layer": j(tr.segments),
            "per_layer_s": j(tr.barrier_layer),
        },
        "segment_time_s": j(tr.segment_time),
        "min_ffn": j(tr.min_ffn),
        "ffn": j(tr.ffn),
        "ffn_margin": j(tr.ffn_margin),
    }


def _padding_json(pd) -> dict | None:
    if pd is None:
        return None
    figures = ("mu", "cv", "p10", "dropped", "max_owner_load", "rho_tallest", "rho_tallest_max", "rho_tiled")
    figures += ("owners_per_token", "redundant")
    return {
        "routing": pd.routing,
        "alpha": pd.alpha,
        "seed": pd.seed,
        "counts": list(pd.counts),
        **{k: jsonval(getattr(pd, k)) for k in figures},
    }


def _dedup_json(dd) -> dict:
    figures = ("owners_per_token", "redundant", "dispatch_send", "return_recv", "bwd_dispatch_send")
    return {"enabled": dd.enabled, **{k: jsonval(getattr(dd, k)) for k in (*figures, "bwd_return_recv")}}


def _compute_json(c) -> dict:
    keys = ("routed", "routed_worst", "routed_time", "routed_worst_time", "shared", "shared_time")
    keys += tuple(f"routed_backward{w}{t}" for w in ("", "_worst") for t in ("", "_time"))
    return {k: jsonval(getattr(c, k)) for k in keys}


def _projection_json(pr) -> dict:
    if isinstance(pr, str):
        return {"skipped": pr}
    return {
        "hw": pr.hw,
        "strategy": pr.strategy,
        "gemm": pr.gemm,
        "flops_forward": pr.flops,
        "forward_s": pr.forward_s,
        "backward_s": pr.backward_s,
        "terms": {
            part: [{"name": t.name, "seconds": t.seconds, "assumption": t.assumption} for t in terms]
            for part, terms in (("forward", pr.forward), ("backward", pr.backward))
        },
        "published": [
            {k: getattr(p, k) for k in ("system", "forward_tflops", "backward_tflops", "source")} for p in pr.published
        ],
    }


def _balance_json(b) -> dict:
    figures = ("slot_bytes", "exchange_bytes", "imbalance_before", "imbalance_after", "replicas", "time_before")
    figures += ("time_after", "weight_bytes", "weight_time")
    return {"slots": b.slots, "min_rows": b.min_rows, **{k: jsonval(getattr(b, k)) for k in figures}}


def to_json(pl: Plan, formulas: bool = False) -> dict:
    """The plan as plain data (bytes as integers). With ``formulas``, each figure's formula too."""
    mem = pl.memory
    out: dict[str, Any] = {
        "layer": pl.layer,
        "file": pl.file,
        "hw": _hw_json(pl.hw),
        "strategy": pl.strategy,
        "gemm": {"lowering": pl.gemm[0], "why": pl.gemm[1]},
        "T_bound": pl.t_bound,
        "values": dict(pl.values),
        **_pooling_json(pl.pooling),
        "capacity": _capacity_json(pl.capacity),
        **_memory_json(mem),
        "transport": _transport_json(pl.transport),
        "padding": _padding_json(pl.padding),
        "dedup": _dedup_json(pl.dedup),
        "verdicts": [
            {"budget": v.budget, "bytes": v.bytes, "hbm": v.hbm, "fits": v.fits, "margin": v.margin}
            for v in pl.verdicts
        ],
        "warnings": list(pl.warnings),
    }
    if pl.compute is not None:
        out["compute"] = _compute_json(pl.compute)
    if pl.projection is not None:
        out["projection"] = _projection_json(pl.projection)
    if pl.balance is not None:  # only when asked for, so other layers' JSON stays as it was
        out["balance"] = _balance_json(pl.balance)
    if mem.alternative is not None:
        name = "plan_bulk" if mem.alternative.strategy == "bulk" else "plan_segmented"
        out["symmetric_bytes"][name] = sym_json(mem.alternative)
    if formulas:
        out["formulas"] = {fig.key: str(fig.formula) for fig in pl.figures() if fig.formula is not None}
        out["symbols"] = dict(SYMBOLS_DOC)
    return out
