"""The generated backward: gradients of x, the gates and every expert weight through
``torch.autograd``, against autograd through ``rdepc.reference``, under every capacity
policy and schedule (and bitwise the same across schedules); the accepted set it walks is
the forward's; a withheld backward task trips with the kernel's record."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from rdepc.passes.symmetric import symmetric_plan
from rdepc.runtime.autograd import gate_grad
from rdepc.runtime.module import KernelError
from rdepc.runtime.tensors import TORCH_DTYPES
from tolerance import assert_close, bound, bounds, layer_chain

from rdepc.api import Layer, elaborate_layer
from rdepc.ir.contract import Tiles
from rdepc.ir.spec import is_gated
from rdepc.parser import parse_text
from rdepc.reference import random_biases, random_inputs, reference_for
from rdepc.reference_capacity import combine_weights

STRATEGIES = ("bulk", "pipelined", "deep")
TILES = Tiles(bm=16, block_h=32, block_f=32, block_r=64, block_k=32)
NAMES = ("x", "topk_weights", "w_gate", "w_up", "w_down")


pytestmark = pytest.mark.usefixtures("fresh_cache")


@dataclass(frozen=True)
class Case:
    W: int = 2
    E: int = 4
    K: int = 2
    T: int = 12
    S: int = 8
    B: int = 2
    H: int = 32
    F: int = 32
    act: str = "swiglu"
    act_args: str = ""  # after ffn, e.g. ", limit = 0.5"
    bias: bool = False  # expert biases
    extra: str = ""  # more statements
    capacity: str = "dropless"
    routing: str = "uniform"
    seed: int = 0
    dedup: bool = False
    gate_input: bool = False  # expert ..., gate input
    dtype: str = "fp32"  # the dtype statement's options

    def layer(self) -> Layer:
        text = (
            "layer grad {\n"
            f"  shape     ranks {self.W}, tokens {self.T}, hidden {self.H}, experts {self.E}, top {self.K}\n"
            f"  expert    {self.act}(ffn = {self.F}{self.act_args}){', bias' if self.bias else ''}"
            f"{', gate input' if self.gate_input else ''}\n"
            f"  dtype     {self.dtype}\n"
            "  owner     balanced\n"
            f"  capacity  {self.capacity}\n"
            f"  segment   rows {self.S}, buffers {self.B}\n"
            "  schedule  pipelined\n"
            + self.extra
            + ("  sideband  row_id, local_expert, gate\n  transport emulated, dedup\n" if self.dedup else "")
            + "}\n"
        )
        spec, _ = elaborate_layer(parse_text(text, "grad.rdep"), None, {})
        return Layer(spec)

    def inputs(self, dtype=torch.float32):
        gated = is_gated(self.act)
        return random_inputs(
            self.W, self.T, self.H, self.F, self.E, self.K, gated=gated, routing=self.routing, seed=self.seed,
            dtype=dtype,
        )  # fmt: skip

    def biases(self, dtype=torch.float32) -> dict:
        if not self.bias:
            return {}
        return random_biases(self.E, self.H, self.F, gated=is_gated(self.act), seed=self.seed, dtype=dtype)


def grads(fn, inputs, dy=None, biases=None):
    """(y, accepted or None, {name: grad}) of sum(y * dy) through ``fn``; ``biases``: the
    expert biases by name, passed as keywords (and their gradients returned)."""
    x, ids, g, wg, wu, wd = inputs
    named = dict(zip(NAMES, (x, g, wg, wu, wd), strict=True)) | (biases or {})
    leaves = {n: None if t is None else t.detach().clone().requires_grad_(True) for n, t in named.items()}
    out = fn(
        *(leaves[n] for n in NAMES[:1]), ids, *(leaves[n] for n in NAMES[1:]), **{k: leaves[k] for k in biases or {}}
    )
    y, accepted = out if isinstance(out, tuple) else (out, None)
    if dy is None:
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * dy).sum().backward()
    return y.detach(), accepted, dy, {n: t.grad for n, t in leaves.items() if t is not None}


def grad_bounds(case: Case, spec, inputs, dy, biases=None) -> dict:
    """{name: per-element bound} of each gradient of sum(y · dy) against autograd through the
    reference (tests/tolerance.py): the layer's chain and the W·T·K rows a weight's gradient sums."""

    def reference_grads(inputs, dy, biases):
        return grads(reference_for(spec), inputs, dy, biases)[3]

    chain = layer_chain(case.H, case.F, case.K, extra=case.W * case.T * case.K)
    return bounds(reference_grads, (inputs, dy, biases or {}), chain)


def check(case: Case, strategies=STRATEGIES) -> dict:
    layer = case.layer()
    inputs, biases = case.inputs(), case.biases()
    _, accepted, dy, want = grads(reference_for(layer.spec), inputs, biases=biases)
    limits = grad_bounds(case, layer.spec, inputs, dy, biases)
    got_all = {}
    for strategy in strategies:
        m = layer.module(schedule=strategy, tiles=TILES)
        y, _, _, got = grads(m, inputs, dy, biases)
        assert torch.equal(m.last_stats["accepted"], accepted), f"{strategy}: accepted set differs for {case}"
        assert torch.equal(m.last_context.accepted, accepted)
        for name, w in want.items():
            assert_close(got[name], w, limits[name], f"{strategy}: d{name} for {case}")
        got_all[strategy] = (y, got)
    first = strategies[0]
    for strategy in strategies[1:]:
        for name in want:
            assert torch.equal(got_all[strategy][1][name], got_all[first][1][name]), (
                f"{strategy}: d{name} is not bitwise {first}'s for {case}"
            )
    return got_all


# ------------------------------------------------------------------ parity with autograd


@pytest.mark.parametrize(
    "case",
    [
        Case(),  # dropless, B·S = 16 < W·T·K: segments reuse the ring
        Case(capacity="factor 0.5", routing="zipf:1.5"),  # drop by arrival, renormalize
        Case(W=3, E=6, T=10, B=3, capacity="factor 0.5, weights zero", routing="zipf:1.5"),  # zero weights
        Case(act="gelu", capacity="rows 3"),
        Case(act="relu", E=3, T=8, S=3, B=2),  # one owner holds two experts, a return ring of 6 rows
        Case(K=3, capacity="factor 0.5", routing="zipf:1.5", dedup=True),  # a return ring, drops
        # every segment resident: rows land in place; expert biases, summed per (token, owner) at the owner
        Case(act="relu", E=3, T=8, S=3, B=2, dedup=True, bias=True),
        # GPT-OSS's experts: its activation, the limit low enough that about half the pre-activations
        # clamp, and biases
        Case(act="clamped_swiglu", act_args=", limit = 0.5, alpha = 1.5", capacity="rows 5", bias=True),
    ],
    ids=[
        "dropless",
        "renormalize",
        "zero-weights",
        "gelu-rows",
        "relu-ring",
        "dedup-ring",
        "dedup-relu-bias",
        "clamped-bias",
    ],
)
def test_gradients_match_autograd_through_the_reference_in_every_schedule(case):
    check(case)


def test_an_all_dropped_token_gets_zero_gradients():
    """rows 1: each expert admits one row, so most tokens lose every slot."""
    case = Case(capacity="rows 1", routing="hot")
    got = check(case, ("bulk",))["bulk"][1]
    layer = case.layer()
    inputs = case.inputs()
    _, accepted = reference_for(layer.spec)(*inputs)
    none = ~accepted.any(dim=-1)  # tokens with every slot dropped
    assert int(none.sum()) > 0
    assert not got["x"][none].any() and not got["topk_weights"][none].any()
    # weights zero: a dropped slot's gate gets no gradient at all (renormalize: it may, through
    # the token's total, which its gate is part of)
    zero = Case(capacity="rows 1, weights zero", routing="hot")
    g0 = check(zero, ("bulk",))["bulk"][1]["topk_weights"]
    assert not g0[~accepted].any()


def test_gate_gradient_through_renormalize_by_hand():
    g = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [0.7, 0.2, 0.1]], dtype=torch.float64, requires_grad=True)
    accepted = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    up = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, 6.0], [0.5, 0.25, -1.0]], dtype=torch.float64)
    everywhere = torch.ones_like(accepted)
    nowhere = everywhere.clone()
    nowhere[2, 2] = False  # expert id -1: its gate is no part of the token's total

    def autograd(g, up, routed, policy):
        g = g.detach().clone().requires_grad_(True)
        (combine_weights(torch.where(routed, g, 0.0), accepted & routed, policy) * up).sum().backward()
        return g.grad

    for routed in (everywhere, nowhere):
        for policy in ("renormalize", "zero"):
            g.grad = None
            (combine_weights(torch.where(routed, g, 0.0), accepted & routed, policy) * up).sum().backward()
            got = gate_grad(g.detach(), accepted & routed, up, policy, routed)
            # both in float64, in another order: two sums of K = 3 gates, the products with up and
            # their sum over K, and 8 pointwise steps
            limit = bound(autograd, (g, up, routed, policy), 3 * 3 + 8, torch.float64)
            assert_close(got, g.grad, limit, policy)
        assert not got[1].any()  # nothing accepted: no gradient
    assert got[2, 2] == 0 and g.grad[2, 2] == 0


def test_finite_differences_in_fp32():
    """No fp64 layer dtype exists (fp32, fp16, bf16), so no float64 gradcheck: a central
    difference in fp32 of sum(y · dy) along random directions of x, the gates and every weight
    agrees with the backward's directional derivative."""
    case = Case(T=6, capacity="factor 0.75", routing="zipf:1.5")
    layer = case.layer()
    m = layer.module(schedule="pipelined", tiles=TILES)
    inputs = case.inputs()
    _, _, dy, got = grads(m, inputs)
    x, ids, g, wg, wu, wd = inputs
    base = {"x": x, "topk_weights": g, "w_gate": wg, "w_up": wu, "w_down": wd}
    gen = torch.Generator().manual_seed(3)
    for name in NAMES:
        v = torch.randn(base[name].shape, generator=gen)
        eps = 1e-2 * float(base[name].abs().max()) / float(v.abs().max())

        def loss(sign, name=name, v=v, eps=eps):
            args = dict(base) | {name: base[name] + sign * eps * v}
            with torch.no_grad():
                y = m(args["x"], ids, args["topk_weights"], args["w_gate"], args["w_up"], args["w_down"])
            return float((y.double() * dy.double()).sum())

        fd = (loss(1) - loss(-1)) / (2 * eps)
        an = float((got[name].double() * v.double()).sum())
        # Not a reordering (tests/tolerance.py's bound does not apply): a central difference is off
        # by its truncation error, eps² / 6 times the third derivative along v, with eps 1 % of the
        # input's largest entry about 5e-5 of the derivative here (the same difference in float64
        # through the reference), plus the fp32 roundings of the two losses divided by 2·eps (about
        # 1e-5 of it): 2e-3 is 40 times what they come to, and far below a wrong gradient's error
        assert abs(fd - an) <= 2e-3 * max(abs(an), 1.0), f"d{name}: finite difference {fd:.6g}, backward {an:.6g}"


