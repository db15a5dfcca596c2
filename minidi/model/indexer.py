"""Lightning indexer: score compressed entries per query, keep the top-k (spec V4.1 §8, V4 §6).

Legend: T queries, N compressed entries, Hi index heads, di index head dim, B candidate block size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidi.selection import topk_picks

from .compressor import CompressorV4
from .config import ModelConfig
from .context import RatioMeta
from .layers import FP8Linear, Linear, RMSNorm, apply_rope
from .quant import fq4_ue8m0, hadamard


_PICK_BYTES = 16  # the top-k's temporaries per score (the NaN-free copy, masks, int32 ranks, the top-k's own)


def _score_row_bytes(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.shape[1] * k.shape[0] * q.element_size()


def _head_weighted_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_h w[t, h] * relu(q[t, h] . k[j]) -> [T, N], in q's dtype (the unchunked chain, one chunk of queries)."""
    scores = torch.einsum("thd,nd->thn", q, k.to(q.dtype))
    return (scores.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)


_pick = topk_picks  # the indexer's picks: the top-k set ascending, -1 for -inf picks (``minidi.selection``)


def indexer_topk_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    topk: int,
    allowed: torch.Tensor | None = None,
    budget: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """**Pass target B** (indexer score + top-k).

    score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]);  -inf unless k_start[t] <= j < k_end[t] (and ``allowed``).
    q [T, Hi, di], k [N, di] (the step's view of compressed entries; a query's own sequence occupies
    [k_start, k_start + its entry count)), w [T, Hi], k_start/k_end [T] int, allowed [T, N] bool or None.
    The score runs in the activation dtype, as the official indexer (bf16 einsum, relu*weights and head sum).
    Returns (idx [T, min(topk, N)] int64, scores [T, N]): idx holds the top-k set in ascending column order, exact
    score ties to the lowest column (``minidi.selection.topk_set``: the same picks whatever else shares the step),
    then -1 for picks scored -inf (outside the visible range or not ``allowed``, when fewer than topk are visible).

    ``budget`` None: the whole chain (the form torch.compile traces: pass B's target; Inductor fuses the relu /
    weight / sum into one reduction over the product). Bytes: the same math with the [T, Hi, N] product built a
    few query rows at a time under ``budget`` (an eager run's memory budget, ``Transformer.set_eager_budget``: at
    4,096 queries x 32 heads x 131,072 entries the whole product is 32 GiB in bf16, and the relu / weight
    temporaries triple it), and the top-k's [T, N] temporaries (~16 B per score) likewise.
    """
    n = k.shape[0]
    if budget is None or q.shape[0] * _score_row_bytes(q, k) <= budget:
        scores = _head_weighted_scores(q, k, w)  # [T, N] (a [T, Hi, N] product inside)
    else:
        rows = max(1, budget // _score_row_bytes(q, k))
        scores = torch.cat([_head_weighted_scores(qc, k, wc) for qc, wc in zip(q.split(rows), w.split(rows))])
    j = torch.arange(n, device=q.device).unsqueeze(0)
    lo, hi = k_start.unsqueeze(1), k_end.unsqueeze(1)
    scores = scores.masked_fill((j < lo) | (j >= hi), float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    kk = min(topk, n)
    if budget is None or q.shape[0] * n * _PICK_BYTES <= budget:
        return _pick(scores, kk), scores
    rows = max(1, budget // (n * _PICK_BYTES))
    return torch.cat([_pick(s, kk) for s in scores.split(rows)]), scores


def candidate_blocks(
    scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, keep_blocks: int, block: int
) -> torch.Tensor:
    """V4.1 pre-filter (candidate source layer): the ``keep_blocks`` blocks of ``block`` entries with the highest
    max score (ties to the lower block), always keeping the newest (partly filled) visible block; blocks whose max is
    -inf are dropped. Blocks count from each sequence's first entry (its view segment starts at a multiple of
    ``block``). scores [T, N] -> block ids [T, min(keep_blocks, cdiv(N, block))] int64: each row's kept blocks in
    ascending order, then -1 (the indexer's pick convention, ``_pick``)."""
    bs = block_max(scores, block)  # [T, NB]
    newest = ((k_end - 1).clamp(min=0) // block).unsqueeze(1)  # [T, 1]
    force = torch.zeros_like(bs, dtype=torch.bool).scatter(1, newest, (k_end > k_start).unsqueeze(1))
    return _pick(bs.masked_fill(force, float("inf")), min(keep_blocks, bs.shape[1]))


def block_max(scores: torch.Tensor, block: int) -> torch.Tensor:
    """The max of each ``block`` consecutive scores (the last block padded with -inf): [T, N] -> fp32 [T, cdiv(N,
    block)]; NaN propagates. Written as a chain of elementwise maxima over the block's columns, the same values as
    ``.view(T, NB, block).amax(-1)``. In the V4.1 step Inductor fuses it with the scores' NaN masking into one
    pointwise kernel: 2.27 ms a step on the H200 (round 14, ``docs/benchmarks/README.md``) where the fused 8-wide
    ``amax`` reduction took 5.05 ms (3.41 ms autotuned) for the 2.4 GB it must move."""
    t, n = scores.shape
    pad = -n % block
    cols = F.pad(scores.float(), (0, pad), value=float("-inf")).view(t, (n + pad) // block, block).unbind(-1)
    out = cols[0]
    for c in cols[1:]:
        out = torch.maximum(out, c)
    return out


def candidate_allowed(blocks: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """The entries of the candidate blocks as a mask: blocks [T, KB] int64 (ids, -1 = none) -> [T, n] bool, entry j
    allowed when block j // ``block`` is one of its row's ids. (Pass M reads the ids instead: candidate-only
    scoring.)"""
    nb = -(-n // block)
    ids = blocks.masked_fill(blocks < 0, nb)  # -1 -> a spare column past every block
    keep = torch.zeros(blocks.shape[0], nb + 1, dtype=torch.bool, device=blocks.device).scatter(1, ids, True)
    return keep[:, torch.arange(n, device=blocks.device) // block]  # [T, n]


def candidate_mask(
    scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, keep_blocks: int, block: int
) -> torch.Tensor:
    """``candidate_blocks`` as a [T, N] bool mask (``candidate_allowed``)."""
    return candidate_allowed(candidate_blocks(scores, k_start, k_end, keep_blocks, block), scores.shape[1], block)


class IndexerV41(nn.Module):
    """Index heads over the shared compressed entries. Owners (kv sources) also turn their compressor's latent into
    indexer keys (wk, k_norm); re-index layers score layer-``candidate_source``'s keys inside its candidates."""

    def __init__(self, cfg: ModelConfig, owns_keys: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = FP8Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, cfg)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads)
        if owns_keys:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps)

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Owner keys from the pre-RoPE compressor latent [N, dc] -> [N, di] (RoPE at the entry position, fq4)."""
        k = apply_rope(self.k_norm(self.wk(latent)), cos, sin)
        return fq4_ue8m0(k, 32) if self.cfg.fake_quant else k

    def queries(self, x: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> q [T, Hi, di] (RoPE at t, fq4), head weights [T, Hi]."""
        q = self.wq_b(q_lat).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope(q, cos, sin)
        if self.cfg.fake_quant:
            q = fq4_ue8m0(q, 32)
        w = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w


class IndexerV4(nn.Module):
    """V4 CSA indexer with its own overlapping ratio-4 compressor; q and k are Hadamard-rotated then FP4-quantised
    (the rotation is an exact identity on the scores, so it is applied only with fake-quant on)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = FP8Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, cfg)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads)
        self.compressor = CompressorV4(cfg, 4, cfg.index_head_dim)

    def _quant(self, x: torch.Tensor) -> torch.Tensor:
        return fq4_ue8m0(hadamard(x), 32) if self.cfg.fake_quant else x

    def keys(self, x: torch.Tensor, meta: RatioMeta, pending: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
        """New indexer keys [Nn, di] from this layer's own ratio-4 compressor; cos/sin [Nn, r/2] at the entry
        positions ``meta.entry_pos`` (the layer's attention compressor has the same ratio 4, so the same entries)."""
        return self._quant(apply_rope(self.compressor(x, meta, pending), cos, sin))

    def queries(self, x: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q = self.wq_b(q_lat).unflatten(-1, (self.n_heads, self.head_dim))
        q = self._quant(apply_rope(q, cos, sin))
        w = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w
