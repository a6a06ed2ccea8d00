"""Templates of the backward's task kinds, as the emitter writes them into a generated kernel
file beside the forward's (``emit.generate``): the backward walks the forward's task table
over the forward's routing, and only these kinds compute something new —

  bgemm1        (the backward's gemm1 entries) dA = dO·Wdᵀ and the activation's backward
  combine_grad  (its combine tiles) dL/dx per token, dL/dg' per slot
  wgrad         each owner's weight gradients, once its dH rows are all written

Its dispatch, return and unpack are the forward's (``stages.py``), over the backward's
heap regions, and so is its gemm2 (``compute.py``: dX = dH·[Wg Wu]ᵀ, the weights read
transposed).
"""

from __future__ import annotations

from rdepc.codegen import dedup
from rdepc.codegen.text import call, narrowed

from rdepc.ir.contract import KernelContract

OWNER = "tl.load(owner_of + e, mask=ok, other=0)"  # dedup: a slot's owner and its row there
SLOT_ROW = "tl.load(slot + base + i, mask=ok, other=0)"


def combine_grad_source(p: KernelContract) -> str:
    landing = (
        "    landing = landing + tl.cast(r, tl.int64) * (T * K) * H  # unpacked from the return ring\n"
        if p.ring
        else "    landing = return_regions(peer(heap, r), True)\n"
    )
    text = '''@triton.jit
def combine_grad(
    heap,
@@LANDING_ARG@@    dy,
    dx,
    accepted,
@@ARGS@@    dgprime,
    r,
    tile,
    n_tokens,
    BLOCK_H: tl.constexpr,
    CAST_F32: tl.constexpr,
):
    """Backward, front-end r, one tile of tokens: dL/dx_t = sum_k dL/dx_tk over its accepted
    slots, in fixed slot order (no float atomics), and each slot's gate gradient
    dL/dg'_tk = dL/dy_t · out_tk (0 for a dropped slot). The accepted set is the forward's.@@DOC@@
    """
    t = tile * COMBINE_TOKENS + tl.arange(0, COMBINE_TOKENS)
    k = tl.arange(0, K_PAD)
    real = t < n_tokens
    base = tl.cast(r, tl.int64) * n_tokens * K
@@LANDING@@    rows = (tl.cast(r, tl.int64) * n_tokens + t) * H
@@BODY@@    tl.store(dgprime + base + t[:, None] * K + k[None, :], dg, mask=real[:, None] & (k < K)[None, :])
'''
    body = """    dg = tl.zeros([COMBINE_TOKENS, K_PAD], tl.float32)
    for h in range(0, H, BLOCK_H):
        c = h + tl.arange(0, BLOCK_H)
        keep = real[:, None] & (c < H)[None, :]
        d = tl.load(dy + rows[:, None] + c[None, :], mask=keep, other=0.0).to(tl.float32)
        acc = tl.zeros([COMBINE_TOKENS, BLOCK_H], tl.float32)
        for kk in range(K):
            ok_k = tl.load(accepted + base + t * K + kk, mask=real, other=0) != 0
            m = ok_k[:, None] & (c < H)[None, :]
            acc += tl.load(landing + (t[:, None] * K + kk) * H + c[None, :], mask=m, other=0.0).to(tl.float32)
            out = tl.load(saved_out + (base + t[:, None] * K + kk) * H + c[None, :], mask=m, other=0.0)
            dg += tl.where(k[None, :] == kk, tl.sum(d * out.to(tl.float32), axis=1)[:, None], 0.0)
        tl.store(dx + rows[:, None] + c[None, :], @@DX@@, mask=keep)
"""
    sub = {"@@ARGS@@": "    saved_out,\n", "@@DOC@@": ""}
    if p.dedup:
        body = (
            """    i = t[:, None] * K + k[None, :]
    ok = tl.load(accepted + base + i, mask=real[:, None] & (k < K)[None, :], other=0) != 0
    e = tl.load(topk_ids + base + i, mask=ok, other=0)
"""
            + dedup.combine_leads(OWNER, SLOT_ROW)
            + """    dg = tl.load((peer(heap, r) + BWD_DGATE).to(tl.pointer_type(tl.float32)) + i, mask=ok, other=0.0)
    for h in range(0, H, BLOCK_H):
        c = h + tl.arange(0, BLOCK_H)
"""
            + dedup.LEAD_ROWS
            + """        tl.store(dx + rows[:, None] + c[None, :], @@DX@@, mask=real[:, None] & (c < H)[None, :])
"""
        )
        sub = {
            "@@ARGS@@": "    topk_ids,\n    owner_of,\n    slot,\n",
            "@@DOC@@": """

    dedup: one dL/dx row came back per (token, owner), at the token's first slot there, the
    slots' rows summed by the owner; the owners also computed dL/dg' (BWD_DGATE), from the
    outputs they kept.""",
        }
    sub |= {
        "@@BODY@@": body,
        "@@DX@@": narrowed(p, "acc", "DTYPE"),
        "@@LANDING_ARG@@": "    landing,\n" if p.ring else "",
        "@@LANDING@@": landing,
    }
    for key, v in sub.items():
        text = text.replace(key, v)
    return text


