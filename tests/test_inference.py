"""Modules built for inference and layers sharing one ring: an inference module allocates
the planner's forward-only heap, gives the training module's outputs bitwise and refuses a
call that would keep what a backward walks; ``rdepc plan`` prints both heaps; two layers
through one shared heap give the same outputs and gradients, bitwise, as two with their own."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import TINY
from rdepc.passes.symmetric import symmetric_plan
from rdepc.runtime import memory
from rdepc.runtime.heap import private_buffers, regions
from rdepc.runtime.memory import HeapSizeError, heap_span

import rdepc
from rdepc.ir.contract import COLUMNS, CONTROL, Tiles
from rdepc.reference import random_inputs

TOKENS = 8  # T' of every call: small, the interpreter runs each layer in seconds


pytestmark = pytest.mark.usefixtures("fresh_cache")


def inputs(seed: int, routing: str = "uniform"):
    c = rdepc.load(TINY).compile().kernel
    return random_inputs(c.W, TOKENS, c.H, c.F, c.E, c.K, seed=seed, routing=routing)


def private_bytes(contract, inference: bool) -> int:
    return sum(dt.itemsize * torch.Size(shape).numel() for _, dt, shape in private_buffers(contract, False, inference))


def test_an_inference_module_allocates_the_planners_forward_heap(tmp_path, monkeypatch):
    layer = rdepc.load(TINY)
    plan = symmetric_plan(layer.spec)
    forward, training = plan["forward"]["total"], plan["forward_backward"]["total"]
    assert (forward, training) == (44_288, 86_528)
    m = layer.module(inference=True)
    c = m.contract
    assert c.forward_bytes == forward and c.heap_bytes == training
    # every rank's slice is the forward's prefix, where the kernels' stride puts it
    assert tuple(m.heap.shape) == (c.W, forward) and m.heap.stride() == (training, 1)
    assert m.heap.untyped_storage().nbytes() == heap_span(c, c.W, True) == (c.W - 1) * training + forward
    assert heap_span(c, 1, True) == forward < heap_span(c, 1) == training  # nvshmem: one slice per GPU
    assert "bwd_ctl" not in m.private and "bwd_tile_done" not in m.private
    # the memory check counts the forward's bytes: room for them, not for training's
    need = heap_span(c, c.W, True) + private_bytes(c, True)
    assert need < heap_span(c, c.W) + private_bytes(c, False)
    path = tmp_path / "meminfo"
    path.write_text(f"MemAvailable: {-(-need // 1024)} kB\n", encoding="ascii")
    monkeypatch.setattr(memory, "MEMINFO", str(path))
    layer.module(inference=True)
    with pytest.raises(HeapSizeError, match=r"forward and backward\) and the private buffers"):
        layer.module()
    path.write_text("MemAvailable: 64 kB\n", encoding="ascii")
    with pytest.raises(HeapSizeError, match=r"forward only \(inference\)\) and the private buffers") as info:
        layer.module(inference=True)
    assert "\n" not in str(info.value)


def test_inference_gives_the_training_modules_outputs_bitwise():
    layer = rdepc.load(TINY)
    x, ids, g, wg, wu, wd = inputs(1)
    params = [t.clone().requires_grad_(True) for t in (wg, wu, wd)]  # as a model's parameters
    with torch.no_grad():
        y = layer.module(inference=True)(x, ids, g, *params)
        want = layer.module()(x, ids, g, *params)
    assert not y.requires_grad and torch.equal(y, want)


def test_a_call_that_would_keep_for_a_backward_is_refused_in_one_line():
    m = rdepc.load(TINY).module(inference=True)
    x, ids, g, wg, wu, wd = inputs(1)
    for which in range(5):  # any float input that requires grad, grad mode on
        args = [x, g, wg, wu, wd]
        args[which] = args[which].clone().requires_grad_(True)
        with pytest.raises(RuntimeError) as info:
            m(args[0], ids, *args[1:])
        assert str(info.value).startswith("rdepc layer tiny was built with inference=True") and "\n" not in str(
            info.value
        )
    assert m.last_context is None  # refused before anything ran


def test_rdepc_plan_shows_the_forward_only_heap_beside_training(main):
    status, out, _ = main("plan", "examples/tiny.rdep")
    assert status == 0
    assert re.search(r"\n  total +44,288 B +86,528 B +86,528 B ", out)  # the region table's forward column
    assert re.search(r"\n  one shared ring +86,528 B ", out)
    assert re.search(r"\n  inference: one shared ring +44,288 B ", out)
    assert re.search(r"\n  inference: per layer x L +44,288 B ", out)
    assert re.search(r"\n  symmetric heap, forward only \(inference\), private ring per layer +44,288 B  fits", out)
    status, out, _ = main("plan", "examples/tiny.rdep", "--json")
    heap = json.loads(out)["symmetric_bytes"]["plan"]
    assert heap["inference_shared_total"] == heap["forward"]["total"] == 44_288
    assert heap["shared_total"] == heap["forward_backward"]["total"] == 86_528


def two_layers(first, second) -> list[torch.Tensor]:
    """y2 = second(first(x)), each layer its own routing and weights, and the backward of
    sum(y2 · dy): the outputs, then every input's gradient. The backward of ``first`` runs
    after the forward of ``second``."""
    x, ids1, *rest1 = inputs(1)
    _, ids2, *rest2 = inputs(2, "zipf:1.5")
    leaves = [t.clone().requires_grad_(True) for t in (x, *rest1, *rest2)]
    y1 = first(leaves[0], ids1, *leaves[1:5])
    y2 = second(y1, ids2, *leaves[5:])
    dy = torch.randn(y2.shape, generator=torch.Generator().manual_seed(3))
    (y2 * dy).sum().backward()
    return [y1.detach(), y2.detach(), *(t.grad for t in leaves)]


def done_flags_count(m, calls: int, backward: bool) -> bool:
    """Whether every done counter in ``m``'s heap stands at ``calls`` times its entry's items."""
    at, size = regions(m.contract)[1 if backward else 0]
    words = m.heap[:, at : at + size].contiguous().view(torch.int64)
    col = {c: i for i, c in enumerate(COLUMNS)}
    table = (m.bwd_work if backward else m.work).table
    return all(words[row[col["rank"]], row[col["flag"]]] == calls * row[col["items"]] for row in table)


def test_two_layers_sharing_one_heap_match_two_with_their_own():
    layer = rdepc.load(TINY)
    a, b = layer.module(), layer.module()
    shared = layer.module(share=a)
    assert shared.heap.data_ptr() == a.heap.data_ptr() and shared.private["ctl"] is a.private["ctl"]
    own = two_layers(a, b)
    both = two_layers(a, shared)
    for i, (want, got) in enumerate(zip(own, both, strict=True)):
        assert torch.equal(want, got), i
    # the ring's counters count every call through it: a's two and shared's one, each way
    calls = CONTROL.index("calls")
    assert a.private["ctl"][calls] == a.private["bwd_ctl"][calls] == 3 and b.private["ctl"][calls] == 1
    assert done_flags_count(a, 3, backward=False) and done_flags_count(a, 3, backward=True)
    # what cannot share: another work, or an inference module's heap (no backward regions)
    with pytest.raises(ValueError, match="cannot share the heap of a module of another tiles"):
        layer.module(share=a, tiles=Tiles(bm=16, block_h=32, block_f=32, block_r=64, block_k=32))
    with pytest.raises(ValueError, match="cannot share the heap of a module built with inference=True"):
        layer.module(share=layer.module(inference=True))
    assert layer.module(inference=True, share=a).heap.data_ptr() == a.heap.data_ptr()
