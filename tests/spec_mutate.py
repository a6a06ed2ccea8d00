"""Near-valid .rdep specs, for the fuzzing of check, plan, compile and viz.

* :func:`near_valid_specs` draws a valid spec (tests/spec_gen.py) with a mutation: a number
  replaced by an extreme one (0, -1, 2**63, 1e308, ...), a name misspelt or swapped for
  another, a statement or option duplicated or dropped, tokens swapped, stray punctuation,
  a bad ``-D`` override or ``--layer``.
* :func:`any_specs` draws valid and near-valid specs, half each.
"""

from __future__ import annotations

import re

from hypothesis import strategies as st
from spec_gen import GenSpec, valid_specs
from test_fuzz import BIG, ODD, PUNCT

# Numbers a near-valid spec puts in place of one of its own.
EXTREMES = [
    "0", "-1", str(2**63), "1e308", str(2**62), str(2**62 + 1), str(2**31), str(2**31 + 1), "65536", "65537",
    "1024", "1025", "1048577", "1.5", "0.5", "-0", "00", "1_0", "2048/3", "1.", "9" * 25, "0.000001",
]  # fmt: skip
# Names a mutation may put in place of another: every keyword, option and value of the language.
VOCABULARY = [
    "param", "layer", "shape", "expert", "shared", "dtype", "model", "route_row", "sideband", "owner", "capacity",
    "segment", "schedule", "transport", "router", "ranks", "tokens", "hidden", "experts", "top", "swiglu", "gelu",
    "relu", "ffn", "bf16", "fp16", "fp32", "fp8_e4m3", "dispatch", "scale", "row", "block", "moe_layers", "vocab",
    "layers", "dense_layers", "dense_ffn", "id", "rank", "token", "slot", "row_id", "local_expert", "gate", "links",
    "balanced", "map", "dropless", "factor", "rows", "drop", "round_robin", "arrival", "lowest_gate", "weights",
    "renormalize", "zero", "buffers", "cut", "auto", "expert", "source", "bulk", "pipelined", "deep", "emulated",
    "nvshmem", "dedup", "on", "off", "softmax", "sigmoid", "bias", "groups", "top_groups", "aux_loss", "z_loss", "x",
    "clamped_swiglu", "limit", "alpha",
    "W", "T", "K", "E", "H", "F",
]  # fmt: skip


_TOKEN = re.compile(
    r"(?P<comment>#[^\n]*)|(?P<num>[0-9][0-9_]*(?:\.[0-9][0-9_]*)?)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<punct>//|<=|\.\.|[-+*/%=,:;(){}\[\]])"
)


def _tokens(text: str, kind: str) -> list[re.Match]:
    return [m for m in _TOKEN.finditer(text) if m.lastgroup == kind]


@st.composite
def _misspelt(draw, word: str) -> str:
    op = draw(st.sampled_from(["drop", "double", "swap", "case", "other", "other", "suffix"]))
    i = draw(st.integers(0, max(0, len(word) - 1)))
    if op == "drop" and len(word) > 1:
        return word[:i] + word[i + 1 :]
    if op == "double":
        return word[: i + 1] + word[i:]
    if op == "swap" and len(word) > 1:
        i = min(i, len(word) - 2)
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if op == "case":
        return word.upper() if word != word.upper() else word.lower()
    if op == "suffix":
        return word + draw(st.sampled_from(["s", "_", "2", "x"]))
    return draw(st.sampled_from(VOCABULARY))