def bgemm1_source(p: KernelContract) -> str:
    """Backward of GEMM2 and of the activation: dA = dO·Wdᵀ, then dH from the saved
    pre-activations; also the activation A itself and the dO rows, for the weight gradients."""
    if p.gated:
        cols = "2 * F"
        doc = "dH = [dA ⊙ up ⊙ silu'(gate), dA ⊙ silu(gate)], interleaved as the weights' [E, H, F, 2]"
        grads = """        pre = saved_pre + row[:, None] * (2 * F) + 2 * c[None, :]
        gate = tl.load(pre, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(pre + 1, mask=keep, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        out = dh + row[:, None] * (2 * F) + 2 * c[None, :]
        tl.store(out, @@DGATE@@, mask=keep)
        tl.store(out + 1, @@DUP@@, mask=keep)
        act = silu * up
"""
        sub = {
            "@@DGATE@@": narrowed(p, "da * up * sig * (1.0 + gate * (1.0 - sig))", "DTYPE"),
            "@@DUP@@": narrowed(p, "da * silu", "DTYPE"),
        }
    else:
        cols = "F"
        deriv = {
            "gelu": (
                "0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))",
                "0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476)) + h * 0.3989422804014327 * tl.exp(-0.5 * h * h)",
            ),
            "relu": ("tl.maximum(h, 0.0)", "tl.where(h > 0.0, 1.0, 0.0)"),
        }[p.act]
        doc = f"dH = dA ⊙ {p.act}'(h)"
        grads = f"""        h = tl.load(saved_pre + row[:, None] * F + c[None, :], mask=keep, other=0.0).to(tl.float32)
        act = {deriv[0]}
        slope = {deriv[1]}
        tl.store(dh + row[:, None] * F + c[None, :], @@DH@@, mask=keep)
"""
        sub = {"@@DH@@": narrowed(p, "da * slope", "DTYPE")}
    text = f'''@triton.jit
def bgemm1(
    heap,
    w_down,
    weight_of,
    group,
    saved_pre,
    dh,
    act_rows,
    do_rows,
    hbuf_rid,
    q,
    s,
    item,
    BM: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    CAST_F32: tl.constexpr,
):
    """Backward, owner q, segment s, work item ``item``: F-block ``item % f_blocks`` of
    m-tile slot ``item // f_blocks`` over the g'·dL/dy rows the backward's dispatch placed
    in payload slot s % B (the forward's places): dA = dO Wdᵀ, then
        {doc},
    written at the rows' places among the owner's rows, beside the activation A the
    forward computed (for dWd). F-block 0 also keeps the dO rows (for dWd) and copies the
    rows' row_ids for the return.
    """
    f_blocks = (F + BLOCK_F - 1) // BLOCK_F
    j = item // f_blocks
    f = item % f_blocks * BLOCK_F
    local, row0, lo, hi = m_tile(group, q, s, j, BM)
    if hi > lo:
        e = tl.cast(tl.load(weight_of + q * E_MAX + local), tl.int64)
        at = ring_row(row0, s, s)
        me = peer(heap, q)
        rows = (me + BWD_PAYLOAD).to(tl.pointer_type(DTYPE))
        w = w_down + e * (F * H)
        m = tl.arange(0, BM)
        live = (m >= lo) & (m < hi)
@@DA@@        row = tl.cast(q, tl.int64) * R_MAX + row0 + m  # the owner's rows, as the forward saved them
        c = f + tl.arange(0, BLOCK_F)
        keep = live[:, None] & (c < F)[None, :]
{grads}        store_rows(act_rows + row * F, @@ACT@@, live, F, f, BLOCK_F)
        if f == 0:
            first = tl.cast(q, tl.int64) * R_MAX + row0
@@DO@@            ring = tl.cast(q, tl.int64) * (B * S) + at + m
            rid = tl.load((me + BWD_ROW_IDS).to(tl.pointer_type(tl.int64)) + at + m, mask=live, other=0)
            tl.store(hbuf_rid + ring, rid, mask=live)
'''
    sub |= {"@@ACT@@": narrowed(p, "act", "DTYPE"), "@@DA@@": _da(p), "@@DO@@": _do_rows(p)}
    if p.dedup:
        end = "    rows' row_ids for the return."
        text = text.replace(end + "\n", end + DEDUP_DOC + "\n")
    for k, v in sub.items():
        text = text.replace(k, v)
    return text.replace("@@COLS@@", cols)


