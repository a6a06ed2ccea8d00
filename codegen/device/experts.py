"""The expert computation at an owner, over the grouped GEMM's m-tiles (``rows.m_tile``):
``gemm1`` (x·[Wg Wu] or x·Wu, the activation fused) and ``gemm2`` (h·Wd), what both passes'
tiles read their operands through (``operand``, the programs' descriptors), and the
m-tile of a work item. The backward's tiles and ``expert_item``, which runs one work item
of either pass, are ``expert_grads``; the GEMM main loop is ``gemm.gemm_tile``."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import narrow
from rdepc.codegen.device.gemm import (
    copy_rows,
    gate_up,
    gemm_tile,
    rows_descriptor,
    store_rows,
)
from rdepc.codegen.device.heap import peer
from rdepc.codegen.device.layout import (
    ACT,
    ACT_ALPHA,
    ACT_LIMIT,
    BIAS,
    BWD_PAYLOAD,
    BWD_WIRE,
    DEDUP,
    DISPATCH_DTYPE,
    DISPATCH_SCALE,
    DTYPE,
    E_MAX,
    GATED,
    KIND_GEMM1,
    PAYLOAD,
    PRECISION,
    R_MAX,
    RECOMPUTE,
    RESEND,
    SB_LINKS,
    SB_ROW_ID,
    SB_SCALE,
    SCALE_COLS,
    SLOT_B_DOWN_AT,
    SLOT_B_UP_AT,
    SLOT_DOWN_AT,
    SLOT_ELEMS,
    TMA,
    UP_COLS,
    B,
    E,
    F,
    H,
    S,
)
from rdepc.codegen.device.rows import ring_row


@triton.jit
def operand(home, slots, e, per_expert, at):
    """Expert ``e``'s operand: row e of ``home`` (``per_expert`` elements a row), or, where
    the kernels read the redundant slots in place (SLOT_ELEMS: one process per rank under
    ``balance replicate``) and ``weight_of`` gave e = -(j + 1), the part at ``at`` of slot
    j's packed row of ``slots`` (``rdepc.ir.balance.slot_parts``): no per-call copy of the
    home experts' weights beside the slots'."""
    if SLOT_ELEMS > 0:
        if e < 0:
            ptr = slots + (-1 - e) * SLOT_ELEMS + at
        else:
            ptr = home + e * per_expert
    else:
        ptr = home + e * per_expert
    return ptr


@triton.jit
def weight_descriptors(w_up, w_down, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tensor descriptors over every expert's weights, as the GEMM tiles read them
    (``gemm_tile``'s ``w_desc``): built once per program, where each tile would otherwise
    write one into global memory and fence it before its loop. GEMM1's and GEMM2's (up,
    down) and the backward's, the same weights read transposed (up_t, down_t); a build
    uses two or three of them. Only where the GEMMs read through descriptors (TMA) and
    no tile reads a redundant slot (SLOT_ELEMS 0: a slot's weights lie in another buffer,
    and its tiles build their own)."""
    up = tl.make_tensor_descriptor(
        w_up, shape=[E * H, UP_COLS * F], strides=[UP_COLS * F, 1], block_shape=[BLOCK_K, UP_COLS * BLOCK_F]
    )
    down = tl.make_tensor_descriptor(w_down, shape=[E * F, H], strides=[H, 1], block_shape=[BLOCK_K, BLOCK_H])
    up_t = tl.make_tensor_descriptor(
        w_up, shape=[E * H, UP_COLS * F], strides=[UP_COLS * F, 1], block_shape=[BLOCK_H, BLOCK_K]
    )
    down_t = tl.make_tensor_descriptor(w_down, shape=[E * F, H], strides=[H, 1], block_shape=[BLOCK_F, BLOCK_K])
    return up, down, up_t, down_t


