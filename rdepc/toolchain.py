"""The Triton and NVSHMEM toolchain of this process, for the code generator and the
runtime alike: which mode Triton runs in, importing generated kernels in the right one, and
where NVSHMEM's device bitcode is and the part of it a kernel links.

Triton fixes a process's mode when it is first imported: ``triton.language``'s own
``@jit`` helpers (``tl.zeros``, ``tl.sum``, ...) are decorated then, as interpreted or as
compiled functions, and kernels of the other mode cannot call them. So a process runs
rdepc kernels either under the interpreter (CPU tensors, ``TRITON_INTERPRET=1``) or
natively (GPU), whichever comes first. :func:`import_kernels` imports Triton in the mode
asked for when it is not imported yet, sets ``TRITON_INTERPRET`` only while the generated
file is imported (where ``@triton.jit`` reads it), restores the environment afterwards,
and reports a clear error when the process is already in the other mode.

Importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path


@contextlib.contextmanager
def interpreter_env(interpret: bool):
    """TRITON_INTERPRET set for the duration, then restored (nothing leaks)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def triton_mode() -> str | None:
    """ "interpret" or "native": the mode Triton was imported in; None before its import."""
    if "triton.language" not in sys.modules:
        return None
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return "interpret" if isinstance(standard.zeros, InterpretedFunction) else "native"


def import_kernels(path: str | Path, interpret: bool):
    """Import the generated kernel file ``path`` for the interpreter or for native runs."""
    path = Path(path).resolve()
    want = "interpret" if interpret else "native"
    with interpreter_env(interpret):
        mode = triton_mode()
        if mode is None:
            importlib.import_module("triton.language")
            mode = triton_mode()
        if mode != want:
            fix = "Start the process with TRITON_INTERPRET=1 in its environment, or build the CPU module first; "
            raise RuntimeError(
                f"rdepc: this process imported Triton in {mode} mode, and a "
                f"{'CPU (interpreted)' if interpret else 'GPU (native)'} module needs {want} mode. Triton fixes the "
                "mode when it is first imported, and something imported it before this module was built (transformers "
                f"does). {fix if interpret else ''}CPU and GPU modules need separate processes."
            )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        name = f"rdepc_kernels_{path.stem}_{digest}_{want}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        if not interpret:
            settle_cache_keys(module)
        return module


def settle_cache_keys(module) -> None:
    """Compute the Triton cache key of every jitted function of a generated kernel file,
    callees before callers. Triton 3.6 folds a callee's global constants into its caller's
    key only when the callee's key was computed first (``DependenciesFinder._update_hash``
    merges ``used_global_vals`` before it asks for the callee's ``cache_key``), so the keys
    of two kernels that share callees (``rdep_layer``, ``rdep_gemm``) depend on which one a
    process keys first: the prewarm's processes and the launching one would file and look
    up different builds. In this order every process gets the same keys."""
    from triton.runtime.jit import JITFunction

    fns = {n: f for n, f in vars(module).items() if isinstance(f, JITFunction)}
    calls = {n: {m for m in fns if m != n and re.search(rf"\b{m}\s*\(", getattr(f, "src", ""))} for n, f in fns.items()}
    done: list[str] = []

    def visit(n: str, path: tuple[str, ...]) -> None:
        if n in done or n in path:
            return
        for m in sorted(calls[n]):
            visit(m, (*path, n))
        done.append(n)

    for n in sorted(fns):
        visit(n, ())
    for n in done:
        fns[n].hash = None
    for n in done:
        _ = fns[n].cache_key


EXTERN_LIB = "libnvshmem_device"  # the library nvshmem_ptr is declared over (transport.NVSHMEM_DEVICE)
INSTALL_HINT = "pip install 'rdepc[nvshmem]' (or nvidia-nvshmem-cu13 and nvshmem4py-cu13)"


class NvshmemUnavailable(RuntimeError):  # noqa: N818 - the name says what it means: not an error in rdepc
    """The nvshmem backend cannot run in this process; the message is one line saying why
    and what to do instead."""


