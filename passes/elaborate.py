"""Elaboration: syntax tree → checked :class:`LayerSpec`.

Gives every statement its meaning, evaluates expressions into sympy objects built from
the tree (never from text), and checks what can be checked before anything runs. All
problems are collected; the caller raises once with every diagnostic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from fractions import Fraction

from rdepc.passes.graph import fewest_tasks, too_many_tasks
from rdepc.passes.router import elaborate_router

from rdepc import syntax as S
from rdepc.diagnostics import Diagnostics, Span, did_you_mean
from rdepc.ir.exact import Poly
from rdepc.ir.graph import MAX_TASKS
from rdepc.ir.spec import (
    ROUTE_VARS,
    SCALE_BLOCK,
    USER_SIDEBAND,
    Capacity,
    Dtype,
    ExpertFn,
    LayerSpec,
    Model,
    Ownership,
    Param,
    Precision,
    RouteRow,
    Segment,
    Shape,
    Shared,
)

# Implementation limits: beyond these a spec is almost certainly a typo, and the
# compiler's own tables (ownership maps, task tables) would not fit in memory.
MAX_VALUE = 2**62
LIMITS = {"ranks": 1024, "experts": 65536, "hidden": 1 << 20, "ffn": 1 << 20, "tokens": 1 << 31, "buffers": 64}

DTYPES = {d.value: d for d in Dtype}
COMPUTE_DTYPES = ("bf16", "fp16", "fp32")
ACTIVATIONS = ("swiglu", "gelu", "relu")
SCHEDULES = ("auto", "bulk", "pipelined", "deep")
TRANSPORTS = ("emulated", "nvshmem")
DROPS = ("round_robin", "arrival", "lowest_gate")  # the first is the default
STATEMENTS = (
    "shape",
    "expert",
    "shared",
    "dtype",
    "model",
    "route_row",
    "sideband",
    "owner",
    "capacity",
    "segment",
    "schedule",
    "transport",
    "router",
)
REQUIRED = ("shape", "expert")


def elaborate(
    module: S.Module,
    layer: str | None = None,
    overrides: Mapping[str, int | Fraction] | None = None,
    sympy: bool = True,
) -> tuple[list[LayerSpec], Diagnostics]:
    """Elaborate the chosen layer (or every layer when ``layer`` is None).

    Returns the specs and the diagnostics (warnings, and errors if any: the caller
    decides when to raise, so ``rdepc check`` can report every layer of a file).
    With ``sympy=False`` (``rdepc check``) sizes stay exact :class:`Poly` values and
    sympy is never imported; every check is made either way.
    """
    diags = Diagnostics({module.file: module.text})
    env, params = _params(module, dict(overrides or {}), diags)
    decls = [d for d in module.layers if layer is None or d.name == layer]
    seen: dict[str, Span] = {}
    for d in module.layers:
        if d.name in seen:
            diags.error(f"duplicate layer '{d.name}'", d.name_span, f"first defined at {seen[d.name]}")
        seen.setdefault(d.name, d.name_span)
    specs = []
    for decl in decls:
        spec = _Layer(module, decl, env, params, diags, sympy).build()
        if spec is not None:
            specs.append(spec)
    return specs, diags


# ---------------------------------------------------------------------------- params


def _params(module: S.Module, overrides: dict, diags: Diagnostics) -> tuple[dict[str, Poly | None], tuple[Param, ...]]:
    # A parameter whose declaration has an error maps to None: its uses fail silently
    # instead of each reporting a misleading "unknown name".
    env: dict[str, Poly | None] = {}
    out: list[Param] = []
    where: dict[str, Span] = {}
    for p in module.params:
        if p.name in where:
            diags.error(f"duplicate parameter '{p.name}'", p.name_span, f"first declared at {where[p.name]}")
            continue
        if p.name in ROUTE_VARS:
            diags.error(f"'{p.name}' is reserved for route_row expressions", p.name_span)
            continue
        if p.name == "x":  # '2 x swiglu(...)' makes x a keyword where a value may follow
            diags.error("'x' is reserved (it counts shared experts: '2 x swiglu(...)')", p.name_span)
            continue
        where[p.name] = p.name_span
        given = overrides.pop(p.name, None)
        if given is not None and abs(given) > MAX_VALUE:
            diags.error(f"override for '{p.name}' is too large (limit 2^62)", p.span)
            env[p.name] = None
            continue
        if p.bound is not None:
            bound = _eval(p.bound, env, diags)
            if bound is None or not bound.is_whole or bound.value < 1:
                if bound is not None:
                    diags.error(f"bound of '{p.name}' must be a positive whole number, got {bound}", p.bound.span)
                env[p.name] = None
                continue
            if given is None:
                env[p.name] = Poly.var(p.name)
                out.append(Param(p.name, None, bound, False, p.span))
                continue
            value = Poly.const(given)
            if not value.is_whole or not 1 <= value.value <= bound.value:
                diags.error(
                    f"override {p.name}={value} is outside 1..{bound}, the range '{p.name}' was declared with",
                    p.span,
                )
                env[p.name] = None
                continue
            env[p.name] = value
            out.append(Param(p.name, value, bound, True, p.span))
            continue
        value = _eval(p.value, env, diags)
        if value is None:
            env[p.name] = None
            continue
        if given is not None:
            value = Poly.const(given)
        env[p.name] = value
        out.append(Param(p.name, value, None, given is not None, p.span))
    if overrides:
        names = ", ".join(sorted(overrides))
        declared = ", ".join(p.name for p in module.params) or "none"
        diags.error(f"override for undeclared parameter {names} (declared: {declared})", Span(module.file, 1, 1, 1, 1))
    return env, tuple(out)


# ---------------------------------------------------------------------- expressions


def _eval(e: S.Expr, env: Mapping[str, Poly | None], diags: Diagnostics) -> Poly | None:
    """The exact value of an expression node; None (and a diagnostic) on error."""
    match e:
        case S.Num(text=text):
            digits = text.replace("_", "")
            if len(digits.partition(".")[0].lstrip("0")) > 19:  # > 2^62; and int() refuses > 4300 digits
                diags.error("number too large (limit 2^62)", e.span)
                return None
            try:
                f = Fraction(digits)
            except ValueError:  # thousands of decimal digits: beyond Python's int-conversion limit
                diags.error("number has too many digits", e.span)
                return None
            if abs(f) > MAX_VALUE:
                diags.error("number too large (limit 2^62)", e.span)
                return None
            return Poly.const(f)
        case S.Name(id=name):
            if name in env:
                return env[name]
            hint = did_you_mean(name, env)
            diags.error(f"unknown name '{name}'", e.span, hint)
            return None
        case S.Neg(operand=o):
            v = _eval(o, env, diags)
            return None if v is None else -v
        case S.BinOp(op=op, lhs=lhs, rhs=rhs):
            a, b = _eval(lhs, env, diags), _eval(rhs, env, diags)
            if a is None or b is None:
                return None
            if op in ("/", "//", "%"):
                if not b.is_const:
                    diags.error(f"'{op}' by the symbolic {b} is not supported; divide by a number", rhs.span)
                    return None
                if b.value == 0:
                    diags.error(f"division by zero ('{op}' by {S.unparse(rhs)})", rhs.span)
                    return None
            if op in ("//", "%") and not a.is_const:
                diags.error(f"'{op}' of the symbolic {a} is not supported", lhs.span)
                return None
            if op == "*" and a.degree + b.degree > 2:
                diags.error("expressions in a bounded parameter may be at most quadratic", e.span)
                return None
            value = {
                "+": lambda: a + b,
                "-": lambda: a - b,
                "*": lambda: a * b,
                "/": lambda: a.scale(1 / b.value),
                "//": lambda: Poly.const(math.floor(a.value / b.value)),
                "%": lambda: Poly.const(a.value % b.value),
            }[op]()
            if any(abs(c) > MAX_VALUE for _, c in value.terms):
                diags.error("value too large (limit 2^62)", e.span)
                return None
            return value
    raise TypeError(e)  # pragma: no cover - the parser builds no other node


# ------------------------------------------------------------------------- a layer


class _Layer:
    def __init__(self, module: S.Module, decl: S.LayerDecl, env, params, diags: Diagnostics, sympy: bool):
        self.module, self.decl, self.env, self.params, self.diags = module, decl, env, params, diags
        self.spans: dict[str, Span] = {}
        self.bounds = {p.name: int(p.bound.value) for p in params if p.bound is not None and p.value is None}
        self.token_vars: frozenset[str] | None = None  # the symbol of 'shape tokens', once known
        self.to_ir = _SympyConverter() if sympy else (lambda v: v)

    # --- argument plumbing ---------------------------------------------------------

    def args(self, stmt: S.Stmt, keyed: Iterable[str] = (), flags: Iterable[str] = (), positional: int = 0):
        """Sort a statement's arguments into options, flags and positional values."""
        keyed, flags = tuple(keyed), tuple(flags)
        opts: dict[str, S.Arg] = {}
        pos: list[S.Positional] = []
        for a in stmt.args:
            match a:
                case S.Flag(name=name):
                    if name in keyed and name not in flags:
                        self.diags.error(f"'{name}' in '{stmt.keyword}' needs a value", a.span)
                        continue
                    if name not in flags:
                        self._unknown(stmt, name, a.span, keyed + flags)
                        continue
                case S.Keyed(name=name):
                    if name in flags and name not in keyed:
                        self.diags.error(f"'{name}' in '{stmt.keyword}' takes no value", a.span)
                        continue
                    if name not in keyed:
                        self._unknown(stmt, name, a.name_span, keyed + flags)
                        continue
                case S.Positional():
                    if len(pos) >= positional:
                        self.diags.error(f"unexpected argument to '{stmt.keyword}'", a.span, self._usage(stmt.keyword))
                    else:
                        pos.append(a)
                    continue
            if name in opts:
                self.diags.error(f"'{name}' given twice in '{stmt.keyword}'", a.span, f"first at {opts[name].span}")
                continue
            opts[name] = a
            self.spans[f"{stmt.keyword}.{name}"] = a.span
        return opts, pos

    def _unknown(self, stmt: S.Stmt, name: str, span: Span, choices: Iterable[str]) -> None:
        self.diags.error(f"unknown option '{name}' in '{stmt.keyword}'", span, did_you_mean(name, choices))

    def _usage(self, keyword: str) -> str:
        return {
            "expert": "write e.g. 'expert swiglu(ffn = 1408)'",
            "shared": "write e.g. 'shared 2 x swiglu(ffn = 1408)'",
        }.get(keyword, f"see docs/language.md for '{keyword}'")

    def choice(self, arg: S.Keyed, choices: Iterable[str], what: str) -> str | None:
        choices = tuple(choices)
        if isinstance(arg.value, S.Name) and arg.value.id in choices:
            return arg.value.id
        shown = S.unparse(arg.value) if isinstance(arg.value, S.Num | S.Name | S.BinOp | S.Neg) else "this"
        self.diags.error(f"{what} must be one of {', '.join(choices)}; got {shown}", arg.value.span)
        return None

    def expr(self, arg: S.Keyed | S.KwArg, what: str) -> tuple[Poly | None, Span]:
        v = arg.value
        if not isinstance(v, S.Num | S.Name | S.BinOp | S.Neg):
            self.diags.error(f"{what} must be a number or an integer expression", v.span)
            return None, v.span
        return _eval(v, self.env, self.diags), v.span

    def size(self, arg, what: str, symbolic_ok: bool = False, limit: int | None = None) -> Poly | None:
        """A positive whole number (or, where allowed, an integer expression in a bounded symbol)."""
        value, span = self.expr(arg, what)
        if value is None:
            return None
        free = value.free
        if free and symbolic_ok:
            # Only the tokens parameter may stay symbolic (Poly.extremes handles one symbol).
            allowed = free if self.token_vars is None else self.token_vars
            if len(free) > 1 or not free <= allowed:
                symbolic_ok = False
                free = (free - allowed) or free
        if free and not symbolic_ok:
            names = ", ".join(sorted(free))
            self.diags.error(
                f"{what} must be a number, but it depends on the symbolic parameter {names}",
                span,
                f"give {names} a value ('param {min(free)} = ...', or -D {min(free)}=N)",
            )
            return None
        if free:
            if not value.integer_valued:
                self.diags.error(f"{what} = {value} is not a whole number for every value of its parameters", span)
                return None
            if self._min(value) < 1:
                self.diags.error(f"{what} = {value} is not positive for every value of its parameters", span)
                return None
            return value
        if not value.is_whole:
            self.diags.error(f"{what} must be a whole number, got {value}", span)
            return None
        if value.value < 1:
            self.diags.error(f"{what} must be positive, got {value}", span)
            return None
        if limit is not None and value.value > limit:
            self.diags.error(f"{what} = {value} is beyond what rdepc supports ({limit})", span)
            return None
        return value

    def _min(self, e: Poly) -> Fraction:
        return e.extremes(self.bounds)[0]

    def _max(self, e: Poly) -> Fraction:
        return e.extremes(self.bounds)[1]

    # --- the layer ------------------------------------------------------------------

    def build(self) -> LayerSpec | None:
        decl = self.decl
        errors_before = len(self.diags.errors)
        stmts: dict[str, S.Stmt] = {}
        for st in decl.stmts:
            if st.keyword not in STATEMENTS:
                hint = did_you_mean(st.keyword, STATEMENTS)
                self.diags.error(f"unknown statement '{st.keyword}'", st.keyword_span, hint)
                continue
            if st.keyword in stmts:
                first = stmts[st.keyword].keyword_span
                self.diags.error(f"duplicate '{st.keyword}' statement", st.keyword_span, f"first at {first}")
                continue
            stmts[st.keyword] = st
            self.spans[st.keyword] = st.span
        for kw in REQUIRED:
            if kw not in stmts:
                self.diags.error(f"layer '{decl.name}' has no '{kw}' statement", decl.name_span, self._usage_req(kw))
        if any(kw not in stmts for kw in REQUIRED):
            return None
        shape = self.shape(stmts["shape"])
        expert = self.expert_fn(stmts["expert"])
        shared = self.shared(stmts.get("shared"))
        precision = self.precision(stmts.get("dtype"))
        model = self.model(stmts.get("model"))
        transport, dedup = self.transport(stmts.get("transport"))
        schedule = self.schedule(stmts.get("schedule"))
        if shape is None:
            return None
        self.token_vars = shape.T.free
        route = self.route_row(stmts.get("route_row"), stmts.get("sideband"), shape, precision)
        ownership = self.ownership(stmts.get("owner"), shape)
        capacity = self.capacity(stmts.get("capacity"), shape)
        segment = self.segment(stmts.get("segment"))
        router = elaborate_router(self, stmts.get("router"), shape)
        if len(self.diags.errors) > errors_before or None in (
            expert,
            precision,
            model,
            route,
            ownership,
            capacity,
            router,
        ):
            return None
        if capacity.drop == "lowest_gate" and "gate" not in route.sideband:
            self.diags.error(
                "drop lowest_gate needs the gate in the sideband: owners admit by gate",
                self.spans.get("capacity.drop"),
                "add 'gate' to the sideband statement",
            )
            return None
        if dedup:
            if "gate" not in route.sideband:
                self.diags.error(
                    "dedup needs the gate in the sideband: an owner sums its experts' gate-weighted outputs",
                    self.spans.get("transport.dedup"),
                    "add 'gate' to the sideband statement",
                )
                return None
            route = dataclasses.replace(route, sideband=(*route.sideband, "links"))
        spec = LayerSpec(
            name=decl.name,
            file=self.module.file,
            params=self.params,
            shape=shape,
            expert=expert,
            shared=shared,
            precision=precision,
            model=model,
            route_row=route,
            ownership=ownership,
            capacity=capacity,
            segment=segment,
            schedule=schedule,
            transport=transport,
            dedup=dedup,
            span=decl.name_span,
            spans=tuple(sorted(self.spans.items())),
            router=router,
        )
        self.warn(spec)
        ir = self.to_ir(spec)
        rows = int(ir.shape.W) * ir.shape.T_max * int(ir.shape.K)
        if ir.keyed_admission and rows >= 1 << 31:  # a key is (gate order) << 31 | dense row index
            self.diags.error(
                f"this capacity admits route rows by key, which needs W·T·K < 2^31 route rows; got {rows:,}",
                self.spans.get("capacity"),
                "use 'drop arrival' with the route row in rank, token, slot order, or fewer tokens",
            )
            return None
        self.task_table_note(spec)
        return ir

    def task_table_note(self, spec: LayerSpec) -> None:
        """A note where compile will stop: the graph stage builds no task table over
        MAX_TASKS tasks, whichever strategy, S and B the scheduler may choose (as compile
        says it, "not supported yet", for a layer the language allows)."""
        sh, cap = spec.shape, spec.capacity
        W, T, K, E = int(sh.W.value), sh.T_max, int(sh.K.value), int(sh.E.value)
        cap_e = None
        if cap.policy == "factor":
            cap_e = math.ceil(cap.factor.value * W * T * K / E)
        elif cap.policy == "rows":
            cap_e = int(self._max(cap.rows))
        seg = None if spec.segment is None else (int(spec.segment.rows.value), int(spec.segment.buffers.value))
        per = spec.ownership.experts_per_rank(W)
        n, strategy, S, segments = fewest_tasks(W, T, K, per, cap_e, spec.schedule, seg, spec.dedup)
        if n > MAX_TASKS:
            what, key, hint = too_many_tasks(W, T, n, strategy, S, segments, seg is not None)
            self.diags.note(f"not supported yet: {what} (compile and run stop here)", spec.span_of(key), hint)

    def _usage_req(self, kw: str) -> str:
        return {
            "shape": "e.g. 'shape ranks 8, tokens 4096, hidden 2048, experts 64, top 6'",
            "expert": "e.g. 'expert swiglu(ffn = 1408)'",
        }[kw]

    # --- statements -----------------------------------------------------------------

    def shape(self, st: S.Stmt) -> Shape | None:
        keys = {"ranks": "W", "tokens": "T", "hidden": "H", "experts": "E", "top": "K"}
        opts, _ = self.args(st, keyed=keys)
        missing = [k for k in keys if k not in opts]
        if missing:
            self.diags.error(f"'shape' is missing {', '.join(missing)}", st.keyword_span, self._usage_req("shape"))
            return None
        vals = {}
        for k, sym in keys.items():
            vals[sym] = self.size(opts[k], k, symbolic_ok=(k == "tokens"), limit=LIMITS.get(k, MAX_VALUE))
        if None in vals.values():
            return None
        if vals["K"].value > vals["E"].value:
            self.diags.error(
                f"top {vals['K']} is more than the {vals['E']} experts: a token picks K distinct experts",
                opts["top"].value.span,
            )
            return None
        T = vals["T"]
        if T.free and Poly.var(next(iter(T.free))) != T:
            self.diags.error("tokens must be a number or a bounded parameter itself", opts["tokens"].value.span)
            return None
        bound = self.bounds[next(iter(T.free))] if T.free else None
        if bound is not None and bound > LIMITS["tokens"]:
            self.diags.error(f"tokens <= {bound} is beyond what rdepc supports ({LIMITS['tokens']})", st.span)
            return None
        return Shape(T_bound=bound, **vals)

    def call(self, v: S.Call, what: str) -> ExpertFn | None:
        if v.fn not in ACTIVATIONS:
            self.diags.error(f"unknown expert function '{v.fn}'", v.fn_span, did_you_mean(v.fn, ACTIVATIONS))
            return None
        ffn = None
        for kw in v.kwargs:
            if kw.name != "ffn":
                self.diags.error(f"unknown argument '{kw.name}' to {v.fn}", kw.name_span, "the only argument is 'ffn'")
            elif ffn is not None:
                self.diags.error(f"'ffn' given twice to {v.fn}", kw.name_span)
            else:
                ffn = kw
        if ffn is None:
            self.diags.error(f"{v.fn} needs its ffn width", v.span, f"e.g. {v.fn}(ffn = 1408)")
            return None
        F = self.size(ffn, f"{what} ffn width", limit=LIMITS["ffn"])
        return None if F is None else ExpertFn(v.fn, F)

    def expert_fn(self, st: S.Stmt) -> ExpertFn | None:
        _, pos = self.args(st, positional=1)
        if not pos or not isinstance(pos[0].value, S.Call):
            self.diags.error("'expert' needs the expert function", st.keyword_span, self._usage("expert"))
            return None
        return self.call(pos[0].value, "expert")

    def shared(self, st: S.Stmt | None) -> Shared | None:
        if st is None:
            return None
        _, pos = self.args(st, positional=1)
        if not pos:
            self.diags.error("'shared' needs the shared experts", st.keyword_span, self._usage("shared"))
            return None
        v = pos[0].value
        count: Poly | None = Poly.const(1)
        if isinstance(v, S.CountCall):
            count = self.size(S.Keyed("count", v.span, v.count, v.span), "shared expert count", limit=64)
            v = v.call
        if not isinstance(v, S.Call):
            self.diags.error("'shared' needs an expert function", v.span, self._usage("shared"))
            return None
        fn = self.call(v, "shared expert")
        return None if fn is None or count is None else Shared(int(count.value), fn)

    def precision(self, st: S.Stmt | None) -> Precision | None:
        if st is None:
            return Precision(Dtype.BF16, Dtype.BF16, None)
        opts, _ = self.args(st, keyed=("dispatch", "scale"), flags=tuple(DTYPES))
        given = [n for n in opts if n in DTYPES]
        if len(given) != 1:
            msg = "'dtype' needs one compute dtype" if not given else "'dtype' names more than one compute dtype"
            self.diags.error(msg, st.keyword_span, "e.g. 'dtype bf16' or 'dtype bf16, dispatch fp8_e4m3'")
            return None
        if given[0] not in COMPUTE_DTYPES:
            self.diags.error(
                f"{given[0]} is a dispatch format, not a compute dtype",
                opts[given[0]].span,
                "e.g. 'dtype bf16, dispatch fp8_e4m3'",
            )
            return None
        self.spans["dtype.dtype"] = opts[given[0]].span
        dtype = DTYPES[given[0]]
        dispatch = dtype
        if "dispatch" in opts:
            name = self.choice(opts["dispatch"], DTYPES, "dispatch dtype")
            if name is None:
                return None
            dispatch = DTYPES[name]
        scale = "row" if dispatch is Dtype.FP8_E4M3 else None
        if "scale" in opts:
            scale = self.choice(opts["scale"], ("row", "block"), "scale")
            if scale is None:
                return None
            if dispatch is not Dtype.FP8_E4M3:
                self.diags.error("a dispatch scale is only used with fp8 dispatch", opts["scale"].span)
                return None
        return Precision(dtype, dispatch, scale)

    def model(self, st: S.Stmt | None) -> Model | None:
        if st is None:
            return Model(Poly.const(1))
        keys = ("moe_layers", "vocab", "layers", "dense_layers", "dense_ffn")
        opts, _ = self.args(st, keyed=keys)
        if "moe_layers" not in opts:
            self.diags.error("'model' needs moe_layers", st.keyword_span, "e.g. 'model moe_layers 27'")
            return None
        vals = {k: self.size(opts[k], k) if k in opts else None for k in keys}
        if any(vals[k] is None for k in opts):
            return None
        if vals["layers"] is not None and vals["moe_layers"].value > vals["layers"].value:
            self.diags.error(
                f"moe_layers {vals['moe_layers']} is more than the model's {vals['layers']} layers",
                opts["moe_layers"].span,
            )
            return None
        if vals["dense_layers"] and vals["layers"]:
            moe, dense, total = (int(vals[k].value) for k in ("moe_layers", "dense_layers", "layers"))
            if moe + dense > total:
                self.diags.error(
                    f"moe_layers {moe} + dense_layers {dense} is more than the model's {total} layers",
                    opts["dense_layers"].span,
                )
                return None
        return Model(**vals)

    def route_row(self, st: S.Stmt | None, sb: S.Stmt | None, shape: Shape, prec: Precision | None) -> RouteRow | None:
        rank, token, slot = (Poly.var(v) for v in ROUTE_VARS)
        eq7 = (rank * shape.T + token) * shape.K + slot
        formula, span = eq7, None
        if st is not None:
            opts, _ = self.args(st, keyed=("id",))
            if "id" not in opts:
                self.diags.error(
                    "'route_row' needs id = ...", st.keyword_span, "e.g. id = (rank * T + token) * K + slot"
                )
                return None
            v = opts["id"].value
            if not isinstance(v, S.Num | S.Name | S.BinOp | S.Neg):
                self.diags.error("route_row id must be an integer expression", v.span)
                return None
            formula, span = _eval(v, self.env | {"rank": rank, "token": token, "slot": slot}, self.diags), v.span
            if formula is None:
                return None
            other = formula.free - set(ROUTE_VARS) - shape.T.free
            if other:
                names = ", ".join(sorted(other))
                self.diags.error(
                    f"route_row id depends on the symbolic parameter {names}, which is not the layer's tokens",
                    span,
                    f"give {names} a value ('param {min(other)} = ...', or -D {min(other)}=N)",
                )
                return None
        sideband = self.sideband(sb, prec)
        if sideband is None:
            return None
        radix = self.radix(formula, shape, span)
        if radix is None:
            return None
        offset, coeffs = radix
        scales = 1
        if prec is not None and prec.dispatch_scale == "block":
            scales = -(-int(shape.H.value) // SCALE_BLOCK)
        return RouteRow(formula, coeffs, offset, sideband, is_eq7=formula == eq7, scales=scales)

    def radix(self, formula: Poly, shape: Shape, span: Span | None):
        """Prove the encoding injective: a mixed-radix number over (rank, token, slot)."""
        route = set(ROUTE_VARS)
        for m, _ in formula.terms:
            powers = [(v, p) for v, p in m if v in route]
            if sum(p for _, p in powers) > 1:
                term = "*".join(v for v, p in powers for _ in range(p))
                self.diags.error(f"route_row id must be linear in rank, token and slot; it has the term {term}", span)
                return None
        extents = {"rank": shape.W, "token": shape.T, "slot": shape.K}
        offset = formula.without(route)
        coeffs = {v: formula.coeff(v) for v in ROUTE_VARS}
        for name, c in [("the constant term", offset), *coeffs.items()]:
            if not c.integer_valued or self._min(c) < 0:
                self.diags.error(f"route_row id: {name} is {c}, not a non-negative whole number", span)
                return None
        live = [v for v in ROUTE_VARS if self._max(extents[v]) > 1]
        order = sorted(live, key=lambda v: self._max(coeffs[v]))
        prev = None
        for v in order:
            if prev is None:
                ok = self._min(coeffs[v]) >= 1
            else:
                ok = self._min(coeffs[v] - coeffs[prev] * extents[prev]) >= 0
            if not ok:
                self.diags.error(
                    "cannot prove route_row id injective: it is not a mixed-radix form over rank, token, slot",
                    span,
                    "use a mixed-radix form such as (rank * T + token) * K + slot",
                )
                return None
            prev = v
        top = offset
        for v in ROUTE_VARS:
            top = top + coeffs[v] * (extents[v] - Poly.const(1))
        if self._max(top) >= 2**63:
            self.diags.error("route_row ids overflow 64 bits at these sizes", span)
            return None
        return offset, tuple((v, coeffs[v]) for v in order)

    def sideband(self, st: S.Stmt | None, prec: Precision | None) -> tuple[str, ...] | None:
        fp8 = prec is not None and prec.dispatch is Dtype.FP8_E4M3
        if st is None:
            return ("row_id", "local_expert", "gate") + (("scale",) if fp8 else ())
        opts, _ = self.args(st, flags=USER_SIDEBAND)
        fields = tuple(f for f in USER_SIDEBAND if f in opts)
        if len(self.diags.errors) and any(a for a in st.args if isinstance(a, S.Flag) and a.name not in opts):
            return None
        if "row_id" not in fields:
            self.diags.error(
                "the sideband must carry row_id: returns are placed by decoded row identity",
                st.keyword_span,
                "RDEP appendix A.3, condition 1",
            )
            return None
        if fp8 and "scale" not in fields:
            self.diags.error("fp8 dispatch needs 'scale' in the sideband (its rows' scales)", st.keyword_span)
            return None
        if not fp8 and "scale" in fields:
            self.diags.warning("'scale' is only used with fp8 dispatch; it is carried but unused", opts["scale"].span)
        return fields

    def ownership(self, st: S.Stmt | None, shape: Shape) -> Ownership | None:
        W, E = int(shape.W.value), int(shape.E.value)
        if st is not None:
            opts, _ = self.args(st, keyed=("map",), flags=("balanced",))
            if len(opts) != 1:
                self.diags.error("'owner' needs one of: balanced, map { ... }", st.keyword_span)
                return None
            if "map" in opts:
                return self.owner_map(opts["map"], W, E)
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

    def owner_map(self, arg: S.Keyed, W: int, E: int) -> Ownership | None:
        if not isinstance(arg.value, S.MapVal):
            self.diags.error("owner map needs { rank: experts; ... }", arg.value.span, "e.g. map { 0: 0..4; 1: 4..8 }")
            return None
        errors = len(self.diags.errors)
        owner: dict[int, tuple[int, Span]] = {}
        ranks_seen: dict[int, Span] = {}
        for entry in arg.value.entries:
            q = self.index(entry.key, W, "rank")
            if q is None:
                continue
            if q in ranks_seen:
                self.diags.error(
                    f"rank {q} appears twice in the owner map", entry.key.span, f"first at {ranks_seen[q]}"
                )
                continue
            ranks_seen[q] = entry.key.span
            for m in entry.members:
                if isinstance(m, S.Range):
                    lo, hi = self.index(m.lo, E, "expert"), self.index(m.hi, E + 1, "range end")
                    if lo is None or hi is None:
                        continue
                    if hi <= lo:
                        self.diags.error(f"empty expert range {lo}..{hi} (ranges are half-open)", m.span)
                        continue
                    experts = range(lo, hi)
                else:
                    e = self.index(m, E, "expert")
                    if e is None:
                        continue
                    experts = (e,)
                twice = [e for e in experts if e in owner]
                if twice:
                    e = twice[0]
                    shown = f"expert {e} is" if len(twice) == 1 else f"{_ranges(twice)} are"
                    self.diags.error(
                        f"{shown} assigned twice (to rank {owner[e][0]} and rank {q})",
                        m.span,
                        f"first assigned at {owner[e][1]}",
                    )
                for e in experts:
                    owner.setdefault(e, (q, m.span))
        if len(self.diags.errors) > errors:
            return None
        missing = [e for e in range(E) if e not in owner]
        if missing:
            self.diags.error(f"owner map leaves {_ranges(missing)} without an owner", arg.value.span)
            return None
        count: dict[int, int] = {}
        local = []
        for e in range(E):
            q = owner[e][0]
            local.append(count.get(q, 0))
            count[q] = local[-1] + 1
        return Ownership("map", tuple(owner[e][0] for e in range(E)), tuple(local))

    def index(self, node: S.Expr, n: int, what: str) -> int | None:
        v = _eval(node, self.env, self.diags)
        if v is None:
            return None
        if not v.is_whole or not 0 <= v.value < n:
            self.diags.error(f"{what} {v} is out of range 0..{n - 1}", node.span)
            return None
        return int(v.value)

    def capacity(self, st: S.Stmt | None, shape: Shape) -> Capacity | None:
        if st is None:
            return Capacity("dropless", None, None, "arrival", "renormalize")
        opts, _ = self.args(st, keyed=("factor", "rows", "drop", "weights"), flags=("dropless",))
        policies = [p for p in ("dropless", "factor", "rows") if p in opts]
        if len(policies) != 1:
            msg = "'capacity' needs one of: dropless, factor F, rows N"
            if policies:
                msg = f"'capacity' gives both {policies[0]} and {policies[1]}; choose one"
            self.diags.error(msg, st.keyword_span)
            return None
        policy = policies[0]
        drop = "round_robin"  # no rank drops first (arrival in eq. 7's order sacrifices the last ranks)
        if "drop" in opts:
            drop = self.choice(opts["drop"], DROPS, "drop policy")
        weights = "renormalize"
        if "weights" in opts:
            weights = self.choice(opts["weights"], ("renormalize", "zero"), "weights")
        if drop is None or weights is None:
            return None
        if policy == "dropless":
            for k in ("drop", "weights"):
                if k in opts:
                    self.diags.warning(f"'{k}' has no effect with dropless capacity", opts[k].span)
            return Capacity("dropless", None, None, "arrival", weights)  # nothing is ever dropped
        if policy == "factor":
            f, span = self.expr(opts["factor"], "capacity factor")
            if f is None:
                return None
            if not f.is_const or f.value <= 0:
                self.diags.error(f"capacity factor must be a positive number, got {f}", span)
                return None
            cap = Capacity("factor", f, None, drop, weights)
        else:
            rows = self.size(opts["rows"], "capacity rows", symbolic_ok=True)
            if rows is None:
                return None
            cap = Capacity("rows", None, rows, drop, weights)
        return cap

    def segment(self, st: S.Stmt | None) -> Segment | None:
        if st is None:
            return None
        opts, _ = self.args(st, keyed=("rows", "buffers", "cut"))
        if "rows" not in opts:
            self.diags.error("'segment' needs rows S", st.keyword_span, "e.g. 'segment rows 4096, buffers 2'")
            return None
        S_ = self.size(opts["rows"], "segment rows", limit=1 << 31)
        B = self.size(opts["buffers"], "segment buffers", limit=LIMITS["buffers"]) if "buffers" in opts else 2
        cut = self.choice(opts["cut"], ("auto", "expert", "source"), "cut") if "cut" in opts else "auto"
        if S_ is None or B is None or cut is None:
            return None
        return Segment(S_, B if isinstance(B, Poly) else Poly.const(B), cut)

    def schedule(self, st: S.Stmt | None) -> str:
        return self.one_flag(st, SCHEDULES, "auto")

    def transport(self, st: S.Stmt | None) -> tuple[str, bool]:
        if st is None:
            return "emulated", False
        opts, _ = self.args(st, keyed=("dedup",), flags=(*TRANSPORTS, "dedup"))
        kinds = [k for k in TRANSPORTS if k in opts]
        if len(kinds) != 1:
            self.diags.error("'transport' needs one of: emulated, nvshmem", st.keyword_span)
            return "emulated", False
        dedup = False
        if "dedup" in opts:
            a = opts["dedup"]
            dedup = True if isinstance(a, S.Flag) else self.choice(a, ("on", "off"), "dedup") == "on"
        return kinds[0], dedup

    def one_flag(self, st: S.Stmt | None, choices: tuple[str, ...], default: str) -> str:
        if st is None:
            return default
        opts, _ = self.args(st, flags=choices)
        if len(opts) != 1:
            if opts or not st.args:
                self.diags.error(f"'{st.keyword}' needs one of: {', '.join(choices)}", st.keyword_span)
            return default
        return next(iter(opts))

    # --- warnings -------------------------------------------------------------------

    def warn(self, spec: LayerSpec) -> None:
        sh, d = spec.shape, self.diags
        W, E = int(sh.W.value), int(sh.E.value)
        per = spec.ownership.experts_per_rank(W)
        if min(per) == 0:
            idle = [q for q in range(W) if per[q] == 0]
            verb = "owns" if len(idle) == 1 else "own"
            d.warning(f"{_ranges(idle, 'rank')} {verb} no experts", spec.span_of("owner"))
        elif spec.ownership.policy == "balanced" and E % W:
            hi, lo = max(per), min(per)
            d.note(
                f"non-uniform ownership: {per.count(hi)} ranks own {hi} experts and {per.count(lo)} own {lo}"
                f" ({hi / lo:.3g}x owner-load asymmetry under equal per-expert traffic)",
                spec.span_of("owner") if "owner" in dict(spec.spans) else spec.span_of("shape.experts"),
            )
        cap = spec.capacity
        if cap.policy == "factor" and cap.factor.value < 1:
            d.warning(
                f"capacity factor {cap.factor} drops rows even when routing is perfectly balanced",
                spec.span_of("capacity.factor"),
            )
        seg = spec.segment
        cap_e = None
        if cap.policy == "factor":
            cap_e = math.ceil(cap.factor.value * sh.W.value * sh.T_max * sh.K.value / sh.E.value)
        elif cap.policy == "rows":
            cap_e = self._max(cap.rows)
        if seg is not None and cap_e is not None and spec.schedule != "bulk":  # bulk: warned below
            owner_rows = cap_e * min(per)
            if min(per) and owner_rows < seg.rows.value:
                d.warning(
                    f"capacity is below one segment: an owner with {min(per)} expert(s) admits at most "
                    f"{owner_rows} rows, less than the {seg.rows}-row segment",
                    spec.span_of("segment.rows"),
                )
        if seg is not None and spec.schedule == "bulk":
            # As passes.graph.geometry sizes bulk: one segment per owner, S the busiest owner's
            # worst case (distinct top-K, capped by capacity), T at its bound.
            worst = [sh.W.value * sh.T_max * min(sh.K.value, e) for e in per]
            rows = [r if cap_e is None else min(r, e * cap_e) for r, e in zip(worst, per, strict=True)]
            at_bound = " with T at its bound" if sh.symbolic else ""
            d.warning(
                f"schedule bulk ignores the segment statement: each owner's rows move as one segment "
                f"(S = {max(1, int(max(rows)))}{at_bound}, B = 1), not in {seg.rows}-row segments "
                f"through {seg.buffers} buffers",
                spec.span_of("segment"),
                "drop the segment statement, or use 'schedule pipelined' "
                "(a segmented --schedule on the command line still uses it)",
            )
        if seg is not None:
            if spec.schedule == "pipelined" and seg.buffers.value < 2:
                d.warning(
                    "pipelined with one buffer cannot overlap: dispatch waits for each compute",
                    spec.span_of("segment.buffers"),
                )
            if spec.schedule == "deep" and seg.buffers.value < 3:
                d.warning(
                    f"deep with {seg.buffers} buffer(s) is no deeper than pipelined; deep wants buffers > 2",
                    spec.span_of("segment.buffers"),
                )
        if spec.schedule in ("pipelined", "deep") and seg is None:
            d.warning(
                f"schedule {spec.schedule} without a 'segment' statement: rdepc chooses S and B",
                spec.span_of("schedule"),
            )
        if spec.precision.dispatch.bytes > spec.precision.dtype.bytes:
            d.warning(
                f"dispatch {spec.precision.dispatch.value} is wider than dtype {spec.precision.dtype.value}",
                spec.span_of("dtype.dispatch"),
            )


def _ranges(xs: list[int], noun: str = "expert") -> str:
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


class _SympyConverter:
    """Rebuilds a LayerSpec with every exact :class:`Poly` turned into a sympy object."""

    def __init__(self):
        import sympy as sp

        self.sp = sp
        self.symbols: dict[str, object] = {v: sp.Symbol(v, integer=True, nonnegative=True) for v in ROUTE_VARS}

    def __call__(self, x):
        if isinstance(x, Poly):
            for v in x.free - self.symbols.keys():
                self.symbols[v] = self.sp.Symbol(v, integer=True, positive=True)
            return x.to_sympy(self.symbols)
        if isinstance(x, tuple):
            return tuple(self(v) for v in x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type | Span):
            return dataclasses.replace(x, **{f.name: self(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init})
        return x
