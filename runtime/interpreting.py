"""What every interpreted launch runs under (:func:`interpreting`): Triton's interpreter with
replacements that compute what it computes, each in place for the launch's duration only.

Each replacement is checked against the interpreter it replaces where that can be done
before use, and an interpreter whose functions differ in shape from those it was written
for is left alone: every replacement is a speed-up, never a change of result.
"""

from __future__ import annotations
import __future__

import contextlib
import dataclasses
import inspect
import math
import types

from rdepc.toolchain import interpreter_env


class _Kept:
    """The scope of a language patch that was already in place: nothing to restore."""

    def restore(self) -> None:
        pass


def language_patched_once():
    """For the duration of an interpreted launch, an interpreted device function's call
    skips the interpreter's language patch when the launch has made it already. The
    interpreter patches ``triton.language`` at every device-function call (a scan of the
    language's modules with ``inspect.getmembers``): about a third of an interpreted
    call's time, for a patch that finds every builtin patched and changes nothing. A
    function whose module sees a language object the launch did not patch is patched as
    before; an interpreter without ``_patch_lang`` is left alone."""
    import triton.language as tl
    from triton.runtime import interpreter

    def make(original):
        langs_of: dict = {}

        def patch(fn):
            langs = langs_of.get(fn)
            if langs is None:
                langs = langs_of[fn] = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
            if langs and not any(tl.core.is_builtin(lang.program_id) for lang in langs):
                return _Kept()
            return original(fn)

        return patch

    return _replaced(interpreter, "_patch_lang", make)


_RMW_PARAMS = ["self", "rmwOp", "ptr", "val", "mask", "sem", "scope"]
_PATCH_PARAMS = ["obj", "name", "member", "builder", "scope"]


def polls_yield():
    """For the duration of a launch whose programs are threads
    (``runtime.launch.ConcurrentInterpreter``), an atomic that adds nothing (a flag read:
    what every wait spins on) gives up the GIL after it. A program spinning on a flag holds
    the GIL as long as one doing work, so the work got 1/N of the CPU among N threads: tiny
    in split mode took 3.3 s a forward, 1.1 s with this; moonlight at T=8, H=64, F=64, 28 s
    and 5.0 s. Threads interleave preemptively at any bytecode already: a switch there is
    one more interleaving, the result the same. An interpreter whose atomic takes other
    parameters is left alone."""
    import time

    from triton.runtime import interpreter

    def make(original):
        if list(inspect.signature(original).parameters) != _RMW_PARAMS:
            return None

        def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
            out = original(self, rmwOp, ptr, val, mask, sem, scope)
            if not val.data.any():
                time.sleep(0)
            return out

        return create_atomic_rmw

    return _replaced(getattr(interpreter, "InterpreterBuilder", None), "create_atomic_rmw", make)


class _Scope:
    """A language patch scope that records what it is asked to set and sets nothing."""

    def set_attr(self, obj, name, value) -> None:
        self.value = value


def builtins_called_directly():
    """For the duration of an interpreted launch, a patched builtin of the language calls
    the builtin's own function with the interpreter's semantic. The interpreter patches each
    builtin (``tl.load``, a tensor's ``__add__``, ...) with a function that copies its
    keyword arguments without ``_semantic`` into a new dict, then calls the builtin's
    wrapper, which checks ``_semantic`` is given and calls the function: two calls and a
    dict for each operation, about a tenth of an interpreted launch's time. Ours sets
    ``_semantic`` in the keyword arguments the call made for it, to the very semantic the
    interpreter's patch passes (asked of it at each patch), and calls the function the
    language's ``builtin`` wrapped, whose check passes; a builtin wrapped otherwise is
    called as it is. An interpreter whose ``_patch_attr`` takes other parameters is left alone."""
    import triton.language as tl
    from triton.runtime import interpreter

    wrapper = getattr(tl.core.builtin(lambda _semantic=None: None), "__code__", None)

    def make(original):
        if list(inspect.signature(original).parameters) != _PATCH_PARAMS:
            return None

        def patch_attr(obj, name, member, builder, scope):
            probe, seen = _Scope(), []
            original(obj, name, lambda **kw: seen.append(kw), builder, probe)
            probe.value()  # the interpreter's patch, called once: the semantic it passes
            if len(seen) != 1 or set(seen[0]) != {"_semantic"}:
                return original(obj, name, member, builder, scope)
            semantic = seen[0]["_semantic"]
            own = getattr(member, "__code__", None) is wrapper and semantic is not None
            fn = member.__wrapped__ if own else member

            def patched(*args, **kwargs):
                kwargs["_semantic"] = semantic
                return fn(*args, **kwargs)

            scope.set_attr(obj, name, patched)

        return patch_attr

    return _replaced(interpreter, "_patch_attr", make)


