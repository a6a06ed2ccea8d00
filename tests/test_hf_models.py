"""rdepc.hf.swap on whole transformers models (small random configs, CPU): logits, generation,
training, parameter names, state dicts and checkpoints, the swap example."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import hf_families as fam
import pytest
import torch
from conftest import HANG_S, ROOT
from hf_models import (
    DEEPSEEK_V3,
    DEEPSEEK_V3_SHARED,
    SMALL,
    case_spec,
    deepseek_v3,
    float64_twin,
    logits_before_and_after,
    logits_bound,
    mixtral,
    moe_chain,
    relative,
    spec_file,
    state_of,
)
from safetensors.torch import load_file
from tolerance import NARROWINGS, assert_close, bound, reorder_bound, spread

import rdepc
from rdepc.hf import SwapError, swap, unswap

transformers = fam.import_transformers()
if transformers is None:
    pytest.skip("transformers is not installed", allow_module_level=True)


# ----------------------------------------------------------------------------- whole models
def test_a_swapped_mixtral_gives_the_same_logits(tmp_path):
    model = mixtral()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    limit = logits_bound(model, tokens, 2 * moe_chain(32, 32, 2, 4))  # the two models differ in 2 MoE blocks
    names, want, got = logits_before_and_after(model, spec_file(tmp_path, "softmax, renormalize"), tokens)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert isinstance(model.model.layers[0].mlp, rdepc.hf.RDEPBlock)
    assert_close(got, want, limit, "logits")
    # transformers still records the router logits: its auxiliary loss works on the swapped model.
    out = model(torch.randint(0, 64, (2, 8)), output_router_logits=True)
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)


@pytest.mark.parametrize("build", [mixtral, deepseek_v3])
def test_a_swapped_models_parameters_keep_their_transformers_names_for_optimizer_groups(build):
    """rdepc.hf.named_parameters names every parameter of a swapped model as the model named
    it before the swap (experts, shared experts, router), each once, each the swapped model's
    own: optimizer groups built by name (here: decay all but the routers) group the same."""
    model = build()
    before = [n for n, _ in model.named_parameters()]
    swap(model, ranks=2, tokens=8, verify=False)
    named = rdepc.hf.named_parameters(model)
    assert sorted(n for n, _ in named) == sorted(before)
    assert {id(p) for _, p in named} == {id(p) for p in model.parameters()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in named)
    assert any(".moe." in n for n, _ in model.named_parameters())  # torch's own names are rdepc's
    routers = [p for n, p in named if n.endswith(".mlp.gate.weight")]
    assert [id(p) for p in routers] == [id(layer.mlp.gate.weight) for layer in model.model.layers]


def test_a_swapped_bf16_mixtral_stays_within_bf16_tolerance_and_trains(tmp_path):
    model = mixtral(torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    # the two models differ in 2 MoE blocks, which round their intermediates in bf16
    limit = logits_bound(model, tokens, 2 * NARROWINGS, torch.bfloat16)
    _, want, got = logits_before_and_after(model, spec_file(tmp_path, "softmax, renormalize", dtype="bf16"), tokens)
    assert_close(got, want, limit, "logits")
    model.train()
    out = model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8)))
    out.loss.backward()
    block = model.model.layers[0].mlp
    assert block.moe.w_gate_up.grad.abs().sum() > 0 and block.gate.weight.grad.abs().sum() > 0


def test_a_swapped_mixtral_generates_the_same_tokens_at_batch_1(tmp_path):
    model = mixtral(layers=1)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    want = model.generate(tokens[:1, :8], **kw)
    swap(model, spec_file(tmp_path, "softmax, renormalize"))  # ranks 2: a prefill of 8 tokens, then 1 at a time
    assert torch.equal(model.generate(tokens[:1, :8], **kw), want)


def test_the_deepseek_v3_bias_is_the_gates_buffer_through_dtype_moves_and_updates(tmp_path):
    model = deepseek_v3()
    original = copy.deepcopy(model)
    swap(model, spec_file(tmp_path, DEEPSEEK_V3, E=8, F=16, extra=DEEPSEEK_V3_SHARED))
    block, ref = model.model.layers[0].mlp, original.model.layers[0].mlp
    assert block.moe.router is None and block.moe.router_bias is None  # routes by the gate's, at each call
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(3))
    before = None
    for dtype, favoured in ((torch.float64, [0, 1]), (torch.float32, [6, 7])):
        model.to(dtype)  # the reference stays fp32: transformers' grouped experts take no fp64
        for m in (model, original):
            m.model.layers[0].mlp.gate.e_score_correction_bias[favoured] += 2.0  # every token picks these now
        with torch.no_grad():
            got, want = block(x.to(dtype)), ref(x)
        assert got.dtype == dtype and block.gate.e_score_correction_bias.dtype == dtype
        twin = float64_twin(ref)

        def transformers_block(x, state, twin=twin):
            with torch.no_grad():
                return torch.func.functional_call(twin, state, (x,))

        assert_close(got, want, bound(transformers_block, (x, state_of(ref)), moe_chain(32, 16, 2, 8, 16)), str(dtype))
        assert before is None or relative(got, before) > 1e-2  # the update moved the routing
        before = got
    assert torch.equal(
        model.state_dict()["model.layers.0.mlp.gate.e_score_correction_bias"], ref.gate.e_score_correction_bias
    )


@pytest.mark.parametrize("name", ["minimax_m2", "lfm2_moe", "afmoe", "hy_v3", "dots3_note_vision"])
def test_a_selection_bias_the_block_holds_routes_and_is_its_state(name):
    """MiniMax-M2, LFM2-MoE, AFMoE, HY-V3 and dots3-note's vision block hold their selection
    bias in the block and pass it to the router: the swapped block holds that tensor under its
    name (the state dict is the block's), routes by it as it is at each call (an update in place
    moves the routing as it moves transformers'), and unswap gives it back as it is."""
    case = fam.CASES[name]
    holder = fam.block(transformers, case)
    bias_name = rdepc.hf_families.FAMILIES[case.block].block_bias
    keys = holder.mlp.state_dict().keys()
    original = copy.deepcopy(holder.mlp)
    swap(holder, ranks=2, tokens=8)
    block = holder.mlp
    assert block.state_dict().keys() == keys and getattr(block, bias_name) is not None
    x = torch.randn(2, 4, fam.H, generator=torch.Generator().manual_seed(3))
    twin = float64_twin(original)
    before = None
    for favoured in ([0, 1], [2, 3]):
        with torch.no_grad():
            for b in (block, original):
                getattr(b, bias_name)[favoured] += 2.0  # every token picks these now
            got, want = block(x), original(x)

        def transformers_block(x, state):
            with torch.no_grad():
                return torch.func.functional_call(twin, state, (x,))

        sigma = spread(transformers_block, (x, state_of(original)))[0]
        chain = moe_chain(fam.H, case.F, case.K, case.E, 32 if case.shared else 0)
        assert_close(got, want, reorder_bound(sigma, chain, want), "y")
        assert before is None or relative(got, before) > 1e-2  # the update moved the routing
        before = got
    back = unswap(holder).mlp
    assert torch.equal(getattr(back, bias_name), getattr(original, bias_name))


@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss", "llama4", "dbrx", "privacy_filter", "minimax_m3_vl"])
def test_a_block_round_trips_through_its_state_dict(tmp_path, name):
    """Qwen2-MoE's shared_expert_gate is the RDEPMoE's shared_gate_proj under the block's name;
    GPT-OSS's interleaved experts and their biases are its w_gate_up, b_gate_up, w_down, b_down;
    Llama-4's [E, H, 2F] gate_up_proj (gate columns, then up) its w_gate_up, its down_proj w_down
    (and the privacy filter's, with its biases in halves too); MiniMax-M3-VL's shared gate_up_proj
    its shared_gate and shared_up;
    DBRX's [E·F, H] w1, v1 and w2 the gate and up halves of its w_gate_up, and its w_down."""
    case = fam.CASES[name]
    holder = fam.block(transformers, case)
    want = {k: v.clone() for k, v in holder.mlp.state_dict().items()}
    swap(holder, case_spec(tmp_path, case))
    state = holder.mlp.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    other = fam.block(transformers, case, seed=1)
    assert not other.mlp.load_state_dict(state, strict=True).missing_keys
    swap(other, case_spec(tmp_path, case))
    moe = other.mlp.moe
    if name == "qwen2_moe":
        assert torch.equal(moe.shared_gate_proj, want["shared_expert_gate.weight"])
    elif name == "minimax_m3_vl":  # the shared MLP's gate_up_proj [2·F_s, H]: shared_gate's rows, then shared_up's
        fused = want["shared_experts.gate_up_proj.weight"]
        assert torch.equal(moe.shared_gate[0].T, fused[:16]) and torch.equal(moe.shared_up[0].T, fused[16:])
    elif name == "dbrx":
        for key, held in (("w1", moe.w_gate), ("v1", moe.w_up)):  # [E, H, F] -> [E·F, H]
            assert torch.equal(held.transpose(1, 2).flatten(0, 1), want[f"experts.mlp.{key}"])
        assert torch.equal(moe.w_down.flatten(0, 1), want["experts.mlp.w2"])
    elif name in ("llama4", "privacy_filter"):  # [E, H, 2F]: the gate half, then up
        assert torch.equal(moe.w_gate_up[..., 0], want["experts.gate_up_proj"][..., : case.F])
        assert torch.equal(moe.w_gate_up[..., 1], want["experts.gate_up_proj"][..., case.F :])
        assert torch.equal(moe.w_down, want["experts.down_proj"])
        if name == "privacy_filter":
            assert torch.equal(moe.b_gate, want["experts.gate_up_proj_bias"][:, : case.F])
            assert torch.equal(moe.b_down, want["experts.down_proj_bias"])
    else:
        assert torch.equal(moe.w_gate_up.flatten(2, 3), want["experts.gate_up_proj"])
        assert torch.equal(moe.b_gate, want["experts.gate_up_proj_bias"][:, 0::2])
        assert torch.equal(moe.b_down, want["experts.down_proj_bias"])
    back = unswap(other.mlp)
    assert type(back).__name__ == case.block
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)


