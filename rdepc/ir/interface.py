"""The interface between a generated kernel and its host side, each part declared once.

:data:`CONSTANTS` is every ``tl.constexpr`` global a kernel file starts with: the layer's
sizes, the spec's choices, the symmetric heap's offsets and the encodings both sides share
(task kinds, table columns, control words, error codes, statistics columns), each with its
value for a kernel contract and its comment. The emitter writes them (``codegen/emit.py``),
the device modules' stand-ins are their values for a small layer
(``codegen/device/layout.py``) and the runtime reads a layer's with :func:`constant_values`:
a constant added here reaches all three.

:data:`STATS` is the statistics buffer's columns (``stats`` [W, ST_COLS] int32, one row per
owner), in order. From it come the ``ST_*`` constants, the buffer's shape in the lowering's
private buffers, and the offsets the runtime's statistics reader indexes.

The kernels' arguments and the private buffers among them are declared in
:mod:`rdepc.ir.arguments`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rdepc.ir.balance import SLOT_CHUNK, exchange_regions, plan_tables, slot_parts
from rdepc.ir.contract import COLUMNS, CONTROL, CTL_TICKETS, ERRORS, KINDS, KernelContract, tile_slots
from rdepc.ir.sizes import (
    BM,
    ROUTE_CHUNK_TOKENS,
    SCALE_BLOCK,
    block_scales,
    combine_cols,
    move_cols,
    next_pow2,
    route_chunks,
    route_counts_at,
    route_scratch_words,
)
from rdepc.ir.spec import ROUTE_VARS, Dtype


@dataclass(frozen=True)
class Column:
    """One statistics column: its constant is ``ST_<NAME>``; ``per_expert`` columns take
    E_MAX places (one per local expert), the others one."""

    name: str
    per_expert: bool
    doc: str


STATS = (
    Column("arrived", True, "rows arrived per local expert"),
    Column("admitted", True, "rows admitted per local expert"),
    Column("mtiles", False, "m-tiles the grouped GEMM ran"),
    Column("cap", False, "the capacity cap_e the scan applied"),
    Column("sent", False, "payload rows this rank dispatched with their data"),
    Column("returned", False, "rows it returned with their data"),
)


def stats_columns(E_MAX: int) -> dict[str, int]:
    """Each column's first place in a row of ``stats``, by name, and ``cols``: the row's length."""
    at, places = {}, 0
    for c in STATS:
        at[c.name] = places
        places += E_MAX if c.per_expert else 1
    return at | {"cols": places}


# ----------------------------------------------------------------------------- the constants
# Every tl.constexpr global the emitter writes at the top of a kernel file, in its order: a
# name, its value for a contract and a comment (a string, or one made from the contract). The
# emitted constants block, the device modules' stand-ins (codegen/device/layout.py: these values
# for a small layer) and the runtime's reader (:func:`constant_values`) all come from it: a
# constant added here reaches all three.


@dataclass(frozen=True)
class Tl:
    """A ``triton.language`` attribute as a constant's value (a dtype): ``tl.<name>``."""

    name: str


@dataclass(frozen=True)
class Constant:
    name: str
    value: Callable[[KernelContract], object]
    doc: str | Callable[[KernelContract], str] = ""


@dataclass(frozen=True)
class Group:
    """Constants written together under their heading (comment lines); ``constants`` may be a
    function that makes them when they are read."""

    heading: tuple[str, ...]
    constants: tuple[Constant, ...] | Callable[[], tuple[Constant, ...]]

    def members(self) -> tuple[Constant, ...]:
        return self.constants() if callable(self.constants) else self.constants


TL_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8_e4m3": "float8e4nv"}
RID_CODES = {v: i for i, v in enumerate(ROUTE_VARS)}  # the device's decode order: 0 rank, 1 token, 2 slot
_RULE = "# " + "-" * 87


def tma(p: KernelContract) -> bool:
    """Whether every GEMM operand's rows are 16-byte aligned — payload, workspace, weights —
    as tensor descriptors (TMA) require; otherwise the GEMMs read through masked pointer loads."""
    a, d = Dtype(p.dtype).bytes, Dtype(p.dispatch).bytes
    return all(n % 16 == 0 for n in (p.H * d, p.H * a, p.F * a))


