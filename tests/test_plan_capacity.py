"""The planner's capacity figures: the tail bounds of eq. 16 and beyond, the capacity that
meets an overflow target, and eq. 18 under a file of routing probabilities with its errors."""

from __future__ import annotations

import math

import pytest
from plan_cli import EX, TINY_SHAPE, moonlight_plan, run_json, write_spec
from rdepc.passes import plan_symbols as PS
from rdepc.passes.capacity import chernoff_union_bound
from rdepc.passes.plan import plan
from rdepc.passes.plan_records import PlanOptions, to_json
from rdepc.passes.probs import parse_probs

import rdepc
from rdepc.cli import main
from rdepc.diagnostics import SpecError


@pytest.fixture(scope="module")
def moonlight() -> dict:
    return moonlight_plan()


def test_tail_bound_branch_beta_le_1(tmp_path):
    # mu = 4·16·2/8 = 16; factor 1.5: cap_e = 24, beta = 0.5, bound 8·exp(-16·0.25/3)
    spec = rdepc.load(write_spec(tmp_path, TINY_SHAPE + "\ncapacity factor 1.5")).spec
    c = to_json(plan(spec))["capacity"]
    assert (c["rows_per_expert"], c["beta"], c["overflow_branch"]) == (24, 0.5, "beta<=1 (eq. 16)")
    assert c["overflow_union_bound"] == pytest.approx(8 * math.exp(-16 * 0.25 / 3))  # 2.11: vacuous
    assert c["overflow_bound"] == 1.0
    assert chernoff_union_bound(16, 0.5, 8) == pytest.approx(2.10878, rel=1e-5)


def test_tail_bound_branch_beta_gt_1(tmp_path):
    # factor 3: cap_e = 48, beta = 2, bound 8·exp(-16·4/(2+2)) = 8e^-16
    spec = rdepc.load(write_spec(tmp_path, TINY_SHAPE + "\ncapacity factor 3")).spec
    c = to_json(plan(spec))["capacity"]
    assert (c["rows_per_expert"], c["beta"], c["overflow_branch"]) == (48, 2.0, "beta>1 (2+beta)")
    assert c["overflow_bound"] == pytest.approx(8 * math.exp(-16), rel=1e-12)
    assert c["overflow_bound"] == pytest.approx(9.0029e-7, rel=1e-4)


def test_tail_bound_no_slack_and_continuity():
    # mixtral_8x7b: factor 1.0 gives beta = 0, no protection at all
    c = to_json(plan(rdepc.load(EX / "mixtral_8x7b.rdep").spec))["capacity"]
    assert (c["beta"], c["overflow_bound"], c["overflow_branch"]) == (0, 1, "beta<=0 (no slack)")
    # the two branches meet at beta = 1 (mu/3 both ways)
    assert chernoff_union_bound(3000, 1.0, 64) == pytest.approx(64 * math.exp(-1000))
    assert chernoff_union_bound(30, 1.0 + 1e-12, 64) == pytest.approx(chernoff_union_bound(30, 1.0, 64))


def test_large_mu_buys_protection():
    # nvl72: mu = 13824, beta = 0.25 -> 128·exp(-13824·0.0625/3) = 128·e^-288
    c = to_json(plan(rdepc.load(EX / "nvl72_e128.rdep").spec))["capacity"]
    assert c["overflow_bound"] == pytest.approx(128 * math.exp(-288), rel=1e-9)


def test_inverse_capacity_factor_branch1(moonlight):
    # mu = 3072, E = 64, P = 1e-6: beta = sqrt(3 ln(E/P) / mu) = 0.1325 (beta <= 1)
    beta = math.sqrt(3 * math.log(64 / 1e-6) / 3072)
    c = moonlight["capacity"]
    assert c["factor_needed"] == pytest.approx(1 + beta, rel=1e-9)
    assert c["rows_per_expert_needed"] == math.ceil((1 + beta) * 3072) == 3480
    assert chernoff_union_bound(3072, c["factor_needed"] - 1, 64) == pytest.approx(1e-6, rel=1e-6)


