"""That a launch finds the build made for it, without a GPU: the arguments RDEPModule really
passes specialise a kernel as the sm_90 build does (Triton's binder, in this process), and
the cache key of each build prewarm makes is the key the JIT of a real launch looks up (a
native process with a stand-in driver). The compiles themselves: tests/test_compile_sm90.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HANG_S, ROOT
from rdepc.codegen.sm90 import KERNELS

import rdepc


class _Recorder:
    """A launcher that records each launch and runs nothing."""

    def __init__(self):
        self.launches, self.calls = 0, []

    def __call__(self, launches):
        self.launches += len(launches)
        self.calls += launches


def _odd(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous view one element past a 64-byte aligned allocation."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    flat[1:] = t.reshape(-1)
    return flat[1:].view(t.shape)


@pytest.mark.parametrize("mode", ["unified", "split"])
def test_the_sm90_build_specialises_as_a_launch_does(monkeypatch, mode):
    """What ``_compile`` compiles (launch_specialization) is what Triton's JIT binds for the
    arguments RDEPModule really passes: the module on the CPU with the native launch's
    tiles, grid (an H100) and spin bound, its inputs at odd offsets (the module copies them
    to aligned ones), each launch recorded and its arguments run through Triton's binder
    for the cuda backend. Only CAST_F32 (the interpreter's upcast) is set as natively."""
    from rdepc.codegen.sm90 import launch_specialization
    from rdepc.runtime.launch import constexpr_tail

    from rdepc.ir.contract import H100_SMS, NATIVE_SPIN_BOUND, Tiles
    from rdepc.toolchain import interpreter_env

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
    y.backward(_odd(torch.ones(W, T, H)))
    kernels = ["rdep_layer", "rdep_layer.backward"]
    if mode == "split":
        kernels = ["rdep_transport", "rdep_gemm", "rdep_transport.backward", "rdep_gemm.backward"]
    assert len(recorder.calls) == len(kernels)
    # Triton is imported in the interpreter's mode (conftest.py)
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
        # what rdepc's launcher passes a build is what Triton's launch would: the same values in order
        ours = (*args, *constexpr_tail(jit, args, kwargs))
        assert len(ours) == len(bound), kernel
        same = (a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(ours, bound.values(), strict=True))
        assert all(same), kernel
        want = launch_specialization(module.contract, fn, kernel)
        assert grid == (module.per_queue[KERNELS[kernel][0] == "rdep_gemm"],), kernel
        assert sum(module.per_queue) == want.launch["n_programs"], kernel
        assert signature == want.signature, kernel
        assert constexprs == want.constexprs, kernel
        assert attrs == want.attrs, kernel
        assert want.specialization["aligned_pointers"] == want.specialization["pointers"] > 0


# A process that runs Triton natively (no GPU: a stand-in driver reports an H100), the acceptance's
# role: each recorded launch goes through rdepc's own native launcher into JITFunction.run, whose
# compile stops at its cache lookup (keys_only) and gives the key it would look up; then prewarm's
# keys for the requests, computed here and again in its compiling process. Controls: another
# num_warps, and a cache-invalidating variable set in this process only, must change the key.
_JIT_KEYS = r"""
import json, os, sys

import torch
from rdepc.codegen.prewarm import _Keyed, keys_only, prewarm
from rdepc.codegen.sm90 import stand_in_driver
from rdepc.runtime.launch import Launcher
from rdepc.toolchain import import_kernels


stand_in_driver()  # an H100: what JITFunction.run asks the driver before it compiles
job = json.loads(open(sys.argv[1]).read())


def arg(a):
    if "int" in a:
        return a["int"]
    dt = getattr(torch, a["dtype"])
    return torch.empty(1, dtype=dt) if a["aligned"] else torch.empty(2, dtype=dt)[1:]  # 64-byte aligned, or not


def launcher(kind):
    if kind == "nvshmem":
        from rdepc.runtime.nvshmem import NvshmemLauncher

        return NvshmemLauncher(world=object())  # its options; the world is used only after the compile
    return Launcher(interpret=False)


def jit_key(launch, meta):
    fn = getattr(import_kernels(launch["kernels"], interpret=False), launch["kernel"])
    args = tuple(arg(a) for a in launch["args"])
    with keys_only():
        try:
            launcher(launch["launcher"])([(fn, tuple(launch["grid"]), args, meta)])
        except _Keyed as k:
            return k.key
    raise AssertionError("the launch did not reach Triton's compile")


out = {"jit": [jit_key(launch, launch["meta"]) for launch in job["launches"]]}
first = job["launches"][0]
out["other_num_warps"] = jit_key(first, first["meta"] | {"num_warps": 2 * first["meta"]["num_warps"]})
os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
out["other_env"] = jit_key(first, first["meta"])
del os.environ["TRITON_DEFAULT_FP_FUSION"]
out["prewarm"] = prewarm(job["requests"], 1, compile=False, target=("cuda", 90, 32))
print(json.dumps(out))
"""


def _described(kernels_path, kernel, grid, args, meta, launcher: str = "triton") -> dict:
    """A launch as the native process rebuilds it: the kernel by name, pointers by dtype and
    16-byte alignment (what Triton specialises on), ints by value."""

    def one(a):
        if isinstance(a, torch.Tensor):
            return {"dtype": str(a.dtype).removeprefix("torch."), "aligned": a.data_ptr() % 16 == 0}
        assert isinstance(a, int) and not isinstance(a, bool), a
        return {"int": a}

    name = kernel if isinstance(kernel, str) else kernel.fn.__name__
    return {"kernels": str(kernels_path), "kernel": name, "grid": list(grid), "args": [one(a) for a in args],
            "meta": meta, "launcher": launcher}  # fmt: skip


def _nvshmem_launches(layer, tiles) -> tuple[list, list]:
    """The nvshmem transport's file's launches, as rank 1 of 2 launches them, and the requests
    prewarm makes for them (none without NVSHMEM's bitcode)."""
    from rdepc.codegen.prewarm import launch_requests
    from rdepc.codegen.sm90 import native_launch, variant_meta

    from rdepc.ir.arguments import POINTEE, kernel_args, own_constexprs
    from rdepc.toolchain import NvshmemUnavailable, bitcode_path

    try:
        bitcode_path()
    except NvshmemUnavailable:
        return [], []
    shmem = layer.compile(backend="nvshmem", interpret=False)
    plan = shmem.kernel
    scalars = native_launch(plan, tiles, "split", rank=1)
    launches = []
    for kernel in ("rdep_layer", "rdep_gemm"):
        args = [
            torch.empty(1, dtype=getattr(torch, POINTEE[kind[1:]])) if kind.startswith("*") else scalars[name]
            for name, kind in kernel_args(plan, kernel)
            if kind != "constexpr"
        ]
        meta = tiles.constexprs() | {"CAST_F32": False} | variant_meta("split", kernel)
        meta = own_constexprs(plan, kernel, meta) | {"num_warps": tiles.num_warps}
        launches.append(_described(shmem.kernels_path, kernel, (scalars["n_programs"],), args, meta, "nvshmem"))
    requests = launch_requests(shmem.kernels_path, shmem.directory / "contract.json", mode="split", tiles=tiles,
                               ranks=[1])  # fmt: skip
    return launches, requests


def test_prewarm_builds_what_the_launch_looks_up(tmp_path, monkeypatch):
    """The Triton cache key of each build prewarm makes is the key the JIT of a real launch
    looks up. RDEPModule on the CPU with the native launch's tiles, grid (an H100) and spin
    bound, made to launch as natively (``interpret`` off after it is built: CAST_F32 off,
    num_warps, %globaltimer) with each launch recorded — a call, a call under autograd and
    its backward, a profiled call, and one under autograd and its backward, in both kernel
    modes; in a native process each recorded launch goes through rdepc's launcher into
    ``JITFunction.run`` up to its cache lookup, and ``launch_requests`` for the same variants
    go through ``prewarm`` (keys only), whose compiling process computes the key again in
    its own environment. The nvshmem launcher
    (NVSHMEM's device library as ``extern_libs``) gives the key prewarm computes for the nvshmem
    transport's file too (its arguments: aligned stand-ins with the rank's launch values)."""
    from rdepc.codegen.prewarm import PASSES, launch_requests

    from rdepc.ir.contract import H100_SMS, NATIVE_SPIN_BOUND, Tiles

    monkeypatch.chdir(ROOT)
    layer = rdepc.load("examples/tiny.rdep")
    sh = layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    tiles = Tiles.default(H, F, layer.spec.precision.dtype.value, interpret=False)
    native = layer.compile(backend="emulated", interpret=False)  # the file a GPU module runs
    g = torch.Generator().manual_seed(0)
    x = _odd(torch.randn(W, T, H, generator=g))
    ids = _odd((torch.arange(T)[:, None] + torch.arange(K)[None, :]).expand(W, T, K) % E)
    gates = _odd(torch.rand(W, T, K, generator=g))
    w_gate, w_up, w_down = (torch.randn(E, *s, generator=g) for s in ((H, F), (H, F), (F, H)))
    launches, requests = [], []
    for mode in ("unified", "split"):
        for pass_ in PASSES:
            m = layer.module("emulated", "cpu", tiles=tiles, programs=H100_SMS, spin_bound=NATIVE_SPIN_BOUND,
                             mode=mode, profile=pass_.startswith("profile"))  # fmt: skip
            m.interpret = False  # built for the CPU; launches as natively
            m._record = lambda *a, **k: None  # the native record reads CUDA events
            m.launcher = recorder = _Recorder()
            if pass_.endswith("train"):
                y = m(_odd(x).requires_grad_(), ids, gates, w_gate, w_up, w_down)
                y.backward(_odd(torch.ones(W, T, H)))
            else:
                m(x, ids, gates, w_gate, w_up, w_down)
            launches += [_described(m.kernels_path, *call) for call in recorder.calls]
            got = launch_requests(native.kernels_path, native.directory / "contract.json", mode=mode, pass_=pass_,
                                  tiles=tiles)  # fmt: skip
            kernels = 1 if mode == "unified" else 2
            assert len(got) == len(recorder.calls) == kernels * len(PASSES[pass_]), (mode, pass_)
            requests += got
    assert any(launch["meta"]["GLOBALTIMER"] for launch in launches)  # a profiled launch stamps natively
    shmem_launches, shmem_requests = _nvshmem_launches(layer, tiles)
    launches += shmem_launches
    requests += shmem_requests
    job = tmp_path / "launches.json"
    job.write_text(json.dumps({"launches": launches, "requests": requests}))
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.pop("TRITON_DEFAULT_FP_FUSION", None)  # the controls set it
    done = subprocess.run([sys.executable, "-c", _JIT_KEYS, str(job)], capture_output=True, text=True, env=env,
                          timeout=HANG_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    warmed = out["prewarm"]
    assert [r["status"] for r in warmed] == ["keyed"] * len(requests), [r.get("error") for r in warmed]
    for launch, jit, r in zip(launches, out["jit"], warmed, strict=True):
        assert jit == r["key"] == r["worker_key"], (r["label"], launch["meta"])
    assert len(set(out["jit"])) == len(launches)  # every variant its own build
    assert out["other_num_warps"] != out["jit"][0] and out["other_env"] != out["jit"][0]


_PREWARM_TWICE = r"""
import json, sys

import torch
from triton import knobs

from rdepc.codegen.sm90 import stand_in_driver
from rdepc.ir.arguments import POINTEE, kernel_args
from rdepc.ir.contract import KernelContract, Tiles
from rdepc.codegen.prewarm import launch_requests, prewarm
from rdepc.toolchain import import_kernels


stand_in_driver()  # an H100: what JITFunction.run asks the driver before it compiles
kernels, path = sys.argv[1:3]
requests = [launch_requests(kernels, path, mode=m)[k] for m, k in (("unified", 0), ("split", 0), ("unified", 0))]
out = {"first": prewarm(requests, 2), "again": prewarm(requests, 2)}
# the JIT's own compile of the first request's launch (warmup: compiled, not launched) finds it
req, plan = requests[0], KernelContract.from_json(open(path).read())
args = [torch.empty(1, dtype=getattr(torch, POINTEE[k[1:]])) if k.startswith("*") else req["launch"][n]
        for n, k in kernel_args(plan) if k != "constexpr"]
tiles = Tiles(**req["tiles"])
meta = tiles.constexprs() | {"CAST_F32": False} | req["meta"] | {"num_warps": tiles.num_warps}
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
fn = import_kernels(kernels, interpret=False).rdep_layer
fn.warmup(*args, grid=(req["launch"]["n_programs"],), **meta)
out["jit_cache_hits"] = hits
print(json.dumps(out))
"""


def test_prewarm_compiles_each_build_once_and_the_launch_finds_it(tmp_path, monkeypatch):
    """tiny's forward in both kernel modes and the unified one again, in two processes: two
    builds compiled, the third request a duplicate; prewarmed again, both are found in the
    cache; the JIT's compile of that launch (a warmup: compiled, not launched) is a cache hit."""
    monkeypatch.chdir(ROOT)
    native = rdepc.load("examples/tiny.rdep").compile(backend="emulated", interpret=False)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    cmd = [sys.executable, "-c", _PREWARM_TWICE, str(native.kernels_path), str(native.directory / "contract.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    first, again = out["first"], out["again"]
    assert [r["status"] for r in first] == ["compiled", "compiled", "duplicate"], [r.get("error") for r in first]
    assert first[2]["of"] == 0 and all(r["seconds"] > 0 for r in first[:2])
    assert [r["status"] for r in again] == ["cached", "cached", "duplicate"]
    assert [r["key"] for r in again] == [r["key"] for r in first]
    assert out["jit_cache_hits"] == [True]
