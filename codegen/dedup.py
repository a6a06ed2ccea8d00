"""Templates of ``dedup`` (X-MoE's redundancy-bypassing dispatch): one payload row per
(token, owner) instead of one per slot, out and back.

A token's accepted slots at owner q sit at rows of q that ascend with their local expert
(payload is expert-contiguous). The first of them carries the token's payload row (and its
fp8 scales); every slot still carries its own sideband — row_id, local expert, gate — and
the ``links`` field: the rows of the token's first and next slot at q (-1 after the last).
So which slots one payload row carries is in the sideband, and the row identity stays
lossless. The owner's GEMM1 reads each slot's input through its first link; its return sends
one row per (token, owner): at the token's last slot there, the sum over its slots of
gate · expert output in link order (ascending local expert), with the raw gates, to the
place of the token's first slot. The front-end's combine adds the rows of every first slot
and applies what only it knows, the capacity weights' per-token factor (renormalize:
Σ_j g_j / Σ_{j accepted} g_j). Every segment stays resident (``passes.graph``), so a link
may point into any earlier segment.
"""

from __future__ import annotations

from rdepc.codegen.text import narrowed

from rdepc.ir.contract import KernelContract

LINKS = '''@triton.jit
def links(heap, topk_ids, owner_of, local_of, rowpos, r, t, row, q, live, n_tokens):
    """dedup, front-end r: for route rows of its tokens ``t`` that sit at rows ``row`` of
    owner q, the rows at q of the token's first accepted slot there and of its next one
    after ``row`` (-1: none), from what q published back (offsets, admitted counts)."""
    kk = tl.arange(0, K_PAD)
    i = t[:, None] * K + kk[None, :]
    m = live[:, None] & (kk < K)[None, :]
    e = tl.load(topk_ids + tl.cast(r, tl.int64) * n_tokens * K + i, mask=m, other=-1)
    m = m & (e >= 0) & (e < E)
    to = tl.load(owner_of + e, mask=m, other=-1)
    at = to * E_MAX + tl.load(local_of + e, mask=m, other=0)
    p = tl.load(rowpos + tl.cast(r, tl.int64) * (T * K) + i, mask=m, other=0)
    me = peer(heap, r)
    m = m & (to == q) & (p < tl.load((me + ADMITTED).to(tl.pointer_type(tl.int32)) + at, mask=m, other=0))
    rows = tl.load((me + OFFSETS).to(tl.pointer_type(tl.int32)) + at, mask=m, other=0) + p
    first = tl.min(tl.where(m, rows, 2147483647), axis=1)
    later = tl.min(tl.where(m & (rows > row[:, None]), rows, 2147483647), axis=1)
    return first, tl.where(later == 2147483647, -1, later)
'''


def dispatch_links() -> str:
    """The dispatch's dedup step: each row's links, into the pass's sideband, and which rows
    send payload."""
    return """        first, later = links(heap, topk_ids, owner_of, local_of, rowpos, r, t, row, q, keep, n_tokens)
        lead = keep & (first == row)  # the token's first slot at q carries its payload row
        if BACKWARD:
            link = (dst + BWD_SB_LINKS).to(tl.pointer_type(tl.int32)) + 2 * at
        else:
            link = (dst + SB_LINKS).to(tl.pointer_type(tl.int32)) + 2 * at
        put(link, first, keep)
        put(link + 1, later, keep)
"""


def dispatch_backward() -> str:
    """The backward dispatch under dedup: dL/dy once per (token, owner), as it is, and each
    slot's g' beside it (the owner scales; ``bgemm1``)."""
    return """            put((dst + BWD_SB_GATE).to(tl.pointer_type(tl.float32)) + at, scale, keep)
            for h in range(0, H, BLOCK_H):
                c = h + tl.arange(0, BLOCK_H)
                m = lead[:, None] & (c < H)[None, :]
                put(to[:, None] + c[None, :], tl.load(src[:, None] + c[None, :], mask=m), m)
"""