def test_inverse_capacity_factor_branch2(capsys):
    # tiny: mu = 16, E = 8: beta solves mu b^2 = c (2 + b), c = ln(E/P) -> beta = 1.99
    j = run_json(capsys, EX / "tiny.rdep", "--overflow", "1e-6")
    c = math.log(8 / 1e-6)
    beta = (c + math.sqrt(c * c + 8 * c * 16)) / (2 * 16)
    assert j["capacity"]["factor_needed"] == pytest.approx(1 + beta, rel=1e-9)
    assert round(j["capacity"]["factor_needed"], 3) == 2.991
    # the closed form shown by --symbolic is the same number as the bisection
    for name in ("tiny", "moonlight"):
        pl = plan(rdepc.load(EX / f"{name}.rdep").spec)
        assert evaluate(pl, pl.capacity.factor_needed) == pytest.approx(pl.capacity.factor_needed.value, rel=1e-9)


def evaluate(pl, fig) -> float:
    """A figure's formula at the plan's symbol table, independently of the planner's own evaluation."""
    table = dict(pl.values)
    return float(fig.formula.subs({s: table[s.name] for s in fig.formula.free_symbols}))


def test_every_formula_evaluates_to_its_value():
    pl = plan(rdepc.load(EX / "nvl72_e128.rdep").spec, PlanOptions(probs=tuple([6 / 128] * 128)))
    n = 0
    for fig in pl.figures():
        if fig.formula is None or "skew" in fig.key or fig.formula.has(PS.p):
            continue
        assert evaluate(pl, fig) == pytest.approx(fig.value, rel=1e-12, abs=1e-300), fig.key
        n += 1
    assert n > 100


def test_inverse_moves_with_target(capsys):
    f6 = run_json(capsys, EX / "moonlight.rdep", "--overflow", "1e-6")["capacity"]["factor_needed"]
    f3 = run_json(capsys, EX / "moonlight.rdep", "--overflow", "1e-3")["capacity"]["factor_needed"]
    assert 1 < f3 < f6
    assert f3 == pytest.approx(1 + math.sqrt(3 * math.log(64 / 1e-3) / 3072), rel=1e-9)


def test_poisson_binomial_eq18(tmp_path, capsys):
    spec = write_spec(tmp_path, TINY_SHAPE + "\ncapacity factor 1.5")
    probs = tmp_path / "p.txt"
    # uniform marginals K/E = 0.25: mu_e = 16, sigma^2 = 64·0.25·0.75 = 12, x = 24 - 16 = 8
    probs.write_text("0.25, 0.25, 0.25, 0.25\n0.25 0.25 0.25 0.25  # uniform\n", encoding="utf-8")
    sk = run_json(capsys, spec, "--probs", probs)["capacity"]["skew"]
    one = math.exp(-(8**2) / (2 * (12 + 8 / 3)))
    assert sk["overflow_bound"] == pytest.approx(min(1.0, 8 * one), rel=1e-12)
    assert sk["sum_p"] == pytest.approx(2.0)
    # a hot expert: p = 0.5 -> mu_e = 32 > cap_e = 24 (term 1); the rest stays
    probs.write_text("0.5 " + " ".join(["0.2142857142857143"] * 7), encoding="utf-8")
    j = run_json(capsys, spec, "--probs", probs)
    sk = j["capacity"]["skew"]
    assert sk["mu_e_max"] == pytest.approx(32.0)
    assert sk["overflow_bound"] == 1.0
    # rows needed for the hot expert: mu_e + x, x solving x^2 = 2c(sigma^2 + x/3), c = ln(E/P)
    c, var = math.log(8 / 1e-6), 64 * 0.5 * 0.5
    x = c / 3 + math.sqrt(c * c / 9 + 2 * c * var)
    assert sk["rows_per_expert_needed"] == math.ceil(32 + x)


