"""Top-k of short rows with exact ties to the lowest index: ``minidi.selection.topk_lowest_index`` in one kernel.

The router picks k = 6 of E = 384 experts per token (``minidi.model.moe.Gate``) with
``topk_lowest_index(s + bias, k)``. In plain torch that is two ``torch.topk`` passes, two sorts, three gathers and
the masks between them (``minidi/selection.py``): ~14 launches per MoE layer, 4.6 ms of a V4.1 EP4 step on the
H200 for 16,384 x 384 values (round 21's kernel table). ``row_topk`` reads each row once and writes the k picks.
Inserted by pass P (``minidi/passes/rewrite_row_topk.py``).

Kernel: one program per BR rows; the row's N values sit in registers (N <= ``MAX_N``). k rounds, each: the largest
value still unpicked, then the lowest unpicked index holding it. So the picks come out in descending order, equal
values by ascending index: the reference's order. NaN ranks as +inf (ties with +inf by index), -0.0 ties with +0.0,
-inf values are picked (lowest indices first) when fewer than k are larger; each value is read back from x, so its
bits (NaN payload, the sign of zero) are the input's.

Legend: R rows (the leading dims flattened), N values per row, k picks, BR/BN tile sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minidi.selection import topk_lowest_index

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, resolve_backend, triton_can_run

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_N = 4096  # longer rows run the reference (the registers of one row per program)


# ---- reference -----------------------------------------------------------------------------------------------------
def row_topk_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: ``minidi.selection.topk_lowest_index``."""
    return topk_lowest_index(x, k)


# ---- kernel --------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _row_topk_kernel(x_ptr, val_ptr, idx_ptr, R, N, K, stride_x, BR: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BN)
    rm = rows < R
    base = x_ptr + rows.to(tl.int64) * stride_x
    x = tl.load(base[:, None] + cols[None, :], mask=rm[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
    key = tl.where(x != x, float("inf"), x)  # [BR, BN]: NaN ranks as +inf (compared in fp32: interpreter-safe)
    live = (cols < N)[None, :] & rm[:, None]  # [BR, BN]: a real value, not picked yet
    out = rows.to(tl.int64) * K
    for r in range(K):
        m = tl.max(tl.where(live, key, float("-inf")), axis=1)  # [BR] the largest unpicked (-inf: all left are)
        j = tl.min(tl.where(live & (key == m[:, None]), cols[None, :], BN), axis=1)  # [BR] its lowest index
        live = live & (cols[None, :] != j[:, None])
        ok = rm & (j < N)
        tl.store(val_ptr + out + r, tl.load(base + j, mask=ok), mask=ok)  # the input's own bits
        tl.store(idx_ptr + out + r, j.to(tl.int64), mask=ok)


def launch(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor) -> None:
    """Checked tensors: x [R, N] with unit column stride, N <= MAX_N; values [R, k] (x's dtype) and indices [R, k]
    int64, contiguous. Writes every element of both (tests pass poisoned outputs)."""
    r, n = x.shape
    if r == 0 or k == 0:
        return
    bn = triton.next_power_of_2(n)
    br = max(1, min(16, 4096 // bn)) if x.is_cuda else max(1, min(4, 256 // bn))
    _row_topk_kernel[(triton.cdiv(r, br),)](x, values, indices, r, n, k, x.stride(0), BR=br, BN=bn,
                                           num_warps=4 if bn * br >= 2048 else 2)


def _check(x: torch.Tensor, k: int) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"row_topk: {what}")

    if x.dim() < 1 or x.dtype not in X_DTYPES:
        fail(f"x must be [..., N] with dtype in {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= x.shape[-1]:
        fail(f"k must be an int in [0, N = {x.shape[-1]}], got {k!r}")


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::row_topk")
def _row_topk_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not triton_can_run(x):
        raise cannot_run("minidi::row_topk", x)
    lead, n = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    values = torch.empty(x2.shape[0], k, dtype=x.dtype, device=x.device)
    indices = torch.empty(x2.shape[0], k, dtype=torch.int64, device=x.device)
    launch(x2, k, values, indices)
    return values.view(*lead, k), indices.view(*lead, k)


@_row_topk_op.register_fake
def _(x, k):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


def row_topk(x: torch.Tensor, k: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``minidi.selection.topk_lowest_index(x, k)``: (values, indices) [..., k], values descending, equal values in
    ascending index order, NaN ranked as +inf. x [..., N] fp32 | bf16 | fp16; 0 <= k <= N. ``backend``: "auto" (the
    kernel where it can run and N <= MAX_N, else the reference), "triton" (raises where it cannot run) or "ref"."""
    _check(x, k)
    if resolve_backend(backend, "row_topk", x) == "ref" or (backend == "auto" and x.shape[-1] > MAX_N):
        return row_topk_ref(x, k)
    if x.shape[-1] > MAX_N:
        raise ValueError(f"row_topk: backend='triton' takes rows of N <= {MAX_N} values, got N = {x.shape[-1]}; "
                         "use backend='auto' (the reference for longer rows)")
    return _row_topk_op(x, k)
