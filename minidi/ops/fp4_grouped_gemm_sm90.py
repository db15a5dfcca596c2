"""The Hopper (sm_90) kernel of ``minidi::fp4_grouped_mm``: bf16 activations x FP4 weights, a warp-specialised
Gluon kernel whose decoder warps turn the packed e2m1 codes and their E8M0 scales into the exact bf16 weights in
shared memory while the MMA warpgroups run bf16 wgmma over the whole K with one fp32 accumulator.

Why bf16 tensor cores here, not FP8: the FP8 kernel (``fp8_grouped_gemm_sm90.py``) must promote every 32 of K (the
activations' scales are per 32), one fused multiply-add per accumulator element per block on the CUDA cores, which
measured as large as its MMAs (round 10: 437 TFLOP/s, 857 with the promotion and decode left out). Here every
weight is exactly a bf16 number (an e2m1 value times a power of two), the activations are bf16 already (the model's
fq8 output is exact in bf16), so the products are the same exact products and nothing is promoted: the consumer
warps only issue wgmma, and the decode runs on other warps, overlapped.

Contract (``fp4_grouped_gemm.py``): y[r] = x[r] @ dequant(w)[e(r)].T, fp32 accumulation, rows past offs[-1] not
written. The decode, exact for E8M0 codes c in [2, 252] (``CODE_LO``, ``CODE_HI``) and 255 (NaN):

    w = e2m1(m) * 2^(c - 127),  e2m1(m) = 2^e_m * (1 + f_m / 2), m = 1..7: (e_m, f_m) = (-1,0) (0,0) (0,1) (1,0) (1,1)
    bf16 bits of |w| = (c << 7) + D[m],  D = [-, -128, 0, 64, 128, 192, 256, 320]  (exponent e_m + c, mantissa f_m)
    code m = 0: +-0;  the sign is the code's bit 3;  c = 255: NaN (0x7FC0) for every code, as 2^(255 - 127) is NaN

Per (row, block of 32) the decoder builds the 8 low and 8 high bytes of these patterns as four 32-bit tables; per 8
codes (one 32-bit word) PTX ``prmt`` looks up the 8 low and 8 high bytes, ORs the sign bits into the high bytes and
interleaves them into four bf16x2 words: 15 instructions per 8 weights. A block whose code is outside [2, 252] and
not 255 (a weight below 2^-125 or above 2^125 is no checkpoint's) decodes to NaN bytes here; the op never sends such
weights to this kernel: one pass over the codes per weight tensor (``fp4_grouped_gemm_hopper.codes_exact``, read
on the host once; ``range_gate``'s device flag where no sync may run) gives every row to the Triton kernel instead.

Measured on the H200 (round 17, ``docs/ops/fp4_grouped_gemm.md``): 1.04-1.12x the Triton kernel, 0.90-1.01x the
FP8 kernel. Since round 18 the op takes the register-operand kernel (``fp4_grouped_gemm_sm90_rs.py``: the decode in
the MMA warps, no decoded weights in shared memory) on sm_90; ``MINIDI_FP4_GEMM_SM90=ws`` selects this one, ``=0``
the Triton kernel. What both Hopper kernels share (the choice, the code range and its gate, the tile schedule, the
launch preparation) is in ``fp4_grouped_gemm_hopper.py``.

Kernel (persistent; the tile schedule of ``_grouped_tiles.py`` rebuilt in Gluon, shared with the FP8 kernel). A tile
is BM activation rows of one expert x BN weight rows: acc[BM, BN] = x[BM, K] @ W[BN, K]^T, both operands K-major in
shared memory (128-byte swizzle). Three partitions share a ring of NS stages of BK = 64 along K:
- loader (1 warp): TMA of the activation tile [BM, 64] bf16 and the packed weight words [BN, 2, 4] int32;
- decoder (DW warps): packed words + E8M0 codes (global) -> the bf16 weight tile [BN, 64] in shared memory;
- MMA (the default partition, WM x WN warpgroups): per stage one async wgmma group (4 x k16) into the accumulator,
  the previous stage released once the next is issued; the epilogue rounds to bf16 and stores with masks.

Legend: R rows (sorted by expert), E experts, N output columns (weight rows), K input columns, BM/BN/BK tile sizes,
NS pipeline stages, DW decoder warps, WM/WN consumer warpgroups along M/N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._fast_launch import fast_launch
from .fp4_grouped_gemm_hopper import BK, CODE_HI, CODE_LO, launch_grid, tma_ready
from .fp8_grouped_gemm_sm90 import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .fp4_grouped_gemm_hopper import _rows, _schedule

D_OFFSETS = (0, -128, 0, 64, 128, 192, 256, 320)  # D[m]: bf16 bits of e2m1(m) * 2^(c - 127) minus c << 7 (m >= 1)


@dataclass(frozen=True)
class Bf16Sm90Config:
    BM: int = 128  # activation rows per tile
    BN: int = 256  # weight rows (output columns) per tile
    NS: int = 4  # pipeline stages (56 KB each at 128 x 256: 224 KB of the 227)
    WM: int = 2  # warpgroups along M (WM * WN consumer warpgroups)
    WN: int = 1
    # per-thread register cap at entry (ptxas compiles every partition under it; setmaxnreg then moves registers
    # to the consumers at run time): a m64n256 accumulator is 128 registers and its wgmma needs 154 in all, so
    # 128 x 256 tiles run 2 decoder warps: the worker warps (loader + decoder) are padded to whole warpgroups, 8 +
    # 4 warps x 168 registers fit the 64K register file (with 4 decoder warps, 16 warps leave 128)
    maxnreg: int = 168
    dec_regs: int = 112  # registers of a decoder thread (its code offsets and two stages of codes: no spills)
    dec_warps: int = 2  # warps of the decoder partition
    dec_rows: int = 1  # weight rows a decoder thread decodes per pass (more: fewer passes and barriers)
    progs_per_sm: int = 1  # persistent programs per multiprocessor

    def threads(self) -> int:
        """Threads of a program: the MMA warpgroups and the worker warps (loader + decoder) padded to warpgroups."""
        return 32 * (4 * self.WM * self.WN + 4 * -(-(1 + self.dec_warps) // 4))

    def check(self) -> None:
        """Clear errors for a config the GPU cannot launch (Triton would say "out of resource: threads") or that the
        decoder cannot tile (2, 4 or 8 passes of dec_rows * 16 * dec_warps rows per tile)."""
        passes = self.BN // (self.dec_rows * 16 * self.dec_warps)
        if passes not in (2, 4, 8) or passes * self.dec_rows * 16 * self.dec_warps != self.BN:
            raise ValueError(f"fp4_grouped_mm (sm90): {self.name()}: BN = {self.BN} is not 2, 4 or 8 decoder passes "
                             f"of {self.dec_rows * 16 * self.dec_warps} rows")
        if self.threads() * self.maxnreg > 65536:
            raise ValueError(f"fp4_grouped_mm (sm90): {self.name()}: {self.threads()} threads x maxnreg "
                             f"{self.maxnreg} exceed the 65,536 registers of a multiprocessor")

    def name(self) -> str:
        return (f"bf16_BM{self.BM}_BN{self.BN}_S{self.NS}_W{self.WM}x{self.WN}_D{self.dec_warps}x{self.dec_regs}"
                f"_r{self.maxnreg}_p{self.progs_per_sm}" + (f"_rows{self.dec_rows}" if self.dec_rows > 1 else ""))


WIDE = Bf16Sm90Config()  # 128 x 256: fewer activation re-reads, but 2 decoder warps bound it (round 17: 0.87x of EP4)
EP4 = Bf16Sm90Config(BN=128, NS=5, maxnreg=128, dec_warps=4, dec_regs=80)  # two m64n128 warpgroups along M
EP1 = Bf16Sm90Config(BM=64, BN=256, NS=4, WM=1, WN=2, maxnreg=128, dec_warps=4, dec_regs=80)  # m64n128 per WG


def default_config(rows_per_expert: float) -> Bf16Sm90Config:
    """128 x 128 tiles (two warpgroups along M, 4 decoder warps) where experts hold >= 96 rows (EP4), else 64 x 256
    (two warpgroups along N: EP1's 64 rows per expert fill one tile). The fastest of the round-17 sweep."""
    return EP4 if rows_per_expert >= 96 else EP1


# ---- the decode, in plain torch (the kernel's twin) and its tables ------------------------------------------------
def decode_tables(codes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """E8M0 codes (any shape, int) -> (LO0, LO1, HI0, HI1) int64: byte j of LO0 / LO1 is the low byte of the bf16 bits
    of code magnitude j / 4 + j (HI: the high byte); NaN bytes for c = 255 and for codes outside [2, 252]."""
    c = codes.to(torch.int64)
    v = [torch.zeros_like(c)] + [(c << 7) + d for d in D_OFFSETS[1:]]
    bad = (c < CODE_LO) | (c > CODE_HI)
    v = [torch.where(bad, torch.full_like(c, 0x7FC0), x) for x in v]
    lo = [x & 0xFF for x in v]
    hi = [x >> 8 for x in v]

    def pack(b: list[torch.Tensor]) -> torch.Tensor:
        return b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)

    return pack(lo[:4]), pack(lo[4:]), pack(hi[:4]), pack(hi[4:])


def decode_ref(w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The bf16 weights [E, N, K] the kernel decodes (a twin of its tables and byte lookups, in plain torch): equal
    to ``dequant_fp4(w_packed, w_scale, bf16)`` for codes in [2, 252] and 255, NaN for other codes."""
    b = w_packed.view(torch.uint8).to(torch.int64)
    nib = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # [E, N, K]
    c = w_scale.view(torch.uint8).to(torch.int64).repeat_interleave(32, dim=-1)
    lo0, lo1, hi0, hi1 = decode_tables(c)
    m = nib & 7
    shift = 8 * (m & 3)
    lo = torch.where(m < 4, lo0 >> shift, lo1 >> shift) & 0xFF
    hi = torch.where(m < 4, hi0 >> shift, hi1 >> shift) & 0xFF
    bits = lo | ((hi | ((nib & 8) << 4)) << 8)  # [0, 2^16): as int16, the same 16 bits
    return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(torch.bfloat16)


# ---- kernel --------------------------------------------------------------------------------------------------------
# 8 packed codes ($4) -> 8 bf16 in 4 words ($0: codes 0-1, $1: 2-3, $2: 4-5, $3: 6-7), with the low-byte tables $5
# (magnitudes 0-3), $6 (4-7) and the high-byte tables $7, $8. Sign of code j (bit 4j+3 of $4) -> bit 7 of high byte
# j, as the FP8 kernel moves it (bytes of ($4, $4 << 4) picked by prmt), then low / high bytes interleaved.
_DECODE_ASM = """{
.reg .b32 m, mh, q, l0, l1, h0, h1, s0, s1;
and.b32 m, $4, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 l0, $5, $6, m;
prmt.b32 h0, $7, $8, m;
prmt.b32 l1, $5, $6, mh;
prmt.b32 h1, $7, $8, mh;
shl.b32 q, $4, 4;
prmt.b32 s0, $4, q, 0x1504;
prmt.b32 s1, $4, q, 0x3726;
lop3.b32 h0, s0, 0x80808080, h0, 0xEA;
lop3.b32 h1, s1, 0x80808080, h1, 0xEA;
prmt.b32 $0, l0, h0, 0x5140;
prmt.b32 $1, l0, h0, 0x7362;
prmt.b32 $2, l1, h1, 0x5140;
prmt.b32 $3, l1, h1, 0x7362;
}"""

if HAVE_GLUON:

    @gluon.jit
    def _byte(v, j: gl.constexpr):
        return (v & 0xFF) << (8 * j)

    @gluon.jit
    def _tables(c, LO: gl.constexpr, HI: gl.constexpr):
        """E8M0 codes (int32 tensor) -> the four byte tables of ``decode_tables`` (NaN tables outside [LO, HI])."""
        b7 = c << 7
        v1, v2, v3, v4 = b7 - 128, b7, b7 + 64, b7 + 128
        v5, v6, v7 = b7 + 192, b7 + 256, b7 + 320
        lo0 = _byte(v1, 1) | _byte(v2, 2) | _byte(v3, 3)
        lo1 = _byte(v4, 0) | _byte(v5, 1) | _byte(v6, 2) | _byte(v7, 3)
        hi0 = _byte(v1 >> 8, 1) | _byte(v2 >> 8, 2) | _byte(v3 >> 8, 3)
        hi1 = _byte(v4 >> 8, 0) | _byte(v5 >> 8, 1) | _byte(v6 >> 8, 2) | _byte(v7 >> 8, 3)
        bad = (c < LO) | (c > HI)
        lo0 = gl.where(bad, -1061109568, lo0)  # 0xC0C0C0C0: low bytes of NaN 0x7FC0
        lo1 = gl.where(bad, -1061109568, lo1)
        hi0 = gl.where(bad, 0x7F7F7F7F, hi0)
        hi1 = gl.where(bad, 0x7F7F7F7F, hi1)
        return lo0, lo1, hi0, hi1

    @gluon.jit
    def _sub_offset(e, n0, N, kb, j: gl.constexpr, SUB: gl.constexpr, NBK: gl.constexpr, LR: gl.constexpr,
                    LB: gl.constexpr):
        """[SUB, NBK] offsets of the first E8M0 codes of sub-pass j's weight rows (clamped to row N - 1: in bounds;
        those columns are not stored)."""
        n = n0 + j * SUB + gl.arange(0, SUB, layout=LR)
        return (e * N + gl.minimum(n, N - 1)).to(gl.int64)[:, None] * kb + gl.arange(0, NBK, layout=LB)[None, :]

    @gluon.jit
    def _sub_offsets(e, n0, N, kb, NSUB: gl.constexpr, SUB: gl.constexpr, NBK: gl.constexpr, LR: gl.constexpr,
                     LB: gl.constexpr):
        """``_sub_offset`` of each of a tile's NSUB sub-passes (a tuple: 2, 4 or 8)."""
        if NSUB == 8:
            return (_sub_offset(e, n0, N, kb, 0, SUB, NBK, LR, LB), _sub_offset(e, n0, N, kb, 1, SUB, NBK, LR, LB),
                    _sub_offset(e, n0, N, kb, 2, SUB, NBK, LR, LB), _sub_offset(e, n0, N, kb, 3, SUB, NBK, LR, LB),
                    _sub_offset(e, n0, N, kb, 4, SUB, NBK, LR, LB), _sub_offset(e, n0, N, kb, 5, SUB, NBK, LR, LB),
                    _sub_offset(e, n0, N, kb, 6, SUB, NBK, LR, LB), _sub_offset(e, n0, N, kb, 7, SUB, NBK, LR, LB))
        elif NSUB == 4:
            return (_sub_offset(e, n0, N, kb, 0, SUB, NBK, LR, LB), _sub_offset(e, n0, N, kb, 1, SUB, NBK, LR, LB),
                    _sub_offset(e, n0, N, kb, 2, SUB, NBK, LR, LB), _sub_offset(e, n0, N, kb, 3, SUB, NBK, LR, LB))
        else:
            gl.static_assert(NSUB == 2)
            return (_sub_offset(e, n0, N, kb, 0, SUB, NBK, LR, LB), _sub_offset(e, n0, N, kb, 1, SUB, NBK, LR, LB))

    @gluon.jit
    def _load_codes(ws_ptr, offs, k0, NSUB: gl.constexpr):
        """The E8M0 codes at ``offs`` + k0 of each sub-pass (a tuple like ``offs``)."""
        if NSUB == 8:
            return (gl.load(ws_ptr + offs[0] + k0), gl.load(ws_ptr + offs[1] + k0), gl.load(ws_ptr + offs[2] + k0),
                    gl.load(ws_ptr + offs[3] + k0), gl.load(ws_ptr + offs[4] + k0), gl.load(ws_ptr + offs[5] + k0),
                    gl.load(ws_ptr + offs[6] + k0), gl.load(ws_ptr + offs[7] + k0))
        elif NSUB == 4:
            return (gl.load(ws_ptr + offs[0] + k0), gl.load(ws_ptr + offs[1] + k0), gl.load(ws_ptr + offs[2] + k0),
                    gl.load(ws_ptr + offs[3] + k0))
        else:
            gl.static_assert(NSUB == 2)
            return (gl.load(ws_ptr + offs[0] + k0), gl.load(ws_ptr + offs[1] + k0))

    @gluon.jit
    def _loader(x_desc, w_desc, a_bufs, p_bufs, x_ready, x_empty, offs_ptr, R, N, E, K, NUM_PROGS,
                BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr):
        BKC: gl.constexpr = 64
        pid = gl.program_id(0)
        starts, cum, m_tiles = _schedule(offs_ptr, R, E, BM, E_POW2, 1)
        n_tiles = gl.cdiv(N, BN)
        ksteps = K // BKC
        i = 0
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            mt = t // n_tiles
            e, m0, m_end = _rows(mt, starts, cum, BM, E_POW2, 1)
            wrow = e * N + (t % n_tiles) * BN
            for ks in range(ksteps):
                s = i % NS
                mbarrier.wait(x_empty.index(s), ((i // NS) & 1) ^ 1)
                mbarrier.expect(x_ready.index(s), BM * BKC * 2 + BN * (BKC // 2))
                tma.async_copy_global_to_shared(x_desc, [m0, ks * BKC], x_ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [wrow, ks * (BKC // 32), 0], x_ready.index(s),
                                                p_bufs.index(s))
                i += 1

    @gluon.jit
    def _decoder(p_bufs, d_bufs, x_ready, d_ready, ws_ptr, offs_ptr, R, N, E, K, NUM_PROGS,
                 BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr, DW: gl.constexpr,
                 RPT: gl.constexpr, DECODE_ASM: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr):
        BKC: gl.constexpr = 64
        NBK: gl.constexpr = BKC // 32  # blocks per stage
        # [SUB, NBK, 4] int32: a thread holds the 4 words (32 codes) of RPT (row, block) pairs
        L3: gl.constexpr = gl.BlockedLayout([RPT, 1, 4], [32 // NBK, NBK, 1], [DW, 1, 1], [2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, L3)  # [BN, NBK]
        LR: gl.constexpr = gl.SliceLayout(1, LS)  # [BN]
        LB: gl.constexpr = gl.SliceLayout(0, LS)  # [NBK]
        D32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        SUB: gl.constexpr = RPT * (32 // NBK) * DW  # weight rows decoded per pass
        pid = gl.program_id(0)
        starts, cum, m_tiles = _schedule(offs_ptr, R, E, BM, E_POW2, DW)
        n_tiles = gl.cdiv(N, BN)
        ksteps = K // BKC
        kb = K // 32
        i = 0
        NSUB: gl.constexpr = BN // SUB
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            mt = t // n_tiles
            e, m0, m_end = _rows(mt, starts, cum, BM, E_POW2, DW)
            offs = _sub_offsets(e, (t % n_tiles) * BN, N, kb, NSUB, SUB, NBK, LR, LB)
            codes = _load_codes(ws_ptr, offs, 0, NSUB)
            for ks in range(ksteps):
                s = i % NS
                # the next stage's E8M0 codes, in flight while this stage waits and decodes (the last one re-read)
                nxt = _load_codes(ws_ptr, offs, gl.minimum(ks + 1, ksteps - 1) * NBK, NSUB)
                mbarrier.wait(x_ready.index(s), (i // NS) & 1)
                for sub in gl.static_range(NSUB):
                    lo0, lo1, hi0, hi1 = _tables(codes[sub].to(gl.int32), LO, HI)
                    p = p_bufs.index(s).slice(sub * SUB, SUB, dim=0).load(L3)  # [SUB, NBK, 4]
                    o0, o1, o2, o3 = gl.inline_asm_elementwise(
                        DECODE_ASM, "=r,=r,=r,=r,r,r,r,r,r",
                        [p, gl.expand_dims(lo0, 2), gl.expand_dims(lo1, 2), gl.expand_dims(hi0, 2),
                         gl.expand_dims(hi1, 2)],
                        dtype=[gl.int32, gl.int32, gl.int32, gl.int32], is_pure=True, pack=1)
                    # element [.., w, x, y] of the joined [SUB, NBK, 4, 2, 2] becomes word 4w + 2x + y: o_(2x+y)
                    v = gl.reshape(gl.join(gl.join(o0, o2), gl.join(o1, o3)), [SUB, BKC // 2])
                    d_bufs.index(s).slice(sub * SUB, SUB, dim=0)._reinterpret(gl.int32, [SUB, BKC // 2], D32).store(v)
                fence_async_shared()
                mbarrier.arrive(d_ready.index(s), count=1)
                codes = nxt
                i += 1

    @gluon.jit
    def _consumer(a_bufs, d_bufs, x_ready, d_ready, x_empty, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS, stride_o,
                  BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr,
                  WM: gl.constexpr, WN: gl.constexpr):
        BKC: gl.constexpr = 64
        NW: gl.constexpr = 4 * WM * WN
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WM, WN],
                                                      instr_shape=[16, BN // WN, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        pid = gl.program_id(0)
        starts, cum, m_tiles = _schedule(offs_ptr, R, E, BM, E_POW2, NW)
        n_tiles = gl.cdiv(N, BN)
        ksteps = K // BKC
        i = 0
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            mt = t // n_tiles
            e, m0, m_end = _rows(mt, starts, cum, BM, E_POW2, NW)
            acc = gl.zeros([BM, BN], gl.float32, mma)
            for ks in range(ksteps):
                s = i % NS
                mbarrier.wait(x_ready.index(s), (i // NS) & 1)
                mbarrier.wait(d_ready.index(s), (i // NS) & 1)
                acc = warpgroup_mma(a_bufs.index(s), d_bufs.index(s).permute((1, 0)), acc, is_async=True)
                # one stage in flight: the previous one is done, its buffers go back to the loader
                acc = warpgroup_mma_wait(1, deps=(acc,))
                if ks > 0:
                    mbarrier.arrive(x_empty.index((i + NS - 1) % NS), count=1)
                i += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(x_empty.index((i + NS - 1) % NS), count=1)
            rows = m0 + gl.arange(0, BM, layout=row_l)
            cols = (t % n_tiles) * BN + gl.arange(0, BN, layout=col_l)
            o_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_o + cols[None, :]
            gl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < m_end)[:, None] & (cols < N)[None, :])

    @fast_launch
    @gluon.jit
    def _fp4_grouped_mm_sm90(x_desc, w_desc, ws_ptr, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS, stride_o,
                             BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr,
                             WM: gl.constexpr, WN: gl.constexpr, DW: gl.constexpr, DEC_REGS: gl.constexpr,
                             RPT: gl.constexpr, DECODE_ASM: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr):
        BKC: gl.constexpr = 64
        d_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NS, BM, BKC], x_desc.layout)
        p_bufs = gl.allocate_shared_memory(gl.int32, [NS, BN, BKC // 32, 4], w_desc.layout)
        d_bufs = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, BKC], d_layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        d_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        x_empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(x_ready.index(s), count=1)
            mbarrier.init(d_ready.index(s), count=1)
            mbarrier.init(x_empty.index(s), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (a_bufs, d_bufs, x_ready, d_ready, x_empty, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS,
                         stride_o, BM, BN, NS, E_POW2, WM, WN)),
            (_loader, (x_desc, w_desc, a_bufs, p_bufs, x_ready, x_empty, offs_ptr, R, N, E, K, NUM_PROGS,
                       BM, BN, NS, E_POW2)),
            (_decoder, (p_bufs, d_bufs, x_ready, d_ready, ws_ptr, offs_ptr, R, N, E, K, NUM_PROGS,
                        BM, BN, NS, E_POW2, DW, RPT, DECODE_ASM, LO, HI)),
        ], [1, DW], [24, DEC_REGS])


def descriptors(x: torch.Tensor, w_packed: torch.Tensor, cfg: Bf16Sm90Config):
    """TMA descriptors: activations [R, K] bf16 in [BM, 64] boxes (128-byte swizzle, the wgmma layout); packed weights
    as int32 words [E * N, K / 32, 4] in [BN, 2, 4] boxes (no swizzle: the decoder reads them)."""
    e, n = w_packed.shape[:2]
    k = x.shape[1]
    x_layout = gl.NVMMASharedLayout.get_default_for([cfg.BM, BK], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    w32 = w_packed.view(torch.int32).reshape(e * n, k // 32, 4)
    return (TensorDescriptor.from_tensor(x, [cfg.BM, BK], x_layout),
            TensorDescriptor.from_tensor(w32, [cfg.BN, BK // 32, 4], w_layout))


def launch_sm90(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
                out: torch.Tensor, config: Bf16Sm90Config | None = None) -> None:
    """Checked tensors: x [R, K] bf16, w_packed [E, N, K/2], w_scale [E, N, K/32], offs [E] int32, out [R, N] bf16
    with unit column stride. Writes the rows below offs[-1] of ``out``."""
    from ._grouped_tiles import e_pow2

    r, k = x.shape
    e, n = w_packed.shape[:2]
    if r == 0 or n == 0:
        return
    if k % BK:
        raise ValueError(f"fp4_grouped_mm (sm90): K = {k} must be a multiple of {BK}")
    x, w_packed, w_scale = tma_ready(x, w_packed, w_scale)
    cfg = config or default_config(r / e)
    cfg.check()
    x_desc, w_desc = descriptors(x, w_packed, cfg)
    progs = launch_grid(x, e, n, cfg.BM, cfg.BN, cfg.progs_per_sm)
    _fp4_grouped_mm_sm90[(progs,)](
        x_desc, w_desc, w_scale.view(torch.uint8), offs, out, r, n, e, k, progs, out.stride(0),
        BM=cfg.BM, BN=cfg.BN, NS=cfg.NS, E_POW2=e_pow2(e, False), WM=cfg.WM, WN=cfg.WN, DW=cfg.dec_warps,
        DEC_REGS=cfg.dec_regs, RPT=cfg.dec_rows, DECODE_ASM=_DECODE_ASM, LO=CODE_LO, HI=CODE_HI,
        num_warps=4 * cfg.WM * cfg.WN, maxnreg=cfg.maxnreg)


__all__ = ["Bf16Sm90Config", "EP1", "EP4", "decode_ref", "decode_tables", "default_config", "launch_sm90"]
