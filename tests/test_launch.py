"""The interpreted launches: the concurrent interpreter's programs as threads, rewritten first,
stopped together; a dot's rows computed apart from each other, as on a GPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rdepc.toolchain import import_kernels
from runtime.launch import ConcurrentInterpreter, Launcher

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


@triton.jit
def tile_dot(a, b, c, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    x = tl.load(a + m[:, None] * K + k[None, :])
    y = tl.load(b + k[:, None] * N + n[None, :])
    tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y))
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


@pytest.mark.parametrize("launch", [Launcher, ConcurrentInterpreter])
def test_a_dots_row_does_not_depend_on_its_place_in_the_tile(kernels, launch):
    """A route row's GEMM is the same arithmetic in whichever m-tile, and at whichever place
    in it, a schedule or a replica of its expert puts it (BLAS kernels round a row by its
    place: OpenBLAS's on AMD Zen do)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g), torch.randn(64, 32, generator=g)
    order = torch.randperm(32, generator=g)
    c, shuffled = torch.empty(32, 32), torch.empty(32, 32)
    for x, out in ((a, c), (a[order].contiguous(), shuffled)):
        launch(True)([(kernels.tile_dot, (1,), (x, b, out), {"M": 32, "K": 64, "N": 32})])
    assert torch.equal(shuffled, c[order])
    assert torch.allclose(c, a @ b, rtol=1e-5, atol=1e-5)


def test_a_native_build_is_prepared_once_and_again_when_its_specialisation_changes():
    """Split mode loads every build before it launches any (a compile between two launches
    would hold the second back); after that Triton's own launch finds it, so a call does not
    pay for the lookup twice. A pointer that loses its 16-byte alignment, an integer that
    becomes 1, another constexpr: another build, prepared again."""
    prepared, launched = [], []

    class Recording(Launcher):
        prepare_always = True

        def _prepare(self, kernel, grid, args, meta):
            prepared.append(meta)

        def _one(self, kernel, grid, args, meta):
            launched.append(meta)

    launcher, kernel = Recording(interpret=False), object()
    base = torch.zeros(8, dtype=torch.int64)
    for args, meta in [
        ((base, 7), {"BM": 64}),
        ((base, 9), {"BM": 64}),  # another call, same build
        ((base[1:], 9), {"BM": 64}),  # 8 bytes in: not 16-byte aligned
        ((base, 1), {"BM": 64}),  # an integer of 1
        ((base, 7), {"BM": 128}),
        ((base, 23), {"BM": 128}),
    ]:
        launcher([(kernel, (1,), args, meta)])
    assert len(launched) == 6 and len(prepared) == 4
