"""Compiled layers: a spec's generated kernels and kernel contract, built once and kept in
the compilation cache (:mod:`rdepc.runtime.cache`), which knows nothing of how they are
made."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rdepc.ir.contract import KernelContract
from rdepc.ir.spec import spec_to_json
from rdepc.runtime.cache import cache_key, entry
from rdepc.runtime.transport import get


def generator_digest() -> str:
    """SHA-256 of the code generator's own source (codegen/, device code included) and of the
    IR it writes (rdepc/ir: the kernel contract in contract.json): a changed generator or
    contract never reuses what was built before, even at the same rdepc version."""
    from rdepc import codegen, ir

    h = hashlib.sha256()
    for package in (codegen, ir):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(f"{package.__name__}/{path.relative_to(root).as_posix()}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


class Compiled:
    """One compilation of a layer, in the cache: the generated kernels (``source``, at
    ``kernels_path``) and their kernel contract (``kernel``)."""

    def __init__(self, directory: Path, hit: bool):
        self.directory = directory
        self.hit = hit
        self.kernels_path = directory / "kernels.py"
        self.kernel = KernelContract.from_json((directory / "contract.json").read_text(encoding="utf-8"))

    @property
    def source(self) -> str:
        return self.kernels_path.read_text(encoding="utf-8")

    def module(self, backend: str = "emulated", device=None, **options):
        """An ``rdepc.runtime.RDEPModule`` running these kernels (``device`` "cpu": the
        Triton interpreter; "cuda": natively); a ``balance replicate`` layer's behind its
        balance plan (``rdepc.runtime.balance.ReplicatedModule``)."""
        from rdepc.runtime.balance import layer_module

        return layer_module(self.kernel, self.kernels_path, backend=backend, device=device, **options)


def compile_layer(
    spec, schedule: str | None = None, hw: str = "h100", backend: str = "emulated", interpret=True, gemm=None
):
    """Generate ``spec``'s kernels (or find them in the cache) and return them as
    :class:`Compiled` (``gemm``: the GEMMs' lowering asked for, as ``--gemm``). Raises
    SpecError for what the code generator does not support."""
    from rdepc.driver import generate_spec

    get(backend)  # a clear error for an unknown backend, before any work
    options = {"schedule": schedule, "hw": hw, "backend": backend} | ({"gemm": gemm} if gemm else {})
    key = cache_key(spec_to_json(spec), options, backend, interpret, generator_digest())

    def build() -> dict[str, str]:
        g = generate_spec(spec, schedule, hw, backend, gemm)
        return {"kernels.py": g.source, "contract.json": g.kernel.to_json() + "\n"}

    directory, hit = entry(key, build, required=("kernels.py", "contract.json"))
    return Compiled(directory, hit)
