"""Compile generated kernels to sm_90 cubins without a GPU (docs: toolchain-facts §3).

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` builds a cubin on a
machine with no GPU and no driver. It runs in subprocesses (``python -m
rdepc.codegen.sm90``): Triton fixes its mode when it is first imported (see
``rdepc.runtime.launch``), so a process that has run the interpreter cannot compile
natively, and the subprocess imports the generated file with ``TRITON_INTERPRET=0`` —
the very file the interpreter tests import. The builds are dealt over processes that run at
once, each kept for the next call (``rdepc.codegen.compilers``: one ``import torch, triton``
serves many layers); each distinct kernel compiles once.

A result records the cubin's path, the compile time, the shared memory the kernel needs
(an H100 gives a block at most 227 KiB), registers per thread and local memory (spills)
read from the cubin (``cuobjdump --dump-resource-usage``, bundled with Triton), the thread
blocks an SM holds at once (``ctas_per_sm``), every GEMM main loop read from the SASS
(``rdepc.codegen.sass.gemm_loops``: instructions per iteration, spills inside it, wgmma
wait depth), and a few facts read from the PTX: the target, the ``wgmma`` shapes of the grouped GEMMs, whether
their operands arrive by TMA (``cp.async.bulk.tensor``), the acquire loads and release
atomics of the flag protocol, and whether NVSHMEM's device code is in it. A ``balance
replicate`` layer's own kernels (the plan, the exchange) are compiled beside the layer's
(:data:`BALANCE_KERNELS`: their resources only). Kernels generated for the
``nvshmem`` transport are linked against NVSHMEM's device bitcode (``extern_libs``: the part
of it they call, ``rdepc.toolchain.nvshmem_library``), which needs the ``nvidia-nvshmem-cu13``
wheel but no GPU.

A kernel is compiled as a launch runs it. Triton's JIT specialises every launch on its
argument values (a pointer whose address is a multiple of 16 and an int divisible by 16
get ``tt.divisibility 16``, an int equal to 1 becomes a constant, an int that fits in 32
bits is an i32 whatever ``kernel_args`` declares), and that changes the code: without the
alignment facts moonlight's forward stored 2 bytes at a time and needed 2.7 KB of stack
per thread. :func:`launch_specialization` runs Triton's own binder over the arguments of
the native launch each kernel stands for: 16-byte aligned pointers (the runtime passes
only such: ``runtime.tensors.aligned``) and the scalars ``KernelContract.launch_scalars``
gives at T' = the plan's T, rank 0, the native spin bound and the native grid on an H100
(132 SMs: ``KernelContract.launch_grid``; ``sms`` to assume another GPU). A launch with
other values (another T' or GPU, another rank of a per-rank transport, where rank 1 is a
constant) may specialise differently; each result records the values and what they
specialised (``launch``, ``specialization``).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

from rdepc.codegen import compilers, sass

from rdepc.ir.arguments import POINTEE, kernel_args, own_constexprs
from rdepc.ir.balance import COUNTERS
from rdepc.ir.contract import (
    H100_SMS,
    NATIVE_MODE,
    NATIVE_SPIN_BOUND,
    TRANSPORT_PROCESSES,
    KernelContract,
    Tiles,
    mode_kernels,
)
from rdepc.toolchain import import_kernels

# The native builds of one generated file, each (function, constexprs): split mode's
# transport kernel and GEMM kernel, forward (keeping what a backward walks: SAVE; the GEMM
# kernel also as a call without autograd launches it) and backward, the GEMM kernel as the
# library lowering launches it, then the unified kernel's forward and backward.
KERNELS = {
    "rdep_transport": ("rdep_layer", {"GEMMS": False, "BACKWARD": False, "SAVE": True}),
    "rdep_gemm": ("rdep_gemm", {"BACKWARD": False, "SAVE": True}),
    "rdep_gemm.forward": ("rdep_gemm", {"BACKWARD": False, "SAVE": False}),  # a call that keeps nothing
    "rdep_transport.backward": ("rdep_layer", {"GEMMS": False, "BACKWARD": True, "SAVE": False}),
    "rdep_gemm.backward": ("rdep_gemm", {"BACKWARD": True, "SAVE": False}),
    # the library GEMM lowering's: the GEMM kernel's items wait and signal, torch computes them
    "rdep_gemm.library": ("rdep_gemm", {"BACKWARD": False, "SAVE": True, "LIBRARY": True}),
    "rdep_layer": ("rdep_layer", {"GEMMS": True, "BACKWARD": False, "SAVE": True}),
    "rdep_layer.backward": ("rdep_layer", {"GEMMS": True, "BACKWARD": True, "SAVE": False}),
}


# A ``balance replicate`` layer's own launches (``codegen/device/balance.py``), as its
# runtime makes them: with every rank in one process the plan (count, solve, reroute) before
# the layer's; one process per rank the plan and the weights are tasks of the layer's kernel
# and what is left is the backward's gradient exchange through the symmetric allocation;
# ``balance_await`` is built once for each counter it waits on (the replicas' gradients, the
# homes' receipts).
BALANCE_KERNELS = {
    "one": ("balance_count", "balance_solve", "balance_reroute"),
    "per-rank": ("balance_await.gradients", "balance_await.receipts", "balance_give", "balance_reduce"),
}
# The balance kernels' parameters' types, by name (the weights in the layer's dtype).
BALANCE_ARGS = {"bal": "*u8", "topk_ids": "*i64", "phys_ids": "*i64", "expected": "*i64", "packed": "*dtype"}
BALANCE_ARGS |= {n: "i64" for n in ("stride", "grads_at")}
BALANCE_ARGS |= {n: "i32" for n in ("n_tokens", "rank", "P", "bound")}
BALANCE_ARGS |= {n: "*i32" for n in ("load", "owner_of", "phys", "cum", "slot_table", "loads", "homes")}
BALANCE_ARGS["err"] = "*i32"  # the exchange's error word


def kernel_mode(kernel: str) -> str:
    """The kernel mode that launches build ``kernel`` (of KERNELS)."""
    return "unified" if KERNELS[kernel][1].get("GEMMS") else "split"


H100_SHARED = 227 * 1024


def cubin_name(layer: str, kernel: str, arch: int) -> str:
    return f"{layer}.{kernel}.sm_{arch}.cubin"


def compile_cubins(
    jobs: list[tuple[Path, Path, Path]],
    arch: int = 90,
    parallel: int = 1,
    timeout: float = 900,
    profile: bool = False,
    sms: int = H100_SMS,
    kernels: list[str] | None = None,
    done=None,
) -> list[dict]:
    """Compile every kernel (``kernels``: of KERNELS or BALANCE_KERNELS; default each job's
    :func:`job_builds`) of each (kernels.py, contract.json, out_dir) job, in up to ``parallel``
    subprocesses running at once (:func:`deal`); results in job order, each job's in kernel
    order. ``profile``: with the profile's %globaltimer stamps compiled in. ``sms``: the GPU's
    SMs, which size the launch each kernel is specialised for. ``done(result, finished,
    total)`` is called as each build finishes (progress). RuntimeError when a build fails or
    the builds take longer than ``timeout`` seconds (their processes are killed)."""
    known = [*KERNELS, *dict.fromkeys(k for ks in BALANCE_KERNELS.values() for k in ks)]
    unknown = set(kernels or ()) - set(known)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)} (known: {', '.join(known)})")
    builds = [(j, k) for j, job in enumerate(jobs) for k in (kernels or job_builds(job[1]))]
    shares = deal(builds, parallel)
    # This environment otherwise: the variables Triton's cache key covers (TRITON_DEFAULT_FP_FUSION,
    # ...) as the launching process has them, so that a build here is the entry its JIT looks up.
    env = dict(os.environ, TRITON_INTERPRET="0")
    results: dict[int, dict] = {}
    busy: list[compilers.Compiler] = []
    stop = threading.Event()  # set once the time is out
    lock = threading.Lock()

    def run(share: list[int]) -> str | None:
        """One process's builds (its results in the order sent); its error text if it failed."""
        payload = [[*(str(Path(x).resolve()) for x in jobs[builds[i][0]]), builds[i][1]] for i in share]
        order = iter(share)

        def each(r: dict) -> None:
            with lock:
                results[next(order)] = r
                if done is not None:
                    done(r, len(results), len(builds))

        c = compilers.take(env)
        with lock:
            busy.append(c)
            if stop.is_set():  # started after the others' time ran out
                c.proc.kill()
        error = c.run({"arch": arch, "profile": profile, "sms": sms, "builds": payload}, each)
        with lock:
            busy.remove(c)
        if error is None:
            compilers.give_back(c)
        return error

    pool = ThreadPoolExecutor(max(1, len(shares)))
    futures = [pool.submit(run, share) for share in shares]
    finished, late = wait(futures, timeout=timeout)
    if late:
        with lock:
            stop.set()
            for c in busy:
                c.proc.kill()  # its run sees the end of its output and reports it
    pool.shutdown(wait=True)
    if late:
        raise RuntimeError(f"rdepc: compiling for sm_{arch} took longer than {timeout:.0f} s (its processes killed)")
    errors = [e for e in (f.result() for f in finished) if e]
    if errors:
        raise RuntimeError(f"rdepc: compiling for sm_{arch} failed:\n" + "\n".join(errors))
    return [results[i] for i in range(len(builds))]


