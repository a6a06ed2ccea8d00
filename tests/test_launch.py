"""The concurrent interpreter: programs as threads, rewritten first, stopped together."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rdepc.toolchain import import_kernels
from runtime.launch import ConcurrentInterpreter

KERNELS = """
import triton
import triton.language as tl


@triton.jit
def bump(flag):
    tl.atomic_add(flag, 1, sem="release")


@triton.jit
def wait_for(flag, target, bound):
    seen = tl.atomic_add(flag, 0, sem="acquire")
    spins = 0
    while (seen < target) & (spins < bound):
        seen = tl.atomic_add(flag, 0, sem="acquire")
        spins += 1
    return seen


@triton.jit
def handshake(flag, out, bound, fail: tl.constexpr, program_base):
    i = program_base + tl.program_id(0)
    if i == 0:
        if fail:
            tl.static_assert(False, "program 0 fails")
        bump(flag)
    else:
        tl.store(out + i, wait_for(flag, 1, bound))
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch") / "handshake.py"
    path.write_text(KERNELS)
    return import_kernels(path, interpret=True)


def test_device_functions_are_rewritten_before_programs_start(kernels, monkeypatch):
    # CPython 3.11 cannot compile AST objects on two threads at once; the launch must
    # rewrite every device function on the calling thread.
    from triton.runtime.interpreter import FunctionRewriter, InterpretedFunction

    for f in (kernels.bump, kernels.wait_for):
        InterpretedFunction.rewritten_fn.pop(f.fn, None)
    threads: list[str] = []
    real = FunctionRewriter.rewrite_ast

    def spy(self):
        threads.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(FunctionRewriter, "rewrite_ast", spy)
    flag, out = torch.zeros(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    ConcurrentInterpreter(True)([(kernels.handshake, (4,), (flag, out, 1 << 20), {"fail": False, "program_base": 0})])
    assert out.tolist() == [0, 1, 1, 1]
    assert len(threads) >= 2 and set(threads) == {threading.main_thread().name}


def test_a_failing_program_stops_its_waiting_peers(kernels):
    flag, out = torch.zeros(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    start = time.monotonic()
    with pytest.raises(Exception, match="program 0 fails"):
        # Without the stop, three programs would spin 2^30 times for a flag nobody bumps.
        ConcurrentInterpreter(True)(
            [(kernels.handshake, (4,), (flag, out, 1 << 30), {"fail": True, "program_base": 0})]
        )
    assert time.monotonic() - start < 30
    assert not [t for t in threading.enumerate() if t.daemon and t.is_alive() and " program " in t.name]
