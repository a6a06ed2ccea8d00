"""A slice of the suite under the newest Triton rdepc supports (pyproject: 3.6 through 3.9;
the suite itself runs 3.6.0, the GPU machines' version): ``rdepc run --check`` of every example
whose kernels are not another's, as tests/test_examples.py narrows it, a dedup layer with fp8 block scales,
tiny_balance one process per rank, and the device-function tests. Triton is installed
(without dependencies) into a directory put first on the subprocesses' PYTHONPATH, so the
rest of the environment is the suite's."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import HANG_S, RESIZED, ROOT, TORCH_APART
from test_examples import NARROW

NEWEST = "3.9.0"


@pytest.fixture(scope="module")
def newest(request, tmp_path_factory) -> dict[str, str]:
    """The environment of a process that imports Triton NEWEST."""
    cache = getattr(request.config, "cache", None)
    target = cache.mkdir(f"triton-{NEWEST}") if cache is not None else tmp_path_factory.mktemp(f"triton-{NEWEST}")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    )
    env.pop("TRITON_INTERPRET", None)
    probe = [sys.executable, "-c", "import triton; print(triton.__version__)"]
    if subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip() != NEWEST:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target)]
        got = subprocess.run([*pip, f"triton=={NEWEST}"], capture_output=True, text=True, timeout=HANG_S)
        if got.returncode != 0:
            pytest.fail(f"could not install triton {NEWEST} for the slice:\n{got.stderr[-2000:]}")
    seen = subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip()
    assert seen == NEWEST, f"the slice's processes import triton {seen!r}, not {NEWEST}"
    return env


def _run(env: dict[str, str], *argv: str, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )  # fmt: skip


def test_examples_check_under_the_newest_triton(newest, tmp_path):
    """Every example but those whose kernels another's are (TORCH_APART, RESIZED)."""
    runs = {
        name: [f"examples/{name}.rdep", *(a for d in overrides for a in ("-D", d))]
        for name, overrides in NARROW.items()
        if name not in TORCH_APART and name not in RESIZED
    }
    assert set(RESIZED.values()) <= set(runs)
    text = (ROOT / "examples" / "deepseek_v3.rdep").read_text(encoding="utf-8").replace("scale row", "scale block")
    dedup = tmp_path / "deepseek_v3_dedup.rdep"
    dedup.write_text(text.replace("transport nvshmem", "transport nvshmem, dedup"), encoding="utf-8")
    assert dedup.read_text(encoding="utf-8").count("dedup") == 1 and "scale block" in text
    runs["deepseek_v3 with dedup and fp8 block scales"] = [
        str(dedup),
        *(a for d in NARROW["deepseek_v3"] for a in ("-D", d)),
    ]
    # one process per rank: a replicated layer's exchange, and its GEMM tiles reading the slots
    runs["tiny_balance on emulated-mp"] = [
        "examples/tiny_balance.rdep",
        "--backend",
        "emulated-mp",
        "--routing",
        "zipf:1.5",
    ]
    one_thread = newest | {"OMP_NUM_THREADS": "1"}  # the runs side by side, one core each
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        got = pool.map(lambda args: _run(one_thread, "-m", "rdepc", "run", *args, "--check"), runs.values())
        done = dict(zip(runs, got, strict=True))
    failed = [
        f"{name}: exit {r.returncode}\n{r.stdout[-800:]}{r.stderr[-1500:]}"
        for name, r in done.items()
        if r.returncode != 0 or not r.stdout.rstrip().endswith("check passed")
    ]
    assert not failed, "\n\n".join(failed)


def test_device_functions_under_the_newest_triton(newest):
    tests = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_device*.py"))]
    assert "tests/test_device.py" in tests
    got = _run(newest, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, timeout=2 * HANG_S)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-2000:]
    assert " passed" in got.stdout.splitlines()[-1]
