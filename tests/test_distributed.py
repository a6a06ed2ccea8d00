"""rdepc.distributed: data parallelism (DDP, FSDP2) over a model whose experts are per rank.

Two processes on the emulated-mp backend (examples/tiny.rdep at W = 2, T' = 8, with a
shared expert added). ``data_parallel`` and ``fully_shard`` leave each rank's experts its
own, average the replicated parameters' gradients and divide the experts' by W: one step's
gradients equal those of the one-process block for the mean of the two ranks' losses
(experts bitwise, the averaged ones to rounding). Plain DDP, DDP with a hand-made ignore
list that misses what its reducer looks up, experts left unscaled, and plain FSDP2 are
each refused in one line before any step. examples/train_moe.py trains under torchrun.
Starting the ranks costs seconds, so one launch runs every in-process case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_S, ROOT, block_parameters, block_reference
from rdepc.runtime import ranks
from tolerance import assert_close, bounds, layer_chain
from torch import nn

import rdepc
from rdepc import distributed

W, T, H = 2, 8, 64
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    text = (ROOT / "examples" / "tiny.rdep").read_text(encoding="utf-8")
    dropless = "  capacity  dropless\n"
    assert dropless in text
    path = tmp_path_factory.mktemp("spec") / "tiny_shared.rdep"
    path.write_text(text.replace(dropless, "  shared    1 x swiglu(ffn = 32)\n" + dropless), encoding="utf-8")
    return str(path)


class Net(nn.Module):
    """A dense projection, then the MoE block: dense, router, shared and expert parameters."""

    def __init__(self, spec: str, backend: str):
        super().__init__()
        torch.manual_seed(3)  # the projection: the same on every rank and in one process
        self.proj = nn.Linear(H, H)
        self.moe = rdepc.RDEPMoE(spec, backend=backend, generator=torch.Generator().manual_seed(7), W=W, T=T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.proj(x)) + 0  # a fresh tensor, not a view (FSDP2 warns of a view)


def inputs() -> torch.Tensor:
    return torch.randn(W, T, H, generator=torch.Generator().manual_seed(8))


def rank_loss(y: torch.Tensor, rank: int) -> torch.Tensor:
    target = torch.randn(y.shape, generator=torch.Generator().manual_seed(100 + rank))
    return ((y - target) ** 2).mean()


def refused(call) -> str:
    try:
        call()
    except rdepc.UsageError as e:
        return str(e)
    return "not refused"


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
    }


def rank_cases(rank: int, world: int, spec: str) -> dict:
    """Every in-process case on one rank (a spawned rank runs this)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    x = inputs()[rank]
    out = {}

    net = Net(spec, "emulated-mp")
    out["experts"] = list(net.moe.experts)
    out["marked"] = sorted(n for n, p in net.named_parameters() if distributed.is_expert(p))
    out["split"] = (
        [n for n, _ in distributed.expert_parameters(net)],
        [n for n, _ in distributed.dense_parameters(net)],
    )
    ddp = distributed.data_parallel(net)
    rank_loss(ddp(x), rank).backward()
    out["ddp"] = grads_of(net)

    moe = rdepc.RDEPMoE(spec, backend="emulated-mp", generator=torch.Generator().manual_seed(7), W=W, T=T)
    ddp = distributed.data_parallel(moe)  # the block itself wrapped: its parameters' reducer names read ".w_down"
    rank_loss(ddp(x), rank).backward()
    out["ddp_block"] = grads_of(moe)

    mesh = init_device_mesh("cpu", (world,))
    net = Net(spec, "emulated-mp")
    distributed.fully_shard(net, mesh=mesh)
    rank_loss(net(x), rank).backward()
    out["fsdp"] = grads_of(net)

    def plain_ddp():
        DistributedDataParallel(Net(spec, "emulated-mp"))(x)

    def hand_made_ignore_list():  # the usual recipe misses the names DDP's reducer reads for the root's own
        moe = rdepc.RDEPMoE(spec, backend="emulated-mp", generator=torch.Generator().manual_seed(7), W=W, T=T)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            moe, [n for n, _ in distributed.expert_parameters(moe)]
        )
        distributed.scale_expert_grads(moe)
        DistributedDataParallel(moe)(x)

    def unscaled():
        net = Net(spec, "emulated-mp")
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            net, [n for n, _ in distributed.expert_parameters(net)]
        )
        DistributedDataParallel(net)(x)

    def plain_fsdp():
        net = Net(spec, "emulated-mp")
        fully_shard(net, mesh=mesh)
        out["check_experts"] = refused(lambda: distributed.check_experts(net.moe))
        net(x)

    for name, case in [
        ("plain_ddp", plain_ddp),
        ("ignore_list", hand_made_ignore_list),
        ("unscaled", unscaled),
        ("plain_fsdp", plain_fsdp),
    ]:
        out[name] = refused(case)
    return out


@pytest.fixture(scope="module")
def per_rank(spec):
    return ranks.spawn(rank_cases, W, spec, timeout=HANG_S)