@contextlib.contextmanager
def interpreting():
    """What every interpreted launch runs under: TRITON_INTERPRET=1, the language patched
    once (:func:`language_patched_once`), its builtins called directly
    (:func:`builtins_called_directly`), a dot by rows (:func:`dot_by_rows`), no overflow
    checks whose failure nothing would report (:func:`overflow_checks_as_reported`), numpy
    dtypes looked up (:func:`numpy_dtypes_looked_up`), operands' casts decided once per kind
    (:func:`operand_checks_remembered`), tensors' shapes shared (:func:`tensor_shapes_shared`),
    block types' too (:func:`block_types_shared`), constants made once
    (:func:`constants_shared`) and device functions' rewrites (:func:`rewrites_shared`)."""
    with (
        interpreter_env(True),
        language_patched_once(),
        builtins_called_directly(),
        dot_by_rows(),
        overflow_checks_as_reported(),
        numpy_dtypes_looked_up(),
        operand_checks_remembered(),
        tensor_shapes_shared(),
        block_types_shared(),
        constants_shared(),
        rewrites_shared(),
    ):
        yield


def constants_shared():
    """For the duration of an interpreted launch, a constant of one value and type is made
    once: the language makes a scalar tensor for every Python number an operation meets
    (``i + 1``, ``tl.load(p, other=0.0)``, a ``tl.constexpr`` operand: a twelfth of an
    interpreted launch's time), each holding a fresh one-element array that no operation
    changes in place (the interpreter's only in-place update, a block pointer's advance,
    adds to copies of its offsets). The first of each value and type is the language's own;
    a number that is not equal to itself (NaN) is made every time, and -0.0 apart from 0.0.
    A language whose constants, made this way, differ from its own is left alone."""
    import triton.language as tl
    from triton.language import semantic

    def make(original):
        table: dict = {}

        def scalar_constant(self, value, dtype):
            if type(dtype) is not tl.dtype or value != value:  # pointers, NaN: as the language does
                return original(self, value, dtype)
            key = (self, type(value), value.hex() if type(value) is float else value, dtype.name)  # -0.0 apart
            found = table.get(key)
            if found is None:
                found = table[key] = original(self, value, dtype)
            return found

        alike = _CONSTANTS_ALIKE.get(original)
        if alike is None:
            alike = _CONSTANTS_ALIKE[original] = _constants_alike(original, scalar_constant)
        return scalar_constant if alike else None

    return _replaced(getattr(semantic, "TritonSemantic", None), "scalar_constant", make)


_CONSTANTS_ALIKE: dict = {}  # the language's scalar_constant -> whether constants_shared's are alike (asked once)


def _constants_alike(original, ours) -> bool:
    """Whether ``ours`` gives the constants ``original`` gives (a value and type, from a fresh
    table: the language's; then found in it), under the interpreter's semantic."""
    import triton.language as tl
    from triton.runtime import interpreter

    semantic = getattr(interpreter, "interpreter_semantic", None)
    if semantic is None:
        return False
    cases = [(0, tl.int32), (-3, tl.int32), (2**31 + 1, tl.uint32), (-(2**40), tl.int64), (0.0, tl.float32)]
    cases += [(-0.0, tl.float32), (0, tl.float32)]
    cases += [(1.5, tl.float32), (True, tl.int1), (7, tl.int64)]
    return all(_same(ours(semantic, value, dtype), original(semantic, value, dtype)) for value, dtype in cases + cases)


def tensor_shapes_shared():
    """For the duration of an interpreted launch, a ``tl.tensor`` takes its ``shape`` and
    ``numel`` from a table, one entry per shape, instead of building them: the language
    builds, for every tensor an operation makes, a ``tl.tuple`` of ``constexpr`` and a tuple
    type whose name formats each of them (a fifth of an interpreted launch's time), values
    that every tensor of one shape holds alike and nothing changes in place. A language
    whose tensors, made this way, differ from its own is left alone."""
    import triton.language as tl

    tensor = tl.core.tensor

    def make(original):
        table: dict = {}

        def init(self, handle, type):
            self.handle = handle
            self.type = type
            self.dtype = type.scalar
            block = type.is_block()
            key = type.name if block else ""  # a name, not the shape: a tl.tuple compares slowly
            found = table.get(key)
            if found is None:
                shape = type.shape if block else ()
                found = table[key] = (tl.constexpr(math.prod(shape)), tl.core.tuple([tl.constexpr(s) for s in shape]))
            self.numel, self.shape = found

        cases = [(None, tl.block_type(tl.float32, [2, 4])), (None, tl.int32)]
        return init if _made_alike(tensor, original, init, cases) else None

    return _replaced(tensor, "__init__", make)


