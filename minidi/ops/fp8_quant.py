"""fq8 split: bf16 / fp32 activations -> e4m3 values + one power-of-two fp32 scale per block of 32 (or 128) along K,
the operands of the FP8 GEMMs (``fp8_grouped_gemm.py``).

    q, s = fq8_split(x, block)     # x [R, K] -> q float8_e4m3fn [R, K], s fp32 [R, K / block]
    # s = 2^ceil(log2(max(amax, 1e-4) / 448)) per block, q = e4m3(clamp(x / s, +-448)), round to nearest even

so that q * s is the model's ``fq8(x)`` bit for bit (``minidi.formats.fq8_split`` is the reference). On an input
that is already fq8's output, the split is exact (q * s == x): the products of the FP8 GEMM are then the products
of the bf16 GEMM it replaces.

Kernel: one program per ``BLOCKS`` consecutive blocks of one row-major [R, K] tensor, viewed as [R * K / block, block]
(with M-major scales, ``fq8_split_launch(..., scales_t=True)`` for cuBLAS: one block column of ``BLOCKS`` consecutive
rows, so that a program's scales are adjacent there); loads in fp32, amax per block, the scale from the amax's bits
(``pow2_ceil``), the quotient by multiplying with 1 / s (a power of two: exact), e4m3 rounding by the hardware
conversion (``cvt.rn.satfinite``) on the GPU and by exact fp32 and integer arithmetic in the interpreter, whose fp32 ->
fp8 cast truncates. Memory-bound: reads 2 B (bf16) and writes 1 B + 4 / block B per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minidi.formats import E4M3_MAX, FQ8_AMAX_FLOOR, fq8_split as fq8_split_ref

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_formats import e4m3_bits, pow2_ceil
from ._triton_utils import cannot_run, interpreting, resolve_backend, triton_can_run

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_SIZES = (32, 128)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(FQ8_AMAX_FLOOR)


@fast_launch
@triton.jit
def _fq8_split_kernel(x_ptr, q_ptr, s_ptr, n_blocks, rows, row_blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
                      SCALES_T: tl.constexpr, INTERPRET: tl.constexpr):
    if SCALES_T:  # BLOCKS rows' block c: their scales are adjacent in s [K / block, R]
        c = tl.program_id(0) % row_blocks
        r = (tl.program_id(0) // row_blocks).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        b = r * row_blocks + c  # [BLOCKS] block ids
        ok = r < rows
    else:  # BLOCKS consecutive blocks
        b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        ok = b < n_blocks
    j = tl.arange(0, BLOCK)
    offs = b[:, None] * BLOCK + j[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)  # [BLOCKS, BLOCK]
    amax = tl.maximum(tl.max(tl.abs(x), 1), _AMAX_FLOOR)
    s = pow2_ceil(tl.div_rn(amax, _E4M3_MAX))  # [BLOCKS]
    inv = ((254 - ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True)  # 1 / s
    v = tl.minimum(tl.maximum(x * inv[:, None], -_E4M3_MAX), _E4M3_MAX)
    if INTERPRET:
        tl.store(q_ptr.to(tl.pointer_type(tl.uint8)) + offs, e4m3_bits(v).to(tl.uint8), mask=ok[:, None])
    else:
        tl.store(q_ptr + offs, v.to(tl.float8e4nv), mask=ok[:, None])
    if SCALES_T:  # s as [K / block, R]: block c of row r at c * R + r
        tl.store(s_ptr + c * rows + r, s, mask=ok)
    else:
        tl.store(s_ptr + b, s, mask=ok)


def _check(x: torch.Tensor, block: int) -> None:
    if x.dim() < 1 or x.dtype not in X_DTYPES:
        raise ValueError(f"fq8_split: x must be [..., K] with dtype in {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if block not in BLOCK_SIZES:
        raise ValueError(f"fq8_split: block must be one of {BLOCK_SIZES}, got {block}")
    if x.shape[-1] % block:
        raise ValueError(f"fq8_split: the last dim {x.shape[-1]} is not a multiple of block {block}")


def fq8_split_launch(x: torch.Tensor, block: int, scales_t: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on a checked input x [R, K] (no op dispatch: for the ops that call it inside their own op).
    ``scales_t``: s is the [R, K / block] transpose-view of a contiguous [K / block, R] tensor (strides (1, R): the
    activation scales' layout of cuBLAS's block-scaled GEMM, ``fp8_gemm_cublas``); same values."""
    x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if scales_t:
        s = torch.empty(k // block, rows, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(rows, k // block, dtype=torch.float32, device=x.device)
    n_blocks = x.numel() // block
    if n_blocks:
        blocks = 32 if block == 32 else 8
        grid = triton.cdiv(rows, blocks) * (k // block) if scales_t else triton.cdiv(n_blocks, blocks)
        _fq8_split_kernel[(grid,)](x, q, s, n_blocks, rows, k // block, BLOCK=block, BLOCKS=blocks,
                                   SCALES_T=scales_t, INTERPRET=interpreting(), num_warps=4)
    return q, s


@dispatch_op("minidi::fq8_split")
def _fq8_split_op(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not triton_can_run(x):
        raise cannot_run("minidi::fq8_split", x)
    q, s = fq8_split_launch(x.reshape(-1, x.shape[-1]), block)
    return q.view(x.shape), s.view(*x.shape[:-1], x.shape[-1] // block)


@_fq8_split_op.register_fake
def _(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(*x.shape[:-1], x.shape[-1] // block, dtype=torch.float32))


@dispatch_op("minidi::fq8_split_ref")
def _fq8_split_ref_op(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return fq8_split_ref(x, block)


@_fq8_split_ref_op.register_fake
def _(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(*x.shape[:-1], x.shape[-1] // block, dtype=torch.float32))


def fq8_split(x: torch.Tensor, block: int = 32, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] bf16 / fp16 / fp32 -> (q float8_e4m3fn [..., K], s fp32 [..., K / block]), q * s = fq8(x) exactly;
    see the module doc. ``backend``: "auto" | "triton" | "ref" (``minidi.formats.fq8_split``)."""
    _check(x, block)
    if resolve_backend(backend, "fq8_split", x) == "ref":
        return _fq8_split_ref_op(x, block)
    return _fq8_split_op(x, block)
