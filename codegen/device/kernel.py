"""The persistent kernel ``rdep_layer``: the task table's work items taken with a ticket,
waited for, run and signalled (the generated file's docstring tells the whole story); and
``owner_buffers``, the private buffers of the ranks a process holds, which ``rdep_gemm``
shares."""

import triton
import triton.language as tl
from rdepc.codegen.device.combine import combine, combine_grad
from rdepc.codegen.device.control import done_flag, now, report, stamp_skipped
from rdepc.codegen.device.dispatch import dispatch
from rdepc.codegen.device.expert_grads import expert_item
from rdepc.codegen.device.experts import m_tile_slot, ring_descriptors, weight_descriptors
from rdepc.codegen.device.layout import (
    C_CLAIM,
    C_DEP_COUNT,
    C_DEP_START,
    C_GUARD,
    C_ITEMS,
    C_KIND,
    C_OWNER,
    C_RANK,
    C_SEGMENT,
    C_SRC,
    CTL_CALLS,
    CTL_ERR_CODE,
    CTL_EXITS,
    CTL_TICKETS,
    DEDUP,
    E_MAX,
    ERR_WAIT,
    KIND_COMBINE,
    KIND_DISPATCH,
    KIND_GEMM1,
    KIND_GEMM2,
    KIND_LOAD,
    KIND_PUSH,
    KIND_RECEIVE,
    KIND_REROUTE,
    KIND_RETURN,
    KIND_ROUTE,
    KIND_SCAN,
    KIND_SOLVE,
    KIND_UNPACK,
    KIND_WGRAD,
    MOVE_COLS,
    NCOL,
    PER_RANK,
    PLAN_SLOTS_AT,
    R_MAX,
    RING,
    ROUTE_CHUNKS,
    ROUTE_SCRATCH,
    SEGMENTS,
    SLOT_ELEMS,
    ST_COLS,
    TILE_SLOTS,
    TMA,
    UP_COLS,
    B,
    F,
    H,
    K,
    S,
    T,
    W,
)
from rdepc.codegen.device.replicas import load_task, reroute_task, solve_task
from rdepc.codegen.device.returns import return_rows, unpack
from rdepc.codegen.device.route import route, scan
from rdepc.codegen.device.rows import bind_m_tiles, bound_m_tile, expert_spans, piece_rows
from rdepc.codegen.device.signals import SCOPE, signal, wait
from rdepc.codegen.device.slots import push_slot, receive_slot
from rdepc.codegen.device.waits import wait_deps, wait_done, whole_wait


@triton.jit
def owner_buffers(
    me, saved_x, saved_pre, saved_out, dh, act_rows, do_rows, group, hbuf, hbuf_rid, staging, staging_rid, tile_done,
    tile_table,
):  # fmt: skip
    """The owner-side private buffers moved back by ``me`` (rank0) ranks' rows: a process
    that runs one rank holds only that rank's rows, so indexing them by the global rank
    lands in them (with every rank in one process me is 0 and nothing moves)."""
    if DEDUP:  # saved_out: each accepted slot's expert output at the owner (else at the front-end)
        saved_out -= me * R_MAX * H
    saved_x -= me * R_MAX * H
    saved_pre -= me * R_MAX * (UP_COLS * F)
    dh -= me * R_MAX * (UP_COLS * F)
    act_rows -= me * R_MAX * F
    do_rows -= me * R_MAX * H
    group -= me * (E_MAX * 2)
    hbuf -= me * (B * S * F)
    hbuf_rid -= me * (B * S)
    staging -= me * (B * S * H)
    staging_rid -= me * (B * S)
    tile_done -= me * (SEGMENTS * TILE_SLOTS)
    tile_table -= me * (SEGMENTS * TILE_SLOTS * 4)
    return (
        saved_x, saved_pre, saved_out, dh, act_rows, do_rows, group, hbuf, hbuf_rid, staging, staging_rid, tile_done,
        tile_table,
    )  # fmt: skip


