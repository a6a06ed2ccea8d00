"""A layer and a call for the runtime's tests: the spec's sizes and policies, the routing and
the tiles (tests/test_runtime*.py)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_cases import layer_text

from rdepc.api import load_text
from rdepc.ir.contract import Tiles

BIG = Tiles(bm=64, block_h=64, block_f=64, block_r=64)
SMALL = Tiles(bm=32, block_h=32, block_f=32, block_r=16, rows_per_item=16)  # several items per transfer


@dataclass(frozen=True)
class Run:
    """One layer and one call: the spec's sizes and policies, the routing and the tiles."""

    W: int
    E: int
    K: int
    T: int
    tokens: int | None = None  # T' (default T)
    H: int = 32
    F: int = 32
    capacity: str = "dropless"
    owner: str = "balanced"
    act: str = "swiglu"
    dtype: str = "fp32"
    routing: str = "uniform"
    seed: int = 0
    tiles: Tiles = BIG
    programs: int = 2

    def text(self) -> str:
        return layer_text(self, schedule="bulk")

    def spec(self):
        return load_text(self.text(), file="run.rdep").spec
