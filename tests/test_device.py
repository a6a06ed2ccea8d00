"""codegen/device/gemm.py, the spec-independent device code, on its own under the interpreter:
one GEMM tile through tensor descriptors and through masked pointer loads (bit for bit
alike), overhanging every edge of both operands; the gate/up split; masked row stores. The
functions are taken the way the emitter takes them (``device.include``), into a
kernel file of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from device_kernels import interpreted
from rdepc.codegen.device import include
from tolerance import assert_close, bound

from rdepc.toolchain import import_kernels

KERNELS = """
import triton
import triton.language as tl


@@DEVICE@@


@triton.jit
def tile(a, a_rows, row0, w, n_cols, col0, out, K_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         BK: tl.constexpr, TMA: tl.constexpr, CAST_F32: tl.constexpr, TRANS_B: tl.constexpr = False):
    acc = gemm_tile(a, a_rows, row0, w, n_cols, col0, K_DIM, BM, BN, BK, 2, TMA, CAST_F32, "ieee", TRANS_B)
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    tl.store(out + m[:, None] * BN + n[None, :], acc)


@triton.jit
def program_tiles(a, a_rows, rows0, w, n_cols, col0, out, N_TILES: tl.constexpr, K_DIM: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TRANS_B: tl.constexpr):
    # a program's tiles of one A through the descriptor it built once (ring_descriptors)
    a_desc = rows_descriptor(a, a_rows, K_DIM, BM, BK)
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    for t in range(N_TILES):
        acc = gemm_tile(a, a_rows, tl.load(rows0 + t), w, n_cols, col0, K_DIM, BM, BN, BK, 2, True, True, "ieee",
                        TRANS_B, a_desc=a_desc)
        tl.store(out + t * BM * BN + m[:, None] * BN + n[None, :], acc)


@triton.jit
def scaled_tile(a, a_rows, row0, w, n_cols, col0, scales, out, K_DIM: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, SCALE_COLS: tl.constexpr):
    acc = gemm_tile(a, a_rows, row0, w, n_cols, col0, K_DIM, BM, BN, BK, 1, TMA, True, "ieee", False, scales,
                    SCALE_COLS)
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    tl.store(out + m[:, None] * BN + n[None, :], acc)


@triton.jit
def gathered_tile(a, a_rows, index, w, n_cols, col0, out, K_DIM: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, TRANS_B: tl.constexpr):
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    acc = gemm_tile(a, a_rows, 0, w, n_cols, col0, K_DIM, BM, BN, BK, 1, False, True, "ieee", TRANS_B,
                    a_index=tl.load(index + m))
    tl.store(out + m[:, None] * BN + n[None, :], acc)


@triton.jit
def quantise(x, y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y + i, to_e4m3(tl.load(x + i), 1.0, True))


@triton.jit
def split(acc, gate, up, live_lo, live_hi, n_cols, col0, BM: tl.constexpr, BN: tl.constexpr):
    m = tl.arange(0, BM)
    n = tl.arange(0, 2 * BN)
    g, u = gate_up(tl.load(acc + m[:, None] * (2 * BN) + n[None, :]), BM, BN)
    live = (m >= live_lo) & (m < live_hi)
    store_rows(gate + m * n_cols, g, live, n_cols, col0, BN)
    store_rows(up + m * n_cols, u, live, n_cols, col0, BN)


@triton.jit
def anchor(x, like, out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out + i, anchored(tl.load(x + i), tl.load(like + i)))
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    path = tmp_path_factory.mktemp("device") / "device_kernels.py"
    device = include("gemm") + "\n\n\n" + include("expert_grads", ("anchored",))
    path.write_text(KERNELS.replace("@@DEVICE@@", device), encoding="utf-8")
    return import_kernels(path, interpret=True)


