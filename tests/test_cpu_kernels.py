"""A slice of the suite's numeric tests under another choice of CPU kernels: ATen's portable
kernels (``ATEN_CPU_CAPABILITY=default``: no vector units) with MKL held to AVX2, where the
suite itself runs whatever the CPU offers (AVX-512 on CI's). Sums round in another order
there, so a tolerance that only held because two computations happened to round alike on
one CPU fails here: the tolerances are derived (tests/tolerance.py), and this keeps them so.
The whole suite passes under each capability too (docs/testing.md); this slice is what CI
repeats on every run."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import HANG_S, ROOT

# fast files whose comparisons are between computations of another order (router, reference,
# kernels under the interpreter, forward and backward, transformers blocks)
SLICE = ("tests/test_tolerance.py", "tests/test_router.py", "tests/test_reference.py", "tests/test_padding.py")
KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_the_numeric_slice_passes_under_portable_cpu_kernels():
    env = dict(os.environ, **KERNELS)
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    seen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert seen.stdout.strip() == "DEFAULT", seen.stdout + seen.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *SLICE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1] and "failed" not in run.stdout.splitlines()[-1]
