"""Templates of the expert GEMM task kinds — ``gemm1`` (x·[Wg Wu] or x·Wu, the activation
fused) and ``gemm2`` (h·Wd) — and ``m_tile``, which binds an m-tile slot to its expert's
rows at run time. The GEMM main loop itself does not depend on the spec: it is
``device/gemm.py``, included verbatim (``device.include``).
"""

from __future__ import annotations

from rdepc.codegen.text import call, narrowed

from rdepc.ir.contract import KernelContract


def m_tile_source() -> str:
    return '''@triton.jit
def m_tile(group, q, s, j, BM: tl.constexpr):
    """Bind m-tile slot j of owner q's segment s at run time to (local expert, first row,
    live rows [lo, hi) of the tile).

    Tiles go expert by expert, each at rows first + i*BM of its local expert's rows, in
    every strategy: a row has the same place in its tile whether the rows are cut into
    segments or not, which keeps results bitwise identical across schedules (a GEMM's
    result for a row may depend on its place in the tile). A tile that a segment boundary
    cuts runs in both segments, each with its own rows live. Only tiles at an expert's end
    or at a segment boundary are partial: padding-free (no padding to the tallest group).
    A slot beyond the routing's tiles gets no live rows. At most ceil(min(R_q, S) / BM) +
    2 E_loc - 1 slots can have live rows (bulk: ceil(R_q / BM) + E_loc - 1), which is how
    many the plan gives each segment of owner q.
    """
    local = tl.arange(0, EL_PAD)
    grp = group + tl.cast(q, tl.int64) * (E_MAX * 2) + local * 2
    first = tl.load(grp, mask=local < E_MAX, other=0)
    lo, rows = clip(first, tl.load(grp + 1, mask=local < E_MAX, other=0), s)
    aligned = first + (lo - first) // BM * BM
    tiles = tl.where(rows > 0, (lo + rows - aligned + BM - 1) // BM, 0)
    ends = tl.cumsum(tiles, axis=0)
    which = tl.sum((ends <= j).to(tl.int32), axis=0)
    hit = local == which
    row0 = tl.sum(tl.where(hit, aligned, 0), axis=0) + (j - tl.sum(tl.where(hit, ends - tiles, 0), axis=0)) * BM
    begin = tl.sum(tl.where(hit, lo, 0), axis=0)
    end = begin + tl.sum(tl.where(hit, rows, 0), axis=0)
    return which, row0, tl.maximum(begin - row0, 0), tl.minimum(end - row0, BM)
'''


def gemm1_source(p: KernelContract) -> str:
    if p.gated:
        weights, width, cols = "w_gate_up", "2 * BLOCK_F", "2 * F"
        what = "silu(x Wg) * (x Wu)"
        act = """        gate, up = gate_up(acc, BM, BLOCK_F)
        act = gate * tl.sigmoid(gate) * up  # SwiGLU
"""
        doc = """one [BM, 2 * BLOCK_F] tile of x [Wg Wu], whose columns interleave gate and up (the
    weights' layout: [E, H, F, 2]), with the activation fused"""
    else:
        weights, width, cols = "w_up", "BLOCK_F", "F"
        what = f"{p.act}(x Wu)"
        act = {
            "gelu": "        act = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))  # exact GELU\n",
            "relu": "        act = tl.maximum(acc, 0.0)  # ReLU\n",
        }[p.act]
        doc = "one [BM, BLOCK_F] tile of x Wu, with the activation fused"
    save = {"@@COLS@@": cols, "@@COL0@@": "2 * f" if p.gated else "f", "@@WIDTH@@": width}
    tile_args = ", ".join(("rows", "B * S", "at", "w", cols, "2 * f" if p.gated else "f", "H", "BM", width))
    text = f'''@triton.jit
def gemm1(
    heap,
    {weights},
    weight_of,
    group,
    hbuf,
    hbuf_rid,
    stats,
    saved_x,
    saved_pre,
    q,
    s,
    item,
    BM: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    CAST_F32: tl.constexpr,
    SAVE: tl.constexpr,
):
    """Owner q, segment s, work item ``item``: F-block ``item % f_blocks`` of m-tile slot
    ``item // f_blocks`` of GEMM1 over the segment's pooled, expert-contiguous rows in payload
    slot s % B,
        h = {what},
    {doc},
    into the owner's private workspace ``hbuf``. F-block 0 also copies the rows' row_ids
    beside them: dispatch may refill the payload slot before GEMM2 has run. With ``SAVE``
    (a forward that backward will walk) the pre-activations and, from F-block 0, the input
    rows are kept at the rows' places among the owner's rows, for the backward.
    """
    f_blocks = (F + BLOCK_F - 1) // BLOCK_F
    j = item // f_blocks
    f = item % f_blocks * BLOCK_F
    local, row0, lo, hi = m_tile(group, q, s, j, BM)
    if hi > lo:
        e = tl.cast(tl.load(weight_of + q * E_MAX + local), tl.int64)
        at = ring_row(row0, s, s)  # the tile's first row in the owner's payload ring
        me = peer(heap, q)
        rows = (me + PAYLOAD).to(tl.pointer_type(DISPATCH_DTYPE))
@@SCALES@@        w = {weights} + e * (H * {cols})
        m = tl.arange(0, BM)
        live = (m >= lo) & (m < hi)
@@LINKS@@@@GEMM@@{act}        row = tl.cast(q, tl.int64) * (B * S) + at + m
        store_rows(hbuf + row * F, @@ACT@@, live, F, f, BLOCK_F)
        if SAVE:
            kept = tl.cast(q, tl.int64) * R_MAX + row0 + m
            store_rows(saved_pre + kept * @@COLS@@, @@PRE@@, live, @@COLS@@, @@COL0@@, @@WIDTH@@)
            if f == 0:
                first = tl.cast(q, tl.int64) * R_MAX + row0
@@COPY@@        if f == 0:
            rid = tl.load((me + SB_ROW_ID).to(tl.pointer_type(tl.int64)) + at + m, mask=live, other=0)
            tl.store(hbuf_rid + row, rid, mask=live)
            tl.atomic_add(stats + tl.cast(q, tl.int64) * ST_COLS + ST_MTILES, 1)  # the padding-free counter
'''
    gemm = [*tile_args.split(", "), "BLOCK_K", "STAGES", "TMA", "CAST_F32", "PRECISION"]
    copy = ["rows", "first_row" if p.dedup else "at + m", "saved_x + first * H", "live", "H", "BM", "BLOCK_K"]
    fp8 = {"@@SCALES@@": ""}
    if p.scale_cols:  # fp8 rows: their scales are in the sideband beside them
        gemm += ["False", "scales", "SCALE_COLS"]
        copy += ["scales", "SCALE_COLS"]
        fp8 = {"@@SCALES@@": "        scales = (me + SB_SCALE).to(tl.pointer_type(tl.float32))  # fp8: [B*S, SCALES]\n"}
    links = ""
    if p.dedup:  # each slot reads the payload row of its token's first slot here (codegen/dedup.py)
        links = """        link = (me + SB_LINKS).to(tl.pointer_type(tl.int32))
        first_row = tl.load(link + 2 * (at + m), mask=live, other=-1)  # dedup: the token's first slot here
"""
        gemm.append("a_index=first_row")
    fp8 |= {"@@GEMM@@": call("acc = gemm_tile", gemm, 8), "@@COPY@@": call("copy_rows", copy, 16), "@@LINKS@@": links}
    subst = {**save, **fp8, "@@ACT@@": narrowed(p, "act", "DTYPE"), "@@PRE@@": narrowed(p, "acc", "DTYPE")}
    for k, v in subst.items():
        text = text.replace(k, v)
    return text


