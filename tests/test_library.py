"""The library GEMM lowering (rdepc.runtime.library): torch's grouped GEMM between the
transport kernel's launches, phased mode, forward and backward, against the reference
under every construct it takes; bitwise across calls and between one process and one
process per rank; the compiler's choice and its reasons; what it refuses, and where."""

from __future__ import annotations

import pytest
import torch
from conftest import HANG_S, ROOT, layer_bound, layer_grad_bounds
from rdepc.runtime import ranks
from rdepc.runtime.library import activation, activation_backward, block_sums
from rdepc.runtime.tensors import TORCH_DTYPES
from tolerance import assert_close, bounds, layer_chain

import rdepc
from rdepc.api import Layer, elaborate_layer
from rdepc.diagnostics import UsageError
from rdepc.ir.queues import COLUMNS, GEMM_KINDS
from rdepc.parser import parse_text
from rdepc.per_rank import Case, Job, run_rank
from rdepc.reference import random_biases, random_inputs, reference_for

# name: (expert, dtype statement, more statements, transport options)
CASES = {
    "swiglu": ("swiglu(ffn = 32)", "fp32", "", ""),
    "gelu": ("gelu(ffn = 32)", "fp32", "", ""),
    "relu": ("relu(ffn = 32)", "fp32", "", ""),
    "clamped swiglu": ("clamped_swiglu(ffn = 32, limit = 0.5)", "fp32", "", ""),
    "gate input": ("swiglu(ffn = 32), gate input", "fp32", "", ""),
    "drops": ("swiglu(ffn = 32)", "fp32", "  capacity  factor 0.75, drop arrival\n", ""),
    "recompute, resend": ("swiglu(ffn = 32)", "fp32", "  activations pre recompute, input resend\n", ""),
    "bf16": ("swiglu(ffn = 32)", "bf16", "", ""),
    "fp8 rows, fp8 backward": ("swiglu(ffn = 32)", "bf16, dispatch fp8_e4m3, scale block, backward fp8_e4m3", "", ""),
    "dedup, fp8 rows": (
        "swiglu(ffn = 32)",
        "fp32, dispatch fp8_e4m3, scale row",
        "  sideband  row_id, local_expert, gate, scale\n",
        ", dedup",
    ),
}


def text_of(case: str, W: int = 2, T: int = 12, gemm: str = "") -> str:
    expert, dtype, extra, transport = CASES[case]
    return (
        "layer lib {\n"
        f"  shape     ranks {W}, tokens {T}, hidden 256, experts 4, top 2\n"
        f"  expert    {expert}\n"
        f"  dtype     {dtype}\n"
        "  owner     balanced\n"
        f"{extra}"
        f"  schedule  bulk{gemm}\n"
        f"  transport emulated{transport}\n"
        "}\n"
    )


def layer(case: str, W: int = 2, T: int = 12, gemm: str = "") -> Layer:
    spec, _ = elaborate_layer(parse_text(text_of(case, W, T, gemm), "lib.rdep"), None, {})
    return Layer(spec)


def grads(fn, inputs, dy, dtype) -> dict:
    """{name: fp32 gradient} of sum(y · dy) through ``fn``, x and the weights in ``dtype`` (a
    non-gated expert has no w_gate), the gates in fp32."""
    x, ids, g, wg, wu, wd = inputs
    named = {"x": x, "w_gate": wg, "w_up": wu, "w_down": wd}
    leaves = {n: t.detach().to(dtype).requires_grad_(True) for n, t in named.items() if t is not None}
    leaves["topk_weights"] = g.detach().float().requires_grad_(True)
    y = fn(leaves["x"], ids, leaves["topk_weights"], leaves.get("w_gate"), leaves["w_up"], leaves["w_down"])
    y = y[0] if isinstance(y, tuple) else y
    (y.float() * dy).sum().backward()
    return {n: t.grad.float() for n, t in leaves.items()}


def inputs_of(lay: Layer, seed: int = 3):
    sh, spec = lay.shapes, lay.spec
    dt = TORCH_DTYPES[spec.precision.dtype.value]
    inp = random_inputs(
        sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], seed=seed, dtype=dt, gated=spec.expert.gated,
        routing="zipf:1.2",
    )  # fmt: skip
    return inp, dt


