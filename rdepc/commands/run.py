"""``rdepc run``: compile one layer, run it on random inputs and compare the result with the
reference operator (``rdepc.reference``, in fp32 on the same rounded inputs).

One process runs every rank (``emulated``), or one process per rank does (``emulated-mp``,
``nvshmem``: each checks its own slice, ``rdepc.per_rank``); either way :func:`report`
prints what the run found and, with ``--check``, its verdict.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rdepc.api import UsageError
from rdepc.commands.common import overrides, print_diags
from rdepc.ir.balance import imbalance
from rdepc.ir.contract import default_mode

# the max relative error --check accepts by default, per dtype
TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 2e-2}


def cmd_run(args) -> int:
    from rdepc.api import INTERPRETER, require_cuda

    if args.device == "cuda":  # before any work: torch's own assertion would surface mid-build
        require_cuda("--device cuda", f"--device cpu ({INTERPRETER})")
    if args.profile is not None:  # before the run, which may take long: a path that cannot be written
        _check_writable("--profile", args.profile)
    layer, tokens = _layer(args)
    from rdepc.runtime import transport

    if transport.get(args.backend).per_rank:
        return _run_per_rank(args, layer, tokens)
    return _run_one_process(args, layer, tokens)


def report(spec, how: str, inputs: str, lines: list[str], check: bool, ok: bool, why: Sequence[str] = ()) -> int:
    """What ``rdepc run`` prints after a run, in one process or per rank, and its exit status:
    the layer and how it ran, its inputs, the run's own ``lines`` and, with ``check``, the
    verdict — ``ok``, or failed for the reasons ``why`` (those the lines do not already say)."""
    out = [f"layer {spec.name} ({spec.file}): {how}", f"  inputs          {inputs}", *lines]
    status = 0
    if check:
        status = 0 if ok else 1
        out.append("check passed" if ok else "check FAILED" + (f": {'; '.join(why)}" if why else ""))
    # One write: under torchrun the W ranks share one stdout, and a report printed line by line
    # (or piece by piece, unbuffered) interleaves with the other ranks' mid-line.
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()
    return status


def judge(err: float, tol: float, same: bool) -> list[str]:
    """Why a result fails the check against the reference: a max relative error ``err``
    beyond ``tol``, an accepted set that is not the reference's (``same``)."""
    why = [] if err <= tol else [f"max relative error {err:.3g} > {tol:g}"]
    if not same:
        why.append("the accepted set differs from the reference's")
    return why


def tolerance(spec, tol: float | None) -> float:
    """``--tol``, or the default for the layer's dtype (:data:`TOLERANCE`)."""
    return TOLERANCE[spec.precision.dtype.value] if tol is None else tol


def _layer(args):
    """The layer ``args`` name, its warnings printed, and the tokens per rank to run; a
    UsageError for a T' beyond the spec's T or a backend that cannot run."""
    from rdepc.api import Layer, elaborate_layer
    from rdepc.driver import backend_warnings
    from rdepc.parser import parse_file

    module = parse_file(args.file)
    spec, warnings = elaborate_layer(module, args.layer, overrides(args))
    print_diags(warnings + backend_warnings(spec, args.backend), {})
    layer = Layer(spec, warnings)
    T = layer.shapes["T"]
    tokens = T if args.tokens is None else args.tokens
    if not 1 <= tokens <= T:
        raise UsageError(f"--tokens {tokens}: expected 1 <= T' <= {T} (the spec's T)")
    from rdepc.runtime import transport

    try:
        transport.get(args.backend)
    except (NotImplementedError, ValueError) as e:
        raise UsageError(f"--backend {args.backend}: {e}") from None
    return layer, tokens


