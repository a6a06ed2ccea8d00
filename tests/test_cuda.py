"""On a GPU only (skipped elsewhere): the native kernels against the reference, and a call
captured in a CUDA graph, replayed with new inputs copied into its input buffers.

Triton fixes its mode at first import and this suite runs the interpreter, so the native
part runs in a subprocess of its own (``python tests/test_cuda.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_native_calls_and_a_replayed_cuda_graph_match_the_reference():
    done = subprocess.run([sys.executable, __file__], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "graph replays exact" in done.stdout


def main() -> None:
    from rdepc.runtime.module import max_relative_error

    import rdepc
    from rdepc.reference import random_inputs, reference_for

    for schedule in ("bulk", "pipelined"):
        layer = rdepc.load(ROOT / "examples/qwen3_30b_a3b.rdep", T=64)
        sh = layer.shapes
        m = layer.module("emulated", "cuda", schedule=schedule)
        W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
        make = [
            random_inputs(W, T, H, F, E, K, seed=s, dtype=torch.bfloat16, gated=True, device="cuda") for s in (0, 1, 2)
        ]
        ref = reference_for(layer.spec)
        eager = [m(*inp) for inp in make]
        m.synchronize()
        for inp, y in zip(make, eager, strict=True):
            err = max_relative_error(y, ref(*[t.float() if t.dtype.is_floating_point else t for t in inp])[0])
            assert err < 2e-2, f"{schedule}: max relative error {err}"
        static = [t.clone() for t in make[0]]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            m(*static)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(*static)
        for inp, y in zip(make, eager, strict=True):
            for dst, src in zip(static, inp, strict=True):
                dst.copy_(src)
            graph.replay()
            m.synchronize()
            assert torch.equal(out, y), f"{schedule}: a replay differs from the eager call"
        print(f"{schedule}: graph replays exact")


if __name__ == "__main__":
    main()