# ------------------------------------------------------------------ the routing it walks


def test_the_backward_walks_its_own_forward_when_another_ran_since():
    """Two forwards, then their backwards in reverse order (as with two micro-batches): each
    backward walks the routing its own forward kept, not the module's latest."""
    case = Case(capacity="factor 0.75", routing="zipf:1.5")
    layer = case.layer()
    m = layer.module(schedule="pipelined", tiles=TILES)
    first, second = case.inputs(), Case(capacity="factor 0.75", routing="uniform", seed=5).inputs()
    alone = grads(m, first)[3]
    x, ids, g, wg, wu, wd = first
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, g, wg, wu, wd)]
    y1 = m(leaves[0], ids, *leaves[1:])
    accepted_first = m.last_context.accepted
    y2 = m(*(t.detach().clone().requires_grad_(True) if t.is_floating_point() else t for t in second))
    assert not torch.equal(m.last_context.accepted, accepted_first)  # the second routed otherwise
    dy = torch.randn(y1.shape, generator=torch.Generator().manual_seed(7))
    y2.sum().backward()
    (y1 * dy).sum().backward()
    for name, t in zip(NAMES, leaves, strict=True):
        assert torch.equal(t.grad, alone[name]), name


def test_the_heap_is_the_plans_forward_backward_figure():
    """Also with the backward's regions grown: re-sent input rows, fp8 rows and their scales."""
    grown = Case(act="relu", E=3, T=8, S=3, dtype="fp32, backward fp8_e4m3", extra="  activations input resend\n")
    for case in (Case(act="relu", E=3, T=8, S=3), grown):
        for strategy in STRATEGIES:
            layer = case.layer()
            m = layer.module(schedule=strategy, tiles=TILES)
            want = symmetric_plan(layer.spec, strategy)["forward_backward"]["total"]
            assert tuple(m.heap.shape) == (2, want) == (2, m.contract.heap_bytes), (case, strategy)
    buffers = symmetric_plan(grown.layer().spec, "pipelined")["buffers"]
    assert buffers["bwd_inputs"] > 0 and buffers["bwd_scales"] > 0 and buffers["bwd_return_scales"] > 0


