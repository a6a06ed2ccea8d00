"""LayerSpec: the checked, typed meaning of one ``layer`` of a .rdep file.

Frozen, slotted dataclasses. Sizes are sympy expressions: integers once every parameter
is known, symbols where a parameter was declared ``param T <= bound``. (``rdepc check``
builds the same records with exact :class:`rdepc.ir.exact.Poly` values instead, so that
checking a spec never imports sympy.) Every field that
came from the source has a span in ``LayerSpec.spans`` (keyed ``"statement.option"``),
so a later stage can point at the text that asked for what it cannot do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

from rdepc.diagnostics import Span
from rdepc.ir.sizes import capacity_rule

if TYPE_CHECKING:  # sympy is imported only where a spec is lowered to sympy objects
    import sympy as sp


class Dtype(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def bytes(self) -> int:
        return {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}[self.value]


# Sideband fields a route row may carry, with their element size in bytes ("scale": per
# scale; a row carries ``RouteRow.scales`` of them).
SIDEBAND_BYTES = {"row_id": 8, "local_expert": 4, "gate": 4, "scale": 4, "links": 8}
# ``links`` (dedup only, never written by a user): the owner rows of the token's first and
# next accepted slot on the same owner, int32 each: which slots one payload row carries.
USER_SIDEBAND = tuple(f for f in SIDEBAND_BYTES if f != "links")

ROUTE_VARS = ("rank", "token", "slot")


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    value: sp.Expr | None  # None: symbolic, bounded by ``bound``
    bound: sp.Integer | None
    overridden: bool
    span: Span


@dataclass(frozen=True, slots=True)
class Shape:
    W: sp.Expr  # ranks (DP = EP = W, TP = 1; eq. 6)
    T: sp.Expr  # tokens per rank: an integer, or a symbol bounded by T_bound
    H: sp.Expr  # hidden size
    E: sp.Expr  # routed experts
    K: sp.Expr  # experts per token (top-K)
    T_bound: int | None  # the bound of a symbolic T; None when T is a number

    @property
    def symbolic(self) -> bool:
        return self.T_bound is not None

    @property
    def T_max(self) -> int:
        return self.T_bound if self.T_bound is not None else int(self.T)


GATED_ACTS = ("swiglu", "clamped_swiglu")  # GEMM1 computes gate and up: its weights are [Wg Wu]
CLAMPED_SWIGLU = {"limit": Fraction(7), "alpha": Fraction(1702, 1000)}  # GPT-OSS's values, the defaults


def is_gated(act: str) -> bool:
    return act in GATED_ACTS


def weight_matrices(act: str) -> int:
    """An expert's [H, F] weight matrices: gate, up and down for a gated expert; up and down else."""
    return 3 if is_gated(act) else 2


@dataclass(frozen=True, slots=True)
class ExpertFn:
    """An expert's function. ``clamped_swiglu`` (GPT-OSS): g = min(x·Wg, limit), u = x·Wu
    clamped to ±limit, (u + 1)·g·σ(alpha·g); ``limit`` and ``alpha`` are None for the others.
    ``bias`` (GPT-OSS): a learned bias after each projection, b_up beside x·Wu (and b_gate
    beside x·Wg) before the activation, b_down after its product with Wd."""

    act: str  # swiglu | clamped_swiglu | gelu | relu
    F: sp.Expr  # ffn width
    limit: Fraction | None = None
    alpha: Fraction | None = None
    bias: bool = False

    @property
    def gated(self) -> bool:
        return is_gated(self.act)

    @property
    def matrices(self) -> int:
        return weight_matrices(self.act)


@dataclass(frozen=True, slots=True)
class Shared:
    count: int
    fn: ExpertFn
    gate: str | None = None  # "sigmoid": the shared experts' sum scaled per token by sigmoid(x · w_sg^T)


@dataclass(frozen=True, slots=True)
class Precision:
    dtype: Dtype  # weights, activations, returned rows
    dispatch: Dtype  # payload rows on the wire
    dispatch_scale: str | None  # fp8 dispatch: "row" (one scale per row) or "block" (per SCALE_BLOCK columns)
    # the backward's rows on the wire (g'·dL/dy out, dL/dx back): None, the compute dtype; or
    # fp8 e4m3 with one fp32 scale per SCALE_BLOCK columns of a row, accumulated in fp32
    backward: Dtype | None = None

    @property
    def backward_fp8(self) -> bool:
        return self.backward is Dtype.FP8_E4M3


@dataclass(frozen=True, slots=True)
class Model:
    moe_layers: sp.Expr
    vocab: sp.Expr | None = None
    layers: sp.Expr | None = None
    dense_layers: sp.Expr | None = None
    dense_ffn: sp.Expr | None = None


