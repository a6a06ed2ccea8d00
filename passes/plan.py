"""The planner: capacity, memory, transport and padding arithmetic for one layer.

``plan(spec, options)`` is a pure function of a checked :class:`LayerSpec` and returns a
frozen :class:`Plan`. Every figure is a sympy expression in named symbols (``W``, ``T``,
``K``, ``E``, ``H``, ``F``, ``S``, ``B``, ``L``, ``f``, ...) built with ``sympy.Symbol``,
then evaluated at the spec's values, so ``rdepc plan --symbolic`` can print the formula
behind every number. The only constants are byte sizes, the RDEP paper's formula
constants (cited where they enter), hardware-profile values (with their source, from
:mod:`rdepc.passes.hardware`), and the two layout constants of rdepc itself: the buffer
alignment of docs/memory.md (``ALIGN``) and the grouped-GEMM tile height (``BM``).

``symmetric_plan(spec, strategy)`` is the symmetric heap of docs/memory.md, region by
region; the memory-plan pass is checked against it. numpy is imported only to sample a
routing (``--routing``). Neither torch nor triton is imported.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import sympy as sp
from rdepc.passes.graph import geometry, max_over_tokens
from rdepc.passes.hardware import PROFILES, HardwareProfile, profile
from rdepc.passes.routing import owners_per_token_expr, sample_routing

from rdepc.diagnostics import Diagnostics, Span
from rdepc.ir.graph import BM
from rdepc.ir.graph import BM as COMBINE_TOKENS
from rdepc.ir.spec import LayerSpec

ALIGN = 256  # bytes: every symmetric buffer is padded to a multiple of this (docs/memory.md)
STRATEGIES = ("bulk", "pipelined", "deep")
SEGMENTED = ("pipelined", "deep")

# The paper's formula constants, each where the paper states it.
PAPER_TENSORS = 4  # Table 4: dispatch and return, forward and backward, routed row tensors
CTX_BYTES_PER_ROW = 8  # eq. 20: row identity and gate state per accepted route row
BARRIERS_PER_SEGMENT = 4  # Prop. B.7
BARRIER_PEER_RANGE = (50e-9, 100e-9)  # Prop. B.7: seconds per peer touch
OVERLAP_BYTES, OVERLAP_FLOPS = 10, 18  # Table 5: minimum D_ff = (10/18) F_gpu / B_eff

INT64, INT32, FP32 = 8, 4, 4  # bytes of the control words and of a gate (docs/memory.md)


def _sym(name: str) -> sp.Symbol:
    return sp.Symbol(name, positive=True)


# Every symbol a figure may use. Integer-valued sizes carry integer=True so that sympy
# keeps ceilings of whole expressions exact.
W, T, H, E, K, F = (sp.Symbol(n, positive=True, integer=True) for n in ("W", "T", "H", "E", "K", "F"))
S, B, L = (sp.Symbol(n, positive=True, integer=True) for n in ("S", "B", "L"))
E_max, E_min = (sp.Symbol(n, positive=True, integer=True) for n in ("E_max", "E_min"))
C = sp.Symbol("C", positive=True, integer=True)  # rows per expert, policy "rows"
f = _sym("f")  # capacity factor
d, a, sb = (sp.Symbol(n, positive=True, integer=True) for n in ("d", "a", "sb"))
V, L_all = (sp.Symbol(n, positive=True, integer=True) for n in ("V", "L_all"))
L_dense, D_dense = (sp.Symbol(n, nonnegative=True, integer=True) for n in ("L_dense", "D_dense"))
F_gpu, B_eff, t_b = _sym("F_gpu"), _sym("B_eff"), _sym("t_b")
P = _sym("P")  # target overflow probability
beta = sp.Symbol("beta", real=True)
p = _sym("p")  # one expert's selection probability (--probs)
# Intermediate figures other formulas are written in (defined by MU_DEF, cap_expr, ...).
mu = _sym("mu")
cap_e = sp.Symbol("cap_e", positive=True, integer=True)
R_max = sp.Symbol("R_max", positive=True, integer=True)

SYMBOLS_DOC = {
    "W": "ranks (DP = EP = W)",
    "T": "tokens per rank (its bound when symbolic)",
    "H": "hidden size",
    "E": "routed experts",
    "K": "experts per token",
    "F": "expert ffn width",
    "L": "MoE layers",
    "S": "rows per segment (ring slot)",
    "B": "segment buffers (ring slots)",
    "E_max": "most experts one rank owns",
    "E_min": "fewest experts one rank owns",
    "f": "capacity factor",
    "C": "rows per expert (capacity rows)",
    "d": "dispatch dtype bytes",
    "a": "dtype bytes",
    "sb": "sideband bytes per row",
    "V": "vocabulary",
    "L_all": "decoder layers",
    "L_dense": "dense FFN layers",
    "D_dense": "dense FFN width",
    "F_gpu": "expert GEMM FLOP/s (profile)",
    "B_eff": "NVLink bytes/s per direction (profile)",
    "t_b": "seconds per peer touch of a barrier (profile)",
    "P": "target overflow probability",
    "mu": "mean rows per expert, W·T·K/E",
    "cap_e": "rows admitted per expert (capacity)",
    "R_max": "rows the busiest owner may hold: min(W·T·min(K, E_max), E_max·cap_e)",
    "beta": "capacity slack, cap_e/mu - 1",
}


def _pad(x: sp.Expr) -> sp.Expr:
    return ALIGN * sp.ceiling(x / ALIGN)


# --- options and the plan --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanOptions:
    hw: str = "h100"
    overflow: float = 1e-6  # target probability that any expert overflows its capacity
    routing: str | None = None  # None | "uniform" | "zipf"
    alpha: float = 0.0  # zipf exponent
    seed: int = 0
    probs: tuple[float, ...] | None = None  # per-expert selection probabilities p_e
    strategy: str | None = None  # None: the spec's schedule (auto: segmented iff a segment)


@dataclass(frozen=True, slots=True)
class Figure:
    """One number of the plan: its formula, its value at the spec's sizes, and its meaning."""

    key: str  # dotted JSON path
    formula: Any  # a sympy expression (or None for a sampled figure)
    value: int | float | None
    unit: str  # B, rows, s, %, x, params, FLOP/B, "" (a plain number)
    what: str  # the accounting in words


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

    def regions(self, phase: str) -> dict[str, int]:
        return {fig.key.rsplit(".", 1)[1]: fig.value for fig in getattr(self, phase)}


