"""What the planner's tests share: ``rdepc plan`` run as a user runs it, a spec file written
from a body, and moonlight's plan."""

from __future__ import annotations

import functools
import json

from conftest import ROOT
from rdepc.passes.plan import plan
from rdepc.passes.plan_records import PlanOptions, to_json

import rdepc
from rdepc.cli import main

EX = ROOT / "examples"
GIB = 2**30
TINY_SHAPE = "shape ranks W, tokens T, hidden 64, experts 8, top 2\nexpert swiglu(ffn = 128)\ndtype fp32"


def run_json(capsys, *args: str) -> dict:
    assert main(["plan", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_text(capsys, *args: str) -> str:
    assert main(["plan", *map(str, args)]) == 0
    return capsys.readouterr().out


def write_spec(tmp_path, body: str, params: str = "param W = 4\nparam T = 16\n", name: str = "t") -> str:
    path = tmp_path / f"{name}.rdep"
    path.write_text(params + "layer " + name + " {\n" + body + "\n}\n", encoding="utf-8")
    return str(path)


def close(x: float, y: float, rel: float) -> bool:
    return abs(x - y) <= rel * abs(y)


@functools.cache
def moonlight_plan() -> dict:
    """moonlight's plan on a B200, as JSON (read, never changed, by the tests that share it)."""
    return to_json(plan(rdepc.load(EX / "moonlight.rdep").spec, PlanOptions(hw="b200")))
