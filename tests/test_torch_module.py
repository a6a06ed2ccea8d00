"""RDEPMoE as an ordinary nn.Module: torch.compile (the layer's custom ops), copies and
pickles, meta-device construction, parameters in another dtype, and any token count."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import ROOT, block_parameters, block_reference
from tolerance import assert_close, bound, bounds, layer_chain
from torch import nn

import rdepc
from rdepc.api import Layer, elaborate_layer
from rdepc.parser import parse_text

TINY = ROOT / "examples" / "tiny.rdep"


def _moe(seed: int = 1, **kw) -> rdepc.RDEPMoE:
    return rdepc.RDEPMoE(kw.pop("spec", TINY), generator=torch.Generator().manual_seed(seed), **kw)


def _bf16_layer() -> Layer:
    text = TINY.read_text().replace("dtype     fp32", "dtype     bf16")
    return Layer(*elaborate_layer(parse_text(text, "tiny_bf16.rdep"), None, {}))


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.a, self.b = _moe(1), _moe(2, spec=ROOT / "examples" / "tiny_balance.rdep")  # b replicates hot experts

    def forward(self, x):
        x = x + self.a(self.norm(x))
        return x + self.b(self.norm(x))


def _step(model: nn.Module, fn, x: torch.Tensor):
    """y, dL/dx and every parameter's gradient of loss = sum(y²)."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.square().sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0))


