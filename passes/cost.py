"""The cost model: what each task of a graph costs on one hardware profile.

Rates come from ``passes/hardware.py`` (every value with its source) plus two figures the
program split needs, each cited below: how many programs a GPU keeps resident (one per SM)
and how many bytes per second one communication program moves over NVLink.

In an overlapped (segmented) schedule a rank's programs are split into two roles
(docs/ARCHITECTURE.md, decision 2): ``p`` communication programs (route, scan, dispatch,
return, unpack, combine: split mode's transport kernel) and ``N − p`` compute programs (the
expert GEMMs: its GEMM kernel). Bulk has nothing to overlap, so all ``N`` programs take
every task in turn (the unified mode); split mode gives it the split that minimises its
stages' sum (``best_split`` with ``overlapped`` false). With a split

* NVLink bytes move at ``min(link, p · link_per_sm)`` — injection saturates with a few
  dozen programs, which is why overlap pays: the programs bulk leaves idle during its
  transport can run expert GEMMs instead;
* local memory traffic (a rank's rows to itself, unpack copies, combine) moves at the
  role's share of HBM bandwidth, ``hbm · programs / N``;
* an expert GEMM costs ``max(FLOPs / (flops · (N−p)/N), bytes / (hbm · (N−p)/N))``, flops
  the rate rdepc's GEMM kernel was measured to reach (``passes.hardware.gemm_rate``), with
  FLOPs counted over launched m-tiles (a partial tile costs a whole one) and bytes the
  expert weights it reads plus its rows in and out (a roofline);
* a flag crossing ranks costs ``latency`` (Prop. B.7's 50–100 ns per peer touch); the
  scan costs two peer-visible barrier sweeps, ``2 · W · latency`` (appendix A.2, phases 1–2).

Rows per task come from a routing: the expected one (each source spreads T·K rows evenly,
eq. 9) unless the caller gives one. The model is a fluid one: a role's programs share its
rate and run its tasks one after another, in the global order (a task's tiles occupy every
program of the role before the next task's do). The route costs its measured rate
(:data:`ROUTE_RATE`) besides its bytes. What it leaves out: the 3-phase protocol's software
overheads beyond the barrier sweeps, kernel launches, L2 effects, GEMM efficiency
falling for short expert groups, and HBM bandwidth a compute-bound GEMM leaves unused (the
communication role is charged its proportional share).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from rdepc.passes.hardware import PROFILES, Value, gemm_rate, profile
from rdepc.passes.loads import admit, expected_counts, segment_load, task_rows

from rdepc.ir import sizes
from rdepc.ir.balance import push_bytes, solve_seconds
from rdepc.ir.graph import CostModel, Rates, TaskGraph
from rdepc.ir.sizes import BM
from rdepc.ir.spec import weight_matrices

# Programs one GPU keeps resident: one per SM.
SMS: dict[str, Value] = {
    "h100": Value(132, "SM", "datasheet", "NVIDIA H100 SXM: 132 SMs (NVIDIA/cudnn-frontend PR #650, anchors-perf.md)"),
    "h200": Value(132, "SM", "datasheet", "NVIDIA H200 SXM: the GH100 die of the H100 SXM, 132 SMs"),
    "b200": Value(148, "SM", "datasheet", "NVIDIA B200: 74 SMs enabled per die, 148 SMs (Chips and Cheese, B200)"),
    "gb300": Value(160, "SM", "datasheet", "NVIDIA Blackwell Ultra GB300: 160 SMs (NVIDIA, Hot Chips 2025)"),
}

# Bytes/s one communication program (SM) moves over NVLink. Measured on SM100; Hopper runs
# the same copy path (TMA bulk copies, NVLink 4) and is charged the same per-SM rate, which
# saturates H100's 371 GB/s with 14 programs. (DeepEP V1's 153 GB/s with 20 SMs on H800 is
# link-bound, so it only bounds the per-SM rate from below.)
_LINK_PER_SM = Value(
    26.8e9,
    "B/s",
    "measured",
    "DeepEP V2, EP8 over SM100 NVLink: 643 GB/s with 24 SMs (deepseek-ai/DeepEP V2 release, anchors-comm.md)",
)
LINK_PER_SM: dict[str, Value] = dict.fromkeys(("h100", "h200", "b200", "gb300"), _LINK_PER_SM)

# Token·experts one rank's route gets through per second, whatever its programs: every committed
# route span (bench/calibration.py, 31 profiled calls) is W·T'·E / (2.0–2.7·10⁹ per second) over
# the 8 ranks emulated on one GPU, at T' 128–4096, E 64–128, 31 or 132 programs, H100 and H200 —
# it grows with the tokens and the experts, not with the SMs. Its median per rank, charged as a
# latency of the route task on every profile until a route is measured elsewhere.
ROUTE_RATE = Value(
    3.06e8,
    "token·experts/s",
    "measured",
    "bench/results/*/perf.json route spans: moonlight 0.85 ms at T' 4096 (E 64), qwen3_30b_a3b 1.58 ms (E 128), "
    "moonlight 0.026 ms at T' 128",
)


def rates(hw: str) -> Rates:
    """The rates of profile ``hw``; ``NAME/N`` (``passes.hardware.emulated``): N ranks emulated
    on one GPU of profile NAME, each with 1/N of its SMs and the profile's shares of FLOP/s and
    HBM bandwidth; a row to a peer is an HBM read and write, one program's share of them."""
    p = profile(hw)
    base, _, n = hw.partition("/")
    sms = int(SMS[base].value)
    per_sm = LINK_PER_SM[base].value if not n else PROFILES[base].hbm_bw.value / sms / 2
    return Rates(
        hw=hw,
        sms=max(1, sms // int(n or 1)),
        flops=gemm_rate(p),
        link=p.link.value,
        link_per_sm=per_sm,
        hbm=p.hbm_bw.value,
        latency=p.barrier_per_peer.value,
    )


def cost_model(
    tg: TaskGraph,
    hw: str = "h100",
    counts: Sequence[Sequence[int]] | None = None,
    held: Sequence[Sequence[int]] | None = None,
) -> CostModel:
    """Work per task of ``tg`` under ``counts`` ([source][expert] rows routed, before
    capacity; None: the expected routing). ``held``: under ``balance replicate``, the home
    expert each slot holds ([rank][slot], -1 empty: the plan for ``counts``), which sets
    the weight pushes' bytes; None: every slot filled, the pushes spread evenly."""
    if counts is None and held is None:
        cm = _expected(tg, hw)
        return cm if cm.graph is tg else replace(cm, graph=tg)  # tg's own decisions
    return _cost_model(tg, hw, counts, held)


# The resolve pass weighs the winner's graph under the expected routing, then the cost pass
# models it again: graphs and cost models are immutable, so each is built once (a few kept).
@lru_cache(maxsize=4)
def _expected(tg: TaskGraph, hw: str) -> CostModel:
    return _cost_model(tg, hw, None, None)


def _cost_model(tg, hw, counts, held) -> CostModel:
    geo = tg.geometry
    given = counts is not None
    load = segment_load(geo, admit(geo, counts if given else expected_counts(geo)))
    rows = task_rows(tg, load)
    row_d = geo.H * geo.d + geo.sb
    row_a = geo.H * geo.a
    weights = weight_matrices(geo.act) * geo.H * geo.F * geo.a
    down = geo.H * geo.F * geo.a  # GEMM2's weights per expert
    R = rates(hw)
    n = len(tg.tasks)
    link_b, mem_b, flops, wbytes, fixed = [0] * n, [0] * n, [0] * n, [0] * n, [0.0] * n
    sent_received = None if held is None else [v.tolist() for v in push_bytes(held, geo.owner, geo.slot_bytes)]
    replicas = geo.W * geo.slots if held is None else int((np.asarray(held) >= 0).sum())  # the solve's passes
    unslotted = set()  # GEMM1 tasks without a slot's rows under the routing: they skip the receive
    for t, k in zip(tg.tasks, rows, strict=True):
        i = t.id
        match t.stage:
            case "balance" if t.detail == "load":  # a row of the load table to every other rank
                link_b[i] = t.bytes * (geo.W - 1) // geo.W
                fixed[i] = R.latency
            case "balance" if t.detail == "solve":  # one program's serial search
                mem_b[i] = t.bytes
                fixed[i] = solve_seconds(geo.homes, replicas)
            case "balance" if t.detail == "reroute":  # read the route rows' ids, write their physical ones
                mem_b[i] = t.bytes
            case "balance":  # a push's stores cross the links; a receive copies the rank's slots through HBM
                n = t.bytes
                if sent_received is not None:
                    n = sent_received[t.detail != "push"][t.rank]
                if t.detail == "push":
                    link_b[i] = n
                    fixed[i] = R.latency  # one flag to each rank it filled, in flight together
                else:
                    mem_b[i] = 2 * n
            case "route":
                mem_b[i] = k * (geo.sb + 16)  # read expert ids and gates, write order and sideband
                fixed[i] = k / geo.K * geo.E / ROUTE_RATE.value
            case "scan":
                mem_b[i] = t.bytes
                fixed[i] = 2 * geo.W * R.latency
            case "dispatch" | "return":
                rb = row_d if t.stage == "dispatch" else row_a
                if t.src == t.owner:
                    mem_b[i] = 2 * k * rb  # to itself: a copy through HBM
                else:
                    link_b[i] = k * rb
            case "compute":  # GEMM1: gate and up (x·[Wg Wu]); GEMM2: the down projection
                d = load.experts.get((t.owner, t.segment), {})
                m = sizes.m_tiles(d.values())
                first = t.detail == "gemm1"
                if first and geo.slots and not any(d.get(j) for j in geo.slot_locals(t.owner)):
                    unslotted.add(i)
                flops[i] = (geo.flop_coef - 2 if first else 2) * m * BM * geo.H * geo.F
                wbytes[i] = (weights - down if first else down) * sum(1 for x in d.values() if x)
                mem_b[i] = k * ((row_d if first else row_a) + geo.F * geo.a)
            case "combine":
                if t.detail == "unpack":
                    mem_b[i] = 2 * k * row_a
                elif t.detail == "tile":
                    mem_b[i] = k * (geo.K * row_a + row_a + 8 * geo.K)
    return CostModel(
        tg,
        R,
        "given" if given else "uniform",
        tuple(rows),
        tuple(link_b),
        tuple(mem_b),
        tuple(flops),
        tuple(wbytes),
        tuple(fixed),
        frozenset(unslotted),
    )


@dataclass(frozen=True, slots=True)
class Split:
    comm: int  # communication programs per rank
    compute: int

    def __str__(self) -> str:
        return f"{self.comm} communication + {self.compute} compute programs"


def durations(cm: CostModel, comm: int | None) -> np.ndarray:
    """Seconds per task when ``comm`` of a rank's programs communicate and the rest
    compute; ``comm=None``: unified, every program takes every task (bulk: nothing to
    overlap, so each stage has the whole GPU)."""
    R = cm.rates
    N = R.sms
    if comm is None:
        comm = comp = N
    else:
        comp = N - comm
        if not 0 < comm < N:
            raise ValueError(f"communication programs must be in 1..{N - 1}, got {comm}")
    link = min(R.link, comm * R.link_per_sm)
    is_comm = np.fromiter((t.role == "comm" for t in cm.graph.tasks), bool, len(cm.graph.tasks))
    link_b = np.asarray(cm.link_bytes, float)
    mem_b = np.asarray(cm.mem_bytes, float)
    flops = np.asarray(cm.flops, float)
    wb = np.asarray(cm.weight_bytes, float)
    fixed = np.asarray(cm.fixed, float)
    comm_t = link_b / link + mem_b / (R.hbm * comm / N)
    comp_t = np.maximum(flops / (R.flops * comp / N), (mem_b + wb) / (R.hbm * comp / N))
    return np.where(is_comm, comm_t, comp_t) + fixed


def role_work(cm: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per rank: NVLink bytes and local bytes of the communication role, and the compute
    role's seconds on a whole GPU; plus fixed seconds per rank. ``comm_seconds(p)`` and
    ``compute_seconds(p)`` follow from these without touching every task again."""
    R = cm.rates
    W = cm.graph.geometry.W
    link = np.zeros(W)
    mem = np.zeros(W)
    comp = np.zeros(W)
    fixed = np.zeros(W)
    for t in cm.graph.tasks:
        i = t.id
        if t.role == "comm":
            link[t.rank] += cm.link_bytes[i]
            mem[t.rank] += cm.mem_bytes[i]
        else:
            comp[t.rank] += max(cm.flops[i] / R.flops, (cm.mem_bytes[i] + cm.weight_bytes[i]) / R.hbm)
        fixed[t.rank] += cm.fixed[i]
    return link, mem, comp, fixed


def estimate(cm: CostModel, work, comm: int, overlapped: bool) -> float:
    """A quick makespan estimate for a program split: the busiest rank's roles, summed when
    nothing overlaps (bulk), their maximum when the schedule overlaps them."""
    R = cm.rates
    N = R.sms
    link, mem, comp, fixed = work
    comm_s = link / min(R.link, comm * R.link_per_sm) + mem / (R.hbm * comm / N)
    comp_s = comp * N / (N - comm)
    per = np.maximum(comm_s, comp_s) if overlapped else comm_s + comp_s
    return float(np.max(per + fixed)) if len(per) else 0.0


def best_split(cm: CostModel, overlapped: bool) -> tuple[Split, float]:
    """The program split that minimises :func:`estimate`, searched over every split."""
    N = cm.rates.sms
    work = role_work(cm)
    best = min(range(1, N), key=lambda p: (estimate(cm, work, p, overlapped), p))
    return Split(best, N - best), estimate(cm, work, best, overlapped)


__all__ = [
    "LINK_PER_SM",
    "ROUTE_RATE",
    "SMS",
    "Split",
    "best_split",
    "cost_model",
    "durations",
    "estimate",
    "rates",
    "role_work",
]


def dump(cm: CostModel) -> str:
    """``--dump-after cost``: the rates and each stage's work on the busiest rank."""
    R = cm.rates
    lines = [
        f"// cost model on {R.hw}: {R.sms} programs per rank (SMs), {R.flops / 1e12:.1f} TFLOP/s, "
        f"NVLink {R.link / 1e9:.0f} GB/s ({R.link_per_sm / 1e9:.1f} GB/s per program), HBM {R.hbm / 1e12:.2f} TB/s, "
        f"flag latency {R.latency * 1e9:.0f} ns",
        f"// routing: {cm.load}",
    ]
    per: dict[str, dict[int, list[float]]] = {}
    for t in cm.graph.tasks:
        key = t.stage if not t.detail else f"{t.stage} {t.detail}"
        row = per.setdefault(key, {}).setdefault(t.rank, [0, 0, 0, 0])
        row[0] += cm.rows[t.id]
        row[1] += cm.link_bytes[t.id]
        row[2] += cm.mem_bytes[t.id] + cm.weight_bytes[t.id]
        row[3] += cm.flops[t.id]
    lines.append(f"// {'stage':<16} {'rows':>10} {'NVLink B':>14} {'memory B':>14} {'FLOPs':>16}  (busiest rank)")
    for key, ranks in per.items():
        r = max(ranks.values(), key=lambda v: (v[1], v[2], v[3], v[0]))
        lines.append(f"   {key:<16} {r[0]:>10,} {r[1]:>14,} {r[2]:>14,} {r[3]:>16,}")
    return "\n".join(lines)
