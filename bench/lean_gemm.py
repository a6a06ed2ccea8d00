"""The yardstick for rdepc's GEMM loops: a lean persistent grouped GEMM, written for nothing
but speed, compiled for sm_90 with the tiles rdepc's kernels use.

``grouped_gemm`` multiplies each group's rows of A (a segment of an offsets array) by its
group's weights, tile by tile: program p takes tiles p, p + P, ... of (group, m-tile,
column block), reads A and the weights through tensor descriptors made on the device
(TMA) and pipelines its K-loop ``STAGES`` deep — the shape of Triton's persistent matmul
tutorial, with no dependency waits, no task table and no epilogue beyond one store.
``compile_sass`` builds it as ``rdepc compile --target sm_90`` builds rdepc's kernels
(``triton.compile`` for GPUTarget("cuda", 90, 32), no GPU) and returns its loops
(``rdepc.codegen.sass.gemm_loops``): ``bench/gemm_loops.py`` and the CI test
``tests/test_gemm_loops.py`` set rdepc's GEMM loops beside it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import triton
import triton.language as tl


@triton.jit
def grouped_gemm(
    a, w, c, offsets, n_rows, n_tiles, tiles_per_group, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    n_blocks = N // BN
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        g = t // tiles_per_group
        r = t % tiles_per_group
        m0 = tl.load(offsets + g) + r // n_blocks * BM
        n0 = r % n_blocks * BN
        end = tl.load(offsets + g + 1)
        if m0 < end:
            a_desc = tl.make_tensor_descriptor(a, shape=[n_rows, K], strides=[K, 1], block_shape=[BM, BK])
            w_desc = tl.make_tensor_descriptor(
                w + g.to(tl.int64) * K * N, shape=[K, N], strides=[N, 1], block_shape=[BK, BN]
            )
            acc = tl.zeros([BM, BN], tl.float32)
            for k in tl.range(0, K, BK, num_stages=STAGES):
                acc = tl.dot(a_desc.load([m0, k]), w_desc.load([k, n0]), acc)
            rows = m0 + tl.arange(0, BM)
            cols = n0 + tl.arange(0, BN)
            out = c + rows[:, None].to(tl.int64) * N + cols[None, :]
            tl.store(out, acc.to(c.dtype.element_ty), mask=(rows < end)[:, None])


def compile_sass(K: int, N: int, BM: int = 128, BN: int = 256, BK: int = 64, stages: int = 3, warps: int = 8) -> dict:
    """Compile ``grouped_gemm`` (bf16, K × N weights per group) for sm_90; its resources and
    GEMM loops as ``rdepc.codegen.sm90`` reports a kernel's."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_sass needs Triton's compiler: run it with TRITON_INTERPRET unset")
    from rdepc.codegen import sass
    from rdepc.codegen.sm90 import resources
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"a": "*bf16", "w": "*bf16", "c": "*bf16", "offsets": "*i32", "n_rows": "i32", "n_tiles": "i32"}
    signature |= {"tiles_per_group": "i32"} | dict.fromkeys(("N", "K", "BM", "BN", "BK", "STAGES"), "constexpr")
    constexprs = {"N": N, "K": K, "BM": BM, "BN": BN, "BK": BK, "STAGES": stages}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    src = ASTSource(fn=grouped_gemm, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "grouped_gemm.cubin"
        cubin.write_bytes(k.asm["cubin"])
        used = resources(cubin)
        loops = sass.gemm_loops(sass.disassemble(cubin))
    return {
        "kernel": f"grouped_gemm BM {BM} BN {BN} BK {BK}",
        "shared": int(k.metadata.shared),
        **used,
        "ctas_per_sm": sass.ctas_per_sm(used["registers"], int(k.metadata.shared), 32 * warps),
        "loops": [loop.as_dict() for loop in loops],
    }


__all__ = ["compile_sass", "grouped_gemm"]
