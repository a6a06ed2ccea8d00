"""Device code that does not depend on the spec: the main loop of one grouped-GEMM tile.

Real Triton, linted and unit-tested like any module (``tests/test_device.py``), and
included verbatim in every generated kernel file by the emitter (``compute.device_source``), which
keeps a generated file self-contained. Everything a function needs comes in through its
arguments — no globals of a generated file — so these functions compile alone.

Operands are row-major matrices whose rows are contiguous: the expert-contiguous payload
rows (GEMM1's A), the GEMM1 → GEMM2 workspace (GEMM2's A) and an expert's weights (B). With
``TMA`` they are read through tensor descriptors, which Hopper turns into bulk tensor
copies (TMA) that the ``num_stages`` software pipeline overlaps with ``wgmma``; without
(a row stride that is not a multiple of 16 bytes) through block pointers. Either way rows
and columns outside the matrix read as zero, so a tile may hang over a matrix's edge —
before its first row, too: an m-tile that a segment boundary cuts starts before its slot.
"""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, CAST_F32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a·b in fp32. ``a`` takes ``b``'s dtype (the payload may travel in another).
    ``CAST_F32`` is set exactly when interpreting: the interpreter computes bf16 on raw bits,
    so both go to fp32 first (and it has no inline assembly, nor memory proxies)."""
    if CAST_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)


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
):
    """One [BM, BN] fp32 tile: A[row0 : row0 + BM, :] · B[:, col0 : col0 + BN].

    A is [a_rows, K_DIM] at ``a``, B is [K_DIM, n_cols] at ``w`` (one expert's weights), both
    row-major; the reduction runs over K_DIM in chunks of BK, its loads pipelined ``STAGES``
    deep. Out-of-range rows and columns count as zero.
    """
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if TMA:
        if not CAST_F32:  # natively (see mma)
            proxy_fence()
        a_desc = tl.make_tensor_descriptor(a, shape=[a_rows, K_DIM], strides=[K_DIM, 1], block_shape=[BM, BK])
        w_desc = tl.make_tensor_descriptor(w, shape=[K_DIM, n_cols], strides=[n_cols, 1], block_shape=[BK, BN])
        for k in tl.range(0, K_DIM, BK, num_stages=STAGES):
            acc = mma(a_desc.load([row0, k]), w_desc.load([k, col0]), acc, CAST_F32, PRECISION)
    else:
        a_ptr = tl.make_block_ptr(a, (a_rows, K_DIM), (K_DIM, 1), (row0, 0), (BM, BK), (1, 0))
        w_ptr = tl.make_block_ptr(w, (K_DIM, n_cols), (n_cols, 1), (0, col0), (BK, BN), (1, 0))
        for _ in tl.range(0, K_DIM, BK, num_stages=STAGES):
            x = tl.load(a_ptr, boundary_check=(0, 1), padding_option="zero")
            y = tl.load(w_ptr, boundary_check=(0, 1), padding_option="zero")
            acc = mma(x, y, acc, CAST_F32, PRECISION)
            a_ptr = tl.advance(a_ptr, (0, BK))
            w_ptr = tl.advance(w_ptr, (BK, 0))
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


__all__ = ["gate_up", "gemm_tile", "mma", "proxy_fence", "store_rows"]