@triton.jit
def ring_descriptors(heap, hbuf, dh, me, BM: tl.constexpr, BLOCK_K: tl.constexpr, BACKWARD: tl.constexpr):
    """The descriptors of the rows the GEMM tiles read (``gemm_tile``'s ``a_desc``), built
    once per program where each tile would otherwise build its own: GEMM1's (the payload
    ring, the forward's or the backward's) and GEMM2's (the workspace ring GEMM1 wrote; in the
    backward dH at the owner's rows). Only one process per rank (PER_RANK), where every GEMM
    item a program runs is its rank's (owner ``me``): the descriptors are those its tiles
    would build, so every read is the same; with all ranks in one process the owner changes
    from item to item and each tile builds its own."""
    mine = peer(heap, me)
    if BACKWARD:
        rows = rows_descriptor((mine + BWD_PAYLOAD).to(tl.pointer_type(BWD_WIRE)), B * S, H, BM, BLOCK_K)
        mid = rows_descriptor(dh + me * R_MAX * (UP_COLS * F), R_MAX, UP_COLS * F, BM, BLOCK_K)
    else:
        rows = rows_descriptor((mine + PAYLOAD).to(tl.pointer_type(DISPATCH_DTYPE)), B * S, H, BM, BLOCK_K)
        mid = rows_descriptor(hbuf + me * (B * S) * F, B * S, F, BM, BLOCK_K)
    return rows, mid


@triton.jit
def glu(gate, up):
    """A gated expert's activation of its fp32 gate and up pre-activations: SwiGLU
    silu(gate)·up, or GPT-OSS's clamped variant: g = min(gate, limit), u = up clamped to
    ±limit, (u + 1)·g·σ(alpha·g)."""
    if ACT == "clamped_swiglu":
        g = tl.minimum(gate, ACT_LIMIT)
        u = tl.minimum(tl.maximum(up, -ACT_LIMIT), ACT_LIMIT)
        return (u + 1.0) * g * tl.sigmoid(g * ACT_ALPHA)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def bias_row(bias, n_cols, col0, BN: tl.constexpr):
    """fp32 [BN]: columns col0 .. col0 + BN of one expert's bias row (``n_cols`` long), 0 past it."""
    c = col0 + tl.arange(0, BN)
    return tl.load(bias + c, mask=c < n_cols, other=0.0).to(tl.float32)


@triton.jit
def store_bias(bias, values, n_cols, col0, BN: tl.constexpr):
    """Store [BN] ``values`` at columns col0 .. col0 + BN of a bias row, clipped to ``n_cols``."""
    c = col0 + tl.arange(0, BN)
    tl.store(bias + c, values, mask=c < n_cols)


@triton.jit
def payload_tile(
    rows,
    at,
    w,
    n_cols,
    col0,
    scales,
    first_row,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    CAST_F32: tl.constexpr,
    TRANS_B: tl.constexpr,
    SCALED: tl.constexpr,
    COLS: tl.constexpr,
    w_desc=None,
    w_row=0,
    a_desc=None,
):
    """A [BM, BN] tile of an owner's payload rows (ring rows ``at``.., H columns) times one
    expert's weights: under DEDUP each row read through its token's first slot here
    (``first_row``); with ``SCALED`` the rows are fp8 with their ``scales`` beside them, one
    per ``COLS`` columns. ``w_desc``, ``w_row``: the weights' descriptor, ``a_desc`` the rows'
    (``gemm_tile``)."""
    if DEDUP:
        if SCALED:
            acc = gemm_tile(
                rows, B * S, at, w, n_cols, col0, H, BM, BN, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION, TRANS_B,
                scales, COLS, a_index=first_row,
            )  # fmt: skip
        else:
            acc = gemm_tile(
                rows, B * S, at, w, n_cols, col0, H, BM, BN, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION, TRANS_B,
                a_index=first_row,
            )  # fmt: skip
    elif SCALED:
        acc = gemm_tile(
            rows, B * S, at, w, n_cols, col0, H, BM, BN, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION, TRANS_B, scales,
            COLS, w_desc=w_desc, w_row=w_row, a_desc=a_desc,
        )  # fmt: skip
    else:
        acc = gemm_tile(
            rows, B * S, at, w, n_cols, col0, H, BM, BN, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION, TRANS_B,
            w_desc=w_desc, w_row=w_row, a_desc=a_desc,
        )  # fmt: skip
    return acc


