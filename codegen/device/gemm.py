"""Device code that does not depend on the spec: the main loop of one grouped-GEMM tile.

Real Triton, linted and unit-tested like any module (``tests/test_device.py``), and
included verbatim in every generated kernel file by the emitter (``device.include``), which
keeps a generated file self-contained. Everything a function needs comes in through its
arguments — no globals of a generated file — so these functions compile alone.

Operands are row-major matrices whose rows are contiguous: the expert-contiguous payload
rows (GEMM1's A), the GEMM1 → GEMM2 workspace (GEMM2's A) and an expert's weights (B). With
``TMA`` they are read through tensor descriptors, which Hopper turns into bulk tensor
copies (TMA) that the ``num_stages`` software pipeline overlaps with ``wgmma``; without
(a row stride that is not a multiple of 16 bytes) through masked pointer loads (not block
pointers, which Triton 3.9 removed). Either way rows and columns outside the matrix read as
zero, so a tile may hang over a matrix's edge — before its first row, too: an m-tile that a
segment boundary cuts starts before its slot.
"""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, CAST_F32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a·b in fp32. ``a`` takes ``b``'s dtype (the payload may travel in another).
    ``CAST_F32`` is set exactly when interpreting: the interpreter computes bf16 on raw bits,
    so both go to fp32 first (and it has no inline assembly, nor memory proxies)."""
    if CAST_F32:
        return tl.dot(row_major(a.to(tl.float32)), row_major(b.to(tl.float32)), acc, input_precision=PRECISION)
    return tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)


@triton.jit
def row_major(x):
    """``x`` itself, in row-major order under the interpreter: there a transposed tile is a
    transposed numpy view, and numpy's matmul (OpenBLAS) may sum a product with such an
    operand in another order than with a row-major one, so a tile read transposed
    (``tl.trans``) and one read in place would differ in their last bits. Through one
    dimension and back, every layout becomes row-major. Interpreter only (``mma``'s
    CAST_F32): compiled, the MMA takes its operands from shared memory in any layout."""
    return tl.reshape(tl.reshape(x, [x.shape[0] * x.shape[1]]), [x.shape[0], x.shape[1]])


@triton.jit
def proxy_fence():
    """Make what this thread may read through ordinary loads — rows other programs or ranks
    stored and released to it — visible to its TMA reads, which go through the async proxy
    (PTX ``fence.proxy.async``); the acquire of a done flag alone orders the generic proxy."""
    tl.inline_asm_elementwise("fence.proxy.async.global;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gemm_tile(
    a,
    a_rows,
    row0,
    w,
    n_cols,
    col0,
    K_DIM: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    TMA: tl.constexpr,
    CAST_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    TRANS_B: tl.constexpr = False,
    a_scale=None,
    SCALE_COLS: tl.constexpr = 0,
    a_index=None,
    w_desc=None,
    w_row=0,
    a_desc=None,
):
    """One [BM, BN] fp32 tile: A[row0 : row0 + BM, :] · B[:, col0 : col0 + BN].

    A is [a_rows, K_DIM] at ``a``, B is [K_DIM, n_cols] at ``w`` (one expert's weights), both
    row-major; with ``TRANS_B``, B is the transpose of the row-major [n_cols, K_DIM] matrix
    at ``w`` (the backward's dL/dy·Wdᵀ and dH·[Wg Wu]ᵀ read the forward's weights as they
    are). The reduction runs over K_DIM in chunks of BK, its loads pipelined ``STAGES``
    deep. Out-of-range rows and columns count as zero.

    With ``SCALE_COLS`` (fp8 rows) A is quantised: its true value is A · its scales, fp32
    [a_rows, ceil(K_DIM / SCALE_COLS)] at ``a_scale``, one per row and SCALE_COLS columns.
    One scale per row (SCALE_COLS >= K_DIM) scales the finished tile; finer scales scale
    each chunk's product before it is added, so BK must divide SCALE_COLS.

    With ``a_index`` (int [BM], -1 for a row that reads as zero) the tile's rows are gathered:
    tile row m is row a_index[m] of A (``row0`` unused), loaded through pointers.

    ``a_desc``: ``rows_descriptor(a, a_rows, K_DIM, BM, BK)`` built once by the program (the
    same descriptor the tile would build), where A is the same matrix for all its tiles.
    """
    if SCALE_COLS > 0 and SCALE_COLS < K_DIM:
        tl.static_assert(SCALE_COLS % BK == 0, "a scale must cover whole reduction chunks")
    # fp8 rows are widened in registers, so the MMA takes A from registers (wgmma "RS").
    # Pipelined, Triton 3.6 keeps 3 of those MMAs in flight while it already rewrites their
    # A registers for the next chunk (the PTX ISA leaves that undefined; on the H100 the
    # fp8 layer's results varied run to run). One stage: a chunk's MMAs finish (wait 0)
    # before the next chunk's A is built.
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    rows = row0 + tl.arange(0, BM)
    if TMA and a_index is None:
        if not CAST_F32:  # natively (see mma)
            proxy_fence()
        if a_desc is not None:
            ad = a_desc
        else:
            ad = rows_descriptor(a, a_rows, K_DIM, BM, BK)
        if w_desc is not None and ((n_cols % BN == 0) if TRANS_B else (K_DIM % BK == 0)):
            # every expert's weights in one descriptor, built once per program: the expert's
            # rows start at w_row, and whole chunks of them end where its rows end (BK divides
            # K_DIM; read transposed, BN divides n_cols), so no read reaches past them
            wd = w_desc
            w0 = w_row.to(tl.int32)
        elif TRANS_B:
            wd = tl.make_tensor_descriptor(w, shape=[n_cols, K_DIM], strides=[K_DIM, 1], block_shape=[BN, BK])
            w0 = 0
        else:
            wd = tl.make_tensor_descriptor(w, shape=[K_DIM, n_cols], strides=[n_cols, 1], block_shape=[BK, BN])
            w0 = 0
        for k in tl.range(0, K_DIM, BK, num_stages=1 if SCALE_COLS > 0 else STAGES):
            if TRANS_B:
                # A's load first: the pipeliner gives consecutive TMA loads one barrier, and
                # the tl.trans between them split them into two (a second wait, arrival and
                # address per iteration)
                x = ad.load([row0, k])
                b = tl.trans(wd.load([w0 + col0, k]))
            else:
                b = wd.load([w0 + k, col0])
                x = ad.load([row0, k])
            acc = mma_chunk(x, b, acc, a_scale, a_rows, rows, k, K_DIM, SCALE_COLS, CAST_F32, PRECISION)
    else:
        if a_index is not None:
            rows = tl.cast(a_index, tl.int64)
        if TRANS_B:  # B[kk, c] is w[c, kk]
            k_stride, col_stride = 1, K_DIM
        else:
            k_stride, col_stride = n_cols, 1
        # 64-bit indices, as a block pointer's were: with 32-bit ones ptxas gave the sm_90
        # dedup kernels more stack.
        cols = tl.cast(col0, tl.int64) + tl.arange(0, BN)
        for k in tl.range(0, K_DIM, BK, num_stages=1 if SCALE_COLS > 0 else STAGES):
            kk = tl.cast(k, tl.int64) + tl.arange(0, BK)
            x = load_tile(a, rows, kk, a_rows, K_DIM, K_DIM, 1)
            y = load_tile(w, kk, cols, K_DIM, n_cols, k_stride, col_stride)
            acc = mma_chunk(x, y, acc, a_scale, a_rows, rows, k, K_DIM, SCALE_COLS, CAST_F32, PRECISION)
    if SCALE_COLS >= K_DIM:
        acc *= row_scales(a_scale, a_rows, rows, 0, K_DIM, SCALE_COLS)[:, None]
    return acc


@triton.jit
def rows_descriptor(a, a_rows, K_DIM: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The tensor descriptor ``gemm_tile`` reads its A [a_rows, K_DIM] (row-major at ``a``)
    through: [BM, BK] blocks, rows past a_rows and columns past K_DIM read as zero."""
    return tl.make_tensor_descriptor(a, shape=[a_rows, K_DIM], strides=[K_DIM, 1], block_shape=[BM, BK])


@triton.jit
def load_tile(ptr, rows, cols, n_rows, n_cols, row_stride, col_stride):
    """The tile ptr[rows[i] * row_stride + cols[j] * col_stride] of an n_rows × n_cols matrix,
    0 where a row or column falls outside it (a row index of -1 included): what a block
    pointer's zero-padded load gave before Triton 3.9 removed them. Offsets are 64-bit:
    rows · row_stride may pass 2^31."""
    r = tl.cast(rows, tl.int64)
    c = tl.cast(cols, tl.int64)
    offsets = r[:, None] * row_stride + c[None, :] * col_stride
    mask = ((r >= 0) & (r < n_rows))[:, None] & ((c >= 0) & (c < n_cols))[None, :]
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def mma_chunk(
    x,
    y,
    acc,
    a_scale,
    a_rows,
    rows,
    k,
    K_DIM: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    CAST_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc + x·y for the reduction chunk at column ``k`` of A (rows ``rows``); with finer fp8
    scales than a row (0 < SCALE_COLS < K_DIM) the chunk's product is scaled by its rows'
    scales before it is added (``gemm_tile``)."""
    if SCALE_COLS > 0 and SCALE_COLS < K_DIM:
        part = mma(x, y, tl.zeros_like(acc), CAST_F32, PRECISION)
        return acc + part * row_scales(a_scale, a_rows, rows, k // SCALE_COLS, K_DIM, SCALE_COLS)[:, None]
    return mma(x, y, acc, CAST_F32, PRECISION)


@triton.jit
def row_scales(scales, n_rows, rows, group, n_cols, SCALE_COLS: tl.constexpr):
    """The scales of column group ``group`` of rows ``rows`` of a quantised matrix of
    ``n_rows`` rows and ``n_cols`` columns (fp32 [n_rows, ceil(n_cols / SCALE_COLS)] at
    ``scales``); rows outside the matrix get 0."""
    live = (rows >= 0) & (rows < n_rows)
    per_row = (n_cols + SCALE_COLS - 1) // SCALE_COLS
    return tl.load(scales + tl.cast(rows, tl.int64) * per_row + group, mask=live, other=0.0)


@triton.jit
def fp8_scale(amax):
    """The fp32 scale that maps a row (block) whose largest magnitude is ``amax`` onto fp8
    e4m3's range [-448, 448]; 1 for an all-zero one."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def to_e4m3(x, scale, CAST_F32: tl.constexpr):
    """fp32 ``x`` / ``scale`` in fp8 e4m3, rounded to nearest even, clamped to +-448. The
    interpreter's conversion does not carry a rounding into the exponent, so under it
    (CAST_F32) the value is first rounded on its bits: normal numbers to e4m3's 3
    mantissa bits, subnormal ones (below 2^-6) to multiples of 2^-9."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    if CAST_F32:
        bits = v.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        mag = tl.abs(v)
        sub = (mag + 24576.0) - 24576.0  # 24576 = 1.5 * 2^14, whose fp32 ulp is 2^-9
        sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)  # keeps -0
        v = tl.where(mag < 0.015625, sub, normal)
    return v.to(tl.float8e4nv)


@triton.jit
def gemm_rows_tn(
    a,
    a_cols,
    col_a,
    b,
    b_cols,
    col_b,
    first,
    n_rows,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    TMA: tl.constexpr,
    CAST_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One [BM, BN] fp32 tile of Aᵀ·B over rows first .. first + n_rows of the row-major
    matrices A [*, a_cols] at ``a`` (its columns col_a .. col_a + BM) and B [*, b_cols] at
    ``b`` (columns col_b .. col_b + BN): a weight gradient, summed over one expert's rows in
    chunks of BK from its first row — a fixed order whatever the schedule, no atomics.

    Compiled, the chunks' loads are software-pipelined ``STAGES`` deep; with ``TMA`` both
    operands are read through tensor descriptors bounded to the expert's rows, so the last
    chunk's rows past them read as zero. The interpreter takes the chunks in a while loop
    (it cannot take a runtime bound in a range) through masked pointer loads: the same
    chunks in the same order."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    ca = col_a + tl.arange(0, BM)
    cb = col_b + tl.arange(0, BN)
    start = tl.cast(first, tl.int64)
    if CAST_F32:
        r0 = 0
        while r0 < n_rows:
            acc = rows_tn_chunk(a, a_cols, ca, b, b_cols, cb, start, r0, n_rows, acc, BK, CAST_F32, PRECISION)
            r0 += BK
    elif TMA:
        proxy_fence()
        rows = tl.maximum(n_rows, 1)  # an expert without rows runs no chunk; a descriptor needs one
        a_desc = tl.make_tensor_descriptor(a + start * a_cols, shape=[rows, a_cols], strides=[a_cols, 1],
                                           block_shape=[BK, BM])  # fmt: skip
        b_desc = tl.make_tensor_descriptor(b + start * b_cols, shape=[rows, b_cols], strides=[b_cols, 1],
                                           block_shape=[BK, BN])  # fmt: skip
        for r0 in tl.range(0, n_rows, BK, num_stages=STAGES):
            chunk_a = a_desc.load([r0, col_a])  # both loads before the tl.trans: one barrier (gemm_tile)
            chunk_b = b_desc.load([r0, col_b])
            acc = mma(tl.trans(chunk_a), chunk_b, acc, CAST_F32, PRECISION)
    else:
        for r0 in tl.range(0, n_rows, BK, num_stages=STAGES):
            acc = rows_tn_chunk(a, a_cols, ca, b, b_cols, cb, start, r0, n_rows, acc, BK, CAST_F32, PRECISION)
    return acc


@triton.jit
def rows_tn_chunk(
    a, a_cols, ca, b, b_cols, cb, start, r0, n_rows, acc, BK: tl.constexpr, CAST_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """``gemm_rows_tn``'s chunk of rows r0 .. r0 + BK through masked pointer loads: acc + its
    Aᵀ·B (rows past n_rows and columns past the matrices read as zero)."""
    rows = start + r0 + tl.arange(0, BK)
    live = r0 + tl.arange(0, BK) < n_rows
    x = tl.load(a + rows[:, None] * a_cols + ca[None, :], mask=live[:, None] & (ca < a_cols)[None, :], other=0.0)
    y = tl.load(b + rows[:, None] * b_cols + cb[None, :], mask=live[:, None] & (cb < b_cols)[None, :], other=0.0)
    return mma(tl.trans(x), y, acc, CAST_F32, PRECISION)


@triton.jit
def column_sums(a, a_cols, col0, first, n_rows, BN: tl.constexpr, BK: tl.constexpr):
    """fp32 [BN]: the sums of columns col0 .. col0 + BN (0 past ``a_cols``) of rows first ..
    first + n_rows of the row-major matrix A [*, a_cols] at ``a``, in chunks of BK rows from
    the first — as ``gemm_rows_tn``, a fixed order whatever the schedule (a bias gradient)."""
    acc = tl.zeros([BN], dtype=tl.float32)
    cols = col0 + tl.arange(0, BN)
    start = tl.cast(first, tl.int64)
    r0 = 0
    while r0 < n_rows:
        live = r0 + tl.arange(0, BK) < n_rows
        rows = start + r0 + tl.arange(0, BK)
        mask = live[:, None] & (cols < a_cols)[None, :]
        acc += tl.sum(tl.load(a + rows[:, None] * a_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32), axis=0)
        r0 += BK
    return acc


@triton.jit
def gate_up(acc, BM: tl.constexpr, BN: tl.constexpr):
    """Split a tile of x·[Wg Wu] whose columns interleave gate and up (column 2f is gate f,
    2f + 1 is up f) into its gate and up halves, [BM, BN] each. In Hopper's accumulator
    layout a thread holds adjacent column pairs, so the split moves no data."""
    return tl.split(tl.reshape(acc, [BM, BN, 2]))


@triton.jit
def store_rows(ptr, tile, live, n_cols, col0, BN: tl.constexpr):
    """Store the ``live`` rows of a [BM, BN] tile at ``ptr`` (one pointer per row), columns
    col0 .. col0 + BN, clipped to ``n_cols``. Rows are masked, never written whole: a tile's
    other rows belong to a neighbouring expert's tile or to another segment."""
    c = col0 + tl.arange(0, BN)
    tl.store(ptr[:, None] + c[None, :], tile, mask=live[:, None] & (c < n_cols)[None, :])


@triton.jit
def copy_rows(
    src, at, dst, live, n_cols, BM: tl.constexpr, BC: tl.constexpr, scales=None, SCALE_COLS: tl.constexpr = 0
):
    """Copy the ``live`` rows ``at`` (int [BM]) of a matrix of ``n_cols`` columns at ``src``
    to the [BM, n_cols] block of contiguous rows at ``dst`` (converted to ``dst``'s dtype), BC
    columns at a time. With ``SCALE_COLS`` the rows are quantised and leave dequantised:
    times their scales, laid out as the rows (as in ``gemm_tile``)."""
    m = tl.arange(0, BM)
    rows_at = tl.cast(at, tl.int64)
    for c0 in range(0, n_cols, BC):
        c = c0 + tl.arange(0, BC)
        mask = live[:, None] & (c < n_cols)[None, :]
        rows = tl.load(src + rows_at[:, None] * n_cols + c[None, :], mask=mask)
        if SCALE_COLS > 0:
            per_row = (n_cols + SCALE_COLS - 1) // SCALE_COLS
            s = tl.load(scales + rows_at[:, None] * per_row + c[None, :] // SCALE_COLS, mask=mask, other=0.0)
            rows = rows.to(tl.float32) * s
        tl.store(dst + m[:, None] * n_cols + c[None, :], rows.to(dst.dtype.element_ty), mask=mask)


__all__ = [
    "column_sums",
    "copy_rows",
    "fp8_scale",
    "gate_up",
    "gemm_rows_tn",
    "gemm_tile",
    "load_tile",
    "mma",
    "mma_chunk",
    "proxy_fence",
    "row_major",
    "row_scales",
    "rows_descriptor",
    "rows_tn_chunk",
    "store_rows",
    "to_e4m3",
]
