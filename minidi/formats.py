"""Checkpoint number formats in plain torch: the one place their math is written (a leaf: imports torch only).

Both sides of the model/ops wall import it: ``minidi.model.quant`` (dequant and fake-quant), the ops' plain-torch
references (``minidi.ops``) and the pass that recognises the model's FP4 decode (pass D). Triton kernels carry
their own ``@triton.jit`` twins of some of these functions (a kernel cannot call torch); each twin says so in its
docstring and ``tests/test_formats.py`` / the op tests hold it equal to the function here.

- E8M0 (``float8_e8m0fnu``, one byte): b -> 2^(b-127); edge codes 0 -> 2^-127 (the fp32 subnormal 0x00400000),
  255 -> NaN.
- FP4 e2m1, packed two per byte (``int8`` [..., n/2]): element 2i = low nibble, 2i+1 = high nibble; nibble bit 3 =
  sign, bits 0-2 index the grid {0, .5, 1, 1.5, 2, 3, 4, 6}; one E8M0 scale per ``FP4_BLOCK`` = 32 consecutive
  elements along the last dim.
- FP8 e4m3 (``float8_e4m3fn``): largest finite magnitude ``E4M3_MAX`` = 448.
- Hadamard rotation (V4's indexer q and k): the Sylvester matrix scaled by n^-1/2, applied in fp32.
- fq8 blocks (the model's FP8 activations): ``fq8_split`` gives the e4m3 values and the power-of-two scale of each
  block of ``block`` values along the last dim; ``minidi.model.quant.fq8`` is their product, the FP8 GEMMs
  (``minidi.ops.fp8_*``) multiply the two parts on the tensor cores.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest e2m1 magnitude
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7 (code | 8: the negative)
FP4_BLOCK = 32  # elements per E8M0 scale of the FP4 expert weights (1 x 32 along the input)
E8M0_MIN_BITS = 0x00400000  # fp32 bits of 2^-127, the value of E8M0 code 0 (an fp32 subnormal)
E8M0_NAN_BITS = 0x7FC00000  # fp32 bits of the NaN E8M0 code 255 decodes to


# ---- E8M0 ----------------------------------------------------------------------------------------------------------
def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (``float8_e8m0fnu`` or ``uint8``) -> fp32 powers of two, exact; 0 -> 2^-127, 255 -> NaN."""
    b = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, E8M0_MIN_BITS), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, E8M0_NAN_BITS), bits)
    return bits.view(torch.float32)


def float_to_e8m0(pow2: torch.Tensor) -> torch.Tensor:
    """Exact powers of two in [2^-127, 2^127] (fp32) -> ``float8_e8m0fnu`` codes."""
    bits = pow2.float().view(torch.int32)
    code = torch.where(bits == E8M0_MIN_BITS, torch.zeros_like(bits), (bits >> 23) & 0xFF)
    return code.to(torch.uint8).view(torch.float8_e8m0fnu)


def pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(y)) for positive normal fp32 ``y``, exact (bit arithmetic, no log rounding): the power-of-two
    (E8M0-representable) scale that maps a block's amax / format max to at most 1."""
    bits = y.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


# ---- FP8 block weights ---------------------------------------------------------------------------------------------
def expand_tiles(scale: torch.Tensor, out: int, inp: int, bo: int, bi: int) -> torch.Tensor:
    """Per-tile values [ceil(out/bo), ceil(inp/bi)] -> one per element [out, inp]."""
    s = scale.repeat_interleave(bo, dim=0)[:out] if bo > 1 else scale[:out]
    return s.repeat_interleave(bi, dim=1)[:, :inp] if bi > 1 else s[:, :inp]


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 e4m3 [out, in] x E8M0 [ceil(out/block), ceil(in/block)] -> ``dtype`` [out, in].

    Pass N (``minidi/passes/patterns.py``: ``fp8_weight_dequant``) recognises exactly this sequence of torch calls in
    the traced model: change it and that matcher together."""
    out, inp = weight.shape
    s = expand_tiles(e8m0_to_float(scale), out, inp, block, block)
    return (weight.float() * s).to(dtype)


# ---- fq8 blocks ----------------------------------------------------------------------------------------------------
FQ8_AMAX_FLOOR = 1e-4  # a block's amax is clamped to at least this before its scale is taken


def float_blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K / block, block]: the blocks every fake quant takes its scales over (``what`` names
    the caller in the error for a K that is not a multiple of ``block``). The passes match these two calls."""
    if x.shape[-1] % block:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of block {block}")
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def fq8_split(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of ``block``) -> (q float8_e4m3fn [..., K], s fp32 [..., K/block]) with
    s = 2^ceil(log2(max(amax, 1e-4) / 448)) per block and q = e4m3(clamp(x / s, +-448)) (round to nearest even):
    q * s is the model's fq8 of x, exactly."""
    g = float_blocks(x, block, "fq8")
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(FQ8_AMAX_FLOOR) / E4M3_MAX)
    q = (g / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


# ---- FP4 (e2m1) ----------------------------------------------------------------------------------------------------
def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values with |x| <= 6 to the e2m1 grid, ties to the even code (0.25->0, 0.75->1, 2.5->2, 5->4)."""
    a = x.abs()
    q = torch.where(a < 2.0, torch.round(a * 2.0) * 0.5,
                    torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0))
    return torch.copysign(q, x)


def fq4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e2m1 fake-quant per ``block`` channels, power-of-two scale 2^ceil(log2(max(amax, 6*2^-126)/6)).

    Pass V (``minidi/passes/patterns.py``: ``fq4_ue8m0_input``) recognises exactly this sequence of torch calls in
    the traced model where it follows the Hadamard rotation: change it and that matcher together."""
    g = float_blocks(x, block, "fq4_ue8m0")
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-126) / E2M1_MAX)
    return (round_e2m1((g / s).clamp(-E2M1_MAX, E2M1_MAX)) * s).flatten(-2).to(x.dtype)


def e2m1_grid(device: torch.device | str = "cpu") -> torch.Tensor:
    """Value of each 4-bit code 0..15, fp32 [16]."""
    g = torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)
    return torch.cat([g, -g])


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., n/2] -> codes int64 [..., n]; element 2i = low nibble, 2i+1 = high nibble."""
    b = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = FP4_BLOCK) -> torch.Tensor:
    """Packed e2m1 [..., out, in/2] x E8M0 [..., out, in/block] -> ``dtype`` [..., out, in] (exact in fp32).

    Pass D (``minidi/passes/rewrite_fp4_experts.py``) recognises exactly this sequence of torch calls in the traced
    model: change it and that pass's matcher together."""
    vals = e2m1_grid(packed.device)[unpack_fp4_codes(packed)]
    s = e8m0_to_float(scale).repeat_interleave(block, dim=-1)
    return (vals * s).to(dtype)


# ---- Hadamard rotation (V4's indexer q and k) ----------------------------------------------------------------------
def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sylvester-order Hadamard matrix scaled by n^-1/2 (fp32 [n, n]); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5  # (n**0.5 is math.sqrt(n) bit for bit at powers of two; this leaf imports torch only)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim by the (symmetric) scaled Hadamard matrix, in fp32; returns the input dtype.

    Pass V (``minidi/passes/rewrite_hadamard.py``) recognises exactly this product (the matrix built by
    ``hadamard_matrix`` in the traced graph): change it and that pass's matcher together."""
    h = hadamard_matrix(x.shape[-1], x.device)
    return (x.float() @ h).to(x.dtype)
