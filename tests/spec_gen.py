"""Hypothesis strategies for whole valid .rdep specs, for the fuzzing of check, plan, compile and viz.

* :func:`valid_specs` draws specs the language accepts, across all of it: every statement
  and option of docs/language.md, sizes given as literals, parameters (bounded ones too)
  or expressions, owner maps, route-row encodings with gaps and offsets, several layers
  in a file, comments, line continuations and CRLF line ends. Sizes stay small (W ≤ 8,
  T ≤ 256, H, F ≤ 512, E ≤ 64, at most 32 segments per owner) so that a spec plans and
  compiles in milliseconds.

It gives a :class:`GenSpec`: the text and the command-line options it is used with.
tests/spec_mutate.py draws near-valid specs from these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from hypothesis import strategies as st

MAX_W, MAX_T, MAX_H, MAX_F, MAX_E = 8, 256, 512, 512, 64
MAX_SEGMENTS = 32  # per owner: keeps task tables (and compile times) small


@dataclass(frozen=True)
class GenSpec:
    """One generated spec: its text and how the commands are called on it."""

    text: str
    kind: str  # "valid" | "near-valid"
    layer: str | None = None  # --layer (files with several layers, or a mutation)
    defines: tuple[str, ...] = ()  # -D NAME=VALUE
    mutation: str = ""  # near-valid: what was changed
    tags: tuple[str, ...] = field(default=(), compare=False)  # constructs the valid spec uses

    def options(self) -> list[str]:
        """The command-line options every command gets."""
        out = [] if self.layer is None else ["--layer", self.layer]
        for d in self.defines:
            out += ["-D", d]
        return out


# --------------------------------------------------------------------------- values


class _Names:
    """Parameters a spec declares, in order: (name, text after the name)."""

    def __init__(self):
        self.decls: list[tuple[str, str]] = []
        self.used: set[str] = set()

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.used or name in ("x", "rank", "token", "slot"):
            i += 1
            name = f"{base}{i}"
        self.used.add(name)
        return name


@st.composite
def _literal(draw, v: int) -> str:
    """A number literal with value ``v`` (v >= 0)."""
    forms = [str(v)]
    if v >= 1000:
        forms.append(f"{v:_}")
    forms.append(f"{v}.0" if v < 10**6 else str(v))
    if v < 100:
        forms.append(f"0{v}")
    return draw(st.sampled_from(forms))


@st.composite
def _expr(draw, v: int, names: _Names, depth: int = 0) -> str:
    """An integer expression whose value is exactly ``v`` (>= 0): a literal, a parameter, or
    an arithmetic form over smaller ones (+ - * / // %, unary minus, parentheses)."""
    kind = draw(st.sampled_from(["lit", "lit", "lit", "param", "op"] if depth < 2 else ["lit"]))
    if kind == "lit" or v > 2**40:
        return draw(_literal(v))
    if kind == "param":
        name = names.fresh(draw(st.sampled_from(["P", "N", "size", "n_", "Hx"])))
        names.decls.append((name, f"= {draw(_expr(v, names, depth + 1))}"))
        return name
    op = draw(st.sampled_from(["+", "-", "*", "/", "//", "%", "neg", "paren"]))
    sub = lambda n: draw(_expr(n, names, depth + 1))  # noqa: E731
    # Compound forms are parenthesised: the result is an operand wherever it is put.
    if op == "+" and v >= 1:
        a = draw(st.integers(0, v))
        return f"({sub(a)} + {sub(v - a)})"
    if op == "-":
        k = draw(st.integers(0, 16))
        return f"({sub(v + k)} - {sub(k)})"
    if op == "*" and v >= 2:
        divs = [d for d in range(2, min(v, 64) + 1) if v % d == 0]
        if divs:
            d = draw(st.sampled_from(divs))
            return f"{sub(d)} * {sub(v // d)}" if depth == 0 else f"({sub(d)} * {sub(v // d)})"
    if op == "/":
        k = draw(st.integers(1, 4))
        return f"({sub(v * k)} / {sub(k)})"
    if op == "//":
        k = draw(st.integers(1, 4))
        return f"({sub(v * k + draw(st.integers(0, k - 1)))} // {sub(k)})"
    if op == "%":
        return f"({sub(v)} % {sub(v + draw(st.integers(1, 8)))})"
    if op == "neg":
        return f"-(-{draw(_literal(v))})"
    if op == "paren":
        return f"({sub(v)})"
    return draw(_literal(v))


# ------------------------------------------------------------------------- a layer


def _balanced(W: int, E: int) -> list[int]:
    base, extra = divmod(E, W)
    owner: list[int] = []
    for q in range(W):
        owner += [q] * (base + (1 if q < extra else 0))
    return owner


def _runs(xs: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and out[-1][1] == x:
            out[-1] = (out[-1][0], x + 1)
        else:
            out.append((x, x + 1))
    return out


@st.composite
def _owner_map(draw, W: int, E: int, names: _Names) -> tuple[str, list[int]]:
    owner = [draw(st.integers(0, W - 1)) for _ in range(E)]
    if draw(st.booleans()):  # contiguous blocks of random sizes
        cuts = sorted(draw(st.lists(st.integers(0, E), min_size=W - 1, max_size=W - 1)))
        bounds = [0, *cuts, E]
        ranks = draw(st.permutations(range(W)))
        owner = [0] * E
        for i in range(W):
            for e in range(bounds[i], bounds[i + 1]):
                owner[e] = ranks[i]
    entries = []
    for q in sorted(set(owner)):
        members = []
        for lo, hi in _runs([e for e in range(E) if owner[e] == q]):
            if hi - lo == 1 and draw(st.booleans()):
                members.append(draw(_expr(lo, names, 1)))
            elif hi - lo > 2 and draw(st.booleans()):  # split a range in two
                mid = draw(st.integers(lo + 1, hi - 1))
                members += [f"{lo}..{mid}", f"{mid}..{hi}"]
            else:
                members.append(f"{draw(_expr(lo, names, 1))}..{draw(_expr(hi, names, 1))}")
        members = draw(st.permutations(members))
        entries.append(f"{draw(_expr(q, names, 1))}: {', '.join(members)}")
    entries = draw(st.permutations(entries))
    if draw(st.booleans()):  # entries separated by ';' on one line, or by line breaks
        return "map { " + "; ".join(entries) + (";" if draw(st.booleans()) else "") + " }", owner
    return "map {\n    " + "\n    ".join(entries) + "\n  }", owner


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _route_row(draw, W: int, T: int, K: int, symbolic: bool, t_name: str, k_name: str, names: _Names):
    """(statement text or None, tag): eq. 7 in one of its spellings, or another mixed-radix
    form: any order of the variables, radices with gaps, a scale and an offset."""
    kind = draw(st.sampled_from(["default", "eq7", "eq7", "radix", "radix"]))
    if kind == "default":
        return None, "route_row default"
    if kind == "eq7":
        form = draw(
            st.sampled_from(
                [
                    "(rank * {T} + token) * {K} + slot",
                    "rank * {T} * {K} + token * {K} + slot",
                    "slot + {K} * (token + {T} * rank)",
                    "{K} * token + slot + rank * ({K} * {T})",
                ]
            )
        )
        return "route_row id = " + form.format(T=t_name, K=k_name), "route_row eq7"
    # ((v3 * N2 + v2) * N1 + v1) * scale + offset, each radix N at least its variable's
    # extent. Only the token's radix may be symbolic, so the form stays at most quadratic.
    extent = {"rank": W, "token": T, "slot": K}
    v1, v2, v3 = draw(st.permutations(["rank", "token", "slot"]))

    def radix(v: str) -> str:
        if v == "token" and (symbolic or draw(st.booleans())):
            return draw(st.sampled_from([t_name, f"({t_name} + {draw(st.integers(1, 3))})"]))
        return draw(_expr(extent[v] + draw(st.sampled_from([0, 0, 1, 7, 100])), names, 1))

    text = f"({v3} * {radix(v2)} + {v2}) * {radix(v1)} + {v1}"
    scale = draw(st.sampled_from([1, 1, 1, 2, 3]))
    if scale != 1:
        text = f"({text}) * {scale}"
    offset = draw(st.sampled_from([0, 0, 0, 1, 5, 1000]))
    if offset:
        text = f"{text} + {offset}"
    return f"route_row id = {text}", "route_row radix"


@dataclass(frozen=True)
class _Dims:
    """One layer's drawn sizes (T the bound when the tokens are symbolic)."""

    W: int
    T: int
    E: int
    K: int
    H: int
    F: int
    symbolic: bool


@st.composite
def _layer(draw, names: _Names, params: dict[str, str]) -> tuple[list[str], list[str]]:
    """The statements of one valid layer and the constructs it uses. ``params`` holds the
    size parameters the file declares (W, T, K: their names), shared by its layers."""
    tags: list[str] = []
    W = int(params["W_value"])
    E = draw(st.one_of(st.integers(1, 16), st.integers(1, MAX_E), st.sampled_from([W, 2 * W, 4 * W, 64])))
    E = max(1, min(E, MAX_E))
    K = draw(st.integers(1, min(E, 8)))
    H = draw(st.one_of(st.sampled_from([8, 16, 64, 128, 256, 512]), st.integers(1, MAX_H)))
    F = draw(st.one_of(st.sampled_from([8, 16, 64, 128, 512]), st.integers(1, MAX_F)))
    d = _Dims(W, int(params["T_value"]), E, K, H, F, params["T_kind"] == "bound")

    def size(v: int, param: str | None = None) -> str:
        if param is not None and draw(st.booleans()):
            return param
        return draw(_expr(v, names))

    stmts = {"shape": _shape(draw, size, names, params, d)}
    act = draw(st.sampled_from(["swiglu", "clamped_swiglu", "gelu", "relu"]))
    tags.append(f"expert {act}")
    stmts["expert"] = f"expert {act}(ffn = {size(F)}{', limit = 7.5' if act == 'clamped_swiglu' else ''})"
    if draw(st.booleans()):
        n = draw(st.integers(1, 4))
        call = f"{draw(st.sampled_from(['swiglu', 'gelu', 'relu']))}(ffn = {size(draw(st.integers(1, MAX_F)))})"
        stmts["shared"] = "shared " + (call if n == 1 and draw(st.booleans()) else f"{n} x {call}")
        tags.append("shared")
    if draw(st.booleans()):
        stmts["router"] = _router(draw, d, tags)
    dtype, fp8 = _dtype(draw, tags)
    if dtype is not None:
        stmts["dtype"] = dtype
    if draw(st.booleans()):
        stmts["model"] = _model(draw, size, params)
        tags.append("model")
    k_name = params["K"] if params.get("K_value") == str(K) else str(K)
    route, tag = draw(_route_row(W, d.T, K, d.symbolic, params["T"], k_name, names))
    tags.append(tag)
    if route is not None:
        stmts["route_row"] = route
    owner = _owner(draw, names, d, stmts, tags)
    capacity, drop, cap_max = _capacity(draw, size, params, d, tags)
    if capacity is not None:
        stmts["capacity"] = capacity
    dedup = _transport(draw, stmts, tags)
    _sideband(draw, fp8, drop, dedup, stmts, tags)
    _segment(draw, size, d, [owner.count(q) for q in range(W)], cap_max, stmts, tags)
    if d.symbolic:
        tags.append("symbolic tokens")
    order = draw(st.permutations(list(stmts)))
    return [stmts[k] for k in order], tags


def _shape(draw, size, names: _Names, params: dict[str, str], d: _Dims) -> str:
    """shape: every option, in any order, 'name value' or 'name = value'."""
    shape_vals = {
        "ranks": size(d.W, params.get("W")),
        "tokens": params["T"] if d.symbolic or (params.get("T") and draw(st.booleans())) else draw(_expr(d.T, names)),
        "hidden": size(d.H),
        "experts": size(d.E),
        "top": size(d.K, params["K"] if params.get("K_value") == str(d.K) else None),
    }
    keys = draw(st.permutations(list(shape_vals)))
    eq = draw(st.sampled_from([" ", " = "]))
    return "shape " + ", ".join(f"{k}{eq}{shape_vals[k]}" for k in keys)


def _router(draw, d: _Dims, tags: list[str]) -> str:
    parts = [draw(st.sampled_from(["softmax", "sigmoid"]))]
    tags.append(f"router {parts[0]}")
    for flag in ("bias", "renormalize"):
        if draw(st.booleans()):
            parts.append(flag)
    if draw(st.booleans()):
        opts = [(g, m) for g in _divisors(d.E) for m in range(1, g + 1) if m * (d.E // g) >= d.K]
        g, m = draw(st.sampled_from(opts))
        parts += [f"groups {g}", f"top_groups {m}"]
        tags.append("router groups")
    if draw(st.booleans()):
        parts.append(f"scale {draw(st.sampled_from(['1', '2.5', '2.446', '0.5', '16', '1_000']))}")
    for loss in ("aux_loss", "z_loss"):
        if draw(st.booleans()):
            parts.append(f"{loss} {draw(st.sampled_from(['0', '0.01', '0.001', '1', '1.5']))}")
            tags.append(loss)
    return "router " + ", ".join(draw(st.permutations(parts)))


def _dtype(draw, tags: list[str]) -> tuple[str | None, bool]:
    """The dtype statement (None: the default bf16) and whether rows are dispatched in fp8."""
    dtype = draw(st.sampled_from(["bf16", "fp16", "fp32"]))
    dispatch = draw(st.sampled_from([None, None, "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e4m3"]))
    fp8 = dispatch == "fp8_e4m3"
    scale = draw(st.sampled_from([None, "row", "block"])) if fp8 else None
    if dispatch is None and dtype == "bf16" and not draw(st.booleans()):
        return None, fp8
    parts = [dtype] + ([f"dispatch {dispatch}"] if dispatch else []) + ([f"scale {scale}"] if scale else [])
    tags.append(f"dtype {dtype}" + (f" dispatch {dispatch}" if dispatch else "") + (f" {scale}" if scale else ""))
    return "dtype " + ", ".join(draw(st.permutations(parts))), fp8


def _model(draw, size, params: dict[str, str]) -> str:
    moe = draw(st.integers(1, 64))
    parts = [f"moe_layers {size(moe, params.get('L') if params.get('L_value') == str(moe) else None)}"]
    layers = None
    if draw(st.booleans()):
        layers = moe + draw(st.integers(0, 8))
        parts.append(f"layers {layers}")
    if layers is not None and layers > moe and draw(st.booleans()):
        parts.append(f"dense_layers {draw(st.integers(1, layers - moe))}")
    if draw(st.booleans()):
        parts.append(f"dense_ffn {draw(st.integers(1, 20000))}")
    if draw(st.booleans()):
        parts.append(f"vocab {draw(st.integers(1, 300000))}")
    return "model " + ", ".join(draw(st.permutations(parts)))


def _owner(draw, names: _Names, d: _Dims, stmts: dict[str, str], tags: list[str]) -> list[int]:
    """The owner statement, if any, and the owner of each expert."""
    if draw(st.booleans()):
        stmts["owner"] = "owner balanced"
        tags.append("owner balanced")
        return _balanced(d.W, d.E)
    if draw(st.booleans()):
        text, owner = draw(_owner_map(d.W, d.E, names))
        stmts["owner"] = "owner " + text
        tags.append("owner map")
        return owner
    return _balanced(d.W, d.E)


def _capacity(
    draw, size, params: dict[str, str], d: _Dims, tags: list[str]
) -> tuple[str | None, str | None, int | None]:
    """The capacity statement (None: the default), its drop policy and the largest cap_e over
    T' in 1..T (None when unbounded), which the segment sizes below are drawn for."""
    policy = draw(st.sampled_from(["default", "dropless", "factor", "factor", "rows", "rows"]))
    if policy == "default":
        return None, None, None
    parts, cap_max = [], None
    if policy == "dropless":
        parts.append("dropless")
    elif policy == "factor":
        f = draw(st.sampled_from(["1", "1.0", "1.25", "0.5", "0.25", "2", "3.5", "1_000", "0.01"]))
        parts.append(f"factor {f}")
        cap_max = math.ceil(Fraction(f.replace("_", "")) * d.W * d.T * d.K / d.E)
    else:
        text, cap_max = _capacity_rows(draw, size, params, d, tags)
        parts.append(text)
    drop = None
    if policy != "dropless" or draw(st.booleans()):
        if draw(st.booleans()):
            drop = draw(st.sampled_from(["round_robin", "arrival", "lowest_gate"]))
            parts.append(f"drop {drop}")
            tags.append(f"drop {drop}")
        if draw(st.booleans()):
            parts.append(f"weights {draw(st.sampled_from(['renormalize', 'zero']))}")
    tags.append(f"capacity {policy}")
    return "capacity " + ", ".join(draw(st.permutations(parts))), drop, cap_max


def _capacity_rows(draw, size, params: dict[str, str], d: _Dims, tags: list[str]) -> tuple[str, int]:
    """``rows N``, N an expression of the tokens when they are symbolic, and its largest value."""
    T = d.T
    if d.symbolic and draw(st.booleans()):
        forms = [
            ("{T}", lambda t: t),
            ("2 * {T}", lambda t: 2 * t),
            ("{T} + 3", lambda t: t + 3),
            (f"{T + 1} - {{T}}", lambda t: T + 1 - t),  # decreasing in T
            ("{T} * {T} - {T} + 1", lambda t: t * t - t + 1),
            (f"{3 * T} - 2 * {{T}}", lambda t: 3 * T - 2 * t),
        ]
        form, fn = draw(st.sampled_from(forms))
        tags.append("capacity rows symbolic")
        return "rows " + form.format(T=params["T"]), max(fn(t) for t in range(1, T + 1))
    rows = draw(st.one_of(st.integers(1, 64), st.integers(1, d.W * T * d.K)))
    return f"rows {size(rows)}", rows


def _transport(draw, stmts: dict[str, str], tags: list[str]) -> bool:
    """The transport statement, if any; whether it deduplicates."""
    dedup = False
    if draw(st.booleans()):
        parts = [draw(st.sampled_from(["emulated", "emulated", "nvshmem"]))]
        if draw(st.booleans()):
            dd = draw(st.sampled_from(["dedup", "dedup on", "dedup = on", "dedup off"]))
            dedup = not dd.endswith("off")
            parts.append(dd)
        stmts["transport"] = "transport " + ", ".join(draw(st.permutations(parts)))
        tags.append(f"transport {parts[0]}" + (" dedup" if dedup else ""))
    return dedup


def _sideband(draw, fp8: bool, drop: str | None, dedup: bool, stmts: dict[str, str], tags: list[str]) -> None:
    """sideband: row_id always; scale with fp8; gate when lowest_gate or dedup need it."""
    need = {"row_id"} | ({"scale"} if fp8 else set()) | ({"gate"} if drop == "lowest_gate" or dedup else set())
    if draw(st.booleans()):  # without the statement the default carries all of them
        extra = set(draw(st.lists(st.sampled_from(["local_expert", "gate", "scale"]), unique=True)))
        if not fp8 and "scale" in extra and draw(st.booleans()):
            extra.discard("scale")  # with it: carried but unused, a warning
        fields = need | extra
        stmts["sideband"] = "sideband " + ", ".join(draw(st.permutations(sorted(fields))))
        tags.append("sideband")


def _segment(draw, size, d: _Dims, per: list[int], cap_max: int | None, stmts: dict[str, str], tags: list[str]) -> None:
    """segment: S large enough for at most MAX_SEGMENTS segments of the busiest owner; and the
    schedule statement."""
    worst = [d.W * d.T * min(d.K, e) for e in per]
    R = [w if cap_max is None else min(w, e * cap_max) for w, e in zip(worst, per, strict=True)]
    R_max = max(max(R), 1)
    schedule = draw(st.sampled_from(["default", "auto", "bulk", "pipelined", "pipelined", "deep", "deep"]))
    if draw(st.booleans()) or (schedule in ("pipelined", "deep") and draw(st.booleans())):
        lo = -(-R_max // MAX_SEGMENTS)
        S = draw(st.one_of(st.integers(lo, max(lo, R_max)), st.integers(lo, 2 * R_max + 1)))
        parts = [f"rows {size(S)}"]
        if draw(st.booleans()):
            parts.append(f"buffers {draw(st.sampled_from([1, 2, 2, 3, 4, 8]))}")
        if draw(st.booleans()):
            parts.append(f"cut {draw(st.sampled_from(['auto', 'expert', 'source']))}")
        stmts["segment"] = "segment " + ", ".join(draw(st.permutations(parts)))
        tags.append("segment")
    if schedule != "default":
        stmts["schedule"] = f"schedule {schedule}"
        tags.append(f"schedule {schedule}")


@st.composite
def _layout(draw, stmts: list[str]) -> str:
    """Statements as lines of a layer body: indentation, comments, blank lines, and a
    backslash continuation after a comma now and then."""
    lines = []
    for s in stmts:
        if "," in s and "{" not in s and draw(st.integers(0, 5)) == 0:
            i = s.index(",")
            s = s[: i + 1] + draw(st.sampled_from([" \\\n      ", "\\\n\t", " \\  \n  "])) + s[i + 1 :].lstrip()
        indent = draw(st.sampled_from(["  ", "    ", "\t", ""]))
        tail = draw(st.sampled_from(["", "", "", "  # a comment", "\t#", " # , } { 1..2"]))
        lines.append(indent + s + tail)
        if draw(st.integers(0, 7)) == 0:
            lines.append(draw(st.sampled_from(["", "  # comment-only line", "   "])))
    return "\n".join(lines)


@st.composite
def valid_specs(draw) -> GenSpec:
    """A spec the language accepts (see the module docstring)."""
    names = _Names()
    names.used |= {"W", "T", "K", "L"}
    decl = names.decls.append  # in creation order: a parameter sees only those above it
    W = draw(st.one_of(st.integers(1, MAX_W), st.sampled_from([1, 2, 4, 8])))
    t_kind = draw(st.sampled_from(["value", "value", "literal", "bound", "bound_overridden"]))
    T = draw(st.one_of(st.integers(1, 32), st.integers(1, MAX_T), st.sampled_from([1, 16, 128, 129, 256])))
    params: dict[str, str] = {"W_value": str(W), "T_kind": "value", "T": "T", "K": ""}
    defines: list[str] = []
    tags: list[str] = []
    if draw(st.booleans()):
        params["W"] = "W"
        decl(("W", f"= {draw(_expr(W, names))}"))
    if t_kind == "bound":
        params["T_kind"] = "bound"
        decl(("T", f"<= {draw(_expr(T, names))}"))
    elif t_kind == "bound_overridden":  # a bound made a value on the command line
        decl(("T", f"<= {draw(st.integers(T, MAX_T))}"))
        defines.append(f"T={T}")
        tags.append("-D T")
    elif t_kind == "value":
        decl(("T", f"= {draw(_expr(T, names))}"))
        if draw(st.integers(0, 5)) == 0:  # -D replaces the declared value
            T = draw(st.integers(1, MAX_T))
            defines.append(f"T={T}")
            tags.append("-D T")
    else:
        params["T"] = str(T)
    params["T_value"] = str(T)
    if draw(st.booleans()):
        k = draw(st.integers(1, 8))
        params["K"], params["K_value"] = "K", str(k)
        decl(("K", f"= {k}"))
    if draw(st.booleans()):
        lv = draw(st.integers(1, 64))
        params["L"], params["L_value"] = "L", str(lv)
        decl(("L", f"= {lv}"))
    n_layers = draw(st.sampled_from([1, 1, 1, 1, 2, 3]))
    layer_names = draw(
        st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True), min_size=n_layers, max_size=n_layers,
                 unique=True).filter(lambda xs: not set(xs) & {"x", "param", "layer"})
    )  # fmt: skip
    bodies = []
    for name in layer_names:
        stmts, layer_tags = draw(_layer(names, params))
        tags += layer_tags
        bodies.append(f"layer {name} {{\n{draw(_layout(stmts))}\n}}\n")
    param_text = "".join(f"param {n} {rest}\n" for n, rest in names.decls)
    lead = draw(st.sampled_from(["", "", "# generated\n", "\n\n"]))
    if draw(st.booleans()):
        text = lead + param_text + "\n".join(bodies)
    else:  # declarations may follow the layers that use them
        text = lead + "\n".join(bodies) + param_text
    if draw(st.integers(0, 9)) == 0:
        text = text.replace("\n", "\r\n")
        tags.append("CRLF")
    layer = draw(st.sampled_from(layer_names)) if n_layers > 1 or draw(st.integers(0, 4)) == 0 else None
    return GenSpec(text, "valid", layer, tuple(defines), "", tuple(tags))


__all__ = ["GenSpec", "valid_specs"]
