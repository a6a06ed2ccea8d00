"""Hardware profiles for the planner and the cost model: every value with its source.

``flops`` is a dense bf16 GEMM's rate (or, ``flops_is_expert``, an expert GEMM's measured
one); the cost model charges expert GEMMs at :func:`gemm_rate`, the share of it rdepc's
GEMM kernel was measured to reach. ``link`` is the effective NVLink bandwidth one GPU
injects at (bytes/s, one direction), ``hbm`` the GPU's memory in bytes. Where a measured
value exists it is used in preference to a datasheet peak, and ``kind`` says which one a
figure is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Value:
    value: float
    unit: str
    kind: str  # "measured", "datasheet", or "derived" (from another Value)
    source: str


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    description: str
    flops: Value  # FLOP/s, bf16 dense, for grouped expert GEMMs
    link: Value  # bytes/s per direction per GPU over NVLink
    hbm: Value  # bytes of GPU memory
    hbm_bw: Value  # bytes/s of GPU memory bandwidth
    barrier_per_peer: Value  # seconds per peer touch of a peer-visible phase barrier
    # ``flops`` is itself an expert GEMM's measured rate, not a dense GEMM's (gemm_rate)
    flops_is_expert: bool = False

    def values(self) -> dict[str, Value]:
        return {k: getattr(self, k) for k in ("flops", "link", "hbm", "hbm_bw", "barrier_per_peer")}


_BARRIER = Value(
    75e-9,
    "s",
    "datasheet",
    "RDEP paper, Prop. B.7: 50-100 ns per peer touch (midpoint)",
)

PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        "h100",
        "NVIDIA H100 SXM 80 GB, NVLink 4",
        Value(794.5e12, "FLOP/s", "measured", "cuBLAS bf16 MAMF on H100 SXM (stas00/ml-engineering, MAMF table)"),
        Value(371e9, "B/s", "measured", "p2pBandwidthLatencyTest, one pair of 8xH100 SXM (NVIDIA/nccl issue #1264)"),
        Value(80 * 2**30, "B", "datasheet", "NVIDIA H100 SXM datasheet: 80 GB HBM3"),
        Value(3.35e12, "B/s", "datasheet", "NVIDIA H100 SXM datasheet: 3.35 TB/s"),
        _BARRIER,
    ),
    "h200": HardwareProfile(
        "h200",
        "NVIDIA H200 SXM 141 GB, NVLink 4",
        Value(794.5e12, "FLOP/s", "measured", "cuBLAS bf16 MAMF; the MAMF table lists H200 as equal to H100 SXM"),
        Value(371e9, "B/s", "measured", "NVLink 4 as on H100 SXM: p2pBandwidthLatencyTest (NVIDIA/nccl issue #1264)"),
        Value(141e9, "B", "datasheet", "NVIDIA H200 datasheet: 141 GB HBM3e"),
        Value(4.8e12, "B/s", "datasheet", "NVIDIA H200 datasheet: 4.8 TB/s"),
        _BARRIER,
    ),
    "b200": HardwareProfile(
        "b200",
        "NVIDIA B200, NVLink 5 (the RDEP paper's 8xB200 node)",
        Value(1377e12, "FLOP/s", "measured", "RDEP paper Table 5: isolated expert compute, 24K rows"),
        Value(972e9, "B/s", "measured", "RDEP paper Table 5: effective NVLink bandwidth, injection plateau at 16 MB"),
        Value(180e9, "B", "datasheet", "NVIDIA DGX B200 datasheet: 1,440 GB of GPU memory over 8 GPUs"),
        Value(8e12, "B/s", "datasheet", "NVIDIA B200 datasheet: 8 TB/s HBM3e"),
        _BARRIER,
        flops_is_expert=True,
    ),
    "gb300": HardwareProfile(
        "gb300",
        "NVIDIA GB300 NVL72 (Blackwell Ultra), NVLink 5 domain of 72 GPUs",
        Value(2.5e15, "FLOP/s", "datasheet", "NVIDIA GB300 NVL72 datasheet: 180 PFLOPS dense FP16/BF16 over 72 GPUs"),
        Value(900e9, "B/s", "datasheet", "NVIDIA GB300 NVL72 datasheet: 1.8 TB/s NVLink 5 per GPU, both directions"),
        Value(288e9, "B", "datasheet", "NVIDIA GB300 NVL72 datasheet: 288 GB HBM3e per GPU"),
        Value(8e12, "B/s", "datasheet", "NVIDIA GB300 NVL72 datasheet: 8 TB/s per GPU"),
        _BARRIER,
    ),
}


def profile(name: str) -> HardwareProfile:
    """Profile ``name``, or ``NAME/N``: N ranks emulated on one GPU of profile NAME (:func:`emulated`)."""
    base, slash, n = name.partition("/")
    if base not in PROFILES:
        raise ValueError(f"unknown hardware profile '{name}' (known: {', '.join(PROFILES)}, or NAME/N)")
    if not slash:
        return PROFILES[base]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"hardware profile '{name}': N in NAME/N must be a positive whole number of ranks")
    return emulated(PROFILES[base], int(n))


def emulated(p: HardwareProfile, n: int) -> HardwareProfile:
    """One of ``n`` ranks emulated on one GPU of ``p``, as the GPU leases measure a node's layer
    (one process, every rank's kernels on the same device): each rank has 1/n of the GPU's
    FLOP/s, memory and memory bandwidth, and a row sent to a peer is read from and written to
    the same HBM, so the "link" is half the rank's share of HBM bandwidth."""

    def part(v: Value, scale: float, how: str) -> Value:
        return Value(v.value * scale, v.unit, "derived", f"{how} of {p.name}'s: {v.source}")

    share = f"1/{n}"
    return HardwareProfile(
        f"{p.name}/{n}",
        f"{n} ranks emulated on one {p.description}",
        part(p.flops, 1 / n, share),
        part(p.hbm_bw, 1 / n / 2, f"half of {share} of the HBM bandwidth (a read and a write), instead"),
        part(p.hbm, 1 / n, share),
        part(p.hbm_bw, 1 / n, share),
        p.barrier_per_peer,
        p.flops_is_expert,
    )


HW_HELP = (
    f"hardware profile: {', '.join(PROFILES)}, or NAME/N for N ranks emulated on one GPU of NAME, "
    "as the GPU leases measure a node's layer (e.g. h200/8); default: h100"
)


# The share of ``flops`` (cuBLAS's dense MAMF) an expert GEMM reaches under each lowering
# (rdepc.ir.lowering), measured on moonlight's forward (196,608 expert-sorted rows, H 2048,
# F 1408: 3.40 TFLOP) on one H200; the same kernels on every profile until another is
# measured.
GEMM_EFFICIENCY: dict[str, Value] = {
    "library": Value(
        0.673,
        "of flops",
        "measured",
        "bench/results/h200-2026-11-28-lease/b-perf.json: torch._grouped_mm alone, 534.6 TFLOPS median",
    ),
    "triton": Value(
        0.620,
        "of flops",
        "measured",
        "bench/results/h200-2026-11-28-lease/b-perf.json: bulk split's GEMM stage, 9.02 ms on 101 of 132 SMs "
        "(377 TFLOPS; 493 scaled to all 132)",
    ),
}


def gemm_rate(p: HardwareProfile) -> float:
    """FLOP/s the cost model charges rdepc's expert GEMMs (the Triton kernel) at on ``p``: the
    share of ``flops`` the kernel was measured to reach of a dense GEMM's rate, or ``flops``
    itself where that is already an expert GEMM's measured rate (b200: RDEP's Table 5)."""
    return p.flops.value * (1.0 if p.flops_is_expert else GEMM_EFFICIENCY["triton"].value)


# The host's work in one call before its first launch (the input checks that read device data:
# ids' and gates' range and NaNs, the error record and the statistics copied back), as the
# profiled calls of the newest leases measured it (``host_overhead_ms``: the call's median less
# its kernels' span): a fixed part, the smallest case's, and a part per routed row the process
# checks (the four T' = 4,096 cases' median slope). Older runtimes measured 0.4–3.0 ms.
HOST_CALL = Value(
    0.945e-3,
    "s",
    "measured",
    "bench/results/h200-2026-11-28-lease/a-perf.json: moonlight T' 128 (6,144 rows), host_overhead_ms 0.945",
)
HOST_PER_ROW = Value(
    5.6e-9,
    "s/row",
    "measured",
    "bench/results/h200-2026-11-28-lease/{a,b}-perf.json: host_overhead_ms 1.78–2.63 at 196,608 rows "
    "(moonlight T' 4,096), 2.11 at 262,144 (qwen3_30b_a3b): 4.2–8.6 ns a row above the fixed part, median 5.6",
)


def host_seconds(rows: int) -> float:
    """The host's time in one call of a process that checks ``rows`` routed rows (T'·K per
    rank it runs): :data:`HOST_CALL` + :data:`HOST_PER_ROW` each."""
    return HOST_CALL.value + HOST_PER_ROW.value * rows
