"""The other small device functions of codegen/device/, one by one under the interpreter,
each against a reference written here in Python: fp32 narrowing, the input checks, dedup's
lead slots, the scan's key counts, the heap's peers and puts, signals and waits (the kernels
file: tests/device_kernels.py); and every global a copied function reads is one the emitter
writes for every example."""

from __future__ import annotations

import ast
import itertools
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, tiny_segmented
from device_kernels import BASE, Code, launch, pow2
from rdepc.codegen import emit, transport
from rdepc.codegen.device import HERE, include

import rdepc
from rdepc.driver import generate_spec
from rdepc.ir.balance import plan_elems, plan_tables, slot_elems, slot_parts, solve

# --- control.py: narrow, note, validate ----------------------------------------------------


def narrow_inputs(subnormal: bool = True) -> torch.Tensor:
    """fp32 values: random over many scales; exact bf16 and fp16 halfway cases with both
    parities; just off halfway; signed zeros; infinities; values that round to inf; a NaN;
    fp32 subnormals unless ``subnormal`` is False."""
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-38, 1e-6, 1.0, 1e4, 1e30])
    parts = [torch.randn(640, generator=g) * scales.repeat_interleave(128)]
    bits = torch.randint(0x00800000, 0x7F000000, (256,), generator=g, dtype=torch.int64)
    bits = torch.cat((bits, bits | (1 << 31)))
    for low in (0x8000, 0x18000, 0x7FFF, 0x8001):  # bf16: halfway, halfway odd, just below, just above
        parts.append(((bits & ~0x1FFFF) | low).to(torch.int32).view(torch.float32))
    fp16 = torch.randint(0x38800000, 0x47000000, (256,), generator=g, dtype=torch.int64)  # fp16's normal range
    for low in (0x1000, 0x3000, 0x0FFF):  # fp16: halfway, halfway odd, just below
        parts.append(((fp16 & ~0x3FFF) | low).to(torch.int32).view(torch.float32))
    edges = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 6e-8, 3e-8, 65504.0, 65520.0, 65519.0, 3.4028235e38, -3.4e38]
    edges += [3.3961776e38, 1.1754942e-38, float("inf"), -float("inf"), float("nan")]
    x = torch.cat([*parts, torch.tensor(edges)])
    if not subnormal:
        x = x[(x.abs() >= 2**-126) | (x == 0) | x.isnan()]
    return torch.cat((x, torch.zeros(pow2(x.numel()) - x.numel())))


def narrowed(kernels, name: str, x: torch.Tensor, dtype: torch.dtype, cast: bool) -> torch.Tensor:
    y = torch.full(x.shape, 7.0, dtype=dtype)
    launch(getattr(kernels(), name), (1,), x, y, N=x.numel(), CAST_F32=cast)
    return y


def assert_same_bits(x: torch.Tensor, y: torch.Tensor) -> None:
    """y is x.to(y.dtype) bit for bit, NaN for NaN."""
    want = x.to(y.dtype)
    bits = torch.int32 if y.dtype == torch.float32 else torch.int16
    wrong = (y.view(bits) != want.view(bits)) & ~(want.isnan() & y.isnan())
    show = [
        (f"{float(a):.8g}", hex(int(b)), hex(int(c)))
        for a, b, c in zip(x[wrong], y.view(bits)[wrong], want.view(bits)[wrong], strict=True)
    ]
    assert not wrong.any(), f"{int(wrong.sum())} values (x, got, torch): {show[:6]}"


@pytest.mark.parametrize(
    ("name", "dtype", "cast"),
    [
        ("narrow_bf16", torch.bfloat16, True),
        ("narrow_f16", torch.float16, True),
        ("narrow_f16", torch.float16, False),
        ("narrow_f32", torch.float32, True),
        ("narrow_f32", torch.float32, False),
    ],
)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, casting to inf
def test_narrow_rounds_to_nearest_even_as_torch_does(kernels, name, dtype, cast):
    """narrow: fp32 to bf16 (under CAST_F32, the interpreter's), fp16 and fp32 bit for bit
    as torch's ``.to``: round to nearest, ties to even, overflow to inf (bf16: fp32's normal
    range and zero, inf, NaN; its subnormals are the next test's)."""
    x = narrow_inputs(subnormal=dtype != torch.bfloat16)
    assert_same_bits(x, narrowed(kernels, name, x, dtype, cast))


