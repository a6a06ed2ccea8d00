"""The torch side of a layer's tensors, shared by the module, tuning and the face: the spec's
dtypes as torch dtypes, the packed gate/up operand GEMM1 reads, 16-byte alignment, and the
relative error a run is checked with."""

from __future__ import annotations

import math

import torch

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_DTYPES = {"int32": torch.int32, "int64": torch.int64}


def gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """[E, H, F] gate and up weights as the one [E, H, F, 2] operand GEMM1 reads (column 2f
    gate f, 2f + 1 up f): a view when they are already the halves of one such tensor,
    otherwise a new tensor."""
    if torch.compiler.is_compiling():  # fake tensors have no storage to compare: interleave
        return torch.stack((w_gate, w_up), dim=-1)
    shape = (*w_gate.shape, 2)
    strides = [1]
    for n in reversed(shape[1:]):
        strides.insert(0, strides[0] * n)
    halves = (
        w_up.shape == w_gate.shape
        and w_up.dtype == w_gate.dtype
        and w_up.device == w_gate.device
        and w_gate.stride() == w_up.stride() == tuple(strides[:-1])
        and w_gate.untyped_storage().data_ptr() == w_up.untyped_storage().data_ptr()
        and w_up.data_ptr() == w_gate.data_ptr() + w_gate.element_size()
    )
    return w_gate.as_strided(shape, strides) if halves else torch.stack((w_gate, w_up), dim=-1)


def gemm1_operand(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Gate and up (weights or biases) as GEMM1's interleaved operand: :func:`gate_up`, or a
    new stacked tensor when autograd needs their gradients (a view of one [..., 2] tensor has
    no gradient of its own halves)."""
    grads = torch.is_grad_enabled() and (w_gate.requires_grad or w_up.requires_grad)
    return torch.stack((w_gate, w_up), dim=-1) if grads else gate_up(w_gate, w_up)


def aligned(w: torch.Tensor) -> torch.Tensor:
    """``w``, or a copy of it whose first element is 16-byte aligned, as TMA requires; every
    tensor a launch passes is, so that Triton specialises every pointer as aligned
    (``tt.divisibility`` 16), the build ``rdepc compile --target sm_90`` reports."""
    return w if w.data_ptr() % 16 == 0 else w.clone()


# Elements per slice max_relative_error widens at once: whole, a weight gradient in float64
# (deepseek_v3's w_up: 15 GB) and its temporaries do not fit beside what a check holds.
ERROR_SLICE = 1 << 24


def max_relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max|y - ref| / max|ref| (0 when both are zero), in float64, a slice of ERROR_SLICE
    elements at a time (a maximum is exact in any order)."""
    y, ref = (t.reshape(-1) for t in torch.broadcast_tensors(y, ref))
    scales, errs = [0.0], [0.0]
    for i in range(0, ref.numel(), ERROR_SLICE):
        r = ref[i : i + ERROR_SLICE].double()
        scales.append(float(r.abs().max()))
        errs.append(float((y[i : i + ERROR_SLICE].double() - r).abs().max()))
    scale, err = (float(torch.tensor(v, dtype=torch.float64).max()) for v in (scales, errs))  # a NaN stays one
    if scale == 0:
        return 0.0 if err == 0 else math.inf
    return err / scale


__all__ = ["INT_DTYPES", "TORCH_DTYPES", "aligned", "gate_up", "gemm1_operand", "max_relative_error"]
