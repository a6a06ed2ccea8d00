"""Every generated kernel of every example compiles to an sm_90 cubin, without a GPU.

The compiles run in subprocesses (rdepc.codegen.sm90): this process runs the Triton
interpreter for the other tests, and Triton fixes its mode at first import. Each example is
compiled for its own schedule (tiny bulk, moonlight pipelined with a return ring, qwen3
deep), its one kernel ``rdep_layer`` — the forward in both kernel modes (unified and
role-split), keeping what a backward walks, and the backward pass — for
the one-process ``emulated`` transport and for ``nvshmem`` (NVSHMEM's bitcode linked); the
examples are dealt over two processes (deepseek_v3 with its fp8 dispatch). Each kernel is
compiled as a launch runs it; that a launch's real arguments specialise it the same way is
checked in this process, with Triton's binder and no compile.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from conftest import EXAMPLES, ROOT, tiny_segmented
from rdepc.codegen import UNSUPPORTED, generate_spec, write_module
from rdepc.codegen.sm90 import H100_SHARED, KERNELS, compile_cubins, cubin_name

import rdepc


def _generate(tmp_path, backend: str = "emulated"):
    """(layer name, dtype, Generated) for every example, compiled for its own schedule."""
    out = []
    for ex in EXAMPLES:
        spec = rdepc.load(f"examples/{ex.name}").spec
        assert not {f for f, _ in spec.features()} & UNSUPPORTED, ex.name
        out.append((spec.name, spec.precision.dtype.value, generate_spec(spec, backend=backend)))
    return out


@pytest.mark.parametrize("backend", ["emulated", "nvshmem"])
def test_every_example_compiles_for_sm90(tmp_path, monkeypatch, backend):
    """nvshmem: one process per rank, peers through nvshmem_ptr, NVSHMEM's device bitcode
    (the nvidia-nvshmem-cu13 wheel of the test extras, the GPU machines' 3.4.5) linked in."""
    monkeypatch.chdir(ROOT)
    if backend == "nvshmem":
        from rdepc.runtime.nvshmem import NvshmemUnavailable, bitcode_path

        try:
            bitcode_path()
        except NvshmemUnavailable as e:  # the test extras bring it on Linux x86-64 (CI)
            pytest.skip(str(e))
    jobs, dtypes = [], {}
    for name, dtype, g in _generate(tmp_path, backend):
        out = tmp_path / name
        out.mkdir()
        write_module(g, out)
        jobs.append((out / f"{name}_kernels.py", out / f"{name}.plan.json", out))
        dtypes[name] = dtype
    assert len(jobs) == len(EXAMPLES)
    results = compile_cubins(jobs, arch=90, parallel=min(2, os.cpu_count() or 1))
    assert [r["layer"] for r in results] == [name for name in dtypes for _ in KERNELS]
    for r in results:
        cubin = tmp_path / r["layer"] / cubin_name(r["layer"], r["kernel"], 90)
        assert r["cubin"] == str(cubin) and cubin.stat().st_size == r["bytes"] > 0
        assert r["target"] == "sm_90a"
        assert r["acquire"] and r["release"], "the flag protocol must compile to acquire loads and release atomics"
        assert r["shared"] <= H100_SHARED, f"{r['layer']} needs {r['shared']} bytes of shared memory"
        assert r["nvshmem"] == (backend == "nvshmem"), f"{r['layer']}: NVSHMEM device code linked: {r['nvshmem']}"
        assert r["tma"], f"{r['layer']}: the GEMM operands do not arrive by TMA"
        assert 0 < r["registers"] <= 255 and r["local_bytes"] >= 0 and r["stack"] >= 0
        sp = r["specialization"]  # compiled as a launch runs it (launch_specialization)
        assert sp["aligned_pointers"] == sp["pointers"] > 0 and r["launch"]["n_programs"] > 0, (r["layer"], sp)
        if r["layer"] == "moonlight" and not r["kernel"].endswith("backward"):
            # Without the launch's alignment facts its stores were 2 bytes wide: 2.3-2.7 KB of stack
            # (Triton 3.6-3.9); as launched 32-160 bytes (nvshmem, NVSHMEM's device code linked: 600-840).
            most = 256 if backend == "emulated" else 1024
            assert r["stack"] <= most, f"moonlight {r['kernel']}: {r['stack']} bytes of stack per thread"
        fp8 = r["layer"] == "deepseek_v3" and not r["kernel"].endswith("backward")  # the backward sends no fp8
        assert r["fp8"] == fp8, f"{r['layer']} {r['kernel']}: fp8 e4m3 conversions: {r['fp8']}"
        if dtypes[r["layer"]] != "fp32":  # bf16 grouped GEMMs on Hopper tensor cores
            assert r["wgmma"], f"{r['layer']}: no wgmma in the PTX"
            # GEMM1: gate and up as one operand, 2·block_f = 256 wide; GEMM2 block_h = 128
            assert {"m64n256k16", "m64n128k16"} <= set(r["wgmma_shapes"]), r["wgmma_shapes"]
    times = ", ".join(f"{r['layer']} {r['seconds']:.1f} s" for r in results)
    print(f"sm_90 compile times ({backend}): {times}")


def test_cli_compile_writes_a_cubin_per_kernel(tmp_path, monkeypatch, capsys):
    from rdepc import cli

    monkeypatch.chdir(ROOT)
    assert cli.main(["compile", "examples/tiny.rdep", "-o", str(tmp_path), "--target", "sm_90"]) == 0
    out = capsys.readouterr().out
    cubin = tmp_path / "tiny.rdep_layer.sm_90.cubin"
    assert cubin.stat().st_size > 0
    split = tmp_path / "tiny.rdep_layer.role_split.sm_90.cubin"
    assert split.stat().st_size > 0
    assert "compiled rdep_layer for sm_90a in " in out and f"wrote {cubin}" in out
    assert "compiled rdep_layer.role_split for sm_90a in " in out
    backward = tmp_path / "tiny.rdep_layer.backward.sm_90.cubin"
    assert backward.stat().st_size > 0 and "compiled rdep_layer.backward for sm_90a in " in out
    assert "registers" in out and "GEMMs: no wgmma, TMA" in out  # tiny is fp32: IEEE dots, TMA operands
    assert "bytes of stack and 0 bytes of local memory (spills) per thread" in out
    # compiled as a native launch at T' = T runs it, on an H100's grid (unified: at most one program per work item)
    grids = re.findall(r"as launched: pointers 16-byte aligned, T'=16, (\d+) programs\n", out)
    assert len(grids) == 3 and int(grids[1]) == 132 and 0 < int(grids[0]) == int(grids[2]) <= 132, grids
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["tiny.spec.json", "tiny_kernels.py", "tiny.plan.json", "tiny.py", cubin.name, split.name, backward.name]
    )


