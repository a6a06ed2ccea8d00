"""``balance replicate`` at run time: the plan the device derives is rdepc.ir.balance's to the
row; the layer's outputs, dL/dx and dL/dg are the layer's without replication bitwise, its
expert gradients within fp32 rounding (replicas' sums added into their home's), in every
strategy and kernel mode; one process per rank (emulated-mp) is the one-process layer
bitwise; the statistics and ``rdepc run`` report the owners' balance; a capacity that
drops is refused at the statement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import HANG_S, ROOT
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tolerance import assert_close, bounds, layer_chain

import rdepc
from rdepc.diagnostics import SpecError
from rdepc.ir.balance import imbalance, slot_elems, solve
from rdepc.reference import reference_for

W, T, H, F, E, K = 4, 16, 64, 128, 8, 2
OWNER = np.repeat(np.arange(W), E // W)
SPEC = """layer b {{
  shape ranks 4, tokens 16, hidden 64, experts 8, top 2
  expert swiglu(ffn = 128)
  dtype fp32
  {capacity}
  balance replicate(slots = {N}, min_rows = {U})
}}
"""


def layer_file(tmp, N: int, U: int, capacity: str = "") -> str:
    f = tmp / f"b_{N}_{U}{'_cap' if capacity else ''}.rdep"
    f.write_text(SPEC.format(N=N, U=U, capacity=capacity))
    return str(f)


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("balance")
    return {(N, U): rdepc.load(layer_file(tmp, N, U)).module("emulated", "cpu") for N, U in ((1, 2), (2, 5))}


def device_plan(module, load):
    """The plan the layer's balance_solve kernel derives for ``load`` [W, E]."""
    i32 = {"dtype": torch.int32}
    out = {
        "phys": torch.empty((E, W), **i32),
        "cum": torch.empty((W, E, W), **i32),
        "slots": torch.empty((W, module.slots), **i32),
        "loads": torch.empty((2, W), **i32),
    }
    args = (torch.tensor(load, **i32), module.owner, out["phys"], out["cum"], out["slots"], out["loads"])
    module._launch([(module.inner.kernels.balance_solve, (1,), args, {})])
    return out


loads = st.lists(st.integers(0, 40), min_size=W * E, max_size=W * E).map(lambda v: np.array(v).reshape(W, E))


@pytest.mark.parametrize("slots", [(1, 2), (2, 5)], ids=["N1-U2", "N2-U5"])
@settings(max_examples=12, deadline=None, derandomize=True)
@given(load=loads)
@example(load=np.zeros((W, E), dtype=np.int64))
@example(load=np.tile([60, 0, 1, 1, 1, 0, 1, 1], (W, 1)))
def test_the_device_plan_is_the_references(modules, slots, load):
    module = modules[slots]
    want = solve(load, OWNER, *slots)
    got = device_plan(module, load)
    assert (got["slots"].numpy() == want.slots).all()
    assert (got["cum"].numpy() == np.cumsum(want.split, axis=2)).all()
    assert (got["loads"][1].numpy() == want.rank_loads).all()
    held = want.quota > 0
    for e, t in zip(*np.nonzero(held), strict=True):  # the instance of e on t: the home, or its slot there
        slot = list(want.slots[t]).index(e) if OWNER[e] != t else None
        assert got["phys"][e, t] == (e if slot is None else E + t * slots[0] + slot)