def test_a_withheld_backward_task_trips_with_the_kernels_record_and_the_next_backward_recovers():
    case = Case()
    layer = case.layer()
    m = layer.module(schedule="pipelined", tiles=TILES, spin_bound=200)
    entry = next(i for i, n in enumerate(m.contract.bwd_names) if n.startswith("gemm1"))
    m.withhold(entry, backward=True)
    with pytest.raises(KernelError, match=r"the backward kernel stopped in call 1: .* waited 200 spins") as err:
        grads(m, case.inputs())
    record = err.value.record
    assert record["pass"] == "backward" and record["flag_task"] == m.contract.bwd_names[entry]
    # The backward's control words were reset: the next backward runs, and its gradients are right.
    check_again = grads(m, case.inputs())[3]
    _, _, dy, want = grads(reference_for(layer.spec), case.inputs(), dy=None)
    limits = grad_bounds(case, layer.spec, case.inputs(), dy)
    for name in want:
        assert_close(check_again[name], want[name], limits[name], f"d{name}")


@pytest.mark.parametrize("pre", ["keep", "recompute"])
def test_what_the_forward_keeps_is_the_planners_saved_activations(pre):
    from rdepc.passes.plan import plan

    case = Case(capacity="factor 1.0", extra=f"  activations pre {pre}\n")
    layer = case.layer()
    m = layer.module(schedule="pipelined", tiles=TILES)
    x, ids, g, wg, wu, wd = case.inputs()
    from rdepc.runtime import ops
    from rdepc.runtime.tensors import gate_up

    brought, _ = m.padding(None, x.shape[-2])  # what a differentiable call's rdepc::forward returns
    out = ops.forward(m.handle, x, ids, g, gate_up(wg, wu), wd, None, None, brought, True)
    kept = dict(zip((name for name, _, _ in ops.forward_layout(m, x.shape[-2], True)), out, strict=True))
    figures = {f.key: f.value for f in plan(layer.spec).figures()}
    rows = [kept[n][0] for n in ("saved_x", "saved_pre") if n in kept]
    assert ("saved_pre" in kept) == (pre == "keep")
    per_owner = sum(r.numel() for r in rows) * kept["saved_x"].element_size()
    assert per_owner == figures["saved_activations.per_layer"]
    assert (
        kept["saved_out"][0].numel() * kept["saved_out"].element_size()
        == figures["saved_activations.outputs_per_layer"]
    )


