"""rdepc.codegen: a scheduled, memory-planned layer → one readable Triton file.

The ``codegen`` stage is the driver's last pass (``rdepc.driver.spec_passes``): it takes the
scheduler's Schedule, lowers it with its memory plan into a kernel contract
(:mod:`rdepc.codegen.lower`: the task table with work items, heap offsets, ownership
tables) and emits the kernels (:mod:`rdepc.codegen.emit`). :mod:`rdepc.codegen.sm90`
compiles the emitted file to sm_90 cubins without a GPU.

Scope: the forward and backward passes, fp8 dispatch (row or block scales), dedup (forward
and backward), any route-row encoding, admission by
arrival or by lowest gate, every schedule (``bulk``, ``pipelined``,
``deep``: the kernels run the scheduler's task table, B-slot rings included), every
transport (``emulated``: all ranks in one process; ``emulated-mp`` and ``nvshmem``: one
process per rank). The kernels are generated for the backend asked for,
whatever the spec's ``transport`` statement names.
One generated file serves both kernel modes (unified: ``rdep_layer``; split: ``rdep_layer``
without its GEMM tasks, a constexpr, beside ``rdep_gemm``). Shared experts are computed
densely on the front-end by ``rdepc.RDEPMoE``, outside the routed kernels; symbolic tokens
(``param T <= N``) run with the call's T'.

Generating source needs neither torch nor triton.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from rdepc.codegen.emit import content_hash, generate
from rdepc.codegen.lower import lower

from rdepc.ir.contract import KernelContract
from rdepc.ir.graph import MemoryPlan, Schedule


@dataclass(frozen=True)
class Generated:
    """The codegen stage's output: the kernel contract, the source, and the schedule and memory
    plan they came from (``schedule.table`` is the task table the kernel runs)."""

    kernel: KernelContract
    source: str
    schedule: Schedule
    memory: MemoryPlan

    @property
    def name(self) -> str:
        return self.kernel.layer


@dataclass(frozen=True)
class CodegenPass:
    """Schedule, its memory plan and the GEMMs' lowering (the memplan and lowering passes'
    outputs) → Generated. ``schedule``
    is the strategy the user asked for explicitly (command line or API), None when it came
    from the spec or the cost model (it is recorded in the generated header)."""

    schedule: str | None = None
    hw: str = "h100"
    transport: str = "emulated"
    name: str = "codegen"

    def __call__(self, sched: Schedule, mp: MemoryPlan, lowering) -> Generated:
        spec = sched.graph.spec
        options = (("schedule", self.schedule or "from the spec"), ("hw", self.hw), ("backend", self.transport))
        contract = lower(spec, sched, mp, self.transport)
        decisions = (*contract.decisions, f"gemm = {lowering.gemm} ({lowering.why})")
        contract = dataclasses.replace(
            contract, options=options, gemm=lowering.gemm, gemm_why=lowering.why, decisions=decisions
        )  # fmt: skip
        return Generated(contract, generate(contract), sched, mp)


def dump(g: Generated) -> str:
    """``--dump-after codegen``: the generated source."""
    return g.source.rstrip("\n")


def write_module(g: Generated, out: Path) -> list[Path]:
    """Write the importable module of ``g`` into ``out``: the kernels (``LAYER_kernels.py``),
    the kernel contract (``LAYER.contract.json``) and a small wrapper (``LAYER.py``) whose
    ``module(backend, device)`` builds the runtime module. Atomic writes (tmp + replace)."""
    name = g.kernel.layer
    files = {
        f"{name}_kernels.py": g.source,
        f"{name}.contract.json": g.kernel.to_json() + "\n",
        f"{name}.py": wrapper_source(g.kernel),
    }
    written = []
    for fname, text in files.items():
        target = out / fname
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
        written.append(target)
    return written


def wrapper_source(contract: KernelContract) -> str:
    name, transport = contract.layer, contract.transport
    if transport == "emulated":
        usage = f"""    layer = {name}.module(device="cpu")  # the emulated backend; "cpu" runs the Triton interpreter
    y = layer(x, topk_ids, topk_weights, w_gate, w_up, w_down)  # x [W, T', H] -> y [W, T', H]"""
        device = '"cpu"'
    else:
        usage = f"""    layer = {name}.module()  # {transport}: one process per rank (torchrun), this rank's share
    y = layer(x, topk_ids, topk_weights, w_gate, w_up, w_down)  # x [T', H] -> y [T', H]"""
        device = '"cpu"' if transport == "emulated-mp" else "None"
    return f'''"""Layer {name}, compiled by rdepc {contract.rdepc} from {contract.file} for the {transport} backend.

    import {name}
{usage}

The kernels are in {name}_kernels.py, their contract in {name}.contract.json.
"""

from pathlib import Path

from rdepc.runtime import load_compiled

HERE = Path(__file__).resolve().parent


def module(backend="{contract.transport}", device={device}, **options):
    """The compiled layer as an ``rdepc.runtime.RDEPModule`` (see its ``forward``)."""
    contract, kernels = HERE / "{name}.contract.json", HERE / "{name}_kernels.py"
    return load_compiled(contract, kernels, backend=backend, device=device, **options)
'''


__all__ = [
    "CodegenPass",
    "Generated",
    "content_hash",
    "dump",
    "generate",
    "lower",
    "write_module",
]
