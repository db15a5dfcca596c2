"""Repeat launches of minidi's Triton and Gluon kernels without Triton's per-launch binding (``@fast_launch``).

Triton's ``JITFunction.run`` binds every launch anew: it specialises each argument, builds the cache key from the
options' string, checks the kernel's globals and builds launch metadata for its hooks before it calls the compiled
kernel's launcher. A V4-Flash step makes ~1,960 such launches of minidi's kernels, and its host enqueued the step at
about the pace of its kernels (``docs/benchmarks/README.md``, round 37). Measured on an H100 machine's host (round
39, ``bench/bench_host_calls.py``): the mHC gate's launcher (20 kernel arguments) 70.9 us a call through Triton's
``run``, 65.3 through this module; an empty kernel of 6 arguments 16.5 and 17.0 us (there the binding is cheap and
the launcher's own C call dominates).

``@fast_launch`` (above ``@triton.jit`` / ``@gluon.jit``) gives the kernel a ``run`` that keeps, per launch
signature, the compiled kernel Triton chose, and launches it directly on a repeat:

- The signature (``launch_key``) is every argument's type and value, a tensor's dtype and whether its address is
  16-byte aligned (what Triton specialises a pointer on), a TMA descriptor's base dtype, block shape, layout and
  padding; keyword arguments (constexprs, launch options) by name and value; the current device. It is finer than
  Triton's own key (an integer by its value, not by its == 1 / % 16 / range classes), so a launch that Triton would
  compile differently never finds another's kernel.
- A launch with a new signature goes through Triton's ``run`` (compile, checks and errors as always), and the
  compiled kernel it returns is kept (at most ``MAX_PLANS`` per kernel; past that, Triton's ``run`` every time).
- A repeat calls that kernel's launcher with the arguments in the kernel's parameter order (defaults filled in),
  the current stream, and no hooks or launch metadata: ``JITFunction.run`` passes Triton's hook chains and builds
  the metadata for them, which do nothing while the chains are empty.

Through Triton's ``run`` always: under the interpreter (kernels are not JIT functions there: ``fast_launch`` returns
them as they are); with ``MINIDI_FAST_LAUNCH=0`` (A/B runs); with a Triton other than the versions checked on a GPU
(``CHECKED_TRITON``); warmup launches; a grid that is not a tuple; Triton launch hooks or a kernel's pre-run hooks
set; an argument of any other type (the precompiler's fake tensors, tensor subclasses); inside ``through_triton()``
(the precompiler's deferred launches). Not re-checked on a repeat: the kernel's global constants (Triton raises when
one changed; minidi's kernels read module constants only). ``launch_counts()`` says per kernel how many launches hit,
missed or could not be keyed.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from typing import Any, Iterator

import torch
import triton
from triton.runtime.jit import JITFunction

ENV = "MINIDI_FAST_LAUNCH"
CHECKED_TRITON = ("3.6.",)  # the launcher call below was checked against these versions' JITFunction.run on a GPU
MAX_PLANS = 64  # kept compiled kernels per kernel (a step's launches of one kernel use a handful)

ENABLED: bool = os.environ.get(ENV, "1") != "0" and triton.__version__.startswith(CHECKED_TRITON)
"""Whether repeat launches skip Triton's binding (tests switch it; the environment decides it at import)."""

_SCALARS = frozenset((int, bool, float, str, type(None)))
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_local = threading.local()
_KERNELS: list[JITFunction] = []
_FAST_CLASSES: dict[type, type] = {}


