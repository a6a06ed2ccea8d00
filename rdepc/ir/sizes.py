"""The sizes every pass reads: one function per formula, in the RDEP paper's names.

A *route row* is one (token, slot) pair a front-end sends to the *owner* of the slot's
expert, the rank that holds it; ``E_loc(q)`` is the number of experts owner q holds. The
capacity decides the *accepted set*: the route rows an owner admits, at most ``cap_e`` per
expert. An owner's admitted rows move and are computed in *segments* of ``S`` rows (one
segment of all of them in bulk).

Sizes are plain ints (T at its bound when it is symbolic). The rules that ``rdepc plan``
also prints as formulas (:func:`capacity_rule`, :func:`owner_rows_rule`,
:func:`done_counters`) take their operations as arguments or use only ``+`` and ``*``, so
the planner builds its sympy formula by calling the same function with symbols. Pure
Python: nothing here imports torch, triton or sympy. (``rdepc.reference`` keeps its own
copy on purpose: it shares no code with the compiler.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

BM = 128  # rows of one grouped-GEMM m-tile: the planner's and the cost model's tile height
# Columns the combine sums over all K slots at once (each slot's rows loaded before the sum):
# 128 spilled the transport kernel on sm_90 (moonlight: 1,000 B of stack)
COMBINE_COLS = 64


def combine_cols(K: int) -> int:
    """Columns a combine step sums over all K slots: COMBINE_COLS up to K = 8, half that
    above, where K slots' rows of 64 columns (16·K registers a thread at 128 tokens and 8
    warps) spilled on sm_90 (qwen3_next_80b_a3b, K = 10: 119 spill loads a step; at 32
    columns none)."""
    return COMBINE_COLS if K <= 8 else COMBINE_COLS // 2


# Bytes of rows a program's move step (a dispatch's, return's or unpack's; the GEMM kernel's
# copy of the rows it keeps) loads before it stores them: in BLOCK_H columns of 64 rows (every
# tile's block_r) a step was 16 KB, a round trip each (the combine's steps, ~12 GB/s a program,
# were as latency-bound before their slots were unrolled)
MOVE_BYTES = 64 * 1024


def move_cols(H: int, elem_bytes: int, rows: int = 64) -> int:
    """Columns one step of a copy of ``rows`` rows of ``elem_bytes`` each carries: MOVE_BYTES
    of them (in bf16 512 at a transport move's 64 rows, 256 at an m-tile's BM), no more than H
    rounded up to a power of two."""
    return min(MOVE_BYTES // (rows * elem_bytes), next_pow2(H, 16))


def next_pow2(n: int, least: int = 2) -> int:
    """The least power of two, ``least`` or more, that is n or more (a tl.arange size)."""
    p = least
    while p < n:
        p *= 2
    return p


def kept_columns(H: Any, F: Any, gated: bool, recompute: bool, resend: bool = False) -> dict[str, Any]:
    """Columns of each owner-row buffer a forward keeps for its backward, per row: the input
    rows x (saved_x) unless the backward's dispatch sends them again (``activations input
    resend``), and GEMM1's pre-activations (saved_pre: gate and up of a gated expert, h of
    another) unless the backward computes them again (``activations pre recompute``). The
    planner's saved-activation figures and the runtime's buffers read this."""
    return ({} if resend else {"saved_x": H}) | ({} if recompute else {"saved_pre": (2 if gated else 1) * F})


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ of two ints, exactly."""
    return -(-a // b)


# Columns one fp8 scale covers under ``scale block`` and in an fp8 backward (DeepEP's block of
# 128 elements).
SCALE_BLOCK = 128


def block_scales(H: Any) -> Any:
    """fp32 scales a row of H columns carries at one per SCALE_BLOCK columns, ⌈H/128⌉ (an int,
    or a sympy expression for a symbol): fp8 dispatch's ``scale block``, the fp8 backward."""
    return ceil_div(H, SCALE_BLOCK)


# --- capacity: the accepted set ----------------------------------------------------------


def capacity_rule(policy: str, mu: Any, factor: Any, rows: Any, ceil: Callable[[Any], Any]) -> Any:
    """cap_e over any number type: ``ceil(f·μ)`` for ``capacity factor f``, where μ = W·T·K/E
    is the mean route rows per expert (eq. 2 with DP = W); the spec's rows for ``capacity
    rows C``; None when dropless (every route row is accepted)."""
    if policy == "dropless":
        return None
    if policy == "rows":
        return rows
    return ceil(factor * mu)


def cap_e(policy: str, W: int, T: int, K: int, E: int, factor: Any = None, rows: int | None = None) -> int | None:
    """Route rows one owner admits for one expert (its share of the accepted set): by
    :func:`capacity_rule` at W ranks of T tokens, K slots each, over E experts. ``factor``
    is any exact number (int, Fraction, a sympy Rational); ``rows`` the spec's capacity rows,
    already at its largest over the tokens a call may bring."""
    mu = Fraction(W * T * K, E)
    cap = capacity_rule(policy, mu, None if factor is None else Fraction(factor), rows, math.ceil)
    return None if cap is None else int(cap)


def owner_rows_rule(W: Any, T: Any, K: Any, n_local: Any, cap: Any, Min: Callable[[Any, Any], Any]) -> Any:
    """R_q over any number type: route rows owner q may admit. Its worst case, every token
    of every front-end picking distinct experts on it, is ``W·T·min(K, E_loc(q))``; a
    capacity caps it at ``E_loc(q)·cap_e`` (``cap`` None: dropless, no cap)."""
    worst = W * T * Min(K, n_local)
    return worst if cap is None else Min(worst, n_local * cap)


def owner_rows(W: int, T: int, K: int, n_local: int, cap: int | None) -> int:
    """R_q of an owner holding ``n_local`` experts (:func:`owner_rows_rule`)."""
    return owner_rows_rule(W, T, K, n_local, cap, min)


def bulk_rows(rows_max: Sequence[int]) -> int:
    """S_bulk = max_q R_q: bulk moves each owner's accepted rows as one segment of the busiest
    owner's size (at least one row)."""
    return max(max(rows_max, default=0), 1)


# --- segments, tasks and their done counters -----------------------------------------------


# Ring slots of a segmented strategy: deep runs dispatch B - 1 segments ahead of compute, so
# with fewer than DEEP_BUFFERS it is no deeper than pipelined; when nothing says B, each
# strategy's least that does what it is for.
DEEP_BUFFERS = 3
DEFAULT_BUFFERS = {"pipelined": 2, "deep": DEEP_BUFFERS}


def lookahead(strategy: str, B: int) -> int:
    """Segments dispatch runs ahead of compute: 1 for bulk and pipelined, B - 1 for deep."""
    return 1 if strategy in ("bulk", "pipelined") else max(1, int(B) - 1)


def segment_count(rows: int, S: int) -> int:
    """Segments of S rows that ``rows`` admitted rows of one owner fill: ⌈R_q / S⌉."""
    return ceil_div(rows, S)


def return_ring(segmented: bool, B: int, S: int, T: int, K: int) -> bool:
    """Whether returns land in a ring of B slots of S rows (claimed, then freed by unpacks):
    segmented, and the ring holds fewer than the T·K route rows a front-end gets back."""
    return segmented and B * S < T * K


ROUTE_CHUNK_TOKENS = 256  # tokens one route work item counts, and then buckets


def route_chunks(T: int) -> int:
    """Chunks of a front-end's tokens the route splits into, each counted by one work item
    and bucketed by another (the route's 2 · route_chunks work items)."""
    return max(1, ceil_div(T, ROUTE_CHUNK_TOKENS))


def route_counts_at(E_pad: int) -> int:
    """Where a front-end's route scratch keeps its chunks' counts (then bases) per expert:
    after the bucket base per expert and the bases per (owner, local expert) and one past."""
    return 2 * E_pad + 2


def route_scratch_words(E_pad: int, T: int) -> int:
    """int32 words of a front-end's route scratch: the bucket base per expert, the bases per
    (owner, local expert) and one past, then per chunk a count (then the base) per expert."""
    return route_counts_at(E_pad) + route_chunks(T) * E_pad


def token_tiles(T: int) -> int:
    """Combine tiles of one front-end: ⌈T / BM⌉ tiles of BM tokens."""
    return ceil_div(T, BM)


def tasks_per_segment(W: Any, ring: Any) -> Any:
    """Tasks one (owner, segment) adds to the graph: a dispatch from every front-end and a
    return to every one (2W), its GEMM1 and GEMM2 (2), and with a return ring (``ring`` true
    or 1) an unpack at every front-end (W)."""
    return 2 * W + 2 + W * ring


def done_counters(W: Any, tiles: Any, segments: Any, ring: Any, balanced: Any = 0) -> Any:
    """Done counters one rank's heap slice holds (the ``flags`` buffer, in int64 words): a
    bound on the task-table entries one rank runs when the busiest owner runs ``segments``
    segments: its route, scan and combine wait (3), its ``tiles`` combine tiles, and
    :func:`tasks_per_segment` per segment. Over ints and over sympy expressions alike (the
    planner's formula passes ⌈T/BM⌉ and the ring condition as expressions). Under ``balance
    replicate`` (``balanced`` true or 1) its balance tasks too (5: load, solve, reroute, push,
    receive)."""
    return 3 + 5 * balanced + tiles + tasks_per_segment(W, ring) * segments


def task_count(W: int, T: int, segments: Sequence[int], ring: bool, balanced: bool = False) -> int:
    """Tasks of a whole graph: per rank its route, scan, combine wait and combine tiles (and
    under ``balance replicate``, ``balanced``, its five balance tasks), and
    :func:`tasks_per_segment` for every (owner, segment)."""
    return W * (3 + token_tiles(T) + 5 * balanced) + sum(segments) * tasks_per_segment(W, ring)


# --- m-tiles -------------------------------------------------------------------------------


def segments_cut(rows_max: Sequence[int], S: int) -> bool:
    """Whether segment boundaries cut an owner's admitted rows (some R_q > S); in bulk, and
    whenever every owner's rows fit one segment, they never do."""
    return max(rows_max, default=0) > S


def segment_m_tiles(rows: int, n_local: int, cut: bool, bm: int = BM) -> int:
    """m-tile slots a segment of at most ``rows`` admitted rows over ``n_local`` local experts
    may need. m-tiles go expert by expert, each aligned to its expert's first row (so a row
    keeps its place in its tile whatever the schedule): ⌈rows/bm⌉ + E_loc − 1 tiles; when
    segment boundaries cut an owner's rows (``cut``), a boundary may split one tile per
    expert in two, E_loc more: ⌈rows/bm⌉ + 2·E_loc − 1. 0 for an owner with no experts."""
    if not n_local:
        return 0
    return ceil_div(rows, bm) + (2 if cut else 1) * n_local - 1


def m_tiles(rows_per_expert: Iterable[int], bm: int = BM) -> int:
    """m-tiles one segment launches for these admitted rows per local expert, each expert's
    rows starting a tile (padding-free: only its last tile is partial). What the cost model
    charges for a routing; :func:`segment_m_tiles` bounds it over every routing."""
    return sum(ceil_div(n, bm) for n in rows_per_expert)


def m_tile_slots(rows_max: Sequence[int], n_local: Sequence[int], S: int, bm: int = BM) -> tuple[int, ...]:
    """m-tile slots per segment of each owner q, the rule the kernel's ``m_tile`` runs:
    :func:`segment_m_tiles` of min(R_q, S) rows, cut when some owner's rows exceed S."""
    cut = segments_cut(rows_max, S)
    return tuple(segment_m_tiles(min(r, S), n, cut, bm) for r, n in zip(rows_max, n_local, strict=True))


# The backward's sideband under dedup, per payload row: its g' (fp32), then its links (2 int32).
BWD_SIDEBAND = (("gate", 4), ("links", 8))


def heap_buffers(
    W: Any, T: Any, K: Any, E_max: Any, H: Any, S: Any, B: Any, d: Any, a: Any, sb: Any, done: Any, **kw: Any
) -> list[tuple[str, str, Any, Any, Any]]:
    """The symmetric heap's buffers of one rank's slice, in order (docs/memory.md): (region,
    name, bytes, slots, bytes per slot), unpadded. A rule over any number type, so the
    memory plan evaluates it with ints and ``rdepc plan`` prints it with symbols.

    ``S``, ``B``: ring slots (bulk: S = R_max, B = 1); ``R_ret`` (keyword): returned rows a
    front-end holds (B·S with a ring, else T·K); ``ids``: rows whose row_ids the return
    ring keeps (R_ret when it rotates, else 0); ``ring``: whether it rotates (slots of the
    return buffers: B, else one); ``keyed``, ``dedup``: the spec's admission and transport;
    ``d``, ``a``, ``sb``: bytes of a payload element, a layer element and a sideband row;
    ``done``: done counters per rank; ``resend`` (keyword, default false): the backward's
    dispatch sends the input rows again, in the payload's dtype (``activations input resend``);
    ``bwd_fp8`` (keyword, default false): the backward's rows go as fp8 e4m3, 1 byte an
    element, with :func:`block_scales` fp32 scales a row beside them (``dtype ..., backward
    fp8_e4m3``)."""
    R_ret, ids, ring, keyed, dedup = kw["R_ret"], kw["ids"], kw["ring"], kw["keyed"], kw["dedup"]
    resend = kw.get("resend", False)
    bd, bsc = (1, block_scales(H) * 4) if kw.get("bwd_fp8", False) else (a, 0)
    bwd_sb = sum(n for _, n in BWD_SIDEBAND)
    return [
        ("control", "tokens", W * 8, 1, 0),
        ("control", "counts", W * E_max * 4, 1, 0),
        ("control", "offsets", W * E_max * 4, 1, 0),
        ("control", "admitted", W * E_max * 4, 1, 0),
        ("control", "keys", W * T * K * 8 if keyed else 0, 1, 0),
        ("control", "flags", done * 8, 1, 0),
        ("payload", "payload", B * S * H * d, B, S * H * d),
        ("sideband", "sideband", B * S * sb, B, S * sb),
        ("return", "return", R_ret * H * a, B if ring else 1, S * H * a if ring else R_ret * H * a),
        ("return", "return_ids", ids * 8, B if ring else 1, S * 8 if ring else 0),
        ("bwd_control", "bwd_flags", (done + 1) * 8, 1, 0),
        ("bwd_payload", "bwd_payload", B * S * H * bd, B, S * H * bd),
        ("bwd_payload", "bwd_scales", B * S * bsc, B, S * bsc),
        ("bwd_payload", "bwd_row_ids", B * S * 8, B, S * 8),
        ("bwd_payload", "bwd_sideband", B * S * bwd_sb if dedup else 0, B, S * bwd_sb if dedup else 0),
        ("bwd_payload", "bwd_inputs", B * S * H * d if resend else 0, B, S * H * d if resend else 0),
        ("bwd_return", "bwd_return", R_ret * H * bd, B if ring else 1, S * H * bd if ring else 0),
        ("bwd_return", "bwd_return_scales", R_ret * bsc, B if ring else 1, S * bsc if ring else 0),
        ("bwd_return", "bwd_return_ids", ids * 8, B if ring else 1, S * 8 if ring else 0),
        ("bwd_return", "bwd_dgate", T * K * 4 if dedup else 0, 1, 0),
    ]


__all__ = [
    "BM",
    "BWD_SIDEBAND",
    "SCALE_BLOCK",
    "block_scales",
    "bulk_rows",
    "cap_e",
    "capacity_rule",
    "ceil_div",
    "done_counters",
    "heap_buffers",
    "m_tile_slots",
    "m_tiles",
    "owner_rows",
    "owner_rows_rule",
    "return_ring",
    "segment_count",
    "segment_m_tiles",
    "segments_cut",
    "task_count",
    "tasks_per_segment",
    "token_tiles",
]
