"""Every generated kernel of every example compiles to an sm_90 cubin, without a GPU.

The compiles run in subprocesses (rdepc.codegen.sm90): this process runs the Triton
interpreter for the other tests, and Triton fixes its mode at first import. Each example is
compiled for its own schedule (moonlight pipelined with a return ring; examples whose builds
another's cover are skipped, SAME_KERNELS, or compile their transport kernel's alone,
TRANSPORT_ONLY): split mode's transport kernel and
GEMM kernel, forward (keeping what a backward walks) and backward, and the unified
kernel's forward — for the one-process ``emulated`` transport and for ``nvshmem``
(NVSHMEM's bitcode linked); the examples are dealt over two processes (deepseek_v3 with its
fp8 dispatch). tiny's compile through the command line takes every build, the unified
backward too. Each kernel is compiled as a launch runs it; that a launch's real arguments
specialise it the same way, and find prewarm's builds, tests/test_launch_keys_sm90.py checks.
"""

from __future__ import annotations

import os
import re

import pytest
from conftest import EXAMPLES, RESIZED, ROOT, TORCH_APART, tiny_segmented
from rdepc.codegen import write_module
from rdepc.codegen.sm90 import BALANCE_KERNELS, H100_SHARED, KERNELS, compile_cubins, cubin_name

import rdepc
from rdepc.driver import generate_spec

# What every example compiles in CI: split mode's four builds and the unified forward.
EVERY_EXAMPLE = ("rdep_transport", "rdep_gemm", "rdep_transport.backward", "rdep_gemm.backward", "rdep_layer")


# Examples whose builds another example's cover (TORCH_APART, RESIZED: qwen3_30b_a3b's GEMM builds
# compile in test_gemm_loops), and tiny_balance (tiny's at E = 12; its balance kernels:
# test_the_balance_kernels_...) and tiny (every one of its builds compiles in
# test_cli_compile_writes_a_cubin_per_kernel).
SAME_KERNELS = {f"{name}.rdep" for name in (*TORCH_APART, *RESIZED, "tiny_balance", "tiny")}
# Examples whose GEMM builds another's cover: only their transport kernel's builds compile.
# mixtral_8x7b differs from moonlight (bf16 SwiGLU) by its admission (keyed, round-robin): the
# route and the scan.
TRANSPORT_ONLY = {"mixtral_8x7b.rdep"}
TRANSPORT_BUILDS = ("rdep_transport", "rdep_transport.backward")

# nvshmem's builds differ from emulated's by the transport's device half alone: bf16, fp8
# dispatch and dedup (deepseek_v3) cover what links against NVSHMEM's bitcode (fp32 changes only
# the element type, which the emulated builds of tiny compile)
NVSHMEM_EXAMPLES = ("moonlight.rdep", "deepseek_v3.rdep")


def _generate(tmp_path, backend: str = "emulated", names: tuple[str, ...] | None = None):
    """(layer name, dtype, Generated) for every example but SAME_KERNELS (or those ``names``), compiled for its
    own schedule."""
    out = []
    for ex in (e for e in EXAMPLES if (names is None and e.name not in SAME_KERNELS) or (names and e.name in names)):
        spec = rdepc.load(f"examples/{ex.name}").spec
        out.append((spec.name, spec.precision.dtype.value, generate_spec(spec, backend=backend)))
    return out


