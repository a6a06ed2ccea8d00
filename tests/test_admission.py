"""Admission under a capacity and the route-row identity: ``drop round_robin`` (token index
first, the ranks taking turns: drops spread over the ranks), ``drop lowest_gate`` (highest
gates first, ties by ascending row_id) and route-row encodings other than eq. 7 (slot-major,
rank-major with gaps, a permutation). The accepted set is ``rdepc.reference``'s exactly and
the same in every schedule; outputs match the reference; every row_id in an owner's
sideband decodes, by the spec's own encoding, to its row."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close, bound, layer_chain

from rdepc.api import Layer, elaborate_layer
from rdepc.ir.contract import Tiles
from rdepc.parser import parse_text
from rdepc.reference import random_inputs, reference_for, row_id_for

TILES = Tiles(bm=16, block_h=32, block_f=32, block_r=64, block_k=32)
STRATEGIES = ("bulk", "pipelined", "deep")


pytestmark = pytest.mark.usefixtures("fresh_cache")


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
    limit = bound(reference_for(lay.spec), inp, layer_chain(sh["H"], sh["F"], sh["K"]))
    outs = []
    for strategy in strategies:
        m = lay.module(schedule=strategy, tiles=TILES)
        y = m(*inp)
        assert torch.equal(m.last_stats["accepted"], accepted), f"{strategy}: the accepted set differs"
        assert_close(y, ref, limit, strategy)
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
    _, arrival = reference_for(layer(f"{capacity}, drop arrival").spec)(*inp)
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
    _, arrival = reference_for(layer("rows 3, drop arrival").spec)(*inp)
    _, accepted = reference_for(lay.spec)(*inp)
    assert torch.equal(accepted, arrival) and torch.equal(m.last_stats["accepted"], accepted)


ENCODINGS = {
    "slot-major": "(slot * W + rank) * T + token",
    "rank-major, gaps": "(rank * 64 + token) * 4 + slot + 7",
    "token-major": "(token * W + rank) * K + slot",
    "permutation": "(slot * T + token) * W + rank",
}


# every encoding dropless (its decoding); each dropping policy under two encodings, one of them
# rank-major for drop arrival, the one encoding under which arrival order is eq. 7's
ENCODED = [(name, "dropless") for name in sorted(ENCODINGS)] + [
    ("rank-major, gaps", "factor 0.75, drop arrival"),
    ("slot-major", "factor 0.75, drop arrival"),
    ("token-major", "factor 0.75"),
    ("permutation", "factor 0.75"),
    ("token-major", "rows 3, drop lowest_gate"),
    ("permutation", "rows 3, drop lowest_gate"),
]


@pytest.mark.parametrize(("name", "capacity"), ENCODED)
def test_route_row_encodings_decode_and_admit_as_the_reference(name, capacity):
    lay = layer(capacity, ENCODINGS[name].replace("W", "3").replace("K", "2"))
    assert not lay.spec.route_row.is_eq7
    inp, accepted, m = run_everywhere(lay, "zipf:1.2", strategies=("bulk", "deep"))
    # the sideband's row ids decode to their rows by the spec's own encoding
    p, ctx = m.contract, m.last_context
    rid = row_id_for(lay.spec, lay.shapes["T"])
    heap = m.heap.cpu()
    at = p.offset("sideband_row_id")
    for r, t, k in ctx.accepted.nonzero().tolist():
        q, slot = p.owner[int(inp.topk_ids[r, t, k])], int(ctx.slot[r, t, k])
        assert int(heap[q, at + 8 * slot : at + 8 * slot + 8].view(torch.int64)) == rid(r, t, k)
    _, eq7 = reference_for(layer(capacity).spec)(*inp)
    if capacity == "factor 0.75, drop arrival":  # ascending row_id: not source by source unless rank-major
        assert torch.equal(accepted, eq7) == name.startswith("rank-major")
    elif capacity == "factor 0.75":  # round_robin orders by token and rank, whatever the encoding
        assert torch.equal(accepted, eq7) and not accepted.all()


def drops_per_rank(inp, accepted) -> list[int]:
    return ((inp.topk_ids >= 0) & ~accepted).sum(dim=(1, 2)).tolist()


@pytest.mark.parametrize("routing", ["hot", "zipf:1.5"])
def test_round_robin_spreads_the_drops_over_the_ranks(routing):
    """Under a skewed routing ``drop arrival`` (eq. 7) drops only the last ranks' rows, rank 0
    never; ``round_robin`` (the default) drops about as many of every rank's, and the kernel's
    ``dropped_per_source`` counts them."""
    lay = layer("factor 0.5", W=4, T=12, E=4, K=2)
    inp, accepted, m = run_everywhere(lay, routing, strategies=("bulk", "pipelined"))
    fair = drops_per_rank(inp, accepted)
    assert m.last_stats["dropped_per_source"].tolist() == fair
    assert sum(fair) == m.last_stats["dropped_rows"] > 0
    _, arrival = reference_for(layer("factor 0.5, drop arrival", W=4, T=12, E=4, K=2).spec)(*inp)
    biased = drops_per_rank(inp, arrival)
    assert sum(biased) == sum(fair) and biased[0] == 0 and biased[-1] == max(biased)
    assert max(fair) - min(fair) < max(biased) - min(biased)
    assert min(fair) > 0, f"a rank kept every row: {fair}"


def test_round_robin_takes_turns_at_each_token_index():
    """Every row to expert 0 (K = 1) with room for 6 of the 12: tokens 0 and 1 of every rank.
    With room for 5 the last place at token index 1 goes to the rank whose turn is first
    there, rank 1 (rank 0 had the first turn at token index 0)."""
    lay = layer("rows 6", W=3, T=4, E=2, K=1)
    sh = lay.shapes
    inp = random_inputs(sh["W"], sh["T"], sh["H"], sh["F"], sh["E"], sh["K"], seed=3)
    inp = inp._replace(topk_ids=torch.zeros_like(inp.topk_ids))
    m = lay.module(schedule="bulk", tiles=TILES)
    m(*inp)
    want = torch.zeros(3, 4, 1, dtype=torch.bool)
    want[:, :2] = True
    assert torch.equal(m.last_stats["accepted"], want)
    five = layer("rows 5", W=3, T=4, E=2, K=1)
    _, accepted = reference_for(five.spec)(*inp)
    want[0, 1] = False  # token index 1: ranks 1, 2, then 0
    assert torch.equal(accepted, want)
    m5 = five.module(schedule="bulk", tiles=TILES)
    m5(*inp)
    assert torch.equal(m5.last_stats["accepted"], want)