def _run_one_process(args, layer, tokens: int) -> int:
    """``rdepc run`` on the one-process backend: every rank's tokens in one call."""
    import time

    import torch

    from rdepc.reference import reference_for
    from rdepc.runtime.tensors import max_relative_error

    spec, sh = layer.spec, layer.shapes
    W, H, F, E, K = (sh[k] for k in ("W", "H", "F", "E", "K"))
    options = {"mode": args.mode, "comm_programs": args.comm_programs, "gemm": _gemm(args)}
    options |= {"profile": True} if args.profile is not None else {}
    kernels = layer.module(args.backend, args.device, schedule=args.schedule, **options)
    inputs, biases = _random_call(args, spec, sh, tokens)
    t0 = time.perf_counter()
    y = kernels(*inputs, **biases)
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    as_fp32 = [None if t is None else (t.float() if t.dtype.is_floating_point else t) for t in inputs]
    ref_biases = {k: None if v is None else v.float() for k, v in biases.items()}
    ref, accepted_ref = reference_for(spec)(*as_fp32, **ref_biases)
    err = max_relative_error(y, ref)
    st = kernels.last_stats
    same = bool(torch.equal(st["accepted"].cpu(), accepted_ref.cpu()))
    tol = tolerance(spec, args.tol)
    where = f"{args.device} (Triton interpreter)" if kernels.interpret else args.device
    lines = [f"  max rel. error  {err:.3g}  (max|y - ref| / max|ref|, rdepc.reference in fp32; tolerance {tol:g})"]
    if spec.precision.dispatch_scale is not None:  # the reference above saw the rows fp8 dispatch sends
        exact, _ = reference_for(spec, dispatch_rounding=False)(*as_fp32)
        scales = f"{spec.route_row.scales} fp32 scale{'s' if spec.route_row.scales > 1 else ''} per row"
        lines.append(
            f"  fp8 dispatch    e4m3 rows, {scales}; {max_relative_error(y, exact):.3g} from the unquantised operator"
        )
    rows, mismatch = _row_lines(spec, kernels, st, same, (W, tokens, E, K))
    lines += rows + _kernel_lines(kernels, st, elapsed)
    stop = None  # a profile that could not be written: the run's report, then this error
    if args.profile is not None:
        try:
            lines.append(_write_profile(kernels, args.profile))
        except OSError as e:
            stop = f"rdepc: error: cannot write {e.filename or args.profile}: {e.strerror or e}"
    why = [] if mismatch is None else [mismatch]
    why += judge(err, tol, same)
    how = f"{kernels.transport.name} backend on {where}, {kernels.contract.strategy} schedule"
    shape = f"W={W} T'={tokens} H={H} F={F} E={E} K={K}"
    inputs_line = f"{shape}, {spec.precision.dtype.value}, routing {args.routing}, seed {args.seed}"
    status = report(spec, how, inputs_line, lines, args.check and stop is None, not why, why)
    if stop is not None:
        print(stop, file=sys.stderr)
        return 1
    return status


def _random_call(args, spec, sh, tokens: int) -> tuple[list, dict]:
    """The call's random inputs at T' = ``tokens`` (``--routing``, ``--seed``) and the experts'
    biases where the spec has them."""
    from rdepc.reference import random_biases, random_inputs
    from rdepc.runtime.tensors import TORCH_DTYPES

    W, H, F, E, K = (sh[k] for k in ("W", "H", "F", "E", "K"))
    dt = TORCH_DTYPES[spec.precision.dtype.value]
    inputs = random_inputs(
        W, tokens, H, F, E, K, routing=args.routing, seed=args.seed, dtype=dt, gated=spec.expert.gated,
        device=args.device,
    )  # fmt: skip
    biases = {}
    if spec.expert.bias:
        biases = random_biases(E, H, F, gated=spec.expert.gated, seed=args.seed, dtype=dt, device=args.device)
    return inputs, biases


def _row_lines(spec, kernels, st: dict, same: bool, dims: tuple[int, ...]) -> tuple[list[str], str | None]:
    """What became of the route rows (accepted, repeated, moved, dropped, balanced), and why
    the transport is wrong if it moved other than the rows it must; ``dims``: W, T', E, K."""
    from rdepc.passes.sampled_routing import owners_per_token_expr
    from rdepc.reference import owner_pairs

    W, tokens, E, K = dims
    n_rows = W * tokens * K
    accepted = int(st["accepted"].sum())
    agree = "matches the reference" if same else "DIFFERS from the reference"
    lines = [f"  accepted set    {agree} ({accepted} of {n_rows} route rows accepted)"]
    # the owners the rows went to: a balance replicate layer's physical experts and their ranks
    pairs = owner_pairs(kernels.last_context.topk_ids.cpu(), st["accepted"], kernels.contract.owner)
    uniform = float(owners_per_token_expr(E, K, spec.ownership.experts_per_rank(W))) / K
    lines.append(
        f"  redundancy      {accepted - pairs} of {accepted} accepted route rows repeat a (token, owner) pair "
        f"({100 * (1 - pairs / max(accepted, 1)):.1f} %; uniform routing: {100 * (1 - uniform):.1f} %), "
        f"rows dedup {'does' if spec.dedup else 'would'} not send"
    )
    sent, back = int(st["dispatched_rows"].sum()), int(st["returned_rows"].sum())
    want = pairs if spec.dedup else accepted  # rows the transport must have moved with their data
    moved = _moved(spec, sent, accepted, back)
    cap = "dropless" if st["capacity"] is None else f"cap_e = {st['capacity']} rows per expert"
    lines += [
        f"  transport       {moved}{'' if sent == back == want else f' (MISMATCH: expected {want} each way)'}",
        f"  rows per expert {st['rows_per_expert'].tolist()}",
        f"  rows per owner  {st['rows_per_owner'].tolist()} (max/mean {imbalance(st['rows_per_owner'].tolist()):.3f})",
        f"  dropped rows    {st['dropped_rows']} ({cap})",
    ]
    if "balance" in st:
        bl = st["balance"]
        lines.append(
            f"  balance         max/mean {bl['imbalance_before']:.3f} before, {bl['imbalance_after']:.3f} after "
            f"(rows per rank {bl['before']} -> {bl['after']}; slots hold experts {bl['slots'].tolist()}, -1 empty)"
        )
    if st["dropped_rows"]:
        order = f"drop {spec.capacity.drop}"
        lines.append(f"  dropped per src {st['dropped_per_source'].tolist()} per front-end rank ({order})")
    mismatch = None if sent == back == want else f"the transport moved {sent} rows out and {back} back, not {want}"
    return lines, mismatch


