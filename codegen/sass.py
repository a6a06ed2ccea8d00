"""What a compiled kernel's machine code says about its GEMM main loops (sm_90 SASS).

:func:`gemm_loops` reads ``nvdisasm`` output (Triton bundles the tool) and finds every
innermost loop that issues warpgroup MMAs (``HGMMA``): the body between a backward branch
and its target. Per loop: the SASS instructions of one iteration, the HGMMAs among them,
the local-memory loads and stores (``LDL``/``STL``: spills) inside it, the TMA loads
(``UTMALDG``), the register-to-uniform moves (``R2UR``: what a loop pays when ptxas keeps
its shared-memory addresses and pipeline counters in per-thread registers) and the
wgmma wait depth (the largest N of ``WARPGROUP.DEPBAR.LE gsb0, N``: how many MMA groups
stay in flight while the next chunk's loads are issued; 0 serialises them).

A backward branch can also come from an out-of-line retry (a barrier's try-wait jumps to a
stub at the end of the function that jumps back into the loop); such a "loop" runs from
inside the real one to the stub, overlapping it: of overlapping HGMMA loops only the
smallest counts, and so does one that holds a smaller one (a persistent kernel's loop
over its tiles).
:func:`sum_loops` finds the loops that sum loaded rows instead (the combine's), and
:func:`move_loops` those that store them (dispatch, return, unpack): how many of their
128-bit loads issue before the first FMA or 128-bit store (both wait for the rows they
read) says how many rows a program has in flight.
Pure Python over text; :func:`disassemble` runs the tool.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

_INST = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s.*`\((\.L_x_\d+)\)")
_DEPBAR = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+|\d+)")
_HGMMA = re.compile(r"HGMMA\.(\d+x\d+x\d+)")


# An H100 SM (CUDA occupancy limits for compute capability 9.0).
H100_SM = {"registers": 65536, "shared": 228 * 1024, "threads": 2048, "blocks": 32}


@dataclass(frozen=True)
class Loop:
    """One GEMM main loop: its address range and per-iteration figures (module docstring)."""

    start: int
    end: int
    instructions: int
    hgmma: int
    shapes: tuple[str, ...]
    spill_loads: int
    spill_stores: int
    tma_loads: int
    r2ur: int
    wait_depth: int

    def as_dict(self) -> dict:
        return asdict(self) | {"start": f"{self.start:#x}", "end": f"{self.end:#x}"}


def disassemble(cubin: str | Path) -> str:
    """The cubin's SASS as ``nvdisasm -c`` prints it (Triton's bundled nvdisasm)."""
    from triton import knobs

    tool = Path(knobs.nvidia.cuobjdump.path).with_name("nvdisasm")
    return subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def _parse(text: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    insts: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INST.search(line)
        if m:
            for label in pending:
                labels[label] = len(insts)
            pending = []
            insts.append((int(m.group(1), 16), m.group(2)))
    return insts, labels


def _innermost(insts: list[tuple[int, str]], labels: dict[str, int], keep) -> list[tuple[int, int]]:
    """The (first, last) instruction indices of the innermost loops whose body ``keep``
    accepts (a list of instruction texts), in address order: the body between a backward
    branch and its target, of overlapping ones the smallest (module docstring)."""
    spans = []
    for i, (_, ins) in enumerate(insts):
        m = _BRANCH.search(ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            lo = labels[m.group(1)]
            if keep([s for _, s in insts[lo : i + 1]]):
                spans.append((lo, i))
    inner: list[tuple[int, int]] = []
    for lo, hi in sorted(set(spans), key=lambda x: (x[1] - x[0], x[0])):  # smallest first
        if not any(lo <= b and a <= hi for a, b in inner):  # overlaps none kept: not a retry stub's span
            inner.append((lo, hi))
    return sorted(inner)


def gemm_loops(text: str) -> list[Loop]:
    """The innermost HGMMA loops of one kernel's SASS, in address order."""
    insts, labels = _parse(text)
    out = []
    for lo, hi in _innermost(insts, labels, lambda body: any("HGMMA" in s for s in body)):
        body = [s for _, s in insts[lo : hi + 1]]
        ops = [_op(s) for s in body]
        depths = [int(d, 0) for s in body for d in _DEPBAR.findall(s)]
        out.append(
            Loop(
                start=insts[lo][0],
                end=insts[hi][0],
                instructions=len(body),
                hgmma=sum(op.startswith("HGMMA") for op in ops),
                shapes=tuple(sorted({m for s in body for m in _HGMMA.findall(s)})),
                spill_loads=sum(op.startswith("LDL") for op in ops),
                spill_stores=sum(op.startswith("STL") for op in ops),
                tma_loads=sum(op.startswith("UTMALDG") for op in ops),
                r2ur=sum(op.startswith("R2UR") for op in ops),
                wait_depth=max(depths, default=-1),
            )
        )
    return out


