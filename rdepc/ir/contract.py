"""The kernel contract: everything a generated kernel and its host side agree on.

:class:`KernelContract` is plain data — ints, strings and tuples, written to JSON beside
the generated kernels — produced by the lowering pass (``rdepc.codegen.lower``) and read by
the code generator and the runtime alike: the layer's sizes, the symmetric-heap layout of
the memory plan, the ownership tables, the capacity rule, the task table, and the
encodings both sides share (the control block, error codes; the task kinds, table columns
and kernel modes are ``rdepc.ir.queues``', named here too). It lives with the IR so that
the runtime never imports the code generator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from fractions import Fraction

from rdepc.diagnostics import layer_prefix
from rdepc.ir.balance import slot_chunks, slot_elems
from rdepc.ir.queues import COLUMNS as COLUMNS
from rdepc.ir.queues import GEMM_KINDS as GEMM_KINDS
from rdepc.ir.queues import INTERPRETED_MODE as INTERPRETED_MODE
from rdepc.ir.queues import KINDS as KINDS
from rdepc.ir.queues import MODES as MODES
from rdepc.ir.queues import NATIVE_MODE as NATIVE_MODE
from rdepc.ir.queues import QUEUE_WORDS as QUEUE_WORDS
from rdepc.ir.queues import Row as Row
from rdepc.ir.queues import Work as Work
from rdepc.ir.queues import concurrent as concurrent
from rdepc.ir.queues import default_mode as default_mode
from rdepc.ir.queues import mode_kernels as mode_kernels
from rdepc.ir.queues import phase_queues as phase_queues
from rdepc.ir.queues import queue_records as queue_records
from rdepc.ir.sizes import BM as COMBINE_TOKENS
from rdepc.ir.sizes import SCALE_BLOCK, cap_e, m_tile_slots, next_pow2, route_chunks
from rdepc.ir.spec import Dtype, is_gated

# Transports (backends) and how their ranks are held: all in one process, or one process per rank.
TRANSPORT_PROCESSES = {"emulated": "one", "emulated-mp": "per-rank", "nvshmem": "per-rank"}
# Error codes a program writes into the control block before it stops.
ERRORS = {1: "wait expired", 2: "owner overflow", 3: "row_id decodes to another rank"}
# The private control block (int64): a logical clock, the error record, the input checks'
# counters, the call count, then (at CTL_TICKETS) the ticket counter of the kernel that takes
# tickets, which its launches of a call share (queue_records). The done
# flags are symmetric: each rank's in its own heap slice (``flags``), where peers read them.
CONTROL = ("clock", "err_code", "err_entry", "err_dep", "err_rank", "err_epoch", "err_resource", "err_segment")
CONTROL += ("err_seen", "err_expected")
# Input checks (validate): offending route rows per kind, each followed by the first one's key.
CONTROL += ("bad_ids", "bad_ids_at", "bad_gates", "bad_gates_at", "dup_tokens", "dup_tokens_at")
# The call count on the device: a launch's epoch is ``calls`` + 1, and its last program out
# (``exits``) closes the call, so that a launch carries no per-call argument and a captured
# CUDA graph replays correctly.
CONTROL += ("calls", "exits")
# Split mode: the GEMM kernel's programs that have started, over calls (a wait that expires
# says whether the two kernels ran at once).
CONTROL += ("gemm_programs",)
CTL_TICKETS = 20
assert len(CONTROL) <= CTL_TICKETS
INT32_MAX = 2**31 - 1
ROLE_INDEX = {"comm": 0, "compute": 1}
# Native launch defaults, shared by RDEPModule and the sm_90 compile (which stands in for a
# launch it cannot make): spins a wait may take before the call fails, and the SMs (one
# program each) of the GPU a compile without one assumes, an H100 SXM.
NATIVE_SPIN_BOUND = 1 << 26
H100_SMS = 132


def ctl_words(W: int) -> int:
    """Words of the private control block: CONTROL's words, then the ticket counter of the
    kernel that takes tickets (unified mode's, or split mode's transport kernel's)."""
    return CTL_TICKETS + 1


def tile_slots(rows_max, n_local, S: int, bm: int = 16) -> int:
    """m-tile slots of the busiest (owner, segment) at ``bm`` rows per m-tile (default: the
    smallest legal one, so that ``tile_done`` fits every choice of tiles)."""
    return max(m_tile_slots(rows_max, n_local, S, bm), default=0)


SHARED_BYTES = 227 * 1024  # shared memory one block may use on an H100 / H200
ACC_REGISTERS = 128  # of the 255 registers a thread may have: a GEMM tile's fp32 accumulator, no more


@dataclass(frozen=True, slots=True)
class Tiles:
    """Tile sizes of the generated kernel (constexprs at launch; not part of the source).

    ``bm`` rows per m-tile of the grouped GEMMs; ``block_f`` the F columns of one GEMM1 tile
    (a gated expert's gate and up make its operand 2·block_f wide); ``block_h`` the H
    columns of one GEMM2 tile, and of one row chunk of the unified kernel's moves (dispatch,
    return, unpack; the transport kernel's: ``move_cols``);
    ``block_k`` the reduction chunk of both GEMMs (GEMM1 over H, GEMM2 over F);
    ``block_r`` rows per dispatch/return block; ``rows_per_item`` rows one dispatch or
    return work item moves at most (more rows: more items, striding); ``num_warps`` and
    ``num_stages`` (software-pipelined operand loads of the GEMM loops) for native launches."""

    bm: int = 64
    block_h: int = 64
    block_f: int = 128
    block_r: int = 64
    rows_per_item: int = 1 << 30
    num_warps: int = 4
    block_k: int = 64
    num_stages: int = 2

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"tile size {f.name} must be a positive int, got {v!r}")
        for name in ("bm", "block_h", "block_f", "block_r", "block_k"):
            v = getattr(self, name)
            if v & (v - 1) or v < 16:
                raise ValueError(f"tile size {name} must be a power of two >= 16, got {v}")

    def constexprs(self) -> dict[str, int]:
        """The kernel's tile constexprs (``rdepc.ir.arguments.ARGUMENTS``) these sizes set."""
        return {
            "BM": self.bm,
            "BLOCK_H": self.block_h,
            "BLOCK_F": self.block_f,
            "BLOCK_K": self.block_k,
            "BLOCK_R": self.block_r,
            "STAGES": self.num_stages,
        }

    def gemm_tiles(self, contract: KernelContract, backward: bool = False) -> tuple[tuple[int, int, int], ...]:
        """(rows, columns, bytes of a row operand's element) of each GEMM tile a pass
        computes, every one summed over ``block_k`` chunks: GEMM1's [bm, up·block_f] (a gated
        expert's gate and up: up = 2; its rows in the dispatch dtype) and GEMM2's [bm,
        block_h]; the backward's also the weight gradients' [block_h, up·block_f] and
        [block_f, block_h], summed over the expert's rows."""
        up, a, d = 2 if contract.gated else 1, Dtype(contract.dtype).bytes, Dtype(contract.dispatch).bytes
        out = ((self.bm, up * self.block_f, d), (self.bm, self.block_h, a))
        return (*out, (self.block_h, up * self.block_f, a), (self.block_f, self.block_h, a)) if backward else out

    def shared_bytes(self, contract: KernelContract, backward: bool = False) -> int:
        """Shared memory a pass's pipelined GEMM loops need: ``num_stages`` copies of one
        [rows, block_k] and one [block_k, columns] chunk of its largest tile."""
        a = Dtype(contract.dtype).bytes
        return self.num_stages * max(self.block_k * (m * e + n * a) for m, n, e in self.gemm_tiles(contract, backward))

    def accumulator_registers(self, contract: KernelContract, backward: bool = False) -> int:
        """Registers a thread holds its share of a pass's largest fp32 accumulator in."""
        return max(m * n for m, n, _ in self.gemm_tiles(contract, backward)) // (32 * self.num_warps)

    def fits(self, contract: KernelContract, backward: bool = False) -> bool:
        """Whether a pass's GEMM tiles fit a GPU block (an H100's or H200's 227 KiB of shared
        memory, with an eighth left for the rest of the kernel) without spilling their
        accumulators (at most ``ACC_REGISTERS`` a thread)."""
        shared = self.shared_bytes(contract, backward) <= SHARED_BYTES * 7 // 8
        return shared and self.accumulator_registers(contract, backward) <= ACC_REGISTERS

    def for_backward(self, contract: KernelContract) -> Tiles:
        """The tiles a native backward launches with: these, narrowed until its GEMM tiles fit
        too (:meth:`fits`). The weight gradient's [block_h, up·block_f] tile is the largest:
        block_f is halved first (block_h also sets the column blocks the gates' gradient is
        summed over: narrowing it would change that sum's rounding), then block_h, then
        stages dropped. ``rdepc tune`` times the forward, whose best GEMM2 tile (256 wide)
        would make that tile 256 × 256."""
        t = self
        while not t.fits(contract, backward=True):
            if t.block_f > 16:
                t = replace(t, block_f=t.block_f // 2)
            elif t.block_h > 16:
                t = replace(t, block_h=t.block_h // 2)
            elif t.num_stages > 1:
                t = replace(t, num_stages=t.num_stages - 1)
            else:
                return t  # nothing left to narrow: the launch reports what does not fit
        return t

    @staticmethod
    def default(H: int, F: int, dtype: str, interpret: bool) -> Tiles:
        """Interpreter: few, large tiles (it costs ~0.4 ms per program and 1–3 ms per tl.dot,
        almost independent of the tile's size). Native: tiles whose operands fit an H100's
        shared memory with room for software pipelining."""
        if interpret:
            h, f = min(128, next_pow2(H, 16)), min(128, next_pow2(F, 16))
            return Tiles(64, h, f, 64, 1 << 30, 4, max(h, f), 1)
        if dtype == "fp32":
            return Tiles(64, 64, 64, 64, 4096, 4, 32, 2)
        return Tiles(128, 128, 128, 64, 4096, 8, 64, 3)


@dataclass(frozen=True)
class KernelContract:
    """Everything the generated kernel and its host side need, as plain data."""

    layer: str
    file: str
    rdepc: str
    strategy: str
    decisions: tuple[str, ...]
    transport: str  # the backend the kernels were generated for
    spec_transport: str  # the spec's transport statement (the eventual target)
    # sizes (T at its bound)
    W: int
    T: int
    H: int
    F: int
    E: int
    K: int
    E_MAX: int
    S: int  # rows of one ring slot (bulk: max_q R_q)
    B: int  # ring slots (bulk: 1)
    ring: bool  # returns land in a ring of B slots at the front-end and are unpacked
    unified: bool  # the schedule gives every program every task (bulk): one queue per rank
    act: str
    # clamped_swiglu's limit and alpha (ExpertFn); 0 for the other activations
    act_limit: float
    act_alpha: float
    bias: bool  # expert biases: b_up (GEMM1's, laid out as its columns) and b_down (GEMM2's)
    recompute: bool  # the backward computes GEMM1's pre-activations again from the kept input rows
    gate_input: bool  # the gate scales the expert's input (dispatch sends g'·x, the combine adds unweighted)
    resend: bool  # the backward's dispatch sends the input rows again: the owners keep none from the forward
    bwd_fp8: bool  # the backward's rows (g'·dL/dy out, dL/dx back) go as fp8 e4m3, a scale per 128 columns
    dtype: str  # compute dtype: weights, activations, returned rows
    dispatch: str  # payload dtype on the wire
    dispatch_scale: str | None  # fp8 dispatch: "row" or "block" (per SCALE_BLOCK columns); else None
    scales: int  # fp32 scales per payload row (fp8 dispatch)
    sideband: tuple[str, ...]
    symbolic_tokens: bool  # row ids and capacity use the call's T' (param T <= bound)
    # the route-row identity id = c + a_rank·rank + a_token·token + a_slot·slot: (c, a_rank,
    # a_token, a_slot), one per T' = 0..T when T is symbolic; and the variables whose extent
    # can exceed 1 by descending coefficient (decoding reads them in this order)
    row_id: tuple[tuple[int, int, int, int], ...]
    row_id_order: tuple[str, ...]
    # owners admit by key (``drop round_robin`` or ``lowest_gate``, or arrival when ascending
    # row_id is not rank, then token, then slot order): each source publishes its rows' keys
    keyed: bool
    dedup: bool  # one payload row per (token, owner), summed back at the owner
    # capacity: policy, factor (p, q), rows (int, or one per T' when T is symbolic), weights (drop: arrival)
    capacity: str
    cap_factor: tuple[int, int] | None
    cap_rows: int | tuple[int, ...] | None
    weights: str
    drop: str  # round_robin | arrival | lowest_gate
    # ownership tables
    owner: tuple[int, ...]  # π(e)
    local: tuple[int, ...]  # λ(e)
    n_local: tuple[int, ...]  # E_loc(q)
    weight_of: tuple[int, ...]  # [W, E_MAX]: expert weight index of (q, λ) (emulated: e)
    order: tuple[int, ...]  # experts sorted by (owner, local)
    owner_first: tuple[int, ...]  # [W + 1]: position in ``order`` of q's first expert
    rows_max: tuple[int, ...]  # R_q: rows owner q may admit (the plan's bound)
    from_one: tuple[int, ...]  # rows one source may send owner q (distinct top-K, capacity)
    # the symmetric heap (one rank's slice) and the private buffers
    heap_bytes: int
    # the forward's part of a slice: its regions come first, so it is the prefix [0, forward_bytes)
    # and the backward's regions the rest (a module built for inference allocates only it)
    forward_bytes: int
    heap: tuple[tuple[str, int], ...]  # name → byte offset
    layout: tuple[tuple[str, str, int, int], ...]  # the heap's buffers: (name, region, offset, size)
    private: tuple[tuple[str, str, tuple[int, ...]], ...]  # per-rank private buffers: (name, dtype, shape)
    # the task table: the scheduler's entries in its global order (``items`` filled by work())
    table: tuple[Row, ...]
    deps: tuple[int, ...]  # dependency entries; -(d + 1): entry d of the previous call
    names: tuple[str, ...]  # task names, for error messages and profiles
    tasks: tuple[int, ...]  # the graph's task id of each entry
    # the backward's own entries, after the forward's (``bwd_table``): one weight-gradient
    # entry per owner, its dependencies numbered after the forward's (``bwd_deps``)
    wgrad_table: tuple[Row, ...] = ()
    wgrad_deps: tuple[int, ...] = ()
    programs: tuple[int, int] = (1, 1)  # split mode's (transport, GEMM) kernel programs per rank (the schedule's)
    guard: int = 0  # bytes of guard band before each heap buffer and after the last (tests)
    combine_tokens: int = COMBINE_TOKENS
    options: tuple[tuple[str, str], ...] = ()  # the codegen options it was generated with
    # balance replicate: (N slots a rank, U least rows a replica); E counts the slots as experts
    balance: tuple[int, int] = (0, 0)
    # the expert GEMMs' lowering on a GPU (rdepc.ir.lowering): the compiler's choice, and why
    gemm: str = "triton"
    gemm_why: str = ""

    @property
    def per_rank(self) -> bool:
        """One process per rank (each runs its rank's entries), not all ranks in one."""
        return TRANSPORT_PROCESSES[self.transport] == "per-rank"

    @property
    def homes(self) -> int:
        """The experts the router picks from: E less the W·N redundant slots (``rdepc.passes.replicate``)."""
        return self.E - self.W * self.balance[0]

    @property
    def slots_in_place(self) -> int:
        """The redundant slots a rank's kernels take as an operand of their own (one process
        per rank with ``balance replicate``: N), else 0."""
        return self.balance[0] if self.per_rank else 0

    @property
    def slot_elems(self) -> int:
        """Elements of one redundant slot the kernels read in place (``slots_in_place``:
        ``rdepc.ir.balance.slot_parts``), else 0."""
        return slot_elems(3 if self.gated else 2, self.H, self.F, self.bias) if self.slots_in_place else 0

    @property
    def slot_chunks(self) -> int:
        """Work items one slot takes in the push and receive tasks (``balance replicate``;
        the same in every transport, where one process holds every rank they move nothing)."""
        return slot_chunks(slot_elems(3 if self.gated else 2, self.H, self.F, self.bias))

    @property
    def backward_reads_x(self) -> bool:
        """The backward kernel reads the forward's input x: the gate gradient when the gate
        scales the expert's input, or the input rows sent again (``activations input resend``)."""
        return self.gate_input or self.resend

    @property
    def n_entries(self) -> int:
        return len(self.table)

    @property
    def bwd_table(self) -> tuple[Row, ...]:
        """The backward's task table: the forward's entries (same order, dependencies and done
        counters, counted in the backward's own words), then the weight gradients."""
        return self.table + self.wgrad_table

    @property
    def bwd_deps(self) -> tuple[int, ...]:
        return self.deps + self.wgrad_deps

    @property
    def bwd_names(self) -> tuple[str, ...]:
        return self.names + tuple(f"wgrad r{row.owner}" for row in self.wgrad_table)

    @property
    def R_MAX(self) -> int:
        """Rows of the busiest owner: the rows the backward's saved activations hold per owner."""
        return max(self.rows_max, default=0)

    def work(self, tiles: Tiles, mode: str = "unified", rank: int | None = None, backward: bool = False) -> Work:
        """The work items of every entry under ``tiles``, queued for ``mode`` (see the module
        docstring): unified, one queue of every entry; split, the transport kernel's queue
        (every entry but the GEMM ones) and the GEMM kernel's; phased, the transport's entries
        that wait for no GEMM (:func:`phase_queues`), the GEMM kernel's, then the transport's
        others. ``rank``: only that rank's entries (a transport with one process per rank).
        ``backward``: of the backward's table."""
        if mode not in MODES:
            raise ValueError(f"unknown kernel mode '{mode}' (known: {', '.join(MODES)})")
        if rank is not None and not 0 <= rank < self.W:
            raise ValueError(f"rank {rank} out of range [0, {self.W})")
        m_slots = m_tile_slots(self.rows_max, self.n_local, self.S, tiles.bm)  # the kernel's m_tile rule

        def split(rows: int) -> int:
            return max(1, min(-(-rows // tiles.rows_per_item), -(-rows // tiles.block_r)))

        table = []
        h_blocks, f_blocks = -(-self.H // tiles.block_h), -(-self.F // tiles.block_f)
        for row in self.bwd_table if backward else self.table:
            kind, owner = KINDS[row.kind], row.owner
            items = 1
            if kind == "route" and not backward:  # each chunk counted, then bucketed (the backward routes nothing)
                items = 2 * route_chunks(self.T)
            elif kind in ("dispatch", "return", "unpack"):
                items = split(min(self.S, self.from_one[owner]))
            elif kind == "gemm1":
                items = m_slots[owner] * -(-self.F // tiles.block_f)
            elif kind == "gemm2":
                items = m_slots[owner] * h_blocks
            elif kind == "push":  # every chunk of the rank's home experts: read once, stored to each replica
                items = (self.n_local[row.rank] - self.balance[0]) * self.slot_chunks
            elif kind == "receive":
                items = self.balance[0] * self.slot_chunks
            elif kind == "wgrad":  # per local expert: dW of GEMM1's weights, then of Wd, in tiles
                items = self.n_local[owner] * 2 * h_blocks * f_blocks
            table.append(row._replace(items=items))
        mine = [i for i, row in enumerate(table) if rank is None or row.rank == rank]
        if mode == "unified":
            queues = [mine]
        elif mode == "split":
            queues = [[i for i in mine if table[i].kind not in GEMM_KINDS]]
            queues.append([i for i in mine if table[i].kind in GEMM_KINDS])
        else:
            names, deps = (self.bwd_names, self.bwd_deps) if backward else (self.names, self.deps)
            queues = phase_queues(self.layer, names, table, deps, mine)
        queue = tuple(i for q in queues for i in q)
        first, bounds = [0], []
        for q in queues:
            bounds.append((len(first) - 1, len(first) - 1 + len(q)))
            for i in q:
                first.append(first[-1] + table[i].items)
        return Work(mode, tuple(table), queue, tuple(first), tuple(bounds), m_slots)

    @property
    def key_bits(self) -> int:
        """Bits an admission key needs: a dense row index is below W·T·K; a gate-ordered
        key spans 63."""
        return 63 if self.drop == "lowest_gate" else max(1, (self.W * self.T * self.K - 1).bit_length())

    @property
    def keys_in_row_order(self) -> bool:
        """Whether a source's admission keys ascend with its route rows t*K + k (token, then
        slot): then a row's place in its run is a running count, not a comparison of keys."""
        if self.drop == "round_robin":
            return True
        if self.drop == "lowest_gate":
            return False
        order = [v for v in self.row_id_order if v in ("token", "slot")]
        return order != ["slot", "token"]

    @property
    def gated(self) -> bool:
        return is_gated(self.act)

    @property
    def scale_cols(self) -> int:
        """Payload columns one fp8 scale covers (0 without fp8 dispatch)."""
        return {"row": self.H, "block": SCALE_BLOCK}.get(self.dispatch_scale, 0)

    def offset(self, name: str) -> int:
        return dict(self.heap)[name]

    def cap_at(self, T: int) -> int | None:
        """cap_e for a call with T' = ``T`` tokens per rank (None: dropless): the spec's
        capacity rule (``rdepc.ir.sizes.cap_e``) at the call's T', as
        rdepc.reference.capacity_for; symbolic row tables are read at T'."""
        rows = self.cap_rows[T] if isinstance(self.cap_rows, tuple) else self.cap_rows
        factor = None if self.cap_factor is None else Fraction(*self.cap_factor)
        return cap_e(self.capacity, self.W, T, self.K, self.E, factor, rows)

    def caps(self) -> tuple[int, ...]:
        """cap_e for every total n = Σ_r T'_r of tokens the W ranks bring to a call, n in
        [0, W·T]: the scan reads it at the owner, which learns n from the ``tokens`` words
        every front-end published. A factor's mean is over the n tokens, μ = n·K/E (with
        equal T' this is :meth:`cap_at`, T' = n / W); row tables are read at ⌈n / W⌉.
        Dropless: INT32_MAX."""
        out = []
        for n in range(self.W * self.T + 1):
            if self.capacity == "factor":
                cap = cap_e("factor", 1, n, self.K, self.E, Fraction(*self.cap_factor))
            else:
                cap = self.cap_at(-(-n // self.W))
            out.append(INT32_MAX if cap is None else cap)
        return tuple(out)

    def row_id_radix(self, T: int) -> tuple[int, int, int, int]:
        """(c, a_rank, a_token, a_slot) of the route-row identity at a call with T' tokens:
        the spec's T, or T' when the spec's T is symbolic."""
        return self.row_id[min(T, self.T) if self.symbolic_tokens else 0]

    def launch_grid(self, work: Work, programs: int, comm: int | None = None) -> tuple[int, tuple[int, ...]]:
        """(the programs of the call, programs per queue) of a launch of ``work`` given a
        budget of ``programs`` that run at once (natively one per SM of the GPU's share this
        process has). Unified: the budget capped by the work items, one queue. Split: the
        transport kernel ``comm`` programs (default: the budget in the ratio of the
        schedule's communication and compute programs), the GEMM kernel the rest, each
        capped by its items; both kernels' programs must run at once (their queues wait
        on each other), so a split that does not fit the budget is a ValueError."""
        if work.mode == "unified":
            programs = max(1, min(programs, work.n_items))
            return programs, (programs,)
        items = [work.first_item[hi] - work.first_item[lo] for lo, hi in work.bounds]
        if work.mode == "phased":  # one launch after another: each has the whole budget
            if comm is not None:
                raise ValueError(
                    f"{layer_prefix(self.layer)}: phased mode launches the transport and the GEMM kernel one after "
                    "another, each with every program: it takes no transport-program count"
                )
            per_queue = tuple(max(1, min(programs, n)) for n in items)
            return sum(per_queue), per_queue
        if comm is None:
            c, g = self.programs
            comm = min(programs - 1, max(1, round(programs * c / (c + g))))
        if comm < 1 or comm > programs - 1:
            raise ValueError(
                f"{layer_prefix(self.layer)}: split mode runs the transport and the GEMM kernel at once, at least "
                f"one program each, within {programs} programs: {comm} transport programs leave "
                f"{programs - comm} for the GEMMs"
            )
        per_queue = (max(1, min(comm, items[0])), max(1, min(programs - comm, items[1])))
        return sum(per_queue), per_queue

    def launch_scalars(
        self, n_tokens: int, n_programs: int, rank: int | None, bound: int, per_rank: bool = False
    ) -> dict[str, int]:
        """``rdep_layer``'s scalar arguments (``rdepc.ir.arguments.kernel_args``) of a launch: ``n_tokens``
        the call's T', ``n_programs`` the grid, ``rank`` this process's rank (None: all of
        them, in one process), ``bound`` the spin bound. Row ids decode at the owner with
        one radix for all ranks: per rank (``per_rank``), whose T' may differ, the spec's T;
        otherwise the call's T'. Triton specialises a launch on these values (an int of 1
        is a constant, one divisible by 16 is marked so): the sm_90 compile uses them too."""
        rid_c, rid_r, rid_t, rid_k = self.row_id_radix(self.T if per_rank else n_tokens)
        return {
            "n_tokens": n_tokens,
            "n_programs": n_programs,
            "rank0": rank or 0,
            "rid_c": rid_c,
            "rid_r": rid_r,
            "rid_t": rid_t,
            "rid_k": rid_k,
            "ex_stride": 0,  # a replicated layer's exchange stride: its module gives it
            "bound": bound,
            "program_base": 0,  # rdep_gemm: the first program's number (the interpreter's threads count on)
        }

    def to_json(self) -> str:
        # Fields are plain data (tuples, named-tuple rows), which json writes as lists:
        # asdict's deep copy of a 10^5-row table cost seconds a compile.
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> KernelContract:
        d = json.loads(text)
        for f in fields(KernelContract):
            v = d.get(f.name)
            if isinstance(v, list):
                d[f.name] = _tuples(v)
        for name in ("table", "wgrad_table"):  # rows as named records again
            d[name] = tuple(Row(*row) for row in d.get(name, ()))
        return KernelContract(**d)


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v
