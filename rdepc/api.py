"""The Python API: ``rdepc.parse`` and ``rdepc.load``."""

from __future__ import annotations

import math
import numbers
import os
from fractions import Fraction
from pathlib import Path

from rdepc import syntax as S
from rdepc.diagnostics import Diagnostic, SpecError, UsageError
from rdepc.driver import elaborate_layer
from rdepc.ir.spec import LayerSpec
from rdepc.parser import parse_file, parse_text

INTERPRETER = "the Triton interpreter: rdepc sets TRITON_INTERPRET=1"


def require_cuda(what: str, instead: str) -> None:
    """Raise :class:`UsageError`, in one line, when this torch cannot run on a CUDA GPU: a
    CPU-only build, or no device visible. ``what`` names the request (``device "cuda"``),
    ``instead`` what runs without a GPU. Called before any work, so that torch's own
    assertion deep inside a build never reaches the user."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        raise UsageError(
            f"{what}: this torch ({torch.__version__}) is a CPU-only build, without CUDA; "
            f"use {instead} or install a CUDA build of torch"
        )
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"HIP {torch.version.hip}"
        raise UsageError(
            f"{what}: this torch ({torch.__version__}, {build}) sees no GPU; use {instead}, "
            "or check the driver and CUDA_VISIBLE_DEVICES"
        )


def check_device(device) -> None:
    """:func:`require_cuda` for a ``device`` argument naming a CUDA device; others pass."""
    if device is None:
        return
    import torch

    if isinstance(device, int) and not isinstance(device, bool):
        kind = "cuda"  # an index names a GPU, as in torch.device(0) (which a CPU-only torch refuses)
    else:
        try:
            kind = torch.device(device).type  # "cuda", "cuda:1", torch.device(...)
        except (RuntimeError, TypeError, ValueError):
            return  # not a device at all: RDEPModule says what it accepts
    if kind != "cuda":
        return
    name = device if isinstance(device, int) else f'"{device}"'
    require_cuda(f"device {name}", f'device="cpu" ({INTERPRETER})')


def parse(text_or_path: str | os.PathLike) -> S.Module:
    """Parse a spec: a :class:`pathlib.Path`, a string naming an existing file, or a one-line
    string ending in ``.rdep`` (which no spec text does), is read; any other string is taken
    as the spec's text. Raises :class:`SpecError`."""
    if isinstance(text_or_path, os.PathLike):
        return parse_file(text_or_path)
    one_line = "\n" not in text_or_path
    try:
        is_file = one_line and Path(text_or_path).is_file()
    except (OSError, ValueError):  # e.g. a one-line spec longer than a file name may be
        is_file = False
    if is_file or (one_line and text_or_path.endswith(".rdep")):  # a mistyped path: "no such file"
        return parse_file(text_or_path)
    return parse_text(text_or_path)


def parse_override(text: str) -> tuple[str, int | Fraction]:
    """'-D NAME=VALUE': VALUE is a whole or decimal number."""
    name, eq, value = text.partition("=")
    if not eq or not name.isidentifier():
        raise UsageError(f"-D {text}: expected NAME=VALUE")
    try:
        f = Fraction(value.replace("_", ""))
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"-D {text}: {value!r} is not a number") from None
    return name, int(f) if f.denominator == 1 else f


def _override_value(name: str, v) -> int | Fraction:
    """A keyword override of ``load``: a whole or decimal number (not a bool, NaN or infinity)."""
    if isinstance(v, bool):
        pass
    elif isinstance(v, numbers.Integral):
        return int(v)
    elif isinstance(v, numbers.Rational):
        return Fraction(v)
    elif isinstance(v, numbers.Real) and math.isfinite(v):
        return Fraction(str(float(v)))  # 1.25 means 5/4, as in a spec
    raise UsageError(f"override {name}={v!r}: expected a whole or decimal number")


