"""``rdepc compile``: the elaborated spec, the generated kernels, their contract and an
importable module in one directory; with ``--target sm_90`` also every kernel's cubin."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rdepc.api import UsageError
from rdepc.commands.common import overrides, print_diags


def cmd_compile(args) -> int:
    from rdepc.driver import PASS_NAMES, Options, compile_file, dump_json, spec_passes

    known = list(PASS_NAMES) + [p.name for p in spec_passes()]
    for name in args.dump_after:
        if name not in known:
            raise UsageError(f"--dump-after {name}: no such pass (passes: {', '.join(known)})")
    opts = Options(
        args.layer,
        overrides(args),
        tuple(args.dump_after),
        args.time_passes,
        schedule=args.schedule,
        cut=args.cut,
        hw=args.hw,
        backend=args.backend,
        gemm=None if args.gemm in (None, "auto") else args.gemm,
        verify_each=args.verify_each,
    )
    # sys.stdout as it is now: compile_file's default was bound when rdepc.driver was imported
    result = compile_file(args.file, opts, sys.stdout)
    generated = result.outputs["codegen"]
    print_diags(result.warnings, {})
    out = Path(args.out or Path("build") / result.spec.name)
    target = out / f"{result.spec.name}.spec.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(dump_json(result.spec) + "\n", encoding="utf-8")
        tmp.replace(target)
        from rdepc.codegen import write_module

        wrote = [target, *write_module(generated, out)]
    except OSError as e:  # -o names a file, an unwritable place, ...
        print(f"rdepc: error: cannot write {e.filename or target}: {e.strerror or e}", file=sys.stderr)
        return 1
    if args.target:
        wrote += _cubins(out, result.spec.name)
    for path in wrote:
        print(f"wrote {path}")
    return 0


def _cubins(out: Path, name: str) -> list[Path]:
    """Compile the written kernels for sm_90, printing what each build is; the cubins' paths."""
    from rdepc.codegen.sm90 import compile_cubins

    def progress(r: dict, finished: int, total: int) -> None:
        print(f"rdepc: compiled {finished} of {total} builds for sm_90 ({r['kernel']})", file=sys.stderr, flush=True)

    wrote = []
    job = (out / f"{name}_kernels.py", out / f"{name}.contract.json", out)
    for r in compile_cubins([job], arch=90, parallel=min(8, os.cpu_count() or 1), done=progress):
        wrote.append(Path(r["cubin"]))
        if r.get("balance"):  # a replicated layer's plan and exchange: launches of their own
            print(
                f"compiled {r['kernel']} for {r['target']} in {r['seconds']:.1f} s: {r['bytes']:,} bytes, "
                f"{r['shared']:,} bytes of shared memory, {r['registers']} registers, {r['stack']:,} bytes of "
                f"stack and {r['local_bytes']:,} bytes of local memory (spills) per thread, 4 warps, "
                f"{r['ctas_per_sm']} CTA{'s' if r['ctas_per_sm'] != 1 else ''} per SM"
            )
            continue
        mma = ", ".join(r["wgmma_shapes"]) or "no wgmma"
        sp, at, built = r["specialization"], r["launch"], r["descriptors"]
        aligned = "" if sp["aligned_pointers"] == sp["pointers"] else f"{sp['aligned_pointers']} of "
        ones = "".join(f", {n}=1 constant" for n in sp["constexpr_ones"])
        print(
            f"compiled {r['kernel']} for {r['target']} in {r['seconds']:.1f} s: {r['bytes']:,} bytes, "
            f"{r['shared']:,} bytes of shared memory, {r['registers']} registers, {r['stack']:,} bytes of "
            f"stack and {r['local_bytes']:,} bytes of local memory (spills) per thread, "
            f"{r['ctas_per_sm']} CTA{'s' if r['ctas_per_sm'] != 1 else ''} per SM; GEMMs: {mma}, "
            f"{_tma(r['tma'], built)}; as launched: {aligned}pointers 16-byte aligned, "
            f"T'={at['n_tokens']}, {at['n_programs']} programs{ones}"
        )
        for loop in r["loops"]:
            print(f"  {loop_line(loop)}")
        for kind in ("move", "sum"):
            for loop in r[f"{kind}_loops"]:
                print(f"  {row_line(kind, loop, 32 * r['tiles']['num_warps'])}")
    return wrote


def _tma(tma: bool, built: dict) -> str:
    if not tma:
        return "no TMA"
    return f"TMA (tensor descriptors built: {built['program']} at a program's start, {built['item']} by its work items)"


def loop_line(loop: dict) -> str:
    """One GEMM main loop of a compile's report (``rdepc.codegen.sass.Loop``), in words."""
    spills = loop["spill_loads"] + loop["spill_stores"]
    return (
        f"GEMM loop {'/'.join(loop['shapes'])} at {loop['start']}: {loop['instructions']} instructions per "
        f"iteration, {loop['hgmma']} HGMMA, {loop['tma_loads']} TMA loads, {loop['r2ur']} R2UR, "
        f"{spills} spill loads/stores, wgmma wait depth {loop['wait_depth']}"
    )


def row_line(kind: str, loop: dict, threads: int) -> str:
    """One loop that copies rows (``move``) or sums them (``sum``) of a compile's report
    (``rdepc.codegen.sass.RowLoop``), in words: what a program has in flight before its first
    FMA or store waits for a row."""
    spills = loop["spill_loads"] + loop["spill_stores"]
    return (
        f"row loop ({kind}) at {loop['start']:#x}: {loop['loads_ahead']} of its {loop['loads']} loads a thread "
        f"(16 bytes each) before the first use ({loop['loads_ahead'] * 16 * threads // 1024} KB in flight a program), "
        f"{spills} spill loads/stores"
    )
