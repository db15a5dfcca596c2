"""Indexer scores and top-k inside each query's candidate blocks: V4.1's re-index layers (pass M).

Legend: T queries, N keys, H index heads, D index head dim, KB candidate blocks per query, B entries per block,
C = KB * B candidate entries per query, BN entries per tile.

The naive re-index layer scores every key and masks all but the candidates (``candidate_allowed``: the blocks
layer ``candidate_source`` kept, ``minidi.model.indexer.candidate_blocks``)::

    s   = indexer scores [T, N]; s = s.masked_fill(~allowed, -inf)      # allowed [T, N] from blocks [T, KB]
    idx = top-k of s (ascending keys, ties to the lowest key, -1 for -inf picks)

Here only the candidates are scored: C entries a query instead of N (2,048 blocks of 8 of 131,072 keys at V4.1's
full size, 1/8 of the work), in each query's candidate order (block ids ascending, so candidate positions ascend with
their keys and the top-k's lowest-position tie-break is the lowest key's)::

    sc[t, i * B + r] = score(t, blocks[t, i] * B + r)   (-inf: id -1, key >= N or outside [k_start, k_end))
    pos = topk_indices(sc, k); idx = blocks[t, pos // B] * B + pos % B  (-1 stays -1)

Kernel ``_candidate_score_kernel``: one program per (query, run of tiles); per tile the BN / B blocks' ids, the
BN key rows gathered, k [BN, D] @ q_t^T [D, HP] on the tensor cores, relu, * w, sum over heads, store. ``mma="fp8"``
(fq4 q and k, as pass B's): the operands are ``rebase_e4m3``'s e4m3 rows with one power-of-two scale each (exact
products, ``indexer_score_fp8.py``); a tile holding a row that rebase flags inexact (the query's, or a gathered key's)
is computed by the bf16 dot on the original operands instead, in the same program (a check of the gathered rows' flags
and a branch before each tile's loads: on the H200, in separate device calls, this measured faster than checking
after the FP8 dot and than a branch-free loop taken when every key row is exact). Scores are fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._indexer_blocks import _pow2, _record
from ._triton_utils import cannot_run, interpreting, mma, resolve_backend, triton_can_run
from .indexer_fp8_quant import _launch_rebase
from .topk import MAX_K, _topk_op, topk_indices_ref

_QK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MMA_KINDS = ("native", "fp8")
_KEY_REBASE_GROUP = 64  # rows per program of the key rebase (its per-row flags are what the kernel reads)


@fast_launch
@triton.jit
def _candidate_score_kernel(
    q_ptr, k_ptr, q8_ptr, sq_ptr, k8_ptr, sk_ptr, qok_ptr, kok_ptr, w_ptr, ks_ptr, ke_ptr, blk_ptr, out_ptr,
    T, N, H, C, KB, tiles_per_prog,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_bt, stride_ot,
    B: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    tile0 = tl.program_id(1) * tiles_per_prog
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    hmask = h < H
    qoffs = t.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :]
    qmask = hmask[:, None] & (d[None, :] < D)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + h, mask=hmask, other=0.0).to(tl.float32)  # [HP]
    ks = tl.load(ks_ptr + t).to(tl.int32)
    ke = tl.load(ke_ptr + t).to(tl.int32)
    qT = tl.trans(tl.load(q_ptr + qoffs, mask=qmask, other=0.0))  # [DP, HP] original q (the inexact fallback)
    if FP8:
        q8T = tl.trans(tl.load(q8_ptr + qoffs, mask=qmask, other=0.0))  # [DP, HP] e4m3
        w8 = w * tl.load(sq_ptr + t.to(tl.int64) * H + h, mask=hmask, other=0.0)  # w' = w * sq
        q_exact = tl.load(qok_ptr + t) != 0
    e = tl.arange(0, BN)
    for tile in range(tile0, tl.minimum(tile0 + tiles_per_prog, tl.cdiv(C, BN))):
        pos = tile * BN + e  # [BN] candidate positions
        pmask = pos < C
        ids = tl.load(blk_ptr + t.to(tl.int64) * stride_bt + pos // B, mask=pmask, other=-1)
        row = ids * B + pos % B
        valid = pmask & (ids >= 0) & (row < N) & (row >= ks) & (row < ke)
        rows = tl.where(valid, row, 0).to(tl.int64)
        kmask = valid[:, None] & (d[None, :] < D)
        acc = tl.zeros((BN, HP), dtype=tl.float32)
        if FP8:
            k_exact = tl.min(tl.load(kok_ptr + rows, mask=valid, other=1).to(tl.int32), axis=0) > 0
            if q_exact & k_exact:
                k8 = tl.load(k8_ptr + rows[:, None] * stride_kn + d[None, :], mask=kmask, other=0.0)
                if INTERPRET:  # the interpreter's fp8 dot is not relied on: exact fp32 operands
                    acc = tl.dot(k8.to(tl.float32), q8T.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(k8, q8T, acc)  # [BN, HP]
                sk = tl.load(sk_ptr + rows, mask=valid, other=0.0)
                s = tl.sum(tl.maximum(acc, 0.0) * w8[None, :], axis=1) * sk  # [BN]
            else:  # a row e4m3 x 2^k cannot hold (q's or a gathered key's): this tile with the native dot
                kt = tl.load(k_ptr + rows[:, None] * stride_kn + d[None, :], mask=kmask, other=0.0)
                acc = mma(kt, qT, acc, IEEE, INTERPRET)
                s = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
        else:
            kt = tl.load(k_ptr + rows[:, None] * stride_kn + d[None, :], mask=kmask, other=0.0)
            acc = mma(kt, qT, acc, IEEE, INTERPRET)
            s = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + pos, tl.where(valid, s, float("-inf")), mask=pmask)


def default_candidate_config() -> dict:
    """Tile config (small tiles in the interpreter). ``tiles_per_prog``: BN-entry tiles one program scores.
    ``fp8_min_heads`` / ``fp8_min_dim``: the FP8 dot's N (padded heads) and K (padded dim) are at least these. On the
    GPU they are V4.1's index shape (32 heads of 128): a small model's 8 heads of 64 (a [128, 64] x [64, 16] e4m3 dot)
    faulted with an illegal address on the H100 with Triton 3.6 (round 30), where 32 x 128 is tested. The padding is
    exact (zero q columns, zero weights)."""
    if interpreting():
        return dict(BN=16, num_warps=4, num_stages=1, tiles_per_prog=2, fp8_min_heads=16, fp8_min_dim=32)
    return dict(BN=128, num_warps=4, num_stages=3, tiles_per_prog=32, fp8_min_heads=32, fp8_min_dim=128)


def _launch_candidate_scores(q, k, w, k_start, k_end, blocks, block, fp8, out=None, info=None, **cfg):
    """The kernel on checked inputs -> candidate scores [T, KB * block] fp32."""
    t, h, d = q.shape
    n, kb = k.shape[0], blocks.shape[1]
    c = kb * block
    conf = {**default_candidate_config(), **cfg}
    bn, tpp = conf["BN"], conf["tiles_per_prog"]
    hp, dp = _pow2(h, 16), _pow2(d, 32)
    if fp8:
        hp, dp = max(hp, _pow2(conf["fp8_min_heads"])), max(dp, _pow2(conf["fp8_min_dim"]))
    if bn < 16 or bn % block:
        raise ValueError(f"BN must be >= 16 and a multiple of the block size {block}, got {bn}")
    if out is None:
        out = torch.empty(t, c, device=q.device, dtype=torch.float32)
    if t == 0 or c == 0:
        return out
    q = q.contiguous()
    k = (k if k.dtype == q.dtype else k.to(q.dtype)).contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    if fp8:
        q8, sq, _, qok = _launch_rebase(q.view(t * h, d), h)  # one flag per query (its H rows)
        k8, sk, kok, _ = _launch_rebase(k, _KEY_REBASE_GROUP)  # one flag per key row
        q8, qok, kok = q8.view(t, h, d), qok.view(torch.int8), kok.view(torch.int8)
    else:
        q8, sq, k8, sk, qok, kok = q, w, k, w, w, w  # not read (FP8 False)
    grid = (t, triton.cdiv(triton.cdiv(c, bn), tpp))
    kern = _candidate_score_kernel[grid](
        q, k, q8, sq, k8, sk, qok, kok, w, k_start.contiguous(), k_end.contiguous(), blocks, out,
        t, n, h, c, kb, tpp, q.stride(0), q.stride(1), k.stride(0), w.stride(0), blocks.stride(0), out.stride(0),
        B=block, D=d, DP=dp, HP=hp, BN=bn, FP8=fp8, IEEE=q.dtype == torch.float32,
        INTERPRET=interpreting(), num_warps=conf["num_warps"], num_stages=conf["num_stages"],
    )
    _record(info, kern, grid[0] * grid[1])
    return out


def positions_to_keys(pos: torch.Tensor, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Candidate positions [T, k] (-1 = none) -> key ids: blocks[t, pos // block] * block + pos % block."""
    p = pos.clamp(min=0)
    keys = blocks.gather(1, p // block) * block + p % block
    return torch.where(pos >= 0, keys, -1)


@dispatch_op("minidi::indexer_topk_candidates")
def _candidates_op(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor,
    blocks: torch.Tensor, block: int, topk: int, fp8: bool,
) -> torch.Tensor:
    if not triton_can_run(q, k, w, k_start, k_end, blocks):
        raise cannot_run("minidi::indexer_topk_candidates", q, k, w, k_start, k_end, blocks)
    sc = _launch_candidate_scores(q, k, w, k_start, k_end, blocks, block, fp8)
    return positions_to_keys(_topk_op(sc, topk, None, None, None, 0), blocks, block)


@_candidates_op.register_fake
def _(q, k, w, k_start, k_end, blocks, block, topk, fp8):
    return q.new_empty(q.shape[0], topk, dtype=torch.int64)


# ------------------------------------------------------------------------------------------------------- references
def candidate_scores_ref(q, k, w, k_start, k_end, blocks, block) -> torch.Tensor:
    """Plain torch, float64 products: the kernel's contract. [T, KB * block] fp32, -inf where invalid."""
    t, n = q.shape[0], k.shape[0]
    pos = torch.arange(blocks.shape[1] * block, device=q.device)
    ids = blocks[:, pos // block]  # [T, C]
    row = ids * block + pos % block
    valid = (ids >= 0) & (row < n) & (row >= k_start[:, None]) & (row < k_end[:, None])
    kr = k.double()[row.clamp(0, max(n - 1, 0))] if n else k.new_zeros(t, pos.shape[0], k.shape[1]).double()
    s = torch.einsum("thd,tcd->thc", q.double(), kr).relu()  # [T, H, C]
    s = (s * w.double().unsqueeze(-1)).sum(1)
    return s.float().masked_fill(~valid, float("-inf"))


def indexer_topk_candidates_ref(q, k, w, k_start, k_end, topk, blocks, block) -> torch.Tensor:
    """The definition: the candidate scores' top-k set (ties to the lowest key), ascending keys, -1 for -inf picks."""
    kk = min(topk, k.shape[0])
    pos = topk_indices_ref(candidate_scores_ref(q, k, w, k_start, k_end, blocks, block), kk)
    return positions_to_keys(pos, blocks, block)


# ----------------------------------------------------------------------------------------------------- public wrapper
def _check(q, k, w, k_start, k_end, topk, blocks, block, backend, mma_kind) -> str:
    if mma_kind not in MMA_KINDS:
        raise ValueError(f"mma must be one of {MMA_KINDS}, got {mma_kind!r}")
    for name, x in (("q", q), ("k", k), ("w", w), ("k_start", k_start), ("k_end", k_end), ("blocks", blocks)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on {q.device} (the device of q), got {x.device}")
    if q.dim() != 3 or q.dtype not in _QK_DTYPES:
        raise ValueError(f"q must be [T, H, D] bf16/fp16/fp32, got {tuple(q.shape)} {q.dtype}")
    t, h, d = q.shape
    if k.dim() != 2 or k.shape[1] != d or k.dtype not in _QK_DTYPES:
        raise ValueError(f"k must be [N, {d}] bf16/fp16/fp32 (D of q), got {tuple(k.shape)} {k.dtype}")
    if w.shape != (t, h) or w.dtype not in _QK_DTYPES:
        raise ValueError(f"w must be [{t}, {h}] bf16/fp16/fp32, got {tuple(w.shape)} {w.dtype}")
    for name, x in (("k_start", k_start), ("k_end", k_end)):
        if x.shape != (t,) or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be [{t}] int32/int64, got {tuple(x.shape)} {x.dtype}")
    if blocks.dim() != 2 or blocks.shape[0] != t or blocks.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"blocks must be [{t}, KB] int32/int64 (block ids, -1 = none), got "
                         f"{tuple(blocks.shape)} {blocks.dtype}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if not isinstance(topk, int) or not 0 <= topk <= MAX_K:
        raise ValueError(f"topk must be an int in [0, {MAX_K}], got {topk!r}")
    if mma_kind == "fp8" and not 1 <= d <= 256:
        raise ValueError(f"mma='fp8' needs D in [1, 256], got {d}")
    return resolve_backend(backend, "indexer_topk_candidates", q, k, w, k_start, k_end, blocks)


def indexer_topk_candidates(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, topk: int,
    blocks: torch.Tensor, block: int, backend: str = "auto", mma: str = "native",
) -> torch.Tensor:
    """``indexer_topk(q, k, w, k_start, k_end, topk, candidate_allowed(blocks, N, block))[0]``, scoring only the
    candidates.

    q [T, H, D], k [N, D], w [T, H] (bf16/fp16/fp32), k_start / k_end [T] int, blocks [T, KB] int: each query's
    candidate block ids, distinct, ascending, then -1 (``candidate_blocks``' output; with another order the picks
    are the same set but exact ties go to the lowest candidate position and the keys are not sorted).
    Returns idx [T, min(topk, N)] int64: the top-k set of the candidates' fp32 scores in ascending key order, exact
    ties to the lowest key, then -1 for picks scored -inf (fewer than top-k visible candidates).
    ``mma``: "native" or "fp8" (fq4 q and k: e4m3 operands, exact products; tiles with an inexact row fall back to
    the native dot). ``backend``: "auto" | "triton" | "ref" (plain torch, float64 products).
    """
    run = _check(q, k, w, k_start, k_end, topk, blocks, block, backend, mma)
    kk = min(topk, k.shape[0])
    if run == "ref":
        return indexer_topk_candidates_ref(q, k, w, k_start, k_end, topk, blocks, block)
    return _candidates_op(q, k, w, k_start, k_end, blocks.long(), block, kk, mma == "fp8")


__all__ = ["indexer_topk_candidates", "indexer_topk_candidates_ref", "candidate_scores_ref",
           "default_candidate_config", "positions_to_keys"]
