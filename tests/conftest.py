"""Shared test setup: a deterministic hypothesis profile, so CI never flakes."""

import os
from pathlib import Path

import pytest
from device_kernels import kernels  # noqa: F401 - the device-function tests' fixture
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

# A wall-clock bound in a test only ends a hang: whatever outlives it has stopped making
# progress, on any machine under any load (the slowest launch seen, emulated-mp tiny on 2
# cores beside two CPU-heavy processes, takes under a tenth of it). No test asserts speed.
HANG_S = 900


def growing_bounds(first: float):
    """first, 2·first, 4·first, ... up to :data:`HANG_S`: the bounds a test that must see a
    launch end by its own timeout tries in turn, the next only when a loaded machine had not
    reached the point the test needs within the last."""
    bound = first
    while bound <= HANG_S:
        yield bound
        bound *= 2


EXAMPLES = sorted((ROOT / "examples").glob("*.rdep"))
TINY = ROOT / "examples" / "tiny.rdep"


def tiny_segmented(directory: Path, rows: int = 32, buffers: int = 2) -> Path:
    """examples/tiny.rdep as a pipelined layer of ``rows``-row segments through ``buffers``
    ring slots, written into ``directory``. tiny itself is bulk (one segment per owner, S =
    128); tests of segmented schedules use this, where S = 32 gives each owner 4 segments."""
    text = TINY.read_text(encoding="utf-8")
    bulk = "  schedule  bulk\n"
    assert bulk in text, "examples/tiny.rdep no longer says 'schedule  bulk': update tiny_segmented"
    path = directory / f"tiny_S{rows}_B{buffers}.rdep"
    segmented = f"  segment   rows {rows}, buffers {buffers}\n  schedule  pipelined\n"
    path.write_text(text.replace(bulk, segmented), encoding="utf-8")
    return path


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


GRAD_NAMES = ("x", "topk_weights", "w_gate", "w_up", "w_down")


def grads_in(fn, inputs, dy, dtype) -> dict:
    """{name: fp32 gradient} of sum(y · dy) through ``fn`` (a layer or the reference), x and
    the weights in ``dtype``, the gates in fp32."""
    x, ids, g, wg, wu, wd = inputs
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, wg, wu, wd)]
    gates = g.detach().float().requires_grad_(True)
    y = fn(leaves[0], ids, gates, *leaves[1:])
    y = y[0] if isinstance(y, tuple) else y
    (y.float() * dy).sum().backward()
    return {n: t.grad.float() for n, t in zip(GRAD_NAMES, (leaves[0], gates, *leaves[1:]), strict=True)}
