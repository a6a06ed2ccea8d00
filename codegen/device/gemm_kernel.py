"""The persistent GEMM kernel ``rdep_gemm`` of split mode: only the expert GEMM work, beside
the transport kernel (``rdep_layer`` compiled without it)."""

import triton
import triton.language as tl
from rdepc.codegen.device.control import done_flag, now, report, stamp_skipped
from rdepc.codegen.device.expert_grads import expert_item
from rdepc.codegen.device.experts import m_tile_slot, ring_descriptors, weight_descriptors
from rdepc.codegen.device.kernel import owner_buffers
from rdepc.codegen.device.layout import (
    C_DEP_START,
    C_GUARD,
    C_ITEMS,
    C_KIND,
    C_OWNER,
    C_RANK,
    C_SEGMENT,
    CTL_CALLS,
    CTL_ERR_CODE,
    CTL_EXITS,
    CTL_GEMM_PROGRAMS,
    ERR_WAIT,
    KEEP_COLS,
    KIND_GEMM1,
    KIND_GEMM2,
    NCOL,
    PER_RANK,
    SEGMENTS,
    SLOT_ELEMS,
    TILE_SLOTS,
    TMA,
    F,
)
from rdepc.codegen.device.rows import bound_m_tile, segment_empty
from rdepc.codegen.device.signals import SCOPE, signal, wait
from rdepc.codegen.device.waits import wait_deps, wait_done, whole_wait


