"""The emulated expert-parallel exchange's rows in one launch: ``out`` block r (of ``size``) is x rolled by r T // size
rows (``minidi.runtime.expert_parallel.rotated_blocks``, a benchmark's synthesised ranks).

The copy form (two ATen ``copy_`` per block: 2 size - 1 device memcpys a call, 22 per V4.1 layer for its three
tensors) cost the step's host more than the GPU: 884 ``cudaMemcpyAsync`` a V4.1 EP4 step, and the largest share of
the GPU's idle time in the round-20 profile (``docs/benchmarks/h200_round20/gaps_before.txt``). One kernel copies all
blocks: rows are moved as words (the widest of 8 / 4 / 2 / 1 bytes that divides the row), the source row of each
output row computed once per row, so the copy is index math per row and a vector move per word.

Legend: T rows of x, W words a row, size blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, triton_can_run

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@fast_launch
@triton.jit
def _rotated_rows_kernel(x_ptr, out_ptr, T, W, SIZE, BR: tl.constexpr, BW: tl.constexpr):
    """Program (block of BR output rows, BW words): output row i = block r = i // T, row j = i % T of it, reads x
    row (j - r T // SIZE) mod T."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    w = tl.program_id(1) * BW + tl.arange(0, BW)
    ok = i < SIZE * T
    r = i // T
    j = i - r * T
    src = j - r * T // SIZE
    src = tl.where(src < 0, src + T, src)
    m = ok[:, None] & (w < W)[None, :]
    v = tl.load(x_ptr + src.to(tl.int64)[:, None] * W + w[None, :], mask=m)
    tl.store(out_ptr + i.to(tl.int64)[:, None] * W + w[None, :], v, mask=m)


def _words(x: torch.Tensor) -> torch.Tensor:
    """A contiguous x [T, ...] as [T, W] words of the widest dtype that divides a row (and x's storage offset)."""
    row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    b = x.contiguous().view(torch.uint8).reshape(x.shape[0], row_bytes)
    for dt in _WORDS:
        if row_bytes % dt.itemsize == 0 and b.data_ptr() % dt.itemsize == 0:
            return b.view(dt)
    raise AssertionError("uint8 always divides")  # pragma: no cover


def rotated_rows(x: torch.Tensor, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, ...] (CUDA, or CPU under TRITON_INTERPRET=1) -> [size * T, ...]: block r is ``x.roll(r * T // size, 0)``,
    by one kernel launch. Any dtype (rows move as bytes). ``out``: a contiguous buffer to write (tests poison it),
    else a fresh one."""
    if size < 1:
        raise ValueError(f"rotated_rows: size >= 1 expected, got {size}")
    if not triton_can_run(x):
        raise cannot_run("rotated_rows", x)
    t = x.shape[0]
    shape = (size * t, *x.shape[1:])
    if out is None:
        out = x.new_empty(shape)
    elif out.shape != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"rotated_rows: out must be a contiguous {tuple(shape)} {x.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if out.numel() == 0:
        return out
    src = _words(x)
    w = src.shape[1]
    dst = out.view(torch.uint8).reshape(size * t, -1).view(src.dtype)
    bw = min(1024, triton.next_power_of_2(w))
    br = max(1, min(256, 4096 // bw))
    grid = (triton.cdiv(size * t, br), triton.cdiv(w, bw))
    _rotated_rows_kernel[grid](src, dst, t, w, size, BR=br, BW=bw, num_warps=4)
    return out
