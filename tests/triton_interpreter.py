"""A faster Triton interpreter for the CPU test suite: helpers called inside a launch skip re-patching the language.

Under ``TRITON_INTERPRET=1`` each kernel launch (``GridExecutor.__call__``) patches ``triton.language`` (its builtins
become numpy-backed callables) and restores it when the launch ends. Every call of a ``@triton.jit`` helper from a
kernel (``InterpretedFunction.__call__``) patches it again: an ``inspect.getmembers`` walk of ``tl``, ``tl.tensor``,
``tl.math`` ... whose result is the state the launch already set (a patched member is no longer a builtin, so the walk
re-patches nothing it changes). Profiled on an interpreted tiny-v41 step (the passes' ops, 2 CPU cores): 45 % of the
step's time was that walk (py-spy, ``_patch_lang``).

``skip_repatching_inside_launches`` wraps ``_patch_lang``: a launch's call patches as before and records the
language modules it patched until its scope is restored; a helper's call made while a launch is running, whose
modules are among those patched, gets an empty scope. A helper reaching a module the launch did not patch (``tl.zeros``
lives in ``tl.core``) patches as before, once per launch: the interpreter never restores a helper's patch, so that
module stays patched for the rest of the launch. A Triton whose interpreter is laid out differently patches as before
everywhere, so the worst case is today's speed.
The kernels' semantics are untouched: the language a helper runs with is the one its launch patched.
"""

from __future__ import annotations

import inspect
import sys


class _EmptyScope:
    def restore(self) -> None:
        pass


def skip_repatching_inside_launches() -> bool:
    """Install the wrapper (idempotent). Returns whether it is installed."""
    try:
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    real = getattr(it, "_patch_lang", None)
    launch = getattr(getattr(it, "GridExecutor", None), "__call__", None)
    if real is None or launch is None:
        return False
    if getattr(real, "_minidi_wrapped", False):
        return True
    launch_code = launch.__code__
    active: list[frozenset[int]] = []  # per running launch: ids of the language modules it patched

    def langs_of(fn) -> frozenset[int]:
        mods = (it.tl, it.tl.core)
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in mods)

    class _LaunchScope:
        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            try:
                self.scope.restore()
            finally:
                active.pop()

    def _patch_lang(fn):
        langs = langs_of(fn)
        if sys._getframe(1).f_code is launch_code:  # a launch: patch, and remember what until it restores
            scope = real(fn)
            active.append(langs)
            return _LaunchScope(scope)
        if active and langs <= active[-1]:  # a helper inside a launch: already patched
            return _EmptyScope()
        scope = real(fn)  # a helper's patch is never restored (the interpreter drops its scope): it lasts the launch
        if active:
            active[-1] = active[-1] | langs
        return scope

    _patch_lang._minidi_wrapped = True
    it._patch_lang = _patch_lang
    return True
