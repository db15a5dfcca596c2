"""Manifold-constrained hyper-connections (mHC): n residual streams mixed around every sublayer.

Spec V4 §3 (per-site mixer, hc_head) and V4.1 §4 (single pass: the ``pre`` a site computes collapses the input of
the next site). All mixer math is fp32; streams are stored in the activation dtype between sites.
Legend: T tokens, n streams (hc_mult), D width.
"""

from __future__ import annotations

import torch


def hc_mixer(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, n, D] -> pre [T, n], post [T, n], comb [T, n, n] (fp32).

    mu = (flat(x) . fn^T) * rsqrt(mean(flat(x)^2) + eps)  (official order: project, then scale)
    pre = sigmoid(mu[:n]*s0 + b) + hc_eps; post = 2*sigmoid(mu[n:2n]*s1 + b); comb = Sinkhorn(mu[2n:]*s2 + b).
    """
    t, n, d = x.shape
    z = x.reshape(t, n * d).float()
    mu = (z @ fn.float().t()) * torch.rsqrt(z.square().mean(-1, keepdim=True) + norm_eps)  # [T, (2+n)n]
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mu[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * torch.sigmoid(mu[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    c = (mu[:, 2 * n :] * scale[2] + base[2 * n :]).view(t, n, n)  # [T, j, k]
    c = torch.softmax(c, dim=-1) + hc_eps
    c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)  # normalise over j (columns) first
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + hc_eps)
        c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, c


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """u = sum_j pre_j * x_j: x [T, n, D], pre [T, n] -> [T, D] in the stream dtype."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def hc_expand(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """x'_k = post_k * h + sum_j comb[j, k] * x_j (fp32, stored in the stream dtype). x [T,n,D], h [T,D]."""
    mixed = torch.einsum("tjk,tjd->tkd", comb, x.float())
    return (post.unsqueeze(-1) * h.float().unsqueeze(1) + mixed).to(x.dtype)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """V4 only: collapse the streams before the final norm. x [T, n, D] -> [T, D]."""
    t, n, d = x.shape
    z = x.reshape(t, n * d).float()
    mu = (z @ fn.float().t()) * torch.rsqrt(z.square().mean(-1, keepdim=True) + norm_eps)  # [T, n]
    pre = torch.sigmoid(mu * scale.float()[0] + base.float()) + hc_eps
    return hc_collapse(x, pre)
