"""Train a tiny MoE language model whose MoE blocks are rdepc's compiled kernels.

The model is token embedding (a vocabulary of 64) -> ``--layers`` blocks -> final RMSNorm ->
linear head. Each block is pre-norm and residual twice over: a learned causal depthwise
convolution over the tokens of a sequence (so the next token is predictable from the ones
before it), then ``rdepc.RDEPMoE`` — its router and expert weights trained like any other
parameter, its routed experts running the Triton kernels generated from ``--spec`` forward
and backward. A batch is the layer's own shape [W, T', H]: W sequences, one per rank, of
the spec's T tokens each; the model's dtype is the spec's.

The data is synthetic and deterministic: sequences drawn from a fixed random first-order
Markov chain over the 64 tokens (a few likely successors per token), a fresh batch each
step, and the loss is next-token cross-entropy, minimized with AdamW over every parameter.
A progress bar goes to stderr; the last line on stdout reads
``loss FIRST -> LAST over N steps (S s)``, and the script exits 0 when the mean of the last
3 losses is below the mean of the first 3, else 1.

On a CPU the kernels run under the Triton interpreter (slow: a few seconds a step per
layer for examples/tiny.rdep; the defaults take about three minutes on two cores); on a
GPU they run natively:

    .venv/bin/python examples/train_moe.py
    .venv/bin/python examples/train_moe.py --steps 8 --layers 1 --json build/train.json
    .venv/bin/python examples/train_moe.py --device cuda --steps 200

With a per-rank backend (``--backend emulated-mp`` on the CPU, ``nvshmem`` on GPUs) each
of the spec's W ranks is a process, started by torchrun (``-D W=2`` sets the spec's W):

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_moe.py --backend emulated-mp -D W=2

Every rank builds the model with the same seed (so the replicated parameters start equal,
and its experts are its slice of the same layer), draws its own batch [1, T'] (its own
sequence, seeded by its rank) and trains through ``rdepc.distributed.data_parallel``:
DistributedDataParallel over the replicated parameters, each rank's experts its own. The
loss reported is the mean over the ranks. At the end every rank checks that the
replicated parameters are still identical on every rank and that no two ranks hold the
same expert weights (digests gathered over torch.distributed); rank 0 prints the summary.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rdepc.runtime.ranks import RanksError
from torch import nn
from torch.nn import functional as F

import rdepc
import rdepc.distributed
from rdepc.api import parse_override

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 64


class CausalConv(nn.Module):
    """Depthwise causal convolution over the token axis: y[:, t] mixes x[:, t-k+1 .. t]."""

    def __init__(self, H: int, k: int = 4):
        super().__init__()
        self.k = k
        self.weight = nn.Parameter(torch.randn(H, 1, k) / math.sqrt(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        h = F.pad(x.transpose(1, 2), (self.k - 1, 0))
        return F.conv1d(h, self.weight, groups=x.shape[-1]).transpose(1, 2)


class Block(nn.Module):
    """x + mix(norm(x)), then x + moe(norm(x))."""

    def __init__(self, moe: rdepc.RDEPMoE):
        super().__init__()
        self.mix_norm = nn.RMSNorm(moe.H)
        self.mix = CausalConv(moe.H)
        self.moe_norm = nn.RMSNorm(moe.H)
        self.moe = moe
        self.per_rank = rdepc.distributed.is_per_rank(moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.mix_norm(x))
        h = self.moe_norm(x)
        if self.per_rank:  # a rank's block takes its own tokens, [T', H]
            return x + self.moe(h.reshape(-1, h.shape[-1])).view_as(h)
        return x + self.moe(h)


class MoELM(nn.Module):
    def __init__(
        self, spec: str, layers: int, device: str | None, seed: int, backend: str = "emulated", overrides=None
    ):
        super().__init__()
        seeds = [torch.Generator().manual_seed(seed + i) for i in range(layers)]
        moes = [rdepc.RDEPMoE(spec, backend=backend, device=device, generator=g, **(overrides or {})) for g in seeds]
        first = moes[0]
        self.W, self.T, self.H = first.W, first.T, first.H
        dtype = first.w_down.dtype  # the layer's; its router stays fp32
        device = first.w_down.device  # nvshmem: the GPU this rank runs on
        torch.manual_seed(seed)  # the non-MoE parameters
        self.embed = nn.Embedding(VOCAB, self.H)
        self.blocks = nn.ModuleList(Block(m) for m in moes)
        self.norm = nn.RMSNorm(self.H)
        self.head = nn.Linear(self.H, VOCAB)
        nn.init.zeros_(self.head.weight)  # the first loss: exactly log(VOCAB)
        nn.init.zeros_(self.head.bias)
        dense = [self.embed, self.norm, self.head, *(m for b in self.blocks for m in (b.mix_norm, b.mix, b.moe_norm))]
        for m in dense:  # the MoE blocks already are on the device, in their dtype with fp32 routers
            m.to(device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [W, T'] -> logits [W, T', V]
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class MarkovData:
    """A fixed random first-order Markov chain over VOCAB tokens: each token has 4 likely
    successors (most of the mass) and a little noise; batches are deterministic in ``seed``
    and ``rank`` (the chain is the same for every rank, its draws its own)."""

    def __init__(self, seed: int, rank: int = 0):
        g = torch.Generator().manual_seed(seed + 1000)
        logits = torch.full((VOCAB, VOCAB), -2.0)
        succ = torch.stack([torch.randperm(VOCAB, generator=g)[:4] for _ in range(VOCAB)])
        logits.scatter_(1, succ, torch.tensor([5.0, 3.0, 2.0, 1.0]).expand(VOCAB, 4))
        self.P = torch.softmax(logits, dim=-1)
        self.g = torch.Generator().manual_seed(seed + 2000 + 7919 * rank)

    def entropy(self) -> float:
        """The chain's mean conditional entropy (nats): the best loss a model can reach."""
        stat = torch.full((VOCAB,), 1.0 / VOCAB)
        for _ in range(200):
            stat = stat @ self.P
        return float(-(stat[:, None] * self.P * self.P.log()).sum())

    def batch(self, B: int, T: int) -> torch.Tensor:
        """[B, T + 1] tokens: inputs [:, :-1], targets [:, 1:]."""
        seq = torch.empty(B, T + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(VOCAB, (B,), generator=self.g)
        for t in range(T):
            seq[:, t + 1] = torch.multinomial(self.P[seq[:, t]], 1, generator=self.g).squeeze(1)
        return seq


def progress(i: int, n: int, loss: float | None, elapsed: float, width: int = 24) -> None:
    """One line on stderr, rewritten in place: the bar, step i/n, loss, elapsed, s/step."""
    done = round(width * i / n)
    bar = "#" * done + "-" * (width - done)
    shown = "-" if loss is None else f"{loss:.4f}"
    rate = f"{elapsed / i:.2f}" if i else "-"
    sys.stderr.write(f"\r[{bar}] step {i}/{n}  loss {shown}  {elapsed:.0f} s  {rate} s/step ")
    sys.stderr.flush()


def summarize(stats: dict | None) -> str:
    if stats is None:
        return "no stats"
    rows = stats.get("rows_per_expert")
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else rows
    cap = stats.get("capacity")
    return f"rows per expert {rows}, dropped rows {stats.get('dropped_rows')}, capacity {cap or 'dropless'}"


def digest(params) -> str:
    """A digest of the parameters' exact bytes."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_checks(model: MoELM, world: int) -> list[str]:
    """What is wrong with the ranks' models after training (nothing: []): the replicated
    parameters must be identical on every rank, and no two ranks may hold the same expert
    weights. Collective: every rank gathers every rank's digests and gives the same answer."""
    import torch.distributed as dist

    mine = {
        "dense": digest(p for _, p in rdepc.distributed.dense_parameters(model)),
        "experts": [digest(p for _, p in rdepc.distributed.expert_parameters(b.moe)) for b in model.blocks],
    }
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    problems = []
    if len({d["dense"] for d in every}) != 1:
        problems.append("the replicated (dense) parameters differ across ranks")
    for j in range(len(model.blocks)):
        if len({d["experts"][j] for d in every}) != world:
            problems.append(f"block {j}: two ranks hold the same expert weights")
    return problems


def make_parser() -> argparse.ArgumentParser:
    """The command line: the spec and its overrides, the backend and device, the run's sizes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="examples/tiny.rdep", help="the layer's .rdep file (default: %(default)s)")
    ap.add_argument(
        "--backend",
        choices=("emulated", "emulated-mp", "nvshmem"),
        default="emulated",
        help="emulated: every rank in this process; emulated-mp (CPU) and nvshmem (GPUs): one process per rank, "
        "under torchrun --nproc-per-node W",
    )
    ap.add_argument(
        "-D",
        "--define",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one of the spec's params (e.g. -D W=2), as rdepc's own -D",
    )
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), help="cpu (the Triton interpreter; the default) or cuda (nvshmem: its GPU)"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2, help="MoE blocks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write {losses, steps, device, spec, seconds} here")
    return ap


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """The checked arguments, ``device`` settled for the backend, and the spec's overrides."""
    ap = make_parser()
    args = ap.parse_args(argv)
    if args.steps < 1 or args.layers < 1:
        ap.error("--steps and --layers must be at least 1")
    if args.backend == "nvshmem":  # its GPU: the one NVSHMEM picks for the rank
        if args.device == "cpu":
            ap.error("--backend nvshmem runs on GPUs: leave out --device cpu")
        args.device = "cuda"
    elif args.backend == "emulated-mp" and args.device == "cuda":
        ap.error("--backend emulated-mp runs on the CPU (its heap is host shared memory): use nvshmem on GPUs")
    args.device = args.device or "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda{' (nvshmem)' if args.backend == 'nvshmem' else ''}: no CUDA device is available")
    try:
        overrides = dict(parse_override(d) for d in args.define)
    except rdepc.UsageError as e:
        ap.error(str(e))
    return args, overrides


