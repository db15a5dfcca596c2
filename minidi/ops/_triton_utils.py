"""Shared helpers for minidi's Triton ops (CPU interpreter support, backend choice).

Triton's CPU interpreter (``TRITON_INTERPRET=1``) cannot do bf16 arithmetic: it stores bf16 as uint16 and ``tl.dot``
multiplies the raw bit patterns (PITFALLS.md). Kernels therefore do all arithmetic in fp32 after loading, and feed
``tl.dot`` through ``dot`` below, which upcasts its operands only when the ``INTERPRET`` constexpr says the
interpreter is running; on the GPU the operands stay bf16 and use tensor cores.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BACKENDS = ("triton", "ref")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_can_run(*tensors: torch.Tensor) -> bool:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    on_cuda = all(t.is_cuda for t in tensors)
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    return on_cuda or (on_cpu and interpreting())


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


@triton.jit
def dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc += a @ b; operands upcast to fp32 only in the interpreter (bf16 dot is wrong there)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def local_row_count(offs_ptr, E, R):
    """Rows below offs[E-1] (this rank's experts' rows, sorted first), clamped to [0, R]; read on the device."""
    return tl.minimum(tl.maximum(tl.load(offs_ptr + E - 1), 0), R)