def job_builds(contract_path: Path) -> list[str]:
    """Every build a layer's launches compile: its balance kernels (a ``balance replicate``
    layer's, :data:`BALANCE_KERNELS`), then :data:`KERNELS`."""
    contract = KernelContract.from_json(Path(contract_path).read_text(encoding="utf-8"))
    balance = BALANCE_KERNELS[TRANSPORT_PROCESSES[contract.transport]] if contract.balance[0] else ()
    return [*balance, *KERNELS]


def deal(builds: list[tuple[int, str]], parallel: int) -> list[list[int]]:
    """The builds (job, kernel) each of at most ``parallel`` processes compiles, by index:
    whole jobs, the heaviest first to the least loaded process, where there are as many
    jobs as processes (each process imports a job's kernels once); else build by build."""
    jobs = list(dict.fromkeys(j for j, _ in builds))
    parallel = max(1, min(parallel, len(builds)))
    if len(jobs) < parallel:
        return [list(range(len(builds)))[p::parallel] for p in range(parallel)]
    of = {j: [i for i, (job, _) in enumerate(builds) if job == j] for j in jobs}
    shares: list[list[int]] = [[] for _ in range(parallel)]
    for j in sorted(jobs, key=lambda j: -len(of[j])):
        min(shares, key=len).extend(of[j])
    return [sorted(share) for share in shares if share]


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