@pytest.mark.parametrize(
    "case",
    [
        Case(act="clamped_swiglu", act_args=", limit = 0.5", bias=True, capacity="rows 5"),
        Case(act="relu", E=3, T=8, S=3, B=2, dedup=True),
    ],
    ids=["gated-bias", "relu-dedup"],
)
def test_recomputed_pre_activations_give_the_kept_ones_outputs_and_gradients_bitwise(case):
    """activations pre recompute: the forward keeps no pre-activations and the backward runs
    GEMM1 again from the kept input rows, with the forward's tile and reduction order; outputs
    and every gradient are bitwise those of keeping them."""
    inputs, biases = case.inputs(), case.biases()
    kept = case.layer().module(schedule="pipelined", tiles=TILES)
    y, _, dy, want = grads(kept, inputs, biases=biases)
    again = dataclasses.replace(case, extra="  activations pre recompute\n").layer()
    for strategy in ("pipelined", "bulk"):
        m = again.module(schedule=strategy, tiles=TILES)
        got_y, _, _, got = grads(m, inputs, dy, biases)
        assert m.contract.recompute and torch.equal(got_y, y), strategy
        for name in want:
            assert torch.equal(got[name], want[name]), f"{strategy}: d{name}"


# ------------------------------------------------------------------ the gate on the expert's input


