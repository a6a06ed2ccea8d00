"""A ``balance replicate`` layer's weight pushes as tasks of its own kernel (one process per
rank): each rank's push task puts its home experts' operands into the slots the call's plan
gave them, on the slots' ranks, each chunk read once and stored to every replica; each
rank's receive task, once every push has finished
(their done flags, the layer's own waits), copies its N slots into the call's operand, which
its GEMM tiles read and its backward keeps. In every other layer, and with every rank in one
process (whose slots' weights are gathered before the launch), SLOT_ELEMS is 0 and the
kernel compiles neither."""

import triton
import triton.language as tl
from rdepc.codegen.device.heap import peer_in, put
from rdepc.codegen.device.layout import (
    BIAS,
    DTYPE,
    EX_SLOTS_AT,
    SLOT_B_DOWN_AT,
    SLOT_B_UP_AT,
    SLOT_CHUNK,
    SLOT_CHUNKS,
    SLOT_DOWN_AT,
    SLOT_ELEMS,
    SLOTS,
    SLOTS_PAD,
    UP_COLS,
    F,
    H,
    W,
)


@triton.jit
def copy_elems(src, dst, n):
    """``n`` elements from ``src`` to ``dst`` (either may be a peer's), in blocks."""
    start = 0
    while start < n:
        i = start + tl.arange(0, 1024)
        put(dst + i, tl.load(src + i, mask=i < n), i < n)
        start += 1024


@triton.jit
def slot_block(w_up, w_down, b_up, b_down, i, j, live):
    """Elements ``j`` of local expert ``i``'s operands packed as a slot (``w_up`` GEMM1's
    [E_loc, H, UP_COLS·F], ``w_down`` [E_loc, F, H], with BIAS ``b_up`` [E_loc, UP_COLS·F]
    and ``b_down`` [E_loc, H]; ``rdepc.ir.balance.slot_parts``' offsets): each from the one
    tensor that holds it."""
    up = live & (j < SLOT_DOWN_AT)
    v = tl.load(w_up + i * (H * (UP_COLS * F)) + j, mask=up, other=0.0)
    down = live & (j >= SLOT_DOWN_AT) & (j < SLOT_DOWN_AT + F * H)
    v = tl.where(down, tl.load(w_down + i * (F * H) + (j - SLOT_DOWN_AT), mask=down, other=0.0), v)
    if BIAS:
        bu = live & (j >= SLOT_B_UP_AT) & (j < SLOT_B_DOWN_AT)
        v = tl.where(bu, tl.load(b_up + i * (UP_COLS * F) + (j - SLOT_B_UP_AT), mask=bu, other=0.0), v)
        bd = live & (j >= SLOT_B_DOWN_AT)
        v = tl.where(bd, tl.load(b_down + i * H + (j - SLOT_B_DOWN_AT), mask=bd, other=0.0), v)
    return v


@triton.jit
def push_slot(
    exchange, ex_stride, slot_table, order, owner_first, w_up, w_down, b_up, b_down, rank, item,
):  # fmt: skip
    """Work item ``item`` = i·SLOT_CHUNKS + c of rank ``rank``'s push task (the layer's kernel,
    one process per rank): chunk c (SLOT_CHUNK elements) of home expert i's operands as the
    layer's kernels read them, read once and stored into every slot the call's plan gave the
    expert, on the slots' ranks (``exchange``: the balance exchange, whose slot region holds
    [SLOTS, SLOT_ELEMS] of DTYPE on every rank). A slot's weights move on as many programs as take
    its chunks. The task's done flag, raised after every item, tells the receivers."""
    i = item // SLOT_CHUNKS
    lo = (item % SLOT_CHUNKS) * SLOT_CHUNK
    hi = tl.minimum(lo + SLOT_CHUNK, SLOT_ELEMS)
    e = tl.load(order + tl.load(owner_first + rank) + i)
    s = tl.arange(0, SLOTS_PAD)
    held = tl.load(slot_table + s, mask=s < W * SLOTS, other=-1) == e
    if tl.max(held.to(tl.int32), axis=0) > 0:
        start = lo
        while start < hi:
            j = start + tl.arange(0, 1024)
            live = j < hi
            v = slot_block(w_up, w_down, b_up, b_down, tl.cast(i, tl.int64), j, live)
            for t in range(W):
                for k in range(SLOTS):
                    if tl.load(slot_table + t * SLOTS + k) == e:
                        dst = (peer_in(exchange, t, ex_stride) + EX_SLOTS_AT).to(tl.pointer_type(DTYPE))
                        put(dst + tl.cast(k, tl.int64) * SLOT_ELEMS + j, v, live)
            start += 1024


@triton.jit
def receive_slot(exchange, ex_stride, slots, rank, item):
    """Work item ``item`` = j·SLOT_CHUNKS + c of rank ``rank``'s receive task, once every
    rank's push has finished: chunk c of slot j as its home pushed it, copied into the
    call's operand ``slots`` [SLOTS, SLOT_ELEMS] (what the GEMM tiles read, and the call's
    backward after later calls refilled the region)."""
    lo = (item % SLOT_CHUNKS) * SLOT_CHUNK
    at = tl.cast(item // SLOT_CHUNKS, tl.int64) * SLOT_ELEMS + lo
    n = tl.minimum(SLOT_CHUNK, SLOT_ELEMS - lo)
    copy_elems((peer_in(exchange, rank, ex_stride) + EX_SLOTS_AT).to(tl.pointer_type(DTYPE)) + at, slots + at, n)