def expected(a, row0, w, col0, BM, BN):
    """The tile with every out-of-range row and column as zero, in fp32 (float64 if a is)."""
    ct = torch.promote_types(a.dtype, torch.float32)
    rows = torch.zeros(BM, a.shape[1], dtype=ct)
    for i in range(BM):
        if 0 <= row0 + i < a.shape[0]:
            rows[i] = a[row0 + i].to(ct)
    cols = torch.zeros(w.shape[0], BN, dtype=ct)
    for j in range(BN):
        if col0 + j < w.shape[1]:
            cols[:, j] = w[:, col0 + j].to(ct)
    return rows @ cols


def tile_bound(a, row0, w, col0, BM, BN):
    """The tile's bound (tests/tolerance.py): a dot product over K, summed in fp32 (bf16 operands
    are exact there), K roundings and the last one."""
    return bound(expected, (a, row0, w, col0, BM, BN), a.shape[1] + 1)


@pytest.mark.parametrize(
    ("dtype", "K", "N", "tma"),
    [
        (torch.float32, 48, 80, True),  # rows 192 B, 320 B: tensor descriptors
        (torch.bfloat16, 48, 80, True),
        (torch.float32, 20, 36, False),  # rows 80 B, 144 B: pointer loads work too
        (torch.float32, 5, 7, False),  # rows of 20 B and 28 B: only pointer loads
    ],
)
@pytest.mark.parametrize("row0", [-8, 0, 30])
def test_gemm_tile_reads_zero_outside_both_operands(kernels, dtype, K, N, tma, row0):
    g = torch.Generator().manual_seed(K * 100 + N)
    a = torch.randn(40, K, generator=g).to(dtype)
    w = torch.randn(K, N, generator=g).to(dtype)
    BM, BN, BK = 32, 32, 32  # K and N not multiples of the tile: the last chunks overhang
    for col0 in (0, 64 if N > 64 else N - 3):
        out = torch.full((BM, BN), float("nan"))
        interpreted(
            kernels.tile, (1,), (a, a.shape[0], row0, w, N, col0, out), dict(K_DIM=K, BM=BM, BN=BN, BK=BK, TMA=tma,
                                                                             CAST_F32=True)
        )  # fmt: skip
        assert_close(out, expected(a, row0, w, col0, BM, BN), tile_bound(a, row0, w, col0, BM, BN), f"col0 {col0}")


@pytest.mark.parametrize("trans_b", [False, True])
def test_a_programs_rows_descriptor_gives_each_tile_its_own_descriptors_result(kernels, trans_b):
    """Tiles that read A through one descriptor their program built (``a_desc``: the payload
    and workspace rings, one process per rank) are bitwise the tiles that build their own,
    overhanging rows included."""
    g = torch.Generator().manual_seed(11)
    K, N, BM, BN, BK = 48, 80, 32, 32, 32
    a = torch.randn(40, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) if trans_b else torch.randn(K, N, generator=g)).to(torch.bfloat16)
    rows0 = torch.tensor([30, 0, 16, -8], dtype=torch.int32)
    shared = torch.full((len(rows0), BM, BN), float("nan"))
    interpreted(
        kernels.program_tiles, (1,), (a, a.shape[0], rows0, w, N, 64, shared),
        dict(N_TILES=len(rows0), K_DIM=K, BM=BM, BN=BN, BK=BK, TRANS_B=trans_b),
    )  # fmt: skip
    for t, row0 in enumerate(rows0.tolist()):
        own = torch.full((BM, BN), float("nan"))
        interpreted(
            kernels.tile, (1,), (a, a.shape[0], row0, w, N, 64, own),
            dict(K_DIM=K, BM=BM, BN=BN, BK=BK, TMA=True, CAST_F32=True, TRANS_B=trans_b),
        )  # fmt: skip
        assert torch.equal(shared[t], own), row0


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("row0", [-8, 0, 30])
def test_pointer_loads_match_tensor_descriptors_bit_for_bit(kernels, trans_b, row0):
    """The masked pointer loads (TMA=False) give the tile the descriptors give, to the bit, B
    as it is or transposed: schedules that differ in TMA compare bitwise."""
    g = torch.Generator().manual_seed(7)
    K, N, BM, BN, BK = 48, 80, 32, 32, 32
    a = torch.randn(40, K, generator=g)
    w = torch.randn(N, K, generator=g) if trans_b else torch.randn(K, N, generator=g)
    b = w.t() if trans_b else w
    for col0 in (0, 64):
        outs = []
        for tma in (True, False):
            out = torch.full((BM, BN), float("nan"))
            interpreted(
                kernels.tile, (1,), (a, a.shape[0], row0, w, N, col0, out),
                dict(K_DIM=K, BM=BM, BN=BN, BK=BK, TMA=tma, CAST_F32=True, TRANS_B=trans_b),
            )  # fmt: skip
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert_close(outs[1], expected(a, row0, b, col0, BM, BN), tile_bound(a, row0, b, col0, BM, BN), f"col0 {col0}")


