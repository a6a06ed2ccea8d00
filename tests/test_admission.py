"""Admission under a capacity and the route-row identity: ``drop lowest_gate`` (highest
gates first, ties by ascending row_id) and route-row encodings other than eq. 7 (slot-major,
rank-major with gaps, a permutation). The accepted set is ``rdepc.reference``'s exactly and
the same in every schedule; outputs match the reference; every row_id in an owner's
sideband decodes, by the spec's own encoding, to its row."""

from __future__ import annotations

import pytest
import torch
from rdepc.codegen.lower import Tiles

from rdepc.api import Layer, elaborate_layer
from rdepc.parser import parse_text
from rdepc.reference import random_inputs, reference_for, row_id_for

TILES = Tiles(bm=16, block_h=32, block_f=32, block_r=64, block_k=32)
STRATEGIES = ("bulk", "pipelined", "deep")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RDEPC_CACHE_DIR", str(tmp_path / "rdepc-cache"))


def layer(capacity: str, route_row: str | None = None, W: int = 3, T: int = 10, E: int = 6, K: int = 2) -> Layer:
    text = (
        f"param T = {T}\n"
        "layer adm {\n"
        f"  shape     ranks {W}, tokens T, hidden 32, experts {E}, top {K}\n"
        "  expert    swiglu(ffn = 32)\n"
        "  dtype     fp32\n"
        f"  capacity  {capacity}\n"
        + (f"  route_row id = {route_row}\n" if route_row else "")
        + "  segment   rows 8, buffers 2\n"
        "  schedule  pipelined\n"
        "}\n"
    )
    spec, _ = elaborate_layer(parse_text(text, "adm.rdep"), None, {})
    return Layer(spec)


def run_everywhere(lay: Layer, routing: str, seed: int = 0, strategies=STRATEGIES):
    sh = lay.shapes
    inp = random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], routing=routing, seed=seed)
    ref, accepted = reference_for(lay.spec)(*inp)
    outs = []
    for strategy in strategies:
        m = lay.module(schedule=strategy, tiles=TILES)
        y = m(*inp)
        assert torch.equal(m.last_stats["accepted"], accepted), f"{strategy}: the accepted set differs"
        err = float((y - ref).abs().max()) / float(ref.abs().max())
        assert err <= 1e-5, f"{strategy}: relative error {err:.3g}"
        outs.append((m, y))
    assert all(torch.equal(y, outs[0][1]) for _, y in outs[1:]), "not bitwise the same across schedules"
    return inp, accepted, outs[0][0]


@pytest.mark.parametrize(("capacity", "routing"), [("factor 0.75", "zipf:1.2"), ("rows 2", "hot"), ("rows 4", "one")])
def test_lowest_gate_admits_the_highest_gates(capacity, routing):
    """ "one": every token's slot k goes to expert k, so an expert's gates are all of one
    slot and ties are rare; "hot" crowds experts 0..K-1; rows 4 with "one": each expert
    keeps the 4 highest of its W·T gates."""
    lay = layer(f"{capacity}, drop lowest_gate")
    inp, accepted, _ = run_everywhere(lay, routing)
    _, arrival = reference_for(layer(capacity).spec)(*inp)
    assert not torch.equal(accepted, arrival), "lowest_gate admits what arrival does: the test shows nothing"
    assert 0 < int(accepted.sum()) < accepted.numel()
    # every admitted row's gate is at least every dropped row's gate of the same expert
    for e in range(lay.shapes["E"]):
        to_e = inp.topk_ids == e
        kept, dropped = inp.topk_weights[to_e & accepted], inp.topk_weights[to_e & ~accepted]
        if kept.numel() and dropped.numel():
            assert float(kept.min()) >= float(dropped.max())


def test_lowest_gate_breaks_ties_by_ascending_row_id():
    """Equal gates everywhere: the admitted rows are the smallest row_ids, as under arrival."""
    lay = layer("rows 3, drop lowest_gate")
    sh = lay.shapes
    inp = random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], routing="hot")
    inp = inp._replace(topk_weights=torch.full_like(inp.topk_weights, 0.5))
    m = lay.module(schedule="deep", tiles=TILES)
    m(*inp)
    _, arrival = reference_for(layer("rows 3").spec)(*inp)
    _, accepted = reference_for(lay.spec)(*inp)
    assert torch.equal(accepted, arrival) and torch.equal(m.last_stats["accepted"], accepted)


ENCODINGS = {
    "slot-major": "(slot * W + rank) * T + token",
    "rank-major, gaps": "(rank * 64 + token) * 4 + slot + 7",
    "token-major": "(token * W + rank) * K + slot",
    "permutation": "(slot * T + token) * W + rank",
}


@pytest.mark.parametrize("name", sorted(ENCODINGS))
@pytest.mark.parametrize("capacity", ["dropless", "factor 0.75", "rows 3, drop lowest_gate"])
def test_route_row_encodings_decode_and_admit_as_the_reference(name, capacity):
    lay = layer(capacity, ENCODINGS[name].replace("W", "3").replace("K", "2"))
    assert not lay.spec.route_row.is_eq7
    inp, accepted, m = run_everywhere(lay, "zipf:1.2", strategies=("bulk", "deep"))
    # the sideband's row ids decode to their rows by the spec's own encoding
    p, ctx = m.plan, m.last_context
    rid = row_id_for(lay.spec, lay.shapes["T"])
    heap = m.heap.cpu()
    at = p.offset("sideband_row_id")
    for r, t, k in ctx.accepted.nonzero().tolist():
        q, slot = p.owner[int(inp.topk_ids[r, t, k])], int(ctx.slot[r, t, k])
        assert int(heap[q, at + 8 * slot : at + 8 * slot + 8].view(torch.int64)) == rid(r, t, k)
    if capacity == "factor 0.75":  # arrival in ascending row_id: not source by source unless rank-major
        _, eq7 = reference_for(layer(capacity).spec)(*inp)
        assert torch.equal(accepted, eq7) == name.startswith("rank-major")
