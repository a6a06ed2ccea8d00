"""Lowering: a Schedule and its MemoryPlan → the kernel contract the generated code runs.

The kernel contract (:class:`rdepc.ir.contract.KernelContract`) is plain data — ints, strings and lists, written to
JSON beside the generated kernels — holding everything the persistent kernel and its host
side need: the layer's sizes, the symmetric-heap layout of the memory plan, the ownership
tables, the capacity rule, the tile sizes, and the task table.

The task table is the scheduler's own (``Schedule.table``), consumed as is, for any
strategy (bulk, pipelined, deep): one row per task, in the scheduler's global topological
order, with its dependencies — the data edges and the write-after-read edges of the B-slot
rings (a slot's next segment waits for the consumer of its previous one: the credits).
What lowering adds is the expansion of each task into **work items**, the unit a
persistent program takes with one ticket (docs/ARCHITECTURE.md, decision 1: "expand tiles only
into the kernel's task table"):

============== ====================================================================
task           work items
============== ====================================================================
load r         1 (balance replicate): r's rows per home expert into every rank's load table
solve q        1: the call's plan from q's copy of the table (every rank derives the same)
reroute r      1: r's route rows' physical experts under the plan
push r         E_loc(r) − N home experts × C chunks (balance replicate): a chunk of one
               expert's operands, read once, stored into every slot the plan gave it
receive q      N × C: a chunk of one of q's slots, copied into the call's operand
route r        2 × ⌈T / 256⌉: each chunk of 256 of r's tokens counted per expert (its rows'
               positions within the chunk), then — once every chunk is counted — bucketed
               (the first bucketing item turns the counts into bases and publishes them)
scan q         1
dispatch r→q s ⌈rows r may place in segment s of q / rows_per_item⌉, striding over blocks
gemm1 q s      m-tile slots × ⌈F / block_f⌉ F-blocks, m-tile major: one [BM, 2·block_f]
               tile of x·[Wg Wu] with the activation fused (gelu/relu: [BM, block_f])
gemm2 q s      m-tile slots × ⌈H / block_h⌉ H-blocks: one [BM, block_h] tile of h·Wd
               m-tile slots per segment: ⌈min(R_q, S) / BM⌉ + 2·E_loc(q) − 1 (bulk:
               ⌈R_q / BM⌉ + E_loc(q) − 1), each bound at run time to (local expert, rows)
               — padding-free grouped GEMM, tiles aligned to each expert's rows
return q→r s   as dispatch
unpack r j     as dispatch (return ring only: claim j copied out of its slot)
combine wait r 1 (no work: it only joins the returns into rank r)
combine tile   1 (the scheduler's token tiles of ``rdepc.ir.graph.BM`` tokens)
============== ====================================================================

A task's done flag counts its finished items; a dependent waits until the count reaches
``epoch × items`` (the epoch is the call count: nothing is reset between calls). Items are
numbered in table order, so the ticket order is the scheduler's topological order refined
by item index — still topological, which is what makes the persistent kernel
deadlock-free even when its programs run one at a time as in the interpreter.

Two kernel modes take the same table. **Unified**: one ticket counter, every program runs
any task. **Split**: the transport kernel's queue (route, scan, dispatch, return, unpack,
combine: the communication role's tasks) with its ticket counter, and the GEMM kernel's
(gemm1, gemm2, wgrad: the compute role's), whose programs stride over its items; both need
programs running at once (``KernelContract.work``, ``launch_grid``).

Four dependencies reach into the **previous call** (encoded ``-(dep + 1)``, waited for at
``(epoch − 1) × items``), so that under a transport with one process per rank a fast
rank's call cannot overwrite what a slow rank still reads: a route waits for the previous
call's scans (the counts it overwrites at every owner) and its own rank's combine tiles
(its row order); a scan waits for every combine tile of the previous call — all of the
previous call's work — before it publishes offsets that start the rings over; a push
(``balance replicate``) waits for every rank's receive, which copied its slots out, and a
load for every rank's solve, which read the load table it overwrites.

GEMM items also carry a *guard*: the scan of their owner. An m-tile slot first waits for
that scan (which fixes how many rows each local expert holds); a slot that is empty under
the routing skips its dependencies and finishes at once (the task graph's ``empty_if``
predicate, evaluated per tile; split mode's GEMM kernel counts a program's remaining items
of the entry done with it, the live slots being a prefix). A GEMM2 item waits for its
m-tile of the segment's GEMM1, not the whole entry: every GEMM1 item of a live slot also
counts into a per-(owner, segment, m-tile) counter (``tile_done``, private to the owner),
which the scan sets to ``(epoch − 1) × ⌈F / block_f⌉`` as it binds the slot, and the GEMM2
items of m-tile j wait for ``epoch × ⌈F / block_f⌉`` there.
"""

