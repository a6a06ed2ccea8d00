"""What a work item waits for before it runs: an entry's done flag (a GEMM item's guard, its
owner's scan) and its entry's dependencies' done flags, each bounded (``signals.wait``);
shared by the kernels that take work items."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import done_flag
from rdepc.codegen.device.layout import (
    C_DEP_COUNT,
    C_DEP_START,
    C_ITEMS,
    C_KIND,
    E_MAX,
    HOMES,
    KIND_GEMM1,
    KIND_GEMM2,
    KIND_RECEIVE,
    NCOL,
    SLOTS,
)
from rdepc.codegen.device.signals import wait


@triton.jit
def wait_done(heap, table, entry, target, bound, stop, BACKWARD: tl.constexpr):
    """Wait until task-table entry ``entry`` has finished its items in call ``target``: (the
    value its done flag showed, the value waited for)."""
    want = target * tl.load(table + entry * NCOL + C_ITEMS)
    return wait(done_flag(heap, table, entry, BACKWARD), want, bound, stop), want


@triton.jit
def whole_wait(weight_of, kind, owner, local):
    """Whether a work item waits for every dependency of its entry: all but a GEMM1 m-tile
    of ``owner``'s local expert ``local`` that computes no redundant slot (``balance
    replicate``: a slot's weight_of is -(j + 1) one process per rank, an id past the home
    experts with every rank in one), which does not wait for its rank's receive."""
    whole = kind == kind
    if SLOTS > 0:  # noqa: SIM102 - SLOTS is folded at compile time, the kind tested at run time
        if kind == KIND_GEMM1:
            w = tl.load(weight_of + owner * E_MAX + local)
            whole = (w < 0) | (w >= HOMES)
    return whole


@triton.jit
def wait_deps(heap, table, deps, row, kind, target, tile, f_blocks, bound, stop, whole, BACKWARD: tl.constexpr):
    """Wait for every dependency of the task-table entry at ``row`` in call ``target``:
    (the entry that did not finish or -1, the value its flag showed, the value expected).
    A dependency -(e + 1) is entry e of the previous call, waited for at (target - 1) ×
    its items. A GEMM2 item waits for its own m-tile of the segment's GEMM1 only: the
    counter ``tile`` at target × ``f_blocks``. Unless ``whole`` (:func:`whole_wait`), a
    receive is not waited for. The first wait that expires ends the loop."""
    blocked = -1
    seen = target * 0
    expected = target * 0
    d = tl.load(row + C_DEP_START)
    end = d + tl.load(row + C_DEP_COUNT)
    while (d < end) & (blocked < 0):
        dep = tl.load(deps + d)
        before = (dep < 0).to(tl.int64)
        dep = tl.where(dep < 0, -dep - 1, dep)
        want = (target - before) * tl.load(table + dep * NCOL + C_ITEMS)
        flag = done_flag(heap, table, dep, BACKWARD)
        if (kind == KIND_GEMM2) & (tl.load(table + dep * NCOL + C_KIND) == KIND_GEMM1):
            want = target * f_blocks
            flag = tile
        if SLOTS > 0:  # noqa: SIM102 - SLOTS is folded at compile time
            if (kind == KIND_GEMM1) & (whole == 0) & (tl.load(table + dep * NCOL + C_KIND) == KIND_RECEIVE):
                want = want * 0  # a wait already met
        got = wait(flag, want, bound, stop)
        if got < want:
            blocked = dep
            seen = got
            expected = want
        d += 1
    return blocked, seen, expected
