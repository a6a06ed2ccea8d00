"""The route in chunks: a front-end's tokens split into chunks of ROUTE_CHUNK_TOKENS, each
counted by one work item and bucketed by another once every chunk is counted. Under the
interpreter, with more tokens than one chunk (and a last chunk part full, and calls that
bring fewer tokens than the plan's bound): every route row's position is its place among
its front-end's rows to the same expert, in row order or, under ``drop lowest_gate``, in
admission-key order; the accepted set and the output are the reference's; phased mode's
is bitwise the unified kernel's."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from tolerance import assert_close, bound, layer_chain

import rdepc
from rdepc.ir.contract import COLUMNS, KINDS, Tiles
from rdepc.ir.sizes import ROUTE_CHUNK_TOKENS, route_chunks
from rdepc.reference import random_inputs, reference_for

T = ROUTE_CHUNK_TOKENS * 2 + 40  # three chunks, the last part full


def layer(tmp_path, capacity: str):
    text = TINY.read_text(encoding="utf-8").replace("capacity  dropless", f"capacity  {capacity}")
    text = text.replace("hidden 64", "hidden 32").replace("ffn = 128", "ffn = 32")
    path = tmp_path / "chunked.rdep"
    path.write_text(text, encoding="utf-8")
    return rdepc.load(path, W=2, T=T)


def test_the_route_has_two_items_a_chunk_in_the_forward_and_one_in_the_backward(tmp_path):
    contract = layer(tmp_path, "dropless").compile().kernel
    assert route_chunks(T) == 3 and route_chunks(1) == 1 and route_chunks(ROUTE_CHUNK_TOKENS) == 1
    items = {
        backward: {
            w.table[i][COLUMNS.index("items")] for i in range(len(w.table)) if w.table[i][0] == KINDS.index("route")
        }
        for backward in (False, True)
        for w in [contract.work(Tiles(), "unified", backward=backward)]
    }
    assert items == {False: {6}, True: {1}}


@pytest.mark.parametrize(
    "capacity, tokens", [("dropless", T), ("dropless", ROUTE_CHUNK_TOKENS + 3), ("factor 0.75, drop lowest_gate", T)]
)
def test_chunked_positions_are_one_pass_over_the_rows(tmp_path, capacity, tokens):
    lay = layer(tmp_path, capacity)
    sh = lay.shapes
    inputs = random_inputs(2, tokens, sh["H"], sh["F"], sh["E"], sh["K"], routing="zipf:1.2", seed=4, gated=True)
    ids, gates = inputs[1:3]
    want, accepted = reference_for(lay)(*inputs)
    unified = lay.module(mode="unified")
    y = unified(*inputs)
    assert_close(y, want, bound(reference_for(lay), inputs, layer_chain(sh["H"], sh["F"], sh["K"])), "y")
    assert torch.equal(unified.last_context.accepted, accepted)
    pos = unified.private["rowpos"][:, : tokens * sh["K"]]
    flat_ids = ids.reshape(2, -1)
    keyed = "lowest_gate" in capacity
    for r in range(2):
        for e in range(sh["E"]):
            rows = (flat_ids[r] == e).nonzero().flatten()
            if keyed:  # admission-key order: the larger gate first, then the earlier row
                g = gates.reshape(2, -1)[r, rows]
                rows = rows[sorted(range(len(rows)), key=lambda j: (-g[j].item(), rows[j].item()))]
            assert pos[r, rows].tolist() == list(range(len(rows))), (r, e)
    phased = lay.module(mode="phased")
    assert torch.equal(phased(*inputs), y)
    assert torch.equal(phased.private["rowpos"][:, : tokens * sh["K"]], pos)