def test_narrow_rounds_fp32_subnormals_to_bf16_as_torch_does(kernels):
    x = torch.tensor([8.487103e-39, -1.1258398e-38, 1e-40, 1e-45, 5.9e-39, -2.2e-39, 1e-39, 3e-42])
    assert_same_bits(x, narrowed(kernels, "narrow_bf16", x, torch.bfloat16, True))


def test_narrow_keeps_every_nan_a_nan_in_bf16(kernels):
    bits = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFC00000, 0x7FA00000, 0, 0])
    x = bits.to(torch.int32).view(torch.float32)
    y = narrowed(kernels, "narrow_bf16", x, torch.bfloat16, True)
    assert torch.equal(y.isnan(), x.isnan()), [hex(int(v) & 0xFFFF) for v in y.view(torch.int16)]
    assert_same_bits(x, y)  # torch's quiet NaN, 0x7FC0, for every NaN


@pytest.mark.parametrize("case", ["clean", "some", "earlier-seen", "all"])
def test_note_counts_offenders_and_keeps_the_largest_key(kernels, case):
    """note: adds the number of offending rows to word 3 and raises word 4 to their largest
    key; writes nothing when no row offends."""
    N = 64
    rng = np.random.default_rng(len(case))
    keys = torch.from_numpy(rng.permutation(N) * 977 + (1 << 35) + 1)  # distinct, past 32 bits
    bad = torch.from_numpy(rng.random(N) < {"clean": 0.0, "some": 0.2, "earlier-seen": 0.2, "all": 1.0}[case])
    ctl = torch.arange(100, 108, dtype=torch.int64)
    if case == "earlier-seen":
        ctl[4] = 1 << 41  # a larger key an earlier block noted stays
    want = ctl.clone()
    if bad.any():
        want[3] += int(bad.sum())
        want[4] = max(int(want[4]), int(keys[bad].max()))
    launch(kernels().note_rows, (1,), ctl, bad.to(torch.int8), keys, N=N)
    assert ctl.tolist() == want.tolist()


VALIDATE = dict(W=3, T=16, K=3, K_PAD=4, E=6, VALIDATE_TOKENS=8)


def reference_validate(ids, gates, T: int, E: int) -> dict[str, tuple[int, int]]:
    """(count, largest key) of bad ids, non-finite gates on routed slots and tokens with a
    repeated expert; key W·T·K − (r·T + t)·K − k (the earliest offender's is the largest)."""
    W, n, K = ids.shape
    found = {"ids": [], "gates": [], "dups": []}
    for r, t in itertools.product(range(W), range(n)):
        key = W * T * K - (r * T + t) * K
        e = [int(x) for x in ids[r, t]]
        for k in range(K):
            if e[k] < -1 or e[k] >= E:
                found["ids"].append(key - k)
            if e[k] != -1 and not math.isfinite(float(gates[r, t, k])):
                found["gates"].append(key - k)
        routed = [x for x in e if x != -1]
        if len(set(routed)) < len(routed):
            found["dups"].append(key)
    return {n: (len(v), max(v, default=0)) for n, v in found.items()}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # numpy: inf - inf
