"""The small device functions of codegen/device/, one by one under the interpreter, each
against a reference written here in Python: route-row decoding for every row_id order,
admission keys, spans cut to segments, ring slots, m-tiles and their slot bound, fp32
narrowing, the input checks, dedup's lead slots, the scan's key counts, the heap's peers
and puts, signals and waits. The functions are taken the way the emitter takes them
(``device.include``) into small kernel files whose constants block this file writes, one
file per set of constants; and every global a copied function reads is one the emitter
writes for every example."""

from __future__ import annotations

import ast
import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, tiny_segmented
from rdepc.codegen import emit, transport
from rdepc.codegen.device import HERE, include
from rdepc.runtime.launch import Launcher

import rdepc
from rdepc.driver import generate_spec
from rdepc.toolchain import import_kernels

# The constants the functions under test read, at a small layer's values; a test's variant
# replaces some of them.
BASE = dict(
    W=4,
    T=8,
    K=2,
    E=8,
    E_MAX=3,
    EL_PAD=4,
    K_PAD=2,
    S=24,
    B=3,
    RID_0=0,
    RID_1=1,
    RID_2=2,
    DROP="arrival",
    HEAP_BYTES=256,
    SCOPE="gpu",
    VALIDATE_TOKENS=8,
    KEY_ROWS=4,
    CTL_BAD_IDS=10,
    CTL_BAD_GATES=12,
    CTL_DUP_TOKENS=14,
)

TESTS = """
@triton.jit
def decode_rows(rids, out, n, rid_c, rid_r, rid_t, rid_k, N: tl.constexpr):
    i = tl.arange(0, N)
    m = i < n
    rank, token, slot = decode(tl.load(rids + i, mask=m, other=0), rid_c, rid_r, rid_t, rid_k)
    tl.store(out + i * 3, rank, mask=m)
    tl.store(out + i * 3 + 1, token, mask=m)
    tl.store(out + i * 3 + 2, slot, mask=m)


@triton.jit
def row_keys(gates, out, N: tl.constexpr):
    r = tl.program_id(0)
    i = tl.arange(0, N)
    live = i < T * K
    tl.store(out + r * (T * K) + i, row_key(gates + r * (T * K), r, i, live), mask=live)


@triton.jit
def clip_spans(first, rows, out, N: tl.constexpr):
    s = tl.program_id(0)
    i = tl.arange(0, N)
    lo, n = clip(tl.load(first + i), tl.load(rows + i), s)
    tl.store(out + (s * N + i) * 2, lo)
    tl.store(out + (s * N + i) * 2 + 1, n)


@triton.jit
def locate_rows(lo, n, u, out, U: tl.constexpr):
    c = tl.program_id(0)
    local = tl.arange(0, EL_PAD)
    at = c * U + tl.arange(0, U)
    which, row = locate(tl.load(u + at), tl.load(lo + c * EL_PAD + local), tl.load(n + c * EL_PAD + local), local)
    tl.store(out + at * 2, which)
    tl.store(out + at * 2 + 1, row)


@triton.jit
def ring_rows(rows, out, N: tl.constexpr):
    s = tl.program_id(0)
    slot = tl.program_id(1)
    i = tl.arange(0, N)
    tl.store(out + (s * tl.num_programs(1) + slot) * N + i, ring_row(tl.load(rows + s * N + i), s, slot))


@triton.jit
def m_tiles(group, slots, out, BM: tl.constexpr, SLOTS: tl.constexpr):
    s = tl.program_id(0)
    q = tl.program_id(1)
    n = tl.load(slots + q * tl.num_programs(0) + s)
    j = 0
    while j < n:
        which, row0, lo, hi = m_tile(group, q, s, j, BM)
        o = out + ((q * tl.num_programs(0) + s) * SLOTS + j) * 4
        tl.store(o, which)
        tl.store(o + 1, row0)
        tl.store(o + 2, lo)
        tl.store(o + 3, hi)
        j += 1


@triton.jit
def narrow_bf16(x, y, N: tl.constexpr, CAST_F32: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, narrow(tl.load(x + i), tl.bfloat16, CAST_F32))


@triton.jit
def narrow_f16(x, y, N: tl.constexpr, CAST_F32: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, narrow(tl.load(x + i), tl.float16, CAST_F32))


@triton.jit
def narrow_f32(x, y, N: tl.constexpr, CAST_F32: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, narrow(tl.load(x + i), tl.float32, CAST_F32))


@triton.jit
def note_rows(ctl, bad, key, N: tl.constexpr):
    i = tl.arange(0, N)
    note(ctl, 3, tl.load(bad + i) != 0, tl.load(key + i))


@triton.jit
def validate_inputs(topk_ids, gates, ctl, n_tokens):
    validate(topk_ids, gates, ctl, tl.program_id(0), n_tokens)


@triton.jit
def lead_slots(ok, q, row, out, N: tl.constexpr, KP: tl.constexpr):
    i = tl.arange(0, N)[:, None] * KP + tl.arange(0, KP)[None, :]
    tl.store(out + i, leads(tl.load(ok + i) != 0, tl.load(q + i), tl.load(row + i)).to(tl.int8))


@triton.jit
def count_below(keys, counts, n_local, bounds, out):
    src = tl.program_id(0)
    local = tl.arange(0, EL_PAD)
    bound = tl.load(bounds + src * EL_PAD + local)
    tl.store(out + src * EL_PAD + local, keys_below(keys, counts, src, local, local < tl.load(n_local), bound))


@triton.jit
def put_words(heap, values, mask, at, N: tl.constexpr):
    r = tl.program_id(0)
    i = tl.arange(0, N)
    words = (peer(heap, r) + at).to(tl.pointer_type(tl.int32))
    put(words + i, tl.load(values + r * N + i), tl.load(mask + r * N + i) != 0)


@triton.jit
def put_to_peers(heap, at, value, WP: tl.constexpr):
    peers = tl.arange(0, WP)
    put((peer(heap, peers) + at).to(tl.pointer_type(tl.int64)), value + peers, peers < W)


@triton.jit
def signal_then_wait(flag, seen, target, bound, TIMES: tl.constexpr):
    for _ in tl.static_range(TIMES):
        signal(flag)
    tl.store(seen, wait(flag, target, bound))
"""

