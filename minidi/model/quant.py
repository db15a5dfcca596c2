"""Weight formats and fake-quant, in plain torch (spec V4.1 §11-12, V4 §10).

Storage formats (checkpoint; the decoders and constants are ``minidi.formats``, re-exported here):
- FP8: ``float8_e4m3fn`` [out, in] + ``float8_e8m0fnu`` scale [ceil(out/B), ceil(in/B)]; W = q * 2^(e-127) per BxB tile
  (B = 32 in V4.1, 128 in V4).
- FP4 experts: ``int8`` [out, in/2], element 2i = low nibble, 2i+1 = high nibble; nibble bit 3 = sign, low 3 bits index
  the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}; scale ``float8_e8m0fnu`` [out, in/32] (1x32 along the input).
- E8M0 byte b -> 2^(b-127); edge codes: 0 -> 2^-127 (a subnormal fp32), 255 -> NaN.

Fake-quant (QAT semantics, output-visible): ``fq8`` (e4m3, power-of-two scales), ``fq4_ue8m0`` (e2m1, power-of-two
scales), ``fq4_e4m3`` (e2m1, e4m3 scales). All compute in fp32 and return the input dtype.
"""

from __future__ import annotations

import torch

# The formats themselves (E8M0 / e2m1 decode, the grids, the e4m3 max) live in the leaf module minidi.formats, shared
# with the ops' references; re-exported here for the model's modules.
from minidi.formats import (E2M1_GRID, E2M1_MAX, E4M3_MAX, dequant_fp4, dequant_fp8, e2m1_grid,  # noqa: F401
                            e8m0_to_float, expand_tiles, float_blocks, float_to_e8m0, fq4_ue8m0, hadamard,
                            hadamard_matrix, pow2_ceil, round_e2m1, unpack_fp4_codes)


# ---- FP8 block weights ---------------------------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (e4m3 [out, in], E8M0 [ceil(out/block), ceil(in/block)]), power-of-two scale per tile."""
    out, inp = w.shape
    po, pi = -out % block, -inp % block
    wp = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    tiles = wp.view((out + po) // block, block, (inp + pi) // block, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    s = pow2_ceil(amax / E4M3_MAX)
    q = (w.float() / expand_tiles(s, out, inp, block, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(s)


# ---- FP4 (e2m1) --------------------------------------------------------------------------------------------------
def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Values already on the e2m1 grid (fp32) -> codes 0..15 (uint8)."""
    a = x.abs()
    idx = torch.bucketize(a, torch.tensor(E2M1_GRID, device=x.device))
    sign = (torch.signbit(x) & (a > 0)).to(torch.int64) << 3
    return (idx | sign).to(torch.uint8)


def quantize_fp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., out, in] -> (packed int8 [..., out, in/2], E8M0 [..., out, in/block]), power-of-two scales."""
    *lead, inp = w.shape
    g = w.float().reshape(*lead, inp // block, block)
    s = pow2_ceil(g.abs().amax(-1).clamp_min(E2M1_MAX * 2.0**-126) / E2M1_MAX)
    q = round_e2m1((g / s.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)).reshape(*lead, inp)
    c = e2m1_codes(q).reshape(*lead, inp // 2, 2)
    packed = (c[..., 0] | (c[..., 1] << 4)).view(torch.int8)
    return packed, float_to_e8m0(s)


# ---- activation / KV fake-quant ---------------------------------------------------------------------------------
def fq8(x: torch.Tensor, block: int) -> torch.Tensor:
    """e4m3 fake-quant per ``block`` channels, scale 2^ceil(log2(max(amax, 1e-4)/448))."""
    g = float_blocks(x, block, "fq8")
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / E4M3_MAX)
    q = (g / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.flatten(-2).to(x.dtype)


def fq4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """e2m1 fake-quant per ``block`` channels with an e4m3 scale e4m3(max(amax, 6*2^-9)/6) (not a power of two)."""
    g = float_blocks(x, block, "fq4_e4m3")
    amax = g.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-9)
    s = (amax / E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn).float()  # explicit saturation
    return (round_e2m1((g / s).clamp(-E2M1_MAX, E2M1_MAX)) * s).flatten(-2).to(x.dtype)