def test_validate_counts_bad_ids_gates_and_repeats_with_the_earliest(kernels, seed):
    """validate over W front-ends of T' < T tokens (several blocks): out-of-range ids, NaN
    and ±inf gates where a slot routes somewhere, tokens with an expert twice (-1 slots are
    padding: neither). Seed 0 is clean: the control block is left as it was."""
    W, T, K, E = VALIDATE["W"], VALIDATE["T"], VALIDATE["K"], VALIDATE["E"]
    n = 13
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.permutation(E)[:K] for _ in range(n)] for _ in range(W)]).astype(np.int64)
    gates = rng.random((W, n, K)).astype(np.float32)
    pad = rng.random((W, n, K)) < 0.15
    ids[pad] = -1
    gates[pad & (rng.random((W, n, K)) < 0.5)] = np.nan  # padding may carry any gate
    if seed:
        for _ in range(3 * seed):
            r, t, k = rng.integers(0, W), rng.integers(0, n), rng.integers(0, K)
            what = rng.integers(0, 3)
            if what == 0:
                ids[r, t, k] = rng.choice([-2, -9, E, E + 4])
            elif what == 1:
                gates[r, t, k] = rng.choice([np.nan, np.inf, -np.inf])
            else:
                ids[r, t, k] = ids[r, t, (k + 1) % K] if ids[r, t, (k + 1) % K] != -1 else 0
                ids[r, t, (k + 1) % K] = ids[r, t, k]
    want = reference_validate(ids, gates, T, E)
    assert (sum(c for c, _ in want.values()) == 0) == (seed == 0)
    ctl = torch.zeros(24, dtype=torch.int64) if seed else torch.arange(24, dtype=torch.int64) * 3 + 1
    before = ctl.clone()
    mod = kernels(**VALIDATE)
    launch(mod.validate_inputs, (W,), torch.from_numpy(ids), torch.from_numpy(gates), ctl, n)
    words = {"ids": BASE["CTL_BAD_IDS"], "gates": BASE["CTL_BAD_GATES"], "dups": BASE["CTL_DUP_TOKENS"]}
    expect = before.clone()
    for name, (count, key) in want.items():
        if count:
            expect[words[name]] += count
            expect[words[name] + 1] = key
    assert ctl.tolist() == expect.tolist(), want


# --- combine.py: leads; route.py: keys_below -----------------------------------------------


def test_leads_are_each_tokens_first_accepted_slot_per_owner(kernels):
    """leads: an accepted slot leads iff no accepted slot of its token at the same owner
    has a lower row there."""
    N, KP = 32, 4
    rng = np.random.default_rng(11)
    ok = rng.random((N, KP)) < 0.7
    q = rng.integers(0, 3, (N, KP))
    row = rng.permutation(1000)[: N * KP].reshape(N, KP)
    out = torch.full((N, KP), 9, dtype=torch.int8)
    args = (torch.from_numpy(ok).to(torch.int8), torch.from_numpy(q).int(), torch.from_numpy(row).int(), out)
    launch(kernels().lead_slots, (1,), *args, N=N, KP=KP)
    want = [
        [
            bool(ok[t, k]) and min(row[t, j] for j in range(KP) if ok[t, j] and q[t, j] == q[t, k]) == row[t, k]
            for k in range(KP)
        ]
        for t in range(N)
    ]
    assert (out != 0).tolist() == want
    assert any(ok[t, j] and ok[t, k] and q[t, j] == q[t, k] for t in range(N) for j in range(KP) for k in range(j))


def test_keys_below_counts_each_sources_keys_under_the_bound(kernels):
    """keys_below: per local expert of the owner (those below n_local), how many of the keys
    a source published for it (its run among the source's runs, laid in local order, as
    long as its count) are below that expert's bound; other locals count 0."""
    W, T, K, E_MAX, EL = BASE["W"], BASE["T"], BASE["K"], BASE["E_MAX"], BASE["EL_PAD"]
    rng = np.random.default_rng(13)
    n_local = 2
    counts = np.zeros((W, E_MAX), np.int32)
    counts[:, :n_local] = [[9, 7], [0, 16], [5, 0], [3, 4]]
    counts[:, n_local:] = 6  # beyond the owner's experts: not read
    keys = np.full((W, T * K), 1 << 50, np.int64)  # past every run: must not count
    for src in range(W):
        run = np.sort(rng.integers(0, 200, int(counts[src, :n_local].sum())))
        keys[src, : run.size] = run
    bounds = rng.integers(0, 220, (W, EL)).astype(np.int64)
    bounds[0, 0] = keys[0, 0]  # a key equal to the bound is not below it
    out = torch.full((W, EL), -1, dtype=torch.int32)
    args = (torch.from_numpy(keys), torch.from_numpy(counts), torch.tensor([n_local], dtype=torch.int32))
    launch(kernels().count_below, (W,), *args, torch.from_numpy(bounds), out)
    want = np.zeros((W, EL), np.int64)
    for src in range(W):
        start = 0
        for l in range(n_local):
            run = keys[src, start : start + counts[src, l]]
            want[src, l] = sum(int(k) < int(bounds[src, l]) for k in run)
            start += counts[src, l]
    assert out.tolist() == want.tolist()
    assert counts[:, :n_local].max() > 2 * BASE["KEY_ROWS"]  # runs longer than a block of keys