@dataclass
class Specialized:
    """What :func:`launch_specialization` derives for one kernel: ``signature``,
    ``constexprs`` and ``attrs`` as ``ASTSource`` takes them, the parsed ``options``, the
    launch's scalar values (``launch``) and a summary of the specialisation."""

    signature: dict
    constexprs: dict
    attrs: dict
    options: object
    launch: dict
    specialization: dict


def stand_in_driver(arch: int = 90) -> None:
    """Make Triton's active driver a stand-in for a CUDA GPU of compute capability ``arch``
    on a machine without one: a native launch (``JITFunction.run``, ``warmup``) asks it for
    the current device, stream and target, and nothing else before it compiles. What runs
    the builds is the caller's to replace (their CUDA launch needs a GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class StandIn:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

    driver.set_active(StandIn())


def native_launch(
    contract: KernelContract,
    tiles: Tiles,
    mode: str = NATIVE_MODE,
    sms: int = H100_SMS,
    tokens: int | None = None,
    rank: int | None = None,
    spin_bound: int = NATIVE_SPIN_BOUND,
    comm: int | None = None,
) -> dict[str, int]:
    """The scalar arguments of a native launch as RDEPModule passes them on a GPU of ``sms``
    SMs (this process's share): its programs (``KernelContract.launch_grid``, one per SM;
    ``comm``: split mode's transport programs) and ``KernelContract.launch_scalars`` at T'
    = ``tokens`` (default the plan's T), ``rank`` (a per-rank transport's process; default
    0) and the spin bound. A backward launches with its forward's. Every kernel of a call
    takes the same scalars (each the ones it declares)."""
    per_rank = contract.per_rank
    rank = (rank or 0) if per_rank else None
    programs, _ = contract.launch_grid(contract.work(tiles, mode, rank=rank), sms, comm)
    n_tokens = contract.T if tokens is None else tokens
    return contract.launch_scalars(n_tokens, programs, rank, spin_bound, per_rank)


def launch_values(contract: KernelContract, kernel: str, tiles: Tiles, sms: int = H100_SMS) -> dict[str, int]:
    """The scalar arguments of the native launch ``kernel`` (of KERNELS) stands for: T' =
    the plan's T, rank 0 (per-rank transports), the native spin bound, and the grid
    RDEPModule gives ``sms`` SMs in the build's mode (a backward launches on its forward's)."""
    return native_launch(contract, tiles, kernel_mode(kernel), sms)


def kernel_meta(contract: KernelContract, tiles: Tiles, kernel: str, profile: bool = False) -> dict:
    """The constexprs a native launch of build ``kernel`` passes (its function's only)."""
    fn, variant = KERNELS[kernel]
    meta = tiles.constexprs() | {"CAST_F32": False, "PROFILE": profile, "GLOBALTIMER": profile, "LIBRARY": False}
    meta |= variant
    return own_constexprs(contract, fn, meta)


def variant_meta(
    mode: str, kernel: str, backward: bool = False, save: bool = False, profile: bool = False, library: bool = False
) -> dict[str, bool]:
    """The constexprs that tell one native launch of ``kernel`` (``rdep_layer`` or
    ``rdep_gemm``) from another (RDEPModule._launch): those ``mode`` sets for it
    (``mode_kernels``), the pass, keeping what a backward walks, the profile's %globaltimer
    stamps (a profiled module's, in either pass) and, for the GEMM kernel, the library
    lowering's waits without GEMMs."""
    meta = dict(mode_kernels(mode))[kernel] | {"PROFILE": profile, "GLOBALTIMER": profile}
    meta |= {"BACKWARD": backward, "SAVE": save}
    return meta | ({"LIBRARY": library} if kernel == "rdep_gemm" else {})


def launch_options(contract: KernelContract, tiles: Tiles, arch: int | None = None) -> dict:
    """The options besides the constexprs a native launch passes Triton: ``num_warps`` and,
    for the nvshmem transport, NVSHMEM's device library as ``extern_libs`` (as
    ``runtime.nvshmem.NvshmemLauncher`` adds it; ``arch``: the library for that architecture,
    default the launcher's)."""
    options: dict = {"num_warps": tiles.num_warps}
    if contract.transport == "nvshmem":
        from rdepc.toolchain import nvshmem_extern_libs

        options["extern_libs"] = nvshmem_extern_libs() if arch is None else nvshmem_extern_libs(arch)
    return options


def launch_specialization(
    contract: KernelContract,
    fn,
    kernel: str,
    *,
    arch: int = 90,
    tiles: Tiles | None = None,
    options: dict | None = None,
    profile: bool = False,
    sms: int = H100_SMS,
) -> Specialized:
    """Triton's own JIT binder (the code a launch runs before it compiles) run for the
    cuda backend over the arguments a native launch of ``kernel`` passes: a 16-byte aligned
    stand-in for every pointer, :func:`launch_values`, the constexprs. ``fn``: the
    generated ``rdep_layer``, native or interpreted (its Python function is what counts).
    Compiles nothing and needs no GPU. RuntimeError when this Triton's binder is not where
    it was in 3.6–3.9: an unspecialised build would report code no launch runs."""
    tiles = tiles or Tiles.default(contract.H, contract.F, contract.dtype, interpret=False)
    scalars = launch_values(contract, kernel, tiles, sms)
    kwargs = kernel_meta(contract, tiles, kernel, profile) | {"num_warps": tiles.num_warps} | (options or {})
    return specialize(contract, fn, scalars, kwargs, ("cuda", arch, 32), KERNELS[kernel][0])


def specialize(
    contract: KernelContract,
    fn,
    scalars: dict[str, int],
    kwargs: dict,
    target=("cuda", 90, 32),
    kernel: str = "rdep_layer",
) -> Specialized:
    """What ``JITFunction.run`` derives for ``target`` from a launch of ``fn`` (the generated
    ``kernel``, of ``rdepc.ir.arguments.KERNELS``) with the scalar arguments ``scalars`` (those
    it declares), a 16-byte aligned tensor of its declared type for every pointer (every
    pointer the runtime passes is: ``runtime.tensors.aligned``) and the keyword arguments
    ``kwargs`` (constexprs and options), passed as a launch passes them."""
    import torch

    from rdepc.toolchain import interpreter_env, triton_mode

    declared = dict(kernel_args(contract, kernel))
    args = []
    for name, kind in declared.items():
        if kind.startswith("*"):  # a CPU allocation: 64-byte aligned
            args.append(torch.empty(1, dtype=getattr(torch, POINTEE[kind[1:]])))
        elif kind != "constexpr":
            args.append(scalars[name])
    # The binder imports Triton's gluon on first use, which must see the mode this process runs in.
    with interpreter_env(triton_mode() == "interpret"):
        return _specialize(contract, fn, tuple(target), declared, args, scalars, dict(kwargs), kernel)


def _run_options(jit, kwargs: dict) -> dict:
    """``kwargs`` with the options ``JITFunction.run`` adds to a launch's before it parses them."""
    from triton import knobs

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    return kwargs


def _specialize(contract, fn, target, declared, args, scalars, kwargs, kernel) -> Specialized:
    import triton

    try:  # JITFunction.run's first steps, for a cuda target instead of the current device's
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        # interpreted: the same Python function and decorator arguments (do_not_specialize)
        jit = fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **fn.kwargs)
        backend = make_backend(GPUTarget(*target))
        kwargs = _run_options(jit, kwargs)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, specialization, leftover = binder(*args, **kwargs)
        parsed, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, leftover)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise RuntimeError(
            f"rdepc: cannot specialise {kernel} as a launch does with Triton {triton.__version__}: its JIT binder "
            "(triton.runtime.jit.create_function_from_signature, JITFunction._pack_args, as in 3.6-3.9) is not "
            f"what rdepc knows ({type(e).__name__}: {e}); an unspecialised build would report code no launch runs"
        ) from e
    names = list(bound)
    for name, kind in declared.items():  # the binder infers what kernel_args declares: only scalars may differ
        got = signature[name]
        if kind.startswith("*") and got != kind:
            raise RuntimeError(f"rdepc: Triton typed {kernel}'s {name} {got}, kernel_args declares {kind}")
    divisible = {names[k[0]] for k, a in attrs.items() if ["tt.divisibility", 16] in a}
    summary = {
        "aligned_pointers": sum(1 for n, k in declared.items() if k.startswith("*") and n in divisible),
        "pointers": sum(1 for k in declared.values() if k.startswith("*")),
        "divisible_ints": [n for n in scalars if n in divisible],
        "constexpr_ones": [n for n in scalars if n in signature and signature[n] == "constexpr"],
        "i32_from_i64": [n for n in scalars if n in declared and declared[n] == "i64" and signature[n] == "i32"],
    }
    return Specialized(signature, constexprs, attrs, parsed, scalars, summary)