DEVICE = "\n\n\n".join(
    (
        include("heap"),
        include("signals"),
        include("control", ("narrow", "note", "validate")),
        include("rows"),
        include("route", ("keys_below",)),
        include("combine", ("leads",)),
    )
)


def _value(v) -> str:
    return f'"{v}"' if isinstance(v, str) else repr(v)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """kernels(**constants): a kernel file of the functions under test with BASE's constants,
    ``constants`` replacing some, imported for the interpreter (one file per set)."""
    folder = tmp_path_factory.mktemp("device_functions")
    built: dict[tuple, object] = {}

    def build(**changes):
        consts = {**BASE, **changes}
        key = tuple(sorted(consts.items()))
        if key not in built:
            block = "\n".join(f"{n} = tl.constexpr({_value(v)})" for n, v in consts.items())
            text = f"import triton\nimport triton.language as tl\n\n{block}\n\n\n{DEVICE}\n\n{TESTS}"
            path = folder / f"functions_{len(built)}.py"
            path.write_text(text, encoding="utf-8")
            built[key] = import_kernels(path, interpret=True)
        return built[key]

    return build


def launch(kernel, grid, *args, **meta):
    Launcher(interpret=True)(kernel, grid, args, meta)


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


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
    out = torch.full((*slots.shape, int(slots.max()), 4), -99, dtype=torch.int64)
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


# --- control.py: narrow, note, validate ----------------------------------------------------


