"""The chunked-tile kernel of ``fp4_grouped_gemm_sm90_rs`` (``RsConfig.chunked``, the sm_90 default since round 25):
tiles sized to the expert's rows, up to BT activation rows of one expert in 64-row chunks. The decode, its tables and
the packed-tile layouts are the fixed-tile kernel's (``_fp4_rs_decode``); what and why: ``fp4_grouped_gemm_sm90_rs``'s
docstring, ``docs/ops/fp4_grouped_gemm.md`` (round 25). Configs, descriptors and the launch:
``fp4_grouped_gemm_sm90_rs``.

Legend: as ``fp4_grouped_gemm_sm90_rs``; CH = 64 rows a chunk, NA / NB the activation rows of a tile's two
accumulators.
"""

from __future__ import annotations

from ._fast_launch import fast_launch
from .fp8_grouped_gemm_sm90 import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

    from .fp4_grouped_gemm_hopper import _clamped_end, _m_tile_count, _walk
    from ._fp4_rs_decode import _P2, _P3, _decode_words, _operand, _scales

    # Why: the decode costs per tile, whatever the tile's rows. With fixed 128-row tiles an expert of 257 rows takes 3
    # tiles (the third nearly empty): the step's ragged loads (cv ~0.15) cost ~2.5 decoded tiles per 256-row expert
    # where 2 would do. A chunked tile holds ceil(rows / 64) chunks (greedy: full BT tiles, then the remainder), the
    # loader fetches only those chunks, and the MMA partition runs a K loop specialised to the chunk count (one branch
    # per count, so every wgmma sits in straight-line code: accumulators of N = 64, 128, 128 + 64, 256 columns).

    @gluon.jit
    def _chunks(m0, m_end, BT: gl.constexpr):
        """64-row chunks of the tile at row m0 of an expert ending at m_end (1 .. BT / 64)."""
        return (gl.minimum(m_end - m0, BT) + 63) // 64

    @gluon.jit
    def _rs_loader_chunked(x_desc, w_desc, x_bufs, p_bufs, ready, empty, offs_ptr, R, N, E, K, NUM_PROGS,
                           BT: gl.constexpr, BW: gl.constexpr, NS: gl.constexpr):
        """TMA of the tile's chunks only ([64, 64] boxes at their rows of the stage) and its packed weights; the
        expected bytes are the chunk count's (one predicated expect per count: it takes a constant). The schedule is
        walked with scalars (``_walk``): the loader's registers go to the MMA partition."""
        BKC: gl.constexpr = 64
        CH: gl.constexpr = 64
        NCH: gl.constexpr = BT // CH
        pid = gl.program_id(0)
        m_tiles = _m_tile_count(offs_ptr, R, E, BT, 1)
        n_tiles = gl.cdiv(N, BW)
        ksteps = K // BKC
        e = 0
        first = 0
        lo = 0
        hi = _clamped_end(offs_ptr, 0, R)
        i = 0
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            e, m0, m_end, first, lo, hi = _walk(t // n_tiles, e, first, lo, hi, offs_ptr, R, E, BT)
            chunks = _chunks(m0, m_end, BT)
            wrow = e * N + (t % n_tiles) * BW
            for ks in range(ksteps):
                s = i % NS
                bar = ready.index(s)
                mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
                for c in gl.static_range(NCH):
                    mbarrier.expect(bar, (c + 1) * CH * BKC * 2 + BW * (BKC // 2), pred=chunks == c + 1)
                for c in gl.static_range(NCH):
                    tma.async_copy_global_to_shared(x_desc, [m0 + c * CH, ks * BKC], bar,
                                                    x_bufs.index(s).slice(c * CH, CH), pred=c < chunks)
                tma.async_copy_global_to_shared(w_desc, [wrow, ks * (BKC // 2)], bar, p_bufs.index(s))
                i += 1

    @gluon.jit
    def _issue(a, x_s, acc_a, acc_b, NA: gl.constexpr, NB: gl.constexpr, NW: gl.constexpr):
        """One stage's async wgmmas: rows [0, NA) of the activation stage ``x_s`` into acc_a, [NA, NA + NB) into
        acc_b (none when NB = 0), both from the same A registers."""
        acc_a = warpgroup_mma(a, x_s.slice(0, NA).permute((1, 0)), acc_a, is_async=True)
        if NB > 0:
            MMA_B: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                            instr_shape=[16, NB, 16])
            A_B: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_B, k_width=2)
            acc_b = warpgroup_mma(gl.convert_layout(a, A_B, assert_trivial=True),
                                  x_s.slice(NA, NB).permute((1, 0)), acc_b, is_async=True)
        return acc_a, acc_b

    @gluon.jit
    def _stage_chunked(x_bufs, p_bufs, ready, empty, ws_ptr, row_off, acc_a, acc_b, v_other, s3, i, ks, ksteps,
                       NS: gl.constexpr, BW: gl.constexpr, NA: gl.constexpr, NB: gl.constexpr, NW: gl.constexpr,
                       DECODE_ASM: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr, AHEAD: gl.constexpr):
        """``_stage`` with the tile's activation rows split over two accumulators: acc_a (chunks [0, NA)) and acc_b
        (rows [NA, NA + NB); none when NB = 0, acc_b then passes through untouched). Both wgmmas read the same A
        registers and form one in-flight group."""
        P2: gl.constexpr = _P2
        P3: gl.constexpr = _P3
        MMA_A: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, NA, 16])
        A_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_A, k_width=2)
        s = i % NS
        s_next = _scales(ws_ptr, row_off, gl.minimum(ks + 1, ksteps - 1) * 2, P3, LO, HI)
        mbarrier.wait(ready.index(s), (i // NS) & 1)
        v = _decode_words(p_bufs.index(s), s3, P2, P3, BW, DECODE_ASM)
        a = _operand(v, A_A, BW)
        x_s = x_bufs.index(s)
        if AHEAD:  # issue this stage's MMAs, then wait for the previous stage's: one group always queued
            acc_a, acc_b = _issue(a, x_s, acc_a, acc_b, NA, NB, NW)
            # (the accumulators stay pending: this stage's group still writes them)
            if NB > 0:  # (two commit groups a stage: acc_a's, acc_b's)
                acc_a, acc_b, v_other, v = warpgroup_mma_wait(2, deps=(acc_a, acc_b, v_other, v))
                acc_b = warpgroup_mma_init(acc_b)
            else:
                acc_a, v_other, v = warpgroup_mma_wait(1, deps=(acc_a, v_other, v))
            acc_a = warpgroup_mma_init(acc_a)
            if ks > 0:  # (the arrive waits for every warp of the partition: both warpgroups are done)
                mbarrier.arrive(empty.index((i + NS - 1) % NS), count=1)
        else:  # wait for the previous stage's MMAs, release its stage, issue this one's
            if NB > 0:
                acc_a, acc_b, v_other = warpgroup_mma_wait(0, deps=(acc_a, acc_b, v_other))
            else:
                acc_a, v_other = warpgroup_mma_wait(0, deps=(acc_a, v_other))
            if ks > 0:
                mbarrier.arrive(empty.index((i + NS - 1) % NS), count=1)
            acc_a, acc_b = _issue(a, x_s, acc_a, acc_b, NA, NB, NW)
        return acc_a, acc_b, v, s_next, i + 1

    @gluon.jit
    def _store_rows(acc, out_ptr, m0, m_end, n0, N, stride_o, NT: gl.constexpr, BW: gl.constexpr,
                    NW: gl.constexpr):
        """acc [BW, NT] (weight rows x activation rows m0 ..) -> out[m0 .., n0 ..] through a transposing layout
        conversion; rows from m_end and columns from N masked."""
        OUT_L: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BW, BW // 8], [NW, 1], [1, 0])
        o = gl.convert_layout(gl.permute(acc.to(out_ptr.dtype.element_ty), (1, 0)), OUT_L)  # [NT, BW]
        rows = m0 + gl.arange(0, NT, layout=gl.SliceLayout(1, OUT_L))
        cols = n0 + gl.arange(0, BW, layout=gl.SliceLayout(0, OUT_L))
        o_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_o + cols[None, :]
        gl.store(o_ptrs, o, mask=(rows < m_end)[:, None] & (cols < N)[None, :])

    @gluon.jit
    def _tile_chunked(x_bufs, p_bufs, ready, empty, ws_ptr, out_ptr, row_off, m0, m_end, n0, N, ksteps, stride_o, i,
                      NS: gl.constexpr, BW: gl.constexpr, NA: gl.constexpr, NB: gl.constexpr, NW: gl.constexpr,
                      DECODE_ASM: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr, AHEAD: gl.constexpr):
        """One tile of NA + NB activation rows: the K loop (two stages a step, as ``_rs_consumer``) and the
        epilogue. Returns the stage counter."""
        P3: gl.constexpr = _P3
        MMA_A: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, NA, 16])
        acc_a = warpgroup_mma_init(gl.zeros([BW, NA], gl.float32, MMA_A))
        if NB > 0:
            MMA_B: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                            instr_shape=[16, NB, 16])
            acc_b = warpgroup_mma_init(gl.zeros([BW, NB], gl.float32, MMA_B))
        else:  # (a placeholder carried untouched through the loop: folded away)
            acc_b = acc_a
        s3 = _scales(ws_ptr, row_off, 0, P3, LO, HI)
        v_odd = gl.zeros([BW, 2, 16], gl.int32, P3)
        for kk in range(ksteps // 2):  # (each stage's A words kept alive until the wait after the next decode)
            acc_a, acc_b, v_even, s3, i = _stage_chunked(x_bufs, p_bufs, ready, empty, ws_ptr, row_off, acc_a, acc_b,
                                                         v_odd, s3, i, 2 * kk, ksteps, NS, BW, NA, NB, NW,
                                                         DECODE_ASM, LO, HI, AHEAD)
            acc_a, acc_b, v_odd, s3, i = _stage_chunked(x_bufs, p_bufs, ready, empty, ws_ptr, row_off, acc_a, acc_b,
                                                        v_even, s3, i, 2 * kk + 1, ksteps, NS, BW, NA, NB, NW,
                                                        DECODE_ASM, LO, HI, AHEAD)
        if NB > 0:
            acc_a, acc_b, v_odd = warpgroup_mma_wait(0, deps=(acc_a, acc_b, v_odd))
        else:
            acc_a, v_odd = warpgroup_mma_wait(0, deps=(acc_a, v_odd))
        mbarrier.arrive(empty.index((i + NS - 1) % NS), count=1)
        _store_rows(acc_a, out_ptr, m0, m_end, n0, N, stride_o, NA, BW, NW)
        if NB > 0:
            _store_rows(acc_b, out_ptr, m0 + NA, m_end, n0, N, stride_o, NB, BW, NW)
        return i

    @gluon.jit
    def _rs_consumer_chunked(x_bufs, p_bufs, ready, empty, ws_ptr, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS,
                             stride_o, BT: gl.constexpr, BW: gl.constexpr, NS: gl.constexpr, WG: gl.constexpr,
                             DECODE_ASM: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr, AHEAD: gl.constexpr):
        """The MMA partition: per tile, the K loop specialised to its chunk count (1: N 64; 2: 128; 3: 128 + 64;
        4: 256), so no wgmma sits under a run-time branch."""
        NW: gl.constexpr = 4 * WG
        LR: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _P3))
        pid = gl.program_id(0)
        m_tiles = _m_tile_count(offs_ptr, R, E, BT, NW)
        n_tiles = gl.cdiv(N, BW)
        ksteps = K // 64
        kb = K // 32
        e = 0
        first = 0
        lo = 0
        hi = _clamped_end(offs_ptr, 0, R)
        i = 0
        for t in range(pid, m_tiles * n_tiles, NUM_PROGS):
            e, m0, m_end, first, lo, hi = _walk(t // n_tiles, e, first, lo, hi, offs_ptr, R, E, BT)
            chunks = _chunks(m0, m_end, BT)
            n0 = (t % n_tiles) * BW
            # the expert's E8M0 codes and the offsets of the tile's weight rows there (clamped in bounds; those
            # columns are not stored; int32: two registers fewer than int64 offsets from ws_ptr)
            ws_e = ws_ptr + (e * N).to(gl.int64) * kb
            row_off = gl.minimum(n0 + gl.arange(0, BW, layout=LR), N - 1) * kb
            if chunks == 1:
                i = _tile_chunked(x_bufs, p_bufs, ready, empty, ws_e, out_ptr, row_off, m0, m_end, n0, N, ksteps,
                                  stride_o, i, NS, BW, 64, 0, NW, DECODE_ASM, LO, HI, AHEAD)
            if BT >= 128:
                if chunks == 2:
                    i = _tile_chunked(x_bufs, p_bufs, ready, empty, ws_e, out_ptr, row_off, m0, m_end, n0, N,
                                      ksteps, stride_o, i, NS, BW, 128, 0, NW, DECODE_ASM, LO, HI, AHEAD)
            if BT >= 256:
                if chunks == 3:
                    i = _tile_chunked(x_bufs, p_bufs, ready, empty, ws_e, out_ptr, row_off, m0, m_end, n0, N,
                                      ksteps, stride_o, i, NS, BW, 128, 64, NW, DECODE_ASM, LO, HI, AHEAD)
                if chunks == 4:
                    i = _tile_chunked(x_bufs, p_bufs, ready, empty, ws_e, out_ptr, row_off, m0, m_end, n0, N,
                                      ksteps, stride_o, i, NS, BW, 256, 0, NW, DECODE_ASM, LO, HI, AHEAD)

    @fast_launch
    @gluon.jit
    def _fp4_grouped_mm_sm90_rs_chunked(x_desc, w_desc, ws_ptr, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS, stride_o,
                                        BT: gl.constexpr, BW: gl.constexpr, NS: gl.constexpr, E_POW2: gl.constexpr,
                                        WG: gl.constexpr, DECODE_ASM: gl.constexpr, LO: gl.constexpr,
                                        HI: gl.constexpr, LOADER_REGS: gl.constexpr, OVERLAP: gl.constexpr,
                                        AHEAD: gl.constexpr):
        """The kernel of chunked tiles (``RsConfig.chunked``; OVERLAP must be True, E_POW2 is not used: the same
        constexprs as the fixed kernel's): stages of BT activation rows (the tile's chunks filled) and BW packed weight
        rows."""
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
            (_rs_consumer_chunked, (x_bufs, p_bufs, ready, empty, ws_ptr, offs_ptr, out_ptr, R, N, E, K, NUM_PROGS,
                                    stride_o, BT, BW, NS, WG, DECODE_ASM, LO, HI, AHEAD)),
            (_rs_loader_chunked, (x_desc, w_desc, x_bufs, p_bufs, ready, empty, offs_ptr, R, N, E, K, NUM_PROGS,
                                  BT, BW, NS)),
        ], [1], [LOADER_REGS])
