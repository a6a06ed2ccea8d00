"""Swap the sparse MoE blocks of a transformers model for ``RDEPMoE`` blocks, and back.

    from rdepc.hf import swap, unswap
    swap(model, "examples/mixtral_8x7b.rdep", W=1, T=512)   # -> the names of the blocks swapped
    unswap(model)                                            # transformers' own blocks again

swap maps exactly the transformers (5.x) block classes of the table in
:mod:`rdepc.hf_families` (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, Qwen3-Next, DeepSeek-V2,
DeepSeek-V3, GLM-4-MoE, Ernie-4.5-MoE, HunYuan-MoE-V1, GPT-OSS, Llama-4, and how each one's
router, experts and shared experts read in spec terms); each becomes an :class:`RDEPBlock`
that keeps the block's router module (``gate``, GPT-OSS's and Llama-4's ``router``:
transformers still records its logits, and its weight is the router) and runs the routed
experts, and the shared experts, in an ``RDEPMoE`` that routes from the gate's logits as the
spec's ``router`` says. A block that returns its router's scores (GPT-OSS) or logits
(Llama-4) beside its output still does.

Refused, with a :class:`SwapError` naming the block's path, its class and the reason: a
router the spec language cannot express (Ernie-4.5's clamped gate sum, a DeepSeek-V2
``topk_method`` other than ``greedy`` and ``group_limited_greedy``), every other module with
an ``experts`` submodule, any submodule, parameter, buffer or attribute of a mapped block
outside the table's (a bias on a shared expert's projections, router jitter noise, experts
with biases or in another layout), and a spec that disagrees with the block: its sizes,
expert function, top-K, router or shared experts (``model.layers.0.mlp
(MixtralSparseMoeBlock) has ffn 32, but layer 'm' (m.rdep) says 64``). A spec's capacity
policy is its own: blocks are dropless, and a spec that may drop routes computes what it says.

Weights are copied once (the kernels read gate and up interleaved and ``w_down`` as
[E, F, H]) and held in the block's dtype. An RDEPBlock's state dict presents the block's own
transformers names and layout (``gate.weight``, ``experts.gate_up_proj`` [E, 2F, H],
``experts.down_proj`` [E, H, F], ``shared_experts.gate_proj.weight``, Qwen's
``shared_expert_gate.weight``, the bias buffer, GPT-OSS's ``experts.gate_up_proj_bias``...), and
``load_state_dict`` takes them: what a swapped model's ``save_pretrained`` writes, transformers
loads, and a transformers checkpoint loads into a swapped model. :func:`unswap` gives the
transformers blocks back, with the weights as trained.
"""

from __future__ import annotations

import copy
import operator
from fractions import Fraction

import torch
from torch import nn

from rdepc.api import Layer, UsageError, load
from rdepc.hf_families import ANY, FAMILIES, SILU, Family, Part, router_terms
from rdepc.moe import RDEPMoE


class SwapError(UsageError):
    """A model block that rdepc.hf does not map, or that the spec does not describe."""


# --------------------------------------------------------------------- finding and checking blocks
def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every sparse MoE block: a module with an ``experts`` submodule, or of a
    class in the table (those swap maps and those it refuses); not looked into further."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue
        if type(m).__name__ in FAMILIES or isinstance(m._modules.get("experts"), nn.Module):
            found.append((name, m))
    return found