def narrow_inputs(subnormal: bool = True) -> torch.Tensor:
    """fp32 values: random over many scales; exact bf16 and fp16 halfway cases with both
    parities; just off halfway; signed zeros; infinities; values that round to inf; a NaN;
    fp32 subnormals unless ``subnormal`` is False."""
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-38, 1e-6, 1.0, 1e4, 1e30])
    parts = [torch.randn(640, generator=g) * scales.repeat_interleave(128)]
    bits = torch.randint(0x00800000, 0x7F000000, (256,), generator=g, dtype=torch.int64)
    bits = torch.cat((bits, bits | (1 << 31)))
    for low in (0x8000, 0x18000, 0x7FFF, 0x8001):  # bf16: halfway, halfway odd, just below, just above
        parts.append(((bits & ~0x1FFFF) | low).to(torch.int32).view(torch.float32))
    fp16 = torch.randint(0x38800000, 0x47000000, (256,), generator=g, dtype=torch.int64)  # fp16's normal range
    for low in (0x1000, 0x3000, 0x0FFF):  # fp16: halfway, halfway odd, just below
        parts.append(((fp16 & ~0x3FFF) | low).to(torch.int32).view(torch.float32))
    edges = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 6e-8, 3e-8, 65504.0, 65520.0, 65519.0, 3.4028235e38, -3.4e38]
    edges += [3.3961776e38, 1.1754942e-38, float("inf"), -float("inf"), float("nan")]
    x = torch.cat([*parts, torch.tensor(edges)])
    if not subnormal:
        x = x[(x.abs() >= 2**-126) | (x == 0) | x.isnan()]
    return torch.cat((x, torch.zeros(pow2(x.numel()) - x.numel())))


def narrowed(kernels, name: str, x: torch.Tensor, dtype: torch.dtype, cast: bool) -> torch.Tensor:
    y = torch.full(x.shape, 7.0, dtype=dtype)
    launch(getattr(kernels(), name), (1,), x, y, N=x.numel(), CAST_F32=cast)
    return y


def assert_same_bits(x: torch.Tensor, y: torch.Tensor) -> None:
    """y is x.to(y.dtype) bit for bit, NaN for NaN."""
    want = x.to(y.dtype)
    bits = torch.int32 if y.dtype == torch.float32 else torch.int16
    wrong = (y.view(bits) != want.view(bits)) & ~(want.isnan() & y.isnan())
    show = [
        (f"{float(a):.8g}", hex(int(b)), hex(int(c)))
        for a, b, c in zip(x[wrong], y.view(bits)[wrong], want.view(bits)[wrong], strict=True)
    ]
    assert not wrong.any(), f"{int(wrong.sum())} values (x, got, torch): {show[:6]}"


@pytest.mark.parametrize(
    ("name", "dtype", "cast"),
    [
        ("narrow_bf16", torch.bfloat16, True),
        ("narrow_f16", torch.float16, True),
        ("narrow_f16", torch.float16, False),
        ("narrow_f32", torch.float32, True),
        ("narrow_f32", torch.float32, False),
    ],
)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, casting to inf
def test_narrow_rounds_to_nearest_even_as_torch_does(kernels, name, dtype, cast):
    """narrow: fp32 to bf16 (under CAST_F32, the interpreter's), fp16 and fp32 bit for bit
    as torch's ``.to``: round to nearest, ties to even, overflow to inf (bf16: fp32's normal
    range and zero, inf, NaN; its subnormals are the next test's)."""
    x = narrow_inputs(subnormal=dtype != torch.bfloat16)
    assert_same_bits(x, narrowed(kernels, name, x, dtype, cast))


def test_narrow_rounds_fp32_subnormals_to_bf16_as_torch_does(kernels):
    x = torch.tensor([8.487103e-39, -1.1258398e-38, 1e-40, 1e-45, 5.9e-39, -2.2e-39, 1e-39, 3e-42])
    assert_same_bits(x, narrowed(kernels, "narrow_bf16", x, torch.bfloat16, True))


def test_narrow_keeps_every_nan_a_nan_in_bf16(kernels):
    bits = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFC00000, 0x7FA00000, 0, 0])
    x = bits.to(torch.int32).view(torch.float32)
    y = narrowed(kernels, "narrow_bf16", x, torch.bfloat16, True)
    assert torch.equal(y.isnan(), x.isnan()), [hex(int(v) & 0xFFFF) for v in y.view(torch.int16)]
    assert_same_bits(x, y)  # torch's quiet NaN, 0x7FC0, for every NaN


