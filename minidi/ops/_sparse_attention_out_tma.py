"""The staggered sparse-attention kernel's epilogue through shared memory and bulk tensor stores (``OTMA``, the sm_90
default since round 26): each consumer's [64, D/2] output half as 4 [64, OC] chunks, written with ``stmatrix`` into
two alternating buffers and copied out by the copy engine, the last two copies draining while the next item starts.
Its own module so that ``sparse_attention_sm90_stagger.py`` holds the schedule; the values are ``_out_half``'s
(``sparse_attention_sm90.py``), the same bits as the 4-byte stores of ``_store_half``. See
docs/ops/sparse_attention.md (rounds 25-26).
"""

from __future__ import annotations

from minidi.ops import sparse_attention_sm90 as ws

if ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

    from minidi.ops.sparse_attention_sm90 import _out_half

OC = 64  # output columns per bulk-store chunk (128 B rows: the 128-byte swizzle of P's buffers)


if ws.HAVE_GLUON:

    @gluon.jit
    def _out_chunk(o_desc, buf, x, row, col, WAIT: gl.constexpr):
        """One [64, OC] bf16 chunk of the output through ``buf`` to rows row.., columns col.. of out (a bulk tensor
        store, not waited). WAIT: first wait until the copy engine has read the chunk before last (``buf``'s)."""
        if WAIT:
            tma.store_wait(1)
            gl.thread_barrier()  # every warp sees the buffer free (the issuing thread waited)
        buf.store(x)
        fence_async_shared()  # generic-proxy stores that the copy engine (async proxy) reads
        gl.thread_barrier()  # the whole chunk is written before one thread issues the copy
        tma.async_copy_shared_to_global(o_desc, [row, col], buf)

    @gluon.jit
    def _store_half_tma(o_desc, o_smem, sink, cos_ptr, sin_ptr, acc, l_i, m_i, t, row, HID: gl.constexpr,
                        D: gl.constexpr, ROPE_OUT: gl.constexpr, R2: gl.constexpr, OC: gl.constexpr):
        """``_out_half``'s values (``_store_half``'s, so the same bits; the output's rotation applied in registers),
        written through shared memory (``stmatrix``) and bulk tensor stores instead of ``_store_half``'s
        64 4-byte stores per thread straight from the wgmma layout (each warp store: 8 rows x 16 bytes, half-filled
        32-byte sectors), which keep the consumer issuing while no tensor-core work is queued. The half's 4 [64, OC]
        chunks alternate between two buffers (``o_smem`` HID: this consumer's P buffer, free once both consumers'
        last P V of the item is done; 2 + HID), the copy engine reading one while the next is written; the last two
        stores drain while the next item starts (``_out_drained`` before this consumer's P buffer is written)."""
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        out = _out_half(acc, l_i, m_i, sink, cos_ptr, sin_ptr, t, HID, D, ROPE_OUT, R2)
        # [64, HALF] -> 4 column chunks [64, OC] (register renames): column 2 OC c1 + OC c0 + x -> (c0, c1) split out
        gl.static_assert(HALF == 4 * OC)
        a, b = gl.split(gl.permute(gl.reshape(out.to(gl.bfloat16), [M, 2, 2, OC]), (0, 3, 1, 2)))  # c0 = 0, 1
        x0, x2 = gl.split(a)  # chunks 0 and 2 (c1 = 0, 1)
        x1, x3 = gl.split(b)
        col = HID * HALF
        _out_chunk(o_desc, o_smem.index(HID), x0, row, col, False)
        _out_chunk(o_desc, o_smem.index(2 + HID), x1, row, col + OC, False)
        _out_chunk(o_desc, o_smem.index(HID), x2, row, col + 2 * OC, True)
        _out_chunk(o_desc, o_smem.index(2 + HID), x3, row, col + 3 * OC, True)

    @gluon.jit
    def _out_drained(OTMA: gl.constexpr):
        """OTMA: this consumer's bulk stores of the previous item have read its buffers (before its P buffer is
        written again)."""
        if OTMA:
            tma.store_wait(0)
            gl.thread_barrier()


def out_layout():
    """The output chunks' shared layout: P's (bf16 [64, 64], 128-byte swizzle), which the kernel reuses for them."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
