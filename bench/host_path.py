"""A call's host time before its kernels run, measured without a GPU.

    python bench/host_path.py --out bench/results/host-path-cpu

On a GPU a call's host work sits between the start of a call and its first kernel: what the
module does (checks, outputs allocated, arguments gathered) and what launching its kernels
costs. This measures both on the CPU, for moonlight (narrowed to T = 128 tokens: the host
path does not depend on T, and the CPU fills the call's small outputs, which a GPU queues,
in a few microseconds) in every kernel mode, with the tiles, grid and spin bound of a
native launch on an H100, the median of REPS calls:

* ``module_us``: a forward call through ``routed`` with the launcher replaced by one that
  records its launches (under the interpreter: the module's own work, no kernel run);
* in a second process, which runs Triton natively with a stand-in driver (an H100 that
  launches nothing: the builds are compiled for sm_90, their CUDA launch is a no-op),
  per call: ``triton_launch_us`` (each launch through Triton's ``kernel[grid](...)``),
  ``build_launch_us`` (through ``runtime.launch.Build``, what the launcher runs once a
  build is prepared) and ``prepared_key_us`` (the launcher's lookup of the build).

What it leaves out: the CUDA driver's own work (the launch, argument copies, stream events),
torch's caching allocator on a device, the readback queued after the kernels.
``--module-only`` measures the module's side alone (seconds, nothing compiled): on a GPU
machine, how fast its host runs the same Python. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("unified", "split", "phased")
TOKENS = 128
REPS = 1000


def _per_call_us(fn, reps: int) -> float:
    """The median of ``reps`` timed calls of ``fn``, after ten untimed ones."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e6


class _Recorder:
    """A launcher that records each call's launches and runs nothing."""

    def __init__(self):
        self.launches, self.calls = 0, []

    def __call__(self, launches):
        self.launches += len(launches)
        self.calls.append(launches)


def module_side(mode: str, reps: int, calls_path: Path) -> dict:
    """The module's own host time per forward call in ``mode``; its launches saved to ``calls_path``."""
    import torch
    from rdepc.runtime.tensors import gemm1_operand

    import rdepc
    from rdepc.ir.contract import H100_SMS, NATIVE_SPIN_BOUND, Tiles
    from rdepc.reference import random_inputs

    layer = rdepc.load(ROOT / "examples" / "moonlight.rdep", T=TOKENS)
    sh = layer.shapes
    W, H, F, E, K = (sh[k] for k in ("W", "H", "F", "E", "K"))
    tiles = Tiles.default(H, F, layer.spec.precision.dtype.value, interpret=False)
    module = layer.module(
        "emulated", "cpu", schedule="bulk", tiles=tiles, programs=H100_SMS, spin_bound=NATIVE_SPIN_BOUND, mode=mode
    )
    module.launcher = recorder = _Recorder()
    module._record = lambda *a, **k: None  # the control words: read after the kernels, natively queued
    x, ids, gates, wg, wu, wd = random_inputs(
        W, TOKENS, H, F, E, K, routing="uniform", seed=0, dtype=torch.bfloat16, gated=True
    )
    operand = gemm1_operand(wg, wu)
    us = _per_call_us(lambda: module.routed(x, ids, gates, operand, wd), reps)
    recorder.calls.clear()
    module.routed(x, ids, gates, operand, wd)  # one call's launches (phased mode: three, one at a time)
    launches = [
        (fn.fn.__name__, g, [_shell(a) for a in args], meta | {"CAST_F32": False})
        for c in recorder.calls
        for fn, g, args, meta in c
    ]
    torch.save({"path": str(module.kernels_path), "launches": launches}, calls_path)
    return {"mode": mode, "kernels": [name for name, _, _, _ in launches], "module_us": us}


class _Shell(tuple):
    """A tensor argument as a launch sees it (dtype, size, strides, offset into a storage of
    ``nbytes``), not its values: no launch here runs. Saved, moonlight's weights were 1.1 GB
    a mode to write and read back."""


def _shell(arg):
    import torch

    if not isinstance(arg, torch.Tensor):
        return arg
    return _Shell((arg.dtype, tuple(arg.shape), arg.stride(), arg.storage_offset(), arg.untyped_storage().nbytes()))


