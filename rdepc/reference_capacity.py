"""The reference operator's capacity policy (RDEP section 3.6, described in
:mod:`rdepc.reference`): which route rows the owner of an expert admits, and the combine
weights g' once the rest are dropped. Like the operator it shares no code with the compiler,
its code generator or its runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

DROPS = ("round_robin", "arrival", "lowest_gate")
WEIGHTS = ("renormalize", "zero")

RowId = Callable[[int, int, int], int]


def eq7_row_id(T: int, K: int) -> RowId:
    """RDEP eq. 7: row_id = (rank · T + token) · K + slot."""
    return lambda r, t, k: (r * T + t) * K + k


def accepted_rows(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    capacity: int | Sequence[int] | None,
    *,
    num_experts: int,
    drop: str = "round_robin",
    row_id: RowId | None = None,
) -> torch.Tensor:
    """The accepted route-row set, a bool tensor shaped like ``topk_ids`` [W, T', K].

    Written as the owner would do it, one expert at a time with plain Python lists: collect
    the rows sent to the expert, order them by the drop policy, admit the first cap_e.
    """
    if drop not in DROPS:
        raise ValueError(f"unknown drop policy {drop!r}; expected one of {', '.join(DROPS)}")
    W, T, K = topk_ids.shape
    E = num_experts
    if capacity is None:
        return torch.ones((W, T, K), dtype=torch.bool, device=topk_ids.device)
    caps = _caps(capacity, E)
    rid = row_id if row_id is not None else eq7_row_id(T, K)

    ids = topk_ids.tolist()
    gates = topk_weights.to(device="cpu", dtype=torch.float64).tolist()
    rows_of: list[list[tuple[int, int, int, int, float]]] = [[] for _ in range(E)]
    seen: set[int] = set()
    for r in range(W):
        for t in range(T):
            for k in range(K):
                i = int(rid(r, t, k))
                if i in seen:
                    raise ValueError(f"row_id is not injective: ({r}, {t}, {k}) repeats row id {i}")
                seen.add(i)
                if ids[r][t][k] != -1:  # -1: the slot routes nowhere (padding), no route row
                    rows_of[ids[r][t][k]].append((i, r, t, k, gates[r][t][k]))

    accepted = [[[False] * K for _ in range(T)] for _ in range(W)]
    for e in range(E):
        rows = rows_of[e]
        if drop == "round_robin":  # token index, then the rank's turn at that index, then slot
            order = sorted(rows, key=lambda row: (row[2], (row[1] - row[2]) % W, row[3]))
        elif drop == "arrival":
            order = sorted(rows, key=lambda row: row[0])  # smallest row_id first
        else:
            order = sorted(rows, key=lambda row: (-row[4], row[0]))  # highest gate first, then row_id
        for _, r, t, k, _ in order[: caps[e]]:
            accepted[r][t][k] = True
    return torch.tensor(accepted, dtype=torch.bool, device=topk_ids.device)


def combine_weights(topk_weights: torch.Tensor, accepted: torch.Tensor, weights: str = "renormalize") -> torch.Tensor:
    """g' from g and the accepted set (float, same shape as ``topk_weights``)."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights policy {weights!r}; expected one of {', '.join(WEIGHTS)}")
    g = topk_weights
    kept = torch.where(accepted, g, torch.zeros_like(g))
    if weights == "zero":
        return kept
    total = g.sum(dim=-1, keepdim=True)
    survived = kept.sum(dim=-1, keepdim=True)
    # A token with nothing accepted (or only zero gates accepted) keeps weight 0 everywhere.
    scale = torch.where(survived != 0, total / torch.where(survived != 0, survived, 1), 0)
    return kept * scale


def _caps(capacity: int | Sequence[int], E: int) -> list[int]:
    if isinstance(capacity, bool):
        raise TypeError("capacity must be None, an int or a sequence of ints, not a bool")
    if isinstance(capacity, int):
        caps = [capacity] * E
    else:
        caps = [int(c) for c in capacity]
        if len(caps) != E:
            raise ValueError(f"capacity needs one value per expert ({E}), got {len(caps)}")
    if any(c < 0 for c in caps):
        raise ValueError(f"capacity must be non-negative, got {caps}")
    return caps


__all__ = ["DROPS", "WEIGHTS", "RowId", "accepted_rows", "combine_weights", "eq7_row_id"]
