"""A faster Triton interpreter for the CPU suites (`TRITON_INTERPRET=1`), computing the same.

The interpreter patches the language modules (`triton.language` and `triton.language.core`:
their builtins, `range`, the tensor class) that a kernel's globals hold once per launch
(`GridExecutor.__call__`), and again on every call of a `@triton.jit` device function inside it
(`InterpretedFunction.__call__`), walking the modules with `inspect.getmembers` each time. After
the first patch of a module in a launch the later ones change nothing that the code can see (the
builtins are patched already; the other attributes get equal replacements), yet they took about
a quarter of the interpreted attention's time: its tile and block helpers are called once per
program. `install` patches each module once per launch: a device-function call patches only
when its globals hold a language module that the launch has not patched yet. A Triton other
than the pinned one is left as it is.

It also builds the interpreter's table of numpy types (`_get_np_dtype`) once instead of on every
lookup (the same table, the same answers), and lists each language module's builtins once instead
of walking the module on every launch (the launch restores them, so the list stays true).

Block types and tensors of one shape share the objects that describe it (the shape tuple, its
element count, the printed name), and equality of block types and of shapes compares their values
without building a tuple for the other side: building these objects for every interpreted
operation took a quarter of an interpreted kernel's time.

Last, it turns off the interpreter's int32 overflow checks (`sanitize_overflow`), which cost a
third of an interpreted kernel's time and check nothing here: each integer add and multiply
computes its result again in int64 and a range condition, which `device_assert` then drops, as
it drops every assertion unless the kernel runs with `debug` (a kernel storing 50,000 * 50,000
in int32 stores the wrapped value with the checks on). Compiled kernels skip them the same way.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import inspect
import math

PINNED = "3.7.1"  # requirements/runtime.txt: the interpreter whose internals this follows


def install() -> bool:
    """Patch the pinned Triton's interpreter as the module docstring says; True if done."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton is a runtime dependency
        return False
    if triton.__version__ != PINNED:
        return False
    patched: set[int] = set()  # ids of the language modules the running launch has patched
    langs: dict[object, frozenset[int]] = {}  # function -> ids of the language modules it sees

    def langs_of(fn) -> frozenset[int]:
        if fn not in langs:
            mods = [v for v in fn.__globals__.values() if inspect.ismodule(v)]
            langs[fn] = frozenset(id(m) for m in mods if m is tl or m is tl.core)
        return langs[fn]

    launch, device = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__

    def launch_call(self, *args, **kwargs):
        outer = set(patched)  # (a launch inside a launch does not happen; kept safe anyway)
        patched.clear()
        patched.update(langs_of(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()
            patched.update(outer)

    def device_call(self, *args, **kwargs):
        if langs_of(self.fn) <= patched:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
        patched.update(langs_of(self.fn))
        return device(self, *args, **kwargs)

    get_np_dtype = interpreter._get_np_dtype
    table = {}
    for ty in vars(tl).values():
        if isinstance(ty, tl.dtype) and not isinstance(ty, (tl.pointer_type, tl.block_type)):
            with contextlib.suppress(KeyError):  # (a type with no numpy type is left out)
                table[ty] = get_np_dtype(ty)

    def np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        found = None if isinstance(element, tl.pointer_type) else table.get(element)
        return found if found is not None else get_np_dtype(tt_dtype)

    interpreter._get_np_dtype = np_dtype
    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    interpreter.GridExecutor.__call__ = launch_call
    interpreter.InterpretedFunction.__call__ = device_call
    builtins_of: dict[int, list] = {}  # id of a language module -> its (name, builtin) pairs

    def patch_builtin(pkg, builder, scope):
        if id(pkg) not in builtins_of:  # (read while unpatched: each launch restores them)
            members = inspect.getmembers(pkg)
            builtins_of[id(pkg)] = [(n, m) for n, m in members if tl.core.is_builtin(m)]
        for name, member in builtins_of[id(pkg)]:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin
    _share_shapes(tl.core)
    return True


def _share_shapes(core) -> None:
    """Block types and tensors of one shape share their shape objects (module docstring)."""
    by_dims: dict[tuple, tuple] = {}  # dims -> (type shape, numel, tensor shape, tensor numel)

    def shapes(dims: tuple) -> tuple:
        found = by_dims.get(dims)
        if found is None:
            numel = core.validate_block_shape(dims) if dims else 1
            found = (
                core.tuple(list(dims)),
                numel,
                core.tuple([core.constexpr(d) for d in dims]),
                core.constexpr(math.prod(dims)),
            )
            by_dims[dims] = found
        return found

    def dims_of(shape) -> tuple:
        if isinstance(shape, core.constexpr):
            shape = shape.value
        values = shape.values if isinstance(shape, core.tuple) else shape
        return builtins.tuple(v.value if isinstance(v, core.constexpr) else v for v in values)

    names: dict[tuple, str] = {}

    def block_init(self, element_ty, shape):
        self.element_ty = element_ty
        dims = dims_of(shape)
        if not dims:
            raise TypeError("0d block_type is forbidden")
        self.shape, self.numel = shapes(dims)[:2]
        key = (dims, element_ty.name)
        name = names.get(key)
        if name is None:
            name = names[key] = f"<{self.shape}, {element_ty}>"
        self.name = name

    def tensor_init(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        dims = builtins.tuple(type.shape.values) if type.is_block() else ()
        self.shape, self.numel = shapes(dims)[2:]

    tuple_eq = core.tuple.__eq__

    def shape_eq(self, other):
        if isinstance(other, (list, core.tuple)):  # (tl.tuple's equality, without a new tuple)
            return core.constexpr(
                self.values == (other if isinstance(other, list) else other.values)
            )
        return tuple_eq(self, other)

    def block_eq(self, other) -> bool:
        if not isinstance(other, core.block_type):
            return False
        return self.element_ty == other.element_ty and self.shape.values == other.shape.values

    core.block_type.__init__ = block_init
    core.block_type.__eq__ = block_eq
    core.tensor.__init__ = tensor_init
    core.tuple.__eq__ = shape_eq
