"""Dispatch phase 3 (RDEP section 3.4): a source's admitted rows, payload and sideband, to
the exact offsets their owner published, in the owner's ring slot of the segment."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import narrow
from rdepc.codegen.device.gemm import fp8_scale, to_e4m3
from rdepc.codegen.device.heap import peer, put
from rdepc.codegen.device.layout import (
    ADMITTED,
    BWD_FP8,
    BWD_INPUTS,
    BWD_PAYLOAD,
    BWD_ROW_IDS,
    BWD_SB_GATE,
    BWD_SB_LINKS,
    BWD_SCALE_COLS,
    BWD_SCALES,
    BWD_SCALES_AT,
    BWD_WIRE,
    CARRY_GATE,
    CARRY_LOCAL_EXPERT,
    DEDUP,
    DISPATCH_DTYPE,
    DISPATCH_SCALE,
    DTYPE,
    E_MAX,
    EL_PAD,
    GATE_INPUT,
    OFFSETS,
    PAYLOAD,
    RESEND,
    ROUTE_SCRATCH,
    SB_GATE,
    SB_LINKS,
    SB_LOCAL_EXPERT,
    SB_ROW_ID,
    SB_SCALE,
    SCALE_COLS,
    SCALES,
    ST_COLS,
    ST_SENT,
    H,
    K,
    T,
)
from rdepc.codegen.device.rows import clip, links, locate, ring_row


@triton.jit
def dispatch(
    heap,
    x,
    inputs,
    gates,
    order,
    owner_first,
    n_local,
    sorted_rows,
    scratch,
    topk_ids,
    owner_of,
    local_of,
    rowpos,
    stats,
    r,
    q,
    s,
    item,
    items,
    n_tokens,
    rid_c,
    rid_r,
    rid_t,
    rid_k,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MOVE_H: tl.constexpr,
    CAST_F32: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Source r → owner q, segment s (dispatch phase 3): the admitted rows of r that fall in
    the segment, payload and sideband, into q's ring slot s % B. Returns how many (all the
    entry's items find the same: 0 says every one of them is empty).

    The backward sends along the same offsets (the forward's accepted set, never routed
    again): ``x`` is then dL/dy and ``gates`` g', each row goes as g'·dL/dy in the layer's
    dtype (BWD_FP8: in fp8 e4m3, a scale per BWD_SCALE_COLS columns into BWD_SCALES_AT) into
    q's backward payload ring, and its row_id beside it.

    GATE_INPUT: the forward sends g·x, rounded to the layer's dtype (then to the dispatch
    format), as the expert's input; the backward sends dL/dy as it is (the combine added the
    returned rows unweighted).

    RESEND: the backward also sends each row's input again (``inputs``, the forward's x; g'·x
    under GATE_INPUT), as the forward's dispatch sent it, into q's BWD_INPUTS at the same place.

    A step that copies rows or scales them (the forward's payload but fp8, the backward's
    g'·dL/dy) carries MOVE_H columns; one that quantises them (fp8), sends dL/dy once per
    (token, owner) (DEDUP) or resends the input rows (RESEND), BLOCK_H.

    Every row goes to the exact offset q published for its (source, local expert) span plus
    its position in the span; payload and sideband share that one split table (appendix
    A.3, condition 2). Spans are disjoint by construction, so placement needs no atomics.
    Work item ``item`` of ``items`` takes every items-th block of BLOCK_R rows.

    DEDUP: only the token's first slot at q sends its payload row (and scales; in the
    backward dL/dy as it is); every slot sends its sideband with the links to its token's
    first and next slot there (in the backward its g' too: the owner scales).
    """
    local = tl.arange(0, EL_PAD)
    mine = local < tl.load(n_local + q)
    me = peer(heap, r)
    offset = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, mask=mine, other=0)
    admitted = tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, mask=mine, other=0)
    lo, count = clip(offset, admitted, s)
    n = tl.sum(count, axis=0)
    expert = tl.load(order + tl.load(owner_first + q) + local, mask=mine, other=0)
    bucket = tl.load(scratch + tl.cast(r, tl.int64) * ROUTE_SCRATCH + expert, mask=mine, other=0)
    dst = peer(heap, q)
    if BACKWARD:
        payload = (dst + BWD_PAYLOAD).to(tl.pointer_type(BWD_WIRE))
    else:
        payload = (dst + PAYLOAD).to(tl.pointer_type(DISPATCH_DTYPE))
    rows = sorted_rows + tl.cast(r, tl.int64) * (T * K)
    base = tl.cast(r, tl.int64) * n_tokens * K
    start = item * BLOCK_R
    while start < n:
        u = start + tl.arange(0, BLOCK_R)
        start += items * BLOCK_R
        keep = u < n
        which, row = locate(u, lo, count, local)
        at_expert = which[:, None] == local[None, :]
        p = row - tl.sum(tl.where(at_expert, offset[None, :], 0), axis=1)  # position in r's run
        i = tl.load(rows + tl.sum(tl.where(at_expert, bucket[None, :], 0), axis=1) + p, mask=keep, other=0)
        t = i // K  # route row t*K + k of rank r
        k = i % K
        at = ring_row(row, s, s)
        src = x + (tl.cast(r, tl.int64) * n_tokens + t) * H
        to = payload + tl.cast(at, tl.int64) * H
        if DEDUP:
            first, later = links(heap, topk_ids, owner_of, local_of, rowpos, r, t, row, q, keep, n_tokens)
            send = keep & (first == row)  # the token's first slot at q carries its payload row
            if BACKWARD:
                link = (dst + BWD_SB_LINKS).to(tl.pointer_type(tl.int32)) + 2 * at
            else:
                link = (dst + SB_LINKS).to(tl.pointer_type(tl.int32)) + 2 * at
            put(link, first, keep)
            put(link + 1, later, keep)
        else:
            send = keep
        if BACKWARD:
            gp = tl.load(gates + base + i, mask=keep, other=0.0)  # g', which is g on every accepted row
            scale = gp
            if GATE_INPUT:  # the gate scaled the forward's input: dL/dy goes as it is
                scale = tl.where(keep, 1.0, 0.0)
            if DEDUP:  # dL/dy once per (token, owner), as it is, and each slot's g' beside it (bgemm1 scales)
                put((dst + BWD_SB_GATE).to(tl.pointer_type(tl.float32)) + at, scale, keep)
                for h in range(0, H, BLOCK_H):
                    c = h + tl.arange(0, BLOCK_H)
                    m = send[:, None] & (c < H)[None, :]
                    put(to[:, None] + c[None, :], tl.load(src[:, None] + c[None, :], mask=m), m)
            elif BWD_FP8:  # g'·dL/dy in fp32, then fp8 e4m3 with a scale per BWD_SCALE_COLS columns
                scales_at = (dst + BWD_SCALES_AT).to(tl.pointer_type(tl.float32)) + tl.cast(at, tl.int64) * BWD_SCALES
                for h in range(0, H, BWD_SCALE_COLS):
                    c = h + tl.arange(0, BWD_SCALE_COLS)
                    m = keep[:, None] & (c < H)[None, :]
                    v = tl.load(src[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32) * scale[:, None]
                    put_e4m3(v, to, scales_at, h, keep, m, BWD_SCALE_COLS, CAST_F32)
            else:
                for h in range(0, H, MOVE_H):
                    c = h + tl.arange(0, MOVE_H)
                    m = keep[:, None] & (c < H)[None, :]
                    rows_h = tl.load(src[:, None] + c[None, :], mask=m)
                    put(to[:, None] + c[None, :], narrow(rows_h.to(tl.float32) * scale[:, None], DTYPE, CAST_F32), m)
            if RESEND:  # the input rows again, as the forward's dispatch sent them (no dedup, no fp8)
                src_x = inputs + (tl.cast(r, tl.int64) * n_tokens + t) * H
                to_x = (dst + BWD_INPUTS).to(tl.pointer_type(DISPATCH_DTYPE)) + tl.cast(at, tl.int64) * H
                for h in range(0, H, BLOCK_H):
                    c = h + tl.arange(0, BLOCK_H)
                    m = keep[:, None] & (c < H)[None, :]
                    rows_h = gated(tl.load(src_x[:, None] + c[None, :], mask=m), gp, CAST_F32)
                    put(to_x[:, None] + c[None, :], on_wire(rows_h, CAST_F32), m)
        else:
            if GATE_INPUT:  # the gate scales the expert's input (no dedup: every slot sends its own row)
                scale = tl.load(gates + base + i, mask=send, other=0.0)
            else:
                scale = tl.zeros([BLOCK_R], tl.float32)  # unread
            payload_rows(dst, src, to, at, send, scale, BLOCK_R, BLOCK_H, MOVE_H, CAST_F32)
            sent = tl.sum(send.to(tl.int32), axis=0)
            tl.atomic_add(stats + tl.cast(r, tl.int64) * ST_COLS + ST_SENT, sent)
        row_id = rid_c + tl.cast(r, tl.int64) * rid_r + tl.cast(t, tl.int64) * rid_t + k * rid_k
        if BACKWARD:
            put((dst + BWD_ROW_IDS).to(tl.pointer_type(tl.int64)) + at, row_id, keep)
        else:  # the sideband: row_id, and the fields the spec carries
            put((dst + SB_ROW_ID).to(tl.pointer_type(tl.int64)) + at, row_id, keep)
            if CARRY_LOCAL_EXPERT:
                put((dst + SB_LOCAL_EXPERT).to(tl.pointer_type(tl.int32)) + at, which, keep)
            if CARRY_GATE:
                gate = tl.load(gates + base + i, mask=keep, other=0.0)
                put((dst + SB_GATE).to(tl.pointer_type(tl.float32)) + at, gate, keep)
    return n


@triton.jit
def put_e4m3(v, to, scales_at, h, keep, m, COLS: tl.constexpr, CAST_F32: tl.constexpr):
    """fp32 rows ``v`` (0 where masked), columns h .. h + COLS, as fp8 e4m3 at rows ``to`` and
    each row's scale for the block at ``scales_at`` (its row's scales), the ``keep`` rows only:
    fp8 dispatch's ``scale block`` and the fp8 backward."""
    qscale = fp8_scale(tl.max(tl.abs(v), axis=1))
    put(scales_at + h // COLS, qscale, keep)
    c = h + tl.arange(0, COLS)
    put(to[:, None] + c[None, :], to_e4m3(v, qscale[:, None], CAST_F32), m)


@triton.jit
def gated(rows, scale, CAST_F32: tl.constexpr):
    """GATE_INPUT: source rows (the layer's dtype) times their gates, rounded to the layer's
    dtype as the reference's g·x is; otherwise the rows as they are."""
    if GATE_INPUT:
        return narrow(rows.to(tl.float32) * scale[:, None], DTYPE, CAST_F32)
    return rows


@triton.jit
def payload_rows(
    dst, src, to, at, send, scale, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, MOVE_H: tl.constexpr,
    CAST_F32: tl.constexpr,
):  # fmt: skip
    """The forward dispatch's payload rows (those ``send`` marks), from ``src`` to ``to``: as
    they are, narrowed to the dispatch dtype, or quantised to fp8 e4m3 (DISPATCH_SCALE) with
    their scales into the sideband. GATE_INPUT: each row times its gate ``scale`` first."""
    if DISPATCH_SCALE == "row":
        scales = (dst + SB_SCALE).to(tl.pointer_type(tl.float32))
        # fp8 e4m3, one scale per row: the row's largest magnitude first
        amax = tl.zeros([BLOCK_R], tl.float32)
        for h in range(0, H, BLOCK_H):
            c = h + tl.arange(0, BLOCK_H)
            m = send[:, None] & (c < H)[None, :]
            rows_h = gated(tl.load(src[:, None] + c[None, :], mask=m, other=0.0), scale, CAST_F32).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(rows_h), axis=1))
        qscale = fp8_scale(amax)
        put(scales + at, qscale, send)
        for h in range(0, H, BLOCK_H):
            c = h + tl.arange(0, BLOCK_H)
            m = send[:, None] & (c < H)[None, :]
            rows_h = gated(tl.load(src[:, None] + c[None, :], mask=m, other=0.0), scale, CAST_F32).to(tl.float32)
            put(to[:, None] + c[None, :], to_e4m3(rows_h, qscale[:, None], CAST_F32), m)
    elif DISPATCH_SCALE == "block":
        at_scales = (dst + SB_SCALE).to(tl.pointer_type(tl.float32)) + tl.cast(at, tl.int64) * SCALES
        for h in range(0, H, SCALE_COLS):  # fp8 e4m3, one scale per SCALE_COLS columns of a row
            c = h + tl.arange(0, SCALE_COLS)
            m = send[:, None] & (c < H)[None, :]
            rows_h = gated(tl.load(src[:, None] + c[None, :], mask=m, other=0.0), scale, CAST_F32).to(tl.float32)
            put_e4m3(rows_h, to, at_scales, h, send, m, SCALE_COLS, CAST_F32)
    else:
        for h in range(0, H, MOVE_H):
            c = h + tl.arange(0, MOVE_H)
            m = send[:, None] & (c < H)[None, :]
            rows_h = gated(tl.load(src[:, None] + c[None, :], mask=m), scale, CAST_F32)
            put(to[:, None] + c[None, :], on_wire(rows_h, CAST_F32), m)


@triton.jit
def on_wire(rows, CAST_F32: tl.constexpr):
    """Rows in the layer's dtype as the payload carries them (a dispatch dtype that is not
    fp8): as they are, or narrowed to it."""
    if DISPATCH_DTYPE == DTYPE:
        return rows
    elif tl.bfloat16 == DISPATCH_DTYPE:
        return narrow(rows.to(tl.float32), DISPATCH_DTYPE, CAST_F32)
    else:
        return rows.to(DISPATCH_DTYPE)
