"""The GEMM main loops of rdepc's sm_90 builds beside the lean grouped GEMM's (no GPU needed).

    python bench/gemm_loops.py --out bench/results/gemm-loops-sm90

compiles each example's kernels for sm_90 as ``rdepc compile --target sm_90`` does (its own
schedule, the tiles a native launch takes, an H100's grid), reads every GEMM main loop from
the SASS (``codegen/sass.py``: instructions per iteration, spills inside, wgmma wait depth,
R2UR) and the kernels' registers, stack, shared memory and CTAs per SM, and compiles the
yardstick (``bench/lean_gemm.py``) at the same tiles; the GEMM kernel also as generated
for one process per rank (``emulated-mp``, as ``nvshmem``'s). It writes ``OUT.json`` and
``OUT.md``.

``--label L --append`` adds the rows of the rdepc this interpreter imports under label L to
an existing ``OUT.json`` (e.g. an earlier commit's, installed elsewhere and put first on
PYTHONPATH); the loops are always read by this tree's ``codegen/sass.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("moonlight", "qwen3_30b_a3b")
PER_RANK = ["rdep_gemm", "rdep_gemm.forward", "rdep_gemm.backward"]
TARGET = 1.10  # the bound: a GEMM loop within 10 % of the yardstick's instructions per iteration


def _sass():
    """This tree's codegen/sass.py, whatever rdepc the interpreter imports."""
    spec = importlib.util.spec_from_file_location("rdepc_tree_sass", ROOT / "codegen" / "sass.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def rdepc_rows(examples: list[str], label: str, backend: str = "emulated", kernels=None) -> list[dict]:
    """One row per (example, build) of the rdepc this interpreter imports, generated for
    ``backend`` (``kernels``: those builds only)."""
    from rdepc.codegen import write_module
    from rdepc.codegen.sm90 import compile_cubins

    import rdepc
    from rdepc.driver import generate_spec

    sass = _sass()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for name in examples:
            out = Path(tmp) / name
            out.mkdir()
            cwd = Path.cwd()
            os.chdir(ROOT)  # the header names the spec by the path it was loaded from
            try:
                write_module(generate_spec(rdepc.load(f"examples/{name}.rdep").spec, backend=backend), out)
            finally:
                os.chdir(cwd)
            jobs.append((out / f"{name}_kernels.py", out / f"{name}.contract.json", out))
        for r in compile_cubins(jobs, arch=90, parallel=min(2, os.cpu_count() or 1), kernels=kernels):
            threads = r.get("threads") or 32 * r["tiles"]["num_warps"]
            text = sass.disassemble(r["cubin"])
            loops = [loop.as_dict() for loop in sass.gemm_loops(text)]
            row_loops = [{"kind": "move", **asdict(loop)} for loop in sass.move_loops(text)]
            row_loops += [{"kind": "sum", **asdict(loop)} for loop in sass.sum_loops(text)]
            rows.append(
                {
                    "label": label,
                    "layer": r["layer"],
                    "kernel": r["kernel"],
                    "registers": r["registers"],
                    "stack": r["stack"],
                    "local_bytes": r["local_bytes"],
                    "shared": r["shared"],
                    "ctas_per_sm": sass.ctas_per_sm(r["registers"], r["shared"], threads),
                    "loops": loops,
                    "threads": threads,
                    "row_loops": row_loops,  # the transport's moves and combine
                }
            )
    return rows


def yardstick_rows() -> list[dict]:
    """The lean grouped GEMM at GEMM1's and GEMM2's tiles (moonlight's K and N)."""
    sys.path.append(str(ROOT))  # an installed rdepc stays first
    from bench.lean_gemm import compile_sass

    rows = []
    for K, N, BN in ((2048, 2816, 256), (1408, 2048, 128)):
        r = compile_sass(K, N, BN=BN)
        rows.append({"label": "yardstick", "layer": "-", **r})
    return rows


def markdown(data: dict) -> str:
    """The table of ``data`` (OUT.json), one line per GEMM loop."""
    yard = {loop["shapes"][0]: loop["instructions"] for r in data["yardstick"] for loop in r["loops"][:1]}
    lines = [
        "# GEMM main loops, sm_90 SASS (compiled without a GPU)",
        "",
        f"Triton {data['triton']}; tiles BM 128, GEMM1 2·128 columns, GEMM2 128, BK 64, 8 warps, 3 stages. "
        "Instructions per loop iteration against the lean grouped GEMM at the same tile shape "
        f"(`bench/lean_gemm.py`); the issue's bound is {TARGET:.2f}×.",
        "",
        "| build | layer | kernel | regs | stack B | shared B | CTAs/SM | loop shape | instr/iter | × yardstick "
        "| R2UR | spills | wait depth |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in [*data["yardstick"], *data["rows"]]:
        for loop in r["loops"] or [None]:
            if loop is None:
                cells = ["-"] * 6
            else:
                shape = loop["shapes"][0] if loop["shapes"] else "?"
                ratio = loop["instructions"] / yard[shape] if shape in yard else float("nan")
                spills = loop["spill_loads"] + loop["spill_stores"]
                cells = [shape, loop["instructions"], f"{ratio:.2f}", loop["r2ur"], spills, loop["wait_depth"]]
            head = [r["label"], r["layer"], r["kernel"], r["registers"], r["stack"], r["shared"], r["ctas_per_sm"]]
            lines.append("| " + " | ".join(str(c) for c in [*head, *cells]) + " |")
    lines += [
        "",
        "## Row loops: rows copied (move: the transport's dispatch, return, unpack; the GEMM kernel's kept "
        "input rows) or summed (sum: the combine)",
        "",
        "128-bit loads a thread per iteration, and how many of them issue before the first FMA or 128-bit "
        "store waits for one: what a program has in flight (× 16 B × its threads) before a round trip.",
        "",
        "| build | layer | kernel | loop | loads a thread | ahead | KB in flight a program | spills |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        for loop in r.get("row_loops", []):
            kb = loop["loads_ahead"] * 16 * r["threads"] / 1024
            spills = loop["spill_loads"] + loop["spill_stores"]
            cells = [r["label"], r["layer"], r["kernel"], loop["kind"], loop["loads"], loop["loads_ahead"], f"{kb:g}"]
            lines.append("| " + " | ".join(str(c) for c in [*cells, spills]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="OUT: writes OUT.json and OUT.md")
    ap.add_argument("--examples", nargs="+", default=list(EXAMPLES))
    ap.add_argument("--label", default="this tree", help="the rows' label")
    ap.add_argument("--append", action="store_true", help="add the rows to OUT.json instead of starting it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.append:
        data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    else:
        import triton

        data = {"triton": triton.__version__, "yardstick": yardstick_rows(), "rows": []}
    data["rows"] += rdepc_rows(args.examples, args.label)
    # the GEMM kernel as one process per rank runs it (its rows through descriptors of its own)
    data["rows"] += rdepc_rows(args.examples, f"{args.label} (per rank)", "emulated-mp", PER_RANK)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(data), encoding="utf-8")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
