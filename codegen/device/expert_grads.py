"""The backward's expert work at an owner: ``bgemm1`` (dA = dO·Wdᵀ over a bound m-tile and
the activation's backward) and ``wgrad`` (the weight gradients), with what the activation's
backward is made of; and ``expert_item``, which runs one GEMM work item of either pass (it
sits here, beside the backward's tiles, because it calls both these and ``experts``')."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import narrow
from rdepc.codegen.device.experts import bias_row, gemm1, gemm2, glu, operand, payload_tile, store_bias
from rdepc.codegen.device.gemm import (
    column_sums,
    copy_rows,
    gate_up,
    gemm_rows_tn,
    gemm_tile,
    store_rows,
)
from rdepc.codegen.device.heap import peer
from rdepc.codegen.device.layout import (
    ACT,
    ACT_ALPHA,
    ACT_LIMIT,
    BIAS,
    BWD_FP8,
    BWD_INPUTS,
    BWD_PAYLOAD,
    BWD_ROW_IDS,
    BWD_SB_GATE,
    BWD_SB_LINKS,
    BWD_SCALE_COLS,
    BWD_SCALES_AT,
    BWD_WIRE,
    DEDUP,
    DISPATCH_DTYPE,
    DTYPE,
    E_MAX,
    GATED,
    KIND_GEMM1,
    KIND_GEMM2,
    KIND_WGRAD,
    PRECISION,
    R_MAX,
    RECOMPUTE,
    RESEND,
    SLOT_B_DOWN_AT,
    SLOT_B_UP_AT,
    SLOT_DOWN_AT,
    TMA,
    UP_COLS,
    B,
    F,
    H,
    S,
)
from rdepc.codegen.device.rows import ring_row


@triton.jit
def glu_backward(gate, up, da):
    """``glu``'s backward at pre-activations ``gate`` and ``up`` for dL/d(activation) ``da``:
    (dL/dgate, dL/dup). A clamped input passes no gradient (as torch's clamp: inside the
    bounds, bounds included)."""
    if ACT == "clamped_swiglu":
        g = tl.minimum(gate, ACT_LIMIT)
        u = tl.minimum(tl.maximum(up, -ACT_LIMIT), ACT_LIMIT)
        sig = tl.sigmoid(g * ACT_ALPHA)
        gs = g * sig
        d_gate = tl.where(gate <= ACT_LIMIT, da * (u + 1.0) * (sig + gs * ACT_ALPHA * (1.0 - sig)), 0.0)
        d_up = tl.where((up >= -ACT_LIMIT) & (up <= ACT_LIMIT), da * gs, 0.0)
        return d_gate, d_up
    sig = tl.sigmoid(gate)
    return da * up * sig * (1.0 + gate * (1.0 - sig)), da * (gate * sig)


@triton.jit
def anchored(x, like):
    """``x``, bitwise, computed from ``like`` too: x - (+0.0), the +0.0 formed from ``like``
    (any value, a NaN or an infinity included). Triton gives an element-wise result the layout
    of its operands: the pre-activations a dA tile loads then share the accumulator's layout,
    and the gated activation's backward is formed once, not once per layout (880 B of stack)."""
    z = tl.abs(like * 0.0)
    return x - tl.where(z == z, z, 0.0)


@triton.jit
def glu_again(gate, up):
    """The activation at pre-activations ``gate`` and ``up``, for the down projection's
    weight gradient: ``glu``'s, with the clamped variant's products in ``glu_backward``'s
    order. Apart from ``glu_backward`` so that the unified kernel forms it after dgate and dup
    are stored: with the three tiles formed at once, 255 registers did not hold its GEMM
    loops (two spills in each). The GEMM kernel forms it before that store (``bgemm1``)."""
    if ACT == "clamped_swiglu":
        g = tl.minimum(gate, ACT_LIMIT)
        u = tl.minimum(tl.maximum(up, -ACT_LIMIT), ACT_LIMIT)
        return (u + 1.0) * (g * tl.sigmoid(g * ACT_ALPHA))
    return glu(gate, up)


