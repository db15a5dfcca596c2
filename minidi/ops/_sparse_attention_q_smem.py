"""What the staggered sparse-attention kernel does to each item's Q in shared memory once the producer has copied it
(``QASYNC``): q's rotation of its trailing 2 R2 channels (over Q's whole half 1, ``_rope_q_smem``, ``QROPE`` 0; over
the 64-column chunks that hold them, ``_rope_q_tail``, ``QROPE`` 1 / 2) and V4's q-norm scale per row
(``_scale_q_half``, ``QNORM``). The same products (``mul.rn.f32``), sums and bf16 roundings as the model's
``apply_rope`` and ``rms_norm``. Its own module so that ``sparse_attention_sm90_stagger.py`` holds the schedule; see
docs/ops/sparse_attention.md (round 36).
"""

from __future__ import annotations

from minidi.ops import sparse_attention_sm90 as ws

if ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from minidi.ops.sparse_attention_sm90 import _mul_rn


if ws.HAVE_GLUON:

    @gluon.jit
    def _rope_q_smem(qh, cos_ptr, sin_ptr, t, D: gl.constexpr, R2: gl.constexpr):
        """q's rotation of its trailing 2 R2 channels applied in place to Q's half 1 ([64, D/2] bf16 in shared memory),
        as ``_q_half`` applies it in its load: the same products (``mul.rn.f32``), sums and bf16 rounding."""
        HALF: gl.constexpr = D // 2
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [64, HALF]
        x = qh.load(ld_l).to(gl.float32)
        x0, x1 = gl.split(gl.reshape(x, [64, HALF // 2, 2]))  # [64, HALF/2] each: even / odd channels
        d0 = HALF + 2 * gl.arange(0, HALF // 2, layout=gl.SliceLayout(0, x0.type.layout))
        rot = d0 >= D - 2 * R2
        pair = gl.where(rot, (d0 - (D - 2 * R2)) // 2, 0)
        c = gl.load(cos_ptr + t * R2 + pair, mask=rot, other=1.0)[None, :]
        sn = gl.load(sin_ptr + t * R2 + pair, mask=rot, other=0.0)[None, :]
        y0 = gl.where(rot[None, :], _mul_rn(x0, c) + _mul_rn(x1, -sn), x0)  # even: x0 c - x1 s
        y1 = gl.where(rot[None, :], _mul_rn(x1, c) + _mul_rn(x0, sn), x1)  # odd: x1 c + x0 s
        y = gl.reshape(gl.join(y0, y1), [64, HALF]).to(gl.bfloat16)
        qh.store(gl.convert_layout(y, ld_l))

    @gluon.jit
    def _scale_q_half(qh, qs_ptr, row0, D: gl.constexpr):
        """Q's half ([64, D/2] bf16 in shared memory, rows row0 .. row0 + 63 of [T H]) times each row's scale from
        qs_ptr, in fp32, rounded to bf16 in place: ``sparse_attention.scale_q``, the model's q RMSNorm given its
        rsqrt."""
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [64, HALF]
        r = gl.load(qs_ptr + row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ld_l)))
        x = qh.load(ld_l).to(gl.float32)
        qh.store((x * r[:, None]).to(gl.bfloat16))

    @gluon.jit
    def _rope_q_tail(qh, cos_ptr, sin_ptr, t, D: gl.constexpr, R2: gl.constexpr):
        """``_rope_q_smem`` over the trailing 64-column chunks of Q's half 1 that hold the 2 R2 rotated channels
        (one chunk at V4.1's R2 = 32, a quarter of the half): the same products, sums and bf16 rounding; the other
        channels are neither read nor written."""
        HALF: gl.constexpr = D // 2
        RB: gl.constexpr = 64 * ((2 * R2 + 63) // 64)  # whole 128-byte swizzle chunks
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64, 64] per 4 warps x 8 lanes
        qt = qh.slice(HALF - RB, RB, dim=1)
        x = qt.load(ld_l).to(gl.float32)
        x0, x1 = gl.split(gl.reshape(x, [64, RB // 2, 2]))  # [64, RB/2] each: even / odd channels
        d0 = D - RB + 2 * gl.arange(0, RB // 2, layout=gl.SliceLayout(0, x0.type.layout))
        rot = d0 >= D - 2 * R2
        pair = gl.where(rot, (d0 - (D - 2 * R2)) // 2, 0)
        c = gl.load(cos_ptr + t * R2 + pair, mask=rot, other=1.0)[None, :]
        sn = gl.load(sin_ptr + t * R2 + pair, mask=rot, other=0.0)[None, :]
        y0 = gl.where(rot[None, :], _mul_rn(x0, c) + _mul_rn(x1, -sn), x0)  # even: x0 c - x1 s
        y1 = gl.where(rot[None, :], _mul_rn(x1, c) + _mul_rn(x0, sn), x1)  # odd: x1 c + x0 s
        y = gl.reshape(gl.join(y0, y1), [64, RB]).to(gl.bfloat16)
        qt.store(gl.convert_layout(y, ld_l))
