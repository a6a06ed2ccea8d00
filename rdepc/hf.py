"""Swap the sparse MoE blocks of a transformers model for ``RDEPMoE`` blocks, and back.

    from rdepc.hf import swap, unswap
    swap(model, "examples/mixtral_8x7b.rdep", W=1, T=512)   # -> the names of the blocks swapped
    unswap(model)                                            # transformers' own blocks again

swap maps exactly the transformers (5.x) block classes of this table; each becomes an
:class:`RDEPBlock` that keeps the block's router module (``gate``: transformers still records
its logits, and its weight is the router) and runs the routed experts, and the shared
experts, in an ``RDEPMoE`` that routes from the gate's logits as the spec's ``router`` says:

============== =========================== =========================================== ==================
family         block class                 spec ``router``                             shared experts
============== =========================== =========================================== ==================
Mixtral        MixtralSparseMoeBlock       softmax, renormalize                        none
Qwen3-MoE      Qwen3MoeSparseMoeBlock      softmax (renormalize: ``norm_topk_prob``)   none
OLMoE          OlmoeSparseMoeBlock         softmax (renormalize: ``norm_topk_prob``)   none
DeepSeek-V2    DeepseekV2Moe               ``greedy``: softmax, scale S                ``shared_experts``
DeepSeek-V3    DeepseekV3MoE               sigmoid, bias, groups G, top_groups M,      ``shared_experts``
                                           (renormalize), scale S
GLM-4-MoE      Glm4MoeMoE                  as DeepSeek-V3                              ``shared_experts``
Ernie-4.5-MoE  Ernie4_5_MoeSparseMoeBlock  softmax, bias, renormalize (the bias:       ``shared_experts``
                                           ``gate.moe_statics``)                       or none
HunYuan-MoE-V1 HunYuanMoEV1Moe             softmax, renormalize (the weight:           ``shared_mlp``
               (``HunYuanMoEV1Gate``)      ``gate.wg.weight``)
============== =========================== =========================================== ==================

S is the gate's ``routed_scaling_factor``, G and M its ``num_group`` and ``topk_group``
(``groups G, top_groups G`` limits nothing: it is the spec without groups), and the bias the
gate's ``e_score_correction_bias``, read at every call (it follows ``model.to(...)`` and the
training loop's in-place updates). The experts are fused (``gate_up_proj`` [E, 2F, H],
``down_proj`` [E, H, F], SiLU-gated: the spec's ``swiglu(ffn = F)``); the one shared MLP of
width F_s is the spec's ``shared N x swiglu(ffn = F_s / N)`` for any N dividing it.

Refused, with a :class:`SwapError` naming the block's path, its class and the reason, because
the spec language cannot express them: Qwen2-MoE and Qwen3-Next (``Qwen2MoeSparseMoeBlock``,
``Qwen3NextSparseMoeBlock``: the shared expert is scaled by ``sigmoid(shared_expert_gate(x))``),
GPT-OSS (``GptOssMLP``: a router bias on the logits, softmax over the top-K logits, expert
biases, a clamped SwiGLU), Llama-4 (``Llama4TextMoe``: the gate scales the expert's input, a
sigmoid of the top-K logits), DeepSeek-V2 with ``topk_method group_limited_greedy`` limiting
groups (a group scores its best expert; rdepc's router sums its best two), Ernie-4.5 with a
``moe_norm_min`` of 1/E or more (the gates' sum clamped). So is every other module with an
``experts`` submodule, any submodule, parameter, buffer or attribute of a mapped block outside
the table's (a bias on a shared expert's projections, router jitter noise, experts with
biases or in another layout), and a spec that disagrees with the block: its sizes, expert
function, top-K, router or shared experts (``model.layers.0.mlp (MixtralSparseMoeBlock) has
ffn 32, but layer 'm' (m.rdep) says 64``). A spec's capacity policy is its own: blocks are
dropless, and a spec that may drop routes computes what it says.

Weights are copied once (the kernels read gate and up interleaved and ``w_down`` as
[E, F, H]) and held in the block's dtype. An RDEPBlock's state dict presents the block's own
transformers names and layout (``gate.weight``, ``experts.gate_up_proj`` [E, 2F, H],
``experts.down_proj`` [E, H, F], ``shared_experts.gate_proj.weight``, the bias buffer...), and
``load_state_dict`` takes them: what a swapped model's ``save_pretrained`` writes, transformers
loads, and a transformers checkpoint loads into a swapped model. :func:`unswap` gives the
transformers blocks back, with the weights as trained.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import nn

from rdepc.api import Layer, UsageError, load
from rdepc.moe import RDEPMoE


class SwapError(UsageError):
    """A model block that rdepc.hf does not map, or that the spec does not describe."""


ANY = object()  # an attribute whose value swap does not read (or reads through the router rule)
SILU = ("SiLU", "SiLUActivation")


@dataclass(frozen=True)
class Part:
    """A submodule swap knows: its class, and the children, parameters, buffers and plain
    attributes it may have, each name mapped to the value it must have (or ANY; a child to its
    Part). ``classes`` None: any class, not looked into (an activation, compared with the spec)."""

    classes: tuple[str, ...] | None
    children: dict[str, Part] = field(default_factory=dict)
    params: dict[str, object] = field(default_factory=dict)
    buffers: dict[str, object] = field(default_factory=dict)
    attrs: dict[str, object] = field(default_factory=dict)


_ACT = Part(None)
_LINEAR = Part(("Linear",), params={"weight": ANY, "bias": None}, attrs={"in_features": ANY, "out_features": ANY})
_EXPERT_LAYOUT = {"has_gate": True, "has_bias": False, "has_post_expert_norm": False, "is_transposed": False}


def _mlp(cls: str) -> Part:
    children = {"gate_proj": _LINEAR, "up_proj": _LINEAR, "down_proj": _LINEAR, "act_fn": _ACT}
    return Part((cls,), children, attrs={"config": ANY, "hidden_size": ANY, "intermediate_size": ANY})


def _experts(cls: str) -> Part:
    attrs = {"num_experts": ANY, "hidden_dim": ANY, "intermediate_dim": ANY, "config": ANY}
    attrs |= _EXPERT_LAYOUT | {"is_concatenated": True}  # the attributes transformers' expert kernels read
    return Part((cls,), {"act_fn": _ACT}, params={"gate_up_proj": ANY, "down_proj": ANY}, attrs=attrs)


def _gate(cls: str, *attrs: str, **parts) -> Part:
    known = dict.fromkeys(("top_k", "num_experts", *attrs), ANY)
    return Part((cls,), params={"weight": ANY}, attrs=known, **parts)


# --------------------------------------------------------------------- the routers, in spec terms
def _router(score: str, renormalize: bool, bias: bool = False, groups=(1, 1), scale=1) -> dict:
    g, m = groups
    g, m = (1, 1) if (m or 1) >= (g or 1) else (g, m)  # every group kept: no groups at all
    return {
        "score": score,
        "bias": bias,
        "groups": g,
        "top_groups": m,
        "renormalize": renormalize,
        "scale": Fraction(str(scale)),
    }


def _softmax_renormalized(gate) -> dict:
    return _router("softmax", True)


def _softmax_norm_topk(gate) -> dict:
    return _router("softmax", bool(gate.norm_topk_prob))


def _deepseek_v2(gate) -> dict | str:
    method = gate.topk_method
    if method == "group_limited_greedy" and gate.topk_group != gate.num_group:
        return (
            f"topk_method group_limited_greedy (top {gate.topk_group} of {gate.num_group} groups): a group "
            "scores its best expert, and rdepc's router sums its best two"
        )
    if method not in ("greedy", "group_limited_greedy"):
        return f"topk_method {method!r}, which rdepc.hf does not map"
    return _router("softmax", False, scale=gate.routed_scaling_factor)  # the greedy top-K, never renormalised


def _deepseek_v3(gate) -> dict:
    groups = (gate.num_group, gate.topk_group)
    return _router("sigmoid", bool(gate.norm_topk_prob), True, groups, gate.routed_scaling_factor)


def _ernie(gate) -> dict | str:
    if gate.norm_min * gate.num_experts >= 1:  # a softmax's top-K sum is at least 1/E: below, never clamped
        return f"norm_min {gate.norm_min} (the gates' sum clamped at it), which is not below 1/E"
    return _router("softmax", True, True)


@dataclass(frozen=True)
class Family:
    """How swap maps one transformers block class: everything the block may hold (its gate's
    and experts' classes among it), its gate's rule in the spec's router terms (or why there is
    none), where the gate keeps its selection bias and the block its shared MLP."""

    name: str
    block: Part
    router: Callable[[nn.Module], dict | str]
    bias: str | None = None
    shared: str | None = None


def _family(name, block, *, gate, experts, router, shared=None, attrs=None, bias=None) -> Family:
    children = {"gate": gate, "experts": _experts(experts)}
    if shared is not None:
        children[shared[0]] = _mlp(shared[1])
    part = Part((block,), children, attrs=attrs or {})
    return Family(name, part, router, bias, None if shared is None else shared[0])


_V3_GATE = ("hidden_dim", "routed_scaling_factor", "num_group", "topk_group", "norm_topk_prob")
_CONFIG = {"config": ANY}

FAMILIES: dict[str, Family] = {
    f.block.classes[0]: f
    for f in (
        _family(
            "Mixtral", "MixtralSparseMoeBlock",
            gate=_gate("MixtralTopKRouter", "hidden_dim"),
            experts="MixtralExperts",
            router=_softmax_renormalized,
            attrs={"top_k": ANY, "jitter_noise": 0},  # jitter: noise on the input in training
        ),
        _family(
            "Qwen3-MoE", "Qwen3MoeSparseMoeBlock",
            gate=_gate("Qwen3MoeTopKRouter", "hidden_dim", "norm_topk_prob"),
            experts="Qwen3MoeExperts",
            router=_softmax_norm_topk,
        ),
        _family(
            "OLMoE", "OlmoeSparseMoeBlock",
            gate=_gate("OlmoeTopKRouter", "hidden_dim", "norm_topk_prob"),
            experts="OlmoeExperts",
            router=_softmax_norm_topk,
        ),
        _family(
            "DeepSeek-V2", "DeepseekV2Moe",
            gate=_gate("DeepseekV2TopkRouter", "hidden_dim", "routed_scaling_factor", "topk_method", "num_group",
                       "topk_group"),
            experts="DeepseekV2Experts",
            router=_deepseek_v2,
            shared=("shared_experts", "DeepseekV2MLP"),
            attrs=_CONFIG,
        ),
        _family(
            "DeepSeek-V3", "DeepseekV3MoE",
            gate=_gate("DeepseekV3TopkRouter", *_V3_GATE, buffers={"e_score_correction_bias": ANY}),
            experts="DeepseekV3Experts",
            router=_deepseek_v3,
            shared=("shared_experts", "DeepseekV3MLP"),
            attrs=_CONFIG,
            bias="e_score_correction_bias",
        ),
        _family(
            "GLM-4-MoE", "Glm4MoeMoE",
            gate=_gate("Glm4MoeTopkRouter", *_V3_GATE, buffers={"e_score_correction_bias": ANY}),
            experts="Glm4MoeExperts",
            router=_deepseek_v3,
            shared=("shared_experts", "Glm4MoeMLP"),
            attrs=_CONFIG,
            bias="e_score_correction_bias",
        ),
        _family(
            "Ernie-4.5-MoE", "Ernie4_5_MoeSparseMoeBlock",
            gate=_gate("Ernie4_5_MoeTopKRouter", "norm_min", children={
                "moe_statics": Part(("Ernie4_5_MoeStatics",), params={"e_score_correction_bias": ANY}),
            }),
            experts="Ernie4_5_MoeExperts",
            router=_ernie,
            shared=("shared_experts", "Ernie4_5_MoeMLP"),  # None without moe_num_shared_experts
            attrs=dict.fromkeys(("hidden_dim", "num_experts", "top_k"), ANY),
            bias="moe_statics.e_score_correction_bias",  # [1, E]
        ),
        _family(
            "HunYuan-MoE-V1", "HunYuanMoEV1Moe",
            gate=Part(("HunYuanMoEV1Gate",), {"wg": _LINEAR},
                      attrs=dict.fromkeys(("config", "layer_idx", "num_experts", "top_k"), ANY)),
            experts="HunYuanMoEV1Experts",
            router=_softmax_renormalized,
            shared=("shared_mlp", "HunYuanMoEV1MLP"),
            attrs=_CONFIG,
        ),
    )
}  # fmt: skip

REFUSED: dict[str, str] = {
    "Qwen2MoeSparseMoeBlock": "Qwen2-MoE scales its shared expert by sigmoid(shared_expert_gate(x)), which a spec's "
    "shared experts cannot express",
    "Qwen3NextSparseMoeBlock": "Qwen3-Next scales its shared expert by sigmoid(shared_expert_gate(x)), which a spec's "
    "shared experts cannot express",
    "GptOssMLP": "GPT-OSS adds a router bias to the logits and softmaxes the top-K logits, and its experts have "
    "biases and a clamped SwiGLU, which a spec cannot express",
    "Llama4TextMoe": "Llama-4 scales each expert's input by a sigmoid of its top-K logit (not its output), which a "
    "spec cannot express",
}


# --------------------------------------------------------------------- finding and checking blocks
def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every sparse MoE block: a module with an ``experts`` submodule, or of a
    class in the table (those swap maps and those it refuses); not looked into further."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue
        if (
            type(m).__name__ in FAMILIES
            or type(m).__name__ in REFUSED
            or isinstance(m._modules.get("experts"), nn.Module)
        ):
            found.append((name, m))
    return found


def family_of(name: str, block: nn.Module) -> Family:
    """The table's row for ``block`` (at ``name`` in its model), or a :class:`SwapError`."""
    cls = type(block).__name__
    if cls in REFUSED:
        raise SwapError(f"{name} ({cls}): {REFUSED[cls]}")
    if cls not in FAMILIES:
        raise SwapError(
            f"{name} ({cls}) has experts, but {cls} is not a block class rdepc.hf maps (rdepc.hf's table lists them)"
        )
    return FAMILIES[cls]


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else type(v).__name__


