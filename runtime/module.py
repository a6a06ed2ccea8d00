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
``dropped_rows``, ``accepted`` [W, T', K] (bool: the accepted set), ``m_tiles`` [W] (m-tiles
the grouped GEMM ran per owner), ``capacity`` (cap_e at this T', None when dropless) and
``launches`` (per-rank backends: the same for the rank's own experts, ``[E_loc]``, and its
own tokens, ``[T', K]``); ``last_context`` the routing context backward will need: the
accepted set, each accepted row's slot in its owner's payload (-1 when dropped) and the
combine weights g'. Backward is not supported yet: differentiating through ``forward``
raises.

A gated expert's GEMM1 reads gate and up as one operand whose columns interleave them,
[E, H, F, 2] (``gate_up``): pass ``w_gate`` and ``w_up`` as the two halves of one such
tensor (``w[..., 0]``, ``w[..., 1]``, as ``RDEPMoE`` holds them) and nothing is copied;
separate tensors are interleaved into a new one at every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from rdepc.codegen.emit import kernel_args
from rdepc.codegen.lower import COLUMNS, CONTROL, CTL_TICKETS, INT32_MAX, MODES, KernelPlan, Tiles
from rdepc.runtime import ranks, tune
from rdepc.runtime import transport as transports
from rdepc.runtime.launch import import_kernels
from rdepc.runtime.records import KernelError, input_error, kernel_error

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
    """``w``, or a copy of it whose first element is 16-byte aligned, as TMA requires."""
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
    """forward runs the kernel; backward is not generated yet and says so."""

    @staticmethod
    def forward(ctx, module, x, topk_ids, gates, w_gate, w_up, w_down):
        y, context = module._run(x, topk_ids, gates, w_gate, w_up, w_down)
        ctx.save_for_backward(context.topk_ids, context.accepted, context.slot, context.gprime)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        raise NotImplementedError(
            "rdepc: backward of the routed RDEP layer is not supported yet (the code generator emits the forward "
            "pass only); the forward kept its routing context (accepted set, payload slots, g') for it"
        )


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
        plan: KernelPlan,
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
        self.interpret = device.type == "cpu"
        self.mode = mode
        self.kernels = import_kernels(self.kernels_path, self.interpret)
        p = plan
        self.tiles, self.tiles_source = self._tiles(tiles)
        self.work = p.work(self.tiles, mode, rank=self.rank)
        # The global ids of the experts whose weights forward takes, in that order: per rank,
        # this rank's experts in local order; otherwise every expert.
        mine = sorted((e for e in range(p.E) if p.owner[e] == self.rank), key=lambda e: p.local[e])
        self.local_experts = tuple(mine) if self.per_rank else tuple(range(p.E))
        if programs is None:
            if self.interpret:  # role-split: one program (one thread) per queue
                programs = 2 if mode == "unified" else len(self.work.bounds)
            else:
                programs = torch.cuda.get_device_properties(device).multi_processor_count
        if mode == "unified":
            programs = max(1, min(programs, self.work.n_items))
            per_queue = [programs]
        else:  # each rank its slice (one process per rank: all of it), split between roles as scheduled
            comm, compute = p.programs
            share = max(2, programs // (1 if self.per_rank else p.W))
            n_comm = min(share - 1, max(1, round(share * comm / (comm + compute))))
            per_queue = [n_comm, share - n_comm] * (1 if self.per_rank else p.W)
        self.programs = programs  # the grid's budget: every program resident at once on a GPU
        self.per_queue = tuple(per_queue)
        self.grid = sum(per_queue)
        # Spins are cheap on a GPU and slow under the interpreter; concurrent interpreted programs
        # wait for each other's turns under the GIL, so they get more.
        # Across processes an interpreted wait may outlast a whole peer's stage: bounded in spins
        # all the same (a dead peer trips it), but generously.
        if spin_bound is None:
            spin_bound = (
                1 << 26 if not self.interpret else 10_000 if mode == "unified" and not self.per_rank else 1 << 20
            )
        self.spin_bound = spin_bound
        self.profiling = profile
        self.dtype = TORCH_DTYPES[p.dtype]
        self.heap = self.transport.allocate_heap(p.W, p.heap_bytes, device)

        def i32(values) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int32, device=device)

        self.tables = {
            "table": i32(v for row in self.work.table for v in row),
            "deps": i32(p.deps or (0,)),
            "queue": i32(self.work.queue),
            "first_item": i32(self.work.first_item),
            "queues": i32(v for (lo, hi), n in zip(self.work.bounds, per_queue, strict=True) for v in (lo, hi, n)),
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
        self.private = {}
        for name, dt, shape in p.private:
            torch_dt = TORCH_DTYPES.get(dt) or INT_DTYPES[dt]
            if self.per_rank and name != "ctl":  # [W, ...] buffers: only this rank's row
                shape = (1, *shape[1:])
            self.private[name] = torch.zeros(shape, dtype=torch_dt, device=device)
        self.private["profile"] = torch.zeros(2 * self.work.n_items if profile else 1, dtype=torch.int64, device=device)
        self._owner = torch.tensor(p.owner, dtype=torch.long)
        self._local = torch.tensor(p.local, dtype=torch.long)
        self.epoch = 0  # calls since the control block was last reset (the kernel keeps its own count)
        self.launcher = self.transport.launcher(self.interpret, concurrent=mode == "role-split")
        self._last: tuple | None = None  # what last_stats is computed from, when it is read
        self._stats_cache: dict | None = None
        self._pending: tuple | None = None  # a native call whose control words are still on their way
        self.last_context: RoutingContext | None = None
        self.last_profile: dict | None = None
        self._withheld: int | None = None
        self._broken: str | None = None  # per-rank backends: a kernel error ends the module
        self._flags = (dict(p.heap)["flags"], next(size for name, _, _, size in p.layout if name == "flags"))

    # ------------------------------------------------------------------ the call
    def __call__(self, x, topk_ids, topk_weights, w_gate, w_up, w_down):
        return self.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down)

    def forward(self, x, topk_ids, topk_weights, w_gate, w_up, w_down) -> torch.Tensor:
        """y = the routed layer of every rank's tokens (see the module docstring)."""
        self._settle(wait=False)  # the previous native call's errors, if its record has landed
        self._check(x, topk_ids, topk_weights, w_gate, w_up, w_down)
        return _Routed.apply(self, x, topk_ids, topk_weights, w_gate, w_up, w_down)

    def withhold(self, entry: int) -> None:
        """Fault injection: in the next call only, task-table entry ``entry`` runs nothing and
        never signals its done flag, as if its producer were lost. The call fails with the
        kernel's error record once a dependent's wait expires."""
        if not 0 <= entry < self.work.n_entries:
            raise ValueError(f"task-table entry {entry} out of range [0, {self.work.n_entries})")
        if self.per_rank and self.plan.table[entry][COLUMNS.index("rank")] != self.rank:
            raise ValueError(
                f"task-table entry {entry} ({self.plan.names[entry]}) runs on another rank than {self.rank}"
            )
        self._withheld = entry

    def _run(self, x, topk_ids, topk_weights, w_gate, w_up, w_down):
        p = self.plan
        if self._broken:
            raise RuntimeError(self._broken)
        W, K = p.W, p.K
        Tn = x.shape[-2]
        lead = () if self.per_rank else (W,)
        x = x.detach().contiguous()
        ids = topk_ids.detach().to(torch.int64).contiguous()
        gates = topk_weights.detach().to(torch.float32).contiguous()
        if p.gated:
            weights = {"w_gate_up": gate_up(w_gate.detach(), w_up.detach()), "w_down": w_down}
        else:
            weights = {"w_up": w_up, "w_down": w_down}
        y = torch.empty((*lead, Tn, p.H), dtype=self.dtype, device=self.device)
        accepted = torch.zeros((*lead, Tn, K), dtype=torch.int8, device=self.device)
        slot = torch.full((*lead, Tn, K), -1, dtype=torch.int32, device=self.device)
        gprime = torch.zeros((*lead, Tn, K), dtype=torch.float32, device=self.device)
        launches = self.launcher.launches
        # Row ids decode at the owner: one radix for all ranks, whose T' may differ per rank.
        rid_rank, rid_token = p.row_id_radix(p.T if self.per_rank else Tn)
        self.epoch += 1
        table = self.tables["table"]
        if self._withheld is not None:
            table = table.clone()
            table[self._withheld * len(COLUMNS) + COLUMNS.index("kind")] = -1
            self._withheld = None

        def arg(a: torch.Tensor) -> torch.Tensor:  # a call with T' = 0 still launches: no null pointers
            return a if a.numel() else a.new_zeros(1)

        given = {"heap": self.heap, "x": x, "topk_ids": ids, "gates": gates, "y": y, "accepted": accepted}
        given |= {"slot": slot, "gprime": gprime}
        given |= {k: aligned(w.detach().contiguous()) for k, w in weights.items()}
        given |= self.tables | {"table": table} | self.private
        given |= {"n_tokens": Tn, "n_programs": self.grid, "rank0": self.rank or 0}
        given |= {"rid_rank": rid_rank, "rid_token": rid_token, "bound": self.spin_bound, "program_base": 0}
        tl = self.tiles
        meta = tl.constexprs() | {
            "CAST_F32": self.interpret,  # upcast 16-bit operands, round bf16 by hand
            "ROLE_SPLIT": self.mode == "role-split",
            "PROFILE": self.profiling,
            "GLOBALTIMER": self.profiling and not self.interpret,
        }
        args = tuple(
            arg(given[name]) if isinstance(given[name], torch.Tensor) else given[name]
            for name, kind in kernel_args(p)
            if kind != "constexpr"
        )
        if not self.interpret:
            meta["num_warps"] = tl.num_warps
        self.launcher(self.kernels.rdep_forward, (self.grid,), args, meta)
        accepted = accepted.bool()
        self._last, self._stats_cache = (accepted, self.launcher.launches - launches), None
        self._record(ids, gates)
        self.last_context = RoutingContext(ids, accepted, slot, gprime)
        if self.profiling:
            self.last_profile = self._profile()
        return y, self.last_context

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
        p = self.plan
        if given is not None:
            return given, "given"
        if self.interpret:
            return Tiles.default(p.H, p.F, p.dtype, True), "the interpreter's (few, large tiles)"
        found = tune.lookup(p, torch.cuda.get_device_name(self.device))
        if found is not None:
            return found
        return Tiles.default(p.H, p.F, p.dtype, False), "defaults (not tuned: rdepc tune FILE --device cuda)"

    # ------------------------------------------------------------------ checks
    def _check(self, x, topk_ids, topk_weights, w_gate, w_up, w_down) -> None:
        p = self.plan
        W, T, H, F, E, K = p.W, p.T, p.H, p.F, p.E, p.K
        name = f"rdepc layer {p.layer}"
        for arg, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w_up", w_up)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if self.per_rank:  # one rank's tokens, its own experts' weights
            name += f" (rank {self.rank} of {W})"
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
            if not isinstance(w, torch.Tensor):
                raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(w).__name__}")
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
        # them (validate) and the host raises from its record, with no sync in the call.

    # ------------------------------------------------------------------ results
    def _record(self, ids, gates) -> None:
        """Read the call's control words: under the interpreter at once (host memory: no
        sync); natively, queue their copy to pinned host memory behind the kernel and read
        them when they have landed — at the next call, at :meth:`synchronize` or when
        ``last_stats`` is read — so the call itself never waits for the device."""
        words = self.private["ctl"][:CTL_TICKETS]
        if self.interpret:
            self._raise_from(words.tolist(), ids, gates)
            return
        if self._capturing():
            # Captured into a CUDA graph: its replays run no host code, so the words are read
            # where the user asks for them — synchronize() copies them then.
            self._pending = (None, words, ids, gates)
            return
        host = torch.empty(CTL_TICKETS, dtype=torch.int64, pin_memory=True)
        host.copy_(words, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (event, host, ids, gates)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        """Wait for the last call and raise the error it recorded, if any (a native call's
        errors are raised here, at the next call, or when ``last_stats`` is read; a call
        captured into a CUDA graph — and so each of its replays — only here)."""
        self._settle(wait=True)

    def _settle(self, wait: bool) -> None:
        if self._pending is None or self._capturing():  # nothing is read while a graph is captured
            return
        event, host, ids, gates = self._pending
        if event is None:  # a captured call: only an explicit synchronize() reads its words
            if not wait:
                return
            torch.cuda.current_stream(self.device).synchronize()
        elif not wait and not event.query():
            return
        else:
            event.synchronize()
        self._pending = None
        self._raise_from(host.tolist(), ids, gates)

    def _raise_from(self, words: list[int], ids, gates) -> None:
        p = self.plan
        err = kernel_error(p, words, self.mode, self.spin_bound)
        if err is not None:
            if self.per_rank:
                # Other ranks' done flags live in their processes' slices: one rank cannot reset
                # them, so the layer must be rebuilt on every rank.
                self._broken = f"{err} (this per-rank module is stopped: rebuild it on every rank)"
            else:
                # The programs stopped early: their tickets and flags are off the count. The next
                # call starts afresh from epoch 1 on zeroed control words, never on stale flags.
                self.private["ctl"].zero_()
                self.private["tile_done"].zero_()
                at, size = self._flags
                self.heap[:, at : at + size] = 0
                self.epoch = 0
            raise err
        name = f"rdepc layer {p.layer}" + (f" (rank {self.rank} of {p.W})" if self.per_rank else "")
        bad = input_error(p, words, name, ids, gates, self.per_rank)
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
        cap = int(st[:, 2 * p.E_MAX + 1].max())  # what the scans applied (every owner the same)
        cap = None if cap == INT32_MAX else cap
        return {
            "rows_per_expert": admitted,
            "received_per_expert": arrived,
            "dropped_per_expert": dropped,
            "rows_per_owner": st[:, p.E_MAX : 2 * p.E_MAX].sum(dim=1),
            "dropped_rows": int(dropped.sum()),
            "accepted": accepted,
            "m_tiles": st[:, 2 * p.E_MAX].clone(),
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
    plan = KernelPlan.from_json(Path(plan_path).read_text(encoding="utf-8"))
    return RDEPModule(plan, kernels_path, **options)


def max_relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max|y - ref| / max|ref| (0 when both are zero), in float64."""
    y, ref = y.double(), ref.double()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((y - ref).abs().max()) if ref.numel() else 0.0
    if scale == 0:
        return 0.0 if err == 0 else math.inf
    return err / scale


__all__ = ["KernelError", "RDEPModule", "RoutingContext", "load_compiled", "max_relative_error"]