def _descriptor_types() -> frozenset[type]:
    """Triton's host TMA descriptor classes (Triton's and Gluon's Hopper one), those this Triton has."""
    found = []
    for module, name in (("triton.tools.tensor_descriptor", "TensorDescriptor"),
                         ("triton.experimental.gluon.nvidia.hopper", "TensorDescriptor")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except Exception:  # noqa: BLE001 - a Triton without it (or whose import fails): no such descriptors
            pass
    return frozenset(found)


_DESCRIPTORS = _descriptor_types()


class _Unkeyed(Exception):
    """An argument this module cannot key: the launch goes through Triton's ``run``."""


def value_key(v: Any) -> Any:
    """One argument's part of the launch signature (see the module doc); raises ``_Unkeyed`` for other types."""
    t = type(v)
    if t in _TENSORS:
        return v.dtype, v.data_ptr() & 15 == 0
    if t in _SCALARS:
        return t, v
    if t in _DESCRIPTORS:
        if type(v.base) not in _TENSORS:
            raise _Unkeyed(t)
        return t, v.base.dtype, tuple(v.block_shape), getattr(v, "layout", None), v.padding
    if isinstance(v, triton.language.dtype):
        return t, v
    raise _Unkeyed(t)


def launch_key(args: tuple, kwargs: dict) -> tuple:
    """The launch signature of ``args`` and ``kwargs`` (without the device; see the module doc)."""
    key = [len(args)]
    for v in args:
        key.append(value_key(v))
    for name, v in kwargs.items():
        key.append(name)
        key.append(value_key(v))
    return tuple(key)


@contextlib.contextmanager
def through_triton() -> Iterator[None]:
    """Every launch of this thread goes through Triton's ``run`` while inside (the precompiler defers launches by
    patching it)."""
    before = getattr(_local, "bypass", False)
    _local.bypass = True
    try:
        yield
    finally:
        _local.bypass = before


class _Plan:
    """A kept compiled kernel and how a launch's arguments map onto its parameters."""

    __slots__ = ("kernel", "launcher", "function", "metadata", "tail")

    def __init__(self, kernel: Any, params: list, n_args: int) -> None:
        self.kernel = kernel
        self.launcher = kernel.run  # the property initialises the handles (the launch just made did already)
        self.function = kernel.function
        self.metadata = kernel.packed_metadata
        self.tail = [(p.name, p.default) for p in params[n_args:]]  # filled from kwargs, else the default


class _FastRun:
    """The ``run`` of a ``fast_launch`` kernel (a mixin before Triton's JIT function class)."""

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        counts = self._fast_counts
        if warmup or not ENABLED or type(grid) is not tuple or self.pre_run_hooks or _hooks_set() or \
                getattr(_local, "bypass", False):
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        try:
            key = (_current_device(), launch_key(args, kwargs))
        except _Unkeyed:
            counts[2] += 1
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        plan = self._fast_plans.get(key)
        if plan is None:
            counts[1] += 1
            kernel = super().run(*args, grid=grid, warmup=warmup, **kwargs)
            if kernel is not None and not hasattr(kernel, "result") and len(self._fast_plans) < MAX_PLANS:
                self._fast_plans[key] = _Plan(kernel, self.params, len(args))
            return kernel
        counts[0] += 1
        n = len(grid)
        plan.launcher(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _current_stream(key[0]),
                      plan.function, plan.metadata, None, None, None,
                      *args, *[kwargs.get(name, default) for name, default in plan.tail])
        return plan.kernel


def _hooks_set() -> bool:
    """Whether a Triton launch hook would run (Triton 3.6+ keeps them as chains, empty unless a tool adds one)."""
    rt = triton.knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def fast_launch(fn: Any) -> Any:
    """``fn`` (a ``triton.jit`` / ``gluon.jit`` kernel) with repeat launches that skip Triton's binding (see the
    module doc); anything else (the interpreter's functions) as it is."""
    if not isinstance(fn, JITFunction):
        return fn
    base = type(fn)
    cls = _FAST_CLASSES.get(base)
    if cls is None:
        cls = _FAST_CLASSES[base] = type(f"Fast{base.__name__}", (_FastRun, base), {})
    fn.__class__ = cls
    fn._fast_plans = {}
    fn._fast_counts = [0, 0, 0]
    _KERNELS.append(fn)
    return fn


def launch_counts() -> dict[str, dict[str, int]]:
    """Per ``fast_launch`` kernel that launched: {hits, misses, unkeyed} since import (or ``reset``)."""
    return {k.__name__: dict(zip(("hits", "misses", "unkeyed"), k._fast_counts)) for k in _KERNELS
            if any(k._fast_counts)}


def reset() -> None:
    """Forget every kept kernel and count (tests, benchmarks)."""
    for k in _KERNELS:
        k._fast_plans.clear()
        k._fast_counts[:] = [0, 0, 0]


__all__ = ["CHECKED_TRITON", "ENABLED", "ENV", "MAX_PLANS", "fast_launch", "launch_counts", "launch_key", "reset",
           "through_triton", "value_key"]
