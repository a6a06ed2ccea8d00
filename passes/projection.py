"""A layer's forward and forward + backward per GPU, predicted on a hardware profile, each term
with the assumption behind it, beside published measurements of the same shape
(``rdepc plan``'s projection).

The forward is the scheduler's timeline (passes/schedule.py, the cost model of
passes/cost.py, which charges the expert GEMMs at the share of the rate the Triton kernel was
measured to reach, ``passes/hardware.py``: ``GEMM_EFFICIENCY``), the library lowering's GEMMs
then at its own share. The
backward has no task graph of its own in the model; it is the forward's terms, weighed:
its transport moves the same rows (dL/dy out, dL/dx back), its GEMMs do twice the forward's
FLOPs (dX and dW), its scatter mirrors the combine, and nothing in it overlaps.

Every figure is a prediction. Held against the newest lease of each case at the emulation's
rates (bench/results/model-error), the model predicts bulk split's call at 4,096 tokens within 0.85-1.06x,
but a segmented schedule's at 0.43-0.72x (its roles overlap less than the model's timeline
says) and the unified kernel's at 0.38-0.71x: read a segmented projection as a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from rdepc.passes.hardware import GEMM_EFFICIENCY, profile

from rdepc.ir.graph import Schedule

# The largest task graph ``rdepc plan`` schedules for its projection and its schedule warnings:
# about 2 s on one CPU core (Moonlight's pipelined graph has 10,264 tasks, NVL72's 129,832).
PLAN_TASKS = 50_000


@dataclass(frozen=True)
class Term:
    name: str
    seconds: float
    assumption: str


@dataclass(frozen=True)
class Published:
    """A measured figure of another system, for the shape and node it was measured on."""

    system: str
    shape: tuple[int, int, int, int, int, int]  # W, T per rank, H, F, E, K
    gpu: str  # the hardware profile it ran on
    forward_tflops: float  # per GPU
    backward_tflops: float
    source: str


PUBLISHED = (
    Published(
        "LigerCute EP8 (CUTLASS + NVSHMEM, one persistent kernel)",
        (8, 8192, 2048, 768, 128, 8),
        "h200",
        233.0,
        209.0,
        "linkedin/Liger-Kernel PR #1355, liger_cute_kernels/README.md: Qwen3-30B-A3B on 8xH200, 8,192 tokens "
        "per rank (about 2.65 ms forward, 5.9 ms backward per layer)",
    ),
)


@dataclass(frozen=True)
class Projection:
    hw: str
    strategy: str
    gemm: str
    flops: float  # the forward's useful FLOPs per GPU: flop_coef · H · F per routed row, T·K rows
    forward: tuple[Term, ...]
    backward: tuple[Term, ...]
    published: tuple[Published, ...]

    @property
    def forward_s(self) -> float:
        return sum(t.seconds for t in self.forward)

    @property
    def backward_s(self) -> float:
        return sum(t.seconds for t in self.backward)


def project(sched: Schedule, gemm: str) -> Projection:
    """The projection of ``sched`` (a schedule on its profile) with the expert GEMMs lowered
    by ``gemm``."""
    geo, R = sched.graph.geometry, sched.cost.rates
    busy = dict(sched.stage_busy)
    eff, triton = GEMM_EFFICIENCY[gemm], GEMM_EFFICIENCY["triton"]
    gemms = busy.get("compute", 0.0)  # at the Triton kernel's share of the rate
    moves = busy.get("dispatch", 0.0) + busy.get("return", 0.0)
    local = busy.get("combine", 0.0) + busy.get("unpack", 0.0)
    share = (
        f"the profile's measured expert-GEMM rate: {profile(R.hw).flops.source}"
        if profile(R.hw).flops_is_expert
        else f"{triton.value:.1%} of the profile's rate: {triton.source}"
    )
    link = f"NVLink at min({R.link / 1e9:.0f} GB/s, programs x {R.link_per_sm / 1e9:.1f} GB/s)"
    forward = (
        Term(
            f"{sched.strategy} schedule",
            sched.makespan,
            f"the cost model's timeline on the busiest rank: route, scan, dispatch ({link}), expert GEMMs at "
            f"{R.flops / 1e12:.0f} TFLOP/s over launched m-tiles ({share}), "
            f"return and combine at {R.hbm / 1e12:.2f} TB/s of HBM, overlapped as the schedule overlaps them; "
            f"{sched.programs[0]} + {sched.programs[1]} programs",
        ),
    )
    if gemm != "triton":
        forward += (
            Term(
                f"{gemm} GEMMs",
                gemms * (triton.value / eff.value - 1),
                f"the expert GEMMs ({gemms * 1e3:.3f} ms) at the {gemm} lowering's {eff.value:.1%} of the rate "
                f"instead ({eff.source}), none of the difference hidden",
            ),
        )
    backward = (
        Term("transport", moves, "dL/dy rows out, dL/dx rows back: the forward's dispatch and return, not overlapped"),
        Term(
            "expert GEMMs",
            2 * gemms * triton.value / eff.value,
            f"dX and dW: twice the forward's FLOPs at {eff.value:.1%} of the rate",
        ),
        Term("scatter", local, "g'·dL/dy rows gathered per token and slot: the forward's combine and unpack mirrored"),
    )
    shape = (geo.W, geo.T, geo.H, geo.F, geo.E, geo.K)
    base = R.hw.partition("/")[0]
    published = tuple(p for p in PUBLISHED if p.shape == shape and p.gpu == base and "/" not in R.hw)
    flops = geo.flop_coef * geo.H * geo.F * geo.T * geo.K
    return Projection(R.hw, sched.strategy, gemm, flops, forward, backward, published)


def lines(p: Projection) -> list[str]:
    """The projection as ``rdepc plan`` prints it."""
    out = [
        f"Projection on {p.hw}: a PREDICTION of the cost model, not a measurement ({p.strategy} schedule, {p.gemm} "
        "GEMMs; against the leases the model predicted bulk split's calls at 0.85-1.06x (4,096 tokens), "
        "segmented ones' at 0.43-0.72x: a lower bound for those)",
    ]

    def block(title: str, terms: tuple[Term, ...], total: float, flops: float) -> None:
        out.append(f"  {title:<28} {total * 1e3:9.3f} ms  {flops / total / 1e12:6.0f} TFLOPS per GPU")
        for t in terms:
            out.append(f"    {t.name:<26} {t.seconds * 1e3:9.3f} ms  {t.assumption}")

    block("forward", p.forward, p.forward_s, p.flops)
    block("backward", p.backward, p.backward_s, 2 * p.flops)
    total = p.forward_s + p.backward_s
    out.append(f"  {'forward + backward':<28} {total * 1e3:9.3f} ms  {3 * p.flops / total / 1e12:6.0f} TFLOPS per GPU")
    for pub in p.published:
        fwd, bwd = p.flops / (pub.forward_tflops * 1e12), 2 * p.flops / (pub.backward_tflops * 1e12)
        out.append(
            f"  published, measured: {pub.system}: {pub.forward_tflops:.0f} TFLOPS per GPU forward "
            f"({fwd * 1e3:.2f} ms), {pub.backward_tflops:.0f} backward ({bwd * 1e3:.2f} ms) — {pub.source}"
        )
    return out


__all__ = ["PLAN_TASKS", "PUBLISHED", "Projection", "Published", "Term", "lines", "project"]