@triton.jit
def gemm1(
    heap,
    w_up,
    b_up,
    weight_of,
    slots,
    hbuf,
    hbuf_rid,
    saved_x,
    saved_pre,
    q,
    s,
    local,
    row0,
    lo,
    hi,
    f,
    BM: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    CAST_F32: tl.constexpr,
    SAVE: tl.constexpr,
    COPY_COLS: tl.constexpr,
    w_desc=None,
    a_desc=None,
):
    """Owner q, segment s, one GEMM1 tile: the F-block at column ``f`` of the m-tile bound to
    local expert ``local``, first row ``row0``, live rows [lo, hi) (``rows.m_tile``), of
    GEMM1 over the segment's pooled, expert-contiguous rows in payload slot s % B — h =
    glu(x Wg, x Wu) for a gated expert (one [BM, 2 * BLOCK_F] tile of x [Wg Wu],
    ``w_up``, whose columns interleave gate and up: the weights' layout [E, H, F, 2]), else
    ACT(x Wu) (one [BM, BLOCK_F] tile), the activation fused — into the owner's
    private workspace ``hbuf``. F-block 0 also copies the rows' row_ids beside them:
    dispatch may refill the payload slot before GEMM2 has run. With ``SAVE`` (a forward
    that backward will walk) the pre-activations and, from F-block 0, the input rows are
    kept at the rows' places among the owner's rows, for the backward (the input rows not
    under ``RESEND``: the backward sends them again), ``COPY_COLS`` columns a step. fp8
    rows are read with their scales; under DEDUP each slot reads the payload row of its
    token's first slot here. With ``BIAS`` the expert's b_up (laid out as the tile's
    columns) is added before the activation, so the kept pre-activations hold it.
    """
    if hi > lo:
        e = tl.cast(tl.load(weight_of + q * E_MAX + local), tl.int64)
        at = ring_row(row0, s, s)  # the tile's first row in the owner's payload ring
        me = peer(heap, q)
        rows = (me + PAYLOAD).to(tl.pointer_type(DISPATCH_DTYPE))
        scales = (me + SB_SCALE).to(tl.pointer_type(tl.float32))  # fp8: [B*S, SCALES]
        w = operand(w_up, slots, e, H * (UP_COLS * F), 0)
        m = tl.arange(0, BM)
        live = (m >= lo) & (m < hi)
        first_row = m
        if DEDUP:
            link = (me + SB_LINKS).to(tl.pointer_type(tl.int32))
            first_row = tl.load(link + 2 * (at + m), mask=live, other=-1)  # the token's first slot here
        acc = payload_tile(
            rows, at, w, UP_COLS * F, f * UP_COLS, scales, first_row, BM, UP_COLS * BLOCK_F, BLOCK_K, STAGES,
            CAST_F32, False, DISPATCH_SCALE != "none", SCALE_COLS, w_desc, e * H, a_desc,
        )  # fmt: skip
        if BIAS:
            bias = operand(b_up, slots, e, UP_COLS * F, SLOT_B_UP_AT)
            acc += bias_row(bias, UP_COLS * F, f * UP_COLS, UP_COLS * BLOCK_F)[None, :]
        if GATED:
            gate, up = gate_up(acc, BM, BLOCK_F)
            act = glu(gate, up)
        elif ACT == "gelu":
            act = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))  # exact GELU
        else:
            act = tl.maximum(acc, 0.0)  # ReLU
        row = tl.cast(q, tl.int64) * (B * S) + at + m
        store_rows(hbuf + row * F, narrow(act, DTYPE, CAST_F32), live, F, f, BLOCK_F)
        if SAVE:
            kept = tl.cast(q, tl.int64) * R_MAX + row0 + m
            if not RECOMPUTE:  # else the backward computes them again from the input rows kept below
                pre = narrow(acc, DTYPE, CAST_F32)
                store_rows(saved_pre + kept * (UP_COLS * F), pre, live, UP_COLS * F, f * UP_COLS, UP_COLS * BLOCK_F)
            # else the backward's dispatch sends the input rows again
            if not RESEND:  # noqa: SIM102 - RESEND is folded at compile time, f tested at run time
                if f == 0:
                    first = tl.cast(q, tl.int64) * R_MAX + row0
                    if DEDUP:
                        src_rows = first_row
                    else:
                        src_rows = at + m
                    if DISPATCH_SCALE != "none":
                        copy_rows(rows, src_rows, saved_x + first * H, live, H, BM, BLOCK_K, scales, SCALE_COLS)
                    else:
                        copy_rows(rows, src_rows, saved_x + first * H, live, H, BM, COPY_COLS)
        if f == 0:
            rid = tl.load((me + SB_ROW_ID).to(tl.pointer_type(tl.int64)) + at + m, mask=live, other=0)
            tl.store(hbuf_rid + row, rid, mask=live)


