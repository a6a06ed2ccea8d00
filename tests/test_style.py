"""The repository is lint-clean and formatted: ``ruff check`` and ``ruff format --check``."""

from __future__ import annotations

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
