"""How far two computations of one value may differ when they round in another order.

Every floating-point operation returns its exact result times (1 + δ), |δ| ≤ u, the unit
roundoff of the dtype it rounds to (eps / 2). Two computations that differ only in their
order (a CPU's vector width, BLAS's blocking, a kernel's tiles against the reference's
per-token loop) differ by what their δs make of the value. Bounding every δ by u at once
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1: n·u·Σ|terms| for
a sum of n terms) is too loose to tell a reordering from a real error once a value has
passed two GEMMs and a backward; rounding errors behave as independent, mean-zero
perturbations (Higham & Mary, "A new approach to probabilistic rounding error analysis",
SIAM J. Sci. Comput. 41(5), 2019), which accumulate as √n, not n. So a comparison states
the dtype its computation rounds to and ``chain``, the roundings to that dtype an output
element passes through (a sum of n terms counts n; each pointwise step one), and:

- **σ, measured** (:func:`spread`): in fp32, the reference's own rounding error, sampled —
  it runs in fp32 and in float64 on the same inputs, :data:`SAMPLES` times, the inputs moved
  each time by a relative error uniform in [−u, u] so that every rounding falls anew
  (Monte Carlo arithmetic: Parker, Stott & Pierce, 1997), and σ is each element's RMS
  difference. It carries the values' magnitudes, the size of every reduction on the way and
  their cancellation, intermediate ones included. A narrower dtype (bf16, fp16), which the
  kernels round to at a few points while they accumulate in fp32 and the fp32 reference
  never does, is emulated instead: σ is the spread of the float64 result when the inputs
  move by that dtype's u;
- **another order**: σ is the error of one order of the reductions; another order of a
  reduction of n terms may gather up to √n times as much (recursive summation against a
  blocked one), so each computation is taken to lie within λ·√chain·σ: at :data:`LAMBDA` =
  8, were σ exact, a probability of failure below 2·exp(−32) ≈ 3·10^-14 per element
  (Hoeffding's inequality, as Higham and Mary use it); σ is estimated from 16 samples, and
  λ's margin is what absorbs the estimate's spread;
- **the last rounding** of both results, u·|value| each.

:func:`reorder_bound` is 2λ·√chain·σ + 2u·|want| per element: both computations' share. ``chain`` in a narrower dtype
counts only the roundings to it: a layer's :data:`NARROWINGS`.

A bound so derived catches what the tests exist to catch: a term missing, doubled or routed
to the wrong expert moves an element by that term, and a value rounded to a narrower dtype
than promised moves it by that dtype's u, bf16's 2^16 times fp32's, far beyond λ√chain
fp32 σ; tests/test_tolerance.py perturbs single elements and inputs so and sees the check
fail. The function σ is measured on must compute in float64 when given float64 (the
reference does); one that does not is refused, since its σ would be 0.

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

SAMPLES = 16  # runs that measure σ
LAMBDA = 8.0  # 2·exp(−32) ≈ 3·10^-14 per element were σ exact
# The roundings to a narrower dtype on a layer's way from input to output and back that the
# fp32 reference does not make: GEMM1's output (kept) and activation, GEMM2's output, the
# combined output; backward, g'·dL/dy, dH, dX, the weight gradients.
NARROWINGS = 8


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


def _float64(out: dict) -> dict:
    """The float64 results of a run in float64; a result in another dtype is refused (the
    function did not compute in float64, so its σ would measure nothing)."""
    other = [k for k, v in out.items() if v.dtype != torch.float64]
    assert not other, f"results {other} are not float64: the function must compute in float64 when given float64"
    return {k: v.detach() for k, v in out.items()}


def spread(fn: Callable, args: tuple, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs) -> dict:
    """{key: σ per element} of ``fn(*args, **kwargs)`` (a tensor, a tuple or a dict of
    tensors): in fp32 its rounding error, sampled; in a narrower dtype the spread its
    rounding of the inputs makes (see above)."""
    g = torch.Generator().manual_seed(seed)
    u = unit_roundoff(dtype)

    def moved(t):
        t = t.detach().double()
        return t * (1 + (torch.rand(t.shape, generator=g, dtype=torch.float64) * 2 - 1) * u)

    def run64(a, k):
        return _float64(_flat(fn(*_map(a, lambda t: t.detach().double()), **_map(k, lambda t: t.detach().double()))))

    with torch.enable_grad():  # fn may differentiate
        total: dict = {}
        exact = None if dtype == torch.float32 else run64(args, kwargs)
        for _ in range(SAMPLES):
            a, k = _map(args, moved), _map(kwargs, moved)
            if dtype == torch.float32:
                a, k = _map(a, lambda t: t.float()), _map(k, lambda t: t.float())
                got = {key: v.detach().double() for key, v in _flat(fn(*a, **k)).items()}
                diff = {key: got[key] - v for key, v in run64(a, k).items()}
            else:
                diff = {key: v - exact[key] for key, v in run64(a, k).items()}
            for key, d in diff.items():
                total[key] = total.get(key, 0) + d**2
    return {key: (v / SAMPLES).sqrt() for key, v in total.items()}


def reorder_bound(sigma, chain: int, want, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per element, how far two computations of ``want`` in ``dtype``, ``chain`` roundings to
    it long and spreading an error by ``sigma`` (:func:`spread`), may differ."""
    u = unit_roundoff(dtype)
    sigma = torch.as_tensor(sigma, dtype=torch.float64)
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