from __future__ import annotations

from fractions import Fraction

from rdepc.ir.arguments import layer_sizes, private_buffers
from rdepc.ir.contract import KINDS, ROLE_INDEX, KernelContract, Row
from rdepc.ir.graph import MemoryPlan, Schedule
from rdepc.ir.sizes import BWD_SIDEBAND
from rdepc.ir.spec import ROUTE_VARS, LayerSpec
from rdepc.version import __version__


def _kind(stage: str, detail: str) -> int:
    if stage in ("combine", "compute", "balance"):
        return KINDS.index({"wait": "combine_wait", "tile": "combine", "unpack": "unpack"}.get(detail, detail))
    return KINDS.index(stage)


def _previous_call(sched: Schedule) -> dict[int, tuple[int, ...]]:
    """Entry → the previous call's entries it waits for (module docstring)."""
    scans = [e.index for e in sched.table if e.stage == "scan"]
    tiles: dict[int, list[int]] = {}
    for e in sched.table:
        if e.stage == "combine" and e.detail == "tile":
            tiles.setdefault(e.rank, []).append(e.index)
    every_tile = tuple(sorted(i for v in tiles.values() for i in v))
    receives = tuple(e.index for e in sched.table if e.detail == "receive")
    solves = tuple(e.index for e in sched.table if e.detail == "solve")
    out = {}
    for e in sched.table:
        if e.stage == "route":
            out[e.index] = (*scans, *tiles.get(e.rank, ()))
        elif e.stage == "scan":
            out[e.index] = every_tile
        elif e.detail == "push":  # a slot is written again once its rank has copied it out
            out[e.index] = receives
        elif e.detail == "load":  # a rank's copy of the load table, once every rank's solve has read it
            out[e.index] = solves
    return out


def lower(
    spec: LayerSpec,
    sched: Schedule,
    mp: MemoryPlan,
    transport: str = "emulated",
    order: tuple[int, ...] | None = None,
    guard: int = 0,
) -> KernelContract:
    """The kernel contract of ``spec`` scheduled as ``sched`` with heap ``mp``.

    ``order`` renumbers the task table (entry ``order[i]`` of the schedule becomes entry i);
    it must still be topological. ``guard`` puts that many bytes before every heap buffer
    and after the last (guard bands a test fills with a pattern)."""
    geo = sched.graph.geometry
    if spec.dedup and max(geo.rows_max, default=0) > geo.B * geo.S:
        raise AssertionError("dedup needs every segment resident (B·S >= R_max): the geometry raises B")
    table, deps, names, tasks, runs = _task_table(sched, order)
    fwd_runs = max(runs, default=0)
    wgrad_table, wgrad_deps = _wgrad_table(table, len(deps), runs, geo.W)
    sizes = layer_sizes(geo)
    return KernelContract(
        layer=spec.name,
        file=spec.file,
        rdepc=__version__,
        strategy=sched.strategy,
        decisions=tuple(f"{d.name} = {d.value} ({d.why})" for d in sched.decisions),
        transport=transport,
        spec_transport=spec.transport,
        **_sizes_and_choices(spec, geo, sched),
        **_ownership(geo),
        **_heap(spec, mp, geo, guard, fwd_runs, max(runs, default=0)),
        private=private_buffers(sizes, spec.precision.dtype.value),
        table=tuple(table),
        deps=tuple(deps),
        names=tuple(names),
        tasks=tuple(tasks),
        wgrad_table=tuple(wgrad_table),
        wgrad_deps=tuple(wgrad_deps),
        programs=tuple(sched.kernel_split),
        guard=guard,
        balance=(spec.balance.slots, spec.balance.min_rows) if spec.balance.kind == "replicate" else (0, 0),
    )