def test_the_profiled_kernel_reads_the_globaltimer(tmp_path, monkeypatch):
    """With PROFILE and GLOBALTIMER the work items are stamped with %globaltimer (ns)."""
    monkeypatch.chdir(ROOT)
    g = generate_spec(rdepc.load(tiny_segmented(tmp_path)).spec)  # pipelined, 4 segments per owner
    write_module(g, tmp_path)
    job = (tmp_path / "tiny_kernels.py", tmp_path / "tiny.plan.json", tmp_path)
    results = compile_cubins([job], arch=90, profile=True)
    assert [r["kernel"] for r in results] == list(KERNELS)
    assert all(r["globaltimer"] and r["acquire"] and r["release"] for r in results)


def test_a_dedup_layer_compiles_for_sm90(tmp_path, monkeypatch):
    """deepseek_v3 under dedup (fp8 rows), forward and backward: GEMM1 and the backward's
    GEMM1 gather each slot's row through the links, by pointers, while the weights and
    GEMM2 stay on TMA and wgmma."""
    from rdepc.api import elaborate_layer
    from rdepc.parser import parse_text

    monkeypatch.chdir(ROOT)
    text = (ROOT / "examples" / "deepseek_v3.rdep").read_text(encoding="utf-8")
    spec, _ = elaborate_layer(
        parse_text(text.replace("transport nvshmem", "transport nvshmem, dedup"), "ds.rdep"), None, {}
    )
    g = generate_spec(spec)
    write_module(g, tmp_path)
    job = (tmp_path / "deepseek_v3_kernels.py", tmp_path / "deepseek_v3.plan.json", tmp_path)
    results = compile_cubins([job], arch=90)
    assert [r["kernel"] for r in results] == list(KERNELS)
    for r in results:
        backward = r["kernel"].endswith("backward")
        assert r["fp8"] != backward and r["tma"] and r["acquire"] and r["release"], r
        assert {"m64n256k16", "m64n128k16"} <= set(r["wgmma_shapes"]), r["wgmma_shapes"]
        assert r["shared"] <= H100_SHARED and r["local_bytes"] == 0


