"""What the staggered sparse-attention kernel does to each item's Q in shared memory once the producer has copied it
(``QASYNC``): q's rotation of its trailing 2 R2 channels (over Q's whole half 1, ``_rope_q_smem``, ``QROPE`` 0; over
the 64-column chunks that hold them, ``_rope_q_tail``, ``QROPE`` 1 / 2) and V4's q-norm scale per row
(``_scale_q_half``, ``QNORM``), and which consumer does what when (``_ready_q``); with ``QANG`` the rotating consumer
pulls its next item's angles into L1 an item ahead (``_prefetch_angles``). The same products
(``mul.rn.f32``), sums and bf16 roundings as the model's ``apply_rope`` and ``rms_norm``. Its own module so that
``sparse_attention_sm90_stagger.py`` holds the schedule; see docs/ops/sparse_attention.md (round 36).
"""

from __future__ import annotations

from minidi.ops import sparse_attention_sm90 as ws

if ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from minidi.ops.sparse_attention_sm90 import _arrive, _mul_rn


if ws.HAVE_GLUON:

    @gluon.jit
    def _ready_q(q_smem, q_bar, qs_ptr, cos_ptr, sin_ptr, t, t_next, row0, it, HID: gl.constexpr, D: gl.constexpr,
                 R2: gl.constexpr, ROPE_Q: gl.constexpr, QROPE: gl.constexpr, QNORM: gl.constexpr,
                 QANG: gl.constexpr):
        """Consumer HID's part in readying an item's Q (rows row0 .. row0 + 63 of [T H]; ``it``: the CTA's item count)
        once the producer's copy has landed. QNORM: each consumer scales its own D half (consumer 1 then rotates its
        chunk) and arrives (half 1 on q_bar 2, half 0 on q_bar 3); each waits for the other's half behind its first
        Q K^T over its own. Else, with ROPE_Q, ``QROPE``: 0 consumer 1 rotates the whole half 1 and consumer 0 waits
        here; 1 consumer 1 rotates the chunk (consumer 0 waits behind its first Q K^T); 2 consumer 0 rotates it behind
        that Q K^T and consumer 1 waits here. QANG: the rotating consumer first pulls the angles of its next item's
        token ``t_next`` into L1 (``_prefetch_angles``)."""
        if QANG and ROPE_Q and HID == (1 if (QNORM or QROPE != 2) else 0):
            _prefetch_angles(cos_ptr, sin_ptr, t_next, R2)
        mbarrier.wait(q_bar.index(0), it & 1)
        if QNORM:
            _scale_q_half(q_smem.index(HID), qs_ptr, row0, D)
            if ROPE_Q and HID == 1:
                gl.thread_barrier()  # the rotation reads what the other warps of the group just scaled
                _rope_q_tail(q_smem.index(1), cos_ptr, sin_ptr, t, D, R2)
            fence_async_shared()
            _arrive(q_bar.index(3 - HID))
        elif ROPE_Q:
            if HID == 1 and QROPE != 2:
                if QROPE == 0:
                    _rope_q_smem(q_smem.index(1), cos_ptr, sin_ptr, t, D, R2)
                else:
                    _rope_q_tail(q_smem.index(1), cos_ptr, sin_ptr, t, D, R2)
                fence_async_shared()
                _arrive(q_bar.index(2))
            elif (HID == 0 and QROPE == 0) or (HID == 1 and QROPE == 2):
                mbarrier.wait(q_bar.index(2), it & 1)
        fence_async_shared()  # cp.async / generic stores of Q; the wgmma reads it (async proxy)

    @gluon.jit
    def _prefetch_angles(cos_ptr, sin_ptr, t, R2: gl.constexpr):
        """Token t's cos and sin rows (R2 fp32 each) pulled into this SM's L1 (``prefetch.global.L1``: no register
        holds them) an item ahead, so the rotation that reads them (``_rope_q_cols``, then the output's in the store)
        finds them there instead of waiting on L2 or HBM behind the item's Q."""
        gl.static_assert(R2 <= 224)  # eight addresses 32 fp32 apart (the last clamped) touch every 128-byte line
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        i = gl.minimum(gl.arange(0, 8, layout=lay) * 32, R2 - 1)
        gl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.b32 $0, 0;", "=r,l", [cos_ptr + t * R2 + i],
                                  dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.b32 $0, 0;", "=r,l", [sin_ptr + t * R2 + i],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _rope_q_cols(qt, cos_ptr, sin_ptr, t, D: gl.constexpr, R2: gl.constexpr, RB: gl.constexpr,
                     ld_l: gl.constexpr):
        """q's rotation of its trailing 2 R2 channels applied in place to ``qt``, Q's last RB columns ([64, RB] bf16
        in shared memory, channels D - RB .. D - 1), loaded and stored in ``ld_l``: the products (``mul.rn.f32``),
        sums and bf16 rounding of ``_q_half``'s load."""
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

    @gluon.jit
    def _rope_q_smem(qh, cos_ptr, sin_ptr, t, D: gl.constexpr, R2: gl.constexpr):
        """``_rope_q_cols`` over the whole of Q's half 1 ([64, D/2]; ``QROPE`` 0)."""
        _rope_q_cols(qh, cos_ptr, sin_ptr, t, D, R2, D // 2, gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))

    @gluon.jit
    def _rope_q_tail(qh, cos_ptr, sin_ptr, t, D: gl.constexpr, R2: gl.constexpr):
        """``_rope_q_cols`` over only the trailing 64-column chunks of Q's half 1 that hold the 2 R2 rotated
        channels (whole 128-byte swizzle atoms: one chunk at V4.1's R2 = 32, a quarter of the half); the other
        channels are neither read nor written (``QROPE`` 1 / 2, ``QNORM``)."""
        RB: gl.constexpr = 64 * ((2 * R2 + 63) // 64)
        _rope_q_cols(qh.slice(D // 2 - RB, RB, dim=1), cos_ptr, sin_ptr, t, D, R2, RB,
                     gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def _scale_q_half(qh, qs_ptr, row0, D: gl.constexpr):
        """Q's half ([64, D/2] bf16 in shared memory, rows row0 .. row0 + 63 of [T H]) times each row's scale from
        qs_ptr, in fp32, rounded to bf16 in place: ``sparse_attention.scale_q``, the model's q RMSNorm given its
        rsqrt."""
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [64, HALF]
        r = gl.load(qs_ptr + row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ld_l)))
        x = qh.load(ld_l).to(gl.float32)
        qh.store((x * r[:, None]).to(gl.bfloat16))