def spec_path(spec: str) -> Path:
    """The spec file: as given, else relative to the repository's root."""
    path = Path(spec)
    if not path.exists() and (ROOT / path).exists():  # the default, from any directory
        path = ROOT / path
    return path


@dataclass(frozen=True)
class Run:
    """The model and where this process stands: ``net`` is what a step calls (the model, or
    its DDP wrapper on a per-rank backend)."""

    model: MoELM
    net: nn.Module
    rank: int
    world: int
    per_rank: bool

    @property
    def lead(self) -> bool:
        return self.rank == 0  # it prints; every rank checks


def distribute(model: MoELM, per_rank: bool) -> Run:
    """On a per-rank backend: this process's rank, and the model wrapped for data parallelism."""
    if not per_rank:
        return Run(model, model, 0, 1, per_rank)
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    net = rdepc.distributed.data_parallel(model)  # the replicated parameters DDP's; the experts each rank's own
    return Run(model, net, rank, world, per_rank)


def print_header(args: argparse.Namespace, run: Run, data: MarkovData) -> None:
    """The layer, the parameter count, the batch, and the losses to compare against."""
    model, world, per_rank = run.model, run.world, run.per_rank
    n_params = sum(p.numel() for p in model.parameters())
    where = f", {world} processes (one per rank)" if per_rank else ""
    print(
        f"{args.layers} x {model.blocks[0].moe!r}{where}\n"
        f"{n_params} parameters{' on rank 0' if per_rank else ''}, batch [W={model.W}, T'={model.T}] tokens, "
        f"vocab {VOCAB}, entropy floor {data.entropy():.3f}, uniform {math.log(VOCAB):.3f}",
        flush=True,
    )


