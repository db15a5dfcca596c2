"""Shared by the expert GEMM benchmarks (``bench_fp4_grouped_gemm.py``, ``bench_fp8_grouped_gemm.py``): rows per
expert (uniform or skewed), chunked weight dequantisation, and the bf16-vs-bf16 output check."""

from __future__ import annotations

import torch

NAIVE_CHUNK = 16  # experts per eager dequant chunk (its int64 temporaries: ~0.4 GB per expert here)


def make_counts(e: int, rows: int, dist: str, gen: torch.Generator) -> torch.Tensor:
    if dist == "uniform":
        return torch.full((e,), rows, dtype=torch.int64)
    p = torch.exp(torch.randn(e, generator=gen))  # lognormal popularity: a few hot experts, some nearly idle
    return torch.multinomial(p / p.sum(), e * rows, replacement=True, generator=gen).bincount(minlength=e)


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
