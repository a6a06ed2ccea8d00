"""The library lowering of the expert GEMMs (``gemm library``): torch's grouped GEMM where
the Triton GEMM kernel would run.

Phased mode launches the transport kernel's entries that wait for no GEMM, then the GEMM
entries, then the transport's others, one after another on one stream. Under the library
lowering the middle launch is :func:`torch._grouped_mm` (CUTLASS on sm_90, torch's own loops
on the CPU) over each owner's payload rows as the dispatch landed them: expert-contiguous
from row 0, the scan's per-expert spans (``group``: first row and admitted count) their
offsets, device tensors the host never reads. GEMM1 takes [Wg Wu] as one [E, H, 2F]
operand (the weights' interleaved layout), the activation is one pass over its output,
GEMM2 writes the staging rows the return reads, and the row ids go beside them. Before them,
on the same stream, the GEMM kernel runs its items without computing them (``LIBRARY``):
each waits for what it would read — rows other ranks dispatch land whenever those ranks
get to it — and raises its entry's done flag, so the transport's next launch finds its
dependencies done and reads what the library wrote. A call that keeps what the
backward walks keeps the input rows and pre-activations at the rows' places among the
owner's rows, as ``gemm1`` does.

The GEMM entries' done flags are read only by their own rank's entries (the returns), which
run in the transport's next launch, after the library's GEMMs on the stream.

The backward likewise: dA = dO·Wdᵀ over the g'·dL/dy rows its dispatch landed, the
activation's backward (dH, interleaved as the weights), dX = dH·[Wg Wu]ᵀ into the staging
rows, and each local expert's weight gradients as 2-D × 2-D grouped GEMMs with the offsets
along their reduction (dWd = Aᵀ·dO, d[Wg Wu] = Xᵀ·dH; the biases' as row sums). The
pre-activations are the forward's, or GEMM1's again from the kept input rows
(``activations pre recompute``); under ``activations input resend`` the input rows come
again beside dO.

fp8 rows (the dispatch's, the backward's) are read times their scales; under dedup each row
reads its token's one row here through its link; under ``balance replicate`` one process per
rank a rank's redundant slots' operands come from where its kernels read them in place, their
gradients go where its exchange takes them home. What the lowering does not serve is
:func:`rdepc.ir.lowering.library_refusals`: segmented schedules.
"""

from __future__ import annotations

import torch
from rdepc.runtime.heap import own_slices
from rdepc.runtime.tensors import TORCH_DTYPES

from rdepc.ir.balance import slot_parts
from rdepc.ir.contract import KernelContract
from rdepc.ir.sizes import SCALE_BLOCK

WIRE = TORCH_DTYPES | {"fp8_e4m3": torch.float8_e4m3fn}  # a row's dtype on the wire, by name
SQRT_HALF = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327


def activation(pre: torch.Tensor, p: KernelContract) -> torch.Tensor:
    """The expert's activation of fp32 pre-activations (a gated expert's interleaved as
    [.., F, 2]): the device code's ``glu`` (SwiGLU, GPT-OSS's clamped variant), exact GELU
    or ReLU."""
    if p.gated:
        gate, up = pre[:, 0::2], pre[:, 1::2]
        if p.act == "clamped_swiglu":
            g = gate.clamp(max=p.act_limit)
            u = up.clamp(-p.act_limit, p.act_limit)
            return (u + 1.0) * (g * torch.sigmoid(g * p.act_alpha))
        return gate * torch.sigmoid(gate) * up
    if p.act == "gelu":
        return 0.5 * pre * (1.0 + torch.erf(pre * SQRT_HALF))
    return pre.clamp(min=0.0)


def activation_backward(pre: torch.Tensor, da: torch.Tensor, p: KernelContract) -> torch.Tensor:
    """dL/d(pre-activations) for dL/d(activation) ``da``, both fp32 (gated: interleaved as
    the pre-activations): the device code's ``glu_backward``, GELU's and ReLU's slopes. A
    clamped input passes no gradient (bounds included, as torch's clamp)."""
    if p.gated:
        gate, up = pre[:, 0::2], pre[:, 1::2]
        if p.act == "clamped_swiglu":
            g = gate.clamp(max=p.act_limit)
            u = up.clamp(-p.act_limit, p.act_limit)
            sig = torch.sigmoid(g * p.act_alpha)
            gs = g * sig
            d_gate = torch.where(gate <= p.act_limit, da * (u + 1.0) * (sig + gs * p.act_alpha * (1.0 - sig)), 0.0)
            d_up = torch.where((up >= -p.act_limit) & (up <= p.act_limit), da * gs, 0.0)
        else:
            sig = torch.sigmoid(gate)
            d_gate, d_up = da * up * sig * (1.0 + gate * (1.0 - sig)), da * (gate * sig)
        return torch.stack((d_gate, d_up), dim=-1).reshape(pre.shape)
    if p.act == "gelu":
        slope = 0.5 * (1.0 + torch.erf(pre * SQRT_HALF)) + pre * INV_SQRT_2PI * torch.exp(-0.5 * pre * pre)
    else:
        slope = (pre > 0.0).to(pre.dtype)
    return da * slope


