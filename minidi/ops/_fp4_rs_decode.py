"""The FP4 decode of the register-operand Hopper kernels (``fp4_grouped_gemm_sm90_rs`` and its chunked tiles,
``fp4_grouped_gemm_sm90_rs_chunked``): the e2m1 tables, the inline-PTX decode of 4 packed bytes into bf16 pairs
times their block's scale, the packed tile's register layout and the Gluon helpers that load, decode and hand the
words to the wgmma as its A operand. Why and how: ``fp4_grouped_gemm_sm90_rs``'s docstring ("Decode", "Layout").
"""

from __future__ import annotations

from .fp8_grouped_gemm_sm90 import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

# bf16 bits of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: low bytes (table words 0-1), high bytes (2-3)
E2M1_BF16 = (0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0)
NAN_SCALE = 0x7FC07FC0  # bf16x2 NaN: the scale of code 255


def _table_word(values: tuple[int, ...], shift: int) -> int:
    """Bytes ``(v >> shift) & 0xFF`` of four bf16 patterns as one 32-bit prmt table word (as a signed int32)."""
    w = sum(((v >> shift) & 0xFF) << (8 * j) for j, v in enumerate(values))
    return w - (1 << 32) if w >= 1 << 31 else w


TABLES = (_table_word(E2M1_BF16[:4], 0), _table_word(E2M1_BF16[4:], 0),
          _table_word(E2M1_BF16[:4], 8), _table_word(E2M1_BF16[4:], 8))

# 4 packed bytes ($4: byte j = codes 2 j (low nibble), 2 j + 1) -> 4 bf16x2 words ($0..$3: word j = byte j's two
# weights, low nibble in the low half), each times its byte's scale ($5..$8, bf16x2). Tables are immediates.
_DECODE_ASM = """{
.reg .b32 m, mh, q, l0, l1, h0, h1, s0, s1, w0, w1, w2, w3;
and.b32 m, $4, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 l0, 0x%08X, 0x%08X, m;
prmt.b32 h0, 0x%08X, 0x%08X, m;
prmt.b32 l1, 0x%08X, 0x%08X, mh;
prmt.b32 h1, 0x%08X, 0x%08X, mh;
shl.b32 q, $4, 4;
prmt.b32 s0, $4, q, 0x1504;
prmt.b32 s1, $4, q, 0x3726;
lop3.b32 h0, s0, 0x80808080, h0, 0xEA;
lop3.b32 h1, s1, 0x80808080, h1, 0xEA;
prmt.b32 w0, l0, h0, 0x5140;
prmt.b32 w1, l0, h0, 0x7362;
prmt.b32 w2, l1, h1, 0x5140;
prmt.b32 w3, l1, h1, 0x7362;
mul.rn.bf16x2 $0, w0, $5;
mul.rn.bf16x2 $1, w1, $6;
mul.rn.bf16x2 $2, w2, $7;
mul.rn.bf16x2 $3, w3, $8;
}""" % tuple(t & 0xFFFFFFFF for t in (TABLES[0], TABLES[1], TABLES[2], TABLES[3], TABLES[0], TABLES[1], TABLES[2],
                                      TABLES[3]))


# ---- layouts (host-side constexprs) ---------------------------------------------------------------------------------
def packed_layouts(wg: int) -> tuple:
    """(2-D layout of the packed tile [BW, 32] bytes, its 3-D form [BW, 2, 16] (blocks of 32 codes)): thread 4 g + t
    of warp w holds rows 16 w + g, + 8, bytes t + 4 j of each block (j = 0..3, consecutive registers: one 32-bit word
    for the decode)."""
    warps = [[16 << i, 0] for i in range(2 + (wg - 1).bit_length())]
    lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    regs = [[0, 4], [0, 8], [8, 0], [0, 16]]
    bw = 64 * wg
    l2 = gl.DistributedLinearLayout(regs, lanes, warps, [], [bw, 32])

    def three(b):
        return [b[0], b[1] // 16, b[1] % 16]

    l3 = gl.DistributedLinearLayout([three(b) for b in regs], [three(b) for b in lanes], [three(b) for b in warps],
                                    [], [bw, 2, 16])
    return l2, l3


if HAVE_GLUON:
    # the packed-tile layouts as global constexprs (not kernel arguments: launch hooks serialise arguments to JSON)
    _P2, _P3 = (gl.constexpr(lay) for lay in packed_layouts(2))

    @gluon.jit
    def _scales(ws_ptr, row_off, kb0, P3: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr):
        """bf16x2 scales 2^(c - 127) of the [BW, 2] blocks at ``kb0`` ([BW, 2, 1], NaN for c = 255; other codes out
        of [LO, HI] are not sent here by the op's gate)."""
        LC: gl.constexpr = gl.SliceLayout(2, P3)
        blk = gl.arange(0, 2, layout=gl.SliceLayout(0, LC))
        c = gl.load(ws_ptr + row_off[:, None] + kb0 + blk[None, :]).to(gl.int32)
        s = gl.where(c == 255, 0x7FC07FC0, (c << 7) | (c << 23))
        return gl.expand_dims(s, 2)

    @gluon.jit
    def _decode_words(p_buf, s3, P2: gl.constexpr, P3: gl.constexpr, BW: gl.constexpr, DECODE_ASM: gl.constexpr):
        """The packed stage [BW, 32] bytes -> the decode's int32 words [BW, 2, 16] (bf16 pairs, scaled)."""
        p = gl.convert_layout(gl.reshape(p_buf.load(P2), [BW, 2, 16]), P3, assert_trivial=True)
        s = gl.broadcast(s3, p)[0]
        return gl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r,r,r,r,r", [p, s], dtype=gl.int32, is_pure=True,
                                         pack=4)

    @gluon.jit
    def _operand(v, A_L: gl.constexpr, BW: gl.constexpr):
        """The decode's words -> the bf16 A operand [BW, 64] in the wgmma's register layout (no data movement)."""
        lo = v.to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (v >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        w = gl.reshape(gl.join(lo, hi), [BW, 64])
        return gl.convert_layout(w, A_L, assert_trivial=True)

    @gluon.jit
    def _decode(p_buf, s3, P2: gl.constexpr, P3: gl.constexpr, A_L: gl.constexpr, BW: gl.constexpr,
                DECODE_ASM: gl.constexpr):
        """The packed stage [BW, 32] bytes -> the bf16 A operand [BW, 64] in the wgmma's register layout, and the
        decode's int32 words (bf16 pairs) it is made of."""
        v = _decode_words(p_buf, s3, P2, P3, BW, DECODE_ASM)
        # (v: the A operand's registers themselves, as the wgmma reads them: the caller keeps them alive)
        return _operand(v, A_L, BW), v
