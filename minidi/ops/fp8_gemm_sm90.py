"""A block-scaled FP8 dense GEMM for Hopper (sm_90a) in Gluon: the FP8-tensor-core replacement of the bf16 GEMM in
``minidi::fp8_linear`` (issue 21, item 2).

    y = fp8_gemm_sm90(q, s_x, w, w_scale, block, out_dtype)
    # q [M, K] e4m3, s_x [M, K / block] fp32 (``fq8_split(x, block)``), w [N, K] e4m3,
    # w_scale [ceil(N / block), K / block] E8M0 codes (uint8 / float8_e8m0fnu) or their fp32 values -> y [M, N]
    # reference and argument checks: fp8_gemm.py (fp8_gemm_ref, check_args)

Semantics (exact, the default and only mode): for each K block b of ``block`` (32 for V4.1, 128 for V4-Flash)

    part_b = FP8 wgmma of the block's e4m3 operands (fresh accumulator; a 128-block is 4 chained k32 wgmmas)
    acc[m, n] += part_b[m, n] * (s_x[m, b] * s_w[n // block, b])       (fp32, one fma.rn per element per block)
    y = acc rounded to out_dtype

Every product equals the bf16 path's product (``F.linear(fq8(x), dequant_fp8(w))``): e4m3 x e4m3 times powers of two.
The sums differ in order, and the FP8 tensor core sums a block's products in a narrower accumulator than fp32
(on the H100: max |err| 9.8e-5 of sum |x| |w| with 32-blocks, 2.3e-4 with 128-blocks, whose 4 chained wgmmas
accumulate inside the tensor core; the GPU test bounds them by 2^-12 / 2^-11). E8M0 code 255 (NaN) makes its
output columns NaN, code 0 is 2^-127.

Kernel (persistent, warp-specialised; one 128 x BN output tile per program at a time, tiles in a grouped raster
of GROUP_M m-tiles for L2 reuse):
- loader (1 warp, 24 registers): per stage of 128 along K, TMA of the activation tile [128, 128] and the weight
  tile [BN, 128] (e4m3, K-major, 128-byte swizzle: the wgmma operands, both read from shared memory); for 32-blocks
  also the stage's scales by TMA: s_x [128, 4] fp32 and the weight scales as ``weight_scale_t`` (fp32, transposed
  [K / 32, ceil(N / 32) padded to 4], [4, 8] boxes: 16-byte rows, 128-byte-aligned destinations; built per call from
  the codes, or kept by the caller and passed as ``w_scale_t``). A ring of NS stages (mbarriers ready / empty).
- MMA / promotion (the default partition, 2 warpgroups, 64 rows each, registers raised by setmaxnreg): per K block
  one async wgmma m64nBNk32 (x 4 for a 128-block) into one of two partial-sum register sets, alternating; the wait
  of block b leaves block b + 1's MMA in flight (``wgmma.wait_group 1``), so block b's promotion overlaps the next
  MMA, and the two warpgroups overlap each other. Registers: acc 64 + 2 x 64 partials (BN = 128).
- The promotion is a [128, BN / block, block] view of the partial (a reshape that moves no data) times the scale
  product [128, BN / block, 1] (2 x BN / block fp32 multiplies per thread per block), one inline-asm ``fma.rn.f32``
  per element: inline asm with side effects, because LLVM sinks plain arithmetic below the next wgmmas (see
  ``fp8_grouped_gemm_sm90.py``). Each loop iteration (U stages) ends with no MMA in flight: a wgmma result carried
  around a loop back-edge is copied and serialises the wgmmas.
- 128-blocks read their scales from global memory (one [128] and one [BN / 128] vector per block, loaded at the
  block's MMA issue, or with ``PREFETCH`` one block ahead); their rows (K / 128 fp32) are too short for TMA boxes.
- Epilogue: masked stores from the accumulator registers (rows >= M and columns >= N never written), or with
  ``EPI_TMA`` a bulk (TMA) store of the tile through shared memory, clipped to [M, N] by the descriptor (only where
  the output rows are 16-byte aligned; else the masked stores).
- BN = 128 only: a BN = 64 build raised "illegal instruction" on the H100 (not debugged).

Measured (one H100 80GB, ``bench/bench_fp8_gemm.py --ablate``, profiler kernel times, peaks in the same run: bf16
794, fp8 1,447 TFLOP/s; T = 4,096) with the bulk-store epilogue (the default), against ``F.linear`` on the
pre-dequantised bf16 weight: 32-blocks 0.78x (N 1,280, K 5,120) to 0.975x (5,120 x 8,192: 830 TFLOP/s); 128-blocks
1.13-1.35x (32,768 x 1,280: 1,070 TFLOP/s), where ``torch._scaled_mm`` with 1 x 128 / 128 x 128 block scales runs
5,120 x 8,192 in 0.277 ms (ours 0.353). The 32-block kernel does not beat bf16: see the report of issue 21 item 2.

Legend: M rows of x (tokens), N output columns (weight rows), K input columns, BN tile columns, NS stages, U stages
per loop iteration, NB = BN / block column blocks of a tile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ._fast_launch import fast_launch
from ._triton_utils import capability, num_sms
from .fp8_gemm import BLOCKS, check_args, weight_scale_fp32

try:  # Gluon's Hopper API as Triton 3.6 has it; absent or renamed elsewhere: the module is inert
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except Exception:  # noqa: BLE001 - any import failure means "no Gluon path"
    HAVE_GLUON = False

TESTED_TRITON = ((3, 6),)  # Gluon's API moves between releases: the kernel runs only on versions it was tested on
BKC = 128  # K per pipeline stage
BM = 128  # tile rows: two consumer warpgroups of 64


@dataclass(frozen=True)
class Fp8GemmSm90Config:
    BN: int = 128  # output columns per tile (128 only: the BN = 64 build faulted on the H100, not debugged)
    NS: int = 4  # pipeline stages
    GROUP_M: int = 8  # m-tiles per raster group (L2 reuse of the weight tiles)
    U: int = 2  # stages per loop iteration (1 when the stage count is odd)
    PIPE: bool = True  # two partial sets, block b promoted while block b + 1's MMA runs; False: wait 0 each block
    maxnreg: int = 168  # per-thread register cap at entry; setmaxnreg moves registers to the consumers
    progs_per_sm: int = 1
    PREFETCH: bool = False  # 128-blocks: load a block's scales one block ahead instead of at its MMA's issue
    # (same bits; measured 3-9 % slower on the H100)
    EPI_TMA: bool = True  # epilogue: bulk (TMA) store through shared memory where the output allows, else masked
    # stores (same bits; 3-47 % faster kernels on the H100)
    ABLATE: int = 0  # timing ablation (wrong results): 1 = no promotion (the MMAs accumulate in
    # the partial sets, added to the tile's sum once at its end)

    def name(self) -> str:
        return (f"BN{self.BN}_S{self.NS}_G{self.GROUP_M}_U{self.U}_r{self.maxnreg}"
                f"{'' if self.PIPE else '_sync'}{'_tmastore' if self.EPI_TMA else ''}{'_pf' if self.PREFETCH else ''}"
                f"{'' if self.progs_per_sm == 1 else f'_p{self.progs_per_sm}'}"
                f"{'' if not self.ABLATE else f'_ablate{self.ABLATE}'}")


DEFAULT = Fp8GemmSm90Config()


def _triton_version() -> tuple[int, int]:
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return major, minor


def gluon_supported() -> bool:
    """The Gluon API this file is written against is importable and its Triton version was tested."""
    return HAVE_GLUON and _triton_version() in TESTED_TRITON


def can_run(q: torch.Tensor, w: torch.Tensor, block: int) -> bool:
    """CUDA tensors on an sm_90 device, a tested Triton with Gluon, block 32 or 128, K a multiple of 128."""
    if not (q.is_cuda and w.is_cuda and gluon_supported()):
        return False
    if capability(q.device) != (9, 0):
        return False
    return block in BLOCKS and q.dim() == 2 and q.shape[1] % BKC == 0


# ---- kernel --------------------------------------------------------------------------------------------------------
if HAVE_GLUON:

    @gluon.jit
    def _tile_coords(t, num_m, num_n, GROUP_M: gl.constexpr):
        """Tile id -> (m-tile, n-tile) in a grouped raster: GROUP_M m-tiles walk the n-tiles together."""
        in_group = GROUP_M * num_n
        first_m = (t // in_group) * GROUP_M
        size_m = gl.minimum(num_m - first_m, GROUP_M)
        r = t % in_group
        return first_m + r % size_m, r // size_m

    @gluon.jit
    def _loader(a_desc, b_desc, sx_desc, sw_desc, a_bufs, b_bufs, sx_bufs, sw_bufs, ready, empty,
                M, N, K, NUM_PROGS, BN: gl.constexpr, NS: gl.constexpr, GROUP_M: gl.constexpr,
                BLK: gl.constexpr):
        BM_: gl.constexpr = 128
        BK_: gl.constexpr = 128
        NBK: gl.constexpr = BK_ // BLK
        if BLK == 32:
            SWC: gl.constexpr = 8 if BN // 32 < 8 else BN // 32  # weight-scale box columns (128 B at least)
            nbytes: gl.constexpr = (BM_ + BN) * BK_ + (BM_ + SWC) * NBK * 4
        else:
            nbytes: gl.constexpr = (BM_ + BN) * BK_
        pid = gl.program_id(0)
        num_m = gl.cdiv(M, BM_)
        num_n = gl.cdiv(N, BN)
        ksteps = K // BK_
        i = 0
        for t in range(pid, num_m * num_n, NUM_PROGS):
            pm, pn = _tile_coords(t, num_m, num_n, GROUP_M)
            for ks in range(ksteps):
                s = i % NS
                mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [pm * BM_, ks * BK_], ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [pn * BN, ks * BK_], ready.index(s), b_bufs.index(s))
                if BLK == 32:
                    tma.async_copy_global_to_shared(sx_desc, [pm * BM_, ks * NBK], ready.index(s), sx_bufs.index(s))
                    tma.async_copy_global_to_shared(sw_desc, [ks * NBK, pn * (BN // 32)], ready.index(s),
                                                    sw_bufs.index(s))
                i += 1

    @gluon.jit
    def _promote(acc, part, scale, ABLATE: gl.constexpr):
        """acc + part * scale (scale [BM, NB, 1] broadcast along the block's columns): one fma.rn per element. Inline
        asm with side effects: LLVM may not sink it below the wgmmas that follow (as plain arithmetic it does).
        ABLATE 1 (timing only): no promotion, the partial is dropped."""
        if ABLATE == 1:
            return acc
        return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [part, scale, acc],
                                         dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _issue(a, b, pa, pb, PAR: gl.constexpr, USE_ACC: gl.constexpr):
        """Async wgmma(s) of one K block into the partial set PAR (0: pa, 1: pb); use_acc=False never reads it
        (USE_ACC: the no-promotion ablation accumulates into the set, which keeps every MMA live)."""
        if PAR == 0:
            return warpgroup_mma(a, b, pa, use_acc=USE_ACC, is_async=True)
        else:
            return warpgroup_mma(a, b, pb, use_acc=USE_ACC, is_async=True)

    @gluon.jit
    def _retire(part, pa, pb, PAR: gl.constexpr):
        """(pa, pb) with the waited-for result ``part`` in set PAR: the next MMA into that set reuses its registers."""
        if PAR == 0:
            return part, pb
        else:
            return pa, part

    @gluon.jit
    def _smem_scale(sx_bufs, sw_bufs, s, j: gl.constexpr, L3: gl.constexpr, NB: gl.constexpr):
        """32-blocks: the scale product s_x[m, b] * s_w[n // 32, b] of column j of stage s (shared memory), as [BM,
        NB, 1] in L3 (2 x NB fp32 values per thread)."""
        L2: gl.constexpr = gl.SliceLayout(2, L3)
        sx = sx_bufs.index(s).slice(j, 1, dim=1).load(L2)  # [BM, 1]
        sw = sw_bufs.index(s).slice(j, 1, dim=0).slice(0, NB, dim=1).load(L2)  # [1, NB]
        return gl.expand_dims(sx * sw, 2)

    @gluon.jit
    def _global_scales(sx_rows, sw_cols, b, stride_sw, L3: gl.constexpr):
        """128-blocks: s_x[rows, b] [BM, 1] and s_w[cols // 128, b] [1, NB] from global memory (loaded one block
        ahead of their use: the latency hides behind a block's MMA)."""
        L2: gl.constexpr = gl.SliceLayout(2, L3)
        return gl.expand_dims(gl.load(sx_rows + b), 1), gl.expand_dims(gl.load(sw_cols + b * stride_sw), 0)

    @gluon.jit
    def _consumer(a_bufs, b_bufs, sx_bufs, sw_bufs, c_smem, ready, empty, c_desc, sx_ptr, sw_ptr, out_ptr,
                  M, N, K, NUM_PROGS, stride_sx, stride_sw, stride_o,
                  BN: gl.constexpr, NS: gl.constexpr, GROUP_M: gl.constexpr, BLK: gl.constexpr, U: gl.constexpr,
                  PIPE: gl.constexpr, ABLATE: gl.constexpr, EPI_TMA: gl.constexpr, PREFETCH: gl.constexpr):
        BM_: gl.constexpr = 128
        BK_: gl.constexpr = 128
        NBK: gl.constexpr = BK_ // BLK  # blocks per stage
        NB: gl.constexpr = BN // BLK  # column blocks per tile
        NBI: gl.constexpr = U * NBK  # blocks per loop iteration
        WAIT: gl.constexpr = 1 if PIPE else 0
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BN, 32])
        # [BM, NB, BLK] view of an accumulator: the same registers (the reshape moves no data)
        acc = gl.reshape(gl.zeros([BM_, BN], gl.float32, mma), [BM_, NB, BLK])
        L3: gl.constexpr = acc.type.layout
        row_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
        nb_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, L3))
        c_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))
        pid = gl.program_id(0)
        num_m = gl.cdiv(M, BM_)
        num_n = gl.cdiv(N, BN)
        ksteps = K // BK_
        n_it = ksteps // U
        kb = K // BLK
        i = 0
        pa = gl.zeros([BM_, BN], gl.float32, mma)  # the two partial-sum register sets (use_acc=False never reads)
        pb = gl.zeros([BM_, BN], gl.float32, mma)
        for t in range(pid, num_m * num_n, NUM_PROGS):
            pm, pn = _tile_coords(t, num_m, num_n, GROUP_M)
            rows = pm * BM_ + gl.arange(0, BM_, layout=row_l)
            nbs = pn * NB + gl.arange(0, NB, layout=nb_l)
            sx_rows = sx_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_sx  # clamped: rows >= M not stored
            sw_cols = sw_ptr + gl.minimum(nbs, (N - 1) // BLK)
            acc = gl.reshape(gl.zeros([BM_, BN], gl.float32, mma), [BM_, NB, BLK])
            sx_n, sw_n = _global_scales(sx_rows, sw_cols, 0, stride_sw, L3)  # 128-blocks: block 0's scales
            for it in range(n_it):
                # Blocks q = 0 .. NBI - 1 of this iteration alternate between the partial sets pa (even) and pb
                # (odd). Issue q, retire q - 1 (PIPE: q stays in flight), promote q - 1. The iteration ends with
                # nothing in flight.
                for u in gl.static_range(U):
                    s = (i + u) % NS
                    mbarrier.wait(ready.index(s), ((i + u) // NS) & 1)
                    for j in gl.static_range(NBK):
                        a = a_bufs.index(s).slice(BLK * j, BLK, dim=1)
                        b = b_bufs.index(s).slice(BLK * j, BLK, dim=1).permute((1, 0))
                        if BLK == 32:
                            sc = _smem_scale(sx_bufs, sw_bufs, s, j, L3, NB)
                        elif PREFETCH:  # this block's scales (loaded a block ago), then the next block's loads
                            sc = gl.expand_dims(sx_n * sw_n, 2)
                            sx_n, sw_n = _global_scales(sx_rows, sw_cols, gl.minimum((it * U + u) * NBK + j + 1,
                                                                                     kb - 1), stride_sw, L3)
                        else:  # loaded at the MMA's issue, used at its promotion
                            sx_c, sw_c = _global_scales(sx_rows, sw_cols, (it * U + u) * NBK + j, stride_sw, L3)
                            sc = gl.expand_dims(sx_c * sw_c, 2)
                        tok = _issue(a, b, pa, pb, (u * NBK + j) % 2, ABLATE == 1)
                        if u * NBK + j > 0:  # static: block q = u * NBK + j of the iteration
                            prev = warpgroup_mma_wait(WAIT, deps=(tok_prev,))  # noqa: F821 (block q - 1)
                            pa, pb = _retire(prev, pa, pb, (u * NBK + j - 1) % 2)
                            if j == 0:  # the previous stage's MMAs are all done
                                mbarrier.arrive(empty.index((i + u - 1) % NS), count=1)
                            acc = _promote(acc, gl.reshape(prev, [BM_, NB, BLK]), sc_prev, ABLATE)  # noqa: F821
                        tok_prev = tok
                        sc_prev = sc
                last = warpgroup_mma_wait(0, deps=(tok_prev,))
                pa, pb = _retire(last, pa, pb, (NBI - 1) % 2)
                mbarrier.arrive(empty.index((i + U - 1) % NS), count=1)
                acc = _promote(acc, gl.reshape(last, [BM_, NB, BLK]), sc_prev, ABLATE)
                i += U
            if ABLATE == 1:  # the ablation's partial sets hold every MMA's sum: use them once per tile
                acc = acc + gl.reshape(pa + pb, [BM_, NB, BLK])
            if EPI_TMA:  # bulk store through shared memory, clipped to [M, N] by the descriptor; runs on
                tma.store_wait(0)  # while the next tile's MMAs start (the previous store must have read c_smem)
                gl.thread_barrier()
                c_smem.store(gl.reshape(acc, [BM_, BN]).to(c_desc.dtype))
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(c_desc, [pm * BM_, pn * BN], c_smem)
            else:  # masked stores from the registers (rows >= M, columns >= N never written)
                cols = gl.expand_dims(gl.expand_dims(nbs * BLK, 0), 2) + \
                    gl.expand_dims(gl.expand_dims(gl.arange(0, BLK, layout=c_l), 0), 1)  # [1, NB, BLK]
                r3 = gl.expand_dims(gl.expand_dims(rows, 1), 2)  # [BM, 1, 1]
                o_ptrs = out_ptr + r3.to(gl.int64) * stride_o + cols
                gl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(r3 < M) & (cols < N))
        if EPI_TMA:
            tma.store_wait(0)

    @fast_launch
    @gluon.jit
    def _fp8_gemm_sm90_gluon(a_desc, b_desc, sx_desc, sw_desc, c_desc, sx_ptr, sw_ptr, out_ptr,
                              M, N, K, NUM_PROGS, stride_sx, stride_sw, stride_o,
                              BN: gl.constexpr, NS: gl.constexpr, GROUP_M: gl.constexpr, BLK: gl.constexpr,
                              U: gl.constexpr, PIPE: gl.constexpr, ABLATE: gl.constexpr, EPI_TMA: gl.constexpr,
                              PREFETCH: gl.constexpr):
        BM_: gl.constexpr = 128
        BK_: gl.constexpr = 128
        NBK: gl.constexpr = BK_ // BLK
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NS, BM_, BK_], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NS, BN, BK_], b_desc.layout)
        s_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        if BLK == 32:
            sx_bufs = gl.allocate_shared_memory(gl.float32, [NS, BM_, NBK], sx_desc.layout)
            SWC: gl.constexpr = 8 if BN // 32 < 8 else BN // 32  # a TMA destination is 128-byte aligned
            sw_bufs = gl.allocate_shared_memory(gl.float32, [NS, NBK, SWC], sw_desc.layout)
        else:  # unused (128-blocks read their scales from global memory)
            sx_bufs = gl.allocate_shared_memory(gl.float32, [1, 8, 4], s_layout)
            sw_bufs = gl.allocate_shared_memory(gl.float32, [1, 8, 4], s_layout)
        if EPI_TMA:
            c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM_, BN], c_desc.layout)
        else:  # unused
            c_smem = gl.allocate_shared_memory(gl.float32, [8, 4], s_layout)
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, sx_bufs, sw_bufs, c_smem, ready, empty, c_desc, sx_ptr, sw_ptr, out_ptr,
                         M, N, K, NUM_PROGS, stride_sx, stride_sw, stride_o, BN, NS, GROUP_M, BLK, U, PIPE, ABLATE,
                         EPI_TMA, PREFETCH)),
            (_loader, (a_desc, b_desc, sx_desc, sw_desc, a_bufs, b_bufs, sx_bufs, sw_bufs, ready, empty,
                       M, N, K, NUM_PROGS, BN, NS, GROUP_M, BLK)),
        ], [1], [24])