@pytest.mark.parametrize("case", ["clean", "some", "earlier-seen", "all"])
def test_note_counts_offenders_and_keeps_the_largest_key(kernels, case):
    """note: adds the number of offending rows to word 3 and raises word 4 to their largest
    key; writes nothing when no row offends."""
    N = 64
    rng = np.random.default_rng(len(case))
    keys = torch.from_numpy(rng.permutation(N) * 977 + (1 << 35) + 1)  # distinct, past 32 bits
    bad = torch.from_numpy(rng.random(N) < {"clean": 0.0, "some": 0.2, "earlier-seen": 0.2, "all": 1.0}[case])
    ctl = torch.arange(100, 108, dtype=torch.int64)
    if case == "earlier-seen":
        ctl[4] = 1 << 41  # a larger key an earlier block noted stays
    want = ctl.clone()
    if bad.any():
        want[3] += int(bad.sum())
        want[4] = max(int(want[4]), int(keys[bad].max()))
    launch(kernels().note_rows, (1,), ctl, bad.to(torch.int8), keys, N=N)
    assert ctl.tolist() == want.tolist()


VALIDATE = dict(W=3, T=16, K=3, K_PAD=4, E=6, VALIDATE_TOKENS=8)


def reference_validate(ids, gates, T: int, E: int) -> dict[str, tuple[int, int]]:
    """(count, largest key) of bad ids, non-finite gates on routed slots and tokens with a
    repeated expert; key W·T·K − (r·T + t)·K − k (the earliest offender's is the largest)."""
    W, n, K = ids.shape
    found = {"ids": [], "gates": [], "dups": []}
    for r, t in itertools.product(range(W), range(n)):
        key = W * T * K - (r * T + t) * K
        e = [int(x) for x in ids[r, t]]
        for k in range(K):
            if e[k] < -1 or e[k] >= E:
                found["ids"].append(key - k)
            if e[k] != -1 and not math.isfinite(float(gates[r, t, k])):
                found["gates"].append(key - k)
        routed = [x for x in e if x != -1]
        if len(set(routed)) < len(routed):
            found["dups"].append(key)
    return {n: (len(v), max(v, default=0)) for n, v in found.items()}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # numpy: inf - inf
def test_validate_counts_bad_ids_gates_and_repeats_with_the_earliest(kernels, seed):
    """validate over W front-ends of T' < T tokens (several blocks): out-of-range ids, NaN
    and ±inf gates where a slot routes somewhere, tokens with an expert twice (-1 slots are
    padding: neither). Seed 0 is clean: the control block is left as it was."""
    W, T, K, E = VALIDATE["W"], VALIDATE["T"], VALIDATE["K"], VALIDATE["E"]
    n = 13
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.permutation(E)[:K] for _ in range(n)] for _ in range(W)]).astype(np.int64)
    gates = rng.random((W, n, K)).astype(np.float32)
    pad = rng.random((W, n, K)) < 0.15
    ids[pad] = -1
    gates[pad & (rng.random((W, n, K)) < 0.5)] = np.nan  # padding may carry any gate
    if seed:
        for _ in range(3 * seed):
            r, t, k = rng.integers(0, W), rng.integers(0, n), rng.integers(0, K)
            what = rng.integers(0, 3)
            if what == 0:
                ids[r, t, k] = rng.choice([-2, -9, E, E + 4])
            elif what == 1:
                gates[r, t, k] = rng.choice([np.nan, np.inf, -np.inf])
            else:
                ids[r, t, k] = ids[r, t, (k + 1) % K] if ids[r, t, (k + 1) % K] != -1 else 0
                ids[r, t, (k + 1) % K] = ids[r, t, k]
    want = reference_validate(ids, gates, T, E)
    assert (sum(c for c, _ in want.values()) == 0) == (seed == 0)
    ctl = torch.zeros(24, dtype=torch.int64) if seed else torch.arange(24, dtype=torch.int64) * 3 + 1
    before = ctl.clone()
    mod = kernels(**VALIDATE)
    launch(mod.validate_inputs, (W,), torch.from_numpy(ids), torch.from_numpy(gates), ctl, n)
    words = {"ids": BASE["CTL_BAD_IDS"], "gates": BASE["CTL_BAD_GATES"], "dups": BASE["CTL_DUP_TOKENS"]}
    expect = before.clone()
    for name, (count, key) in want.items():
        if count:
            expect[words[name]] += count
            expect[words[name] + 1] = key
    assert ctl.tolist() == expect.tolist(), want


