"""MoE dispatch gather on the local rows only: ``x[idx]`` for the rows below offs[-1].

The model sorts the T x k routed (token, slot) pairs by expert and gathers one row of the token activations per pair
(``minidi.model.moe.RoutedExperts.forward``)::

    xs = x[order // k]                 # [R, D]: every dispatched row, R = T k (EP N: N times the rank's tokens)
    g = grouped_mm(xs, w1, offs)       # the only readers of xs: the w1 / w3 grouped GEMMs, which read rows
    v = grouped_mm(xs, w3, offs)       # below offs[-1] only (this rank's experts)

At emulated EP4 three quarters of those rows belong to other ranks' experts and are never read. ``gather_rows(x,
idx, offs)`` copies only the rows below offs[-1] and leaves the rest unwritten, as the grouped GEMMs do with their
own outputs. Inserted by pass I (``minidi/passes/rewrite_moe_gather.py``).

``gather_rows_fq8(x, idx, offs, block)`` is ``fq8(x, block)[idx]`` on those rows in the same pass (pass L's bf16
route: the experts' w1 / w3 read the fq8 values as bf16 rows): each local row is read once and written quantised,
with ``minidi::fq8``'s arithmetic (``fq8.fq8_blocks``), instead of an fq8 of all T rows written and read back.

Kernel: one program per [BR rows, BD columns] tile. A program whose rows all lie past offs[-1] (read on the device,
no host sync) returns at once. An index outside [0, T) gives a row of NaN (a loud wrong answer, never a read out of
bounds); the ref backend and CPU tensors raise instead.

Bytes at V4.1-Flash EP4 (R 98,304 rows, 1/4 local, D 5,120 bf16): the local rows' 252 MB read and 252 MB written;
the whole-R gather moves four times that. ``gather_rows_fq8`` moves the same bytes: 0.23 ms a call in round 25's step
on an H100 (~2.2 TB/s, 73 % of the measured copy peak), where fq8_split, q * s and the gather took 0.34 ms.

Legend: T token rows of x, R gathered rows, D columns, E local experts, BR/BD tile sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import fq8 as fq8_op
from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, local_row_count, resolve_backend, triton_can_run
from .fq8 import fq8_blocks

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)  # e4m3: fq8_split's values
_E4M3_NAN = tl.constexpr(0x7F)  # the e4m3 byte of NaN: the poison of an out-of-range index in an e4m3 gather
IDX_DTYPES = (torch.int32, torch.int64)


# ---- reference -----------------------------------------------------------------------------------------------------
def gather_rows_ref(x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Plain torch: every row gathered (rows past offs[-1] come out computed, not garbage)."""
    return x[idx.long()]


