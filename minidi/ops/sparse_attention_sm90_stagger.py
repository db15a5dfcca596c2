"""The sm_90 kernel of ``minidi::sparse_attention`` with FlashMLA's staggered schedule (the op's sm_90 default since
round 24; docs/ops/sparse_attention.md). Partitions and register split as ``sparse_attention_sm90_split``: a producer
warp group gathering key blocks, two consumer warpgroups.

64-key blocks; consumer 0 rounds its block's P at its own running max and issues that P V at once, while consumer 1's
Q K^T runs; consumer 1 takes the pair max, and consumer 0 then rescales and sends consumer 1 its P at the pair max.
Two key stages, each D half with its own ready / free barrier (gathered in the order the consumers free them); one
CTA per SM looping over the (token, head block) items; the producer copies each item's Q as soon as the previous
item's last Q K^T is done (q's rotation then applied in place by consumer 1). See docs/ops/sparse_attention.md.
The output goes through shared memory and bulk tensor stores (``OTMA``, ``_store_half_tma``; rounds 25-26: 0.683
against 0.784 ms at the bench shape on an H100), its last stores draining while the next item starts.

Semantics are ``sparse_attention_sm90_split``'s rule with a 128-key softmax block, except that D half 0 rounds
block 2 j's P at the running max after that block and rescales its fp32 accumulator at the pair max (the online
softmax's rounding point at 64-key granularity); both rotations as ``sparse_attention_sm90``.

Legend: T queries, H heads (a multiple of 64), D = 512, BK keys per block (a pair is 2 BK keys), NS stages.
"""

from __future__ import annotations

import torch

from minidi.ops import sparse_attention_sm90 as ws
from minidi.ops._fast_launch import fast_launch
from minidi.ops._sparse_attention_out_tma import OC, out_layout
from minidi.ops._triton_utils import num_sms
from minidi.ops.sparse_attention_sm90_split import C_REGS, P_REGS

if ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from minidi.ops._sparse_attention_out_tma import _out_drained, _store_half_tma
    from minidi.ops._sparse_attention_q_smem import _ready_q, _rope_q_tail
    from minidi.ops.sparse_attention_sm90 import _add, _arrive, _max, _q_half, _store_half

PW, MAXNREG = ws.PW, ws.MAXNREG
PERSISTENT = True  # one CTA per SM looping over (token, head block) items
QASYNC = True  # the producer copies each item's Q as soon as the previous item's Q K^T are done
BK = 64  # keys per block (a pair is 128 keys)
STAGES = {64: 2, 32: 4}  # stages per block size: Q 64 KB + 2 x 64 KB (+ 2 x 8 KB P) or 4 x 32 KB (+ 2 x 4 KB)
OTMA = True  # the output through shared memory (4 [64, 64] chunks per consumer) and bulk tensor stores (round 26)
# who applies q's rotation to the copied Q (QASYNC): 0 consumer 1, over Q's whole half 1, before either consumer's first
# Q K^T (rounds 24-35); 1 consumer 1, over the 64-column chunks that hold the rotated channels only, consumer 0 waiting
# for it after issuing its first Q K^T over D half 0 (which no rotation touches); 2 consumer 0 itself, over those
# chunks, while its first Q K^T over D half 0 runs, consumer 1 waiting for it. Round 36 (H100, the bench shape, q's
# rotation / both): 0.726 / 0.737 ms with 0, 0.707 / 0.722 with 1, 0.710 / 0.725 with 2
QROPE = 1
# QANG: the consumer that rotates Q pulls the next item's cos / sin rows into L1 an item ahead (prefetch.global.L1),
# where the rotation otherwise loads them behind the wait for the item's Q (round 38). Round 39 (H100, the bench
# shape, QROPE 1, one call): 0.707 against 0.739 ms with both rotations folded (the step's), 0.703 against 0.706 with
# q's only; every output bit-equal
QANG = True