@pytest.mark.parametrize("case", list(CASES))
def test_the_library_lowering_matches_the_reference_forward_and_backward(case):
    lay = layer(case)
    inp, dt = inputs_of(lay)
    module = lay.module(gemm="library")
    assert (module.gemm, module.mode, module.gemm_source) == ("library", "phased", "given")
    with torch.no_grad():
        y = module(*inp)
    ref, accepted = reference_for(lay.spec)(*(t.float() if t is not None and t.is_floating_point() else t for t in inp))
    assert torch.equal(module.last_stats["accepted"], accepted)
    narrow = None if dt == torch.float32 else dt
    assert_close(y, ref, layer_bound(lay, inp, narrow), f"{case}: y")
    dy = torch.randn(inp.x.shape, generator=torch.Generator().manual_seed(7)).to(dt).float()
    got = grads(module, inp, dy, dt)
    want = grads(reference_for(lay.spec), inp, dy, torch.float32)
    limits = layer_grad_bounds(lay, inp, dy, narrow)
    for name, w in want.items():
        assert_close(got[name], w, limits[name], f"{case}: d{name}")


def test_expert_biases_through_the_library():
    """Output and every gradient, the biases' included, within their bounds of the reference,
    for the library lowering and the Triton one alike."""
    lay = Layer(elaborate_layer(parse_text(text_of("swiglu").replace("ffn = 32)", "ffn = 32), bias"), "b.rdep"),
                                None, {})[0])  # fmt: skip
    inp, _ = inputs_of(lay)
    sh = lay.shapes
    biases = random_biases(sh["E"], sh["H"], sh["F"], gated=True, seed=3)
    dy = torch.randn(inp.x.shape, generator=torch.Generator().manual_seed(7))

    def step(fn, inputs, biases, dy) -> dict:
        x, ids, g, wg, wu, wd = inputs
        named = {"x": x, "topk_weights": g, "w_gate": wg, "w_up": wu, "w_down": wd} | biases
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in named.items()}
        y = fn(leaves["x"], ids, *(leaves[n] for n in ("topk_weights", "w_gate", "w_up", "w_down")),
               **{k: leaves[k] for k in biases})  # fmt: skip
        y = y[0] if isinstance(y, tuple) else y
        (y * dy).sum().backward()
        return {"y": y.detach()} | {n: t.grad for n, t in leaves.items()}

    want = step(reference_for(lay.spec), inp, biases, dy)
    limits = bounds(lambda *a: step(reference_for(lay.spec), *a), (inp, biases, dy),
                    layer_chain(sh["H"], sh["F"], sh["K"], extra=sh["W"] * sh["T"] * sh["K"]))  # fmt: skip
    for gemm in ("triton", "library"):
        module = lay.module(gemm=gemm, mode="phased")
        got = step(module, inp, biases, dy)
        for name, w in want.items():
            assert_close(got[name], w, limits[name], f"{gemm}: {name}")


def test_the_library_lowering_is_bitwise_across_calls_and_from_one_process_to_one_per_rank(tmp_path):
    path = tmp_path / "lib.rdep"
    path.write_text(text_of("swiglu", W=2, T=8), encoding="utf-8")
    sh = rdepc.load(path).shapes
    inp = random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], seed=0)
    module = rdepc.load(path).module(gemm="library")
    with torch.no_grad():
        y, again = module(*inp), module(*inp)
    assert torch.equal(y, again)
    case = Case(str(path), gemm="library", keep_output=True, calls=2)
    results = [r[0] for r in ranks.spawn(run_rank, 2, Job((case,)), timeout=HANG_S)]
    for rank, r in enumerate(results):
        assert r["gemm"] == "library" and r["mode"] == "phased"
        assert torch.equal(r["y"], y[rank]), rank


def test_no_rank_waits_for_another_ranks_gemm_entries():
    """What the library relies on: its GEMM entries' done flags, raised by the GEMM kernel
    before the library computes, are waited for only by entries of their own rank, which
    run after the library on the stream (every example, bulk, both passes)."""
    col = {c: i for i, c in enumerate(COLUMNS)}
    for path in sorted((ROOT / "examples").glob("*.rdep")):
        p = rdepc.load(path, **({"W": 12} if "nvl72" in path.name else {})).compile(schedule="bulk").kernel
        for table, deps in ((p.table, p.deps), (p.bwd_table, p.bwd_deps)):
            for row in table:
                start, n = row[col["dep_start"]], row[col["dep_count"]]
                for d in deps[start : start + n]:
                    dep = table[d if d >= 0 else -d - 1]
                    if dep[col["kind"]] in GEMM_KINDS:
                        assert dep[col["rank"]] == row[col["rank"]], path.name


