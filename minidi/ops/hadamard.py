"""V: the Hadamard rotation of V4's indexer q and k (``minidi.model.quant.hadamard``) on tensor cores.

    y = hadamard_rotate(x)     # x [..., n] bf16 / fp16, n a power of two in [16, 256] -> [..., n] in x's dtype
    # = the model's (x.float() @ hadamard_matrix(n)).to(x.dtype): fp32 math, one rounding
    y = hadamard_rotate(x, fq4_block=32)
    # = fq4_ue8m0(that rotation, 32): the indexer's fake quant that follows it, in the same kernel

Why: the model's fp32 matmul runs on CUDA cores (TF32 is off). In the V4-Flash EP4 step (H100, round 34) its 21
launches took 5.09 ms a step at 35 TFLOP/s (``sm80_xmma_gemm_f32f32...``; q's rotation, [4,096 x 64, 128] x
[128, 128]), for a product that moves 67 MB in and out.

How: hadamard_matrix(n) = c S with S's entries +-1 (exact in bf16 and fp16) and c = 1 / sqrt(n) rounded to fp32 (the
model's entries are +-c). x S has exact products, so one dot on the tensor cores with fp32 accumulation computes it;
the kernel multiplies by c in fp32 and rounds once to x's dtype. The model's matmul adds the products x_i * (+-c)
with fp32 FMAs instead: the two differ by fp32 roundings in another order and place, before the one rounding to x's
dtype (tests: within that rounding plus 2^-20 of c sum |x_i| of the exact product, on the interpreter and the GPU).

Kernel ``_hadamard_kernel``: one program per BM rows, [BM, n] x [n, n] in one ``tl.dot``; memory-bound (reads and
writes 2 n bytes a row). S is built once per (n, dtype, device). fp32 x (fp32 models) runs the reference.
With ``fq4_block`` the epilogue rounds the rotation to x's dtype (the model's rounding point) and applies
``fq4_ue8m0`` to each block of the row in registers (``_triton_formats.fq4_ue8m0_blocks``, exact): the result is the
model's fq4 of the kernel's rotation bit for bit. Inductor's code for that fq4 made two more passes over q (round 34's
V4-Flash EP4 kernel table, H100: two kernels whose fused names carry ``round_e2m1``'s and ``pow2_ceil``'s
operations, 21 calls each, 3.36 ms a step).

Measured (one H100, round 34, ``bench/bench_hadamard.py``; docs/benchmarks/h100_round34/bench_hadamard.json): q
[4,096, 64, 128] bf16 in 0.0518 ms (2,591 GB/s, 89 % of the copy peak measured in the run) against 0.4743 ms for the
model's fp32 matmul eager and 0.3888 ms under stock torch.compile; in the V4-Flash EP4 step 42 launches (q and k)
take 1.06 ms where the fp32 matmul took 5.06 ms for q alone. With the fq4 (round 35, another H100,
docs/benchmarks/h100_round35/bench_hadamard.json): 0.0711 ms (63 % of copy; the rotation alone 0.0511 ms, 87.5 %)
against 0.2104 ms for the op followed by Inductor's fq4; in the step 42 launches take 1.66 ms.

Legend: M rows (x flattened to [M, n]), n the rotated width, BM rows per program.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from minidi.formats import fq4_ue8m0, hadamard, hadamard_matrix

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_formats import fq4_ue8m0_blocks
from ._triton_utils import cannot_run, dot, interpreting, resolve_backend, round_bf16, triton_can_run

KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # S and x S exact in one dot
X_DTYPES = (*KERNEL_DTYPES, torch.float32)
MIN_N, MAX_N = 16, 256


# ---- reference -----------------------------------------------------------------------------------------------------
def hadamard_ref(x: torch.Tensor, fq4_block: int = 0) -> torch.Tensor:
    """The model's rotation, plain torch (``minidi.formats.hadamard``): (x.float() @ hadamard_matrix(n)).to(x.dtype);
    with ``fq4_block`` its ``fq4_ue8m0`` in blocks of that many channels."""
    y = hadamard(x)
    return fq4_ue8m0(y, fq4_block) if fq4_block else y


@functools.lru_cache(maxsize=None)
def scale_of(n: int) -> float:
    """c: the model's matrix entries' magnitude, 1 / sqrt(n) as the fp32 division ``hadamard_matrix`` does."""
    return float(torch.ones((), dtype=torch.float32) / math.sqrt(n))


@functools.lru_cache(maxsize=None)
def signs(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """S [n, n] (+-1, Sylvester order, symmetric) in ``dtype`` on ``device``: hadamard_matrix(n) / c."""
    return (hadamard_matrix(n) * math.sqrt(n)).round().to(dtype).to(device)


# ---- kernel --------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _hadamard_kernel(x_ptr, s_ptr, out_ptr, M, scale, N: tl.constexpr, BM: tl.constexpr, FQ4: tl.constexpr,
                     INTERPRET: tl.constexpr, ROUND_BF16: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.arange(0, N)
    ok = (rm < M)[:, None]
    offs = rm[:, None] * N + rn[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)  # [BM, N]
    s = tl.load(s_ptr + rn[:, None] * N + rn[None, :])  # [N, N] +-1
    y = dot(x, s, tl.zeros([BM, N], dtype=tl.float32), INTERPRET) * scale
    if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest
        y = round_bf16(y)
    if FQ4 > 0:  # the model's rounding to x's dtype, then fq4_ue8m0 of each block of FQ4 channels
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = tl.reshape(fq4_ue8m0_blocks(tl.reshape(y, [BM, N // FQ4, FQ4])), [BM, N])
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def launch(x: torch.Tensor, out: torch.Tensor, fq4_block: int = 0, BM: int = 64, num_warps: int = 4) -> torch.Tensor:
    """The kernel on a contiguous x [M, n] (a kernel dtype) into out [M, n] (same dtype); ``fq4_block`` as the op's;
    the tile overrides the default (benchmarks)."""
    m, n = x.shape
    if m:
        _hadamard_kernel[(triton.cdiv(m, BM),)](
            x, signs(n, x.dtype, x.device), out, m, scale_of(n), N=n, BM=BM, FQ4=fq4_block, INTERPRET=interpreting(),
            ROUND_BF16=interpreting() and x.dtype == torch.bfloat16, num_warps=num_warps)
    return out


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::hadamard_rotate")
def _hadamard_op(x: torch.Tensor, fq4_block: int = 0) -> torch.Tensor:
    if not triton_can_run(x):
        raise cannot_run("minidi::hadamard_rotate", x)
    x2 = x.contiguous().view(-1, x.shape[-1])
    return launch(x2, torch.empty_like(x2), fq4_block).view(x.shape)


@_hadamard_op.register_fake
def _(x, fq4_block=0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def width_ok(n: int) -> bool:
    """The widths the kernel rotates: a power of two in [MIN_N, MAX_N]."""
    return MIN_N <= n <= MAX_N and n & (n - 1) == 0


def fq4_block_ok(block: int, n: int) -> bool:
    """The fq4 blocks the kernel quantises in: 0 (none) or a power of two from 2 to n (so it divides n)."""
    return type(block) is int and (block == 0 or (2 <= block <= n and block & (block - 1) == 0))


def check_args(op: str, x: torch.Tensor, fq4_block: int = 0) -> None:
    """x [..., n] of a dtype in ``X_DTYPES``, n a power of two in [MIN_N, MAX_N], ``fq4_block`` as ``fq4_block_ok``;
    else a ValueError naming ``op``."""
    if x.dim() < 1 or x.dtype not in X_DTYPES:
        raise ValueError(f"{op}: x must be [..., n] with dtype in {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    n = x.shape[-1]
    if not width_ok(n):
        raise ValueError(f"{op}: the rotated width n must be a power of two in [{MIN_N}, {MAX_N}], got {n}")
    if not fq4_block_ok(fq4_block, n):
        raise ValueError(f"{op}: fq4_block must be 0 (no fake quant) or a power of two in [2, n = {n}], got "
                         f"{fq4_block!r}")


def hadamard_rotate(x: torch.Tensor, fq4_block: int = 0, backend: str = "auto") -> torch.Tensor:
    """x [..., n] -> the model's Hadamard rotation of the last dim in x's dtype (see the module doc); ``fq4_block`` >
    0: its ``fq4_ue8m0`` in blocks of that many channels. ``backend``: "auto" (the kernel where it can run and x is
    bf16 / fp16, else the reference), "triton" or "ref"."""
    check_args("hadamard_rotate", x, fq4_block)
    if resolve_backend(backend, "hadamard_rotate", x) == "ref":
        return hadamard_ref(x, fq4_block)
    if x.dtype not in KERNEL_DTYPES:
        if backend == "triton":
            raise ValueError(f"hadamard_rotate: backend='triton' has no kernel for {x.dtype} x (bf16 / fp16 only: "
                             "S x is then exact in one dot); backend='auto' runs the reference")
        return hadamard_ref(x, fq4_block)
    return _hadamard_op(x, fq4_block)


__all__ = ["fq4_block_ok", "hadamard_ref", "hadamard_rotate", "launch", "scale_of", "signs", "width_ok"]