@dataclass(frozen=True)
class RowLoop:
    """One loop that moves or sums loaded rows (a dispatch's, a return's, the combine's): per
    iteration its instructions, its 128-bit global loads, how many of them issue before the
    first FMA or 128-bit store (both wait for the rows they read: the loads after it are a
    round trip later), its FMAs and the spills inside it."""

    start: int
    end: int
    instructions: int
    loads: int
    loads_ahead: int
    ffma: int
    spill_loads: int
    spill_stores: int


def _row_loops(text: str, keep) -> list[RowLoop]:
    """The innermost loops that load 128-bit rows, issue no HGMMA and whose opcodes ``keep``
    accepts, in address order (retry stubs and enclosing loops dropped as in :func:`gemm_loops`)."""

    def rows(body: list[str]) -> bool:
        ops = [_op(s) for s in body]
        return any("LDG.E.128" in s for s in body) and "HGMMA" not in ops and keep(ops, body)

    insts, labels = _parse(text)
    out = []
    for lo, hi in _innermost(insts, labels, rows):
        body = [s for _, s in insts[lo : hi + 1]]
        ops = [_op(s) for s in body]
        first_use = min(i for i, s in enumerate(body) if ops[i] == "FFMA" or "STG.E.128" in s)
        wide = [i for i, s in enumerate(body) if "LDG.E.128" in s]
        out.append(
            RowLoop(
                start=insts[lo][0],
                end=insts[hi][0],
                instructions=len(ops),
                loads=len(wide),
                loads_ahead=sum(i < first_use for i in wide),
                ffma=ops.count("FFMA"),
                spill_loads=ops.count("LDL"),
                spill_stores=ops.count("STL"),
            )
        )
    return out


def sum_loops(text: str) -> list[RowLoop]:
    """The row loops of one kernel's SASS that sum with FMAs (the combine's)."""
    return _row_loops(text, lambda ops, body: "FFMA" in ops)


def move_loops(text: str) -> list[RowLoop]:
    """The row loops of one kernel's SASS that store 128-bit rows and sum nothing (the
    moves': dispatch, return, unpack)."""
    return _row_loops(text, lambda ops, body: "FFMA" not in ops and any("STG.E.128" in s for s in body))


def _op(ins: str) -> str:
    """An instruction's opcode without its modifiers or predicate."""
    return (ins.split()[1] if ins.startswith("@") else ins.split()[0]).split(".")[0]


def ctas_per_sm(registers: int, shared: int, threads: int, sm: dict | None = None) -> int:
    """Thread blocks of one kernel an SM holds at once, by registers, shared memory and
    threads (an H100's limits unless ``sm`` gives others): the registers a block takes are
    allocated per warp in units of 256, its shared memory with 1 KiB reserved per block."""
    sm = sm or H100_SM
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = sm["registers"] // (per_warp * warps)
    by_shared = sm["shared"] // (shared + 1024) if shared else sm["blocks"]
    by_threads = sm["threads"] // threads
    return max(0, min(by_regs, by_shared, by_threads, sm["blocks"]))


__all__ = ["H100_SM", "Loop", "RowLoop", "ctas_per_sm", "disassemble", "gemm_loops", "move_loops", "sum_loops"]