def weight_scale_t_shape(n: int, k: int, block: int) -> tuple[int, int]:
    """[K / block, ceil(N / block) rounded up to 4]: the shape of ``weight_scale_t`` for a weight [N, K]."""
    return k // block, triton.cdiv(triton.cdiv(n, block), 4) * 4


def weight_scale_t(w_scale: torch.Tensor) -> torch.Tensor:
    """The kernel's form of the weight scales: fp32 [K / block, ceil(N / block) rounded up to 4] (transposed, so that
    a stage's scales are one TMA box with 16-byte rows; the padding columns are never used). ``w_scale`` [ceil(N /
    block), K / block] E8M0 codes or fp32. Constant per weight: callers may keep it and pass it as ``w_scale_t``."""
    sw = weight_scale_fp32(w_scale)
    nb, kb = sw.shape
    out = torch.zeros(weight_scale_t_shape(nb, kb, 1), dtype=torch.float32, device=sw.device)
    out[:, :nb] = sw.t()
    return out


@functools.lru_cache(maxsize=None)
def _swizzled_layout(box: tuple[int, int], dtype):
    """The default (swizzled) shared layout of a TMA box: the same object for every call with this box and dtype
    (built once: it was most of ``descriptors``' host time per GEMM call)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), dtype)


def descriptors(q: torch.Tensor, s_x: torch.Tensor, w: torch.Tensor, sw_t: torch.Tensor, block: int,
                cfg: Fp8GemmSm90Config, out: torch.Tensor | None = None):
    """TMA descriptors: q [M, K] in [128, 128] boxes and w [N, K] in [BN, 128] boxes (e4m3, 128-byte swizzle, the
    wgmma layout); for 32-blocks s_x [M, K/32] in [128, 4] boxes and the transposed fp32 weight scales
    (``weight_scale_t``) in [4, max(8, BN/32)] boxes (no swizzle). 128-blocks: the scale descriptors are q's
    (unused). The output descriptor ([128, BN] boxes, 128-byte swizzle) where ``out`` is given, else q's (unused)."""
    a_desc = TensorDescriptor.from_tensor(q, [BM, BKC], _swizzled_layout((BM, BKC), gl.float8e4nv))
    b_desc = TensorDescriptor.from_tensor(w, [cfg.BN, BKC], _swizzled_layout((cfg.BN, BKC), gl.float8e4nv))
    c_desc = a_desc
    if out is not None:
        c_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[out.dtype]
        c_desc = TensorDescriptor.from_tensor(out, [BM, cfg.BN], _swizzled_layout((BM, cfg.BN), c_dtype))
    if block != 32:
        return a_desc, b_desc, a_desc, a_desc, c_desc
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sx_desc = TensorDescriptor.from_tensor(s_x, [BM, BKC // 32], s_layout)
    sw_desc = TensorDescriptor.from_tensor(sw_t, [BKC // 32, max(8, cfg.BN // 32)], s_layout)
    return a_desc, b_desc, sx_desc, sw_desc, c_desc


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous()


def fp8_gemm_sm90(q: torch.Tensor, s_x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int,
                  out_dtype: torch.dtype = torch.bfloat16, config: Fp8GemmSm90Config | None = None,
                  out: torch.Tensor | None = None, w_scale_t: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, K] e4m3, s_x [M, K / block] fp32, w [N, K] e4m3, w_scale [ceil(N / block), K / block] E8M0 codes or
    fp32 -> y [M, N] ``out_dtype`` (see the module doc). ``w_scale_t``: ``weight_scale_t(w_scale)``, kept by the
    caller (skips its per-call construction). ``out``: an [M, N] tensor of ``out_dtype`` with unit column stride to
    write into."""
    check_args(q, s_x, w, w_scale, block, out_dtype, "fp8_gemm_sm90")
    if not can_run(q, w, block):
        raise ValueError(f"fp8_gemm_sm90: cannot run here (needs CUDA tensors on an sm_90 GPU, Triton "
                         f"{TESTED_TRITON} with Gluon, K a multiple of {BKC}); got K {q.shape[1]} on {q.device}")
    cfg = config or DEFAULT
    if cfg.BN != 128:
        raise ValueError(f"fp8_gemm_sm90: config BN {cfg.BN} must be 128")
    m, k = q.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"fp8_gemm_sm90: out must be [{m}, {n}] {out_dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if m == 0 or n == 0:
        return out
    shape_t = weight_scale_t_shape(n, k, block)
    if w_scale_t is None:
        w_scale_t = weight_scale_t(w_scale)
    elif w_scale_t.dtype != torch.float32 or tuple(w_scale_t.shape) != shape_t:
        raise ValueError(f"fp8_gemm_sm90: w_scale_t must be weight_scale_t(w_scale): fp32 {shape_t}, got "
                         f"{tuple(w_scale_t.shape)} {w_scale_t.dtype}")
    q, w, s_x, w_scale_t = _aligned(q), _aligned(w), _aligned(s_x), _aligned(w_scale_t)
    ksteps = k // BKC
    u = cfg.U if ksteps % cfg.U == 0 else 1
    epi_tma = cfg.EPI_TMA and (out.stride(0) * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0
    a_desc, b_desc, sx_desc, sw_desc, c_desc = descriptors(q, s_x, w, w_scale_t, block, cfg,
                                                           out if epi_tma else None)
    tiles = triton.cdiv(m, BM) * triton.cdiv(n, cfg.BN)
    progs = max(1, min(num_sms(q.device) * cfg.progs_per_sm, tiles))
    _fp8_gemm_sm90_gluon[(progs,)](
        a_desc, b_desc, sx_desc, sw_desc, c_desc, s_x, w_scale_t, out, m, n, k, progs, s_x.stride(0),
        w_scale_t.stride(0), out.stride(0), BN=cfg.BN, NS=cfg.NS, GROUP_M=cfg.GROUP_M, BLK=block, U=u, PIPE=cfg.PIPE,
        ABLATE=cfg.ABLATE, EPI_TMA=epi_tma, PREFETCH=cfg.PREFETCH, num_warps=8, maxnreg=cfg.maxnreg)
    return out
