"""The measured timeline of one call, as Chrome trace-event JSON (``rdepc run --profile``).

An :class:`~rdepc.runtime.module.RDEPModule` built with ``profile=True`` records, per
task-table entry that ran, the clock at its first work item's start and at its last item's
end (``last_profile``). :func:`measured_trace` turns that into the same shape of trace as
the scheduler's prediction (``rdepc viz --trace``, :func:`rdepc.viz.trace`), so the two open
side by side in https://ui.perfetto.dev:

* one complete event (``ph: "X"``) per entry, named after its task, ``pid`` = rank, ``tid``
  0 when the schedule is unified (bulk: every program does every stage) and the kernel ran
  unified, else 0 for the rank's communication tasks (split mode: the transport kernel's)
  and 1 for its compute tasks (the GEMM kernel's); ``cat`` the stage (``route``,
  ``scan``, ``dispatch``, ``compute``, ``return``, ``combine``; unpack and the combine wait
  are stage ``combine`` with ``detail`` ``unpack`` / ``wait``, as in the prediction);
* the same process and thread name metadata events (``rank r``; ``all programs``,
  ``communication`` and ``compute``, or ``transport kernel`` and ``GEMM kernel``);
* ``args``: the entry, the graph's task id, the entry's segment, claim, owner and source
  where they apply, and the raw clock values.

Clocks (``otherData.clock`` / ``otherData.unit``): on a GPU ``globaltimer``, %globaltimer
in ns, written as µs from the earliest start — real durations. Under the Triton interpreter
``logical``: an atomic counter the kernel bumps at every work item's start and end, written
as is, one tick per µs of the trace, from the earliest start. Logical ticks order the
tasks (an entry starts after every entry it depends on has ended; the items a kernel counts
done without running them, an empty m-tile slot's or a run of moves without rows, share
one tick); they are not durations.

With the programs of each launch given, ``last_profile["kernels"]`` also says per launch how
its time divides (:func:`kernel_summary`): per task kind the items and the time they ran, and
for the GEMM kernel, whose program of each item is known, per program the time its items ran
against the time it waited.

An entry's span runs from its first item's start to its last item's end, so it may overlap
other entries' spans when items of several entries interleave. One exception to the order
above: a compute m-tile slot found empty at run time skips its dispatch dependencies (only
its owner's scan guards it), so where programs run concurrently (a GPU) a compute entry may
start before a dispatch it depends on has ended.

Pure Python: neither torch nor triton is imported here.
"""

from __future__ import annotations

import json
from pathlib import Path

from rdepc.ir.contract import KINDS, KernelContract
from rdepc.ir.queues import mode_kernels
from rdepc.ir.trace import rank_metadata

# Task-table kind → (stage, detail), as the task graph names them (rdepc.ir.graph.Task).
STAGE_OF = {
    "route": ("route", ""),
    "scan": ("scan", ""),
    "dispatch": ("dispatch", ""),
    "gemm1": ("compute", "gemm1"),
    "gemm2": ("compute", "gemm2"),
    "wgrad": ("compute", "wgrad"),  # the backward's weight gradients
    "return": ("return", ""),
    "unpack": ("combine", "unpack"),
    "combine_wait": ("combine", "wait"),
    "combine": ("combine", "tile"),
    "load": ("balance", "load"),
    "solve": ("balance", "solve"),
    "reroute": ("balance", "reroute"),
    "push": ("balance", "push"),
    "receive": ("balance", "receive"),
}
CLOCKS = {
    "logical": (
        "tick",
        "logical clock (Triton interpreter): ts and dur are ticks of an atomic counter the kernel bumps at every "
        "work item's start and end, shown as 1 µs per tick from the earliest start; they order the tasks, they are "
        "not durations",
    ),
    "globaltimer": ("us", "%globaltimer (ns) converted to µs from the earliest start: measured durations"),
}


def read_profile(work, buffer, interpret: bool, mode: str, programs=None) -> dict:
    """A profiled call's record (``RDEPModule.last_profile``) from its ``profile`` buffer
    (start and end of every work item of ``work``): per entry that ran, its first item's
    start and its last item's end; with ``programs`` (each launch's), ``kernels``
    (:func:`kernel_summary`)."""
    at = buffer.view(-1, 2).to("cpu").tolist()[: work.n_items]
    events = []
    for entry, (first, items) in enumerate(work.entry_items()):
        if items:
            span = at[first : first + items]
            events.append((entry, min(s for s, _ in span), max(e for _, e in span)))
    out = {"clock": "logical" if interpret else "globaltimer", "mode": mode, "events": events}
    if programs is not None:
        out["kernels"] = kernel_summary(work, at, programs)
    return out


