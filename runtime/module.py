"""RDEPModule: a generated layer, runnable from PyTorch on a transport backend.

The emulated backend (the only one today) holds all W ranks in one process: ``forward``
takes every rank's tokens at once,

    forward(x, topk_ids, topk_weights, w_gate, w_up, w_down) -> y
        x             [W, T', H]   the layer's dtype, any T' <= T (the spec's bound)
        topk_ids      [W, T', K]   int64 (int32 accepted), each token's K distinct experts
        topk_weights  [W, T', K]   the gates g (any float dtype; used in fp32)
        w_gate, w_up  [E, H, F]    every expert's weights (w_gate None for gelu/relu experts)
        w_down        [E, F, H]
        y             [W, T', H]   the routed part of the layer, sum_k g'_k f_{e_k}(x)

and launches exactly one kernel per call. The per-rank backends (``emulated-mp``,
``nvshmem``) run one process per rank, each with its own module and the per-rank signature

    forward(x [T', H], topk_ids [T', K], topk_weights [T', K],
            w_gate [E_loc, H, F], w_up [E_loc, H, F], w_down [E_loc, F, H]) -> y [T', H]

— each rank its own tokens (ranks may bring different T' <= T, zero included) and only
its local experts' weights, in local order (expert e is local expert λ(e) of owner
π(e); ``local_experts`` lists them). The kernel is the same; each process launches it on
its rank's queue(s) and the capacity follows the tokens all ranks bring, which the route
stage publishes beside its counts.

A call has no device→host sync: the checks that need the data (expert ids in range,
distinct top-K, finite gates) run in the kernel, and its control words — those checks'
counts, the error record — are read under the interpreter at the end of the call, and on a
GPU once their copy behind the kernel has landed: at the next call, at ``synchronize()``
or when ``last_stats`` is read.

After each call ``last_stats`` holds its statistics and ``last_context`` the routing
context the backward walks (``rdepc.runtime.stats`` lists them). ``forward`` is
differentiable (``torch.autograd``): x, ``topk_weights`` and the expert weights get
gradients, ``topk_ids`` none (``rdepc.runtime.autograd`` says what the backward keeps and
does).

A gated expert's GEMM1 reads gate and up as one operand whose columns interleave them,
[E, H, F, 2] (``gate_up``): pass ``w_gate`` and ``w_up`` as the two halves of one such
tensor (``w[..., 0]``, ``w[..., 1]``, as ``RDEPMoE`` holds them) and nothing is copied;
separate tensors are interleaved into a new one at every call. Any strides are accepted
(transposed, sliced with a step, expanded, at an offset): what is not contiguous is copied
at the call — for weights, at every call — and the result is the contiguous one, bitwise.

Before it allocates anything the module checks that its heap and private buffers fit the
memory they come from (the transport's ``room``); :class:`HeapSizeError` says in one line
by how much they do not and which spec statements size them.

The class composes the runtime's parts, all under ``rdepc.runtime``: ``heap`` (what a
module allocates, where it reads in it), ``memory`` (the check before), ``inputs`` (a
call's arguments checked), ``stats`` (what a call leaves, read back), ``records`` (control
words as exceptions), ``profile`` (a profiled call's record), ``autograd`` (the backward's
Function, dL/dg), ``tensors`` (dtypes, the gate/up operand, alignment) and ``tune`` (the
tiles a launch uses).
"""

from __future__ import annotations

from pathlib import Path

import torch
from rdepc.runtime import grid, ops, ranks, tune
from rdepc.runtime import transport as transports
from rdepc.runtime.autograd import RoutingContext
from rdepc.runtime.heap import (
    NO_BACKWARD,
    SHARED_COUNTERS,
    allocate_private,
    check_sharing,
    keeps_outputs,
    local_experts,
    own_slices,
    owner_row_block,
    owner_row_buffers,
    placeholders,
    private_buffers,
    regions,
    reset_control,
    task_tables,
)
from rdepc.runtime.inputs import brought_tokens, check_inputs
from rdepc.runtime.library import LibraryGemms
from rdepc.runtime.memory import HeapSizeError, check_fits
from rdepc.runtime.profile import read_profile
from rdepc.runtime.records import KernelError, input_error, kernel_error
from rdepc.runtime.stats import Readback, call_stats
from rdepc.runtime.tensors import TORCH_DTYPES, aligned, gemm1_operand

