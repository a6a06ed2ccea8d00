"""On a GPU only (skipped elsewhere): native calls against the reference, and a call captured
in a CUDA graph, replayed with new inputs copied into its input buffers, bitwise the eager
calls — the acceptance's ``cuda_graph`` checks (bench/acceptance.py, docs/gpu.md).

Triton fixes its mode at first import and this suite runs the interpreter, so the native
part runs in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import HANG_S, ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_native_calls_and_a_replayed_cuda_graph_match_the_reference(tmp_path):
    cmd = [
        sys.executable,
        "bench/acceptance.py",
        "--stage",
        "correct",
        "--only",
        "cuda_graph/*",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    checks = {c["name"]: c for c in json.loads((tmp_path / "correct.json").read_text())["checks"]}
    for name in ("cuda_graph/qwen3_30b_a3b", "cuda_graph/tiny"):
        assert checks[name]["status"] == "pass" and checks[name]["figures"]["captured"], checks[name]