@pytest.mark.parametrize(
    "case",
    [
        Case(W=3, E=6, T=10, B=3, capacity="factor 0.5, weights zero", routing="zipf:1.5", gate_input=True),
        Case(
            act="clamped_swiglu", act_args=", limit = 0.5", bias=True, capacity="rows 5, weights zero", gate_input=True
        ),
    ],
    ids=["zero-weights", "clamped-bias"],
)
def test_the_gate_on_the_experts_input_matches_autograd_through_the_reference(case):
    """``expert ..., gate input`` (Llama-4): y = Σ f(g'·x). The dispatch scales each row, the
    combine adds the returned rows unweighted, the backward sends dL/dy as it is and the
    front-end forms dL/dx = Σ g'·dL/d(g'x) and dL/dg' = x·dL/d(g'x): every gradient against
    autograd through the reference, bitwise across schedules; and it is not the output-gated
    operator."""
    from rdepc.passes.plan import plan
    from rdepc.runtime import ops

    got = check(case, strategies=("pipelined", "bulk"))
    layer = case.layer()
    m = layer.module(tiles=TILES)
    assert layer.spec.gate_on == "input" and m.contract.gate_input
    # no expert output is kept for the gate gradient: it reads x, which the planner counts instead
    assert "saved_out" not in {name for name, _, _ in ops.kept_layout(m, case.T)}
    figures = {f.key: f.value for f in plan(layer.spec).figures()}
    assert figures["saved_activations.outputs_per_layer"] == case.T * case.H * 4
    y = got["pipelined"][0]
    other = grads(reference_for(dataclasses.replace(case, gate_input=False).layer().spec), case.inputs(),
                  biases=case.biases())[0]  # fmt: skip
    assert float((y - other).abs().max()) > 1e-3 * float(other.abs().max())


@pytest.mark.parametrize(
    ("case", "policy"),
    [
        (Case(act="clamped_swiglu", act_args=", limit = 0.5", bias=True, capacity="rows 5"), "input resend"),
        (
            Case(W=3, E=6, T=10, B=3, capacity="factor 0.5, weights zero", gate_input=True),
            "pre recompute, input resend",
        ),
    ],
    ids=["gated-bias", "gate-input-recompute"],
)
def test_resent_input_rows_give_the_kept_ones_outputs_and_gradients_bitwise(case, policy):
    """activations input resend: the owners keep no input rows; the backward's dispatch sends
    them again beside dL/dy, as the forward's dispatch sent them (g'·x under gate input), and
    GEMM1 again reads them where the forward's GEMM1 read its payload. Outputs and every
    gradient are bitwise those of keeping them; what the forward keeps is the planner's figure."""
    from rdepc.passes.plan import plan
    from rdepc.runtime import ops

    inputs, biases = case.inputs(), case.biases()
    y, _, dy, want = grads(case.layer().module(schedule="pipelined", tiles=TILES), inputs, biases=biases)
    again = dataclasses.replace(case, extra=f"  activations {policy}\n").layer()
    m = again.module(schedule="pipelined", tiles=TILES)  # B = 2 slots of 8 rows: the ring is reused
    got_y, _, _, got = grads(m, inputs, dy, biases)
    assert m.contract.resend and torch.equal(got_y, y)
    for name in want:
        assert torch.equal(got[name], want[name]), f"d{name}"
    kept = {name: shape for name, shape, _ in ops.kept_layout(m, case.T)}
    assert "saved_x" not in kept and ("saved_pre" in kept) == ("recompute" not in policy)
    figures = {f.key: f.value for f in plan(again.spec).figures()}
    kept_rows = [shape for name, shape in kept.items() if name in ("saved_x", "saved_pre")]
    per_owner = sum(math.prod(shape[1:]) for shape in kept_rows)
    assert per_owner * 4 == figures["saved_activations.per_layer"]
    assert figures["transport.bwd_dispatch.row_bytes"] == case.H * (4 + 4)  # dL/dy and x again, fp32


# ------------------------------------------------------------------ an fp8 backward transport