def test_device_code_uses_no_block_pointers():
    """Triton 3.9 removed block pointers (tl.make_block_ptr, tl.advance, boundary_check):
    neither device.py nor any kernel template may use them."""
    from rdepc.codegen import device

    root = Path(device.__file__).resolve().parent.parent
    used = [
        f"{path.relative_to(root)}: {name}"
        for folder in ("codegen", "runtime")
        for path in sorted((root / folder).glob("*.py"))
        for name in ("make_block_ptr(", "tl.advance(", "boundary_check=")
        if name in path.read_text(encoding="utf-8")
    ]
    assert not used, used


@pytest.mark.parametrize(("K", "scale_cols", "tma"), [(96, 96, True), (96, 32, True), (80, 32, False)])
def test_gemm_tile_applies_fp8_row_and_block_scales(kernels, K, scale_cols, tma):
    """An fp8 A with one scale per row (scale_cols = K) or per 32 columns: the tile is
    (A · its scales) · B; rows outside A, scales included, count as zero."""
    g = torch.Generator().manual_seed(K + scale_cols)
    a = (torch.randn(40, K, generator=g) * 50).to(torch.float8_e4m3fn)
    groups = -(-K // scale_cols)
    scales = torch.rand(40, groups, generator=g) + 0.5
    w = torch.randn(K, 48, generator=g).to(torch.bfloat16)

    def dequantised(a, scales):
        return a * scales.repeat_interleave(scale_cols, dim=1)[:, :K]

    deq = dequantised(a.float(), scales)
    BM, BN, BK = 32, 32, 32
    for row0 in (-8, 20):
        out = torch.full((BM, BN), float("nan"))
        interpreted(
            kernels.scaled_tile, (1,), (a, 40, row0, w, 48, 16, scales, out),
            dict(K_DIM=K, BM=BM, BN=BN, BK=BK, TMA=tma, SCALE_COLS=scale_cols),
        )  # fmt: skip

        def tile(a, s, w, row0=row0):
            return expected(dequantised(a, s), row0, w, 16, BM, BN)

        # the sum over K in runs of scale_cols columns, each run's sum times its scale, the runs' sum
        limit = bound(tile, (a.float(), scales, w), K + groups + 1)
        assert_close(out, expected(deq, row0, w, 16, BM, BN), limit, f"row0 {row0}")


@pytest.mark.parametrize("trans_b", [False, True])
def test_gemm_tile_gathers_rows_by_index(kernels, trans_b):
    """With ``a_index`` tile row m is A's row index[m] (-1: zero), repeats allowed (dedup's
    slots read their token's one row); B as it is or transposed (the backward's dL/dy·Wdᵀ)."""
    g = torch.Generator().manual_seed(11)
    K, N, BM, BN, BK = 40, 48, 16, 32, 16
    a = torch.randn(24, K, generator=g)
    w = torch.randn(N, K, generator=g) if trans_b else torch.randn(K, N, generator=g)
    index = torch.tensor([3, 3, -1, 0, 23, 7, 7, 7, -1, 1, 2, 5, 5, 9, 10, 23], dtype=torch.int32)
    out = torch.full((BM, BN), float("nan"))
    interpreted(
        kernels.gathered_tile, (1,), (a, 24, index, w, N, 8, out),
        dict(K_DIM=K, BM=BM, BN=BN, BK=BK, TRANS_B=trans_b),
    )  # fmt: skip

    def gathered(a, w):
        rows = torch.where((index >= 0)[:, None], a[index.clamp(min=0).long()], 0.0)
        b = w.t() if trans_b else w
        return rows @ torch.cat((b, torch.zeros(K, BN, dtype=b.dtype)), dim=1)[:, 8 : 8 + BN]

    assert_close(out, gathered(a, w), bound(gathered, (a, w), K + 1), "tile")  # a dot product over K


def test_e4m3_rounding_is_torchs_bit_for_bit(kernels):
    """Under the interpreter the rounding is done on the bits (its own conversion does not
    carry into the exponent): normal, subnormal, halfway, signed-zero and clamped values."""
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([1.9688, 1.96875, 2.0625, 0.0, -0.0, 448.0, -448.0, 2**-6, 2**-10, 3 * 2**-10, 15 * 2**-10])
    x = torch.cat([torch.randn(4096, generator=g) * 100, torch.randn(4085, generator=g) * 0.01, edges])
    x = x.clamp(-448.0, 448.0)
    y = torch.empty(x.numel(), dtype=torch.float8_e4m3fn)
    interpreted(kernels.quantise, (1,), (x, y), dict(N=x.numel()))
    assert torch.equal(y.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_gate_up_splits_interleaved_columns_and_stores_only_live_rows(kernels):
    BM, BN, n_cols = 16, 16, 24
    acc = torch.randn(BM, 2 * BN, generator=torch.Generator().manual_seed(1))
    gate = torch.full((BM, n_cols), -1.0)
    up = torch.full((BM, n_cols), -1.0)
    interpreted(kernels.split, (1,), (acc, gate, up, 3, 11, n_cols, 16), dict(BM=BM, BN=BN))
    want_gate = torch.full((BM, n_cols), -1.0)
    want_up = torch.full((BM, n_cols), -1.0)
    want_gate[3:11, 16:] = acc[3:11, 0 : 2 * (n_cols - 16) : 2]  # column 2f is gate f, 2f + 1 up f
    want_up[3:11, 16:] = acc[3:11, 1 : 2 * (n_cols - 16) : 2]
    assert torch.equal(gate, want_gate) and torch.equal(up, want_up)


def test_anchored_returns_its_input_bit_for_bit_whatever_it_is_anchored_to(kernels):
    edges = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.0, -3.5, float("inf"), -float("inf"), float("nan")])
    g = torch.Generator().manual_seed(2)
    values = torch.cat((edges, torch.randn(7, generator=g) * 1e30))
    x, like = (t.reshape(-1).contiguous() for t in torch.meshgrid(values, values, indexing="ij"))
    n = 1 << (x.numel() - 1).bit_length()
    x, like = (torch.cat((t, torch.zeros(n - t.numel()))) for t in (x, like))
    out = torch.full_like(x, 7.0)
    interpreted(kernels.anchor, (1,), (x, like, out), dict(N=n))
    same = (out.view(torch.int32) == x.view(torch.int32)) | (out.isnan() & x.isnan())
    assert same.all(), (x[~same][:4], like[~same][:4], out[~same][:4])


def test_native_launches_get_a_scratch_allocator_unless_the_program_has_one():
    """Tensor descriptors made on the device live in Triton's global scratch, which needs an
    allocator: the launchers give theirs, never replacing one the program set."""
    import contextvars

    import triton
    from rdepc.runtime.launch import _scratch, scratch_allocator
    from triton.runtime import _allocation

    def fresh():
        scratch_allocator()
        return _allocation._allocator.get()

    def own():
        mine = lambda size, alignment, stream: None  # noqa: E731
        triton.set_allocator(mine)
        scratch_allocator()
        return _allocation._allocator.get() is mine

    assert contextvars.Context().run(fresh) is _scratch
    assert contextvars.Context().run(own)