def grouped(rows: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row block g of ``rows`` (the rows before ``offs[g]``, after ``offs[g - 1]``) times
    ``weights[g]``, fp32: the library's grouped GEMM, in the rows' dtype, widened."""
    return torch._grouped_mm(rows, weights, offs=offs).float()


def grouped_t(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[G, a cols, b cols]: group g is aᵀ·b over the rows of block g (a weight's gradient:
    the offsets along the reduction)."""
    return torch._grouped_mm(a.t(), b, offs=offs).float()


def block_sums(values: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[G, cols] fp32: each row block's column sums (a bias's gradient), as a grouped GEMM
    against a column of ones: the library's fp32 accumulation, in a fixed order (a scatter's
    atomics would not be)."""
    width = 16 // values.element_size()  # the grouped GEMM takes rows of 16 bytes at least
    ones = torch.ones(values.shape[0], width, dtype=values.dtype, device=values.device)
    return grouped_t(values, ones, offs)[..., 0]


class LibraryGemms:
    """The GEMM step of a module's calls under the library lowering: per owner this process
    runs, its home experts' weight indices (then its slots held in place), its rows (R_q) and
    their views in its heap slice."""

    def __init__(self, module):
        p: KernelContract = module.contract
        self.p = p
        self.dtype = module.dtype
        self.per_rank, self.rank = module.per_rank, module.rank
        self.owners = [module.rank] if module.per_rank else list(range(p.W))
        # one process per rank under balance replicate, a rank's last N locals are redundant
        # slots whose operands the kernels read packed in place (``slots``), not in the weights
        self.slots = p.slots_in_place
        self.parts = slot_parts(p.H, p.F, p.gated, p.bias)
        weight_of = module.tables["weight_of"].view(p.W, p.E_MAX)
        self.weights = [weight_of[q, : p.n_local[q] - self.slots].long() for q in self.owners]
        self.rows = [p.rows_max[q] for q in self.owners]
        self.at = dict(p.heap)

    # ------------------------------------------------------------------ views of the heap
    def _view(self, slices: torch.Tensor, i: int, at: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        size = rows * cols * torch.empty((), dtype=dtype).element_size()
        return slices[i, at : at + size].view(dtype).view(rows, cols)

    def _rows(self, slices: torch.Tensor, i: int, R: int, backward: bool) -> torch.Tensor:
        """Owner slice i's first R rows as its GEMM1 (forward) or its dA (backward) reads them,
        in the compute dtype: fp8 rows times their scales (one per ``cols`` columns); under
        dedup each row through its link to its token's first row here, and the backward's
        dL/dy there times the row's own g' (its dO)."""
        p = self.p
        if backward:
            payload, wire, scales, cols = "bwd_payload", p.dtype, "bwd_scales", SCALE_BLOCK
            wire = "fp8_e4m3" if p.bwd_fp8 else wire
            links, gate = "bwd_sideband_links", "bwd_sideband_gate"
        else:
            payload, wire, scales, cols = "payload", p.dispatch, "sideband_scale", p.scale_cols
            links, gate = "sideband_links", None
        rows = self._view(slices, i, self.at[payload], R, p.H, WIRE[wire])
        if wire == "fp8_e4m3":
            n = -(-p.H // cols)
            scale = self._view(slices, i, self.at[scales], R, n, torch.float32)
            rows = rows.float() * scale.repeat_interleave(cols, dim=1)[:, : p.H]
        if p.dedup:
            first = self._view(slices, i, self.at[links], R, 2, torch.int32)[:, 0].long().clamp(0, R - 1)
            rows = rows[first]
            if gate is not None:
                rows = rows.float() * self._view(slices, i, self.at[gate], R, 1, torch.float32)
        return rows.to(self.dtype)

    def _operand(self, given: dict, name: str, e: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
        """[local experts, *shape]: operand ``name`` (w_up as [H, UP_COLS·F], w_down, b_up,
        b_down) of the home experts ``e``, then of the redundant slots held in place."""
        if name not in given or (name.startswith("b_") and not self.p.bias):
            return None
        home = given[name][e].reshape(len(e), *shape)
        if not self.slots:
            return home
        at, n = self.parts[name]
        return torch.cat((home, given["slots"][:, at : at + n].reshape(self.slots, *shape)))

    def _gradient(self, given: dict, name: str, e: torch.Tensor, grad: torch.Tensor) -> None:
        """Store the local experts' gradient of operand ``name``: the home experts' into
        ``d``+name, the slots' into their parts of ``dslots``."""
        homes = len(e)
        given["d" + name][e] = grad[:homes].reshape(homes, *given["d" + name].shape[1:]).to(self.dtype)
        if self.slots:
            at, n = self.parts[name]
            given["dslots"][:, at : at + n] = grad[homes:].reshape(self.slots, n).to(self.dtype)

    def _gemm1(self, x: torch.Tensor, given: dict, e: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """GEMM1's pre-activations of rows ``x`` (+ b_up), in the compute dtype, as ``gemm1``
        keeps them and the backward's recompute forms them again."""
        p = self.p
        cols = (2 if p.gated else 1) * p.F
        pre = grouped(x, self._operand(given, "w_up", e, (p.H, cols)), offs)
        if p.bias:
            pre += self._operand(given, "b_up", e, (cols,)).float()[self._expert_of(offs, x.shape[0])]
        return pre.to(self.dtype)

    def _spans(self, group: torch.Tensor, i: int, q: int) -> torch.Tensor:
        """Owner q's offsets: the end of each local expert's rows (first + admitted), int32
        (its redundant slots among them)."""
        g = group[i, : self.p.n_local[q]]
        return (g[:, 0] + g[:, 1]).to(torch.int32)

    def run(self, given: dict, backward: bool, save: bool) -> None:
        """The GEMM step of a pass (``given``: a launch's arguments by name)."""
        if backward:
            self.backward(given["heap"], given)
        else:
            self.forward(given["heap"], given, save)

    # ------------------------------------------------------------------ the forward
    def forward(self, heap: torch.Tensor, given: dict, save: bool) -> None:
        p = self.p
        slices = own_slices(heap, self.per_rank, self.rank)
        for i, q in enumerate(self.owners):
            R, e = self.rows[i], self.weights[i]
            offs = self._spans(given["group"], i, q)
            x = self._rows(slices, i, R, backward=False)
            pre = self._gemm1(x, given, e, offs)
            act = activation(pre.float(), p).to(self.dtype)
            out = grouped(act, self._operand(given, "w_down", e, (p.F, p.H)), offs)
            if p.bias:
                out += self._operand(given, "b_down", e, (p.H,)).float()[self._expert_of(offs, R)]
            out = out.to(self.dtype)
            given["staging"][i, :R] = out
            if save and p.dedup:  # the owner keeps its rows' outputs for the gate's gradient
                given["saved_out"][i, :R] = out
            given["staging_rid"][i, :R] = self._view(slices, i, self.at["sideband_row_id"], R, 1, torch.int64)[:, 0]
            if save:
                if not p.recompute:
                    given["saved_pre"][i, :R] = pre
                if not p.resend:
                    given["saved_x"][i, :R] = x

    @staticmethod
    def _expert_of(offs: torch.Tensor, rows: int) -> torch.Tensor:
        """Each row's expert among the owner's (rows past the last span: the last expert's)."""
        at = torch.arange(rows, device=offs.device, dtype=torch.int32)
        return torch.searchsorted(offs, at, right=True).clamp(max=len(offs) - 1)

    # ------------------------------------------------------------------ the backward
    def backward(self, heap: torch.Tensor, given: dict) -> None:
        p = self.p
        slices = own_slices(heap, self.per_rank, self.rank)
        payload = WIRE[p.dispatch]
        up_cols = (2 if p.gated else 1) * p.F
        for i, q in enumerate(self.owners):
            R, e = self.rows[i], self.weights[i]
            offs = self._spans(given["group"], i, q)
            w_up = self._operand(given, "w_up", e, (p.H, up_cols))
            d_o = self._rows(slices, i, R, backward=True)
            if p.resend:
                x = self._view(slices, i, self.at["bwd_inputs"], R, p.H, payload).to(self.dtype)
            else:
                x = given["saved_x"][i, :R]
            pre = (self._gemm1(x, given, e, offs) if p.recompute else given["saved_pre"][i, :R]).float()
            da = grouped(d_o, self._operand(given, "w_down", e, (p.F, p.H)).transpose(1, 2), offs)
            dh = activation_backward(pre, da, p).to(self.dtype)
            act = activation(pre, p).to(self.dtype)
            given["staging"][i, :R] = grouped(dh, w_up.transpose(1, 2), offs).to(self.dtype)
            given["staging_rid"][i, :R] = self._view(slices, i, self.at["bwd_row_ids"], R, 1, torch.int64)[:, 0]
            self._gradient(given, "w_up", e, grouped_t(x, dh, offs))
            self._gradient(given, "w_down", e, grouped_t(act, d_o, offs))
            if p.bias:
                self._gradient(given, "b_up", e, block_sums(dh, offs))
                self._gradient(given, "b_down", e, block_sums(d_o, offs))


__all__ = ["LibraryGemms", "activation", "activation_backward", "block_sums", "grouped", "grouped_t"]
