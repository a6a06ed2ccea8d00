"""The meaning of each statement of a layer (shape, expert, shared, dtype, model, route_row,
sideband, owner, capacity, segment, schedule, transport): one function per statement, its
record or None after reporting its errors, over the elaborator's per-layer context ``layer``
(``rdepc.passes.elaborate._Layer``: ``args``, ``size``, ``expr``, ``choice``, ``usage``,
``least``, ``most``, ``diags``, ``spans``, ``bounds``, ``env``)."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from rdepc.passes.expressions import MAX_VALUE, evaluate

from rdepc import syntax as S
from rdepc.diagnostics import Span, did_you_mean
from rdepc.ir.exact import Poly
from rdepc.ir.lowering import GEMM_LOWERINGS
from rdepc.ir.sizes import block_scales
from rdepc.ir.spec import (
    CLAMPED_SWIGLU,
    ROUTE_VARS,
    USER_SIDEBAND,
    Capacity,
    Dtype,
    ExpertFn,
    Model,
    Ownership,
    Precision,
    RouteRow,
    Segment,
    Shape,
    Shared,
)

# Implementation limits: beyond these a spec is almost certainly a typo, and the
# compiler's own tables (ownership maps, task tables) would not fit in memory.
LIMITS = {"ranks": 1024, "experts": 65536, "hidden": 1 << 20, "ffn": 1 << 20, "tokens": 1 << 31, "buffers": 64}

DTYPES = {d.value: d for d in Dtype}
COMPUTE_DTYPES = ("bf16", "fp16", "fp32")
ACTIVATIONS = ("swiglu", "clamped_swiglu", "gelu", "relu")
SCHEDULES = ("auto", "bulk", "pipelined", "deep")
TRANSPORTS = ("emulated", "nvshmem")
DROPS = ("round_robin", "arrival", "lowest_gate")  # the first is the default
PRE_ACTIVATIONS = ("keep", "recompute")  # the first is the default
INPUT_ACTIVATIONS = ("keep", "resend")  # the owners' input rows: kept from the forward, or sent again
GATE_PLACES = ("output", "input")  # where the gate scales the expert: the first is the default (Llama-4: input)
SHARED_GATES = ("sigmoid",)  # Qwen2-MoE, Qwen3-Next: sigmoid(x · w_sg^T) scales the shared experts' sum


def shape(layer, st: S.Stmt) -> Shape | None:
    keys = {"ranks": "W", "tokens": "T", "hidden": "H", "experts": "E", "top": "K"}
    opts, _ = layer.args(st, keyed=keys)
    missing = [k for k in keys if k not in opts]
    if missing:
        layer.diags.error(f"'shape' is missing {', '.join(missing)}", st.keyword_span, layer.usage_req("shape"))
        return None
    vals = {}
    for k, sym in keys.items():
        vals[sym] = layer.size(opts[k], k, symbolic_ok=(k == "tokens"), limit=LIMITS.get(k, MAX_VALUE))
    if None in vals.values():
        return None
    if vals["K"].value > vals["E"].value:
        layer.diags.error(
            f"top {vals['K']} is more than the {vals['E']} experts: a token picks K distinct experts",
            opts["top"].value.span,
        )
        return None
    T = vals["T"]
    if T.free and Poly.var(next(iter(T.free))) != T:
        layer.diags.error("tokens must be a number or a bounded parameter itself", opts["tokens"].value.span)
        return None
    bound = layer.bounds[next(iter(T.free))] if T.free else None
    if bound is not None and bound > LIMITS["tokens"]:
        layer.diags.error(f"tokens <= {bound} is beyond what rdepc supports ({LIMITS['tokens']})", st.span)
        return None
    return Shape(T_bound=bound, **vals)


def call(layer, v: S.Call, what: str) -> ExpertFn | None:
    if v.fn not in ACTIVATIONS:
        layer.diags.error(f"unknown expert function '{v.fn}'", v.fn_span, did_you_mean(v.fn, ACTIVATIONS))
        return None
    allowed = ("ffn", *CLAMPED_SWIGLU) if v.fn == "clamped_swiglu" else ("ffn",)
    given: dict[str, S.KwArg] = {}
    for kw in v.kwargs:
        if kw.name not in allowed:
            names = " and ".join(f"'{a}'" for a in allowed)
            layer.diags.error(
                f"unknown argument '{kw.name}' to {v.fn}",
                kw.name_span,
                f"the only argument is {names}" if len(allowed) == 1 else f"its arguments are {names}",
            )
        elif kw.name in given:
            layer.diags.error(f"'{kw.name}' given twice to {v.fn}", kw.name_span)
        else:
            given[kw.name] = kw
    if "ffn" not in given:
        layer.diags.error(f"{v.fn} needs its ffn width", v.span, f"e.g. {v.fn}(ffn = 1408)")
        return None
    F = layer.size(given["ffn"], f"{what} ffn width", limit=LIMITS["ffn"])
    if v.fn != "clamped_swiglu":
        return None if F is None else ExpertFn(v.fn, F)
    params = dict(CLAMPED_SWIGLU)
    for name in CLAMPED_SWIGLU:
        if name in given:
            value, span = layer.expr(given[name], f"clamped_swiglu {name}")
            if value is None:
                return None
            if not value.is_const or value.value <= 0:
                layer.diags.error(f"clamped_swiglu {name} must be a positive number, got {value}", span)
                return None
            params[name] = Fraction(value.value)
    return None if F is None else ExpertFn(v.fn, F, params["limit"], params["alpha"])


def expert_fn(layer, st: S.Stmt) -> tuple[ExpertFn | None, str | None]:
    """The routed experts' function, and where the gate scales them (``gate output``, the
    default: y = Σ g'·f(x); ``gate input``: y = Σ f(g'·x))."""
    opts, pos = layer.args(st, keyed=("gate",), flags=("bias",), positional=1)
    gate = layer.choice(opts["gate"], GATE_PLACES, "expert gate") if "gate" in opts else GATE_PLACES[0]
    if not pos or not isinstance(pos[0].value, S.Call):
        layer.diags.error("'expert' needs the expert function", st.keyword_span, layer.usage("expert"))
        return None, gate
    fn = call(layer, pos[0].value, "expert")
    return (fn if fn is None or "bias" not in opts else replace(fn, bias=True)), gate


def shared(layer, st: S.Stmt | None) -> Shared | None:
    if st is None:
        return None
    opts, pos = layer.args(st, keyed=("gate",), positional=1)
    if not pos:
        layer.diags.error("'shared' needs the shared experts", st.keyword_span, layer.usage("shared"))
        return None
    gate = layer.choice(opts["gate"], SHARED_GATES, "shared gate") if "gate" in opts else None
    if "gate" in opts and gate is None:
        return None
    v = pos[0].value
    count: Poly | None = Poly.const(1)
    if isinstance(v, S.CountCall):
        count = layer.size(S.Keyed("count", v.span, v.count, v.span), "shared expert count", limit=64)
        v = v.call
    if not isinstance(v, S.Call):
        layer.diags.error("'shared' needs an expert function", v.span, layer.usage("shared"))
        return None
    fn = call(layer, v, "shared expert")
    return None if fn is None or count is None else Shared(int(count.value), fn, gate)


def precision(layer, st: S.Stmt | None) -> Precision | None:
    if st is None:
        return Precision(Dtype.BF16, Dtype.BF16, None)
    opts, _ = layer.args(st, keyed=("dispatch", "scale", "backward"), flags=tuple(DTYPES))
    given = [n for n in opts if n in DTYPES]
    if len(given) != 1:
        msg = "'dtype' needs one compute dtype" if not given else "'dtype' names more than one compute dtype"
        layer.diags.error(msg, st.keyword_span, "e.g. 'dtype bf16' or 'dtype bf16, dispatch fp8_e4m3'")
        return None
    if given[0] not in COMPUTE_DTYPES:
        layer.diags.error(
            f"{given[0]} is a dispatch format, not a compute dtype",
            opts[given[0]].span,
            "e.g. 'dtype bf16, dispatch fp8_e4m3'",
        )
        return None
    layer.spans["dtype.dtype"] = opts[given[0]].span
    dtype = DTYPES[given[0]]
    dispatch = dtype
    if "dispatch" in opts:
        name = layer.choice(opts["dispatch"], DTYPES, "dispatch dtype")
        if name is None:
            return None
        dispatch = DTYPES[name]
    scale = "row" if dispatch is Dtype.FP8_E4M3 else None
    if "scale" in opts:
        scale = layer.choice(opts["scale"], ("row", "block"), "scale")
        if scale is None:
            return None
        if dispatch is not Dtype.FP8_E4M3:
            layer.diags.error("a dispatch scale is only used with fp8 dispatch", opts["scale"].span)
            return None
    backward = None
    if "backward" in opts:
        name = layer.choice(opts["backward"], (given[0], "fp8_e4m3"), "backward transport dtype")
        if name is None:
            return None
        backward = DTYPES[name] if DTYPES[name] is not dtype else None
    return Precision(dtype, dispatch, scale, backward)


def model(layer, st: S.Stmt | None) -> Model | None:
    if st is None:
        return Model(Poly.const(1))
    keys = ("moe_layers", "vocab", "layers", "dense_layers", "dense_ffn")
    opts, _ = layer.args(st, keyed=keys)
    if "moe_layers" not in opts:
        layer.diags.error("'model' needs moe_layers", st.keyword_span, "e.g. 'model moe_layers 27'")
        return None
    vals = {k: layer.size(opts[k], k) if k in opts else None for k in keys}
    if any(vals[k] is None for k in opts):
        return None
    if vals["layers"] is not None and vals["moe_layers"].value > vals["layers"].value:
        layer.diags.error(
            f"moe_layers {vals['moe_layers']} is more than the model's {vals['layers']} layers",
            opts["moe_layers"].span,
        )
        return None
    if vals["dense_layers"] and vals["layers"]:
        moe, dense, total = (int(vals[k].value) for k in ("moe_layers", "dense_layers", "layers"))
        if moe + dense > total:
            layer.diags.error(
                f"moe_layers {moe} + dense_layers {dense} is more than the model's {total} layers",
                opts["dense_layers"].span,
            )
            return None
    return Model(**vals)


def route_row(layer, st: S.Stmt | None, sb: S.Stmt | None, shape: Shape, prec: Precision | None) -> RouteRow | None:
    rank, token, slot = (Poly.var(v) for v in ROUTE_VARS)
    eq7 = (rank * shape.T + token) * shape.K + slot
    formula, span = eq7, None
    if st is not None:
        opts, _ = layer.args(st, keyed=("id",))
        if "id" not in opts:
            layer.diags.error("'route_row' needs id = ...", st.keyword_span, "e.g. id = (rank * T + token) * K + slot")
            return None
        v = opts["id"].value
        if not isinstance(v, S.Num | S.Name | S.BinOp | S.Neg):
            layer.diags.error("route_row id must be an integer expression", v.span)
            return None
        formula, span = evaluate(v, layer.env | {"rank": rank, "token": token, "slot": slot}, layer.diags), v.span
        if formula is None:
            return None
        other = formula.free - set(ROUTE_VARS) - shape.T.free
        if other:
            names = ", ".join(sorted(other))
            layer.diags.error(
                f"route_row id depends on the symbolic parameter {names}, which is not the layer's tokens",
                span,
                f"give {names} a value ('param {min(other)} = ...', or -D {min(other)}=N)",
            )
            return None
    sideband = sideband_fields(layer, sb, prec)
    if sideband is None:
        return None
    radix = mixed_radix(layer, formula, shape, span)
    if radix is None:
        return None
    offset, coeffs = radix
    scales = 1
    if prec is not None and prec.dispatch_scale == "block":
        scales = block_scales(int(shape.H.value))
    return RouteRow(formula, coeffs, offset, sideband, is_eq7=formula == eq7, scales=scales)


def mixed_radix(layer, formula: Poly, shape: Shape, span: Span | None):
    """Prove the encoding injective: a mixed-radix number over (rank, token, slot)."""
    route = set(ROUTE_VARS)
    for m, _ in formula.terms:
        powers = [(v, p) for v, p in m if v in route]
        if sum(p for _, p in powers) > 1:
            term = "*".join(v for v, p in powers for _ in range(p))
            layer.diags.error(f"route_row id must be linear in rank, token and slot; it has the term {term}", span)
            return None
    extents = {"rank": shape.W, "token": shape.T, "slot": shape.K}
    offset = formula.without(route)
    coeffs = {v: formula.coeff(v) for v in ROUTE_VARS}
    for name, c in [("the constant term", offset), *coeffs.items()]:
        if not c.integer_valued or layer.least(c) < 0:
            layer.diags.error(f"route_row id: {name} is {c}, not a non-negative whole number", span)
            return None
    live = [v for v in ROUTE_VARS if layer.most(extents[v]) > 1]
    order = sorted(live, key=lambda v: layer.most(coeffs[v]))
    prev = None
    for v in order:
        if prev is None:
            ok = layer.least(coeffs[v]) >= 1
        else:
            ok = layer.least(coeffs[v] - coeffs[prev] * extents[prev]) >= 0
        if not ok:
            layer.diags.error(
                "cannot prove route_row id injective: it is not a mixed-radix form over rank, token, slot",
                span,
                "use a mixed-radix form such as (rank * T + token) * K + slot",
            )
            return None
        prev = v
    top = offset
    for v in ROUTE_VARS:
        top = top + coeffs[v] * (extents[v] - Poly.const(1))
    if layer.most(top) >= 2**63:
        layer.diags.error("route_row ids overflow 64 bits at these sizes", span)
        return None
    return offset, tuple((v, coeffs[v]) for v in order)


def sideband_fields(layer, st: S.Stmt | None, prec: Precision | None) -> tuple[str, ...] | None:
    fp8 = prec is not None and prec.dispatch is Dtype.FP8_E4M3
    if st is None:
        return ("row_id", "local_expert", "gate") + (("scale",) if fp8 else ())
    opts, _ = layer.args(st, flags=USER_SIDEBAND)
    fields = tuple(f for f in USER_SIDEBAND if f in opts)
    if len(layer.diags.errors) and any(a for a in st.args if isinstance(a, S.Flag) and a.name not in opts):
        return None
    if "row_id" not in fields:
        layer.diags.error(
            "the sideband must carry row_id: returns are placed by decoded row identity",
            st.keyword_span,
            "RDEP appendix A.3, condition 1",
        )
        return None
    if fp8 and "scale" not in fields:
        layer.diags.error("fp8 dispatch needs 'scale' in the sideband (its rows' scales)", st.keyword_span)
        return None
    if not fp8 and "scale" in fields:
        layer.diags.warning("'scale' is only used with fp8 dispatch; it is carried but unused", opts["scale"].span)
    return fields


def ownership(layer, st: S.Stmt | None, shape: Shape) -> Ownership | None:
    W, E = int(shape.W.value), int(shape.E.value)
    if st is not None:
        opts, _ = layer.args(st, keyed=("map",), flags=("balanced",))
        if len(opts) != 1:
            layer.diags.error("'owner' needs one of: balanced, map { ... }", st.keyword_span)
            return None
        if "map" in opts:
            return owner_map(layer, opts["map"], W, E)
    # Contiguous blocks; the first E mod W ranks own one expert more (eq. 5 when W | E).
    base, extra = divmod(E, W)
    owner = []
    for q in range(W):
        owner += [q] * (base + (1 if q < extra else 0))
    first: dict[int, int] = {}
    for e, q in enumerate(owner):
        first.setdefault(q, e)
    local = [e - first[owner[e]] for e in range(E)]
    return Ownership("balanced", tuple(owner), tuple(local))


def owner_map(layer, arg: S.Keyed, W: int, E: int) -> Ownership | None:
    if not isinstance(arg.value, S.MapVal):
        layer.diags.error("owner map needs { rank: experts; ... }", arg.value.span, "e.g. map { 0: 0..4; 1: 4..8 }")
        return None
    errors = len(layer.diags.errors)
    owner: dict[int, tuple[int, Span]] = {}
    ranks_seen: dict[int, Span] = {}
    for entry in arg.value.entries:
        q = index(layer, entry.key, W, "rank")
        if q is None:
            continue
        if q in ranks_seen:
            layer.diags.error(f"rank {q} appears twice in the owner map", entry.key.span, f"first at {ranks_seen[q]}")
            continue
        ranks_seen[q] = entry.key.span
        for m in entry.members:
            if isinstance(m, S.Range):
                lo, hi = index(layer, m.lo, E, "expert"), index(layer, m.hi, E + 1, "range end")
                if lo is None or hi is None:
                    continue
                if hi <= lo:
                    layer.diags.error(f"empty expert range {lo}..{hi} (ranges are half-open)", m.span)
                    continue
                experts = range(lo, hi)
            else:
                e = index(layer, m, E, "expert")
                if e is None:
                    continue
                experts = (e,)
            twice = [e for e in experts if e in owner]
            if twice:
                e = twice[0]
                shown = f"expert {e} is" if len(twice) == 1 else f"{ranges(twice)} are"
                layer.diags.error(
                    f"{shown} assigned twice (to rank {owner[e][0]} and rank {q})",
                    m.span,
                    f"first assigned at {owner[e][1]}",
                )
            for e in experts:
                owner.setdefault(e, (q, m.span))
    if len(layer.diags.errors) > errors:
        return None
    missing = [e for e in range(E) if e not in owner]
    if missing:
        layer.diags.error(f"owner map leaves {ranges(missing)} without an owner", arg.value.span)
        return None
    count: dict[int, int] = {}
    local = []
    for e in range(E):
        q = owner[e][0]
        local.append(count.get(q, 0))
        count[q] = local[-1] + 1
    return Ownership("map", tuple(owner[e][0] for e in range(E)), tuple(local))


def index(layer, node: S.Expr, n: int, what: str) -> int | None:
    v = evaluate(node, layer.env, layer.diags)
    if v is None:
        return None
    if not v.is_whole or not 0 <= v.value < n:
        layer.diags.error(f"{what} {v} is out of range 0..{n - 1}", node.span)
        return None
    return int(v.value)


def capacity(layer, st: S.Stmt | None, shape: Shape) -> Capacity | None:
    if st is None:
        return Capacity("dropless", None, None, "arrival", "renormalize")
    opts, _ = layer.args(st, keyed=("factor", "rows", "drop", "weights"), flags=("dropless",))
    policies = [p for p in ("dropless", "factor", "rows") if p in opts]
    if len(policies) != 1:
        msg = "'capacity' needs one of: dropless, factor F, rows N"
        if policies:
            msg = f"'capacity' gives both {policies[0]} and {policies[1]}; choose one"
        layer.diags.error(msg, st.keyword_span)
        return None
    policy = policies[0]
    drop = "round_robin"  # no rank drops first (arrival in eq. 7's order sacrifices the last ranks)
    if "drop" in opts:
        drop = layer.choice(opts["drop"], DROPS, "drop policy")
    weights = "renormalize"
    if "weights" in opts:
        weights = layer.choice(opts["weights"], ("renormalize", "zero"), "weights")
    if drop is None or weights is None:
        return None
    if policy == "dropless":
        for k in ("drop", "weights"):
            if k in opts:
                layer.diags.warning(f"'{k}' has no effect with dropless capacity", opts[k].span)
        return Capacity("dropless", None, None, "arrival", weights)  # nothing is ever dropped
    if policy == "factor":
        f, span = layer.expr(opts["factor"], "capacity factor")
        if f is None:
            return None
        if not f.is_const or f.value <= 0:
            layer.diags.error(f"capacity factor must be a positive number, got {f}", span)
            return None
        cap = Capacity("factor", f, None, drop, weights)
    else:
        rows = layer.size(opts["rows"], "capacity rows", symbolic_ok=True)
        if rows is None:
            return None
        cap = Capacity("rows", None, rows, drop, weights)
    return cap


def segment(layer, st: S.Stmt | None) -> Segment | None:
    if st is None:
        return None
    opts, _ = layer.args(st, keyed=("rows", "buffers", "cut"))
    if "rows" not in opts:
        layer.diags.error("'segment' needs rows S", st.keyword_span, "e.g. 'segment rows 4096, buffers 2'")
        return None
    S_ = layer.size(opts["rows"], "segment rows", limit=1 << 31)
    B = layer.size(opts["buffers"], "segment buffers", limit=LIMITS["buffers"]) if "buffers" in opts else 2
    cut = layer.choice(opts["cut"], ("auto", "expert", "source"), "cut") if "cut" in opts else "auto"
    if S_ is None or B is None or cut is None:
        return None
    return Segment(S_, B if isinstance(B, Poly) else Poly.const(B), cut)


def activations(layer, st: S.Stmt | None, precision: Precision | None) -> tuple[str, str] | None:
    """What the owners keep for the backward, per tensor: GEMM1's pre-activations kept (the
    default) or recomputed; the input rows kept (the default) or sent again by the
    backward's dispatch."""
    if st is None:
        return PRE_ACTIVATIONS[0], INPUT_ACTIVATIONS[0]
    opts, _ = layer.args(st, keyed=("pre", "input"))
    if not opts:
        if st.args:  # an unknown option was named already
            return None
        layer.diags.error("'activations' needs a policy for the pre-activations or the input rows",
                         st.keyword_span, "e.g. 'activations pre recompute, input resend'")  # fmt: skip
        return None
    inputs = layer.choice(opts["input"], INPUT_ACTIVATIONS, "activations input") if "input" in opts else "keep"
    if inputs is None:
        return None
    if inputs == "resend" and precision is not None and precision.dispatch_scale is not None:
        layer.diags.error(
            "re-sent input rows must be the rows GEMM1 read: under fp8 dispatch it read them quantised",
            opts["input"].value.span,
            "keep them ('activations input keep'), or dispatch in the compute dtype",
        )
        return None
    if "pre" not in opts:
        return PRE_ACTIVATIONS[0], inputs
    policy = layer.choice(opts["pre"], PRE_ACTIVATIONS, "activations pre")
    if policy == "recompute" and precision is not None and precision.dispatch_scale is not None:
        layer.diags.error(
            "recomputed pre-activations need the rows GEMM1 read: under fp8 dispatch the owner keeps "
            "them dequantised, so GEMM1 again would not give the forward's pre-activations",
            opts["pre"].value.span,
            "keep them ('activations pre keep'), or dispatch in the compute dtype",
        )
        return None
    return None if policy is None else (policy, inputs)


