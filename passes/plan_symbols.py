"""The planner's symbol table: every symbol a figure of ``rdepc plan`` may use, the formulas
that define its intermediate symbols (``mu``, ``cap_e``, ``R_max``), and their evaluation at
one spec's values (:class:`Env`).

The only constants are byte sizes, the RDEP paper's formula constants (cited where they
enter) and the buffer alignment of docs/memory.md (``ALIGN``); the grouped-GEMM tile height
is :data:`rdepc.ir.graph.BM`. Neither torch nor triton is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy as sp
from rdepc.passes.graph import geometry, max_over_tokens, spec_int

from rdepc.ir import sizes
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


def pad(x: sp.Expr) -> sp.Expr:
    return ALIGN * sp.ceiling(x / ALIGN)


# --- the formulas ----------------------------------------------------------------------

MU_DEF = W * T * K / E  # eq. 2 with DP = W


def cap_expr(policy: str) -> sp.Expr:
    """cap_e, rows one owner admits for one expert: ceil(f·μ), C, or ∞ (dropless). The rule
    is :func:`rdepc.ir.sizes.capacity_rule`, the one the passes evaluate, applied to symbols."""
    cap = sizes.capacity_rule(policy, mu, f, C, sp.ceiling)
    return sp.oo if cap is None else cap


def worst_owner_load_expr() -> sp.Expr:
    """Rows the busiest owner receives when every token picks distinct experts on it."""
    return sizes.owner_rows_rule(W, T, K, E_max, None, sp.Min)


def rows_per_owner_expr(policy: str) -> sp.Expr:
    """R_max = max_q R_q (:func:`rdepc.ir.sizes.owner_rows_rule` applied to symbols): the worst
    case, capped by Σ_{e owned by q} cap_e (both grow with E_loc(q), so the maximum is at E_max)."""
    return sizes.owner_rows_rule(W, T, K, E_max, None if policy == "dropless" else cap_e, sp.Min)


# --- evaluation ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Figure:
    """One number of the plan: its formula, its value at the spec's sizes, and its meaning."""

    key: str  # dotted JSON path
    formula: Any  # a sympy expression (or None for a sampled figure)
    value: int | float | None
    unit: str  # B, rows, s, %, x, params, FLOP/B, "" (a plain number)
    what: str  # the accounting in words


class Env:
    """The symbol table of one spec: symbol → value, and figure construction."""

    def __init__(self, values: dict[sp.Symbol, Any], policy: str):
        self.values = {k: v for k, v in values.items() if v is not None}
        self.exact = {k: to_exact(v) for k, v in self.values.items()}
        self.define(mu, MU_DEF)
        self.define(cap_e, cap_expr(policy))
        self.define(R_max, rows_per_owner_expr(policy))

    def define(self, sym: sp.Symbol, expr: sp.Expr) -> None:
        """Give an intermediate symbol its value, computed from its own formula."""
        r = expr.xreplace(self.exact)
        self.exact[sym] = r
        self.values[sym] = number(r)

    def value(self, expr: Any) -> int | float | None:
        if expr is None:
            return None
        r = expr.xreplace(self.exact) if isinstance(expr, sp.Basic) else expr
        return number(r)

    def fig(self, key: str, expr: Any, unit: str, what: str) -> Figure:
        return Figure(key, expr, self.value(expr), unit, what)


def to_exact(v: Any) -> sp.Basic:
    if isinstance(v, sp.Basic):
        return v
    return sp.Float(v) if isinstance(v, float) else sp.Integer(v)


def number(r: Any) -> int | float:
    if isinstance(r, int | float):
        return r
    if r is sp.oo:
        return math.inf
    if isinstance(r, sp.Integer):
        return int(r)
    if isinstance(r, sp.Basic) and not r.is_number:
        raise ValueError(f"a figure has free symbols left: {r}")
    return float(r)


def spec_values(spec: LayerSpec, strategy: str, rows: int | None = None, buffers: int | None = None) -> dict:
    sh = spec.shape
    Wv = int(sh.W)
    per_rank = spec.ownership.experts_per_rank(Wv)
    cap = spec.capacity
    seg = spec.segment
    Sv = rows if rows is not None else (spec_int(seg.rows, spec) if seg is not None else None)
    Bv = buffers if buffers is not None else (spec_int(seg.buffers, spec) if seg is not None else None)
    if strategy in SEGMENTED and (Sv is None or Bv is None):
        raise ValueError(f"strategy '{strategy}' needs segment rows and buffers: the spec has no segment statement")
    if strategy in SEGMENTED and spec.dedup:  # every segment resident (passes.graph.geometry)
        Bv = geometry(spec, strategy, S=Sv, B=Bv).B
    m = spec.model
    return {
        W: Wv,
        T: sh.T_max,
        H: spec_int(sh.H, spec),
        E: spec_int(sh.E, spec),
        K: spec_int(sh.K, spec),
        F: spec_int(spec.expert.F, spec),
        L: spec_int(m.moe_layers, spec),
        S: Sv,
        B: Bv,
        E_max: max(per_rank),
        E_min: min(per_rank),
        f: sp.Rational(cap.factor) if cap.policy == "factor" else None,
        C: max_over_tokens(cap.rows, spec) if cap.policy == "rows" else None,  # the largest over T' <= T
        d: spec.precision.dispatch.bytes,
        a: spec.precision.dtype.bytes,
        sb: spec.route_row.sideband_bytes,
        V: spec_int(m.vocab, spec) if m.vocab is not None else None,
        L_all: spec_int(m.layers, spec) if m.layers is not None else None,
        L_dense: spec_int(m.dense_layers, spec) if m.dense_layers is not None else 0,
        D_dense: spec_int(m.dense_ffn, spec) if m.dense_ffn is not None else 0,
    }
