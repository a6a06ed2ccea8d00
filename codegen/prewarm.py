"""Prewarming Triton's cache for native launches (the acceptance's stages on a GPU).

:func:`prewarm` compiles the builds given launches will ask for into Triton's on-disk cache,
in parallel processes, so that each launch's JIT finds its kernel there instead of spending
10-40 s of one core on it (the acceptance's stages launch dozens). A request
(:func:`launch_requests`) names the generated file, its plan, the tiles, the variant's
constexprs and the launch's scalars; the build is what ``JITFunction.run`` compiles for those
arguments — its binder, its ``_pack_args``, the ``debug`` and ``instrumentation_mode``
options it adds, ``extern_libs`` where the nvshmem launcher passes it — and its key is the
one ``triton.compile`` computes (:func:`compile_key`, which runs compile() itself up to
its cache lookup). The calling process computes every key (it is the process whose JIT
will look them up), compiles each missing one once, and each compiling process computes the
key again in its own environment and refuses a build whose key differs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from rdepc.codegen.sm90 import launch_options, native_launch, specialize, variant_meta

from rdepc.ir.arguments import own_constexprs
from rdepc.ir.contract import (
    H100_SMS,
    NATIVE_MODE,
    NATIVE_SPIN_BOUND,
    KernelContract,
    Tiles,
    mode_kernels,
)
from rdepc.toolchain import package_home

# What each pass of a launch compiles: (backward, save, profile) per launch, in launch order.
PASSES = {
    "forward": ((False, False, False),),  # a call without autograd
    "train": ((False, True, False), (True, False, False)),  # under autograd: the forward keeps, then the backward
    "profile": ((False, False, True),),  # a profiled module's call (%globaltimer stamps)
    "profile_train": ((False, True, True), (True, False, True)),  # ... under autograd, and its backward
}
VARIANT_CONSTEXPRS = ("BACKWARD", "SAVE", "PROFILE", "GLOBALTIMER")  # and rdep_layer's GEMMS, rdep_gemm's LIBRARY
_LINE = "rdepc-prewarm "  # a compiling process's result lines start so (anything else on stdout is not one)


def launch_requests(
    kernels_path: str | Path,
    contract_path: str | Path,
    *,
    mode: str = NATIVE_MODE,
    pass_: str = "forward",
    tiles: Tiles | None = None,
    sms: int = H100_SMS,
    tokens: int | None = None,
    ranks: list[int] | None = None,
    spin_bound: int = NATIVE_SPIN_BOUND,
    label: str = "",
    gemm: str = "triton",
) -> list[dict]:
    """:func:`prewarm`'s requests for the launches a native RDEPModule of this generated file
    makes in ``mode`` for ``pass_`` (PASSES), one per kernel the mode launches (once however
    often a call launches it): its tiles (default the native defaults; the module uses
    ``rdepc tune``'s record when there is one), T' = ``tokens`` (default the plan's T), a
    GPU of ``sms`` SMs, the spin bound; a per-rank transport: one request per rank in
    ``ranks`` (default all W), each process's own launch; ``gemm``: the GEMMs' lowering (the
    library's launches the GEMM kernel to wait and signal only). ValueError where the module
    refuses the launch (a split that leaves a kernel no program, a phased call of a
    schedule whose GEMMs wait for returns)."""
    contract = KernelContract.from_json(Path(contract_path).read_text(encoding="utf-8"))
    tiles = tiles or Tiles.default(contract.H, contract.F, contract.dtype, interpret=False)
    per_rank = contract.per_rank
    out = []
    for rank in (range(contract.W) if ranks is None else ranks) if per_rank else (None,):
        launch = native_launch(contract, tiles, mode, sms, tokens, rank, spin_bound)
        for backward, save, profile in PASSES[pass_]:
            what = f"{pass_}{' backward' if backward else ''}{'' if rank is None else f' rank {rank}'}"
            own = tiles.for_backward(contract) if backward else tiles  # as RDEPModule launches a backward
            for kernel in dict(mode_kernels(mode)):  # phased launches the transport kernel twice: one build
                out.append(
                    {
                        "kernels": str(Path(kernels_path).resolve()),  # the compiling process starts elsewhere
                        "contract": str(Path(contract_path).resolve()),
                        "kernel": kernel,
                        "tiles": asdict(own),
                        "meta": variant_meta(mode, kernel, backward, save, profile, gemm == "library"),
                        "launch": launch,
                        "label": f"{label or contract.layer} {mode} {kernel} {what}",
                    }
                )
    return out


class _Keyed(Exception):  # noqa: N818 - not an error: compile() stopped at its cache lookup
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


@contextlib.contextmanager
def keys_only():
    """Within it ``triton.compile`` (and so a JIT launch that would compile) computes its
    cache key and stops at its cache lookup, raising ``_Keyed(key)``: nothing is compiled
    or read. RuntimeError when this Triton's compile() does not look its cache up through
    ``triton.compiler.compiler.get_cache_manager`` (3.6)."""
    from triton.compiler import compiler as tc

    real = getattr(tc, "get_cache_manager", None)
    if real is None or "get_cache_manager(hash)" not in _source_of(tc.compile):
        import triton

        raise RuntimeError(
            f"rdepc: Triton {triton.__version__}'s compile() does not look its cache up as 3.6 does "
            "(get_cache_manager(hash)): its cache keys cannot be computed without compiling"
        )

    def stop(key):
        raise _Keyed(key)

    tc.get_cache_manager = stop
    try:
        yield
    finally:
        tc.get_cache_manager = real


def _source_of(fn) -> str:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def compile_key(src, target, options: dict) -> str:
    """The key ``triton.compile(src, target=target, options=options)`` files its build under
    (the SHA-256 naming its cache directory): compile() itself, run up to its cache lookup
    (:func:`keys_only`), so the key covers what it covers (Triton, the source and its
    callees, the specialisation, the backend and ptxas, the parsed options, the
    cache-invalidating environment variables)."""
    import triton

    with keys_only():
        try:
            triton.compile(src, target=target, options=options)
        except _Keyed as k:
            return k.key
    raise RuntimeError("rdepc: triton.compile did not reach its cache lookup")  # keys_only ensures it does


def _in_cache(src, key: str) -> bool:
    """Whether Triton's cache holds the build ``key`` of ``src`` (compile()'s own test for a hit)."""
    from triton.runtime.cache import get_cache_manager

    name = f"{src.name[:150]}.json"
    return (get_cache_manager(key).get_group(name) or {}).get(name) is not None


class _Builds:
    """Builds of requests in this process: the generated files imported natively (as a
    native RDEPModule imports them, so a later module of the same file shares them), their
    plans read once."""

    def __init__(self, target):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*target)
        self.contracts: dict[str, KernelContract] = {}

    def source(self, req: dict):
        """(ASTSource, parsed options as a dict) that a launch of ``req`` compiles."""
        from triton.compiler import ASTSource

        from rdepc.toolchain import import_kernels

        kernel = req["kernel"]
        want = set(VARIANT_CONSTEXPRS) | ({"GEMMS"} if kernel == "rdep_layer" else {"LIBRARY"})
        if set(req["meta"]) != want:
            raise ValueError(f"a prewarm request's meta for {kernel} sets {sorted(req['meta'])}, not {sorted(want)}")
        contract = self.contracts.get(req["contract"])
        if contract is None:
            contract = self.contracts[req["contract"]] = KernelContract.from_json(
                Path(req["contract"]).read_text(encoding="utf-8")
            )
        fn = getattr(import_kernels(req["kernels"], interpret=False), kernel)
        tiles = Tiles(**req["tiles"])
        # RDEPModule._launch's meta natively, the launcher's options (num_warps, extern_libs)
        meta = own_constexprs(contract, kernel, tiles.constexprs() | {"CAST_F32": False} | req["meta"])
        kwargs = meta | launch_options(contract, tiles)
        t = self.target
        sp = specialize(contract, fn, req["launch"], kwargs, (t.backend, t.arch, t.warp_size), kernel)
        src = ASTSource(fn=fn, signature=sp.signature, constexprs=sp.constexprs, attrs=sp.attrs)
        return src, sp.options.__dict__

    def key(self, req: dict) -> tuple[object, dict, str]:
        src, options = self.source(req)
        return src, options, compile_key(src, self.target, options)


def current_target() -> tuple[str, int, int]:
    """(backend, arch, warp size) of this process's GPU as Triton's JIT sees it; without a
    GPU an H100's, ("cuda", 90, 32)."""
    import torch

    if torch.cuda.is_available():
        from triton.runtime import driver

        t = driver.active.get_current_target()
        return (t.backend, t.arch, t.warp_size)
    return ("cuda", 90, 32)


def prewarm(
    requests: list[dict],
    parallel: int = 1,
    *,
    compile: bool = True,
    target: tuple[str, int, int] | None = None,
    timeout: float | None = None,
) -> list[dict]:
    """Compile what each request's launch will compile (:func:`launch_requests`) into
    Triton's cache, in ``parallel`` processes, each build once; one result per request.

    This process computes every request's key as its own JIT would (so it must run Triton
    natively: a process that runs the interpreter cannot); a key already in the cache, or
    an earlier request's, is not compiled again. The rest go, largest generated file first,
    to ``parallel`` processes that share one queue; each computes the key again in its own
    environment and compiles only when it is the same (a difference, e.g. a cache-
    invalidating environment variable set in one process only, would make every build one
    no launch finds: it is reported as failed). ``compile`` False: keys only, nothing
    compiled (the processes still compute theirs). ``target``: (backend, arch, warp size),
    default :func:`current_target`. ``timeout``: seconds after which the processes are
    ended; what they had not compiled is reported as not run.

    A result: ``label``, ``key``, ``status`` — ``compiled`` (``seconds``), ``cached``
    (already in the cache), ``duplicate`` (of request ``of``), ``keyed`` (compile False),
    ``failed`` (``error``) or ``not run`` — and ``worker_key``, the key its process
    computed."""
    target = tuple(target) if target else current_target()
    builds = _Builds(target)
    results: list[dict] = []
    first: dict[str, int] = {}
    todo: list[int] = []
    for i, req in enumerate(requests):
        r = {"label": req.get("label", ""), "key": None, "status": None}
        results.append(r)
        try:
            src, _, key = builds.key(req)
        except Exception as e:  # reported with the request; the others go on
            r |= {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        r["key"] = key
        if key in first:
            r |= {"status": "duplicate", "of": first[key]}
            continue
        first[key] = i
        if compile and _in_cache(src, key):
            r["status"] = "cached"
        else:
            todo.append(i)
    todo.sort(key=lambda i: -Path(requests[i]["kernels"]).stat().st_size)  # the longest first
    if todo:
        _dispatch(requests, results, todo, max(1, min(parallel, len(todo))), compile, target, timeout)
    return results


def _dispatch(requests, results, todo, parallel, compile, target, timeout) -> None:
    """``todo`` through ``parallel`` compiling processes fed from one queue (a thread each)."""
    import tempfile

    env = dict(os.environ, TRITON_INTERPRET="0")  # otherwise this process's: Triton's cache key covers some
    queue = list(reversed(todo))
    lock = threading.Lock()
    procs = []
    ended = threading.Event()  # the timeout ended the processes

    def feed(p, errlog):
        while True:
            with lock:
                if not queue:
                    break
                i = queue.pop()
            r = results[i]
            try:
                p.stdin.write(json.dumps({"request": requests[i], "key": r["key"], "target": target,
                                          "compile": compile}) + "\n")  # fmt: skip
                p.stdin.flush()
                line = p.stdout.readline()
                while line and not line.startswith(_LINE):
                    line = p.stdout.readline()
            except (BrokenPipeError, OSError, ValueError):
                line = ""
            if not line:  # the process ended: killed at the timeout, or crashed
                if ended.is_set():
                    r["status"] = "not run"  # its compile was cut short
                    break
                errlog.seek(0)
                tail = errlog.read().decode(errors="replace").strip()[-1500:]
                last = tail.splitlines()[-1] if tail else "no output"  # the exception, first: summaries cut the rest
                r |= {"status": "failed", "error": f"the compiling process ended (exit {p.poll()}): {last}\n{tail}"}
                break
            r |= json.loads(line[len(_LINE) :])
        with contextlib.suppress(OSError, ValueError):
            p.stdin.close()

    threads = []
    for _ in range(parallel):
        errlog = tempfile.TemporaryFile()  # noqa: SIM115 - closed when its process has ended
        p = subprocess.Popen(
            [sys.executable, "-m", "rdepc.codegen.prewarm"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog, text=True, env=env, cwd=package_home(),
        )  # fmt: skip
        procs.append((p, errlog))
        t = threading.Thread(target=feed, args=(p, errlog), daemon=True)
        t.start()
        threads.append(t)
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):  # past the timeout: end the processes (ours, by their handles)
        ended.set()
        with lock:
            queue.clear()
        for p, _ in procs:
            p.kill()
        for t in threads:
            t.join()
    for p, errlog in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=60)
        errlog.close()
    for i in todo:
        if results[i]["status"] is None:
            results[i]["status"] = "not run"


def _prewarm_worker() -> int:
    """A compiling process of :func:`prewarm`: one request per stdin line, one result line each."""
    builds = None
    for line in sys.stdin:
        job = json.loads(line)
        out: dict = {}
        t0 = time.perf_counter()
        try:
            if builds is None:
                builds = _Builds(job["target"])
            src, options, key = builds.key(job["request"])
            out["worker_key"] = key
            if key != job["key"]:
                out |= {"status": "failed", "error": (
                    f"the compiling process's key {key[:16]}... is not the launching process's {job['key'][:16]}...: "
                    "their environments differ in what Triton's cache key covers (TRITON_* variables, ptxas, "
                    "libdevice): a build here would be one no launch finds")}  # fmt: skip
            elif not job["compile"]:
                out["status"] = "keyed"
            elif _in_cache(src, key):  # another process compiled it meanwhile
                out["status"] = "cached"
            else:
                import triton

                k = triton.compile(src, target=builds.target, options=options)
                if k.hash != key:
                    raise RuntimeError(f"triton.compile filed the build under {k.hash}, not {key}")
                out |= {"status": "compiled", "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as e:
            out |= {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
        print(_LINE + json.dumps(out), flush=True)
    return 0


def prewarm_summary(results: list[dict]) -> dict:
    """Counts of :func:`prewarm`'s results by status, the builds' compile seconds summed and
    the longest, and the first failures."""
    count = {s: sum(r["status"] == s for r in results) for s in ("compiled", "cached", "duplicate", "keyed",
                                                                 "failed", "not run")}  # fmt: skip
    seconds = [r.get("seconds", 0.0) for r in results if r["status"] == "compiled"]
    return {
        "requests": len(results),
        "builds": len({r["key"] for r in results if r["key"]}),
        **count,
        "compile_seconds": round(sum(seconds), 1),
        "longest_seconds": max(seconds, default=0.0),
        "failures": [f"{r['label']}: {r.get('error', '')}"[:400] for r in results if r["status"] in ("failed",)][:5],
    }


if __name__ == "__main__":
    sys.exit(_prewarm_worker())
