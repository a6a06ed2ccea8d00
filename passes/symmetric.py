"""The symmetric heap of one layer per rank, region by region, exactly as docs/memory.md
defines it: :func:`symmetric_formulas` as sympy formulas, :func:`symmetric_plan` as plain
ints (the memory-plan pass is checked against it), and the figures of ``rdepc plan``."""

from __future__ import annotations

import sympy as sp
from rdepc.passes.plan_records import SymmetricPlan
from rdepc.passes.plan_symbols import (
    SEGMENTED,
    B,
    E_max,
    Env,
    H,
    K,
    L,
    R_max,
    S,
    T,
    W,
    a,
    d,
    pad,
    sb,
    spec_values,
)

from rdepc.ir import sizes
from rdepc.ir.sizes import BM
from rdepc.ir.spec import LayerSpec


def done_counters_expr(strategy: str, balanced: bool = False) -> sp.Expr:
    """Done counters per rank (the ``flags`` buffer's words): :func:`rdepc.ir.sizes.done_counters`
    applied to symbols, with n = ⌈R_max/S⌉ segments of the busiest owner (bulk: one), a
    return ring iff segmented and B·S < T·K, and ``balanced`` (``balance replicate``: its
    five balance tasks) as memplan.flag_slots evaluates the same rule."""
    if strategy in SEGMENTED:
        ring = sp.Piecewise((sp.Integer(1), B * S < T * K), (sp.Integer(0), True))
        return sizes.done_counters(W, sp.ceiling(T / BM), sp.ceiling(R_max / S), ring, int(balanced))
    if strategy == "bulk":
        return sizes.done_counters(W, sp.ceiling(T / BM), sp.Integer(1), sp.Integer(0), int(balanced))
    raise ValueError(f"unknown strategy '{strategy}'")


def symmetric_formulas(
    strategy: str,
    keyed: bool = False,
    dedup: bool = False,
    resend: bool = False,
    bwd_fp8: bool = False,
    balanced: bool = False,
) -> dict[str, dict[str, sp.Expr]]:
    """docs/memory.md as formulas: ``{"S", "B", "R_ret", "buffers", "forward", "forward_backward"}``.
    Bulk uses ``S = R_max`` (:func:`rdepc.passes.plan_symbols.rows_per_owner_expr`); ``keyed`` admission adds the keys,
    ``dedup`` the backward's sideband and gate gradients, ``resend`` the input rows the backward sends again,
    ``bwd_fp8`` the backward's rows as fp8 with their scales, ``balanced`` (``balance replicate``)
    five done counters a rank more."""
    done = done_counters_expr(strategy, balanced)
    if strategy in SEGMENTED:
        Sx, Bx, R_ret = S, B, B * S
        # the return ring rotates (claims, unpacks) only when its B·S rows cannot hold all T·K
        ids, ring = sp.Piecewise((R_ret, B * S < T * K), (sp.Integer(0), True)), True
    else:
        Sx, Bx, R_ret = R_max, sp.Integer(1), T * K
        ids, ring = sp.Integer(0), False  # every row lands at its (token, slot) place: nothing to decode
    heap = sizes.heap_buffers(
        W,
        T,
        K,
        E_max,
        H,
        Sx,
        Bx,
        d,
        a,
        sb,
        done,
        R_ret=R_ret,
        ids=ids,
        ring=ring,
        keyed=keyed,
        dedup=dedup,
        resend=resend,
        bwd_fp8=bwd_fp8,
    )
    # piecewise_fold: a ring's row_ids as one Piecewise of bytes, as docs/memory.md writes them
    buf = {}
    for _, name, n, _, _ in heap:
        n = sp.Integer(n) if isinstance(n, int) else n
        buf[name] = pad(sp.piecewise_fold(n) if name.endswith("_ids") else n)
    control = sum((buf[k] for k in ("tokens", "counts", "offsets", "admitted", "keys", "flags")), sp.Integer(0))
    ret = buf["return"] + buf["return_ids"]
    fwd = {"control": control, "payload": buf["payload"], "sideband": buf["sideband"], "return": ret}
    fwd["total"] = sum(fwd.values(), sp.Integer(0))
    fb = {k: v for k, v in fwd.items() if k != "total"}
    fb["bwd_control"] = buf["bwd_flags"]
    fb["bwd_payload"] = buf["bwd_payload"] + buf["bwd_scales"] + buf["bwd_row_ids"] + buf["bwd_sideband"]
    fb["bwd_payload"] += buf["bwd_inputs"]
    fb["bwd_return"] = buf["bwd_return"] + buf["bwd_return_scales"] + buf["bwd_return_ids"] + buf["bwd_dgate"]
    fb["total"] = fwd["total"] + fb["bwd_control"] + fb["bwd_payload"] + fb["bwd_return"]
    return {"S": Sx, "B": Bx, "R_ret": R_ret, "buffers": buf, "forward": fwd, "forward_backward": fb}


