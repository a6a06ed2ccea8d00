"""The compilation cache: generated kernels and their plan, keyed by what produced them.

The key is a SHA-256 over the elaborated spec (``spec_to_json``), the codegen options, the
rdepc, torch and triton versions (and a digest of the generator's own source), the target
(the backend) and whether the kernels run under the interpreter. An entry is a directory holding ``kernels.py`` and
``plan.json``; every file is written to a temporary name and moved into place
(``os.replace``), and a ``complete`` marker written last, so a reader never sees half an
entry. The directory is ``$RDEPC_CACHE_DIR``, default ``~/.cache/rdepc``; one that cannot be
created or written raises :class:`CacheError` (a ``UsageError``) before anything is compiled.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import rdepc
from rdepc.diagnostics import UsageError


class CacheError(UsageError):
    """The cache directory cannot be used: one line naming it, the variable that chose it and
    what to do."""


def cache_dir() -> Path:
    if os.environ.get("RDEPC_CACHE_DIR"):
        return Path(os.environ["RDEPC_CACHE_DIR"])
    try:
        return Path.home() / ".cache" / "rdepc"
    except RuntimeError:  # no HOME and no password entry to fall back on
        raise CacheError(
            "cannot find a home directory for the compilation cache (HOME is unset); "
            "set RDEPC_CACHE_DIR to a writable directory"
        ) from None


def _unusable(path: Path, e: OSError) -> CacheError:
    """Why ``path`` (in the cache) could not be made or written, as :class:`CacheError`."""
    near = path
    while not near.exists() and near.parent != near:  # the deepest part that is there
        near = near.parent
    if near.exists() and not near.is_dir():
        why = f"{near} is a file, not a directory"
    elif near.exists() and not os.access(near, os.W_OK | os.X_OK):
        why = f"{near} is not writable"
    else:
        why = f"{e.filename or path}: {e.strerror or e}"
    if os.environ.get("RDEPC_CACHE_DIR"):
        where = f"RDEPC_CACHE_DIR={os.environ['RDEPC_CACHE_DIR']}"
        fix = "set RDEPC_CACHE_DIR to a writable directory"
    else:
        where = f"{cache_dir()} (RDEPC_CACHE_DIR is unset: the default under HOME={Path.home()})"
        fix = "set RDEPC_CACHE_DIR to a writable directory, or point HOME at a writable directory"
    return CacheError(f"cannot use the compilation cache {where}: {why}; {fix}")


def usable_cache_dir() -> Path:
    """:func:`cache_dir`, created if need be; raises :class:`CacheError` (one line) when it
    cannot be created or written, before anything is compiled into it."""
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unusable(d, e) from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise _unusable(d, PermissionError(13, "Permission denied", str(d)))
    return d


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def generator_digest() -> str:
    """SHA-256 of the code generator's own source (codegen/ and the transports): a changed
    generator never reuses kernels it emitted before, even at the same rdepc version."""
    from rdepc.runtime import transport

    from rdepc import codegen

    h = hashlib.sha256()
    for path in [*sorted(Path(codegen.__file__).parent.glob("*.py")), Path(transport.__file__)]:
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(spec_json: dict, options: dict, target: str, interpret: bool) -> str:
    data = {
        "spec": spec_json,
        "options": options,
        "rdepc": rdepc.__version__,
        "generator": generator_digest(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "target": target,
        "interpret": interpret,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def entry(key: str, build: Callable[[], dict[str, str]]) -> tuple[Path, bool]:
    """The cache directory of ``key``, built by ``build()`` (file name → text) on a miss.
    Returns (directory, hit)."""
    d = cache_dir() / key[:2] / key
    try:
        if (d / "complete").is_file():  # a read-only cache still serves what it holds
            return d, True
    except OSError as e:
        raise _unusable(d, e) from None
    usable_cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)  # before building: an unusable cache fails fast
    except OSError as e:
        raise _unusable(d, e) from None
    files = build()
    try:
        for name, text in files.items():
            write_atomic(d / name, text)
        write_atomic(d / "complete", key + "\n")
    except OSError as e:  # a full disk, or the directory changed under us
        raise _unusable(d, e) from None
    return d, False


class Compiled:
    """One compilation of a layer, in the cache: the generated kernels (``source``, at
    ``kernels_path``) and their kernel plan (``kernel``)."""

    def __init__(self, directory: Path, hit: bool):
        from rdepc.codegen.lower import KernelPlan

        self.directory = directory
        self.hit = hit
        self.kernels_path = directory / "kernels.py"
        self.kernel = KernelPlan.from_json((directory / "plan.json").read_text(encoding="utf-8"))

    @property
    def source(self) -> str:
        return self.kernels_path.read_text(encoding="utf-8")

    def module(self, backend: str = "emulated", device=None, **options):
        """An ``rdepc.runtime.RDEPModule`` running these kernels (``device`` "cpu": the
        Triton interpreter; "cuda": natively)."""
        from rdepc.runtime.module import RDEPModule

        return RDEPModule(self.kernel, self.kernels_path, backend=backend, device=device, **options)


def compile_layer(spec, schedule: str | None = None, hw: str = "h100", backend: str = "emulated", interpret=True):
    """Generate ``spec``'s kernels (or find them in the cache) and return them as
    :class:`Compiled`. Raises SpecError for what the code generator does not support."""
    from rdepc.codegen import generate_spec
    from rdepc.runtime.transport import get

    from rdepc.ir.spec import spec_to_json

    get(backend)  # a clear error for an unknown backend, before any work
    options = {"schedule": schedule, "hw": hw, "backend": backend}
    key = cache_key(spec_to_json(spec), options, backend, interpret)

    def build() -> dict[str, str]:
        g = generate_spec(spec, schedule, hw, backend)
        return {"kernels.py": g.source, "plan.json": g.kernel.to_json() + "\n"}

    directory, hit = entry(key, build)
    return Compiled(directory, hit)


__all__ = [
    "CacheError",
    "Compiled",
    "cache_dir",
    "cache_key",
    "compile_layer",
    "entry",
    "usable_cache_dir",
    "write_atomic",
]
