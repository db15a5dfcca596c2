"""Shared by the expert GEMM benchmarks (``bench_fp4_grouped_gemm.py``, ``bench_fp8_grouped_gemm.py``): rows per
expert (uniform, balanced or skewed), chunked weight dequantisation, and the bf16-vs-bf16 output check."""

from __future__ import annotations

import torch

NAIVE_CHUNK = 16  # experts per eager dequant chunk (its int64 temporaries: ~0.4 GB per expert here)


DISTS = ("uniform", "balanced", "skewed")
# Lognormal sigma of the experts' popularity. "balanced": the router's loads in the real step (V4.1 EP4 with zero gate
# bias, bench/expert_loads.py: cv ~0.15, max/mean ~1.4); with the multinomial draw's own noise (cv 1/sqrt(rows)) it
# gives cv ~0.15, max/mean ~1.35-1.45 for 96 experts x 256 rows (``load_stats``). "skewed": a few hot experts, some
# nearly idle (cv ~1.3).
POPULARITY_SIGMA = {"balanced": 0.14, "skewed": 1.0}


def make_counts(e: int, rows: int, dist: str, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert [e] int64 summing to e * rows: exactly ``rows`` each ("uniform"), or a multinomial draw over
    lognormal popularities ("balanced", "skewed": ``POPULARITY_SIGMA``)."""
    if dist == "uniform":
        return torch.full((e,), rows, dtype=torch.int64)
    if dist not in POPULARITY_SIGMA:
        raise ValueError(f"unknown rows distribution {dist!r}: expected one of {DISTS}")
    p = torch.exp(POPULARITY_SIGMA[dist] * torch.randn(e, generator=gen))
    return torch.multinomial(p / p.sum(), e * rows, replacement=True, generator=gen).bincount(minlength=e)


def load_stats(counts: torch.Tensor, tile_rows: tuple[int, ...] = (64, 128, 256)) -> dict:
    """cv and max / mean of the rows per expert, and the m-tiles per expert that fixed tiles of each size take."""
    c = counts.double()
    mean = c.mean().item()
    out = {"cv": round(c.std(unbiased=False).item() / mean, 3), "max_over_mean": round(c.max().item() / mean, 3)}
    for bt in tile_rows:
        out[f"tiles_per_expert_bt{bt}"] = round(((counts + bt - 1) // bt).sum().item() / len(counts), 3)
    return out


def dequant_chunked(wp: torch.Tensor, ws: torch.Tensor, fn, out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(*wp.shape[:2], 2 * wp.shape[2], dtype=torch.bfloat16, device=wp.device) if out is None else out
    for i in range(0, wp.shape[0], NAIVE_CHUNK):
        out[i:i + NAIVE_CHUNK] = fn(wp[i:i + NAIVE_CHUNK], ws[i:i + NAIVE_CHUNK])
    return out


def check(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """bf16 vs bf16 (both fp32-accumulated): ok if |d| <= 2^-7 |ref| + 1e-3 max|ref| everywhere."""
    d = (out.float() - ref.float()).abs()
    r = ref.float().abs()
    bad = int((d > 2**-7 * r + 1e-3 * r.max()).sum())
    return {"ok": bad == 0 and bool(torch.isfinite(out).all()), "bad": bad,
            "max_rel_err": float(d.max() / r.max()), "mean_rel_err": float(d.mean() / r.mean())}