def _c(name: str, value: Callable[[KernelContract], object], doc="") -> Constant:
    return Constant(name, value, doc)


def _field(name: str, doc="") -> Constant:
    """A constant that is the contract's field of the same name (or the name in lower case)."""
    attr = name if name in KernelContract.__dataclass_fields__ else name.lower()
    return Constant(name, lambda p: getattr(p, attr), doc)


def _heap(name: str, region: str, doc, optional: bool = False) -> Constant:
    """A region's byte offset in a rank's heap slice (the memory plan); -1 for an ``optional``
    region this layer has not."""
    return Constant(name, lambda p: dict(p.heap).get(region, -1) if optional else dict(p.heap)[region], doc)


def _rid(i: int) -> Callable[[KernelContract], int]:
    return lambda p: ([RID_CODES[v] for v in p.row_id_order] + [-1] * 3)[i]


def _slot_at(part: str) -> Callable[[KernelContract], int]:
    """Where a redundant slot read in place holds ``part`` (``rdepc.ir.balance.slot_parts``), else -1."""
    return lambda p: slot_parts(p.H, p.F, p.gated, p.bias).get(part, (-1, 0))[0] if p.slot_elems else -1


def _exchange_at(table: str) -> Callable[[KernelContract], int]:
    """The balance exchange's tables (one process per rank), else -1."""

    def at(p: KernelContract) -> int:
        if not p.slot_elems:
            return -1
        return exchange_regions(p.W, p.homes, p.balance[0], p.slot_elems, Dtype(p.dtype).bytes)[0].get(table, -1)

    return at


def _plan_at(table: str) -> Callable[[KernelContract], int]:
    """The balance plan's tables the balance tasks read (one process per rank), else -1."""
    return lambda p: plan_tables(p.W, p.homes, p.balance[0]).get(table, (-1, 0))[0] if p.slot_elems else -1


_SCALE = {"row": "one per row", "block": "one per SCALE_COLS columns"}
_SIDEBAND = {
    "row_id": "int64 [B*S]",
    "local_expert": "int32 [B*S]",
    "gate": "fp32 [B*S]",
    "scale": "fp32 [B*S, SCALES]",
    "links": "int32 [B*S, 2]: the token's first and next row here (dedup)",
}