# --- combine.py: leads; route.py: keys_below -----------------------------------------------


def test_leads_are_each_tokens_first_accepted_slot_per_owner(kernels):
    """leads: an accepted slot leads iff no accepted slot of its token at the same owner
    has a lower row there."""
    N, KP = 32, 4
    rng = np.random.default_rng(11)
    ok = rng.random((N, KP)) < 0.7
    q = rng.integers(0, 3, (N, KP))
    row = rng.permutation(1000)[: N * KP].reshape(N, KP)
    out = torch.full((N, KP), 9, dtype=torch.int8)
    args = (torch.from_numpy(ok).to(torch.int8), torch.from_numpy(q).int(), torch.from_numpy(row).int(), out)
    launch(kernels().lead_slots, (1,), *args, N=N, KP=KP)
    want = [
        [
            bool(ok[t, k]) and min(row[t, j] for j in range(KP) if ok[t, j] and q[t, j] == q[t, k]) == row[t, k]
            for k in range(KP)
        ]
        for t in range(N)
    ]
    assert (out != 0).tolist() == want
    assert any(ok[t, j] and ok[t, k] and q[t, j] == q[t, k] for t in range(N) for j in range(KP) for k in range(j))


def test_keys_below_counts_each_sources_keys_under_the_bound(kernels):
    """keys_below: per local expert of the owner (those below n_local), how many of the keys
    a source published for it (its run among the source's runs, laid in local order, as
    long as its count) are below that expert's bound; other locals count 0."""
    W, T, K, E_MAX, EL = BASE["W"], BASE["T"], BASE["K"], BASE["E_MAX"], BASE["EL_PAD"]
    rng = np.random.default_rng(13)
    n_local = 2
    counts = np.zeros((W, E_MAX), np.int32)
    counts[:, :n_local] = [[9, 7], [0, 16], [5, 0], [3, 4]]
    counts[:, n_local:] = 6  # beyond the owner's experts: not read
    keys = np.full((W, T * K), 1 << 50, np.int64)  # past every run: must not count
    for src in range(W):
        run = np.sort(rng.integers(0, 200, int(counts[src, :n_local].sum())))
        keys[src, : run.size] = run
    bounds = rng.integers(0, 220, (W, EL)).astype(np.int64)
    bounds[0, 0] = keys[0, 0]  # a key equal to the bound is not below it
    out = torch.full((W, EL), -1, dtype=torch.int32)
    args = (torch.from_numpy(keys), torch.from_numpy(counts), torch.tensor([n_local], dtype=torch.int32))
    launch(kernels().count_below, (W,), *args, torch.from_numpy(bounds), out)
    want = np.zeros((W, EL), np.int64)
    for src in range(W):
        start = 0
        for l in range(n_local):
            run = keys[src, start : start + counts[src, l]]
            want[src, l] = sum(int(k) < int(bounds[src, l]) for k in run)
            start += counts[src, l]
    assert out.tolist() == want.tolist()
    assert counts[:, :n_local].max() > 2 * BASE["KEY_ROWS"]  # runs longer than a block of keys


# --- heap.py, signals.py -------------------------------------------------------------------


