"""Tile sizes per layer and device: the tuning step, its cache, and the choice a module makes.

``rdepc tune FILE --device cuda`` runs the compiled layer natively with every candidate
:class:`~rdepc.codegen.lower.Tiles` that fits the device's shared memory, times each, and
records the fastest beside the layer's kernel contract: one JSON file per (kernel contract, device,
triton version) under ``$RDEPC_CACHE_DIR/tuning`` (default ``~/.cache/rdepc/tuning``),
with every candidate's time; then, unless a kernel mode was given, the fastest tiles in
split mode at several shares of the SMs for the transport kernel and in phased mode, the
fastest of those recorded as ``launch``. A native module built without explicit ``tiles``
takes the recorded choice when there is one (``RDEPModule.tiles_source`` says which), and
``Tiles.default`` otherwise; without a mode the recorded mode, and in split mode without
a transport-program count the recorded split (``RDEPModule.mode_source``). The interpreter
keeps its own few-large-tiles choice and its own mode: what is fast there says nothing
about a GPU.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, fields
from pathlib import Path

from rdepc.runtime.cache import _unusable, _version, cache_dir, write_atomic

from rdepc.ir.contract import MODES, KernelContract, Tiles, default_mode
from rdepc.ir.lowering import contract_refusals


def candidates(contract: KernelContract) -> list[Tiles]:
    """The tiles ``rdepc tune`` tries: m-tiles of 64 and 128 rows, GEMM tiles 64 to 256 wide
    (32 or 64 in fp32), 4 or 8 warps, 2 to 4 pipeline stages — those that fit in shared memory
    and whose accumulators stay in registers (``Tiles.fits``: the forward's, which is what is
    timed; a backward launches them narrowed, ``Tiles.for_backward``). Nearest the defaults
    first (fewest sizes changed; then the larger m-tile, more warps, wider tiles): a budget
    that ends the tuning early leaves out the candidates least like the tiles known to run well."""
    wide = (32, 64) if contract.dtype == "fp32" else (64, 128, 256)
    k = 32 if contract.dtype == "fp32" else 64
    base = Tiles.default(contract.H, contract.F, contract.dtype, interpret=False)
    out = []
    for bm in (64, 128):
        for block_f in wide:
            for block_h in wide:
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        t = Tiles(bm, block_h, block_f, 64, 4096, warps, k, stages)
                        if t.fits(contract):
                            out.append(t)

    def order(t: Tiles) -> tuple:
        changed = sum(getattr(t, f.name) != getattr(base, f.name) for f in fields(Tiles))
        return (changed, -t.bm, -t.num_warps, -t.block_h, -t.block_f, abs(t.num_stages - base.num_stages))

    return sorted(out, key=order)


def key(contract: KernelContract, device_name: str) -> str:
    """What a tuning result is valid for: the kernel contract, the device and Triton's version."""
    text = json.dumps([contract.to_json(), device_name, _version("triton")])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _path(contract: KernelContract, device_name: str) -> Path:
    return cache_dir() / "tuning" / f"{contract.layer}-{key(contract, device_name)}.json"