def _spread(values: list) -> dict:
    v = sorted(values)
    return {"least": v[0], "median": v[len(v) // 2], "most": v[-1]} if v else {}


def kernel_summary(work, at: list, programs) -> list[dict]:
    """Where each launch of a profiled call spent its time, from every work item's start and
    end (``at``, the profile's clock): per launch (``mode_kernels``' order) its kernel, its
    programs, its span (first start to last end) and per task kind its items, those that took
    any time (``ran``: an m-tile slot found empty takes none), the time they ran (``busy``,
    summed) and how long one took (least, median, most of those that ran). A GEMM kernel's program p takes items p,
    p + P, ... of its queue, so there also per program: the time its items ran, the time
    between them (``waited``: its waits and its turns of the loop) and after its last
    (``idle_after``), each spread over the programs; ``busy_share`` is the programs' busy
    time over programs × span. Tells a kernel that waits from one whose items are slow."""
    out = []
    for q, ((lo, hi), (kernel, _)) in enumerate(zip(work.bounds, mode_kernels(work.mode), strict=True)):
        first, last = work.first_item[lo], work.first_item[hi]
        if last <= first:
            continue
        start = min(s for s, _ in at[first:last])
        end = max(e for _, e in at[first:last])
        kinds: dict[str, dict] = {}
        for pos in range(lo, hi):
            kind = KINDS[work.table[work.queue[pos]].kind]
            k = kinds.setdefault(kind, {"items": 0, "busy": 0, "took": []})
            for s, e in at[work.first_item[pos] : work.first_item[pos + 1]]:
                k["items"] += 1
                k["busy"] += e - s
                if e > s:
                    k["took"].append(e - s)
        n = programs[q]
        rec = {"kernel": kernel, "programs": n, "span": end - start}
        rec["kinds"] = {
            kind: {"items": k["items"], "ran": len(k["took"]), "busy": k["busy"], "item": _spread(k["took"])}
            for kind, k in kinds.items()
        }
        if kernel == "rdep_gemm":  # programs stride over the queue: each item's program is known
            busy, waited, idle = [0] * n, [0] * n, [0] * n
            for p in range(n):
                mine = sorted(at[first + p : last : n])
                if not mine:
                    idle[p] = end - start
                    continue
                busy[p] = sum(e - s for s, e in mine)
                waited[p] = (mine[-1][1] - start) - busy[p]
                idle[p] = end - mine[-1][1]
            rec |= {"busy": _spread(busy), "waited": _spread(waited), "idle_after": _spread(idle)}
            rec["busy_share"] = sum(busy) / (n * (end - start)) if end > start else None
        out.append(rec)
    return out


def _thread_names(contract: KernelContract, mode: str, programs) -> list[tuple[int, str]]:
    if mode in ("split", "phased"):  # programs: each launch's (phased: the transport kernel's two launches)
        each = tuple(programs) if isinstance(programs, tuple | list) else (programs, programs)
        comm, compute = "/".join(str(n) for n in each[::2]) if each[0] else None, each[1]
        after = ", before and after the GEMMs" if mode == "phased" else ""
        return [
            (0, "transport kernel" + (f" ({comm} programs{after})" if comm else "")),
            (1, "GEMM kernel" + (f" ({compute} programs)" if compute else "")),
        ]
    if contract.unified:
        return [(0, "all programs" + (f" ({programs})" if programs else ""))]
    # An overlapped schedule run by the unified kernel: every program takes tasks of both roles.
    shared = f" (unified kernel: any of {programs} programs)" if programs else " (unified kernel)"
    return [(0, f"communication{shared}"), (1, f"compute{shared}")]


def measured_trace(contract: KernelContract, profile: dict, programs=None) -> dict:
    """The measured profile of one call (``RDEPModule.last_profile``) of the kernels of
    ``plan`` as Chrome trace-event JSON (a dict), in the shape of :func:`rdepc.viz.trace`.
    ``programs``: the kernels' programs (unified mode: its grid; split mode: the transport
    and the GEMM kernel's), shown in the thread names when given."""
    clock = profile.get("clock")
    if clock not in CLOCKS:
        raise ValueError(f"unknown profile clock {clock!r} (known: {', '.join(CLOCKS)})")
    mode = profile.get("mode", "unified")
    spans = list(profile.get("events", ()))
    n = contract.n_entries
    for entry, start, end in spans:
        if not 0 <= entry < n:
            raise ValueError(f"profile event for task-table entry {entry}, out of range [0, {n})")
        if end < start:
            raise ValueError(f"profile event for entry {entry} ({contract.names[entry]}) ends before it starts")
    unit, note = CLOCKS[clock]
    origin = min((s for _, s, _ in spans), default=0)
    last = max((e for _, _, e in spans), default=origin)
    scale = 1e-3 if clock == "globaltimer" else 1  # ns → µs; ticks as they are

    events = rank_metadata(contract.W, _thread_names(contract, mode, programs))
    for entry, start, end in spans:
        row = contract.table[entry]
        kind = KINDS[row.kind]
        stage, detail = STAGE_OF[kind]
        role = row.resource % 2  # resource = 2·rank + role: 0 communication (transport), 1 compute (GEMMs)
        args = {"entry": entry, "task": contract.tasks[entry], "kind": kind}
        for key in ("segment", "claim", "owner", "src"):
            v = getattr(row, key)
            if v >= 0:
                args["source" if key == "src" else key] = v
        if detail:
            args["detail"] = detail
        args["clock_start"] = start
        args["clock_end"] = end
        dur = (end - start) * scale if clock == "globaltimer" else max(end - start, 1)
        events.append(
            {
                "name": contract.names[entry],
                "cat": stage,
                "ph": "X",
                "pid": row.rank,
                "tid": 0 if contract.unified and mode == "unified" else role,
                "ts": (start - origin) * scale,
                "dur": dur,
                "args": args,
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {
            "measured": True,
            "layer": contract.layer,
            "strategy": contract.strategy,
            "mode": mode,
            "clock": clock,
            "unit": unit,
            "note": note,
            "span": (last - origin) * scale,
            "tasks": len(spans),
            "entries": n,
            "programs": programs,
            "kernels": profile.get("kernels"),  # how each launch spent its time (kernel_summary)
        },
    }


def write_measured_trace(contract: KernelContract, profile: dict, path: str | Path, programs=None) -> Path:
    """Write :func:`measured_trace` to ``path`` (JSON); returns the path. Raises OSError."""
    path = Path(path)
    path.write_text(json.dumps(measured_trace(contract, profile, programs)), encoding="utf-8")
    return path


__all__ = ["CLOCKS", "STAGE_OF", "measured_trace", "read_profile", "write_measured_trace"]
