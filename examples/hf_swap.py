"""Swap the MoE blocks of a small, randomly initialised transformers Mixtral for rdepc blocks.

    python examples/hf_swap.py            # CPU, under the Triton interpreter
    python examples/hf_swap.py --dtype bf16

Builds the model from a config (nothing is downloaded), runs it, replaces every sparse MoE
block with ``rdepc.hf.swap`` (the same weights, the routed experts run by rdepc's compiled
kernels), runs it again on the same tokens and prints how far the logits moved. Needs
transformers 5.x (``pip install 'transformers>=5.0'``, or rdepc's test extras).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# transformers imports Triton, and a process keeps Triton's first mode: on the CPU, the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

try:
    import transformers
except ImportError:
    sys.exit("examples/hf_swap.py needs transformers, which is not installed: pip install 'transformers>=5.0'")

from rdepc.hf import swap

SPEC = """\
layer small_mixtral {
  shape     ranks 2, tokens 16, hidden 64, experts 4, top 2
  expert    swiglu(ffn = 128)
  router    softmax, renormalize
  dtype     DTYPE
  schedule  bulk
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval().to(dtype)
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = model(tokens).logits.float()
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "small_mixtral.rdep"
        spec.write_text(SPEC.replace("DTYPE", args.dtype))
        swapped = swap(model, spec)
    with torch.no_grad():
        after = model(tokens).logits.float()
    err = ((after - before).abs().max() / before.abs().max()).item()
    print(f"swapped {len(swapped)} blocks: {', '.join(swapped)}")
    print(f"logits max relative difference: {err:.2e} ({args.dtype})")


if __name__ == "__main__":
    main()