@dataclass(frozen=True, slots=True)
class MemoryPlan:
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
    memory: MemoryPlan
    transport: TransportPlan
    dedup: DedupPlan
    padding: PaddingPlan | None
    verdicts: tuple[Verdict, ...]
    warnings: tuple[str, ...] = field(default=())

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


# --- evaluation ------------------------------------------------------------------------


class _Env:
    """The symbol table of one spec: symbol → value, and figure construction."""

    def __init__(self, values: dict[sp.Symbol, Any], policy: str):
        self.values = {k: v for k, v in values.items() if v is not None}
        self._exact = {k: _exact(v) for k, v in self.values.items()}
        self.define(mu, MU_DEF)
        self.define(cap_e, cap_expr(policy))
        self.define(R_max, rows_per_owner_expr(policy))

    def define(self, sym: sp.Symbol, expr: sp.Expr) -> None:
        """Give an intermediate symbol its value, computed from its own formula."""
        r = expr.xreplace(self._exact)
        self._exact[sym] = r
        self.values[sym] = _number(r)

    def value(self, expr: Any) -> int | float | None:
        if expr is None:
            return None
        r = expr.xreplace(self._exact) if isinstance(expr, sp.Basic) else expr
        return _number(r)

    def fig(self, key: str, expr: Any, unit: str, what: str) -> Figure:
        return Figure(key, expr, self.value(expr), unit, what)


def _exact(v: Any) -> sp.Basic:
    if isinstance(v, sp.Basic):
        return v
    return sp.Float(v) if isinstance(v, float) else sp.Integer(v)


def _number(r: Any) -> int | float:
    if isinstance(r, int | float):
        return r
    if r is sp.oo:
        return math.inf
    if isinstance(r, sp.Integer):
        return int(r)
    if isinstance(r, sp.Basic) and not r.is_number:
        raise ValueError(f"a figure has free symbols left: {r}")
    return float(r)


def _int(expr: Any, spec: LayerSpec) -> int:
    """A spec size as an int (T at its bound when T is symbolic)."""
    if isinstance(expr, sp.Basic) and expr.free_symbols:
        expr = expr.subs(spec.shape.T, spec.shape.T_max)
    return int(expr)


def resolve_strategy(spec: LayerSpec, strategy: str | None = None) -> str:
    """bulk | pipelined | deep: ``auto`` is segmented iff the spec has a segment statement."""
    s = strategy or spec.schedule
    if s == "auto":
        return "pipelined" if spec.segment is not None else "bulk"
    if s not in STRATEGIES:
        raise ValueError(f"unknown strategy '{s}' (known: auto, {', '.join(STRATEGIES)})")
    return s


def _spec_values(spec: LayerSpec, strategy: str, rows: int | None = None, buffers: int | None = None) -> dict:
    sh = spec.shape
    Wv = int(sh.W)
    per_rank = spec.ownership.experts_per_rank(Wv)
    cap = spec.capacity
    seg = spec.segment
    Sv = rows if rows is not None else (_int(seg.rows, spec) if seg is not None else None)
    Bv = buffers if buffers is not None else (_int(seg.buffers, spec) if seg is not None else None)
    if strategy in SEGMENTED and (Sv is None or Bv is None):
        raise ValueError(f"strategy '{strategy}' needs segment rows and buffers: the spec has no segment statement")
    if strategy in SEGMENTED and spec.dedup:  # every segment resident (passes.graph.geometry)
        Bv = geometry(spec, strategy, S=Sv, B=Bv).B
    m = spec.model
    return {
        W: Wv,
        T: sh.T_max,
        H: _int(sh.H, spec),
        E: _int(sh.E, spec),
        K: _int(sh.K, spec),
        F: _int(spec.expert.F, spec),
        L: _int(m.moe_layers, spec),
        S: Sv,
        B: Bv,
        E_max: max(per_rank),
        E_min: min(per_rank),
        f: sp.Rational(cap.factor) if cap.policy == "factor" else None,
        C: max_over_tokens(cap.rows, spec) if cap.policy == "rows" else None,  # the largest over T' <= T
        d: spec.precision.dispatch.bytes,
        a: spec.precision.dtype.bytes,
        sb: spec.route_row.sideband_bytes,
        V: _int(m.vocab, spec) if m.vocab is not None else None,
        L_all: _int(m.layers, spec) if m.layers is not None else None,
        L_dense: _int(m.dense_layers, spec) if m.dense_layers is not None else 0,
        D_dense: _int(m.dense_ffn, spec) if m.dense_ffn is not None else 0,
    }


