"""The runtime's errors and its API under the Triton interpreter: inputs checked before a
launch, waits that expire, owner overflows, RDEPMoE, ``rdepc.load`` through the cache, an
imported compiled directory, ``rdepc run``; the layer against the reference:
tests/test_runtime.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import pytest
import torch
from conftest import ROOT
from rdepc.runtime.module import KernelError, RDEPModule
from rdepc.runtime.tensors import gate_up
from runtime_run import Run
from tolerance import assert_close, bound, bounds, layer_chain, reorder_bound, unit_roundoff

import rdepc
from rdepc.api import Layer, elaborate_layer
from rdepc.ir.contract import Tiles
from rdepc.parser import parse_text
from rdepc.reference import random_inputs, reference_for

pytestmark = pytest.mark.usefixtures("module_cache")


# ------------------------------------------------------------------ errors


@pytest.fixture(scope="module")
def tiny_module():
    return rdepc.load(ROOT / "examples" / "tiny.rdep").module()


def _bad(name: str, inputs):
    x, ids, g, wg, wu, wd = inputs
    match name:
        case "x shape":
            return (x[:, :, :-1], ids, g, wg, wu, wd), r"x must be \[W=4, T', H=64\], got \(4, 16, 63\)"
        case "too many tokens":
            return (torch.cat([x, x], 1), torch.cat([ids, ids], 1), torch.cat([g, g], 1), wg, wu, wd), (
                r"x has T'=32 tokens per rank, more than the layer's bound T=16"
            )
        case "x dtype":
            return (x.double(), ids, g, wg, wu, wd), r"x must be torch.float32 \(the spec's dtype fp32\)"
        case "ids dtype":
            return (x, ids.float(), g, wg, wu, wd), "topk_ids must be int64 \\(or int32\\), got torch.float32"
        case "ids shape":
            return (x, ids[..., :1], g, wg, wu, wd), r"topk_ids must be \[W, T', K\] = \[4, 16, 2\]"
        case "expert out of range":
            ids = ids.clone()
            ids[2, 5, 1] = 8
            ids[3, 0, 0] = -2
            ids[3, 1, 0] = -1  # routes nowhere: no error
            return (x, ids, g, wg, wu, wd), (
                r"expert ids must lie in \[0, 8\) or be -1 \(no expert\): 2 route rows out of range, the first rank 2 "
                r"token 5 \(token 37 in order\) slot 1 \(id 8\)"
            )
        case "duplicate expert":
            return (x, ids[..., :1].expand(-1, -1, 2), g, wg, wu, wd), (
                r"64 tokens list one expert twice in their top-K, the first rank 0 token 0 \(token 0 in order\) "
                r"\(experts \[(\d), \1\]\)"
            )
        case "NaN gate":
            g = g.clone()
            g[1, 2, 0] = float("nan")
            return (x, ids, g, wg, wu, wd), (
                r"topk_weights has 1 non-finite gates \(NaN or inf\), the first rank 1 token 2 \(token 18 in order\) "
                r"slot 0 \(nan\)"
            )
        case "inf gate":
            g = g.clone()
            g[3, 7, 1] = float("-inf")
            g[2, 9, 0] = float("inf")
            return (x, ids, g, wg, wu, wd), (
                r"2 non-finite gates \(NaN or inf\), the first rank 2 token 9 \(token 41 in order\) slot 0 \(inf"
            )
        case "missing w_gate":
            return (x, ids, g, None, wu, wd), "swiglu experts are gated: w_gate"
        case "w_down shape":
            return (x, ids, g, wg, wu, wd.transpose(1, 2)), r"w_down must be \[8, 128, 64\]"
        case "weights dtype":
            return (x, ids, g, wg.half(), wu, wd), "w_gate must be torch.float32"
        case "device":
            return (x.to("meta"), ids, g, wg, wu, wd), "x is on meta, the module on cpu"
    raise AssertionError(name)


IN_KERNEL = ("expert out of range", "duplicate expert", "NaN gate", "inf gate")


@pytest.mark.parametrize(
    "case",
    [
        "x shape",
        "too many tokens",
        "x dtype",
        "ids dtype",
        "ids shape",
        "expert out of range",
        "duplicate expert",
        "NaN gate",
        "inf gate",
        "missing w_gate",
        "w_down shape",
        "weights dtype",
        "device",
    ],
)
def test_inputs_are_checked(tiny_module, case):
    """Shapes, dtypes and devices on the host, before any launch; what needs the data (ids
    in range, distinct top-K, finite gates) in the kernel, raised from its record after the
    call, which completes: the next call runs clean."""
    inputs = random_inputs(4, 16, 64, 128, 8, 2, seed=1)
    args, message = _bad(case, inputs)
    before = tiny_module.launcher.launches
    with pytest.raises((ValueError, TypeError), match=message):
        tiny_module(*args)
    assert tiny_module.launcher.launches - before == (1 if case in IN_KERNEL else 0)
    if case in IN_KERNEL:
        y = tiny_module(*inputs)
        reference = reference_for(rdepc.load(ROOT / "examples" / "tiny.rdep"))
        ref, _ = reference(*inputs)
        assert_close(y, ref, bound(reference, inputs, layer_chain(64, 128, 2)), "the next call")


def test_a_call_that_needs_no_gradient_keeps_nothing(tiny_module):
    inputs = random_inputs(4, 16, 64, 128, 8, 2, seed=2)
    y = tiny_module(*inputs)  # nothing requires grad: no graph, nothing kept for a backward
    assert not y.requires_grad and y.grad_fn is None
    gates = inputs.topk_weights.clone().requires_grad_(True)
    with torch.no_grad():
        assert tiny_module(inputs.x, inputs.topk_ids, gates, *inputs[3:]).grad_fn is None
    y = tiny_module(inputs.x, inputs.topk_ids, gates, *inputs[3:])
    assert y.requires_grad and "rdepc_forward" in type(y.grad_fn).__name__  # the rdepc::forward op's
    ctx = tiny_module.last_context  # the routing context the backward walks
    # dropless: every slot survives, and g' = g · Σg / Σg, that scale 1 exactly
    assert ctx.accepted.all() and (ctx.slot >= 0).all() and torch.equal(ctx.gprime, inputs.topk_weights)


def test_max_relative_error_a_slice_at_a_time_is_the_whole_tensors(monkeypatch):
    from rdepc.runtime import tensors

    g = torch.Generator().manual_seed(3)
    ref = torch.randn(5, 7, generator=g)
    y = ref + 1e-3 * torch.randn(5, 7, generator=g)
    whole = float((y.double() - ref.double()).abs().max()) / float(ref.double().abs().max())
    monkeypatch.setattr(tensors, "ERROR_SLICE", 4)  # 9 slices, the last one of 3
    assert tensors.max_relative_error(y, ref) == whole
    y[4, 6] = float("nan")  # in the last slice: a NaN is never a maximum's loser
    assert math.isnan(tensors.max_relative_error(y, ref))
    assert tensors.max_relative_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert tensors.max_relative_error(torch.ones(3), torch.zeros(3)) == math.inf
    assert tensors.max_relative_error(torch.ones(2, 3), torch.ones(3) * 2) == 0.5  # broadcast, as y - ref does


def test_a_wait_that_expires_is_reported_not_hung():
    """A task table whose order is not topological (entry 0 waits on the last entry): the
    sequential interpreter would hang; the bounded wait reports the task and its dependency."""
    layer = rdepc.load(ROOT / "examples" / "tiny.rdep")
    compiled = layer.compile()
    plan = compiled.kernel
    last = len(plan.table) - 1
    first = plan.table[0]._replace(dep_start=len(plan.deps), dep_count=1)
    broken = dataclasses.replace(plan, table=(first, *plan.table[1:]), deps=(*plan.deps, last))
    module = RDEPModule(broken, compiled.kernels_path, spin_bound=20)
    inputs = random_inputs(4, 16, 64, 128, 8, 2)
    message = (
        r"the forward kernel stopped in call 1: task #0 \(route r0\) on rank 0 \(any task \(unified\) programs\) "
        r"waited 20 spins for the done flag of task #55 \(combine tile0 r3\) on rank 3: saw 0, expected 1"
    )
    for _ in range(2):  # the control block is reset after an error: the next call fails the same way
        with pytest.raises(KernelError, match=message) as e:
            module(*inputs)
        assert e.value.record["flag"] == last and e.value.record["call"] == 1


def test_an_owner_overflow_is_reported():
    """More rows than the plan's bound (duplicate top-K ids, which forward() rejects, sent
    straight to the kernel): the scan admits none and reports instead of writing past S."""
    module = Layer(Run(W=2, E=2, K=2, T=4).spec()).module()
    inputs = random_inputs(2, 4, 32, 32, 2, 2)
    ids = torch.zeros((2, 4, 2), dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"owner r0 admitted 16 rows, more than the plan's bound R_q = 8"):
        module._run(inputs.x, ids, inputs[2], gate_up(*inputs[3:5]), inputs[5], torch.full((2,), 4))


# ------------------------------------------------------------------ API and CLI


def test_rdepmoe_runs_the_kernels_and_adds_shared_experts():
    text = Run(W=2, E=4, K=2, T=6).text().replace("  owner", "  shared    2 x swiglu(ffn = 16)\n  owner")
    spec, _ = elaborate_layer(parse_text(text, "moe.rdep"), None, {})
    moe = rdepc.RDEPMoE(Layer(spec), generator=torch.Generator().manual_seed(0))
    assert isinstance(moe, torch.nn.Module)
    names = {n for n, _ in moe.named_parameters()}
    assert names == {"router", "w_gate_up", "w_down", "shared_gate", "shared_up", "shared_down"}
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    ids, gates, _ = moe.route(x)
    one = torch.ones(2, 6)  # renormalised gates: K = 2 of a softmax over E = 4, their sum and quotients
    assert_close(gates.sum(-1), one, reorder_bound(unit_roundoff(torch.float32) * one, 4 + 2 * 2 + 2, one), "sums")
    assert ids.dtype == torch.int64
    probs = torch.softmax(x @ moe.router.T, -1)
    assert torch.equal(ids, probs.topk(2, dim=-1).indices)

    def block(x, p):  # the router, the routed experts by the reference, the shared experts
        top, ids = torch.softmax(x @ p["router"].T, -1).topk(2, dim=-1)
        wgu = p["w_gate_up"]
        routed, _ = reference_for(spec)(x, ids, top / top.sum(-1, keepdim=True), wgu[..., 0], wgu[..., 1], p["w_down"])
        shared = sum(
            (torch.nn.functional.silu(x @ p["shared_gate"][j]) * (x @ p["shared_up"][j])) @ p["shared_down"][j]
            for j in range(2)
        )
        return routed + shared

    params = {n: p.detach() for n, p in moe.named_parameters()}
    # the layer's chain, two shared experts of F = 16, and the router: its dot over H, its softmax over E
    chain = layer_chain(32, 32, 2, extra=2 * 16 + 32 + 4)
    with torch.no_grad():
        routed, _ = reference_for(spec)(x, ids, gates, moe.w_gate, moe.w_up, moe.w_down)
        shared = sum(
            (torch.nn.functional.silu(x @ moe.shared_gate[j]) * (x @ moe.shared_up[j])) @ moe.shared_down[j]
            for j in range(2)
        )
    assert_close(y.detach(), routed + shared, bound(block, (x, params), chain), "y")
    assert moe.last_stats["launches"] == 1
    # Training: the router through the gates, the experts through the generated backward.
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    launches = moe.kernels.launcher.launches
    (y * dy).sum().backward()
    assert moe.kernels.launcher.launches == launches + 1  # one launch: the backward pass

    def block_grads(x, params, dy):
        ref = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
        (block(x, ref) * dy).sum().backward()
        return {n: p.grad for n, p in ref.items()}

    want = block_grads(x, params, dy)
    limits = bounds(block_grads, (x, params, dy), chain + 2 * 6 * 2)  # and the W·T·K rows a weight's gradient sums
    for name, p in moe.named_parameters():
        assert_close(p.grad, want[name], limits[name], name)


def test_load_compiles_through_the_cache(tiny_module):
    layer = rdepc.load(ROOT / "examples" / "tiny.rdep")
    compiled = layer.compile()
    assert compiled.hit  # tiny_module compiled it first
    assert tiny_module.kernels_path == compiled.kernels_path
    assert layer.source == compiled.source and "def rdep_layer(" in layer.source
    assert layer.generated.kernel == compiled.kernel
    assert str(tiny_module).startswith("<rdepc.RDEPModule tiny on emulated/cpu (interpreter): W=4 T<=16")


def test_compiled_directory_is_importable(tmp_path, monkeypatch):
    from rdepc import cli

    monkeypatch.chdir(ROOT)
    assert cli.main(["compile", "examples/tiny.rdep", "-o", str(tmp_path)]) == 0
    spec = importlib.util.spec_from_file_location("tiny_compiled", tmp_path / "tiny.py")
    wrapper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrapper)
    module = wrapper.module(device="cpu")
    inputs = random_inputs(4, 11, 64, 128, 8, 2, routing="zipf:1.0", seed=4)
    y = module(*inputs)
    reference = reference_for(rdepc.load("examples/tiny.rdep"))
    ref, accepted = reference(*inputs)
    assert_close(y, ref, bound(reference, inputs, layer_chain(64, 128, 2)), "y")
    assert torch.equal(module.last_stats["accepted"], accepted)
    assert module.kernels_path == tmp_path / "tiny_kernels.py"


def test_cli_run_check(monkeypatch, capsys):
    from rdepc.runtime import tensors

    from rdepc import cli

    compared = []  # what the command compares: its output and the reference's
    relative = tensors.max_relative_error
    monkeypatch.setattr(tensors, "max_relative_error", lambda y, ref: compared.append((y, ref)) or relative(y, ref))
    monkeypatch.chdir(ROOT)
    status = cli.main(["run", "examples/tiny.rdep", "--check", "--routing", "zipf:1.2", "--tokens", "13"])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0] == "layer tiny (examples/tiny.rdep): emulated backend on cpu (Triton interpreter), bulk schedule"
    assert lines[1] == "  inputs          W=4 T'=13 H=64 F=128 E=8 K=2, fp32, routing zipf:1.2, seed 0"
    y, ref = compared[0]
    inputs = random_inputs(4, 13, 64, 128, 8, 2, routing="zipf:1.2", seed=0)  # what the command drew
    reference = reference_for(rdepc.load("examples/tiny.rdep"))
    assert torch.equal(ref, reference(*inputs)[0])
    assert_close(y, ref, bound(reference, inputs, layer_chain(64, 128, 2)), "y")
    assert lines[2].split()[3] == f"{relative(y, ref):.3g}"  # the error printed is y's
    assert lines[3] == "  accepted set    matches the reference (104 of 104 route rows accepted)"
    assert lines[-1] == "check passed"
    assert any(line.startswith("  rows per expert [") for line in lines)


def test_cli_run_check_fails_when_the_result_disagrees(monkeypatch, capsys):
    """The check compares with rdepc.reference: a reference that disagrees fails it (exit 1)."""
    import rdepc.reference as reference
    from rdepc import cli

    monkeypatch.chdir(ROOT)
    real = reference.reference_for

    def off_by_a_little(layer):
        fn = real(layer)

        def shifted(*args):
            y, accepted = fn(*args)
            return y * 1.001, accepted

        return shifted

    monkeypatch.setattr(reference, "reference_for", off_by_a_little)
    assert cli.main(["run", "examples/tiny.rdep", "--check"]) == 1
    assert "check FAILED: max relative error" in capsys.readouterr().out


def test_cli_run_usage_errors(monkeypatch, capsys):
    from rdepc import cli

    monkeypatch.chdir(ROOT)
    assert cli.main(["run", "examples/tiny.rdep", "--tokens", "17"]) == 2
    assert "--tokens 17: expected 1 <= T' <= 16" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli.main(["run", "examples/tiny.rdep", "--backend", "nvshmem"]) == 2
        assert "--backend nvshmem needs a CUDA GPU and none is visible" in capsys.readouterr().err
        assert cli.main(["run", "examples/tiny.rdep", "--device", "cuda"]) == 2


def test_the_interpreter_flag_does_not_leak(tiny_module):
    assert os.environ.get("TRITON_INTERPRET") in (None, "0")
    assert tiny_module.interpret


def test_a_split_that_leaves_a_kernel_no_program_is_refused():
    """Split mode's kernels wait on each other: each needs a program of its own within the
    programs that run at once (one per SM); the transport's share follows the schedule's
    split unless given, and neither kernel gets more programs than it has work items."""
    plan = rdepc.load(ROOT / "examples" / "tiny.rdep").compile().kernel  # W = 4
    tiles = Tiles.default(plan.H, plan.F, plan.dtype, interpret=False)
    split, unified = plan.work(tiles, "split"), plan.work(tiles, "unified")
    with pytest.raises(ValueError, match="at least one program each, within 1 programs"):
        plan.launch_grid(split, 1)
    with pytest.raises(ValueError, match="6 transport programs leave 0 for the GEMMs"):
        plan.launch_grid(split, 6, comm=6)
    items = [split.first_item[hi] - split.first_item[lo] for lo, hi in split.bounds]
    assert plan.launch_grid(split, 2) == (2, (1, 1))
    total, (comm, gemm) = plan.launch_grid(split, 132, comm=5)
    assert comm == min(5, items[0]) and gemm == min(127, items[1]) and total == comm + gemm
    assert plan.launch_grid(unified, 1) == (1, (1,))  # one queue in dependency order: any grid
