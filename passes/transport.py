"""The transport analysis of ``rdepc plan``: bytes and time per stage for the busiest rank,
expected and worst case, the barrier budget (Prop. B.7) and the overlap rule (Table 5);
:func:`transport_bytes`, the bytes of one call's transport (also ``rdepc run``'s count); and
what ``dedup`` saves under uniform routing."""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp
from rdepc.passes.plan_records import DedupPlan, Stage, TransportPlan
from rdepc.passes.plan_symbols import (
    BARRIER_PEER_RANGE,
    BARRIERS_PER_SEGMENT,
    FP32,
    INT32,
    INT64,
    OVERLAP_BYTES,
    OVERLAP_FLOPS,
    SEGMENTED,
    B_eff,
    E,
    E_max,
    Env,
    F,
    F_gpu,
    Figure,
    H,
    K,
    R_max,
    S,
    T,
    W,
    a,
    d,
    mu,
    sb,
    spec_int,
    t_b,
)
from rdepc.passes.sampled_routing import owners_per_token_expr

from rdepc.ir.sizes import block_scales
from rdepc.ir.spec import LayerSpec


def _max(x: sp.Expr, y: sp.Expr) -> sp.Expr:
    return sp.Max(x, y, evaluate=False)  # evaluated when the values are in


def transport_plan(env: Env, strategy: str, resend: bool = False, bwd_fp8: bool = False) -> TransportPlan:
    """``resend``: the backward's dispatch also sends each row's input again (H·d bytes);
    ``bwd_fp8``: the backward's rows go as fp8 e4m3 with an fp32 scale per 128 columns."""
    disp_row = H * d + sb
    expected_owner = E_max * mu
    admitted = sp.Min(expected_owner, R_max)  # a capacity below the mean load caps it
    segmented = strategy in SEGMENTED
    stages = _stages(env, admitted, disp_row, resend, bwd_fp8)
    segs = sp.ceiling(admitted / S) if segmented else sp.Integer(1)
    return TransportPlan(
        stages,
        *_barriers(env, segs, segmented),
        env.fig("transport.segment_time", S * disp_row / B_eff, "s", "one segment's dispatch, S·(H·d + sb)/B_eff")
        if segmented
        else None,
        *_overlap(env),
    )


def _stages(env: Env, admitted: sp.Expr, disp_row: sp.Expr, resend: bool, bwd_fp8: bool) -> tuple[Stage, ...]:
    """The forward's dispatch and return, then the backward's: bytes and time of each for the
    busiest rank, ``admitted`` the rows an owner expects."""
    ret_row = H * a
    grad_row, grad_bytes = (H + 4 * block_scales(H), "H + 4·⌈H/128⌉") if bwd_fp8 else (ret_row, "H·a")
    bwd_row, bwd_what = grad_row, f"g'·dL/dy rows, front-end → owner: T·K rows of {grad_bytes} bytes"
    if resend:
        bwd_row = grad_row + H * d
        bwd_what = f"g'·dL/dy rows and the input rows again, front-end → owner: T·K rows of {grad_bytes} + H·d bytes"

    def stage(name: str, what: str, row: sp.Expr, front_to_owner: bool) -> Stage:
        key = f"transport.{name}"
        front = T * K * row
        owner_exp, owner_worst = admitted * row, R_max * row
        send_e, send_w = (front, front) if front_to_owner else (owner_exp, owner_worst)
        recv_e, recv_w = (owner_exp, owner_worst) if front_to_owner else (front, front)
        return Stage(
            name,
            what,
            env.fig(f"{key}.row_bytes", row, "B", "bytes per row on the wire"),
            env.fig(f"{key}.send_expected", send_e, "B", "bytes the busiest rank sends, uniform routing"),
            env.fig(f"{key}.send_worst", send_w, "B", "bytes the busiest rank sends, worst case"),
            env.fig(f"{key}.recv_expected", recv_e, "B", "bytes the busiest rank receives, uniform routing"),
            env.fig(f"{key}.recv_worst", recv_w, "B", "bytes the busiest rank receives, worst case"),
            env.fig(f"{key}.time_expected", _max(send_e, recv_e) / B_eff, "s", "max(send, recv) / B_eff"),
            env.fig(f"{key}.time_worst", _max(send_w, recv_w) / B_eff, "s", "max(send, recv) / B_eff"),
        )

    return (
        stage("dispatch", "payload + sideband, front-end → owner: T·K rows of H·d + sb bytes", disp_row, True),
        stage("return", "expert outputs, owner → front-end: rows of H·a bytes", ret_row, False),
        stage("bwd_dispatch", bwd_what, bwd_row, True),
        stage("bwd_return", f"dL/dx rows, owner → front-end: rows of {grad_bytes} bytes", grad_row, False),
    )


