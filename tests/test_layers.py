"""The package's layers and the arrows between them, read from every import statement
(module level and inside functions alike): front end → IR → passes → code generator, the
runtime reading the IR (never the code generator or the face), and no import cycles.

    base       rdepc.diagnostics, syntax, parser, grammar, version, toolchain
    ir         rdepc.ir.*: the spec, the task graph and schedule, the kernel contract
    passes     rdepc.passes.*
    codegen    rdepc.codegen.* (device code included)
    reference  rdepc.reference, reference_capacity: the independent reference operator, its capacity policy
    runtime    rdepc.runtime.*
    face       the rest of rdepc: api, driver, cli, compiled, moe, hf, viz, report, per_rank

A layer may import its own and those listed for it in ALLOWED; the face imports any.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
BASE = {"rdepc.diagnostics", "rdepc.syntax", "rdepc.parser", "rdepc.grammar", "rdepc.version", "rdepc.toolchain"}
REFERENCE = {"rdepc.reference", "rdepc.reference_capacity"}
ALLOWED = {
    "base": {"base"},
    "ir": {"base", "ir"},
    "passes": {"base", "ir", "passes"},
    "codegen": {"base", "ir", "passes", "codegen"},
    "reference": {"base", "ir", "reference"},
    "runtime": {"base", "ir", "reference", "runtime"},
    "face": {"base", "ir", "passes", "codegen", "reference", "runtime", "face"},
}


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name, from pyproject's package-dir."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    out = {}
    for pkg in cfg["packages"]:
        top = max((k for k in dirs if pkg == k or pkg.startswith(k + ".")), key=len)
        folder = ROOT / dirs[top] / Path(*pkg[len(top) + 1 :].split(".")) if pkg != top else ROOT / dirs[top]
        for f in sorted(folder.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def layer(mod: str) -> str:
    for name in BASE:
        if mod == name or mod.startswith(name + "."):
            return "base"
    if mod in REFERENCE:
        return "reference"
    parts = mod.split(".")
    if len(parts) > 1 and parts[1] in ("ir", "passes", "codegen", "runtime"):
        return parts[1]
    return "face"


def imports(mods: dict[str, Path]) -> nx.DiGraph:
    """Module → module it imports (inside the package), with the line of the statement."""
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    g.add_edge(mod, t, line=node.lineno)
    return g


GRAPH = imports(modules())


def test_every_module_is_read():
    names = set(GRAPH)
    assert {"rdepc.ir.contract", "rdepc.codegen.emit", "rdepc.codegen.device.gemm", "rdepc.runtime.module"} <= names
    assert GRAPH.number_of_edges() > 100


def upward(g: nx.DiGraph) -> list[str]:
    """The arrows of ``g`` that point where their layer may not import."""
    return [
        f"{a} ({layer(a)}) imports {b} ({layer(b)}) at line {d.get('line', '?')}"
        for a, b, d in g.edges(data=True)
        if layer(b) not in ALLOWED[layer(a)]
    ]


def cycles(g: nx.DiGraph) -> list[list[str]]:
    """The import cycles of ``g``; a package's __init__ naming its own submodules is none."""
    h = g.copy()
    h.remove_edges_from([(a, b) for a, b in g.edges if b.startswith(a + ".")])
    return list(nx.simple_cycles(h))


def test_no_arrow_points_up():
    bad = upward(GRAPH)
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "\n".join(" → ".join([*c, c[0]]) for c in found[:10])


def test_the_rules_can_fail():
    """The checks above flag what they exist for: a runtime module importing the code
    generator, the IR importing a pass, and a loop of face modules; not a package's
    __init__ importing its submodule."""
    g = GRAPH.copy()
    g.add_edge("rdepc.runtime.module", "rdepc.codegen.emit", line=1)
    g.add_edge("rdepc.ir.graph", "rdepc.passes.tasks", line=2)
    g.add_edge("rdepc.driver", "rdepc.api", line=3)
    assert len(upward(g)) == 2 and all("line 1" in b or "line 2" in b for b in upward(g))
    found = sorted(map(sorted, cycles(g)))
    assert ["rdepc.api", "rdepc.driver"] in found and ["rdepc.ir.graph", "rdepc.passes.tasks"] in found
    g.add_edge("rdepc.codegen.device", "rdepc.codegen.device.gemm")
    g.add_edge("rdepc.codegen.device.gemm", "rdepc.codegen.device")
    assert len(cycles(g)) == len(found)