_BUFFER_WHAT = {
    "tokens": "W int64: the tokens T' each front-end brings to the call",
    "counts": "W·E_max int32 rows each source sends to each local expert",
    "offsets": "W·E_max int32 write bases published back to each source",
    "admitted": "W·E_max int32 admitted rows per (owner, local expert)",
    "keys": "W·T·K int64 admission keys published to the owner (keyed admission; else 0)",
    "flags": "int64 done counters of the tasks one rank runs (ready flags and credits): "
    "3 + ⌈T/128⌉ + (2W+2)·n + W·n if the return ring rotates, n = ⌈R_max/S⌉ segments (bulk: 1)",
    "payload": "B·S dispatched rows of H·d bytes",
    "sideband": "B·S rows of sb bytes (row_id, local expert, gate, scale)",
    "return": "R_ret returned rows of H·a bytes",
    "return_ids": "int64 row_id per return-ring row (R_ret·8 if the ring rotates, else 0): unpacks place rows by it",
    "bwd_flags": "int64 done counters of the backward's tasks: the forward's, and one weight-gradient task per owner",
    "bwd_payload": "B·S g'·dL/dy rows of H·a bytes (backward fp8: H), front-end → owner",
    "bwd_scales": "backward fp8: B·S rows of ⌈H/128⌉ fp32 scales beside the backward payload (else 0)",
    "bwd_row_ids": "B·S int64 row_ids of the backward payload rows",
    "bwd_sideband": "dedup: B·S rows of 12 bytes (g', links) beside the backward payload (else 0)",
    "bwd_inputs": "activations input resend: B·S input rows x of H·d bytes sent again (else 0)",
    "bwd_return": "R_ret dL/dx rows of H·a bytes (backward fp8: H), owner → front-end",
    "bwd_return_scales": "backward fp8: R_ret rows of ⌈H/128⌉ fp32 scales beside the dL/dx rows (else 0)",
    "bwd_return_ids": "int64 row_id per backward return-ring row (as return_ids)",
    "bwd_dgate": "dedup: T·K fp32 dL/dg' per (token, slot), owner → front-end (else 0)",
}

_REGION_WHAT = {
    "control": "tokens, counts, offsets, admitted, flags (each padded)",
    "payload": _BUFFER_WHAT["payload"],
    "sideband": _BUFFER_WHAT["sideband"],
    "return": "R_ret returned rows of H·a bytes, then their int64 row_ids if the ring rotates (each padded)",
    "bwd_control": _BUFFER_WHAT["bwd_flags"],
    "bwd_payload": "B·S g'·dL/dy rows of H·a bytes, their int64 row_ids, dedup's (g', links), re-sent input rows "
    "(each padded)",
    "bwd_return": "R_ret dL/dx rows of H·a bytes, their int64 row_ids if the ring rotates, dedup's dL/dg' "
    "(each padded)",
    "total": "sum of the regions",
}