DEDUP_DOC = """

    dedup: the payload holds dL/dy once per (token, owner), at the token's first slot. Each
    row reads it through its link and scales by its own g' (the backward's sideband): dA =
    g'·(dL/dy Wdᵀ), and the dO rows it keeps are g'·dL/dy."""


def _da(p: KernelContract) -> str:
    args = "rows, B * S, at, w, F, f, H, BM, BLOCK_F, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION, True"
    if not p.dedup:
        return f"        da = gemm_tile({args})\n"
    return f"""        link = (me + BWD_SB_LINKS).to(tl.pointer_type(tl.int32))
        first_row = tl.load(link + 2 * (at + m), mask=live, other=-1)  # the token's first slot here
        gp = tl.load((me + BWD_SB_GATE).to(tl.pointer_type(tl.float32)) + at + m, mask=live, other=0.0)
{call("da = gemm_tile", [*args.split(", "), "a_index=first_row"], 8)}        da = da * gp[:, None]
"""


def _do_rows(p: KernelContract) -> str:
    if not p.dedup:
        return "            copy_rows(rows, at + m, do_rows + first * H, live, H, BM, BLOCK_K)\n"
    do = narrowed(p, "d.to(tl.float32) * gp[:, None]", "DTYPE")
    return f"""            for c0 in range(0, H, BLOCK_K):  # dO = g'·dL/dy, per row
                cols = c0 + tl.arange(0, BLOCK_K)
                mk = live[:, None] & (cols < H)[None, :]
                d = tl.load(rows + tl.cast(first_row, tl.int64)[:, None] * H + cols[None, :], mask=mk, other=0.0)
                do = {do}
                tl.store(do_rows + (first + m)[:, None] * H + cols[None, :], do, mask=mk)
"""


def wgrad_source(p: KernelContract) -> str:
    """The weight gradients of one owner's experts, summed over each expert's rows."""
    weights, cols, width = ("GEMM1's [Wg Wu]", "2 * F", "2 * BLOCK_F") if p.gated else ("Wu", "F", "BLOCK_F")
    return f'''@triton.jit
def wgrad(
    saved_x,
    dh,
    act_rows,
    do_rows,
    dw_up,
    dw_down,
    weight_of,
    group,
    q,
    item,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr,
):
    """Backward, owner q, work item ``item``: one tile of a local expert's weight gradients,
    the expert's rows summed in chunks of BLOCK_K from its first row — a fixed order in
    every schedule and no float atomics, so the result is deterministic and the same for
    bulk, pipelined and deep. Items run expert by expert: first the
    [BLOCK_H, {width}] tiles of d{weights} = Xᵀ dH, then the [BLOCK_F, BLOCK_H] tiles of
    dWd = Aᵀ dO. An expert that received no rows gets zeros.
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
        c = t % f_blocks * {width}
        xs = saved_x + base * H
        ds = dh + base * {cols}
        d_up = gemm_rows_tn(xs, H, i, ds, {cols}, c, first, n, BLOCK_H, {width}, BLOCK_K, CAST_F32, PRECISION)
        h = i + tl.arange(0, BLOCK_H)
        store_rows(dw_up + e * (H * {cols}) + h * {cols}, @@UP@@, h < H, {cols}, c, {width})
    else:
        j = (t - per) // h_blocks * BLOCK_F
        k = (t - per) % h_blocks * BLOCK_H
        a_rows = act_rows + base * F
        o_rows = do_rows + base * H
        d_down = gemm_rows_tn(a_rows, F, j, o_rows, H, k, first, n, BLOCK_F, BLOCK_H, BLOCK_K, CAST_F32, PRECISION)
        f = j + tl.arange(0, BLOCK_F)
        store_rows(dw_down + e * (F * H) + f * H, @@DOWN@@, f < F, H, k, BLOCK_H)
'''.replace("@@UP@@", narrowed(p, "d_up", "DTYPE")).replace("@@DOWN@@", narrowed(p, "d_down", "DTYPE"))