def _tensor(arg):
    """A tensor of the shell's layout over a fresh storage, as aligned as the module's own
    (``torch.empty``): the same specialisation."""
    import torch

    if not isinstance(arg, _Shell):
        return arg
    dtype, size, stride, offset, nbytes = arg
    storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def launch_side(calls_path: Path, reps: int) -> dict:
    """In a process of its own (Triton native): per call, Triton's launch, the build's launch
    and the launcher's build lookup, the CUDA launch a no-op."""
    import torch
    from rdepc.codegen.sm90 import stand_in_driver
    from rdepc.runtime.launch import Build, constexpr_tail, prepared_key

    from rdepc.toolchain import import_kernels

    stand_in_driver()  # an H100 that runs nothing
    record = torch.load(calls_path, weights_only=False)
    kernels = import_kernels(record["path"], interpret=False)
    runs = []
    for name, grid, shells, meta in record["launches"]:
        kernel, args = getattr(kernels, name), [_tensor(a) for a in shells]
        compiled = kernel.warmup(*args, grid=grid, **meta)
        compiled.module, compiled.function = 1, 0  # loaded, as far as Triton can tell
        compiled._run = lambda *a: None
        runs.append((kernel, grid, args, meta, Build(compiled, constexpr_tail(kernel, args, meta))))

    def triton_launch():
        for kernel, grid, args, meta, _ in runs:
            kernel[grid](*args, **meta)

    def build_launch():
        for _, grid, args, _, build in runs:
            build.launch(grid, args)

    def lookup():
        for kernel, grid, args, meta, _ in runs:
            prepared_key(kernel, grid, args, meta)

    return {
        "triton_launch_us": _per_call_us(triton_launch, reps),
        "build_launch_us": _per_call_us(build_launch, reps),
        "prepared_key_us": _per_call_us(lookup, reps),
    }


def measure(reps: int, module_only: bool = False) -> dict:
    import torch

    from bench.moe_bench import environment

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            calls = Path(tmp) / f"{mode}.pt"
            row = module_side(mode, reps, calls)
            if module_only:
                rows.append(row)
                print(f"{mode}: module {row['module_us']:.0f} us", flush=True)
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--launch-side", str(calls), "--reps", str(reps)],
                capture_output=True, text=True, cwd=ROOT, timeout=1800, check=False,
            )  # fmt: skip
            if out.returncode:
                raise RuntimeError(f"the launch side of {mode} failed:\n{out.stderr[-3000:]}")
            row |= json.loads(out.stdout.strip().splitlines()[-1])
            row["call_us"] = row["module_us"] + row["prepared_key_us"] + row["build_launch_us"]
            rows.append(row)
            ours = row["prepared_key_us"] + row["build_launch_us"]
            print(f"{mode}: module {row['module_us']:.0f} us, launches {row['triton_launch_us']:.0f} us through "
                  f"Triton, {ours:.0f} us through the builds", flush=True)  # fmt: skip
    env = environment(torch.device("cpu"))
    return {"layer": "examples/moonlight.rdep", "tokens": TOKENS, "schedule": "bulk", "reps": reps, "env": env,
            "rows": rows}  # fmt: skip


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [
        "# A call's host time before its kernels, on the CPU",
        "",
        f"{env['device']}; Python {env['python']}, torch {env['torch']}, triton {env['triton']}; "
        f"{result['layer']} at T = {result['tokens']}, {result['schedule']}, an H100's grid and tiles; "
        f"µs per call, the median of {result['reps']}. Triton's launches run with a stand-in driver (the builds "
        "compiled for sm_90, their CUDA launch a no-op): the driver's own work is not in these figures.",
        "",
        "| mode | kernels launched | module | launches through Triton | launches through the builds (lookup + launch) "
        "| call (module + builds) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "call_us" not in r:  # --module-only
            lines.append(f"| {r['mode']} | {', '.join(r['kernels'])} | {r['module_us']:.0f} | - | - | - |")
            continue
        ours = r["prepared_key_us"] + r["build_launch_us"]
        lines.append(
            f"| {r['mode']} | {', '.join(r['kernels'])} | {r['module_us']:.0f} | {r['triton_launch_us']:.0f} "
            f"| {ours:.0f} ({r['prepared_key_us']:.0f} + {r['build_launch_us']:.0f}) | {r['call_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--module-only", action="store_true", help="the module's side only: no sm_90 builds")
    ap.add_argument("--launch-side", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.append(str(ROOT))  # `from bench import ...` as a script; an installed rdepc stays first
    if a.launch_side is not None:
        print(json.dumps(launch_side(a.launch_side, a.reps)))
        return 0
    result = measure(a.reps, a.module_only)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        a.out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
        print(f"wrote {a.out.with_suffix('.json')} and {a.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