@dataclass(frozen=True, slots=True)
class RouteRow:
    """row_id = offset + Σ coefficient·variable, a mixed-radix (hence injective) encoding."""

    formula: sp.Expr  # in the symbols rank, token, slot (and T when symbolic)
    radix: tuple[tuple[str, sp.Expr], ...]  # (variable, coefficient), smallest coefficient first
    offset: sp.Expr
    sideband: tuple[str, ...]
    is_eq7: bool
    scales: int = 1  # fp32 scales per row in the "scale" field (``scale block``: ceil(H / SCALE_BLOCK))

    def coefficient(self, var: str) -> sp.Expr | int:
        return dict(self.radix).get(var, 0)

    def field_bytes(self, field: str) -> int:
        """Bytes one row carries in sideband field ``field`` (``scale``: all its scales)."""
        return SIDEBAND_BYTES[field] * (self.scales if field == "scale" else 1)

    @property
    def sideband_bytes(self) -> int:
        return sum(self.field_bytes(f) for f in self.sideband)


@dataclass(frozen=True, slots=True)
class Ownership:
    policy: str  # balanced | map
    owner: tuple[int, ...]  # owner rank of each expert: π(e)
    local: tuple[int, ...]  # owner-local index of each expert: λ(e)

    def experts_of(self, rank: int) -> tuple[int, ...]:
        return tuple(e for e, q in enumerate(self.owner) if q == rank)

    def experts_per_rank(self, W: int) -> tuple[int, ...]:
        counts = [0] * W
        for q in self.owner:
            counts[q] += 1
        return tuple(counts)


@dataclass(frozen=True, slots=True)
class Capacity:
    policy: str  # dropless | factor | rows
    factor: sp.Rational | None
    rows: sp.Expr | None  # for policy "rows"
    drop: str  # round_robin | arrival | lowest_gate: the order an expert admits rows in
    weights: str  # renormalize | zero

    def rows_per_expert(self, shape: Shape) -> sp.Expr | None:
        """cap_e: rows an owner admits for one expert, as an expression in T when T is
        symbolic (:func:`rdepc.ir.sizes.capacity_rule`); None when dropless."""
        import sympy as sp

        return capacity_rule(self.policy, shape.W * shape.T * shape.K / shape.E, self.factor, self.rows, sp.ceiling)


@dataclass(frozen=True, slots=True)
class Router:
    """How a token picks its K experts and their gates (docs/language.md, 'router').

    Numbers are exact fractions: they never pass through sympy, and the runtime takes floats.
    """

    score: str = "softmax"  # softmax | sigmoid: s = score(x · Wr^T) over the E experts
    renormalize: bool = True  # the K gates divided by their sum
    norm_min: Fraction | None = None  # with renormalize: by max(their sum, norm_min) (Ernie-4.5's moe_norm_min)
    bias: bool = False  # a per-expert bias added to s for choosing only (DeepSeek-V3)
    groups: int = 1  # E experts in ``groups`` groups; a token picks from its ``top_groups`` best
    top_groups: int = 1
    group_score: str = "top2"  # a group's score: the sum of its best two c (DeepSeek-V3), or its best (max, V2)
    logit_bias: bool = False  # a learned per-expert bias added to the logits before scoring (GPT-OSS)
    scale: Fraction = Fraction(1)  # routed scaling factor, applied to the gates last
    aux_loss: Fraction | None = None  # coefficient of the load-balancing loss, None: not computed
    z_loss: Fraction | None = None  # coefficient of the router z-loss, None: not computed


@dataclass(frozen=True, slots=True)
class Balance:
    """``balance``: none, or exact-load replication of hot experts (docs/language.md, 'balance')."""

    kind: str = "none"  # none | replicate
    slots: int = 0  # N redundant expert slots per rank
    min_rows: int = 0  # U: the least a replica carries


@dataclass(frozen=True, slots=True)
class Segment:
    rows: sp.Integer  # S
    buffers: sp.Integer  # B
    cut: str  # auto | expert | source


