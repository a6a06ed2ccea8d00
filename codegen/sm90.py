"""Compile generated kernels to sm_90 cubins without a GPU (docs: toolchain-facts §3).

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` builds a cubin on a
machine with no GPU and no driver. It runs in a fresh subprocess (``python -m
rdepc.codegen.sm90``): Triton fixes its mode when it is first imported (see
``rdepc.runtime.launch``), so a process that has run the interpreter cannot compile
natively, and the subprocess imports the generated file with ``TRITON_INTERPRET=0`` —
the very file the interpreter tests import. Jobs are batched so one subprocess (one
``import torch, triton``) compiles many layers; each distinct kernel compiles once.

A result records the cubin's path, the compile time, the shared memory the kernel needs
(an H100 gives a block at most 227 KiB), registers per thread and local memory (spills)
read from the cubin (``cuobjdump --dump-resource-usage``, bundled with Triton), and a few
facts read from the PTX: the target, the ``wgmma`` shapes of the grouped GEMMs, whether
their operands arrive by TMA (``cp.async.bulk.tensor``), the acquire loads and release
atomics of the flag protocol, and whether NVSHMEM's device code is in it. Kernels generated for the
``nvshmem`` transport are linked against NVSHMEM's device bitcode (``extern_libs``), which
needs the ``nvidia-nvshmem-cu13`` wheel but no GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rdepc.codegen.emit import kernel_args
from rdepc.codegen.lower import KernelPlan, Tiles

# The kernels of one generated file: rdep_layer's forward in each kernel mode (constexprs),
# keeping what a backward walks (SAVE), and its backward pass.
KERNELS = {
    "rdep_layer": {"ROLE_SPLIT": False, "BACKWARD": False, "SAVE": True},
    "rdep_layer.role_split": {"ROLE_SPLIT": True, "BACKWARD": False, "SAVE": True},
    "rdep_layer.backward": {"ROLE_SPLIT": False, "BACKWARD": True, "SAVE": False},
}
H100_SHARED = 227 * 1024


def cubin_name(layer: str, kernel: str, arch: int) -> str:
    return f"{layer}.{kernel}.sm_{arch}.cubin"


def compile_cubins(
    jobs: list[tuple[Path, Path, Path]],
    arch: int = 90,
    parallel: int = 1,
    timeout: float = 900,
    profile: bool = False,
) -> list[dict]:
    """Compile every kernel of each (kernels.py, plan.json, out_dir) job, in ``parallel``
    subprocesses (jobs dealt round-robin); results in job order. ``profile``: with the
    profile's %globaltimer stamps compiled in."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    batches = [list(range(i, len(jobs), parallel)) for i in range(min(parallel, len(jobs)))]
    procs = []
    for batch in batches:
        payload = json.dumps({"arch": arch, "profile": profile, "jobs": [[str(x) for x in jobs[i]] for i in batch]})
        cmd = [sys.executable, "-m", "rdepc.codegen.sm90"]
        p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        procs.append((batch, p, payload))
    results: dict[int, list[dict]] = {}
    errors = []
    for batch, p, payload in procs:
        out, err = p.communicate(payload, timeout=timeout)
        if p.returncode != 0:
            errors.append(err.strip()[-4000:])
            continue
        per_job = json.loads(out.strip().splitlines()[-1])
        for i, r in zip(batch, per_job, strict=True):
            results[i] = r
    if errors:
        raise RuntimeError(f"rdepc: compiling for sm_{arch} failed:\n" + "\n".join(errors))
    return [r for i in range(len(jobs)) for r in results[i]]


def resources(cubin: Path) -> dict:
    """Registers per thread and local memory per thread (spill slots, stack) of a cubin's
    kernel, from ``cuobjdump --dump-resource-usage``."""
    from triton import knobs

    text = subprocess.run(
        [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text))
    return {
        "registers": int(got.get("REG", -1)),
        "local_bytes": int(got.get("LOCAL", -1)),
        "stack": int(got.get("STACK", -1)),
    }


def _compile(kernels_path: str, plan_path: str, out_dir: str, arch: int, profile: bool = False) -> list[dict]:
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    plan = KernelPlan.from_json(Path(plan_path).read_text(encoding="utf-8"))
    name = f"rdepc_sm{arch}_{plan.layer}_{abs(hash(kernels_path))}"
    spec = importlib.util.spec_from_file_location(name, kernels_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    tiles = Tiles.default(plan.H, plan.F, plan.dtype, interpret=False)
    constexprs = tiles.constexprs() | {"CAST_F32": False, "PROFILE": profile, "GLOBALTIMER": profile}
    options: dict = {"num_warps": tiles.num_warps}
    if plan.transport == "nvshmem":
        # The nvshmem transport's device half calls nvshmem_ptr: link NVSHMEM's bitcode.
        from rdepc.runtime.nvshmem import EXTERN_LIB, bitcode_path

        options["extern_libs"] = {EXTERN_LIB: str(bitcode_path(arch))}
    out = []
    for kernel, mode in KERNELS.items():
        fn = module.rdep_layer
        t0 = time.perf_counter()
        src = ASTSource(fn=fn, signature=dict(kernel_args(plan)), constexprs=constexprs | mode)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        seconds = time.perf_counter() - t0
        target = Path(out_dir) / cubin_name(plan.layer, kernel, arch)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(k.asm["cubin"])
        tmp.replace(target)
        ptx = k.asm["ptx"]
        wgmma = sorted({w.split(".")[4] for w in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\w+", ptx)})
        out.append(
            {
                "layer": plan.layer,
                "kernel": kernel,
                "cubin": str(target),
                "bytes": len(k.asm["cubin"]),
                "seconds": round(seconds, 3),
                "shared": int(k.metadata.shared),
                "target": next((line.split()[1] for line in ptx.splitlines() if line.startswith(".target")), ""),
                "wgmma": "wgmma" in ptx,
                "wgmma_shapes": wgmma,
                "tma": "cp.async.bulk.tensor" in ptx,
                **resources(target),
                "acquire": "acquire" in ptx,
                "release": "release" in ptx,
                "globaltimer": "%globaltimer" in ptx,
                "fp8": "e4m3x2" in ptx,  # fp8 e4m3 conversions (the forward's quantise and GEMM1 operand)
                # NVSHMEM's code inlined from the bitcode (its device state, which
                # nvshmem.core.module_init fills, is then a .const of the module).
                "nvshmem": "nvshmem" in ptx,
                "tiles": {**tiles.constexprs(), "num_warps": tiles.num_warps},
            }
        )
    return out


def main() -> int:
    request = json.loads(sys.stdin.read())
    arch, profile = request["arch"], request.get("profile", False)
    results = [_compile(kernels, plan, out, arch, profile) for kernels, plan, out in request["jobs"]]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["H100_SHARED", "KERNELS", "compile_cubins", "cubin_name"]
