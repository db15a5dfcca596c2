"""Engram: an n-gram hash memory added to the residual streams before a block (spec V4.1 §5.2).

Legend: T tokens, n streams, D width, R = (max_ngram-1)*heads rows per token, hd engram head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import FP8Linear, hold_e8m0_as_bytes, scale_param, weight_param
from .quant import e8m0_to_float


class EngramEmbedding(nn.Module):
    """FP8 table [rows, hd] with one E8M0 scale per row per 32-channel block; rows are gathered, then dequantised."""

    def __init__(self, rows: int, head_dim: int) -> None:
        super().__init__()
        self.weight = weight_param(rows, head_dim, dtype=torch.float8_e4m3fn)
        self.scale = scale_param(rows, head_dim // 32)
        hold_e8m0_as_bytes(self)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [T, R] -> [T, R, hd] (exact in bf16)."""
        q = self.weight[ids].float()  # [T, R, hd]
        s = e8m0_to_float(self.scale[ids])  # [T, R, hd/32]
        return (q.unflatten(-1, (s.shape[-1], 32)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


class Engram(nn.Module):
    """``rows``: rows of the embedding table held (the config's ``engram_num_embeddings`` entry, or fewer: the
    caller then takes the hash ids modulo ``rows``, ``Transformer.engram_ids``)."""

    def __init__(self, cfg: ModelConfig, rows: int) -> None:
        super().__init__()
        self.cfg, self.rows = cfg, rows
        n_rows = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
        self.embed = EngramEmbedding(rows, cfg.engram_head_dim)
        self.wkv = FP8Linear(n_rows * cfg.engram_head_dim, (cfg.hc_mult + 1) * cfg.dim, cfg)
        self.q_weight = weight_param(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16)
        self.k_weight = weight_param(cfg.hc_mult, cfg.dim, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, n, D] streams, ids [T, R] hashed rows -> updated streams [T, n, D]."""
        n, d = x.shape[1:]
        eps = self.cfg.norm_eps
        kv = self.wkv(self.embed(ids, x.dtype).flatten(1)).unflatten(-1, (n + 1, d))  # [T, n+1, D]
        key = kv[:, :n].float()  # [T, n, D]
        value = kv[:, n].float()  # [T, D], added to every stream
        w = self.q_weight.float() * self.k_weight.float()  # [n, D]; only the product is used
        xf = x.float()
        rho = torch.rsqrt(xf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)  # [T, n]
        delta = (xf * w * key).sum(-1) * rho / d**0.5  # [T, n]
        mag = torch.sqrt(delta.abs().clamp(min=1e-6))
        g = torch.sigmoid(torch.where(delta >= 0, mag, -mag))  # delta = +-0 counts as positive: sigmoid(+0.001)
        return (xf + g.unsqueeze(-1) * value.unsqueeze(1)).to(x.dtype)