def test_a_swapped_model_round_trips_through_transformers_checkpoints(tmp_path):
    model = deepseek_v3()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits
    hf_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "hf")
    spec = spec_file(tmp_path, DEEPSEEK_V3, E=8, F=16, extra=DEEPSEEK_V3_SHARED)
    swap(model, spec)
    # The swapped model's state dict is the transformers model's: its names, layouts and values.
    state = model.state_dict()
    assert state.keys() == hf_state.keys() and all(torch.equal(state[k], hf_state[k]) for k in state)
    model.save_pretrained(tmp_path / "rdep")
    saved, written = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "rdep" / "model.safetensors"),
    )
    assert saved.keys() == written.keys() and all(torch.equal(saved[k], written[k]) for k in saved)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "rdep").eval()
    # The transformers checkpoint into swapped models: by load_state_dict, and by from_pretrained.
    fresh = transformers.DeepseekV3ForCausalLM(model.config).eval()
    swap(fresh, spec)
    assert not fresh.load_state_dict(hf_state, strict=True).missing_keys
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    swap(loaded, spec)
    limit = logits_bound(back, tokens, 2 * moe_chain(32, 16, 2, 8, 16))  # the models differ in 2 MoE blocks
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, want)
        assert_close(fresh(tokens).logits, want, limit, "fresh")
        assert_close(loaded(tokens).logits, want, limit, "loaded")
        assert unswap(fresh) is fresh and type(fresh.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
        assert torch.equal(fresh(tokens).logits, want)  # the transformers blocks again, with the weights
    assert {k: v.shape for k, v in fresh.state_dict().items()} == {k: v.shape for k, v in hf_state.items()}


def test_rdepmoe_takes_any_number_of_tokens_and_fp32_into_a_bf16_layer(tmp_path):
    moe = rdepc.RDEPMoE(
        spec_file(tmp_path, "softmax, renormalize", dtype="bf16"), generator=torch.Generator().manual_seed(0)
    )
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    y = moe(x)  # fp32 in, cast at the boundary, fp32 out
    assert y.dtype == torch.float32 and y.shape == (2, 8, 32)
    assert torch.equal(moe(x.reshape(16, 32)), y.reshape(16, 32))  # [N, H]: the W ranks' tokens in order
    assert torch.equal(moe(x.reshape(16, 32)[:15]), y.reshape(16, 32)[:15])  # padded to the W ranks


def test_triton_imported_natively_first_says_what_to_set():
    code = (
        "import triton.language, rdepc\n"
        "try:\n"
        "    rdepc.RDEPMoE('examples/tiny.rdep', device='cpu')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert "Start the process with TRITON_INTERPRET=1 in its environment" in out.stdout, out.stderr


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_hf_swap_example_runs(dtype):
    out = subprocess.run(
        [sys.executable, "examples/hf_swap.py", "--dtype", dtype],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, out.stderr
    assert "swapped 2 blocks: model.layers.0.mlp, model.layers.1.mlp" in out.stdout
    err = float(out.stdout.split("difference: ")[1].split()[0])
    assert err <= (1e-5 if dtype == "fp32" else 2e-2)


def test_the_hf_swap_example_without_transformers_says_what_to_install():
    code = "import runpy, sys\nsys.modules['transformers'] = None\nrunpy.run_path(sys.argv[1], run_name='__main__')\n"
    out = subprocess.run(
        [sys.executable, "-c", code, "examples/hf_swap.py"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "examples/hf_swap.py needs transformers, which is not installed: pip install 'transformers>=5.0'"
    ]


def test_from_hf_without_transformers_says_what_to_install(tmp_path):
    code = "import sys\nsys.modules['transformers'] = None\nfrom rdepc.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    out = subprocess.run(
        [sys.executable, "-c", code, "from-hf", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "rdepc: error: rdepc from-hf needs transformers, which is not installed: pip install 'transformers>=5.0'"
    )


def test_ernies_gate_floor_is_the_specs_norm_min_where_the_bias_makes_it_bind(tmp_path):
    """An Ernie-4.5 block whose selection bias picks experts whose scores sum below its
    moe_norm_min (transformers divides the chosen gates by clamp(sum, min=norm_min)): swapped
    with 'norm_min' it computes what transformers does; a spec without it is refused."""
    case = fam.Case(
        "ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock",
        {"moe_intermediate_size": 16, "moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 0,
         "moe_norm_min": 0.1},
        router="softmax, bias, renormalize, norm_min 0.1", E=8,
    )  # fmt: skip
    holder = fam.block(transformers, case)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in holder.mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        holder.mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 8, generator=g))
    original = copy.deepcopy(holder.mlp)
    x = torch.randn(2, 8, fam.H, generator=g)
    scores = torch.softmax(torch.nn.functional.linear(x.reshape(-1, fam.H), original.gate.weight), dim=-1)
    chosen = (scores + original.gate.moe_statics.e_score_correction_bias).topk(2, dim=-1).indices
    assert (scores.gather(-1, chosen).sum(-1) < 0.1).any()  # the floor binds for some token
    with pytest.raises(SwapError, match=r"has router norm_min 0\.1, but layer 'm' \(.*\) says None"):
        swap(copy.deepcopy(holder), case_spec(tmp_path, dataclasses.replace(case, router="softmax, bias, renormalize")))
    assert swap(holder, case_spec(tmp_path, case)) == ["mlp"]
    with torch.no_grad():
        want, got = original(x), holder.mlp(x)
    twin = float64_twin(original)
    sigma = spread(lambda x, state: torch.func.functional_call(twin, state, (x,)), (x, state_of(original)))[0]
    assert_close(got, want, reorder_bound(sigma, moe_chain(fam.H, case.F, case.K, case.E), want), "y")


def test_from_hf_writes_the_spec_of_a_checkpoint_directory_offline(tmp_path, main):
    """rdepc from-hf reads only a model's config (saved here, no weights), builds the model on
    the meta device and writes its MoE blocks' spec: dense first layers counted out of the
    model statement, the config's dtype kept, the result a spec rdepc check accepts."""
    cfg = transformers.DeepseekV3Config(
        **(SMALL | {"num_hidden_layers": 4, "num_key_value_heads": 4}), intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, dtype="bfloat16",
    )  # fmt: skip
    cfg.save_pretrained(tmp_path / "dsv3")
    out = tmp_path / "dsv3.rdep"
    status, said, err = main("from-hf", str(tmp_path / "dsv3" / "config.json"), "--ranks", "2", "-o", str(out))
    assert status == 0, err
    assert said == f"wrote {out}\n"
    text = out.read_text()
    assert "router   sigmoid, bias, groups 4, top_groups 2, renormalize, scale 2.5" in text
    assert "model    moe_layers 3, layers 4, vocab 64" in text and "dtype    bf16" in text
    layer = rdepc.load(out)
    assert layer.shapes["W"] == 2 and layer.shapes["T"] == 4096 and layer.shapes["E"] == 8
    status, said, _ = main("check", str(out))
    assert status == 0 and "layer deepseek_v3: ok" in said
    for bad, message in (
        (tmp_path / "nowhere", "nowhere: no such file or directory (a model directory or its config.json)"),
        (tmp_path, f"{tmp_path} has no config.json"),
        (out, "dsv3.rdep: give a model directory or its config.json"),
    ):
        status, _, err = main("from-hf", str(bad))
        assert status == 2 and message in err, err