@dataclass(frozen=True, slots=True)
class LayerSpec:
    name: str
    file: str
    params: tuple[Param, ...]
    shape: Shape
    expert: ExpertFn
    shared: Shared | None
    precision: Precision
    model: Model
    route_row: RouteRow
    ownership: Ownership
    capacity: Capacity
    segment: Segment | None  # None: the scheduler chooses
    schedule: str  # auto | bulk | pipelined | deep
    transport: str  # emulated | nvshmem
    dedup: bool
    span: Span
    spans: tuple[tuple[str, Span], ...] = field(default=())
    router: Router = field(default=Router())
    balance: Balance = field(default=Balance())
    # GEMM1's pre-activations for the backward: kept at the owner from the forward, or computed
    # again in the backward from the kept input rows (``activations pre recompute``)
    pre_activations: str = "keep"
    # the owners' input rows for the backward: kept from the forward, or sent again by the
    # backward's dispatch beside dL/dy (``activations input resend``)
    input_activations: str = "keep"
    # where the gate scales a routed expert: its output, y = Σ g'·f(x) (the default), or its
    # input, y = Σ f(g'·x) (Llama-4; ``expert ..., gate input``)
    gate_on: str = "output"
    # the expert GEMMs' lowering the spec asks for (``schedule ..., gemm L``): auto (the
    # compiler chooses), triton or library (rdepc.ir.lowering)
    gemm: str = "auto"

    def span_of(self, key: str) -> Span:
        """The span of ``"statement.option"``, else of the statement, else of the layer."""
        table = dict(self.spans)
        while key:
            if key in table:
                return table[key]
            key = key.rpartition(".")[0]
        return self.span

    @property
    def keyed_admission(self) -> bool:
        """Whether owners admit by key: under a capacity, with ``drop round_robin`` (token
        index first, ranks taking turns) or ``drop lowest_gate`` (gate, then row_id), or under
        ``drop arrival`` when ascending row_id is not rank, then token, then slot order (an
        owner cannot take each source's rows as one prefix in source order)."""
        if self.capacity.policy == "dropless":
            return False
        if self.capacity.drop != "arrival":
            return True
        order = [v for v, _ in reversed(self.route_row.radix)]
        return [v for v in ROUTE_VARS if v in order] != order


def jsonable(v):
    """sympy and IR values → JSON: whole numbers as ints, other numbers and formulas as text."""
    import sympy as sp

    if isinstance(v, sp.Integer):
        return int(v)
    if isinstance(v, sp.Basic):
        return str(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple | list):
        return [jsonable(x) for x in v]
    if isinstance(v, Span):
        return str(v)
    return v


def _act_params(fn: ExpertFn) -> dict:
    out = {} if fn.limit is None else {"limit": float(fn.limit), "alpha": float(fn.alpha)}
    return out | ({"bias": True} if fn.bias else {})


def spec_to_json(spec: LayerSpec) -> dict:
    """The elaborated spec as plain data (what ``rdepc compile`` writes and golden files hold)."""
    sh = spec.shape
    W = int(sh.W)
    per_rank = spec.ownership.experts_per_rank(W)
    cap = spec.capacity
    j = jsonable
    return {
        "layer": spec.name,
        "file": spec.file,
        "params": {
            p.name: {"value": j(p.value), "bound": j(p.bound), "overridden": p.overridden, "at": str(p.span)}
            for p in spec.params
        },
        "shape": {"W": j(sh.W), "T": j(sh.T), "T_bound": sh.T_bound, "H": j(sh.H), "E": j(sh.E), "K": j(sh.K)},
        "expert": {"act": spec.expert.act, "F": j(spec.expert.F), "gated": spec.expert.gated, "gate": spec.gate_on}
        | _act_params(spec.expert),
        "shared": None
        if spec.shared is None
        else {"count": spec.shared.count, "act": spec.shared.fn.act, "F": j(spec.shared.fn.F)}
        | _act_params(spec.shared.fn)
        | ({"gate": spec.shared.gate} if spec.shared.gate else {}),
        "activations": {"pre": spec.pre_activations, "input": spec.input_activations},
        "precision": {
            "dtype": spec.precision.dtype.value,
            "dispatch": spec.precision.dispatch.value,
            "dispatch_scale": spec.precision.dispatch_scale,
            "backward": (spec.precision.backward or spec.precision.dtype).value,
        },
        "model": {k: j(getattr(spec.model, k)) for k in ("moe_layers", "vocab", "layers", "dense_layers", "dense_ffn")},
        "route_row": {
            "id": str(spec.route_row.formula),
            "eq7": spec.route_row.is_eq7,
            "radix": [[v, j(c)] for v, c in spec.route_row.radix],
            "offset": j(spec.route_row.offset),
            "sideband": list(spec.route_row.sideband),
            "sideband_bytes": spec.route_row.sideband_bytes,
        },
        "ownership": {
            "policy": spec.ownership.policy,
            "experts_per_rank": list(per_rank),
            "owner": list(spec.ownership.owner),
            "local": list(spec.ownership.local),
        },
        "capacity": {
            "policy": cap.policy,
            "factor": j(cap.factor),
            "rows_per_expert": j(cap.rows_per_expert(sh)),
            "drop": cap.drop,
            "weights": cap.weights,
        },
        "segment": None
        if spec.segment is None
        else {"rows": j(spec.segment.rows), "buffers": j(spec.segment.buffers), "cut": spec.segment.cut},
        "schedule": spec.schedule,
        "gemm": spec.gemm,
        "transport": spec.transport,
        "dedup": spec.dedup,
    } | (  # only when asked for, so the JSON of a layer without it stays as it was
        {"balance": {"kind": spec.balance.kind, "slots": spec.balance.slots, "min_rows": spec.balance.min_rows}}
        if spec.balance.kind != "none"
        else {}
    )
