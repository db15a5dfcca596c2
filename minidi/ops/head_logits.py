"""O: the output head's fp32 GEMM for the few rows a step returns logits for, reading the bf16 weight as it is.

    logits = head_logits(y, weight)        # = y.float() @ weight.float().t()   (the official fp32 head GEMM)

Why: the model's head casts its [V, D] bf16 weight to fp32 every step (V4.1-Flash: 129,280 x 5,120, 1.32 GB read,
2.65 GB written) and then runs cuBLAS's fp32 GEMV over the copy (2.65 GB read): H200 round 20, 1.94 ms for the casts
and 0.65 ms for the GEMV, for one logit row. The bytes that must move are the bf16 weight once: 0.32 ms at copy
bandwidth.

Kernel (Triton; the interpreter runs it on CPU tensors): one program per [ROWS, BV] tile of the logits, looping over
D in BD steps: the weight tile [BV, BD] upcast to fp32 (exact), the rows' [ROWS, BD] fp32 values, products summed
over the step in fp32 (exact products of a bf16 weight and a bf16 or fp32 y; each a single fp32 rounding for fp32
y), accumulated across steps in fp32. Only the summation order differs from the fp32 GEMM: error within the standard
bound D 2^-24 sum |y| |w| (the tests check it against an fp64 product). ROWS <= 8 logit rows share a weight read;
more rows take one program column per 8 (each reads the weight again).

Where it pays (H200 round 21, ``bench/bench_head_logits.py``, V 129,280, D 5,120): one row 0.870 ms (1,522 GB/s,
36 % of copy) against 2.473 ms for the model's code eagerly and 1.584 ms compiled; but 2.90 ms at 4 rows and 5.63 ms
at 8 (the [ROWS, BV, BD] product tile reduces badly), where the model's code takes 2.7-3.0 ms. So the op runs the
kernel for up to ``MAX_ROWS`` = 1 row (a prefill step of one sequence) and the reference GEMM for more, until the
kernel is tiled for them (a tensor-core tile with per-block promotion, as ``gate_tf32x3``, is the candidate).

Backends: "auto" (the kernel where it can run, else the reference), "triton", "ref" (``head_logits_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, resolve_backend, triton_can_run

DTYPES = (torch.bfloat16, torch.float32)
MAX_ROWS = 1  # above: the reference fp32 GEMM (a cast of the weight and cuBLAS), measured faster from 4 rows
_ROWS_PER_PROGRAM = 8
_TILE_ELEMENTS = 8192  # ROWS x BV x BD products per step: 64 fp32 registers a thread at 4 warps


def head_logits_ref(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The model's head GEMM: y [L, D] bf16 | fp32, weight [V, D] bf16 | fp32 -> [L, V] fp32."""
    return y.float() @ weight.float().t()


@fast_launch
@triton.jit
def _head_logits_kernel(y_ptr, w_ptr, out_ptr, L, V, D, stride_y, stride_w, stride_o,
                        ROWS: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    v = tl.program_id(0) * BV + tl.arange(0, BV)  # [BV] vocabulary rows
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # [ROWS] logit rows
    v_ok, r_ok = v < V, r < L
    w_rows = w_ptr + v.to(tl.int64)[:, None] * stride_w
    y_rows = y_ptr + r.to(tl.int64)[:, None] * stride_y
    acc = tl.zeros([ROWS, BV], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        d_ok = d < D
        w = tl.load(w_rows + d[None, :], mask=v_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BV, BD]
        y = tl.load(y_rows + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [ROWS, BD]
        acc += tl.sum(y[:, None, :] * w[None, :, :], axis=2)  # [ROWS, BV]
    out = out_ptr + r.to(tl.int64)[:, None] * stride_o + v[None, :]
    tl.store(out, acc, mask=r_ok[:, None] & v_ok[None, :])


def tile(rows: int) -> tuple[int, int, int]:
    """(ROWS, BV, BD) for ``rows`` logit rows: ROWS the next power of two up to 8, BD 128, BV from the tile budget."""
    r = min(triton.next_power_of_2(max(rows, 1)), _ROWS_PER_PROGRAM)
    bd = 128
    return r, max(_TILE_ELEMENTS // (r * bd), 8), bd


def launch(y: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    (rows, d), v = y.shape, weight.shape[0]
    if not (rows and v):
        return
    r, bv, bd = tile(rows)
    grid = (triton.cdiv(v, bv), triton.cdiv(rows, r))
    _head_logits_kernel[grid](y, weight, out, rows, v, d, y.stride(0), weight.stride(0), out.stride(0),
                              ROWS=r, BV=bv, BD=bd, num_warps=4, num_stages=3)


@dispatch_op("minidi::head_logits")
def _head_logits_op(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if not triton_can_run(y, weight):
        raise cannot_run("minidi::head_logits", y, weight)
    if y.shape[0] > MAX_ROWS:
        return head_logits_ref(y, weight)
    y = y if y.stride(-1) == 1 else y.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((y.shape[0], weight.shape[0]), dtype=torch.float32, device=y.device)
    launch(y, weight, out)
    return out


@_head_logits_op.register_fake
def _(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return y.new_empty((y.shape[0], weight.shape[0]), dtype=torch.float32)


@dispatch_op("minidi::head_logits_ref")
def _head_logits_ref_op(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return head_logits_ref(y, weight)


@_head_logits_ref_op.register_fake
def _(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return y.new_empty((y.shape[0], weight.shape[0]), dtype=torch.float32)


def head_logits(y: torch.Tensor, weight: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """y [L, D] bf16 | fp32, weight [V, D] bf16 | fp32 -> [L, V] fp32 = y.float() @ weight.float().t(), up to the
    fp32 summation order. ``backend``: "auto" | "triton" | "ref"."""
    if y.dim() != 2 or y.dtype not in DTYPES:
        raise ValueError(f"head_logits: y must be [L, D] in {DTYPES}, got {tuple(y.shape)} {y.dtype}")
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.shape[1] != y.shape[1]:
        raise ValueError(f"head_logits: weight must be [V, D] = [V, {y.shape[1]}] in {DTYPES}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if y.device != weight.device:
        raise ValueError(f"head_logits: y and weight must share a device, got {y.device}, {weight.device}")
    if resolve_backend(backend, "head_logits", y, weight) == "ref":
        return _head_logits_ref_op(y, weight)
    return _head_logits_op(y, weight)