def _kernel_lines(kernels, st: dict, elapsed: float) -> list[str]:
    """The tiles, the launches and the GEMM lowering the call ran."""
    t = kernels.tiles
    return [
        f"  m-tiles         {st['m_tiles'].tolist()} per owner (BM = {t.bm}, padding-free)",
        f"  tiles           BM {t.bm}, F-block {t.block_f}, H-block {t.block_h}, K-chunk {t.block_k}, "
        f"{t.num_warps} warps, {t.num_stages} stages: {kernels.tiles_source}",
        *_backward_tiles(kernels),
        f"  kernel          {_launches(st['launches'], kernels)}, "
        f"{kernels.work.n_items} work items over {kernels.work.n_entries} task-table entries, {elapsed:.2f} s",
        f"  gemm            {kernels.gemm}: {kernels.gemm_source}",
    ]


def _launches(n: int, kernels) -> str:
    """How the call launched: its kernels, mode (tuned: said so) and programs."""
    source = getattr(kernels, "mode_source", "given")
    return _kernels_line(n, kernels) + (f"; mode {source}" if source.startswith("tuned") else "")


def _gemm(args) -> str | None:
    """``--gemm``: None where the compiler chooses."""
    return None if args.gemm in (None, "auto") else args.gemm


def _kernels_line(n: int, kernels) -> str:
    if kernels.mode == "unified":
        return f"{n} launch, unified mode, {kernels.grid} programs"
    if kernels.mode == "phased":
        before, gemm, after = kernels.per_queue
        middle = (
            "the library's grouped GEMMs" if getattr(kernels, "gemm", "triton") == "library" else f"GEMM kernel {gemm}"
        )
        return (
            f"{n} launches, phased mode, one after another: transport kernel {before} programs, {middle}, "
            f"transport kernel {after}"
        )
    comm, gemm = kernels.per_queue
    return f"{n} launches, split mode: transport kernel {comm} programs, GEMM kernel {gemm}"


def _write_profile(kernels, path: str) -> str:
    """Write the call's measured timeline to ``path``; the report's line saying so."""
    from rdepc.runtime.profile import write_measured_trace

    prof = kernels.last_profile
    programs = kernels.grid if kernels.mode == "unified" else kernels.per_queue
    written = write_measured_trace(kernels.contract, prof, path, programs=programs)
    clock = "logical clock: an order, not durations" if prof["clock"] == "logical" else "%globaltimer"
    return f"  profile         {len(prof['events'])} task events ({clock}) → {written}"


def _check_writable(option: str, path: str) -> None:
    """UsageError unless ``path`` can be written as a file: checked before a long run, not after it."""
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{option} {path}: is a directory (expected a file name, e.g. OUT.json)")
    parent = out.parent
    if not parent.exists():
        raise UsageError(f"{option} {path}: no such directory {parent}")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is not a directory")
    if out.exists() and not os.access(out, os.W_OK):
        raise UsageError(f"{option} {path}: permission denied (the file is not writable)")
    if not out.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: permission denied (cannot create files in {parent})")


def _moved(spec, sent: int, accepted: int, back: int) -> str:
    """What the transport moved: its rows and bytes out and back (``passes.transport.transport_bytes``)."""
    from rdepc.passes.transport import transport_bytes
    from rdepc.report import fmt_bytes

    out, ret = transport_bytes(spec, sent, accepted, back)
    rows = f"{sent} payload rows out for {accepted} accepted route rows, {back} back: "
    rows += f"{fmt_bytes(out)} out, {fmt_bytes(ret)} back"
    if spec.dedup:
        return f"{rows} (dedup: {100 * (1 - sent / max(accepted, 1)):.1f} % fewer rows)"
    return rows


