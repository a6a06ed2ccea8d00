"""The generated kernels' arguments and the private buffers among them, each declared once.

:data:`ARGUMENTS` is every argument of ``rdep_layer`` and ``rdep_gemm`` in their order (the
signatures of ``codegen/device/kernel.py`` and ``codegen/device/gemm_kernel.py``; a test holds
they agree): a name, a Triton type (``*T``: a pointer to the layer's dtype), the kernels that
take it and a comment. :func:`kernel_args` reads it for the host's launches, the sm_90
compiles and the placeholders a runtime passes for what a layer has not.

:data:`PRIVATE` is every per-rank private buffer (``KernelContract.private``): a name, its
dtype (``T``: the layer's activation dtype), its shape as a function of the lowering's sizes
(:class:`Sizes`), when a layer has it, and the argument the backward's launch passes it as
(its own control words and tile counters). The lowering builds the contract's list from it
(:func:`private_buffers`); the runtime allocates that list.

Importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from rdepc.ir.contract import ctl_words, tile_slots
from rdepc.ir.interface import stats_columns
from rdepc.ir.sizes import next_pow2, route_scratch_words

if TYPE_CHECKING:
    from rdepc.ir.contract import KernelContract
    from rdepc.ir.graph import Geometry

LAYER, GEMM = "rdep_layer", "rdep_gemm"
BOTH = (LAYER, GEMM)
# The kernels of a generated file, by name: their arguments are kernel_args(contract, name).
KERNELS = BOTH


@dataclass(frozen=True)
class Argument:
    name: str
    type: str  # a Triton type; "*T": a pointer to the layer's dtype
    kernels: tuple[str, ...] = (LAYER,)
    doc: str = ""


def _args(names: str, type_: str, kernels: tuple[str, ...] = (LAYER,), doc: str = "") -> tuple[Argument, ...]:
    return tuple(Argument(n, type_, kernels, doc) for n in names.split())


ARGUMENTS = (
    Argument("heap", "*u8", BOTH, "this rank's slice of the symmetric heap"),
    *_args("x", "*T"),
    Argument("topk_ids", "*i64"),
    Argument("gates", "*fp32"),
    Argument("w_up", "*T", BOTH, "a gated expert's [Wg Wu], interleaved: [E, H, F, 2]"),
    *_args("w_down", "*T", BOTH),
    *_args("y", "*T"),
    Argument("accepted", "*i8"),
    Argument("slot", "*i32"),
    Argument("gprime", "*fp32"),
    # The backward's: dL/dy, dL/dx, dL/dg'; what the forward saved for it (input rows and
    # pre-activations at the owner, expert outputs at the front-end or under dedup at the
    # owner); its working rows (dH, the activation, g'·dL/dy at the owner) and the weight
    # gradients.
    *_args("dy dx", "*T"),
    Argument("dgprime", "*fp32"),
    *_args("saved_x saved_pre saved_out dh act_rows do_rows dw_up dw_down", "*T", BOTH),
    *_args("b_up b_down db_up db_down", "*T", BOTH, "expert biases: GEMM1's [E, F, 2] or [E, F], GEMM2's [E, H]"),
    *_args("slots dslots", "*T", BOTH, "the redundant slots' packed operands and their gradients (balance)"),
    # the balance tasks' plan (rdepc.ir.balance.plan_tables), the route rows' home expert
    # ids (the reroute writes their physical ids into topk_ids) and the balance exchange
    Argument("plan", "*i32"),
    Argument("home_ids", "*i64"),
    Argument("exchange", "*u8"),
    *_args("table deps queue", "*i32", BOTH, "the task table and its work queues"),
    *_args("queue_pos", "*i32"),
    *_args("first_item queues", "*i32", BOTH),
    *_args("owner_of local_of n_local", "*i32"),
    *_args("weight_of", "*i32", BOTH),
    *_args("order owner_first rows_max caps m_slots rowpos sorted_rows route_scratch recv", "*i32"),
    *_args("group tile_table", "*i32", BOTH),
    *_args("hbuf", "*T", BOTH),
    *_args("hbuf_rid", "*i64", BOTH),
    *_args("staging", "*T", BOTH),
    *_args("staging_rid", "*i64", BOTH),
    *_args("tile_done", "*i64", BOTH),
    Argument("landing", "*T", doc="a return ring's unpacked rows"),
    Argument("stats", "*i32"),
    *_args("ctl profile", "*i64", BOTH),
    Argument("tokens_of", "*i64"),
    Argument("n_tokens", "i32"),
    *_args("n_programs rank0", "i32", BOTH),
    *_args("rid_c rid_r rid_t rid_k ex_stride", "i64"),
    Argument("bound", "i32", BOTH, "spins a wait may take"),
    Argument("program_base", "i32", (GEMM,), "its programs' first number: its own"),
    *_args("BM BLOCK_H BLOCK_F BLOCK_K", "constexpr", BOTH),
    *_args("BLOCK_R", "constexpr"),
    *_args("STAGES CAST_F32", "constexpr", BOTH),
    *_args("GEMMS", "constexpr"),
    *_args("PROFILE GLOBALTIMER BACKWARD SAVE", "constexpr", BOTH),
    Argument("LIBRARY", "constexpr", (GEMM,), "the GEMM items of the library lowering's kernel"),
)  # fmt: skip

# The torch dtype (by name) a pointer argument of kernel_args points to, by its Triton type.
POINTEE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
POINTEE |= {"u8": "uint8", "i8": "int8", "i32": "int32", "i64": "int64"}


def kernel_args(contract: KernelContract, kernel: str = LAYER) -> list[tuple[str, str]]:
    """(name, Triton type) of the arguments of ``kernel`` (``rdep_layer`` or ``rdep_gemm``),
    in order: the names the host passes arguments by and the types sm_90 compiles use. The
    same for every layer but for the dtype of the layer's tensors."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")
    pointer = f"*{contract.dtype}"
    return [(a.name, pointer if a.type == "*T" else a.type) for a in ARGUMENTS if kernel in a.kernels]