def _compile(
    kernels_path: str,
    contract_path: str,
    out_dir: str,
    arch: int,
    profile: bool,
    sms: int,
    kernels: list[str],
):
    """Each build of ``kernels`` of one job, yielded as it is compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    contract = KernelContract.from_json(Path(contract_path).read_text(encoding="utf-8"))
    # as a launch imports it: its builds' cache keys do not depend on which kernel was compiled
    # first, so a build compiled before (another job, another test) is found in Triton's cache
    module = import_kernels(kernels_path, interpret=False)
    tiles = Tiles.default(contract.H, contract.F, contract.dtype, interpret=False)
    options: dict = {"num_warps": tiles.num_warps}
    if contract.transport == "nvshmem":
        # The nvshmem transport's device half calls nvshmem_ptr: link NVSHMEM's library.
        from rdepc.toolchain import nvshmem_extern_libs

        options["extern_libs"] = nvshmem_extern_libs(arch)
    for kernel in kernels:
        if kernel not in KERNELS:
            yield _balance(contract, module, kernel, Path(out_dir), arch, options)
            continue
        fn = getattr(module, KERNELS[kernel][0])
        own = tiles.for_backward(contract) if KERNELS[kernel][1].get("BACKWARD") else tiles  # as a module launches
        t0 = time.perf_counter()
        sp = launch_specialization(
            contract, fn, kernel, arch=arch, tiles=own, options=options, profile=profile, sms=sms
        )
        src = ASTSource(fn=fn, signature=sp.signature, constexprs=sp.constexprs, attrs=sp.attrs)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=sp.options.__dict__)
        r = _written(contract, kernel, k, Path(out_dir), arch, 32 * own.num_warps, time.perf_counter() - t0)
        ptx = k.asm["ptx"]
        wgmma = sorted({w.split(".")[4] for w in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m\w+", ptx)})
        text = sass.disassemble(Path(r["cubin"]))
        loops = [loop.as_dict() for loop in sass.gemm_loops(text)]
        yield (
            {
                **r,
                "wgmma": "wgmma" in ptx,
                "wgmma_shapes": wgmma,
                "tma": "cp.async.bulk.tensor" in ptx,
                "descriptors": descriptor_builds(ptx),
                "loops": loops,
                "sum_loops": [asdict(loop) for loop in sass.sum_loops(text)],  # the combine's
                "move_loops": [asdict(loop) for loop in sass.move_loops(text)],  # dispatch's, return's, unpack's
                "acquire": "acquire" in ptx,
                "release": "release" in ptx,
                "globaltimer": "%globaltimer" in ptx,
                "fp8": "e4m3x2" in ptx,  # fp8 e4m3 conversions (the forward's quantise and GEMM1 operand)
                # NVSHMEM's code inlined from the bitcode (its device state, which
                # nvshmem.core.module_init fills, is then a .const of the module).
                "nvshmem": "nvshmem" in ptx,
                "tiles": {**own.constexprs(), "num_warps": own.num_warps},
                "launch": sp.launch,
                "specialization": sp.specialization,
            }
        )


def descriptor_builds(ptx: str) -> dict[str, int]:
    """The tensor descriptors a kernel builds in global memory (each a ``tensormap`` written
    and fenced before its first read), read from its PTX: ``program`` those before its first
    atomic (where a program starts: the GEMM kernel counts itself in, the unified kernel takes
    its first ticket), ``item`` those after, which a work item builds each time it runs them."""
    first = ptx.find("atom.")
    builds = [m.start() for m in re.finditer(r"tensormap\.replace\.tile\.global_address", ptx)]
    program = sum(1 for at in builds if first < 0 or at < first)
    return {"program": program, "item": len(builds) - program}


def _balance(contract: KernelContract, module, kernel: str, out_dir: Path, arch: int, options: dict) -> dict:
    """One balance kernel a ``balance replicate`` layer launches (:data:`BALANCE_KERNELS`),
    at Triton's default 4 warps and unspecialised (its pointers and scalars vary by call):
    registers, stack, local memory (spills), shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, _, waits = kernel.partition(".")
    fn = getattr(module, name)
    signature = {a: BALANCE_ARGS.get(a, "constexpr").replace("*dtype", "*" + contract.dtype) for a in fn.arg_names}
    constexprs = {(fn.arg_names.index("counter"),): COUNTERS[waits]} if waits else {}
    t0 = time.perf_counter()
    options = {**options, "num_warps": 4}
    k = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)
    return {**_written(contract, kernel, k, out_dir, arch, 32 * 4, time.perf_counter() - t0), "balance": True}


