"""The Hopper (sm_90) kernel of ``minidi::fp8_fp4_grouped_mm``: a warp-specialised Gluon kernel in which one FP8 MMA
stays in flight while the previous one is promoted, with the FP4 weights' 1 x 32 scales folded into the decoded e4m3
bytes (one fused multiply-add per accumulator element per 32 of K instead of two). Measured on the H200 (round 10):
1.07-1.22x the bf16 op ``fp4_grouped_mm``, 3.4-3.8x the Triton kernel (docs/ops/fp8_grouped_gemm.md).

Contract (``fp8_grouped_gemm.py``): y[r] = (q[r] * s[r]) @ dequant(w)[e(r)].T, per K block b of 32 an FP8 MMA of
the block's e4m3 operands, promoted into an fp32 accumulator with the block's scales; rows past offs[-1] not
written. Same products, same per-block promotion; only the scale arithmetic is rearranged, exactly:

    acc += part_b * s_x[r, b] * s_w[n, b]           (the Triton kernel: two ops per element per block)
    s_w[n, b] = 2^(c[n, b] - 127) = 2^(base[n] - 127) * 2^d,  d = c[n, b] - base[n] in [-5, 6]
    w'[n, k] = e2m1[n, k] * 2^d is exactly an e4m3 value (2^-6 .. 384: normal e4m3 numbers)
    part'_b = FP8 MMA of (q, w');  acc += part'_b * s_x[r, b];  y = acc * 2^(base[n] - 127) in the epilogue

A weight row folds when its E8M0 codes span at most 11 (max - min <= 11) and none is 255 (NaN); ``fold_fp4_rows``
gives base[n] = min(min_b c + 5, 254) per row (so 2^(base - 127) is a normal fp32 number) for a tensor whose every
row folds, and None otherwise: the caller then runs the Triton kernel (exact per-block outer-product promotion).
The kernel re-checks d per (row, block) and decodes a block whose d is out of range to NaN bytes (e4m3 0x7F / 0xFF):
a base that does not belong to the scales poisons the output instead of being silently wrong.

Decode (the e4m3 byte of code m times 2^d, d + 5 = u in [0, 11]): byte = LUT[m] + 8 u for m != 0, 0 for m = 0, the
sign from bit 3 of the nibble. Per (row, block) two 32-bit tables of the 8 magnitudes are built (one multiply and
three adds); per 8 codes (one 32-bit word of packed weights) PTX ``prmt`` looks up 4 + 4 magnitudes and moves the
sign bits into place: 9 instructions per 8 weights.

Kernel (persistent; the tile schedule of ``_grouped_tiles.py`` rebuilt in Gluon, from ``offs`` on the device). A
tile is BM activation rows of one expert x BN weight rows, acc[BM, BN] = x[BM, K] @ W'[BN, K]^T (activations are
the wgmma A operand, loaded to registers, decoded weights the B operand in shared memory, both K-major). Three
partitions share a ring of NS stages of BK = 128 along K:
- loader (1 warp): TMA of the activation tile [BM, BK] e4m3 and the packed weight tile [BN, BK/32, 4] int32;
- decoder (4 warps): packed weights (shared memory) + E8M0 scales (global) -> e4m3 bytes of W' in shared memory;
- MMA / promotion (the default partition, 2 warpgroups): the tile is two column halves; per 32-wide K block one
  async m64n64k32 wgmma per half and warpgroup (use_acc False) into that half's partial registers; PIPE: each wait
  is deferred until the other half's next MMA is issued, so one MMA runs while the other half is promoted,
  acc += part * s_x[rows]; the epilogue scales each column by 2^(base - 127) and stores with masks.

Legend: R rows (sorted by expert), E experts, N output columns (weight rows), K input columns, BM/BN/BK tile sizes,
NS pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from minidi.formats import FP4_BLOCK
from minidi.ops._fast_launch import fast_launch

try:  # Gluon's Hopper API as Triton 3.6 has it; absent or renamed elsewhere: the Triton kernel is used instead
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except Exception:  # noqa: BLE001 - any import failure means "no Gluon path"
    HAVE_GLUON = False

TESTED_TRITON = ((3, 6),)  # Gluon's API moves between releases: the kernel runs only on versions it was tested on
FOLD_SPAN = 11  # max - min of a row's E8M0 codes that still folds: d in [-5, 6]
BK = 128  # K per stage (4 blocks of 32)


@dataclass(frozen=True)
class Sm90Config:
    BM: int = 128  # activation rows per tile
    BN: int = 128  # weight rows (output columns) per tile
    NS: int = 4  # pipeline stages
    WM: int = 2  # warpgroups along M (WM * WN = 2 consumer warpgroups)
    WN: int = 1
    PIPE: bool = True  # defer each half-MMA's wait until the next half-MMA is issued
    ABLATE: int = 0  # timing ablations (wrong results): 1 no promotion, 2 no decode, 3 neither
    maxnreg: int = 128  # per-thread register cap at entry; setmaxnreg moves registers to the consumers
    dec_regs: int = 64  # registers of a decoder thread
    dec_warps: int = 4  # warps of the decoder partition
    progs_per_sm: int = 1  # persistent programs per multiprocessor

    def name(self) -> str:
        return (f"BM{self.BM}_BN{self.BN}_S{self.NS}_W{self.WM}x{self.WN}_D{self.dec_warps}x{self.dec_regs}"
                f"_r{self.maxnreg}_p{self.progs_per_sm}_{'pipe' if self.PIPE else 'sync'}")


EP4 = Sm90Config()
EP1 = Sm90Config(BM=64, BN=256, NS=4, WM=1, WN=2, dec_regs=96)


def default_config(rows_per_expert: float) -> Sm90Config:
    """128 x 128 tiles (two warpgroups along M, 4 stages) for EP4-like loads (>= 96 rows per expert), else 64 x 256
    (two warpgroups along N, 4 stages: EP1's 64 rows per expert fill one tile). The fastest of the round-10 sweep
    (docs/ops/fp8_grouped_gemm.md)."""
    return EP4 if rows_per_expert >= 96 else EP1


# ---- the weight-scale fold (plain torch; once per weight tensor) ---------------------------------------------------
def fold_fp4_rows(w_scale: torch.Tensor) -> torch.Tensor | None:
    """E8M0 [E, N, K/32] -> base int32 [E, N] with c[n, b] - base[n] in [-5, 6] for every block (base = min(min_b c
    + 5, 254)), or None when some row cannot fold (its codes span more than 11, or one is 255 = NaN). One host sync;
    weights are constant, so callers compute it once per weight tensor."""
    c = w_scale.view(torch.uint8)
    lo = c.amin(-1).to(torch.int32)
    hi = c.amax(-1).to(torch.int32)
    ok = bool(((hi - lo <= FOLD_SPAN) & (hi < 255)).all())
    if not ok:
        return None
    return torch.clamp(lo + 5, max=254).contiguous()


def fold_ref(w_packed: torch.Tensor, w_scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of the kernel's decode: the e4m3 bytes of w' = e2m1 * 2^(c - base) [E, N, K] (uint8), 0x7F
    or 0xFF (NaN, with the code's sign) in every block whose c - base is outside [-5, 6]. The kernel computes
    exactly these bytes."""
    b = w_packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # [E, N, K]
    u = w_scale.view(torch.uint8).to(torch.int32) - base[..., None].to(torch.int32) + 5  # [E, N, K/32]
    u = u.repeat_interleave(FP4_BLOCK, dim=-1)
    lut = torch.tensor([0x00, 0x08, 0x10, 0x14, 0x18, 0x1C, 0x20, 0x24], dtype=torch.int32, device=b.device)
    m = codes & 7
    mag = torch.where(m == 0, 0, lut[m] + 8 * u)
    mag = torch.where((u < 0) | (u > FOLD_SPAN), 0x7F, mag)
    return (mag | ((codes & 8) << 4)).to(torch.uint8)


def _triton_version() -> tuple[int, int]:
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return major, minor


def gluon_supported() -> bool:
    """The Gluon API this file is written against is importable and its Triton version was tested."""
    return HAVE_GLUON and _triton_version() in TESTED_TRITON


def can_run(q: torch.Tensor, w_packed: torch.Tensor) -> bool:
    """CUDA tensors on an sm_90 device, a tested Triton with Gluon, K a multiple of 128, at most 511 experts."""
    if not (q.is_cuda and gluon_supported()):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return q.shape[1] % BK == 0 and w_packed.shape[0] <= 511


# ---- kernel --------------------------------------------------------------------------------------------------------
# prmt-based decode of 8 packed codes ($2) with the magnitude tables $3 (codes 0-3) / $4 (codes 4-7): $0 = e4m3 bytes
# of codes 0-3, $1 = codes 4-7. Sign of code j (bit 4j+3 of $2) -> bit 7 of byte j: bytes of ($2, $2 << 4) picked by
# prmt (the sign of an even code is bit 3 of its byte: bit 7 after << 4; of an odd code bit 7 already).
_DECODE_ASM = """{
.reg .b32 m, mh, q, a, b, s0, s1;
and.b32 m, $2, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 a, $3, $4, m;
prmt.b32 b, $3, $4, mh;
shl.b32 q, $2, 4;
prmt.b32 s0, $2, q, 0x1504;
prmt.b32 s1, $2, q, 0x3726;
lop3.b32 $0, s0, 0x80808080, a, 0xEA;
lop3.b32 $1, s1, 0x80808080, b, 0xEA;
}"""
_LUT0 = 0x14100800  # e4m3 bytes of e2m1 codes 0..3 times 2^-5 (u = 0): 0, 2^-6, 2^-5, 1.5 * 2^-5
_LUT1 = 0x24201C18  # codes 4..7: 2^-4, 1.5 * 2^-4, 2^-3, 1.5 * 2^-3

if HAVE_GLUON:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _sum0(x):
        """Sum of a 1-D tensor (gl.sum's combine function is a triton.jit function, which the interpreter mode of
        the CPU tests turns into one Gluon cannot call)."""
        return gl.reduce(x, 0, _add)

    @gluon.jit
    def _expert_tiles(offs_ptr, R, E, BM: gl.constexpr, E_POW2: gl.constexpr, NW: gl.constexpr):
        """Per expert (E_POW2 >= E + 1 entries): row start, row end (clamped to [0, R]), inclusive cumsum of the
        m-tile counts, first m-tile id; and the number of m-tiles (twin of ``_grouped_tiles.expert_m_tiles``)."""
        lay: gl.constexpr = gl.BlockedLayout([E_POW2 // (32 * NW)], [32], [NW], [0])
        ei = gl.arange(0, E_POW2, layout=lay)
        ends = gl.load(offs_ptr + ei, mask=ei < E, other=R)
        starts = gl.load(offs_ptr + ei - 1, mask=(ei >= 1) & (ei <= E), other=R)
        starts = gl.where(ei == 0, 0, starts)
        ends = gl.minimum(gl.maximum(ends, 0), R)
        starts = gl.minimum(gl.maximum(starts, 0), R)
        ntile = gl.where(ei < E, (gl.maximum(ends - starts, 0) + BM - 1) // BM, 0)
        cum = gl.associative_scan(ntile, 0, _add)
        return starts, ends, cum, cum - ntile, _sum0(ntile)

    @gluon.jit
    def _tile_rows(mt, starts, ends, cum, first, BM: gl.constexpr, E_POW2: gl.constexpr, NW: gl.constexpr):
        """m-tile ``mt`` -> (its expert, its first row, the expert's row end) (``_grouped_tiles.m_tile_rows``)."""
        lay: gl.constexpr = gl.BlockedLayout([E_POW2 // (32 * NW)], [32], [NW], [0])
        ei = gl.arange(0, E_POW2, layout=lay)
        e = _sum0((cum <= mt).to(gl.int32))
        sel = ei == e
        m0 = _sum0(gl.where(sel, starts, 0)) + (mt - _sum0(gl.where(sel, first, 0))) * BM
        return e, m0, _sum0(gl.where(sel, ends, 0))

    @gluon.jit
    def _loader(q_desc, w_desc, a_bufs, p_bufs, x_ready, x_empty, offs_ptr, R, N, E, K, NUM_PROGS,
                BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr):
        BKC: gl.constexpr = 128
        pid = gl.program_id(0)
        starts, ends, cum, first, m_tiles = _expert_tiles(offs_ptr, R, E, BM, E_POW2, 1)
        n_tiles = gl.cdiv(N, BN)
        ksteps = K // BKC
        i = 0
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            mt = t // n_tiles
            e, m0, m_end = _tile_rows(mt, starts, ends, cum, first, BM, E_POW2, 1)
            wrow = e * N + (t % n_tiles) * BN
            for ks in range(ksteps):
                s = i % NS
                mbarrier.wait(x_empty.index(s), ((i // NS) & 1) ^ 1)
                mbarrier.expect(x_ready.index(s), BM * BKC + BN * (BKC // 2))
                tma.async_copy_global_to_shared(q_desc, [m0, ks * BKC], x_ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [wrow, ks * (BKC // 32), 0], x_ready.index(s),
                                                p_bufs.index(s))
                i += 1

    @gluon.jit
    def _decoder(p_bufs, d_bufs, x_ready, d_ready, ws_ptr, base_ptr, offs_ptr, R, N, E, K, NUM_PROGS,
                 BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr, ABLATE: gl.constexpr,
                 DW: gl.constexpr, DECODE_ASM: gl.constexpr, LUT0: gl.constexpr, LUT1: gl.constexpr):
        BKC: gl.constexpr = 128
        NBK: gl.constexpr = BKC // 32  # blocks per stage
        # [BN, NBK, 4] int32: a thread holds the 4 words (32 codes) of one (row, block)
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // NBK, NBK, 1], [DW, 1, 1], [2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, L3)  # [BN, NBK]
        LR: gl.constexpr = gl.SliceLayout(1, LS)  # [BN]
        LB: gl.constexpr = gl.SliceLayout(0, LS)  # [NBK]
        D32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        pid = gl.program_id(0)
        starts, ends, cum, first, m_tiles = _expert_tiles(offs_ptr, R, E, BM, E_POW2, DW)
        n_tiles = gl.cdiv(N, BN)
        ksteps = K // BKC
        kb = K // 32
        i = 0
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            mt = t // n_tiles
            e, m0, m_end = _tile_rows(mt, starts, ends, cum, first, BM, E_POW2, DW)
            n = (t % n_tiles) * BN + gl.arange(0, BN, layout=LR)
            wrow = (e * N + gl.minimum(n, N - 1)).to(gl.int64)  # clamped: in bounds; those columns are not stored
            off = 5 - gl.load(base_ptr + wrow)  # u = c + off
            sc_ptrs = ws_ptr + wrow[:, None] * kb + gl.arange(0, NBK, layout=LB)[None, :]  # [BN, NBK]
            sc = gl.load(sc_ptrs)
            for ks in range(ksteps):
                s = i % NS
                u = sc.to(gl.int32) + off[:, None]
                dd = u * 0x08080808
                l0 = LUT0 + (dd & -256)  # code 0 stays 0
                l1 = LUT1 + dd
                bad = (u < 0) | (u > 11)
                l0 = gl.expand_dims(gl.where(bad, 0x7F7F7F7F, l0), 2)
                l1 = gl.expand_dims(gl.where(bad, 0x7F7F7F7F, l1), 2)
                mbarrier.wait(x_ready.index(s), (i // NS) & 1)
                if ABLATE < 2:  # ABLATE >= 2: no decode (the MMAs read stale bytes; timing only)
                    p = p_bufs.index(s).load(L3)  # [BN, NBK, 4]
                    lo, hi = gl.inline_asm_elementwise(DECODE_ASM, "=r,=r,r,r,r", [p, l0, l1],
                                                       dtype=[gl.int32, gl.int32], is_pure=True, pack=1)
                    v = gl.reshape(gl.join(lo, hi), [BN, BKC // 4])  # bytes of codes 0-3, 4-7, 8-11, ... of a row
                    d_bufs.index(s)._reinterpret(gl.int32, [BN, BKC // 4], D32).store(v)
                fence_async_shared()
                mbarrier.arrive(d_ready.index(s), count=1)
                # the next stage's scale codes, issued after the fence (a fence waits for every load in flight):
                # their latency hides behind the next stage's wait and decode; the last one is read twice
                sc = gl.load(sc_ptrs + gl.minimum(ks + 1, ksteps - 1) * NBK)
                i += 1

    @gluon.jit
    def _half_mma(a, d_bufs, s, j: gl.constexpr, h: gl.constexpr, part, HALF: gl.constexpr, USE_ACC: gl.constexpr):
        """Async FP8 wgmma of K block j of stage s against weight rows [h * HALF, (h + 1) * HALF): x[BM, 32] (``a``,
        registers) @ W'[HALF, 32]^T into the registers of ``part`` (read only when USE_ACC, an ablation)."""
        b = d_bufs.index(s).slice(32 * j, 32, dim=1).slice(h * HALF, HALF, dim=0).permute((1, 0))
        return warpgroup_mma(a, b, part, use_acc=USE_ACC, is_async=True)

    @gluon.jit
    def _promote(acc, part, sx, ABLATE: gl.constexpr):
        """acc + part * sx[row], one fma.rn per element. Inline asm with side effects: LLVM may not move it past the
        wgmma asm around it (as plain arithmetic, it sank every promotion below every MMA of the loop body: all the
        partial sums live at once, spilled, and ptxas serialised the wgmmas)."""
        if ABLATE % 2 == 1:  # ablation: no promotion (the MMA accumulated into ``part`` itself)
            return part
        return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [part, sx[:, None], acc],
                                         dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _load_scales(s_rows, b0, NB: gl.constexpr):
        """The activation scales of NB consecutive K blocks from b0 (a tuple of [BM] row vectors)."""
        if NB == 8:
            return (gl.load(s_rows + b0), gl.load(s_rows + (b0 + 1)), gl.load(s_rows + (b0 + 2)),
                    gl.load(s_rows + (b0 + 3)), gl.load(s_rows + (b0 + 4)), gl.load(s_rows + (b0 + 5)),
                    gl.load(s_rows + (b0 + 6)), gl.load(s_rows + (b0 + 7)))
        else:
            gl.static_assert(NB == 4)
            return (gl.load(s_rows + b0), gl.load(s_rows + (b0 + 1)), gl.load(s_rows + (b0 + 2)),
                    gl.load(s_rows + (b0 + 3)))

    @gluon.jit
    def _consumer(a_bufs, d_bufs, x_ready, d_ready, x_empty, s_ptr, base_ptr, offs_ptr, out_ptr,
                  R, N, E, K, NUM_PROGS, stride_s, stride_o,
                  BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr,
                  WM: gl.constexpr, WN: gl.constexpr, PIPE: gl.constexpr, ABLATE: gl.constexpr, U: gl.constexpr):
        BKC: gl.constexpr = 128
        NBK: gl.constexpr = BKC // 32
        NW: gl.constexpr = 4 * WM * WN
        HALF: gl.constexpr = BN // 2
        # the tile is two column halves [BM, BN/2], each one wgmma per warpgroup of n = BN / 2 / WN = 64
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WM, WN],
                                                      instr_shape=[16, HALF // WN, 32])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        UA: gl.constexpr = ABLATE % 2 == 1
        WAIT: gl.constexpr = 1 if PIPE else 0
        pid = gl.program_id(0)
        starts, ends, cum, first, m_tiles = _expert_tiles(offs_ptr, R, E, BM, E_POW2, NW)
        n_tiles = gl.cdiv(N, BN)
        ksteps = K // BKC
        i = 0
        # partial-sum registers of the two halves (recycled across blocks and tiles; use_acc=False never reads them)
        pa = gl.zeros([BM, HALF], gl.float32, mma)
        pb = gl.zeros([BM, HALF], gl.float32, mma)
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            mt = t // n_tiles
            e, m0, m_end = _tile_rows(mt, starts, ends, cum, first, BM, E_POW2, NW)
            rows = m0 + gl.arange(0, BM, layout=row_l)
            s_rows = s_ptr + gl.minimum(rows, R - 1).to(gl.int64) * stride_s
            acc_l = gl.zeros([BM, HALF], gl.float32, mma)
            acc_r = gl.zeros([BM, HALF], gl.float32, mma)
            if UA:
                pa = acc_l
                pb = acc_r
            # Block b: issue its left half, retire the right half of b - 1, issue its right half, retire its left
            # half (PIPE: each wait leaves the MMA just issued in flight). An iteration covers U stages (4U blocks)
            # and ends with nothing in flight: an in-flight accumulator carried around a loop makes the compiler copy
            # it, and ptxas then serialises every wgmma.
            # the activation scales of the next iteration are loaded one iteration ahead (global latency)
            n_it = ksteps // U
            sx_cur = _load_scales(s_rows, 0, U * NBK)
            for it in range(n_it):
                sx_nxt = _load_scales(s_rows, gl.minimum(it + 1, n_it - 1) * (U * NBK), U * NBK)
                for u in gl.static_range(U):
                    s = (i + u) % NS
                    mbarrier.wait(x_ready.index(s), ((i + u) // NS) & 1)
                    mbarrier.wait(d_ready.index(s), ((i + u) // NS) & 1)
                    for j in gl.static_range(NBK):
                        sx = sx_cur[u * NBK + j]
                        a = a_bufs.index(s).slice(32 * j, 32, dim=1).load(a_l)
                        tok_l = _half_mma(a, d_bufs, s, j, 0, pa, HALF, UA)
                        if u + j > 0:  # static: tok_r / sx_prev exist from the unrolled block before (noqa)
                            pb = warpgroup_mma_wait(WAIT, deps=(tok_r,))  # noqa: F821
                            if u > 0 and j == 0:  # the previous stage's MMAs are all done
                                mbarrier.arrive(x_empty.index((i + u - 1) % NS), count=1)
                            acc_r = _promote(acc_r, pb, sx_prev, ABLATE)  # noqa: F821
                        tok_r = _half_mma(a, d_bufs, s, j, 1, pb, HALF, UA)
                        pa = warpgroup_mma_wait(WAIT, deps=(tok_l,))
                        acc_l = _promote(acc_l, pa, sx, ABLATE)
                        sx_prev = sx
                pb = warpgroup_mma_wait(0, deps=(tok_r,))
                mbarrier.arrive(x_empty.index((i + U - 1) % NS), count=1)
                acc_r = _promote(acc_r, pb, sx_prev, ABLATE)
                sx_cur = sx_nxt
                i += U
            # epilogue: each column's weight scale 2^(base - 127), masked stores of the two halves
            for h in gl.static_range(2):
                cols = (t % n_tiles) * BN + h * HALF + gl.arange(0, HALF, layout=col_l)
                base = gl.load(base_ptr + (e * N + gl.minimum(cols, N - 1)).to(gl.int64))
                if h == 0:
                    y = acc_l * (base << 23).to(gl.float32, bitcast=True)[None, :]
                else:
                    y = acc_r * (base << 23).to(gl.float32, bitcast=True)[None, :]
                o_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_o + cols[None, :]
                gl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=(rows < m_end)[:, None] & (cols < N)[None, :])

    @fast_launch
    @gluon.jit
    def _fp8_fp4_grouped_mm_sm90(q_desc, w_desc, s_ptr, ws_ptr, base_ptr, offs_ptr, out_ptr,
                                 R, N, E, K, NUM_PROGS, stride_s, stride_o,
                                 BM: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr,
                                 WM: gl.constexpr, WN: gl.constexpr, PIPE: gl.constexpr, ABLATE: gl.constexpr,
                                 U: gl.constexpr, DW: gl.constexpr, DEC_REGS: gl.constexpr,
                                 DECODE_ASM: gl.constexpr, LUT0: gl.constexpr, LUT1: gl.constexpr):
        BKC: gl.constexpr = 128
        d_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NS, BM, BKC], q_desc.layout)
        p_bufs = gl.allocate_shared_memory(gl.int32, [NS, BN, BKC // 32, 4], w_desc.layout)
        d_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NS, BN, BKC], d_layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        d_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        x_empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(x_ready.index(s), count=1)
            mbarrier.init(d_ready.index(s), count=1)
            mbarrier.init(x_empty.index(s), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (a_bufs, d_bufs, x_ready, d_ready, x_empty, s_ptr, base_ptr, offs_ptr, out_ptr,
                         R, N, E, K, NUM_PROGS, stride_s, stride_o, BM, BN, NS, E_POW2, WM, WN, PIPE, ABLATE, U)),
            (_loader, (q_desc, w_desc, a_bufs, p_bufs, x_ready, x_empty, offs_ptr, R, N, E, K, NUM_PROGS,
                       BM, BN, NS, E_POW2)),
            (_decoder, (p_bufs, d_bufs, x_ready, d_ready, ws_ptr, base_ptr, offs_ptr, R, N, E, K, NUM_PROGS,
                        BM, BN, NS, E_POW2, ABLATE, DW, DECODE_ASM, LUT0, LUT1)),
        ], [1, DW], [24, DEC_REGS])


def descriptors(q: torch.Tensor, w_packed: torch.Tensor, cfg: Sm90Config):
    """TMA descriptors: activations [R, K] e4m3 in [BM, 128] boxes (128-byte swizzle, the wgmma A layout); packed
    weights as int32 words [E * N, K / 32, 4] in [BN, 4, 4] boxes (no swizzle: the decoder reads them)."""
    r, k = q.shape
    e, n = w_packed.shape[:2]
    q_layout = gl.NVMMASharedLayout.get_default_for([cfg.BM, BK], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    w32 = w_packed.view(torch.int32).reshape(e * n, k // 32, 4)
    q_desc = TensorDescriptor.from_tensor(q, [cfg.BM, BK], q_layout)
    w_desc = TensorDescriptor.from_tensor(w32, [cfg.BN, BK // 32, 4], w_layout)
    return q_desc, w_desc


def launch_sm90(q: torch.Tensor, s: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, base: torch.Tensor,
                offs: torch.Tensor, out: torch.Tensor, config: Sm90Config | None = None) -> None:
    """Checked, contiguous tensors: q [R, K] e4m3, s [R, K/32] fp32, w_packed [E, N, K/2], w_scale [E, N, K/32],
    base [E, N] int32 (``fold_fp4_rows``), offs [E] int32, out [R, N]. Writes the rows below offs[-1] of ``out``."""
    from ._grouped_tiles import e_pow2
    from ._triton_utils import num_sms

    r, k = q.shape
    e, n = w_packed.shape[:2]
    if r == 0 or n == 0:
        return
    if k % BK:
        raise ValueError(f"fp8_fp4_grouped_mm (sm90): K = {k} must be a multiple of {BK}")
    # TMA: 16-byte aligned bases and row strides (contiguous copies where not); the scale and base tensors are
    # indexed as dense [E * N, K / 32] / [E * N]
    q = q if q.is_contiguous() and q.data_ptr() % 16 == 0 else q.contiguous()
    w_packed = w_packed if w_packed.is_contiguous() and w_packed.data_ptr() % 16 == 0 else w_packed.contiguous()
    w_scale, base = w_scale.contiguous(), base.contiguous()
    cfg = config or default_config(r / e)
    q_desc, w_desc = descriptors(q, w_packed, cfg)
    max_tiles = (r // cfg.BM + e) * triton.cdiv(n, cfg.BN)
    progs = max(1, min(num_sms(q.device) * cfg.progs_per_sm, max_tiles))
    _fp8_fp4_grouped_mm_sm90[(progs,)](
        q_desc, w_desc, s, w_scale.view(torch.uint8), base, offs, out,
        r, n, e, k, progs, s.stride(0), out.stride(0),
        BM=cfg.BM, BN=cfg.BN, NS=cfg.NS, E_POW2=e_pow2(e, False), WM=cfg.WM, WN=cfg.WN, PIPE=cfg.PIPE,
        ABLATE=cfg.ABLATE, U=2 if (k // BK) % 2 == 0 else 1, DW=cfg.dec_warps,
        DEC_REGS=cfg.dec_regs, DECODE_ASM=_DECODE_ASM, LUT0=_LUT0, LUT1=_LUT1,
        num_warps=4 * cfg.WM * cfg.WN, maxnreg=cfg.maxnreg)
