"""The sm_90 expert GEMMs' per-weight-tensor checks decided on the device, with no host sync: the FP8 kernel's
weight-scale fold (``fp8_grouped_gemm.fp8_fp4_grouped_mm`` uses it when it is not given a base) and the bf16
kernel's code range (``fp4_grouped_gemm_hopper.range_gate``), cached per weight tensor (``cached_per_tensor``), and the
two offs copies that pick the fast or the exact kernel (``gate_offs``). The code range is also read on the host once
per weight tensor (``code_range_known``: one sync at its first call), so the bf16 op launches only the kernel that
runs; the device gate stays for calls that may not sync (a CUDA graph being captured).

``fold_fp4_rows`` (``fp8_grouped_gemm_sm90.py``) gives the per-row base, or None when a row cannot fold: one host
sync. Here the same base comes from one pass over the E8M0 codes on the device, with a
device flag set when some row cannot fold; per call, a one-program kernel writes two copies of ``offs``: the folded
Gluon kernel's (``offs``, or all zeros when a row does not fold: it then runs no tile) and the exact Triton kernel's
(the reverse). Both kernels are launched every call; the one that must not run finds no rows. The fold is cached per
weight-scale tensor (weights are constant), so a call costs one tiny launch after the first.

Legend: E experts, N weight rows (output columns), NB = K / 32 scale blocks per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._fast_launch import fast_launch
from ._weight_cache import cached_per_tensor
from .fp8_grouped_gemm_sm90 import FOLD_SPAN

@fast_launch
@triton.jit
def _fold_rows_kernel(ws_ptr, base_ptr, bad_ptr, ROWS, NB, BR: tl.constexpr, NB_P2: tl.constexpr,
                      SPAN: tl.constexpr):
    """Per weight row (E8M0 codes [ROWS, NB]): base = min(min_b c + 5, 254) (``fold_fp4_rows``); a row that cannot
    fold (codes spanning more than SPAN, or a 255) sets *bad_ptr to 1."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, NB_P2)
    rm = rows < ROWS
    m = rm[:, None] & (cols < NB)[None, :]
    c = tl.load(ws_ptr + rows.to(tl.int64)[:, None] * NB + cols[None, :], mask=m, other=0).to(tl.int32)
    lo = tl.min(tl.where(m, c, 255), 1)
    hi = tl.max(tl.where(m, c, 0), 1)
    tl.store(base_ptr + rows, tl.minimum(lo + 5, 254), mask=rm)
    bad = tl.max(((hi - lo > SPAN) | (hi >= 255)).to(tl.int32) & rm.to(tl.int32), 0)
    if bad != 0:
        tl.atomic_max(bad_ptr, bad)


@fast_launch
@triton.jit
def _gate_offs_kernel(offs_ptr, bad_ptr, fold_offs_ptr, exact_offs_ptr, E, E_P2: tl.constexpr):
    """offs for the folded kernel (offs, or all zeros = no rows, when some row does not fold) and for the exact
    kernel (the reverse): each kernel runs no tile unless it is the one that must."""
    e = tl.arange(0, E_P2)
    o = tl.load(offs_ptr + e, mask=e < E, other=0)
    bad = tl.load(bad_ptr)
    tl.store(fold_offs_ptr + e, tl.where(bad != 0, 0, o), mask=e < E)
    tl.store(exact_offs_ptr + e, tl.where(bad != 0, o, 0), mask=e < E)


