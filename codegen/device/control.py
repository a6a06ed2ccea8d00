"""The control block and the helpers every task kind shares: the call's first error for the
host, an entry's done counter, the profile's clock, fp32 narrowed to a kernel dtype, and
the route stage's input checks."""

import triton
import triton.language as tl
from rdepc.codegen.device.heap import peer
from rdepc.codegen.device.layout import (
    BWD_FLAGS,
    C_FLAG,
    C_RANK,
    CTL_BAD_GATES,
    CTL_BAD_IDS,
    CTL_CLOCK,
    CTL_DUP_TOKENS,
    CTL_ERR_CODE,
    CTL_ERR_DEP,
    CTL_ERR_ENTRY,
    CTL_ERR_EPOCH,
    CTL_ERR_EXPECTED,
    CTL_ERR_RANK,
    CTL_ERR_RESOURCE,
    CTL_ERR_SEEN,
    CTL_ERR_SEGMENT,
    FLAGS,
    K_PAD,
    NCOL,
    VALIDATE_TOKENS,
    E,
    K,
    T,
    W,
)


@triton.jit
def report(ctl, code, entry, dep, rank, epoch, queue, segment, seen, expected):
    """Record the call's first error for the host to raise (later ones are dropped): what
    happened, in which task-table entry, on which rank and queue, for which segment, and
    for a wait the flag (entry ``dep``) with the value seen versus the one expected."""
    zero = tl.zeros([], tl.int64)
    if tl.atomic_cas(ctl + CTL_ERR_CODE, zero, zero + code) == 0:
        tl.store(ctl + CTL_ERR_ENTRY, tl.cast(entry, tl.int64))
        tl.store(ctl + CTL_ERR_DEP, tl.cast(dep, tl.int64))
        tl.store(ctl + CTL_ERR_RANK, tl.cast(rank, tl.int64))
        tl.store(ctl + CTL_ERR_EPOCH, tl.cast(epoch, tl.int64))
        tl.store(ctl + CTL_ERR_RESOURCE, tl.cast(queue, tl.int64))
        tl.store(ctl + CTL_ERR_SEGMENT, tl.cast(segment, tl.int64))
        tl.store(ctl + CTL_ERR_SEEN, tl.cast(seen, tl.int64))
        tl.store(ctl + CTL_ERR_EXPECTED, tl.cast(expected, tl.int64))


@triton.jit
def done_flag(heap, table, entry, BACKWARD: tl.constexpr):
    """Entry ``entry``'s done counter: symmetric, in the heap slice of the rank that runs it,
    so a waiter on any rank reads it where its producer signals it. The backward counts in
    its own words."""
    row = table + entry * NCOL
    at = peer(heap, tl.load(row + C_RANK))
    if BACKWARD:
        at += BWD_FLAGS
    else:
        at += FLAGS
    return at.to(tl.pointer_type(tl.int64)) + tl.load(row + C_FLAG)


@triton.jit
def now(ctl, GLOBALTIMER: tl.constexpr):
    """A timestamp for the profile: %globaltimer (ns) on a GPU, else a logical clock (an
    atomic counter: an order, not a duration)."""
    if GLOBALTIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.atomic_add(ctl + CTL_CLOCK, 1)
    return t


@triton.jit
def stamp_skipped(ctl, profile, item0, k, end, step, GLOBALTIMER: tl.constexpr):
    """The profile's start and end, both now, of items k, k + step, ... before ``end`` (of the
    launch whose first item is ``item0``): empty m-tile slots counted done without running."""
    stamp = now(ctl, GLOBALTIMER)
    while k < end:
        tl.store(profile + (item0 + k) * 2, stamp)
        tl.store(profile + (item0 + k) * 2 + 1, stamp)
        k += step


@triton.jit
def narrow(x, dtype: tl.constexpr, CAST_F32: tl.constexpr):
    """fp32 ``x`` in ``dtype``, rounded to nearest even. The interpreter truncates fp32 to
    bf16 (subnormals included), so under it (CAST_F32) bf16 is made from the bits, as torch
    makes it: rounded to nearest even, every NaN the quiet NaN 0x7FC0."""
    if CAST_F32 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
        top = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, top).to(tl.uint16)
        return top.to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def note(ctl, word, bad, key):
    """Count the offending rows ``bad`` into control word ``word`` and keep the earliest
    (the largest ``key``) in the word after it; nothing is written when none offends."""
    count = tl.sum(bad.to(tl.int64), axis=0)
    if count > 0:
        tl.atomic_add(ctl + word, count)
        tl.atomic_max(ctl + word + 1, tl.max(tl.where(bad, key, 0), axis=0))


@triton.jit
def validate(topk_ids, gates, ctl, r, n_tokens, t_lo, t_hi):
    """Front-end r's routing inputs, its tokens [t_lo, t_hi) of the call's ``n_tokens``:
    expert ids in [0, E) or -1 (a slot that routes nowhere: padding), K distinct experts per
    token, finite gates. Offenders are counted into the control block with the first one
    (key W*T*K - (r*T + t)*K - k: earliest is largest; atomic, so chunks checked by several
    programs agree) for the host to raise after the call; the call goes on (an id out of
    range is routed nowhere, its slot not accepted), so no rank is left waiting and the next
    call starts clean."""
    base = tl.cast(r, tl.int64) * n_tokens * K
    key0 = W * T * K - tl.cast(r, tl.int64) * (T * K)
    slots = tl.arange(0, K_PAD)
    start = t_lo
    while start < t_hi:
        t = start + tl.arange(0, VALIDATE_TOKENS)
        start += VALIDATE_TOKENS
        live = (t < t_hi)[:, None] & (slots < K)[None, :]
        i = t[:, None] * K + slots[None, :]
        e = tl.load(topk_ids + base + i, mask=live, other=0)
        g = tl.load(gates + base + i, mask=live, other=0.0)
        key = tl.ravel(key0 - i)
        note(ctl, CTL_BAD_IDS, tl.ravel(live & ((e < -1) | (e >= E))), key)
        # NaN and +-inf (g - g is not 0); a slot that routes nowhere may carry any gate
        note(ctl, CTL_BAD_GATES, tl.ravel(live & (e != -1) & ((g - g) != 0)), key)
        routed = live & (e != -1)  # two slots that route nowhere are no repeated expert
        pair = routed[:, :, None] & routed[:, None, :] & (slots[:, None] < slots[None, :])[None, :, :]
        twice = tl.max(tl.max(((e[:, :, None] == e[:, None, :]) & pair).to(tl.int32), axis=2), axis=1) > 0
        note(ctl, CTL_DUP_TOKENS, twice, key0 - t * K)