def test_probs_file_errors(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("0.1 0.2\nzz 1.5\n", encoding="utf-8")
    assert main(["plan", str(EX / "tiny.rdep"), "--probs", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:2:1: error: 'zz' is not a number" in err
    assert f"{bad}:2:4: error: probability 1.5 is outside [0, 1]" in err
    bad.write_text("0.25 0.25\n", encoding="utf-8")
    assert main(["plan", str(EX / "tiny.rdep"), "--probs", str(bad)]) == 1
    assert "expected 8 probabilities (one per expert), found 2" in capsys.readouterr().err
    assert main(["plan", str(EX / "tiny.rdep"), "--probs", str(tmp_path / "missing.txt")]) == 2


def test_probs_json_array_as_the_plain_format(tmp_path, capsys):
    spec = write_spec(tmp_path, TINY_SHAPE + "\ncapacity factor 1.5")
    plain, js = tmp_path / "p.txt", tmp_path / "p.json"
    plain.write_text("0.5\t0.25, 0.25  # tabs too\n" + " ".join(["0.2"] * 5) + "\n", encoding="utf-8")
    js.write_text("\n  [0.5, 0.25, 0.25,\n   0.2, 0.2, 0.2, 0.2, 0.2]\n", encoding="utf-8")
    assert parse_probs(plain.read_text(encoding="utf-8"), str(plain), 8) == (0.5, 0.25, 0.25) + (0.2,) * 5
    assert parse_probs(js.read_text(encoding="utf-8"), str(js), 8) == (0.5, 0.25, 0.25) + (0.2,) * 5
    assert parse_probs("[1, 0]", "f", 2) == (1.0, 0.0)  # JSON integers
    assert (
        run_json(capsys, spec, "--probs", js)["capacity"]["skew"]
        == run_json(capsys, spec, "--probs", plain)["capacity"]["skew"]
    )


def probs_errors(text: str, experts: int = 8) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_probs(text, "p", experts)
    return [f"{d.span}: {d.message}" for d in e.value.diagnostics]


def test_probs_errors_point_at_their_entry():
    assert probs_errors("0.1\t0.2, zz\n# c 1.5\n  1.5, -0 nan # x") == [
        "p:1:10: 'zz' is not a number",
        "p:3:3: probability 1.5 is outside [0, 1]",
        "p:3:11: probability nan is outside [0, 1]",
    ]
    assert probs_errors('[0.5,\n "x", [1,\n 2], {"a": 1},\n  1.5, true, null, 1e999, NaN]') == [
        "p:2:2: '\"x\"' is not a number",
        "p:2:7: '[...]' is not a number",
        "p:3:6: '{...}' is not a number",
        "p:4:3: probability 1.5 is outside [0, 1]",
        "p:4:8: 'true' is not a number",
        "p:4:14: 'null' is not a number",
        "p:4:20: probability 1e999 is outside [0, 1]",
        "p:4:27: probability NaN is outside [0, 1]",
    ]
    assert probs_errors("[0.5, 0.5]") == ["p:1:1: expected 8 probabilities (one per expert), found 2"]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("[0.5 0.5]", "p:1:6: invalid JSON: Expecting ',' delimiter"),
        ("\n[0.5,\n  0.5\n", "p:4:1: invalid JSON: Expecting ',' delimiter"),
        ("[0.5, 0.5] 0.5", "p:1:12: invalid JSON: Extra data"),
        ("  [0.5, .5]", "p:1:9: invalid JSON: Expecting value"),
    ],
)
def test_probs_json_syntax_errors_where_json_reports_them(text, where):
    assert probs_errors(text) == [where]


def test_probs_json_errors_from_the_command_line(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text("[0.25, 0.25,\n 0.25 0.25]\n", encoding="utf-8")
    assert main(["plan", str(EX / "tiny.rdep"), "--probs", str(bad)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"{bad}:2:7: error: invalid JSON: Expecting ',' delimiter",
        "    2 |  0.25 0.25]",
        "      |       ^",
    ]