SIZES = (
    _field("W", "ranks: DP = EP = W, TP = 1 (RDEP eq. 6)"),
    _field("T", "tokens per rank, the plan's bound"),
    _field("H", "hidden size"),
    _field("F", "ffn width of one expert"),
    _field("E", "routed experts"),
    _field("K", "experts per token (top-K)"),
    _c("E_MAX", lambda p: p.E_MAX, "most experts one owner holds"),
    _field("S", "rows of one ring slot (bulk: the worst case over owners, max_q R_q)"),
    _field("B", "ring slots: segment s uses slot s % B"),
    _c("E_PAD", lambda p: next_pow2(p.E), "E, E_MAX, W and K rounded up to powers of two (tl.arange sizes)"),
    _c("EL_PAD", lambda p: next_pow2(p.E_MAX)),
    _c("W_PAD", lambda p: next_pow2(p.W)),
    _c("K_PAD", lambda p: next_pow2(p.K)),
    _c("ROUTE_ROWS", lambda p: max(16, min(256, 8192 // next_pow2(p.E))),
       "route rows per block of the route stage's one-hot prefix count"),
    _c("ROUTE_CHUNK_TOKENS", lambda p: ROUTE_CHUNK_TOKENS, "tokens one route work item counts, and then buckets"),
    _c("ROUTE_CHUNKS", lambda p: route_chunks(p.T),
       "chunks of a front-end's tokens: the route's items are twice as many"),
    _c("ROUTE_SCRATCH", lambda p: route_scratch_words(next_pow2(p.E), p.T),
       "int32 words of a front-end's route scratch"),
    _c("ROUTE_COUNTS_AT", lambda p: route_counts_at(next_pow2(p.E)),
       "where in it each chunk's counts per expert start"),
    _c("KEY_ROWS", lambda p: 64, "admission keys per block of the scan's count"),
    _c("KEY_BITS", lambda p: p.key_bits if p.keyed else 0, "bits of an admission key: the scan's bisection steps"),
    _field("COMBINE_TOKENS", "tokens per combine tile (the scheduler's token tiles)"),
    _c("COMBINE_COLS", lambda p: combine_cols(p.K), "columns the combine sums over all K slots at once (wider spills)"),
    _c("MOVE_COLS", lambda p: move_cols(p.H, Dtype(p.dtype).bytes), "columns a transport move's step carries"),
    _c("KEEP_COLS", lambda p: move_cols(p.H, Dtype(p.dtype).bytes, BM),
       "columns a step of the GEMM kernel's row copies"),
    _c("VALIDATE_TOKENS", lambda p: max(16, 512 // (next_pow2(p.K) * next_pow2(p.K))),
       "tokens per block of the input checks"),
    _c("SEGMENTS", lambda p: -(-max(p.rows_max, default=0) // p.S), "segments of the busiest owner"),
    _c("TILE_SLOTS", lambda p: tile_slots(p.rows_max, p.n_local, p.S),
       "m-tile slots per segment at 16 rows per m-tile"),
    _c("SLOT_BLOCK", lambda p: 64, "m-tile slots per block of the scan's m-tile table"),
    _c("R_MAX", lambda p: p.R_MAX, "rows of the busiest owner: the backward's saved rows per owner"),
    _field("SCALE_COLS",
           lambda p: f"payload columns one fp8 scale covers ({_SCALE.get(p.dispatch_scale, 'none: no fp8')})"),
    _c("SCALES", lambda p: p.scales if p.scale_cols else 0, "fp32 scales per payload row, in the sideband"),
    _field("HOMES", "home experts: the E - W*SLOTS the router picks from (balance replicate)"),
    _c("HOMES_PAD", lambda p: next_pow2(p.homes)),
    _c("SLOTS", lambda p: p.balance[0], "redundant expert slots a rank (balance replicate; else 0)"),
    _c("SLOTS_PAD", lambda p: next_pow2(max(p.W * p.balance[0], 1)), "W*SLOTS rounded up to a power of two"),
    _c("RANK_SLOTS_PAD", lambda p: next_pow2(max(p.balance[0], 1), 1), "SLOTS rounded up to a power of two"),
    _c("MIN_ROWS", lambda p: p.balance[1], "the least rows a replica takes"),
    _field("SLOT_ELEMS", "elements of one redundant slot read in place (one process per rank)"),
    _c("SLOT_DOWN_AT", _slot_at("w_down"), "a slot's GEMM2 weights, after GEMM1's (then b_up, b_down)"),
    _c("SLOT_B_UP_AT", _slot_at("b_up")),
    _c("SLOT_B_DOWN_AT", _slot_at("b_down")),
    _c("SLOT_CHUNK", lambda p: SLOT_CHUNK, "slot elements one push or receive work item moves"),
    _c("SLOT_CHUNKS", lambda p: p.slot_chunks if p.balance[0] else 1, "work items a slot takes"),
    _c("EX_LOADS_AT", _exchange_at("loads"), "the balance exchange's load table [W, HOMES] int32 (bytes)"),
    _c("EX_SLOTS_AT", _exchange_at("slots"), "... and its slots' weights [SLOTS, SLOT_ELEMS]"),
    _c("PLAN_PHYS_AT", _plan_at("phys"), "the plan's tables (int32 elements; its load table first)"),
    _c("PLAN_CUM_AT", _plan_at("cum")),
    _c("PLAN_SLOTS_AT", _plan_at("slots")),
    _c("PLAN_LOADS_AT", _plan_at("loads")),
)  # fmt: skip

CHOICES = (
    _c("DTYPE", lambda p: Tl(TL_DTYPE[p.dtype]), "weights, activations, returned rows"),
    _c("DISPATCH_DTYPE", lambda p: Tl(TL_DTYPE[p.dispatch]), "payload rows on the wire"),
    _c("DISPATCH_SCALE", lambda p: p.dispatch_scale or "none", "fp8 payload scales: row, block or none"),
    _c("PRECISION", lambda p: "ieee", "fp32 tl.dot in IEEE fp32, not TF32"),
    _c("TMA", tma, "GEMM operands read through tensor descriptors (rows 16-byte aligned)"),
    _field("PER_RANK", "one process per rank: every GEMM item a process runs is its rank's"),
    _field("ACT", "the expert's activation"),
    _field("ACT_LIMIT", "clamped_swiglu: gate <= limit, up within +-limit (else 0)"),
    _field("ACT_ALPHA", "clamped_swiglu: (up + 1) * gate * sigmoid(alpha * gate) (else 0)"),
    _field("BIAS", "expert biases: GEMM1's epilogue adds b_up before the activation, GEMM2's b_down"),
    _field("RECOMPUTE", "the backward computes GEMM1's pre-activations again (not kept)"),
    _field("GATE_INPUT", "the gate scales the expert's input: rows go out as g'*x, come back unweighted"),
    _field("RESEND", "the backward's dispatch sends the input rows again (the owners kept none)"),
    _field("BWD_FP8", "the backward's rows go as fp8 e4m3, with a scale per BWD_SCALE_COLS columns"),
    _c("BWD_WIRE", lambda p: Tl("float8e4nv" if p.bwd_fp8 else TL_DTYPE[p.dtype]), "the backward's rows on the wire"),
    _c("BWD_SCALE_COLS", lambda p: SCALE_BLOCK, "columns of a backward row one fp8 scale covers"),
    _c("BWD_SCALES", lambda p: block_scales(p.H) if p.bwd_fp8 else 0, "fp32 scales per backward row"),
    _field("GATED", "a gated expert: GEMM1's weights are [Wg Wu], interleaved"),
    _c("UP_COLS", lambda p: 2 if p.gated else 1, "GEMM1 output columns per ffn column"),
    _field("KEYED", "admission by key (a drop policy other than arrival order), not by row order"),
    _c("POSITIONS_BY_KEY", lambda p: p.keyed and not p.keys_in_row_order, "route positions in key order"),
    _field("DROP", "the capacity's drop policy"),
    _c("RENORMALIZE", lambda p: p.weights == "renormalize", "capacity weights: renormalize over accepted slots"),
    _c("CARRY_LOCAL_EXPERT", lambda p: "local_expert" in p.sideband, "the sideband carries each row's local expert"),
    _c("CARRY_GATE", lambda p: "gate" in p.sideband, "the sideband carries each row's gate"),
    _field("RING", "returns go through a return ring that unpack empties"),
    _field("DEDUP", "one payload row per (token, owner) (X-MoE)"),
    _c("RID_0", _rid(0), "route-row variables from the largest row_id coefficient down:"),
    _c("RID_1", _rid(1), lambda p: "0 rank, 1 token, 2 slot, -1 none (route_row " + " > ".join(p.row_id_order) + ")"),
    _c("RID_2", _rid(2)),
)  # fmt: skip

HEAP = (
    _field("HEAP_BYTES", "one rank's slice: the forward's regions, then the backward's"),
    _heap("TOKENS", "tokens", "int64 [W] at the owner: the tokens T' each front-end brings to the call"),
    _heap("COUNTS", "counts", "int32 [W, E_MAX] at the owner: rows each source sends each local expert"),
    _heap("OFFSETS", "offsets", "int32 [W, E_MAX] at the source: write base per (owner, local expert)"),
    _heap("ADMITTED", "admitted", "int32 [W, E_MAX] at the source: admitted rows per (owner, local expert)"),
    _heap("KEYS", "keys", "int64 [W, T*K] at the owner: each source's admission keys", optional=True),
    _heap("FLAGS", "flags", "int64 done counters of the entries this rank runs (task-table column flag)"),
    _heap("PAYLOAD", "payload", "DISPATCH_DTYPE [B*S, H]: a segment's rows by local expert, then source"),
    *(_heap(f"SB_{f.upper()}", f"sideband_{f}", f"sideband {f}, {what}", optional=True)
      for f, what in _SIDEBAND.items()),
    _heap("RETURN", "return", lambda p: "DTYPE at the front-end: " + (
        "the return ring, claim j in slot j % B" if p.ring else "row t*K + k of each (token, slot)")),
    _heap("RETURN_IDS", "return_ids", "int64 [B*S]: the row_id of each return-ring row", optional=True),
    _heap("BWD_FLAGS", "bwd_flags", "int64 the backward's done counters"),
    _heap("BWD_PAYLOAD", "bwd_payload", "BWD_WIRE [B*S, H]: g'·dL/dy rows at the forward's places"),
    _heap("BWD_SCALES_AT", "bwd_scales", "fp32 [B*S, BWD_SCALES]: BWD_FP8, their scales"),
    _heap("BWD_ROW_IDS", "bwd_row_ids", "int64 [B*S]: their row_ids"),
    _heap("BWD_INPUTS", "bwd_inputs", "DISPATCH_DTYPE [B*S, H]: RESEND, the input rows x again at those places"),
    _heap("BWD_RETURN", "bwd_return", "BWD_WIRE: dL/dx rows at the front-end, laid out as RETURN"),
    _heap("BWD_RETURN_SCALES", "bwd_return_scales", "fp32 [rows, BWD_SCALES]: BWD_FP8, their scales"),
    _heap("BWD_RETURN_IDS", "bwd_return_ids", "int64 [B*S]: their row_ids", optional=True),
    _heap("BWD_SB_GATE", "bwd_sideband_gate", "fp32 [B*S]: dedup, each backward row's g'", optional=True),
    _heap("BWD_SB_LINKS", "bwd_sideband_links", "int32 [B*S, 2]: dedup, its links (as SB_LINKS)", optional=True),
    _heap("BWD_DGATE", "bwd_dgate", "fp32 [T*K] at the front-end: dedup, dL/dg' of each (token, slot)", optional=True),
)  # fmt: skip

_LEAD = "stats [W, ST_COLS]: "


def _encodings() -> tuple[Constant, ...]:
    """The encodings both sides share; the statistics columns as :data:`STATS` holds them now."""
    return (
    *(_c(f"KIND_{k.upper()}", lambda p, i=i: i) for i, k in enumerate(KINDS)),
    *(_c(f"C_{c.upper()}", lambda p, i=i: i) for i, c in enumerate(COLUMNS)),
    _c("NCOL", lambda p: len(COLUMNS)),
    *(_c(f"CTL_{c.upper()}", lambda p, i=i: i) for i, c in enumerate(CONTROL)),
    _c("CTL_TICKETS", lambda p: CTL_TICKETS, "the ticket counter, cumulative over calls"),
    *(_c(f"ERR_{n}", lambda p, code=code: code, ERRORS[code])
      for code, n in zip(ERRORS, ("WAIT", "OVERFLOW", "ROW_ID"), strict=True)),
    *(_c(f"ST_{c.name.upper()}", lambda p, n=c.name: stats_columns(p.E_MAX)[n],
         (_LEAD if i == 0 else "") + c.doc + ("," if i < len(STATS) - 1 else ""))
      for i, c in enumerate(STATS)),
    _c("ST_COLS", lambda p: stats_columns(p.E_MAX)["cols"]),
    )  # fmt: skip


CONSTANTS = (
    Group((_RULE, "# The layer: sizes from the spec (T at its bound; a call may pass T' <= T tokens per rank)", _RULE),
          SIZES),
    Group(("# The spec's choices, which the device functions branch on at compile time.",), CHOICES),
    Group((_RULE, "# The symmetric heap: byte offsets in one rank's slice (the memory plan, docs/memory.md)", _RULE),
          HEAP),
    Group(("# Task kinds, columns of a task-table row (int32), the control block (int64), statistics.",), _encodings),
)  # fmt: skip


def constant_groups(p: KernelContract) -> list[tuple[tuple[str, ...], list[tuple[str, object, str]]]]:
    """:data:`CONSTANTS` for ``p``, group by group: (heading, [(name, value, comment), ...])."""
    return [
        (g.heading, [(c.name, c.value(p), c.doc(p) if callable(c.doc) else c.doc) for c in g.members()])
        for g in CONSTANTS
    ]


def constant_values(p: KernelContract) -> list[tuple[str, object, str]]:
    """Every constant of :data:`CONSTANTS` for ``p``: (name, value, comment), in order."""
    return [c for _, group in constant_groups(p) for c in group]


__all__ = [
    "CONSTANTS",
    "STATS",
    "Column",
    "Constant",
    "Group",
    "Tl",
    "constant_groups",
    "constant_values",
    "stats_columns",
    "tma",
]