# --- the formulas ----------------------------------------------------------------------

MU_DEF = W * T * K / E  # eq. 2 with DP = W


def cap_expr(policy: str) -> sp.Expr:
    """cap_e, rows one owner admits for one expert: ceil(f·μ), C, or ∞ (dropless)."""
    if policy == "dropless":
        return sp.oo
    if policy == "rows":
        return C
    return sp.ceiling(f * mu)


def worst_owner_load_expr() -> sp.Expr:
    """Rows the busiest owner receives when every token picks distinct experts on it."""
    return W * T * sp.Min(K, E_max)


def rows_per_owner_expr(policy: str) -> sp.Expr:
    """R_max = max_q R_q: the worst case, capped by Σ_{e owned by q} cap_e (both grow with
    E_loc(q), so the maximum is at E_max)."""
    if policy == "dropless":
        return worst_owner_load_expr()
    return sp.Min(worst_owner_load_expr(), E_max * cap_e)


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


def symmetric_formulas(strategy: str, keyed: bool = False, dedup: bool = False) -> dict[str, dict[str, sp.Expr]]:
    """docs/memory.md as formulas: ``{"S", "B", "R_ret", "buffers", "forward", "forward_backward"}``.
    Bulk uses ``S = R_max`` (:func:`rows_per_owner_expr`); ``keyed`` admission adds the keys,
    ``dedup`` the backward's sideband and gate gradients."""
    # Done counters per rank (memplan.flag_slots): route, scan, combine wait, the combine
    # tiles, W·n dispatches, n GEMM1s and n GEMM2s, W·n returns and, with a rotating return ring, W·n
    # unpacks, where n is the busiest owner's segments.
    tiles = 3 + sp.ceiling(T / COMBINE_TOKENS)
    if strategy in SEGMENTED:
        Sx, Bx, R_ret = S, B, B * S
        # the return ring rotates (claims, unpacks) only when its B·S rows cannot hold all T·K
        ids = sp.Piecewise((R_ret * INT64, B * S < T * K), (sp.Integer(0), True))
        n = sp.ceiling(R_max / S)
        done = tiles + (2 * W + 2) * n + sp.Piecewise((W * n, B * S < T * K), (sp.Integer(0), True))
    elif strategy == "bulk":
        Sx, Bx, R_ret = R_max, sp.Integer(1), T * K
        ids = sp.Integer(0)  # every row lands at its (token, slot) place: nothing to decode
        done = tiles + 2 * W + 2
    else:
        raise ValueError(f"unknown strategy '{strategy}'")
    buf = {
        "tokens": _pad(W * INT64),
        "counts": _pad(W * E_max * INT32),
        "offsets": _pad(W * E_max * INT32),
        "admitted": _pad(W * E_max * INT32),
        "keys": _pad(W * T * K * INT64) if keyed else sp.Integer(0),  # keyed admission (LayerSpec)
        "flags": _pad(done * INT64),
        "payload": _pad(Bx * Sx * H * d),
        "sideband": _pad(Bx * Sx * sb),
        "return": _pad(R_ret * H * a),
        "return_ids": _pad(ids),
        "bwd_flags": _pad((done + 1) * INT64),
        "bwd_payload": _pad(Bx * Sx * H * a),
        "bwd_row_ids": _pad(Bx * Sx * INT64),
        "bwd_sideband": _pad(Bx * Sx * (FP32 + 2 * INT32)) if dedup else sp.Integer(0),
        "bwd_return": _pad(R_ret * H * a),
        "bwd_return_ids": _pad(ids),
        "bwd_dgate": _pad(T * K * FP32) if dedup else sp.Integer(0),
    }
    control = sum((buf[k] for k in ("tokens", "counts", "offsets", "admitted", "keys", "flags")), sp.Integer(0))
    ret = buf["return"] + buf["return_ids"]
    fwd = {"control": control, "payload": buf["payload"], "sideband": buf["sideband"], "return": ret}
    fwd["total"] = sum(fwd.values(), sp.Integer(0))
    fb = {k: v for k, v in fwd.items() if k != "total"}
    fb["bwd_control"] = buf["bwd_flags"]
    fb["bwd_payload"] = buf["bwd_payload"] + buf["bwd_row_ids"] + buf["bwd_sideband"]
    fb["bwd_return"] = buf["bwd_return"] + buf["bwd_return_ids"] + buf["bwd_dgate"]
    fb["total"] = fwd["total"] + fb["bwd_control"] + fb["bwd_payload"] + fb["bwd_return"]
    return {"S": Sx, "B": Bx, "R_ret": R_ret, "buffers": buf, "forward": fwd, "forward_backward": fb}


