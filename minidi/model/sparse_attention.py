"""Sparse attention with a per-head sink, written the plain way (pass target A).

Legend: T queries, H heads, D head dim (512), W window slots, K compressed slots, Nw / Nc rows in the caches.
"""

from __future__ import annotations

import torch


def sparse_attention_naive(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_idx: torch.Tensor,
    comp_kv: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """**Pass target A** (key assembly + attention): gather key rows by index, ``cat``, blank empty slots, attend.

    q [T, H, D]; window_kv [Nw, D], window_idx [T, W]; comp_kv [Nc, D], comp_idx [T, K] (rows, -1 = empty);
    sink [H] fp32. One KV row is both key and value for every head (single KV head, MQA).
    p_j = exp(s_j - M) / (sum_i exp(s_i - M) + exp(sink_h - M)), M = max over real keys (the sink enters the
    denominator only). As the official kernel: fp32 scores, the unnormalised exp rounded to the activation dtype
    (bf16) before PV, fp32 accumulation, division by the fp32 denominator. Returns [T, H, D] in q's dtype.
    """
    keys = window_kv[window_idx.clamp(min=0)]  # [T, W, D]
    idx = window_idx
    if comp_idx is not None and comp_kv is not None:
        keys = torch.cat([keys, comp_kv[comp_idx.clamp(min=0)]], dim=1)  # [T, W+K, D]
        idx = torch.cat([window_idx, comp_idx], dim=1)
    valid = idx >= 0  # [T, K']
    keys = torch.where(valid.unsqueeze(-1), keys, torch.zeros_like(keys))
    scores = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale  # [T, H, K']
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # real keys only; every query has at least itself
    e = torch.exp(scores - m)
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink.float().view(1, -1, 1) - m)
    e = e.to(q.dtype).float()  # bf16 probability rounding before PV (no-op in fp32 mode)
    out = torch.einsum("thk,tkd->thd", e, keys.float()) / denom
    return out.to(q.dtype)
