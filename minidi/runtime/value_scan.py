"""Opt-in value scan of loaded weights: NaN / Inf, and E8M0 scale byte 255 (the format's NaN).

A structurally perfect checkpoint can still hold bad values (a flipped bit in a 290 GB download, a broken
conversion): one NaN weight or one E8M0 scale of 0xFF makes every logit NaN with no hint why. The scan reads every
byte, so it is opt-in (``load_checkpoint(..., validate_values=True)`` / ``load_model(...)``); the benchmark card
can call ``scan_values`` itself or note that values were not scanned. It works in chunks, so it needs little
memory beyond the weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

CHUNK = 1 << 24  # elements per pass: bounds the temporary masks at full size
# for a benchmark card whose weights were not scanned (random weights, or validate_values=False)
NOT_SCANNED_NOTE = "weight values not scanned for NaN / Inf / E8M0 255 (load with validate_values=True)"
_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _count(t: torch.Tensor, bad) -> int:
    flat = t.reshape(-1)
    return sum(int(bad(flat[i:i + CHUNK]).sum()) for i in range(0, flat.numel(), CHUNK))


def tensor_problem(name: str, t: torch.Tensor) -> str | None:
    """What is wrong with the values of one tensor, or None."""
    if t.dtype == torch.float8_e8m0fnu:
        n = _count(t.view(torch.uint8), lambda c: c == 255)
        return f"{name}: {n} E8M0 scale byte(s) 255 (NaN)" if n else None
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        n = _count(t, lambda c: ~torch.isfinite(c.float()))
        return f"{name}: {n} NaN/Inf value(s)" if n else None
    if t.dtype in _FLOATS:
        nan = _count(t, torch.isnan)
        inf = _count(t, torch.isinf)
        parts = [f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else ""]
        return f"{name}: {', '.join(p for p in parts if p)} value(s)" if nan or inf else None
    return None  # integer tensors (packed FP4 codes, tid2eid) have no non-finite values


def scan_values(tensors: Mapping[str, torch.Tensor], max_listed: int = 100) -> list[str]:
    """One problem line listing every tensor with NaN / Inf values or E8M0 255 scales (empty if all are clean)."""
    bad = [p for p in (tensor_problem(n, t) for n, t in tensors.items()) if p]
    if not bad:
        return []
    more = f" ... (+{len(bad) - max_listed} more)" if len(bad) > max_listed else ""
    return [f"bad values in tensors ({len(bad)}): " + "; ".join(bad[:max_listed]) + more]
