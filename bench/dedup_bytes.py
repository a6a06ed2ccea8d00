"""What ``dedup`` saves on the wire: Moonlight's routing (E = 64 over W = 8 owners, K = 6),
narrowed to T tokens per rank, run with and without dedup on uniform and zipf routings.

    python bench/dedup_bytes.py --out bench/results/dedup_cpu            # CPU: the interpreter
    python bench/dedup_bytes.py --device cuda --tokens 4096 --out ...    # a GPU, Moonlight's T

Rows and bytes are what the kernels' dispatch and return tasks counted (``last_stats``:
``dispatched_rows``, ``returned_rows``), priced by the planner's byte model
(``passes.transport.transport_bytes``), beside the planner's prediction for the routing: the
uniform expectation Σ_q 1 − C(E − E_q, K)/C(E, K) owners per token, and the exact count of
distinct (token, owner) pairs of the accepted set (``rdepc.reference.owner_pairs``). Byte
counts do not depend on the device; the interpreter runs a narrowed H and F. Writes OUT.json
and OUT.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # `from bench import ...`; an installed rdepc stays first

from bench.moe_bench import environment, write_results  # noqa: E402


def measure(dedup: bool, routing: str, tokens: int, hidden: int, ffn: int, device: str) -> dict:
    import torch
    from rdepc.passes.sampled_routing import owners_per_token_expr
    from rdepc.passes.transport import transport_bytes
    from rdepc.runtime.tensors import TORCH_DTYPES, max_relative_error

    from rdepc.api import Layer, elaborate_layer
    from rdepc.parser import parse_text
    from rdepc.reference import owner_pairs, random_inputs, reference_for

    text = (ROOT / "examples" / "moonlight.rdep").read_text(encoding="utf-8")
    if dedup:
        text = text.replace("transport nvshmem", "transport nvshmem, dedup")
    overrides = {"T": tokens, "H": hidden, "F": ffn}
    spec, warnings = elaborate_layer(parse_text(text, "moonlight.rdep"), None, overrides)
    layer = Layer(spec, warnings)
    sh = layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    dtype = spec.precision.dtype.value
    inputs = random_inputs(W, T, H, F, E, K, routing=routing, seed=0, dtype=TORCH_DTYPES[dtype], device=device)
    kernels = layer.module("emulated", device)
    with torch.no_grad():
        y = kernels(*inputs)
    st = kernels.last_stats
    f32 = [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs]
    ref, _ = reference_for(spec)(*f32)
    sent, back = int(st["dispatched_rows"].sum()), int(st["returned_rows"].sum())
    accepted = int(st["accepted"].sum())
    out, ret = transport_bytes(spec, sent, accepted, back)
    owners = float(owners_per_token_expr(E, K, spec.ownership.experts_per_rank(W)))
    return {
        "dedup": dedup,
        "routing": routing,
        "W": W,
        "T": T,
        "H": H,
        "F": F,
        "E": E,
        "K": K,
        "accepted_route_rows": accepted,
        "token_owner_pairs": owner_pairs(inputs.topk_ids.cpu(), st["accepted"].cpu(), spec.ownership.owner),
        "dispatched_rows": sent,
        "returned_rows": back,
        "dispatch_bytes": int(out),
        "return_bytes": int(ret),
        "uniform_redundant": 1 - owners / K,
        "max_rel_err": max_relative_error(y.cpu(), ref.cpu()),
    }


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    routings = list(dict.fromkeys(r["routing"] for r in runs))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.2
    for j, (key, what) in enumerate((("dispatch_bytes", "dispatch"), ("return_bytes", "return"))):
        for d, dedup in enumerate((False, True)):
            vals = [next(r[key] for r in runs if r["routing"] == g and r["dedup"] == dedup) / 1e3 for g in routings]
            xs = [i + (2 * j + d - 1.5) * width for i in range(len(routings))]
            ax.bar(xs, vals, width, label=f"{what}{', dedup' if dedup else ''}", alpha=0.55 if not dedup else 1.0)
    ax.set_xticks(range(len(routings)), routings)
    ax.set_ylabel("kB per layer call, all front-ends")
    r0 = runs[0]
    ax.set_title(f"Moonlight routing (W={r0['W']}, E={r0['E']}, K={r0['K']}), T={r0['T']}, H={r0['H']}: bytes moved")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=32, help="T per rank (default 32)")
    ap.add_argument("--hidden", type=int, default=64, help="H (default 64; Moonlight's is 2048)")
    ap.add_argument("--ffn", type=int, default=64, help="F (default 64; Moonlight's is 1408)")
    ap.add_argument("--out", default="build/bench/dedup", help="writes OUT.json and OUT.png")
    args = ap.parse_args(argv)
    import torch

    runs = []
    for routing in ("uniform", "zipf:1.2"):
        for dedup in (False, True):
            r = measure(dedup, routing, args.tokens, args.hidden, args.ffn, args.device)
            saved = 1 - r["dispatched_rows"] / r["accepted_route_rows"]
            print(
                f"{routing:9} dedup {'on ' if dedup else 'off'}: {r['dispatched_rows']} rows out, "
                f"{r['returned_rows']} back, {r['dispatch_bytes']:,} B out, {r['return_bytes']:,} B back "
                f"({100 * saved:.1f} % fewer rows; uniform predicts {100 * r['uniform_redundant']:.1f} %), "
                f"max rel. error {r['max_rel_err']:.3g}",
                flush=True,
            )
            runs.append(r)
    results = {"environment": environment(torch.device(args.device)), "runs": runs}
    write_results(results, Path(args.out), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