@triton.jit
def gemm2(
    rows,
    hbuf_rid,
    w,
    bias,
    weight_of,
    slots,
    staging,
    staging_rid,
    saved_out,
    q,
    s,
    local,
    row0,
    lo,
    hi,
    h,
    BM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    CAST_F32: tl.constexpr,
    BACKWARD: tl.constexpr,
    SAVE: tl.constexpr,
    w_desc=None,
    a_desc=None,
):
    """Owner q, segment s, one GEMM2 tile: the H-block at column ``h`` of a bound m-tile
    (as ``gemm1``'s) of GEMM2, out = h Wd (``rows`` the workspace ring GEMM1 wrote,
    ``w`` = Wd), one [BM, BLOCK_H] tile into the owner's ``staging`` ring (the memory
    plan's private staging); H-block 0 copies the rows' row_ids beside them, for the
    return. The backward's: dX = dH [Wg Wu]ᵀ (or dH Wuᵀ), ``rows`` the dH its GEMM1 wrote
    at the rows' places among the owner's rows, ``w`` GEMM1's weights, read transposed.
    DEDUP with ``SAVE``: a row's output leaves summed with its token's other slots here, so
    the owner keeps the outputs at the rows' places among its rows, for the gate gradient.
    With ``BIAS`` the forward adds the expert's b_down (``bias``) to its output.
    """
    if hi > lo:
        e = tl.cast(tl.load(weight_of + q * E_MAX + local), tl.int64)
        at = ring_row(row0, s, s)
        base = tl.cast(q, tl.int64) * (B * S)
        if BACKWARD:
            rows += tl.cast(q, tl.int64) * R_MAX * (UP_COLS * F)
            w = operand(w, slots, e, H * (UP_COLS * F), 0)
            acc = gemm_tile(
                rows, R_MAX, row0, w, H, h, UP_COLS * F, BM, BLOCK_H, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION, True,
                w_desc=w_desc, w_row=e * H, a_desc=a_desc,
            )  # fmt: skip
        else:
            rows += base * F
            w = operand(w, slots, e, F * H, SLOT_DOWN_AT)
            acc = gemm_tile(
                rows, B * S, at, w, H, h, F, BM, BLOCK_H, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION, w_desc=w_desc,
                w_row=e * F, a_desc=a_desc,
            )  # fmt: skip
            if BIAS:
                acc += bias_row(operand(bias, slots, e, H, SLOT_B_DOWN_AT), H, h, BLOCK_H)[None, :]
        m = tl.arange(0, BM)
        live = (m >= lo) & (m < hi)
        row = base + at + m
        out = narrow(acc, DTYPE, CAST_F32)
        store_rows(staging + row * H, out, live, H, h, BLOCK_H)
        if DEDUP and SAVE:
            store_rows(saved_out + (tl.cast(q, tl.int64) * R_MAX + row0 + m) * H, out, live, H, h, BLOCK_H)
        if h == 0:
            tl.store(staging_rid + row, tl.load(hbuf_rid + row, mask=live, other=0), mask=live)


@triton.jit
def m_tile_slot(kind, item, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr):
    """The m-tile slot of GEMM work item ``item`` of an entry of ``kind``: items run m-tile
    major, GEMM1's ⌈F / BLOCK_F⌉ column blocks or GEMM2's ⌈H / BLOCK_H⌉ per slot."""
    f_blocks = (F + BLOCK_F - 1) // BLOCK_F
    h_blocks = (H + BLOCK_H - 1) // BLOCK_H
    return tl.where(kind == KIND_GEMM1, item // f_blocks, item // h_blocks)