def own_constexprs(contract: KernelContract, kernel: str, meta: dict) -> dict:
    """``meta`` without the constexprs the generated ``kernel`` does not take (a launch passes
    each kernel of its mode only its own)."""
    names = {n for n, kind in kernel_args(contract, kernel) if kind == "constexpr"}
    return {k: v for k, v in meta.items() if k in names}


# ----------------------------------------------------------------------------- private buffers
class Sizes(NamedTuple):
    """What the private buffers' shapes read: the layer's sizes (T at its bound), the next
    power of two of E (``E_PAD``), the words of the route's scratch and of the control
    block, the m-tile slots of all segments of the busiest owner (``tiles``), and whether
    the returns land in a ring (``ring``)."""

    W: int
    T: int
    K: int
    H: int
    F: int
    B: int
    S: int
    E_MAX: int
    route_words: int
    ctl_words: int
    stats_cols: int
    tiles: int
    ring: bool


@dataclass(frozen=True)
class Private:
    name: str
    dtype: str  # "T": the layer's activation dtype
    shape: Callable[[Sizes], tuple[int, ...]]
    doc: str
    present: Callable[[Sizes], bool] = lambda z: True
    backward_of: str | None = None  # the argument the backward's launch passes it as


PRIVATE = (
    Private("rowpos", "int32", lambda z: (z.W, z.T * z.K), "each route row's position in its (source, expert) run"),
    Private("sorted_rows", "int32", lambda z: (z.W, z.T * z.K), "each source's rows bucketed by (owner, local expert)"),
    Private("route_scratch", "int32", lambda z: (z.W, z.route_words),
            "bucket base per expert, then per (owner, local), then each chunk's counts (bases) per expert"),
    Private("recv", "int32", lambda z: (z.W, z.W, z.E_MAX, 2), "the owner's split table: (payload offset, admitted)"),
    Private("group", "int32", lambda z: (z.W, z.E_MAX, 2), "(first payload row, rows) per (owner, local expert)"),
    Private("tile_table", "int32", lambda z: (z.W, z.tiles * 4),
            "each m-tile slot's (local expert, first row, lo, hi) per (owner, segment): the GEMMs' tile table"),
    Private("hbuf", "T", lambda z: (z.W, z.B * z.S, z.F), "silu(x·Wg) ⊙ (x·Wu) per payload ring row: GEMM1 → GEMM2"),
    Private("hbuf_rid", "int64", lambda z: (z.W, z.B * z.S), "their row ids: the payload slot refills before GEMM2"),
    Private("staging", "T", lambda z: (z.W, z.B * z.S, z.H),
            "expert outputs per payload ring row (the memory plan's staging ring)"),
    Private("staging_rid", "int64", lambda z: (z.W, z.B * z.S), "their row ids, for the return"),
    Private("tile_done", "int64", lambda z: (z.W, z.tiles), "each m-tile slot's GEMM1 counter per (owner, segment)"),
    Private("bwd_tile_done", "int64", lambda z: (z.W, z.tiles), "the backward's own", backward_of="tile_done"),
    Private("landing", "T", lambda z: (z.W, z.T * z.K, z.H), "unpacked returns at their (token, slot) places",
            present=lambda z: z.ring),
    Private("stats", "int32", lambda z: (z.W, z.stats_cols), "rdepc.ir.interface.STATS"),
    Private("ctl", "int64", lambda z: (z.ctl_words,), "clock, error record, ticket counters"),
    Private("bwd_ctl", "int64", lambda z: (z.ctl_words,), "the backward's own", backward_of="ctl"),
)  # fmt: skip

