"""Device code: the Triton functions every generated kernel file is made of.

Each module here is real Triton — linted, importable and unit-tested per function under
the interpreter (``tests/test_device.py``). The emitter copies their ``@triton.jit`` (and
``@core.extern``) functions verbatim into a generated file (:func:`include`), after the
constants block it writes; so a generated file is self-contained and holds no device logic
that is not here.

A function reads the generated file's constants (sizes, heap offsets, the memory scope) as
globals. A module that has such functions declares each of those names at its top as a
stand-in, so that it imports and its functions run alone in tests; the stand-ins are not
copied, and a test holds that every global a copied function reads is one the emitter
writes.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

HERE = Path(__file__).resolve().parent
DECORATORS = ("triton.jit", "core.extern")


def functions(module: str) -> list[tuple[str, str]]:
    """(name, source) of the device functions of ``module`` (a file here, without ``.py``),
    in file order, each from its decorator to its last line, verbatim."""
    # Every generated file includes every module: parsing them was most of a generation's time.
    # Keyed by the file's identity, an edited module is read again.
    st = (HERE / f"{module}.py").stat()
    return list(_parsed(module, st.st_mtime_ns, st.st_size))


@functools.cache
def _parsed(module: str, mtime_ns: int, size: int) -> tuple[tuple[str, str], ...]:
    text = (HERE / f"{module}.py").read_text(encoding="utf-8")
    lines = text.split("\n")
    out = []
    for node in ast.parse(text).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
        if any(n in DECORATORS for n in names):
            out.append((node.name, "\n".join(lines[node.decorator_list[0].lineno - 1 : node.end_lineno])))
    return tuple(out)


def include(module: str, names: tuple[str, ...] | None = None) -> str:
    """The device functions of ``module`` (those in ``names``, when given) as text for a
    generated file: verbatim, two blank lines apart."""
    found = functions(module)
    if names is not None:
        missing = set(names) - {n for n, _ in found}
        if missing:
            raise KeyError(f"codegen/device/{module}.py has no device function {', '.join(sorted(missing))}")
        found = [(n, s) for n, s in found if n in names]
    return "\n\n\n".join(s for _, s in found)


__all__ = ["functions", "include"]