def one_process(spec: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The same layer in one process: gradients of the mean of the W ranks' losses, and their
    bounds (tests/tolerance.py) by the reference block in float64."""
    net = Net(spec, "emulated")
    y = net(inputs())
    (sum(rank_loss(y[r], r) for r in range(W)) / W).backward()
    block = block_reference(net.moe)

    def reference(x, params):
        leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
        h = nn.functional.linear(x, leaves["proj.weight"], leaves["proj.bias"])
        y = block(h, {n.removeprefix("moe."): t for n, t in leaves.items() if n.startswith("moe.")})
        (sum(rank_loss(y[r], r) for r in range(W)) / W).backward()
        return {n: t.grad for n, t in leaves.items()}

    params = {n: p.detach() for n, p in net.named_parameters()}
    assert params.keys() == {f"moe.{n}" for n in block_parameters(net.moe)} | {"proj.weight", "proj.bias"}
    # tiny (F = 128, E = 8, K = 2) behind the projection over H: the layer's chain, the shared expert's
    # F = 32, the router's dot over H and softmax over E, the projection's H; a weight's gradient
    # sums W·T·K rows, and the ranks' average adds two steps
    chain = layer_chain(H, 128, 2, extra=32 + H + 8 + H + W * T * 2 + 2)
    return {n: p.grad for n, p in net.named_parameters()}, bounds(reference, (inputs(), params), chain)


def compare(got: dict, want: dict, limits: dict, experts: list[int], what: str) -> None:
    """Each gradient within its bound of the one process's; experts' rows are this rank's, bitwise."""
    for name, g in got.items():
        if name.split(".")[-1] in distributed.EXPERT_WEIGHTS:  # one owner's sum, divided by 2: exact
            assert torch.equal(g, want[name][experts]), name
        else:
            assert_close(g, want[name], limits[name], f"{what}: {name}")


def test_one_step_gradients_equal_one_process_mean_of_losses(spec, per_rank):
    want, limits = one_process(spec)
    assert sorted(per_rank[0]["experts"] + per_rank[1]["experts"]) == list(range(8))
    for rank, got in enumerate(per_rank):
        for case in ("ddp", "fsdp"):
            assert set(got[case]) == set(want), case
            compare(got[case], want, limits, got["experts"], f"{case}, rank {rank}")


def test_data_parallel_over_the_block_itself(per_rank):
    """DDP wrapping an RDEPMoE itself: its reducer looks its parameters up as ".w_down" (a
    list of plain names would leave them averaged); data_parallel lists both, so the
    replicated gradients are averaged (equal on both ranks) and the experts' are not."""
    block = [got["ddp_block"] for got in per_rank]
    for name in block[0]:
        same = torch.equal(block[0][name], block[1][name])
        assert same == (name not in distributed.EXPERT_WEIGHTS), name


def test_experts_are_marked_and_split_from_the_dense_parameters(per_rank):
    got = per_rank[0]
    assert got["marked"] == ["moe.w_down", "moe.w_gate_up"]
    experts, dense = got["split"]
    assert experts == ["moe.w_gate_up", "moe.w_down"]
    assert dense == ["proj.weight", "proj.bias", "moe.router", "moe.shared_gate", "moe.shared_up", "moe.shared_down"]


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("plain_ddp", "DistributedDataParallel covers moe.w_gate_up, per-rank experts of rdepc layer tiny"),
        ("ignore_list", "would average the gradients of w_gate_up, per-rank experts of rdepc layer tiny"),
        ("unscaled", "call rdepc.distributed.scale_expert_grads(model)"),
        ("plain_fsdp", "fully_shard sharded w_gate_up, w_down of rdepc layer tiny"),
        ("check_experts", "shard it with rdepc.distributed.fully_shard(module)"),
    ],
)
def test_misuse_is_refused_in_one_line(per_rank, case, words):
    for got in per_rank:
        message = got[case]
        assert words in message and "\n" not in message, message
    fix = {
        "plain_ddp": "build the model again and wrap it with rdepc.distributed.data_parallel(model)",
        "ignore_list": "as '.w_gate_up', which its ignore list lacks; wrap the model with rdepc.distributed",
        "plain_fsdp": "shard it with rdepc.distributed.fully_shard(module)",
    }
    assert fix.get(case, "") in per_rank[0][case]


def test_train_example_under_torchrun(tmp_path):
    """examples/train_moe.py, one process per rank: the loss falls, the ranks' experts stay
    distinct and the replicated parameters identical (the script checks both, and fails)."""
    out = tmp_path / "train.json"
    env = dict(os.environ, RDEPC_CACHE_DIR=str(tmp_path / "rdepc-cache"), NO_COLOR="1")
    argv = [TORCHRUN, "--standalone", "--nproc-per-node", str(W), str(ROOT / "examples" / "train_moe.py")]
    args = ["--backend", "emulated-mp", "-D", f"W={W}", "-D", f"T={T}", "--steps", "4", "--layers", "1"]
    p = subprocess.run(
        [*argv, *args, "--lr", "1e-2", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[-2] == f"{W} ranks: each holds its own experts, the replicated parameters identical on every rank"
    assert lines[-1].startswith("loss ") and "over 4 steps" in lines[-1], p.stdout
    result = json.loads(out.read_text())
    assert result["backend"] == "emulated-mp" and result["ranks"] == W
    assert result["losses"][-1] < result["losses"][0], result["losses"]
