"""Swap the sparse MoE blocks of a transformers model for ``RDEPMoE`` blocks, and back.

    from rdepc.hf import spec_for, swap, unswap
    swap(model, ranks=2, tokens=512)                         # the spec written from the blocks
    swap(model, "examples/mixtral_8x7b.rdep", W=1, T=512)   # or one given, checked against them
    print(spec_for(model, ranks=2, tokens=512))              # the spec swap writes
    named_parameters(model)                                  # its parameters by transformers' names
    unswap(model)                                            # transformers' own blocks again

swap maps exactly the transformers (5.x) block classes of the table in
:mod:`rdepc.hf_families` (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, Qwen3-Next, DeepSeek-V2,
DeepSeek-V3, GLM-4-MoE, Ernie-4.5-MoE, HunYuan-MoE-V1, GPT-OSS, Llama-4, MiniMax, Jamba,
GraniteMoE (and GraniteMoE-Shared's and -Hybrid's blocks), FlexOlmo, the text blocks of
Qwen3-VL-MoE, Qwen3.5-MoE and GLM-4V-MoE, dots.llm1,
DeepSeek-V3's clones (Kimi-Linear, EXAONE-MoE, GLM-4-MoE-Lite, DeepSeek-V3.2, MiMo-V2-Flash,
Solar-Open, GLM-MoE-DSA, MiniCPM-5-MoE, Bailing-Hybrid, A.X-K2, dots3-note's text block), DeepSeek-OCR-2's and
Unlimited-OCR's text blocks, GraniteMoE-SWA, Qwen3-MoE's clones (Qwen3-Omni-MoE's thinker and
talker blocks, Mellum, Qwen4-Exp's text block, Lara-Mini), and, in
:mod:`rdepc.hf_families_more`, MiniMax-M2, LFM2-MoE and AFMoE (whose selection bias the block
holds), DBRX, Aria's text block, Mistral-4, Mistral-Large-4's text block, Flint, HY-V3 and
dots3-note's vision block (both holding their selection bias), Beam, Laguna and Step-3.7
(their scale the block's), MiniMax-M3-VL's (clamped SwiGLU experts and shared MLP, the
shared MLP's gate and up fused), OpenAI's privacy filter (GPT-OSS's experts, gate and up in halves),
and how each one's
router, experts and shared experts read in spec terms); each becomes an :class:`RDEPBlock`
that keeps the block's router module (``gate``, GPT-OSS's and Llama-4's ``router``:
transformers still records its logits, and its weight is the router) and runs the routed
experts, and the shared experts, in an ``RDEPMoE`` that routes from the gate's logits as the
spec's ``router`` says. A block that returns its router's scores (GPT-OSS) or logits
(Llama-4) beside its output still does.

Refused, with a :class:`SwapError` naming the block's path, its class and the reason
(:mod:`rdepc.hf_spec` reads the blocks): a router the spec language cannot express (a
DeepSeek-V2 ``topk_method`` other than ``greedy`` and ``group_limited_greedy``), every other
MoE block (the mapped families listed, a near twin named), any submodule, parameter, buffer
or attribute of a mapped block outside the table's (a bias on a shared expert's projections,
router jitter noise, experts with biases or in another layout), and a spec that disagrees with the block: its sizes,
expert function, top-K, router or shared experts (``model.layers.0.mlp
(MixtralSparseMoeBlock) has ffn 32, but layer 'm' (m.rdep) says 64``). A spec's capacity
policy is its own: blocks are dropless, and a spec that may drop routes computes what it says.
Last, before any block is replaced, each swapped block is run beside its original on a probe
batch (:func:`probe`), and one whose output differs beyond its dtype's rounding is refused.

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

import torch
from torch import nn

from rdepc.api import Layer, load, load_text
from rdepc.hf_families import FAMILIES, Family, router_terms
from rdepc.hf_parts import BIASED_LAYOUTS
from rdepc.hf_spec import (
    SwapError,
    blocks_of,
    describe,
    expert_text,
    experts_weight,
    family_of,
    moe_blocks,
    shared_text,
    show,
    spec_for,
    written,
)
from rdepc.moe import RDEPMoE


# --------------------------------------------------------------------- checking a spec
def _check(name: str, block: nn.Module, layer: Layer) -> Family:
    """The block's family, once its structure is the table's and the spec describes it."""
    f = describe(name, block)
    where = f"{name} ({f.cls})"
    spec, sh = layer.spec, layer.shapes
    found = {"hidden": f.H, "experts": f.E, "ffn": f.F, "top": f.K, "expert": f.expert, "expert gate": f.gate_on}
    ef = spec.expert
    want = {"hidden": sh["H"], "experts": sh["E"], "ffn": sh["F"], "top": sh["K"], "expert gate": spec.gate_on}
    want["expert"] = expert_text(ef.act, ef.limit, ef.alpha, ef.bias)
    r = spec.router
    spec_rule = router_terms(
        r.score, r.renormalize, r.bias, (r.groups, r.top_groups), r.scale, r.group_score, r.logit_bias, r.norm_min
    )
    for k, v in f.router.items():
        found[f"router {k}"], want[f"router {k}"] = v, spec_rule[k]
    for k in found:
        if found[k] != want[k]:
            says = f"layer '{spec.name}' ({spec.file}) says {show(want[k])}"
            raise SwapError(f"{where} has {k} {show(found[k])}, but {says}")
    sp, have = spec.shared, f.shared
    says = None if sp is None else shared_text(sp.count, sp.fn.act, int(sp.fn.F), sp.gate, sp.fn.limit, sp.fn.alpha)
    has = None if have is None else shared_text(1, have.act, have.ffn, have.gate, have.limit, have.alpha)
    if have is None or sp is None:
        if (have is None) != (sp is None):
            raise SwapError(f"{where} has shared {has}, but layer '{spec.name}' ({spec.file}) says {says}")
    elif (have.act, have.ffn, have.gate, have.limit, have.alpha) != (
        sp.fn.act, sp.count * int(sp.fn.F), sp.gate, sp.fn.limit, sp.fn.alpha  # N experts of F_s/N
    ):  # fmt: skip
        raise SwapError(f"{where} has shared {has}, but layer '{spec.name}' ({spec.file}) says {says}")
    return FAMILIES[f.cls]


# --------------------------------------------------------------------- the swapped block
def _held(name: str) -> str:
    """The RDEPMoE parameter that holds a layout entry: DBRX's w_gate and w_up are w_gate_up's
    halves; a fused shared gate_up_proj's gate rows are shared_gate (its up rows shared_up)."""
    return {"w_gate": "w_gate_up", "w_up": "w_gate_up", "shared_gate_up": "shared_gate"}.get(name, name)


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
        bias = getattr(block, fam.block_bias, None) if fam.block_bias else None
        if isinstance(bias, nn.Parameter):  # the block's own selection bias (AFMoE's a parameter), kept as it is
            self.register_parameter(fam.block_bias, bias)
        elif bias is not None:  # a buffer (MiniMax-M2, LFM2-MoE)
            self.register_buffer(fam.block_bias, bias)
        moe_options.setdefault("dtype", experts_weight(block)[1].dtype)  # the model's dtype; compute in the spec's
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

    def block_bias(self) -> torch.Tensor | None:
        """The block's own selection bias (the router's second argument) as it is now, or None."""
        name = self.family.block_bias
        return None if name is None else getattr(self, name, None)

    def router_bias(self) -> torch.Tensor | None:
        """The gate's (or the block's) selection bias [E] as it is now, or None."""
        fam = self.family
        if fam.block_bias:
            bias = self.block_bias()
        else:
            bias = None if fam.bias is None else operator.attrgetter(fam.bias)(self.router_module)
        return None if bias is None else bias.reshape(-1)

    def forward(self, hidden_states: torch.Tensor):
        fam = self.family
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # any number of tokens: the block pads them to the W ranks
        args = (x if fam.router_flat else hidden_states,) + ((self.block_bias(),) if fam.block_bias else ())
        routed = self.router_module(*args)  # its logits among its outputs: transformers records them
        logits = routed if fam.logits is None else routed[fam.logits]
        y = self.moe(x, logits=logits, router_bias=self.router_bias())
        y = y if self.family.flat else y.reshape(shape)
        return (y, routed[1]) if self.family.returns_router else y

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The block's transformers key of each expert weight -> (the RDEPMoE parameter that
        holds it, its transformers shape)."""
        m = self.moe
        E, H, F = len(m.experts), m.H, m.F
        if self.family.experts == "dbrx":  # [E·F, H] each; the gate and up halves of w_gate_up, by their views
            out = {
                f"experts.mlp.{k}": (name, (E * F, H))
                for k, name in (("w1", "w_gate"), ("v1", "w_up"), ("w2", "w_down"))
            }
        elif self.family.experts == "llama4":
            out = {"experts.gate_up_proj": ("w_gate_up", (E, H, 2 * F)), "experts.down_proj": ("w_down", (E, F, H))}
        elif self.family.experts in BIASED_LAYOUTS:
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
            if self.family.shared_fused:  # gate rows, then up rows: shared_gate's and shared_up's
                out[f"{s}.gate_up_proj.weight"] = ("shared_gate_up", (2 * width, H))
            else:
                out[f"{s}.gate_proj.weight"] = ("shared_gate", (width, H))
                out[f"{s}.up_proj.weight"] = ("shared_up", (width, H))
            out[f"{s}.down_proj.weight"] = ("shared_down", (H, width))
        if self.hf_shared_gate:
            out[f"{self.hf_shared_gate}.weight"] = ("shared_gate_proj", (1, H))  # one layout: nn.Linear's
        return out

    def hf_named_parameters(self):
        """(transformers name, parameter) of each parameter of the block: the router's, and a
        selection bias the block holds, as they are; the experts' and shared experts' under the
        names of the block's state dict (:meth:`layout`; one parameter holding two entries, as
        DBRX's w_gate_up holds w1 and v1, is named by the first)."""
        named = {id(p): (n, p) for n, p in self.named_parameters()}
        for key, (name, _) in self.layout().items():
            p = getattr(self.moe, _held(name))
            if id(p) in named and named[id(p)][0].startswith("moe."):
                named[id(p)] = (key, p)
        return list(named.values())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The routed and shared experts' weights under the block's transformers names and in its
        layouts (new tensors, detached): ``experts.gate_up_proj`` [E, 2F, H] (gate rows, then up),
        ``experts.down_proj`` [E, H, F], the shared MLP's ``gate_proj`` / ``up_proj`` [N·F_s, H]
        and ``down_proj`` [H, N·F_s] (shared expert j: hidden units j·F_s onward), and the gate
        that scales it, ``shared_expert_gate.weight`` [1, H]."""
        return self.hf_layout(lambda p: p.detach())

    def hf_layout(self, of) -> dict[str, torch.Tensor]:
        """``of`` (a function of an RDEPMoE parameter: the parameter, its gradient) of each expert
        weight, under the block's transformers names and in its layouts (:meth:`hf_state_dict`)."""
        out = {}
        interleaved = self.family.experts == "gpt_oss"  # [E, H, 2F] and [E, 2F]: rdepc's own layout
        down_as_held = self.family.experts in (*BIASED_LAYOUTS, "llama4")  # [E, F, H] (and [E, H]) as rdepc holds them
        for key, (name, _) in self.layout().items():
            held = _held(name)
            p = source = of(getattr(self.moe, held))
            if name == "shared_gate_up":  # [N, H, F_s] each -> [N·F_s, H], gate rows then up
                halves = (of(self.moe.shared_gate), of(self.moe.shared_up))
                p = torch.cat([h.transpose(1, 2).flatten(0, 1) for h in halves])
            elif held != name:  # [E, H, F, 2] -> [E, F, H] (w1 or v1) -> [E·F, H]
                p = p[..., 0 if name == "w_gate" else 1].transpose(1, 2).flatten(0, 1)
            elif self.family.experts == "dbrx" and name == "w_down":  # [E, F, H] -> [E·F, H]
                p = p.flatten(0, 1)
            elif interleaved and name in ("w_gate_up", "b_gate_up"):
                p = p.flatten(-2, -1)
            elif name in ("w_gate_up", "b_gate_up") and self.family.experts == "gpt_oss_halves":  # [..., F, 2]
                p = p.transpose(-1, -2).flatten(-2, -1)
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
        dbrx = self.family.experts == "dbrx"  # [E·F, H]: expert e's rows e·F onward
        if dbrx and value.dim() == 2 and value.shape[0] == m.E * m.F != len(m.experts) * m.F:
            value = value.unflatten(0, (m.E, m.F))[list(m.experts)].flatten(0, 1)  # a per-rank block's experts
        elif name in experts and value.dim() == len(want) and value.shape[0] == m.E != len(m.experts):
            value = value[list(m.experts)]  # a per-rank block: its own experts' rows
        if tuple(value.shape) != want:
            return f"copying a param with shape {tuple(value.shape)}, the block's is {want}"
        if name == "shared_gate_up":  # [2·N·F_s, H]: gate rows, then up rows
            for half, p in zip(value.chunk(2), (m.shared_gate, m.shared_up), strict=True):
                p.copy_(half.unflatten(0, (p.shape[0], p.shape[2])).transpose(1, 2))
            return None
        p = getattr(m, name)  # DBRX's w_gate, w_up: views of w_gate_up [E, H, F, 2]
        if dbrx:  # [E·F, H] -> [E, F, H], w_down's layout; the gate and up halves [E, H, F]
            value = value.unflatten(0, (-1, m.F))
            p.copy_(value if name == "w_down" else value.transpose(1, 2))
        elif self.family.experts == "gpt_oss" and name in experts:  # rdepc's layout, gate and up interleaved
            p.copy_(value.unflatten(-1, (m.F, 2)) if name in ("w_gate_up", "b_gate_up") else value)
        elif self.family.experts == "gpt_oss_halves" and name in experts:  # [..., 2F]: the gate half, then up
            p.copy_(value.unflatten(-1, (2, m.F)).transpose(-1, -2) if name in ("w_gate_up", "b_gate_up") else value)
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
        if self.block_bias() is not None:  # the block's selection bias as it is now (it follows .to and updates)
            setattr(block, self.family.block_bias, self.block_bias())
        layout = self.layout()
        for key, value in self.hf_state_dict().items():
            owner, _, leaf = key.rpartition(".")
            grad = getattr(self.moe, _held(layout[key][0])).requires_grad
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
# How far a swapped block's output on the probe may stray from transformers' block's, as a
# share of the largest output value: several roundings of the dtype (the two sum the experts
# in another order), far below what a wrong router or expert function gives (0.1 or more).
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def probe(name: str, block: nn.Module, swapped: RDEPBlock) -> None:
    """Refuse ``swapped`` unless its output on a probe batch (W·min(T, 4) tokens drawn from a
    fixed seed) is ``block``'s within :data:`PROBE_TOLERANCE`; nothing to probe on the meta
    device."""
    w = experts_weight(block)[1]
    if w.device.type == "meta":
        return
    n = swapped.moe.W * min(swapped.moe.T, 4)
    x = torch.randn(1, n, swapped.moe.H, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        want, got = block(x), swapped(x)
    want, got = (y[0] if isinstance(y, tuple) else y for y in (want, got))
    scale = want.float().abs().max().item()
    off = (got.float().reshape(want.shape) - want.float()).abs().max().item() / (scale or 1.0)
    bound = PROBE_TOLERANCE.get(w.dtype, 1e-2)
    if not off <= bound:  # NaN included
        raise SwapError(
            f"{name} ({type(block).__name__}): on a probe of {n} tokens the swapped block's output differs from "
            f"transformers' by {off:.3g} of its largest value, beyond the {bound:g} {str(w.dtype)[6:]} allows: the "
            "spec or the mapping computes something else (swap(..., verify=False) skips this check)"
        )


def register(block_class: str | type, family: Family, *, replace: bool = False) -> None:
    """Map the transformers-style block class ``block_class`` (or its name) as ``family`` says
    (:class:`rdepc.hf_families.Family`: the structure swap accepts, the router rule in spec
    terms, the experts' layout): swap, spec_for and their checks and probe then treat it as
    one of the table's. A class already mapped is refused unless ``replace``."""
    name = block_class if isinstance(block_class, str) else block_class.__name__
    if name in FAMILIES and not replace:
        raise SwapError(f"{name} is mapped already (as {FAMILIES[name].name}): register(..., replace=True) remaps it")
    if family.block.classes is None or name not in family.block.classes:
        raise SwapError(f"register({name}): the family's block Part must list {name} among its classes")
    FAMILIES[name] = family


def swap(
    model: nn.Module,
    spec=None,
    *,
    layer: str | None = None,
    ranks: int | None = None,
    tokens: int | None = None,
    verify: bool = True,
    **options,
) -> list[str]:
    """Replace every sparse MoE block of ``model`` with an :class:`RDEPBlock`. ``spec`` (a
    path or a :class:`Layer`) describes them, and each block is checked against it; without
    one, :func:`spec_for` writes it from the blocks themselves (one layer per distinct block).
    ``ranks`` and ``tokens`` set W and T (default 1 and 512 for a written spec); other
    keywords are ``-D`` overrides of the spec's named parameters, but ``backend``, ``device``,
    ``schedule`` and ``module_options``, which go to ``RDEPMoE``. The blocks are built on the
    device their weights are on unless ``device`` says otherwise. Returns the names of the
    blocks replaced; raises :class:`SwapError`, before replacing any, when there are none, or
    one is not in rdepc.hf's table, or the spec does not describe it, or (``verify``, the
    default) a swapped block's output on a probe batch is not the block's (:func:`probe`)."""
    moe_keys = ("backend", "device", "schedule", "module_options")
    moe_options = {k: options.pop(k) for k in moe_keys if k in options}
    blocks = blocks_of(model)
    if blocks[0][0] == "":
        raise SwapError(f"{type(model).__name__} is itself a sparse MoE block: swap the model (or a module) holding it")
    if spec is None:
        text, layer_of = written(model, ranks or 1, tokens or 512)
        file = f"<rdepc.hf.spec_for({type(model).__name__})>"
        built = {n: load_text(text, n, file, **options) for n in set(layer_of.values())}
        layers = [built[layer_of[name]] for name, _ in blocks]
    else:
        options |= {k: v for k, v in (("W", ranks), ("T", tokens)) if v is not None}
        one = spec if isinstance(spec, Layer) else load(spec, layer, **options)
        layers = [one] * len(blocks)
    families = [_check(name, block, built) for (name, block), built in zip(blocks, layers, strict=True)]
    swapped = []
    for (name, block), fam, built in zip(blocks, families, layers, strict=True):
        device = moe_options.get("device", experts_weight(block)[1].device)
        swapped.append(RDEPBlock(block, built, fam, **{**moe_options, "device": device}))
        if verify:
            probe(name, block, swapped[-1])
    for (name, _), new in zip(blocks, swapped, strict=True):  # none replaced before every one is verified
        _replace(model, name, new)
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


def named_parameters(model: nn.Module):
    """``model.named_parameters()`` with each swapped block's parameters under the names of
    the transformers block it replaced (:meth:`RDEPBlock.hf_named_parameters`): what a
    training script matches names against (optimizer groups, freezing, weight decay) finds
    them as it did before the swap. Each parameter once; the rest as torch names them."""
    hf = {}
    for prefix, m in model.named_modules():
        if isinstance(m, RDEPBlock):
            hf |= {id(p): f"{prefix}.{n}" if prefix else n for n, p in m.hf_named_parameters()}
    return [(hf.get(id(p), n), p) for n, p in model.named_parameters()]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, new)


__all__ = [
    "FAMILIES",
    "Family",
    "RDEPBlock",
    "SwapError",
    "family_of",
    "moe_blocks",
    "named_parameters",
    "probe",
    "register",
    "spec_for",
    "swap",
    "unswap",
]
