"""What a transformers MoE block is, in spec terms, read from the block itself: the one
reading that :func:`rdepc.hf.swap` checks a given spec against and that :func:`spec_for`
writes out as ``.rdep`` text when no spec is given.

    from rdepc.hf import spec_for
    print(spec_for(model, ranks=8, tokens=4096))   # one layer per distinct MoE block

A block is found (:func:`moe_blocks`), its class looked up in :mod:`rdepc.hf_families`
(:func:`family_of`), its structure held to the table's (:func:`walk`), and its sizes, expert
function, router rule and shared experts read (:func:`describe`) — each with where it came
from: the block's config key when one holds the value, else the tensor or attribute.
"""

from __future__ import annotations

import difflib
import re
import types
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
from torch import nn

from rdepc.api import UsageError
from rdepc.hf_families import ANY, FAMILIES, SILU, UNMAPPED, Family, Part
from rdepc.hf_parts import BIASED_LAYOUTS, CLAMPED_FUSED, OneOf


class SwapError(UsageError):
    """A model block that rdepc.hf does not map, or that the spec does not describe."""


# --------------------------------------------------------------------- finding blocks
# A block class transformers names as a mixture of experts (JetMoE's ``JetMoeMoE`` holds its
# experts as ``input_linear`` / ``output_linear``, not ``experts``); not the dense MLPs inside
# one (``Qwen2MoeMLP``).
_MOE_CLASS = re.compile(r"(MoE|Moe|MoeBlock|MoEBlock)$")


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every sparse MoE block, outermost first and not looked into further: a
    module of a class in the table, named as a mixture of experts, or holding an ``experts``
    submodule — unless it is an attention (JetMoE's mixture of attention heads is not the
    layer's MoE block)."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue
        cls = type(m).__name__
        experts = isinstance(m._modules.get("experts"), nn.Module) and "Attention" not in cls
        if cls in FAMILIES or _MOE_CLASS.search(cls) or experts:
            found.append((name, m))
    return found


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`moe_blocks`, or a :class:`SwapError` when there is none."""
    blocks = moe_blocks(model)
    if not blocks:
        raise SwapError(f"{type(model).__name__} has no sparse MoE block (a module with 'experts')")
    return blocks


def supported() -> str:
    """The families swap maps, as a refusal lists them."""
    return ", ".join(f"{f.name} ({cls})" for cls, f in FAMILIES.items())


def family_of(name: str, block: nn.Module) -> Family:
    """The table's row for ``block`` (at ``name`` in its model), or a :class:`SwapError` that
    names the block, lists what is mapped and names the mapped class nearest by name."""
    cls = type(block).__name__
    if cls in FAMILIES:
        return FAMILIES[cls]
    twin = next(iter(difflib.get_close_matches(cls, FAMILIES, n=1, cutoff=0.75)), None)
    near = f"; the nearest mapped class is {twin} ({FAMILIES[twin].name}): compare the two" if twin else ""
    why = f" ({UNMAPPED[cls]})" if cls in UNMAPPED else ""
    raise SwapError(
        f"{name or type(block).__name__} ({cls}) has experts, but {cls} is not a block class rdepc.hf maps{why}{near}. "
        f"Mapped: {supported()}"
    )


# --------------------------------------------------------------------- the table's structure
def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else type(v).__name__


def walk(where: str, m: nn.Module, part: Part, path: str = "") -> None:
    """Refuse anything in ``m`` that ``part`` does not list, or whose value it fixes otherwise."""
    cls = type(m).__name__
    if part.classes is None:
        return
    if cls not in part.classes:
        what = path.rstrip(".") or "the block"
        raise SwapError(f"{where} has {what} of class {cls}, where rdepc.hf maps {' or '.join(part.classes)}")
    for name, child in m._modules.items():
        if name not in part.children:
            raise SwapError(f"{where} has submodule {path}{name} ({type(child).__name__}), which rdepc.hf does not map")
        if child is not None:
            walk(where, child, part.children[name], f"{path}{name}.")
    for kind, have, known in (("parameter", m._parameters, part.params), ("buffer", m._buffers, part.buffers)):
        for name, t in have.items():
            if name not in known:
                raise SwapError(f"{where} has {kind} {path}{name}, which rdepc.hf does not map")
            if known[name] is None and t is not None:
                raise SwapError(f"{where} has {kind} {path}{name}, which rdepc.hf maps only when it is None")
    for name, v in vars(m).items():
        if name.startswith("_") or name == "training" or name in part.children:
            continue
        if name not in part.attrs:
            raise SwapError(f"{where} has attribute {path}{name} = {_short(v)}, which rdepc.hf does not map")
        want = part.attrs[name]
        if want is not ANY and not (v in want.values if isinstance(want, OneOf) else v == want):
            raise SwapError(f"{where} has {path}{name} = {_short(v)}, and rdepc.hf maps only {want!r}")


# --------------------------------------------------------------------- the block in spec terms
def show(v) -> str:
    """A value as the spec writes it (a scale 2.5, a floor 1e-12)."""
    return f"{float(v):g}" if isinstance(v, Fraction) else str(v)


def expert_text(act: str, limit=None, alpha=None, bias: bool = False) -> str:
    """An expert function as a spec says it, less its width."""
    params = "" if limit is None else f"(limit = {show(limit)}, alpha = {show(alpha)})"
    return f"{act}{params}" + (", bias" if bias else "")


def shared_text(count: int, act: str, ffn: int, gate: str | None = None, limit=None, alpha=None) -> str:
    params = "" if limit is None else f", limit = {show(limit)}, alpha = {show(alpha)}"
    return f"{count} x {act}(ffn = {ffn}{params})" + ("" if gate is None else f", gate {gate}")


DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Shared:
    count: int  # N shared experts of ffn // N each: one MLP of width ffn
    act: str
    ffn: int
    gate: str | None  # "sigmoid": Qwen's shared_expert_gate
    limit: Fraction | None = None  # clamped_swiglu's (MiniMax-M3-VL's)
    alpha: Fraction | None = None


@dataclass(frozen=True)
class Found:
    """One block read in spec terms; ``sources``: (the spec's term, where its value came from)."""

    family: str
    cls: str
    E: int
    H: int
    F: int
    K: int
    act: str  # swiglu, clamped_swiglu, or "gated X" (X another activation: no spec function)
    limit: Fraction | None  # clamped_swiglu's
    alpha: Fraction | None
    bias: bool  # the experts' projections have biases
    gate_on: str
    router: dict  # hf_families.router_terms
    shared: Shared | None
    dtype: str
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def expert(self) -> str:
        """The expert function as a spec says it, less its width."""
        return expert_text(self.act, self.limit, self.alpha, self.bias)

    def expert_line(self) -> str:
        """The spec's ``expert`` statement's value."""
        params = "" if self.limit is None else f", limit = {show(self.limit)}, alpha = {show(self.alpha)}"
        return (
            f"{self.act}(ffn = {self.F}{params})"
            + (", bias" if self.bias else "")
            + (", gate input" if self.gate_on == "input" else "")
        )

    def same_layer(self) -> tuple:
        """Everything but where the values were read: blocks equal here are one spec layer."""
        fields = {k: v for k, v in vars(self).items() if k not in ("sources", "router")}
        return tuple(fields.items()) + tuple(sorted(self.router.items()))


def _config(block: nn.Module):
    """The config the block was built from, where it or a module in it keeps one."""
    return next((m.config for m in block.modules() if getattr(m, "config", None) is not None), None)


_KEYS = {  # the config keys that hold each value, by family naming
    "H": ("hidden_size",),
    "E": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "F": ("moe_intermediate_size", "intermediate_size"),
    "K": ("num_experts_per_tok", "moe_k", "moe_topk", "top_k"),
    "N": ("n_shared_experts", "moe_num_shared_experts", "num_shared_experts"),
}


def _source(config, what: str, value, fallback: str) -> str:
    for key in _KEYS[what] if config is not None else ():
        if getattr(config, key, None) == value:
            return f"config.{key}"
    return fallback


_GATE_ATTRS = (
    "norm_topk_prob", "routed_scaling_factor", "topk_method", "num_group", "topk_group", "norm_min", "route_scale",
    "use_expert_bias", "moe_normalize_expert_weights", "router_scaling_factor",
)  # fmt: skip


def act_name(fn) -> str:
    """An activation's class name, or a plain function's own (``F.silu``: silu)."""
    return fn.__name__ if isinstance(fn, types.FunctionType) else type(fn).__name__


def experts_weight(block: nn.Module) -> tuple[str, torch.Tensor]:
    """The experts' first weight and its name in the block (``experts.gate_up_proj``, DBRX's
    ``experts.mlp.w1``): its device and dtype are the experts'."""
    name, w = next(block.experts.named_parameters())
    return f"experts.{name}", w


def _experts_found(where: str, fam: Family, ex: nn.Module) -> tuple[int, int, int, tuple]:
    """(E, H, F, (act, limit, alpha, bias)) of a block's experts, in its family's layout."""
    if fam.experts == "dbrx":  # experts.mlp.w1 (gate), v1 (up), w2 (down, [F, H] an expert), each [E·F, H]
        mlp = ex.mlp
        E, (EF, H) = mlp.moe_num_experts, mlp.w1.shape
        for key in ("v1", "w2"):
            if getattr(mlp, key).shape != mlp.w1.shape:
                raise SwapError(f"{where} has experts.mlp.{key} {tuple(getattr(mlp, key).shape)}, not w1's {(EF, H)}")
        act = act_name(mlp.activation_fn)
        return E, H, EF // E, ("swiglu" if act in SILU else f"gated {act}", None, None, False)
    if fam.experts in (*BIASED_LAYOUTS, "llama4"):  # gate_up_proj [E, H, 2F], down_proj [E, F, H]
        E, H, twoF = ex.gate_up_proj.shape
        down, layout = (E, twoF // 2, H), "[E, F, H]"
    else:
        E, twoF, H = ex.gate_up_proj.shape
        down, layout = (E, H, twoF // 2), "[E, H, F]"
    if fam.experts in BIASED_LAYOUTS:  # biases, GPT-OSS's clamped SwiGLU
        fn = ("clamped_swiglu", Fraction(str(ex.limit)), Fraction(str(ex.alpha)), True)
    elif fam.experts == CLAMPED_FUSED:  # the same SwiGLU, no biases
        fn = ("clamped_swiglu", Fraction(str(ex.swiglu_limit)), Fraction(str(ex.swiglu_alpha)), False)
    else:
        act = act_name(ex.act_fn)
        fn = ("swiglu" if act in SILU else f"gated {act}", None, None, False)
    if tuple(ex.down_proj.shape) != down:
        raise SwapError(f"{where} has experts.down_proj {tuple(ex.down_proj.shape)}, not {layout} = {down}")
    return E, H, twoF // 2, fn


def _expert_source(ex: nn.Module, fn: tuple) -> str:
    if fn[0] == "clamped_swiglu" and not fn[3]:
        return f"experts.swiglu_limit {ex.swiglu_limit}, experts.swiglu_alpha {ex.swiglu_alpha}"
    if fn[0] == "clamped_swiglu":
        return f"experts.limit {ex.limit}, experts.alpha {ex.alpha}, experts.gate_up_proj_bias and down_proj_bias"
    if isinstance(getattr(ex, "mlp", None), nn.Module):  # DBRX's
        return f"experts.mlp.activation_fn {act_name(ex.mlp.activation_fn)}"
    return f"experts.act_fn {act_name(ex.act_fn)}"


def _shared_found(block: nn.Module, fam: Family, config) -> Shared | None:
    mlp = getattr(block, fam.shared) if fam.shared else None
    if mlp is None:
        return None
    gated = "sigmoid" if fam.shared_gate and getattr(block, fam.shared_gate) is not None else None
    if fam.shared_fused:  # one gate_up_proj [2·F_s, H], gate rows then up; GPT-OSS's clamped SwiGLU
        limit, alpha = Fraction(str(mlp.swiglu_limit)), Fraction(str(mlp.swiglu_alpha))
        return Shared(1, "clamped_swiglu", mlp.gate_up_proj.weight.shape[0] // 2, gated, limit, alpha)
    width = mlp.gate_proj.weight.shape[0]
    fn = act_name(getattr(mlp, "act_fn", None) or mlp.activation_fn)  # Llama-4's: activation_fn
    n = next((getattr(config, k) for k in _KEYS["N"] if isinstance(getattr(config, k, None), int)), 1)
    n = n if n > 0 and width % n == 0 else 1  # DeepSeek's N shared experts are one MLP of N·F_s
    return Shared(n, "swiglu" if fn in SILU else f"gated {fn}", width, gated)


def _shared_source(fam: Family, shared: Shared, H: int) -> str:
    if fam.shared_fused:
        return f"{fam.shared}.gate_up_proj [{2 * shared.ffn}, {H}], its swiglu_limit and swiglu_alpha"
    return f"{fam.shared}.gate_proj [{shared.ffn}, {H}]" + (f", {fam.shared_gate}" if shared.gate else "")


def describe(name: str, block: nn.Module) -> Found:
    """``block`` (at ``name``) in spec terms, once its structure is the table's; a
    :class:`SwapError` when it is not, or its router has no spec terms."""
    fam = family_of(name, block)
    where = f"{name} ({type(block).__name__})"
    walk(where, block, fam.block)
    gate = getattr(block, fam.gate)
    E, H, F, fn = _experts_found(where, fam, block.experts)
    owner, owner_name = (block, "") if fam.rule_reads == "block" else (gate, f"{fam.gate}.")  # DBRX: the block's
    if not hasattr(owner, "top_k"):  # a block that holds its scale (Beam, Laguna), its router top-K
        k_owner, k_name = gate, f"{fam.gate}."
    else:
        k_owner, k_name = owner, owner_name
    rule = fam.router(owner)
    if isinstance(rule, str):
        who = "it" if fam.rule_reads == "block" else f"its router {type(owner).__name__}"
        raise SwapError(f"{where}: {who} has {rule}")
    config = _config(block)
    key, weight = experts_weight(block)
    tensor = f"{key} {tuple(weight.shape)}"
    read = ", ".join(f"{a} = {getattr(owner, a)!r}" for a in _GATE_ATTRS if hasattr(owner, a))
    if fam.block_bias:
        read += f"{', ' if read else ''}the block's {fam.block_bias}"
    sources = (
        ("hidden", _source(config, "H", H, tensor)),
        ("experts", _source(config, "E", E, tensor)),
        ("ffn", _source(config, "F", F, tensor)),
        ("top", _source(config, "K", k_owner.top_k, f"{k_name}top_k")),
        ("expert", _expert_source(block.experts, fn)),
        ("router", f"{fam.name}'s rule, {type(owner).__name__}" + (f": {read}" if read else "")),
        ("dtype", f"{tensor}'s dtype"),
    )
    shared = _shared_found(block, fam, config)
    dtype = DTYPES.get(weight.dtype, str(weight.dtype))
    found = Found(fam.name, type(block).__name__, E, H, F, k_owner.top_k, *fn, fam.gate_on, rule, shared, dtype)
    if shared is not None:
        sources += (("shared", _shared_source(fam, shared, H)),)
    return replace(found, sources=sources)


# --------------------------------------------------------------------- writing the spec
def router_text(terms: dict) -> str:
    """The spec's ``router`` options for router terms (``hf_families.router_terms``)."""
    out = [terms["score"]]
    out += [k for k in ("logit_bias", "bias") if terms[k]]
    if terms["groups"] > 1:
        out += [f"groups {terms['groups']}", f"top_groups {terms['top_groups']}"]
        if terms["group_score"] != "top2":
            out.append(f"group_score {terms['group_score']}")
    if terms["renormalize"]:
        out.append("renormalize")
    if terms["norm_min"] is not None:
        out.append(f"norm_min {show(terms['norm_min'])}")
    if terms["scale"] != 1:
        out.append(f"scale {show(terms['scale'])}")
    return ", ".join(out)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def layer_text(f: Found, name: str, blocks: list[str], model=None) -> str:
    """One ``layer`` of .rdep text for the blocks ``blocks`` (all read as ``f``), each value
    commented with where it came from; ``model``'s config, when given, sizes the ``model``
    statement."""
    src = dict(f.sources)
    where = blocks[0] if len(blocks) == 1 else f"{blocks[0]} and {len(blocks) - 1} more"
    if f.act.startswith("gated "):
        raise SwapError(f"{where} ({f.cls}) has experts {f.act}, which the spec language has no function for")
    if f.shared is not None and f.shared.act.startswith("gated "):
        raise SwapError(
            f"{where} ({f.cls}) has a shared MLP {f.shared.act}, which the spec language has no function for"
        )
    shape = f"ranks W, tokens T, hidden {f.H}, experts {f.E}, top {f.K}"
    rows = [
        ("shape", shape, f"hidden: {src['hidden']}; experts: {src['experts']}; top: {src['top']}"),
        ("expert", f.expert_line(), f"ffn: {src['ffn']}; {src['expert']}"),
        ("router", router_text(f.router), src["router"]),
    ]
    if f.shared is not None:
        s = f.shared
        rows.append(("shared", shared_text(s.count, s.act, s.ffn // s.count, s.gate, s.limit, s.alpha), src["shared"]))
    rows.append(("dtype", f.dtype, src["dtype"]))
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if config is not None and isinstance(layers, int) and layers >= len(blocks):
        vocab = getattr(config, "vocab_size", None)
        text = f"moe_layers {len(blocks)}, layers {layers}" + (f", vocab {vocab}" if isinstance(vocab, int) else "")
        rows.append(("model", text, f"{len(blocks)} of config.num_hidden_layers {layers} are this block"))
    lines = [f"layer {name} {{"]
    for k, v, why in rows:
        lines += [f"  # {why}", f"  {k:<8} {v}"]
    lines.append("}")
    return "\n".join(lines)


def spec_for(model_or_block: nn.Module, *, ranks: int = 1, tokens: int = 512) -> str:
    """The .rdep text of every distinct MoE block of ``model_or_block`` (a model, a module
    holding blocks, or a block), one ``layer`` each, for ``ranks`` ranks and ``tokens`` tokens
    per rank (``param W`` and ``T``, overridable as ``-D`` / keywords). Raises
    :class:`SwapError` for a block swap cannot map, naming it."""
    return written(model_or_block, ranks, tokens)[0]


def written(model_or_block: nn.Module, ranks: int, tokens: int) -> tuple[str, dict[str, str]]:
    """:func:`spec_for`'s text, and the layer it writes for each block (by the block's name)."""
    if ranks < 1 or tokens < 1:
        raise UsageError(f"spec_for needs ranks and tokens of at least 1, got ranks={ranks}, tokens={tokens}")
    root = type(model_or_block).__name__
    blocks = blocks_of(model_or_block)
    kinds: dict[tuple, tuple[Found, list[str]]] = {}
    for name, block in blocks:
        f = describe(name or root, block)
        kinds.setdefault(f.same_layer(), (f, []))[1].append(name)
    head = [
        f"# The MoE blocks of {root}, as rdepc.hf.spec_for read them: "
        f"{len(blocks)} block(s), {len(kinds)} distinct layer(s).",
        "# Each value's comment says where it came from; W and T are yours to set (-D W=8 -D T=4096).",
        f"param W = {ranks}",
        f"param T = {tokens}",
    ]
    layers, layer_of = [], {}
    for i, (f, names) in enumerate(kinds.values()):
        name = _slug(f.family) + (f"_{i + 1}" if len(kinds) > 1 else "")
        shown = [n or root for n in names]
        listed = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
        layers.append(f"# {f.family} ({f.cls}): {listed}\n" + layer_text(f, name, shown, model_or_block))
        layer_of |= dict.fromkeys(names, name)
    return "\n".join(head) + "\n\n" + "\n\n".join(layers) + "\n", layer_of


__all__ = [
    "Found",
    "SwapError",
    "act_name",
    "describe",
    "experts_weight",
    "family_of",
    "moe_blocks",
    "router_text",
    "spec_for",
    "supported",
    "walk",
]