@st.composite
def mutate(draw, spec: GenSpec) -> GenSpec:
    """``spec`` with one mutation (see the module docstring)."""
    text = spec.text
    layer, defines = spec.layer, list(spec.defines)
    op = draw(
        st.sampled_from(
            ["number"] * 5 + ["name"] * 4 + ["dup_stmt", "del_stmt", "dup_opt", "del_opt", "swap", "punct", "define"]
            + ["layer", "dup_layer", "odd"]
        )
    )  # fmt: skip
    what = op
    lines = text.split("\n")
    stmt_lines = [i for i, ln in enumerate(lines) if re.match(r"\s*[a-z_]+\s", ln) and not ln.lstrip().startswith(
        ("param", "layer", "#"))]  # fmt: skip
    if op == "number" and (nums := _tokens(text, "num")):
        m = draw(st.sampled_from(nums))
        new = draw(st.sampled_from([x for x in [*EXTREMES, *BIG[:10]] if x != m[0]]))
        text = text[: m.start()] + new + text[m.end() :]
        what = f"number {m[0]} -> {new[:30]}"
    elif op == "name" and (words := _tokens(text, "name")):
        m = draw(st.sampled_from(words))
        new = draw(_misspelt(m[0]))
        text = text[: m.start()] + new + text[m.end() :]
        what = f"name {m[0]} -> {new}"
    elif op in ("dup_stmt", "del_stmt") and stmt_lines:
        i = draw(st.sampled_from(stmt_lines))
        what = f"{op} {lines[i].split()[0]}"
        lines[i : i + 1] = [lines[i], lines[i]] if op == "dup_stmt" else []
        text = "\n".join(lines)
    elif op in ("dup_opt", "del_opt") and stmt_lines:
        i = draw(st.sampled_from(stmt_lines))
        kw, _, rest = lines[i].strip().partition(" ")
        args = [a.strip() for a in rest.split("#")[0].split(",")] if "{" not in rest and "(" not in rest else []
        args = [a for a in args if a]
        if args:
            j = draw(st.integers(0, len(args) - 1))
            if op == "dup_opt":
                args.insert(j, args[j])
            else:
                del args[j]
            lines[i] = f"  {kw} {', '.join(args)}"
            text = "\n".join(lines)
            what = f"{op} {kw}"
    elif op == "swap":
        toks = [m for m in _TOKEN.finditer(text) if m.lastgroup != "comment"]
        if len(toks) >= 2:
            i, j = sorted(draw(st.lists(st.integers(0, len(toks) - 1), min_size=2, max_size=2, unique=True)))
            a, b = toks[i], toks[j]
            text = text[: a.start()] + b[0] + text[a.end() : b.start()] + a[0] + text[b.end() :]
            what = f"swap {a[0]} {b[0]}"
    elif op == "punct":
        toks = _tokens(text, "punct")
        if toks and draw(st.booleans()):
            m = draw(st.sampled_from(toks))
            text = text[: m.start()] + text[m.end() :]
            what = f"delete {m[0]}"
        else:
            pos = draw(st.integers(0, len(text)))
            p = draw(st.sampled_from(PUNCT))
            text = text[:pos] + p + text[pos:]
            what = f"insert {p}"
    elif op == "define":
        name = draw(st.sampled_from(["T", "W", "K", "L", "Q", "x", "T "]))
        value = draw(st.sampled_from([*EXTREMES, "", "abc", "1/0", "nan", "inf", "3"]))
        d = draw(st.sampled_from([f"{name}={value}", name, f"={value}"]))
        defines.append(d)
        what = f"-D {d}"
    elif op == "layer":
        layer = draw(st.sampled_from(["nope", "", "g", "layer"]))
        what = f"--layer {layer!r}"
    elif op == "dup_layer" and (m := re.search(r"layer [^\n]*\{.*?\n\}\r?\n", text, re.S)):
        text = text + m[0]
        what = "duplicate layer"
    else:
        pos = draw(st.integers(0, len(text)))
        s = draw(st.sampled_from(ODD))
        text = text[:pos] + s + text[pos:]
        what = f"insert {s!r}"
    return GenSpec(text, "near-valid", layer, tuple(defines), what, spec.tags)


@st.composite
def near_valid_specs(draw) -> GenSpec:
    """A valid spec with one mutation, or (one in five) two."""
    out = draw(mutate(draw(valid_specs())))
    if draw(st.integers(0, 4)) == 0:
        first = out.mutation
        out = draw(mutate(out))
        out = GenSpec(out.text, out.kind, out.layer, out.defines, f"{out.mutation}; {first}", out.tags)
    return out


@st.composite
def any_specs(draw) -> GenSpec:
    """Valid and near-valid specs, half each."""
    return draw(valid_specs()) if draw(st.booleans()) else draw(near_valid_specs())


__all__ = ["EXTREMES", "any_specs", "mutate", "near_valid_specs"]