# ---- kernel --------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _gather_rows_kernel(x_ptr, idx_ptr, offs_ptr, out_ptr, T, R, D, E, stride_x, stride_o,
                        BR: tl.constexpr, BD: tl.constexpr, BYTES: tl.constexpr, QUANT: tl.constexpr,
                        BLOCK: tl.constexpr):
    # the local-rows tile prologue, a deliberate twin of moe_activation's kernel (Triton inlines no shared
    # block-index helper that returns several tensors as cheaply as these six lines)
    n_rows = local_row_count(offs_ptr, E, R)
    r0 = tl.program_id(0) * BR
    if r0 < n_rows:  # a tile past this rank's rows returns at once
        rows = r0 + tl.arange(0, BR)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        rm = rows < n_rows
        cm = cols < D
        src = tl.load(idx_ptr + rows, mask=rm, other=0).to(tl.int64)
        ok = rm & (src >= 0) & (src < T)  # out of range: NaN row, never an out-of-bounds read
        if BYTES:  # e4m3 rows as raw bytes (uint8 views): NaN is the byte 0x7F
            v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=ok[:, None] & cm[None, :],
                        other=_E4M3_NAN)
        else:
            v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=ok[:, None] & cm[None, :],
                        other=float("nan"))
        if QUANT:  # each row's blocks of BLOCK columns through minidi::fq8's arithmetic (BD a multiple of BLOCK)
            v = tl.reshape(fq8_blocks(tl.reshape(v.to(tl.float32), [BR * BD // BLOCK, BLOCK])), [BR, BD])
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], v.to(out_ptr.dtype.element_ty),
                 mask=rm[:, None] & cm[None, :])


def launch(x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, fq8_block: int = 0) -> None:
    """Checked tensors (x, out with unit column stride, idx / offs contiguous). Writes the rows of ``out`` below
    offs[-1] only (tests pass a poisoned ``out``); ``fq8_block`` > 0: each written row is fq8 of x's row."""
    r, d = out.shape
    if r == 0 or d == 0:
        return
    br = 16 if x.is_cuda else 8
    # GPU copy tiles of 1,024 columns; quantising ones of 256 (62 registers a thread on sm_90, where 1,024 take all
    # 255: the fp32 block arithmetic holds the tile)
    bd = max(min((256 if fq8_block else 1024) if x.is_cuda else 64, triton.next_power_of_2(d)), fq8_block)
    grid = (triton.cdiv(r, br), triton.cdiv(d, bd))
    byte_rows = x.dtype == torch.float8_e4m3fn  # copied as bytes (the interpreter has no fp8 arrays)
    if byte_rows:
        x, out = x.view(torch.uint8), out.view(torch.uint8)
    _gather_rows_kernel[grid](x, idx, offs, out, x.shape[0], r, d, offs.numel(), x.stride(0), out.stride(0),
                              BR=br, BD=bd, BYTES=byte_rows, QUANT=fq8_block > 0, BLOCK=max(fq8_block, 1),
                              num_warps=4)


def _check(x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"gather_rows: {what}")

    if x.dim() != 2 or x.dtype not in X_DTYPES:
        fail(f"x must be [T, D] with dtype in {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if idx.dim() != 1 or idx.dtype not in IDX_DTYPES:
        fail(f"idx must be [R] int32/int64 (the x row of each output row), got {tuple(idx.shape)} {idx.dtype}")
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.numel() == 0:
        fail(f"offs must be [E] int32 with E >= 1 (cumulative row ends), got {tuple(offs.shape)} {offs.dtype}")
    devs = {t.device for t in (x, idx, offs)}
    if len(devs) != 1:
        fail(f"x, idx and offs must be on one device, got {sorted(map(str, devs))}")


# ---- custom ops ----------------------------------------------------------------------------------------------------
def _gathered(op: str, x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor, fq8_block: int) -> torch.Tensor:
    """The body of both ops: the kernel's rows below offs[-1] (an index out of range raises on CPU tensors)."""
    if not triton_can_run(x, idx, offs):
        raise cannot_run(f"minidi::{op}", x, idx, offs)
    if idx.device.type == "cpu" and idx.numel():  # real tensors here (the op body), so a host check costs no sync
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= x.shape[0]:
            raise IndexError(f"{op}: idx holds {lo if lo < 0 else hi}, outside x's {x.shape[0]} rows")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(idx.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    launch(x, idx.contiguous(), offs.contiguous(), out, fq8_block)
    return out


@dispatch_op("minidi::gather_rows")
def _gather_rows_op(x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _gathered("gather_rows", x, idx, offs, 0)


@_gather_rows_op.register_fake
def _(x, idx, offs):
    return x.new_empty(idx.shape[0], x.shape[1])


@dispatch_op("minidi::gather_rows_fq8")
def _gather_rows_fq8_op(x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor, block: int) -> torch.Tensor:
    return _gathered("gather_rows_fq8", x, idx, offs, block)


@_gather_rows_fq8_op.register_fake
def _(x, idx, offs, block):
    return x.new_empty(idx.shape[0], x.shape[1])


def gather_rows(x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """[R, D] in x's dtype: row r = x[idx[r]] for r < offs[-1]; the rows past it are not written (garbage), as with
    the grouped GEMMs that read them. x [T, D] bf16 | fp16 | fp32 | float8_e4m3fn; idx [R] int32 | int64 in [0, T)
    (checked on CPU tensors; on the GPU an index out of range gives a NaN row, e4m3 NaN bytes in an e4m3 gather);
    offs [E] int32 cumulative row ends. ``backend``: "auto" (the kernel where it can run, else the reference),
    "triton" or "ref" (plain torch, every row gathered; an index out of range raises there)."""
    _check(x, idx, offs)
    if resolve_backend(backend, "gather_rows", x, idx, offs) == "ref":
        return gather_rows_ref(x, idx, offs)
    return _gather_rows_op(x, idx, offs)


def gather_rows_fq8(x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor, block: int,
                    backend: str = "auto") -> torch.Tensor:
    """``fq8(x, block)[idx]`` on the rows below offs[-1] in one pass: each local row read once from x and written
    once quantised (the model's ``x = fq8(x); xs = x[idx]``, without the [T, D] fq8 result in between). x [T, D]
    bf16 | fp32 with D a multiple of ``block`` (32 | 128); the rest as ``gather_rows``. Bit for bit ``minidi::fq8``
    of the gathered rows: the model's fq8 on finite blocks, all NaN for a block holding a NaN or an infinity (as is
    a row of an index out of range, from the kernel). ``backend`` "ref": plain torch on every row."""
    _check(x, idx, offs)
    fq8_op.check(x, block, "gather_rows_fq8")
    if resolve_backend(backend, "gather_rows_fq8", x, idx, offs) == "ref":
        return fq8_op.fq8_ref(gather_rows_ref(x, idx, offs), block)
    return _gather_rows_fq8_op(x, idx, offs, block)