def lookup(contract: KernelContract, device_name: str) -> tuple[Tiles, str] | None:
    """The recorded tiles for ``plan`` on ``device_name`` and where they come from, or None."""
    path = _path(contract, device_name)
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        tiles = Tiles(**rec["tiles"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, or unreadable: a damaged record never breaks a run
    return tiles, f"tuned on {rec['device']} ({rec['date']}, {rec['ms']:.3f} ms)"


def launch_tiles(contract: KernelContract, device_name: str | None, interpret: bool) -> tuple[Tiles, str]:
    """The tiles a module of ``plan`` launches with, and where they come from: under the
    interpreter its own, natively ``rdepc tune``'s record for ``device_name`` or the defaults."""
    if interpret:
        return Tiles.default(contract.H, contract.F, contract.dtype, True), "the interpreter's (few, large tiles)"
    found = lookup(contract, device_name) if device_name else None
    if found is not None:
        return found
    return Tiles.default(
        contract.H, contract.F, contract.dtype, False
    ), "defaults (not tuned: rdepc tune FILE --device cuda)"


def backward_tiles(contract: KernelContract, tiles: Tiles, interpret: bool) -> Tiles:
    """The tiles a backward launch uses: natively ``tiles`` narrowed until its weight
    gradients' tiles fit too (``Tiles.for_backward``; the defaults fit as they are), under
    the interpreter ``tiles`` (it has no registers or shared memory to fit)."""
    return tiles if interpret else tiles.for_backward(contract)


def lookup_launch(contract: KernelContract, device_name: str) -> dict | None:
    """The kernel mode and GEMM lowering ``rdepc tune`` found fastest for ``contract`` on
    ``device_name`` with its tiles (``launch``: ``mode``, ``comm_programs`` of the fastest
    split, ``gemm``, ``programs`` the budget it was timed at, ``ms``), or None: not tuned,
    or tuned before launches were. A record from before the lowerings were timed ran the
    Triton GEMM kernel."""
    try:
        launch = json.loads(_path(contract, device_name).read_text(encoding="utf-8"))["launch"]
        if launch["mode"] not in MODES or not isinstance(launch["programs"], int):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"gemm": "triton"} | launch


def record(
    contract: KernelContract,
    device_name: str,
    best: Tiles,
    results: list[dict],
    launch: dict | None = None,
    launch_results: list[dict] | None = None,
) -> Path:
    """Write the tuning result for ``plan`` on ``device_name``; its path. ``launch``: the
    fastest kernel mode with the tiles (:func:`time_launches`), ``launch_results`` all of them."""
    ms = min(r["ms"] for r in results if r["tiles"] == asdict(best))
    rec = {
        "layer": contract.layer,
        "strategy": contract.strategy,
        "device": device_name,
        "triton": _version("triton"),
        "date": dt.date.today().isoformat(),
        "tiles": asdict(best),
        "ms": ms,
        "results": results,
    }
    if launch is not None:
        rec |= {"launch": launch, "launch_results": launch_results or []}
    path = _path(contract, device_name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(rec, indent=1) + "\n")
    except OSError as e:
        raise _unusable(path.parent, e) from None
    return path


def tune(
    contract: KernelContract,
    time_tiles: Callable[[Tiles], float],
    tried: Iterable[Tiles],
    progress: Callable[[str], None] = lambda line: None,
    budget: float | None = None,
) -> tuple[Tiles, list[dict]]:
    """Time every candidate with ``time_tiles`` (milliseconds of one call; it raises when a
    candidate cannot run, which is recorded and skipped); the fastest, and every result.
    ``budget``: seconds after which the remaining candidates are recorded as not timed."""
    results = _time_each(tried, lambda t: {"tiles": asdict(t)}, time_tiles, _short, progress, budget)
    timed = [r for r in results if "ms" in r]
    if not timed:
        raise RuntimeError(f"rdepc tune: no candidate tiles ran for layer {contract.layer}: " + results[0]["error"])
    best = min(timed, key=lambda r: r["ms"])
    return Tiles(**best["tiles"]), results


SPLIT_FACTORS = (1.0, 0.5, 0.75, 1.25, 1.5)  # of the schedule's transport programs, tried in split mode


Launch = tuple[str, int | None, str]  # (kernel mode, split mode's transport programs, GEMM lowering)


def launch_candidates(contract: KernelContract, tiles: Tiles, programs: int) -> list[Launch]:
    """(mode, transport programs, GEMM lowering) the tuned tiles are timed in: split mode with
    the schedule's share of ``programs`` for the transport kernel and with SPLIT_FACTORS of
    it, then phased mode where the schedule's GEMMs wait for no return (``phase_queues``),
    with the Triton GEMM kernel and, where the library lowering runs the layer, the library's."""
    _, (comm, _) = contract.launch_grid(contract.work(tiles, "split"), programs)
    comms = dict.fromkeys(min(programs - 1, max(1, round(comm * f))) for f in SPLIT_FACTORS)
    out: list[Launch] = [("split", c, "triton") for c in comms]
    try:
        contract.work(tiles, "phased")
    except ValueError:
        return out
    out.append(("phased", None, "triton"))
    return out if contract_refusals(contract) else [*out, ("phased", None, "library")]


def time_launches(
    time_launch: Callable[[str, int | None, str], float],
    tried: Iterable[Launch],
    programs: int,
    progress: Callable[[str], None] = lambda line: None,
) -> tuple[dict, list[dict]]:
    """Time each (mode, transport programs, GEMM lowering) with ``time_launch`` (milliseconds
    of one call; a launch that raises is recorded and skipped); the fastest as
    :func:`lookup_launch` returns it (``comm_programs``: the fastest split's, whichever mode
    won), and every result."""

    def what(launch: Launch) -> str:
        mode, comm, gemm = launch
        return f"{mode} mode" + (f", {comm} transport programs of {programs}" if comm else "") + f", {gemm} GEMMs"

    def entry(launch: Launch) -> dict:
        return {"mode": launch[0], "comm_programs": launch[1], "gemm": launch[2]}

    results = _time_each(tried, entry, lambda c: time_launch(*c), what, progress)
    timed = [r for r in results if "ms" in r]
    if not timed:
        raise RuntimeError("rdepc tune: the tuned tiles ran in no kernel mode: " + results[0]["error"])
    best = min(timed, key=lambda r: r["ms"])
    splits = [r for r in timed if r["mode"] == "split"]
    comm = min(splits, key=lambda r: r["ms"])["comm_programs"] if splits else None
    return {
        "mode": best["mode"],
        "comm_programs": comm,
        "gemm": best["gemm"],
        "programs": programs,
        "ms": best["ms"],
    }, results


def _time_each(tried, entry, time_one, describe, progress, budget: float | None = None) -> list[dict]:
    """Time each of ``tried`` with ``time_one`` (milliseconds of one call): per candidate its
    ``entry`` with ``ms``, or ``error`` when it raised (recorded and skipped, not fatal), or
    ``skipped`` once ``budget`` seconds have passed (after at least one was timed); a
    progress line each, ``describe`` naming it."""
    results: list[dict] = []
    tried = list(tried)
    deadline = None if budget is None else time.monotonic() + budget
    for i, t in enumerate(tried):
        if deadline is not None and time.monotonic() > deadline and any("ms" in r for r in results):
            results.append(entry(t) | {"skipped": f"not timed: the budget of {budget:g} s was spent"})
            progress(f"  [{i + 1}/{len(tried)}] {describe(t)}  not timed (budget)")
            continue
        try:
            ms = time_one(t)
            results.append(entry(t) | {"ms": ms})
            line = f"{ms:9.3f} ms"
        except Exception as e:  # a candidate that does not compile or run is skipped, not fatal
            results.append(entry(t) | {"error": f"{type(e).__name__}: {e}"[:300]})
            line = f"failed: {type(e).__name__}"
        progress(f"  [{i + 1}/{len(tried)}] {describe(t)}  {line}")
    return results


def _short(t: Tiles) -> str:
    return (
        f"BM {t.bm:>3} F-block {t.block_f:>3} H-block {t.block_h:>3} K {t.block_k:>3} "
        f"warps {t.num_warps} stages {t.num_stages}"
    )


def tune_layer(
    layer,
    device: str = "cuda",
    *,
    schedule: str | None = None,
    mode: str | None = None,
    tokens: int | None = None,
    reps: int = 10,
    warmup: int = 3,
    tried: Iterable[Tiles] | None = None,
    progress: Callable[[str], None] = lambda line: None,
    budget: float | None = None,
    launches: Iterable[Launch] | None = None,
) -> tuple[Tiles, list[dict], Path]:
    """Tune ``layer`` (an ``rdepc.Layer``) on ``device``, on the emulated backend at T' =
    ``tokens`` (default: the spec's T) with uniform routing: every candidate is run ``warmup``
    times, then timed ``reps`` times (CUDA events; wall clock on the CPU), its median kept;
    then the fastest tiles in each kernel mode and split (``launches``, default
    :func:`launch_candidates`), unless ``mode`` is given. Records both (:func:`record`);
    returns the tiles, every tiles result and the record's path. ``budget``: seconds, past
    which the remaining candidates are not timed (:func:`tune`)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    contract = layer.compile(schedule=schedule, interpret=not cuda).kernel  # what the modules below run
    inputs, biases = _tuning_inputs(layer, device, tokens)
    name = torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu (Triton interpreter)"

    tiles_mode = mode or default_mode(cuda)  # not a mode an earlier tuning recorded: the tiles first

    def time_tiles(t: Tiles) -> float:
        return time_module(layer.module("emulated", device, schedule=schedule, mode=tiles_mode, tiles=t))

    def time_module(m) -> float:
        return _median_ms(m, inputs, biases, warmup, reps, cuda)

    best, results = tune(contract, time_tiles, tried if tried is not None else candidates(contract), progress, budget)
    if mode is not None:  # the mode was given: the tiles for it
        return best, results, record(contract, name, best, results)
    programs = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count if cuda else 3
    tried_launches = launch_candidates(contract, best, programs) if launches is None else list(launches)
    progress(f"  the fastest tiles in each kernel mode ({len(tried_launches)} launches):")

    def time_launch(mode_: str, comm: int | None, gemm: str) -> float:
        m = layer.module("emulated", device, schedule=schedule, mode=mode_, tiles=best, comm_programs=comm, gemm=gemm)
        return time_module(m)

    launch, launch_results = time_launches(time_launch, tried_launches, programs, progress)
    return best, results, record(contract, name, best, results, launch, launch_results)


def _tuning_inputs(layer, device: str, tokens: int | None) -> tuple[tuple, dict]:
    """Uniformly routed inputs at T' = ``tokens`` (default: the spec's T), GEMM1's operand
    packed once, and the experts' biases where the spec has them."""
    from rdepc.runtime.tensors import TORCH_DTYPES, gate_up

    from rdepc.reference import random_biases, random_inputs

    sh = layer.shapes
    W, T, H, F, E, K = (sh[k] for k in ("W", "T", "H", "F", "E", "K"))
    spec = layer.spec
    x, ids, gates, w_gate, w_up, w_down = random_inputs(
        W, tokens or T, H, F, E, K, dtype=TORCH_DTYPES[spec.precision.dtype.value], gated=spec.expert.gated,
        device=device,
    )  # fmt: skip
    if w_gate is not None:  # the [E, H, F, 2] operand once, so that no call interleaves it again
        packed = gate_up(w_gate, w_up)
        w_gate, w_up = packed[..., 0], packed[..., 1]
    dt = TORCH_DTYPES[spec.precision.dtype.value]
    biases = random_biases(E, H, F, gated=spec.expert.gated, dtype=dt, device=device) if spec.expert.bias else {}
    return (x, ids, gates, w_gate, w_up, w_down), biases


def _median_ms(m, inputs: tuple, biases: dict, warmup: int, reps: int, cuda: bool) -> float:
    """The median of ``reps`` timed calls of ``m`` after ``warmup`` untimed ones, in ms (CUDA
    events on a GPU; the wall clock on the CPU)."""
    import torch

    for _ in range(warmup):
        m(*inputs, **biases)
    m.synchronize()  # a candidate whose run fails raises here, before it is timed
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            m(*inputs, **biases)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            m(*inputs, **biases)
            times.append((time.perf_counter() - t0) * 1e3)
    m.synchronize()
    return sorted(times)[len(times) // 2]


__all__ = [
    "Launch",
    "backward_tiles",
    "candidates",
    "key",
    "launch_candidates",
    "launch_tiles",
    "lookup",
    "lookup_launch",
    "record",
    "time_launches",
    "tune",
    "tune_layer",
]
