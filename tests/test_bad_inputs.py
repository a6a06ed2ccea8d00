"""Bad tensors through ``RDEPModule.forward`` and ``RDEPMoE``, and heaps larger than the
memory they would come from.

Every bad input is either a one-line TypeError/ValueError naming the layer and the
argument, refused on the host before any launch (or, for what needs the data, by the
kernel's validate stage: tests/test_runtime.py), or a documented behaviour checked here:
any strides are accepted and give bitwise the contiguous result; zero tokens give an
empty output and a working backward; a NaN or inf in x reaches only its own token's
output (one-process module), and through RDEPMoE's router becomes a non-finite-gate
error; a padding token's contents never matter.

A small layer (W=2, T=8, H=32, F=32, E=4, K=2: ~0.5 s per interpreted call) carries the
calls; refusals launch nothing and cost nothing.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import HANG_S, ROOT
from hypothesis import given, settings
from hypothesis import strategies as st
from rdepc.runtime import memory, ranks, transport
from rdepc.runtime.module import HeapSizeError, RDEPModule

import rdepc
from rdepc.api import Layer, elaborate_layer
from rdepc.diagnostics import UsageError
from rdepc.parser import parse_text
from rdepc.reference import random_inputs

W, T, H, F, E, K = 2, 8, 32, 32, 4, 2
TOKENS = 6  # T' of the good inputs: one more is still within the bound
ARGS = ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down")
TINY = ROOT / "examples" / "tiny.rdep"


def small_spec(act: str = "swiglu", capacity: str = "dropless", extra: str = "", bias: bool = False):
    text = (
        "layer small {\n"
        f"  shape     ranks {W}, tokens {T}, hidden {H}, experts {E}, top {K}\n"
        f"  expert    {act}(ffn = {F}){', bias' if bias else ''}\n"
        f"{extra}"
        "  dtype     fp32\n"
        f"  capacity  {capacity}\n"
        "  schedule  bulk\n"
        "  transport emulated\n"
        "}\n"
    )
    spec, _ = elaborate_layer(parse_text(text, "small.rdep"), None, {})
    return spec


pytestmark = pytest.mark.usefixtures("module_cache")


@pytest.fixture(scope="module")
def small():
    """(module, good inputs, their output)."""
    module = Layer(small_spec()).module()
    good = random_inputs(W, TOKENS, H, F, E, K, seed=3)
    return module, good, module(*good)


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


# ------------------------------------------------------------------ refused on the host


def corrupt(good, arg: str, kind: str, data) -> tuple[tuple, type, str]:
    """``good`` with ``arg`` corrupted by ``kind`` (details drawn from ``data``), the error
    type expected and a regex its message matches."""
    args = dict(zip(ARGS, good, strict=True))
    t = args[arg]
    weight = arg.startswith("w_")
    shape = {"x": "x must be", "topk_ids": "topk_ids must be", "topk_weights": "topk_weights must be"}
    shape_msg = rf"{arg} must be \[{E}, " if weight else shape[arg]
    match kind:
        case "list" | "numpy" | "float":
            bad = {"list": t.tolist(), "numpy": t.numpy(), "float": 1.0}[kind]
            got = {"list": "list", "numpy": "ndarray", "float": "float"}[kind]
            out = (TypeError, rf"{arg} must be a torch\.Tensor, got {got}$")
        case "None":
            bad = None
            out = (
                (ValueError, rf"swiglu experts are gated: w_gate \[E={E}, H={H}, F={F}\] is required$")
                if arg == "w_gate"
                else (TypeError, rf"{arg} must be a torch\.Tensor, got NoneType$")
            )
        case "sparse":
            bad = t.to_sparse()
            out = (TypeError, rf"{arg} must be a dense \(strided\) tensor, got a sparse_coo one$")
        case "dtype":
            wrong = {
                "x": [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.complex64],
                "topk_ids": [torch.float32, torch.int16, torch.uint8, torch.bool],
                "topk_weights": [torch.int64, torch.int32, torch.bool, torch.complex64],
            }.get(arg, [torch.float64, torch.float16, torch.bfloat16, torch.int32])
            dt = data.draw(st.sampled_from(wrong), label="dtype")
            bad = t.to(dt)
            out = (TypeError, rf"{arg} must be .*got {re.escape(str(dt))}$")
        case "resize":  # one dimension one longer or shorter
            d = data.draw(st.integers(0, t.dim() - 1), label="dim")
            n = t.shape[d] + data.draw(st.sampled_from([-1, 1]), label="delta")
            bad = t.narrow(d, 0, n) if n < t.shape[d] else torch.cat([t, t.narrow(d, 0, 1)], d)
            if arg == "x" and d == 1:  # x sets T': the routing tensors then disagree with it
                want = rf"topk_ids must be \[W, T', K\] = \[{W}, {n}, {K}\], got \({W}, {TOKENS}, {K}\)$"
                out = (ValueError, want)
            else:
                out = (ValueError, rf"{shape_msg}.*got {re.escape(str(tuple(bad.shape)))}$")
        case "rank":  # a dimension too many or too few
            bad = t[None] if data.draw(st.booleans(), label="more") else t[0]
            out = (ValueError, rf"{shape_msg}.*got {re.escape(str(tuple(bad.shape)))}$")
        case "device":
            bad = t.to("meta")
            out = (ValueError, rf"{arg} is on meta, the module on cpu$")
        case _:
            raise AssertionError(kind)
    args[arg] = bad
    return tuple(args.values()), *out


KINDS = ("list", "numpy", "float", "None", "sparse", "dtype", "resize", "rank", "device")


@settings(max_examples=60)
@given(arg=st.sampled_from(ARGS), kind=st.sampled_from(KINDS), data=st.data())
def test_a_corrupted_argument_is_refused_in_one_line_before_any_launch(small, arg, kind, data):
    module, good, _ = small
    args, error, message = corrupt(good, arg, kind, data)
    before = module.launcher.launches
    with pytest.raises(error) as info:
        module(*args)
    assert re.match(rf"rdepc layer small: {message}", one_line(info.value)), str(info.value)
    assert module.launcher.launches == before


@pytest.mark.parametrize("kind", KINDS)
def test_every_corruption_of_x_is_refused(small, kind):
    """The explicit x cases (the hypothesis test above draws the arguments at random)."""

    class Fixed:  # the details corrupt() draws, fixed: fp64, H one shorter, a dimension more
        @staticmethod
        def draw(strategy, label=None):
            return {"dtype": torch.float64, "dim": 2, "delta": -1, "more": True}[label]

    module, good, _ = small
    args, error, message = corrupt(good, "x", kind, Fixed)
    with pytest.raises(error, match=rf"^rdepc layer small: {message}"):
        module(*args)


def test_weights_for_the_wrong_experts_and_gating(small):
    module, good, _ = small
    x, ids, g, wg, wu, wd = good
    want = rf"^rdepc layer small: w_down must be \[{E}, {F}, {H}\], got \(2, {F}, {H}\)$"
    with pytest.raises(ValueError, match=want):
        module(x, ids, g, wg, wu, wd[:2])  # one rank's experts into the one-process module
    gelu = Layer(small_spec("gelu")).module()
    with pytest.raises(ValueError, match=r"^rdepc layer small: gelu experts are not gated: pass w_gate=None$"):
        gelu(x, ids, g, wg, wu, wd)
    with pytest.raises(ValueError, match=r"^rdepc layer small: swiglu experts are gated: w_gate \[E=4, H=32, F=32\]"):
        module(x, ids, g, None, wu, wd)


def test_expert_biases_are_required_exactly_when_the_spec_has_them(small):
    module, good, _ = small
    x, ids, g, wg, wu, wd = good
    b = {"b_gate": torch.zeros(E, F), "b_up": torch.zeros(E, F), "b_down": torch.zeros(E, H)}
    with pytest.raises(ValueError, match=r"^rdepc layer small: the spec's experts have no biases, but b_down, b_gate"):
        module(x, ids, g, wg, wu, wd, **b)
    biased = Layer(small_spec(bias=True)).module()
    want = rf"b_up \[{E}, {F}\], b_down \[{E}, {H}\], b_gate \[{E}, {F}\] required$"
    with pytest.raises(
        ValueError, match=r"^rdepc layer small: the experts have biases \('expert \.\.\., bias'\): " + want
    ):
        biased(x, ids, g, wg, wu, wd)
    with pytest.raises(ValueError, match=rf"^rdepc layer small: b_down must be \[{E}, {H}\], got \({E}, {F + 1}\)$"):
        biased(x, ids, g, wg, wu, wd, **(b | {"b_down": torch.zeros(E, F + 1)}))


def test_the_per_rank_signature_wants_its_own_experts(small):
    """A per-rank module checks [T', H] tokens and [E_loc, ...] weights. Its check on a copy
    of the one-process module posing as rank 1 of 2 (tests/test_multiprocess.py runs the
    real per-rank modules, which take W processes)."""
    module, good, _ = small
    x, ids, g, wg, wu, wd = good
    rank1 = copy.copy(module)
    rank1.per_rank, rank1.rank, rank1.local_experts = True, 1, (1, 3)
    mine = [1, 3]
    rank1._check(x[1], ids[1], g[1], wg[mine], wu[mine], wd[mine])  # its own: accepted
    name = r"^rdepc layer small \(rank 1 of 2\): "
    with pytest.raises(ValueError, match=name + rf"w_up must be \[2, {H}, {F}\], got \({E}, {H}, {F}\)$"):
        rank1._check(x[1], ids[1], g[1], wg, wu, wd)  # every expert's weights
    with pytest.raises(ValueError, match=name + rf"x must be \[T', H={H}\], got \({W}, {TOKENS}, {H}\)$"):
        rank1._check(x, ids, g, wg[mine], wu[mine], wd[mine])  # every rank's tokens
    with pytest.raises(TypeError, match=name + r"topk_weights must be a torch\.Tensor, got list$"):
        rank1._check(x[1], ids[1], g[1].tolist(), wg[mine], wu[mine], wd[mine])


# ------------------------------------------------------------------ accepted: any strides


def relayout(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t``'s values in another memory layout."""
    match how:
        case "contiguous":
            return t
        case "transposed":  # the last two dimensions swapped in memory
            return t.transpose(-1, -2).contiguous().transpose(-1, -2)
        case "stepped":  # every other row of a larger tensor
            big = torch.zeros((2 * t.shape[0], *t.shape[1:]), dtype=t.dtype)
            big[::2] = t
            return big[::2]
        case "offset":  # at an odd element offset into its storage (not 16-byte aligned)
            flat = torch.zeros(t.numel() + 3, dtype=t.dtype)
            flat[3:] = t.reshape(-1)
            return flat[3:].view(t.shape)
    raise AssertionError(how)


LAYOUTS = ("contiguous", "transposed", "stepped", "offset")


@settings(max_examples=16)
@given(
    layouts=st.fixed_dictionaries({a: st.sampled_from(LAYOUTS) for a in ARGS}),
    ids32=st.booleans(),
    gates64=st.booleans(),
    halves=st.booleans(),
)
def test_any_strides_give_the_contiguous_result_bitwise(small, layouts, ids32, gates64, halves):
    """Non-contiguous, sliced with a step, at a storage offset, int32 ids, fp64 gates, gate
    and up as the halves of one tensor: the call makes them contiguous (a copy; weights
    too, at every call) and computes bitwise what the contiguous inputs give."""
    module, good, y0 = small
    args = [relayout(t, layouts[a]) for a, t in zip(ARGS, good, strict=True)]
    if ids32:
        args[1] = args[1].to(torch.int32)
    if gates64:
        args[2] = args[2].double()
    if halves:  # RDEPMoE's layout: [E, H, F, 2], gate and up interleaved
        both = torch.stack((good.w_gate, good.w_up), dim=-1)
        args[3], args[4] = both[..., 0], both[..., 1]
    assert torch.equal(module(*args), y0)


def test_expanded_tensors_run_as_their_copies(small):
    """Stride-0 (expanded) inputs and weights: read through their copies, bitwise."""
    module, good, _ = small
    x, ids, g, wg, wu, wd = good
    expanded = (
        x[:, :1].expand(-1, TOKENS, -1),
        ids[:, :1].expand(-1, TOKENS, -1),
        g[:, :1].expand(-1, TOKENS, -1),
        wg[:1].expand(E, -1, -1),
        wu,
        wd[:, :1].expand(-1, F, -1),
    )
    assert any(0 in t.stride() for t in expanded)
    y = module(*expanded)
    assert torch.equal(y, module(*(t.contiguous() for t in expanded)))


def test_strided_leaves_get_their_gradients(small):
    """Gradients reach non-contiguous leaves, bitwise as they reach contiguous ones."""
    module, good, _ = small
    dy = torch.randn(W, TOKENS, H, generator=torch.Generator().manual_seed(5))

    def grads(how: str) -> list[torch.Tensor]:
        leaves = [relayout(t.clone(), how).requires_grad_(True) for t in (good.x, good.w_up, good.w_down)]
        y = module(leaves[0], good.topk_ids, good.topk_weights, good.w_gate, leaves[1], leaves[2])
        (y * dy).sum().backward()
        return [t.grad for t in leaves]

    for a, b in zip(grads("contiguous"), grads("transposed"), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ zero tokens, NaN and inf


def test_zero_tokens_give_an_empty_output_and_a_backward(small):
    module, good, _ = small
    x = good.x[:, :0].clone().requires_grad_(True)
    gates = good.topk_weights[:, :0].clone().requires_grad_(True)
    w_up = good.w_up.clone().requires_grad_(True)
    y = module(x, good.topk_ids[:, :0], gates, good.w_gate, w_up, good.w_down)
    assert y.shape == (W, 0, H)
    y.sum().backward()
    assert x.grad.shape == (W, 0, H) and gates.grad.shape == (W, 0, K)
    assert not w_up.grad.any()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
@pytest.mark.parametrize("capacity", ["dropless", "factor 0.5"])
def test_a_non_finite_token_reaches_only_its_own_output(small, capacity):
    """NaN and inf in x are the caller's: the call runs, those tokens' outputs are not
    finite, every other token's is bitwise what it is without them, and nothing of them
    stays for the next call."""
    module, good, y0 = small
    if capacity != "dropless":  # drops: who is accepted never depends on x
        module = Layer(small_spec(capacity=capacity)).module()
        y0 = module(*good)
    x = good.x.clone()
    x[0, 1, 5] = float("nan")
    x[1, 4, 0] = float("-inf")
    y = module(x, *good[1:])
    hit = torch.zeros(W, TOKENS, dtype=torch.bool)
    hit[0, 1] = hit[1, 4] = True
    accepted = module.last_stats["accepted"].any(dim=-1)  # a token whose every slot was dropped gets 0
    assert torch.equal(~y[hit].isfinite().all(dim=-1), accepted[hit])
    assert torch.equal(y[~hit], y0[~hit])
    assert torch.equal(module(*good), y0)


# ------------------------------------------------------------------ RDEPMoE


@pytest.fixture(scope="module")
def moe():
    extra = "  shared    1 x swiglu(ffn = 16)\n  router    softmax, renormalize, aux_loss 0.01, z_loss 0.001\n"
    layer = Layer(small_spec(extra=extra))
    return rdepc.RDEPMoE(layer, device="cpu", generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "case",
    ["list", "numpy", "None", "int", "bool", "complex", "sparse", "meta", "rank 1", "N", "H", "T"],
)
def test_rdepmoe_refuses_bad_x_in_one_line(moe, case):
    x = torch.randn(W, TOKENS, H)
    bad, error, message = {
        "list": (x.tolist(), TypeError, r"rdepc layer small: x must be a torch\.Tensor, got list"),
        "numpy": (x.numpy(), TypeError, r"rdepc layer small: x must be a torch\.Tensor, got ndarray"),
        "None": (None, TypeError, r"rdepc layer small: x must be a torch\.Tensor, got NoneType"),
        "int": (x.long(), TypeError, r"rdepc layer small: x must be a floating-point tensor .*, got torch\.int64"),
        "bool": (x > 0, TypeError, r"rdepc layer small: x must be a floating-point tensor .*, got torch\.bool"),
        "complex": (x.to(torch.complex64), TypeError, r"rdepc layer small: x must be a floating-point tensor"),
        "sparse": (x.to_sparse(), TypeError, r"rdepc layer small: x must be a dense \(strided\) tensor"),
        "meta": (x.to("meta"), ValueError, r"rdepc layer small: x is on meta, the block on cpu"),
        "rank 1": (x[0, 0], ValueError, r"rdepc layer small: x must be \[\.\.\., H\] with H=32, got \(32,\)"),
        "N": (torch.randn(3, 6, H), ValueError, r"rdepc layer small: x has 18 tokens, more than the 2 ranks x T=8"),
        "H": (x[..., :-1], ValueError, r"x has hidden size 31, but rdepc layer small has 32"),
        "T": (torch.randn(W, T + 1, H), ValueError, r"rdepc layer small: x has T'=9 tokens per rank, more than"),
    }[case]
    before = moe.kernels.launcher.launches
    with pytest.raises(error) as info:
        moe(bad)
    assert re.match(message, one_line(info.value)), str(info.value)
    assert moe.kernels.launcher.launches == before


def test_rdepmoe_refuses_bad_logits(moe):
    x = torch.randn(W, TOKENS, H)
    with pytest.raises(ValueError, match=r"^rdepc layer small: logits must be \[2, 6, 4\] \(x's shape, E=4 for H\)"):
        moe(x, logits=torch.randn(W, TOKENS, E - 1))
    with pytest.raises(TypeError, match=r"^rdepc layer small: logits must be a torch\.Tensor, got list$"):
        moe(x, logits=[0.0] * E)
    with pytest.raises(TypeError, match=r"^rdepc layer small: logits must be a floating-point tensor"):
        moe(x, logits=torch.zeros(W, TOKENS, E, dtype=torch.long))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
@pytest.mark.parametrize("bad", ["nan", "inf", "logits"])
def test_rdepmoe_a_non_finite_token_is_a_non_finite_gate_error(moe, bad):
    """NaN or inf in x (or in the logits given) makes non-finite router logits, so
    non-finite softmax gates: the kernel's validate stage counts them and the call raises
    one line naming the token and the router, with no host sync in the call."""
    x = torch.randn(W, TOKENS, H, generator=torch.Generator().manual_seed(1))
    logits = None
    if bad == "logits":
        logits = moe.route(x).logits.clone()
        logits[1, 2, 3] = float("nan")
    else:
        x[1, 2, 7] = float(bad)
    with pytest.raises(ValueError) as info:
        moe(x, logits=logits)
    assert re.match(
        r"rdepc layer small: 2 non-finite gates \(NaN or inf\), the first rank 1 token 2 \(token 8 in order\) slot 0 "
        r"\(nan\), from the "
        r"router: x, the router weight or the logits given hold NaN or inf for that token$",
        one_line(info.value),
    ), str(info.value)
    moe(torch.randn(W, TOKENS, H))  # and the next call runs clean


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: NaN arithmetic
def test_rdepmoe_names_a_flat_inputs_token_by_its_place_in_x(moe):
    """A flat [N, H] input is split over the W ranks in order: its token 7 is rank 1's token 1
    (T' = 6 here), and the error names both."""
    x = torch.randn(W * TOKENS, H, generator=torch.Generator().manual_seed(1))
    x[7, 0] = float("nan")
    with pytest.raises(ValueError, match=r"the first rank 1 token 1 \(token 7 in order\) slot 0 \(nan\)"):
        moe(x)


def test_rdepmoe_a_padding_token_may_hold_anything(moe):
    """A padding token's row reads as zeros: NaN there changes no output, no loss and no
    gradient, and its own y is 0."""
    x = torch.randn(W, TOKENS, H, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(W, TOKENS, dtype=torch.bool)
    mask[0, 3] = False

    def step(x):
        x = x.clone().requires_grad_(True)
        moe.zero_grad()
        y, out = moe(x, mask=mask, router_outputs=True)
        (y.square().sum() + out.aux_loss + out.z_loss).backward()
        return y, out, x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}

    y0, out0, dx0, g0 = step(x)
    x[0, 3] = float("nan")
    y, out, dx, g = step(x)
    assert not y[0, 3].any() and torch.equal(y, y0)
    assert torch.equal(out.aux_loss, out0.aux_loss) and torch.equal(out.z_loss, out0.z_loss)
    assert torch.equal(dx, dx0) and not dx[0, 3].any()
    assert all(torch.equal(g[n], g0[n]) and g[n].isfinite().all() for n in g0)


def test_rdepmoe_zero_tokens(moe):
    x = torch.randn(0, H, requires_grad=True)
    y, out = moe(x, router_outputs=True)
    assert y.shape == (0, H) and out.logits.shape == (0, E)
    assert float(out.aux_loss.detach()) == 0 and float(out.z_loss.detach()) == 0  # not the NaN of an empty mean
    (y.sum() + out.aux_loss + out.z_loss).backward()
    assert x.grad.shape == (0, H)


# ------------------------------------------------------------------ a heap larger than the device


def meminfo(tmp_path, available_kb: int | None) -> str:
    path = tmp_path / "meminfo"
    lines = ["MemTotal:       1000 kB"] + ([] if available_kb is None else [f"MemAvailable:   {available_kb} kB"])
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    return str(path)


HEAP_LINE = (
    r"rdepc layer tiny: the symmetric heap needs 338\.0 KiB \(4 ranks × 84\.5 KiB: payload B=1 × S=128 rows "
    r"64\.0 KiB, return T·K=32 rows 16\.0 KiB, control, sideband and ids 4\.5 KiB; forward and backward\) and the "
    r"private buffers 395\.3 KiB more, 733\.3 KiB in all, but {room}; a bulk schedule moves each owner's rows as one "
    r"segment, S = the busiest owner's rows \(128 with capacity dropless\): lower T \(tokens 16\), set or lower a "
    r"capacity factor, or move the rows in segments \(segment rows S, buffers B; schedule pipelined\)$"
)


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if the heap is allocated or the kernels imported."""

    def never(*args, **kwargs):
        raise AssertionError("allocated or imported before the memory check")

    monkeypatch.setattr(transport.Emulated, "allocate_heap", never)
    monkeypatch.setattr("rdepc.runtime.module.import_kernels", never)


def test_a_heap_larger_than_the_host_is_one_line_before_any_allocation(tmp_path, monkeypatch, no_allocation):
    compiled = rdepc.load(TINY).compile()
    monkeypatch.setattr(memory, "MEMINFO", meminfo(tmp_path, 512))
    with pytest.raises(HeapSizeError) as info:
        RDEPModule(compiled.kernel, compiled.kernels_path)
    assert isinstance(info.value, UsageError)
    assert re.match(HEAP_LINE.format(room=r"the host has 512\.0 KiB available"), one_line(info.value)), str(info.value)
    # without MemAvailable: the free pages
    pages = {"SC_AVPHYS_PAGES": 100, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(memory, "MEMINFO", meminfo(tmp_path, None))
    monkeypatch.setattr(memory.os, "sysconf", pages.__getitem__)
    with pytest.raises(HeapSizeError, match=r"but the host has 400\.0 KiB available;"):
        RDEPModule(compiled.kernel, compiled.kernels_path)


def test_a_heap_larger_than_the_gpu_is_one_line_before_any_allocation(monkeypatch, no_allocation):
    compiled = rdepc.load(TINY).compile()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (600 * 1024, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 100 * 1024)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    with pytest.raises(HeapSizeError) as info:
        RDEPModule(compiled.kernel, compiled.kernels_path, device="cuda:0")
    assert re.match(HEAP_LINE.format(room=r"cuda:0 has 700\.0 KiB free"), one_line(info.value)), str(info.value)
    # the nvshmem backend's heap comes out of NVSHMEM's own reservation: only the device's size bounds it
    assert transport.get("nvshmem").room("cuda:0") == (80 * 2**30, "cuda:0 has 80.0 GiB in all")
    assert transport.get("nvshmem").heap_ranks(4) == 1 and transport.get("emulated-mp").heap_ranks(4) == 4


def test_rdepc_run_says_it_in_one_line(tmp_path, monkeypatch, main):
    monkeypatch.setattr(memory, "MEMINFO", meminfo(tmp_path, 512))
    status, out, err = main("run", "examples/tiny.rdep")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("rdepc: error: rdepc layer tiny: the symmetric heap needs")
    assert re.match("rdepc: error: " + HEAP_LINE.format(room=r"the host has 512\.0 KiB available"), err.rstrip("\n"))


def short_rank(rank: int, world: int, file: str, meminfo: str) -> str:
    """A per-rank module where rank 1 alone has too little memory: the error it raises."""
    if rank == 1:
        memory.MEMINFO = meminfo
    try:
        rdepc.load(file, W=world).module("emulated-mp")
    except HeapSizeError as e:
        return str(e)
    return "built"


def test_per_rank_modules_all_refuse_what_one_rank_cannot_hold(tmp_path):
    """The ranks agree before the collective allocation: none is left waiting for a peer
    that refused."""
    got = ranks.spawn(short_rank, 2, str(TINY), meminfo(tmp_path, 64), timeout=HANG_S)
    assert got[0] == got[1] and got[0].startswith("rdepc layer tiny (rank 1 of 2): the symmetric heap needs")
    assert "but the host has 64.0 KiB available" in got[0]
