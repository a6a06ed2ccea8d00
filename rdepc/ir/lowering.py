"""The expert GEMMs' lowering: the Triton GEMM kernel's tasks (``triton``) or torch's grouped
GEMM between two launches of the transport kernel (``library``, phased mode: see
``rdepc.runtime.library``). What the library lowering serves, and which one a module runs,
decided here for the compiler, the planner and the runtime alike."""

from __future__ import annotations

from rdepc.diagnostics import UsageError, layer_prefix

GEMM_LOWERINGS = ("triton", "library")
LIBRARY_MODE = "phased"  # the library's GEMMs run between the transport kernel's two launches
# Where a lowering asked for comes from (the lowering pass's reasons): asked for, it holds
# under the interpreter too; the cost model's choice is a GPU's.
ASKED = ("command line --gemm", "spec: schedule ..., gemm")


def library_refusals(strategy: str) -> list[str]:
    """Why the library lowering cannot run a layer (empty: it can): each construct it does
    not take yet, in words. It runs each owner's rows as one grouped GEMM, so one segment per
    owner (bulk)."""
    if strategy != "bulk":
        return [f"the {strategy} schedule moves an owner's rows in segments (the library runs bulk)"]
    return []


def contract_refusals(contract) -> list[str]:
    """:func:`library_refusals` of a kernel contract."""
    return library_refusals(contract.strategy)


def choose_gemm(given: str | None, contract, interpret: bool, tuned: dict | None = None) -> tuple[str, str]:
    """The lowering a module runs and where it comes from: ``given``; the contract's where
    the command line or the spec asked for it; under the interpreter ``triton`` (it exists
    to run the Triton kernels: the library is asked for); ``rdepc tune``'s fastest on this
    GPU (``tuned``: its launch record); else the compiler's choice. A UsageError names why a
    given ``library`` cannot run the layer."""
    if given is not None:
        if given not in GEMM_LOWERINGS:
            raise UsageError(f"unknown GEMM lowering '{given}' (known: {', '.join(GEMM_LOWERINGS)})")
        why = contract_refusals(contract) if given == "library" else []
        if why:
            raise UsageError(
                f"{layer_prefix(contract.layer)}: the library GEMM lowering cannot run it: {'; '.join(why)}"
            )
        return given, "given"
    if contract.gemm_why.startswith(ASKED):
        return contract.gemm, contract.gemm_why
    if interpret:
        return "triton", "the interpreter runs the Triton kernels"
    if tuned is not None and tuned.get("gemm") in GEMM_LOWERINGS:
        return tuned["gemm"], f"tuned ({tuned['ms']:.3f} ms; rdepc tune)"
    return contract.gemm, contract.gemm_why


__all__ = ["ASKED", "GEMM_LOWERINGS", "LIBRARY_MODE", "choose_gemm", "contract_refusals", "library_refusals"]