_BUFFER_WHAT = {
    "tokens": "W int64: the tokens T' each front-end brings to the call",
    "counts": "W·E_max int32 rows each source sends to each local expert",
    "offsets": "W·E_max int32 write bases published back to each source",
    "admitted": "W·E_max int32 admitted rows per (owner, local expert)",
    "keys": "W·T·K int64 admission keys published to the owner (keyed admission; else 0)",
    "flags": "int64 done counters of the tasks one rank runs (ready flags and credits): "
    "3 + ⌈T/128⌉ + (2W+2)·n + W·n if the return ring rotates, n = ⌈R_max/S⌉ segments (bulk: 1)",
    "payload": "B·S dispatched rows of H·d bytes",
    "sideband": "B·S rows of sb bytes (row_id, local expert, gate, scale)",
    "return": "R_ret returned rows of H·a bytes",
    "return_ids": "int64 row_id per return-ring row (R_ret·8 if the ring rotates, else 0): unpacks place rows by it",
    "bwd_flags": "int64 done counters of the backward's tasks: the forward's, and one weight-gradient task per owner",
    "bwd_payload": "B·S g'·dL/dy rows of H·a bytes, front-end → owner",
    "bwd_row_ids": "B·S int64 row_ids of the backward payload rows",
    "bwd_sideband": "dedup: B·S rows of 12 bytes (g', links) beside the backward payload (else 0)",
    "bwd_return": "R_ret dL/dx rows of H·a bytes, owner → front-end",
    "bwd_return_ids": "int64 row_id per backward return-ring row (as return_ids)",
    "bwd_dgate": "dedup: T·K fp32 dL/dg' per (token, slot), owner → front-end (else 0)",
}

_REGION_WHAT = {
    "control": "tokens, counts, offsets, admitted, flags (each padded)",
    "payload": _BUFFER_WHAT["payload"],
    "sideband": _BUFFER_WHAT["sideband"],
    "return": "R_ret returned rows of H·a bytes, then their int64 row_ids if the ring rotates (each padded)",
    "bwd_control": _BUFFER_WHAT["bwd_flags"],
    "bwd_payload": "B·S g'·dL/dy rows of H·a bytes, their int64 row_ids, dedup's (g', links) (each padded)",
    "bwd_return": "R_ret dL/dx rows of H·a bytes, their int64 row_ids if the ring rotates, dedup's dL/dg' "
    "(each padded)",
    "total": "sum of the regions",
}


def symmetric_plan(
    spec: LayerSpec, strategy: str | None = None, *, rows: int | None = None, buffers: int | None = None
) -> dict:
    """The symmetric heap of one layer per rank, exactly as docs/memory.md defines it.

    ``strategy`` is bulk, pipelined, deep, auto (segmented iff the spec has a segment
    statement) or None (the spec's own schedule, resolved the same way). ``rows`` and
    ``buffers`` override the segment's S and B (for a schedule that chooses them).
    Returns plain ints::

        {"strategy", "S", "B", "R_ret", "buffers": {name: padded bytes},
         "forward": {"control", "payload", "sideband", "return", "total"},
         "forward_backward": {... forward regions, "bwd_control", "bwd_payload", "bwd_return", "total"}}
    """
    strategy = resolve_strategy(spec, strategy)
    env = _Env(_spec_values(spec, strategy, rows, buffers), spec.capacity.policy)
    fm = symmetric_formulas(strategy, spec.keyed_admission, spec.dedup)
    return {
        "strategy": strategy,
        "S": env.value(fm["S"]),
        "B": env.value(fm["B"]),
        "R_ret": env.value(fm["R_ret"]),
        "buffers": {k: env.value(v) for k, v in fm["buffers"].items()},
        "forward": {k: env.value(v) for k, v in fm["forward"].items()},
        "forward_backward": {k: env.value(v) for k, v in fm["forward_backward"].items()},
    }


def _symmetric(env: _Env, strategy: str, key: str, spec: LayerSpec) -> SymmetricPlan:
    sideband = spec.route_row.sideband
    fm = symmetric_formulas(strategy, spec.keyed_admission, spec.dedup)
    what = dict(_BUFFER_WHAT, sideband=f"B·S rows of sb bytes ({', '.join(sideband)})")
    region_what = dict(_REGION_WHAT, sideband=what["sideband"])
    segmented = strategy in SEGMENTED
    s_what = "S_bulk = max_q R_q rows, one slot"
    if segmented:
        chosen = "segment statement" if spec.segment is not None else "chosen by the cost model: no segment statement"
        s_what = f"rows per ring slot ({chosen})"
    r_what = "B·S: a ring of B slots of S rows" if segmented else "T·K: every sent row lands in its own place"
    return SymmetricPlan(
        strategy,
        env.fig(f"{key}.S", fm["S"], "rows", s_what),
        env.fig(f"{key}.B", fm["B"], "", "ring slots" if segmented else "one slot (bulk)"),
        env.fig(f"{key}.R_ret", fm["R_ret"], "rows", r_what),
        tuple(env.fig(f"{key}.buffers.{k}", v, "B", what[k]) for k, v in fm["buffers"].items()),
        tuple(env.fig(f"{key}.forward.{k}", v, "B", region_what[k]) for k, v in fm["forward"].items()),
        tuple(
            env.fig(f"{key}.forward_backward.{k}", v, "B", region_what[k]) for k, v in fm["forward_backward"].items()
        ),
        env.fig(
            f"{key}.private_total",
            fm["forward_backward"]["total"] * L,
            "B",
            "forward+backward heap × L (a private ring per layer)",
        ),
        env.fig(
            f"{key}.shared_total",
            fm["forward_backward"]["total"],
            "B",
            "forward+backward heap once (one ring shared by layers run one after another)",
        ),
    )


