"""The ``replicate`` pass: a layer with ``balance replicate(slots = N, ...)`` → the physical
layer its kernels run.

Replicas live in N redundant slots per rank. The kernels see each slot as an expert of its
own, owned by its rank: the E home experts keep their ids, owners and local indices, and
slot j of rank t is physical expert E + t·N + j, local expert E_loc(t) + j of rank t. Each
call, the balance plan (:mod:`rdepc.ir.balance`, on the device) decides which home expert a
slot holds and which route rows it takes; the rest of the layer — route, scan, dispatch,
the grouped GEMM, return, combine, the backward — is the physical layer's, unchanged. A
layer without replication passes through as it is.
"""

from __future__ import annotations

import dataclasses

import sympy as sp

from rdepc.ir.spec import Balance, LayerSpec, Ownership


def slot_expert(E: int, N: int, rank: int, j: int) -> int:
    """The physical expert id of slot ``j`` of ``rank`` in a layer of E home experts, N slots a rank."""
    return E + rank * N + j


def physical_layer(spec: LayerSpec) -> LayerSpec:
    """``spec`` with its N·W redundant slots as experts of their ranks (the module docstring)."""
    if spec.balance.kind != "replicate":
        return spec
    W, E, N = int(spec.shape.W), int(spec.shape.E), spec.balance.slots
    per_rank = spec.ownership.experts_per_rank(W)
    owner = list(spec.ownership.owner) + [t for t in range(W) for _ in range(N)]
    local = list(spec.ownership.local) + [per_rank[t] + j for t in range(W) for j in range(N)]
    assert len(owner) == slot_expert(E, N, W, 0)
    return dataclasses.replace(
        spec,
        shape=dataclasses.replace(spec.shape, E=sp.Integer(E + W * N)),
        ownership=Ownership("map", tuple(owner), tuple(local)),
    )


def without_replication(spec: LayerSpec) -> LayerSpec:
    """``spec`` with no balance statement: the layer without replication (of a physical
    layer, its slots stay experts of their ranks, with no weight pushes)."""
    return dataclasses.replace(spec, balance=Balance())


def physical_counts(spec: LayerSpec, counts) -> tuple[list[list[int]], object]:
    """Rows per (source, physical expert) of a routing's ``counts`` [W][E] under the plan
    every rank derives for it (:func:`rdepc.ir.balance.solve`), and that plan: what the
    kernels of ``physical_layer(spec)`` move and compute for that routing."""
    import numpy as np

    from rdepc.ir.balance import solve

    b, owner = spec.balance, spec.ownership.owner
    W, E, N = int(spec.shape.W), len(owner), b.slots
    load = np.asarray(counts, dtype=np.int64)
    plan = solve(load, owner, N, b.min_rows)
    out = np.zeros((W, E + W * N), dtype=np.int64)
    out[:, :E] = plan.split[:, np.arange(E), owner]  # each source's rows its experts' homes take
    for t in range(W):
        for j, e in enumerate(plan.slots[t]):
            if e >= 0:
                out[:, slot_expert(E, N, t, j)] = plan.split[:, e, t]
    return out.tolist(), plan


def dump(spec: LayerSpec) -> str:
    b = spec.balance
    if b.kind != "replicate":
        return "no replication: the layer as the spec gives it"
    W, N = int(spec.shape.W), b.slots
    E = int(spec.shape.E) - W * N
    rows = [f"{E} home experts, {N} slots a rank: physical experts {E}..{E + W * N - 1}"]
    rows += [f"  rank {t}: slots {slot_expert(E, N, t, 0)}..{slot_expert(E, N, t, N - 1)}" for t in range(W)]
    return "\n".join(rows)


__all__ = ["dump", "physical_counts", "physical_layer", "slot_expert", "without_replication"]