@triton.jit(noinline=True)
def skip_empty_run(
    heap, table, queue, first_item, tile_table, ctl, profile, pos, last_pos, item0, mine, stride, target,
    PROFILE: tl.constexpr, GLOBALTIMER: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    """From queue position ``pos``, a GEMM1 or GEMM2 entry whose segment has no m-tile (its
    slot 0 is empty): the run of such entries from there, 64 positions at a time, up to the
    first that is another kind, whose owner's scan is not done yet, or whose segment has
    rows. Returns the position after the run. Each entry of the run is counted done, all
    its items in one signal, by the program whose items include its first (``mine``: this
    program's first item of the call, its items ``mine`` + k·``stride``); every other program
    only steps past it. An owner's rows fill its segments in order (``route.scan`` packs them
    from row 0), so once one is empty so are its later ones: a pipelined schedule plans each
    owner's segments for every row choosing it (dropless: ~W times what uniform routing
    brings), and the programs would otherwise step through the empty ones one entry at a time."""
    lane = tl.arange(0, 64)
    end = pos
    going = end < last_pos
    while going:
        p = end + lane
        live = p < last_pos
        entry = tl.load(queue + p, mask=live, other=0)
        row = table + entry * NCOL
        kind = tl.load(row + C_KIND, mask=live, other=-1)
        gemm = live & ((kind == KIND_GEMM1) | (kind == KIND_GEMM2))
        guard = tl.load(row + C_GUARD, mask=gemm, other=-1)
        gemm = gemm & (guard >= 0)
        guard = tl.where(gemm, guard, 0)
        grow = table + guard * NCOL
        scanned = tl.atomic_add(done_flag(heap, table, guard, BACKWARD), 0, mask=gemm, sem="acquire", scope=SCOPE)
        tl.debug_barrier()  # every warp sees what the acquire made visible: the scans' m-tile tables
        ready = gemm & (scanned >= target * tl.load(grow + C_ITEMS, mask=gemm, other=0))
        owner = tl.load(row + C_OWNER, mask=ready, other=0)
        empty = ready & segment_empty(tile_table, owner, tl.load(row + C_SEGMENT, mask=ready, other=0), ready)
        run = tl.min(tl.where(empty, 64, lane), axis=0)  # the first position that is not in the run
        first = tl.load(first_item + p, mask=lane < run, other=0) - item0
        items = tl.load(first_item + p + 1, mask=lane < run, other=0) - item0 - first
        counted = (lane < run) & (first % stride == mine)
        if PROFILE:
            stamp_entries(ctl, profile, item0, first, items, counted, GLOBALTIMER)
        tl.debug_barrier()
        tl.atomic_add(done_flag(heap, table, entry, BACKWARD), items, mask=counted, sem="release", scope=SCOPE)
        end += run
        going = (run == 64) & (end < last_pos)
    return end


@triton.jit
def stamp_entries(ctl, profile, item0, first, items, counted, GLOBALTIMER: tl.constexpr):
    """The profile's stamps (``control.stamp_skipped``) of every item of the entries
    ``counted`` among those whose items are [``first``, ``first`` + ``items``) (of the launch
    whose first item is ``item0``): counted done without running."""
    lane = tl.arange(0, 64)
    for j in range(0, 64):
        pick = counted & (lane == j)
        lo = tl.sum(tl.where(pick, first, 0), axis=0)
        stamp_skipped(ctl, profile, item0, lo, lo + tl.sum(tl.where(pick, items, 0), axis=0), 1, GLOBALTIMER)


@triton.jit(do_not_specialize=["n_programs", "rank0", "bound", "program_base"])
def rdep_gemm(
    heap, w_up, w_down, saved_x, saved_pre, saved_out, dh, act_rows, do_rows, dw_up, dw_down, b_up, b_down, db_up,
    db_down, slots, dslots, table, deps, queue, first_item, queues, weight_of, group, tile_table, hbuf, hbuf_rid,
    staging, staging_rid, tile_done, ctl, profile, n_programs, rank0, bound, program_base, BM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, CAST_F32: tl.constexpr,
    PROFILE: tl.constexpr, GLOBALTIMER: tl.constexpr, BACKWARD: tl.constexpr, SAVE: tl.constexpr,
    LIBRARY: tl.constexpr,
):  # fmt: skip
    """Split and phased mode's GEMM kernel: the work items of the GEMM entries (the queue
    whose record ``queues`` starts at: gemm1, gemm2 and the backward's wgrad, in the task
    table's order, m-tile major within an entry), program p of the queue's P taking items
    p, p + P, p + 2P, ... — no ticket and no search: a program's items only move forward,
    so it finds each one's entry by stepping its queue position. What an item waits for is
    remembered across the program's items: its owner's scan (the guard) and its entry's
    dependencies once per entry, after that only a GEMM2 item's own m-tile of GEMM1 (one
    counter). The transport kernel waits on the GEMM entries' done flags, which count their
    finished items. A program whose item's m-tile slot has no live rows counts that item and
    the rest of its items in the entry done with one signal: under a dropless bulk schedule
    most slots are empty (an owner's slots cover every token choosing it, ~W times the rows
    a uniform routing brings), and each would otherwise cost its loop turn, its m-tile's
    words and two released signals. Where the whole segment is empty (a segmented schedule
    plans each owner as many segments), the program counts the run of such entries from it
    done at once (``skip_empty_run``): each by the program whose items include its first.

    Progress: the earliest unfinished item of either kernel has its inputs done (the table
    is topological), and its program is at it — a program finishes its items in order —
    or, in the transport kernel, holds its ticket; so a split call ends as long as both
    kernels' programs are resident at once, which the host checks before it launches (a
    phased call launches them one after another: what a launch waits for is done before it
    starts, or within it). ``program_base`` numbers this launch's programs (the interpreter
    runs each as its own launch of one); ``n_programs`` counts every launch's programs,
    which all count out of the call.

    LIBRARY (the library GEMM lowering, rdepc.runtime.library): the items wait and signal as
    they would, and compute nothing: torch's grouped GEMMs, issued after this launch on the
    same stream, compute them once every row they read has landed, from whichever rank.
    """
    me = tl.cast(rank0, tl.int64)
    (
        saved_x, saved_pre, saved_out, dh, act_rows, do_rows, group, hbuf, hbuf_rid, staging, staging_rid, tile_done,
        tile_table,
    ) = owner_buffers(
        me, saved_x, saved_pre, saved_out, dh, act_rows, do_rows, group, hbuf, hbuf_rid, staging, staging_rid,
        tile_done, tile_table,
    )  # fmt: skip
    up_desc = None  # the experts' weights through descriptors built once (else each tile builds its own)
    down_desc = None
    up_t = None
    down_t = None
    if TMA and SLOT_ELEMS == 0 and not LIBRARY:
        up_desc, down_desc, up_t, down_t = weight_descriptors(w_up, w_down, BLOCK_H, BLOCK_F, BLOCK_K)
    rows_desc = None  # the rows the tiles read, likewise (one process per rank: one owner's)
    mid_desc = None
    if TMA and PER_RANK and not LIBRARY:
        rows_desc, mid_desc = ring_descriptors(heap, hbuf, dh, me, BM, BLOCK_K, BACKWARD)
    tl.atomic_add(ctl + CTL_GEMM_PROGRAMS, 1)  # started: a wait that expires says whether both kernels ran
    epoch = tl.load(ctl + CTL_CALLS, volatile=True) + 1
    target = epoch
    f_blocks = (F + BLOCK_F - 1) // BLOCK_F
    pos = tl.load(queues)  # this launch's queue record: its positions [first, last) and its programs
    last_pos = tl.load(queues + 1)
    stride = tl.load(queues + 2)
    item0 = tl.load(first_item + pos)
    n_items = tl.load(first_item + last_pos) - item0
    item = (program_base + tl.program_id(0)).to(tl.int32)
    entry = -1
    next_first = item0 - item0  # the first item of the entry after the current one
    kind = 0
    rank = 0
    owner = 0
    segment = 0
    guard = -1
    guarded = -1  # the last guard (scan) this program saw done
    ready = -1  # the last entry whose dependencies this program saw done
    failed = tl.load(ctl + CTL_ERR_CODE, volatile=True)
    while (item < n_items) & (failed == 0):
        while next_first <= item:  # step to the item's entry: at most once per entry over the whole call
            entry = tl.load(queue + pos)
            pos += 1
            next_first = tl.load(first_item + pos) - item0
            row = table + entry * NCOL
            kind = tl.load(row + C_KIND)
            rank = tl.load(row + C_RANK)
            owner = tl.load(row + C_OWNER)
            segment = tl.load(row + C_SEGMENT)
            guard = tl.load(row + C_GUARD)
        row = table + entry * NCOL
        # the entry's first item, read again rather than carried: Triton 3.6 drops a value the
        # inner loop assigns from the outer loop's carried values when it aliased another one
        # before the loop (every item after an entry's first then took the wrong m-tile)
        i = (item - (tl.load(first_item + pos - 1) - item0)).to(tl.int32)
        blocked = -1
        seen = target * 0
        expected = target * 0
        if (guard >= 0) & (guard != guarded):  # gemm1, gemm2: their owner's scan first
            got, want = wait_done(heap, table, guard, target, bound, ctl + CTL_ERR_CODE, BACKWARD)
            if got < want:
                blocked = guard
                seen = got
                expected = want
            else:
                guarded = guard
        mt = m_tile_slot(kind, i, BLOCK_H, BLOCK_F)
        tile = tile_done + (owner * SEGMENTS + segment) * TILE_SLOTS + mt  # its GEMM1 items done, over calls
        local = 0
        row0 = 0
        lo = 0
        hi = 1  # wgrad: no m-tile
        if (guard >= 0) & (blocked < 0):
            local, row0, lo, hi = bound_m_tile(tile_table, owner, segment, mt)
        if (hi > lo) & (blocked < 0):
            whole = whole_wait(weight_of, kind, owner, local)
            if (entry != ready) | (whole == 0):
                blocked, seen, expected = wait_deps(
                    heap, table, deps, row, kind, target, tile, f_blocks, bound, ctl + CTL_ERR_CODE, whole, BACKWARD
                )
                if (blocked < 0) & whole:  # an m-tile that skipped the receive leaves the entry unready
                    ready = entry
            elif kind == KIND_GEMM2:  # the entry's other dependencies are done: its m-tile of GEMM1
                got = wait(tile, target * f_blocks, bound, ctl + CTL_ERR_CODE)
                if got < target * f_blocks:
                    blocked = tl.load(deps + tl.load(row + C_DEP_START))  # GEMM1 of the segment, its first
                    seen = got
                    expected = target * f_blocks
        if blocked >= 0:
            report(ctl, ERR_WAIT, entry, blocked, rank, epoch, 1, segment, seen, expected)
        elif (kind >= 0) & (hi <= lo):
            if segment_empty(tile_table, owner, segment, kind >= 0):
                # The segment has no m-tile: it and the empty segments after it, each
                # counted done by the program whose items include its first (skip_empty_run).
                pos = skip_empty_run(
                    heap, table, queue, first_item, tile_table, ctl, profile, pos - 1, last_pos, item0, item % stride,
                    stride, target, PROFILE, GLOBALTIMER, BACKWARD,
                )  # fmt: skip
                next_first = tl.load(first_item + pos) - item0
                item = next_first + (item % stride + stride - next_first % stride) % stride - stride
            else:
                # A slot past the routing's m-tiles. The slots with live rows are a prefix of
                # the segment's (rows.m_tile) and an entry's items run m-tile major, so every
                # item this program has left in the entry is empty too: all counted done at
                # once (a dropless bulk owner has ~W times the slots its rows fill), their
                # slots' GEMM1 counters left to the scan (rows.bind_m_tiles).
                rest = ((next_first - 1 - item) // stride + 1).to(tl.int32)
                if PROFILE:
                    stamp_skipped(ctl, profile, item0, item, next_first, stride, GLOBALTIMER)
                signal(done_flag(heap, table, entry, BACKWARD), rest)
                item += (rest - 1) * stride
        elif kind >= 0:
            if PROFILE:
                start = now(ctl, GLOBALTIMER)
            # the rows an item keeps for the backward (and the backward's dO rows) are copied
            # KEEP_COLS columns a step, as many bytes as a transport move's: 16 loads a thread
            # before the first store, where BLOCK_K columns were 4
            if not LIBRARY:
                expert_item(
                    kind, heap, w_up, w_down, weight_of, slots, dslots, group, hbuf, hbuf_rid, staging, staging_rid,
                    saved_x, saved_pre, saved_out, dh, act_rows, do_rows, dw_up, dw_down, b_up, b_down, db_up, db_down,
                    owner, segment, i, local, row0, lo, hi, BM, BLOCK_H, BLOCK_F, BLOCK_K, STAGES, CAST_F32, BACKWARD,
                    SAVE, True, KEEP_COLS, up_desc, down_desc, up_t, down_t, rows_desc, mid_desc,
                )  # fmt: skip
            if PROFILE:
                at = (item0 + item) * 2
                tl.store(profile + at, start)
                tl.store(profile + at + 1, now(ctl, GLOBALTIMER))
            if kind == KIND_GEMM1:
                signal(tile)
            signal(done_flag(heap, table, entry, BACKWARD))
        item += stride
        failed = tl.load(ctl + CTL_ERR_CODE, volatile=True)
    if tl.atomic_add(ctl + CTL_EXITS, 1) == target * n_programs - 1:
        tl.atomic_add(ctl + CTL_CALLS, 1)