def symmetric_plan(
    spec: LayerSpec,
    strategy: str | None = None,
    *,
    rows: int | None = None,
    buffers: int | None = None,
    hw: str = "h100",
) -> dict:
    """The symmetric heap of one layer per rank, exactly as docs/memory.md defines it (a
    ``balance replicate`` layer's: its physical layer's, as compile builds it).

    ``strategy`` is bulk, pipelined, deep, auto (the strategy, S and B the scheduler chooses
    on the profile ``hw``, as compile does) or None (the spec's own schedule, resolved the same
    way). ``rows`` and ``buffers`` override the segment's S and B (for a schedule that chooses
    them).
    Returns plain ints::

        {"strategy", "S", "B", "R_ret", "buffers": {name: padded bytes},
         "forward": {"control", "payload", "sideband", "return", "total"},
         "forward_backward": {... forward regions, "bwd_control", "bwd_payload", "bwd_return", "total"}}
    """
    from rdepc.passes.replicate import physical_layer
    from rdepc.passes.resolve import resolve_strategy

    spec = physical_layer(spec)  # what compile builds (balance replicate: the slots are experts)
    resolved = resolve_strategy(spec, strategy, hw)
    strategy = resolved.strategy
    rows, buffers = resolved.S if rows is None else rows, resolved.B if buffers is None else buffers
    env = Env(spec_values(spec, strategy, rows, buffers), spec.capacity.policy)
    fm = spec_formulas(spec, strategy)
    return {
        "strategy": strategy,
        "S": env.value(fm["S"]),
        "B": env.value(fm["B"]),
        "R_ret": env.value(fm["R_ret"]),
        "buffers": {k: env.value(v) for k, v in fm["buffers"].items()},
        "forward": {k: env.value(v) for k, v in fm["forward"].items()},
        "forward_backward": {k: env.value(v) for k, v in fm["forward_backward"].items()},
    }


def spec_formulas(spec: LayerSpec, strategy: str) -> dict[str, dict[str, sp.Expr]]:
    """:func:`symmetric_formulas` with the options ``spec`` chooses."""
    return symmetric_formulas(
        strategy,
        spec.keyed_admission,
        spec.dedup,
        spec.input_activations == "resend",
        spec.precision.backward_fp8,
        spec.balance.kind == "replicate",
    )


def symmetric_figures(env: Env, strategy: str, key: str, spec: LayerSpec) -> SymmetricPlan:
    sideband = spec.route_row.sideband
    fm = spec_formulas(spec, strategy)
    what = dict(_BUFFER_WHAT, sideband=f"B·S rows of sb bytes ({', '.join(sideband)})")
    region_what = dict(_REGION_WHAT, sideband=what["sideband"])
    segmented = strategy in SEGMENTED
    s_what = "S_bulk = max_q R_q rows, one slot"
    if segmented:
        chosen = "segment statement" if spec.segment is not None else "chosen by the cost model: no segment statement"
        s_what = f"rows per ring slot ({chosen})"
    r_what = "B·S: a ring of B slots of S rows" if segmented else "T·K: every sent row lands in its own place"
    return SymmetricPlan(
        strategy,
        env.fig(f"{key}.S", fm["S"], "rows", s_what),
        env.fig(f"{key}.B", fm["B"], "", "ring slots" if segmented else "one slot (bulk)"),
        env.fig(f"{key}.R_ret", fm["R_ret"], "rows", r_what),
        tuple(env.fig(f"{key}.buffers.{k}", v, "B", what[k]) for k, v in fm["buffers"].items()),
        tuple(env.fig(f"{key}.forward.{k}", v, "B", region_what[k]) for k, v in fm["forward"].items()),
        tuple(
            env.fig(f"{key}.forward_backward.{k}", v, "B", region_what[k]) for k, v in fm["forward_backward"].items()
        ),
        env.fig(
            f"{key}.private_total",
            fm["forward_backward"]["total"] * L,
            "B",
            "forward+backward heap × L (a private ring per layer)",
        ),
        env.fig(
            f"{key}.shared_total",
            fm["forward_backward"]["total"],
            "B",
            "forward+backward heap once (one ring shared by layers run one after another)",
        ),
        env.fig(
            f"{key}.inference_private_total",
            fm["forward"]["total"] * L,
            "B",
            "forward heap × L: what modules built with inference=True allocate (a private ring per layer)",
        ),
        env.fig(f"{key}.inference_shared_total", fm["forward"]["total"], "B", "forward heap once (one shared ring)"),
    )