# The private buffers only the backward's launch reads (its control words and tile counters):
# a module built for inference allocates the others.
BACKWARD_PRIVATE = frozenset(p.name for p in PRIVATE if p.backward_of)


def layer_sizes(geo: Geometry) -> Sizes:
    """The private buffers' :class:`Sizes` of a schedule's geometry (the lowering's and the
    memory plan's)."""
    E_MAX = max(geo.experts, default=0)
    slots = max(geo.segments, default=0) * tile_slots(geo.rows_max, geo.experts, geo.S)
    return Sizes(geo.W, geo.T, geo.K, geo.H, geo.F, geo.B, geo.S, E_MAX, route_scratch_words(next_pow2(geo.E), geo.T),
                 ctl_words(geo.W), stats_columns(E_MAX)["cols"], slots, geo.return_ring)  # fmt: skip


_ELEMENT_BYTES = {"int32": 4, "int64": 8}


def rank_bytes(z: Sizes, name: str, activation_bytes: int) -> int | None:
    """Bytes of one rank's part of the private buffer ``name`` (its first dimension is the
    ranks'), a ``T`` element ``activation_bytes`` wide; None where the layer has none."""
    (p,) = (p for p in PRIVATE if p.name == name)
    if not p.present(z):
        return None
    return math.prod(p.shape(z)[1:]) * (activation_bytes if p.dtype == "T" else _ELEMENT_BYTES[p.dtype])


def private_buffers(z: Sizes, activation: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """The layer's private buffers: (name, dtype, shape), ``T`` made ``activation``."""
    return tuple((p.name, activation if p.dtype == "T" else p.dtype, p.shape(z)) for p in PRIVATE if p.present(z))


__all__ = [
    "ARGUMENTS",
    "BACKWARD_PRIVATE",
    "BOTH",
    "GEMM",
    "KERNELS",
    "LAYER",
    "POINTEE",
    "PRIVATE",
    "Argument",
    "Private",
    "Sizes",
    "kernel_args",
    "layer_sizes",
    "own_constexprs",
    "private_buffers",
    "rank_bytes",
]
