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

After each call ``last_stats`` (copied when read) holds ``rows_per_expert`` [E] (admitted),
``received_per_expert`` [E], ``dropped_per_expert`` [E], ``rows_per_owner`` [W],
``dropped_rows``, ``dropped_per_source`` [W] (route rows of each front-end's tokens the
capacity dropped), ``accepted`` [W, T', K] (bool: the accepted set), ``m_tiles`` [W] (m-tiles
the grouped GEMM ran per owner), ``capacity`` (cap_e at this T', None when dropless),
``dispatched_rows`` [W] (payload rows each front-end sent with their data: one per accepted
route row, under ``dedup`` one per (token, owner)), ``returned_rows`` [W] (rows each owner
sent back with their data) and ``launches`` (per-rank backends: the same for the rank's own
experts, ``[E_loc]``, and its own tokens, ``[T', K]``, ``dropped_per_source`` ``[1]``);
``last_context`` the routing context
the backward walks: the accepted set, each accepted row's slot in its owner's payload (-1
when dropped) and the combine weights g'.

``forward`` is differentiable (``torch.autograd``): x, ``topk_weights`` and the expert
weights get gradients, ``topk_ids`` none. A call that needs them (grad mode on and an input
that requires grad) keeps what the generated backward walks — the routing tables (offsets,
split tables, the accepted set, g'), each owner's input rows and pre-activations, each
accepted slot's expert output — and the backward launches the same kernel with its
``BACKWARD`` constexpr: g'·dL/dy to the forward's places, the expert backward and the
weight gradients at the owners (summed over each expert's rows in a fixed order: no
float atomics), dL/dx rows home and summed per token in slot order, dL/dg' = dL/dy·out,
then dL/dg through the capacity weights policy on the host (torch ops, no sync). Dropped
slots get no gradient; a token with every slot dropped gets zero. Per-rank backends: every
rank calls backward (it is collective, like the forward), and gets its own tokens' and its
own experts' gradients. Under ``dedup`` the backward moves one dL/dy row per (token,
owner) out and one summed dL/dx row back, as the forward does; each slot's expert output
stays at its owner, which computes dL/dg' there and sends it home as one fp32 per slot.

A gated expert's GEMM1 reads gate and up as one operand whose columns interleave them,
[E, H, F, 2] (``gate_up``): pass ``w_gate`` and ``w_up`` as the two halves of one such
tensor (``w[..., 0]``, ``w[..., 1]``, as ``RDEPMoE`` holds them) and nothing is copied;
separate tensors are interleaved into a new one at every call. Any strides are accepted
(transposed, sliced with a step, expanded, at an offset): what is not contiguous is copied
at the call — for weights, at every call — and the result is the contiguous one, bitwise.

Before it allocates anything the module checks that its heap and private buffers fit the
memory they come from (the transport's ``room``); :class:`HeapSizeError` says in one line
by how much they do not and which spec statements size them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from rdepc.runtime import ranks, tune
from rdepc.runtime import transport as transports
from rdepc.runtime.memory import HeapSizeError, heap_shortfall
from rdepc.runtime.records import KernelError, input_error, kernel_error

from rdepc.ir.contract import (
    COLUMNS,
    CONTROL,
    CTL_TICKETS,
    INT32_MAX,
    MODES,
    NATIVE_SPIN_BOUND,
    POINTEE,
    KernelContract,
    Tiles,
    kernel_args,
)
from rdepc.toolchain import import_kernels

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_DTYPES = {"int32": torch.int32, "int64": torch.int64}


def gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """[E, H, F] gate and up weights as the one [E, H, F, 2] operand GEMM1 reads (column 2f
    gate f, 2f + 1 up f): a view when they are already the halves of one such tensor,
    otherwise a new tensor."""
    shape = (*w_gate.shape, 2)
    strides = [1]
    for n in reversed(shape[1:]):
        strides.insert(0, strides[0] * n)
    halves = (
        w_up.shape == w_gate.shape
        and w_up.dtype == w_gate.dtype
        and w_up.device == w_gate.device
        and w_gate.stride() == w_up.stride() == tuple(strides[:-1])
        and w_gate.untyped_storage().data_ptr() == w_up.untyped_storage().data_ptr()
        and w_up.data_ptr() == w_gate.data_ptr() + w_gate.element_size()
    )
    return w_gate.as_strided(shape, strides) if halves else torch.stack((w_gate, w_up), dim=-1)


def aligned(w: torch.Tensor) -> torch.Tensor:
    """``w``, or a copy of it whose first element is 16-byte aligned, as TMA requires; every
    tensor a launch passes is, so that Triton specialises every pointer as aligned
    (``tt.divisibility`` 16), the build ``rdepc compile --target sm_90`` reports."""
    return w if w.data_ptr() % 16 == 0 else w.clone()


@dataclass(frozen=True)
class RoutingContext:
    """What the forward's accepted set looked like, for a backward that walks it (appendix
    A.3, condition 4): per (rank, token, slot) whether it was accepted, its row's slot in
    its owner's payload (-1 when dropped), and its combine weight g'."""

    topk_ids: torch.Tensor
    accepted: torch.Tensor
    slot: torch.Tensor
    gprime: torch.Tensor


class _Routed(torch.autograd.Function):
    """forward runs the kernel and keeps what the backward walks; backward runs the kernel's
    backward pass over it."""

    @staticmethod
    def forward(ctx, module, x, topk_ids, gates, w_gate, w_up, w_down, brought):
        y, context, kept = module._run(x, topk_ids, gates, w_gate, w_up, w_down, brought, save=True)
        ctx.module, ctx.kept, ctx.context = module, kept, context
        ctx.n_tokens = x.shape[-2]
        ctx.save_for_backward(gates, w_gate, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        gates, w_gate, w_up, w_down = ctx.saved_tensors
        dx, dgates, dwg, dwu, dwd = ctx.module._backward(
            grad_y, ctx.context, ctx.kept, ctx.n_tokens, gates, w_gate, w_up, w_down
        )
        return None, dx, None, dgates, dwg, dwu, dwd, None


def gate_grad(
    gates: torch.Tensor, accepted: torch.Tensor, dgprime: torch.Tensor, weights: str, routed: torch.Tensor
) -> torch.Tensor:
    """dL/dg from dL/dg' through the capacity weights policy (the combine's g'):
    ``zero`` (and dropless) g' = g on accepted slots; ``renormalize`` g'_i = A_i g_i G / S_A
    with G = sum_j g_j, S_A = sum_j A_j g_j (0 when S_A = 0), whose derivative is
    dL/dg_m = A_m dL/dg'_m G / S_A + (1 - A_m G / S_A) sum_i dL/dg'_i A_i g_i / S_A.
    The gate of a slot that routes nowhere (``routed`` false: expert id -1) is no part of
    G: it counts as 0 and gets no gradient."""
    g = gates.to(torch.promote_types(gates.dtype, torch.float32))
    g = torch.where(routed, g, 0.0)
    dgprime = dgprime.to(g.dtype)
    if weights != "renormalize":
        return torch.where(accepted, dgprime, 0.0)
    kept = torch.where(accepted, g, 0.0)
    total = g.sum(dim=-1, keepdim=True)
    survived = kept.sum(dim=-1, keepdim=True)
    ok = survived != 0
    denom = torch.where(ok, survived, 1.0)
    scale = total / denom
    through = (dgprime * kept).sum(dim=-1, keepdim=True) / denom
    dg = torch.where(accepted, dgprime * scale, 0.0) + through - torch.where(accepted, scale, 0.0) * through
    return torch.where(ok & routed, dg, 0.0)


def dense(name: str, arg: str, t) -> None:
    """TypeError unless ``t`` is an ordinary (strided, not nested) tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise TypeError(f"{name}: {arg} must be a dense (strided) tensor, got a {layout} one")


def token_mask(counts: list[int], Tn: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts`` on ``device`` (int64 [W]) and the mask of the tokens they cover (bool [W, Tn]),
    without the host waiting for the device (a pinned copy, queued)."""
    host = torch.tensor(counts, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    brought = host.to(device, non_blocking=True)
    return brought, torch.arange(Tn, device=device)[None, :] < brought[:, None]


class RDEPModule:
    """One generated layer on one backend and device (see the module docstring).

    ``mode``: ``unified`` (default: every program takes any task, one ticket counter) or
    ``role-split`` (per rank a communication queue and a compute queue, each with its own
    programs; they must run concurrently: on a GPU every program is resident, on the CPU
    each interpreted program runs in its own thread, ``ConcurrentInterpreter``). ``programs``:
    the grid's size, by default two under the interpreter (role-split: one per queue, 2·W)
    and one per SM on a GPU; role-split gives each rank an equal share, split between its
    two queues in the ratio of the schedule's communication and compute programs.
    ``spin_bound``: spins a wait may take before the call fails with a :class:`KernelError`.
    ``profile``: record the start and end of every work item (``last_profile``)."""

    def __init__(
        self,
        plan: KernelContract,
        kernels_path: str | Path,
        *,
        backend: str = "emulated",
        device=None,
        tiles: Tiles | None = None,
        programs: int | None = None,
        spin_bound: int | None = None,
        mode: str = "unified",
        profile: bool = False,
    ):
        self.plan = plan
        self.kernels_path = Path(kernels_path)
        self.transport = transports.get(backend)
        if plan.transport != self.transport.name:
            raise ValueError(f"{self.kernels_path} was generated for the {plan.transport} backend, not {backend}")
        if mode not in MODES:
            raise ValueError(f"unknown kernel mode '{mode}' (known: {', '.join(MODES)})")
        self.per_rank = self.transport.per_rank
        self.rank = None  # per-rank backends: this process's rank
        if backend == "nvshmem":  # NVSHMEM picks this rank's GPU when it starts
            from rdepc.runtime.nvshmem import NvshmemWorld

            world = NvshmemWorld.start()
            asked = None if device is None else torch.device(device)
            if asked is not None and (asked.type != "cuda" or asked.index not in (None, world.device.index)):
                raise ValueError(f"the nvshmem backend runs rank {world.rank} on {world.device}")
            device = world.device
        device = torch.device(device if device is not None else "cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {device}: the emulated backend runs on 'cpu' (Triton interpreter) or 'cuda'")
        if backend == "emulated-mp" and device.type != "cpu":
            raise ValueError(
                "the emulated-mp backend runs on 'cpu' (its heap is host shared memory): use nvshmem on GPUs"
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.per_rank:
            self.rank, _ = ranks.process_group(plan.W)
        self.device = device
        self._check_memory()  # before anything is allocated or imported
        self.interpret = device.type == "cpu"
        self.mode = mode
        self.kernels = import_kernels(self.kernels_path, self.interpret)
        p = plan
        self.tiles, self.tiles_source = self._tiles(tiles)
        self.work = p.work(self.tiles, mode, rank=self.rank)
        self.bwd_work = p.work(self.tiles, mode, rank=self.rank, backward=True)
        # The global ids of the experts whose weights forward takes, in that order: per rank,
        # this rank's experts in local order; otherwise every expert.
        mine = sorted((e for e in range(p.E) if p.owner[e] == self.rank), key=lambda e: p.local[e])
        self.local_experts = tuple(mine) if self.per_rank else tuple(range(p.E))
        if programs is None:
            if self.interpret:  # role-split: one program (one thread) per queue
                programs = 2 if mode == "unified" else len(self.work.bounds)
            else:
                programs = torch.cuda.get_device_properties(device).multi_processor_count
        # unified: capped by the work items; role-split: each rank its slice, split between roles
        programs, per_queue = p.launch_grid(self.work, programs, self.per_rank, resident=not self.interpret)
        self.programs = programs  # the grid's budget: every program resident at once on a GPU
        self.per_queue = per_queue
        self.grid = sum(per_queue)
        # Spins are cheap on a GPU and slow under the interpreter; concurrent interpreted programs
        # wait for each other's turns under the GIL, so they get more.
        # Across processes an interpreted wait may outlast a whole peer's stage: bounded in spins
        # all the same (a dead peer trips it), but generously.
        if spin_bound is None:
            interpreted = 10_000 if mode == "unified" and not self.per_rank else 1 << 20
            spin_bound = interpreted if self.interpret else NATIVE_SPIN_BOUND
        self.spin_bound = spin_bound
        self.profiling = profile
        self.dtype = TORCH_DTYPES[p.dtype]
        self.heap = self.transport.allocate_heap(p.W, p.heap_bytes, device)

        def i32(values) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int32, device=device)

        def queued(work, deps) -> dict[str, torch.Tensor]:
            return {
                "table": i32(v for row in work.table for v in row),
                "deps": i32(deps or (0,)),
                "queue": i32(work.queue),
                "first_item": i32(work.first_item),
                "queues": i32(v for (lo, hi), n in zip(work.bounds, per_queue, strict=True) for v in (lo, hi, n)),
            }

        self.bwd_tables = queued(self.bwd_work, p.bwd_deps)
        self.tables = queued(self.work, p.deps) | {
            "program_queue": i32(q for q, n in enumerate(per_queue) for _ in range(n if mode != "unified" else 1)),
            "owner_of": i32(p.owner),
            "local_of": i32(p.local),
            "n_local": i32(p.n_local),
            # one process per rank holds its own experts only: weights by local index
            "weight_of": i32(p.weight_of if not self.per_rank else (i % p.E_MAX for i in range(p.W * p.E_MAX))),
            "order": i32(p.order),
            "owner_first": i32(p.owner_first),
            "rows_max": i32(p.rows_max),
            "caps": i32(p.caps()),
        }
        self.private = {name: torch.zeros(shape, dtype=dt, device=device) for name, dt, shape in self._private()}
        self.private["profile"] = torch.zeros(2 * self.work.n_items if profile else 1, dtype=torch.int64, device=device)
        # what a launch passes for the other pass's pointers: never read, but of the declared type,
        # which Triton's signature (and so the build a launch runs) takes from the argument
        self._unused = {
            kind: torch.zeros(1, dtype=getattr(torch, POINTEE[kind[1:]]), device=device)
            for _, kind in kernel_args(p)
            if kind.startswith("*")
        }
        self._owner = torch.tensor(p.owner, dtype=torch.long)
        self._local = torch.tensor(p.local, dtype=torch.long)
        self.epoch = 0  # calls since the control block was last reset (the kernel keeps its own count)
        self.launcher = self.transport.launcher(self.interpret, concurrent=mode == "role-split")
        self._last: tuple | None = None  # what last_stats is computed from, when it is read
        self._stats_cache: dict | None = None
        self._pending: list[tuple] = []  # native calls whose control words are still on their way
        self.last_context: RoutingContext | None = None
        self.last_profile: dict | None = None
        self._withheld: tuple[int, bool] | None = None  # (entry, in the backward)
        self._broken: str | None = None  # per-rank backends: a kernel error ends the module
        # what makes the gates this module is called with, when not the caller's topk_weights
        # (RDEPMoE: its router): named in the non-finite-gate error
        self.routed_by: str | None = None
        sizes = {name: (at, size) for name, _, at, size in p.layout}
        self._flags, self._bwd_flags = sizes["flags"], sizes["bwd_flags"]
        # the heap words the backward reads from a rank's own slice: the offsets and admitted
        # counts its owners published to it (adjacent buffers)
        self._published = (sizes["offsets"][0], sizes["admitted"][0] + sizes["admitted"][1])

    def _private(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The plan's private buffers as this process allocates them."""
        out = []
        for name, dt, shape in self.plan.private:
            if self.per_rank and name not in ("ctl", "bwd_ctl"):  # [W, ...] buffers: only this rank's row
                shape = (1, *shape[1:])
            out.append((name, TORCH_DTYPES.get(dt) or INT_DTYPES[dt], tuple(shape)))
        return out

    def _check_memory(self) -> None:
        """Refuse a heap (and private buffers) larger than the memory they come from, in one
        line naming what sizes them, before anything is allocated. On a per-rank backend the
        ranks agree first: none goes on into the collective allocation a peer refused."""
        p = self.plan
        slices = self.transport.heap_ranks(p.W)
        private = sum(math.prod(shape) * dt.itemsize for _, dt, shape in self._private())
        room = self.transport.room(self.device)
        message = None
        if room is not None and slices * p.heap_bytes + private > room[0]:
            name = f"rdepc layer {p.layer}" + (f" (rank {self.rank} of {p.W})" if self.per_rank else "")
            message = f"{name}: {heap_shortfall(p, slices, private, room[1])}"
        if self.per_rank:
            import torch.distributed as dist

            verdicts = [None] * p.W
            dist.all_gather_object(verdicts, message)
            message = next((v for v in verdicts if v), None)
        if message:
            raise HeapSizeError(message)

    # ------------------------------------------------------------------ the call
    def __call__(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, *, tokens=None):
        return self.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, tokens=tokens)

    def forward(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, *, tokens=None) -> torch.Tensor:
        """y = the routed layer of every rank's tokens (see the module docstring). ``tokens``
        (one process): how many of the T' tokens each rank brings, a list of W ints (or a CPU
        tensor); rank r's tokens past ``tokens[r]`` are padding: they route nowhere, get
        y = 0, and the capacity follows the tokens brought, as when the ranks' T' differ."""
        self._settle(wait=False)  # the previous native call's errors, if its record has landed
        self._check(x, topk_ids, topk_weights, w_gate, w_up, w_down)
        brought, real = self.padding(tokens, x.shape[-2])
        if real is not None:  # the tokens past each rank's count route nowhere
            topk_ids = torch.where(real[..., None], topk_ids, -1)
        inputs = (x, topk_weights, w_gate, w_up, w_down)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            return _Routed.apply(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, brought)
        return self._run(x, topk_ids, topk_weights, w_gate, w_up, w_down, brought, save=False)[0]

    def padding(self, tokens, Tn: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``tokens`` (see :meth:`forward`) checked: the tokens each rank brings as the kernel
        reads them ([W]; a per-rank module: its own, [1]) and the mask of those tokens among
        the T' = ``Tn`` (bool [W, Tn]; None when every token is brought)."""
        ranks = 1 if self.per_rank else self.plan.W
        if tokens is None:
            return torch.full((ranks,), Tn, dtype=torch.int64, device=self.device), None
        name = f"rdepc layer {self.plan.layer}"
        if self.per_rank:
            raise ValueError(f"{name}: tokens= is for the one-process backend; each rank passes its own T' tokens")
        if isinstance(tokens, torch.Tensor):
            if tokens.device.type != "cpu" or tokens.dtype.is_floating_point or tokens.dim() != 1:
                raise ValueError(f"{name}: tokens must be W={ranks} ints on the host (a list or a CPU tensor)")
            tokens = tokens.tolist()
        counts = list(tokens)
        if len(counts) != ranks or any(
            isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= Tn for n in counts
        ):
            raise ValueError(
                f"{name}: tokens must give each of the W={ranks} ranks a count in [0, T'={Tn}], got {counts}"
            )
        return token_mask(counts, Tn, self.device)

    def withhold(self, entry: int, backward: bool = False) -> None:
        """Fault injection: in the next call only (``backward``: the next backward), task-table
        entry ``entry`` runs nothing and never signals its done flag, as if its producer
        were lost. The call fails with the kernel's error record once a dependent's wait
        expires."""
        table, names = (self.plan.bwd_table, self.plan.bwd_names) if backward else (self.plan.table, self.plan.names)
        if not 0 <= entry < len(table):
            raise ValueError(f"task-table entry {entry} out of range [0, {len(table)})")
        if self.per_rank and table[entry][COLUMNS.index("rank")] != self.rank:
            raise ValueError(f"task-table entry {entry} ({names[entry]}) runs on another rank than {self.rank}")
        self._withheld = (entry, backward)

    def _run(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, brought, save: bool = False):
        """Launch the forward. ``save``: keep what the backward walks, returned third."""
        p = self.plan
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
        given |= self._weights(w_gate, w_up, w_down)
        kept = None
        if save:  # the owners' rows (input, pre-activations) and the expert outputs: at the front-ends,
            # under dedup at the owners (they return them summed per (token, owner))
            new = {"dtype": self.dtype, "device": self.device}
            kept = {
                "saved_x": self._owner_rows(p.H),
                "saved_pre": self._owner_rows(2 * p.F if p.gated else p.F),
                "saved_out": self._owner_rows(p.H) if p.dedup else torch.empty((*lead, Tn, K, p.H), **new),
            }
            given |= kept
        self.epoch += 1
        self._launch(given, Tn, backward=False, save=save)
        if save:  # the routing tables the backward walks, as this call left them
            lo, hi = self._published
            kept["published"] = self._own_heap()[:, lo:hi].clone()
            routing = ("sorted_rows", "route_scratch", "recv", "group", *(("rowpos",) if p.dedup else ()))
            kept |= {n: self.private[n].clone() for n in routing}  # dedup: rowpos finds the links again
        accepted = accepted.bool()
        self._last, self._stats_cache = (accepted, self.launcher.launches - launches), None
        self._record(ids, gates)
        self.last_context = RoutingContext(ids, accepted, slot, gprime)
        if self.profiling:
            self.last_profile = self._profile()
        return y, self.last_context, kept

    def _backward(self, dy, context: RoutingContext, kept: dict, Tn: int, gates, w_gate, w_up, w_down):
        """Launch the backward over a forward's routing context and what it kept; returns the
        gradients of x, the gates and the weights (w_gate None for an ungated expert)."""
        p = self.plan
        if self._broken:
            raise RuntimeError(self._broken)
        self._settle(wait=False)
        lead = () if self.per_rank else (p.W,)
        weights = self._weights(w_gate, w_up, w_down)
        up = weights["w_up"]
        new = {"device": self.device, "dtype": self.dtype}
        given = {
            "dy": aligned(dy.detach().to(self.dtype).contiguous()),
            "dx": torch.empty((*lead, Tn, p.H), **new),
            "dgprime": torch.empty((*lead, Tn, p.K), device=self.device, dtype=torch.float32),
            "accepted": context.accepted.to(torch.int8),
            "gprime": context.gprime,
            "topk_ids": context.topk_ids,  # dedup: the links, and which slots lead at their owner
            "slot": context.slot,
            "dh": self._owner_rows(2 * p.F if p.gated else p.F),
            "act_rows": self._owner_rows(p.F),
            "do_rows": self._owner_rows(p.H),
            "dw_up": torch.zeros(up.shape, **new),  # an owner without rows runs no weight gradient
            "dw_down": torch.zeros(weights["w_down"].shape, **new),
        }
        given |= weights | {k: v for k, v in kept.items() if k != "published"}
        lo, hi = self._published
        self._own_heap()[:, lo:hi] = kept["published"]  # the forward's offsets, whatever ran since
        self._launch(given, Tn, backward=True, save=False)
        self._record(None, None, backward=True)
        routed = (context.topk_ids >= 0) & (context.topk_ids < p.E)
        dgates = gate_grad(gates, context.accepted, given["dgprime"], p.weights, routed).to(gates.dtype)
        dw_up = given["dw_up"]
        if p.gated:
            dwg, dwu = dw_up[..., 0], dw_up[..., 1]
        else:
            dwg, dwu = None, dw_up
        return given["dx"], dgates, dwg, dwu, given["dw_down"]

    def _owner_rows(self, cols: int) -> torch.Tensor:
        """[owners, R_max, cols] rows in the layer's dtype, one block per owner this process
        runs: where the owners' rows sit for the backward, at their places among their rows."""
        owners = 1 if self.per_rank else self.plan.W
        return torch.empty((owners, self.plan.R_MAX, cols), dtype=self.dtype, device=self.device)

    def _weights(self, w_gate, w_up, w_down) -> dict[str, torch.Tensor]:
        """The kernel's weight arguments: ``w_up`` is a gated expert's [Wg Wu], interleaved."""
        if self.plan.gated:
            weights = {"w_up": gate_up(w_gate.detach(), w_up.detach()), "w_down": w_down}
        else:
            weights = {"w_up": w_up, "w_down": w_down}
        return {k: aligned(w.detach().contiguous()) for k, w in weights.items()}

    def _own_heap(self) -> torch.Tensor:
        """The heap slices this process owns, [ranks, heap_bytes]."""
        if not self.per_rank:
            return self.heap
        return self.heap.view(1, -1) if self.heap.dim() == 1 else self.heap[self.rank : self.rank + 1]

    def _launch(self, given: dict, Tn: int, backward: bool, save: bool) -> None:
        """One launch of the persistent kernel: the forward, or with ``backward`` its backward
        pass (its own task table, control words and tile counters)."""
        p = self.plan
        tables = self.tables | (self.bwd_tables if backward else {})
        if self._withheld is not None and self._withheld[1] == backward:
            table = tables["table"].clone()
            table[self._withheld[0] * len(COLUMNS) + COLUMNS.index("kind")] = -1
            tables = tables | {"table": table}
            self._withheld = None
        private = dict(self.private)
        if backward:
            private |= {"ctl": self.private["bwd_ctl"], "tile_done": self.private["bwd_tile_done"]}
        given = {"heap": self.heap, **private, **tables, **given}
        given |= p.launch_scalars(Tn, self.grid, self.rank, self.spin_bound, self.per_rank)
        tl = self.tiles
        meta = tl.constexprs() | {
            "CAST_F32": self.interpret,  # upcast 16-bit operands, round bf16 by hand
            "ROLE_SPLIT": self.mode == "role-split",
            "PROFILE": self.profiling and not backward,
            "GLOBALTIMER": self.profiling and not backward and not self.interpret,
            "BACKWARD": backward,
            "SAVE": save,
        }

        def arg(name: str, kind: str):
            a = given.get(name)
            if a is None:  # the other pass's tensors: never read
                return self._unused[kind]
            if isinstance(a, torch.Tensor) and not a.numel():  # a call with T' = 0 still launches
                return a.new_zeros(1)
            return a

        args = tuple(arg(name, kind) for name, kind in kernel_args(p) if kind != "constexpr")
        if not self.interpret:
            meta["num_warps"] = tl.num_warps
        self.launcher(self.kernels.rdep_layer, (self.grid,), args, meta)

    def _profile(self) -> dict:
        """Per entry that ran: its first item's start and its last item's end."""
        at = self.private["profile"].view(-1, 2).to("cpu").tolist()
        events = []
        for entry, (first, items) in enumerate(self.work.entry_items()):
            if items:
                span = at[first : first + items]
                events.append((entry, min(s for s, _ in span), max(e for _, e in span)))
        return {"clock": "logical" if self.interpret else "globaltimer", "mode": self.mode, "events": events}

    def _tiles(self, given: Tiles | None) -> tuple[Tiles, str]:
        """The tiles to launch with, and where they come from: given, the interpreter's own,
        ``rdepc tune``'s record for this plan on this GPU, or the defaults."""
        if given is not None:
            return given, "given"
        device_name = None if self.interpret else torch.cuda.get_device_name(self.device)
        return tune.launch_tiles(self.plan, device_name, self.interpret)

    # ------------------------------------------------------------------ checks
    def _check(self, x, topk_ids, topk_weights, w_gate, w_up, w_down) -> None:
        p = self.plan
        W, T, H, F, E, K = p.W, p.T, p.H, p.F, p.E, p.K
        name = f"rdepc layer {p.layer}"
        if self.per_rank:  # one rank's tokens, its own experts' weights
            name += f" (rank {self.rank} of {W})"
        for arg, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w_up", w_up)):
            dense(name, arg, t)
        if self.per_rank:
            lead, lead_s, n_exp, E_s = (), "", len(self.local_experts), f"E_loc={len(self.local_experts)}"
        else:
            lead, lead_s, n_exp, E_s = (W,), "W, ", E, f"E={E}"
        if x.dim() != len(lead) + 2 or tuple(x.shape[: len(lead)]) != lead or x.shape[-1] != H:
            raise ValueError(f"{name}: x must be [{lead_s.replace('W', f'W={W}')}T', H={H}], got {tuple(x.shape)}")
        Tn = x.shape[-2]
        if Tn > T:
            raise ValueError(f"{name}: x has T'={Tn} tokens per rank, more than the layer's bound T={T}")
        want = (*lead, Tn, K)
        if tuple(topk_ids.shape) != want:
            raise ValueError(f"{name}: topk_ids must be [{lead_s}T', K] = {list(want)}, got {tuple(topk_ids.shape)}")
        if tuple(topk_weights.shape) != want:
            raise ValueError(
                f"{name}: topk_weights must be [{lead_s}T', K] = {list(want)}, got {tuple(topk_weights.shape)}"
            )
        if x.dtype != self.dtype:
            raise TypeError(f"{name}: x must be {self.dtype} (the spec's dtype {p.dtype}), got {x.dtype}")
        if topk_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name}: topk_ids must be int64 (or int32), got {topk_ids.dtype}")
        if not topk_weights.dtype.is_floating_point:
            raise TypeError(f"{name}: topk_weights must be a floating-point tensor, got {topk_weights.dtype}")
        experts = {"w_up": (w_up, (n_exp, H, F)), "w_down": (w_down, (n_exp, F, H))}
        if p.gated:
            if w_gate is None:
                raise ValueError(f"{name}: {p.act} experts are gated: w_gate [{E_s}, H={H}, F={F}] is required")
            experts["w_gate"] = (w_gate, (n_exp, H, F))
        elif w_gate is not None:
            raise ValueError(f"{name}: {p.act} experts are not gated: pass w_gate=None")
        for arg, (w, shape) in experts.items():
            dense(name, arg, w)
            if tuple(w.shape) != shape:
                raise ValueError(f"{name}: {arg} must be {list(shape)}, got {tuple(w.shape)}")
            if w.dtype != self.dtype:
                raise TypeError(f"{name}: {arg} must be {self.dtype} (the spec's dtype {p.dtype}), got {w.dtype}")
        tensors = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights}
        tensors.update({k: v for k, (v, _) in experts.items()})
        for arg, t in tensors.items():
            if t.device != self.device:
                raise ValueError(f"{name}: {arg} is on {t.device}, the module on {self.device}")
        # Expert ids in range, distinct top-K and finite gates need the data: the kernel checks
        # them (validate) and the host raises from its record, with no sync in the call. Any
        # strides are accepted: _run and _weights make the tensors contiguous (a copy when
        # they are not).

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
        if self._capturing():
            # Captured into a CUDA graph: its replays run no host code, so the words are read
            # where the user asks for them — synchronize() copies them then.
            self._pending.append((None, words, ids, gates, backward))
            return
        host = torch.empty(CTL_TICKETS, dtype=torch.int64, pin_memory=True)
        host.copy_(words, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, ids, gates, backward))

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        """Wait for the last call and raise the error it recorded, if any (a native call's
        errors are raised here, at the next call, or when ``last_stats`` is read; a call
        captured into a CUDA graph — and so each of its replays — only here)."""
        self._settle(wait=True)

    def _settle(self, wait: bool) -> None:
        """Raise the first error of the native calls whose words have landed (all, with
        ``wait``), oldest first."""
        while self._pending and not self._capturing():  # nothing is read while a graph is captured
            event, host, ids, gates, backward = self._pending[0]
            if event is None:  # a captured call: only an explicit synchronize() reads its words
                if not wait:
                    return
                torch.cuda.current_stream(self.device).synchronize()
            elif not wait and not event.query():
                return
            else:
                event.synchronize()
            self._pending.pop(0)
            self._raise_from(host.tolist(), ids, gates, backward)

    def _raise_from(self, words: list[int], ids, gates, backward: bool = False) -> None:
        p = self.plan
        err = kernel_error(p, words, self.mode, self.spin_bound, backward)
        if err is not None:
            self._pending.clear()
            if self.per_rank:
                # Other ranks' done flags live in their processes' slices: one rank cannot reset
                # them, so the layer must be rebuilt on every rank.
                self._broken = f"{err} (this per-rank module is stopped: rebuild it on every rank)"
            else:
                # The programs stopped early: their tickets and flags are off the count. The next
                # call starts afresh from epoch 1 on zeroed control words, never on stale flags.
                pre = "bwd_" if backward else ""
                self.private[pre + "ctl"].zero_()
                self.private[pre + "tile_done"].zero_()
                at, size = self._bwd_flags if backward else self._flags
                self.heap[:, at : at + size] = 0
                if not backward:
                    self.epoch = 0
            raise err
        if backward:
            return
        name = f"rdepc layer {p.layer}" + (f" (rank {self.rank} of {p.W})" if self.per_rank else "")
        bad = input_error(p, words, name, ids, gates, self.per_rank, self.routed_by)
        if bad is not None:
            first, last = CONTROL.index("bad_ids"), CONTROL.index("dup_tokens_at")
            self.private["ctl"][first : last + 1] = 0  # the call completed: only the counts go
            raise bad

    @property
    def last_stats(self) -> dict | None:
        """The last call's statistics (module docstring), copied to the host when read."""
        if self._last is None:
            return None
        if self._stats_cache is None:
            self._settle(wait=True)
            self._stats_cache = self._stats(*self._last)
        return self._stats_cache

    def _stats(self, accepted: torch.Tensor, launches: int) -> dict:
        p = self.plan
        st = self.private["stats"].to("cpu", torch.long)
        if self.per_rank:  # this rank's own experts, in local order
            local = self._local[list(self.local_experts)]
            arrived, admitted = st[0, local], st[0, p.E_MAX + local]
        else:
            arrived = st[self._owner, self._local]
            admitted = st[self._owner, p.E_MAX + self._local]
        dropped = arrived - admitted
        ids = self.last_context.topk_ids.to("cpu")
        routed = (ids >= 0) & (ids < p.E)  # an id of -1 routes nowhere: no row to drop
        lost = (routed & ~accepted.to("cpu")).sum(dim=(-2, -1))  # per source rank (this rank's, per-rank)
        cap = int(st[:, 2 * p.E_MAX + 1].max())  # what the scans applied (every owner the same)
        cap = None if cap == INT32_MAX else cap
        return {
            "rows_per_expert": admitted,
            "received_per_expert": arrived,
            "dropped_per_expert": dropped,
            "rows_per_owner": st[:, p.E_MAX : 2 * p.E_MAX].sum(dim=1),
            "dropped_rows": int(dropped.sum()),
            "dropped_per_source": lost.reshape(-1),
            "accepted": accepted,
            "m_tiles": st[:, 2 * p.E_MAX].clone(),
            "dispatched_rows": st[:, 2 * p.E_MAX + 2].clone(),
            "returned_rows": st[:, 2 * p.E_MAX + 3].clone(),
            "capacity": cap,
            "launches": launches,
        }

    @property
    def source(self) -> str:
        return self.kernels_path.read_text(encoding="utf-8")

    def __repr__(self) -> str:
        p = self.plan
        return (
            f"<rdepc.RDEPModule {p.layer} on {self.transport.name}/{self.device}"
            f"{' (interpreter)' if self.interpret else ''}: W={p.W} T<={p.T} H={p.H} F={p.F} E={p.E} K={p.K}, "
            f"{self.work.n_items} work items, {self.mode} mode, grid ({self.grid},)>"
        )


def load_compiled(plan_path: str | Path, kernels_path: str | Path, **options) -> RDEPModule:
    """The module of a compiled layer directory (``rdepc compile FILE -o DIR``)."""
    plan = KernelContract.from_json(Path(plan_path).read_text(encoding="utf-8"))
    return RDEPModule(plan, kernels_path, **options)


def max_relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max|y - ref| / max|ref| (0 when both are zero), in float64."""
    y, ref = y.double(), ref.double()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((y - ref).abs().max()) if ref.numel() else 0.0
    if scale == 0:
        return 0.0 if err == 0 else math.inf
    return err / scale


__all__ = ["HeapSizeError", "KernelError", "RDEPModule", "RoutingContext", "load_compiled", "max_relative_error"]