def skewed(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(W, T, E, generator=g)
    logits[..., 0] += 3  # rank 0's experts are hot
    logits[..., 1] += 2
    ids = logits.topk(K, -1).indices
    gates = torch.rand(W, T, K, generator=g)
    x = torch.randn(W, T, H, generator=g)
    weights = [torch.randn(E, H, F, generator=g) / 8, torch.randn(E, H, F, generator=g) / 8]
    return ids, gates, x, [*weights, torch.randn(E, F, H, generator=g) / 11]


def train_step(module, ids, gates, x, weights, rank: int | None = None):
    """y and the gradients of sum(y·dy) for a fixed dy (``rank``: that rank's slice of it)."""
    leaves = [t.clone().requires_grad_() for t in (x, gates, *weights)]
    y = module(leaves[0], ids, leaves[1], *leaves[2:])
    dy = torch.linspace(-1, 1, W * T * H).reshape(W, T, H)
    (y * (dy if rank is None else dy[rank])).sum().backward()
    return y.detach(), [t.grad for t in leaves]


def step_bounds() -> dict:
    """{i: bound} of train_step's i-th value ([y, dL/dx, dL/dg, dWg, dWu, dWd]) computed in another
    order, by the reference (tiny's operator) in float64 (tests/tolerance.py): y the layer's
    chain, a gradient also the W·T·K rows a weight's sums."""
    reference = reference_for(rdepc.load("examples/tiny.rdep").spec)

    def step(ids, gates, x, weights):
        y, grads = train_step(lambda *args: reference(*args)[0], ids, gates, x, weights)
        return [y, *grads]

    chain = layer_chain(H, F, K)
    y = bounds(lambda *args: step(*args)[:1], skewed(), chain)
    return y | {i: b for i, b in bounds(step, skewed(), chain + W * T * K).items() if i > 0}


@pytest.fixture(scope="module")
def unreplicated():
    module = rdepc.load("examples/tiny.rdep").module("emulated", "cpu")
    return train_step(module, *skewed()), module.last_stats


@pytest.fixture(scope="module")
def limits() -> dict:
    return step_bounds()


@pytest.mark.parametrize(
    "schedule, mode", [("bulk", "unified"), ("pipelined", "unified"), ("deep", "unified"), ("bulk", "split")]
)
def test_outputs_are_the_unreplicated_layers_and_gradients_agree(unreplicated, limits, schedule, mode):
    (y0, g0), stats0 = unreplicated
    module = rdepc.load("examples/tiny_balance.rdep").module("emulated", "cpu", schedule=schedule, mode=mode)
    y, g = train_step(module, *skewed())
    assert torch.equal(y, y0)
    assert torch.equal(g[0], g0[0]) and torch.equal(g[1], g0[1])  # dL/dx, dL/dg
    for i, (a, b) in enumerate(zip(g[2:], g0[2:], strict=True), 3):  # a replica's gradient is summed into its home's
        assert_close(a, b, limits[i], ("w_gate", "w_up", "w_down")[i - 3])
    st = module.last_stats
    bl = st["balance"]
    assert (bl["slots"] >= 0).any()  # the hot experts were replicated
    assert bl["imbalance_after"] < bl["imbalance_before"] == imbalance(stats0["rows_per_owner"].tolist())
    assert bl["after"] == st["rows_per_owner"].tolist()
    assert torch.equal(st["rows_per_expert"], stats0["rows_per_expert"])  # summed over each expert's instances


def test_the_library_gemms_run_the_replicated_layer_too(unreplicated, limits):
    """The library GEMM lowering over the physical layer (the slots' copies as experts of their
    ranks): output and every gradient within their bounds of the unreplicated layer's, the
    replicas' gradients summed into their homes'."""
    (y0, g0), _ = unreplicated
    module = rdepc.load("examples/tiny_balance.rdep").module("emulated", "cpu", gemm="library")
    assert (module.gemm, module.mode) == ("library", "phased")
    y, g = train_step(module, *skewed())
    for i, (a, b) in enumerate(zip([y, *g], [y0, *g0], strict=True)):
        assert_close(a, b, limits[i], ("y", "x", "gates", "w_gate", "w_up", "w_down")[i])
    assert (module.last_stats["balance"]["slots"] >= 0).any()  # the hot experts were replicated


def test_each_source_splits_its_rows_by_the_plans_quotas():
    module = rdepc.load("examples/tiny_balance.rdep").module("emulated", "cpu")
    ids, gates, x, weights = skewed(1)
    with torch.no_grad():
        module(x, ids, gates, *weights)
    load = np.stack([np.bincount(ids[r].reshape(-1), minlength=E) for r in range(W)])
    assert (module.last_plan["load"].numpy() == load).all()
    want = solve(load, OWNER, module.slots, module.min_rows)
    phys = module.last_context.topk_ids.numpy()  # each route row's physical expert
    inst = module.last_plan["phys"].numpy()
    for r in range(W):
        for e in range(E):
            for t in range(W):
                sent = int(((ids[r].numpy() == e) & (phys[r] == inst[e, t])).sum()) if inst[e, t] >= 0 else 0
                assert sent == want.split[r, e, t], (r, e, t)


def test_rdepc_run_prints_the_balance_before_and_after(main):
    status, out, err = main("run", "examples/tiny_balance.rdep", "--check", "--routing", "zipf:1.5")
    assert status == 0, err
    line = next(x for x in out.splitlines() if x.lstrip().startswith("balance"))
    before, after = (float(v) for v in line.split("max/mean ")[1].split(" after")[0].split(" before, "))
    assert before > 2 and after <= 1.05
    assert out.rstrip().endswith("check passed")


def test_a_capacity_that_drops_is_refused_at_the_statement(tmp_path):
    f = layer_file(tmp_path, 1, 2, capacity="capacity factor 1.25")
    with pytest.raises(SpecError) as e:
        rdepc.load(f)
    d = e.value.diagnostics[0]
    assert d.message.startswith("balance replicate needs a dropless capacity")
    assert (d.span.line, d.span.col) == (6, 11)  # at replicate(...)


def compiled(module):
    """The layer's call under torch.compile(fullgraph=True): the plan and the exchange are
    custom ops, so nothing breaks the graph; aot_eager keeps torch's own op numerics."""
    torch._dynamo.reset()
    return torch.compile(lambda *a: module(*a), fullgraph=True, backend="aot_eager")


def two_layers(a, b, rank: int | None = None, mine=slice(None)):
    """Two layers (b after a, its own routing and weights), both forwards before either
    backward; y and dL/dx, then every gradient of both layers' weights."""
    ids, gates, x, weights = skewed()
    ids2, gates2, _, weights2 = skewed(1)
    if rank is not None:
        ids, gates, x, ids2, gates2 = ids[rank], gates[rank], x[rank], ids2[rank], gates2[rank]
    leaves = [t.clone().requires_grad_() for t in (x, *(w[mine] for w in weights), *(w[mine] for w in weights2))]
    y = b(a(leaves[0], ids, gates, *leaves[1:4]), ids2, gates2, *leaves[4:])
    (y * y).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


def rank_step(rank: int, W_: int, file: str):
    """One rank's process: its tokens and home experts through the emulated-mp layer,
    forward and backward, eager and then compiled; then two layers sharing one heap and
    one exchange."""
    layer = rdepc.load(file)
    module = layer.module("emulated-mp")
    ids, gates, x, weights = skewed()
    mine = list(module.local_experts)
    args = (ids[rank], gates[rank], x[rank], [w[mine] for w in weights], rank)
    y, g = train_step(module, *args)
    plan = {k: v.clone() for k, v in module.last_plan.items()}
    replayable = per_call_arguments(module, *args[:4])
    kept = saved_for_backward(module, *args[:4])
    shared = layer.module("emulated-mp", share=module)
    assert shared.ex is module.ex
    compiled_step = train_step(compiled(module), *args)
    split = train_step(layer.module("emulated-mp", mode="split", schedule="pipelined"), *args)
    library = train_step(layer.module("emulated-mp", gemm="library"), *args)  # the slots' operands read in place
    return y, g, mine, plan, compiled_step, two_layers(module, shared, rank, mine), replayable, kept, split, library


def saved_for_backward(module, ids, gates, x, weights) -> list[tuple[int, ...]]:
    """The shapes of the layer-dtype tensors a forward keeps for its backward, the caller's
    weights aside."""
    leaves = [w.clone().requires_grad_() for w in weights]
    mine = {w.untyped_storage().data_ptr() for w in leaves}
    shapes = []

    def keep(t):
        if t.dtype == module.dtype and t.untyped_storage().data_ptr() not in mine:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        module(x, ids, gates, *leaves)
    return shapes


def per_call_arguments(module, ids, gates, x, weights) -> tuple[list, list[int]]:
    """Two more forwards, their launches recorded (the exchange's and the layer's): the
    launches' non-tensor arguments that differ between the calls — a CUDA graph replays the
    captured ones, so a count kept on the host would go stale —, and how many launches of
    each the two calls made."""
    calls, launchers = [[], []], (module._launch, module.inner.launcher)
    for i, name in enumerate(("_launch", "launcher")):
        owner = module if name == "_launch" else module.inner

        def record(launches, i=i):
            calls[i][-1].extend(launches)
            launchers[i](launches)

        record.launches = 0  # the layer counts its launches for last_stats
        setattr(owner, name, record)
    with torch.no_grad():
        for _ in range(2):
            calls[0].append([]), calls[1].append([])
            module(x, ids, gates, *weights)
    module._launch, module.inner.launcher = launchers
    differ = []
    for one, two in (pair for kind in calls for pair in zip(*kind, strict=True)):
        scalars = [(a, b) for a, b in zip(one[2], two[2], strict=True) if not isinstance(a, torch.Tensor)]
        kernel = getattr(one[0], "__name__", "")
        differ += [(kernel, a, b) for a, b in scalars if a != b] + (
            [(kernel, one[3], two[3])] if one[3] != two[3] else []
        )
    return differ, [sum(len(c) for c in kind) for kind in calls]


def test_one_process_per_rank_is_the_one_process_layer_bitwise():
    """emulated-mp: every rank exchanges its loads, derives the same plan, reroutes its rows
    and pushes its hot experts' weights to the slots (tasks of its layer, no launch of their
    own) and adds its replicas' gradients home in rank order: each rank's y, dL/dx, dL/dg
    and expert gradients are bitwise the one-process layer's, in split mode and pipelined
    too. Under
    torch.compile(fullgraph=True) they are the eager ones (one process: tests/test_torch_module.py). Two
    layers sharing one heap and one exchange, both forwards before either backward, are
    two one-process layers. Call after call the launches take the same arguments, as a
    replayed CUDA graph does."""
    from rdepc.runtime import ranks

    f = str(ROOT / "examples" / "tiny_balance.rdep")
    got = ranks.spawn(rank_step, W, f, timeout=HANG_S)
    one = rdepc.load(f).module("emulated", "cpu")
    y0, g0 = train_step(one, *skewed())
    layer = rdepc.load(f)
    two = two_layers(layer.module("emulated", "cpu"), layer.module("emulated", "cpu"))
    y0_lib, g0_lib = train_step(layer.module("emulated", "cpu", gemm="library"), *skewed())
    for rank, (y, g, mine, plan, (yr, gr), shared, (differ, launched), kept, split, lib) in enumerate(got):
        # a forward is the layer's launch alone: its kernel exchanges the loads and derives the plan
        assert differ == [] and launched[0] == 0 and launched[1] > 0, (rank, differ, launched)
        # the kernels read the slots in place: the backward keeps this call's copy of the N slots, and
        # no [homes + N, ...] physical weights (a copy of every home expert's beside them)
        c = one.contract
        homes, N, P = len(mine), one.slots, slot_elems(3 if c.gated else 2, c.H, c.F, c.bias)
        assert (N, P) in kept and not any(s[0] == homes + N for s in kept if len(s) >= 3), (rank, kept)
        assert torch.equal(shared[0], two[0][rank]) and torch.equal(shared[1], two[1][rank])
        for a, b in zip(shared[2:], two[2:], strict=True):
            assert torch.equal(a, b[mine]), rank
        assert torch.equal(y, y0[rank])
        assert torch.equal(g[0], g0[0][rank]) and torch.equal(g[1], g0[1][rank])
        for a, b in zip(g[2:], g0[2:], strict=True):
            assert torch.equal(a, b[mine])
        for name, table in one.last_plan.items():  # every rank derived the same plan, table for table
            assert torch.equal(plan[name], table), (rank, name)
        assert all(torch.equal(a, b) for a, b in zip([y, *g], [yr, *gr], strict=True)), rank
        # split mode, pipelined: the GEMM kernel's slot m-tiles wait for the receive, its threads beside the transport's
        assert all(torch.equal(a, b) for a, b in zip([y, *g], [split[0], *split[1]], strict=True)), rank
        # the library lowering: each rank bitwise the one-process library layer's (its slots read in place)
        assert torch.equal(lib[0], y0_lib[rank]) and torch.equal(lib[1][0], g0_lib[0][rank]), rank
        assert torch.equal(lib[1][1], g0_lib[1][rank])
        for a, b in zip(lib[1][2:], g0_lib[2:], strict=True):
            assert torch.equal(a, b[mine]), rank


def test_an_expired_exchange_wait_names_what_it_waited_for_and_stops_the_layer():
    """The backward's exchange waits store which counter expired (the replicas' gradients 1,
    the homes' receipts 2) and give up at once; the host names it in a KernelError and stops
    the module: the ranks' arrival counts no longer agree."""
    from rdepc.runtime.records import KernelError

    module = rdepc.load("examples/tiny_balance.rdep").module("emulated", "cpu")
    k, stride = module.inner.kernels, 1024
    bal = torch.zeros(W * stride, dtype=torch.uint8)  # no rank ever signals
    slots = torch.tensor([[0], [-1], [-1], [-1]], dtype=torch.int32)  # rank 0 holds a replica of expert 0 (homed there)
    expected = torch.zeros(2, dtype=torch.int64)
    for counter in (0, 1):
        err = torch.zeros(1, dtype=torch.int32)
        module._run(k.balance_await, (1,), (bal, stride, counter, slots, module.owner, expected, 0, 50, err))
        assert err.tolist() == [counter + 1]
    with pytest.raises(KernelError, match=r"waited .* spins for the replicas' gradients from other ranks"):
        module._raise_err([1])
    with pytest.raises(RuntimeError, match="rebuild it on every rank"):
        ids, gates, x, weights = skewed()
        module(x, ids, gates, *weights)


@pytest.mark.parametrize(("victim", "waiter"), [("push r1", "receive r"), ("load r1", "solve r")])
def test_a_withheld_balance_task_is_the_layers_own_expired_wait(victim, waiter):
    """The loads and the weight pushes are tasks of the layer's graph: one that never
    finishes trips the tasks waiting for it (every rank's solve, every rank's receive), an
    error of the layer naming both, and the next call recovers."""
    from rdepc.runtime.records import KernelError

    module = rdepc.load("examples/tiny_balance.rdep").module("emulated", "cpu", spin_bound=50)
    ids, gates, x, weights = skewed()
    good = module(x, ids, gates, *weights)
    module.withhold(module.contract.names.index(victim))
    with pytest.raises(KernelError) as e:
        module(x, ids, gates, *weights)
    rec = e.value.record
    assert rec["what"] == "wait expired" and rec["flag_task"] == victim and rec["task"].startswith(waiter)
    assert torch.equal(module(x, ids, gates, *weights), good)


def test_dedup_sums_per_physical_owner_within_rounding(tmp_path, limits):
    """Under ``dedup`` an owner sums a token's rows before returning them: which rows share an
    owner follows the plan, so outputs and gradients agree with the unreplicated layer's
    up to fp32 rounding, not bitwise."""
    text = (ROOT / "examples" / "tiny_balance.rdep").read_text(encoding="utf-8")
    f = tmp_path / "d.rdep"
    f.write_text(text.replace("transport emulated", "transport emulated, dedup"))
    module = rdepc.load(f).module("emulated", "cpu")
    y, g = train_step(module, *skewed())
    y0, g0 = train_step(rdepc.load("examples/tiny.rdep").module("emulated", "cpu"), *skewed())
    assert module.last_stats["balance"]["imbalance_after"] < module.last_stats["balance"]["imbalance_before"]
    for i, (a, b) in enumerate(zip([y, *g], [y0, *g0], strict=True)):
        assert_close(a, b, limits[i], ("y", "x", "topk_weights", "w_gate", "w_up", "w_down")[i])