def _run_per_rank(args, layer, tokens: int) -> int:
    """``rdepc run`` on a per-rank backend: under torchrun this process is one rank; without
    it, ``emulated-mp`` starts its W processes itself (``nvshmem`` needs torchrun's GPUs)."""
    import torch

    from rdepc import per_rank
    from rdepc.runtime import ranks
    from rdepc.toolchain import NvshmemUnavailable

    spec, W = layer.spec, layer.shapes["W"]
    gpu = args.backend == "nvshmem"
    if gpu and not torch.cuda.is_available():
        raise UsageError("--backend nvshmem needs a CUDA GPU and none is visible (on a CPU: --backend emulated-mp)")
    if not gpu and args.device != "cpu":
        raise UsageError("--backend emulated-mp runs on --device cpu (its heap is host shared memory)")
    if args.profile is not None:
        raise UsageError(f"--profile: not supported yet with the per-rank backend {args.backend} (use emulated)")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not torchrun and gpu:
        raise UsageError(
            f"--backend nvshmem runs one process per GPU rank: torchrun --nproc-per-node {W} -m rdepc run ..."
        )
    case = per_rank.Case(
        file=str(layer.spec.file),
        layer=spec.name,
        overrides=tuple(overrides(args).items()),
        backend=args.backend,
        device="cuda" if gpu else "cpu",
        schedule=args.schedule,
        mode=args.mode,
        gemm=_gemm(args),
        routing=args.routing,
        seed=args.seed,
        tokens=tokens,
    )
    job = per_rank.Job((case,))
    tol = tolerance(spec, args.tol)
    try:
        if torchrun:
            rank, _ = ranks.process_group(W)
            results = per_rank.run_rank(rank, W, job)
        else:
            print(f"starting {W} rank processes ({args.backend}, Triton interpreter) ...", flush=True)
            results = [r[0] for r in ranks.spawn(per_rank.run_rank, W, job)]
    except (ranks.RanksError, NvshmemUnavailable) as e:  # a rank could not run (kernel errors: per rank below)
        print(f"rdepc: error: {str(e).splitlines()[0].removeprefix('rdepc: ')}", file=sys.stderr)
        return 1
    where = "cuda (one process per GPU rank)" if gpu else "cpu (Triton interpreter, one process per rank)"
    ran = next((r for r in results if "gemm" in r), {"mode": args.mode or default_mode(gpu), "gemm": _gemm(args)})
    how = f"{args.backend} backend on {where}, {ran['mode']} mode, gemm {ran['gemm'] or 'triton'}"
    inputs = f"W={W} T'={tokens}, routing {args.routing}, seed {args.seed}; each rank checks its slice"
    lines, ok = _rank_lines(results, tol)
    return report(spec, how, inputs, lines, args.check, ok)  # a failing rank's line says why


def _rank_lines(results: list[dict], tol: float) -> tuple[list[str], bool]:
    """One line per rank's result (``rdepc.per_rank.run_case``), and whether every rank passed its check."""
    lines, ok = [], True
    for r in results:
        head = f"  rank {r['rank']}  T'={r['tokens']:<5}"
        if "error" in r:
            lines.append(f"{head} FAILED: {r['error']}")
            ok = False
            continue
        st = r["stats"]
        err = r.get("error_rel")
        if err is None:
            check = "no reference (ranks bring different T' under a capacity policy)"
        else:
            same = "accepted set matches" if r["accepted_same"] else "accepted set DIFFERS"
            check = f"max rel. error {err:.3g}, {same}"
            ok = ok and not judge(err, tol, r["accepted_same"])
        rows = dict(zip(r["local_experts"], st["rows_per_expert"], strict=True))
        times = ", ".join(f"{t:.2f}" for t in r["calls"])
        bl = st.get("balance")
        balance = ""
        if bl is not None:  # balance replicate: the plan every rank derived, and this rank's slots
            pairs = zip(bl["slots"][r["rank"]].tolist(), bl["slot_rows"].tolist(), strict=True)
            held = {e: n for e, n in pairs if e >= 0}
            balance = (
                f", balance max/mean {bl['imbalance_before']:.3f} before, {bl['imbalance_after']:.3f} after "
                f"(slots hold {held or 'nothing'})"
            )
        lines.append(
            f"{head} {check}; rows per own expert {rows}, dropped {st['dropped_rows']}, "
            f"m-tiles {st['m_tiles']}, rows out {sum(st['dispatched_rows'])} and back {sum(st['returned_rows'])}"
            f"{balance}; call {times} s"
        )
    return lines, ok


def _backward_tiles(kernels) -> list[str]:
    """The backward's tiles when they are not the forward's (``Tiles.for_backward`` narrowed them)."""
    b, t = kernels.bwd_tiles, kernels.tiles
    if b == t:
        return []
    return [
        f"  backward tiles  F-block {b.block_f}, H-block {b.block_h}, {b.num_stages} stages (its weight gradients fit)"
    ]
