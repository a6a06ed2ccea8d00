"""examples/train_moe.py end to end, in a subprocess: a CI-sized run (one MoE block, a few
steps, backward through the compiled kernels under the Triton interpreter) exits 0 and its
loss falls; a per-rank backend started without torchrun is refused in one line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from conftest import HANG_S, ROOT

SCRIPT = ROOT / "examples" / "train_moe.py"


def test_train_example_loss_falls(tmp_path):
    out = tmp_path / "train.json"
    steps = 6
    env = dict(os.environ, RDEPC_CACHE_DIR=str(tmp_path / "rdepc-cache"), NO_COLOR="1")
    args = ["--steps", str(steps), "--layers", "1", "--lr", "1e-2", "--seed", "0", "--json", str(out)]
    p = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=HANG_S
    )
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"over {steps} steps" in p.stdout.splitlines()[-1], p.stdout
    assert "block 0: rows per expert" in p.stdout, p.stdout

    result = json.loads(out.read_text())
    losses = result["losses"]
    assert result["steps"] == steps
    assert result["device"] == "cpu"
    assert result["spec"] == "examples/tiny.rdep"
    assert len(losses) == steps
    assert all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def test_per_rank_backend_outside_torchrun_is_refused_in_one_line(tmp_path):
    """--backend emulated-mp runs one process per rank: started alone, the script says how to
    start it (the torchrun launch itself is tests/test_distributed.py's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"RDEPC_CACHE_DIR": str(tmp_path / "rdepc-cache"), "NO_COLOR": "1"}
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "emulated-mp", "-D", "W=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        "train_moe: a per-rank backend runs one process per rank: start them with "
        "`torchrun --nproc-per-node 2 ...` (or rdepc.runtime.ranks.spawn)"
    ], p.stderr