def test_an_fp8_backward_transport_is_within_its_bound_of_the_compute_dtypes_and_bitwise_across_schedules():
    """``dtype ..., backward fp8_e4m3``: g'·dL/dy goes to the owners and dL/dx comes back as fp8
    e4m3, one fp32 scale per 128 columns of a row, summed in fp32 at the front-end. The forward
    is untouched (outputs bitwise); every gradient within 0.1 of the compute dtype's backward
    (relative to its largest value; e4m3 keeps 3 mantissa bits: 2^-4 per element; dL/dg exact
    unless the gate is on the input, where it reads the returned rows), and bitwise across
    schedules (a return ring, pipelined; rows at their places, bulk). 160 columns: a full
    128-column scale block and a partial one; drops, and the gate on the input."""
    case = Case(H=160, capacity="factor 0.5, weights zero", routing="zipf:1.5", gate_input=True)
    inputs, biases = case.inputs(), case.biases()
    y, _, dy, want = grads(case.layer().module(schedule="pipelined", tiles=TILES), inputs, biases=biases)
    fp8 = dataclasses.replace(case, dtype="fp32, backward fp8_e4m3").layer()
    got_all = []
    for strategy in ("pipelined", "bulk"):
        m = fp8.module(schedule=strategy, tiles=TILES)
        got_y, _, _, got = grads(m, inputs, dy, biases)
        assert m.contract.bwd_fp8 and torch.equal(got_y, y), strategy
        errors = {n: float((got[n] - want[n]).abs().max()) / float(want[n].abs().max()) for n in want}
        assert all(e <= 0.1 for e in errors.values()) and errors["x"] > 0 and errors["w_up"] > 0, (strategy, errors)
        got_all.append(got)
    assert all(torch.equal(got_all[0][n], got_all[1][n]) for n in want)


def test_the_gate_on_the_input_resent_rows_and_an_fp8_backward_are_bitwise_in_split_mode():
    """The transport kernel and the GEMM kernel launched side by side (split) give what the one
    persistent kernel gives (unified), all three constructs at once, drops included."""
    case = Case(
        capacity="factor 0.5, weights zero", routing="zipf:1.5", gate_input=True, dtype="fp32, backward fp8_e4m3",
        extra="  activations pre recompute, input resend\n",
    )  # fmt: skip
    layer = case.layer()
    inputs = case.inputs()
    y, _, dy, want = grads(layer.module(schedule="pipelined", tiles=TILES), inputs)
    got_y, _, _, got = grads(layer.module(schedule="pipelined", mode="split", tiles=TILES), inputs, dy)
    assert torch.equal(got_y, y) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize(
    "case",
    [
        Case(F=40, capacity="factor 0.5, weights zero", routing="zipf:1.5"),
        Case(F=40, act="clamped_swiglu", act_args=", limit = 0.5", bias=True, dtype="bf16"),
    ],
    ids=["swiglu-drops", "clamped-bias-bf16"],
)
def test_the_gemm_kernels_paired_da_epilogue_is_bitwise_the_unified_kernels(case):
    """The split GEMM kernel forms dA's gated backward over its even and odd columns apart,
    from pre-activations ``anchored`` to them, and stores dgate and dup as pairs
    (``bgemm1``'s PAIRED, ``paired_backward``); the unified kernel loads and stores them per
    column. The kept pre-activations (no recompute), an F that the F-block does not divide
    (40 against 32: a partial pair block): bitwise alike."""
    layer = case.layer()
    dt = TORCH_DTYPES[layer.spec.precision.dtype.value]
    inputs, biases = case.inputs(dt), case.biases(dt)  # the gates stay fp32
    y, _, dy, want = grads(layer.module(schedule="bulk", tiles=TILES), inputs, biases=biases)
    got_y, _, _, got = grads(layer.module(schedule="bulk", mode="split", tiles=TILES), inputs, dy, biases)
    assert torch.equal(got_y, y) and want.keys() == got.keys()
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def test_a_backward_on_narrower_tiles_than_its_forward_computes_the_same_gradients(monkeypatch):
    """Natively a backward launches ``Tiles.for_backward`` of the forward's tiles (tiles tuned
    on the forward may make its weight-gradient tiles too large): its own work items, tile
    counters and constexprs. Here, under the interpreter, block_f narrowed on purpose (as
    for_backward narrows first): every sum runs over the same chunks in the same order, so
    the gradients are bitwise."""
    from rdepc.runtime import tune

    case = Case(bias=True, capacity="factor 0.5", routing="zipf:1.5")
    layer, inputs, biases = case.layer(), case.inputs(), case.biases()
    y, _, dy, want = grads(layer.module(schedule="pipelined", tiles=TILES), inputs, biases=biases)
    narrow = dataclasses.replace(TILES, block_f=16)
    monkeypatch.setattr(tune, "backward_tiles", lambda contract, tiles, interpret: narrow)
    m = layer.module(schedule="pipelined", tiles=TILES)
    assert m.tiles == TILES and m.bwd_tiles == narrow
    y2, _, _, got = grads(m, inputs, dy, biases)
    assert torch.equal(y2, y) and want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"d{name} differs on the narrower backward tiles"