# --- heap.py, signals.py -------------------------------------------------------------------


def test_peer_and_put_address_each_ranks_slice_of_the_heap(kernels):
    """peer(heap, r) is r's slice of a [W, HEAP_BYTES] uint8 heap; put stores the values its
    mask keeps there, for a scalar rank and for a vector of ranks (padded lanes masked)."""
    W, HB, N, at = BASE["W"], BASE["HEAP_BYTES"], 16, 40
    mod = kernels()
    heap = torch.full((W, HB), 0xAB, dtype=torch.uint8)
    values = torch.arange(W * N, dtype=torch.int32).reshape(W, N) * 1000 - 7
    mask = torch.from_numpy(np.random.default_rng(2).random((W, N)) < 0.6)
    launch(mod.put_words, (W,), heap, values, mask.to(torch.int8), at, N=N)
    want = torch.full((W, HB), 0xAB, dtype=torch.uint8)
    for r in range(W):
        words = want[r, at : at + 4 * N].clone().view(torch.int32)
        words[mask[r]] = values[r][mask[r]]
        want[r, at : at + 4 * N] = words.view(torch.uint8)
    assert torch.equal(heap, want)
    launch(mod.put_to_peers, (1,), heap, 200, 1 << 40, WP=8)
    for r in range(W):
        want[r, 200:208] = torch.tensor([(1 << 40) + r], dtype=torch.int64).view(torch.uint8)
    assert torch.equal(heap, want)