def family_of(name: str, block: nn.Module) -> Family:
    """The table's row for ``block`` (at ``name`` in its model), or a :class:`SwapError`."""
    cls = type(block).__name__
    if cls not in FAMILIES:
        raise SwapError(
            f"{name} ({cls}) has experts, but {cls} is not a block class rdepc.hf maps (rdepc.hf_families lists them)"
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


def _shared_text(count: int, act: str, ffn: int, gate: str | None = None) -> str:
    return f"{count} x {act}(ffn = {ffn})" + ("" if gate is None else f", gate {gate}")


def _expert_text(act: str, limit=None, alpha=None, bias: bool = False) -> str:
    """An expert function as a spec says it, less its width."""
    params = "" if limit is None else f"(limit = {_show(limit)}, alpha = {_show(alpha)})"
    return f"{act}{params}" + (", bias" if bias else "")


def _experts_found(where: str, fam: Family, ex: nn.Module) -> tuple[int, int, int, str]:
    """(E, H, F, the expert function in spec terms) of a block's experts, in its family's layout."""
    if fam.experts in ("gpt_oss", "llama4"):  # gate_up_proj [E, H, 2F], down_proj [E, F, H]
        E, H, twoF = ex.gate_up_proj.shape
        down, layout = (E, twoF // 2, H), "[E, F, H]"
    else:
        E, twoF, H = ex.gate_up_proj.shape
        down, layout = (E, H, twoF // 2), "[E, H, F]"
    if fam.experts == "gpt_oss":  # gate and up interleaved, biases
        text = _expert_text("clamped_swiglu", Fraction(str(ex.limit)), Fraction(str(ex.alpha)), bias=True)
    else:
        act = type(ex.act_fn).__name__
        text = "swiglu" if act in SILU else f"gated {act}"
    if tuple(ex.down_proj.shape) != down:
        raise SwapError(f"{where} has experts.down_proj {tuple(ex.down_proj.shape)}, not {layout} = {down}")
    return E, H, twoF // 2, text


def _check(name: str, block: nn.Module, layer: Layer) -> Family:
    """The block's family, once its structure is the table's and the spec describes it."""
    fam = family_of(name, block)
    where = f"{name} ({type(block).__name__})"
    _walk(where, block, fam.block)
    spec, sh = layer.spec, layer.shapes
    gate = getattr(block, fam.gate)
    E, H, F, expert = _experts_found(where, fam, block.experts)
    rule = fam.router(gate)
    if isinstance(rule, str):
        raise SwapError(f"{where}: its router {type(gate).__name__} has {rule}")
    found = {"hidden": H, "experts": E, "ffn": F, "top": gate.top_k, "expert": expert, "expert gate": fam.gate_on}
    ef = spec.expert
    want = {"hidden": sh["H"], "experts": sh["E"], "ffn": sh["F"], "top": sh["K"], "expert gate": spec.gate_on}
    want["expert"] = _expert_text(ef.act, ef.limit, ef.alpha, ef.bias)
    r = spec.router
    spec_rule = router_terms(
        r.score, r.renormalize, r.bias, (r.groups, r.top_groups), r.scale, r.group_score, r.logit_bias, r.norm_min
    )
    for k, v in rule.items():
        found[f"router {k}"], want[f"router {k}"] = v, spec_rule[k]
    for k in found:
        if found[k] != want[k]:
            says = f"layer '{spec.name}' ({spec.file}) says {_show(want[k])}"
            raise SwapError(f"{where} has {k} {_show(found[k])}, but {says}")
    mlp = getattr(block, fam.shared) if fam.shared else None
    gated = "sigmoid" if fam.shared_gate and getattr(block, fam.shared_gate) is not None else None
    sp = spec.shared
    says = None if sp is None else _shared_text(sp.count, sp.fn.act, int(sp.fn.F), sp.gate)
    if mlp is None or sp is None:
        if (mlp is None) != (sp is None):
            has = None if mlp is None else _shared_text(1, "swiglu", mlp.gate_proj.weight.shape[0], gated)
            raise SwapError(f"{where} has shared {has}, but layer '{spec.name}' ({spec.file}) says {says}")
    else:
        Fs = mlp.gate_proj.weight.shape[0]
        fn = type(getattr(mlp, "act_fn", None) or mlp.activation_fn).__name__  # Llama-4's: activation_fn
        act = "swiglu" if fn in SILU else f"gated {fn}"
        if (act, Fs, gated) != (sp.fn.act, sp.count * int(sp.fn.F), sp.gate):  # N experts of F_s/N each
            raise SwapError(
                f"{where} has shared {_shared_text(1, act, Fs, gated)}, but layer '{spec.name}' ({spec.file}) "
                f"says {says}"
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
        self.hf_gate = fam.gate  # the router module's name: gate, or GPT-OSS's router
        has_shared = fam.shared is not None and getattr(block, fam.shared) is not None
        self.hf_shared = fam.shared if has_shared else None  # its shared MLP's name (Ernie's may be None)
        self.hf_shared_gate = fam.shared_gate if has_shared else None  # the Linear(H, 1) scaling it (Qwen)
        gate = getattr(block, fam.gate)
        setattr(self, fam.gate, gate)  # kept: its weight is the router, and transformers records its logits
        moe_options.setdefault("dtype", block.experts.gate_up_proj.dtype)  # the model's dtype; compute in the spec's
        self.moe = RDEPMoE(layer, **moe_options)
        self.moe.router = None  # routes by the gate's logits: one router weight, no tensor shared in checkpoints
        self.moe.router_logit_bias = None  # the gate's logits hold any bias on them
        self.moe.router_bias = None  # the gate's own buffer is passed at each call: it follows model.to and updates
        # The transformers block without its expert weights (meta), for unswap: its class, config and attributes.
        shared = [getattr(block, n) for n in (self.hf_shared, self.hf_shared_gate) if n]
        shells = [block.experts, *shared]
        memo = {id(gate): gate}
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

    @property
    def router_module(self) -> nn.Module:
        """The block's router module (``gate``, or GPT-OSS's ``router``)."""
        return getattr(self, self.hf_gate)

    def router_bias(self) -> torch.Tensor | None:
        """The gate's selection bias [E] as it is now, or None."""
        bias = self.family.bias
        return None if bias is None else operator.attrgetter(bias)(self.router_module).reshape(-1)

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # any number of tokens: the block pads them to the W ranks
        routed = self.router_module(x)  # its logits among its outputs: transformers records them
        y = self.moe(x, logits=routed[self.family.logits], router_bias=self.router_bias())
        y = y if self.family.flat else y.reshape(shape)
        return (y, routed[1]) if self.family.returns_router else y

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The block's transformers key of each expert weight -> (the RDEPMoE parameter that
        holds it, its transformers shape)."""
        m = self.moe
        E, H, F = len(m.experts), m.H, m.F
        if self.family.experts == "llama4":
            out = {"experts.gate_up_proj": ("w_gate_up", (E, H, 2 * F)), "experts.down_proj": ("w_down", (E, F, H))}
        elif self.family.experts == "gpt_oss":
            out = {
                "experts.gate_up_proj": ("w_gate_up", (E, H, 2 * F)),
                "experts.gate_up_proj_bias": ("b_gate_up", (E, 2 * F)),
                "experts.down_proj": ("w_down", (E, F, H)),
                "experts.down_proj_bias": ("b_down", (E, H)),
            }
        else:
            out = {"experts.gate_up_proj": ("w_gate_up", (E, 2 * F, H)), "experts.down_proj": ("w_down", (E, H, F))}
        s = self.hf_shared
        if s:
            width = m.shared_up.shape[0] * m.shared_up.shape[2]  # N shared experts of F_s: one MLP of N·F_s
            out[f"{s}.gate_proj.weight"] = ("shared_gate", (width, H))
            out[f"{s}.up_proj.weight"] = ("shared_up", (width, H))
            out[f"{s}.down_proj.weight"] = ("shared_down", (H, width))
        if self.hf_shared_gate:
            out[f"{self.hf_shared_gate}.weight"] = ("shared_gate_proj", (1, H))  # one layout: nn.Linear's
        return out

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The routed and shared experts' weights under the block's transformers names and in its
        layouts (new tensors, detached): ``experts.gate_up_proj`` [E, 2F, H] (gate rows, then up),
        ``experts.down_proj`` [E, H, F], the shared MLP's ``gate_proj`` / ``up_proj`` [N·F_s, H]
        and ``down_proj`` [H, N·F_s] (shared expert j: hidden units j·F_s onward), and the gate
        that scales it, ``shared_expert_gate.weight`` [1, H]."""
        out = {}
        interleaved = self.family.experts == "gpt_oss"  # [E, H, 2F] and [E, 2F]: rdepc's own layout
        down_as_held = self.family.experts in ("gpt_oss", "llama4")  # [E, F, H] (and [E, H]) as rdepc holds them
        for key, (name, _) in self.layout().items():
            p = source = getattr(self.moe, name).detach()
            if interleaved and name in ("w_gate_up", "b_gate_up"):
                p = p.flatten(-2, -1)
            elif down_as_held and name in ("w_down", "b_down"):
                pass
            elif self.family.experts == "llama4" and name == "w_gate_up":  # [E, H, F, 2] -> [E, H, 2F]
                p = p.transpose(2, 3).flatten(2, 3)
            elif name == "w_gate_up":  # [E, H, F, 2] -> [E, 2, F, H]
                p = p.permute(0, 3, 2, 1).flatten(1, 2)
            elif name == "w_down":
                p = p.transpose(1, 2)
            elif name == "shared_down":  # [N, F_s, H] -> [H, N, F_s]
                p = p.permute(2, 0, 1).flatten(1, 2)
            elif name != "shared_gate_proj":  # [N, H, F_s] -> [N, F_s, H]
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
        experts = ("w_gate_up", "w_down", "b_gate_up", "b_down")
        if name in experts and value.dim() == len(want) and value.shape[0] == m.E != len(m.experts):
            value = value[list(m.experts)]  # a per-rank block: its own experts' rows
        if tuple(value.shape) != want:
            return f"copying a param with shape {tuple(value.shape)}, the block's is {want}"
        p = getattr(m, name)
        if self.family.experts == "gpt_oss" and name in experts:  # rdepc's layout, gate and up interleaved
            p.copy_(value.unflatten(-1, (m.F, 2)) if name in ("w_gate_up", "b_gate_up") else value)
        elif self.family.experts == "llama4" and name in experts:  # [E, H, 2F] gate then up; [E, F, H]
            p.copy_(value.unflatten(-1, (2, m.F)).transpose(2, 3) if name == "w_gate_up" else value)
        elif name == "w_gate_up":
            p.copy_(value.unflatten(1, (2, m.F)).permute(0, 3, 2, 1))
        elif name == "w_down":
            p.copy_(value.transpose(1, 2))
        elif name == "shared_down":
            p.copy_(value.unflatten(1, p.shape[:2]).permute(1, 2, 0))
        elif name == "shared_gate_proj":
            p.copy_(value)
        else:
            p.copy_(value.unflatten(0, (p.shape[0], p.shape[2])).transpose(1, 2))
        return None

    def to_hf(self) -> nn.Module:
        """The transformers block again: this block's gate module, and experts holding its weights
        (in the RDEPMoE parameters' dtype, on their device)."""
        shell = self.__dict__["_hf_shell"]
        gate = self.router_module
        block = copy.deepcopy(shell, {id(getattr(shell, self.hf_gate)): gate})
        setattr(block, self.hf_gate, gate)
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


__all__ = ["FAMILIES", "Family", "RDEPBlock", "SwapError", "family_of", "moe_blocks", "swap", "unswap"]
