"""Elaboration: syntax tree → checked :class:`LayerSpec`.

Gives every statement its meaning, evaluates expressions into sympy objects built from
the tree (never from text), and checks what can be checked before anything runs. All
problems are collected; the caller raises once with every diagnostic.

The parts, one role each: parameters and exact expressions (:mod:`rdepc.passes.expressions`),
each statement's meaning (:mod:`rdepc.passes.statements`), the warnings and notes on a built
spec (:mod:`rdepc.passes.spec_checks`); here, the pass itself and the per-layer context
(:class:`_Layer`) those functions read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from fractions import Fraction

from rdepc.passes import spec_checks, statements
from rdepc.passes.balance_statement import elaborate_balance
from rdepc.passes.expressions import evaluate, parameters
from rdepc.passes.router_statement import elaborate_router

from rdepc import syntax as S
from rdepc.diagnostics import Diagnostics, Span, did_you_mean
from rdepc.ir.exact import Poly
from rdepc.ir.spec import (
    ROUTE_VARS,
    LayerSpec,
)

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
    "balance",
    "activations",
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
    env, params = parameters(module, dict(overrides or {}), diags)
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


# ------------------------------------------------------------------------- a layer


class _Layer:
    """The elaborator's per-layer context: argument plumbing, sizes and the build, which gives
    each statement its meaning (:mod:`rdepc.passes.statements`) and checks the spec
    (:mod:`rdepc.passes.spec_checks`)."""

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
                        self.diags.error(f"unexpected argument to '{stmt.keyword}'", a.span, self.usage(stmt.keyword))
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

    def usage(self, keyword: str) -> str:
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
        return evaluate(v, self.env, self.diags), v.span

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
            if self.least(value) < 1:
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

    def least(self, e: Poly) -> Fraction:
        return e.extremes(self.bounds)[0]

    def _gate_input_fits(self, capacity, dedup: bool) -> bool:
        """``expert ..., gate input`` scales each row before it is sent: its owner's expert reads
        it scaled, so the scale must be final at dispatch and the row the slot's own."""
        at = self.spans.get("expert.gate")
        if dedup:
            self.diags.error(
                "dedup sends one row per (token, owner) for all its slots there; with the gate on the expert's "
                "input every slot's row is scaled by its own gate",
                self.spans.get("transport.dedup"),
                f"drop 'dedup', or gate the experts' outputs (expert gate at {at})",
            )
            return False
        if capacity.policy != "dropless" and capacity.weights == "renormalize":
            self.diags.error(
                "with the gate on the expert's input a capacity that drops needs 'weights zero': a row is scaled "
                "when it is sent, before its owner admits it, so its gate cannot follow the slots that survive",
                self.spans.get("capacity.weights", self.spans.get("capacity")),
                "add 'weights zero' to the capacity statement, or make it dropless",
            )
            return False
        return True

    def most(self, e: Poly) -> Fraction:
        return e.extremes(self.bounds)[1]

    # --- the layer ------------------------------------------------------------------

    def build(self) -> LayerSpec | None:
        """The layer's checked spec, or None after reporting why: its statements, each one's
        meaning, the rules between statements, then the built spec's checks."""
        errors_before = len(self.diags.errors)
        stmts = self._statements()
        parts = None if stmts is None else self._meanings(stmts)
        if parts is None or len(self.diags.errors) > errors_before:
            return None
        parts["route_row"] = self._combined(parts)
        if parts["route_row"] is None:
            return None
        spec = LayerSpec(
            name=self.decl.name,
            file=self.module.file,
            params=self.params,
            **parts,
            span=self.decl.name_span,
            spans=tuple(sorted(self.spans.items())),
        )
        return self._checked(spec)

    def _statements(self) -> dict[str, S.Stmt] | None:
        """The layer's statements by keyword: each known, at most once, the required ones there."""
        decl = self.decl
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
                self.diags.error(f"layer '{decl.name}' has no '{kw}' statement", decl.name_span, self.usage_req(kw))
        return None if any(kw not in stmts for kw in REQUIRED) else stmts

    def _meanings(self, stmts: dict[str, S.Stmt]) -> dict | None:
        """Each statement's record, by the LayerSpec field it fills; None when one failed."""
        shape = statements.shape(self, stmts["shape"])
        expert, gate_on = statements.expert_fn(self, stmts["expert"])
        shared = statements.shared(self, stmts.get("shared"))
        precision = statements.precision(self, stmts.get("dtype"))
        model = statements.model(self, stmts.get("model"))
        transport, dedup = statements.transport(self, stmts.get("transport"))
        schedule, gemm = statements.schedule(self, stmts.get("schedule"))
        if shape is None:
            return None
        self.token_vars = shape.T.free
        route = statements.route_row(self, stmts.get("route_row"), stmts.get("sideband"), shape, precision)
        ownership = statements.ownership(self, stmts.get("owner"), shape)
        capacity = statements.capacity(self, stmts.get("capacity"), shape)
        segment = statements.segment(self, stmts.get("segment"))
        router = elaborate_router(self, stmts.get("router"), shape)
        pre = statements.activations(self, stmts.get("activations"), precision)
        balance = None
        if ownership is not None:
            balance = elaborate_balance(self, stmts.get("balance"), ownership, int(shape.W.value), capacity)
        needed = dict(expert=expert, precision=precision, model=model, route_row=route, ownership=ownership)
        needed |= dict(capacity=capacity, router=router, balance=balance, gate_on=gate_on)
        if pre is None or None in needed.values():
            return None
        more = dict(shape=shape, shared=shared, segment=segment, schedule=schedule, gemm=gemm, transport=transport)
        return needed | more | dict(dedup=dedup, pre_activations=pre[0], input_activations=pre[1])

    def _combined(self, parts: dict):
        """The rules between statements; the route row as the spec holds it (with the dedup
        links), or None after reporting a conflict."""
        route, dedup, capacity = parts["route_row"], parts["dedup"], parts["capacity"]
        if parts["gate_on"] == "input" and not self._gate_input_fits(capacity, dedup):
            return None
        if parts["precision"].backward_fp8 and dedup:
            self.diags.error(
                "an fp8 backward transport is not implemented with dedup: its owners sum dL/dx rows per "
                "(token, owner) and compute dL/dg' from the dL/dy rows",
                self.spans.get("dtype.backward"),
                f"drop 'backward fp8_e4m3', or drop dedup (at {self.spans.get('transport.dedup')})",
            )
            return None
        if parts["input_activations"] == "resend" and dedup:
            self.diags.error(
                "re-sent input rows go one per route row, where dedup sends one per (token, owner)",
                self.spans.get("activations.input"),
                "keep the input rows ('activations input keep'), or drop dedup "
                f"(at {self.spans.get('transport.dedup')})",
            )
            return None
        if capacity.drop == "lowest_gate" and "gate" not in route.sideband:
            self.diags.error(
                "drop lowest_gate needs the gate in the sideband: owners admit by gate",
                self.spans.get("capacity.drop"),
                "add 'gate' to the sideband statement",
            )
            return None
        if not dedup:
            return route
        if "gate" not in route.sideband:
            self.diags.error(
                "dedup needs the gate in the sideband: an owner sums its experts' gate-weighted outputs",
                self.spans.get("transport.dedup"),
                "add 'gate' to the sideband statement",
            )
            return None
        return dataclasses.replace(route, sideband=(*route.sideband, "links"))

    def _checked(self, spec: LayerSpec) -> LayerSpec | None:
        """The built spec's warnings and checks, then the spec in the pass's number system."""
        spec_checks.warn(self, spec)
        if not spec_checks.library_check(self, spec):
            return None
        ir = self.to_ir(spec)
        rows = int(ir.shape.W) * ir.shape.T_max * int(ir.shape.K)
        if ir.keyed_admission and rows >= 1 << 31:  # a key is (gate order) << 31 | dense row index
            self.diags.error(
                f"this capacity admits route rows by key, which needs W·T·K < 2^31 route rows; got {rows:,}",
                self.spans.get("capacity"),
                "use 'drop arrival' with the route row in rank, token, slot order, or fewer tokens",
            )
            return None
        spec_checks.task_table_note(self, spec)
        return ir

    def usage_req(self, kw: str) -> str:
        return {
            "shape": "e.g. 'shape ranks 8, tokens 4096, hidden 2048, experts 64, top 6'",
            "expert": "e.g. 'expert swiglu(ffn = 1408)'",
        }[kw]


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
