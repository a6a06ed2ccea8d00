"""Every generated kernel of every example compiles to an sm_90 cubin, without a GPU.

The compiles run in subprocesses (rdepc.codegen.sm90): this process runs the Triton
interpreter for the other tests, and Triton fixes its mode at first import. Each example is
compiled for its own schedule (tiny bulk, moonlight pipelined with a return ring, qwen3
deep), its one kernel ``rdep_layer`` — the forward in both kernel modes (unified and
role-split), keeping what a backward walks, and the backward pass — for
the one-process ``emulated`` transport and for ``nvshmem`` (NVSHMEM's bitcode linked); the
examples are dealt over two processes (deepseek_v3 with its fp8 dispatch).
"""

from __future__ import annotations

import os

import pytest
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
