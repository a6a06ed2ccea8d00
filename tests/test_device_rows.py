"""rows.py of codegen/device/, one function at a time under the interpreter, each against
a reference written here in Python: route-row decoding for every row_id order, admission
keys for every drop policy, spans cut to segments, ring slots, m-tiles and their slot
bound (the kernels file: tests/device_kernels.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from device_kernels import BASE, launch, pow2

# --- rows.py: decode and row_key over every route-row order ---------------------------------

CODES = {"rank": 0, "token": 1, "slot": 2}
# Route-row orders, largest coefficient first, with extents (W, T, K): every permutation, and
# encodings without a variable (its extent 1).
ENCODINGS = [(order, 3, 5, 2) for order in itertools.permutations(("rank", "token", "slot"))] + [
    (("token", "rank"), 3, 5, 1),
    (("slot", "token"), 1, 5, 3),
    (("token",), 1, 6, 1),
]


ENCODING_IDS = [f"{'>'.join(order)}-W{W}-T{T}-K{K}" for order, W, T, K in ENCODINGS]


def rid_constants(order) -> dict:
    codes = [CODES[v] for v in order] + [-1] * (3 - len(order))
    return dict(RID_0=codes[0], RID_1=codes[1], RID_2=codes[2])


def coefficients(order, extents: dict, gapped: bool) -> tuple[int, dict]:
    """(c, {variable: coefficient}) of a mixed-radix route-row encoding in ``order``: dense
    (eq. 7's kind) or with gaps between the radices and an offset."""
    a, coef = (3, {}) if gapped else (1, {})
    for v in reversed(order):
        coef[v] = a
        a = a * extents[v] + (5 if gapped else 0)
    return (11 if gapped else 0), coef


def all_rows(W: int, T: int, K: int) -> list[tuple[int, int, int]]:
    return [(r, t, k) for r in range(W) for t in range(T) for k in range(K)]


def row_id(c: int, coef: dict, r: int, t: int, k: int) -> int:
    return c + coef.get("rank", 0) * r + coef.get("token", 0) * t + coef.get("slot", 0) * k


@pytest.mark.parametrize(("order", "W", "T", "K"), ENCODINGS, ids=ENCODING_IDS)
def test_decode_round_trips_every_route_row(kernels, order, W, T, K):
    """decode(c + a_rank·rank + a_token·token + a_slot·slot) is (rank, token, slot) for every
    row, dense or gapped, whatever the order of the variables; a variable the encoding has
    not decodes to 0."""
    mod = kernels(W=W, T=T, K=K, **rid_constants(order))
    rows = all_rows(W, T, K)
    for gapped in (False, True):
        c, coef = coefficients(order, {"rank": W, "token": T, "slot": K}, gapped)
        rids = torch.tensor([row_id(c, coef, *x) for x in rows], dtype=torch.int64)
        assert len(set(rids.tolist())) == len(rows)
        out = torch.full((len(rows), 3), -7, dtype=torch.int64)
        a = [coef.get(v, 0) for v in ("rank", "token", "slot")]
        launch(mod.decode_rows, (1,), rids, out, len(rows), c, *a, N=pow2(len(rows)))
        assert out.tolist() == [list(x) for x in rows], (order, gapped)


def keys_of(mod, W: int, T: int, K: int, gates: torch.Tensor | None = None) -> list[int]:
    """row_key of every route row of every rank, in (rank, token, slot) order."""
    gates = torch.zeros(W * T * K) if gates is None else gates
    out = torch.full((W * T * K,), -1, dtype=torch.int64)
    launch(mod.row_keys, (W,), gates, out, N=pow2(T * K))
    return out.tolist()


def ranks_of(values: list) -> list[int]:
    """Each value's position in ascending order (values distinct)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    pos = [0] * len(values)
    for p, i in enumerate(order):
        pos[i] = p
    return pos


@pytest.mark.parametrize(("order", "W", "T", "K"), ENCODINGS, ids=ENCODING_IDS)
def test_arrival_keys_ascend_with_row_id(kernels, order, W, T, K):
    """drop arrival: the key is the row's place in ascending row_id order (a dense index),
    unique, for a gapped encoding in any order."""
    keys = keys_of(kernels(W=W, T=T, K=K, DROP="arrival", **rid_constants(order)), W, T, K)
    c, coef = coefficients(order, {"rank": W, "token": T, "slot": K}, gapped=True)
    rids = [row_id(c, coef, *x) for x in all_rows(W, T, K)]
    assert keys == ranks_of(rids)


@pytest.mark.parametrize("order", [("rank", "token", "slot"), ("slot", "rank", "token")])
def test_round_robin_keys_take_turns_by_token(kernels, order):
    """drop round_robin: token first, then the ranks' turn (rank − token) mod W, then the
    slot, whatever the row_id order; unique."""
    W, T, K = 3, 5, 2
    keys = keys_of(kernels(W=W, T=T, K=K, DROP="round_robin", **rid_constants(order)), W, T, K)
    rows = all_rows(W, T, K)
    assert len(set(keys)) == len(keys)
    assert keys == ranks_of([(t, (r - t) % W, k) for r, t, k in rows])
    # token 1: rank 1 goes first, then rank 2, then rank 0
    at = {x: key for x, key in zip(rows, keys, strict=True)}
    assert at[(1, 1, 0)] < at[(1, 1, 1)] < at[(2, 1, 0)] < at[(0, 1, 0)] < at[(0, 2, 0)]


@pytest.mark.parametrize("order", [("rank", "token", "slot"), ("slot", "rank", "token")])
def test_lowest_gate_keys_put_the_highest_gate_first_then_row_id(kernels, order):
    """drop lowest_gate: descending gate, ties (-0.0 with +0.0 among them) by ascending
    row_id; unique, non-negative int64."""
    W, T, K = 3, 5, 2
    rng = np.random.default_rng(3)
    pool = np.array([0.5, 0.5, 0.25, -0.0, 0.0, -0.25, 1e-40, -1e-40, 3.0, float("inf"), -float("inf")], np.float32)
    gates = torch.from_numpy(rng.choice(pool, size=W * T * K).astype(np.float32))
    gates[:4] = torch.tensor([0.0, -0.0, -0.0, 0.0])  # rank 0, token 0 and 1: signed zeros
    keys = keys_of(kernels(W=W, T=T, K=K, DROP="lowest_gate", **rid_constants(order)), W, T, K, gates)
    c, coef = coefficients(order, {"rank": W, "token": T, "slot": K}, gapped=False)
    rids = [row_id(c, coef, *x) for x in all_rows(W, T, K)]
    g = gates.tolist()
    assert len(set(keys)) == len(keys) and all(0 <= k < 1 << 63 for k in keys)
    assert ranks_of(keys) == ranks_of([(-g[i], rids[i]) for i in range(len(g))])
    zeros = sorted(range(4), key=rids.__getitem__)
    assert [keys[i] for i in zeros] == sorted(keys[i] for i in zeros)  # -0.0 and +0.0 tie: row_id decides


# --- rows.py: clip, locate, ring_row -------------------------------------------------------


def test_clip_cuts_spans_to_each_segment(kernels):
    """clip: the span [first, first + rows) within segment s's rows [s·S, s·S + S) — its
    first row and count (0 when they do not meet)."""
    S = BASE["S"]
    rng = np.random.default_rng(5)
    first = rng.integers(0, 4 * S, 32)
    first[:4] = [0, S - 1, S, 2 * S + 3]
    rows = rng.integers(0, 2 * S + 5, 32)
    rows[:4] = [S, 1, 0, 3 * S]
    n_seg = 7
    out = torch.full((n_seg, 32, 2), -1, dtype=torch.int64)
    launch(kernels().clip_spans, (n_seg,), torch.from_numpy(first).int(), torch.from_numpy(rows).int(), out, N=32)
    for s in range(n_seg):
        for i in range(32):
            meet = set(range(first[i], first[i] + rows[i])) & set(range(s * S, s * S + S))
            lo, count = out[s, i].tolist()
            assert count == len(meet), (s, first[i], rows[i])
            if meet:
                assert lo == min(meet), (s, first[i], rows[i])


def test_piece_rows_counts_what_each_move_finds_in_a_segment(kernels):
    """piece_rows: the rows source r and owner q move for segment s, the spans q published
    cut to it — read from r's heap slice (a dispatch, an unpack) or from q's split table
    (a return), as the tasks read them; the test a kernel makes before it counts a run of
    moves without rows done."""
    W, E_MAX, S, HEAP = BASE["W"], BASE["E_MAX"], BASE["S"], BASE["HEAP_BYTES"]
    rng = np.random.default_rng(11)
    heap = torch.zeros((W, HEAP), dtype=torch.uint8)
    published = rng.integers(0, 3 * S, (W, W, E_MAX, 2))  # [r, q, local]: (first, rows) as r's slice holds them
    kept = rng.integers(0, 3 * S, (W, W, E_MAX, 2))  # [q, r, local]: q's split table, made to differ
    published[0, 1] = 0  # a piece without rows anywhere
    kept[2, 3, :, 1] = 0
    for r in range(W):
        words = heap[r].view(torch.int32)
        words[BASE["OFFSETS"] // 4 :][: W * E_MAX] = torch.from_numpy(published[r, :, :, 0].reshape(-1)).int()
        words[BASE["ADMITTED"] // 4 :][: W * E_MAX] = torch.from_numpy(published[r, :, :, 1].reshape(-1)).int()
    recv = torch.from_numpy(kept.reshape(-1)).int()
    pieces = [(b, r, q, s) for b in (0, 1) for r in range(W) for q in range(W) for s in range(4)]
    N = pow2(len(pieces))
    pieces += [(0, 0, 0, 0)] * (N - len(pieces))
    cols = [torch.tensor(c, dtype=torch.int32) for c in zip(*pieces, strict=True)]
    out = torch.full((N,), -1, dtype=torch.int32)
    launch(kernels().piece_sizes, (1,), heap, recv, *cols, out, N=N)
    for i, (b, r, q, s) in enumerate(pieces):
        if i % 3 == 2:
            assert out[i] == -1, i
            continue
        spans = kept[q, r] if b else published[r, q]
        want = sum(len(set(range(f, f + n)) & set(range(s * S, s * S + S))) for f, n in spans)
        assert out[i] == want, (b, r, q, s)
    assert {int(out[i]) for i, p in enumerate(pieces) if p[1:3] == (0, 1) and not p[0] and i % 3 != 2} == {0}


def test_locate_finds_the_span_and_payload_row_of_each_row_of_a_piece(kernels):
    """locate: the u-th row of spans (lo_l, n_l) taken in local order is span l's row
    lo_l + (u − rows before l); empty spans are skipped."""
    U = 32
    cases = [
        [(5, 3), (40, 0), (9, 4), (100, 2)],
        [(0, 0), (0, 0), (7, 6), (2, 1)],
        [(3, 8), (20, 8), (50, 8), (90, 8)],
        [(0, 1), (30, 2), (60, 0), (90, 5)],
    ]
    lo = torch.tensor([[a for a, _ in c] for c in cases], dtype=torch.int32)
    n = torch.tensor([[b for _, b in c] for c in cases], dtype=torch.int32)
    u = torch.arange(U, dtype=torch.int32).repeat(len(cases), 1)
    out = torch.full((len(cases), U, 2), -1, dtype=torch.int32)
    launch(kernels().locate_rows, (len(cases),), lo, n, u, out, U=U)
    for c, spans in enumerate(cases):
        want = [(l, a + i) for l, (a, b) in enumerate(spans) for i in range(b)]
        assert out[c, : len(want)].tolist() == [list(w) for w in want], spans


def test_ring_row_places_a_segments_rows_in_its_ring_slot(kernels):
    """ring_row: row s·S + i of segment s sits at row i of ring slot ``slot mod B``."""
    S, B, N = BASE["S"], BASE["B"], 16
    rng = np.random.default_rng(7)
    n_seg, n_slot = 5, 7
    offsets = rng.integers(0, S, (n_seg, N))
    rows = torch.from_numpy(offsets + np.arange(n_seg)[:, None] * S).int()
    out = torch.full((n_seg, n_slot, N), -1, dtype=torch.int32)
    launch(kernels().ring_rows, (n_seg, n_slot), rows, out, N=N)
    for s, slot in itertools.product(range(n_seg), range(n_slot)):
        assert out[s, slot].tolist() == [(slot % B) * S + int(i) for i in offsets[s]]


# --- rows.py: m_tile -----------------------------------------------------------------------


def reference_tiles(spans, s: int, S: int, BM: int) -> list[tuple[int, int, int, int]]:
    """The m-tiles of segment s: expert by expert, tile i of expert l at rows first_l + i·BM,
    its live rows those of the expert inside the segment; tiles with none are not run."""
    out = []
    for l, (first, rows) in enumerate(spans):
        for i in range(-(-rows // BM)):
            row0 = first + i * BM
            a, b = max(row0, first, s * S), min(row0 + BM, first + rows, s * S + S)
            if a < b:
                out.append((l, row0, a - row0, b - row0))
    return out


def some_owners(rng, E_MAX: int, most: int, BM: int, S: int | None) -> list[list[tuple[int, int]]]:
    """Owners' (first, rows) per local expert, the rows of an owner's experts one after the
    other from 0: one with no experts, one of short experts (one row, none, BM + 1), two
    random ones, and (given S) one whose experts cross segment boundaries mid-tile."""
    listed = [[], [1, 0, BM + 1, 2 * BM - 1][:E_MAX]]
    listed += [[int(x) for x in rng.integers(0, most + 1, int(rng.integers(1, E_MAX + 1)))] for _ in range(2)]
    if S:
        listed.append([S - 3, 2 * BM + 5, S + 1, 3][:E_MAX])
    return [[(sum(rows[:i]), r) for i, r in enumerate(rows)] for rows in listed]


@pytest.mark.parametrize(
    ("E_MAX", "EL_PAD", "S", "BM", "most"),
    [(3, 4, 24, 8, 24), (2, 2, 128, 16, 60), (4, 4, 40, 16, 24)],
    ids=["segmented", "bulk", "segmented-4-experts"],
)
def test_m_tile_binds_slots_to_the_tiles_in_order_and_none_past_the_bound(kernels, E_MAX, EL_PAD, S, BM, most):
    """m_tile over random owners: slot j of segment s is the j-th tile (expert by expert,
    aligned at first + i·BM, cut by the segment); the slots past the tiles up to and past
    the plan's bound ceil(min(R, S)/BM) + 2·E_loc − 1 (bulk: ceil(R/BM) + E_loc − 1), and a
    slot in the segment after the last, have no live rows."""
    rng = np.random.default_rng(S * BM + E_MAX)
    owners = some_owners(rng, E_MAX, most, BM, None if S == 128 else S)
    totals = [sum(r for _, r in spans) for spans in owners]
    bulk = max(totals) <= S
    assert bulk == (S == 128)

    def bound(spans, R):
        if not spans:
            return 0
        return -(-R // BM) + len(spans) - 1 if bulk else -(-min(R, S) // BM) + 2 * len(spans) - 1

    # Per owner, its bound's slots and one more in each segment with rows; one in the next.
    segments = [-(-R // S) for R in totals]
    slots = torch.zeros((len(owners), max(segments) + 1), dtype=torch.int32)
    for q, spans in enumerate(owners):
        slots[q, : segments[q]] = bound(spans, totals[q]) + 1
        slots[q, segments[q]] = 1
    group = torch.zeros((len(owners), E_MAX, 2), dtype=torch.int32)
    for q, spans in enumerate(owners):
        for l, (first, rows) in enumerate(spans):
            group[q, l] = torch.tensor([first, rows])
    out = torch.full((*slots.shape, pow2(int(slots.max())), 4), -99, dtype=torch.int32)
    mod = kernels(E_MAX=E_MAX, EL_PAD=EL_PAD, S=S)
    launch(mod.m_tiles, slots.shape[::-1], group, slots, out, BM=BM, SLOTS=out.shape[2])
    for q, spans in enumerate(owners):
        for s in range(segments[q] + 1):
            want = reference_tiles(spans, s, S, BM)
            assert len(want) <= bound(spans, totals[q]), (spans, s)
            got = [tuple(x) for x in out[q, s, : slots[q, s]].tolist()]
            assert got[: len(want)] == want, (spans, s)
            assert all(hi <= lo for _, _, lo, hi in got[len(want) :]), (spans, s, got)
            assert len(got) > len(want)


# Owners' rows per local expert (first row, rows) for the m-tile table's tests: E_MAX 3,
# segments of S 24 rows, BM 8, 3 segments of 16 slots; an owner without rows among them.
E_MAX_T, S_T, BM_T, SEGMENTS_T, TILE_SLOTS_T = 3, 24, 8, 3, 16
OWNERS = [[(0, 5), (5, 0), (5, 30)], [(0, 24), (24, 1), (25, 40)], [], [(0, 2), (2, 2), (4, 2)]]


def owner_groups() -> torch.Tensor:
    """OWNERS as the scan leaves them (``group``: [owners, E_MAX, 2])."""
    group = torch.zeros((len(OWNERS), E_MAX_T, 2), dtype=torch.int32)
    for q, spans in enumerate(OWNERS):
        for l, (first, rows) in enumerate(spans):
            group[q, l] = torch.tensor([first, rows])
    return group


def test_the_m_tile_table_holds_each_slots_binding(kernels):
    """bind_m_tiles writes every owner's slots of every segment, in blocks of SLOT_BLOCK
    (a partial last block included), and bound_m_tile reads back m_tile's binding of each:
    the live slots a prefix, the rest empty (what lets the GEMM kernel count an entry's
    remaining items done at its first empty slot). Each slot's GEMM1 counter is set to its
    value before the call, (epoch - 1) · f_blocks; nothing past the owner's slots is touched."""
    E_MAX, S, BM, SEGMENTS, TILE_SLOTS = E_MAX_T, S_T, BM_T, SEGMENTS_T, TILE_SLOTS_T
    owners, group = OWNERS, owner_groups()
    n_slots = torch.tensor([13, 9, 0, 16], dtype=torch.int32)  # 13: one block of 8 and a partial one
    table = torch.full((len(owners), SEGMENTS * TILE_SLOTS * 4), -7, dtype=torch.int32)
    out = torch.full((len(owners), SEGMENTS, TILE_SLOTS, 4), -99, dtype=torch.int32)
    counters = torch.full((len(owners), SEGMENTS * TILE_SLOTS), 5, dtype=torch.int64)  # 5: a slot left behind
    epoch, f_blocks = 4, 3
    mod = kernels(E_MAX=E_MAX, EL_PAD=4, S=S, SEGMENTS=SEGMENTS, TILE_SLOTS=TILE_SLOTS, SLOT_BLOCK=8)
    launch(
        mod.bound_tiles, (len(owners),), group, table, counters, n_slots, epoch, f_blocks, out, BM=BM, SLOTS=TILE_SLOTS
    )
    for q, spans in enumerate(owners):
        n = int(n_slots[q])
        for s in range(SEGMENTS):
            want = reference_tiles(spans, s, S, BM)
            got = [tuple(x) for x in out[q, s, :n].tolist()]
            assert got[: len(want)] == want, (q, s)
            assert all(hi <= lo for _, _, lo, hi in got[len(want) :]), (q, s, got)
        words = table[q].view(SEGMENTS, TILE_SLOTS, 4)
        assert (words[:, n:] == -7).all(), "a slot past the owner's count was written"
        at = counters[q].view(SEGMENTS, TILE_SLOTS)
        assert (at[:, :n] == (epoch - 1) * f_blocks).all() and (at[:, n:] == 5).all(), (q, at)


def test_segment_empty_says_which_segments_have_no_m_tile(kernels):
    """segment_empty: owner q's segment s has no m-tile (its slot 0 without live rows, as
    bind_m_tiles wrote it), as scalars and as a masked vector — the test the GEMM kernel
    makes before it counts a run of empty segments done."""
    E_MAX, S, BM, SEGMENTS, TILE_SLOTS = E_MAX_T, S_T, BM_T, SEGMENTS_T, TILE_SLOTS_T
    owners, group = OWNERS, owner_groups()
    n_slots = torch.tensor([13, 9, 4, 16], dtype=torch.int32)
    table = torch.zeros((len(owners), SEGMENTS * TILE_SLOTS * 4), dtype=torch.int32)
    counters = torch.zeros((len(owners), SEGMENTS * TILE_SLOTS), dtype=torch.int64)
    mod = kernels(E_MAX=E_MAX, EL_PAD=4, S=S, SEGMENTS=SEGMENTS, TILE_SLOTS=TILE_SLOTS, SLOT_BLOCK=8)
    read = torch.zeros((len(owners), SEGMENTS, TILE_SLOTS, 4), dtype=torch.int32)
    launch(mod.bound_tiles, (len(owners),), group, table, counters, n_slots, 1, 1, read, BM=BM, SLOTS=TILE_SLOTS)
    out = torch.full((len(owners), 2, 4), -1, dtype=torch.int32)
    launch(mod.empty_segments, (len(owners),), table, out, N=4)
    for q, spans in enumerate(owners):
        want = [int(not reference_tiles(spans, s, S, BM)) for s in range(SEGMENTS)]
        assert out[q, 1, :SEGMENTS].tolist() == want, (q, want)
        assert out[q, 0, 0:SEGMENTS:2].tolist() == want[0::2] and (out[q, 0, 1::2] == -1).all(), q
    assert out[1, 1, :SEGMENTS].tolist() == [0, 0, 0] and out[0, 1, :SEGMENTS].tolist() == [0, 0, 1]