from rdepc.diagnostics import layer_prefix
from rdepc.ir.balance import plan_elems
from rdepc.ir.contract import (
    COLUMNS,
    CONTROL,
    CTL_TICKETS,
    MODES,
    KernelContract,
    Tiles,
    concurrent,
)
from rdepc.ir.interface import constant_values
from rdepc.ir.lowering import choose_gemm
from rdepc.toolchain import import_kernels


class RDEPModule:
    """One generated layer on one backend and device (see the module docstring).

    ``mode``: ``unified`` (one kernel, every program takes any task, one ticket counter;
    the default under the interpreter), ``split`` (the transport kernel and the GEMM kernel
    launched side by side, each with its own programs; the default on a GPU; they must run
    concurrently: on a GPU every program is resident, on the CPU each interpreted program
    runs in its own thread, ``ConcurrentInterpreter``) or ``phased`` (the transport kernel,
    the GEMM kernel and the transport kernel again, one after another on the stream, each
    with every program: nothing overlaps, nothing is held back for the other kernel); by
    default ``rdepc tune``'s fastest on this GPU, else ``default_mode`` (``mode_source``
    says which). ``programs``: how many run at once, by default one per SM of this
    process's share of the GPU, and under the interpreter two (unified), three (split) or
    one (phased). ``comm_programs``: split mode's transport programs, the rest the GEMM
    kernel's (default: ``rdepc tune``'s fastest split, else in the ratio of the schedule's
    communication and compute programs).
    ``spin_bound``: spins a wait may take before the call fails with a :class:`KernelError`.
    ``profile``: record the start and end of every work item (``last_profile``; a
    backward's: ``last_backward_profile``).
    ``inference``: the forward's heap and buffers only; a call that would save is refused.
    ``share``: a module of this layer whose heap and call counters this one uses (one ring).
    ``gemm``: the expert GEMMs' lowering, ``triton`` (the GEMM kernel) or ``library``
    (torch's grouped GEMM between the transport kernel's launches, phased mode:
    ``rdepc.runtime.library``); by default the compiler's choice, under the interpreter
    ``triton`` (``gemm_source`` says which)."""

    def __init__(
        self,
        contract: KernelContract,
        kernels_path: str | Path,
        *,
        backend: str = "emulated",
        device=None,
        tiles: Tiles | None = None,
        programs: int | None = None,
        spin_bound: int | None = None,
        mode: str | None = None,
        comm_programs: int | None = None,
        profile: bool = False,
        inference: bool = False,
        share: RDEPModule | None = None,
        gemm: str | None = None,
    ):
        self.contract = contract
        self.inference = inference
        self.kernels_path = Path(kernels_path)
        self.device = transports.module_device(backend, device)
        self.interpret = self.device.type == "cpu"
        self.transport = self._transport(backend, mode)
        self.per_rank = self.transport.per_rank
        self.rank = ranks.process_group(contract.W)[0] if self.per_rank else None  # this process's, per rank
        buffers = private_buffers(contract, self.per_rank, inference)
        check_fits(
            contract, self.transport, self.device, buffers, self.rank, inference, heap=share is None
        )  # before anything is allocated or imported
        # rdepc tune's record for this layer on this GPU: tiles, the fastest kernel mode and split
        gpu = None if self.interpret else torch.cuda.get_device_name(self.device)
        tuned = None if gpu is None else tune.lookup_launch(contract, gpu)
        self.gemm, self.gemm_source = choose_gemm(gemm, contract, self.interpret, tuned)
        mode, self.mode_source = grid.choose_mode(mode, tuned, self.interpret, self.gemm)
        self.mode = mode
        self.profiling = profile
        self.dtype = TORCH_DTYPES[contract.dtype]
        self.kernels = import_kernels(self.kernels_path, self.interpret)
        given = (tiles, "given") if tiles is not None else None
        self.tiles, self.tiles_source = given or tune.launch_tiles(contract, gpu, self.interpret)
        self.bwd_tiles = tune.backward_tiles(contract, self.tiles, self.interpret)
        self.work = contract.work(self.tiles, mode, rank=self.rank)
        self.bwd_work = contract.work(self.bwd_tiles, mode, rank=self.rank, backward=True)
        self.local_experts = local_experts(contract, self.rank, slots=True)  # the weights its launches take
        self.grid, self.per_queue = grid.launch_grid(self, programs, comm_programs, tuned)  # all resident on a GPU
        self.spin_bound = grid.spin_bound(spin_bound, mode, self.interpret, self.per_rank)
        self._allocate(buffers, share)
        self.library = LibraryGemms(self) if self.gemm == "library" else None
        self._start()

    def _transport(self, backend: str, mode: str | None) -> transports.Transport:
        """``backend``'s transport; a ValueError unless the kernels were generated for it and
        ``mode`` is a kernel mode (None: chosen later)."""
        transport = transports.get(backend)
        if self.contract.transport != transport.name:
            made = self.contract.transport
            raise ValueError(f"{self.kernels_path} was generated for the {made} backend, not {backend}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"unknown kernel mode '{mode}' (known: {', '.join(MODES)})")
        return transport

    def _allocate(self, buffers, share: RDEPModule | None = None) -> None:
        """The symmetric heap (the transport's: collective on a per-rank backend; inference:
        each slice's forward prefix; ``share``: that module's), the task tables, the private
        buffers and the placeholders a launch passes."""
        p, device = self.contract, self.device
        counters = ()
        if share is None:
            used = p.forward_bytes if self.inference else None
            self.heap = self.transport.allocate_heap(p.W, p.heap_bytes, device, used)
        else:  # the heap's done flags count every sharer's calls: so must the words they are read against
            check_sharing(self, share)
            self.heap = share.heap
            counters = {n: share.private[n] for n, _, _ in buffers if n in SHARED_COUNTERS}
        self.tables, self.bwd_tables = task_tables(p, self.work, self.bwd_work, self.per_queue, self.per_rank, device)
        own = [b for b in buffers if b[0] not in counters]
        stamps = 2 * max(self.work.n_items, self.bwd_work.n_items) if self.profiling else 1  # a pass's at a time
        self.private = allocate_private(own, stamps, device) | dict(counters)
        self._unused = placeholders(p, device)
        self._flags, self._bwd_flags, self._published = regions(p)
        # balance replicate, one process per rank (rdepc.runtime.balance sets both): the
        # exchange and the stride between ranks' slices, which the load, solve, push and
        # receive tasks write and read; the replicated module's handle, whose exchange brings
        # the slots' gradients home in the backward
        self.exchange: tuple[torch.Tensor, int] | None = None
        self.balanced_by: int | None = None
        self.balance_plan: torch.Tensor | None = None  # ... and the plan buffer its last forward derived

    def _refuse_saving(self) -> None:
        """A module built for inference has no backward regions: a call that would keep what
        a backward walks is refused before it runs."""
        if self.inference:
            raise RuntimeError(f"{self._name()} was built with inference=True (the forward heap only): {NO_BACKWARD}")

    def _start(self) -> None:
        """The host's state between calls, before the first."""
        self.handle = ops.register(self)  # what the rdepc::forward and rdepc::backward ops name it by
        self.epoch = 0  # calls since the control block was last reset (the kernel keeps its own count)
        self.launcher = self.transport.launcher(self.interpret, concurrent=concurrent(self.mode))
        self._plans: dict[tuple[bool, bool], list[tuple]] = {}  # (backward, save) -> grid.pass_launches
        self._last: tuple | None = None  # what last_stats is computed from, when it is read
        self._stats_cache: dict | None = None
        self._readback = Readback(self.device)  # native calls whose control words are still on their way
        self.last_context: RoutingContext | None = None
        self.last_profile: dict | None = None
        self.last_backward_profile: dict | None = None
        self._withheld: tuple[int, bool] | None = None  # (entry, in the backward)
        self._broken: str | None = None  # per-rank backends: a kernel error ends the module
        # what makes the gates this module is called with, when not the caller's topk_weights
        # (RDEPMoE: its router): named in the non-finite-gate error
        self.routed_by: str | None = None

    # ------------------------------------------------------------------ the call
    def __call__(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, **kw):
        return self.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, **kw)

    def forward(
        self, x, topk_ids, topk_weights, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None, tokens=None
    ) -> torch.Tensor:
        """y = the routed layer of every rank's tokens (see the module docstring). ``tokens``
        (one process): how many of the T' tokens each rank brings, a list of W ints (or a CPU
        tensor); rank r's tokens past ``tokens[r]`` are padding: they route nowhere, get
        y = 0, and the capacity follows the tokens brought, as when the ranks' T' differ.
        ``b_gate``, ``b_up`` [E, F] and ``b_down`` [E, H]: the expert biases of a spec whose
        experts have them (``expert ..., bias``), required there and refused elsewhere.
        A replicated layer one process per rank (``KernelContract.slots_in_place``; through
        ``rdepc.runtime.balance``): ``topk_ids`` are home experts' ids and the weights the
        home experts' only; the kernel derives the call's plan, reroutes the rows and fills
        the slots itself."""
        self._check(x, topk_ids, topk_weights, w_gate, w_up, w_down, b_gate, b_up, b_down)
        operand, bias = w_up, b_up
        if self.contract.gated:
            operand = gemm1_operand(w_gate, w_up)
            bias = None if b_up is None else gemm1_operand(b_gate, b_up)
        return self._routed(x, topk_ids, topk_weights, operand, w_down, bias, b_down, tokens)

    def routed(self, x, topk_ids, topk_weights, w_up, w_down, *, b_up=None, b_down=None, tokens=None) -> torch.Tensor:
        """:meth:`forward` with GEMM1's operand as the kernel reads it: a gated expert's gate
        and up interleaved, ``w_up`` [E, H, F, 2] (``RDEPMoE``'s ``w_gate_up``), else [E, H, F];
        likewise its bias ``b_up`` [E, F, 2] (``b_gate_up``), else [E, F]."""
        gated = self.contract.gated
        halves = (w_up[..., 0], w_up[..., 1]) if gated else (None, w_up)
        bias = (b_up[..., 0], b_up[..., 1]) if gated and b_up is not None else (None, b_up)
        self._check(x, topk_ids, topk_weights, *halves, w_down, *bias, b_down)
        return self._routed(x, topk_ids, topk_weights, w_up, w_down, b_up, b_down, tokens)

    def _routed(self, x, topk_ids, topk_weights, w_up, w_down, b_up, b_down, tokens) -> torch.Tensor:
        """The checked call, through the ``rdepc::forward`` op (differentiable, and what
        ``torch.compile`` captures); it keeps what the backward walks when a gradient may
        be asked for."""
        brought, real = self.padding(tokens, x.shape[-2])
        if real is not None:  # the tokens past each rank's count route nowhere
            topk_ids = torch.where(real[..., None], topk_ids, -1)
        leaves = (x, topk_weights, w_up, w_down, b_up, b_down)
        save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)
        if save:
            self._refuse_saving()
        weights = (w_up, w_down, b_up, b_down)
        return ops.forward(self.handle, x, topk_ids, topk_weights, *weights, brought, save)[0]

    def _forward_op(self, x, topk_ids, gates, w_up, w_down, b_up, b_down, brought, save: bool) -> list[torch.Tensor]:
        """``rdepc::forward``'s implementation: the call, its routing context (with a
        replicated layer's plan one process per rank) and (``save``) what it kept, in
        ``ops.forward_layout``'s order."""
        self._settle(wait=False)  # the previous native call's errors, if its record has landed
        if self.balanced_by is not None:  # ... and its replicas' gradient exchange's (rdepc.runtime.balance)
            ops.module_of(self.balanced_by).settle(wait=False)
        y, context, kept = self._run(x, topk_ids, gates, w_up, w_down, brought, save=save, b_up=b_up, b_down=b_down)
        out = [y, context.accepted, context.slot, context.gprime]
        out += [context.topk_ids, self.balance_plan] if self.contract.slots_in_place else []
        return out + ([kept[name] for name, _, _ in ops.kept_layout(self, x.shape[-2])] if save else [])

    def _routing_tables(self) -> tuple[str, ...]:
        """The private buffers a backward walks as the forward left them (dedup: rowpos finds the links again)."""
        return ("sorted_rows", "route_scratch", "recv", "group", *(("rowpos",) if self.contract.dedup else ()))

    def padding(self, tokens, Tn: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``tokens`` (see :meth:`forward`) checked: the tokens each rank brings as the kernel
        reads them ([W]; a per-rank module: its own, [1]) and the mask of those tokens among
        the T' = ``Tn`` (bool [W, Tn]; None when every token is brought)."""
        return brought_tokens(self.contract, tokens, Tn, self.per_rank, self.device)

    def withhold(self, entry: int, backward: bool = False) -> None:
        """Fault injection: in the next call only (``backward``: the next backward), task-table
        entry ``entry`` runs nothing and never signals its done flag, as if its producer
        were lost. The call fails with the kernel's error record once a dependent's wait
        expires."""
        table, names = (
            (self.contract.bwd_table, self.contract.bwd_names)
            if backward
            else (self.contract.table, self.contract.names)
        )
        if not 0 <= entry < len(table):
            raise ValueError(f"task-table entry {entry} out of range [0, {len(table)})")
        if self.per_rank and table[entry].rank != self.rank:
            raise ValueError(f"task-table entry {entry} ({names[entry]}) runs on another rank than {self.rank}")
        self._withheld = (entry, backward)

    def _run(self, x, topk_ids, topk_weights, w_up, w_down, brought, save: bool = False, b_up=None, b_down=None):
        """Launch the forward (``w_up``: GEMM1's operand; ``b_up``, ``b_down``: the expert
        biases, when the spec has them). ``save``: keep what the backward walks, returned
        third (a replicated layer one process per rank: the call's copy of this rank's slots
        too)."""
        p = self.contract
        if self._broken:
            raise RuntimeError(self._broken)
        W, K = p.W, p.K
        Tn = x.shape[-2]
        lead = () if self.per_rank else (W,)
        # 16-byte aligned (a view at an odd offset is copied): the build Triton's launch picks, and sm_90 reports
        x = aligned(x.detach().contiguous())
        ids = aligned(topk_ids.detach().to(torch.int64).contiguous())
        gates = aligned(topk_weights.detach().to(torch.float32).contiguous())
        y = torch.empty((*lead, Tn, p.H), dtype=self.dtype, device=self.device)
        accepted = torch.zeros((*lead, Tn, K), dtype=torch.int8, device=self.device)
        slot = torch.full((*lead, Tn, K), -1, dtype=torch.int32, device=self.device)
        gprime = torch.zeros((*lead, Tn, K), dtype=torch.float32, device=self.device)
        launches = self.launcher.launches
        given = {"x": x, "topk_ids": ids, "gates": gates, "y": y, "accepted": accepted, "slot": slot, "gprime": gprime}
        given["tokens_of"] = brought
        given |= self._operands(w_up, w_down, b_up, b_down)
        if p.slots_in_place:  # the balance tasks: the plan, the rows' physical ids, the call's copy of the slots
            given["home_ids"], given["topk_ids"] = ids, torch.empty_like(ids)
            given["plan"] = torch.empty(plan_elems(W, p.homes, p.slots_in_place), dtype=torch.int32, device=self.device)
            given["slots"] = torch.empty((p.slots_in_place, p.slot_elems), dtype=self.dtype, device=self.device)
            given["exchange"], given["ex_stride"] = self.exchange
            ids = given["topk_ids"]
        kept = None
        if save:  # the owners' rows (input, pre-activations) and the expert outputs: at the front-ends,
            # under dedup at the owners (they return them summed per (token, owner)); none when the
            # gate is on the expert's input (its gradient reads x)
            kept = {name: self._owner_row_block(cols) for name, cols in owner_row_buffers(p, backward=False).items()}
            if keeps_outputs(p):
                kept["saved_out"] = torch.empty((*lead, Tn, K, p.H), dtype=self.dtype, device=self.device)
            given |= kept
            if p.slots_in_place:
                kept["slots"] = given["slots"]
        self.epoch += 1
        self._launch(given, Tn, backward=False, save=save)
        if save:  # the routing tables the backward walks, as this call left them
            lo, hi = self._published
            kept["published"] = own_slices(self.heap, self.per_rank, self.rank)[:, lo:hi].clone()
            kept |= {n: self.private[n].clone() for n in self._routing_tables()}
        accepted = accepted.bool()
        self.balance_plan = given.get("plan")
        self._last, self._stats_cache = (accepted, self.launcher.launches - launches), None
        self._record(ids, gates)
        self.last_context = RoutingContext(ids, accepted, slot, gprime)
        if self.profiling:
            self.last_profile = read_profile(
                self.work, self.private["profile"], self.interpret, self.mode, self.per_queue
            )
        return y, self.last_context, kept

    def _backward_op(
        self, dy, x, topk_ids, accepted, slot, gprime, w_up, w_down, b_up, slots, kept
    ) -> list[torch.Tensor]:
        """``rdepc::backward``'s implementation: [dx, dL/dg', dw_up (GEMM1's operand's shape), dw_down],
        then, when the experts have biases, [db_up, db_down], then with ``slots`` (the
        forward's copy of this rank's slots) their gradient."""
        Tn = dy.shape[-2]
        kept = dict(zip((name for name, _, _ in ops.kept_layout(self, Tn)), kept, strict=True))
        context = RoutingContext(aligned(topk_ids.to(torch.int64).contiguous()), accepted, slot, gprime)
        return list(self._backward(dy, context, kept, Tn, w_up, w_down, b_up, x, slots))

    def _backward(self, dy, context: RoutingContext, kept: dict, Tn: int, w_up, w_down, b_up=None, x=None, slots=None):
        """Launch the backward over a forward's routing context and what it kept; returns the
        gradients of x, g' and GEMM1's and GEMM2's operands (and their biases, when the
        experts have them; then the redundant slots', with ``slots``). ``b_up``: GEMM1's bias,
        which recomputed pre-activations add; ``x``: the forward's input
        (``KernelContract.backward_reads_x``)."""
        p = self.contract
        if self._broken:
            raise RuntimeError(self._broken)
        self._settle(wait=False)
        lead = () if self.per_rank else (p.W,)
        weights = self._operands(w_up, w_down, slots=slots)
        if b_up is not None:
            weights["b_up"] = aligned(b_up.detach().contiguous())
        if p.backward_reads_x and x is None:
            raise ValueError("this layer's backward reads the forward's x (its gate scales the expert's input, or "
                             "it sends the input rows again): pass it")  # fmt: skip
        new = {"device": self.device, "dtype": self.dtype}
        given = {
            "dy": aligned(dy.detach().to(self.dtype).contiguous()),
            "dx": torch.empty((*lead, Tn, p.H), **new),
            "dgprime": torch.empty((*lead, Tn, p.K), device=self.device, dtype=torch.float32),
            "accepted": context.accepted.to(torch.int8),
            "gprime": context.gprime,
            "topk_ids": context.topk_ids,  # dedup: the links, and which slots lead at their owner
            "slot": context.slot,
            **{name: self._owner_row_block(cols) for name, cols in owner_row_buffers(p, backward=True).items()},
            "dw_up": torch.zeros(weights["w_up"].shape, **new),  # an owner without rows runs no weight gradient
            "dw_down": torch.zeros(weights["w_down"].shape, **new),
        }
        if p.backward_reads_x:
            given["x"] = aligned(x.detach().to(self.dtype).contiguous())
        if p.bias:  # GEMM1's bias as its operand's columns: [E, F, 2] or [E, F]
            given["db_up"] = torch.zeros(weights["w_up"].shape[:1] + weights["w_up"].shape[2:], **new)
            given["db_down"] = torch.zeros((weights["w_down"].shape[0], p.H), **new)
        if slots is not None:
            given["dslots"] = torch.zeros(slots.shape, **new)
        given |= weights | {k: v for k, v in kept.items() if k != "published"}
        lo, hi = self._published  # the forward's offsets, whatever ran since
        own_slices(self.heap, self.per_rank, self.rank)[:, lo:hi] = kept["published"]
        self._launch(given, Tn, backward=True, save=False)
        self._record(None, None, backward=True)
        if self.profiling:
            stamps = self.private["profile"]
            self.last_backward_profile = read_profile(self.bwd_work, stamps, self.interpret, self.mode, self.per_queue)
        out = given["dx"], given["dgprime"], given["dw_up"], given["dw_down"]
        out += (given["db_up"], given["db_down"]) if p.bias else ()
        return out + ((given["dslots"],) if slots is not None else ())

    def _owner_row_block(self, cols: int) -> torch.Tensor:
        return owner_row_block(self.contract, self.per_rank, cols, self.dtype, self.device)

    def _operands(self, w_up, w_down, b_up=None, b_down=None, slots=None) -> dict[str, torch.Tensor]:
        """The kernel's weight arguments, contiguous and aligned (``w_up``: GEMM1's operand),
        and the expert biases and the redundant slots when given."""
        given = {"w_up": w_up, "w_down": w_down} | ({} if b_up is None else {"b_up": b_up, "b_down": b_down})
        given |= {} if slots is None else {"slots": slots}
        return {k: aligned(v.detach().contiguous()) for k, v in given.items()}

    def _launch(self, given: dict, Tn: int, backward: bool, save: bool) -> None:
        """One launch of the persistent kernel: the forward, or with ``backward`` its backward
        pass (its own task table, control words and tile counters)."""
        p = self.contract
        tables = self.tables | (self.bwd_tables if backward else {})
        if self._withheld is not None and self._withheld[1] == backward:
            table = tables["table"].clone()
            table[self._withheld[0] * len(COLUMNS) + COLUMNS.index("kind")] = -1
            tables = tables | {"table": table}
            self._withheld = None
        private = self.private
        if backward:
            private = private | {"ctl": self.private["bwd_ctl"], "tile_done": self.private["bwd_tile_done"]}
        scalars = p.launch_scalars(Tn, self.grid, self.rank, self.spin_bound, self.per_rank)
        given = {"heap": self.heap, **private, **tables, **scalars, **given}
        unused = self._unused

        def arg(name: str, kind: str):
            a = given.get(name)
            if a is None:  # the other pass's tensors: never read
                return unused[kind]
            if isinstance(a, torch.Tensor) and not a.numel():  # a call with T' = 0 still launches
                return a.new_zeros(1)
            return a

        launches = []
        if (backward, save) not in self._plans:
            self._plans[backward, save] = grid.pass_launches(self, backward, save)
        for i, (kernel, names, meta, queues) in enumerate(self._plans[backward, save]):
            given["queues"] = queues  # launch i reads queue i's record
            launches.append((kernel, (self.per_queue[i],), tuple(arg(n, kind) for n, kind in names), meta))
        if concurrent(self.mode):
            self.launcher(launches)
        else:  # phased: one after another on the stream, each done before the next starts
            for i, launch in enumerate(launches):
                self.launcher([launch])
                if i == 1 and self.library is not None:  # the GEMM kernel waited for the rows: the library's GEMMs
                    self.library.run(given, backward, save)

    # ------------------------------------------------------------------ checks
    def _name(self) -> str:
        """The layer as errors name it: per rank, with this process's rank."""
        c = self.contract
        return layer_prefix(c.layer) + (f" (rank {self.rank} of {c.W})" if self.per_rank else "")

    def _check(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None) -> None:
        p = self.contract
        N = p.slots_in_place  # then the weights are the home experts' only
        if N and self.exchange is None:
            raise ValueError(f"{self._name()}: a balance replicate layer runs through its ReplicatedModule "
                             "(rdepc.runtime.balance.layer_module), which gives it the slots' exchange")  # fmt: skip
        own = len(self.local_experts) - N if self.per_rank else None  # one rank's tokens, its own experts' weights
        biases = {"b_gate": b_gate, "b_up": b_up, "b_down": b_down}
        check_inputs(
            self.contract, self._name(), own, self.dtype, self.device, x, topk_ids, topk_weights, w_gate, w_up, w_down,
            biases,
        )  # fmt: skip

    # ------------------------------------------------------------------ results
    def _record(self, ids, gates, backward: bool = False) -> None:
        """Read the call's control words: under the interpreter at once (host memory: no
        sync); natively, queue their copy to pinned host memory behind the kernel and read
        them when they have landed — at the next call, at :meth:`synchronize` or when
        ``last_stats`` is read — so the call itself never waits for the device."""
        words = self.private["bwd_ctl" if backward else "ctl"][:CTL_TICKETS]
        if self.interpret:
            self._raise_from(words.tolist(), ids, gates, backward)
            return
        self._readback.queue(words, ids, gates, backward)

    def synchronize(self) -> None:
        """Wait for the last call and raise the error it recorded, if any (a native call's
        errors are raised here, at the next call, or when ``last_stats`` is read; a call
        captured into a CUDA graph — and so each of its replays — only here)."""
        self._settle(wait=True)

    def _settle(self, wait: bool) -> None:
        """Raise the first error of the native calls whose words have landed (all, with
        ``wait``), oldest first."""
        self._readback.settle(wait, self._raise_from)

    def _raise_from(self, words: list[int], ids, gates, backward: bool = False) -> None:
        p = self.contract
        err = kernel_error(p, words, self.mode, self.spin_bound, backward, self.per_queue[-1])
        if err is not None:
            self._readback.clear()
            if self.per_rank:
                # Other ranks' done flags live in their processes' slices: one rank cannot reset
                # them, so the layer must be rebuilt on every rank.
                self._broken = f"{err} (this per-rank module is stopped: rebuild it on every rank)"
                # A wait on this rank's own flag fails too when the task it waited for waits on a
                # peer that is gone (its scan, for the routes of a killed rank): either way NVSHMEM's
                # finalize, a collective, must not wait for the peers at exit.
                if err.record.get("flag_rank") is not None:
                    self.transport.peers_lost(
                        f"a wait for {err.record['flag_task']} on rank {err.record['flag_rank']} failed"
                    )
            else:
                # The programs stopped early: the next call starts afresh from epoch 1 on zeroed
                # control words, never on stale flags.
                reset_control(self.private, self.heap, self._bwd_flags if backward else self._flags, backward)
                if not backward:
                    self.epoch = 0
            raise err
        if backward:
            return
        bad = input_error(p, words, self._name(), ids, gates, self.per_rank, self.routed_by)
        if bad is not None:
            first, last = CONTROL.index("bad_ids"), CONTROL.index("dup_tokens_at")
            self.private["ctl"][first : last + 1] = 0  # the call completed: only the counts go
            raise bad

    @property
    def constants(self) -> dict[str, object]:
        """The layer's kernel constants by name, as its kernel file holds them
        (``rdepc.ir.interface.CONSTANTS``, the table the emitter writes from)."""
        return {name: value for name, value, _ in constant_values(self.contract)}

    @property
    def last_stats(self) -> dict | None:
        """The last call's statistics (``rdepc.runtime.stats`` lists them), copied to the host when read."""
        if self._last is None:
            return None
        if self._stats_cache is None:
            self._settle(wait=True)
            accepted, launches = self._last
            own = self.local_experts if self.per_rank else None
            self._stats_cache = call_stats(
                self.contract, self.private["stats"], self.last_context.topk_ids, accepted, launches, own
            )
        return self._stats_cache

    @property
    def source(self) -> str:
        return self.kernels_path.read_text(encoding="utf-8")

    def __repr__(self) -> str:
        p = self.contract
        return (
            f"<rdepc.RDEPModule {p.layer} on {self.transport.name}/{self.device}"
            f"{' (interpreter)' if self.interpret else ''}: W={p.W} T<={p.T} H={p.H} F={p.F} E={p.E} K={p.K}, "
            f"{self.work.n_items} work items, {self.mode} mode, grid ({self.grid},)>"
        )


__all__ = ["HeapSizeError", "KernelError", "RDEPModule"]