@triton.jit(noinline=True)
def take_empty_rest(ctl, first_item, profile, pos, item0, base, PROFILE: tl.constexpr, GLOBALTIMER: tl.constexpr):
    """At an empty m-tile slot of the entry at queue position ``pos``: the live slots are a
    prefix and an entry's items run m-tile major, so the entry's items no program has taken
    yet are empty too. Their tickets are taken at once (the counter moved to the entry's
    end; a call still takes its items' tickets and one past them per program) and counted
    done with this one: how many they are. A call of its own, not inlined: beside the
    unified kernel's GEMM loops its few values cost a spill there."""
    end = tl.load(first_item + pos + 1) - item0
    taken = tl.atomic_max(ctl + CTL_TICKETS, base + end) - base
    if PROFILE:
        stamp_skipped(ctl, profile, item0, taken, end, 1, GLOBALTIMER)
    return tl.maximum(end - taken, 0)


@triton.jit(noinline=True)
def take_empty_run(
    heap, table, deps, queue, queue_pos, first_item, recv, ctl, profile, pos, last_pos, item0, base, target,
    PROFILE: tl.constexpr, GLOBALTIMER: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    """The transport kernel, at a move (dispatch, return, unpack) of the entry at queue
    position ``pos`` that found no rows, its dependencies done: the items no program has
    taken yet of that entry and of the run of moves after it without rows either, counted
    done at once — their tickets taken in one step (the counter moved to the run's end: a
    call still takes its items' tickets and one past them per program). A move joins the
    run, 64 positions at a time, while its piece has no rows (``rows.piece_rows``) and its
    dependencies are done or are entries of the run: counting it done is then what running
    it would do. The first entry's rest counts toward its own signal (returned); the others
    are signalled here. A pipelined schedule plans each owner's segments for every row
    choosing it (dropless: ~W times what a uniform routing brings), so most moves past the
    last filled segment have no rows, and each would otherwise cost a ticket, a search, its
    waits and a signal."""
    lane = tl.arange(0, 64)
    dep_lane = tl.arange(0, 4)
    end = pos + 1
    going = end < last_pos
    while going:
        p = end + lane
        live = p < last_pos
        row = table + tl.load(queue + p, mask=live, other=0) * NCOL
        kind = tl.load(row + C_KIND, mask=live, other=-1)
        count = tl.load(row + C_DEP_COUNT, mask=live, other=0)
        move = (kind == KIND_DISPATCH) | (kind == KIND_RETURN) | (kind == KIND_UNPACK)
        ok = live & move & (count <= 4)
        has = ok[:, None] & (dep_lane[None, :] < count[:, None])
        dep = tl.load(deps + tl.load(row + C_DEP_START, mask=ok, other=0)[:, None] + dep_lane[None, :], mask=has)
        has = has & (dep >= 0)  # -(e + 1): entry e of the previous call, done
        dep = tl.where(has, dep, 0)
        at = tl.load(queue_pos + dep, mask=has, other=-1)
        polled = has & ((at < pos) | (at >= p[:, None]))  # the run's earlier entries count as done
        want = target * tl.load(table + dep * NCOL + C_ITEMS, mask=polled, other=0)
        seen = tl.atomic_add(done_flag(heap, table, dep, BACKWARD), 0, mask=polled, sem="acquire", scope=SCOPE)
        ok = ok & (tl.max((polled & (seen < want)).to(tl.int32), axis=1) == 0)
        tl.debug_barrier()  # every warp sees what the acquires made visible: the published spans
        src = tl.load(row + C_SRC, mask=ok, other=0)
        owner = tl.load(row + C_OWNER, mask=ok, other=0)
        segment = tl.load(row + C_SEGMENT, mask=ok, other=0)
        empty = ok & (piece_rows(heap, recv, kind == KIND_RETURN, src, owner, segment, ok) == 0)
        run = tl.min(tl.where(empty, 64, lane), axis=0)  # the first position that is not in the run
        end += run
        going = (run == 64) & (end < last_pos)
    hi = tl.load(first_item + end) - item0
    taken = tl.atomic_max(ctl + CTL_TICKETS, base + hi) - base  # the run's items from here are this program's
    if PROFILE:
        stamp_skipped(ctl, profile, item0, taken, hi, 1, GLOBALTIMER)
    at = pos + 1
    while at < end:
        p = at + lane
        live = p < end
        first = tl.maximum(tl.load(first_item + p, mask=live, other=0) - item0, taken)
        units = tl.minimum(tl.load(first_item + p + 1, mask=live, other=0) - item0, hi) - first
        live = live & (units > 0)
        entry = tl.load(queue + p, mask=live, other=0)
        tl.debug_barrier()
        tl.atomic_add(done_flag(heap, table, entry, BACKWARD), units, mask=live, sem="release", scope=SCOPE)
        at += 64
    return tl.maximum(tl.minimum(tl.load(first_item + pos + 1) - item0, hi) - taken, 0)


@triton.jit(
    do_not_specialize=["n_tokens", "n_programs", "rank0", "rid_c", "rid_r", "rid_t", "rid_k", "ex_stride", "bound"]
)
def rdep_layer(
    heap, x, topk_ids, gates, w_up, w_down, y, accepted, slot, gprime, dy, dx, dgprime, saved_x, saved_pre, saved_out,
    dh, act_rows, do_rows, dw_up, dw_down, b_up, b_down, db_up, db_down, slots, dslots, plan, home_ids, exchange, table,
    deps, queue, queue_pos, first_item, queues, owner_of, local_of, n_local, weight_of, order, owner_first, rows_max,
    caps, m_slots, rowpos, sorted_rows, route_scratch, recv, group, tile_table, hbuf, hbuf_rid, staging, staging_rid,
    tile_done, landing, stats, ctl, profile, tokens_of, n_tokens, n_programs, rank0, rid_c, rid_r, rid_t, rid_k,
    ex_stride, bound, BM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, STAGES: tl.constexpr, CAST_F32: tl.constexpr, GEMMS: tl.constexpr, PROFILE: tl.constexpr,
    GLOBALTIMER: tl.constexpr, BACKWARD: tl.constexpr, SAVE: tl.constexpr,
):  # fmt: skip
    """The persistent kernel: take a ticket from the queue, find the task-table entry, wait,
    run, signal. ``BACKWARD`` false: the forward; true: the backward, which walks the
    backward's table (the forward's entries, then the weight gradients) with its own
    control words, done counters and heap regions, over the routing tables the forward left
    (``sorted_rows``, ``route_scratch``, ``recv``, ``group`` and the heap's offsets): its
    route and scan entries only keep the table's order, nothing is routed again.

    Unified mode (``GEMMS``): the queue holds every entry (one process per rank: every entry
    its rank runs); any program runs any task. Split mode: this is the transport kernel,
    compiled without the GEMM tasks; its queue holds every other entry, and ``rdep_gemm``,
    launched beside it, runs the GEMM work. Phased mode: the same transport kernel, launched
    before ``rdep_gemm`` with the entries that wait for no GEMM and after it with the others.
    A launch's queue is the record its ``queues`` argument starts at. Tickets and done flags
    count up across calls: the call's ``epoch`` is the call count the control block holds,
    plus one; a launch's tickets of call ``epoch`` start at (epoch - 1) * (the tickets of the
    kernel's launches of a call) + (those its earlier launches take), an entry is done at
    epoch * its items. A wait
    that expires records the error (entry, rank, queue, segment, flag, value seen and
    expected) and every program stops at its next ticket. Compute items wait for their
    owner's scan first (their guard): an m-tile slot that the routing leaves empty skips
    its dispatch dependencies and finishes at once, with the rest of its entry's items no
    program has taken yet (the live slots are a prefix); in the transport kernel a move
    without rows, with the run of such moves after it (``take_empty_run``). An entry of
    kind < 0 is withheld (fault injection): it runs nothing and never signals.
    ``n_programs``: the programs of every kernel of the call, which all count out of it.
    """
    # Columns a step of a move that copies rows carries: the transport kernel's MOVE_COLS (more
    # rows in flight); the unified kernel's BLOCK_H, where wider steps cost its GEMM loops their
    # registers
    MOVE_H: tl.constexpr = BLOCK_H if GEMMS else MOVE_COLS
    # A process that runs one rank (rank0) holds only that rank's inputs and private buffers:
    # their bases move back by rank0 rows, so indexing them by the global rank lands in them.
    # With every rank in one process rank0 is 0 and nothing moves.
    me = tl.cast(rank0, tl.int64)
    x -= me * n_tokens * H
    y -= me * n_tokens * H
    dy -= me * n_tokens * H
    dx -= me * n_tokens * H
    topk_ids -= me * n_tokens * K
    home_ids -= me * n_tokens * K
    gates -= me * n_tokens * K
    accepted -= me * n_tokens * K
    slot -= me * n_tokens * K
    gprime -= me * n_tokens * K
    dgprime -= me * n_tokens * K
    tokens_of -= me  # the tokens each rank brings, <= n_tokens (the rows past them route nowhere)
    if not DEDUP:  # saved_out: each accepted slot's expert output at the front-end
        saved_out -= me * n_tokens * K * H
    (
        saved_x, saved_pre, saved_out, dh, act_rows, do_rows, group, hbuf, hbuf_rid, staging, staging_rid, tile_done,
        tile_table,
    ) = owner_buffers(
        me, saved_x, saved_pre, saved_out, dh, act_rows, do_rows, group, hbuf, hbuf_rid, staging, staging_rid,
        tile_done, tile_table,
    )  # fmt: skip
    stats -= me * ST_COLS
    rowpos -= me * (T * K)
    sorted_rows -= me * (T * K)
    route_scratch -= me * ROUTE_SCRATCH
    recv -= me * (W * E_MAX * 2)
    if RING:
        landing -= me * (T * K * H)
    sent = x  # the rows the dispatch sends
    if BACKWARD:  # dL/dy goes where x went, scaled by g' (GATE_INPUT: as it is)
        sent = dy
        gates = gprime
    up_desc = None  # the experts' weights through descriptors built once (else each tile builds its own)
    down_desc = None
    up_t = None
    down_t = None
    if GEMMS and TMA and SLOT_ELEMS == 0:
        up_desc, down_desc, up_t, down_t = weight_descriptors(w_up, w_down, BLOCK_H, BLOCK_F, BLOCK_K)
    rows_desc = None  # the rows the tiles read, likewise (one process per rank: one owner's)
    mid_desc = None
    if GEMMS and TMA and PER_RANK:
        rows_desc, mid_desc = ring_descriptors(heap, hbuf, dh, me, BM, BLOCK_K, BACKWARD)
    epoch = tl.load(ctl + CTL_CALLS, volatile=True) + 1  # this call: the launches before it closed theirs
    target = epoch
    f_blocks = (F + BLOCK_F - 1) // BLOCK_F  # work items per m-tile: GEMM1's F-blocks
    first_pos = tl.load(queues)  # this launch's queue record (rdepc.ir.contract.queue_records)
    last_pos = tl.load(queues + 1)
    item0 = tl.load(first_item + first_pos)
    n_items = tl.load(first_item + last_pos) - item0
    base = (target - 1) * tl.load(queues + 4) + tl.load(queues + 3)  # the call's tickets, this launch's first
    ticket = tl.atomic_add(ctl + CTL_TICKETS, 1) - base
    failed = tl.load(ctl + CTL_ERR_CODE, volatile=True)
    while (ticket < n_items) & (failed == 0):
        lo = first_pos  # the queue position of this item: the last one whose first item <= ticket
        hi = last_pos
        while hi - lo > 1:
            mid = (lo + hi) // 2
            below = tl.load(first_item + mid) - item0 <= ticket
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        entry = tl.load(queue + lo)
        item = (ticket - (tl.load(first_item + lo) - item0)).to(tl.int32)
        row = table + entry * NCOL
        kind = tl.load(row + C_KIND)
        rank = tl.load(row + C_RANK)
        src = tl.load(row + C_SRC)
        owner = tl.load(row + C_OWNER)
        segment = tl.load(row + C_SEGMENT)
        claim = tl.load(row + C_CLAIM)
        items = tl.load(row + C_ITEMS)
        blocked = -1
        seen = target * 0
        expected = target * 0
        guard = tl.load(row + C_GUARD)
        if guard >= 0:  # GEMM items: their owner's scan first
            got, want = wait_done(heap, table, guard, target, bound, ctl + CTL_ERR_CODE, BACKWARD)
            if got < want:
                blocked = guard
                seen = got
                expected = want
        empty = 0
        mt = m_tile_slot(kind, item, BLOCK_H, BLOCK_F)  # a GEMM item's m-tile slot
        tile = tile_done + (owner * SEGMENTS + segment) * TILE_SLOTS + mt  # its GEMM1 items done, over calls
        local = 0
        row0 = 0
        lo_row = 0
        hi_row = 0
        if (guard >= 0) & (blocked < 0):
            local, row0, lo_row, hi_row = bound_m_tile(tile_table, owner, segment, mt)
            empty = (hi_row <= lo_row).to(tl.int32)
        if (empty == 0) & (blocked < 0):
            whole = whole_wait(weight_of, kind, owner, local)
            blocked, seen, expected = wait_deps(
                heap, table, deps, row, kind, target, tile, f_blocks, bound, ctl + CTL_ERR_CODE, whole, BACKWARD
            )
        if (kind == KIND_ROUTE) & (item >= ROUTE_CHUNKS) & (blocked < 0):
            # a bucketing item: every chunk counted (the items before it, by ticket), and the
            # first bucketing item's bases
            want = (target - 1) * items + ROUTE_CHUNKS + (item > ROUTE_CHUNKS).to(tl.int32)
            got = wait(done_flag(heap, table, entry, BACKWARD), want, bound, ctl + CTL_ERR_CODE)
            if got < want:
                blocked = entry
                seen = got
                expected = want
        if blocked >= 0:
            report(ctl, ERR_WAIT, entry, blocked, rank, epoch, 0, segment, seen, expected)
        elif kind >= 0:
            if PROFILE:
                start = now(ctl, GLOBALTIMER)
            if empty == 0:
                if kind == KIND_ROUTE:
                    if not BACKWARD:
                        route(
                            heap, topk_ids, gates, order, owner_of, local_of, owner_first, rowpos, sorted_rows,
                            route_scratch, stats, ctl, rank, n_tokens, tl.load(tokens_of + rank), item,
                        )  # fmt: skip
                elif kind == KIND_SCAN:
                    if BACKWARD:  # the m-tile table again, from the rows the forward left
                        first, rows = expert_spans(group, rank)
                        bind_m_tiles(
                            first, rows, tile_table, tile_done, rank, tl.load(m_slots + rank), epoch, f_blocks, BM
                        )
                    else:
                        scan(
                            heap, n_local, rows_max, caps, recv, group, tile_table, tile_done, m_slots, stats, ctl,
                            entry, epoch, rank, f_blocks, BM,
                        )  # fmt: skip
                elif kind == KIND_DISPATCH:
                    moved = dispatch(
                        heap, sent, x, gates, order, owner_first, n_local, sorted_rows, route_scratch, topk_ids,
                        owner_of, local_of, rowpos, stats,
                        src, owner, segment, item, items, n_tokens, rid_c, rid_r, rid_t, rid_k, BLOCK_R, BLOCK_H,
                        MOVE_H, CAST_F32, BACKWARD,
                    )  # fmt: skip
                    if not GEMMS:  # the transport kernel: a run of moves without rows at once
                        empty = (moved == 0).to(tl.int32)
                elif (kind == KIND_GEMM1) | (kind == KIND_GEMM2) | (kind == KIND_WGRAD):
                    if GEMMS:  # split mode: rdep_gemm runs them
                        # rows copied BLOCK_K columns a step: wider, the backward's GEMM loops and
                        # stack lost registers (rdep_gemm copies KEEP_COLS)
                        expert_item(
                            kind, heap, w_up, w_down, weight_of, slots, dslots, group, hbuf, hbuf_rid, staging,
                            staging_rid, saved_x, saved_pre, saved_out, dh, act_rows, do_rows, dw_up, dw_down, b_up,
                            b_down, db_up, db_down, owner, segment, item, local, row0, lo_row, hi_row, BM, BLOCK_H,
                            BLOCK_F, BLOCK_K, STAGES, CAST_F32, BACKWARD, SAVE, False, BLOCK_K, up_desc, down_desc,
                            up_t, down_t, rows_desc, mid_desc,
                        )  # fmt: skip
                elif kind == KIND_RETURN:
                    moved = return_rows(
                        heap, recv, staging, staging_rid, saved_out, stats, ctl, entry, epoch, owner, src, segment,
                        claim, item, items, rid_c, rid_r, rid_t, rid_k, BLOCK_R, BLOCK_H, MOVE_H, CAST_F32,
                        BACKWARD,
                    )  # fmt: skip
                    if not GEMMS:
                        empty = (moved == 0).to(tl.int32)
                elif kind == KIND_COMBINE:
                    if BACKWARD:
                        combine_grad(
                            heap, landing, x, dy, dx, accepted, saved_out, topk_ids, owner_of, slot, gprime,
                            dgprime, rank, claim, n_tokens, CAST_F32,
                        )  # fmt: skip
                    else:
                        combine(
                            heap, landing, topk_ids, gates, y, accepted, slot, gprime, owner_of, local_of,
                            rowpos, saved_out, rank, claim, n_tokens, CAST_F32, SAVE,
                        )  # fmt: skip
                # KIND_COMBINE_WAIT has no work: it only joins the returns into its rank.
                if RING:  # noqa: SIM102 - RING is folded at compile time, the kind tested at run time
                    if kind == KIND_UNPACK:
                        moved = unpack(
                            heap, landing, ctl, entry, epoch, rank, owner, segment, claim, item, items, rid_c, rid_r,
                            rid_t, rid_k, BLOCK_R, BLOCK_H, MOVE_H, CAST_F32, BACKWARD,
                        )  # fmt: skip
                        if not GEMMS:
                            empty = (moved == 0).to(tl.int32)
                # the call's balance plan and the slots' weights, one process per rank (with every
                # rank in one, the plan is launched before the layer and the slots gathered from
                # it); in the backward these tasks run nothing
                if (SLOT_ELEMS > 0) and (not BACKWARD):  # folded at compile time
                    if kind == KIND_LOAD:
                        load_task(exchange, ex_stride, home_ids, n_tokens, rank)
                    elif kind == KIND_SOLVE:
                        solve_task(exchange, ex_stride, plan, owner_of, rank)
                    elif kind == KIND_REROUTE:
                        reroute_task(home_ids, topk_ids, plan, n_tokens, rank)
                    elif kind == KIND_PUSH:
                        push_slot(
                            exchange, ex_stride, plan + PLAN_SLOTS_AT, order, owner_first, w_up, w_down, b_up, b_down,
                            rank, item,
                        )  # fmt: skip
                    elif kind == KIND_RECEIVE:
                        receive_slot(exchange, ex_stride, slots, rank, item)
            if PROFILE:
                at = (tl.load(first_item + lo) + item) * 2
                tl.store(profile + at, start)
                tl.store(profile + at + 1, now(ctl, GLOBALTIMER))
            units = target * 0 + 1
            if empty != 0:  # an empty m-tile slot, or (the transport kernel) a move without rows
                if GEMMS:  # the unified kernel: the entry's rest only (a run's call there costs its GEMM loops)
                    units += take_empty_rest(ctl, first_item, profile, lo, item0, base, PROFILE, GLOBALTIMER)
                else:
                    units += take_empty_run(
                        heap, table, deps, queue, queue_pos, first_item, recv, ctl, profile, lo, last_pos, item0,
                        base, target, PROFILE, GLOBALTIMER, BACKWARD,
                    )  # fmt: skip
            elif kind == KIND_GEMM1:  # the scan sets an empty slot's counter (rows.bind_m_tiles)
                signal(tile)
            signal(done_flag(heap, table, entry, BACKWARD), units)
        ticket = tl.atomic_add(ctl + CTL_TICKETS, 1) - base
        failed = tl.load(ctl + CTL_ERR_CODE, volatile=True)
    # The last of the call's n_programs programs out closes the call: the next launch reads
    # its epoch from the count, so no argument changes from call to call.
    if tl.atomic_add(ctl + CTL_EXITS, 1) == target * n_programs - 1:
        tl.atomic_add(ctl + CTL_CALLS, 1)
