"""Shared test setup: a deterministic hypothesis profile, so CI never flakes."""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from rdepc import cli

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.rdep"))


@pytest.fixture
def main(capsys, monkeypatch):
    """rdepc.cli.main(argv) in-process, from the repo root: (status, stdout, stderr)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NO_COLOR", "1")

    def call(*argv: str) -> tuple[int, str, str]:
        try:
            status = cli.main(list(argv))
        except SystemExit as e:  # argparse's own usage errors, --help and --version
            status = e.code
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        return status, out, err

    return call


@pytest.fixture
def root() -> Path:
    return ROOT


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/*.json from the current compiler instead of comparing",
    )


@pytest.fixture
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")