def block_types_shared():
    """For the duration of an interpreted launch, a ``tl.block_type`` of an element type and
    shape made before takes its ``shape``, ``numel`` and ``name`` from a table: the language
    builds, for every block type (every splat, broadcast, load, ...), a ``tl.tuple`` of its
    shape, checks it and formats its name, values that every block type of one element type
    and shape holds alike and nothing changes in place. A language whose block types, made
    this way, differ from its own is left alone."""
    import triton.language as tl

    block, constexpr = tl.block_type, tl.constexpr

    def make(original):
        table: dict = {}

        def init(self, element_ty, shape):
            key = (element_ty.name, getattr(element_ty, "address_space", None))
            key += tuple(s.value if type(s) is constexpr else s for s in shape)
            found = table.get(key)
            if found is None:
                original(self, element_ty, shape)
                table[key] = (self.shape, self.numel, self.name)
                return
            self.element_ty = element_ty
            self.shape, self.numel, self.name = found

        cases = [(tl.float32, [2, 4]), (tl.pointer_type(tl.int8), [4]), (tl.int32, [constexpr(8)])]
        return init if _made_alike(block, original, init, cases + cases) else None  # twice: made, then found

    return _replaced(block, "__init__", make)


def _made_alike(cls, original, init, cases) -> bool:
    """Whether ``init`` makes an object of ``cls`` from each of ``cases`` (arguments) as ``original`` does."""
    for args in cases:
        ours, theirs = object.__new__(cls), object.__new__(cls)
        init(ours, *args)
        original(theirs, *args)
        if vars(ours).keys() != vars(theirs).keys():
            return False
        if any(repr(getattr(ours, k)) != repr(getattr(theirs, k)) for k in vars(theirs)):
            return False
    return True


_CHECK_PARAMS = ["self", "lhs", "rhs", "allow_lhs_ptr", "allow_rhs_ptr", "arithmetic_check", "div_or_mod"]


def operand_checks_remembered():
    """For the duration of an interpreted launch, the language's implicit casts and
    broadcasts of a binary operation's operands are decided once per kind of operands. Every
    ``+``, ``<``, ``&`` ... first converts its operands to their computation type and
    broadcasts their shapes, a decision of the two types and the operation's flags alone:

    - two tensors the language returns as they are (one value type, a pointer and its
      offset: 72% of tiny's operations) are let through for those types and flags;
    - a tensor and a Python integer (``i + 1``, ``ptr + 4``: 29%) become the tensor and the
      integer's constant in the type the language chose for that tensor's type, integer and
      flags, broadcast, checked equal to the language's own result the first time and made
      once.

    Anything else (operands the language converts, floats, errors) goes through the
    language's function every time. A language whose function takes other parameters is
    left alone."""
    import triton.language as tl
    from triton.language import semantic

    def make(original):
        return _checked(tl.tensor, original) if list(inspect.signature(original).parameters) == _CHECK_PARAMS else None

    return _replaced(getattr(semantic, "TritonSemantic", None), "binary_op_type_checking_impl", make)


