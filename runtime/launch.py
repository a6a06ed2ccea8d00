"""Launch: counting launches, Triton's scratch allocator, and the interpreter's threads.

Generated kernels are imported by :func:`rdepc.toolchain.import_kernels`.
"""

from __future__ import annotations

import inspect
import threading

from rdepc.runtime.interpreting import interpreting, polls_yield


class Launcher:
    """Launches a call's kernels, counting them: per call the host launches a fixed number of
    kernels (unified mode one, split mode two, phased mode three one at a time) and runs no
    torch op on the heap between launches. Tests wrap it.

    A call is a list of launches, (kernel, grid, args, meta) each, whose programs must all
    run at once when there are several (split mode's transport and GEMM kernels wait on
    each other). Natively every kernel is built and loaded first — CUDA may load a module
    only once the kernels already running have finished (lazy loading), which would keep
    the second kernel from starting while the first waits for it — then the first goes on
    the current stream and each other on a side stream forked from it and joined back after
    it: the work after the call waits for all of them, and a CUDA graph captures the fork
    and the join.

    A native launch asks Triton for its build once (:func:`prepared_key` names it) and then
    launches that build itself (:class:`Build`): Triton's own launch would bind the
    arguments, key its cache and compare every global constant the kernel reads (152 for
    moonlight's transport kernel) again at every call.

    An interpreted launch runs with TRITON_INTERPRET=1 set for its duration: Triton reads
    it again at launch (its first interpreted launch imports more of itself)."""

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.launches = 0
        self._sides: dict = {}  # device -> the side streams of this launcher
        self._builds: dict = {}  # prepared_key -> Build: what a native launch runs

    def __call__(self, launches: list[tuple]) -> None:
        if self.interpret:
            if len(launches) > 1:
                raise ValueError("the Triton interpreter runs launches one after another: concurrent ones need "
                                 "ConcurrentInterpreter")  # fmt: skip
            self.launches += 1
            kernel, grid, args, meta = launches[0]
            with interpreting():
                kernel[grid](*args, **meta)
            return
        scratch_allocator()
        # every kernel built and loaded before any is launched: a JIT compile, or a module
        # load (which may wait for the kernels running: CUDA's lazy loading), between two
        # launches would hold back the second kernel while the first spins on its flags
        builds = [self._build(*launch) for launch in launches]
        if len(launches) == 1:
            self._one(builds[0], launches[0][1], launches[0][2])
            return
        import torch

        main = torch.cuda.current_stream()
        sides = self._side_streams(main.device, len(launches) - 1)
        for side in sides:
            side.wait_stream(main)
        self._one(builds[0], launches[0][1], launches[0][2])
        for side, build, launch in zip(sides, builds[1:], launches[1:], strict=True):
            with torch.cuda.stream(side):
                self._one(build, launch[1], launch[2])
        for side in sides:
            main.wait_stream(side)

    def _build(self, kernel, grid: tuple[int, ...], args: tuple, meta: dict) -> Build:
        """The build a launch runs: Triton's, asked for once per :func:`prepared_key`."""
        key = prepared_key(kernel, grid, args, meta)
        build = self._builds.get(key)
        if build is None:
            build = self._builds[key] = Build(
                self._prepare(kernel, grid, args, meta), constexpr_tail(kernel, args, meta)
            )
        return build

    def _prepare(self, kernel, grid: tuple[int, ...], args: tuple, meta: dict):
        """Build ``kernel`` for this launch's arguments (a lookup once it is in Triton's cache),
        load it into the CUDA context and return it (Triton's ``CompiledKernel``)."""
        compiled = kernel.warmup(*args, grid=grid, **meta)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # async compile mode
        compiled._init_handles()  # cuModuleLoadData, the function's attributes: loaded now, not at launch
        return compiled

    def _one(self, build: Build, grid: tuple[int, ...], args: tuple) -> None:
        self.launches += 1
        build.launch(grid, args)

    def _side_streams(self, device, n: int) -> list:
        import torch

        have = self._sides.setdefault(device, [])
        while len(have) < n:
            have.append(torch.cuda.Stream(device=device))
        return have[:n]


