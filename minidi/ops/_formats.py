"""Checkpoint number formats shared by the ops' plain-torch references (ops import nothing from minidi.model)."""

from __future__ import annotations

import torch


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (``float8_e8m0fnu`` or ``uint8``) -> fp32 2^(b-127), exact; 0 -> 2^-127, 255 -> NaN."""
    b = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)  # 2^-127 is the fp32 subnormal 0x00400000
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)  # NaN
    return bits.view(torch.float32)