def return_parts(p: KernelContract) -> dict[str, str]:
    """The return under dedup (``stages.return_source``'s frame): one summed row per (token,
    owner), from the token's last slot."""
    if p.ring:
        land = """        at = ring_row(row, s, claim)  # the claim's slot of r's return ring
        to = landing + tl.cast(at, tl.int64) * H
        put(ids + at, tl.where(ok, rid, -1), live)  # -1: no row here (the token returns from elsewhere)
"""
        where = "into the slot of r's return ring this piece claimed (claim % B),\n"
        where += "    with the row_id of the token's first slot"
    else:
        land = """        to = landing + (t * K + k) * H
"""
        where = "to the (token, slot) place of the token's first slot,\n    by its decoded row_id"
    doc = f"""Owner q → front-end r, segment s, dedup: for every token of r whose last slot at q is
    in the segment, sum_k g_k · out_k over its slots here (link order, raw gates, fp32), one
    row in the layer's dtype, {where} (appendix A.3, condition 3).

    The rows are found by the owner's saved split table, cut to the segment; the token's
    other slots are reached through the sideband's links (every segment is resident). A
    row_id that decodes to another rank is reported, not written. The backward returns
    dL/dx the same way, the slots' rows summed as they are (g' scaled dO), and each slot's
    dL/dg' = dL/dy · out_k, with the output the forward kept here (``saved_out``), one
    fp32 to its own (token, slot) place in r's BWD_DGATE."""
    return {
        "@@CAST@@": "    CAST_F32: tl.constexpr,\n",
        "@@SAVED@@": "    saved_out,\n",
        "@@DOC@@": doc,
        "@@POINTERS@@": """    me = peer(heap, q)
    if BACKWARD:
        link = (me + BWD_SB_LINKS).to(tl.pointer_type(tl.int32))
        dy = (me + BWD_PAYLOAD).to(tl.pointer_type(DTYPE))  # one row per (token, owner), at its first slot
        dgate = (peer(heap, r) + BWD_DGATE).to(tl.pointer_type(tl.float32))
        kept = saved_out + tl.cast(q, tl.int64) * R_MAX * H
        hops = tl.arange(0, K_PAD)
    else:
        link = (me + SB_LINKS).to(tl.pointer_type(tl.int32))
        gate = (me + SB_GATE).to(tl.pointer_type(tl.float32))
""",
        "@@FIND@@": """        at = ring_row(row, s, s)
        last = live & (tl.load(link + 2 * at + 1, mask=live, other=0) < 0)
        first = tl.load(link + 2 * at, mask=last, other=0)
        rid = tl.load(row_ids + first, mask=last, other=0)
""",
        "@@SENDS@@": "last",
        "@@LAND@@": land,
        "@@COPY@@": f"""        if BACKWARD:
            dg = tl.zeros([BLOCK_R, K_PAD], tl.float32)  # dL/dg' of the token's slots here, hop by hop
        for h in range(0, H, BLOCK_H):
            c = h + tl.arange(0, BLOCK_H)
            m = ok[:, None] & (c < H)[None, :]
            acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
            if BACKWARD:
                d = tl.load(dy + tl.cast(first, tl.int64)[:, None] * H + c[None, :], mask=m, other=0.0).to(tl.float32)
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
            put(to[:, None] + c[None, :], {narrowed(p, "acc", "DTYPE")}, m)
        if BACKWARD:  # each slot's dL/dg' to its own (token, slot) place at r
            k_row = tl.where(ok, first, -1)
            for hop in range(K):
                on = k_row >= 0
                _rank, t_k, k_k = decode(tl.load(row_ids + k_row, mask=on, other=0), rid_c, rid_r, rid_t, rid_k)
                put(dgate + t_k * K + k_k, tl.sum(tl.where(hops[None, :] == hop, dg, 0.0), axis=1), on)
                k_row = tl.where(on, tl.load(link + 2 * k_row + 1, mask=on, other=-1), -1)
""",
    }


def combine_leads(q: str, row: str) -> str:
    """The combine's dedup step (forward and backward): which accepted slots ``ok`` are their
    token's first at their owner ``q`` by their row there (the ones whose place holds a
    returned row)."""
    return f"""    # dedup: a slot is its token's first at its owner when no accepted slot there has a lower row
    q = {q}
    row = {row}
    twin = ok[:, :, None] & ok[:, None, :] & (q[:, :, None] == q[:, None, :]) & (row[:, None, :] < row[:, :, None])
    lead = ok & (tl.max(twin.to(tl.int32), axis=2) == 0)
"""


LEAD_ROWS = """        acc = tl.zeros([COMBINE_TOKENS, BLOCK_H], tl.float32)
        for kk in range(K):  # one row per (token, owner), at the token's first slot there, in slot order
            lead_k = tl.max(tl.where(k[None, :] == kk, lead.to(tl.int32), 0), axis=1) != 0
            m = lead_k[:, None] & (c < H)[None, :]
            acc += tl.load(landing + (t[:, None] * K + kk) * H + c[None, :], mask=m, other=0.0).to(tl.float32)
"""


def combine_sum(p: KernelContract) -> str:
    """The combine's sum under dedup: the rows of the tokens' first slots, then the
    per-token factor of the capacity weights (each row is sum_{k at q} g_k out_k)."""
    factor = "acc * scale[:, None]" if p.weights == "renormalize" else "acc"
    return f"""    y_rows = y + (tl.cast(r, tl.int64) * n_tokens + t) * H
    real = t < n_tokens
    for h in range(0, H, BLOCK_H):
        c = h + tl.arange(0, BLOCK_H)
{LEAD_ROWS}        keep = real[:, None] & (c < H)[None, :]
        tl.store(y_rows[:, None] + c[None, :], {narrowed(p, factor, "DTYPE")}, mask=keep)
"""
