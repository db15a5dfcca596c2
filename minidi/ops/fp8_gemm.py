"""The block-scaled FP8 dense GEMM's contract: its plain-torch reference and its argument checks, shared by the
Hopper kernel (``fp8_gemm_sm90.py``) and whatever calls it.

    y = fp8_gemm_ref(q, s_x, w, w_scale, block, out_dtype)
    # = (q * s_x) @ (w * s_w)^T in fp64, rounded once to out_dtype: q [M, K] e4m3, s_x [M, K / block] fp32
    # (``fq8_split(x, block)``), w [N, K] e4m3, w_scale [ceil(N / block), K / block] E8M0 codes or fp32 (s_w: each
    # block x block tile's scale)

The kernel computes the same products (e4m3 x e4m3 times powers of two) and promotes each K block's partial sum in
fp32; the sums differ in order only (semantics and bounds: ``fp8_gemm_sm90.py``).
"""

from __future__ import annotations

import torch

BLOCKS = (32, 128)  # scale block along K (= weight tile side)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_CODE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


# ---- reference and argument checks -----------------------------------------------------------------------------------
def weight_scale_fp32(w_scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8 / float8_e8m0fnu) -> fp32 2^(c - 127) (0 -> 2^-127, 255 -> NaN); fp32 passes through."""
    if w_scale.dtype == torch.float32:
        return w_scale
    from minidi.formats import e8m0_to_float

    return e8m0_to_float(w_scale)


def fp8_gemm_ref(q: torch.Tensor, s_x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Plain torch, fp64 math on the dequantised operands: (q * s_x) @ (w * s_w)^T rounded once to ``out_dtype``."""
    check_args(q, s_x, w, w_scale, block, out_dtype, "fp8_gemm_ref")
    m, k = q.shape
    n = w.shape[0]
    x = q.double() * s_x.double().repeat_interleave(block, 1)  # [M, K]
    sw = weight_scale_fp32(w_scale).double().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)  # [N, K]
    return (x @ (w.double() * sw).t()).to(out_dtype)


def check_args(q: torch.Tensor, s_x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int,
               out_dtype: torch.dtype, who: str = "fp8_gemm") -> None:
    """A ValueError naming what is wrong with a GEMM's arguments (``who``: the caller, in the message)."""
    def fail(what: str) -> None:
        raise ValueError(f"{who}: {what}")

    if block not in BLOCKS:
        fail(f"block must be one of {BLOCKS}, got {block}")
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        fail(f"q must be [M, K] float8_e4m3fn, got {tuple(q.shape)} {q.dtype}")
    if w.dim() != 2 or w.dtype != torch.float8_e4m3fn:
        fail(f"w must be [N, K] float8_e4m3fn, got {tuple(w.shape)} {w.dtype}")
    m, k = q.shape
    n = w.shape[0]
    if w.shape[1] != k:
        fail(f"q's K {k} is not w's K {w.shape[1]} (q {tuple(q.shape)}, w {tuple(w.shape)})")
    if k % block:
        fail(f"K {k} is not a multiple of block {block}")
    if s_x.dtype != torch.float32 or tuple(s_x.shape) != (m, k // block):
        fail(f"s_x must be fp32 [M, K / block] = {(m, k // block)}, got {tuple(s_x.shape)} {s_x.dtype}")
    tiles = (-(-n // block), k // block)
    if w_scale.dtype not in (*SCALE_CODE_DTYPES, torch.float32) or tuple(w_scale.shape) != tiles:
        fail(f"w_scale must be E8M0 codes (uint8 / float8_e8m0fnu) or fp32 of shape {tiles} (ceil(N / block), "
             f"K / block), got {tuple(w_scale.shape)} {w_scale.dtype}")
    if out_dtype not in OUT_DTYPES:
        fail(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    devs = {t.device for t in (q, s_x, w, w_scale)}
    if len(devs) != 1:
        fail(f"q, s_x, w and w_scale must be on one device, got {sorted(map(str, devs))}")