def _walk(where: str, m: nn.Module, part: Part, path: str = "") -> None:
    """Refuse anything in ``m`` that ``part`` does not list, or whose value it fixes otherwise."""
    cls = type(m).__name__
    if part.classes is None:
        return
    if cls not in part.classes:
        raise SwapError(
            f"{where} has {path.rstrip('.')} of class {cls}, where rdepc.hf maps {' or '.join(part.classes)}"
        )
    for name, child in m._modules.items():
        if name not in part.children:
            raise SwapError(f"{where} has submodule {path}{name} ({type(child).__name__}), which rdepc.hf does not map")
        if child is not None:
            _walk(where, child, part.children[name], f"{path}{name}.")
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
        if want is not ANY and v != want:
            raise SwapError(f"{where} has {path}{name} = {_short(v)}, and rdepc.hf maps only {want!r}")


def _show(v) -> str:
    return f"{float(v):g}" if isinstance(v, Fraction) else str(v)  # a scale as the spec writes it


def _shared_text(count: int, act: str, ffn: int) -> str:
    return f"{count} x {act}(ffn = {ffn})"


def _check(name: str, block: nn.Module, layer: Layer) -> Family:
    """The block's family, once its structure is the table's and the spec describes it."""
    fam = family_of(name, block)
    where = f"{name} ({type(block).__name__})"
    _walk(where, block, fam.block)
    spec, sh = layer.spec, layer.shapes
    ex, gate = block.experts, block.gate
    E, twoF, H = ex.gate_up_proj.shape
    if tuple(ex.down_proj.shape) != (E, H, twoF // 2):
        raise SwapError(
            f"{where} has experts.down_proj {tuple(ex.down_proj.shape)}, not [E, H, F] = {(E, H, twoF // 2)}"
        )
    act = type(ex.act_fn).__name__
    rule = fam.router(gate)
    if isinstance(rule, str):
        raise SwapError(f"{where}: its router {type(gate).__name__} has {rule}")
    found = {
        "hidden": H,
        "experts": E,
        "ffn": twoF // 2,
        "top": gate.top_k,
        "expert": "swiglu" if act in SILU else f"gated {act}",
    }
    want = {"hidden": sh["H"], "experts": sh["E"], "ffn": sh["F"], "top": sh["K"], "expert": spec.expert.act}
    r = spec.router
    spec_rule = _router(r.score, r.renormalize, r.bias, (r.groups, r.top_groups), r.scale)
    for k, v in rule.items():
        found[f"router {k}"], want[f"router {k}"] = v, spec_rule[k]
    for k in found:
        if found[k] != want[k]:
            says = f"layer '{spec.name}' ({spec.file}) says {_show(want[k])}"
            raise SwapError(f"{where} has {k} {_show(found[k])}, but {says}")
    mlp = getattr(block, fam.shared) if fam.shared else None
    says = None if spec.shared is None else _shared_text(spec.shared.count, spec.shared.fn.act, int(spec.shared.fn.F))
    if mlp is None or spec.shared is None:
        if (mlp is None) != (spec.shared is None):
            has = None if mlp is None else _shared_text(1, "swiglu", mlp.gate_proj.weight.shape[0])
            raise SwapError(f"{where} has shared {has}, but layer '{spec.name}' ({spec.file}) says {says}")
    else:
        Fs = mlp.gate_proj.weight.shape[0]
        act = "swiglu" if type(mlp.act_fn).__name__ in SILU else f"gated {type(mlp.act_fn).__name__}"
        if (act, Fs) != (spec.shared.fn.act, spec.shared.count * int(spec.shared.fn.F)):  # N experts of F_s/N each
            raise SwapError(
                f"{where} has shared {_shared_text(1, act, Fs)}, but layer '{spec.name}' ({spec.file}) says {says}"
            )
    return fam


# --------------------------------------------------------------------- the swapped block
class RDEPBlock(nn.Module):
    """A transformers sparse MoE block (a class in rdepc.hf's table), its experts run by rdepc's
    kernels. ``gate`` is the block's router module; ``moe`` an ``RDEPMoE`` with no router of its
    own (it routes from the gate's logits, by the gate's bias). Its state dict is the block's."""

    def __init__(self, block: nn.Module, layer: Layer, family: Family | None = None, **moe_options):
        super().__init__()
        fam = family or family_of(type(block).__name__, block)
        self.hf_class = type(block).__name__  # the table's key (a Family holds functions: not pickled)
        has_shared = fam.shared is not None and getattr(block, fam.shared) is not None
        self.hf_shared = fam.shared if has_shared else None  # its shared MLP's name (Ernie's may be None)
        self.gate = block.gate  # kept: its weight is the router, and transformers records its logits
        moe_options.setdefault("dtype", block.experts.gate_up_proj.dtype)  # the model's dtype; compute in the spec's
        self.moe = RDEPMoE(layer, **moe_options)
        self.moe.router = None  # routes by the gate's logits: one router weight, no tensor shared in checkpoints
        self.moe.router_bias = None  # the gate's own buffer is passed at each call: it follows model.to and updates
        # The transformers block without its expert weights (meta), for unswap: its class, config and attributes.
        shells = [block.experts] + ([getattr(block, self.hf_shared)] if self.hf_shared else [])
        memo = {id(block.gate): block.gate}
        for p in (p for m in shells for p in m.parameters()):
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        self.__dict__["_hf_shell"] = copy.deepcopy(block, memo)  # not a submodule: no state, no parameters
        with torch.no_grad():
            for key in self.layout():
                error = self._write(key, block.get_parameter(key))
                if error:  # _check has compared the sizes: this is a block that changed since
                    raise SwapError(f"{type(block).__name__}.{key}: {error}")
        self.register_state_dict_post_hook(_present)
        self.register_load_state_dict_pre_hook(_take)
        self.register_load_state_dict_post_hook(_forget_child_keys)

    @property
    def family(self) -> Family:
        return FAMILIES[self.hf_class]

    def router_bias(self) -> torch.Tensor | None:
        """The gate's selection bias [E] as it is now, or None."""
        bias = self.family.bias
        return None if bias is None else operator.attrgetter(bias)(self.gate).reshape(-1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # any number of tokens: the block pads them to the W ranks
        logits = self.gate(x)[0]  # every mapped gate returns (logits, gates, ids): transformers records them
        return self.moe(x, logits=logits, router_bias=self.router_bias()).reshape(shape)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The block's transformers key of each expert weight -> (the RDEPMoE parameter that
        holds it, its transformers shape)."""
        m = self.moe
        E, H, F = len(m.experts), m.H, m.F
        out = {"experts.gate_up_proj": ("w_gate_up", (E, 2 * F, H)), "experts.down_proj": ("w_down", (E, H, F))}
        s = self.hf_shared
        if s:
            width = m.shared_up.shape[0] * m.shared_up.shape[2]  # N shared experts of F_s: one MLP of N·F_s
            out[f"{s}.gate_proj.weight"] = ("shared_gate", (width, H))
            out[f"{s}.up_proj.weight"] = ("shared_up", (width, H))
            out[f"{s}.down_proj.weight"] = ("shared_down", (H, width))
        return out

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The routed and shared experts' weights under the block's transformers names and in its
        layouts (new tensors, detached): ``experts.gate_up_proj`` [E, 2F, H] (gate rows, then up),
        ``experts.down_proj`` [E, H, F], the shared MLP's ``gate_proj`` / ``up_proj`` [N·F_s, H]
        and ``down_proj`` [H, N·F_s] (shared expert j: hidden units j·F_s onward)."""
        out = {}
        for key, (name, _) in self.layout().items():
            p = source = getattr(self.moe, name).detach()
            if name == "w_gate_up":  # [E, H, F, 2] -> [E, 2, F, H]
                p = p.permute(0, 3, 2, 1).flatten(1, 2)
            elif name == "w_down":
                p = p.transpose(1, 2)
            elif name == "shared_down":  # [N, F_s, H] -> [H, N, F_s]
                p = p.permute(2, 0, 1).flatten(1, 2)
            else:  # [N, H, F_s] -> [N, F_s, H]
                p = p.transpose(1, 2).flatten(0, 1)
            p = p.contiguous()
            aliased = p.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
            out[key] = p.clone() if aliased else p  # never the parameter's own storage (a size-1 dimension)
        return out

    def _write(self, key: str, value: torch.Tensor) -> str | None:
        """Copy one transformers tensor into its RDEPMoE parameter (call under no_grad); the
        error when its shape is not the block's."""
        m = self.moe
        name, want = self.layout()[key]
        if name in ("w_gate_up", "w_down") and value.dim() == 3 and value.shape[0] == m.E != len(m.experts):
            value = value[list(m.experts)]  # a per-rank block: its own experts' rows
        if tuple(value.shape) != want:
            return f"copying a param with shape {tuple(value.shape)}, the block's is {want}"
        p = getattr(m, name)
        if name == "w_gate_up":
            p.copy_(value.unflatten(1, (2, m.F)).permute(0, 3, 2, 1))
        elif name == "w_down":
            p.copy_(value.transpose(1, 2))
        elif name == "shared_down":
            p.copy_(value.unflatten(1, p.shape[:2]).permute(1, 2, 0))
        else:
            p.copy_(value.unflatten(0, (p.shape[0], p.shape[2])).transpose(1, 2))
        return None

    def to_hf(self) -> nn.Module:
        """The transformers block again: this block's gate module, and experts holding its weights
        (in the RDEPMoE parameters' dtype, on their device)."""
        shell = self.__dict__["_hf_shell"]
        block = copy.deepcopy(shell, {id(shell.gate): self.gate})
        block.gate = self.gate
        layout = self.layout()
        for key, value in self.hf_state_dict().items():
            owner, _, leaf = key.rpartition(".")
            grad = getattr(self.moe, layout[key][0]).requires_grad
            setattr(block.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=grad))
        return block


