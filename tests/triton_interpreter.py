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
lookup (the same table, the same answers).

Last, it turns off the interpreter's int32 overflow checks (`sanitize_overflow`), which cost a
third of an interpreted kernel's time and check nothing here: each integer add and multiply
computes its result again in int64 and a range condition, which `device_assert` then drops, as
it drops every assertion unless the kernel runs with `debug` (a kernel storing 50,000 * 50,000
in int32 stores the wrapped value with the checks on). Compiled kernels skip them the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

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
    return True
