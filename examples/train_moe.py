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
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import rdepc

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.mix_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoELM(nn.Module):
    def __init__(self, spec: str, layers: int, device: str, seed: int):
        super().__init__()
        moes = [
            rdepc.RDEPMoE(spec, device=device, generator=torch.Generator().manual_seed(seed + i)) for i in range(layers)
        ]
        first = moes[0]
        self.W, self.T, self.H = first.W, first.T, first.H
        dtype = first.w_down.dtype  # the layer's; its router stays fp32
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
    successors (most of the mass) and a little noise; batches are deterministic in ``seed``."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed + 1000)
        logits = torch.full((VOCAB, VOCAB), -2.0)
        succ = torch.stack([torch.randperm(VOCAB, generator=g)[:4] for _ in range(VOCAB)])
        logits.scatter_(1, succ, torch.tensor([5.0, 3.0, 2.0, 1.0]).expand(VOCAB, 4))
        self.P = torch.softmax(logits, dim=-1)
        self.g = torch.Generator().manual_seed(seed + 2000)

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="examples/tiny.rdep", help="the layer's .rdep file (default: %(default)s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: the Triton interpreter")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2, help="MoE blocks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write {losses, steps, device, spec, seconds} here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.layers < 1:
        ap.error("--steps and --layers must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")

    spec = Path(args.spec)
    if not spec.exists() and (ROOT / spec).exists():  # the default, from any directory
        spec = ROOT / spec

    torch.manual_seed(args.seed)
    model = MoELM(str(spec), args.layers, args.device, args.seed)
    data = MarkovData(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    W, T = model.W, model.T
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.layers} x {model.blocks[0].moe!r}\n"
        f"{n_params} parameters, batch [W={W}, T'={T}] tokens, vocab {VOCAB}, "
        f"entropy floor {data.entropy():.3f}, uniform {math.log(VOCAB):.3f}",
        flush=True,
    )

    losses: list[float] = []
    start = time.perf_counter()
    progress(0, args.steps, None, 0.0)
    for i in range(args.steps):
        seq = data.batch(W, T).to(args.device)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        progress(i + 1, args.steps, losses[-1], time.perf_counter() - start)
    seconds = time.perf_counter() - start
    sys.stderr.write("\n")

    for j, b in enumerate(model.blocks):
        print(f"block {j}: {summarize(b.moe.last_stats)}")
    if args.json:
        out = {"losses": losses, "steps": args.steps, "device": args.device, "spec": args.spec, "seconds": seconds}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps ({seconds:.0f} s)")

    k = min(3, len(losses))
    head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if not all(math.isfinite(v) for v in losses):
        print("the loss is not finite", file=sys.stderr)
        return 1
    if not tail < head:
        print(f"the loss did not fall: mean of the last {k} {tail:.4f} >= mean of the first {k} {head:.4f}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