def schedule(layer, st: S.Stmt | None) -> tuple[str, str]:
    """(strategy, the expert GEMMs' lowering): ``schedule STRATEGY[, gemm LOWERING]``."""
    if st is None:
        return "auto", "auto"
    opts, _ = layer.args(st, keyed=("gemm",), flags=SCHEDULES)
    strategies = [k for k in SCHEDULES if k in opts]
    if len(strategies) > 1 or not st.args:
        layer.diags.error(f"'schedule' needs one of: {', '.join(SCHEDULES)}", st.keyword_span)
    if len(strategies) != 1:  # none (an unknown one is reported where it stands), or several
        strategies = ["auto"]
    gemm = "auto"
    if "gemm" in opts:
        gemm = layer.choice(opts["gemm"], ("auto", *GEMM_LOWERINGS), "schedule gemm") or "auto"
    return strategies[0], gemm


def transport(layer, st: S.Stmt | None) -> tuple[str, bool]:
    if st is None:
        return "emulated", False
    opts, _ = layer.args(st, keyed=("dedup",), flags=(*TRANSPORTS, "dedup"))
    kinds = [k for k in TRANSPORTS if k in opts]
    if len(kinds) != 1:
        layer.diags.error("'transport' needs one of: emulated, nvshmem", st.keyword_span)
        return "emulated", False
    dedup = False
    if "dedup" in opts:
        a = opts["dedup"]
        dedup = True if isinstance(a, S.Flag) else layer.choice(a, ("on", "off"), "dedup") == "on"
    return kinds[0], dedup


def ranges(xs: list[int], noun: str = "expert") -> str:
    """[1, 2, 3, 7] → 'experts 1..4, 7' (half-open ranges, as in the language)."""
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}..{xs[j] + 1}")
        i = j + 1
    many = len(xs) > 1
    shown = ", ".join(parts[:8]) + (", ..." if len(parts) > 8 else "")
    return f"{noun}{'s' if many else ''} {shown}"