def gemm2_source(p: KernelContract) -> str:
    cols = "2 * F" if p.gated else "F"
    grad = f"rows, R_MAX, row0, w, H, h, {cols}, BM, BLOCK_H, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION, True"
    if p.gated:  # as ruff formats a call that does not fit one line
        grad = f"\n                {grad}\n            "
    text = f'''@triton.jit
def gemm2(
    rows,
    hbuf_rid,
    w,
    weight_of,
    group,
    staging,
    staging_rid,
@@SAVED_ARG@@    q,
    s,
    item,
    BM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    CAST_F32: tl.constexpr,
    BACKWARD: tl.constexpr,
@@SAVE_ARG@@):
    """Owner q, segment s, work item ``item``: H-block ``item % h_blocks`` of m-tile slot
    ``item // h_blocks`` of GEMM2, out = h Wd (``rows`` the workspace ring GEMM1 wrote,
    ``w`` = Wd), one [BM, BLOCK_H] tile into the owner's ``staging`` ring (the memory
    plan's private staging); H-block 0 copies the rows' row_ids beside them, for the
    return. The backward's: dX = dH {"[Wg Wu]" if p.gated else "Wu"}ᵀ, ``rows`` the dH its GEMM1 wrote at the
    rows' places among the owner's rows, ``w`` GEMM1's weights, read transposed.@@SAVE_DOC@@
    """
    h_blocks = (H + BLOCK_H - 1) // BLOCK_H
    j = item // h_blocks
    h = item % h_blocks * BLOCK_H
    local, row0, lo, hi = m_tile(group, q, s, j, BM)
    if hi > lo:
        e = tl.cast(tl.load(weight_of + q * E_MAX + local), tl.int64)
        at = ring_row(row0, s, s)
        base = tl.cast(q, tl.int64) * (B * S)
        if BACKWARD:
            rows += tl.cast(q, tl.int64) * R_MAX * {cols}
            w += e * (H * {cols})
            acc = gemm_tile(@@GRAD@@)
        else:
            rows += base * F
            w += e * (F * H)
            acc = gemm_tile(rows, B * S, at, w, H, h, F, BM, BLOCK_H, BLOCK_K, STAGES, TMA, CAST_F32, PRECISION)
        m = tl.arange(0, BM)
        live = (m >= lo) & (m < hi)
        row = base + at + m
@@STORE@@        if h == 0:
            tl.store(staging_rid + row, tl.load(hbuf_rid + row, mask=live, other=0), mask=live)
'''
    store = "        store_rows(staging + row * H, @@OUT@@, live, H, h, BLOCK_H)\n"
    sub = {"@@SAVED_ARG@@": "", "@@SAVE_ARG@@": "", "@@SAVE_DOC@@": ""}
    if p.dedup:  # the outputs leave summed per (token, owner): the owner keeps each row's for dL/dg'
        store = """        out = @@OUT@@
        store_rows(staging + row * H, out, live, H, h, BLOCK_H)
        if SAVE:
            store_rows(saved_out + (tl.cast(q, tl.int64) * R_MAX + row0 + m) * H, out, live, H, h, BLOCK_H)
"""
        sub = {
            "@@SAVED_ARG@@": "    saved_out,\n",
            "@@SAVE_ARG@@": "    SAVE: tl.constexpr,\n",
            "@@SAVE_DOC@@": """ With ``SAVE`` (dedup: a
    row's output leaves summed with its token's other slots here) the owner keeps the
    outputs at the rows' places among its rows, for the gate gradient.""",
        }
    for k, v in (sub | {"@@STORE@@": store, "@@OUT@@": narrowed(p, "acc", "DTYPE"), "@@GRAD@@": grad}).items():
        text = text.replace(k, v)
    return text
