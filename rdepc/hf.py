"""Swap the sparse MoE blocks of a transformers model for ``RDEPMoE`` blocks.

    from rdepc.hf import swap
    swapped = swap(model, "examples/mixtral_8x7b.rdep", W=1, T=512, H=..., F=...)

Each block with a router ``gate`` (``weight`` [E, H]) and fused ``experts``
(``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]) — transformers' Mixtral,
Qwen3-MoE and DeepSeek-V3 blocks — becomes an :class:`RDEPBlock`: the same router module
(transformers still records its logits for its auxiliary loss) routing as the spec's
``router`` statement says, and an ``RDEPMoE`` whose experts (and DeepSeek-V3's shared
expert) carry the block's weights. They are copied once: the kernels read gate and up
interleaved and ``w_down`` as [E, F, H], which transformers' layouts are not. A spec that
disagrees with a block (a size, the activation, the router) is a :class:`SwapError` that
names both.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from torch import nn

from rdepc.api import Layer, UsageError, load
from rdepc.moe import RDEPMoE


class SwapError(UsageError):
    """A model block that the spec does not describe."""


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every sparse MoE block: a router ``gate`` and fused ``experts``."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if hasattr(m, "gate") and hasattr(getattr(m, "experts", None), "gate_up_proj")
    ]


def _router_of(gate: nn.Module) -> dict:
    """The spec ``router`` a transformers router module computes."""
    if hasattr(gate, "e_score_correction_bias"):  # DeepSeek-V3
        return {
            "score": "sigmoid",
            "bias": True,
            "groups": gate.num_group,
            "top_groups": gate.topk_group,
            "renormalize": bool(gate.norm_topk_prob),
            "scale": Fraction(str(gate.routed_scaling_factor)),
        }
    return {"score": "softmax", "bias": False, "renormalize": bool(getattr(gate, "norm_topk_prob", True))}


def _check(name: str, block: nn.Module, layer: Layer) -> None:
    spec, sh = layer.spec, layer.shapes
    ex = block.experts
    E, twoF, H = ex.gate_up_proj.shape
    act = type(getattr(ex, "act_fn", None)).__name__
    found = {
        "hidden": H,
        "experts": E,
        "ffn": twoF // 2,
        "top": block.gate.top_k,
        "expert": "swiglu" if act in ("SiLU", "SiLUActivation") else f"gated {act}",
    }
    want = {"hidden": sh["H"], "experts": sh["E"], "ffn": sh["F"], "top": sh["K"], "expert": spec.expert.act}
    r = spec.router
    for k, v in _router_of(block.gate).items():
        found[f"router {k}"] = v
        want[f"router {k}"] = getattr(r, k)
    shared = getattr(block, "shared_experts", None)
    found["shared"] = None if shared is None else f"1 x swiglu(ffn = {shared.gate_proj.weight.shape[0]})"
    want["shared"] = (
        None if spec.shared is None else f"{spec.shared.count} x {spec.shared.fn.act}(ffn = {spec.shared.fn.F})"
    )
    for k in found:
        if found[k] != want[k]:
            raise SwapError(
                f"{name} ({type(block).__name__}) has {k} {found[k]}, but layer '{spec.name}' "
                f"({spec.file}) says {want[k]}"
            )
    if getattr(block, "jitter_noise", 0):
        raise SwapError(f"{name} uses router jitter noise ({block.jitter_noise}), which rdepc's router does not have")


class RDEPBlock(nn.Module):
    """A transformers sparse MoE block, with its routed experts run by rdepc's kernels."""

    def __init__(self, block: nn.Module, layer: Layer, **moe_options):
        super().__init__()
        self.gate = block.gate  # kept: its weight is the router, and transformers records its logits
        self.moe = RDEPMoE(layer, **moe_options)
        F = self.moe.F
        ex = block.experts
        with torch.no_grad():
            self.moe.w_gate_up.copy_(ex.gate_up_proj.unflatten(1, (2, F)).permute(0, 3, 2, 1))
            self.moe.w_down.copy_(ex.down_proj.transpose(1, 2))
            shared = getattr(block, "shared_experts", None)
            if shared is not None:
                self.moe.shared_gate[0].copy_(shared.gate_proj.weight.T)
                self.moe.shared_up[0].copy_(shared.up_proj.weight.T)
                self.moe.shared_down[0].copy_(shared.down_proj.weight.T)
        self.moe.router = self.gate.weight  # one parameter: the gate computes the logits the block routes by
        if self.moe.router_bias is not None:
            self.moe.router_bias = self.gate.e_score_correction_bias

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = self.gate(x)[0]
        return self.moe(x, logits=logits).reshape(shape)


def swap(model: nn.Module, spec, *, layer: str | None = None, **options) -> list[str]:
    """Replace every sparse MoE block of ``model`` with an :class:`RDEPBlock` built from
    ``spec`` (a path or a :class:`Layer`; ``-D`` overrides as keywords, e.g.
    ``T=512``). ``backend``, ``device``, ``schedule``, ``module_options`` go to ``RDEPMoE``;
    the blocks are built on the device their weights are on unless ``device`` says otherwise.
    Returns the names of the blocks replaced; raises :class:`SwapError` when there are none or
    one disagrees with the spec."""
    moe_keys = ("backend", "device", "schedule", "module_options")
    moe_options = {k: options.pop(k) for k in moe_keys if k in options}
    built = spec if isinstance(spec, Layer) else load(spec, layer, **options)
    blocks = moe_blocks(model)
    if not blocks:
        raise SwapError(f"{type(model).__name__} has no sparse MoE block (a 'gate' router and fused 'experts')")
    for name, block in blocks:
        _check(name, block, built)
    for name, block in blocks:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        device = moe_options.get("device", block.experts.gate_up_proj.device)
        setattr(parent, attr, RDEPBlock(block, built, **{**moe_options, "device": device}))
    return [name for name, _ in blocks]


__all__ = ["RDEPBlock", "SwapError", "moe_blocks", "swap"]
