"""Small building blocks: RMSNorm, RoPE (with YaRN), FP8 linear, plain linear.

Rounding points follow the official reference (spec V4.1 §11): RMSNorm keeps its weight in fp32 and rounds once;
RoPE angles and cos/sin are fp32, rotated channels are rounded to the activation dtype. The layers look cos/sin up
in a table precomputed for every position (``RopeTable``, one per inv_freq variant, as the official ``freqs_cis``).
Legend: T tokens, H heads, D width, r rope dims.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .quant import dequant_fp8, fq8


def weight_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, frozen parameter (inference only; the loader fills it)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


# E8M0 scales are held as their raw bytes (uint8): Inductor's CPU backend has no float8_e8m0fnu. The checkpoint
# dtype is kept at the boundary: state_dict() returns float8_e8m0fnu views and load_state_dict takes them.
E8M0_HELD = torch.uint8


def scale_param(*shape: int) -> nn.Parameter:
    return weight_param(*shape, dtype=E8M0_HELD)


def e8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(E8M0_HELD) if t.dtype == torch.float8_e8m0fnu else t


def _e8m0_to_bytes(mod: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    for name, p in mod.named_parameters(recurse=False):
        key = prefix + name
        if p.dtype == E8M0_HELD and key in state_dict:
            state_dict[key] = e8m0_bytes(state_dict[key])


def _e8m0_from_bytes(mod: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, p in mod.named_parameters(recurse=False):
        if p.dtype == E8M0_HELD and prefix + name in state_dict:
            state_dict[prefix + name] = state_dict[prefix + name].view(torch.float8_e8m0fnu)


def hold_e8m0_as_bytes(module: nn.Module) -> None:
    """Translate this module's own E8M0 scale entries between the checkpoint dtype and the held bytes (module-level
    hooks: a module holding them pickles, e.g. to a compile worker)."""
    module._register_load_state_dict_pre_hook(_e8m0_to_bytes, with_module=True)
    module._register_state_dict_hook(_e8m0_from_bytes)


class RMSNorm(nn.Module):
    """y = w * x * rsqrt(mean(x^2) + eps), all in fp32, one rounding to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = weight_param(dim, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class Linear(nn.Module):
    """A plain (bf16 checkpoint) linear, computed in the activation dtype. ``fp32=True`` computes in fp32."""

    def __init__(self, in_features: int, out_features: int, fp32: bool = False) -> None:
        super().__init__()
        self.fp32 = fp32
        self.weight = weight_param(out_features, in_features, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight.to(x.dtype))


class FP8Linear(nn.Module):
    """FP8 e4m3 weight with E8M0 block scales (checkpoint format kept as loaded).

    forward: fq8 of the input along K in blocks of ``act_block`` (QAT semantics, when fake-quant is on), then a GEMM
    with the block-dequantised weight in the activation dtype (fp32 accumulation on the device).
    """

    def __init__(self, in_features: int, out_features: int, cfg: ModelConfig, quant_input: bool = True) -> None:
        super().__init__()
        b = cfg.weight_block
        self.block, self.act_block = b, cfg.act_block
        self.quant_input = quant_input and cfg.fake_quant
        self.weight = weight_param(out_features, in_features, dtype=torch.float8_e4m3fn)
        self.scale = scale_param(-(-out_features // b), -(-in_features // b))
        hold_e8m0_as_bytes(self)

    def dequant(self, dtype: torch.dtype) -> torch.Tensor:
        return dequant_fp8(self.weight, self.scale, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_input:
            x = fq8(x, self.act_block)
        return F.linear(x, self.dequant(x.dtype))


# ---- RoPE ---------------------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig, compressed: bool) -> torch.Tensor:
    """Per-pair frequencies ω_i, fp32 [r/2]. Compressed layers: base compress_rope_theta with the YaRN blend
    (DeepSeek convention, V4 spec §4); window-only layers: base rope_theta, no YaRN. No mscale (attention_factor 1)."""
    r = cfg.rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    if not compressed or cfg.rope_factor == 1.0:
        return freqs

    def corr_dim(num_rot: float) -> float:
        return r * math.log(cfg.original_seq_len / (num_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr_dim(cfg.beta_fast)), 0)
    hi = min(math.ceil(corr_dim(cfg.beta_slow)), r - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(r // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return freqs * (1 - ramp) + freqs / cfg.rope_factor * ramp


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int) -> cos, sin fp32 [T, r/2]; angle = t * ω in fp32. The formula of ``rope_table``."""
    ang = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return torch.cos(ang), torch.sin(ang)


def rope_table(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """cos/sin of every position 0..P-1 -> fp32 [P, r/2, 2] (cos, sin), computed on inv_freq's device by
    ``rope_cos_sin``, so a row equals ``rope_cos_sin`` of its position on that device bitwise."""
    cos, sin = rope_cos_sin(torch.arange(max_positions, device=inv_freq.device), inv_freq)
    return torch.stack([cos, sin], dim=-1)


def rope_cos_sin_lookup(positions: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int, in [0, P)) -> cos, sin fp32 [T, r/2]: rows of a ``rope_table`` [P, r/2, 2].

    Compiled kernels then only load cos/sin (a gather fused into the consumer) instead of evaluating them per
    element of the rotated tensor. The positions are not checked here (a check would be a host sync per call, or a
    graph break under compile): they are made on the host before the step, where lengths past
    max_position_embeddings are rejected (``Transformer.forward``; ``runtime.batch.build_step`` for the engine and the
    benchmark). On the CPU an index past the table still raises torch's IndexError."""
    cs = table[positions]  # [T, r/2, 2]
    return cs[..., 0], cs[..., 1]


class RopeTable(nn.Module):
    """One inv_freq variant's table (``rope_table`` of ``rope_inv_freq(cfg, compressed)`` over
    max_position_embeddings positions), a non-persistent buffer ``cos_sin`` [P, r/2, 2] fp32 (256 MB at 1M positions).

    The Transformer builds one per variant and hands the same module to every Attention of that variant: the buffer
    has one slot, so ``model.to(device)`` moves it once and the layers keep sharing it (a tensor registered as a
    buffer of each layer would be copied once per layer by ``to``)."""

    def __init__(self, cfg: ModelConfig, compressed: bool) -> None:
        super().__init__()
        self.cfg, self.compressed = cfg, compressed
        self.register_buffer("cos_sin", self._build(), persistent=False)

    def _build(self, device: torch.device | str | None = None) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.cfg, self.compressed)  # on the default device (meta while building on meta)
        if device is not None:
            inv_freq = inv_freq.to(device)
        return rope_table(inv_freq, self.cfg.max_position_embeddings)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the table on ``device`` (default: where it is now), with that device's cos/sin."""
        self.cos_sin = self._build(self.cos_sin.device if device is None else device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2*cos.shape[-1]`` channels of x [T, ..., D] as interleaved pairs (2i, 2i+1).

    cos/sin are [T, r/2]; they broadcast over any middle dims. ``inverse`` rotates by -angle (output de-rotation).
    """
    r = 2 * cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    pairs = rot.float().unflatten(-1, (r // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, out], dim=-1)
