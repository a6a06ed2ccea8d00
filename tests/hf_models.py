"""Small random transformers models, their spec files and the float64 twins the tolerance
bounds re-run, for tests/test_hf.py and tests/test_hf_models.py."""

from __future__ import annotations

import contextlib
import copy

import hf_families as fam
import torch
from tolerance import bound, layer_chain

from rdepc.hf import swap

transformers = fam.import_transformers()  # None without it: the test modules skip
SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def spec_file(tmp_path, router: str, E: int = 4, K: int = 2, F: int = 32, dtype: str = "fp32", extra: str = ""):
    path = tmp_path / "m.rdep"
    path.write_text(
        "layer m {\n"
        f"  shape  ranks 2, tokens 8, hidden 32, experts {E}, top {K}\n"
        f"  expert swiglu(ffn = {F})\n"
        f"  dtype  {dtype}\n"
        f"  router {router}\n"
        f"{extra}"
        "  schedule bulk\n"
        "}\n"
    )
    return path


def case_spec(tmp_path, case: fam.Case, **kw):
    path = tmp_path / "case.rdep"
    path.write_text(fam.spec_text(case, **kw))
    return path


def logits_before_and_after(model, spec, tokens=None):
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)) if tokens is None else tokens
    with torch.no_grad():
        want = model(tokens).logits
        names = swap(model, spec)
        got = model(tokens).logits
    return names, want, got


def relative(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


class Float64Mode(torch.overrides.TorchFunctionMode):
    """Every fp32 a module asks for made fp64 (``.float()``, ``.to(torch.float32)``, a
    ``dtype=torch.float32``): a block that computes in fp32 whatever its input (the privacy
    filter's) would leave its float64 twin's roundings in fp32, and the bound blind to them.
    Active where the twin's input (or, for a model, its weights) is fp64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def float64_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a transformers module, its experts run by transformers' eager loop (its
    grouped GEMMs take no float64), under :class:`Float64Mode`: what tests/tolerance.py's
    bounds re-run."""
    twin = copy.deepcopy(module).double()
    for m in twin.modules():
        if hasattr(getattr(m, "config", None), "_experts_implementation"):
            m.config._experts_implementation = "eager"
    forward = twin.forward

    def forward64(x, *args, **kwargs):  # tolerance.spread runs it in fp32 too: as the block runs
        held = x if x.is_floating_point() else next(twin.parameters())  # a model's input: token ids
        with Float64Mode() if held.dtype == torch.float64 else contextlib.nullcontext():
            return forward(x, *args, **kwargs)

    twin.forward = forward64
    return twin


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name, detached: its inputs besides x."""
    return {n: t.detach() for n, t in (*module.named_parameters(), *module.named_buffers())}


def logits_bound(model, tokens, chain: int, dtype=torch.float32) -> torch.Tensor:
    """The bound (tests/tolerance.py) of ``model``'s logits for ``tokens`` computed another way."""
    twin = float64_twin(model)

    def logits(state):
        with torch.no_grad():
            return torch.func.functional_call(twin, state, (tokens,)).logits

    return bound(logits, (state_of(model),), chain, dtype)


def moe_chain(H: int, F: int, K: int, E: int, shared: int = 0) -> int:
    """An MoE block's chain: the layer's, its shared experts' F, its router's dot over H and its
    scores over E."""
    return layer_chain(H, F, K, extra=shared + H + E)


def mixtral(dtype=torch.float32, layers: int = 2):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        **(SMALL | {"num_hidden_layers": layers}), intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    )
    return transformers.MixtralForCausalLM(cfg).eval().to(dtype)


def deepseek_v3():
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        **(SMALL | {"num_key_value_heads": 4}), intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=0,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.2)  # transformers zeroes it: every token would tie
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    return model


DEEPSEEK_V3 = "sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5"
DEEPSEEK_V3_SHARED = "  shared 1 x swiglu(ffn = 16)\n"