def _barriers(env: Env, segs: sp.Expr, segmented: bool) -> tuple[Figure, ...]:
    """The barrier budget (Prop. B.7): one barrier, at both ends of t_b's range, per segment,
    the segments and the layer's."""
    lo, hi = BARRIER_PEER_RANGE
    return (
        env.fig("transport.barrier.per_barrier", W * t_b, "s", "one phase barrier: W peer touches (Prop. B.7)"),
        env.fig("transport.barrier.per_barrier_low", (W * t_b).subs(t_b, lo), "s", "at 50 ns per peer (Prop. B.7)"),
        env.fig("transport.barrier.per_barrier_high", (W * t_b).subs(t_b, hi), "s", "at 100 ns per peer (Prop. B.7)"),
        env.fig(
            "transport.barrier.per_segment",
            BARRIERS_PER_SEGMENT * W * t_b,
            "s",
            "4 barriers per segment (Prop. B.7)",
        ),
        env.fig(
            "transport.barrier.segments",
            segs,
            "",
            "segments the busiest owner runs per layer, ceil(min(E_max·μ, R_max)/S)"
            if segmented
            else "bulk: one exchange",
        ),
        env.fig(
            "transport.barrier.per_layer",
            segs * BARRIERS_PER_SEGMENT * W * t_b,
            "s",
            "segments × 4 barriers × W × t_b, forward",
        ),
    )


def _overlap(env: Env) -> tuple[Figure, Figure, Figure]:
    """The overlap rule (Table 5): the smallest ffn width whose compute hides the transport,
    the spec's, and its margin."""
    return (
        env.fig(
            "transport.min_ffn",
            sp.Rational(OVERLAP_BYTES, OVERLAP_FLOPS) * F_gpu / B_eff,
            "",
            "Table 5: smallest D_ff with grouped-GEMM compute ≥ transport, (10/18)·F_gpu/B_eff",
        ),
        env.fig("transport.ffn", F, "", "the spec's expert ffn width"),
        env.fig(
            "transport.ffn_margin",
            F / (sp.Rational(OVERLAP_BYTES, OVERLAP_FLOPS) * F_gpu / B_eff),
            "x",
            "F over the minimum",
        ),
    )


def transport_bytes(spec: LayerSpec, payload_rows, route_rows, returned_rows, dedup: bool | None = None, sizes=None):
    """(dispatch, return) bytes of one call's transport: ``payload_rows`` rows sent with their
    data (and fp8 scales), every one of ``route_rows`` accepted route rows with the rest of its
    sideband (under ``dedup``, default the spec's, with its links), ``returned_rows`` rows of
    H·a bytes back. ``sizes`` (H, d, a, sb): the spec's, or the planner's symbols; the counts
    ints or sympy expressions alike (the planner's figures and ``rdepc run``'s counts)."""
    rr = spec.route_row
    if sizes is None:
        sizes = (
            spec_int(spec.shape.H, spec),
            spec.precision.dispatch.bytes,
            spec.precision.dtype.bytes,
            rr.sideband_bytes,
        )
    H_, d_, a_, sb_ = sizes
    scale = rr.field_bytes("scale") if "scale" in rr.sideband else 0
    on = spec.dedup if dedup is None else dedup
    links = rr.field_bytes("links") if on and "links" not in rr.sideband else 0  # in sb when the spec has it
    return payload_rows * (H_ * d_ + scale) + route_rows * (sb_ - scale + links), returned_rows * H_ * a_


def dedup_plan(env: Env, spec: LayerSpec, per_rank: Sequence[int]) -> DedupPlan:
    owners = owners_per_token_expr(E, K, per_rank)
    send, back = transport_bytes(spec, T * owners, T * K, T * owners, True, (H, d, a, sb))
    return DedupPlan(
        spec.dedup,
        env.fig(
            "dedup.owners_per_token",
            owners,
            "",
            "expected distinct owners of a token's K experts, uniform routing: Σ_q 1 - C(E - E_q, K)/C(E, K)",
        ),
        env.fig("dedup.redundant", 1 - owners / K, "frac", "route rows that repeat a (token, owner) pair"),
        env.fig(
            "dedup.dispatch_send",
            send,
            "B",
            "bytes a front-end dispatches with dedup: a payload row (and its scales) per (token, owner), "
            "the rest of the sideband and the links per slot",
        ),
        env.fig(
            "dedup.return_recv",
            back,
            "B",
            "bytes a front-end receives back with dedup, one summed row per (token, owner)",
        ),
        env.fig(
            "dedup.bwd_dispatch_send",
            T * owners * H * a + T * K * (INT64 + FP32 + 2 * INT32),
            "B",
            "backward: a dL/dy row per (token, owner), and per slot its row_id, g' and links",
        ),
        env.fig(
            "dedup.bwd_return_recv",
            T * owners * H * a + T * K * FP32,
            "B",
            "backward: a summed dL/dx row per (token, owner), and per slot its fp32 dL/dg'",
        ),
    )
