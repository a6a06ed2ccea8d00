"""The planner's compute figures: the FLOPs of one layer's expert GEMMs per rank and their
time at the profile's dense rate — the routed experts at the busiest owner (its expected
load and its worst case, as the transport figures count rows) and the shared experts,
which every front-end computes for each of its own T tokens. The backward does two GEMMs
for each of the forward's (dX and dW); under ``activations pre recompute`` the routed
experts' backward also runs GEMM1 again (its gate and up projections, or up alone)."""

from __future__ import annotations

import sympy as sp
from rdepc.passes.plan_records import ComputePlan
from rdepc.passes.plan_symbols import E_max, Env, F, F_gpu, H, R_max, T, mu

from rdepc.ir.spec import LayerSpec

N_sh = sp.Symbol("N_sh", positive=True, integer=True)  # shared experts
F_sh = sp.Symbol("F_sh", positive=True, integer=True)  # a shared expert's ffn width


def compute_plan(env: Env, spec: LayerSpec) -> ComputePlan:
    mats = spec.expert.matrices
    per_row = 2 * mats * H * F
    how = f"{2 * mats}·H·F FLOPs a row" + (" (gate, up, down)" if mats == 3 else " (up, down)")
    rows = sp.Min(E_max * mu, R_max)
    routed = env.fig("compute.routed", rows * per_row, "FLOP", f"min(E_max·μ, R_max) rows at the busiest owner × {how}")
    worst = env.fig("compute.routed_worst", R_max * per_row, "FLOP", f"R_max rows × {how}")
    routed_t = env.fig("compute.routed_time", routed.formula / F_gpu, "s", "the same at F_gpu")
    worst_t = env.fig("compute.routed_worst_time", worst.formula / F_gpu, "s", "the same at F_gpu")
    gemm1 = 2 * (mats - 1) * H * F  # GEMM1's FLOPs a row: every matrix but down
    recompute = spec.pre_activations == "recompute"
    bwd_row = 2 * per_row + (gemm1 if recompute else 0)
    bwd_how = "2× the forward (dX and dW)"
    if recompute:
        bwd_how += f" + GEMM1 again, {2 * (mats - 1)}·H·F a row (recompute)"
    bwd = env.fig("compute.routed_backward", rows * bwd_row, "FLOP", f"min(E_max·μ, R_max) rows × {bwd_how}")
    bwd_worst = env.fig("compute.routed_backward_worst", R_max * bwd_row, "FLOP", f"R_max rows × {bwd_how}")
    bwd_t = env.fig("compute.routed_backward_time", bwd.formula / F_gpu, "s", "the same at F_gpu")
    bwd_worst_t = env.fig("compute.routed_backward_worst_time", bwd_worst.formula / F_gpu, "s", "the same at F_gpu")
    shared = shared_t = None
    if spec.shared is not None:
        sh = spec.shared
        env.values[N_sh], env.exact[N_sh] = sh.count, sp.Integer(sh.count)
        env.values[F_sh], env.exact[F_sh] = int(sh.fn.F), sp.Integer(int(sh.fn.F))
        s_mats = sh.fn.matrices
        words = f"T tokens × N_sh·{2 * s_mats}·H·F_sh" + (" + H (the gate)" if sh.gate else "")
        flops = T * N_sh * 2 * s_mats * H * F_sh + (2 * T * H if sh.gate else 0)
        shared = env.fig("compute.shared", flops, "FLOP", f"{words}: every front-end, its own tokens")
        shared_t = env.fig("compute.shared_time", flops / F_gpu, "s", "the same at F_gpu")
    return ComputePlan(routed, worst, routed_t, worst_t, bwd, bwd_worst, bwd_t, bwd_worst_t, shared, shared_t)