def _task_table(sched: Schedule, order: tuple[int, ...] | None) -> tuple[list, list, list, list, list[int]]:
    """The forward's task table in ``order`` (rows, dependency entries, task names, graph
    task ids) and the entries each rank runs (each one's done counter is its place among them)."""
    W = sched.graph.geometry.W
    n = len(sched.table)
    order = tuple(range(n)) if order is None else tuple(order)
    if sorted(order) != list(range(n)):
        raise ValueError("order must be a permutation of the task table's entries")
    new = [0] * n
    for i, old in enumerate(order):
        new[old] = i
    previous = _previous_call(sched)
    scan_of = {e.rank: new[e.index] for e in sched.table if e.stage == "scan"}
    table, deps, names, tasks = [], [], [], []
    runs = [0] * W  # entries each rank runs so far: the next one's done counter
    for i, old in enumerate(order):
        e = sched.table[old]
        kind = _kind(e.stage, e.detail)
        guard_dep = scan_of[e.owner] if e.stage == "compute" else -1
        mine = [new[d] for d in e.deps]
        if any(d >= i for d in mine):
            raise ValueError(f"task table entry {i} depends on a later entry: the order is not topological")
        task = sched.graph.tasks[e.task]
        resource = 2 * e.rank + ROLE_INDEX[task.role]
        before = [-(new[d] + 1) for d in previous.get(old, ())]
        flag = runs[e.rank]
        runs[e.rank] += 1
        table.append(
            Row(kind, e.rank, e.src, e.owner, e.segment, e.claim, items=0, dep_start=len(deps),
                dep_count=len(mine) + len(before), guard=guard_dep, resource=resource, flag=flag)
        )  # fmt: skip
        deps.extend(mine + before)
        names.append(task.name)
        tasks.append(e.task)
    return table, deps, names, tasks, runs


def _wgrad_table(table: list[Row], n_deps: int, runs: list[int], W: int) -> tuple[list[Row], list[int]]:
    """The backward's own entries: it walks the same table (its dispatches carry g'·dL/dy, its
    GEMMs are the transposed ones, its returns carry dL/dx), then each owner's weight
    gradients, once every GEMM1 of the owner has written its rows' dH (``runs`` counts them)."""
    wgrad_table, wgrad_deps = [], []
    gemm1 = KINDS.index("gemm1")
    gemm1s: dict[int, list[int]] = {}
    for i, row in enumerate(table):
        if row.kind == gemm1:
            gemm1s.setdefault(row.owner, []).append(i)
    for q in range(W):
        mine = gemm1s.get(q)
        if not mine:
            continue
        start = n_deps + len(wgrad_deps)
        wgrad_table.append(
            Row(KINDS.index("wgrad"), rank=q, src=q, owner=q, segment=0, claim=0, items=0, dep_start=start,
                dep_count=len(mine), guard=-1, resource=2 * q + 1, flag=runs[q])
        )  # fmt: skip
        wgrad_deps.extend(mine)
        runs[q] += 1
    return wgrad_table, wgrad_deps


def _ownership(geo) -> dict:
    """The ownership tables: π(e), λ(e), E_loc(q), the weight index of each (q, λ), the
    experts by (owner, local) and each owner's first among them; R_q and what one source
    may send each owner."""
    W, E, E_MAX = geo.W, geo.E, max(geo.experts)
    owner, local = geo.owner, geo.local
    weight_of = [0] * (W * E_MAX)
    for e in range(E):
        weight_of[owner[e] * E_MAX + local[e]] = e
    owner_first = [sum(geo.experts[:q]) for q in range(W)] + [E]
    return {
        "E_MAX": E_MAX,
        "owner": tuple(owner),
        "local": tuple(local),
        "n_local": tuple(geo.experts),
        "weight_of": tuple(weight_of),
        "order": tuple(sorted(range(E), key=lambda e: (owner[e], local[e]))),
        "owner_first": tuple(owner_first),
        "rows_max": tuple(geo.rows_max),
        "from_one": geo.from_one,
    }


