"""How far two computations of one value may differ when they round in another order.

Every floating-point operation returns its exact result times (1 + δ), |δ| ≤ u, the unit
roundoff of the dtype it rounds to (eps / 2). Two computations that differ only in their
order (a CPU's vector width, BLAS's blocking, a kernel's tiles against the reference's
per-token loop) differ by what their δs make of the value. Bounding every δ by u at once
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1: n·u·Σ|terms| for
a sum of n terms) is too loose to tell a reordering from a real error once a value has
passed two GEMMs and a backward; rounding errors behave as independent, mean-zero
perturbations (Higham & Mary, "A new approach to probabilistic rounding error analysis",
SIAM J. Sci. Comput. 41(5), 2019), which accumulate as √n, not n. So:

- **magnitude**: how the computation spreads one rounding's error is measured, not
  guessed: it runs in float64 :data:`SAMPLES` times with every floating input multiplied
  by (1 + δ), δ uniform in [−u, u] (a rounding's error), and σ is each output element's
  standard deviation about the unperturbed float64 result (Monte Carlo arithmetic: Parker,
  Stott & Pierce, 1997). σ carries the values' magnitudes and the computation's
  conditioning (a sum whose terms cancel spreads an error far beyond its result);
- **size of the reduction**: an output element passes through ``chain`` roundings (a sum
  of n terms counts n; each pointwise step — exp, a division, an activation, a scale —
  one), each spreading an error like an input's, so the order's effect is within
  √chain · σ for each computation;
- **the dtype's epsilon**: u above, and the final rounding of each result, u·|value|.

Each computation is within λ·√chain·σ of the exact value with a probability of failure below
2·exp(−λ²/2) (Hoeffding's inequality, as Higham and Mary use it); at :data:`LAMBDA` = 8
that is 3·10^-14 per element. :func:`reorder_bound` is twice that plus both results'
rounding, per element.

A bound so derived catches what the tests exist to catch: a term missing, doubled or routed
to the wrong expert moves an element by that term, and a value rounded to a narrower dtype
than promised (bf16: u = 2^-9, 2^15 times fp32's) moves it by thousands of σ;
tests/test_tolerance.py perturbs single elements and inputs so and sees the check fail.

What this bound is not for: the comparisons the project promises bitwise (one lowering
across runs, schedules, kernel modes and backends on one machine) stay ``torch.equal``; a
comparison with a quantised computation is bounded by its quantisation step, stated where
it is made; a result that is exact (integer-valued, or one rounding of an exact value) is
compared exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

SAMPLES = 16  # float64 runs that measure σ
LAMBDA = 8.0  # standard deviations: 2·exp(−32) ≈ 3·10^-14 per element


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def _map(values, f):
    """``values`` (a tensor, a tuple, a named tuple, a dict, or None) with ``f`` applied to
    every floating tensor in it."""
    if isinstance(values, torch.Tensor):
        return f(values) if values.is_floating_point() else values
    if isinstance(values, dict):
        return {k: _map(v, f) for k, v in values.items()}
    if hasattr(values, "_replace"):
        return type(values)(*(_map(v, f) for v in values))
    if isinstance(values, (tuple, list)):
        return type(values)(_map(v, f) for v in values)
    return values


def _flat(out) -> dict:
    """A function's result as {key: tensor}: a dict, a tuple (by position) or a tensor."""
    if isinstance(out, torch.Tensor):
        return {0: out}
    if isinstance(out, dict):
        return dict(out)
    return {i: v for i, v in enumerate(out) if isinstance(v, torch.Tensor) and v.is_floating_point()}


def spread(fn: Callable, args: tuple, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs) -> dict:
    """{key: σ per element} of ``fn(*args, **kwargs)`` (a tensor, a tuple or a dict of
    tensors), run in float64 with every floating input perturbed by a relative error
    uniform in [−u, u] of ``dtype`` (see above)."""
    g = torch.Generator().manual_seed(seed)
    u = unit_roundoff(dtype)

    def f64(t):
        return t.detach().double()

    def noisy(t):
        t = t.detach().double()
        return t * (1 + (torch.rand(t.shape, generator=g, dtype=torch.float64) * 2 - 1) * u)

    with torch.enable_grad():  # fn may differentiate
        exact = {k: v.detach().double() for k, v in _flat(fn(*_map(args, f64), **_map(kwargs, f64))).items()}
        total = {k: torch.zeros_like(v) for k, v in exact.items()}
        for _ in range(SAMPLES):
            out = _flat(fn(*_map(args, noisy), **_map(kwargs, noisy)))
            for k in total:
                total[k] += (out[k].detach().double() - exact[k]) ** 2
    return {k: (v / SAMPLES).sqrt() for k, v in total.items()}


def reorder_bound(sigma: torch.Tensor, chain: int, want: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Per element, how far two computations of ``want`` in ``dtype``, ``chain`` roundings
    long and spreading an error by ``sigma`` (:func:`spread`), may differ."""
    u = unit_roundoff(dtype)
    return 2 * LAMBDA * math.sqrt(chain) * sigma + 2 * u * torch.as_tensor(want).detach().double().abs()


def bounds(fn: Callable, args: tuple, chain: int, dtype: torch.dtype = torch.float32, **kwargs) -> dict:
    """{key: per-element bound} for each result of ``fn(*args, **kwargs)`` computed another
    way: :func:`reorder_bound` of its :func:`spread`."""
    want = _flat(fn(*args, **kwargs))
    return {k: reorder_bound(s, chain, want[k], dtype) for k, s in spread(fn, args, dtype, **kwargs).items()}


def bound(fn: Callable, args: tuple, chain: int, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor:
    """:func:`bounds` of a function with one result that counts (a tensor, or a tuple whose
    first entry is the result: the reference's (y, accepted))."""
    return bounds(fn, args, chain, dtype, **kwargs)[0]


def layer_chain(H: int, F: int, K: int, extra: int = 0) -> int:
    """The roundings from a layer's input to its output: GEMM1's sum over H, GEMM2's over F,
    the sum over K slots (``extra``: a shared expert's F, or for a weight's gradient the rows
    it sums), and 8 pointwise steps (activation and its product, gate, the router's score,
    renormalisation and scale, biases, clamps)."""
    return H + F + K + extra + 8


def assert_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, what: str = "") -> None:
    """|got − want| ≤ ``bound`` for every element (NaN nowhere), else an AssertionError naming
    the worst element, its error and its bound."""
    got, want = (t.detach().double() for t in torch.broadcast_tensors(got.detach(), want.detach()))
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(want)
    err = (got - want).abs()
    bad = ~(err <= bound)  # a NaN fails
    if bad.any():
        over = torch.where(bad, err / bound.clamp_min(1e-300), torch.zeros_like(err)).nan_to_num(nan=float("inf"))
        i = int(over.reshape(-1).argmax())
        at = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), want.shape)) if want.dim() else ()
        raise AssertionError(
            f"{what + ': ' if what else ''}{int(bad.sum())} of {want.numel()} elements beyond their bound; "
            f"worst at {at}: got {got.reshape(-1)[i].item():.9g}, want {want.reshape(-1)[i].item():.9g}, "
            f"|error| {err.reshape(-1)[i].item():.3g} > bound {bound.reshape(-1)[i].item():.3g}"
        )
