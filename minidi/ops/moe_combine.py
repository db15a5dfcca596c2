"""MoE combine: sum each token's k expert-output rows in slot order, reading only rows of local experts.

Replaces (pass target C, ``minidi.model.moe.moe_combine_naive``)::

    r = where(local[:, None], rows.float(), 0)          # [R, D]
    slots = zeros_like(r).index_copy_(0, order, r)       # [R, D] token-slot order
    out = slots.view(T, k, D).sum(1)                     # [T, D] fp32

with two small kernels and no host sync:

1. ``_invert_kernel``: ``slot_row[order[i]] = i if local[i] else -1`` (the inverse permutation, with non-local rows
   already masked out; slots that no row maps to stay -1 from a fill).
2. ``_combine_kernel``: one program per [BLOCK_T tokens, BLOCK_D columns] tile; for slot j = 0..k-1 (unrolled) it
   gathers ``rows[slot_row[t*k + j], d]`` with a *masked* load (rows of non-local experts are never read, so their
   NaN/garbage cannot leak, not even as 0*NaN), adds it to an fp32 accumulator in slot order and stores the tile once.

Each output element is summed by one thread in the fixed order 0 + s_0 + s_1 + ... + s_{k-1}, the same order as the
naive ``sum(dim=1)``: results are bitwise identical across runs, and equal to the naive combine (bitwise on the CPU
interpreter; <= 1e-6 relative wherever torch's reduction order differs).

Bytes at the V4.1-Flash bench shape (T 4,096, k 6, D 5,120, bf16 rows): local rows read once (R_local * D * 2) plus
the fp32 output written once (T * D * 4 = 84 MB); EP4 (1/4 local): 63 + 84 = 147 MB (~35 us at 4.2 TB/s); all local:
252 + 84 = 336 MB (~80 us). The inverse costs R * 13 bytes (negligible) and two launches. In the emulated EP4 step
the combine runs over the dispatch of all four ranks (T 16,384, R 98,304, a quarter local): 252 MB of local rows
read and 336 MB of fp32 written, ~588 MB a call, 0.202 ms on an H100 (97 % of its measured copy peak; round 26's
kernel table, ``bench/minidi_work.py``).

Legend: T tokens, k slots per token, R = T*k routed rows, D model width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, resolve_backend, triton_can_run

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- reference -----------------------------------------------------------------------------------------------------
def moe_combine_ref(rows: torch.Tensor, order: torch.Tensor, local: torch.Tensor, k: int) -> torch.Tensor:
    """Plain torch (the naive combine). rows [R, D], order [R] int64, local [R] bool -> [T, D] fp32, T = R // k.
    A deliberate twin of ``minidi.model.moe.moe_combine_naive`` (the ops import nothing of the model);
    ``tests/ops/test_moe_combine.py::test_ref_is_the_model_naive_function`` holds the two bit-equal."""
    r = rows.float()
    r = torch.where(local.unsqueeze(-1), r, torch.zeros_like(r))
    slots = torch.zeros_like(r).index_copy_(0, order, r)  # [R, D] in token-slot order
    return slots.view(-1, k, r.shape[-1]).sum(dim=1)


# ---- kernels -------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _invert_kernel(order_ptr, local_ptr, slot_row_ptr, R, BLOCK: tl.constexpr):
    """slot_row[order[i]] = i if local[i] else -1, for i in this block."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < R
    slot = tl.load(order_ptr + i, mask=m, other=0)
    is_local = tl.load(local_ptr + i, mask=m, other=0) != 0
    tl.store(slot_row_ptr + slot, tl.where(is_local, i, -1).to(tl.int32), mask=m)


@fast_launch
@triton.jit
def _combine_kernel(rows_ptr, slot_row_ptr, out_ptr, T, D, stride_r, stride_o,
                    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, d] = sum_{j<K} rows[slot_row[t*K + j], d] (fp32, slot order); slot_row < 0 contributes 0 unread."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    t_ok = t < T
    d_ok = d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(slot_row_ptr + t * K + j, mask=t_ok, other=-1)  # [BT] int32, -1: nothing to read
        ptrs = rows_ptr + row.to(tl.int64)[:, None] * stride_r + d[None, :]  # [BT, BD]
        m = (row >= 0)[:, None] & d_ok[None, :]
        acc += tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + t.to(tl.int64)[:, None] * stride_o + d[None, :]
    tl.store(out_ptrs, acc, mask=t_ok[:, None] & d_ok[None, :])


