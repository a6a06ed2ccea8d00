"""The memory plan: every buffer of the symmetric heap at its offset, with lifetimes.

The layout is docs/memory.md's, region by region (control, payload, sideband, return, then
the backward regions), each buffer padded to ``ALIGN`` = 256 bytes, computed here from the
schedule's own S, B and R_ret — independently of the planner (``rdepc plan``), whose
``symmetric_plan`` a test checks it against (the done counters of the ``flags`` buffer are
the one rule of :mod:`rdepc.ir.sizes` both evaluate).

Lifetimes are given in task-table indices and in predicted seconds: the control words live
for the whole layer; the payload and sideband rings from the first dispatch to the last
compute; the return ring and its row ids (``return_ids``, one int64 per ring row, which the
unpacks decode) from the first return to the last unpack (the landing, in bulk or when the
ring holds every returned row, until the last combine tile; ``return_ids`` is then empty).
The backward regions (its done counters, the g'·dL/dy payload ring and its row ids, the dL/dx
return and its ids; under dedup the backward's sideband and the gate gradients) are not used
by the forward schedule: the backward runs the same task table over them, the forward's
offsets unchanged.

Ring slots are checked generation by generation: a slot's next contents (segment s + B on
the payload ring, claim j + B on a front-end's return ring, segment s + B on an owner's
private staging ring) are written only after the previous contents were consumed — in the
global order and in predicted time — and no owner ever holds more than B live payload slots.
Any violation is a compiler bug and is reported as one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rdepc.ir import sizes
from rdepc.ir.arguments import layer_sizes, rank_bytes
from rdepc.ir.graph import Buffer, MemoryPlan, Schedule, SlotUse

BACKWARD_REGIONS = ("bwd_control", "bwd_payload", "bwd_return")
ALIGN = 256  # docs/memory.md: every symmetric buffer is padded to a multiple of this
EPS = 1e-12  # seconds: predicted times compare with this slack (float sums)

_WHAT = {
    "tokens": "int64 per peer: the tokens T' that front-end brings to the call (phase 1, with the counts)",
    "counts": "int32 rows each source sends to each local expert (phase 1)",
    "offsets": "int32 write base per (owner, local expert) published back (phase 2)",
    "admitted": "int32 admitted rows per (owner, local expert): the accepted set",
    "keys": "int64 [W, T·K] at the owner: each source's admission keys, one ascending run per local expert"
    " (keyed admission only)",
    "flags": "int64 done counters of the tasks this rank runs, cumulative over calls: ready flags and credits",
    "payload": "dispatched rows, expert-contiguous within a slot",
    "sideband": "row_id, local expert, gate (and fp8 scale) per payload row",
    "return": "expert outputs landing at the front-end",
    "return_ids": "int64 row_id per return-ring row: the unpack places each row by it",
    "bwd_flags": "int64 done counters of the backward's tasks (the forward's, and a weight-gradient task per owner)",
    "bwd_payload": "g'·dL/dy rows, front-end → owner, expert-contiguous within a slot (the forward's offsets)",
    "bwd_row_ids": "int64 row_id per backward payload row: the owner returns each dL/dx row by it",
    "bwd_sideband": "dedup: fp32 g' and int32 links per backward payload row (the payload is one dL/dy row per"
    " (token, owner))",
    "bwd_inputs": "activations input resend: the input rows x again, front-end → owner, in the payload's dtype, "
    "at the backward payload rows' places",
    "bwd_scales": "backward fp8: fp32 scales of the g'·dL/dy rows, one per 128 columns of a row",
    "bwd_return": "dL/dx rows landing at the front-end",
    "bwd_return_scales": "backward fp8: fp32 scales of the dL/dx rows, one per 128 columns of a row",
    "bwd_return_ids": "int64 row_id per backward return-ring row",
    "bwd_dgate": "dedup: fp32 dL/dg' per (token, slot) at the front-end, computed by the owners",
}


def flag_slots(W: int, T: int, segments: int, ring: bool, balanced: bool = False) -> int:
    """Done counters one rank's heap slice holds when the busiest owner runs ``segments``
    segments (:func:`rdepc.ir.sizes.done_counters`; the planner's figure is the same rule)."""
    return sizes.done_counters(W, sizes.token_tiles(T), segments, ring, balanced)


def pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class MemPlanPass:
    """Schedule → MemoryPlan."""

    name: str = "memplan"

    def __call__(self, sched: Schedule) -> MemoryPlan:
        mp = memory_plan(sched)
        if mp.problems:
            raise AssertionError("memory plan violates its own invariants:\n  " + "\n  ".join(mp.problems))
        return mp


def memory_plan(sched: Schedule) -> MemoryPlan:
    """The symmetric heap and the rank's private buffers of ``sched``'s layer, with their
    lifetimes and the ring slots' checks."""
    geo = sched.graph.geometry
    S, B = geo.S, geo.B
    R_ret = B * S if geo.segmented else geo.T * geo.K
    live = _live_span(sched)
    buffers = _symmetric_buffers(sched, live, R_ret)
    fwd, fb = _regions(buffers)

    private = _private(geo, live)
    uses = _slot_uses(sched)
    problems = _check(buffers, uses, B)
    max_live = _max_live(uses, "payload")
    if max_live > B:
        problems.append(f"an owner holds {max_live} live payload slots, more than B = {B}")
    return MemoryPlan(
        layer=sched.layer,
        strategy=sched.strategy,
        S=S,
        B=B,
        R_ret=R_ret,
        align=ALIGN,
        buffers=tuple(buffers),
        private=tuple(private),
        forward=tuple(fwd.items()),
        forward_backward=tuple(fb.items()),
        uses=tuple(uses),
        max_live_payload=max_live,
        problems=tuple(problems),
    )


Lifetime = tuple[tuple[int, int] | None, tuple[float, float] | None]


def _live_span(sched: Schedule) -> Callable[..., Lifetime]:
    """``live(*stages)``: from the first to the last task of those stages, in task-table
    indices and in predicted seconds ((None, None) when the layer has none)."""
    pos, start, end = sched.position, sched.start, sched.end
    by_stage: dict[str, list[int]] = {}
    for t in sched.graph.tasks:
        key = f"{t.stage} {t.detail}" if t.detail else t.stage
        by_stage.setdefault(key, []).append(t.id)

    def live(*stages: str) -> Lifetime:
        ids = [u for s in stages for u in by_stage.get(s, [])]
        if not ids:
            return None, None
        return (min(pos[u] for u in ids), max(pos[u] for u in ids)), (
            min(start[u] for u in ids),
            max(end[u] for u in ids),
        )

    return live


def _heap(tg, R_ret: int) -> list[tuple[str, str, int, int, int]]:
    """The symmetric heap's buffers at this layer's sizes, in heap order: (region, name,
    bytes, slots, slot bytes)."""
    geo = tg.geometry
    W, S, B, H, T, K = geo.W, geo.S, geo.B, geo.H, geo.T, geo.K
    E_max = max(geo.experts, default=0)
    ring = geo.return_ring
    done = flag_slots(W, T, max(geo.segments, default=0), ring, geo.slots > 0)
    return sizes.heap_buffers(
        W, T, K, E_max, H, S, B, geo.d, geo.a, geo.sb, done, R_ret=R_ret, ids=R_ret if ring else 0, ring=ring,
        keyed=tg.spec.keyed_admission, dedup=geo.dedup, resend=tg.spec.input_activations == "resend",
        bwd_fp8=tg.spec.precision.backward_fp8,
    )  # fmt: skip


def _symmetric_buffers(sched: Schedule, live: Callable[..., Lifetime], R_ret: int) -> list[Buffer]:
    """The symmetric heap's buffers at their offsets, each padded to ALIGN, with what they
    hold and when the forward schedule uses them."""
    geo = sched.graph.geometry
    n = len(sched.order)
    whole = ((0, n - 1), (0.0, sched.makespan)) if n else (None, None)
    none = (None, None)  # the backward's buffers: not used by the forward schedule
    ring = geo.return_ring
    lives = {
        "payload": live("dispatch", "compute gemm1"),
        "sideband": live("dispatch", "compute gemm1"),
        "return": live("return", "combine unpack") if ring else live("return", "combine tile"),
        "return_ids": live("return", "combine unpack") if ring else (None, None),
    }
    spec_rows = [
        (region, name, nbytes, slots, slot_bytes, lives.get(name, whole if region == "control" else none))
        for region, name, nbytes, slots, slot_bytes in _heap(sched.graph, R_ret)
    ]
    buffers = []
    off = 0
    for region, name, nbytes, slots, slot_bytes, (lv, lv_s) in spec_rows:
        size = pad(nbytes)
        what = _WHAT[name]
        if name == "return":
            what += f" ({'a ring of B slots of S rows' if ring else 'every row at its (token, slot) place'})"
        elif name in ("return_ids", "bwd_return_ids") and not ring:
            what += " (empty: rows land at their (token, slot) places, nothing to decode)"
        buffers.append(Buffer(name, region, off, nbytes, size, slots, slot_bytes, what, lv, lv_s))
        off += size
    return buffers


def _regions(buffers: list[Buffer]) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per region and in total: the forward's regions, and the forward's and the backward's."""
    regions_fwd: dict[str, int] = {"control": 0, "payload": 0, "sideband": 0, "return": 0}
    regions_fb: dict[str, int] = {}
    for b in buffers:
        if b.region in regions_fwd:
            regions_fwd[b.region] += b.size
        regions_fb[b.region] = regions_fb.get(b.region, 0) + b.size
    fwd = {**regions_fwd, "total": sum(regions_fwd.values())}
    fb = {k: regions_fb[k] for k in ("control", "payload", "sideband", "return", *BACKWARD_REGIONS)}
    fb["total"] = sum(fb.values())
    return fwd, fb


# The memory plan's private buffers: each the rank's part of these of the kernel interface's
# (rdepc.ir.arguments.PRIVATE), whether it is a ring of B slots, what it holds, and the stages
# between which it is live.
_PRIVATE = (
    ("workspace", ("hbuf", "hbuf_rid"), True, ("compute gemm1", "compute gemm2"),
     "owner's GEMM1 activations and their row_ids per segment, read by its GEMM2 (private)"),
    ("staging", ("staging", "staging_rid"), True, ("compute gemm2", "return"),
     "owner's expert outputs and their row_ids per segment, read by its returns (private, not symmetric)"),
    ("landing", ("landing",), False, ("combine unpack", "combine tile"),
     "front-end's returned rows at their (token, slot) places, filled by unpacks (private)"),
)  # fmt: skip


def _private(geo, live) -> list[Buffer]:
    """The rank's private buffers the layer has, one after another."""
    z, out, off = layer_sizes(geo), [], 0
    for name, parts, ring, stages, what in _PRIVATE:
        each = [rank_bytes(z, p, geo.a) for p in parts]
        if None in each:
            continue
        nbytes = sum(each)
        slots, slot_bytes = (geo.B, nbytes // geo.B) if ring else (1, 0)
        out.append(Buffer(name, "private", off, nbytes, pad(nbytes), slots, slot_bytes, what, *live(*stages)))
        off += pad(nbytes)
    return out


def _slot_uses(sched: Schedule) -> list[SlotUse]:
    """Every generation of every ring slot: first writer to last reader."""
    tg = sched.graph
    geo = tg.geometry
    pos, start, end = sched.position, sched.start, sched.end
    writers: dict[tuple, list[int]] = {}
    readers: dict[tuple, list[int]] = {}
    for t in tg.tasks:
        if not geo.segmented:
            break
        if t.stage == "dispatch":
            writers.setdefault(("payload", t.owner, t.segment % geo.B, t.segment), []).append(t.id)
        elif t.detail == "gemm1":
            readers.setdefault(("payload", t.owner, t.segment % geo.B, t.segment), []).append(t.id)
            writers.setdefault(("workspace", t.owner, t.segment % geo.B, t.segment), []).append(t.id)
        elif t.detail == "gemm2":
            readers.setdefault(("workspace", t.owner, t.segment % geo.B, t.segment), []).append(t.id)
            writers.setdefault(("staging", t.owner, t.segment % geo.B, t.segment), []).append(t.id)
        elif t.stage == "return":
            readers.setdefault(("staging", t.owner, t.segment % geo.B, t.segment), []).append(t.id)
            if geo.return_ring:
                writers.setdefault(("return", t.src, t.slot, t.claim), []).append(t.id)
        elif t.detail == "unpack":
            readers.setdefault(("return", t.src, t.slot, t.claim), []).append(t.id)
    uses = []
    for key, ws in writers.items():
        rs = readers.get(key, [])
        ids = ws + rs
        uses.append(
            SlotUse(
                key[0],
                key[1],
                key[2],
                key[3],
                min(pos[u] for u in ws),
                max(pos[u] for u in (rs or ws)),
                min(start[u] for u in ws),
                max(end[u] for u in ids),
            )
        )
    uses.sort(key=lambda u: (u.ring, u.rank, u.slot, u.generation))
    return uses


def _check(buffers: list[Buffer], uses: list[SlotUse], B: int) -> list[str]:
    problems = []
    prev_end = 0
    for b in buffers:
        if b.offset % ALIGN or b.size % ALIGN or b.size < b.bytes:
            problems.append(f"{b.name}: offset {b.offset} / size {b.size} not padded to {ALIGN}")
        if b.offset < prev_end:
            problems.append(f"{b.name} at {b.offset} overlaps the buffer before it (ends at {prev_end})")
        if b.slots * b.slot_bytes > b.bytes:
            problems.append(f"{b.name}: {b.slots} slots of {b.slot_bytes} bytes do not fit in {b.bytes}")
        prev_end = b.offset + b.size
    last: dict[tuple, SlotUse] = {}
    for u in uses:
        key = (u.ring, u.rank, u.slot)
        p = last.get(key)
        if p is not None:
            if not p.last < u.first:
                problems.append(
                    f"{u.ring} slot {u.slot} of rank {u.rank}: generation {u.generation} is written (task-table "
                    f"index {u.first}) before generation {p.generation} is consumed (index {p.last})"
                )
            if u.start < p.end - EPS:
                problems.append(
                    f"{u.ring} slot {u.slot} of rank {u.rank}: generation {u.generation} starts at {u.start:.3e} s, "
                    f"before generation {p.generation} is consumed at {p.end:.3e} s"
                )
        last[key] = u
    return problems


def _max_live(uses: list[SlotUse], ring: str) -> int:
    """Most generations of one rank's ``ring`` live at once (in predicted time, and in
    task-table order)."""
    best = 0
    per: dict[int, list[SlotUse]] = {}
    for u in uses:
        if u.ring == ring:
            per.setdefault(u.rank, []).append(u)
    for lst in per.values():
        for key in (lambda u: (u.start, u.end), lambda u: (u.first, u.last)):
            events = []
            for u in lst:
                s, e = key(u)
                if e > s:
                    events += [(s, 1), (e, -1)]
            events.sort(key=lambda x: (x[0], x[1]))
            live = 0
            for _, d in events:
                live += d
                best = max(best, live)
    return best


__all__ = ["ALIGN", "MemPlanPass", "dump", "memory_plan", "pad"]


def dump(mp: MemoryPlan) -> str:
    """``--dump-after memplan``: the heap, buffer by buffer, and its regions."""
    lines = [
        f"// symmetric heap of layer {mp.layer} per rank: {mp.strategy}, S={mp.S}, B={mp.B}, R_ret={mp.R_ret}, "
        f"aligned to {mp.align} B",
        f"// {'offset':>12} {'size':>12} {'bytes':>12}  {'region':<11} {'buffer':<11} slots  live (task-table index)",
    ]
    for b in (*mp.buffers, *mp.private):
        live = "-" if b.live is None else f"{b.live[0]}..{b.live[1]}"
        lines.append(
            f"   {b.offset:>12,} {b.size:>12,} {b.bytes:>12,}  {b.region:<11} {b.name:<11} {b.slots:>5}  {live}"
            f"  {b.what}"
        )
    lines.append("// forward          " + ", ".join(f"{k} {v:,}" for k, v in mp.forward))
    lines.append("// forward+backward " + ", ".join(f"{k} {v:,}" for k, v in mp.forward_backward))
    lines.append(
        f"// ring generations checked: {len(mp.uses)}; most live payload slots of one owner: "
        f"{mp.max_live_payload} (B = {mp.B})"
    )
    lines += [f"// PROBLEM: {p}" for p in mp.problems]
    return "\n".join(lines)