def test_peer_and_put_address_each_ranks_slice_of_the_heap(kernels):
    """peer(heap, r) is r's slice of a [W, HEAP_BYTES] uint8 heap; put stores the values its
    mask keeps there, for a scalar rank and for a vector of ranks (padded lanes masked)."""
    W, HB, N, at = BASE["W"], BASE["HEAP_BYTES"], 16, 40
    mod = kernels()
    heap = torch.full((W, HB), 0xAB, dtype=torch.uint8)
    values = torch.arange(W * N, dtype=torch.int32).reshape(W, N) * 1000 - 7
    mask = torch.from_numpy(np.random.default_rng(2).random((W, N)) < 0.6)
    launch(mod.put_words, (W,), heap, values, mask.to(torch.int8), at, N=N)
    want = torch.full((W, HB), 0xAB, dtype=torch.uint8)
    for r in range(W):
        words = want[r, at : at + 4 * N].clone().view(torch.int32)
        words[mask[r]] = values[r][mask[r]]
        want[r, at : at + 4 * N] = words.view(torch.uint8)
    assert torch.equal(heap, want)
    launch(mod.put_to_peers, (1,), heap, 200, 1 << 40, WP=8)
    for r in range(W):
        want[r, 200:208] = torch.tensor([(1 << 40) + r], dtype=torch.int64).view(torch.uint8)
    assert torch.equal(heap, want)


@pytest.mark.parametrize(
    ("start", "times", "target", "bound"), [(0, 1, 1, 5), (5, 3, 7, 0), (2, 2, 9, 50), (4, 0, 5, 0)]
)
def test_signal_then_wait_sees_the_value_or_gives_up_after_its_spins(kernels, start, times, target, bound):
    """signal adds one to the flag; wait returns the flag's value once it reaches the target,
    or, when it never does, the value it last saw after ``bound`` spins."""
    flag = torch.tensor([start], dtype=torch.int64)
    seen = torch.full((1,), -1, dtype=torch.int64)
    launch(kernels().signal_then_wait, (1,), flag, seen, target, bound, TIMES=times)
    assert flag.item() == start + times
    assert seen.item() == start + times


# --- every global a copied function reads is written ---------------------------------------

CAPS = re.compile(r"[A-Z][A-Z0-9_]*")


def free_constants(source: str) -> set[str]:
    """ALL_CAPS names the functions in ``source`` read and neither take nor assign."""
    found = set()
    for fn in ast.parse(source).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        args = fn.args
        bound = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        names = [n for n in ast.walk(fn) if isinstance(n, ast.Name)]
        bound |= {n.id for n in names if not isinstance(n.ctx, ast.Load)}
        found |= {n.id for n in names if isinstance(n.ctx, ast.Load) and CAPS.fullmatch(n.id) and n.id not in bound}
    return found


def written(text: str) -> set[str]:
    return set(re.findall(r"^([A-Za-z_]\w*) = tl\.constexpr\(", text, re.M))


def module_constants(path: Path) -> set[str]:
    """The names a module assigns at its top level (its stand-ins)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}


EXAMPLES = sorted((ROOT / "examples").glob("*.rdep"))


@pytest.mark.parametrize("example", [*EXAMPLES, "tiny-segmented"], ids=lambda p: getattr(p, "stem", p))
def test_every_global_a_device_function_reads_is_a_constant_the_emitter_writes(example, tmp_path):
    """Every ALL_CAPS global of a copied function (the generated file's modules, the heap's
    and the signals') is written by the constants block or the transport's section, and so
    is every stand-in of layout.py (and heap.py's, signals.py's). The names the block writes
    do not depend on the schedule: the examples are planned bulk, which is quick, and tiny
    also segmented and pipelined."""
    path = tiny_segmented(tmp_path) if example == "tiny-segmented" else example
    plan = generate_spec(rdepc.load(path).spec, schedule=None if example == "tiny-segmented" else "bulk").kernel
    block = emit.constants(plan)
    have = written(block) | written(transport.source(plan.transport))
    modules = (*emit.DEVICE_MODULES, "heap", "signals")
    read = {m: free_constants(include(m)) for m in modules}
    assert {"W", "RID_0", "DROP", "S"} <= read["rows"] and read["signals"] == {"SCOPE"}
    missing = {m: sorted(names - have) for m, names in read.items() if names - have}
    assert not missing, f"read by device functions but not written for {Path(str(path)).name}: {missing}"
    stand_ins = module_constants(HERE / "layout.py")
    assert len(stand_ins) > 100
    assert not stand_ins - written(block), sorted(stand_ins - written(block))
    for m in ("heap", "signals"):
        assert module_constants(HERE / f"{m}.py") <= have, m
