"""The register-operand Hopper kernel of ``minidi::fp4_grouped_mm`` (bf16 activations x FP4 weights): the MMA
warpgroups decode their own weights into the registers of a register-operand wgmma, so the decoded weights never
touch shared memory (the design of Hopper's mixed-input GEMMs).

Why: the decoder-warp kernel (``fp4_grouped_gemm_sm90.py``, round 17) writes the decoded bf16 weights to shared
memory and the wgmma reads them back, about 1.8x the shared-memory bytes per FLOP of the FP8 kernel, and stops near
420 TFLOP/s. Here the tile is computed transposed, acc[BW, BT] = W[BW, K] @ x[BT, K]^T: the weights are the wgmma's
A operand, from registers; the activations its B operand, from shared memory (TMA); only the packed codes (half a
byte per weight) pass through shared memory.

Decode (per 4 packed bytes = 8 e2m1 codes, inline PTX, 19 instructions): the magnitudes index two constant 8-byte
tables of the bf16 bits of the e2m1 grid (``prmt``), the sign bit goes to bit 15, and each bf16 pair is multiplied
by the block's scale 2^(c - 127) as bf16 (``mul.rn.bf16x2``): exact, because an e2m1 value times 2^k is a normal
bf16 number for c in [2, 252] (``CODE_LO``, ``CODE_HI``); c = 255 multiplies by NaN. Other codes go to the Triton
kernel (the op's device-side range gate, as for the decoder-warp kernel).

Layout: the wgmma's A fragment (m64 x k16, bf16) gives the thread with lane 4 g + t rows g and g + 8 of its warp's 16
and the k pairs 2 t, 2 t + 1 of each 8-wide k chunk, i.e. byte t of every 4 packed bytes. So each thread loads its
bytes from shared memory with a linear layout (``packed_layout``) whose decoded, joined and reshaped form is the
dot-operand layout itself: the conversion is checked trivial at compile time (no data movement). The 32-byte
swizzle of the packed tile keeps a warp's 8 rows in distinct banks.

Kernel (persistent; the tile schedule of ``_grouped_tiles.py`` in Gluon, shared with the other Hopper kernels): a tile
is BT activation rows of one expert x BW = 64 WG weight rows. Partitions share a ring of NS stages of BK = 64:
- loader (1 warp): TMA of the activation tile [BT, 64] bf16 (128-byte swizzle) and the packed weights [BW, 32] int8;
- MMA (the default partition, WG warpgroups of 64 weight rows): per stage load the packed bytes and the E8M0 codes
  (prefetched one stage ahead from global memory) and decode them while the previous stage's MMAs run, wait for
  those, release their stage, issue this stage's async wgmma group (4 x k16); the epilogue transposes the tile
  through a layout conversion and stores it with masks.

The register-operand hazard (found on the H200, round 18): ptxas (12.8, and 13.4 as well) treats a wgmma's A
registers as free once the instruction is issued, while the tensor cores read them until the wgmma completes. With
one set of A registers carried around the loop, the next stage's address and decode instructions were allocated over
the in-flight operand: wrong outputs, changing from run to run (128-row tiles; 64-row tiles finished in time). So the
K loop runs two stages a step, each decoded into its own registers, and each stage's words are kept alive (passed to
the wait) until the wait that follows the next decode: no register of an in-flight operand is rewritten, which the
CPU test checks on the compiled SASS (``tests/ops/gluon_compile.inflight_a_writes``). K must be a multiple of 128.

Chunked tiles (round 25, ``RsConfig.chunked``, the default; the kernel is ``fp4_grouped_gemm_sm90_rs_chunked.py``): the
decode costs per tile whatever its rows, and with fixed 128-row tiles the step's ragged loads (cv ~0.15: 257-384 rows
take 3 tiles) decode ~2.5 tiles per 256-row expert. A chunked tile holds up to BT = 256 rows of one expert as ceil(rows
/ 64) chunks of 64 (tiles per expert: cdiv(rows, 256), greedy), so ~1.5 decoded tiles and MMA columns of the rows
rounded up to 64:
- the loader TMAs only the tile's chunks ([64, 64] boxes into the stage's rows; one predicated expect-tx per chunk
  count, as the byte count must be a constant) and walks the schedule with scalar loads (``_walk``): it fits 24
  registers, so setmaxnreg gives the MMA warps 240 (``RsConfig.mma_regs``) and the 128 accumulator registers of a
  256-row tile fit without spills;
- the MMA partition branches once per tile on the chunk count to a K loop specialised to it (N = 64, 128, 128 + 64,
  256: two accumulators at most, every wgmma in straight-line code) and stores each accumulator through its own
  transposing conversion;
- ``ahead``: each stage issues its MMAs and then waits for the previous stage's (wait(1)), so one MMA group stays
  queued while the next stage decodes. With wait(0) before the issue (the fixed kernel), ptxas schedules the
  decode's arithmetic after the wait (SASS), which leaves the tensor cores idle during it. The CPU test walks the
  SASS for writes to the A registers of any group still in flight after a wait(N).

Measured on the H200 (round 18, ``docs/ops/fp4_grouped_gemm.md``): V4.1 EP4 w1/w3 at uniform load 517.6 TFLOP/s
(4 stages; the FP8 kernel 438.1, the Triton bf16 kernel 393.7, torch's grouped GEMM on pre-dequantised weights 663.6
in the same run); in the full V4.1 EP4 step the experts' GEMMs take 162.5 ms against the FP8 kernel's 184.8.
Round 25 (H100, fixed vs chunked tiles in one run): EP4 w1/w3 uniform 491.0 -> 638.7, balanced loads (cv 0.14)
418.3 -> 518.7 (torch's grouped GEMM on pre-dequantised weights 565.1 / 489.4); EP1 uniform 315.8 -> 317.5,
balanced 212.0 -> 264.2.

Legend: R rows (sorted by expert), E experts, N output columns (weight rows), K input columns, BT activation rows
per tile (the wgmma's N; chunked: at most), BW weight rows per tile, WG MMA warpgroups, NS stages, CH = 64 rows a
chunk, NA / NB the activation rows of a chunked tile's two accumulators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fp4_grouped_gemm_hopper as hopper
from ._fast_launch import fast_launch
from ._fp4_rs_decode import _DECODE_ASM, E2M1_BF16, NAN_SCALE, TABLES, packed_layouts
from .fp4_grouped_gemm_hopper import BK, CODE_HI, CODE_LO, CODE_NAN, launch_grid, tma_ready
from .fp8_grouped_gemm_sm90 import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ._fp4_rs_decode import _P2, _P3, _decode, _scales
    from .fp4_grouped_gemm_hopper import _rows, _schedule
    from .fp4_grouped_gemm_sm90_rs_chunked import _fp4_grouped_mm_sm90_rs_chunked

SMEM_BYTES = 232448  # dynamic shared memory of an sm_90 block (227 KB)


@dataclass(frozen=True)
class RsConfig:
    BT: int = 128  # activation rows per tile (the wgmma's N); chunked: at most this many, in chunks of 64
    WG: int = 2  # MMA warpgroups, 64 weight rows each (the layouts are built for 2)
    NS: int = 4  # pipeline stages (BT x 128 + BW x 32 bytes each)
    maxnreg: int = 168  # per-thread register cap: (WG + 1 padded loader warpgroup) x 128 threads share 64K
    loader_regs: int = 88  # the loader's schedule vectors without spills
    overlap: bool = True  # decode a stage while the previous stage's MMAs run (False: one after the other)
    progs_per_sm: int = 1
    chunked: bool = False  # tiles sized to the expert's rows: ceil(rows / 64) chunks of 64, up to BT (round 25)
    # chunked: issue a stage's MMAs before waiting for the previous stage's (wgmma wait(1)), so one MMA group is
    # always queued while the next stage decodes (round 25: in the SASS of both kernels the decode's arithmetic
    # comes after the wait(0) on the previous stage, so the MMAs overlapped only its shared-memory loads)
    ahead: bool = False

    @property
    def BW(self) -> int:
        return 64 * self.WG

    def threads(self) -> int:
        return 128 * (self.WG + 1)

    def smem_bytes(self) -> int:
        """Stages plus the epilogue's transpose of the bf16 tile (an upper bound of its scratch). Chunked: Triton
        converts the transposing epilogue in rounds through a few KB of scratch (the compiled kernels' shared memory
        is the stages + 4,164 bytes, CPU compile, both tilings), so 16 KB bounds it and a fifth 256-row stage fits."""
        scratch = 16384 if self.chunked else self.BT * self.BW * 2 + 1024
        return self.NS * (self.BT * BK * 2 + self.BW * BK // 2) + scratch

    def mma_regs(self) -> int:
        """Registers per MMA thread that setmaxnreg gives the default partition (Gluon's warp_specialize: the
        kernel's maxnreg x threads less the loader warpgroup's, over the MMA threads, down to a multiple of 8)."""
        return (self.maxnreg * self.threads() - 128 * self.loader_regs) // (128 * self.WG) // 8 * 8

    def check(self) -> None:
        """Clear errors for a config the GPU cannot run."""
        tiles = (64, 128, 256) if self.chunked else (64, 128)  # (unchunked 256 rows: one 128-register wgmma N)
        if self.BT not in tiles or self.WG != 2:
            raise ValueError(f"fp4_grouped_mm (sm90 rs): {self.name()}: BT must be one of {tiles} with WG = 2")
        if self.threads() * self.maxnreg > 65536:
            raise ValueError(f"fp4_grouped_mm (sm90 rs): {self.name()}: {self.threads()} threads x maxnreg "
                             f"{self.maxnreg} exceed the 65,536 registers of a multiprocessor")
        if self.chunked and not self.overlap:
            raise ValueError(f"fp4_grouped_mm (sm90 rs): {self.name()}: chunked tiles always overlap the decode")
        if self.ahead and not self.chunked:
            raise ValueError(f"fp4_grouped_mm (sm90 rs): {self.name()}: MMAs ahead is the chunked kernel's")
        if self.smem_bytes() > SMEM_BYTES:
            raise ValueError(f"fp4_grouped_mm (sm90 rs): {self.name()}: {self.smem_bytes()} bytes of shared memory "
                             f"exceed {SMEM_BYTES}")

    def name(self) -> str:
        return f"rs_BT{self.BT}_BW{self.BW}_S{self.NS}_r{self.maxnreg}_l{self.loader_regs}_p{self.progs_per_sm}" + \
            ("_chunked" if self.chunked else "") + ("_ahead" if self.ahead else "") + \
            ("" if self.overlap else "_serial")


EP4_FIXED = RsConfig()  # rounds 18-24: 128 activation rows x 128 weight rows: 2 x m64n128k16 wgmma per k16
EP1_FIXED = RsConfig(BT=64, NS=10)  # 64 rows per expert (EP1) fill one tile
# Round 25: tiles of up to 256 rows sized to the expert's rows (EP4's ragged loads: ~1.5 tiles an expert, not ~2.5),
# one MMA group queued ahead. Registers (ptxas 12.8, CPU compile): the loader's scalar schedule fits setmaxnreg's
# minimum 24, which leaves the MMA warps 240 (``mma_regs``): 0 spills, and ptxas keeps the wgmmas asynchronous (at
# 232 it serialises the 256-row tile's with ``ahead``: C7512, insufficient registers). H100, one run: 1.22-1.30x the
# fixed tiles at EP4 (uniform and balanced loads), 1.00-1.01x at EP1 uniform, 1.25-1.27x EP1 balanced
# (docs/benchmarks/h100_round25). EP1: at most 128 rows (a balanced expert of 65-128 rows in one tile; 256 measured
# no better there).
EP4_CHUNKED = RsConfig(BT=256, NS=4, chunked=True, ahead=True, loader_regs=24)
EP1_CHUNKED = RsConfig(BT=128, NS=8, chunked=True, ahead=True, loader_regs=24)
EP4 = EP4_CHUNKED
EP1 = EP1_CHUNKED


def default_config(rows_per_expert: float) -> RsConfig:
    """Chunked tiles of up to 256 activation rows where experts hold >= 96 rows on average (EP4), else up to 128
    (EP1's 64 rows per expert)."""
    return EP4 if rows_per_expert >= 96 else EP1


if HAVE_GLUON:

    @gluon.jit
    def _rs_loader(x_desc, w_desc, x_bufs, p_bufs, ready, empty, offs_ptr, R, N, E, K, NUM_PROGS,
                   BT: gl.constexpr, BW: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr):
        BKC: gl.constexpr = 64
        pid = gl.program_id(0)
        starts, cum, m_tiles = _schedule(offs_ptr, R, E, BT, E_POW2, 1)
        n_tiles = gl.cdiv(N, BW)
        ksteps = K // BKC
        i = 0
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            e, m0, m_end = _rows(t // n_tiles, starts, cum, BT, E_POW2, 1)
            wrow = e * N + (t % n_tiles) * BW
            for ks in range(ksteps):
                s = i % NS
                mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
                mbarrier.expect(ready.index(s), BT * BKC * 2 + BW * (BKC // 2))
                tma.async_copy_global_to_shared(x_desc, [m0, ks * BKC], ready.index(s), x_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [wrow, ks * (BKC // 2)], ready.index(s), p_bufs.index(s))
                i += 1

    @gluon.jit
    def _stage(x_bufs, p_bufs, ready, empty, ws_ptr, row_off, acc, v_other, s3, i, ks, ksteps, NS: gl.constexpr,
               BW: gl.constexpr, P2: gl.constexpr, P3: gl.constexpr, A_L: gl.constexpr, DECODE_ASM: gl.constexpr,
               LO: gl.constexpr, HI: gl.constexpr, OVERLAP: gl.constexpr):
        """One K stage: decode it (the previous stage's MMAs, whose A words are ``v_other``, still running), wait for
        those and release their stage, issue this one's. Returns (acc, this stage's A words, the next scales, i)."""
        s = i % NS
        s_next = _scales(ws_ptr, row_off, gl.minimum(ks + 1, ksteps - 1) * 2, P3, LO, HI)
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        a, v = _decode(p_bufs.index(s), s3, P2, P3, A_L, BW, DECODE_ASM)
        acc, v_other = warpgroup_mma_wait(0, deps=(acc, v_other))
        if ks > 0:  # (the arrive waits for every warp of the partition: both warpgroups are done)
            mbarrier.arrive(empty.index((i + NS - 1) % NS), count=1)
        acc = warpgroup_mma(a, x_bufs.index(s).permute((1, 0)), acc, is_async=True)
        if not OVERLAP:  # each stage's MMAs finish before the next stage is decoded
            acc, v = warpgroup_mma_wait(0, deps=(acc, v))
            acc = warpgroup_mma_init(acc)
        return acc, v, s_next, i + 1

    @gluon.jit
    def _rs_consumer(x_bufs, p_bufs, ready, empty, ws_ptr, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS, stride_o,
                     BT: gl.constexpr, BW: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr, WG: gl.constexpr,
                     DECODE_ASM: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr, OVERLAP: gl.constexpr):
        BKC: gl.constexpr = 64
        P2: gl.constexpr = _P2
        P3: gl.constexpr = _P3
        NW: gl.constexpr = 4 * WG
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                      instr_shape=[16, BT, 16])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        OUT_L: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BW, BW // 8], [NW, 1], [1, 0])
        LR: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, P3))
        pid = gl.program_id(0)
        starts, cum, m_tiles = _schedule(offs_ptr, R, E, BT, E_POW2, NW)
        n_tiles = gl.cdiv(N, BW)
        ksteps = K // BKC
        kb = K // 32
        i = 0
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            e, m0, m_end = _rows(t // n_tiles, starts, cum, BT, E_POW2, NW)
            n0 = (t % n_tiles) * BW
            # E8M0 code offsets of the tile's weight rows (clamped in bounds; those columns are not stored)
            row_off = (e * N + gl.minimum(n0 + gl.arange(0, BW, layout=LR), N - 1)).to(gl.int64) * kb
            acc = warpgroup_mma_init(gl.zeros([BW, BT], gl.float32, mma))
            s3 = _scales(ws_ptr, row_off, 0, P3, LO, HI)
            v_odd = gl.zeros([BW, 2, 16], gl.int32, P3)
            # two stages per iteration, each decoded into its own registers (v_even, v_odd) while the other's MMAs
            # run: an in-flight A operand stays alive until the wait that follows the next decode, so ptxas cannot
            # allocate anything over it (it treats wgmma's A registers as free once issued: round 18's H200 run
            # read clobbered operands when the loop carried one set of registers)
            for kk in range(ksteps // 2):
                acc, v_even, s3, i = _stage(x_bufs, p_bufs, ready, empty, ws_ptr, row_off, acc, v_odd, s3, i,
                                            2 * kk, ksteps, NS, BW, P2, P3, A_L, DECODE_ASM, LO, HI, OVERLAP)
                acc, v_odd, s3, i = _stage(x_bufs, p_bufs, ready, empty, ws_ptr, row_off, acc, v_even, s3, i,
                                           2 * kk + 1, ksteps, NS, BW, P2, P3, A_L, DECODE_ASM, LO, HI, OVERLAP)
            acc, v_odd = warpgroup_mma_wait(0, deps=(acc, v_odd))
            mbarrier.arrive(empty.index((i + NS - 1) % NS), count=1)
            o = gl.convert_layout(gl.permute(acc.to(out_ptr.dtype.element_ty), (1, 0)), OUT_L)  # [BT, BW]
            rows = m0 + gl.arange(0, BT, layout=gl.SliceLayout(1, OUT_L))
            cols = n0 + gl.arange(0, BW, layout=gl.SliceLayout(0, OUT_L))
            o_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_o + cols[None, :]
            gl.store(o_ptrs, o, mask=(rows < m_end)[:, None] & (cols < N)[None, :])

    @fast_launch
    @gluon.jit
    def _fp4_grouped_mm_sm90_rs(x_desc, w_desc, ws_ptr, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS, stride_o,
                                BT: gl.constexpr, BW: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr,
                                WG: gl.constexpr, DECODE_ASM: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
                                LOADER_REGS: gl.constexpr,
                                OVERLAP: gl.constexpr):
        BKC: gl.constexpr = 64
        x_bufs = gl.allocate_shared_memory(gl.bfloat16, [NS, BT, BKC], x_desc.layout)
        p_bufs = gl.allocate_shared_memory(gl.int8, [NS, BW, BKC // 2], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_rs_consumer, (x_bufs, p_bufs, ready, empty, ws_ptr, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS,
                            stride_o, BT, BW, NS, E_POW2, WG, DECODE_ASM, LO, HI, OVERLAP)),
            (_rs_loader, (x_desc, w_desc, x_bufs, p_bufs, ready, empty, offs_ptr, R, N, E, K, NUM_PROGS,
                          BT, BW, NS, E_POW2)),
        ], [1], [LOADER_REGS])


def can_run(x: torch.Tensor, w_packed: torch.Tensor) -> bool:
    """The Hopper kernels' conditions (bf16 CUDA x on sm_90, Triton 3.6's Gluon, <= 511 experts) and K a multiple of
    128 (the K loop takes two stages a step)."""
    return hopper.can_run(x, w_packed) and x.shape[1] % (2 * BK) == 0


def descriptors(x: torch.Tensor, w_packed: torch.Tensor, cfg: RsConfig):
    """TMA descriptors: activations [R, K] bf16 in [BT, 64] boxes (128-byte swizzle, the wgmma's B layout); packed
    weights as bytes [E * N, K / 2] in [BW, 32] boxes (32-byte swizzle: a warp's 8 rows in distinct banks)."""
    e, n = w_packed.shape[:2]
    k = x.shape[1]
    box = [64 if cfg.chunked else cfg.BT, BK]  # (chunked tiles: one box per 64-row chunk)
    x_layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
    w8 = w_packed.view(torch.int8).reshape(e * n, k // 2)
    return (TensorDescriptor.from_tensor(x, box, x_layout),
            TensorDescriptor.from_tensor(w8, [cfg.BW, BK // 2], w_layout))


def kernel_for(cfg: RsConfig):
    """The Gluon kernel of ``cfg``: chunked tiles sized to the expert's rows, or fixed BT-row tiles."""
    return _fp4_grouped_mm_sm90_rs_chunked if cfg.chunked else _fp4_grouped_mm_sm90_rs


def constexprs(cfg: RsConfig, e: int) -> dict:
    """The kernel's constexpr arguments (plain values: launch hooks serialise them to JSON)."""
    from ._grouped_tiles import e_pow2

    consts = dict(BT=cfg.BT, BW=cfg.BW, NS=cfg.NS, E_POW2=e_pow2(e, False), WG=cfg.WG, DECODE_ASM=_DECODE_ASM,
                  LO=CODE_LO, HI=CODE_HI, LOADER_REGS=cfg.loader_regs, OVERLAP=cfg.overlap)
    return dict(consts, AHEAD=cfg.ahead) if cfg.chunked else consts


def launch_sm90_rs(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
                   out: torch.Tensor, config: RsConfig | None = None) -> None:
    """Checked tensors: x [R, K] bf16, w_packed [E, N, K/2], w_scale [E, N, K/32], offs [E] int32, out [R, N] bf16
    with unit column stride; every E8M0 code in [2, 252] or 255 (the op's gate). Writes the rows below offs[-1]."""
    r, k = x.shape
    e, n = w_packed.shape[:2]
    if r == 0 or n == 0:
        return
    if k % (2 * BK):
        raise ValueError(f"fp4_grouped_mm (sm90 rs): K = {k} must be a multiple of {2 * BK} (two stages a step)")
    x, w_packed, w_scale = tma_ready(x, w_packed, w_scale)
    cfg = config or default_config(r / e)
    cfg.check()
    x_desc, w_desc = descriptors(x, w_packed, cfg)
    progs = launch_grid(x, e, n, cfg.BT, cfg.BW, cfg.progs_per_sm)
    kernel_for(cfg)[(progs,)](
        x_desc, w_desc, w_scale.view(torch.uint8), offs, out, r, n, e, k, progs, out.stride(0),
        **constexprs(cfg, e), num_warps=4 * cfg.WG, maxnreg=cfg.maxnreg)


__all__ = ["CODE_HI", "CODE_LO", "CODE_NAN", "E2M1_BF16", "EP1", "EP1_CHUNKED", "EP1_FIXED", "EP4", "EP4_CHUNKED",
           "EP4_FIXED", "NAN_SCALE", "RsConfig", "TABLES", "can_run", "constexprs", "default_config", "descriptors",
           "kernel_for", "launch_sm90_rs", "packed_layouts"]
