"""rdepc.hf.swap against transformers' own sparse MoE blocks (small random configs, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

import rdepc
from rdepc.hf import SwapError, swap


def _transformers():
    """transformers, imported with Triton in interpreter mode: it imports Triton itself, and
    a process keeps the first mode (a CPU module needs the interpreter)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        tf = pytest.importorskip("transformers")
        for model in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
            getattr(tf, model)  # transformers imports lazily: import the models now
        return tf
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


transformers = _transformers()
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


def logits_before_and_after(model, spec, tokens=None):
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)) if tokens is None else tokens
    with torch.no_grad():
        want = model(tokens).logits
        names = swap(model, spec)
        got = model(tokens).logits
    return names, want, got


def relative(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def mixtral(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg).eval().to(dtype)


def test_a_swapped_mixtral_gives_the_same_logits(tmp_path):
    model = mixtral()
    names, want, got = logits_before_and_after(model, spec_file(tmp_path, "softmax, renormalize"))
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert isinstance(model.model.layers[0].mlp, rdepc.hf.RDEPBlock)
    assert relative(got, want) <= 1e-5
    # transformers still records the router logits: its auxiliary loss works on the swapped model.
    out = model(torch.randint(0, 64, (2, 8)), output_router_logits=True)
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)


def test_a_swapped_bf16_mixtral_stays_within_bf16_tolerance_and_trains(tmp_path):
    model = mixtral(torch.bfloat16)
    _, want, got = logits_before_and_after(model, spec_file(tmp_path, "softmax, renormalize", dtype="bf16"))
    assert relative(got, want) <= 2e-2
    model.train()
    out = model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8)))
    out.loss.backward()
    block = model.model.layers[0].mlp
    assert block.moe.w_gate_up.grad.abs().sum() > 0 and block.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("norm", [True, False])
def test_a_swapped_qwen3_moe_gives_the_same_logits(tmp_path, norm):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        **SMALL, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=norm, head_dim=8,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.2)  # transformers zeroes it: every token would tie
    router = "softmax, renormalize" if norm else "softmax"
    _, want, got = logits_before_and_after(model, spec_file(tmp_path, router, E=8, K=3, F=16))
    assert relative(got, want) <= 1e-5


def test_a_swapped_deepseek_v3_gives_the_same_logits(tmp_path):
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
            layer.mlp.gate.weight.normal_(0, 0.2)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    router = "sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5"
    spec = spec_file(tmp_path, router, E=8, K=2, F=16, extra="  shared 1 x swiglu(ffn = 16)\n")
    _, want, got = logits_before_and_after(model, spec)
    assert relative(got, want) <= 1e-5
    block = model.model.layers[0].mlp
    assert block.moe.router_bias is block.gate.e_score_correction_bias  # one buffer, updated by the user


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"F": 64}, "model.layers.0.mlp (MixtralSparseMoeBlock) has ffn 32, but layer 'm' ("),
        ({"router": "softmax"}, "has router renormalize True, but layer 'm' ("),
        ({"router": "sigmoid, renormalize"}, "has router score softmax, but layer 'm' ("),
        ({"E": 8}, "has experts 4, but layer 'm' ("),
    ],
)
def test_a_spec_that_disagrees_with_the_model_names_both(tmp_path, kw, message):
    kw = {"router": "softmax, renormalize", **kw}
    with pytest.raises(SwapError) as err:
        swap(mixtral(), spec_file(tmp_path, kw.pop("router"), **kw))
    assert message in str(err.value) and "m.rdep) says" in str(err.value)


def test_a_model_without_moe_blocks_is_an_error(tmp_path):
    with pytest.raises(SwapError, match="Linear has no sparse MoE block"):
        swap(torch.nn.Linear(2, 2), spec_file(tmp_path, "softmax"))


def test_rdepmoe_takes_n_by_h_and_fp32_into_a_bf16_layer(tmp_path):
    moe = rdepc.RDEPMoE(
        spec_file(tmp_path, "softmax, renormalize", dtype="bf16"), generator=torch.Generator().manual_seed(0)
    )
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    y = moe(x)  # fp32 in, cast at the boundary, fp32 out
    assert y.dtype == torch.float32 and y.shape == (2, 8, 32)
    assert torch.equal(moe(x.reshape(16, 32)), y.reshape(16, 32))  # [N, H]: the W ranks' tokens in order
    with pytest.raises(ValueError, match=r"x \[15, 32\] cannot be split over the 2 ranks of layer 'm'"):
        moe(x.reshape(16, 32)[:15])


def test_triton_imported_natively_first_says_what_to_set():
    code = (
        "import triton.language, rdepc\n"
        "try:\n"
        "    rdepc.RDEPMoE('examples/tiny.rdep', device='cpu')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "Start the process with TRITON_INTERPRET=1 in its environment" in out.stdout, out.stderr


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_hf_swap_example_runs(dtype):
    out = subprocess.run(
        [sys.executable, "examples/hf_swap.py", "--dtype", dtype], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert "swapped 2 blocks: model.layers.0.mlp, model.layers.1.mlp" in out.stdout
    err = float(out.stdout.split("difference: ")[1].split()[0])
    assert err <= (1e-5 if dtype == "fp32" else 2e-2)