class _Recorder:
    """A launcher that records each launch and runs nothing."""

    def __init__(self):
        self.launches, self.calls = 0, []

    def __call__(self, kernel, grid, args, meta):
        self.launches += 1
        self.calls.append((kernel, grid, args, meta))


def _odd(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous view one element past a 64-byte aligned allocation."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    flat[1:] = t.reshape(-1)
    return flat[1:].view(t.shape)


@pytest.mark.parametrize("mode", ["unified", "role-split"])
def test_the_sm90_build_specialises_as_a_launch_does(monkeypatch, mode):
    """What ``_compile`` compiles (launch_specialization) is what Triton's JIT binds for the
    arguments RDEPModule really passes: the module on the CPU with the native launch's
    tiles, grid (an H100) and spin bound, its inputs at odd offsets (the module copies them
    to aligned ones), each launch recorded and its arguments run through Triton's binder
    for the cuda backend. Only CAST_F32 (the interpreter's upcast) is set as natively."""
    from rdepc.codegen.lower import H100_SMS, NATIVE_SPIN_BOUND, Tiles
    from rdepc.codegen.sm90 import launch_specialization
    from rdepc.runtime.launch import interpreter_env

    monkeypatch.chdir(ROOT)
    layer = rdepc.load("examples/tiny.rdep")
    sh = layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    tiles = Tiles.default(H, F, layer.spec.precision.dtype.value, interpret=False)
    module = layer.module("emulated", "cpu", tiles=tiles, programs=H100_SMS, spin_bound=NATIVE_SPIN_BOUND, mode=mode)
    module.launcher = recorder = _Recorder()
    g = torch.Generator().manual_seed(0)
    x = _odd(torch.randn(W, T, H, generator=g)).requires_grad_()
    ids = _odd((torch.arange(T)[:, None] + torch.arange(K)[None, :]).expand(W, T, K) % E)
    gates = _odd(torch.rand(W, T, K, generator=g))
    w_gate, w_up, w_down = (torch.randn(E, *s, generator=g) for s in ((H, F), (H, F), (F, H)))
    y = module(x, ids, gates, w_gate, w_up, w_down)
    kernels = ["rdep_layer" if mode == "unified" else "rdep_layer.role_split"]
    if mode == "unified":  # the backward compiled is the unified one
        y.backward(_odd(torch.ones(W, T, H)))
        kernels.append("rdep_layer.backward")
    assert len(recorder.calls) == len(kernels)
    # Triton is imported now, in the interpreter's mode (the module imported it first)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    for kernel, (fn, grid, args, meta) in zip(kernels, recorder.calls, strict=True):
        jit = JITFunction(fn.fn, **fn.kwargs)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        kwargs = meta | {"CAST_F32": False, "num_warps": tiles.num_warps}
        with interpreter_env(True):  # the binder imports Triton's gluon, which must see this process's mode
            bound, spec, options = binder(*args, **kwargs)
            _, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, spec, options)
        want = launch_specialization(module.plan, fn, kernel)
        assert grid == (want.launch["n_programs"],), kernel
        assert signature == want.signature, kernel
        assert constexprs == want.constexprs, kernel
        assert attrs == want.attrs, kernel
        assert want.specialization["aligned_pointers"] == want.specialization["pointers"] > 0
