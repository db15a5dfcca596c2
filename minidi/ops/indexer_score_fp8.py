"""Lightning-indexer scores on FP8 tensor cores, for fq4 q and k (``indexer_score(..., mma="fp8")``).

Legend: T queries, N keys, H index heads, D index head dim, QB queries per tile, BN keys per tile.

q and k of the model are fq4 (e2m1 times a power of two per 32 channels); ``rebase_e4m3`` re-expresses each row
exactly as e4m3 bytes times one power of two, q[t, h] = q8[t, h] * sq[t, h], k[j] = k8[j] * sk[j]
(``indexer_fp8_quant.py``). The scales are positive, so

    score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) = sk[j] * sum_h (w[t, h] * sq[t, h]) * relu(q8[t, h] . k8[j])

one FP8 MMA over all of D per (row, key): the products are the bf16 path's products (scaled by powers of two), only
the tensor core's accumulation differs (Hopper's FP8 wgmma adds with reduced precision inside an instruction;
``promote`` = Triton's ``max_num_imprecise_acc``: partial sums moved to fp32 every ``promote`` along D, 0 = Triton's
default, none at K = D = 128; docs/ops/indexer.md has the measured errors).

Two launches, in stream order:
1. ``_score_fp8_kernel``: today's dense kernel (``indexer_score._score_kernel``: tiles, work skipping, -inf, chunk
   maxima) with e4m3 operands, w' = w * sq folded once per program and one multiply by sk per score.
2. ``_fixup_kernel``: the tiles that hold a row whose rebase is not exact (``ok`` False: a block-scale spread too
   wide, NaN / Inf, fp16/fp32 values that are not fq4) are computed again with the bf16 (fp32 for fp32 inputs) dot
   on the original operands and overwritten, scores and chunk maxima. Persistent (4 programs per SM walk the FP8
   grid's programs, two flag reads each): 0.07 ms at T 4,096 x N 131,072 when nothing is flagged.
So the op's result equals the bf16 kernel's up to the accumulation inside the exact tiles, on any input.
Chunk maxima (``want_cmax``) cost this kernel ~0.8 ms at that shape and save the top-k ~0.4 ms, so ``indexer_topk``
does not ask for them on this path (docs/ops/indexer.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, interpreting, num_sms, triton_can_run
from .indexer_fp8_quant import _launch_rebase
from ._indexer_blocks import _block, _pow2, _record, score_outputs


@triton.jit
def _block_fp8(k_ptrs, kmask, sk_ptrs, skmask, qT, w, n, ks, ke, out_ptrs, smask, cmax_ptr, t0, T, stride_ct,
               QB: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, KMASK: tl.constexpr,
               WRITE_CMAX: tl.constexpr, CSPLIT: tl.constexpr, PROMOTE: tl.constexpr, INTERPRET: tl.constexpr):
    """One key block: k8 [BN, DP] @ q8^T [DP, QB*HP] (e4m3, fp32 accumulate) -> relu, * w', sum over each query's
    heads, * sk -> [BN, QB]; store, and (WRITE_CMAX) each query's max over each of the block's CSPLIT parts of
    BN / CSPLIT keys ([CSPLIT, QB] from cmax_ptr, the block's first entry in query t0's row): with CSPLIT = 4 warps
    each part is one warp's rows of the wgmma accumulator, reduced in registers and shuffles (a max over all BN
    goes through shared memory: 7.17 against 5.74 ms; the store of the small result still converts its layout)."""
    if KMASK:
        kt = tl.load(k_ptrs, mask=kmask, other=0.0)
        sk = tl.load(sk_ptrs, mask=skmask, other=0.0)
    else:
        kt = tl.load(k_ptrs)
        sk = tl.load(sk_ptrs)
    acc = tl.zeros((BN, QB * HP), dtype=tl.float32)
    if INTERPRET:  # the interpreter's fp8 dot is not relied on: exact fp32 operands
        acc = tl.dot(kt.to(tl.float32), qT.to(tl.float32), acc, input_precision="ieee")
    elif PROMOTE > 0:
        acc = tl.dot(kt, qT, acc, max_num_imprecise_acc=PROMOTE)
    else:
        acc = tl.dot(kt, qT, acc)  # [BN, QB*HP]
    s = tl.maximum(acc, 0.0) * w[None, :]
    s = tl.sum(tl.reshape(s, (BN, QB, HP)), axis=2) * sk[:, None]  # [BN, QB]
    if MASKED:
        s = tl.where((n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :]), s, float("-inf"))
    s = s.to(out_ptrs.dtype.element_ty)
    tl.store(out_ptrs, s, mask=smask)
    if WRITE_CMAX:
        m = tl.max(tl.reshape(s.to(tl.float32), (CSPLIT, BN // CSPLIT, QB)), axis=1)  # [CSPLIT, QB]
        tq = t0 + tl.arange(0, QB)
        tl.store(cmax_ptr + tl.arange(0, CSPLIT)[:, None] + tq[None, :].to(tl.int64) * stride_ct, m,
                 mask=(tq < T)[None, :])


@triton.jit
def _prologue(ks_ptr, ke_ptr, T, N, pid, n_qblocks, blocks_per_prog, QB: tl.constexpr, BN: tl.constexpr):
    """Query block / key range of a program; visible union [lo, hi) and intersection -> computed blocks [cb0, cb1),
    fast blocks [fb0, fb1) (as in ``indexer_score._score_kernel``)."""
    pid_q = pid % n_qblocks
    pid_n = pid // n_qblocks
    tq = pid_q * QB + tl.arange(0, QB)  # [QB]
    tmask = tq < T
    ks = tl.maximum(tl.load(ks_ptr + tq, mask=tmask, other=0).to(tl.int32), 0)
    ke = tl.minimum(tl.load(ke_ptr + tq, mask=tmask, other=0).to(tl.int32), N)
    lo = tl.min(tl.where(tmask, ks, N), axis=0)
    hi = tl.max(ke, axis=0)
    f_lo = tl.max(ks, axis=0)
    f_hi = tl.min(tl.where(tmask, ke, N), axis=0)
    nb0 = pid_n * blocks_per_prog
    nb1 = tl.minimum(nb0 + blocks_per_prog, tl.cdiv(N, BN))
    cb0 = tl.minimum(tl.maximum(nb0, lo // BN), nb1)
    cb1 = tl.maximum(tl.minimum(nb1, tl.cdiv(hi, BN)), cb0)
    fb0 = tl.minimum(tl.maximum(cb0, tl.cdiv(f_lo, BN)), cb1)
    fb1 = tl.maximum(tl.minimum(cb1, f_hi // BN), fb0)
    return pid_q, tq, tmask, ks, ke, nb0, nb1, cb0, cb1, fb0, fb1


@fast_launch
@triton.jit
def _score_fp8_kernel(
    q_ptr, sq_ptr, k_ptr, sk_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, cmax_ptr,
    T, N, H, n_qblocks, blocks_per_prog,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_ot, stride_ct,
    D: tl.constexpr, DP: tl.constexpr, HP: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr,
    WRITE_CMAX: tl.constexpr, CSPLIT: tl.constexpr, PROMOTE: tl.constexpr, INTERPRET: tl.constexpr,
):
    QH: tl.constexpr = QB * HP
    pid_q, tq, tmask, ks, ke, nb0, nb1, cb0, cb1, fb0, fb1 = _prologue(ks_ptr, ke_ptr, T, N, tl.program_id(0),
                                                                       n_qblocks, blocks_per_prog, QB, BN)
    t0 = pid_q * QB
    r = tl.arange(0, QH)  # [QH] row = query-in-block * HP + head
    rt = t0 + r // HP
    rh = r % HP
    rmask = (rt < T) & (rh < H)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + rt[:, None].to(tl.int64) * stride_qt + rh[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & (d[None, :] < D), other=0.0)  # [QH, DP] e4m3
    qT = tl.trans(q)  # [DP, QH]: K-major, as FP8 wgmma wants its B operand
    sq = tl.load(sq_ptr + rt.to(tl.int64) * H + rh, mask=rmask, other=0.0)  # [QH] (q is contiguous)
    w = tl.load(w_ptr + rt.to(tl.int64) * stride_wt + rh, mask=rmask, other=0.0).to(tl.float32) * sq  # w' [QH]

    rn = tl.arange(0, BN)
    out_rows = out_ptr + tq[None, :].to(tl.int64) * stride_ot  # [1, QB]
    smask = tmask[None, :]
    neg = tl.full((BN, QB), float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
    cmax_rows = cmax_ptr + tq[None, :].to(tl.int64) * stride_ct + tl.arange(0, CSPLIT)[:, None]  # [CSPLIT, QB]
    neg_c = tl.full((CSPLIT, QB), float("-inf"), tl.float32)
    for nb in range(nb0, cb0):
        n = nb * BN + rn
        tl.store(out_rows + n[:, None], neg, mask=(n[:, None] < N) & smask)
        if WRITE_CMAX:
            tl.store(cmax_rows + nb * CSPLIT, neg_c, mask=smask)
    for nb in range(cb0, fb0):
        n = nb * BN + rn
        _block_fp8(k_ptr + n[:, None].to(tl.int64) * stride_kn + d[None, :], (n[:, None] < N) & (d[None, :] < D),
                   sk_ptr + n, n < N, qT, w, n, ks, ke, out_rows + n[:, None], (n[:, None] < N) & smask,
                   cmax_ptr + nb * CSPLIT, t0, T, stride_ct, QB, HP, BN, True, True, WRITE_CMAX, CSPLIT, PROMOTE,
                   INTERPRET)
    k_ptrs = k_ptr + (fb0 * BN + rn)[:, None].to(tl.int64) * stride_kn + d[None, :]  # [BN, DP]
    sk_ptrs = sk_ptr + fb0 * BN + rn  # [BN]
    out_ptrs = out_rows + (fb0 * BN + rn)[:, None]  # [BN, QB]
    for nb in range(fb0, fb1):  # fast path: pointer bumps, no masks
        _block_fp8(k_ptrs, d[None, :] < D, sk_ptrs, rn < BN, qT, w, rn, ks, ke, out_ptrs, smask,
                   cmax_ptr + nb * CSPLIT, t0, T, stride_ct, QB, HP, BN, False, D != DP, WRITE_CMAX, CSPLIT, PROMOTE,
                   INTERPRET)
        k_ptrs += BN * stride_kn
        sk_ptrs += BN
        out_ptrs += BN
    for nb in range(fb1, cb1):
        n = nb * BN + rn
        _block_fp8(k_ptr + n[:, None].to(tl.int64) * stride_kn + d[None, :], (n[:, None] < N) & (d[None, :] < D),
                   sk_ptr + n, n < N, qT, w, n, ks, ke, out_rows + n[:, None], (n[:, None] < N) & smask,
                   cmax_ptr + nb * CSPLIT, t0, T, stride_ct, QB, HP, BN, True, True, WRITE_CMAX, CSPLIT, PROMOTE,
                   INTERPRET)
    for nb in range(cb1, nb1):
        n = nb * BN + rn
        tl.store(out_rows + n[:, None], neg, mask=(n[:, None] < N) & smask)
        if WRITE_CMAX:
            tl.store(cmax_rows + nb * CSPLIT, neg_c, mask=smask)


@fast_launch
@triton.jit
def _fixup_kernel(
    q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, cmax_ptr, qok_ptr, kok_ptr,
    T, N, H, n_qblocks, blocks_per_prog, n_progs,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_ot, stride_ct,
    D: tl.constexpr, DP: tl.constexpr, HP: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr, BPP: tl.constexpr,
    WRITE_CMAX: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Recompute, with the bf16 (fp32) dot on the original q / k, every computed tile of the FP8 kernel's program
    ``v`` whose query block (qok[pid_q] == 0) or key block (kok[nb] == 0) holds a row the FP8 rebase could not
    represent. Persistent: each program walks the FP8 grid's programs v = pid, pid + grid, ... and reads two flags
    per v (a grid as large as the FP8 kernel's cost ~0.2 ms even when every program exits at once)."""
    for v in range(tl.program_id(0), n_progs, tl.num_programs(0)):
        pid_q = v % n_qblocks
        nb0 = (v // n_qblocks) * blocks_per_prog
        j = nb0 + tl.arange(0, BPP)
        jmask = (j < nb0 + blocks_per_prog) & (j < tl.cdiv(N, BN))
        bad = (tl.load(qok_ptr + pid_q) == 0) | (tl.max((tl.load(kok_ptr + j, mask=jmask, other=1) == 0)
                                                         .to(tl.int32), axis=0) > 0)
        if bad:
            _fixup_program(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, cmax_ptr, qok_ptr, kok_ptr, v,
                           T, N, H, n_qblocks, blocks_per_prog,
                           stride_qt, stride_qh, stride_kn, stride_wt, stride_ot, stride_ct,
                           D, DP, HP, QB, BN, WRITE_CMAX, IEEE, INTERPRET)


@triton.jit
def _fixup_program(
    q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, cmax_ptr, qok_ptr, kok_ptr, v,
    T, N, H, n_qblocks, blocks_per_prog,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_ot, stride_ct,
    D: tl.constexpr, DP: tl.constexpr, HP: tl.constexpr, QB: tl.constexpr, BN: tl.constexpr,
    WRITE_CMAX: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    QH: tl.constexpr = QB * HP
    pid_q, tq, tmask, ks, ke, nb0, nb1, cb0, cb1, fb0, fb1 = _prologue(ks_ptr, ke_ptr, T, N, v, n_qblocks,
                                                                       blocks_per_prog, QB, BN)
    q_bad = tl.load(qok_ptr + pid_q) == 0
    if cb1 > cb0:
        r = tl.arange(0, QH)
        rt = pid_q * QB + r // HP
        rh = r % HP
        rmask = (rt < T) & (rh < H)
        d = tl.arange(0, DP)
        rn = tl.arange(0, BN)
        out_rows = out_ptr + tq[None, :].to(tl.int64) * stride_ot
        smask = tmask[None, :]
        cmax_rows = cmax_ptr + tq.to(tl.int64) * stride_ct
        for nb in range(cb0, cb1):
            if q_bad | (tl.load(kok_ptr + nb) == 0):
                q = tl.load(q_ptr + rt[:, None].to(tl.int64) * stride_qt + rh[:, None] * stride_qh + d[None, :],
                            mask=rmask[:, None] & (d[None, :] < D), other=0.0)  # [QH, DP]
                w = tl.load(w_ptr + rt.to(tl.int64) * stride_wt + rh, mask=rmask, other=0.0).to(tl.float32)
                n = nb * BN + rn
                _block(k_ptr + n[:, None].to(tl.int64) * stride_kn + d[None, :],
                       (n[:, None] < N) & (d[None, :] < D), tl.trans(q), w, n, ks, ke, out_rows + n[:, None],
                       (n[:, None] < N) & smask, cmax_rows + nb, tmask, QB, HP, BN, True, True, WRITE_CMAX, IEEE,
                       INTERPRET)


# ---------------------------------------------------------------------------------------------------------- launchers
def default_fp8_config(h: int) -> dict:
    """Tile config of the FP8 kernel (H200-tuned in bench/bench_indexer.py; small tiles in the interpreter).
    ``cmax_split``: chunk maxima written per BN / cmax_split keys, then reduced (see ``_block_fp8``)."""
    hp = _pow2(h)
    if interpreting():
        return dict(BN=32, QB=max(1, 32 // hp), num_warps=4, num_stages=1, blocks_per_prog=4, promote=0,
                    cmax_split=4)
    return dict(BN=64, QB=max(1, 128 // hp), num_warps=4, num_stages=3, blocks_per_prog=128, promote=0,
                cmax_split=4)


def _launch_score_fp8(q, k, w, k_start, k_end, out_dtype, want_cmax, out=None, cmax=None, info=None,
                      fixup=True, **cfg):
    """Rebase q and k (``rebase_e4m3``), launch the FP8 kernel and the fixup of inexact tiles. Same contract as
    ``indexer_score._launch_score``; ``fixup=False`` skips the second launch (the bench's cost split).
    Returns (scores [T, N], chunk maxima [T, N/BN])."""
    t, h, d = q.shape
    n = k.shape[0]
    c = {**default_fp8_config(h), **cfg}
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
    q = q.contiguous()
    k = (k if k.dtype == q.dtype else k.to(q.dtype)).contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    q8, sq, _, qok = _launch_rebase(q.view(t * h, d), qb * h)  # one flag per query block of QB * H rows
    k8, sk, _, kok = _launch_rebase(k, bn)  # one flag per key block
    split = c["cmax_split"] if want_cmax else 1
    if bn % split:
        raise ValueError(f"cmax_split {split} must divide BN {bn}")
    cm = cmax if split == 1 else torch.empty(t, cmax.shape[1] * split, device=q.device, dtype=torch.float32)
    n_progs = n_qblocks * n_split
    ks, ke = k_start.contiguous(), k_end.contiguous()
    kern = _score_fp8_kernel[(n_progs,)](
        q8.view(t, h, d), sq, k8, sk, w, ks, ke, out, cm,
        t, n, h, n_qblocks, bpp, q.stride(0), q.stride(1), k.stride(0), w.stride(0), out.stride(0),
        max(cm.stride(0), 1),
        D=d, DP=_pow2(d, 32), HP=hp, QB=qb, BN=bn, WRITE_CMAX=want_cmax, CSPLIT=split, PROMOTE=c["promote"],
        INTERPRET=interpreting(), num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    _record(info, kern, n_progs)
    if split > 1:
        torch.amax(cm.view(t, -1, split), dim=2, out=cmax)
    if fixup:
        grid = min(n_progs, 8 if interpreting() else 4 * num_sms(q.device))
        _fixup_kernel[(grid,)](
            q, k, w, ks, ke, out, cmax, qok.view(torch.int8), kok.view(torch.int8),
            t, n, h, n_qblocks, bpp, n_progs, q.stride(0), q.stride(1), k.stride(0), w.stride(0), out.stride(0),
            max(cmax.stride(0), 1),
            D=d, DP=_pow2(d, 16), HP=hp, QB=qb, BN=bn, BPP=_pow2(bpp), WRITE_CMAX=want_cmax,
            IEEE=q.dtype == torch.float32, INTERPRET=interpreting(), num_warps=4, num_stages=1,
        )
    return out, cmax


# ------------------------------------------------------------------------------------------------------- custom op
@dispatch_op("minidi::indexer_score_fp8")
def _indexer_score_fp8_op(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor,
    out_dtype: torch.dtype, want_cmax: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not triton_can_run(q, k, w, k_start, k_end):
        raise cannot_run("minidi::indexer_score_fp8", q, k, w, k_start, k_end)
    return _launch_score_fp8(q, k, w, k_start, k_end, out_dtype, want_cmax)


@_indexer_score_fp8_op.register_fake
def _(q, k, w, k_start, k_end, out_dtype, want_cmax):
    return score_outputs(q, k, out_dtype, want_cmax, default_fp8_config(q.shape[1])["BN"])


__all__ = ["default_fp8_config"]