# --- numeric helpers (also the test oracle) ---------------------------------------------


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


# --- the planner -----------------------------------------------------------------------


def plan(spec: LayerSpec, options: PlanOptions | None = None) -> Plan:
    opts = options or PlanOptions()
    hw = profile(opts.hw)
    if not 0 < opts.overflow < 1:
        raise ValueError(f"overflow target must be in (0, 1), got {opts.overflow}")
    strategy = resolve_strategy(spec, opts.strategy)
    rows = buffers = None
    if strategy in SEGMENTED and spec.segment is None:
        # No segment statement: the S and B the scheduler chooses on this profile, as compile does.
        from rdepc.passes.schedule import resolve

        choice = resolve(spec, strategy, hw=opts.hw)
        rows, buffers = choice.S, choice.B
    values = _spec_values(spec, strategy, rows, buffers)
    values.update({F_gpu: hw.flops.value, B_eff: hw.link.value, t_b: hw.barrier_per_peer.value, P: opts.overflow})
    policy = spec.capacity.policy
    env = _Env(values, policy)
    Wv = values[W]
    per_rank = spec.ownership.experts_per_rank(Wv)
    warnings: list[str] = []

    # -- pooling ---------------------------------------------------------------------------
    pooling = Pooling(
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
    mu_v = pooling.mu.value

    # -- capacity --------------------------------------------------------------------------
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
    bounded = policy != "dropless" and rpo.value < worst.value
    # the inverse first (beta still free): bisection on the same bound; the closed form is the formula
    bn = beta_needed_expr()
    fn = sp.lambdify(beta, union_bound_expr().xreplace(env._exact), "math")
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
        math.ceil((1 + b_needed) * float(mu_v) - 1e-9),
        "rows",
        "cap_e that meets the overflow target, ceil((1+β)·μ)",
    )
    if policy == "dropless":
        beta_fig = union_fig = None
        bound_fig = env.fig("capacity.overflow_bound", sp.Integer(0), "prob", "dropless: every row is admitted")
        branch = "dropless"
    else:
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
    skew = _skew(env, opts, values, spec, warnings) if opts.probs is not None else None
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

    # -- memory ----------------------------------------------------------------------------
    bulk_pl = PAPER_TENSORS * W * T * K * H * d
    seg_pl = PAPER_TENSORS * B * S * H * d
    has_seg = spec.segment is not None
    t4 = "Table 4: 4 routed row tensors (dispatch, return; fwd, bwd)"
    sym = _symmetric(env, strategy, "symmetric_bytes.plan", spec)
    alt = None
    if strategy in SEGMENTED:
        alt = _symmetric(env, "bulk", "symmetric_bytes.plan_bulk", spec)
    elif has_seg:
        alt = _symmetric(env, "pipelined", "symmetric_bytes.plan_segmented", spec)
    out_rows = R_max if spec.dedup else T * K  # where the expert outputs wait for the backward
    saved_rows = env.fig(
        "saved_activations.rows", R_max, "rows", "the busiest owner's rows (worst case, capped by capacity)"
    )
    row_width = H + 2 * F if spec.expert.gated else H + F
    saved_row = env.fig(
        "saved_activations.bytes_per_row",
        row_width * a,
        "B",
        ("(H + 2F)·a: input row x and the gate and up pre-activations" if spec.expert.gated else "(H + F)·a: x, h"),
    )
    dense_params = dense_bytes = None
    if values.get(V) is not None and values.get(L_all) is not None:
        dp = V * H + 4 * L_all * H**2 + 3 * L_dense * H * D_dense
        dense_params = env.fig(
            "dense_lower_bound.params",
            dp,
            "params",
            "eq. 21: V·H embeddings + 4·L·H² attention + 3·L_dense·H·D_dense dense FFN",
        )
        dense_bytes = env.fig("dense_lower_bound.bytes", dp * a, "B", "the same at the dtype, replicated on every rank")
    memory = MemoryPlan(
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
        env.fig("saved_activations.per_layer", R_max * row_width * a, "B", "owner rows × (H + 2F)·a, one layer"),
        env.fig("saved_activations.total", R_max * row_width * a * L, "B", "× L MoE layers"),
        env.fig(
            "saved_activations.per_layer_expected",
            sp.Min(E_max * mu, R_max) * row_width * a,
            "B",
            "the same for the expected load min(E_max·μ, R_max), one layer",
        ),
        env.fig(
            "saved_activations.outputs_per_layer",
            out_rows * H * a,
            "B",
            "R_max·H·a: each row's expert output at its owner (dedup returns them summed), for the gate "
            "gradient, one layer"
            if spec.dedup
            else "T·K·H·a: each slot's expert output at its front-end, for the gate gradient, one layer",
        ),
        env.fig("saved_activations.outputs_total", out_rows * H * a * L, "B", "× L MoE layers"),
        dense_params,
        dense_bytes,
    )

    # -- transport -------------------------------------------------------------------------
    transport = _transport(env, strategy)
    if transport.min_ffn.value > values[F]:
        warnings.append(
            f"expert ffn {values[F]} is below {transport.min_ffn.value:.0f}, the width at which grouped-GEMM "
            f"compute hides transport on {hw.name} (Table 5 rule): transport will show"
        )

    # -- padding (sampled) -----------------------------------------------------------------
    padding = None
    if opts.routing is not None:
        seg_rows = sym.S.value if strategy in SEGMENTED else None
        padding = _padding(spec, opts, values, per_rank, seg_rows, env.values[cap_e])

    # -- warnings and verdicts --------------------------------------------------------------
    if strategy in SEGMENTED:
        fewest = min(k for k in per_rank if k > 0)
        low = min(fewest * mu_v, env.values[R_max])
        if values[S] > low:
            warnings.append(
                f"segment of {values[S]} rows is larger than the expected load of an owner with {fewest} "
                f"expert(s) ({_g(low)} rows): that owner fills less than one segment, nothing overlaps"
            )
    if mu_v < BM:
        warnings.append(
            f"mu = {_g(mu_v)} rows per expert is below one {BM}-row tile: expert GEMMs launch mostly padding "
            f"(pool more ranks or tokens)"
        )
    hbm = int(hw.hbm.value)
    budgets = [
        ("symmetric heap, rdepc plan fwd+bwd, private ring per layer", sym.private_total.value),
        ("symmetric heap, rdepc plan fwd+bwd, one shared ring", sym.shared_total.value),
        ("paper bulk, all layers (Table 4)", memory.bulk_total.value),
    ]
    if memory.segmented_total is not None:
        budgets.append(("paper segmented, all layers (Table 4)", memory.segmented_total.value))
    budgets.append(("routing context (eq. 20)", memory.routing_context.value))
    budgets.append(("owner activations saved for backward, all layers", memory.saved_total.value))
    budgets.append(("expert outputs saved for the gate gradient, all layers", memory.saved_outputs_total.value))
    if dense_bytes is not None:
        budgets.append(("replicated dense weights, lower bound (eq. 21)", dense_bytes.value))
    together = sym.private_total.value + memory.routing_context.value + memory.saved_total.value
    together += memory.saved_outputs_total.value
    together += dense_bytes.value if dense_bytes is not None else 0
    budgets.append(
        (
            "together: private-ring heap + routing context + saved activations" + (" + dense" if dense_bytes else ""),
            together,
        )
    )
    verdicts = tuple(Verdict(name, int(v), hbm, int(v) <= hbm) for name, v in budgets)
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
        tuple((str(k), _number(v)) for k, v in env.values.items()),
        pooling,
        capacity,
        memory,
        transport,
        _dedup(env, spec, per_rank),
        padding,
        verdicts,
        tuple(warnings),
    )


