"""The nvshmem transport without a GPU: its device half links against NVSHMEM's bitcode (the
part of it rdepc links, the same cubin) and compiles to an sm_90 cubin, and its host half says
clearly why it cannot start on a CPU.

The compiles run in a subprocess with TRITON_INTERPRET=0 (as rdepc.codegen.sm90 does): this
process may run the Triton interpreter for other tests, and Triton fixes its mode at first
import.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import HANG_S, ROOT
from rdepc.codegen import transport
from rdepc.runtime.nvshmem import NvshmemWorld, needs_module_init

from rdepc import toolchain
from rdepc.toolchain import NvshmemUnavailable, bitcode_path

HEADER = "import triton\nimport triton.language as tl\nfrom triton.language import core\n\n"

# A kernel over the whole contract: put into a peer's heap, signal its flag, wait on ours.
PROBE_KERNEL = """

@triton.jit
def probe(heap, to, n, bound, stop, out, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    dst = peer(heap, to)
    put(dst + offs, offs.to(tl.uint8), offs < n)
    signal((dst + 128).to(tl.pointer_type(tl.int32)))
    seen = wait((heap + 128).to(tl.pointer_type(tl.int32)), 1, bound, stop)
    tl.store(out, seen)


@triton.jit
def plain(out, BLOCK: tl.constexpr):
    tl.store(out + tl.arange(0, BLOCK), tl.arange(0, BLOCK))
"""

# Runs in the subprocess: compile the probe against the whole bitcode, against the library cut
# from it (as rdepc links it), and without either; one JSON line out.
COMPILE = textwrap.dedent(
    """
    import hashlib, importlib.util, json, os, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from rdepc.toolchain import EXTERN_LIB, bitcode_path, nvshmem_extern_libs

    spec = importlib.util.spec_from_file_location("nvshmem_probe", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = {"heap": "*u8", "to": "i32", "n": "i32", "bound": "i32", "stop": "*i64", "out": "*i32"}
    signature["BLOCK"] = "constexpr"
    result = {}
    libs = {"bitcode": {EXTERN_LIB: str(bitcode_path())}, "cut": nvshmem_extern_libs(), "none": {}}
    for linked, extern in libs.items():
        src = ASTSource(fn=module.probe, signature=signature, constexprs={"BLOCK": 64})
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "extern_libs": extern})
            cubin = hashlib.sha256(k.asm["cubin"]).hexdigest()
            result[linked] = {"cubin": len(k.asm["cubin"]), "cubin_sha256": cubin, "ptx": k.asm["ptx"]}
        except Exception as e:
            result[linked] = {"error": f"{type(e).__name__}: {e}"}
    # a kernel that calls nothing of NVSHMEM's, compiled as the nvshmem launcher compiles every kernel
    src = ASTSource(fn=module.plain, signature={"out": "*i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 64})
    options = {"num_warps": 4, "extern_libs": nvshmem_extern_libs()}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    result["plain"] = {"ptx": k.asm["ptx"]}
    result["cut_bytes"] = os.path.getsize(nvshmem_extern_libs()[EXTERN_LIB])
    print(json.dumps(result))
    """
)


def test_bitcode_is_the_pinned_single_file():
    path = bitcode_path()
    assert path.is_file() and path.name == "libnvshmem_device.bc"  # 3.4.5: one bitcode for every arch
    assert path.parent.parts[-3:] == ("nvidia", "nvshmem", "lib")
    assert path.stat().st_size > 1 << 20
    assert bitcode_path(arch=80) == path


def test_missing_bitcode_is_one_line_with_the_install_hint(monkeypatch):
    real = toolchain.importlib.util.find_spec
    monkeypatch.setattr(toolchain.importlib.util, "find_spec", lambda name: None if name == "nvidia" else real(name))
    with pytest.raises(NvshmemUnavailable) as err:
        bitcode_path()
    message = str(err.value)
    assert "\n" not in message and "pip install 'rdepc[nvshmem]'" in message and "nvidia-nvshmem-cu13" in message
    assert isinstance(err.value, RuntimeError)


def _functions(source: str) -> dict[str, list[str]]:
    tree = ast.parse(HEADER + source)
    return {f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)}


def test_device_source_keeps_the_emulated_contract():
    NVSHMEM_DEVICE = transport.source("nvshmem")
    ours, emulated = _functions(NVSHMEM_DEVICE), _functions(transport.source("emulated"))
    assert {n: ours[n] for n in emulated} == emulated  # peer, put, signal, wait: same names and arguments
    assert ours["nvshmem_ptr"] == ["ptr", "pe", "_semantic"]
    assert 'SCOPE = tl.constexpr("sys")' in NVSHMEM_DEVICE
    assert NVSHMEM_DEVICE.lstrip("\n").startswith("# " + "-" * 40)


def test_probe_kernel_links_nvshmem_and_compiles_for_sm90(tmp_path):
    kernel = tmp_path / "nvshmem_probe.py"
    kernel.write_text(
        HEADER + "HEAP_BYTES = tl.constexpr(256)\n" + transport.source("nvshmem") + PROBE_KERNEL, encoding="utf-8"
    )
    # a cache of its own: both builds made here, from this file, not found from an earlier run
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run(
        [sys.executable, "-c", COMPILE, str(kernel)],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])

    linked = result["bitcode"]
    assert "error" not in linked, linked.get("error")
    # the library rdepc links, cut from the 31 MB bitcode to nvshmem_ptr and what it reads, gives
    # the same cubin, byte for byte
    assert "error" not in result["cut"], result["cut"].get("error")
    assert result["cut"]["cubin_sha256"] == linked["cubin_sha256"] and result["cut"]["ptx"] == linked["ptx"]
    assert 0 < result["cut_bytes"] < bitcode_path().stat().st_size // 1000
    ptx = linked["ptx"]
    assert linked["cubin"] > 0
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)
    assert re.search(r"\b(ld|atom)\.global\.sys\.acquire\.", ptx), "wait: an acquire at system scope"
    assert re.search(r"\batom\.global\.sys\.release\.add\.", ptx), "signal: a release atomic at system scope"
    assert needs_module_init(ptx)  # nvshmem_ptr inlined: it reads the state module_init fills
    assert not needs_module_init(result["plain"]["ptx"])  # nothing linked: module_init would fail on it
    assert not re.search(r"\.extern\s+\.func.*nvshmem_ptr", ptx)

    unlinked = result["none"]
    assert "nvshmem_ptr" in unlinked.get("error", ""), "without the bitcode nvshmem_ptr must stay unresolved"


def test_world_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: start() would really initialise NVSHMEM")
    for _ in range(2):  # a failed start leaves nothing behind: the second fails the same way
        with pytest.raises(NvshmemUnavailable) as err:
            NvshmemWorld.start()
        message = str(err.value)
        assert "\n" not in message and "GPU" in message and "emulated" in message


def test_a_world_that_lost_a_peer_skips_the_collective_finalize(capsys):
    """After a failed wait on a peer's flag, finalize neither frees collectively nor calls
    NVSHMEM's finalize (which would wait for a dead PE forever); it says so, once."""
    world = NvshmemWorld(0, 2, 0)  # never booted: nvshmem itself is not needed
    world.peers_lost("a wait for rank 1 failed")
    world.peers_lost("a later one")
    world.finalize()
    world.finalize()
    err = capsys.readouterr().err
    assert err.count("rank 0 skips NVSHMEM's finalize") == 1 and "a wait for rank 1 failed" in err
    assert "nvshmem.core" not in sys.modules


def test_import_is_light():
    heavy = ("torch", "triton", "nvshmem")
    code = f"import sys, rdepc.runtime.nvshmem; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