def _checked(tensor, original):
    """The operand checks of :func:`operand_checks_remembered`, the language's ``original`` deciding each kind once."""
    as_they_are: dict = {}  # (lhs kind, rhs kind, flags) -> whether the language returns both as they are
    constants: dict = {}  # (lhs kind, the integer, flags) -> its operand, or None: the language's way

    def checked(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        flags = (allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        if type(lhs) is tensor and type(rhs) is tensor:
            key = (_kind(lhs.type), _kind(rhs.type), flags)
            if as_they_are.get(key):
                return lhs, rhs
            out = original(self, lhs, rhs, *flags)
            as_they_are[key] = out[0] is lhs and out[1] is rhs
            return out
        if type(lhs) is tensor and type(rhs) is int:
            key = (_kind(lhs.type), rhs, flags)
            operand = constants.get(key)
            if operand is not None:
                return lhs, operand
            out = original(self, lhs, rhs, *flags)
            if key not in constants:
                constants[key] = _constant_operand(self, lhs, rhs, out)
            return out
        return original(self, lhs, rhs, *flags)

    return checked


def _kind(t) -> tuple:
    """What the language's operand checks read of a type: its name (element and shape) and,
    for pointers, the address space its name leaves out."""
    return t.name, getattr(t.scalar, "address_space", None)


def _same(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` are of one type and hold the same bits."""
    x, y = a.handle, b.handle
    if type(a) is not type(b) or a.type != b.type or type(x) is not type(y) or x.dtype != y.dtype:
        return False
    return x.data.dtype == y.data.dtype and x.data.shape == y.data.shape and x.data.tobytes() == y.data.tobytes()


def _constant_operand(semantic, lhs, value: int, out) -> object:
    """``value``'s operand beside ``lhs``, the integer's constant in the type ``out`` (the
    language's checked operands ``lhs`` and ``value``) holds it in, broadcast, where ``lhs``
    came through as it was and that operand is ``out``'s second in type and bits; else None.
    Operations read their operands and change none (:func:`constants_shared`): one serves
    every operation with this kind of ``lhs``, integer and flags."""
    if out[0] is not lhs:
        return None
    ours = semantic.broadcast_impl_value(lhs, semantic.scalar_constant(value, dtype=out[1].type.scalar))
    return ours[1] if ours[0] is lhs and _same(ours[1], out[1]) else None


# A device function's code → the module code its rewritten syntax tree compiles to, kept for
# the process: a kernel file of another layer, or the same file elsewhere, holds equal code.
_REWRITES: dict = {}
_REWRITES_CHECKED: list[bool] = []  # the process's first rewrite, the interpreter's own: [equal]
_REWRITE_STEPS = ("_get_jit_fn_file_line", "_find_def", "_prepare_source", "_transform_ast")


def rewrites_shared():
    """For the duration of an interpreted launch, a device function whose code equals one the
    interpreter rewrote before is defined from that rewrite's compiled code, in its own
    module and file. The interpreter rewrites the syntax tree of each function of each
    kernel file it runs (its source read and tokenized, parsed, transformed and compiled),
    and every layer's kernel file holds the same device functions. Equal code has equal
    names, constants and positions; what a ``def`` evaluates beside its code must be equal
    too (the defaults, as defined; the annotations, as first rewritten), and the first
    rewrite of a process is compared with the interpreter's own."""
    from triton.runtime import interpreter

    rewriter = getattr(interpreter, "FunctionRewriter", None)

    def make(original):
        if not all(hasattr(rewriter, step) for step in _REWRITE_STEPS) or _REWRITES_CHECKED == [False]:
            return None

        def rewrite_ast(self):
            code = getattr(self.fn, "__code__", None)
            compiled, annotations = _REWRITES.get(code, (None, None)) if code is not None else (None, None)
            if compiled is None:
                compiled, annotations = _rewrite(self), self.fn.__annotations__
                if compiled is None:  # no source: the interpreter runs the function as it is
                    return original(self)
                if not _REWRITES_CHECKED:
                    ours, theirs = _define(self, compiled, interpreter), original(self)
                    _REWRITES_CHECKED.append(_defined_alike(ours, theirs) and ours.__code__ == theirs.__code__)
                    if not _REWRITES_CHECKED[0]:  # not the interpreter's rewrite: never shared
                        return theirs
                _REWRITES[code] = compiled, annotations
            fn = _define(self, _in_file(compiled, code.co_filename), interpreter)
            alike = _defined_alike(fn, self.fn, annotations=False) and annotations == self.fn.__annotations__
            return fn if alike else original(self)

        return rewrite_ast

    return _replaced(rewriter, "rewrite_ast", make)


def _rewrite(rw):
    """The module code of the interpreter's rewrite of ``rw.fn`` (a FunctionRewriter), by its own steps."""
    try:
        lines, _ = inspect.getsourcelines(rw.fn)
    except Exception:  # as the interpreter's
        return None
    rw.filename, rw.def_file_lineno = rw._get_jit_fn_file_line()
    rw.def_lineno = rw._find_def(lines)
    tree = rw._transform_ast(rw._prepare_source(lines))
    flags = __future__.annotations.compiler_flag  # as the interpreter's module compiles it
    return compile(tree, filename=rw.filename, mode="exec", flags=flags, dont_inherit=True)


def _define(rw, compiled, interpreter):
    """The function ``compiled`` defines, in ``rw.fn``'s module, beside the interpreter's names (as its own
    ``_compile_and_exec`` does)."""
    namespace = {**rw.kwargs}
    fn_globals = rw.fn.__globals__
    for key, value in vars(interpreter).items():
        fn_globals.setdefault(key, value)
    exec(compiled, fn_globals, namespace)
    return namespace[rw.fn.__name__]


def _in_file(code, filename: str):
    """``code`` and the code it holds as compiled from ``filename``."""
    consts = tuple(_in_file(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _defined_alike(fn, other, annotations: bool = True) -> bool:
    """Whether the ``def`` of ``fn`` and that of ``other`` gave one name and equal defaults (and annotations)."""
    made = [(f.__name__, f.__defaults__, f.__kwdefaults__, annotations and f.__annotations__) for f in (fn, other)]
    return made[0] == made[1]


def numpy_dtypes_looked_up():
    """For the duration of an interpreted launch, the interpreter's numpy dtype of a Triton
    type is looked up, not rebuilt: it builds an 18-entry table at each call (for every
    tensor an operation makes: 13% of an interpreted launch's time). The table's value for a
    type is what the interpreter's own function gives it (asked once per type)."""
    from triton.runtime import interpreter

    def make(original):
        table: dict = {}

        def np_dtype(tt_dtype):
            try:
                found = table.get(tt_dtype)
            except TypeError:  # a pointer type (unhashable)
                return original(tt_dtype)
            if found is None:
                found = table[tt_dtype] = original(tt_dtype)
            return found

        return np_dtype

    return _replaced(interpreter, "_get_np_dtype", make)


@contextlib.contextmanager
def overflow_checks_as_reported():
    """For the duration of an interpreted launch, the interpreter's integer overflow checks
    run only when its assertions are on. Its options ask for them (``sanitize_overflow``):
    every int32 ``+``, ``-`` and ``*`` computed again in int64 and compared with the type's
    range, about a third of an interpreted launch's time. But the comparison reaches the
    program only as a device assertion, which the interpreter drops unless its ``debug``
    option is set, and it is not (Triton does not read TRITON_DEBUG there): the work changes
    nothing. An interpreter without the options is left alone."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    checks = getattr(options, "debug", None)
    if checks is None or getattr(options, "sanitize_overflow", checks) == checks:
        yield
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=checks)
    try:
        yield
    finally:
        builder.options = options


def dot_by_rows():
    """For the duration of an interpreted launch, each row of an interpreted ``tl.dot`` is a
    function of that row of ``a`` (and of ``b``) alone, as on a GPU's MMA, whatever its place in
    the tile. The interpreter computes a dot with ``np.matmul``, through BLAS, whose kernels
    may round a row by its place in the block (OpenBLAS's Haswell kernels do, on AMD Zen):
    a route row computed in another m-tile — another schedule, another instance of its
    expert — would differ in the last bit. ``np.einsum``'s own loops (no BLAS) sum each
    element of the product in one order."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)

    def create_dot(self, a, b, d, *precision):
        x, y = a.data, b.data
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):  # fp8: as Triton does
            x = convert(x, a.dtype, tl.float16, None).view(np.float16)
            y = convert(y, b.dtype, tl.float16, None).view(np.float16)
        # A tile's masked rows hold whatever their buffer held: their products may overflow,
        # and are discarded at the masked store. A real row's overflow is an inf in the result.
        with np.errstate(over="ignore", invalid="ignore"):
            product = np.einsum("...mk,...kn->...mn", x, y, dtype=d.data.dtype, optimize=False)
            return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder = getattr(interpreter, "InterpreterBuilder", None)
    return _replaced(builder, "create_dot", lambda original: create_dot if convert is not None else None)


def _ours(fn) -> bool:
    """Whether ``fn`` is a replacement :func:`_replaced` put there (a launch inside a launch)."""
    return getattr(fn, "rdepc_launch", False)


@contextlib.contextmanager
def _replaced(owner, name: str, make):
    """``owner.name`` is ``make(original)`` (marked as ours) for the duration, then what it
    was; left as it is where it is missing, already ours (a launch inside a launch), or
    ``make`` gives None (an interpreter unlike the one the replacement was written for)."""
    original = getattr(owner, name, None)
    replacement = None if original is None or _ours(original) else make(original)
    if replacement is None:
        yield
        return
    replacement.rdepc_launch = True
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)
