"""What pass A folds into the sparse attention around its core, apart from the kernel that calls them: the rotations
(``rope_mode``) and V4's q-norm scale (``q_scale``). Plain torch: ``rope_ref`` (the twin of the model's
``apply_rope``) and ``scale_q`` (of its ``rms_norm``, given the rsqrt). The kernel's Triton helpers: q's rotation
staged in the output's rows (``_rope_stage``; with the scale, the whole of q: ``_qnorm_stage``) or scaled and rotated
in registers (``_rope_load``, the ``nsplit=2`` configs; ``_scaled``), the output's inverse rotation in the store
(``_rope_store_values``), each product rounded on its own (``_product``), and ``_round_p`` (the rounding to the
activation dtype they share with the kernel's probabilities).
Design and measurements: ``docs/ops/sparse_attention.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import round_bf16

ROPE_Q = 1  # rope_mode bit: rotate q's trailing 2 r2 channels by (cos, sin) as the kernel loads it
ROPE_OUT = 2  # rope_mode bit: rotate the output's trailing 2 r2 channels back (by -angle) as the kernel stores it


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of x [T, H, D] as interleaved pairs (2i, 2i + 1), in fp32,
    rounded to x's dtype; cos / sin [T, r2] fp32; ``inverse`` rotates by -angle. A deliberate twin of
    ``minidi.model.layers.apply_rope`` (tests/ops/test_sparse_attention.py holds the two bit-equal)."""
    r = 2 * cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:]
    c, s = cos.view(cos.shape[0], 1, -1), sin.view(sin.shape[0], 1, -1)
    if inverse:
        s = -s
    pairs = rot.float().unflatten(-1, (r // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, out], dim=-1)


def scale_q(q: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] times its per-(token, head) scale ([T, H] or [T, H, 1] fp32) in fp32, rounded to q's dtype: the
    model's ``rms_norm(q, None, eps)`` given its rsqrt (``minidi.model.layers.rms_norm``; a test holds them equal)."""
    return (q.float() * q_scale.reshape(q.shape[0], q.shape[1], 1)).to(q.dtype)


@triton.jit
def _round_p(e, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """The unnormalised probabilities as PV consumes them: rounded to bf16 (nearest even) in bf16 mode."""
    if ROUND_BF16:
        if INTERPRET:  # the interpreter's fp32 -> bf16 cast truncates: round by hand, keep fp32 storage
            return round_bf16(e)
        else:
            return e.to(tl.bfloat16)
    else:
        return e


@triton.jit
def _product(a, b, INTERPRET: tl.constexpr):
    """a * b rounded to fp32 on its own, as eager's separate mul / sub round: on the GPU a ``mul.rn.f32``, which
    neither LLVM nor ptxas contracts into a fused multiply-add with the sum it feeds (a plain product hidden behind
    an opaque ``mov`` was still contracted by ptxas: measured on the H200, not bit-equal to eager)."""
    if INTERPRET:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _scaled(x, qs, QNORM: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """x [BH, n] as the attention reads q, in fp32: with QNORM, x * qs[:, None] in fp32 rounded to q's dtype
    (``scale_q``); without, x as it is."""
    if QNORM:
        y = _round_p(x.to(tl.float32) * qs[:, None], ROUND_BF16, INTERPRET).to(tl.float32)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _rope_load(q_ptr, q_rows, offs, ok, h_ok, cos_ptr, sin_ptr, t, qs, D: tl.constexpr, R2: tl.constexpr,
               ROPE: tl.constexpr, QNORM: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """q [BH, len(offs)] scaled by qs (QNORM: ``_scaled``), then (ROPE) its trailing 2 R2 channels of D rotated
    (pairs 2i, 2i+1; rope_ref's math: each product rounded, then the sum) and rounded to q's dtype; the partner of
    channel d is loaded from d ^ 1. fp32 storage in the interpreter (its bf16 arithmetic is wrong; mma upcasts
    anyway), q's dtype elsewhere."""
    x = _scaled(tl.load(q_ptr + q_rows[:, None] + offs[None, :], mask=h_ok[:, None] & ok[None, :], other=0.0), qs,
                QNORM, ROUND_BF16, INTERPRET)
    if ROPE:
        rot = ok & (offs >= D - 2 * R2)  # [len]
        pair = tl.where(rot, (offs - (D - 2 * R2)) // 2, 0)
        c = tl.load(cos_ptr + t * R2 + pair, mask=rot, other=1.0)
        s = tl.load(sin_ptr + t * R2 + pair, mask=rot, other=0.0)
        s = tl.where(offs % 2 == 0, -s, s)  # even: x0 c - x1 s; odd: x1 c + x0 s
        xp = _scaled(tl.load(q_ptr + q_rows[:, None] + (offs ^ 1)[None, :], mask=h_ok[:, None] & rot[None, :],
                             other=0.0), qs, QNORM, ROUND_BF16, INTERPRET)
        y = _round_p(_product(x, c[None, :], INTERPRET) + _product(xp, s[None, :], INTERPRET), ROUND_BF16,
                     INTERPRET).to(tl.float32)
        x = tl.where(rot[None, :], y, x)
    if not INTERPRET:
        x = x.to(q_ptr.dtype.element_ty)
    return x


@triton.jit
def _rope_stage(q_ptr, out_ptr, q_rows, h_ok, cos_ptr, sin_ptr, t, D: tl.constexpr, R2: tl.constexpr,
                RB: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Write q's rotated trailing 2 R2 channels (rope_ref's math and rounding) into the same rows of ``out``, which
    the program overwrites with its result at the end: the rotated q then reaches the Q@K^T dot through a plain
    load, held in shared memory as the unrotated q is (rotating the loaded tile in registers made Triton keep q in
    registers through the key loop: over a hundred spills, on the H200). RB: 2 R2 rounded up to a power of two."""
    offs = D - 2 * R2 + tl.arange(0, RB)  # [RB] the rotated channels
    ok = offs < D
    pair = tl.where(ok, (offs - (D - 2 * R2)) // 2, 0)
    c = tl.load(cos_ptr + t * R2 + pair, mask=ok, other=1.0)
    s = tl.load(sin_ptr + t * R2 + pair, mask=ok, other=0.0)
    s = tl.where(offs % 2 == 0, -s, s)  # even: x0 c - x1 s; odd: x1 c + x0 s
    m = h_ok[:, None] & ok[None, :]
    x = tl.load(q_ptr + q_rows[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(q_ptr + q_rows[:, None] + (offs ^ 1)[None, :], mask=m, other=0.0).to(tl.float32)
    y = _round_p(_product(x, c[None, :], INTERPRET) + _product(xp, s[None, :], INTERPRET), ROUND_BF16, INTERPRET)
    tl.store(out_ptr + q_rows[:, None] + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _qnorm_stage(q_ptr, out_ptr, q_rows, h_ok, qs, cos_ptr, sin_ptr, t, D: tl.constexpr, R2: tl.constexpr,
                 BD: tl.constexpr, ROPE: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """``_rope_stage`` for a scaled q (QNORM): every channel of q's rows, scaled (``_scaled``) and, with ROPE, its
    trailing 2 R2 rotated, written into the same rows of ``out``; the Q@K^T dot then loads the whole of q from there.
    BD: D rounded up to a power of two."""
    offs = tl.arange(0, BD)
    q = _rope_load(q_ptr, q_rows, offs, offs < D, h_ok, cos_ptr, sin_ptr, t, qs, D, R2, ROPE, True, ROUND_BF16,
                   INTERPRET)
    tl.store(out_ptr + q_rows[:, None] + offs[None, :], q.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (offs < D)[None, :])


@triton.jit
def _rope_store_values(out, d_base, cos_ptr, sin_ptr, t, D: tl.constexpr, R2: tl.constexpr, BH: tl.constexpr,
                       DV: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """The output tile [BH, DV] (fp32) rounded to the output dtype, its trailing 2 R2 channels of D rotated back
    (by -angle; pairs split out of the tile), rounded again: rope_ref(out, cos, sin, inverse=True). fp32 storage."""
    o = _round_p(out, ROUND_BF16, INTERPRET).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(o, (BH, DV // 2, 2)))  # [BH, DV/2] each
    d0 = d_base + 2 * tl.arange(0, DV // 2)  # the tile's even channels
    rot = (d0 >= D - 2 * R2) & (d0 < D)
    pair = tl.where(rot, (d0 - (D - 2 * R2)) // 2, 0)
    c = tl.load(cos_ptr + t * R2 + pair, mask=rot, other=1.0)[None, :]
    s = -tl.load(sin_ptr + t * R2 + pair, mask=rot, other=0.0)[None, :]  # inverse rotation
    y0 = _product(x0, c, INTERPRET) - _product(x1, s, INTERPRET)
    y1 = _product(x0, s, INTERPRET) + _product(x1, c, INTERPRET)
    y0 = tl.where(rot[None, :], y0, x0)
    y1 = tl.where(rot[None, :], y1, x1)
    y = tl.reshape(tl.join(y0, y1), (BH, DV))
    if ROUND_BF16 and INTERPRET:
        y = round_bf16(y)  # the interpreter's fp32 -> bf16 store truncates: hand it the rounded value
    return y


__all__ = ["ROPE_OUT", "ROPE_Q", "rope_ref", "scale_q"]
