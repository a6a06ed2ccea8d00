"""The combine (RDEP section 3.4): a front-end's tokens, one tile at a time, sum their
accepted slots' returned rows in fixed slot order — no float atomics, so the result is
bitwise deterministic — and the backward's counterpart, dL/dx and dL/dg'."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import narrow
from rdepc.codegen.device.heap import peer
from rdepc.codegen.device.layout import (
    ADMITTED,
    BWD_DGATE,
    COMBINE_COLS,
    COMBINE_TOKENS,
    DEDUP,
    DTYPE,
    E_MAX,
    GATE_INPUT,
    K_PAD,
    OFFSETS,
    RENORMALIZE,
    RING,
    E,
    H,
    K,
    T,
)
from rdepc.codegen.device.returns import returned_grad, returned_rows


@triton.jit
def leads(ok, q, row):
    """DEDUP: which accepted slots ``ok`` are their token's first at their owner ``q`` by
    their row ``row`` there (the ones whose place holds a returned row): no accepted slot
    of the token at the same owner has a lower row."""
    twin = ok[:, :, None] & ok[:, None, :] & (q[:, :, None] == q[:, None, :]) & (row[:, None, :] < row[:, :, None])
    return ok & (tl.max(twin.to(tl.int32), axis=2) == 0)


@triton.jit
def lead_rows(firsts, lead, k, c, BLOCK_H: tl.constexpr):
    """DEDUP: the sum of the rows returned per (token, owner), at each token's first slot
    there (``lead``), in slot order, columns ``c``; ``firsts``: each token's first slot's
    row (``slot_rows``)."""
    acc = tl.zeros([COMBINE_TOKENS, BLOCK_H], tl.float32)
    # one row per (token, owner), at the token's first slot there, in slot order; unrolled, so
    # that every slot's rows are loaded before the sum waits for them (as combine's)
    for kk in tl.static_range(K):
        lead_k = tl.max(tl.where(k[None, :] == kk, lead.to(tl.int32), 0), axis=1) != 0
        m = lead_k[:, None] & (c < H)[None, :]
        acc += tl.load(firsts + kk * H + c[None, :], mask=m, other=0.0).to(tl.float32)
    return acc


@triton.jit
def slot_rows(rows, t):
    """Where tokens ``t``'s first slot's row starts in ``rows`` (a row per (token, slot)): a
    slot's is kk·H elements on, a constant its loads and stores carry as an offset. Indexed
    per slot instead, each slot's rows took an address of their own (deepseek_v3's combine,
    H = 7168: 68 spill loads a step)."""
    return rows + tl.cast(t, tl.int64)[:, None] * (K * H)


@triton.jit
def combine(
    heap,
    landing,
    topk_ids,
    gates,
    y,
    accepted,
    slot,
    gprime,
    owner_of,
    local_of,
    rowpos,
    saved_out,
    r,
    tile,
    n_tokens,
    CAST_F32: tl.constexpr,
    SAVE: tl.constexpr,
):
    """Front-end r, one tile of tokens: y_t = sum_k g'_tk out_tk, the slots in fixed order.

    A slot is accepted iff its position in its (source, expert) run is below the count its
    owner admitted and published back. The routing context backward will need (accepted
    set, payload slot at the owner, g') is written beside y; with ``SAVE`` also each
    accepted slot's expert output, for the gate gradient. The returned rows are in r's
    return region, or (RING) in ``landing``, where unpack placed them. Capacity weights:
    g' = g on accepted slots and 0 elsewhere, or (RENORMALIZE) g · sum_j g_j / sum_{j
    accepted} g_j.

    DEDUP: the returned rows are per (token, owner), at the token's first slot there, each
    sum_{k at q} g_k out_k; the combine adds them and applies the per-token factor, and the
    owners keep the expert outputs for the gate gradient (gemm2).

    GATE_INPUT: the experts read g'·x (the dispatch scaled it), so y_t = sum_k out_tk over
    the accepted slots, unweighted; g' is still written for the backward, and no output is
    kept (the gate gradient reads x).
    """
    t = tile * COMBINE_TOKENS + tl.arange(0, COMBINE_TOKENS)
    k = tl.arange(0, K_PAD)
    live = (t < n_tokens)[:, None] & (k < K)[None, :]
    i = t[:, None] * K + k[None, :]
    base = tl.cast(r, tl.int64) * n_tokens * K
    e = tl.load(topk_ids + base + i, mask=live, other=0)
    live = live & (e >= 0) & (e < E)  # an id out of range was never routed (validate reports it)
    at = tl.load(owner_of + e, mask=live, other=0) * E_MAX + tl.load(local_of + e, mask=live, other=0)
    p = tl.load(rowpos + tl.cast(r, tl.int64) * (T * K) + i, mask=live, other=0)
    me = peer(heap, r)
    admitted = tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32)) + at, mask=live, other=0)
    offset = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32)) + at, mask=live, other=0)
    ok = live & (p < admitted)
    g = tl.load(gates + base + i, mask=live, other=0.0)
    kept = tl.where(ok, g, 0.0)
    if RENORMALIZE:
        # g' = g * sum_j g_j / sum_{j accepted} g_j on accepted slots, 0 elsewhere; 0 if none survived.
        total = tl.sum(g, axis=1)
        survived = tl.sum(kept, axis=1)
        scale = tl.where(survived != 0, total / tl.where(survived != 0, survived, 1.0), 0.0)
        w = kept * scale[:, None]
    else:
        w = kept  # weights zero: accepted slots keep g, dropped ones get 0
    real = (t < n_tokens)[:, None] & (k < K)[None, :]
    tl.store(accepted + base + i, ok.to(tl.int8), mask=real)
    tl.store(slot + base + i, tl.where(ok, offset + p, -1), mask=real)
    tl.store(gprime + base + i, w, mask=real)
    if RING:
        landing = landing + tl.cast(r, tl.int64) * (T * K) * H  # unpacked from the return ring
    else:
        landing = returned_rows(me, False)
    firsts = slot_rows(landing, t)
    y_rows = y + (tl.cast(r, tl.int64) * n_tokens + t) * H
    real = t < n_tokens
    if DEDUP:
        lead = leads(ok, at // E_MAX, offset + p)
        for h in range(0, H, COMBINE_COLS):
            c = h + tl.arange(0, COMBINE_COLS)
            acc = lead_rows(firsts, lead, k, c, COMBINE_COLS)
            if RENORMALIZE:
                acc = acc * scale[:, None]
            tl.store(y_rows[:, None] + c[None, :], narrow(acc, DTYPE, CAST_F32), mask=real[:, None] & (c < H)[None, :])
    else:
        tl.debug_barrier()  # the loop below reads g' and the accepted set back, slot by slot
        kept_rows = slot_rows(saved_out + base * H, t)
        # COMBINE_COLS columns at a time, the slots unrolled: all K slots' rows are loaded
        # before one is summed or kept (a loop over the slots keeps one slot's rows in flight,
        # and the step is latency-bound; so does a store of each slot's rows before the next
        # slot's load, which may alias it); the sum keeps its slot order
        for h in range(0, H, COMBINE_COLS):
            c = h + tl.arange(0, COMBINE_COLS)
            masks = ()
            outs = ()
            for kk in tl.static_range(K):
                ok_k = tl.load(accepted + base + t * K + kk, mask=real, other=0) != 0
                m = ok_k[:, None] & (c < H)[None, :]
                out = tl.load(firsts + kk * H + c[None, :], mask=m, other=0.0)
                masks = masks + (m,)  # noqa: RUF005 - Triton compiles no starred tuple
                outs = outs + (out,)  # noqa: RUF005
            acc = tl.zeros([COMBINE_TOKENS, COMBINE_COLS], tl.float32)
            for kk in tl.static_range(K):
                if GATE_INPUT:
                    acc += outs[kk].to(tl.float32)
                else:
                    wk = tl.load(gprime + base + t * K + kk, mask=real, other=0.0)
                    acc += wk[:, None] * outs[kk].to(tl.float32)
                    if SAVE:
                        tl.store(kept_rows + kk * H + c[None, :], outs[kk], mask=masks[kk])
            tl.store(y_rows[:, None] + c[None, :], narrow(acc, DTYPE, CAST_F32), mask=real[:, None] & (c < H)[None, :])


@triton.jit
def combine_grad(
    heap,
    landing,
    x,
    dy,
    dx,
    accepted,
    saved_out,
    topk_ids,
    owner_of,
    slot,
    gprime,
    dgprime,
    r,
    tile,
    n_tokens,
    CAST_F32: tl.constexpr,
):
    """Backward, front-end r, one tile of tokens: dL/dx_t = sum_k dL/dx_tk over its accepted
    slots, in fixed slot order (no float atomics), and each slot's gate gradient
    dL/dg'_tk = dL/dy_t · out_tk (0 for a dropped slot). The accepted set is the forward's.

    DEDUP: one dL/dx row came back per (token, owner), at the token's first slot there, the
    slots' rows summed by the owner; the owners also computed dL/dg' (BWD_DGATE), from the
    outputs they kept.

    GATE_INPUT: a slot's row came back as dL/d(g'x), the gradient of the expert's input:
    dL/dx_t = sum_k g'_tk dL/d(g'x)_tk and dL/dg'_tk = x_t · dL/d(g'x)_tk, with ``x`` the
    forward's input.
    """
    t = tile * COMBINE_TOKENS + tl.arange(0, COMBINE_TOKENS)
    k = tl.arange(0, K_PAD)
    real = t < n_tokens
    base = tl.cast(r, tl.int64) * n_tokens * K
    if RING:
        landing = landing + tl.cast(r, tl.int64) * (T * K) * H  # unpacked from the return ring
    else:
        landing = returned_rows(peer(heap, r), True)
    firsts = slot_rows(landing, t)
    rows = (tl.cast(r, tl.int64) * n_tokens + t) * H
    if DEDUP:
        i = t[:, None] * K + k[None, :]
        ok = tl.load(accepted + base + i, mask=real[:, None] & (k < K)[None, :], other=0) != 0
        e = tl.load(topk_ids + base + i, mask=ok, other=0)
        lead = leads(ok, tl.load(owner_of + e, mask=ok, other=0), tl.load(slot + base + i, mask=ok, other=0))
        dg = tl.load((peer(heap, r) + BWD_DGATE).to(tl.pointer_type(tl.float32)) + i, mask=ok, other=0.0)
        for h in range(0, H, COMBINE_COLS):
            c = h + tl.arange(0, COMBINE_COLS)
            acc = lead_rows(firsts, lead, k, c, COMBINE_COLS)
            tl.store(
                dx + rows[:, None] + c[None, :], narrow(acc, DTYPE, CAST_F32), mask=real[:, None] & (c < H)[None, :]
            )
    else:
        # as combine's: COMBINE_COLS columns at a time, the slots unrolled, so every slot's
        # rows are in flight before the sums wait for them (wider columns spill)
        dg = tl.zeros([COMBINE_TOKENS, K_PAD], tl.float32)
        kept_rows = slot_rows(saved_out + base * H, t)
        for h in range(0, H, COMBINE_COLS):
            c = h + tl.arange(0, COMBINE_COLS)
            keep = real[:, None] & (c < H)[None, :]
            if GATE_INPUT:  # the gate gradient reads the forward's input
                d = tl.load(x + rows[:, None] + c[None, :], mask=keep, other=0.0).to(tl.float32)
            else:
                d = tl.load(dy + rows[:, None] + c[None, :], mask=keep, other=0.0).to(tl.float32)
            acc = tl.zeros([COMBINE_TOKENS, COMBINE_COLS], tl.float32)
            for kk in tl.static_range(K):
                ok_k = tl.load(accepted + base + t * K + kk, mask=real, other=0) != 0
                m = ok_k[:, None] & (c < H)[None, :]
                if RING:  # unpacked into the layer's dtype
                    back = tl.load(firsts + kk * H + c[None, :], mask=m, other=0.0).to(tl.float32)
                else:  # BWD_FP8: with their scales
                    back = returned_grad(peer(heap, r), firsts + kk * H, t * K + kk, c, m, CAST_F32)
                if GATE_INPUT:  # back: dL/d(g'x); the token's row times g', and x · it
                    wk = tl.load(gprime + base + t * K + kk, mask=real, other=0.0)
                    acc += wk[:, None] * back
                    dg += tl.where(k[None, :] == kk, tl.sum(d * back, axis=1)[:, None], 0.0)
                else:  # back: dL/dx of the slot; dL/dg' = dL/dy · the output kept
                    acc += back
                    out = tl.load(kept_rows + kk * H + c[None, :], mask=m, other=0.0)
                    dg += tl.where(k[None, :] == kk, tl.sum(d * out.to(tl.float32), axis=1)[:, None], 0.0)
            tl.store(dx + rows[:, None] + c[None, :], narrow(acc, DTYPE, CAST_F32), mask=keep)
    tl.store(dgprime + base + t[:, None] * K + k[None, :], dg, mask=real[:, None] & (k < K)[None, :])
