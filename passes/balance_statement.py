"""Elaboration of the ``balance`` statement: exact-load replication of hot experts.

    balance none                                  # the default: every expert on its home only
    balance replicate(slots = 2, min_rows = 64)   # N = 2 redundant slots per rank, U = 64

The semantics are in docs/language.md ('balance'); :mod:`rdepc.ir.balance` solves a plan.
"""

from __future__ import annotations

from rdepc import syntax as S
from rdepc.diagnostics import did_you_mean
from rdepc.ir.spec import Balance, Capacity, Ownership

KINDS = ("none", "replicate")
OPTIONS = ("slots", "min_rows")
USAGE = "e.g. 'balance replicate(slots = 2, min_rows = 64)' or 'balance none'"


def elaborate_balance(
    layer, st: S.Stmt | None, ownership: Ownership, W: int, capacity: Capacity | None
) -> Balance | None:
    """The statement's Balance, or None after reporting its errors on ``layer.diags``.

    ``layer`` is the elaborator's per-layer context (``args``, ``size``, ``diags``, ``spans``).
    """
    if st is None:
        return Balance()
    d = layer.diags
    # One argument: the kind, a bare name (none) or a call with its options (replicate(...)).
    if len(st.args) != 1 or isinstance(st.args[0], S.Keyed):
        d.error("'balance' takes one kind: none or replicate(...)", st.span, USAGE)
        return None
    a = st.args[0]
    v = a.value if isinstance(a, S.Positional) else a
    if isinstance(v, S.Call):
        name, span = v.fn, v.fn_span
    elif isinstance(v, S.Flag | S.Name):
        name, span = v.name if isinstance(v, S.Flag) else v.id, v.span
    else:
        name, span = None, v.span
    if name not in KINDS:
        shown = f"'{name}'" if name else "this"
        d.error(f"unknown balance kind {shown}", span, did_you_mean(name, KINDS) if name else USAGE)
        return None
    if name == "none":
        if isinstance(v, S.Call):
            d.error("'balance none' takes no options", v.span, USAGE)
            return None
        return Balance()
    if not isinstance(v, S.Call):
        d.error("'balance replicate' needs its slots and min_rows", v.span, USAGE)
        return None
    given: dict[str, S.KwArg] = {}
    for kw in v.kwargs:
        if kw.name not in OPTIONS:
            d.error(f"unknown option '{kw.name}' to replicate", kw.name_span, did_you_mean(kw.name, OPTIONS))
        elif kw.name in given:
            d.error(f"'{kw.name}' given twice to replicate", kw.name_span, f"first at {given[kw.name].span}")
        else:
            given[kw.name] = kw
            layer.spans[f"balance.{kw.name}"] = kw.span
    missing = [o for o in OPTIONS if o not in given]
    if missing:
        d.error(f"replicate needs {' and '.join(missing)}", v.span, USAGE)
        return None
    slots = layer.size(given["slots"], "balance slots")
    min_rows = layer.size(given["min_rows"], "balance min_rows")
    if slots is None or min_rows is None:
        return None
    # A replica never sits on its expert's home, and a rank holds one copy of an expert at
    # most, so the rank that homes the most experts can fill only E - E_loc slots.
    per_rank = ownership.experts_per_rank(W)
    E, busiest = len(ownership.owner), max(range(W), key=lambda q: (per_rank[q], -q))
    most = E - per_rank[busiest]
    if int(slots.value) > most:
        d.error(
            f"balance slots = {slots} is more than rank {busiest} can fill: it homes {per_rank[busiest]} of the "
            f"{E} experts and a replica never sits on its home, so at most E - E_loc = {most} slots",
            given["slots"].value.span,
            "a single rank homes every expert: there is nowhere to replicate to" if most == 0 else None,
        )
        return None
    if capacity is not None and capacity.policy != "dropless":
        # Admission is per expert instance: a replica would admit rows against a cap of its
        # own, so what a capacity keeps would depend on the plan.
        d.error(
            "balance replicate needs a dropless capacity: a replica would admit rows against its own cap",
            v.span,
            "drop 'capacity', or use 'balance none'",
        )
        return None
    return Balance("replicate", int(slots.value), int(min_rows.value))
