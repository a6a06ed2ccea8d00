"""Stand-ins for the constants the emitter writes at the top of every generated kernel file
(:data:`rdepc.ir.interface.CONSTANTS`): the layer's sizes, the spec's choices, the symmetric
heap's byte offsets, and the encodings the kernel shares with its host side (task kinds,
table columns, control block words, error codes, statistics columns).

Device modules import the names they read from here, so that they import and their
functions run alone under the interpreter; the emitter copies only their functions, which
then read the generated file's own values. The values here are the table's for a small
layer: examples/tiny.rdep as compile plans it, whose contract is ``stand_in.json`` beside
this file (tests/test_interface.py holds that it still gives tiny's values). A constant
added to the table is a stand-in here with no other edit.
"""

from pathlib import Path

import triton.language as tl

from rdepc.ir.contract import KernelContract
from rdepc.ir.interface import Tl, constant_values

STAND_IN = KernelContract.from_json(Path(__file__).with_name("stand_in.json").read_text(encoding="utf-8"))


def _constexpr(value) -> tl.constexpr:
    return tl.constexpr(getattr(tl, value.name) if isinstance(value, Tl) else value)


globals().update({name: _constexpr(value) for name, value, _ in constant_values(STAND_IN)})