def test_pushed_and_received_slots_hold_their_experts_operands_chunk_by_chunk(kernels):
    """slots.py: every rank's push task (a work item per chunk of each home expert, read once)
    puts its home experts' operands into every slot the plan's slot table gives them, packed
    as the layer's kernels read them (rdepc.ir.balance.slot_parts); each rank's receive
    copies its slots out, chunk by chunk. Chunks of 100 elements cross every boundary
    between the parts; experts 0 and 4 have two replicas each, expert 1 none."""
    H, F, W, N, E_loc, chunk = 8, 12, 3, 2, 2, 100
    parts = slot_parts(H, F, True, True)
    P = slot_elems(3, H, F, True)
    chunks = -(-P // chunk)
    at = {f"SLOT_{n}_AT": parts[k][0] for n, k in (("DOWN", "w_down"), ("B_UP", "b_up"), ("B_DOWN", "b_down"))}
    mod = kernels(W=W, H=H, F=F, UP_COLS=2, BIAS=True, DTYPE=Code("tl.float32"), SLOTS=N, SLOTS_PAD=pow2(W * N),
                  SLOT_ELEMS=P, SLOT_CHUNK=chunk, SLOT_CHUNKS=chunks, EX_SLOTS_AT=256, **at)  # fmt: skip
    order = torch.tensor([4, 5, 0, 1, 2, 3], dtype=torch.int32)  # rank 0 homes experts 4 and 5 (a map)
    owner = [1, 1, 2, 2, 0, 0]
    first = torch.tensor([0, 2, 4], dtype=torch.int32)
    table = torch.tensor([[2, 0], [4, -1], [0, 4]], dtype=torch.int32)  # never on its home
    g = torch.Generator().manual_seed(3)
    weights = [
        [torch.randn(E_loc, *shape, generator=g) for shape in ((H, F, 2), (F, H), (F, 2), (H,))] for _ in range(W)
    ]
    stride = 256 + N * P * 4 + 64  # the slots after the exchange's counters and load table
    exchange = torch.zeros(W * stride, dtype=torch.uint8)
    for r in range(W):
        launch(mod.push_chunks, (E_loc * chunks,), exchange, stride, table, order, first, *weights[r], r)
    for r in range(W):
        slots = torch.full((N, P), -1.0)
        launch(mod.receive_chunks, (N * chunks,), exchange, stride, slots, r)
        for j, e in enumerate(table[r].tolist()):
            want = torch.zeros(P)
            if e >= 0:
                i = order[first[owner[e]] :].tolist().index(e)
                want = torch.cat([w[i].flatten() for w in weights[owner[e]]])
            assert torch.equal(slots[j], want), (r, j)


def test_the_plan_tasks_derive_the_references_plan_on_every_rank(kernels):
    """plan.py, as the layer's tasks run it one process per rank: every rank's load puts its
    rows per home expert into every rank's load table; each rank's solve derives, from its
    own copy, the plan of rdepc.ir.balance.solve (every rank the same bytes); each rank's
    reroute sends its rows of each expert to the expert's instances as the plan's split says,
    a repeated expert within a token to one instance, and -1 and out-of-range ids through."""
    W, HOMES, N, U, T, K = 4, 8, 1, 2, 16, 2
    owner = np.repeat(np.arange(W), HOMES // W)
    tables = plan_tables(W, HOMES, N)
    at = {f"PLAN_{n.upper()}_AT": tables[n][0] for n in ("phys", "cum", "slots", "loads")}
    mod = kernels(W=W, T=T, K=K, E=HOMES + W * N, HOMES=HOMES, HOMES_PAD=HOMES, SLOTS=N, RANK_SLOTS_PAD=pow2(N),
                  MIN_ROWS=U, W_PAD=W, K_PAD=K, ROUTE_ROWS=16, EX_LOADS_AT=256, **at)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(W, T, HOMES, generator=g)
    logits[..., 0] += 3  # expert 0 (rank 0's) is hot
    ids = logits.topk(K, -1).indices
    ids[1, 3] = torch.tensor([-1, 2])  # a row routed nowhere
    ids[2, 5] = torch.tensor([6, 6])  # a repeat: the layer's input check sees it
    ids[3, 0, 1] = HOMES + 1  # out of range: becomes E
    stride = 256 + W * HOMES * 4
    exchange = torch.zeros(W * stride, dtype=torch.uint8)
    launch(mod.load_ranks, (W,), exchange, stride, ids, T)
    elems = plan_elems(W, HOMES, N)
    plans = torch.full((W, elems), -7, dtype=torch.int32)
    launch(mod.solve_ranks, (W,), exchange, stride, plans, torch.tensor(owner, dtype=torch.int32), elems)
    phys_ids = torch.full((W, T, K), -9, dtype=torch.int64)
    launch(mod.reroute_ranks, (W,), ids, phys_ids, plans, T, elems)
    load = np.stack([np.bincount(ids[r][(ids[r] >= 0) & (ids[r] < HOMES)], minlength=HOMES) for r in range(W)])
    want = solve(load, owner, N, U)
    for r in range(W):
        assert torch.equal(plans[r], plans[0]), r
    plan = {n: plans[0][o : o + math.prod(shape)].reshape(shape).numpy() for n, (o, shape) in tables.items()}
    assert (plan["load"] == load).all() and (plan["slots"] == want.slots).all()
    assert (plan["cum"] == np.cumsum(want.split, axis=2)).all() and (plan["loads"][1] == want.rank_loads).all()
    assert (want.slots >= 0).any()  # something was replicated
    got = phys_ids.numpy()
    assert got[1, 3, 0] == -1 and got[3, 0, 1] == HOMES + W * N and got[2, 5, 0] == got[2, 5, 1]
    for r in range(W):
        for e in range(HOMES):
            for t in range(W):
                inst = plan["phys"][e, t]
                sent = int(((ids[r].numpy() == e) & (got[r] == inst)).sum()) if inst >= 0 else 0
                if not (r == 2 and e == 6):  # the repeat: both rows to one instance
                    assert sent == want.split[r, e, t], (r, e, t)


@pytest.mark.parametrize(
    ("start", "times", "target", "bound"), [(0, 1, 1, 5), (5, 3, 7, 0), (2, 2, 9, 50), (4, 0, 5, 0)]
)
def test_signal_then_wait_sees_the_value_or_gives_up_after_its_spins(kernels, start, times, target, bound):
    """signal adds one to the flag; wait returns the flag's value once it reaches the target,
    or, when it never does, the value it last saw after ``bound`` spins."""
    flag = torch.tensor([start], dtype=torch.int64)
    seen = torch.full((1,), -1, dtype=torch.int64)
    stop = torch.zeros(1, dtype=torch.int64)
    launch(kernels().signal_then_wait, (1,), flag, seen, target, bound, stop, TIMES=times)
    assert flag.item() == start + times
    assert seen.item() == start + times


def test_wait_gives_up_at_once_when_the_call_has_failed(kernels):
    """A wait whose flag never reaches its target stops as soon as the call's error word is
    set, whatever its bound: 2^40 spins would not end under the interpreter."""
    flag = torch.zeros(1, dtype=torch.int64)
    seen = torch.full((1,), -1, dtype=torch.int64)
    stop = torch.tensor([3], dtype=torch.int64)
    launch(kernels().signal_then_wait, (1,), flag, seen, 5, 1 << 40, stop, TIMES=1)
    assert seen.item() == 1


# --- every global a copied function reads is written ---------------------------------------

CAPS = re.compile(r"[A-Z][A-Z0-9_]*")


def free_constants(source: str) -> set[str]:
    """ALL_CAPS names the functions in ``source`` read and neither take nor assign."""
    found = set()
    for fn in ast.parse(source).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        args = fn.args
        bound = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        names = [n for n in ast.walk(fn) if isinstance(n, ast.Name)]
        bound |= {n.id for n in names if not isinstance(n.ctx, ast.Load)}
        found |= {n.id for n in names if isinstance(n.ctx, ast.Load) and CAPS.fullmatch(n.id) and n.id not in bound}
    return found


def written(text: str) -> set[str]:
    return set(re.findall(r"^([A-Za-z_]\w*) = tl\.constexpr\(", text, re.M))


def module_constants(path: Path) -> set[str]:
    """The names a module assigns at its top level (its stand-ins)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}


EXAMPLES = sorted((ROOT / "examples").glob("*.rdep"))


@pytest.mark.parametrize("example", [*EXAMPLES, "tiny-segmented"], ids=lambda p: getattr(p, "stem", p))
def test_every_global_a_device_function_reads_is_a_constant_the_emitter_writes(example, tmp_path):
    """Every ALL_CAPS global of a copied function (the generated file's modules, the heap's
    and the signals') is written by the constants block or the transport's section, and so
    is every stand-in of heap.py and signals.py. The names the block writes
    do not depend on the schedule: the examples are planned bulk, which is quick, and tiny
    also segmented and pipelined."""
    path = tiny_segmented(tmp_path) if example == "tiny-segmented" else example
    plan = generate_spec(rdepc.load(path).spec, schedule=None if example == "tiny-segmented" else "bulk").kernel
    block = emit.constants(plan)
    have = written(block) | written(transport.source(plan.transport))
    modules = (*emit.DEVICE_MODULES, "balance", "heap", "signals")
    read = {m: free_constants(include(m)) for m in modules}
    assert {"W", "RID_0", "DROP", "S"} <= read["rows"] and read["signals"] == {"SCOPE"}
    missing = {m: sorted(names - have) for m, names in read.items() if names - have}
    assert not missing, f"read by device functions but not written for {Path(str(path)).name}: {missing}"
    # layout.py's stand-ins are the table the block is written from (tests/test_interface.py)
    for m in ("heap", "signals"):
        assert module_constants(HERE / f"{m}.py") <= have, m
