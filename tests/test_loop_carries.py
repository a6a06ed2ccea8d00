"""A Triton front-end hazard the device code must not step on, and a lint that holds it.

Triton (3.6 and 3.9 alike) finds a loop's carried values by visiting the body once with the
values the names hold at the loop's entry, and keeps those a name leaves the body with a
different value. Two names bound to one value before the loop (``first = next_first``) look
unchanged when the body re-binds one to the other (``first = next_first`` again): the name
is not carried, and every iteration that does not reach the assignment reads the value it
had before the loop. The interpreter runs Python's semantics, so only native code shows it:
``rdep_gemm`` once kept its entry's first item so and, on the GPU, gave every GEMM item after
an entry's first the wrong m-tile (the return then read row ids that were never written)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import HANG_S, ROOT

DEVICE = ROOT / "codegen" / "device"


def _aliases(stmts) -> set[tuple[str, str]]:
    """(a, b) for each ``a = b`` between two plain names among ``stmts``' nodes."""
    out = set()
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
                out |= {(t.id, node.value.id) for t in node.targets if isinstance(t, ast.Name)}
    return out


def hazards(source: str, path: str = "<source>") -> list[str]:
    """Every loop that re-binds a name to another it already aliased before the loop:
    ``a = b`` inside, ``a = b`` or ``b = a`` earlier in the function, outside the loop."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for loop in ast.walk(fn):
            if not isinstance(loop, ast.While | ast.For):
                continue
            inside = {id(n) for n in ast.walk(loop)}
            before = [
                n for n in ast.walk(fn) if isinstance(n, ast.Assign) and id(n) not in inside and n.lineno < loop.lineno
            ]
            aliased = _aliases(before)
            aliased |= {(b, a) for a, b in aliased}
            for a, b in sorted(_aliases(loop.body) & aliased):
                found.append(f"{path}:{loop.lineno}: {fn.name}: the loop re-binds {a} = {b}, aliased before it")
    return found


REPRODUCER = """
@triton.jit
def steps(out, n, first_item):
    item = tl.program_id(0)
    pos = 0
    next_first = tl.load(first_item)
    first = next_first
    while item < n:
        if next_first <= item:
            first = next_first
            pos += 1
            next_first = tl.load(first_item + pos)
        tl.store(out + item, item - first)
        item += 4
"""


def test_the_lint_finds_the_reproducer_and_only_the_aliasing():
    assert len(hazards(REPRODUCER)) == 1
    unaliased = REPRODUCER.replace("    first = next_first\n    while", "    first = next_first + 0\n    while")
    assert unaliased != REPRODUCER and hazards(unaliased) == []


def test_no_device_function_rebinds_an_aliased_name_in_a_loop():
    found = [h for p in sorted(DEVICE.glob("*.py")) for h in hazards(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

namespace = {}
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), namespace)  # a JIT function needs its source file
signature = {"out": "*i32", "n": "i32", "first_item": "*i32"}
src = ASTSource(fn=namespace["steps"], signature=signature)
print(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"])
"""


def test_triton_drops_the_aliased_name_from_the_loops_carries(tmp_path):
    """The hazard is Triton's, as documented above: the reproducer's loop carries item, pos
    and next_first but not first (the TTIR of an sm_90 compile; no GPU needed). The compile
    runs in a process of its own that imports Triton in native mode: Triton fixes its mode at
    the first import, and this process's is the interpreter's (conftest.py)."""
    path = Path(tmp_path) / "reproducer.py"
    path.write_text("import triton\nimport triton.language as tl\n" + textwrap.dedent(REPRODUCER))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], capture_output=True, text=True, env=env,
                          timeout=HANG_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    loop = next(line for line in done.stdout.splitlines() if "scf.while" in line)
    carried = loop.split("scf.while (")[1].split(")")[0].count("=")
    assert carried == 3, loop
