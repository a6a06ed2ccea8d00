"""The committed GPU measurements as one table: every perf record under bench/results (an
acceptance perf stage's JSON), each rdepc method it timed with its call's median and, where a
profiled call recorded them, its stages' spans — what the cost model is held against
(bench/model_error.py). A new lease's records extend the table by being committed there.

A row is one (record, case, method): the case's shape (example, W, T', routing), the device,
the commit, the method's strategy, kernel mode and GEMM lowering, the call's median ms and
each stage's span in ms (its first item's start to its last item's end, all ranks together:
the emulated ranks share the GPU). Methods timed without a profile have no stages.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = re.compile(r"W=(\d+) T'=(\d+) H=(\d+) F=(\d+) E=(\d+) K=(\d+) (\S+)")


@dataclass(frozen=True)
class Measurement:
    source: str  # the record's path under bench/results
    commit: str
    device: str
    example: str
    W: int
    T: int
    routing: str
    strategy: str
    mode: str
    gemm: str  # triton | library
    call_ms: float | None  # the method's median (CUDA events)
    stages: dict[str, float] = field(default_factory=dict)  # stage -> span, ms (profiled methods only)


def method_of(name: str) -> tuple[str, str, str] | None:
    """(strategy, mode, lowering) of a perf record's method name (``rdepc bulk split``,
    ``rdepc bulk phased library``), None for a baseline or a derived entry (fwd+bwd, T'=...)."""
    parts = name.split()
    if not parts or parts[0] != "rdepc" or len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "library"):
        return None
    return parts[1], parts[2], parts[3] if len(parts) == 4 else "triton"


def spans(stages: dict, clock: str) -> dict[str, float]:
    """{stage: span ms} of a profiled call's stages (nanoseconds under %globaltimer; the
    interpreter's logical clock has no durations: none)."""
    if clock != "globaltimer":
        return {}
    return {name: (s["to"] - s["from"]) / 1e6 for name, s in stages.items() if "from" in s and "to" in s}


def rows_of(path: Path) -> list[Measurement]:
    """The table's rows of one perf record."""
    rec = json.loads(path.read_text(encoding="utf-8"))
    if rec.get("stage") not in (None, "perf") or rec.get("dry_run"):
        return []
    env = rec.get("environment", {})
    out = []
    for check in rec.get("checks", []):
        figures = check.get("figures", {})
        if not check.get("name", "").startswith("perf/") or "shape" not in figures:
            continue
        shape = SHAPE.match(figures["shape"])
        example = check["name"].split("/")[1]
        W, T = int(shape[1]), int(shape[2])
        clock = figures.get("stage_clock", "")
        profiled = {figures.get("best"): figures.get("stages", {})} | figures.get("stages_others", {})
        for name, timing in figures.get("methods", {}).items():
            how = method_of(name)
            if how is None or "ms" not in timing:
                continue
            staged = spans(profiled.get(" ".join(name.split()[1:]), {}), clock)
            out.append(
                Measurement(
                    str(path.relative_to(RESULTS.parent.parent)),
                    str(env.get("commit", "unknown")),
                    str(env.get("device", "unknown")),
                    example,
                    W,
                    T,
                    shape[7],
                    *how,
                    timing["ms"]["median"],
                    staged,
                )
            )
    return out


def load(root: Path = RESULTS) -> list[Measurement]:
    """Every row of every perf record under ``root``, in path order."""
    out = []
    for path in sorted(root.rglob("*.json")):
        try:
            out += rows_of(path)
        except (ValueError, KeyError, TypeError, AttributeError):  # another kind of record
            continue
    return out


__all__ = ["Measurement", "load", "method_of", "rows_of", "spans"]
