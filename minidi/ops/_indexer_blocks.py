"""What both indexer score kernels share (``indexer_score.py``, bf16; ``indexer_score_fp8.py``, FP8): the key-block
step of the dense kernel, two launcher helpers and the ops' output shapes. A module of its own so that the two
kernels' files import it, not each other."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import mma


@triton.jit
def _block(k_ptrs, kmask, qT, w, n, ks, ke, out_ptrs, smask, cmax_ptrs, tmask,
           QB: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, KMASK: tl.constexpr,
           WRITE_CMAX: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """One key block: k [BN, DP] @ q^T [DP, QB*HP] -> relu, * w, sum over each query's heads -> [BN, QB]; store
    it, and (WRITE_CMAX) each query's max over the block [QB] for the top-k bound.
    MASKED=False is the fast path (every key of the block visible to every query: no masks on loads or scores)."""
    if KMASK:
        kt = tl.load(k_ptrs, mask=kmask, other=0.0)
    else:
        kt = tl.load(k_ptrs)
    acc = mma(kt, qT, tl.zeros((BN, QB * HP), dtype=tl.float32), IEEE, INTERPRET)  # [BN, QB*HP]
    s = tl.maximum(acc, 0.0) * w[None, :]
    s = tl.sum(tl.reshape(s, (BN, QB, HP)), axis=2)  # [BN, QB]
    if MASKED:
        s = tl.where((n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :]), s, float("-inf"))
    s = s.to(out_ptrs.dtype.element_ty)
    tl.store(out_ptrs, s, mask=smask)
    if WRITE_CMAX:
        tl.store(cmax_ptrs, tl.max(s.to(tl.float32), axis=0), mask=tmask)



def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


def _record(info: dict | None, kern, grid: int) -> None:
    """Registers / spills / shared memory of a launched kernel (None under the interpreter)."""
    if info is not None:
        info.update(grid=grid, n_regs=getattr(kern, "n_regs", None), n_spills=getattr(kern, "n_spills", None),
                    shared=getattr(getattr(kern, "metadata", None), "shared", None))


def score_outputs(q: torch.Tensor, k: torch.Tensor, out_dtype: torch.dtype, want_cmax: bool, bn: int):
    """Both score ops' outputs, allocated (their fakes): scores [T, N] ``out_dtype``, and each query's maxima over
    key blocks of ``bn`` [T, cdiv(N, bn)] fp32 when ``want_cmax`` (else [T, 0])."""
    t, n = q.shape[0], k.shape[0]
    return q.new_empty(t, n, dtype=out_dtype), q.new_empty(t, triton.cdiv(n, bn) if want_cmax else 0,
                                                            dtype=torch.float32)