def test_the_compiler_chooses_the_lowering_and_says_why(main, tmp_path):
    status, out, _ = main("compile", "examples/moonlight.rdep", "--schedule", "bulk", "--dump-after", "lowering")
    assert status == 0 and "gemm = library (cost model: library " in out
    assert "predicted (the GEMMs at their measured share of the rate: triton 62%, library 67%)" in out
    status, out, _ = main("compile", "examples/moonlight.rdep", "--dump-after", "lowering")
    assert status == 0  # the spec's pipelined schedule moves segments
    assert "gemm = triton (the library lowering cannot run it: the pipelined schedule moves an owner's rows" in out
    status, out, _ = main(
        "compile", "examples/moonlight.rdep", "--gemm", "library", "-o", str(tmp_path), "--dump-after", "lowering"
    )  # fmt: skip
    assert status == 0 and "gemm = library (command line --gemm)" in out
    header = (tmp_path / "moonlight_kernels.py").read_text(encoding="utf-8").split('"""')[0]
    assert "strategy = bulk (the library GEMM lowering runs bulk (command line --gemm library; the spec's" in header
    status, out, _ = main("compile", "examples/moonlight.rdep", "--schedule", "bulk", "--gemm", "triton",
                          "--dump-after", "lowering")  # fmt: skip
    assert status == 0 and "gemm = triton (command line --gemm)" in out


def test_a_library_request_the_layer_cannot_take_is_refused_where_it_is_made(main, tmp_path):
    spec = tmp_path / "seg.rdep"
    spec.write_text(
        "layer seg {\n  shape     ranks 2, tokens 8, hidden 32, experts 4, top 2\n  expert    swiglu(ffn = 32)\n"
        "  segment   rows 8, buffers 2\n  schedule  pipelined, gemm library\n}\n",
        encoding="utf-8",
    )
    status, _, err = main("check", str(spec))
    assert status == 1
    assert f"{spec}:5:24: error: the library GEMM lowering cannot run this layer: the pipelined schedule" in err
    status, _, err = main("compile", "examples/moonlight.rdep", "--schedule", "pipelined", "--gemm", "library")
    assert status == 2 and "the library GEMM lowering (command line --gemm library) runs bulk schedules" in err
    with pytest.raises(UsageError, match="runs in phased mode"):
        layer("swiglu").module(gemm="library", mode="split")


def test_under_the_interpreter_the_library_runs_when_asked_for(tmp_path):
    """The cost model's choice is a GPU's: under the interpreter a module runs the Triton
    kernels unless the call or the spec asks for the library."""
    chosen = layer("swiglu")
    assert chosen.compile().kernel.gemm == "library"  # bulk on the h100 profile: the cost model's
    assert chosen.module().gemm == "triton"
    asked = layer("swiglu", gemm=", gemm library")
    module = asked.module()
    assert (module.gemm, module.mode) == ("library", "phased")
    assert module.gemm_source == "spec: schedule ..., gemm library"


def test_the_activations_backward_is_autograd_of_the_activation():
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    pre = torch.randn(16, 24, generator=g, dtype=torch.float64) * 2
    da = torch.randn(16, 12, generator=g, dtype=torch.float64)
    for act, gated in (("swiglu", True), ("clamped_swiglu", True), ("gelu", False), ("relu", False)):
        p = SimpleNamespace(gated=gated, act=act, act_limit=1.0, act_alpha=1.702)
        x = pre if gated else pre[:, :12]
        leaf = x.clone().requires_grad_(True)
        (activation(leaf, p) * da).sum().backward()
        assert torch.allclose(activation_backward(x, da, p), leaf.grad, rtol=0, atol=1e-12), act


def test_block_sums_are_each_spans_column_sums():
    values = torch.arange(24.0).reshape(6, 4)
    got = block_sums(values, torch.tensor([2, 2, 5], dtype=torch.int32))  # rows 0-1, none, 2-4; row 5 in none
    want = torch.stack([values[:2].sum(0), torch.zeros(4), values[2:5].sum(0)])
    assert torch.equal(got, want)