def _g(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def _skew(env: _Env, opts: PlanOptions, values: dict, spec: LayerSpec, warnings: list[str]) -> SkewBound:
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


def _max(x: sp.Expr, y: sp.Expr) -> sp.Expr:
    return sp.Max(x, y, evaluate=False)  # evaluated when the values are in


def _transport(env: _Env, strategy: str) -> TransportPlan:
    disp_row = H * d + sb
    ret_row = H * a
    expected_owner = E_max * mu
    admitted = sp.Min(expected_owner, R_max)  # a capacity below the mean load caps it
    segmented = strategy in SEGMENTED

    def stage(name: str, what: str, row: sp.Expr, front_to_owner: bool) -> Stage:
        key = f"transport.{name}"
        front = T * K * row
        owner_exp, owner_worst = admitted * row, R_max * row
        send_e, send_w = (front, front) if front_to_owner else (owner_exp, owner_worst)
        recv_e, recv_w = (owner_exp, owner_worst) if front_to_owner else (front, front)
        return Stage(
            name,
            what,
            env.fig(f"{key}.row_bytes", row, "B", "bytes per row on the wire"),
            env.fig(f"{key}.send_expected", send_e, "B", "bytes the busiest rank sends, uniform routing"),
            env.fig(f"{key}.send_worst", send_w, "B", "bytes the busiest rank sends, worst case"),
            env.fig(f"{key}.recv_expected", recv_e, "B", "bytes the busiest rank receives, uniform routing"),
            env.fig(f"{key}.recv_worst", recv_w, "B", "bytes the busiest rank receives, worst case"),
            env.fig(f"{key}.time_expected", _max(send_e, recv_e) / B_eff, "s", "max(send, recv) / B_eff"),
            env.fig(f"{key}.time_worst", _max(send_w, recv_w) / B_eff, "s", "max(send, recv) / B_eff"),
        )

    stages = (
        stage("dispatch", "payload + sideband, front-end → owner: T·K rows of H·d + sb bytes", disp_row, True),
        stage("return", "expert outputs, owner → front-end: rows of H·a bytes", ret_row, False),
        stage("bwd_dispatch", "dL/dy rows, front-end → owner: T·K rows of H·a bytes", ret_row, True),
        stage("bwd_return", "dL/dx rows, owner → front-end: rows of H·a bytes", ret_row, False),
    )
    segs = sp.ceiling(admitted / S) if segmented else sp.Integer(1)
    lo, hi = BARRIER_PEER_RANGE
    return TransportPlan(
        stages,
        env.fig("transport.barrier.per_barrier", W * t_b, "s", "one phase barrier: W peer touches (Prop. B.7)"),
        env.fig("transport.barrier.per_barrier_low", (W * t_b).subs(t_b, lo), "s", "at 50 ns per peer (Prop. B.7)"),
        env.fig("transport.barrier.per_barrier_high", (W * t_b).subs(t_b, hi), "s", "at 100 ns per peer (Prop. B.7)"),
        env.fig(
            "transport.barrier.per_segment",
            BARRIERS_PER_SEGMENT * W * t_b,
            "s",
            "4 barriers per segment (Prop. B.7)",
        ),
        env.fig(
            "transport.barrier.segments",
            segs,
            "",
            "segments the busiest owner runs per layer, ceil(min(E_max·μ, R_max)/S)"
            if segmented
            else "bulk: one exchange",
        ),
        env.fig(
            "transport.barrier.per_layer",
            segs * BARRIERS_PER_SEGMENT * W * t_b,
            "s",
            "segments × 4 barriers × W × t_b, forward",
        ),
        env.fig("transport.segment_time", S * disp_row / B_eff, "s", "one segment's dispatch, S·(H·d + sb)/B_eff")
        if segmented
        else None,
        env.fig(
            "transport.min_ffn",
            sp.Rational(OVERLAP_BYTES, OVERLAP_FLOPS) * F_gpu / B_eff,
            "",
            "Table 5: smallest D_ff with grouped-GEMM compute ≥ transport, (10/18)·F_gpu/B_eff",
        ),
        env.fig("transport.ffn", F, "", "the spec's expert ffn width"),
        env.fig(
            "transport.ffn_margin",
            F / (sp.Rational(OVERLAP_BYTES, OVERLAP_FLOPS) * F_gpu / B_eff),
            "x",
            "F over the minimum",
        ),
    )


def transport_bytes(spec: LayerSpec, payload_rows, route_rows, returned_rows, dedup: bool | None = None, sizes=None):
    """(dispatch, return) bytes of one call's transport: ``payload_rows`` rows sent with their
    data (and fp8 scales), every one of ``route_rows`` accepted route rows with the rest of its
    sideband (under ``dedup``, default the spec's, with its links), ``returned_rows`` rows of
    H·a bytes back. ``sizes`` (H, d, a, sb): the spec's, or the planner's symbols; the counts
    ints or sympy expressions alike (the planner's figures and ``rdepc run``'s counts)."""
    rr = spec.route_row
    if sizes is None:
        sizes = (_int(spec.shape.H, spec), spec.precision.dispatch.bytes, spec.precision.dtype.bytes, rr.sideband_bytes)
    H_, d_, a_, sb_ = sizes
    scale = rr.field_bytes("scale") if "scale" in rr.sideband else 0
    on = spec.dedup if dedup is None else dedup
    links = rr.field_bytes("links") if on and "links" not in rr.sideband else 0  # in sb when the spec has it
    return payload_rows * (H_ * d_ + scale) + route_rows * (sb_ - scale + links), returned_rows * H_ * a_


def _dedup(env: _Env, spec: LayerSpec, per_rank: Sequence[int]) -> DedupPlan:
    owners = owners_per_token_expr(E, K, per_rank)
    send, back = transport_bytes(spec, T * owners, T * K, T * owners, True, (H, d, a, sb))
    return DedupPlan(
        spec.dedup,
        env.fig(
            "dedup.owners_per_token",
            owners,
            "",
            "expected distinct owners of a token's K experts, uniform routing: Σ_q 1 - C(E - E_q, K)/C(E, K)",
        ),
        env.fig("dedup.redundant", 1 - owners / K, "frac", "route rows that repeat a (token, owner) pair"),
        env.fig(
            "dedup.dispatch_send",
            send,
            "B",
            "bytes a front-end dispatches with dedup: a payload row (and its scales) per (token, owner), "
            "the rest of the sideband and the links per slot",
        ),
        env.fig(
            "dedup.return_recv",
            back,
            "B",
            "bytes a front-end receives back with dedup, one summed row per (token, owner)",
        ),
        env.fig(
            "dedup.bwd_dispatch_send",
            T * owners * H * a + T * K * (INT64 + FP32 + 2 * INT32),
            "B",
            "backward: a dL/dy row per (token, owner), and per slot its row_id, g' and links",
        ),
        env.fig(
            "dedup.bwd_return_recv",
            T * owners * H * a + T * K * FP32,
            "B",
            "backward: a summed dL/dx row per (token, owner), and per slot its fp32 dL/dg'",
        ),
    )


def _padding(
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


# --- JSON ------------------------------------------------------------------------------


def _jsonval(fig: Figure | None) -> Any:
    if fig is None:
        return None
    v = fig.value
    if isinstance(v, float) and math.isinf(v):
        return None
    if fig.unit == "B" and v is not None:
        return int(v)
    return v


def _sym_json(s: SymmetricPlan) -> dict:
    return {
        "strategy": s.strategy,
        "S": _jsonval(s.S),
        "B": _jsonval(s.B),
        "R_ret": _jsonval(s.R_ret),
        "buffers": {f.key.rsplit(".", 1)[1]: _jsonval(f) for f in s.buffers},
        "forward": {f.key.rsplit(".", 1)[1]: _jsonval(f) for f in s.forward},
        "forward_backward": {f.key.rsplit(".", 1)[1]: _jsonval(f) for f in s.forward_backward},
        "private_total": _jsonval(s.private_total),
        "shared_total": _jsonval(s.shared_total),
    }


def to_json(pl: Plan, formulas: bool = False) -> dict:
    """The plan as plain data (bytes as integers). With ``formulas``, each figure's formula too."""
    po, cp, mem, tr = pl.pooling, pl.capacity, pl.memory, pl.transport
    j = _jsonval
    out: dict[str, Any] = {
        "layer": pl.layer,
        "file": pl.file,
        "hw": {
            "name": pl.hw.name,
            "description": pl.hw.description,
            "values": {
                k: {"value": v.value, "unit": v.unit, "kind": v.kind, "source": v.source}
                for k, v in pl.hw.values().items()
            },
        },
        "strategy": pl.strategy,
        "T_bound": pl.t_bound,
        "values": dict(pl.values),
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
        "capacity": {
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
            "skew": None
            if cp.skew is None
            else {
                "sum_p": cp.skew.sum_p,
                "mu_e_max": j(cp.skew.mu_e_max),
                "owner_load_max": j(cp.skew.owner_load_max),
                "overflow_bound": j(cp.skew.overflow_bound),
                "rows_per_expert_needed": j(cp.skew.rows_per_expert_needed),
                "factor_needed": j(cp.skew.factor_needed),
            },
        },
        "symmetric_bytes": {
            "bulk_per_layer": j(mem.bulk_per_layer),
            "segmented_per_layer": j(mem.segmented_per_layer),
            "bulk_total": j(mem.bulk_total),
            "segmented_total": j(mem.segmented_total),
            "bulk_shared": j(mem.bulk_shared),
            "segmented_shared": j(mem.segmented_shared),
            "plan": _sym_json(mem.plan),
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
        "transport": {
            "stages": {
                s.name: {
                    "what": s.what,
                    "row_bytes": j(s.row_bytes),
                    "send_expected": j(s.send_expected),
                    "send_worst": j(s.send_worst),
                    "recv_expected": j(s.recv_expected),
                    "recv_worst": j(s.recv_worst),
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
        },
        "padding": None
        if pl.padding is None
        else {
            "routing": pl.padding.routing,
            "alpha": pl.padding.alpha,
            "seed": pl.padding.seed,
            "counts": list(pl.padding.counts),
            "mu": j(pl.padding.mu),
            "cv": j(pl.padding.cv),
            "p10": j(pl.padding.p10),
            "dropped": j(pl.padding.dropped),
            "max_owner_load": j(pl.padding.max_owner_load),
            "rho_tallest": j(pl.padding.rho_tallest),
            "rho_tallest_max": j(pl.padding.rho_tallest_max),
            "rho_tiled": j(pl.padding.rho_tiled),
            "owners_per_token": j(pl.padding.owners_per_token),
            "redundant": j(pl.padding.redundant),
        },
        "dedup": {
            "enabled": pl.dedup.enabled,
            "owners_per_token": j(pl.dedup.owners_per_token),
            "redundant": j(pl.dedup.redundant),
            "dispatch_send": j(pl.dedup.dispatch_send),
            "return_recv": j(pl.dedup.return_recv),
            "bwd_dispatch_send": j(pl.dedup.bwd_dispatch_send),
            "bwd_return_recv": j(pl.dedup.bwd_return_recv),
        },
        "verdicts": [
            {"budget": v.budget, "bytes": v.bytes, "hbm": v.hbm, "fits": v.fits, "margin": v.margin}
            for v in pl.verdicts
        ],
        "warnings": list(pl.warnings),
    }
    if mem.alternative is not None:
        name = "plan_bulk" if mem.alternative.strategy == "bulk" else "plan_segmented"
        out["symmetric_bytes"][name] = _sym_json(mem.alternative)
    if formulas:
        out["formulas"] = {fig.key: str(fig.formula) for fig in pl.figures() if fig.formula is not None}
        out["symbols"] = dict(SYMBOLS_DOC)
    return out


__all__ = [
    "ALIGN",
    "BM",
    "PROFILES",
    "Figure",
    "Plan",
    "PlanOptions",
    "bisect_decreasing",
    "chernoff_union_bound",
    "owners_per_token_expr",
    "parse_probs",
    "plan",
    "resolve_strategy",
    "rho_tallest",
    "rho_tiled",
    "sample_routing",
    "symmetric_formulas",
    "symmetric_plan",
    "tiled_rows",
    "to_json",
]