def one_line(e: BaseException) -> str:
    """An exception as one short line (messages from native libraries span many)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def bitcode_path(arch: int = 90) -> Path:
    """NVSHMEM's device bitcode from the installed ``nvidia-nvshmem-cu13`` wheel:
    ``nvidia/nvshmem/lib/libnvshmem_device_sm_{arch}.bc`` (3.8 and later split it per
    architecture) or the single ``libnvshmem_device.bc`` (3.4.5, torch's pin). Found by
    file location, not by importing nvshmem4py, so CI needs only the wheel with the bitcode."""
    spec = importlib.util.find_spec("nvidia")  # a namespace package: no __init__ to run
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    names = (f"libnvshmem_device_sm_{arch}.bc", "libnvshmem_device.bc")
    for root in roots:
        for name in names:
            path = Path(root) / "nvshmem" / "lib" / name
            if path.is_file():
                return path
    raise NvshmemUnavailable(
        f"rdepc: the nvshmem backend needs NVSHMEM's device bitcode ({' or '.join(names)}), "
        f"which is not installed: {INSTALL_HINT}"
    )


def package_home() -> str:
    """The folder a ``python -m rdepc...`` subprocess starts in to import this process's
    rdepc: ``-m`` puts the working folder first on ``sys.path``, and in a source tree that
    folder's ``rdepc/`` (without ``passes``, ``codegen``, ... beside it) shadows an installed
    wheel. An editable install resolves the rest from there as it does here."""
    return str(Path(__file__).resolve().parent.parent)


# NVSHMEM's device functions rdepc's kernels call (codegen/device/nvshmem.py), with their C
# types as an LLVM-dialect declaration.
NVSHMEM_CALLED = {"nvshmem_ptr": "(!llvm.ptr, i32) -> !llvm.ptr"}


def nvshmem_extern_libs(arch: int = 90) -> dict[str, str]:
    """The ``extern_libs`` option of every native nvshmem kernel (a launch, a prewarm, an
    sm_90 compile alike): :func:`nvshmem_library`. Triton's cache key hashes the file's content."""
    return {EXTERN_LIB: str(nvshmem_library(arch))}


@functools.cache
def nvshmem_library(arch: int = 90) -> Path:
    """NVSHMEM's device bitcode cut to :data:`NVSHMEM_CALLED` and what they reach, as LLVM IR
    in Triton's cache (made once per bitcode and Triton version). Triton links an extern
    library by parsing the whole file: the 31 MB bitcode cost 5 s of every nvshmem build (of
    8-17 s), its 4 KB cut nothing, and the kernel linked against either is the same cubin
    (tests/test_nvshmem.py). The cut is Triton's own link of the bitcode into a module of the
    declarations alone, the functions it links internal there made external again."""
    import tempfile

    import triton
    from triton._C.libtriton import ir, llvm
    from triton.runtime.cache import get_cache_manager

    full = bitcode_path(arch)
    with full.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    key = hashlib.sha256(f"{triton.__version__} {digest} {sorted(NVSHMEM_CALLED.items())}".encode()).hexdigest()
    cache, name = get_cache_manager(key), f"{EXTERN_LIB}_cut.ll"
    if (have := cache.get_file(name)) is not None:
        return Path(have)
    decls = "".join(f"  llvm.func @{fn}{ty}\n" for fn, ty in NVSHMEM_CALLED.items())
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "decls.mlir").write_text("module {\n" + decls + "}\n", encoding="utf-8")
        context = ir.context()
        ir.load_dialects(context)
        module = llvm.to_module(ir.parse_mlir_module(str(Path(tmp) / "decls.mlir"), context), llvm.context())
    llvm.link_extern_libs(module, [str(full)])
    text = str(module)
    for fn in NVSHMEM_CALLED:
        text, found = re.subn(rf"^define internal (.*@{fn}\()", r"define \1", text, count=1, flags=re.M)
        if not found:
            raise NvshmemUnavailable(f"rdepc: NVSHMEM's device bitcode {full} does not define {fn}")
    return Path(cache.put(text, name, binary=False))
