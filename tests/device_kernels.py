"""The kernels file the device-function tests launch: the small functions of
codegen/device/ copied the way the emitter copies them (``device.include``) behind a
constants block written here, one file per set of constants, imported for the
interpreter; and small test kernels that call them."""

from __future__ import annotations

import pytest
from rdepc.codegen.device import include
from rdepc.runtime.launch import Launcher

from rdepc.ir.contract import CONTROL, CTL_TICKETS
from rdepc.ir.queues import COLUMNS, KINDS
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
    SEGMENTS=3,
    TILE_SLOTS=16,
    SLOT_BLOCK=8,
    OFFSETS=0,  # byte offsets in a rank's heap slice: what owners publish back to it
    ADMITTED=64,
    FLAGS=128,  # ... and its entries' done counters (int64, 16 of them)
    BWD_FLAGS=128,
    NCOL=len(COLUMNS),  # the task table's encoding and the control block's words, as the emitter writes them
    CTL_TICKETS=CTL_TICKETS,
    CTL_CLOCK=CONTROL.index("clock"),
    **{f"C_{c.upper()}": i for i, c in enumerate(COLUMNS)},
    **{f"KIND_{k.upper()}": i for i, k in enumerate(KINDS)},
)


class Code(str):
    """A constant's value written as code (``tl.float32``), not as a string."""


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
def piece_sizes(heap, recv, back, srcs, owners, segments, out, N: tl.constexpr):
    # piece_rows of N pieces at once, every third lane masked off
    i = tl.arange(0, N)
    live = i % 3 != 2
    n = piece_rows(heap, recv, tl.load(back + i), tl.load(srcs + i), tl.load(owners + i), tl.load(segments + i), live)
    tl.store(out + i, n, mask=live)


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
    first, rows = expert_spans(group, q)
    j = tl.arange(0, SLOTS)
    which, row0, lo, hi = m_tile(first, rows, s, j, BM)
    o = out + ((q * tl.num_programs(0) + s) * SLOTS + j) * 4
    live = j < n
    tl.store(o, which, mask=live)
    tl.store(o + 1, row0, mask=live)
    tl.store(o + 2, lo, mask=live)
    tl.store(o + 3, hi, mask=live)


@triton.jit
def bound_tiles(group, tile_table, tile_done, n_slots, epoch, f_blocks, out, BM: tl.constexpr, SLOTS: tl.constexpr):
    # bind_m_tiles for owner program_id(0), then every slot read back through bound_m_tile
    q = tl.program_id(0)
    first, rows = expert_spans(group, q)
    n = tl.load(n_slots + q)
    bind_m_tiles(first, rows, tile_table, tile_done, q, n, epoch, f_blocks, BM)
    tl.debug_barrier()
    for s in range(0, SEGMENTS):
        j = 0
        while j < n:
            which, row0, lo, hi = bound_m_tile(tile_table, q, s, j)
            o = out + ((q * SEGMENTS + s) * SLOTS + j) * 4
            tl.store(o, which)
            tl.store(o + 1, row0)
            tl.store(o + 2, lo)
            tl.store(o + 3, hi)
            j += 1


@triton.jit
def empty_segments(tile_table, out, N: tl.constexpr):
    # segment_empty of owner program_id(0)'s segments: as a vector (odd lanes masked off), and one scalar at a time
    q = tl.program_id(0)
    s = tl.arange(0, N)
    live = (s < SEGMENTS) & (s % 2 == 0)
    tl.store(out + (q * 2) * N + s, segment_empty(tile_table, q + s * 0, s, live).to(tl.int32), mask=live)
    for t in range(0, SEGMENTS):
        tl.store(out + (q * 2 + 1) * N + t, segment_empty(tile_table, q, t, t >= 0).to(tl.int32))


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
    validate(topk_ids, gates, ctl, tl.program_id(0), n_tokens, 0, n_tokens)


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
def push_chunks(exchange, ex_stride, slot_table, order, owner_first, w_up, w_down, b_up, b_down, rank):
    push_slot(exchange, ex_stride, slot_table, order, owner_first, w_up, w_down, b_up, b_down, rank, tl.program_id(0))


@triton.jit
def receive_chunks(exchange, ex_stride, slots, rank):
    receive_slot(exchange, ex_stride, slots, rank, tl.program_id(0))


@triton.jit
def load_ranks(exchange, ex_stride, home_ids, n_tokens):
    load_task(exchange, ex_stride, home_ids, n_tokens, tl.program_id(0))


@triton.jit
def solve_ranks(exchange, ex_stride, plans, owner_of, elems):
    r = tl.program_id(0)
    solve_task(exchange, ex_stride, plans + r * elems, owner_of, r)


@triton.jit
def reroute_ranks(home_ids, topk_ids, plans, n_tokens, elems):
    r = tl.program_id(0)
    reroute_task(home_ids, topk_ids, plans + r * elems, n_tokens, r)


@triton.jit
def empty_run(heap, table, deps, queue, queue_pos, first_item, recv, ctl, profile, pos, last_pos, base, target, out):
    tl.store(out, take_empty_run(heap, table, deps, queue, queue_pos, first_item, recv, ctl, profile, pos, last_pos,
                                 0, base, target, True, False, False))


@triton.jit
def signal_then_wait(flag, seen, target, bound, stop, TIMES: tl.constexpr):
    for _ in tl.static_range(TIMES):
        signal(flag)
    tl.store(seen, wait(flag, target, bound, stop))
"""

DEVICE = "\n\n\n".join(
    (
        include("heap"),
        include("signals"),
        include("control", ("done_flag", "now", "stamp_skipped", "narrow", "note", "validate")),
        include("kernel", ("take_empty_run",)),
        include("rows"),
        include("route", ("keys_below",)),
        include("combine", ("leads",)),
        include("slots"),
        include("replicas"),
    )
)


def _value(v) -> str:
    if isinstance(v, Code):
        return str(v)
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
    interpreted(kernel, grid, args, meta)


def interpreted(kernel, grid, args: tuple, meta: dict) -> None:
    """One interpreted launch of ``kernel``, as the runtime's launcher makes it."""
    Launcher(interpret=True)([(kernel, grid, args, meta)])


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
