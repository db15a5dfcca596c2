"""KV compressors: pool groups of m tokens into one compressed entry (spec V4.1 §7, V4 §5).

Both return the normalised latent (pre-RoPE, pre-quant) and the position of each entry (its group's first token);
the caller rotates and fake-quantises (V4.1 owners also derive indexer keys from the latent).
Legend: T tokens, N = T // m entries, dc latent width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm, weight_param


class CompressorV41(nn.Module):
    """V4.1 CSA2: ratio 2 = channel-wise softmax pooling of two tokens (fp32, no overlap, no ape);
    ratio 1 = a plain projection (bf16, no gate)."""

    def __init__(self, cfg: ModelConfig, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        d = cfg.head_dim
        self.wkv = nn.Module()
        self.wkv.weight = weight_param(d, cfg.dim, dtype=torch.bfloat16)
        if ratio == 2:
            self.wgate = nn.Module()
            self.wgate.weight = weight_param(d, cfg.dim, dtype=torch.bfloat16)
        self.norm = RMSNorm(d, cfg.norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> latent [N, dc] (activation dtype), entry positions [N]."""
        m = self.ratio
        n = x.shape[0] // m
        if m == 1:
            return self.norm(F.linear(x, self.wkv.weight.to(x.dtype))), positions
        xg = x[: n * m].float()
        width = self.wkv.weight.shape[0]
        k = (xg @ self.wkv.weight.float().t()).view(n, m, width)  # [N, m, dc] fp32
        g = (xg @ self.wgate.weight.float().t()).view(n, m, width)
        pooled = (torch.softmax(g, dim=1) * k).sum(dim=1)  # [N, dc]
        return self.norm(pooled.to(x.dtype)), positions[: n * m : m]


class CompressorV4(nn.Module):
    """V4: softmax pooling with a learned per-slot bias ``ape``; ratio 4 overlaps windows (c = 2 halves),
    other ratios pool one window (c = 1). Used for the attention KV (dc = head_dim) and the indexer keys (dc = 128)."""

    def __init__(self, cfg: ModelConfig, ratio: int, dc: int) -> None:
        super().__init__()
        self.ratio, self.dc = ratio, dc
        self.overlap = ratio == 4
        c = 2 if self.overlap else 1
        self.wkv = nn.Module()
        self.wkv.weight = weight_param(c * dc, cfg.dim, dtype=torch.bfloat16)
        self.wgate = nn.Module()
        self.wgate.weight = weight_param(c * dc, cfg.dim, dtype=torch.bfloat16)
        self.ape = weight_param(ratio, c * dc, dtype=torch.float32)
        self.norm = RMSNorm(dc, cfg.norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> latent [N, dc] (activation dtype), entry positions [N]."""
        m, dc = self.ratio, self.dc
        n = x.shape[0] // m
        xg = x[: n * m].float()
        width = self.wkv.weight.shape[0]
        k = (xg @ self.wkv.weight.float().t()).view(n, m, width)  # [N, m, c*dc]
        g = (xg @ self.wgate.weight.float().t()).view(n, m, width) + self.ape.float()
        if self.overlap:
            # entry w pools slots 0..m-1 = A-half of window w-1 and slots m..2m-1 = B-half of window w
            ka, kb = k[..., :dc], k[..., dc:]
            ga, gb = g[..., :dc], g[..., dc:]
            ka_prev = torch.cat([torch.zeros_like(ka[:1]), ka[:-1]], dim=0)
            ga_prev = torch.cat([torch.full_like(ga[:1], float("-inf")), ga[:-1]], dim=0)
            k = torch.cat([ka_prev, kb], dim=1)  # [N, 2m, dc]
            g = torch.cat([ga_prev, gb], dim=1)
        pooled = (torch.softmax(g, dim=1) * k).sum(dim=1)  # [N, dc]
        return self.norm(pooled.to(x.dtype)), positions[: n * m : m]