# ---- launchers -----------------------------------------------------------------------------------------------------
def default_config(d: int, dtype: torch.dtype) -> dict:
    """(BLOCK_T, BLOCK_D, num_warps) for the combine kernel: 16-byte loads, ~4-8 KB in flight per slot per program."""
    block_d = min(1024 if dtype != torch.float32 else 512, triton.next_power_of_2(max(d, 16)))
    return dict(BLOCK_T=2, BLOCK_D=block_d, num_warps=4)


def invert_slots(order: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """order [R] int64 (permutation of 0..R-1), local [R] bool -> slot_row [R] int32 (row of each slot, -1: skip)."""
    r = order.numel()
    slot_row = torch.full((r,), -1, dtype=torch.int32, device=order.device)
    if r:
        block = 1024
        _invert_kernel[(triton.cdiv(r, block),)](order, local.view(torch.uint8), slot_row, r, BLOCK=block, num_warps=4)
    return slot_row


def combine_from_slots(rows: torch.Tensor, slot_row: torch.Tensor, k: int, out: torch.Tensor | None = None,
                       **config) -> torch.Tensor:
    """rows [R, D] (unit stride in D), slot_row [T*k] int32 -> [T, D] fp32. ``config`` overrides the tile shape."""
    r, d = rows.shape
    t = slot_row.numel() // k
    if out is None:
        out = torch.empty((t, d), dtype=torch.float32, device=rows.device)
    cfg = default_config(d, rows.dtype) | config
    if t and d:
        grid = (triton.cdiv(t, cfg["BLOCK_T"]), triton.cdiv(d, cfg["BLOCK_D"]))
        _combine_kernel[grid](rows, slot_row, out, t, d, rows.stride(0), out.stride(0), K=k,
                              BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"])
    return out


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::moe_combine")
def _moe_combine_op(rows: torch.Tensor, order: torch.Tensor, local: torch.Tensor, k: int) -> torch.Tensor:
    if not triton_can_run(rows, order, local):
        raise cannot_run("minidi::moe_combine", rows, order, local)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    return combine_from_slots(rows, invert_slots(order.contiguous(), local.contiguous()), k)


@_moe_combine_op.register_fake
def _(rows: torch.Tensor, order: torch.Tensor, local: torch.Tensor, k: int) -> torch.Tensor:
    return rows.new_empty((rows.shape[0] // k, rows.shape[1]), dtype=torch.float32)


def _check(rows: torch.Tensor, order: torch.Tensor, local: torch.Tensor, k: int) -> None:
    if rows.dim() != 2 or rows.dtype not in ROW_DTYPES:
        raise ValueError(f"moe_combine: rows must be [R, D] in {ROW_DTYPES}, got {tuple(rows.shape)} {rows.dtype}")
    r = rows.shape[0]
    if not isinstance(k, int) or k < 1 or r % k:
        raise ValueError(f"moe_combine: k must be a positive int dividing R = {r}, got {k!r}")
    if order.shape != (r,) or order.dtype != torch.int64:
        raise ValueError(f"moe_combine: order must be [R] = [{r}] int64, got {tuple(order.shape)} {order.dtype}")
    if local.shape != (r,) or local.dtype != torch.bool:
        raise ValueError(f"moe_combine: local must be [R] = [{r}] bool, got {tuple(local.shape)} {local.dtype}")
    if not (rows.device == order.device == local.device):
        raise ValueError(f"moe_combine: rows, order, local must share a device, got {rows.device}, {order.device}, "
                         f"{local.device}")


def moe_combine(rows: torch.Tensor, order: torch.Tensor, local: torch.Tensor, k: int,
                backend: str = "auto") -> torch.Tensor:
    """Sum each token's k expert rows in slot order, skipping rows of non-local experts.

    rows [R, D] bf16/fp16/fp32: expert outputs in sorted-row order (rows of non-local experts may hold anything);
    order [R] int64: the token-slot index t*k + slot of each sorted row, a permutation of 0..R-1 (``argsort``'s
    output; not checked, that would need a host sync); local [R] bool: the row was computed by a local expert.
    Returns [T, D] fp32, T = R // k. The inverse permutation is computed inside (device-side scatter, no sync).
    ``backend``: "auto" (the kernel where it can run, else the reference), "triton" or "ref" (plain torch).
    """
    _check(rows, order, local, k)
    if resolve_backend(backend, "moe_combine", rows, order, local) == "ref":
        return moe_combine_ref(rows, order, local, k)
    return _moe_combine_op(rows, order, local, k)