def _heap(spec: LayerSpec, mp: MemoryPlan, geo, guard: int, fwd_runs: int, all_runs: int) -> dict:
    """The heap: the memory plan's buffers, forward and backward, at its offsets (shifted by
    guard bands), the forward's regions a prefix of the slice (an inference module allocates
    that prefix alone, and every offset its forward reads lies inside it)."""
    B, S = geo.B, geo.S
    bufs = list(mp.buffers)
    for name, n_runs in (("flags", fwd_runs), ("bwd_flags", all_runs)):
        slots = next(b.bytes for b in bufs if b.name == name) // 8
        if n_runs > slots:
            raise AssertionError(f"a rank runs {n_runs} task-table entries, more than its {slots} {name} counters")
    place = {b.name: b.offset + guard * (k + 1) for k, b in enumerate(bufs)}
    fwd = mp.regions("forward")
    n_fwd = sum(b.region in fwd for b in bufs)
    forward_bytes = fwd["total"] + guard * (n_fwd + 1)
    if any(b.region in fwd for b in bufs[n_fwd:]) or place[bufs[n_fwd].name] != forward_bytes:
        raise AssertionError("the forward's heap regions are not a prefix of the slice")
    names_heap = ("tokens", "counts", "offsets", "admitted", "keys", "flags", "payload", "return")
    names_heap += ("bwd_flags", "bwd_payload", "bwd_scales", "bwd_row_ids", "bwd_inputs", "bwd_return")
    names_heap += ("bwd_return_scales",)
    heap = [(name, place[name]) for name in names_heap]
    if geo.return_ring:
        heap += [("return_ids", place["return_ids"]), ("bwd_return_ids", place["bwd_return_ids"])]
    if spec.dedup:
        sb = place["bwd_sideband"]  # structure of arrays: g' [B*S] fp32, then the links [B*S, 2] int32
        for f, nbytes in BWD_SIDEBAND:
            heap.append((f"bwd_sideband_{f}", sb))
            sb += B * S * nbytes
        heap.append(("bwd_dgate", place["bwd_dgate"]))
    sb = place["sideband"]
    for f in spec.route_row.sideband:  # structure of arrays, fields in the spec's (canonical) order
        heap.append((f"sideband_{f}", sb))
        sb += B * S * spec.route_row.field_bytes(f)
    return {
        "heap_bytes": mp.regions("forward_backward")["total"] + guard * (len(bufs) + 1),
        "forward_bytes": forward_bytes,
        "heap": tuple(heap),
        "layout": tuple((b.name, b.region, place[b.name], b.size) for b in bufs),
    }


def _sizes_and_choices(spec: LayerSpec, geo, sched: Schedule) -> dict:
    """The layer's sizes and the spec's choices the kernels read: the expert function,
    precision, route rows and their identity, admission and capacity."""
    T = geo.T
    rr = spec.route_row
    n_T = T + 1 if spec.shape.symbolic else 1  # one row per T' = 0..T when T is symbolic
    parts = [_per_token(rr.offset, spec, n_T), *(_per_token(rr.coefficient(x), spec, n_T) for x in ROUTE_VARS)]
    cap = spec.capacity
    cap_factor = cap_rows = None
    if cap.policy == "factor":
        cap_factor = (int(cap.factor.p), int(cap.factor.q))
    elif cap.policy == "rows":
        cap_rows = _per_token(cap.rows, spec, T + 1) if spec.shape.symbolic else int(cap.rows)
    return {
        **{k: getattr(geo, k) for k in ("W", "T", "H", "F", "E", "K", "S", "B")},
        "ring": geo.return_ring,
        "unified": sched.unified,
        "act": spec.expert.act,
        "act_limit": float(spec.expert.limit or 0),
        "act_alpha": float(spec.expert.alpha or 0),
        "bias": spec.expert.bias,
        "recompute": spec.pre_activations == "recompute",
        "gate_input": spec.gate_on == "input",
        "resend": spec.input_activations == "resend",
        "bwd_fp8": spec.precision.backward_fp8,
        "dtype": spec.precision.dtype.value,
        "dispatch": spec.precision.dispatch.value,
        "dispatch_scale": spec.precision.dispatch_scale,
        "scales": rr.scales,
        "sideband": tuple(rr.sideband),
        "symbolic_tokens": spec.shape.symbolic,
        "row_id": tuple(zip(*parts, strict=True)),
        "row_id_order": tuple(v for v, _ in reversed(rr.radix)),
        "keyed": spec.keyed_admission,
        "dedup": spec.dedup,
        "capacity": cap.policy,
        "cap_factor": cap_factor,
        "cap_rows": cap_rows,
        "weights": cap.weights,
        "drop": cap.drop,
    }


def _per_token(expr, spec: LayerSpec, n: int) -> tuple[int, ...]:
    """``int(expr)`` at T = 0..n-1: a number, or a polynomial in the layer's symbolic T
    evaluated exactly from its coefficients (a sympy substitution per value took minutes
    for a bound of 65536)."""
    if not getattr(expr, "free_symbols", None):
        return (int(expr),) * n
    import sympy as sp

    coeffs = [Fraction(int(c.p), int(c.q)) for c in sp.Poly(expr, spec.shape.T).all_coeffs()]
    out = []
    for t in range(n):
        v = Fraction(0)
        for c in coeffs:
            v = v * t + c
        out.append(int(v))
    return tuple(out)