@triton.jit
def kept_pre_activations(saved_pre, row, live, c, like=None):
    """The forward's gate and up pre-activations (kept interleaved, [.., F, 2]) of the
    owner's rows ``row`` at columns ``c``, fp32; with ``like``, ``anchored`` to it: in its
    layout."""
    keep = live[:, None] & (c < F)[None, :]
    pre = saved_pre + row[:, None] * (2 * F) + 2 * c[None, :]
    gate = tl.load(pre, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(pre + 1, mask=keep, other=0.0).to(tl.float32)
    if like is not None:
        gate = anchored(gate, like)
        up = anchored(up, like)
    return gate, up


@triton.jit
def paired_backward(da, gate, up, dh, row, live, c, CAST_F32: tl.constexpr):
    """The gated backward at columns ``c`` of dA (``glu_backward``), stored as (dgate, dup)
    pairs of the owner's rows ``row`` in dH ([.., F, 2], the weights' layout); the
    activation A at those columns (``glu_again``, narrowed), for the caller to store: formed
    before the pairs are stored, so that gate and up are not held across the store."""
    d_gate, d_up = glu_backward(gate, up, da)
    act = narrow(glu_again(gate, up), DTYPE, CAST_F32)
    pair = tl.join(narrow(d_gate, DTYPE, CAST_F32), narrow(d_up, DTYPE, CAST_F32))
    two = tl.arange(0, 2)
    out = dh + row[:, None, None] * (2 * F) + 2 * c[None, :, None] + two[None, None, :]
    tl.store(out, pair, mask=(live[:, None] & (c < F)[None, :])[:, :, None])
    return act


@triton.jit
def bgemm1(
    heap,
    w_down,
    weight_of,
    slots,
    saved_pre,
    w_up,
    b_up,
    saved_x,
    dh,
    act_rows,
    do_rows,
    hbuf_rid,
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
    PAIRED: tl.constexpr,
    COPY_COLS: tl.constexpr,
    down_t=None,
    up_desc=None,
    a_desc=None,
):
    """Backward, owner q, segment s, one tile: the F-block at column ``f`` of a bound m-tile
    (as ``gemm1``'s), over the g'·dL/dy rows the backward's dispatch placed
    in payload slot s % B (the forward's places): dA = dO Wdᵀ, then dH — for a gated expert
    ``glu_backward``'s (dgate, dup), interleaved as the weights' [E, H, F, 2], else
    dA ⊙ ACT'(h) — written at the rows' places among the owner's rows, beside the activation
    A the forward computed (for dWd). F-block 0 also keeps the dO rows (for dWd) and copies
    the rows' row_ids for the return. The pre-activations are the forward's (``saved_pre``),
    or with ``RECOMPUTE`` GEMM1's tile again from the kept input rows (``pre_activations``).
    With ``RESEND`` the input rows came again beside dO (BWD_INPUTS, in the payload's dtype,
    at the same places): GEMM1 again reads them there as the forward's GEMM1 read its
    payload, and F-block 0 copies them to the owner's rows (``saved_x``) for dWg and dWu.

    PAIRED (the split GEMM kernel): the gated backward runs over dA's even and odd columns
    apart (``paired_backward``), the saved pre-activations ``anchored`` to them and (dgate,
    dup) stored as pairs straight from the accumulator's layout: half the tile's registers at
    a time and no layout conversion for dH (880 B of stack, then 0). The unified kernel
    forms the whole tile in two layouts: with its transport code beside, 255 registers do not
    hold the other (spills in its GEMM loops).

    DEDUP: the payload holds dL/dy once per (token, owner), at the token's first slot. Each
    row reads it through its link and scales by its own g' (the backward's sideband): dA =
    g'·(dL/dy Wdᵀ), and the dO rows it keeps are g'·dL/dy. BWD_FP8: the dO rows are fp8,
    read with their scales (and kept dequantised).
    """
    if hi > lo:
        e = tl.cast(tl.load(weight_of + q * E_MAX + local), tl.int64)
        at = ring_row(row0, s, s)
        me = peer(heap, q)
        rows = (me + BWD_PAYLOAD).to(tl.pointer_type(BWD_WIRE))
        scales = (me + BWD_SCALES_AT).to(tl.pointer_type(tl.float32))  # BWD_FP8: [B*S, BWD_SCALES]
        w = operand(w_down, slots, e, F * H, SLOT_DOWN_AT)
        m = tl.arange(0, BM)
        live = (m >= lo) & (m < hi)
        first_row = m
        if DEDUP:
            link = (me + BWD_SB_LINKS).to(tl.pointer_type(tl.int32))
            first_row = tl.load(link + 2 * (at + m), mask=live, other=-1)  # the token's first slot here
            gp = tl.load((me + BWD_SB_GATE).to(tl.pointer_type(tl.float32)) + at + m, mask=live, other=0.0)
        da = payload_tile(
            rows, at, w, F, f, scales, first_row, BM, BLOCK_F, BLOCK_K, STAGES, CAST_F32, True, BWD_FP8, BWD_SCALE_COLS,
            down_t, e * F, a_desc,
        )  # fmt: skip
        if DEDUP:
            da = da * gp[:, None]
        row = tl.cast(q, tl.int64) * R_MAX + row0 + m  # the owner's rows, as the forward saved them
        c = f + tl.arange(0, BLOCK_F)
        keep = live[:, None] & (c < F)[None, :]
        inputs = (me + BWD_INPUTS).to(tl.pointer_type(DISPATCH_DTYPE))
        if RECOMPUTE:
            if RESEND:  # the rows as the forward's payload held them
                again = pre_activations(
                    inputs, B * S, at, w_up, b_up, slots, e, f, BM, BLOCK_F, BLOCK_K, STAGES, CAST_F32, up_desc
                )
            else:
                xs = saved_x + tl.cast(q, tl.int64) * R_MAX * H
                again = pre_activations(
                    xs, R_MAX, row0, w_up, b_up, slots, e, f, BM, BLOCK_F, BLOCK_K, STAGES, CAST_F32, up_desc
                )
        if GATED and PAIRED:
            # dA's even and odd columns apart: in the accumulator's layout a thread holds
            # column pairs, so the split moves no data (as gate_up's)
            even, odd = tl.split(tl.reshape(da, (BM, BLOCK_F // 2, 2)))
            c_even = f + 2 * tl.arange(0, BLOCK_F // 2)
            if RECOMPUTE:
                gate, up = gate_up(again, BM, BLOCK_F)
                gate_even, gate_odd = tl.split(tl.reshape(gate, (BM, BLOCK_F // 2, 2)))
                up_even, up_odd = tl.split(tl.reshape(up, (BM, BLOCK_F // 2, 2)))
            else:  # each half's loaded as it is formed: the odd half's not held across the even's
                gate_even, up_even = kept_pre_activations(saved_pre, row, live, c_even, even)
            act_even = paired_backward(even, gate_even, up_even, dh, row, live, c_even, CAST_F32)
            if not RECOMPUTE:
                gate_odd, up_odd = kept_pre_activations(saved_pre, row, live, c_even + 1, odd)
            act_odd = paired_backward(odd, gate_odd, up_odd, dh, row, live, c_even + 1, CAST_F32)
            act = tl.reshape(tl.join(act_even, act_odd), (BM, BLOCK_F))
        elif GATED:
            if RECOMPUTE:
                gate, up = gate_up(again, BM, BLOCK_F)
            else:
                gate, up = kept_pre_activations(saved_pre, row, live, c)
            d_gate, d_up = glu_backward(gate, up, da)
            out = dh + row[:, None] * (2 * F) + 2 * c[None, :]
            tl.store(out, narrow(d_gate, DTYPE, CAST_F32), mask=keep)
            tl.store(out + 1, narrow(d_up, DTYPE, CAST_F32), mask=keep)
            act = narrow(glu_again(gate, up), DTYPE, CAST_F32)
        else:
            if RECOMPUTE:
                h = again
            else:
                h = tl.load(saved_pre + row[:, None] * F + c[None, :], mask=keep, other=0.0).to(tl.float32)
            if ACT == "gelu":
                act = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
                slope = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476)) + h * 0.3989422804014327 * tl.exp(
                    -0.5 * h * h
                )
            else:
                act = tl.maximum(h, 0.0)
                slope = tl.where(h > 0.0, 1.0, 0.0)
            tl.store(dh + row[:, None] * F + c[None, :], narrow(da * slope, DTYPE, CAST_F32), mask=keep)
            act = narrow(act, DTYPE, CAST_F32)
        store_rows(act_rows + row * F, act, live, F, f, BLOCK_F)
        if f == 0:
            first = tl.cast(q, tl.int64) * R_MAX + row0
            if DEDUP:
                for c0 in range(0, H, BLOCK_K):  # dO = g'·dL/dy, per row
                    cols = c0 + tl.arange(0, BLOCK_K)
                    mk = live[:, None] & (cols < H)[None, :]
                    d = tl.load(rows + tl.cast(first_row, tl.int64)[:, None] * H + cols[None, :], mask=mk, other=0.0)
                    do = narrow(d.to(tl.float32) * gp[:, None], DTYPE, CAST_F32)
                    tl.store(do_rows + (first + m)[:, None] * H + cols[None, :], do, mask=mk)
            elif BWD_FP8:  # dequantised, as the GEMM above read them
                copy_rows(rows, at + m, do_rows + first * H, live, H, BM, BLOCK_K, scales, BWD_SCALE_COLS)
            else:
                copy_rows(rows, at + m, do_rows + first * H, live, H, BM, COPY_COLS)
            if RESEND:  # the input rows for the weight gradients, as the forward would have kept them
                copy_rows(inputs, at + m, saved_x + first * H, live, H, BM, COPY_COLS)
            ring = tl.cast(q, tl.int64) * (B * S) + at + m
            rid = tl.load((me + BWD_ROW_IDS).to(tl.pointer_type(tl.int64)) + at + m, mask=live, other=0)
            tl.store(hbuf_rid + ring, rid, mask=live)


@triton.jit
def pre_activations(
    xs, n_rows, row0, w_up, b_up, slots, e, f, BM: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, CAST_F32: tl.constexpr, w_desc=None,
):  # fmt: skip
    """``RECOMPUTE``: GEMM1's pre-activations again, fp32 [BM, UP_COLS * BLOCK_F] — x·[Wg Wu]
    (+ b_up) at F-block ``f`` of the m-tile whose first row is ``row0`` among the ``n_rows``
    input rows at ``xs`` (an owner's kept rows, or RESEND's ring), expert ``e``, rounded to
    DTYPE as the forward would have kept them. The same rows, weights, tile and reduction
    order as the forward's GEMM1, so the same values."""
    w = operand(w_up, slots, e, H * (UP_COLS * F), 0)
    acc = gemm_tile(
        xs, n_rows, row0, w, UP_COLS * F, f * UP_COLS, H, BM, UP_COLS * BLOCK_F, BLOCK_K, STAGES, TMA, CAST_F32,
        PRECISION, w_desc=w_desc, w_row=e * H,
    )  # fmt: skip
    if BIAS:
        bias = operand(b_up, slots, e, UP_COLS * F, SLOT_B_UP_AT)
        acc += bias_row(bias, UP_COLS * F, f * UP_COLS, UP_COLS * BLOCK_F)[None, :]
    return narrow(acc, DTYPE, CAST_F32).to(tl.float32)


@triton.jit
def wgrad(
    saved_x,
    dh,
    act_rows,
    do_rows,
    dw_up,
    dw_down,
    db_up,
    db_down,
    weight_of,
    dslots,
    group,
    q,
    item,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    CAST_F32: tl.constexpr,
):
    """Backward, owner q, work item ``item``: one tile of a local expert's weight gradients,
    the expert's rows summed in chunks of BLOCK_K from its first row — a fixed order in
    every schedule and no float atomics, so the result is deterministic and the same for
    bulk, pipelined and deep. Items run expert by expert: first the [BLOCK_H, UP_COLS *
    BLOCK_F] tiles of GEMM1's weight gradient ([Wg Wu] or Wu) = Xᵀ dH, then the [BLOCK_F,
    BLOCK_H] tiles of dWd = Aᵀ dO. An expert that received no rows gets zeros. With
    ``BIAS`` the tiles of the first H-block (F-block) also sum their columns of dH (dO) over
    the same rows, in the same order: the bias gradients db_up and db_down.
    """
    h_blocks = (H + BLOCK_H - 1) // BLOCK_H
    f_blocks = (F + BLOCK_F - 1) // BLOCK_F
    per = h_blocks * f_blocks
    local = item // (2 * per)
    t = item % (2 * per)
    e = tl.cast(tl.load(weight_of + q * E_MAX + local), tl.int64)
    grp = group + tl.cast(q, tl.int64) * (E_MAX * 2) + local * 2
    first = tl.load(grp)
    n = tl.load(grp + 1)
    base = tl.cast(q, tl.int64) * R_MAX
    if t < per:  # (the branches share no names: a compiled kernel's branches must agree on their types)
        i = t // f_blocks * BLOCK_H
        c = t % f_blocks * (UP_COLS * BLOCK_F)
        xs = saved_x + base * H
        ds = dh + base * (UP_COLS * F)
        d_up = gemm_rows_tn(
            xs, H, i, ds, UP_COLS * F, c, first, n, BLOCK_H, UP_COLS * BLOCK_F, BLOCK_K, STAGES, TMA, CAST_F32,
            PRECISION,
        )  # fmt: skip
        h = i + tl.arange(0, BLOCK_H)
        up = narrow(d_up, DTYPE, CAST_F32)
        dw = operand(dw_up, dslots, e, H * (UP_COLS * F), 0)
        store_rows(dw + h * (UP_COLS * F), up, h < H, UP_COLS * F, c, UP_COLS * BLOCK_F)
        if BIAS:  # noqa: SIM102 - BIAS is folded at compile time, the block tested at run time
            if i == 0:
                sum_up = column_sums(ds, UP_COLS * F, c, first, n, UP_COLS * BLOCK_F, BLOCK_K)
                sum_up = narrow(sum_up, DTYPE, CAST_F32)
                db = operand(db_up, dslots, e, UP_COLS * F, SLOT_B_UP_AT)
                store_bias(db, sum_up, UP_COLS * F, c, UP_COLS * BLOCK_F)
    else:
        j = (t - per) // h_blocks * BLOCK_F
        k = (t - per) % h_blocks * BLOCK_H
        a_rows = act_rows + base * F
        o_rows = do_rows + base * H
        d_down = gemm_rows_tn(
            a_rows, F, j, o_rows, H, k, first, n, BLOCK_F, BLOCK_H, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION
        )
        f = j + tl.arange(0, BLOCK_F)
        dwd = operand(dw_down, dslots, e, F * H, SLOT_DOWN_AT)
        store_rows(dwd + f * H, narrow(d_down, DTYPE, CAST_F32), f < F, H, k, BLOCK_H)
        if BIAS:  # noqa: SIM102 - as above
            if j == 0:
                sum_down = column_sums(o_rows, H, k, first, n, BLOCK_H, BLOCK_K)
                dbd = operand(db_down, dslots, e, H, SLOT_B_DOWN_AT)
                store_bias(dbd, narrow(sum_down, DTYPE, CAST_F32), H, k, BLOCK_H)


@triton.jit
def expert_item(
    kind, heap, w_up, w_down, weight_of, slots, dslots, group, hbuf, hbuf_rid, staging, staging_rid, saved_x, saved_pre,
    saved_out, dh, act_rows, do_rows, dw_up, dw_down, b_up, b_down, db_up, db_down, q, s, item, local, row0, lo, hi,
    BM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    CAST_F32: tl.constexpr, BACKWARD: tl.constexpr, SAVE: tl.constexpr, PAIRED: tl.constexpr,
    COPY_COLS: tl.constexpr, up_desc=None, down_desc=None, up_t=None, down_t=None, rows_desc=None, mid_desc=None,
):  # fmt: skip
    """Run GEMM work item ``item`` of an entry of ``kind`` (gemm1, gemm2 or, in the backward,
    wgrad) at owner q, segment s; a GEMM1 or GEMM2 item's m-tile is already bound (local
    expert, first row, live rows [lo, hi): ``rows.m_tile`` of ``m_tile_slot``). Both
    kernels that run GEMM work call it: ``rdep_layer`` in unified mode, ``rdep_gemm``, with
    their program's ``weight_descriptors`` and, one process per rank, ``ring_descriptors``;
    ``COPY_COLS``: the columns a step of an item's row copies carries (the rows kept for the
    backward, its dO rows)."""
    if kind == KIND_GEMM1:
        f = item % ((F + BLOCK_F - 1) // BLOCK_F) * BLOCK_F
        if BACKWARD:
            bgemm1(
                heap, w_down, weight_of, slots, saved_pre, w_up, b_up, saved_x, dh, act_rows, do_rows, hbuf_rid, q, s,
                local, row0, lo, hi, f, BM, BLOCK_F, BLOCK_K, STAGES, CAST_F32, PAIRED, COPY_COLS, down_t, up_desc,
                rows_desc,
            )  # fmt: skip
        else:
            gemm1(
                heap, w_up, b_up, weight_of, slots, hbuf, hbuf_rid, saved_x, saved_pre, q, s, local, row0, lo, hi, f,
                BM, BLOCK_F, BLOCK_K, STAGES, CAST_F32, SAVE, COPY_COLS, up_desc, rows_desc,
            )  # fmt: skip
    elif kind == KIND_GEMM2:
        h = item % ((H + BLOCK_H - 1) // BLOCK_H) * BLOCK_H
        if BACKWARD:  # dX = dH [Wg Wu]ᵀ
            gemm2(
                dh, hbuf_rid, w_up, b_down, weight_of, slots, staging, staging_rid, saved_out, q, s, local, row0, lo,
                hi, h, BM, BLOCK_H, BLOCK_K, STAGES, CAST_F32, True, False, up_t, mid_desc,
            )  # fmt: skip
        else:
            gemm2(
                hbuf, hbuf_rid, w_down, b_down, weight_of, slots, staging, staging_rid, saved_out, q, s, local, row0,
                lo, hi, h, BM, BLOCK_H, BLOCK_K, STAGES, CAST_F32, False, SAVE, down_desc, mid_desc,
            )  # fmt: skip
    elif kind == KIND_WGRAD:  # noqa: SIM102 - BACKWARD is folded at compile time, the kind tested at run time
        if BACKWARD:  # the backward's table only
            wgrad(
                saved_x, dh, act_rows, do_rows, dw_up, dw_down, db_up, db_down, weight_of, dslots, group, q, item,
                BLOCK_H, BLOCK_F, BLOCK_K, STAGES, CAST_F32,
            )  # fmt: skip
