"""A module's kernel mode, the programs of each of its launches and the spins a wait may
take: given, ``rdepc tune``'s record for the layer on this GPU, or the defaults; and what
each launch of a pass passes but the call's own tensors (``pass_launches``)."""

from __future__ import annotations

from rdepc.runtime import ranks

from rdepc.diagnostics import UsageError
from rdepc.ir.arguments import kernel_args, own_constexprs
from rdepc.ir.contract import (
    NATIVE_SPIN_BOUND,
    QUEUE_WORDS,
    default_mode,
    mode_kernels,
)
from rdepc.ir.lowering import LIBRARY_MODE

INTERPRETED_PROGRAMS = {"unified": 2, "split": 3, "phased": 1}  # a launch's programs under the interpreter


def choose_mode(mode: str | None, tuned: dict | None, interpret: bool, gemm: str = "triton") -> tuple[str, str]:
    """The kernel mode — given, phased under the library GEMM lowering (its GEMMs run between
    the transport kernel's launches), ``rdepc tune``'s fastest on this GPU (``tuned``:
    ``runtime.tune.lookup_launch``), or ``default_mode`` — and where it comes from."""
    if gemm == "library":
        if mode not in (None, LIBRARY_MODE):
            raise UsageError(
                f"the library GEMM lowering runs in {LIBRARY_MODE} mode (its GEMMs between the transport kernel's "
                f"launches), not {mode}"
            )
        return LIBRARY_MODE, "given" if mode is not None else "the library GEMM lowering"
    if mode is not None:
        return mode, "given"
    if tuned is not None:
        return tuned["mode"], f"tuned ({tuned['ms']:.3f} ms; rdepc tune)"
    return default_mode(not interpret), "default"


def launch_grid(module, programs: int | None, comm: int | None, tuned: dict | None) -> tuple[int, tuple[int, ...]]:
    """The programs of ``module``'s call and of each launch (``KernelContract.launch_grid``)
    within a budget of ``programs`` that run at once: by default, under the interpreter, two
    (unified), three (split: one transport program, two GEMM programs, each a thread) or one
    (phased); on a GPU one per SM (split and phased mode: of this process's share of the GPU,
    per-rank processes on one GPU sharing it). ``comm``: split mode's transport programs
    (default: ``rdepc tune``'s fastest at this budget, else the schedule's). An interpreted
    phased launch of the GEMM kernel has one program: the interpreter runs a launch's
    programs one after another, and a GEMM program waits for the items before its own."""
    import torch

    mode = module.mode
    if programs is None:
        if module.interpret:
            programs = INTERPRETED_PROGRAMS[mode]
            comm = 1 if comm is None and mode == "split" else comm
        else:  # split, phased: the rank processes sharing this GPU each run their kernels on their share
            programs = torch.cuda.get_device_properties(module.device).multi_processor_count
            if mode != "unified":
                programs = max(2, programs // ranks.sharing_device(module.per_rank))
    if comm is None and mode == "split" and tuned and tuned.get("comm_programs") and tuned["programs"] == programs:
        comm = tuned["comm_programs"]
    total, per_queue = module.contract.launch_grid(module.work, programs, comm)
    if module.interpret and mode == "phased":
        per_queue = (per_queue[0], 1, per_queue[2])
        total = sum(per_queue)
    return total, per_queue


def spin_bound(given: int | None, mode: str, interpret: bool, per_rank: bool) -> int:
    """Spins a wait may take. Spins are cheap on a GPU and slow under the interpreter;
    concurrent interpreted programs wait for each other's turns under the GIL, so they get
    more. Across processes an interpreted wait may outlast a whole peer's stage: bounded in
    spins all the same (a dead peer trips it), but generously. Programs that run one after
    another (unified and phased mode, all ranks in one process) find every dependency done
    unless it never will be: few spins."""
    if given is not None:
        return given
    if not interpret:
        return NATIVE_SPIN_BOUND
    return 10_000 if mode in ("unified", "phased") and not per_rank else 1 << 20


def pass_launches(module, backward: bool, save: bool) -> list[tuple]:
    """What every call of a pass of ``module`` launches, made once (the module keeps it): per
    launch of its mode, the kernel, its arguments' (name, type) but the constexprs, its
    constexprs and options, and its queue record."""
    p = module.contract
    tiles = module.bwd_tiles if backward else module.tiles
    meta = tiles.constexprs() | {
        "CAST_F32": module.interpret,  # upcast 16-bit operands, round bf16 by hand
        "PROFILE": module.profiling,
        "GLOBALTIMER": module.profiling and not module.interpret,
        "BACKWARD": backward,
        "SAVE": save,
        "LIBRARY": module.gemm == "library",  # the GEMM kernel waits and signals; torch computes
    }
    options = {"num_warps": tiles.num_warps} if not module.interpret else {}
    queues = (module.bwd_tables if backward else module.tables)["queues"]
    return [
        (
            getattr(module.kernels, kernel),
            [(name, kind) for name, kind in kernel_args(p, kernel) if kind != "constexpr"],
            own_constexprs(p, kernel, meta | extra) | options,
            queues[QUEUE_WORDS * i :],
        )
        for i, (kernel, extra) in enumerate(mode_kernels(module.mode))
    ]


__all__ = ["INTERPRETED_PROGRAMS", "choose_mode", "launch_grid", "pass_launches", "spin_bound"]
