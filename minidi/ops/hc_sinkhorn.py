"""The mHC mixer's Sinkhorn normalisation in one kernel (pass K): softmax, then alternating column / row sums.

The model computes, per token, on an n x n matrix (``minidi.model.hyper_connections.hc_mixer``)::

    c = softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)                  # columns first
    repeat iters - 1 times:
        c = c / (c.sum(dim=-1, keepdim=True) + eps)              # rows
        c = c / (c.sum(dim=-2, keepdim=True) + eps)              # columns

Under ``torch.compile`` these 2 iters reductions over dims of 4 became a chain of small kernels: at V4.1-Flash (T 4,096,
n 4, iters 20) the mixer's tail took ~0.44 ms per site, 80 sites a step (H200, ``bench/bench_hc_mix.py``), for
256 KB of data. Here one program holds BT tokens' matrices in registers and runs every iteration there.

Numerics: fp32 throughout, the same operations in the same order per element; divisions correctly rounded
(``div_rn``); the exponential is Triton's (its last bit may differ from torch's), and the softmax sum is over n
terms in another order: fp32 level.

Legend: T tokens, n streams, BT tokens per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, resolve_backend, triton_can_run

MAX_STREAMS = 16


# ---- reference -----------------------------------------------------------------------------------------------------
def hc_sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The model's code, plain torch."""
    c = torch.softmax(logits.float(), dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


# ---- kernel --------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, T, N, iters, eps, sx_t, so_t, NP: tl.constexpr, BT: tl.constexpr):
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rj = tl.arange(0, NP)
    rt64 = rt.to(tl.int64)[:, None, None]
    offs = rj[None, :, None] * N + rj[None, None, :]  # [1, NP, NP]: row j, column k
    ok = (rt < T)[:, None, None] & (rj < N)[None, :, None] & (rj < N)[None, None, :]
    c = tl.load(x_ptr + rt64 * sx_t + offs, mask=ok, other=-1e30)  # padding: finite, so no inf - inf anywhere
    m = tl.max(c, axis=2)  # softmax over k
    e = tl.where(ok, tl.exp(c - m[:, :, None]), 0.0)
    s = tl.sum(e, axis=2)  # >= 1 on a real row (the max's term); 0 on padding, made 1 there
    c = tl.where(ok, tl.math.div_rn(e, tl.where(s == 0.0, 1.0, s)[:, :, None]) + eps, 0.0)
    c = tl.where(ok, tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps), 0.0)  # columns (sum over j)
    for _ in range(1, iters):
        c = tl.where(ok, tl.math.div_rn(c, tl.sum(c, axis=2)[:, :, None] + eps), 0.0)  # rows
        c = tl.where(ok, tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps), 0.0)  # columns
    tl.store(out_ptr + rt64 * so_t + offs, c, mask=ok)


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::hc_sinkhorn")
def _sinkhorn_op(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    if not triton_can_run(logits):
        raise cannot_run("minidi::hc_sinkhorn", logits)
    x = logits.contiguous()
    t, n, _ = x.shape
    out = torch.empty_like(x)
    if t:
        bt = 64
        _sinkhorn_kernel[(triton.cdiv(t, bt),)](x, out, t, n, iters, float(eps), x.stride(0), out.stride(0),
                                                 NP=triton.next_power_of_2(n), BT=bt, num_warps=4)
    return out


@_sinkhorn_op.register_fake
def _(logits, iters, eps):
    return torch.empty_like(logits)


def hc_sinkhorn(logits: torch.Tensor, iters: int, eps: float, backend: str = "auto") -> torch.Tensor:
    """logits [T, n, n] fp32 -> the doubly-normalised [T, n, n] fp32 of ``hc_mixer`` (softmax over the last dim,
    then columns, then ``iters - 1`` rounds of rows and columns, each sum + ``eps``).
    ``backend``: "auto" (the kernel where it can run, else the reference), "triton" or "ref" (plain torch)."""
    if logits.dim() != 3 or logits.dtype != torch.float32 or logits.shape[1] != logits.shape[2]:
        raise ValueError(f"hc_sinkhorn: logits must be [T, n, n] float32, got {tuple(logits.shape)} {logits.dtype}")
    if not 0 < logits.shape[1] <= MAX_STREAMS:
        raise ValueError(f"hc_sinkhorn: n must be in 1..{MAX_STREAMS}, got {logits.shape[1]}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"hc_sinkhorn: iters must be an int >= 1, got {iters!r}")
    if resolve_backend(backend, "hc_sinkhorn", logits) == "ref":
        return hc_sinkhorn_ref(logits, iters, eps)
    return _sinkhorn_op(logits, iters, float(eps))
