"""The interpreted launches: the concurrent interpreter's programs as threads, rewritten first,
stopped together; a dot's rows computed apart from each other, as on a GPU; overflow
checks only where a failure would be reported; operands' casts decided once per kind and
tensors' shapes shared, computing what the language does."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from conftest import HANG_S
from tolerance import assert_close, bound

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


@triton.jit
def tile_dot_acc(a, b, c, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    x = tl.load(a + m[:, None] * K + k[None, :])
    y = tl.load(b + k[:, None] * N + n[None, :])
    acc = tl.load(c + m[:, None] * N + n[None, :])
    tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y, acc))


@triton.jit
def times_four(x, out):
    tl.store(out, tl.load(x) * 4)


@triton.jit
def mixed(h, b, i, f, out_h, out_f, out_i, out_b):
    r = tl.arange(0, 4)
    x, y, n, z, w = tl.load(h + r), tl.load(h + 4 + r), tl.load(i + r), tl.load(f + r), tl.load(b + r)
    tl.store(out_h + r, x + y)  # one type: let through
    tl.store(out_f + r, (x / y) + (x % y) + (x + z) + (z < x) + (n + 3) + x * 0.5)  # fp16 / and %: fp32; mixed
    tl.store(out_f + 4 + r, (w * w) + (w / w) + (x * w))  # bf16 alone and with fp16
    acc = (n * n).to(tl.int32)
    for k in range(3):  # the same operations again: decided once; integers of three types and a scalar
        wide, big = (n.to(tl.int64) + 2**40) >> 38, n.to(tl.uint32) + 4000000000
        acc = acc + (n + 3) + (n - 5) + (-2 + n) + wide.to(tl.int32) + big.to(tl.int32) + (tl.program_id(0) + 1)
    tl.store(out_i + r, acc + (n // (n + 1)) + (n & 6))
    tl.store(out_b + r, (x < y) & (n > 2))


@triton.jit
def signed(f, out):
    r = tl.arange(0, 4)
    z = tl.load(f + r)
    for k in range(3):  # the same constants again: made once
        tl.store(out + r, tl.where(z < 0.5, -0.0, 0.0))
        tl.store(out + 4 + r, tl.where(z < 0.5, 0.0, -0.0) * (k + 1))
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch") / "handshake.py"
    path.write_text(KERNELS)
    return import_kernels(path, interpret=True)


def test_device_functions_are_rewritten_before_programs_start(kernels, monkeypatch):
    # CPython 3.11 cannot compile AST objects on two threads at once; the launch must
    # rewrite every device function on the calling thread (the interpreter's rewrite, or
    # one shared from equal code: runtime.interpreting.rewrites_shared).
    import rdepc.runtime.interpreting
    from triton.runtime.interpreter import FunctionRewriter, InterpretedFunction

    for f in (kernels.bump, kernels.wait_for):
        InterpretedFunction.rewritten_fn.pop(f.fn, None)
    threads: list[str] = []

    def spy(owner, name):
        real = getattr(owner, name)

        def spied(*args):
            threads.append(threading.current_thread().name)
            return real(*args)

        monkeypatch.setattr(owner, name, spied)

    spy(FunctionRewriter, "rewrite_ast")
    spy(rdepc.runtime.interpreting, "_define")
    flag, out = torch.zeros(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    ConcurrentInterpreter(True)([(kernels.handshake, (4,), (flag, out, 1 << 20), {"fail": False, "program_base": 0})])
    assert out.tolist() == [0, 1, 1, 1]
    assert len(threads) >= 2 and set(threads) == {threading.main_thread().name}


def test_concurrent_programs_give_up_the_gil_at_each_poll_and_only_there(kernels, monkeypatch):
    """Under the concurrent interpreter each atomic that adds nothing (a waiter's poll) gives
    up the GIL, and no other: three waiters poll at least once each, program 0's bump does
    not yield; one program after another (Triton's launch) nothing yields; after the launch
    the interpreter has its atomic back."""
    from triton.runtime.interpreter import InterpreterBuilder

    real, polls, sleep = InterpreterBuilder.create_atomic_rmw, [], time.sleep
    adds = []  # what each atomic added, seen under the replacement (which wraps this)

    def atomic(self, rmwOp, ptr, val, mask, sem, scope):
        adds.append(int(val.data.sum()))
        return real(self, rmwOp, ptr, val, mask, sem, scope)

    monkeypatch.setattr(InterpreterBuilder, "create_atomic_rmw", atomic)
    monkeypatch.setattr(time, "sleep", lambda s: (polls.append(s), sleep(s)))
    flag, out = torch.zeros(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    ConcurrentInterpreter(True)([(kernels.handshake, (4,), (flag, out, 1 << 20), {"fail": False, "program_base": 0})])
    assert out.tolist() == [0, 1, 1, 1] and flag.item() == 1
    assert adds.count(1) == 1 and len(polls) == adds.count(0) >= 3 and set(polls) == {0}  # the bump did not yield
    assert InterpreterBuilder.create_atomic_rmw is atomic
    polls.clear()
    flag.zero_(), out.zero_()
    Launcher(True)([(kernels.handshake, (4,), (flag, out, 1 << 20), {"fail": False, "program_base": 0})])
    assert out.tolist() == [0, 1, 1, 1] and polls == []


def test_a_failing_program_stops_its_waiting_peers(kernels):
    flag, out = torch.zeros(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    start = time.monotonic()
    with pytest.raises(Exception, match="program 0 fails"):
        # Without the stop, three programs would spin 2^30 times for a flag nobody bumps:
        # hours under the interpreter, so even HANG_S tells a stop from none.
        ConcurrentInterpreter(True)(
            [(kernels.handshake, (4,), (flag, out, 1 << 30), {"fail": True, "program_base": 0})]
        )
    assert time.monotonic() - start < HANG_S
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
    assert_close(c, a @ b, bound(torch.matmul, (a, b), 64 + 1), "c")  # a dot product over K = 64


@pytest.mark.parametrize("launch", [Launcher, ConcurrentInterpreter])
def test_a_dot_over_rows_that_overflow_warns_nothing_and_gives_inf(kernels, launch):
    """A tile's masked rows hold whatever their buffer held: accumulated over K, their sums may
    overflow fp32 (here 64 · 4.7e36 onto 3e38), silently (numpy would warn in the middle of a
    training loop); a row that overflows is inf in the result, where the caller sees it."""
    a, b = torch.ones(32, 64), torch.full((64, 32), 4.7e36)
    c = torch.full((32, 32), 3e38)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch(True)([(kernels.tile_dot_acc, (1,), (a, b, c), {"M": 32, "K": 64, "N": 32})])
    assert torch.isinf(c).all()


def test_a_native_build_is_prepared_once_and_launched_by_the_launcher():
    """Every native build is asked of Triton (``warmup``) once, before any kernel of the call
    launches (a compile between two launches would hold the second back); after that the
    launcher runs the build itself, passing what Triton's own launch passes it: the
    positional arguments, then the constexprs in parameter order (a default included), on a
    three-dimensional grid. A pointer that loses its 16-byte alignment, another dtype, an
    integer that becomes 1 or needs 64 bits, another constexpr: another build."""
    import contextvars

    import triton.language as tl

    prepared, launched = [], []

    class Compiled:
        def _init_handles(self):
            pass

        def __getitem__(self, grid):
            return lambda *args: launched.append((grid, args))

    class Kernel:  # Triton's JITFunction as the launcher reads it: the function and warmup
        @staticmethod
        def fn(ptr, n, BM: tl.constexpr, STAGES: tl.constexpr = 3):
            pass

        def warmup(self, *args, grid, **meta):
            prepared.append((args, meta))
            return Compiled()

    launcher, kernel = Launcher(interpret=False), Kernel()
    base = torch.zeros(8, dtype=torch.int64)
    calls = [
        ((base, 7), {"BM": 64, "num_warps": 8}),
        ((base, 9), {"BM": 64, "num_warps": 8}),  # another call, same build
        ((base[1:], 9), {"BM": 64, "num_warps": 8}),  # 8 bytes in: not 16-byte aligned
        ((base.view(torch.float64), 9), {"BM": 64, "num_warps": 8}),  # another dtype
        ((base, 1), {"BM": 64, "num_warps": 8}),  # an integer of 1
        ((base, 1 << 40), {"BM": 64, "num_warps": 8}),  # one of 64 bits
        ((base, 7), {"BM": 128, "num_warps": 8}),
        ((base, 23), {"BM": 128, "num_warps": 8}),
    ]
    for args, meta in calls:
        contextvars.Context().run(launcher, [(kernel, (2,), args, meta)])  # its scratch allocator: this call's
    assert len(prepared) == 6 and launcher.launches == 8
    assert [a for a, _ in prepared] == [c[0] for i, c in enumerate(calls) if i not in (1, 7)]
    assert launched == [((2, 1, 1), (*args, meta["BM"], 3)) for args, meta in calls]


@pytest.mark.parametrize("launch", [Launcher, ConcurrentInterpreter])
def test_overflow_checks_run_only_where_a_failure_would_be_reported(kernels, launch, monkeypatch):
    """The interpreter's int32 overflow checks end in a device assertion, which it drops
    without its debug option: a launch skips them (an int32 product wraps, as on a GPU,
    either way), runs them with debug on, and leaves the interpreter's options as they were."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    semantic, seen = type(interpreter.interpreter_semantic), []
    real = semantic.binary_op_sanitize_overflow_impl

    def spy(self, *args):  # each int32 +, -, *: whether its check runs
        seen.append(self.builder.options.sanitize_overflow)
        return real(self, *args)

    monkeypatch.setattr(semantic, "binary_op_sanitize_overflow_impl", spy)
    before = builder.options
    assert before.sanitize_overflow and not before.debug  # Triton's defaults, which the launch works around
    x, out = torch.tensor([1 << 30], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    launch(True)([(kernels.times_four, (1,), (x, out), {})])
    assert seen == [False] and out.item() == 0 and builder.options is before  # 2^32 wrapped
    monkeypatch.setattr(builder, "options", dataclasses.replace(before, debug=True))
    with pytest.raises(Exception, match="int32 overflow detected"):
        launch(True)([(kernels.times_four, (1,), (x, out), {})])
    assert seen == [False, True]


def test_numpy_dtypes_are_the_interpreters_own_and_its_function_is_restored():
    """A launch's numpy dtype of each Triton type (scalar, block, pointer, block of pointers)
    is what the interpreter's own function gives, asked once per type; after the launch the
    interpreter has its own function back."""
    import triton.language as tl
    from rdepc.runtime.interpreting import numpy_dtypes_looked_up
    from triton.runtime import interpreter

    original = interpreter._get_np_dtype
    kinds = [tl.float32, tl.bfloat16, tl.int1, tl.float8e4nv, tl.pointer_type(tl.float16)]
    kinds += [tl.block_type(tl.int32, [4, 8]), tl.block_type(tl.pointer_type(tl.int64), [2])]
    asked = []
    with numpy_dtypes_looked_up():
        table = interpreter._get_np_dtype
        assert table is not original
        for t in kinds * 2:
            asked.append(table(t))
    assert interpreter._get_np_dtype is original
    assert asked == [original(t) for t in kinds * 2]


def test_builtins_are_called_with_the_interpreters_semantic_and_its_patch_is_restored(kernels):
    """A builtin patched by a launch computes what the interpreter's patch computes, with a
    semantic of the interpreter's builder (the one its patch passes), whatever ``_semantic``
    the call gives, without the wrapper's check; a member that is no wrapper of the
    language's ``builtin`` is called as it is; after the launch the interpreter patches its
    own way again. (``kernels``: Triton imported interpreting.)"""
    import triton.language as tl
    from rdepc.runtime.interpreting import _Scope, builtins_called_directly
    from triton.runtime import interpreter

    seen = []

    def add(x, y=0, _semantic=None):
        seen.append(_semantic)
        return x + y

    wrapped, plain = tl.core.builtin(add), lambda x, _semantic=None: seen.append(_semantic) or -x
    original, builder = interpreter._patch_attr, interpreter.interpreter_builder
    theirs, ours = _Scope(), _Scope()
    with builtins_called_directly():
        assert interpreter._patch_attr is not original
        for member in (wrapped, plain):
            original(object, "f", member, builder, theirs)
            interpreter._patch_attr(object, "f", member, builder, ours)
            assert ours.value is not theirs.value and ours.value.__code__ is not theirs.value.__code__
            args = (5, 2) if member is wrapped else (5,)
            assert ours.value(*args) == theirs.value(*args) == ours.value(*args, _semantic=None)
            assert [type(s) for s in seen] == [type(seen[0])] * 3 and all(s.builder is builder for s in seen)
            seen.clear()
    assert interpreter._patch_attr is original
    with pytest.raises(ValueError, match="_semantic"):
        wrapped(1, 2)


def test_operand_checks_and_shared_shapes_compute_what_the_language_does(kernels, monkeypatch):
    """A launch decides a binary operation's casts and broadcasts once per kind of operands:
    two tensors let through unchecked only where the language returns them as they are (fp16
    and bf16 ``/`` and ``%`` still compute in fp32, mixed types are converted as the language
    does), a Python integer made in the type the language chose (int32, uint32 and int64
    constants, negative ones, beside a block and a scalar, again in a loop); and makes tensors
    and block types with shared shapes: every result equals the language's own, fewer
    operations reach its type checks (with an integer too), no tensor and fewer block types
    are made its way, and its functions are back after."""
    import contextlib

    import rdepc.runtime.interpreting
    import triton.language as tl
    from triton.language import semantic

    g = torch.Generator().manual_seed(0)
    h = torch.rand(8, generator=g).add(0.5).half()
    args = (h, torch.rand(4, generator=g).add(0.5).bfloat16(), torch.arange(1, 9, 2, dtype=torch.int8))
    args += (torch.rand(4, generator=g),)
    checks, made = semantic.TritonSemantic.binary_op_type_checking_impl, tl.core.tensor.__init__
    typed = tl.block_type.__init__
    counts = []

    def checked(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        counts[-1][0] += 1
        counts[-1][2] += type(rhs) is int
        return checks(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    def init(self, handle, type):
        counts[-1][1] += 1
        made(self, handle, type)

    def block(self, element_ty, shape):
        counts[-1][3] += 1
        typed(self, element_ty, shape)

    monkeypatch.setattr(semantic.TritonSemantic, "binary_op_type_checking_impl", checked)
    monkeypatch.setattr(tl.core.tensor, "__init__", init)
    monkeypatch.setattr(tl.block_type, "__init__", block)

    def run():
        outs = torch.zeros(4, dtype=torch.float16), torch.zeros(8), torch.zeros(4, dtype=torch.int32), torch.zeros(4)
        counts.append([0, 0, 0, 0])
        Launcher(True)([(kernels.mixed, (1,), (*args, *outs), {})])
        assert semantic.TritonSemantic.binary_op_type_checking_impl is checked and tl.core.tensor.__init__ is init
        assert tl.block_type.__init__ is block
        return outs

    ours = run()
    with monkeypatch.context() as m:
        m.setattr(rdepc.runtime.interpreting, "operand_checks_remembered", contextlib.nullcontext)
        m.setattr(rdepc.runtime.interpreting, "tensor_shapes_shared", contextlib.nullcontext)
        m.setattr(rdepc.runtime.interpreting, "block_types_shared", contextlib.nullcontext)
        m.setattr(rdepc.runtime.interpreting, "builtins_called_directly", contextlib.nullcontext)
        theirs = run()
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, theirs, strict=True))
    assert ours[1].abs().sum() > 0 and ours[3].sum() > 0 and ours[2].abs().sum() > 0
    (checked_ours, made_ours, ints_ours, blocks_ours), (checked_theirs, made_theirs, ints_theirs, blocks_theirs) = (
        counts
    )
    assert 0 < checked_ours < checked_theirs  # the first of each kind decided by the language
    assert 0 < ints_ours < ints_theirs
    assert 0 < blocks_ours < blocks_theirs  # the first of each element type and shape made by the language
    assert made_ours == 2 < made_theirs  # the two tensors that compare the ways of making one


def test_constants_are_made_once_and_hold_the_languages_bits(kernels, monkeypatch):
    """A launch makes a constant of one value and type once (``constants_shared``): the
    results equal the language's bit for bit (-0.0 and 0.0 as this Triton makes them: 3.6
    makes both +0.0, 3.9 keeps the sign), and fewer constants reach the language's own
    function."""
    import contextlib

    import rdepc.runtime.interpreting
    from triton.language import semantic

    made, counts = semantic.TritonSemantic.scalar_constant, []

    def scalar_constant(self, value, dtype):
        counts[-1] += 1
        return made(self, value, dtype)

    monkeypatch.setattr(semantic.TritonSemantic, "scalar_constant", scalar_constant)
    f = torch.tensor([0.25, 0.75, -1.0, 2.0])

    def run():
        out = torch.full((8,), 7.0)
        counts.append(0)
        Launcher(True)([(kernels.signed, (1,), (f, out), {})])
        assert semantic.TritonSemantic.scalar_constant is scalar_constant
        return out

    ours = run(), run()  # the first launch compares the two ways of making a constant (once a process)
    with monkeypatch.context() as m:
        m.setattr(rdepc.runtime.interpreting, "constants_shared", contextlib.nullcontext)
        theirs = run()
    assert all(o.view(torch.int32).tolist() == theirs.view(torch.int32).tolist() for o in ours)
    assert theirs.abs().tolist() == [0.0] * 8
    assert 0 < counts[1] < counts[2]


SHARED = """
import triton
import triton.language as tl

SCALE = {scale}


@triton.jit
def scaled(x, n: tl.constexpr = {n}):
    return x * SCALE * n


@triton.jit
def times(x_ptr, out_ptr):
    offs = tl.arange(0, 4)
    tl.store(out_ptr + offs, scaled(tl.load(x_ptr + offs)))
"""


def test_functions_of_equal_code_share_a_rewrite_in_their_own_module(tmp_path, monkeypatch):
    """A kernel file elsewhere whose functions' code equals one launched before takes their
    rewrites, compiled once, with its own constants; a function whose default differs is
    the interpreter's own rewrite; after the launch the interpreter has its rewriter back."""
    files = []
    for i, (scale, n) in enumerate([(2, 1), (3, 1), (3, 5)]):
        path = tmp_path / f"shared_{i}.py"
        path.write_text(SHARED.format(scale=scale, n=n), encoding="utf-8")
        files.append(import_kernels(path, interpret=True))
    import rdepc.runtime.interpreting  # after the kernels: Triton is imported interpreting
    from triton.runtime import interpreter

    compiled, own = [], interpreter.FunctionRewriter.rewrite_ast
    real = rdepc.runtime.interpreting._rewrite
    monkeypatch.setattr(rdepc.runtime.interpreting, "_rewrite", lambda rw: compiled.append(rw.fn.__name__) or real(rw))
    x, outs = torch.arange(1.0, 5.0), []
    for module in files:
        outs.append(torch.zeros(4))
        Launcher(True)([(module.times, (1,), (x, outs[-1]), {})])
        assert interpreter.FunctionRewriter.rewrite_ast is own
    assert [o.tolist() for o in outs] == [(x * 2).tolist(), (x * 3).tolist(), (x * 15).tolist()]
    assert compiled == ["times", "scaled"]  # the first file's; the last file's scaled: the interpreter's