def fold_rows(w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(base [E, N] int32, bad [1] int32: 1 when some row cannot fold), on the device: one pass over the codes."""
    e, n, nb = w_scale.shape
    codes = w_scale.contiguous().view(torch.uint8)
    base = torch.empty(e, n, dtype=torch.int32, device=w_scale.device)
    bad = torch.zeros(1, dtype=torch.int32, device=w_scale.device)
    br = 32
    _fold_rows_kernel[(triton.cdiv(e * n, br),)](codes, base, bad, e * n, nb, BR=br,
                                                 NB_P2=triton.next_power_of_2(nb), SPAN=FOLD_SPAN, num_warps=4)
    return base, bad


def cached_fold_rows(w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fold_rows`` once per weight-scale tensor (``cached_per_tensor``). A stale entry cannot give a silently wrong
    result: any base whose offsets stay in [-5, 6] is exact, and the kernel decodes an out-of-range block to NaN."""
    return cached_per_tensor("fold_rows", w_scale, fold_rows)


def gate_offs(offs: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(offs for the fast kernel, offs for the exact kernel): ``offs`` and zeros when ``bad`` (a [1] int32 device
    flag) is 0, else the reverse; one tiny launch, no host sync."""
    e = offs.shape[0]
    fast_offs, exact_offs = torch.empty_like(offs), torch.empty_like(offs)
    _gate_offs_kernel[(1,)](offs, bad, fast_offs, exact_offs, e, E_P2=triton.next_power_of_2(e), num_warps=1)
    return fast_offs, exact_offs


@fast_launch
@triton.jit
def _code_range_kernel(ws_ptr, bad_ptr, NUMEL, LO: tl.constexpr, HI: tl.constexpr, BLOCK: tl.constexpr):
    """*bad_ptr = 1 when some E8M0 code is outside [LO, HI] and not 255 (NaN)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.load(ws_ptr + i, mask=i < NUMEL, other=LO).to(tl.int32)
    bad = tl.max(((c < LO) | ((c > HI) & (c != 255))).to(tl.int32), 0)
    if bad != 0:
        tl.atomic_max(bad_ptr, bad)


def code_range_flag(w_scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """[1] int32 on the device: 1 when some code of ``w_scale`` is outside [lo, hi] and not 255; one pass."""
    codes = w_scale.contiguous().view(torch.uint8).reshape(-1)
    bad = torch.zeros(1, dtype=torch.int32, device=w_scale.device)
    block = 4096
    _code_range_kernel[(max(1, triton.cdiv(codes.numel(), block)),)](codes, bad, codes.numel(), LO=lo, HI=hi,
                                                                    BLOCK=block)
    return bad


def code_range_known(w_scale: torch.Tensor, lo: int, hi: int) -> bool | None:
    """Whether every code of ``w_scale`` is in [lo, hi] or 255, read on the host once per weight-scale tensor
    (``cached_per_tensor``: one host sync at the tensor's first call, none after). None where the answer cannot be
    kept or fetched: a tensor without a version counter (``torch.inference_mode``: it would sync every call) or a
    CUDA graph being captured (no sync may run); the caller then gates on the device (``code_range_gate``)."""
    if w_scale.is_inference() or _capturing(w_scale):
        return None
    return cached_per_tensor(f"code_range host {lo}..{hi}", w_scale,
                             lambda w: not bool(code_range_flag(w, lo, hi).item()))


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def code_range_gate(w_scale: torch.Tensor, offs: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offs for the fast kernel, offs for the exact kernel) by ``code_range_flag`` (cached per weight-scale tensor,
    ``cached_per_tensor``): a call costs one tiny launch, no host sync."""
    bad = cached_per_tensor(f"code_range {lo}..{hi}", w_scale, lambda w: code_range_flag(w, lo, hi))
    return gate_offs(offs, bad)


def fold_gate(w_scale: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side ``fold_fp4_rows`` with no host sync: (base [E, N] int32, offs for the folded kernel, offs for the
    exact kernel). When every row folds, the first offs is ``offs`` and the second all zeros (the exact kernel then
    runs no tile); otherwise the reverse, and the base is unused. The fold is cached per weight-scale tensor
    (``cached_fold_rows``); each call then costs one tiny launch."""
    base, bad = cached_fold_rows(w_scale)
    fold_offs, exact_offs = gate_offs(offs, bad)
    return base, fold_offs, exact_offs
