"""``dispatch_op``: minidi's ops registered straight on the dispatcher, for a cheaper call than
``torch.library.custom_op``'s.

    @dispatch_op("minidi::fp8_linear")
    def _fp8_linear_op(x: torch.Tensor, ...) -> torch.Tensor: ...

    @_fp8_linear_op.register_fake
    def _(x, ...): ...

The same op to every caller (``torch.ops.minidi.<name>``, Dynamo, Inductor, FakeTensor, ``opcheck``): the schema is
inferred from the annotations as ``custom_op`` infers it, the function runs for every device
(``CompositeExplicitAutograd``), its fake gives the shapes. What differs is the call. Each compiled step calls these ops
~1,500 times (V4-Flash EP4, 43 layers; H100 round 37), and ``custom_op`` runs four Python frames around the function on
every call (its autograd kernel, a redispatch below autograd, the backend wrapper with its output-aliasing check,
Dynamo's disable wrapper). Here the autograd key falls through in C++ and only Dynamo's wrapper stays (so a frame Dynamo
is evaluating never traces into a kernel launch). Measured on this repository's 2-core CPU
(``bench/bench_host_calls.py``, an op returning an empty tensor, ``torch.no_grad``): 7.24 us a call through
``custom_op``, 3.44 here, 1.55 for the plain Python call; from a compiled graph 8.47 and 4.23 us
(``docs/benchmarks/cpu_round37``).

No autograd, as before, and said as clearly: ``custom_op`` raised at backward ("no autograd formula"); here a call
with grad enabled and an input that requires grad raises at once, naming the op.

``mutates_args`` declares arguments written in place, as ``custom_op``'s does (the schema marks them ``Tensor(a!)``;
the compiler orders the op after their writers and before their readers). The stage markers use it
(``stages.stage_mark``: declared, never written). Unlike ``custom_op``'s, an eager call does not bump the declared
arguments' version counters: an op that does write them must bump them itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}
_OPS: dict[str, DispatchOp] = {}


def _library(namespace: str) -> torch.library.Library:
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return lib


def _requires_grad(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad
               for a in torch.utils._pytree.tree_leaves((args, kwargs)))


class DispatchOp:
    """One op on the dispatcher (see the module doc). Calling it calls ``torch.ops.<ns>.<name>``."""

    def __init__(self, qualname: str, fn: Callable, mutates_args: tuple[str, ...] = ()) -> None:
        namespace, sep, name = qualname.partition("::")
        if not (sep and namespace and name):
            raise ValueError(f"dispatch_op: the name must be 'namespace::op', got {qualname!r}")
        self.qualname, self.impl = qualname, fn
        lib = _library(namespace)
        lib.define(name + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))

        def checked(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled() and _requires_grad(args, kwargs):
                raise RuntimeError(f"{qualname} has no autograd: call it under torch.no_grad() or with inputs that "
                                   f"do not require grad")
            return self.impl(*args, **kwargs)

        lib.impl(name, torch._disable_dynamo(checked), "CompositeExplicitAutograd")
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
        self.op: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), name).default
        _OPS[qualname] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        """The op's fake (shapes and dtypes of its outputs from those of its inputs); a decorator, as
        ``custom_op``'s."""
        torch.library.register_fake(self.qualname, fn, lib=_library(self.qualname.partition("::")[0]))
        return fn


def dispatch_op(qualname: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], DispatchOp]:
    """Register the decorated function as the op ``qualname``, functional unless ``mutates_args`` names arguments
    it writes in place (see the module doc)."""
    return lambda fn: DispatchOp(qualname, fn, mutates_args)


def impl_of(op: Any) -> Callable | None:
    """The Python function behind a ``dispatch_op`` (its OpOverload, packet or the object itself); None for any
    other op."""
    if isinstance(op, DispatchOp):
        return op.impl
    if isinstance(op, torch._ops.OpOverload):
        found = _OPS.get(op._name)
    elif isinstance(op, torch._ops.OpOverloadPacket):
        found = _OPS.get(op._qualified_op_name)
    else:
        found = None
    return found.impl if found else None


__all__ = ["DispatchOp", "dispatch_op", "impl_of"]