def _present(module: RDEPBlock, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """The state dict as the transformers block's: no key of the RDEPMoE's (whatever its own
    format), the experts under the block's names."""
    for key in [k for k in state_dict if k.startswith(prefix + "moe.")]:
        del state_dict[key]
    for key, value in module.hf_state_dict().items():
        state_dict[prefix + key] = value


def _take(module: RDEPBlock, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """The transformers keys copied into the RDEPMoE and removed: it never sees them."""
    module.__dict__["_loading"] = prefix
    with torch.no_grad():
        for key in module.layout():
            if prefix + key not in state_dict:
                missing_keys.append(prefix + key)
                continue
            value = state_dict.pop(prefix + key)
            if not torch.overrides.is_tensor_like(value):
                error_msgs.append(
                    f"While copying the parameter named {prefix + key!r}, expected a tensor, got {type(value)}"
                )
                continue
            error = module._write(key, value)
            if error:
                error_msgs.append(f"size mismatch for {prefix}{key}: {error}")


def _forget_child_keys(module: RDEPBlock, incompatible) -> None:
    """The RDEPMoE's own keys are not the block's: none is missing."""
    prefix = module.__dict__.pop("_loading", None)
    if prefix is not None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(prefix + "moe.")]


# --------------------------------------------------------------------- swap and unswap
def swap(model: nn.Module, spec, *, layer: str | None = None, **options) -> list[str]:
    """Replace every sparse MoE block of ``model`` with an :class:`RDEPBlock` built from
    ``spec`` (a path or a :class:`Layer`; ``-D`` overrides as keywords, e.g.
    ``T=512``). ``backend``, ``device``, ``schedule``, ``module_options`` go to ``RDEPMoE``;
    the blocks are built on the device their weights are on unless ``device`` says otherwise.
    Returns the names of the blocks replaced; raises :class:`SwapError`, before replacing any,
    when there are none, or one is not in rdepc.hf's table, or the spec does not describe it."""
    moe_keys = ("backend", "device", "schedule", "module_options")
    moe_options = {k: options.pop(k) for k in moe_keys if k in options}
    built = spec if isinstance(spec, Layer) else load(spec, layer, **options)
    blocks = moe_blocks(model)
    if not blocks:
        raise SwapError(f"{type(model).__name__} has no sparse MoE block (a module with 'experts')")
    if blocks[0][0] == "":
        raise SwapError(f"{type(model).__name__} is itself a sparse MoE block: swap the model (or a module) holding it")
    families = [_check(name, block, built) for name, block in blocks]
    for (name, block), fam in zip(blocks, families, strict=True):
        device = moe_options.get("device", block.experts.gate_up_proj.device)
        _replace(model, name, RDEPBlock(block, built, fam, **{**moe_options, "device": device}))
    return [name for name, _ in blocks]


def unswap(model: nn.Module) -> nn.Module:
    """Every :class:`RDEPBlock` of ``model`` replaced by the transformers block it was swapped
    from, holding its current weights; returns ``model`` (or the block, when ``model`` is one)."""
    if isinstance(model, RDEPBlock):
        return model.to_hf()
    for name, m in list(model.named_modules()):
        if isinstance(m, RDEPBlock):
            _replace(model, name, m.to_hf())
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, new)


__all__ = ["FAMILIES", "REFUSED", "Family", "RDEPBlock", "SwapError", "family_of", "moe_blocks", "swap", "unswap"]
