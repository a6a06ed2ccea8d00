"""The return (RDEP section 3.4): owners send each computed row home to its front-end,
placed by its decoded row_id, never by its position (appendix A.3, condition 3) — straight
to its (token, slot) place, or (RING) through a return ring that ``unpack`` empties."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import narrow
from rdepc.codegen.device.dispatch import put_e4m3
from rdepc.codegen.device.heap import peer, put
from rdepc.codegen.device.layout import (
    ADMITTED,
    BWD_DGATE,
    BWD_FP8,
    BWD_PAYLOAD,
    BWD_RETURN,
    BWD_RETURN_IDS,
    BWD_RETURN_SCALES,
    BWD_SB_LINKS,
    BWD_SCALE_COLS,
    BWD_SCALES,
    BWD_WIRE,
    DEDUP,
    DTYPE,
    E_MAX,
    EL_PAD,
    K_PAD,
    OFFSETS,
    R_MAX,
    RETURN,
    RETURN_IDS,
    RING,
    SB_GATE,
    SB_LINKS,
    ST_COLS,
    ST_RETURNED,
    B,
    H,
    K,
    S,
    T,
    W,
)
from rdepc.codegen.device.rows import clip, decode, locate, owned_by, ring_row


@triton.jit
def returned_rows(me, BACKWARD: tl.constexpr):
    """Where returned rows land in a front-end's heap slice ``me``: each at its (token,
    slot) place, or (RING) in the return ring; the forward's region, or the backward's (in
    BWD_WIRE: under BWD_FP8 with their scales at BWD_RETURN_SCALES, ``returned_grad``)."""
    if BACKWARD:
        rows = (me + BWD_RETURN).to(tl.pointer_type(BWD_WIRE))
    else:
        rows = (me + RETURN).to(tl.pointer_type(DTYPE))
    return rows


@triton.jit
def returned_grad(me, at, row, c, m, CAST_F32: tl.constexpr):
    """dL/dx rows ``row`` (int [N]) of the backward's landing rows in front-end slice ``me``,
    ``at`` where each starts ([N, 1]), columns ``c``, in fp32: under BWD_FP8 times their
    scales, rounded to the layer's dtype (as a return ring's unpack keeps them: the same
    sums either way)."""
    back = tl.load(at + c[None, :], mask=m, other=0.0).to(tl.float32)
    if BWD_FP8:
        scales = (me + BWD_RETURN_SCALES).to(tl.pointer_type(tl.float32))
        per_col = tl.cast(row, tl.int64)[:, None] * BWD_SCALES + c[None, :] // BWD_SCALE_COLS
        back = narrow(back * tl.load(scales + per_col, mask=m, other=0.0), DTYPE, CAST_F32).to(tl.float32)
    return back


@triton.jit
def returned_ids(me, BACKWARD: tl.constexpr):
    """RING: the row_ids of the return ring's rows in a front-end's heap slice ``me``."""
    if BACKWARD:
        return (me + BWD_RETURN_IDS).to(tl.pointer_type(tl.int64))
    return (me + RETURN_IDS).to(tl.pointer_type(tl.int64))


@triton.jit
def return_rows(
    heap,
    recv,
    staging,
    staging_rid,
    saved_out,
    stats,
    ctl,
    entry,
    epoch,
    q,
    r,
    s,
    claim,
    item,
    items,
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
    """Owner q → front-end r, segment s: the outputs of r's rows in the segment, each to its
    (token, slot) place by its decoded row_id — or (RING) into the slot of r's return ring
    that this piece claimed (claim % B), each row with its row_id, for r's unpack to place.
    Returns the piece's rows (as ``dispatch``).

    The rows are found by the owner's saved split table (one span per local expert), cut to
    the segment. A step that copies rows carries MOVE_H columns; one that sums (DEDUP) or
    quantises (BWD_FP8) them, BLOCK_H. A row_id that decodes to another rank is reported,
    not written. The backward returns dL/dx rows the same way, into r's backward regions.

    DEDUP: one row per (token, owner) — for every token of r whose last slot at q is in the
    segment, sum_k g_k · out_k over its slots here (link order, raw gates, fp32), in the
    layer's dtype, with the row_id of the token's first slot, to that slot's place. The
    token's other slots are reached through the sideband's links (every segment is
    resident). The backward returns dL/dx the same way, the slots' rows summed as they are
    (g' scaled dO), and each slot's dL/dg' = dL/dy · out_k, with the output the forward kept
    here (``saved_out``), one fp32 to its own (token, slot) place in r's BWD_DGATE.
    """
    local = tl.arange(0, EL_PAD)
    split = recv + (tl.cast(q, tl.int64) * W + r) * (E_MAX * 2) + local * 2
    lo, count = clip(tl.load(split, mask=local < E_MAX, other=0), tl.load(split + 1, mask=local < E_MAX, other=0), s)
    n = tl.sum(count, axis=0)
    front = peer(heap, r)
    landing = returned_rows(front, BACKWARD)
    if RING:
        ids = returned_ids(front, BACKWARD)
    out = staging + tl.cast(q, tl.int64) * (B * S) * H
    row_ids = staging_rid + tl.cast(q, tl.int64) * (B * S)
    if DEDUP:
        me = peer(heap, q)
        if BACKWARD:
            link = (me + BWD_SB_LINKS).to(tl.pointer_type(tl.int32))
            dy = (me + BWD_PAYLOAD).to(tl.pointer_type(DTYPE))  # one row per (token, owner), at its first slot
            dgate = (peer(heap, r) + BWD_DGATE).to(tl.pointer_type(tl.float32))
            kept = saved_out + tl.cast(q, tl.int64) * R_MAX * H
            hops = tl.arange(0, K_PAD)
        else:
            link = (me + SB_LINKS).to(tl.pointer_type(tl.int32))
            gate = (me + SB_GATE).to(tl.pointer_type(tl.float32))
    start = item * BLOCK_R
    while start < n:
        u = start + tl.arange(0, BLOCK_R)
        start += items * BLOCK_R
        live = u < n
        _, row = locate(u, lo, count, local)
        if DEDUP:
            at = ring_row(row, s, s)
            sends = live & (tl.load(link + 2 * at + 1, mask=live, other=0) < 0)  # the token's last slot here
            first = tl.load(link + 2 * at, mask=sends, other=0)
            rid = tl.load(row_ids + first, mask=sends, other=0)
        else:
            frm = ring_row(row, s, s)
            rid = tl.load(row_ids + frm, mask=live, other=0)
            sends = live
        rank, t, k = decode(rid, rid_c, rid_r, rid_t, rid_k)
        ok = owned_by(rank, rid, sends, r, ctl, entry, epoch, s)
        if not BACKWARD:
            tl.atomic_add(stats + tl.cast(q, tl.int64) * ST_COLS + ST_RETURNED, tl.sum(ok.to(tl.int32), axis=0))
        if RING:
            at = ring_row(row, s, claim)  # the claim's slot of r's return ring
            to_row = tl.cast(at, tl.int64)
            if DEDUP:
                put(ids + at, tl.where(ok, rid, -1), live)  # -1: no row here (the token returns from elsewhere)
            else:
                put(ids + at, rid, ok)
        else:
            to_row = tl.cast(t * K + k, tl.int64)
        to = landing + to_row * H
        if DEDUP:
            if BACKWARD:
                dg = tl.zeros([BLOCK_R, K_PAD], tl.float32)  # dL/dg' of the token's slots here, hop by hop
            for h in range(0, H, BLOCK_H):
                c = h + tl.arange(0, BLOCK_H)
                m = ok[:, None] & (c < H)[None, :]
                acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
                if BACKWARD:
                    d = tl.load(dy + tl.cast(first, tl.int64)[:, None] * H + c[None, :], mask=m, other=0.0).to(
                        tl.float32
                    )
                k_row = tl.where(ok, first, -1)
                for hop in range(K):  # the token's slots here, first to last: at most K
                    on = k_row >= 0
                    at_k = tl.cast(k_row, tl.int64)[:, None] * H + c[None, :]
                    o = tl.load(out + at_k, mask=on[:, None] & m, other=0.0)
                    if BACKWARD:
                        acc += o.to(tl.float32)
                        o_k = tl.load(kept + at_k, mask=on[:, None] & m, other=0.0).to(tl.float32)
                        dg += tl.where(hops[None, :] == hop, tl.sum(d * o_k, axis=1)[:, None], 0.0)
                    else:
                        g = tl.load(gate + k_row, mask=on, other=0.0)
                        acc += g[:, None] * o.to(tl.float32)
                    k_row = tl.where(on, tl.load(link + 2 * k_row + 1, mask=on, other=-1), -1)
                put(to[:, None] + c[None, :], narrow(acc, DTYPE, CAST_F32), m)
            if BACKWARD:  # each slot's dL/dg' to its own (token, slot) place at r
                k_row = tl.where(ok, first, -1)
                for hop in range(K):
                    on = k_row >= 0
                    _rank, t_k, k_k = decode(tl.load(row_ids + k_row, mask=on, other=0), rid_c, rid_r, rid_t, rid_k)
                    put(dgate + t_k * K + k_k, tl.sum(tl.where(hops[None, :] == hop, dg, 0.0), axis=1), on)
                    k_row = tl.where(on, tl.load(link + 2 * k_row + 1, mask=on, other=-1), -1)
        else:
            frm = out + tl.cast(frm, tl.int64) * H
            if BACKWARD and BWD_FP8:  # fp8 e4m3, a scale per BWD_SCALE_COLS columns beside each row
                scales_at = (front + BWD_RETURN_SCALES).to(tl.pointer_type(tl.float32)) + to_row * BWD_SCALES
                for h in range(0, H, BWD_SCALE_COLS):
                    c = h + tl.arange(0, BWD_SCALE_COLS)
                    m = ok[:, None] & (c < H)[None, :]
                    v = tl.load(frm[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
                    put_e4m3(v, to, scales_at, h, ok, m, BWD_SCALE_COLS, CAST_F32)
            else:
                for h in range(0, H, MOVE_H):
                    c = h + tl.arange(0, MOVE_H)
                    m = ok[:, None] & (c < H)[None, :]
                    put(to[:, None] + c[None, :], tl.load(frm[:, None] + c[None, :], mask=m), m)
    return n


@triton.jit
def unpack(
    heap,
    landing,
    ctl,
    entry,
    epoch,
    r,
    q,
    s,
    claim,
    item,
    items,
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
    """RING, front-end r: copy the piece owner q returned for segment s out of its
    return-ring slot (claim % B) to each row's (token, slot) place in r's private landing,
    by the row's decoded row_id (appendix A.3, condition 3); done, the slot is free for
    claim + B. Returns the piece's rows (as ``dispatch``).

    Which slot rows hold the piece follows from what q published to r: the admitted spans
    (offset, count) per local expert, cut to the segment, MOVE_H columns a step. BWD_FP8: the
    backward's rows are fp8 with their scales, and land dequantised, BLOCK_H columns a step.
    """
    local = tl.arange(0, EL_PAD)
    me = peer(heap, r)
    offset = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, mask=local < E_MAX, other=0)
    admitted = tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32)) + q * E_MAX + local, mask=local < E_MAX, other=0)
    lo, count = clip(offset, admitted, s)
    n = tl.sum(count, axis=0)
    ring = returned_rows(me, BACKWARD)
    ids = returned_ids(me, BACKWARD)
    mine = landing + tl.cast(r, tl.int64) * (T * K) * H
    start = item * BLOCK_R
    while start < n:
        u = start + tl.arange(0, BLOCK_R)
        start += items * BLOCK_R
        live = u < n
        _, row = locate(u, lo, count, local)
        at = ring_row(row, s, claim)
        rid = tl.load(ids + at, mask=live, other=0)
        if DEDUP:
            live = live & (rid >= 0)  # no row at this place (its token returned elsewhere)
        rank, t, k = decode(rid, rid_c, rid_r, rid_t, rid_k)
        ok = owned_by(rank, rid, live, r, ctl, entry, epoch, s)
        frm = ring + tl.cast(at, tl.int64) * H
        to = mine + (t * K + k) * H
        if BACKWARD and BWD_FP8:  # dequantised, already rounded to the layer's dtype (exact in it)
            for h in range(0, H, BLOCK_H):
                c = h + tl.arange(0, BLOCK_H)
                m = ok[:, None] & (c < H)[None, :]
                tl.store(
                    to[:, None] + c[None, :], returned_grad(me, frm[:, None], at, c, m, CAST_F32).to(DTYPE), mask=m
                )
        else:
            for h in range(0, H, MOVE_H):
                c = h + tl.arange(0, MOVE_H)
                m = ok[:, None] & (c < H)[None, :]
                tl.store(to[:, None] + c[None, :], tl.load(frm[:, None] + c[None, :], mask=m), mask=m)
    return n
