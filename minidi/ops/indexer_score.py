"""Lightning-indexer scores, fused: score[t, j] = sum_h w[t, h] * relu(q[t, h, :] . k[j, :]) (pass target B).

Legend: T queries, N keys (compressed entries), H index heads, D index head dim, QB queries per tile, BN keys per
tile.

Kernel (dense): one program owns QB queries (QB*H rows of the MMA, query-major, head-minor) and a contiguous range
of key blocks. q [QB*H, D] is loaded once; per key block the tensor cores compute k_blk [BN, D] @ q^T [D, QB*H]
-> [BN, QB*H] in fp32, and the epilogue (relu, * w, sum over the H columns of each query: in-thread adds plus two
quad shuffles in the wgmma layout) runs in registers; only [QB, BN] scores are written. Key blocks outside the union
of the block's visible ranges [k_start, k_end) are not computed (-inf is written), so a block of queries of one
sequence loops over exactly its keys; a block that straddles sequences computes the union and masks per query.
Programs are ordered query-block-fastest so those in flight share one key range in L2.

With ``want_cmax`` the kernel also writes each query's max over each key block ([T, cdiv(N, BN)]): the bound that
lets the top-k read only ~1/4 of each row (minidi/ops/topk.py).

Score dtype: fp32 by default (see docs/ops/indexer.md): fp32 accumulation of exact bf16 products, no intermediate
rounding; bf16 output is available (``out_dtype``) but quantises scores to 8 bits, which turns the top-512 threshold
into a 15-35-way tie at N = 131,072.

``mma="fp8"``: the same scores on FP8 tensor cores for fq4 q / k (``indexer_score_fp8.py``): exact products, the
FP8 MMA's accumulation; rows that e4m3 times one power of two cannot represent fall back to this kernel's dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import indexer_score_fp8 as _fp8
from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._indexer_blocks import _block, _pow2, _record, score_outputs
from ._triton_utils import cannot_run, interpreting, resolve_backend, triton_can_run
from .topk import topk_indices_ref

_QK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MMA_KINDS = ("native", "fp8")  # the score MMA: the operands' own dtype (today's numerics), or FP8 (fq4 inputs)


# ----------------------------------------------------------------------------------------------------------- kernels
@fast_launch
@triton.jit
def _score_kernel(
    q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, cmax_ptr,
    T, N, H, n_qblocks, blocks_per_prog,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_ot, stride_ct,
    D: tl.constexpr, DP: tl.constexpr, HP: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr,
    WRITE_CMAX: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    QH: tl.constexpr = QB * HP
    pid = tl.program_id(0)
    pid_q = pid % n_qblocks  # query blocks fastest: programs in flight share one key range
    pid_n = pid // n_qblocks
    t0 = pid_q * QB

    r = tl.arange(0, QH)  # [QH] row = query-in-block * HP + head
    rt = t0 + r // HP
    rh = r % HP
    rmask = (rt < T) & (rh < H)
    d = tl.arange(0, DP)
    q = tl.load(
        q_ptr + rt[:, None].to(tl.int64) * stride_qt + rh[:, None] * stride_qh + d[None, :],
        mask=rmask[:, None] & (d[None, :] < D), other=0.0,
    )  # [QH, DP]
    qT = tl.trans(q)  # [DP, QH]
    w = tl.load(w_ptr + rt.to(tl.int64) * stride_wt + rh, mask=rmask, other=0.0).to(tl.float32)  # [QH]

    tq = t0 + tl.arange(0, QB)  # [QB]
    tmask = tq < T
    ks = tl.maximum(tl.load(ks_ptr + tq, mask=tmask, other=0).to(tl.int32), 0)  # [QB]
    ke = tl.minimum(tl.load(ke_ptr + tq, mask=tmask, other=0).to(tl.int32), N)  # [QB]
    lo = tl.min(tl.where(tmask, ks, N), axis=0)  # union of the visible ranges: [lo, hi)
    hi = tl.max(ke, axis=0)
    f_lo = tl.max(ks, axis=0)  # intersection: [f_lo, f_hi)
    f_hi = tl.min(tl.where(tmask, ke, N), axis=0)

    nb0 = pid_n * blocks_per_prog
    nb1 = tl.minimum(nb0 + blocks_per_prog, tl.cdiv(N, BN))
    cb0 = tl.minimum(tl.maximum(nb0, lo // BN), nb1)  # computed blocks [cb0, cb1) meet the union
    cb1 = tl.maximum(tl.minimum(nb1, tl.cdiv(hi, BN)), cb0)
    fb0 = tl.minimum(tl.maximum(cb0, tl.cdiv(f_lo, BN)), cb1)  # fast blocks [fb0, fb1) lie inside the intersection
    fb1 = tl.maximum(tl.minimum(cb1, f_hi // BN), fb0)

    rn = tl.arange(0, BN)
    out_rows = out_ptr + tq[None, :].to(tl.int64) * stride_ot  # [1, QB]
    smask = tmask[None, :]
    neg = tl.full((BN, QB), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
    cmax_rows = cmax_ptr + tq.to(tl.int64) * stride_ct  # [QB]: chunk maxima, one per key block
    for nb in range(nb0, cb0):  # invisible to every query of the block
        n = nb * BN + rn
        tl.store(out_rows + n[:, None], neg, mask=(n[:, None] < N) & smask)
        if WRITE_CMAX:
            tl.store(cmax_rows + nb, tl.full((QB,), float("-inf"), tl.float32), mask=tmask)
    for nb in range(cb0, fb0):
        n = nb * BN + rn
        _block(k_ptr + n[:, None].to(tl.int64) * stride_kn + d[None, :], (n[:, None] < N) & (d[None, :] < D),
               qT, w, n, ks, ke, out_rows + n[:, None], (n[:, None] < N) & smask, cmax_rows + nb, tmask,
               QB, HP, BN, True, True, WRITE_CMAX, IEEE, INTERPRET)
    k_ptrs = k_ptr + (fb0 * BN + rn)[:, None].to(tl.int64) * stride_kn + d[None, :]  # [BN, DP]
    out_ptrs = out_rows + (fb0 * BN + rn)[:, None]  # [BN, QB]
    for nb in range(fb0, fb1):  # fast path: pointer bumps, no masks
        _block(k_ptrs, d[None, :] < D, qT, w, rn, ks, ke, out_ptrs, smask, cmax_rows + nb, tmask,
               QB, HP, BN, False, D != DP, WRITE_CMAX, IEEE, INTERPRET)
        k_ptrs += BN * stride_kn
        out_ptrs += BN
    for nb in range(fb1, cb1):
        n = nb * BN + rn
        _block(k_ptr + n[:, None].to(tl.int64) * stride_kn + d[None, :], (n[:, None] < N) & (d[None, :] < D),
               qT, w, n, ks, ke, out_rows + n[:, None], (n[:, None] < N) & smask, cmax_rows + nb, tmask,
               QB, HP, BN, True, True, WRITE_CMAX, IEEE, INTERPRET)
    for nb in range(cb1, nb1):
        n = nb * BN + rn
        tl.store(out_rows + n[:, None], neg, mask=(n[:, None] < N) & smask)
        if WRITE_CMAX:
            tl.store(cmax_rows + nb, tl.full((QB,), float("-inf"), tl.float32), mask=tmask)


# ---------------------------------------------------------------------------------------------------------- launchers
def default_score_config(h: int, dtype: torch.dtype) -> dict:
    """Tile config for the dense kernel (H200-tuned; tests on the interpreter use smaller tiles)."""
    hp = _pow2(h)
    if interpreting():
        return dict(BN=32, QB=max(1, 16 // hp), num_warps=4, num_stages=1, blocks_per_prog=4)
    if dtype == torch.float32:  # exact fp32 products: slow path, only for checks
        return dict(BN=64, QB=max(1, 64 // hp), num_warps=4, num_stages=2, blocks_per_prog=64)
    # 64 keys x (QB*H = 128) rows, one warpgroup: ~140 registers, 81 KB smem -> 2 CTAs per SM, so one CTA's epilogue
    # (CUDA cores) overlaps the other's wgmma; 128 blocks per program -> 8,192 keys (2 MB of bf16 K) per L2 sweep.
    return dict(BN=64, QB=max(1, 128 // hp), num_warps=4, num_stages=3, blocks_per_prog=128)


def _launch_score(q, k, w, k_start, k_end, out_dtype, want_cmax, out=None, cmax=None, info=None, **cfg):
    """Launch the dense kernel; ``out`` / ``cmax`` let tests pass poisoned buffers, ``info`` (a dict) receives the
    compiled kernel's registers / spills / shared memory and the grid. Returns (scores, chunk maxima [T, N/BN])."""
    t, h, d = q.shape
    n = k.shape[0]
    c = {**default_score_config(h, q.dtype), **cfg}
    bn, qb, bpp = c["BN"], c["QB"], c["blocks_per_prog"]
    hp = _pow2(h)
    if qb * hp < 16 or bn < 16:
        raise ValueError(f"tile too small for tl.dot: QB*HP={qb * hp}, BN={bn} (need >= 16)")
    n_qblocks = triton.cdiv(t, qb)
    n_split = max(1, triton.cdiv(triton.cdiv(n, bn), bpp))
    if out is None:
        out = torch.empty(t, n, device=q.device, dtype=out_dtype)
    if cmax is None:
        cmax = torch.empty(t, triton.cdiv(n, bn) if want_cmax else 0, device=q.device, dtype=torch.float32)
    if t == 0 or n == 0:
        return out, cmax
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = (k if k.dtype == q.dtype else k.to(q.dtype)).contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    kern = _score_kernel[(n_qblocks * n_split,)](
        q, k, w, k_start.contiguous(), k_end.contiguous(), out, cmax,
        t, n, h, n_qblocks, bpp,
        q.stride(0), q.stride(1), k.stride(0), w.stride(0), out.stride(0), max(cmax.stride(0), 1),
        D=d, DP=_pow2(d, 16), HP=hp, QB=qb, BN=bn, WRITE_CMAX=want_cmax,
        IEEE=q.dtype == torch.float32, INTERPRET=interpreting(),
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    _record(info, kern, n_qblocks * n_split)
    return out, cmax


# ------------------------------------------------------------------------------------------------------- custom ops
@dispatch_op("minidi::indexer_score")
def _indexer_score_op(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor,
    out_dtype: torch.dtype, want_cmax: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not triton_can_run(q, k, w, k_start, k_end):
        raise cannot_run("minidi::indexer_score", q, k, w, k_start, k_end)
    return _launch_score(q, k, w, k_start, k_end, out_dtype, want_cmax)


@_indexer_score_op.register_fake
def _(q, k, w, k_start, k_end, out_dtype, want_cmax):
    return score_outputs(q, k, out_dtype, want_cmax, default_score_config(q.shape[1], q.dtype)["BN"])


# ---------------------------------------------------------------------------------------------------------- references
def indexer_score_ref(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor,
    out_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype = torch.float32, chunk: int = 64,
) -> torch.Tensor:
    """Plain-torch scores in ``compute_dtype`` (fp32: the fallback; float64: the test oracle), query-chunked so
    the [chunk, H, N] intermediate stays small. Same contract as ``indexer_score``."""
    t, n = q.shape[0], k.shape[0]
    out = torch.empty(t, n, device=q.device, dtype=out_dtype)
    j = torch.arange(n, device=q.device)
    kc = k.to(compute_dtype)
    for a in range(0, t, chunk):
        s = torch.einsum("thd,nd->thn", q[a : a + chunk].to(compute_dtype), kc)  # [c, H, N]
        s = (s.relu() * w[a : a + chunk].to(compute_dtype).unsqueeze(-1)).sum(1)  # [c, N]
        vis = (j >= k_start[a : a + chunk, None]) & (j < k_end[a : a + chunk, None])
        out[a : a + chunk] = s.masked_fill(~vis, float("-inf")).to(out_dtype)
    return out


# ------------------------------------------------------------------------------------------------------ public wrappers
def _check_common(q, k, w, k_start, k_end, backend, mma="native") -> str:
    """Checks the inputs; returns the backend that runs ("triton" or "ref")."""
    if mma not in MMA_KINDS:
        raise ValueError(f"mma must be one of {MMA_KINDS}, got {mma!r}")
    for name, x in (("q", q), ("k", k), ("w", w), ("k_start", k_start), ("k_end", k_end)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on {q.device} (the device of q), got {x.device}")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got shape {tuple(q.shape)}")
    t, h, d = q.shape
    if k.dim() != 2 or k.shape[1] != d:
        raise ValueError(f"k must be [N, {d}] (D of q), got shape {tuple(k.shape)}")
    if w.shape != (t, h):
        raise ValueError(f"w must be [{t}, {h}] ([T, H] of q), got shape {tuple(w.shape)}")
    for name, x in (("k_start", k_start), ("k_end", k_end)):
        if x.shape != (t,) or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be [{t}] int32/int64, got shape {tuple(x.shape)} dtype {x.dtype}")
    if q.dtype not in _QK_DTYPES or k.dtype not in _QK_DTYPES:
        raise TypeError(f"q and k must be bf16/fp16/fp32, got q {q.dtype}, k {k.dtype}")
    if w.dtype not in _QK_DTYPES:
        raise TypeError(f"w must be bf16/fp16/fp32, got {w.dtype}")
    return resolve_backend(backend, "indexer_score", q, k, w, k_start, k_end)


def indexer_score(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor,
    out_dtype: torch.dtype = torch.float32, backend: str = "auto", mma: str = "native",
) -> torch.Tensor:
    """Dense indexer scores.

    q [T, H, D] bf16/fp16/fp32, k [N, D] (cast to q's dtype), w [T, H] any float (used in fp32),
    k_start/k_end [T] int32/int64: query t sees keys j in [k_start[t], k_end[t]) (a packed ragged batch puts several
    sequences in one key pool; the single-sequence case is k_start = 0, k_end = n_visible).
    Returns scores [T, N] ``out_dtype`` (fp32 default, or bf16): fp32 accumulation, -inf outside the visible range.
    ``backend``: "auto" (the kernel where it can run, else the reference), "triton" or "ref" (plain torch, fp32).
    ``mma``: "native" (the operands' dtype on the tensor cores; exact fp32 products for fp32) or "fp8" (for fq4 q
    and k: e4m3 operands with one power-of-two scale per row, exact products, the FP8 MMA's accumulation; rows that
    are not exactly representable so fall back to "native" per tile; ``indexer_score_fp8.py``).
    """
    run = _check_common(q, k, w, k_start, k_end, backend, mma)
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float32 or torch.bfloat16, got {out_dtype}")
    if run == "ref":
        return indexer_score_ref(q, k, w, k_start, k_end, out_dtype)
    op = _fp8._indexer_score_fp8_op if mma == "fp8" else _indexer_score_op
    return op(q, k, w, k_start, k_end, out_dtype, False)[0]


def indexer_topk(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, topk: int,
    allowed: torch.Tensor | None = None, backend: str = "auto", mma: str = "native",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for the model's ``indexer_topk_naive`` (same arguments, same return shapes).

    q [T, H, D], k [N, D], w [T, H], k_start/k_end [T] int, allowed [T, N] bool or None.
    Returns (idx [T, min(topk, N)] int64, scores [T, N] fp32). idx holds the top-k set in ascending key order, exact
    ties to the lowest key, then -1 for picks whose score is -inf: the naive path's order and tie-break, so the two
    agree exactly on equal scores (the naive scores are in the activation dtype: in bf16 the sets can differ).
    Without ``allowed`` the native score kernel also writes each key block's max, which gives the top-k its bound.
    ``mma``: as in ``indexer_score`` ("fp8" for fq4 q and k: pass B picks it when q is an fq4 output; the top-k then
    takes its own bound).
    """
    t, n = q.shape[0], k.shape[0]
    kk = min(topk, n)
    if allowed is not None and (allowed.shape != (t, n) or allowed.dtype != torch.bool):
        raise ValueError(f"allowed must be [{t}, {n}] bool, got {tuple(allowed.shape)} {allowed.dtype}")
    if _check_common(q, k, w, k_start, k_end, backend, mma) == "ref":
        scores = indexer_score_ref(q, k, w, k_start, k_end)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return topk_indices_ref(scores, kk, k_end, k_start), scores
    if mma == "fp8":
        # no chunk maxima from the FP8 kernel: the top-k takes its own bound (H200, round 11, T 4,096 x N 131,072:
        # the maxima cost the FP8 kernel 0.8 ms and save the top-k 0.4 ms; docs/ops/indexer.md)
        scores, cmax = _fp8._indexer_score_fp8_op(q, k, w, k_start, k_end, torch.float32, False)
        cmax, chunk = None, 0
    else:
        scores, cmax = _indexer_score_op(q, k, w, k_start, k_end, torch.float32, allowed is None)
        chunk = default_score_config(q.shape[1], q.dtype)["BN"]  # the score kernel's key block = one chunk
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
        cmax, chunk = None, 0
    return torch.ops.minidi.topk_indices(scores, kk, k_start, k_end, cmax, chunk), scores


__all__ = [
    "indexer_score", "indexer_topk", "indexer_score_ref", "default_score_config", "MMA_KINDS",
]