def test_compile_fullgraph_equals_eager_bitwise(x):
    """torch.compile(fullgraph=True) captures the whole model: the layer's forward and
    backward are the rdepc::forward / rdepc::backward custom ops (no graph break), and with
    torch's own op numerics (aot_eager) every output and gradient equals eager bitwise."""
    torch._dynamo.reset()
    model = TwoBlocks()
    eager = _step(model, model, x)
    compiled = _step(model, torch.compile(model, fullgraph=True, backend="aot_eager"), x)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
    graph = torch._dynamo.explain(model)(x)
    assert graph.graph_break_count == 0 and graph.graph_count == 1
    ops = {str(n.target) for g in graph.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "rdepc.forward.default" in ops
    flat = x.reshape(64, 64)[:15]  # padded inside the graph: the tokens' counts are its constants
    assert torch.equal(torch.compile(model.a, fullgraph=True, backend="aot_eager")(flat), model.a(flat))


def test_compile_with_inductor(x, tmp_path, monkeypatch):
    """Inductor compiles the router's softmax with its own kernels (a last-bit difference in
    the gates); the layer's ops are the same. Its cache is the test's own: one shared with a
    process under another ATEN_CPU_CAPABILITY hands back vectorised C++ that this process's
    precompiled header, built without a vector ISA, cannot compile."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    moe = _moe()
    eager = _step(moe, moe, x)
    compiled = _step(moe, torch.compile(moe, fullgraph=True), x)
    block, params = block_reference(moe), block_parameters(moe)

    def reference_step(x, params):  # _step's values by the reference block
        x = x.detach().clone().requires_grad_(True)
        leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
        y = block(x, leaves)
        y.square().sum().backward()
        return [y.detach(), x.grad, *(leaves[n].grad for n, _ in moe.named_parameters())]

    # tiny: the layer's chain, the router's dot over H = 64 and softmax over E = 8; a gradient also
    # the W·T·K = 128 rows a weight's sums
    chain = layer_chain(64, 128, 2, extra=64 + 8)
    limits = [bound(block, (x, params), chain), *list(bounds(reference_step, (x, params), chain + 128).values())[1:]]
    names = ["y", "x", *(n for n, _ in moe.named_parameters())]
    for a, b, limit, name in zip(eager, compiled, limits, names, strict=True):
        assert_close(b, a, limit, name)


def test_copies_pickles_and_whole_model_saves(x):
    """deepcopy, pickle, torch.save(model) and AveragedModel: the kernels are rebuilt from
    the spec (and the compilation cache) at the copy's first call."""
    moe = _moe()
    y = moe(x)
    assert "module" not in str(type(pickle.dumps(moe)))
    buf = io.BytesIO()
    torch.save(moe, buf)
    buf.seek(0)
    copies = [copy.deepcopy(moe), pickle.loads(pickle.dumps(moe)), torch.load(buf, weights_only=False)]
    copies.append(torch.optim.swa_utils.AveragedModel(moe).module)
    for c in copies:
        assert c._kernels is None and torch.equal(c(x), y)
        assert c.kernels is not moe.kernels  # its own heap
    ema = torch.optim.swa_utils.AveragedModel(moe)
    ema.update_parameters(moe)
    assert torch.equal(ema(x), y)


def test_meta_construction_then_to_empty(x):
    """torchtitan's pattern: build on the meta device (no kernels, no memory), then
    to_empty() and reset_parameters(); the kernels are built at the first call."""
    with torch.device("meta"):
        lazy = _moe()
    assert lazy.w_down.is_meta and lazy._kernels is None
    with pytest.raises(RuntimeError, match=r"meta device: call to_empty\(device=...\) and reset_parameters\(\)"):
        lazy(x)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters(torch.Generator().manual_seed(1))
    assert torch.equal(lazy(x), _moe()(x))
    assert rdepc.RDEPMoE(TINY, device="meta").w_down.is_meta


def test_to_dtype_keeps_the_specs_compute(x):
    """.to(dtype) holds the parameters in that dtype; the layer computes in the spec's. A
    bf16 spec with fp32 parameters (dtype=torch.float32) is fp32 master weights: the same
    outputs as bf16 parameters, gradients in fp32."""
    moe = _moe().to(torch.bfloat16)
    assert moe.w_down.dtype == moe.router.dtype == torch.bfloat16
    y = moe(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.isfinite().all()
    y.float().square().sum().backward()
    assert moe.w_down.grad.dtype == torch.bfloat16

    layer = _bf16_layer()
    master = _moe(spec=layer, dtype=torch.float32)
    plain = _moe(spec=layer)
    assert master.w_gate_up.dtype == torch.float32 and plain.w_gate_up.dtype == torch.bfloat16
    got, want = _step(master, master, x), _step(plain, plain, x)
    assert torch.equal(got[0], want[0])
    assert master.w_down.grad.dtype == torch.float32
    assert torch.equal(master.w_down.grad.bfloat16(), plain.w_down.grad)


def test_any_token_count_and_batch_shape():
    """[N, H] of any N <= W·T and [B, S, H] with B != W: padded to a multiple of W with
    tokens that route nowhere, outputs and gradients those of the real tokens alone."""
    moe = _moe()
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(15, 64, generator=g)
    got = _step(moe, moe, flat)
    moe.zero_grad(set_to_none=True)
    padded = torch.cat((flat, torch.zeros(1, 64))).reshape(4, 4, 64).requires_grad_(True)
    y = moe(padded, tokens=[4, 4, 4, 3]).reshape(16, 64)[:15]
    y.square().sum().backward()
    want = [y.detach(), padded.grad.reshape(16, 64)[:15], *(p.grad for p in moe.parameters())]
    assert got[0].shape == (15, 64) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    batch = torch.randn(3, 5, 64, generator=g)
    y = moe(batch)
    assert y.shape == (3, 5, 64) and torch.equal(y, moe(batch.reshape(15, 64)).reshape(3, 5, 64))
    y, out = moe(batch, router_outputs=True, mask=torch.ones(3, 5, dtype=torch.bool))
    assert out.logits.shape == (3, 5, 8) and torch.equal(y, moe(batch))
    with pytest.raises(ValueError, match=r"x has 65 tokens, more than the 4 ranks x T=16 the layer takes in one call"):
        moe(torch.zeros(65, 64))
    with pytest.raises(ValueError, match=r"tokens= goes with x \[W=4, T', H\]"):
        moe(flat, tokens=[4, 4, 4, 3])