class Build:
    """A native build and the values its launch passes after the call's positional
    arguments: the constexprs, in the kernel's parameter order (what Triton's launch passes
    its build, ``bound_args.values()``, in Triton 3.6 as in 3.9)."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled, tail: tuple):
        self.compiled = compiled
        self.tail = tail

    def launch(self, grid: tuple[int, ...], args: tuple) -> None:
        g = (*grid, 1, 1)[:3]
        self.compiled[g](*args, *self.tail)


def constexpr_tail(kernel, args: tuple, meta: dict) -> tuple:
    """The values a launch of ``kernel`` binds after ``args`` (given positionally): its
    remaining parameters — the constexprs — from ``meta`` or their defaults, in parameter
    order; ``meta``'s other keys (``num_warps``, ...) are options. A TypeError when they do
    not bind (a parameter missing, or given twice)."""
    import inspect

    sig = inspect.signature(kernel.fn)
    bound = sig.bind(*args, **{k: v for k, v in meta.items() if k in sig.parameters})
    bound.apply_defaults()
    return tuple(bound.arguments.values())[len(args) :]


def prepared_key(kernel, grid: tuple[int, ...], args: tuple, meta: dict) -> tuple:
    """What picks the build a native launch runs: the kernel (held: its id alone could be
    reused), its constexprs and options, the device, and what Triton specialises a launch on
    besides — each tensor's dtype and 16-byte alignment, each integer's type (bool, or the
    32 or 64 bits its value needs) and its being 1 or a multiple of 16 (the layer's kernels
    take theirs unspecialised, ``do_not_specialize``)."""
    import torch

    special = tuple(
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else _int_kind(a)
        for a in args
        if isinstance(a, torch.Tensor | int)
    )
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return kernel, tuple(meta.items()), device, special


def _int_kind(a: int) -> tuple:
    """What Triton's launch reads of an integer argument: bool or an integer of 32 bits, or
    of 64 signed or unsigned, and whether it is 1 or a multiple of 16."""
    bits = "u1" if isinstance(a, bool) else "i32" if -(1 << 31) <= a < 1 << 31 else "u64" if a >= 1 << 63 else "i64"
    return bits, a == 1, a % 16 == 0


def _scratch(size: int, alignment: int, stream):
    import torch

    return torch.empty(size, dtype=torch.uint8, device="cuda")


def scratch_allocator() -> None:
    """Give Triton an allocator for the global scratch of native launches, unless the
    program set its own: tensor descriptors made on the device (the GEMMs' TMA operands)
    live there. Memory comes from torch's caching allocator on the current device and
    stream (no synchronization; CUDA-graph capture takes it from the graph's pool)."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        _allocation.set_allocator(_scratch)


def rewrite_callees(fn) -> None:
    """Rewrite, on this thread, every interpreted device function that ``fn`` reaches.

    The interpreter rewrites a ``@jit`` function's AST on its first call. Programs running
    as threads would do that concurrently, and CPython 3.11's ``compile`` of an AST object
    is not thread-safe (``SystemError: AST constructor recursion depth mismatch``): so every
    callee, through globals and through module attributes, is rewritten before they start."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[int] = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        names = _code_names(f.__code__)
        for value in (f.__globals__.get(n) for n in names):
            found = [value]
            if inspect.ismodule(value):
                found = [getattr(value, n, None) for n in names]
            for callee in found:
                if isinstance(callee, InterpretedFunction) and id(callee.fn) not in seen:
                    callee.rewrite()
                    todo.append(callee.fn)


def _code_names(code) -> set[str]:
    """The global and attribute names ``code`` and the code objects nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


class _Stopped(BaseException):
    """Raised into the programs still running when one failed: the launch has failed
    already, and their waits would otherwise run out their whole spin bound."""


def stop(threads: list[threading.Thread]) -> None:
    """Raise :class:`_Stopped` in each of ``threads`` at its next bytecode."""
    import ctypes

    for t in threads:
        if t.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(_Stopped))


class ConcurrentInterpreter(Launcher):
    """Runs a call's interpreted launches with all their programs concurrent: one Python
    thread per program, all started together, instead of the interpreter's one launch and
    one program after another. What split mode needs on a CPU: a GEMM program waiting on
    the transport kernel must not hold the only turn. Each thread runs its kernel as
    program 0 of a grid of 1, with ``program_base`` = its index among its kernel's programs
    where the kernel takes one (``rdep_gemm`` finds its items by it; ``rdep_layer`` takes
    tickets). The threads interleave preemptively under the GIL, a waiter giving it up at
    each poll (``polls_yield``); the interpreter's atomics are single C++ calls under the
    GIL, so they stay atomic.

    It drives the interpreter's own pieces (``GridExecutor``'s argument copies, the language
    patch, ``interpreter_builder``), as Triton 3.6 defines them; another Triton fails with a
    clear error rather than running programs one at a time."""

    def __call__(self, launches: list[tuple]) -> None:
        try:
            from triton.runtime import interpreter
            from triton.runtime.interpreter import GridExecutor, _implicit_cvt, interpreter_builder
        except ImportError as e:  # pragma: no cover - Triton is pinned
            raise RuntimeError(f"rdepc: concurrent interpreted programs need Triton 3.6's interpreter: {e}") from e
        self.launches += len(launches)
        with interpreting(), polls_yield():
            prepared, scopes, threads, errors = [], [], [], []
            try:
                for kernel, grid, args, meta in launches:
                    fn = kernel.rewrite()
                    rewrite_callees(kernel.fn)
                    executor = GridExecutor(fn, kernel.arg_names, (1,), [])
                    host_args, host_meta = executor._init_args_hst(args, meta)
                    scopes.append(interpreter._patch_lang(fn))
                    call = inspect.getcallargs(fn, *host_args, **host_meta)
                    given = {n: a if n in executor.constexprs else _implicit_cvt(a) for n, a in call.items()}
                    prepared.append((executor, args, host_args, meta, host_meta))
                    numbered = "program_base" in given
                    for i in range(grid[0]):
                        mine = given | {"program_base": _implicit_cvt(i)} if numbered else given
                        name = f"{kernel.fn.__name__} program {i}"
                        threads.append(
                            threading.Thread(target=_program, args=(fn, mine, errors), name=name, daemon=True)
                        )
                interpreter_builder.set_grid_dim(1, 1, 1)
                interpreter_builder.set_grid_idx(0, 0, 0)
                for t in threads:
                    t.start()
                stopped = False
                while alive := [t for t in threads if t.is_alive()]:
                    if errors and not stopped:
                        stop(alive)
                        stopped = True
                    alive[0].join(0.01)
                if errors:
                    raise errors[0]
            finally:
                for scope in reversed(scopes):
                    scope.restore()
            for executor, args, host_args, meta, host_meta in prepared:
                executor._restore_args_dev(args, host_args, meta, host_meta)


def _program(fn, given: dict, errors: list) -> None:
    """One interpreted program of a concurrent launch; its error is re-raised on the host."""
    try:
        fn(**given)
    except _Stopped:
        pass
    except BaseException as e:
        errors.append(e)


__all__ = ["ConcurrentInterpreter", "Launcher"]
