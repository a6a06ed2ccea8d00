"""Routing statistics for the planner: one sampled routing (numpy, deterministic by seed),
and how many distinct owners a token's K experts fall on, which is what ``dedup`` saves:
a token sends one payload row to each owner it routes to, not one per slot."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import sympy as sp


def _top_k(W: int, T: int, E: int, K: int, routing: str, alpha: float, seed: int) -> Iterator:
    """The K experts of each of W·T tokens, in chunks of rows: distinct, uniformly or with
    weights ∝ 1/(rank+1)^α where expert e has rank e (Gumbel top-K: sampling without
    replacement)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if routing == "uniform" or alpha == 0:
        logw = np.zeros(E)
    else:
        logw = -alpha * np.log(np.arange(1, E + 1, dtype=np.float64))
    n = W * T
    chunk = max(1, (1 << 21) // E)
    with np.errstate(divide="ignore"):
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            keys = logw - np.log(-np.log(1.0 - rng.random((rows, E))))
            yield np.argpartition(-keys, K - 1, axis=1)[:, :K]


def source_counts(W: int, T: int, E: int, K: int, routing: str, alpha: float, seed: int) -> list[list[int]]:
    """The routing ``sample_routing`` samples, as rows per (source rank, expert): token n of
    the W·T belongs to rank n // T. What the scheduler's cost model takes (``counts``)."""
    import numpy as np

    counts = np.zeros((W, E), dtype=np.int64)
    n = 0
    for top in _top_k(W, T, E, K, routing, alpha, seed):
        ranks = np.repeat((n + np.arange(top.shape[0])) // T, K)
        np.add.at(counts, (ranks, top.ravel()), 1)
        n += top.shape[0]
    return counts.tolist()


def sample_routing(
    W: int, T: int, E: int, K: int, routing: str, alpha: float, seed: int, owner: Sequence[int]
) -> tuple:
    """One sampled routing: rows per expert (a numpy int64 array of length E) and the
    distinct (token, owner) pairs, ``owner[e]`` the rank that owns expert e."""
    import numpy as np

    counts = np.zeros(E, dtype=np.int64)
    owner_of = np.asarray(owner, dtype=np.int64)
    pairs = 0
    for top in _top_k(W, T, E, K, routing, alpha, seed):
        counts += np.bincount(top.ravel(), minlength=E)
        owners = np.sort(owner_of[top], axis=1)
        pairs += int(top.shape[0] + (np.diff(owners, axis=1) != 0).sum())
    return counts, pairs


def owners_per_token_expr(E: sp.Expr, K: sp.Expr, experts_per_rank: Sequence[int]) -> sp.Expr:
    """Expected distinct owners of a token's K experts under uniform routing (K distinct
    experts, every K-set equally likely): owner q is hit unless all K miss its E_q experts,
    Σ_q 1 - C(E - E_q, K) / C(E, K)."""
    return sp.Add(
        *(n * (1 - sp.binomial(E - k, K) / sp.binomial(E, K)) for k, n in sorted(Counter(experts_per_rank).items()))
    )