def rank_mean(loss: torch.Tensor, world: int) -> torch.Tensor:
    """The objective DDP's gradients are for: the mean of the ranks' losses."""
    import torch.distributed as dist

    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= world
    return mean


def train(args: argparse.Namespace, run: Run, data: MarkovData) -> tuple[list[float], float]:
    """AdamW for ``args.steps`` steps, a fresh batch each: the losses and the seconds they took."""
    model = run.model
    device = model.blocks[0].moe.w_down.device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    B = 1 if run.per_rank else model.W  # sequences per process: one per rank
    losses: list[float] = []
    start = time.perf_counter()
    if run.lead:
        progress(0, args.steps, None, 0.0)
    for i in range(args.steps):
        seq = data.batch(B, model.T).to(device)
        logits = run.net(seq[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = rank_mean(loss, run.world) if run.per_rank else loss.detach()
        losses.append(mean.item())
        if run.lead:
            progress(i + 1, args.steps, losses[-1], time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if run.lead:
        sys.stderr.write("\n")
    return losses, seconds


def report(args: argparse.Namespace, run: Run, losses: list[float], seconds: float, problems: list[str]) -> None:
    """The blocks' routing, the ranks' checks and the loss, on stdout; the ``--json`` record."""
    per_rank = run.per_rank
    for j, b in enumerate(run.model.blocks):
        print(f"block {j}{' (rank 0)' if per_rank else ''}: {summarize(b.moe.last_stats)}")
    if args.json:
        out = {"losses": losses, "steps": args.steps, "device": args.device, "spec": args.spec, "seconds": seconds}
        if per_rank:
            out |= {"backend": args.backend, "ranks": run.world}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    for problem in problems:
        print(problem)
    if per_rank and not problems:
        print(f"{run.world} ranks: each holds its own experts, the replicated parameters identical on every rank")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps ({seconds:.0f} s)")


def verdict(losses: list[float], lead: bool) -> int:
    """0 when every loss is finite and the mean of the last 3 is below that of the first 3, else 1."""
    k = min(3, len(losses))
    head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if not all(math.isfinite(v) for v in losses):
        if lead:
            print("the loss is not finite", file=sys.stderr)
        return 1
    if not tail < head:
        if lead:
            print(f"the loss did not fall: mean of the last {k} {tail:.4f} >= mean of the first {k} {head:.4f}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Build the model, train it and report: the exit status (0: the loss fell)."""
    args, overrides = parse_args(argv)
    torch.manual_seed(args.seed)
    try:  # a per-rank backend joins the process group here (torchrun's environment)
        model = MoELM(str(spec_path(args.spec)), args.layers, args.device, args.seed, args.backend, overrides)
    except (rdepc.UsageError, rdepc.SpecError, RanksError) as e:
        print(f"train_moe: {e}", file=sys.stderr)
        return 2
    run = distribute(model, per_rank=args.backend != "emulated")
    data = MarkovData(args.seed, run.rank)
    if run.lead:
        print_header(args, run, data)

    losses, seconds = train(args, run, data)
    problems = rank_checks(model, run.world) if run.per_rank else []
    if run.lead:
        report(args, run, losses, seconds, problems)
    if problems:
        return 1
    return verdict(losses, run.lead)


def leave_process_group() -> None:
    """Per rank: leave the process group together and explicitly. A rank whose process ends
    first, with the group still alive, leaves its peers' gloo threads to be torn down at
    interpreter exit, which can abort them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_before_teardown(status: list[int]) -> None:
    """Registered first, so run last of the exit handlers (NVSHMEM's finalize among them):
    leave with ``status[0]`` before the interpreter tears down C++ statics. Wrapped in
    DistributedDataParallel, a gloo group keeps its threads after destroy_process_group
    (torch 2.13), and tearing them down with the statics can abort a finished run
    ("terminate called without an active exception": 1 run in 7, two at once on 2 cores)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status[0])


if __name__ == "__main__":
    status = [1]  # what an uncaught error leaves (its traceback is printed before the handlers)
    atexit.register(exit_before_teardown, status)
    status[0] = main()
    leave_process_group()
    sys.exit(status[0])
