"""Exact-load expert replication: the ``balance`` statement, the solver's NumPy reference
(rdepc.ir.balance) and its properties, the planner's figures, and compile's refusal."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdepc.ir.balance import imbalance, owner_loads, push_bytes, slot_elems, slot_parts, solve

SPEC = """layer m {{
  shape ranks 8, tokens 512, hidden 64, experts 32, top 4
  expert swiglu(ffn = 128)
  {balance}
}}
"""


def balanced_owner(W, E):
    return np.repeat(np.arange(W), E // W)


def zipf_load(W, E, T, K, alpha, seed):
    """Rows per (source, expert): each token picks K distinct experts, weights ∝ 1/rank^α
    over a random ranking of the experts (so the hot ones land on any owner)."""
    rng = np.random.default_rng(seed)
    logw = -alpha * np.log(np.arange(1, E + 1))[rng.permutation(E)]
    load = np.zeros((W, E), dtype=np.int64)
    for r in range(W):
        keys = logw - np.log(-np.log(1 - rng.random((T, E))))
        load[r] = np.bincount(np.argpartition(-keys, K - 1, axis=1)[:, :K].ravel(), minlength=E)
    return load


def hot_load(W, E, T, K, hot, seed):
    """Uniform routing, except that ``hot`` experts of one owner take half of every token's slots."""
    rng = np.random.default_rng(seed)
    load = rng.multinomial(T * K // 2, np.full(E, 1 / E), size=W)
    load[:, :hot] += rng.multinomial(T * K // 2, np.full(hot, 1 / hot), size=W)
    return load


def check_plan(load, owner, slots, min_rows):
    p = solve(load, owner, slots, min_rows)
    W, E = load.shape
    assert (p.split >= 0).all() and (p.quota >= 0).all()
    assert (p.split.sum(axis=2) == load).all()  # row sums: each source's rows of e all assigned
    assert (p.split.sum(axis=0) == p.quota).all()  # column sums: each instance gets its quota
    assert (p.quota.sum(axis=1) == load.sum(axis=0)).all()
    replica = p.quota > 0
    replica[np.arange(E), owner] = False
    assert (replica.sum(axis=0) <= slots).all()  # at most N replicas a rank, never on the home
    assert (p.quota[replica] >= min_rows).all()  # every replica carries at least U rows
    for t in range(W):  # the slot table names exactly the replicas, each expert once a rank
        named = p.slots[t][p.slots[t] >= 0]
        assert list(named) == sorted(set(named)) == list(np.flatnonzero(replica[:, t]))
        assert (owner[named] != t).all()
    assert p.rank_loads.max() <= p.threshold
    assert p.rank_loads.max() <= owner_loads(load, owner).max()
    return p


@st.composite
def instances(draw):
    W = draw(st.integers(1, 6))
    E = W * draw(st.integers(1, 4))
    owner = np.array(draw(st.permutations(list(np.repeat(np.arange(W), E // W)))))
    load = np.array(draw(st.lists(st.lists(st.integers(0, 60), min_size=E, max_size=E), min_size=W, max_size=W)))
    slots = draw(st.integers(0, E - E // W))
    return load, owner, slots, draw(st.integers(1, 20))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(instances())
def test_plan_properties(case):
    load, owner, slots, min_rows = case
    p = check_plan(load, owner, slots, min_rows)
    q = solve(load.copy(), owner.copy(), slots, min_rows)  # a pure function: identical arrays
    for a, b in ((p.slots, q.slots), (p.quota, q.quota), (p.split, q.split)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert p.threshold == q.threshold


def test_no_slots_no_replicas():
    load = zipf_load(4, 16, 256, 2, 1.5, 0)
    owner = balanced_owner(4, 16)
    p = check_plan(load, owner, 0, 1)
    assert (p.slots.size == 0) and (p.rank_loads == owner_loads(load, owner)).all()


def test_locality_first():
    # expert 0 homed on rank 0 and hot from every source; a replica's rank keeps its own rows
    load = np.array([[40, 1, 1, 1], [40, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]])
    owner = np.arange(4)
    p = check_plan(load, owner, 1, 1)
    for t in np.flatnonzero(p.quota[0] > 0):
        assert p.split[t, 0, t] == min(load[t, 0], p.quota[0, t])


# Slots suffice when every rank may take N = E_loc replicas (W = 8, E = 32: 4 a rank) and the
# hottest expert's load is at most a few ranks' mean: then the search reaches ≤ 1.05.
CASES = [("zipf", a, s) for a in (1.0, 1.5, 2.0) for s in (0, 1)] + [("hot", h, s) for h in (1, 2) for s in (0, 1)]


@pytest.mark.parametrize("kind,arg,seed", CASES)
def test_skewed_loads_balance(kind, arg, seed):
    W, E, T, K = 8, 32, 1024, 4
    load = zipf_load(W, E, T, K, arg, seed) if kind == "zipf" else hot_load(W, E, T, K, arg, seed)
    owner = balanced_owner(W, E)
    before = imbalance(owner_loads(load, owner))
    p = check_plan(load, owner, 4, 16)
    after = imbalance(p.rank_loads)
    assert before > 1.3 and after <= 1.05, (before, after)


def test_imbalance():
    assert imbalance([2, 2, 2]) == 1.0 and imbalance([4, 0]) == 2.0 and imbalance([0, 0]) == 1.0


# ---------------------------------------------------------------------- the statement


def elab(tmp_path, balance):
    from rdepc.passes.elaborate import elaborate

    from rdepc.parser import parse_file

    f = tmp_path / "b.rdep"
    f.write_text(SPEC.format(balance=balance))
    specs, diags = elaborate(parse_file(str(f)), sympy=False)
    return specs, [(d.span.line, d.span.col, d.message) for d in diags.errors]


def test_statement_elaborates(tmp_path):
    (s,), errors = elab(tmp_path, "balance replicate(slots = 2, min_rows = 16)")
    assert not errors and (s.balance.kind, s.balance.slots, s.balance.min_rows) == ("replicate", 2, 16)
    (s,), _ = elab(tmp_path, "balance none")
    assert s.balance.kind == "none"


@pytest.mark.parametrize(
    "text,where,message",
    [
        ("balance replicate(slots = 29, min_rows = 4)", (4, 29), "balance slots = 29 is more than rank 0 can fill"),
        ("balance replicate(slots = 0, min_rows = 4)", (4, 29), "balance slots must be positive"),
        ("balance replicate(slots = 2, min_rows = 0)", (4, 43), "balance min_rows must be positive"),
        ("balance replicate(slots = 2, min_row = 4)", (4, 32), "unknown option 'min_row' to replicate"),
        ("balance replicat", (4, 11), "unknown balance kind 'replicat'"),
        ("balance replicate", (4, 11), "'balance replicate' needs its slots and min_rows"),
    ],
)
def test_statement_errors(tmp_path, text, where, message):
    specs, errors = elab(tmp_path, text)
    assert not specs and any((ln, col) == where and m.startswith(message) for ln, col, m in errors), errors


# ---------------------------------------------------------------------- plan and compile


def run_cli(*argv):
    import contextlib
    import io

    from rdepc.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def test_plan_reports_imbalance_and_slot_memory(tmp_path):
    f = tmp_path / "b.rdep"
    f.write_text(SPEC.format(balance="balance replicate(slots = 2, min_rows = 16)"))
    status, out, _ = run_cli("plan", str(f), "--routing", "zipf:1.5")
    assert status == 0
    lines = {ln.split("  ")[1].strip(): ln for ln in out.splitlines() if ln.startswith("  ") and "  " in ln[2:]}
    assert "98,304 B" in lines["slot memory per rank"]  # 2 slots · 3·64·128 params · 2 bytes
    # the runtime's own allocation: 256 B of counters, 8·32 int32 loads, 2 weight and 2 gradient slots
    assert "197,888 B" in lines["exchange allocation per rank"]
    before = float(lines["owner imbalance, before"].split()[3].rstrip("x"))
    after = float(lines["owner imbalance, after"].split()[3].rstrip("x"))
    assert before > 2 and after <= 1.05
    # the busiest rank's GEMM time falls with its rows; the replicas' weights are what the plan moves
    t_before, t_after = (lines[f"busiest rank's GEMMs, {w}"] for w in ("before", "after"))
    rows = [int(x.split(" rows of the busiest rank")[0].split()[-1]) for x in (t_before, t_after)]
    assert rows[0] > rows[1] > 0 and rows[0] / rows[1] >= before / after * 0.99
    replicas = int(lines["replicas"].split()[1])
    assert f"{replicas * 3 * 64 * 128 * 2:,} B" in lines["replicas' weights moved"]
    assert "replica pushes (sent or received) alone at B_eff" in lines["busiest rank's pushes"]
    status, out, _ = run_cli("plan", str(f))
    assert status == 0 and "needs a routing: --routing uniform or zipf:ALPHA" in out
    assert "owner imbalance, before" not in out


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.integers(1, 64), st.integers(1, 64), st.sampled_from([1, 2, 4]), st.booleans(), st.booleans(), st.integers(0, 3)
)
def test_a_slots_operands_are_as_aligned_as_the_layers(h, f, a, gated, bias, j):
    """Where the layer's GEMMs read through tensor descriptors (every operand row 16-byte
    aligned: codegen.emit.tma), the operands of slot j, read in place at j·SLOT_ELEMS plus
    their offset, start 16-byte aligned too: no slot needs a check of its own."""
    H, F = h * 16 // a, f * 16 // a  # H·a and F·a multiples of 16, as tma() asks
    parts = slot_parts(H, F, gated, bias)
    P = slot_elems(3 if gated else 2, H, F, bias)
    assert sum(n for _, n in parts.values()) == P
    assert all((j * P + at) * a % 16 == 0 for at, _ in parts.values())


def test_push_bytes_counts_one_expert_per_filled_slot_from_its_home():
    slots = np.array([[-1, 3], [0, -1], [3, -1], [-1, -1]])  # expert 3 on ranks 0 and 2, expert 0 on rank 1
    sent, received = push_bytes(slots, balanced_owner(4, 8), 10)  # experts 0, 1 on rank 0; 2, 3 on rank 1; ...
    assert sent.tolist() == [10, 20, 0, 0] and received.tolist() == [10, 10, 10, 0]


def test_viz_draws_the_balanced_owners_beside_the_unreplicated_layer(tmp_path):
    f = tmp_path / "b.rdep"  # a layer whose GEMMs outweigh the plan's solve (tiny ones do not)
    spec = SPEC.replace("tokens 512, hidden 64", "tokens 2048, hidden 2048").replace("ffn = 128", "ffn = 1408")
    f.write_text(spec.format(balance="balance replicate(slots = 2, min_rows = 16)"))
    png = tmp_path / "b.png"
    status, out, _ = run_cli("viz", str(f), "--routing", "zipf:1.5", "--png", str(png))
    assert status == 0 and png.stat().st_size > 0
    line = next(x for x in out.splitlines() if x.startswith("balance: "))
    before, after = (float(v) for v in line.split("max/mean ")[1].split(" after")[0].split(" before, "))
    assert before > 2 and after <= 1.05
    layer = float(next(x for x in out.splitlines() if "makespan" in x).split()[1].replace(",", ""))
    pushes = next(x for x in out.splitlines() if x.lstrip().startswith("weight pushes"))
    took = float(pushes.split("pushes")[1].split()[0].replace(",", ""))
    assert 0 < took < layer  # tasks of the layer, within its makespan
    plan = next(x for x in out.splitlines() if x.lstrip().startswith("plan "))
    assert 0 < float(plan.split()[1].replace(",", "")) < layer
    theirs = float(next(x for x in out.splitlines() if "unreplicated" in x).split()[1].replace(",", ""))
    assert layer < theirs  # the busiest owner's compute shrank more than the pushes cost
    status, out, _ = run_cli("viz", str(f))
    assert status == 0 and "the balanced owners need a routing" in out


def test_the_balance_bench_writes_imbalance_before_and_after_for_every_example_shape(tmp_path):
    """bench/balance.py: every shape and routing once, with JSON and plot; the skewed
    routings end near 1 with 2 slots a rank where they started above 3."""
    import json
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT))
    from bench import balance

    out = tmp_path / "balance"
    assert balance.main(["--out", str(out), "--slots", "2", "--reps", "1"]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert [s["name"] for s in results["shapes"]] == [name for name, _ in balance.SHAPES]
    for shape in results["shapes"]:
        assert [c["routing"] for c in shape["cases"]] == list(balance.ROUTINGS)
        for c in shape["cases"]:
            assert c["after"] <= c["before"] and c["replicas"] <= 2 * shape["W"]
            if c["routing"] != "uniform":
                assert c["before"] > 3 and c["after"] <= 1.11, (shape["name"], c)


def test_the_balance_bench_runs_the_generated_solver_at_moonlights_shape(tmp_path):
    """--device-plan: the generated balance_solve kernel (Triton interpreter) derives the
    reference's plan, table for table, for moonlight's shape (8 ranks, 64 experts, top-6,
    4096 tokens a rank) over every routing."""
    import json
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT))
    from bench import balance

    out = tmp_path / "balance"
    argv = ["--out", str(out), "--slots", "2", "--reps", "1", "--device-plan", "cpu", "--shapes", "moonlight"]
    assert balance.main(argv) == 0
    (shape,) = json.loads(out.with_suffix(".json").read_text())["shapes"]
    assert [c["routing"] for c in shape["cases"]] == list(balance.ROUTINGS)
    assert all(c["device_plan_equal"] and c["device_solve_ms"] > 0 for c in shape["cases"])


def test_the_balance_bench_predicts_the_layer_with_its_pushes_as_tasks():
    """bench/balance.py --timeline: at moonlight's shape with 2 slots under zipf 1.2, the
    layer whose kernels run the plan and push the replicas' weights as tasks is predicted no
    slower than the same layer with the solve and the pushes launched before it, and well
    under the layer without replication."""
    import dataclasses
    import sys

    from conftest import ROOT

    import rdepc
    from rdepc.ir.spec import Balance

    sys.path.insert(0, str(ROOT))
    from bench import balance

    spec = dataclasses.replace(
        rdepc.load(ROOT / "examples" / "moonlight.rdep").spec, balance=Balance("replicate", 2, 64)
    )
    t = balance.makespans(spec, "zipf:1.2", 0, "h100")
    assert t["busiest_pushes_us"] > 0 and t["pushes_as_tasks_us"] <= t["pushes_before_us"]
    # about half: the route (0.86 ms at its measured rate) is the same in both
    assert t["pushes_as_tasks_us"] < 0.55 * t["no_replication_us"]