@pytest.mark.parametrize("backend", ["emulated", "nvshmem"])
def test_every_example_compiles_for_sm90(tmp_path, monkeypatch, backend):
    """nvshmem: one process per rank, peers through nvshmem_ptr, NVSHMEM's device bitcode
    (the nvidia-nvshmem-cu13 wheel of the test extras, the GPU machines' 3.4.5) linked in."""
    monkeypatch.chdir(ROOT)
    if backend == "nvshmem":
        from rdepc.toolchain import NvshmemUnavailable, bitcode_path

        try:
            bitcode_path()
        except NvshmemUnavailable as e:  # the test extras bring it on Linux x86-64 (CI)
            pytest.skip(str(e))
    jobs, dtypes = [], {}
    names = NVSHMEM_EXAMPLES if backend == "nvshmem" else None
    for name, dtype, g in _generate(tmp_path, backend, names):
        out = tmp_path / name
        out.mkdir()
        write_module(g, out)
        jobs.append((out / f"{name}_kernels.py", out / f"{name}.contract.json", out))
        dtypes[name] = dtype
    assert len(jobs) == len(names or [e for e in EXAMPLES if e.name not in SAME_KERNELS])
    few = {f"{p.removesuffix('.rdep')}" for p in TRANSPORT_ONLY} if names is None else set()
    whole = [j for j, name in zip(jobs, dtypes, strict=True) if name not in few]
    # compile_cubins' one process: beside the other test worker's, one a core on CI's 2
    results = compile_cubins(whole, arch=90, kernels=list(EVERY_EXAMPLE))
    part = [j for j, name in zip(jobs, dtypes, strict=True) if name in few]
    results += compile_cubins(part, arch=90, kernels=list(TRANSPORT_BUILDS)) if part else []
    want = [(n, k) for n in dtypes if n not in few for k in EVERY_EXAMPLE]
    want += [(n, k) for n in dtypes if n in few for k in TRANSPORT_BUILDS]
    assert [(r["layer"], r["kernel"]) for r in results] == want
    for r in results:
        gemms = KERNELS[r["kernel"]][0] == "rdep_gemm" or KERNELS[r["kernel"]][1].get("GEMMS")
        cubin = tmp_path / r["layer"] / cubin_name(r["layer"], r["kernel"], 90)
        assert r["cubin"] == str(cubin) and cubin.stat().st_size == r["bytes"] > 0
        assert r["target"] == "sm_90a"
        assert r["acquire"] and r["release"], "the flag protocol must compile to acquire loads and release atomics"
        assert r["shared"] <= H100_SHARED, f"{r['layer']} needs {r['shared']} bytes of shared memory"
        assert r["nvshmem"] == (backend == "nvshmem"), f"{r['layer']} {r['kernel']}: NVSHMEM linked: {r['nvshmem']}"
        assert r["tma"] == gemms, f"{r['layer']} {r['kernel']}: the GEMM operands arrive by TMA: {r['tma']}"
        assert 0 < r["registers"] <= 255 and r["local_bytes"] >= 0 and r["stack"] >= 0 and r["ctas_per_sm"] >= 1
        sp = r["specialization"]  # compiled as a launch runs it (launch_specialization)
        assert sp["aligned_pointers"] == sp["pointers"] > 0 and r["launch"]["n_programs"] > 0, (r["layer"], sp)
        if r["layer"] == "moonlight" and not r["kernel"].endswith("backward"):
            # Without the launch's alignment facts its stores were 2 bytes wide: 2.3-2.7 KB of stack
            # (Triton 3.6-3.9). As launched, the forward's moves 64 KB a step, 264-272 bytes (nvshmem: 320;
            # spilled outside every loop, which test_gemm_loops holds); with each nvshmem peer's
            # alignment unknown, its moves 2 bytes wide: 2,056.
            most = 512
            assert r["stack"] <= most, f"moonlight {r['kernel']}: {r['stack']} bytes of stack per thread"
        if r["kernel"].startswith("rdep_transport"):
            # Rows move 16 bytes a load and store (a loop that stores 2 bytes at a time is no move loop:
            # through nvshmem_ptr's unaligned peers every one did), each step's loads before its stores.
            moves = r["move_loops"]
            assert len(moves) >= 2, (r["layer"], r["kernel"], moves)
            assert all(m["loads_ahead"] == m["loads"] and m["spill_loads"] == 0 for m in moves), (r["layer"], moves)
            if dtypes[r["layer"]] != "fp32" and r["kernel"] == "rdep_transport":
                # The forward's combine sums its slots' rows without a spill at every shape: each
                # slot's rows at a constant offset from the first's (deepseek_v3, H = 7168, spilled
                # 68 loads a step when every slot's address was its own).
                sums = r["sum_loops"]  # none where the combine adds its rows unweighted (GATE_INPUT)
                assert all(s["spill_loads"] == s["spill_stores"] == 0 for s in sums), (r["layer"], sums)
                assert sums or r["layer"] != "deepseek_v3", r["kernel"]
        if gemms and r["layer"] in ("moonlight", "deepseek_v3"):
            # Tensor descriptors built in global memory, each written and fenced before its first read:
            # the experts' weights' and, one process per rank, the rows' (payload and workspace rings) once
            # per program; by every work item only the weight gradients' (bounded to the expert's rows, two
            # per kind) and, all ranks in one process, the rows' (the owner changes from item to item).
            one = backend == "emulated"
            per_item = (4 if r["kernel"].endswith("backward") else 0) + (2 if one else 0)
            assert r["descriptors"] == {"program": 2 if one else 4, "item": per_item}, (r["layer"], r["kernel"])
        fp8 = r["layer"] == "deepseek_v3" and not r["kernel"].endswith("backward")  # the backward sends no fp8
        assert r["fp8"] == fp8, f"{r['layer']} {r['kernel']}: fp8 e4m3 conversions: {r['fp8']}"
        if dtypes[r["layer"]] != "fp32" and gemms:  # bf16 grouped GEMMs on Hopper tensor cores
            assert r["wgmma"], f"{r['layer']}: no wgmma in the PTX"
            # GEMM1: gate and up as one operand, 2·block_f = 256 wide; GEMM2 block_h = 128
            assert {"m64n256k16", "m64n128k16"} <= set(r["wgmma_shapes"]), r["wgmma_shapes"]
        elif not gemms:
            assert not r["wgmma"] and not r["loops"], f"{r['layer']}: the transport kernel holds a GEMM"
    times = ", ".join(f"{r['layer']} {r['seconds']:.1f} s" for r in results)
    print(f"sm_90 compile times ({backend}): {times}")