class Layer:
    """A loaded layer: ``.spec`` (the LayerSpec) and ``.shapes`` (its sizes as ints).

    Compiling is lazy, on first use of ``.generated``, ``.source`` or ``.module()``:
    ``.generated`` is what the passes made (``.schedule`` with its task table, ``.memory``
    the symmetric heap, ``.kernel`` the kernel contract); ``.source`` the generated Triton
    file; ``.module(backend="emulated", device=...)`` the runnable layer
    (:class:`rdepc.runtime.RDEPModule`). Generated kernels are cached on disk
    (``$RDEPC_CACHE_DIR``, default ``~/.cache/rdepc``), keyed by a hash of the spec, the
    options, the rdepc/torch/triton versions, the target and the interpreter flag.
    """

    def __init__(self, spec: LayerSpec, warnings: tuple[Diagnostic, ...] = ()):
        self.spec = spec
        self.warnings = warnings
        self._generated = None
        self._compiled: dict = {}

    def compile(
        self,
        *,
        schedule: str | None = None,
        backend: str = "emulated",
        hw: str = "h100",
        interpret: bool = True,
        gemm: str | None = None,
    ):
        """The generated kernels of this layer (from the cache when they are there): an
        ``rdepc.compiled.Compiled`` with ``.source``, ``.kernel`` and ``.module()``.
        ``schedule`` overrides the spec's (as ``--schedule``), ``gemm`` its GEMMs' lowering
        (as ``--gemm``); raises SpecError for what the code generator does not support yet."""
        key = (schedule, backend, hw, interpret, gemm)
        if key not in self._compiled:
            from rdepc.compiled import compile_layer

            self._compiled[key] = compile_layer(self.spec, schedule, hw, backend, interpret, gemm)
        return self._compiled[key]

    @property
    def generated(self):
        """What the passes made of the spec (``rdepc.codegen.Generated``): ``.schedule`` (its
        ``.table`` is the task table the kernel runs), ``.memory`` (the symmetric heap),
        ``.kernel`` (the kernel contract), ``.source``. (``rdepc plan``'s report is
        :func:`rdepc.passes.plan.plan`.)"""
        if self._generated is None:
            from rdepc.driver import generate_spec

            self._generated = generate_spec(self.spec)
        return self._generated

    @property
    def source(self) -> str:
        """The generated Triton source of this layer's kernels."""
        return self.compile().source

    def module(self, backend: str = "emulated", device=None, *, schedule: str | None = None, **options):
        """The layer as a runnable module: ``forward(x, topk_ids, topk_weights, w_gate, w_up,
        w_down) -> y`` on ``backend`` — ``emulated`` (all ranks in this process), or one rank
        per process with ``emulated-mp`` (CPU) and ``nvshmem`` (this rank's GPU, under
        torchrun) — on ``device`` "cpu" (the Triton interpreter, the default) or "cuda".
        ``options``: ``tiles``, ``programs``, ``spin_bound``, ``mode``, ``profile``, ``gemm``
        (see rdepc.runtime.RDEPModule; ``gemm`` reaches the compiler too: the library
        lowering runs bulk)."""
        check_device(device)  # before compiling
        interpret = backend != "nvshmem" and (device is None or str(device).startswith("cpu"))
        gemm = options.get("gemm")
        compiled = self.compile(schedule=schedule, backend=backend, interpret=interpret, gemm=gemm)
        return compiled.module(backend=backend, device=device, **options)

    @property
    def shapes(self) -> dict[str, int]:
        sh = self.spec.shape
        return {
            "W": int(sh.W),
            "T": sh.T_max,
            "H": int(sh.H),
            "F": int(self.spec.expert.F),
            "E": int(sh.E),
            "K": int(sh.K),
        }

    def __repr__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.shapes.items())
        return f"<rdepc.Layer {self.spec.name} {dims}>"


def load(path: str | os.PathLike, layer: str | None = None, **overrides: int | float | Fraction) -> Layer:
    """Parse and check ``path``; choose ``layer`` (needed when the file has several);
    ``overrides`` replace named parameters. Raises :class:`SpecError` or :class:`UsageError`."""
    module = parse_file(path)
    clean = {k: _override_value(k, v) for k, v in overrides.items()}
    spec, warnings = elaborate_layer(module, layer, clean)
    return Layer(spec, warnings)


def load_text(text: str, layer: str | None = None, file: str = "<string>", **overrides) -> Layer:
    """:func:`load` of spec text rather than a file (``file`` names it in diagnostics)."""
    module = parse_text(text, file)
    clean = {k: _override_value(k, v) for k, v in overrides.items()}
    spec, warnings = elaborate_layer(module, layer, clean)
    return Layer(spec, warnings)


__all__ = ["Layer", "SpecError", "UsageError", "load", "load_text", "parse"]