def _written(contract: KernelContract, kernel: str, k, out_dir: Path, arch: int, threads: int, seconds: float) -> dict:
    """A compiled ``kernel``'s cubin written to ``out_dir`` (atomically), and what every build
    reports: its size, compile time, target, shared memory, registers, stack and spills,
    and the CTAs an SM holds."""
    target = out_dir / cubin_name(contract.layer, kernel, arch)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(k.asm["cubin"])
    tmp.replace(target)
    used, shared = resources(target), int(k.metadata.shared)
    return {
        "layer": contract.layer,
        "kernel": kernel,
        "cubin": str(target),
        "bytes": len(k.asm["cubin"]),
        "seconds": round(seconds, 3),
        "shared": shared,
        "target": next((ln.split()[1] for ln in k.asm["ptx"].splitlines() if ln.startswith(".target")), ""),
        **used,
        "threads": threads,
        "ctas_per_sm": sass.ctas_per_sm(used["registers"], shared, threads),
    }


def main() -> int:
    """Compile the builds (kernels.py, contract.json, out_dir, kernel) of each request read from
    stdin, a line each: one JSON result a line as each finishes, then ``compilers.END``;
    whatever else writes to stdout goes to stderr."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        arch, profile, sms = request["arch"], request.get("profile", False), request.get("sms", H100_SMS)
        for job, builds in itertools.groupby(request["builds"], key=lambda b: tuple(b[:3])):
            for r in _compile(*job, arch, profile, sms, [b[3] for b in builds]):
                results.write(json.dumps(r) + "\n")
                results.flush()
        results.write(json.dumps(compilers.END) + "\n")
        results.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = [
    "BALANCE_KERNELS",
    "H100_SHARED",
    "KERNELS",
    "Specialized",
    "compile_cubins",
    "cubin_name",
    "kernel_meta",
    "kernel_mode",
    "launch_options",
    "launch_specialization",
    "launch_values",
    "native_launch",
    "specialize",
    "variant_meta",
]