def test_cli_compile_writes_a_cubin_per_kernel(tmp_path, monkeypatch, capsys):
    """tiny_balance one process per rank: every build of the layer (its GEMM tiles reading the
    redundant slots as an operand of their own) and the balance kernels its runtime launches."""
    from rdepc import cli

    monkeypatch.chdir(ROOT)
    argv = [
        "compile",
        "examples/tiny_balance.rdep",
        "--backend",
        "emulated-mp",
        "-o",
        str(tmp_path),
        "--target",
        "sm_90",
    ]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    builds = [*BALANCE_KERNELS["per-rank"], *KERNELS]
    assert f"rdepc: compiled {len(builds)} of {len(builds)} builds for sm_90" in err  # progress, as each finishes
    cubins = [tmp_path / f"tiny_balance.{kernel}.sm_90.cubin" for kernel in builds]
    for kernel, cubin in zip(builds, cubins, strict=True):
        assert cubin.stat().st_size > 0 and f"compiled {kernel} for sm_90a in " in out and f"wrote {cubin}" in out
    assert "registers" in out and "GEMMs: no wgmma, TMA" in out  # fp32: IEEE dots, TMA operands
    assert "GEMMs: no wgmma, no TMA" in out  # the transport kernel
    assert re.search(
        r"row loop \(move\) at 0x[0-9a-f]+: (\d+) of its \1 loads a thread \(16 bytes each\) before the first use", out
    )
    assert re.search(r"bytes of stack and 0 bytes of local memory \(spills\) per thread, [12] CTAs? per SM", out)
    balance = re.findall(r"compiled balance_\S+ .* 0 bytes of local memory \(spills\) per thread, 4 warps", out)
    assert len(balance) == len(BALANCE_KERNELS["per-rank"])
    # compiled as a native launch at T' = T runs it, on an H100's grid (at most one program per work item)
    grids = [int(n) for n in re.findall(r"as launched: pointers 16-byte aligned, T'=16, (\d+) programs\n", out)]
    assert len(grids) == len(KERNELS) and all(0 < n <= 132 for n in grids), grids
    written = ["tiny_balance.spec.json", "tiny_balance_kernels.py", "tiny_balance.contract.json", "tiny_balance.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*written, *(c.name for c in cubins)])


def test_compiling_processes_are_kept_for_the_next_call_and_dealt_whole_jobs(tmp_path, monkeypatch):
    """A compiling process answers each request whole and serves the next one with the same
    environment; one that fails is killed and says why, as are those whose time runs out;
    builds are dealt whole jobs to a process where there are enough jobs, else build by build."""
    from rdepc.codegen import compilers
    from rdepc.codegen.sm90 import deal

    monkeypatch.chdir(ROOT)
    env = dict(os.environ, TRITON_INTERPRET="0")
    first = compilers.take(env)
    assert first.run({"arch": 90, "builds": []}, lambda r: pytest.fail(f"no build asked: {r}")) is None
    compilers.give_back(first)
    again = compilers.take(env | {"PYTEST_CURRENT_TEST": "another test"})  # no compile reads it
    assert again is first and again.proc.poll() is None
    missing = ["/nonexistent/x_kernels.py", "/nonexistent/x.contract.json", "/nonexistent", "rdep_gemm"]
    error = again.run({"arch": 90, "builds": [missing]}, lambda r: pytest.fail(f"no result expected: {r}"))
    assert "No such file" in error and again.proc.poll() is not None
    fresh = compilers.take(env)
    assert fresh is not again  # a failed process is never kept
    fresh.close()
    write_module(generate_spec(rdepc.load("examples/tiny.rdep").spec), tmp_path)
    job = (tmp_path / "tiny_kernels.py", tmp_path / "tiny.contract.json", tmp_path)
    idle = list(compilers._IDLE)
    with pytest.raises(RuntimeError, match=r"took longer than 0 s \(its processes killed\)"):
        compile_cubins([job], arch=90, parallel=2, kernels=["rdep_gemm", "rdep_transport"], timeout=0.01)
    assert all(c in idle for c in compilers._IDLE)  # none given back
    builds = [(0, "a"), (0, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")]
    assert deal(builds, 2) == [[3, 4, 5], [0, 1, 2]]  # whole jobs, the largest first
    assert deal(builds[:2], 2) == [[0], [1]]  # fewer jobs than processes: build by build
    assert deal(builds[:3], 4) == [[0], [1], [2]]  # and no more processes than builds
    assert deal(builds, 1) == [[0, 1, 2, 3, 4, 5]]


def test_the_profiled_kernel_reads_the_globaltimer(tmp_path, monkeypatch):
    """With PROFILE and GLOBALTIMER the work items are stamped with %globaltimer (ns), the
    backward's too: the stamps of both kernel functions (the transport kernel's are the unified
    kernel's, one function), one build each."""
    monkeypatch.chdir(ROOT)
    g = generate_spec(rdepc.load(tiny_segmented(tmp_path)).spec)  # pipelined, 4 segments per owner
    write_module(g, tmp_path)
    job = (tmp_path / "tiny_kernels.py", tmp_path / "tiny.contract.json", tmp_path)
    kernels = ["rdep_transport", "rdep_gemm.backward"]
    results = compile_cubins([job], arch=90, profile=True, kernels=kernels)
    assert [r["kernel"] for r in results] == kernels
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
    job = (tmp_path / "deepseek_v3_kernels.py", tmp_path / "deepseek_v3.contract.json", tmp_path)
    results = compile_cubins([job], arch=90, kernels=["rdep_transport", "rdep_gemm", "rdep_gemm.backward"])
    for r in results:
        backward, gemms = r["kernel"].endswith("backward"), r["kernel"].startswith("rdep_gemm")
        assert r["fp8"] != backward and r["tma"] == gemms and r["acquire"] and r["release"], r
        if gemms:
            assert {"m64n256k16", "m64n128k16"} <= set(r["wgmma_shapes"]), r["wgmma_shapes"]
        assert r["shared"] <= H100_SHARED and r["local_bytes"] == 0


@pytest.mark.parametrize(
    "shape, backend", [("tiny_balance", "emulated"), ("moonlight-shaped", "nvshmem"), ("nvl72-shaped", "emulated")]
)
def test_the_balance_kernels_compile_for_sm_90_without_local_memory(tmp_path, shape, backend):
    """Every balance kernel a ``balance replicate`` layer launches on its transport builds
    for sm_90 (ptxas) with no spills: tiny_balance (fp32) in one process, and moonlight's
    shape (8 ranks, 64 experts, top-6, bf16) with 2 slots a rank for nvshmem (its exchange
    through nvshmem_ptr, NVSHMEM's bitcode linked; tiny_balance's per-rank builds compile in
    test_cli_compile_writes_a_cubin_per_kernel), and nvl72_e128's (72 ranks, 128 experts),
    where the solver once held [128, 128] quota and ranking matrices: 4,424 B of stack, 2,767
    local loads, 69-97 ms a solve on an H200. The solver's 64-bit divisions (the
    proportional split) call a subroutine: a few bytes of stack, nothing more. nvl72's layer
    is bulk, as the cost model would choose it (the balance kernels are the same): choosing
    weighs 21 candidates of up to 337,104 tasks."""
    path = ROOT / "examples" / "tiny_balance.rdep"
    if shape == "nvl72-shaped":
        path = tmp_path / "n.rdep"
        path.write_text(
            "layer n {\n  shape ranks 72, tokens 256, hidden 64, experts 128, top 8\n"
            "  expert swiglu(ffn = 64)\n  dtype bf16\n  schedule bulk\n"
            "  balance replicate(slots = 1, min_rows = 16)\n}\n"
        )
    elif shape != "tiny_balance":
        path = tmp_path / "m.rdep"
        path.write_text(
            "layer m {\n  shape ranks 8, tokens 4096, hidden 2048, experts 64, top 6\n"
            "  expert swiglu(ffn = 1408)\n  dtype bf16\n  balance replicate(slots = 2, min_rows = 64)\n}\n"
        )
    g = generate_spec(rdepc.load(path).spec, backend=backend)
    written = write_module(g, tmp_path)
    kernels = next(p for p in written if p.name.endswith("_kernels.py"))
    balance = list(BALANCE_KERNELS["one" if backend == "emulated" else "per-rank"])
    got = compile_cubins([(kernels, tmp_path / f"{g.kernel.layer}.contract.json", tmp_path)], arch=90, kernels=balance)
    assert [r["kernel"] for r in got] == balance
    for r in got:
        assert r["local_bytes"] == 0 and r["stack"] <= 64 and 0 < r["registers"] <= 255, r
        assert r["target"] == "sm_90a" and r["ctas_per_sm"] >= 1 and r["bytes"] > 0, r


@pytest.mark.parametrize("backend", ["emulated", "nvshmem"])
def test_the_library_lowerings_gemm_kernel_compiles_to_waits_and_signals(tmp_path, monkeypatch, backend):
    """The GEMM kernel as the library GEMM lowering launches it (LIBRARY): its items wait for
    their rows and signal their entries, and compute nothing (no TMA, no local memory; the
    stack is the call frame of the error report, 16-24 bytes)."""
    monkeypatch.chdir(ROOT)
    if backend == "nvshmem":
        from rdepc.toolchain import NvshmemUnavailable, bitcode_path

        try:
            bitcode_path()
        except NvshmemUnavailable as e:
            pytest.skip(str(e))
    jobs = []
    for name, _, g in _generate(tmp_path, backend, ("moonlight.rdep", "deepseek_v3.rdep")):
        out = tmp_path / name
        out.mkdir()
        write_module(g, out)
        jobs.append((out / f"{name}_kernels.py", out / f"{name}.contract.json", out))
    results = compile_cubins(jobs, arch=90, kernels=["rdep_gemm.library"])
    assert [r["layer"] for r in results] == ["deepseek_v3", "moonlight"]
    for r in results:
        assert r["acquire"] and r["release"] and not r["tma"], r["layer"]
        assert r["local_bytes"] == 0 and r["stack"] <= 64, (r["layer"], r["stack"], r["local_bytes"])