if ws.HAVE_GLUON:

    @gluon.jit
    def _producer_halves(kv_ptr, code_ptr, q_ptr, k_smem, q_smem, k_ready, k_free, q_bar, comp_off, n_keys,
                         n_pairs, n_items, H, D: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr, PW: gl.constexpr,
                         QASYNC: gl.constexpr):
        """The staggered kernel's producer, over this CTA's work items: pair j's blocks 2 j, 2 j + 1 into stages
        (i % NS, i counted over the CTA's items), one D half at a time in the order the consumers free them (block
        2 j half 0, 2 j + 1 half 1, 2 j half 1, 2 j + 1 half 0), each half signalled on its own barrier (index
        2 stage + half); the next item's first pair is gathered while the consumers finish this one. A thread copies
        16 bytes of BK / (4 PW) rows per 128 bytes of a half row, so it holds few row addresses (56 registers).
        QASYNC: the item's Q too (cp.async, once both consumers' last Q K^T of the previous item is done)."""
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0])  # [BK, HALF]
        rows = gl.arange(0, BK, layout=gl.SliceLayout(1, lay))
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        n_hb = H // 64
        for w in range(pid, n_items, n_prog):
            it = (w - pid) // n_prog
            ib = 2 * n_pairs * it  # blocks of this CTA's earlier items
            code_row = code_ptr + (w // n_hb).to(gl.int64) * n_keys
            if QASYNC:
                qrow = ((w // n_hb).to(gl.int64) * H + (w % n_hb) * 64 + gl.arange(0, 64, gl.SliceLayout(1, lay))) * D
                mbarrier.wait(q_bar.index(1), (it & 1) ^ 1)  # q_free: the previous item's Q K^T are all done
                for h in gl.static_range(2):
                    cols = h * (D // 2) + gl.arange(0, D // 2, layout=gl.SliceLayout(0, lay))
                    async_copy.async_copy_global_to_shared(q_smem.index(h), q_ptr + qrow[:, None] + cols[None, :])
                async_copy.mbarrier_arrive(q_bar.index(0), increment_count=False)  # q_ready
            c0n = gl.load(code_row + rows, mask=rows < n_keys, other=-1)  # [BK] slot codes, one pair ahead
            c1n = gl.load(code_row + BK + rows, mask=BK + rows < n_keys, other=-1)
            for j in range(n_pairs):
                c0 = c0n
                c1 = c1n
                r0 = (2 * j + 2) * BK + rows
                c0n = gl.load(code_row + r0, mask=r0 < n_keys, other=-1)
                c1n = gl.load(code_row + r0 + BK, mask=r0 + BK < n_keys, other=-1)
                i = ib + 2 * j
                # in the order the consumers free the halves: (block, half) (0, 0), (1, 1), (0, 1), (1, 0)
                _copy_half(kv_ptr, k_smem, k_ready, k_free, c0, comp_off, i, 0, D, NS, lay)
                _copy_half(kv_ptr, k_smem, k_ready, k_free, c1, comp_off, i + 1, 1, D, NS, lay)
                _copy_half(kv_ptr, k_smem, k_ready, k_free, c0, comp_off, i, 1, D, NS, lay)
                _copy_half(kv_ptr, k_smem, k_ready, k_free, c1, comp_off, i + 1, 0, D, NS, lay)

    @gluon.jit
    def _copy_half(kv_ptr, k_smem, k_ready, k_free, code, comp_off, i, h: gl.constexpr, D: gl.constexpr,
                   NS: gl.constexpr, lay: gl.constexpr):
        """D half h of block i (slot codes ``code``) into its stage once its consumer has freed it; its barrier fires
        when the copies land. Empty slots are zero-filled."""
        HALF: gl.constexpr = D // 2
        cols = h * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, lay))
        # both caches from kv_ptr (comp_kv sits comp_off elements after window_kv); arithmetic, no select
        roff = (code >> 30).to(gl.int64) * comp_off + (code & 0x3FFFFFFF).to(gl.int64) * D
        bar = 2 * (i % NS) + h
        mbarrier.wait(k_free.index(bar), ((i // NS) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(k_smem.index(bar), kv_ptr + roff[:, None] + cols[None, :],
                                               mask=(code >= 0)[:, None])
        async_copy.mbarrier_arrive(k_ready.index(bar), increment_count=False)  # when this thread's copies land

    @gluon.jit
    def _qk_half(q_smem, k_smem, k_ready, i, h: gl.constexpr, acc, USE: gl.constexpr, NS: gl.constexpr):
        """Issue acc (+)= Q[:, half h] K_i[:, half h]^T (block i, stage i % NS) once that half has landed."""
        # i >> 30 is 0 (i < 2^26), but not to the compiler: the Q descriptors (and, with 2 stages, the K ones)
        # stay in the loop instead of being hoisted out of it into 64-bit registers (spilled)
        z = i >> 30
        s = i % NS + z
        mbarrier.wait(k_ready.index(2 * s + h), (i // NS) & 1)
        fence_async_shared()  # cp.async wrote the stage (generic proxy); the wgmma reads it (async proxy)
        return warpgroup_mma(q_smem.index(h + z), k_smem.index(2 * s + h).permute((1, 0)), acc, use_acc=USE,
                             is_async=True)

    @gluon.jit
    def _codes(code_row, i, n_keys, BK: gl.constexpr, s_l: gl.constexpr):
        """Block i's slot codes [BK] (-1 past the list), in the score tile's column layout."""
        c = i * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, s_l))
        return gl.load(code_row + c, mask=c < n_keys, other=-1)

    @gluon.jit
    def _wg0_pair(sp, code, i0, mj, pj, m_i, l_i, acc, scale, k_smem, p_smem, m0_smem, m1_smem, m_ready, p_ready,
                  k_free, NS: gl.constexpr, p_l: gl.constexpr):
        """Consumer 0, the pair of blocks i0 (its own, scores sp) and i0 + 1: softmax at its own running max, P V of
        its block at once (the tensor cores' work while consumer 1's softmax runs), then the pair max from consumer
        1, P at the pair max for consumer 1, the rescale and the other block's P V (issued, not waited). mj / pj:
        the pair's phase counts of the max / P barriers."""
        o_l: gl.constexpr = acc.type.layout
        s0 = i0 % NS
        s1 = (i0 + 1) % NS
        sc = gl.where((code >= 0)[None, :], sp * scale, float("-inf"))
        m0 = gl.maximum(m_i, gl.reduce(sc, 1, _max))  # the running max after block i0
        m0_smem.store(m0)
        _arrive(m_ready.index(0))
        m0u = gl.where(m0 == float("-inf"), 0.0, m0)  # no real key yet: keep exp finite
        a0 = gl.exp(m_i - m0u)
        e0 = gl.exp(sc - m0u[:, None])
        acc = acc * gl.convert_layout(a0, gl.SliceLayout(1, o_l))[:, None]
        tok = warpgroup_mma(gl.convert_layout(e0.to(gl.bfloat16), p_l), k_smem.index(2 * s0), acc, is_async=True)
        mbarrier.wait(m_ready.index(1), mj & 1)
        m1 = m1_smem.load(m0.type.layout)  # the pair's max (consumer 1's), the same in both consumers
        m1u = gl.where(m1 == float("-inf"), 0.0, m1)
        e = gl.exp(sc - m1u[:, None])  # block i0 at the pair max: consumer 1's P and this block's denominator
        l_i = l_i * gl.exp(m_i - m1u) + gl.reduce(e, 1, _add)
        p_smem.index(0).store(e.to(gl.bfloat16))
        fence_async_shared()  # generic-proxy stores that the other consumer's wgmma reads
        _arrive(p_ready.index(0))
        acc = warpgroup_mma_wait(0, deps=(tok,))
        _arrive(k_free.index(2 * s0))  # block i0, half 0: its Q K^T and P V are done
        acc = acc * gl.convert_layout(gl.exp(m0 - m1u), gl.SliceLayout(1, o_l))[:, None]
        mbarrier.wait(p_ready.index(1), pj & 1)
        tok = warpgroup_mma(p_smem.index(1), k_smem.index(2 * s1), acc, is_async=True)
        return tok, m1, l_i

    @gluon.jit
    def _consumer0(q_smem, k_smem, p_smem, m0_smem, m1_smem, k_ready, k_free, m_ready, p_ready, q_bar, code_row,
                   n_keys, n_pairs, ib, mb, pb, scale, acc, m_i, l_i, cos_ptr, sin_ptr, t, it, BK: gl.constexpr,
                   NS: gl.constexpr, s_l: gl.constexpr, p_l: gl.constexpr, QASYNC: gl.constexpr, OTMA: gl.constexpr,
                   D: gl.constexpr, R2: gl.constexpr, ROPE_Q: gl.constexpr, QROPE: gl.constexpr,
                   QNORM: gl.constexpr):
        """Consumer 0's loop over one item's pairs (ib / mb / pb: the CTA's earlier blocks / max phases / P phases;
        it: the CTA's item count); the next pair's Q K^T is issued behind this pair's second P V, its half 0 before
        block 2 j + 1's half 0 is freed. QROPE 1 / 2 (with QASYNC and ROPE_Q): q's rotated channels, which lie in D
        half 1, are waited for / rotated here, after the first Q K^T over D half 0 is issued; QNORM: D half 1, scaled
        (and rotated) by consumer 1, is waited for there too."""
        code = _codes(code_row, 0, n_keys, BK, s_l)
        tok_s = _qk_half(q_smem, k_smem, k_ready, ib, 0, gl.zeros([64, BK], gl.float32, s_l), False, NS)
        if QASYNC and ((ROPE_Q and QROPE == 1) or QNORM):  # consumer 1 scales / rotates D half 1
            mbarrier.wait(q_bar.index(2), it & 1)
            fence_async_shared()
        if QASYNC and ROPE_Q and QROPE == 2 and not QNORM:  # this consumer rotates them behind its Q K^T over half 0
            _rope_q_tail(q_smem.index(1), cos_ptr, sin_ptr, t, D, R2)
            fence_async_shared()  # generic-proxy stores that both consumers' wgmma read
            _arrive(q_bar.index(2))
        sp = warpgroup_mma_wait(0, deps=(_qk_half(q_smem, k_smem, k_ready, ib, 1, tok_s, True, NS),))
        _out_drained(OTMA)  # the previous item's output left this consumer's P buffer (long done by now)
        for j in range(n_pairs - 1):
            i0 = ib + 2 * j
            tok, m_i, l_i = _wg0_pair(sp, code, i0, mb + j, pb + j, m_i, l_i, acc, scale, k_smem, p_smem, m0_smem,
                                      m1_smem, m_ready, p_ready, k_free, NS, p_l)
            code = _codes(code_row, 2 * j + 2, n_keys, BK, s_l)
            tok_s = _qk_half(q_smem, k_smem, k_ready, i0 + 2, 0, gl.zeros([64, BK], gl.float32, s_l), False, NS)
            acc = warpgroup_mma_wait(1, deps=(tok,))  # issued first: done
            _arrive(k_free.index(2 * ((i0 + 1) % NS)))  # block i0 + 1, half 0 (before waiting for the next half)
            tok_s = _qk_half(q_smem, k_smem, k_ready, i0 + 2, 1, tok_s, True, NS)
            sp = warpgroup_mma_wait(0, deps=(tok_s,))
        if QASYNC:  # its last Q K^T of the item is done: q_free
            _arrive(q_bar.index(1))
        i0 = ib + 2 * (n_pairs - 1)
        tok, m_i, l_i = _wg0_pair(sp, code, i0, mb + n_pairs - 1, pb + n_pairs - 1, m_i, l_i, acc, scale, k_smem,
                                  p_smem, m0_smem, m1_smem, m_ready, p_ready, k_free, NS, p_l)
        acc = warpgroup_mma_wait(0, deps=(tok,))
        _arrive(k_free.index(2 * ((i0 + 1) % NS)))
        return acc, m_i, l_i

    @gluon.jit
    def _consumer1(q_smem, k_smem, p_smem, m0_smem, m1_smem, k_ready, k_free, m_ready, p_ready, q_bar, code_row,
                   n_keys, n_pairs, ib, mb, pb, scale, acc, m_i, l_i, it, BK: gl.constexpr, NS: gl.constexpr,
                   s_l: gl.constexpr, p_l: gl.constexpr, QASYNC: gl.constexpr, OTMA: gl.constexpr,
                   QNORM: gl.constexpr):
        """Consumer 1's loop over one item's pairs: its block's Q K^T (D half 1 first), the pair max from consumer
        0's, softmax, its P V, then consumer 0's block's P V. QNORM: the item's first Q K^T over D half 0 waits for
        consumer 0 to have scaled that half (it: the CTA's item count)."""
        o_l: gl.constexpr = acc.type.layout
        for j in range(n_pairs):
            i = ib + 2 * j + 1
            s0 = (i - 1) % NS
            s1 = i % NS
            code = _codes(code_row, 2 * j + 1, n_keys, BK, s_l)
            tok_s = _qk_half(q_smem, k_smem, k_ready, i, 1, gl.zeros([64, BK], gl.float32, s_l), False, NS)
            if QASYNC and QNORM:
                if j == 0:  # consumer 0 scales D half 0
                    mbarrier.wait(q_bar.index(3), it & 1)
                    fence_async_shared()
            sp = warpgroup_mma_wait(0, deps=(_qk_half(q_smem, k_smem, k_ready, i, 0, tok_s, True, NS),))
            sc = gl.where((code >= 0)[None, :], sp * scale, float("-inf"))
            mx = gl.reduce(sc, 1, _max)
            mbarrier.wait(m_ready.index(0), (mb + j) & 1)
            m1 = gl.maximum(m0_smem.load(mx.type.layout), mx)  # the pair max (consumer 0's max covers m_i)
            m1_smem.store(m1)
            _arrive(m_ready.index(1))
            if QASYNC:  # its last Q K^T of the item is done (every warp is past the barrier above): q_free
                mbarrier.arrive(q_bar.index(1), count=1, pred=j == n_pairs - 1)
            m1u = gl.where(m1 == float("-inf"), 0.0, m1)
            alpha = gl.exp(m_i - m1u)
            e = gl.exp(sc - m1u[:, None])
            l_i = l_i * alpha + gl.reduce(e, 1, _add)
            pb16 = e.to(gl.bfloat16)  # the bf16 probability rounding before PV
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            tok = warpgroup_mma(gl.convert_layout(pb16, p_l), k_smem.index(2 * s1 + 1), acc, is_async=True)
            if j == 0:
                _out_drained(OTMA)  # the previous item's output left this consumer's P buffer
            p_smem.index(1).store(pb16)
            fence_async_shared()
            _arrive(p_ready.index(1))
            mbarrier.wait(p_ready.index(0), (pb + j) & 1)
            tok = warpgroup_mma(p_smem.index(0), k_smem.index(2 * s0 + 1), tok, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(tok,))
            gl.thread_barrier()
            mbarrier.arrive(k_free.index(2 * s1 + 1), count=1)  # block i, half 1
            mbarrier.arrive(k_free.index(2 * s0 + 1), count=1)  # block i - 1, half 1
            m_i = m1
        return acc, m_i, l_i

    @gluon.jit
    def _consumer_stagger(q_ptr, out_ptr, o_desc, code_ptr, sink_ptr, cos_ptr, sin_ptr, qs_ptr, q_smem, k_smem, p_smem,
                          m_mine, m_other, m0_smem, m1_smem, k_ready, k_free, q_bar, m_ready, p_ready, H, n_keys,
                          n_pairs, n_items, scale, HID: gl.constexpr, D: gl.constexpr, BK: gl.constexpr,
                          NS: gl.constexpr, ROPE_Q: gl.constexpr, ROPE_OUT: gl.constexpr, R2: gl.constexpr,
                          QASYNC: gl.constexpr, OTMA: gl.constexpr, OC: gl.constexpr, QROPE: gl.constexpr,
                          QNORM: gl.constexpr, QANG: gl.constexpr):
        """Consumer HID over this CTA's work items (item w: token w // (H / 64), head block w % (H / 64): out's
        rows 64 w .. 64 w + 63 of [T H, D])."""
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HALF, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        n_hb = H // M
        # Q's half of each item into shared memory at its start: the other consumer's Q K^T of the previous item is
        # done by then (each consumer waited for the other's last pair max, which follows its last Q K^T)
        for w in range(pid, n_items, n_prog):
            it = (w - pid) // n_prog  # this CTA's item count so far
            t = (w // n_hb).to(gl.int64)
            hb = w % n_hb
            if QASYNC:  # the producer copies Q; each consumer's part in scaling / rotating it (QNORM / QROPE)
                t_next = (gl.minimum(w + n_prog, n_items - 1) // n_hb).to(gl.int64)  # (QANG's prefetch)
                _ready_q(q_smem, q_bar, qs_ptr, cos_ptr, sin_ptr, t, t_next, t * H + hb * M, it, HID, D, R2, ROPE_Q,
                         QROPE, QNORM, QANG)
            else:
                q_smem.index(HID).store(_q_half(q_ptr, cos_ptr, sin_ptr, t, hb, H, HID, D, ROPE_Q, R2))
                fence_async_shared()
                _arrive(q_bar.index(0))
                mbarrier.wait(q_bar.index(0), it & 1)
            code_row = code_ptr + t * n_keys
            if OTMA:  # issued now, used by the epilogue: its latency stays off the item's tail
                sink = gl.load(sink_ptr + hb * M + gl.arange(0, M, layout=gl.SliceLayout(1, s_l)))
            m_i = gl.full([M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
            l_i = gl.zeros([M], gl.float32, gl.SliceLayout(1, s_l))
            acc = gl.zeros([M, HALF], gl.float32, o_l)
            ib = 2 * n_pairs * it
            mb = (n_pairs + 1) * it  # the max barriers also carry the denominators once per item
            pb = n_pairs * it
            if HID == 0:
                acc, m_i, l_i = _consumer0(q_smem, k_smem, p_smem, m0_smem, m1_smem, k_ready, k_free, m_ready,
                                           p_ready, q_bar, code_row, n_keys, n_pairs, ib, mb, pb, scale, acc, m_i,
                                           l_i, cos_ptr, sin_ptr, t, it, BK, NS, s_l, p_l, QASYNC, OTMA, D, R2,
                                           ROPE_Q, QROPE, QNORM)
            else:
                acc, m_i, l_i = _consumer1(q_smem, k_smem, p_smem, m0_smem, m1_smem, k_ready, k_free, m_ready,
                                           p_ready, q_bar, code_row, n_keys, n_pairs, ib, mb, pb, scale, acc, m_i,
                                           l_i, it, BK, NS, s_l, p_l, QASYNC, OTMA, QNORM)
            # the denominator: l_0 + l_1 (each consumer has read the other's last maximum before this point)
            m_mine.store(l_i)
            _arrive(m_ready.index(HID))
            mbarrier.wait(m_ready.index(1 - HID), (mb + n_pairs) & 1)
            l_i = l_i + m_other.load(l_i.type.layout)
            if OTMA:  # both consumers' last P V are done (the denominators were exchanged after them): P's buffers
                # are free for the output
                _store_half_tma(o_desc, p_smem, sink, cos_ptr, sin_ptr, acc, l_i, m_i, t, w * M, HID, D, ROPE_OUT,
                                R2, OC)
            else:
                _store_half(out_ptr, sink_ptr, cos_ptr, sin_ptr, acc, l_i, m_i, t, hb, H, HID, D, ROPE_OUT, R2)
        if OTMA:
            tma.store_wait(0)  # the last stores have read shared memory before the CTA exits

    @fast_launch
    @gluon.jit
    def _sparse_attention_sm90_stagger(q_ptr, kv_ptr, code_ptr, sink_ptr, out_ptr, o_desc, cos_ptr, sin_ptr, qs_ptr,
                                       comp_off,
                                       H, n_keys, n_items, scale, D: gl.constexpr, BK: gl.constexpr,
                                       NS: gl.constexpr, PW: gl.constexpr, P_REGS: gl.constexpr,
                                       C_REGS: gl.constexpr, ROPE_Q: gl.constexpr, ROPE_OUT: gl.constexpr,
                                       R2: gl.constexpr, QASYNC: gl.constexpr,
                                       OTMA: gl.constexpr, OC: gl.constexpr, QROPE: gl.constexpr,
                                       QNORM: gl.constexpr, QANG: gl.constexpr):
        """o_desc: out [T H, D] as a bulk-store descriptor of [64, OC] boxes (OTMA; else any value, unused); qs_ptr:
        q's row scales [T H] fp32 (QNORM, with QASYNC; else any pointer, unused)."""
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        n_pairs = gl.cdiv(n_keys, 2 * BK)
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        psw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * BK, 128), element_bitwidth=16, rank=2)
        ml: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, M, HALF], sw)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NS, BK, HALF], sw)  # [2 stage + half]
        # P of consumer 0 / 1; OTMA: 2 more [64, OC] (= BK) buffers, the four holding the output chunks (16 KB more:
        # 230,808 B of the 232,448)
        gl.static_assert(not OTMA or BK == OC)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [4 if OTMA else 2, M, BK], psw)
        m0_smem = gl.allocate_shared_memory(gl.float32, [M], ml)  # consumer 0's running max after its block
        m1_smem = gl.allocate_shared_memory(gl.float32, [M], ml)  # the pair max (consumer 1)
        l0_smem = gl.allocate_shared_memory(gl.float32, [M], ml)  # the denominators at the end of an item
        l1_smem = gl.allocate_shared_memory(gl.float32, [M], ml)
        k_ready = gl.allocate_shared_memory(gl.int64, [2 * NS, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [2 * NS, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # Q ready, free, half 1 / 0 done
        m_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2 * NS):
            mbarrier.init(k_ready.index(s), count=PW * 32)  # one cp.async arrival per producer thread
            mbarrier.init(k_free.index(s), count=1)  # each half of a stage has one last reader
        if QASYNC:
            mbarrier.init(q_bar.index(0), count=PW * 32)  # the producer's cp.async arrivals
        else:
            mbarrier.init(q_bar.index(0), count=2)  # both consumers stored their half
        mbarrier.init(q_bar.index(1), count=2)  # both consumers' last Q K^T of an item
        mbarrier.init(q_bar.index(2), count=1)  # q's channels rotated (QROPE) / Q's half 1 scaled (QNORM)
        mbarrier.init(q_bar.index(3), count=1)  # Q's half 0 scaled (QNORM)
        for h in gl.static_range(2):
            mbarrier.init(m_ready.index(h), count=1)
            mbarrier.init(p_ready.index(h), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer_stagger, (q_ptr, out_ptr, o_desc, code_ptr, sink_ptr, cos_ptr, sin_ptr, qs_ptr, q_smem, k_smem,
                                 p_smem, l0_smem, l1_smem, m0_smem, m1_smem, k_ready, k_free, q_bar, m_ready, p_ready,
                                 H, n_keys, n_pairs, n_items, scale, 0, D, BK, NS, ROPE_Q, ROPE_OUT, R2, QASYNC, OTMA,
                                 OC, QROPE, QNORM, QANG)),
            (_consumer_stagger, (q_ptr, out_ptr, o_desc, code_ptr, sink_ptr, cos_ptr, sin_ptr, qs_ptr, q_smem, k_smem,
                                 p_smem, l1_smem, l0_smem, m0_smem, m1_smem, k_ready, k_free, q_bar, m_ready, p_ready,
                                 H, n_keys, n_pairs, n_items, scale, 1, D, BK, NS, ROPE_Q, ROPE_OUT, R2, QASYNC, OTMA,
                                 OC, QROPE, QNORM, QANG)),
            (_producer_halves, (kv_ptr, code_ptr, q_ptr, k_smem, q_smem, k_ready, k_free, q_bar, comp_off, n_keys,
                                n_pairs, n_items, H, D, BK, NS, PW, QASYNC)),
        ], [4, PW], [C_REGS, P_REGS])


def launch_sm90_stagger(q: torch.Tensor, window_kv: torch.Tensor, code: torch.Tensor, sink: torch.Tensor,
                        out: torch.Tensor, comp_off: int, scale: float, rope_cos: torch.Tensor | None = None,
                        rope_sin: torch.Tensor | None = None, rope_mode: int = 0, info: dict | None = None,
                        bk: int = BK, c_regs: int = C_REGS, p_regs: int = P_REGS,
                        persistent: bool = PERSISTENT, qasync: bool = QASYNC, otma: bool = OTMA,
                        qrope: int = QROPE, q_scale: torch.Tensor | None = None, angles_ahead: bool = QANG) -> None:
    """``launch_sm90_split``'s contract, the staggered consumers (``_sparse_attention_sm90_stagger``) with ``bk`` keys
    per block (64: 2 stages, 32: 4 stages); ``persistent``: one CTA per SM looping over the (token, head block) items
    (else one CTA per item); ``qasync``: the producer copies each item's Q as soon as the previous item's last Q K^T
    is done (q's rotation then applied in shared memory), instead of the consumers loading it at the item's start;
    ``otma``: the output through shared memory and bulk tensor stores (64-key blocks only: it reuses P's 128-byte
    swizzled buffers; a 16-byte aligned out), instead of 4-byte stores from the accumulators; ``qrope``: who
    rotates the copied Q and when (``QROPE``'s values); ``q_scale``: q's row scales [T, H] fp32, contiguous
    (``sparse_attention.scale_q`` in the Q load; needs ``qasync``: ``scales_q``); ``angles_ahead``: the rotating
    consumer prefetches its next item's cos / sin rows into L1 (``QANG``; with ``qasync``)."""
    if q_scale is not None and not qasync:
        raise ValueError("sparse_attention sm90 stagger: q_scale needs qasync=True (the consumers' own Q load has no "
                         "scale; the op scales q before such a launch)")
    if qrope not in (0, 1, 2):
        raise ValueError(f"sparse_attention sm90 stagger: qrope must be 0, 1 or 2, got {qrope!r}")
    t, h, d = q.shape
    if t == 0:
        return
    r2, rope_cos, rope_sin = ws.launch_rope_args(code, sink, rope_cos, rope_sin, rope_mode, "sm90 stagger")
    ns = STAGES[bk]
    n_items = t * (h // ws.HEADS)
    grid = min(n_items, num_sms(q.device)) if persistent else n_items
    otma = otma and bk == OC and out.data_ptr() % 16 == 0
    # out [T H, D] in [64, OC] boxes, the layout of P's buffers; without otma out itself stands in (never read)
    o_desc = TensorDescriptor(out.view(t * h, d), [t * h, d], [d, 1], [ws.HEADS, OC], out_layout()) if otma else out
    kernel = _sparse_attention_sm90_stagger[(grid,)](
        q, window_kv, code, sink, out, o_desc, rope_cos, rope_sin, sink if q_scale is None else q_scale, comp_off, h,
        code.shape[1], n_items, float(scale), D=d, BK=bk, NS=ns, PW=PW, P_REGS=p_regs, C_REGS=c_regs,
        ROPE_Q=bool(rope_mode & 1), ROPE_OUT=bool(rope_mode & 2), R2=r2, QASYNC=qasync, OTMA=otma, OC=OC, QROPE=qrope,
        QNORM=q_scale is not None, QANG=bool(angles_ahead), num_warps=4, maxnreg=MAXNREG)
    if info is not None:
        info.update(impl="gluon_sm90_stagger", grid=grid, BK=bk, NS=ns, PW=PW, c_regs=c_regs, p_regs=p_regs,
                    persistent=persistent, qasync=qasync, otma=otma, qrope=qrope,
                    q_scale=q_scale is not None, angles_ahead=bool(angles_ahead))
        ws.kernel_info(kernel, info)


def scales_q(impl: str, config: dict) -> bool:
    """Whether the sm_90 kernel ``impl`` with launcher options ``config`` applies q's row scales in its Q load (the
    staggered kernel with its Q copied ahead); the op scales q first for the others."""
    return impl == "gluon_stagger" and config.get("qasync", QASYNC)
