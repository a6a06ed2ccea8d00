"""Golden files: the elaborated spec of every example, as ``rdepc compile`` writes it.

``pytest --update-golden`` rewrites tests/golden/<name>.json from the current compiler;
review the diff before committing it. Elaboration runs on the repo-relative path
("examples/x.rdep"), so the goldens do not depend on where the checkout lives.
"""

from __future__ import annotations

import difflib
import json

import pytest
from conftest import EXAMPLES, ROOT
from rdepc.passes.elaborate import elaborate

from rdepc.ir.spec import spec_to_json
from rdepc.parser import parse_file

GOLDEN = ROOT / "tests" / "golden"


def _elaborated(name: str, sympy: bool = True):
    module = parse_file(f"examples/{name}.rdep")
    specs, diags = elaborate(module, sympy=sympy)
    diags.check()
    assert [s.name for s in specs] == list(module.layer_names)
    return specs, diags


def _dump(data) -> str:
    return json.dumps(data, indent=2, sort_keys=False) + "\n"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_golden(example, monkeypatch, update_golden):
    monkeypatch.chdir(ROOT)
    (spec,), _ = _elaborated(example.stem)
    got = _dump(spec_to_json(spec))
    path = GOLDEN / f"{example.stem}.json"
    if update_golden:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got, encoding="utf-8")
        return
    assert path.is_file(), f"no golden for {example.name}: run pytest --update-golden"
    want = path.read_text(encoding="utf-8")
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(path), "now"))
        pytest.fail(f"{example.name} elaborates differently from its golden (pytest --update-golden):\n{diff}")


def test_every_golden_has_an_example():
    stale = {p.stem for p in GOLDEN.glob("*.json")} - {p.stem for p in EXAMPLES}
    assert not stale, f"goldens without an example: {sorted(stale)}"


def test_goldens_hold_repo_relative_paths():
    for path in GOLDEN.glob("*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["file"] == f"examples/{path.stem}.rdep"
        for p in data["params"].values():
            assert p["at"].startswith(f"examples/{path.stem}.rdep:")
        assert str(ROOT) not in path.read_text(encoding="utf-8")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_check_mode_agrees_with_golden(example, monkeypatch):
    """``rdepc check`` elaborates without sympy; it must reach the same numbers."""
    monkeypatch.chdir(ROOT)
    golden = json.loads((GOLDEN / f"{example.stem}.json").read_text(encoding="utf-8"))
    (spec,), _ = _elaborated(example.stem, sympy=False)
    sh = spec.shape
    got = {k: int(getattr(sh, k)) for k in ("W", "T", "H", "E", "K")}
    assert got == {k: golden["shape"][k] for k in got}
    assert int(spec.expert.F) == golden["expert"]["F"]
    assert list(spec.ownership.owner) == golden["ownership"]["owner"]
    assert list(spec.ownership.local) == golden["ownership"]["local"]
    assert [[v, int(c)] for v, c in spec.route_row.radix] == golden["route_row"]["radix"]
    assert list(spec.route_row.sideband) == golden["route_row"]["sideband"]
    assert spec.route_row.is_eq7 == golden["route_row"]["eq7"]
    assert spec.capacity.policy == golden["capacity"]["policy"]
    assert spec.schedule == golden["schedule"]
    assert spec.transport == golden["transport"]


def test_golden_values_match_the_papers_arithmetic(monkeypatch):
    """Spot checks of the goldens against numbers worked out by hand."""
    monkeypatch.chdir(ROOT)
    load = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in GOLDEN.glob("*.json")}
    moon = load["moonlight"]
    assert moon["shape"] == {"W": 8, "T": 4096, "T_bound": None, "H": 2048, "E": 64, "K": 6}
    assert moon["route_row"]["radix"] == [["slot", 1], ["token", 6], ["rank", 24576]]
    assert moon["route_row"]["eq7"] is True
    assert moon["route_row"]["sideband_bytes"] == 16
    assert moon["ownership"]["experts_per_rank"] == [8] * 8
    assert moon["shared"] == {"count": 2, "act": "swiglu", "F": 1408}
    nvl = load["nvl72_e128"]
    assert nvl["ownership"]["experts_per_rank"] == [2] * 56 + [1] * 16
    assert nvl["capacity"]["rows_per_expert"] == 17280  # ceil(1.25 * 72 * 4096 * 6 / 128)
    assert nvl["capacity"]["factor"] == "5/4"
    ds = load["deepseek_v3"]
    assert ds["precision"] == {"dtype": "bf16", "dispatch": "fp8_e4m3", "dispatch_scale": "row", "backward": "bf16"}
    assert ds["route_row"]["sideband"] == ["row_id", "local_expert", "gate", "scale"]
    assert ds["route_row"]["sideband_bytes"] == 20
    tiny = load["tiny"]
    assert tiny["capacity"]["rows_per_expert"] is None
    assert tiny["ownership"]["owner"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert tiny["ownership"]["local"] == [0, 1] * 4
