"""Compile a Gluon kernel for sm_90a on the CPU (Triton's compiler and ptxas need no GPU): the helper of the Hopper
kernels' compile tests."""

from __future__ import annotations

from typing import Any

import torch


def compile_sm90(fn: Any, descs: dict[str, Any], ptrs: dict[str, torch.dtype], consts: dict[str, Any],
                 **options: Any) -> Any:
    """``fn`` compiled for sm_90a: ``descs`` its TMA descriptor arguments, ``ptrs`` the dtype of each pointer
    argument, ``consts`` its constexprs; every other argument an i32. Returns Triton's compiled kernel (``.asm``)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {}
    for name in fn.arg_names:
        if name in descs:
            sig[name] = native_specialize_impl(BaseBackend, descs[name], False, True, True)[0]
        elif name in ptrs:
            sig[name] = native_specialize_impl(BaseBackend, torch.empty(4, dtype=ptrs[name]), False, True, True)[0]
        elif name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    return triton.compile(GluonASTSource(fn, sig, {c: consts[c] for c in consts}), target=GPUTarget("cuda", 90, 32),
                          options=options)
