"""KV compressors: pool groups of m tokens into one compressed entry (spec V4.1 §7, V4 §5).

A group may straddle steps (chunked prefill, a cached prefix): the fp32 K|G rows of tokens whose group is not yet
complete stay in a *pending* pool, and ``RatioMeta.group_idx`` picks each new entry's m rows from
``cat(pending, this step's K|G)``. Both compressors return the normalised latent (pre-RoPE, pre-quant) of the
entries completed in this step; the caller rotates and fake-quantises them.
Legend: T new tokens, Nn new entries, dc latent width, c = 2 halves when V4 windows overlap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .context import RatioMeta
from .layers import RMSNorm, weight_param


def _proj(cfg: ModelConfig, out: int) -> nn.Module:
    m = nn.Module()
    m.weight = weight_param(out, cfg.dim, dtype=torch.bfloat16)
    return m


def gather_groups(
    kg_new: torch.Tensor, pending: torch.Tensor | None, meta: RatioMeta
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of each new entry from cat(pending, new) [Nn, m, 2w]; then keep the still-incomplete rows pending.

    Returns (groups, all rows); the pending pool is updated in place (rows of incomplete groups)."""
    rows = kg_new if pending is None else torch.cat([pending, kg_new], dim=0)  # [Rp+T, 2w]
    if pending is not None:
        pending.index_copy_(0, meta.pend_dst, rows[meta.pend_src])
    return rows[meta.group_idx], rows


class CompressorV41(nn.Module):
    """V4.1 CSA2: ratio 2 = channel-wise softmax pooling of two tokens (fp32, no overlap, no ape);
    ratio 1 = a plain projection (bf16, no gate)."""

    def __init__(self, cfg: ModelConfig, ratio: int) -> None:
        super().__init__()
        self.ratio, self.width = ratio, cfg.head_dim
        self.wkv = _proj(cfg, cfg.head_dim)
        if ratio == 2:
            self.wgate = _proj(cfg, cfg.head_dim)
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, meta: RatioMeta, pending: torch.Tensor | None) -> torch.Tensor:
        """x [T, D] -> latent [Nn, dc] (activation dtype)."""
        if self.ratio == 1:
            return self.norm(F.linear(x, self.wkv.weight.to(x.dtype)))[meta.group_idx[:, 0]]
        xf = x.float()
        kg = torch.cat([xf @ self.wkv.weight.float().t(), xf @ self.wgate.weight.float().t()], dim=-1)  # [T, 2w]
        groups, _ = gather_groups(kg, pending, meta)  # [Nn, m, 2w]
        k, g = groups[..., : self.width], groups[..., self.width :]
        pooled = (torch.softmax(g, dim=1) * k).sum(dim=1)  # [Nn, dc]
        return self.norm(pooled.to(x.dtype))


class CompressorV4(nn.Module):
    """V4: softmax pooling with a learned per-slot bias ``ape``; ratio 4 overlaps windows (c = 2 halves: entry w
    pools the A-half of window w-1 and the B-half of window w), other ratios pool one window (c = 1).
    Used for the attention KV (dc = head_dim) and the indexer keys (dc = index_head_dim)."""

    def __init__(self, cfg: ModelConfig, ratio: int, dc: int) -> None:
        super().__init__()
        self.ratio, self.dc = ratio, dc
        self.overlap = ratio == 4
        self.width = (2 if self.overlap else 1) * dc
        self.wkv = _proj(cfg, self.width)
        self.wgate = _proj(cfg, self.width)
        self.ape = weight_param(ratio, self.width, dtype=torch.float32)
        self.norm = RMSNorm(dc, cfg.norm_eps)

    def forward(self, x: torch.Tensor, meta: RatioMeta, pending: torch.Tensor | None) -> torch.Tensor:
        """x [T, D] -> latent [Nn, dc] (activation dtype)."""
        w, dc = self.width, self.dc
        xf = x.float()
        kg = torch.cat([xf @ self.wkv.weight.float().t(), xf @ self.wgate.weight.float().t()], dim=-1)  # [T, 2w]
        groups, rows = gather_groups(kg, pending, meta)  # [Nn, m, 2w]
        ape = self.ape.float()
        k, g = groups[..., :w], groups[..., w:] + ape  # slot j of every window gets ape[j]
        if self.overlap:
            prev = rows[meta.prev_idx.clamp(min=0)]  # [Nn, m, 2w]: window w-1
            has_prev = (meta.prev_idx >= 0).unsqueeze(-1)
            k_prev = torch.where(has_prev, prev[..., :dc], torch.zeros_like(prev[..., :dc]))
            g_prev = torch.where(has_prev, prev[..., w : w + dc] + ape[:, :dc], float("-inf"))
            k = torch.cat([k_prev, k[..., dc:]], dim=1)  # [Nn, 2m, dc]
            g = torch.cat([g_prev, g[..., dc:]], dim=1)
        pooled = (torch.softmax(g, dim=1) * k).sum(dim=1)  # [Nn, dc]
        return self.norm(pooled.to(x.dtype))
