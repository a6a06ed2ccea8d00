"""The repository is lint-clean and formatted (``ruff check`` and ``ruff format --check``), and
its functions short enough to hold whole."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_S, ROOT


def _ruff() -> list[str]:
    beside = Path(sys.executable).parent / "ruff"
    if beside.exists():
        return [str(beside)]
    if shutil.which("ruff"):
        return [shutil.which("ruff")]
    probe = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "ruff"]
    pytest.skip("ruff is not installed (pip install -e '.[test]')")


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(args):
    p = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, f"ruff {' '.join(args)} found problems:\n{p.stdout}{p.stderr}"


# Triton kernels whose split waits on a GPU: a device function cut in two changes what the
# compiler inlines and keeps in registers, which only a measurement on the device can judge.
LONG_DEVICE_FUNCTIONS = {
    ("codegen/device/kernel.py", "rdep_layer"),
    ("codegen/device/gemm_kernel.py", "rdep_gemm"),
    ("codegen/device/dispatch.py", "dispatch"),
    ("codegen/device/expert_grads.py", "bgemm1"),
    ("codegen/device/returns.py", "return_rows"),
    ("codegen/device/combine.py", "combine"),
    ("codegen/device/combine.py", "combine_grad"),
    ("codegen/device/gemm.py", "gemm_tile"),
    ("codegen/device/experts.py", "gemm1"),
}
LONGEST = 80  # lines: a function a reader holds whole


def test_functions_are_short_enough_to_hold_whole():
    """Every function of the repository (its tests too) is at most LONGEST lines, but the device
    kernels listed (and each of those still is long: the list holds no stale entry)."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    long = set()
    for path in files.stdout.split():
        tree = ast.parse((ROOT / path).read_text(), path)
        functions = (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        long |= {(path, f.name) for f in functions if f.end_lineno - f.lineno + 1 > LONGEST}
    assert not long - LONG_DEVICE_FUNCTIONS, f"longer than {LONGEST} lines: {sorted(long - LONG_DEVICE_FUNCTIONS)}"
    assert not LONG_DEVICE_FUNCTIONS - long, f"listed, no longer long: {sorted(LONG_DEVICE_FUNCTIONS - long)}"
