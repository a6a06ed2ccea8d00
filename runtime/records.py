"""What a call left in its control words, read back as exceptions.

The kernel writes two kinds of record into the first ``CTL_TICKETS`` words of its private
control block (``rdepc.codegen.lower.CONTROL``):

- the **error record** (``err_*``): the first fatal error — a wait that expired, an owner
  overflow, a row_id that decodes to another rank. Every program stops at its next
  ticket; the host raises :class:`KernelError`;
- the **input checks** (``bad_*``, ``dup_*``): route rows whose expert id is out of range,
  tokens that list one expert twice, non-finite gates, each counted with the first
  offender's key. The call completes (such a row is routed nowhere); the host raises
  ``ValueError`` naming the first offender.

Nothing here touches the device: the module hands over the words once they are on the
host (at once under the interpreter; on a GPU when the copy it queued has landed).
"""

from __future__ import annotations

from rdepc.diagnostics import layer_prefix
from rdepc.ir.contract import CONTROL, ERRORS, KernelContract

AT = {name: i for i, name in enumerate(CONTROL)}


class KernelError(RuntimeError):
    """The forward kernel stopped on an error it recorded; ``record`` holds the kernel's own
    record: code, what, call (epoch), entry and task, rank, queue (role), segment and, for
    an expired wait, the flag waited for (its task and rank) with the value seen and the
    value expected."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record

    def __reduce__(self):  # crosses processes (rdepc.runtime.ranks.spawn) with its record
        return (KernelError, (str(self), self.record))


def kernel_error(
    contract: KernelContract,
    words: list[int],
    mode: str,
    spin_bound: int,
    backward: bool = False,
    gemm_programs: int = 0,
) -> KernelError | None:
    """The call's fatal error, or None (``backward``: of a backward call, whose entries are
    the backward's table). ``gemm_programs``: split mode's GEMM kernel programs per call,
    which its ``gemm_programs`` word counts as they start: an expired wait whose call
    started fewer says the two kernels did not run at once."""
    names = ("err_code", "err_entry", "err_dep", "err_rank", "err_epoch", "err_resource", "err_segment")
    code, entry, dep, rank, epoch, queue, segment = (words[AT[n]] for n in names)
    seen, expected = words[AT["err_seen"]], words[AT["err_expected"]]
    if code == 0:
        return None
    p = contract
    names, table = (p.bwd_names, p.bwd_table) if backward else (p.names, p.table)

    def task(i: int) -> str:
        return f"task #{i} ({names[i]})" if 0 <= i < len(names) else f"task #{i}"

    role = "any task (unified)" if mode == "unified" else ("transport kernel", "GEMM kernel")[queue % 2]
    seg = f", segment {segment}" if segment >= 0 else ""
    flag_rank = table[dep].rank if code == 1 and 0 <= dep < len(table) else None
    if code == 1:
        what = (
            f"{task(entry)} on rank {rank} ({role}{' programs' if mode == 'unified' else ''}{seg}) waited "
            f"{spin_bound} spins for the done "
            f"flag of {task(dep)} on rank {flag_rank}: saw {seen}, expected {expected}"
        )
    elif code == 2:
        what = f"owner r{rank} admitted {seen} rows, more than the plan's bound R_q = {expected}"
    elif code == 3:
        what = f"{task(entry)}{seg}: row_id {seen} decodes to another rank than r{rank}"
    else:
        what = f"{task(entry)}: {ERRORS.get(code, f'error code {code}')}"
    record = {
        "code": code,
        "what": ERRORS.get(code, f"error code {code}"),
        "call": epoch,
        "entry": entry,
        "pass": "backward" if backward else "forward",
        "task": names[entry] if 0 <= entry < len(names) else None,
        "rank": rank,
        "queue": queue,
        "role": role,
        "segment": segment,
        "flag": dep if code == 1 else None,
        "flag_task": names[dep] if code == 1 and 0 <= dep < len(names) else None,
        "flag_rank": flag_rank,
        "seen": seen,
        "expected": expected,
    }
    if mode == "split" and code == 1 and gemm_programs:
        started = words[AT["gemm_programs"]] - (epoch - 1) * gemm_programs
        record["gemm_programs_started"] = started
        if started < gemm_programs:
            what += (
                f"; {started} of the GEMM kernel's {gemm_programs} programs had started: split mode's two kernels "
                "did not run at once (another kernel held the GPU's SMs, or the GEMM kernel was held back)"
            )
    kernel = "backward" if backward else "forward"
    return KernelError(f"{layer_prefix(p.layer)}: the {kernel} kernel stopped in call {epoch}: {what}", record)


def input_error(
    contract: KernelContract, words: list[int], name: str, ids, gates, per_rank: bool, gates_from: str | None = None
) -> ValueError | None:
    """The call's offending inputs, or None. ``ids`` and ``gates`` are the call's own
    ([W, T', K], or [T', K] on a per-rank backend): the first offender's value is read from
    them (only here, on the error path). ``gates_from``: what made the gates, when the
    caller did not pass them (RDEPMoE's router), named instead of ``topk_weights``."""
    p = contract
    TK = p.T * p.K

    def first(kind: str) -> tuple[str, int, tuple]:
        """Where the first offender is: its token as the call's layout names it (one process:
        rank and token, and its place among the call's tokens, rank by rank, as a flat [N, H]
        input was split), its slot, its index into ``ids``."""
        idx = p.W * TK - words[AT[f"{kind}_at"]]
        r, t, k = idx // TK, idx % TK // p.K, idx % p.K
        if per_rank:
            return f"token {t}", k, (t,)
        return f"rank {r} token {t} (token {r * ids.shape[-2] + t} in order)", k, (r, t)

    why = []
    if n := words[AT["bad_ids"]]:
        token, k, at = first("bad_ids")
        v = int(ids[(*at, k)])
        why.append(
            f"expert ids must lie in [0, {p.E}) or be -1 (no expert): {n} route rows out of range, the first {token} "
            f"slot {k} (id {v})"
        )
    if n := words[AT["dup_tokens"]]:
        token, _, at = first("dup_tokens")
        row = [int(v) for v in ids[at].tolist()]
        why.append(
            f"{n} tokens list one expert twice in their top-K, the first {token} (experts {row}); the plan "
            "bounds an owner's rows by W*T*min(K, E_loc), which holds for distinct top-K experts"
        )
    if n := words[AT["bad_gates"]]:
        token, k, at = first("bad_gates")
        v = float(gates[(*at, k)])
        where = f"the first {token} slot {k} ({v})"
        if gates_from is None:
            why.append(f"topk_weights has {n} non-finite gates (NaN or inf), {where}")
        else:
            why.append(f"{n} non-finite gates (NaN or inf), {where}, from {gates_from}")
    return ValueError(f"{name}: " + "; ".join(why)) if why else None


__all__ = ["KernelError", "input_error", "kernel_error"]
