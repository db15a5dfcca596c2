"""fq8 as an op: the model's e4m3 fake quant of an activation (``quant.fq8``), in the activation's dtype.

    y = fq8(x, block)          # x [..., K] bf16 | fp32, K a multiple of block (32 | 128) -> y like x
    # per block of ``block`` consecutive elements along K: s = 2^ceil(log2(max(amax, 1e-4) / 448)),
    # y = e4m3(clamp(x / s, +-448)) * s, rounded once to x's dtype (exact: an e4m3 value times a power of two)

Users: ``fp8_linear`` (pass N) runs the kernel on its input when its ``act_block`` is set; pass R inserts this op
once where several FP8 linears read one input with one act_block, and calls them with -act_block (its result is
then "x as it is", known to be fq8 in those blocks): ``fq8(x)`` once instead of once per linear, the same bits
(``docs/passes.md``).

Kernel ``_fq8_kernel`` (Triton; the interpreter runs it on CPU tensors), memory-bound: one program per ``BLOCKS``
blocks of the row-major input; amax per block, the scale from its bits (``pow2_ceil``), the quotient by 1 / scale (a
power of two: exact), the e4m3 rounding in fp32 (``round_e4m3``: exact, ties to even), times the scale, one rounding
to x's dtype. So the output is ``fq8(x)`` bit for bit on finite blocks; a block holding a NaN or an infinity comes out
all NaN (eager fq8 gives NaN or a signed zero per element there). Reads and writes x's bytes once each.

Backends: "auto" (the kernel where it can run, else the reference), "triton", "ref" (``fq8_ref``: plain torch from
``minidi.formats``, behind an opaque op so that a CPU graph holds one node too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minidi.formats import E4M3_MAX, FQ8_AMAX_FLOOR, fq8_split

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_formats import pow2_ceil, round_e4m3
from ._triton_utils import cannot_run, resolve_backend, triton_can_run

X_DTYPES = (torch.bfloat16, torch.float32)  # the model's dtypes
BLOCKS = (32, 128)  # fq8 block sizes along K (V4.1: 32, V4: 128)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(FQ8_AMAX_FLOOR)


# ---- reference -----------------------------------------------------------------------------------------------------
def fq8_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """The model's ``quant.fq8(x, block)``: q * s of ``minidi.formats.fq8_split``, in x's dtype."""
    q, s = fq8_split(x, block)
    return (q.float().unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


# ---- kernel --------------------------------------------------------------------------------------------------------
@triton.jit
def fq8_blocks(x):
    """fq8 of each row of x [N, BLOCK] fp32 (a row is one fq8 block), in fp32: e4m3(clamp(x / s, +-448)) * s; a
    block holding a NaN or an infinity comes out all NaN. Shared with the fused gather
    (``moe_gather.gather_rows_fq8``), so the two cannot drift apart."""
    a = tl.abs(x)
    bad = tl.max(((a != a) | (a == float("inf"))).to(tl.int32), 1) > 0  # a NaN or an infinity: poisoned block
    amax = tl.maximum(tl.max(tl.where(a == a, a, 0.0), 1), _AMAX_FLOOR)
    s = pow2_ceil(tl.div_rn(amax, _E4M3_MAX))  # [N]
    inv = ((254 - ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True)  # 1 / s
    q = round_e4m3(tl.minimum(tl.maximum(x * inv[:, None], -_E4M3_MAX), _E4M3_MAX))
    return tl.where(bad[:, None], float("nan"), q * s[:, None])


@fast_launch
@triton.jit
def _fq8_kernel(x_ptr, y_ptr, n_blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS] block ids
    ok = b < n_blocks
    offs = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)  # [BLOCKS, BLOCK]
    tl.store(y_ptr + offs, fq8_blocks(x).to(y_ptr.dtype.element_ty), mask=ok[:, None])


def fq8_launch(x: torch.Tensor, block: int) -> torch.Tensor:
    """fq8 of a contiguous x (last dim a multiple of ``block``) by ``_fq8_kernel``; the result is contiguous."""
    y = torch.empty_like(x)
    n_blocks = x.numel() // block
    if n_blocks:
        blocks = 32 if block == 32 else 8
        _fq8_kernel[(triton.cdiv(n_blocks, blocks),)](x, y, n_blocks, BLOCK=block, BLOCKS=blocks, num_warps=4)
    return y


def check(x: torch.Tensor, block: int, op: str = "fq8") -> None:
    """fq8's input rules (dtype, block size, K a multiple of it), errors named after ``op`` (a fused user's name)."""
    if x.dim() < 1 or x.dtype not in X_DTYPES:
        raise ValueError(f"{op}: x must be [..., K] with dtype in {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if block not in BLOCKS:
        raise ValueError(f"{op}: block must be one of {BLOCKS}, got {block}")
    if x.shape[-1] % block:
        raise ValueError(f"{op}: the last dim {x.shape[-1]} is not a multiple of block {block} (blocks along K)")


# ---- custom ops ----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::fq8")
def _fq8_op(x: torch.Tensor, block: int) -> torch.Tensor:
    if not triton_can_run(x):
        raise cannot_run("minidi::fq8", x)
    return fq8_launch(x.contiguous(), block)


@_fq8_op.register_fake
def _(x, block):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@dispatch_op("minidi::fq8_ref")
def _fq8_ref_op(x: torch.Tensor, block: int) -> torch.Tensor:
    return fq8_ref(x, block).contiguous()


@_fq8_ref_op.register_fake
def _(x, block):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def fq8(x: torch.Tensor, block: int, backend: str = "auto") -> torch.Tensor:
    """x [..., K] bf16 | fp32, block 32 | 128 dividing K -> [..., K] contiguous in x's dtype, equal bit for bit to
    the model's ``quant.fq8(x, block)`` on finite blocks (see the module doc). ``backend``: "auto" | "triton" |
    "ref"."""
    check(x, block)
    if resolve_backend(backend, "fq8", x) == "ref":
        return _fq8_ref_op(x, block)
    return _fq8_op(x, block)
