"""The sm_90 kernel of ``minidi::sparse_attention`` with FlashMLA's split of the work: each consumer warpgroup owns
alternate key blocks for Q K^T and softmax, and one D half of P V (docs/ops/sparse_attention.md, round 19).

One CTA per (query token, block of 64 heads), the partitions of ``sparse_attention_sm90`` (its producer, Q load and
epilogue are shared): a producer gathering BK-key blocks into a ring of NS stages, and two consumer warpgroups.
Key blocks come in pairs (2 BK keys, the unit of the online softmax); consumer h takes block 2 j + h of pair j::

    S_h = Q @ K_h^T                        # [64, BK] fp32 over all of D (its own block only: no partial scores)
    swap the row maxima (64 floats); m = max(m, max_h S_0, max_h S_1)    # the same fp32 max in both consumers
    P_h = bf16(exp(S_h - m)); l_h = l_h alpha + sum P_h (fp32, unrounded)
    P_h -> shared memory                   # [64, BK] bf16, for the other consumer
    acc_h = acc_h alpha + P_h @ V_h[:, half h] + P_other @ V_other[:, half h]    # P_h from registers, P_other from smem

so every MMA is useful, the softmax of a key is computed once (the ``sparse_attention_sm90`` consumers both run it
on every block), and the consumers exchange 64 maxima and a [64, BK] bf16 tile per pair instead of two [64, BK] fp32
partial score tiles per block. With ``PIPE`` each consumer issues the next pair's Q K^T before this pair's softmax, so
the tensor cores run it while the softmax and the exchange run (FA3's overlap; at BK 32 the second score tile is 16
registers). The denominators are summed once at the end (l_0 + l_1, the same fp32 sum in both).

The staggered schedule that replaced this one as the default is ``sparse_attention_sm90_stagger``.

Semantics are the other kernels' rule with a 2 BK-key softmax block: fp32 scores, max over real keys only,
exp(s - running max) rounded to bf16 before PV, fp32 accumulation and denominator, the sink in the denominator only,
0 for a row with no valid key, out-of-range slots empty; both rotations as ``sparse_attention_sm90``.

Legend: T queries, H heads (a multiple of 64), D = 512, BK keys per block (a pair is 2 BK keys), NS stages.
"""

from __future__ import annotations

import torch

from minidi.ops import sparse_attention_sm90 as ws
from minidi.ops._fast_launch import fast_launch

if ws.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from minidi.ops.sparse_attention_sm90 import _add, _max, _producer, _q_half, _store_half

BK = 32  # keys per block: a pair (one block per consumer) is 64 keys, the other kernels' softmax block
NS = 4  # stages: Q 64 KB + 4 x 32 KB keys + 2 x 4 KB P + maxima = 201 KB of the 227 KB; the producer is a pair ahead
PIPE = False  # issue the next pair's Q K^T before this pair's softmax (measured slower: 1.253 vs 1.046 ms, spills)
PW, MAXNREG = ws.PW, ws.MAXNREG
C_REGS = 224  # consumer registers per thread (216 as in sparse_attention_sm90: 1.044 ms, 38 spills; 224: 1.007, 28)
P_REGS = 56  # producer registers: 12 warps at MAXNREG 168 leave (168 * 384 - 224 * 128 - 56 * 128) / 128 = 224 for
# the default partition (consumer 0)
ZQ = True  # index Q by an opaque 0 in the loop: its 32 wgmma descriptors are not hoisted (28 spills without)


if ws.HAVE_GLUON:

    @gluon.jit
    def _pair(sp, code, j, m_i, l_i, acc, scale, k_smem, p_smem, m_mine, m_other, m_ready, p_ready, s, so,
              HID: gl.constexpr, p_l: gl.constexpr):
        """Pair j after its scores: the max exchange, softmax of this consumer's block, P exchange, both P V MMAs
        (issued, not waited: the caller waits). Returns (acc token, m, l)."""
        o_l: gl.constexpr = acc.type.layout
        sc = gl.where((code >= 0)[None, :], sp * scale, float("-inf"))
        mx = gl.reduce(sc, 1, _max)  # [64] this block's row max over real keys
        m_mine.store(mx)
        gl.thread_barrier()
        mbarrier.arrive(m_ready.index(HID), count=1)
        mbarrier.wait(m_ready.index(1 - HID), j & 1)
        mo = m_other.load(mx.type.layout)
        m_new = gl.maximum(m_i, gl.maximum(mx, mo))  # the pair's running max: the same in both consumers
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no real key yet: keep exp finite
        alpha = gl.exp(m_i - m_use)
        e = gl.exp(sc - m_use[:, None])  # [64, BK]
        l_new = l_i * alpha + gl.reduce(e, 1, _add)
        pb = e.to(gl.bfloat16)  # the bf16 probability rounding before PV
        p_smem.index(HID).store(pb)
        fence_async_shared()  # generic-proxy stores that the other consumer's wgmma reads
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(HID), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(gl.convert_layout(pb, p_l), k_smem.index(2 * s + HID), acc, is_async=True)
        mbarrier.wait(p_ready.index(1 - HID), j & 1)
        acc = warpgroup_mma(p_smem.index(1 - HID), k_smem.index(2 * so + HID), acc, is_async=True)
        return acc, m_new, l_new

    @gluon.jit
    def _scores(q_smem, k_smem, k_ready, s_zero, i, NS: gl.constexpr, ZQ: gl.constexpr):
        """Issue S = Q K^T of block i (stage i % NS) over both D halves, once the stage has landed. ``ZQ``: index Q
        by i >> 30 (0) so that its descriptors are not hoisted out of the loop (see ``_qk``)."""
        s = i % NS
        z = i >> 30 if ZQ else 0
        mbarrier.wait(k_ready.index(s), (i // NS) & 1)
        fence_async_shared()  # cp.async wrote the stage (generic proxy); the wgmma reads it (async proxy)
        sp = warpgroup_mma(q_smem.index(z), k_smem.index(2 * s).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        return warpgroup_mma(q_smem.index(1 + z), k_smem.index(2 * s + 1).permute((1, 0)), sp, is_async=True)

    @gluon.jit
    def _release(k_empty, s, so):
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(s), count=1)
        mbarrier.arrive(k_empty.index(so), count=1)

    @gluon.jit
    def _consumer(q_ptr, out_ptr, code_ptr, sink_ptr, cos_ptr, sin_ptr, q_smem, k_smem, p_smem, m_mine, m_other,
                  k_ready, k_empty, q_ready, m_ready, p_ready, t, hb, H, n_keys, n_pairs, scale,
                  HID: gl.constexpr, D: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr,
                  ROPE_Q: gl.constexpr, ROPE_OUT: gl.constexpr, R2: gl.constexpr, PIPE: gl.constexpr,
                  ZQ: gl.constexpr):
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HALF, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)

        # both Q halves in shared memory before either consumer's first Q K^T (q's rotation in consumer 1's load)
        q_smem.index(HID).store(_q_half(q_ptr, cos_ptr, sin_ptr, t, hb, H, HID, D, ROPE_Q, R2))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(q_ready.index(0), count=1)
        mbarrier.wait(q_ready.index(0), 0)

        cols_k = gl.arange(0, BK, layout=gl.SliceLayout(0, s_l))
        code_row = code_ptr + t * n_keys
        m_i = gl.full([M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))  # running max over real keys
        l_i = gl.zeros([M], gl.float32, gl.SliceLayout(1, s_l))  # this consumer's share of the denominator
        acc = gl.zeros([M, HALF], gl.float32, o_l)
        s_zero = gl.zeros([M, BK], gl.float32, s_l)
        if PIPE:
            sp = warpgroup_mma_wait(0, deps=(_scores(q_smem, k_smem, k_ready, s_zero, HID, NS, ZQ),))
            for j in range(n_pairs - 1):
                i = 2 * j + HID
                s = i % NS
                so = (2 * j + 1 - HID) % NS
                code = gl.load(code_row + i * BK + cols_k, mask=i * BK + cols_k < n_keys, other=-1)
                tok_s = _scores(q_smem, k_smem, k_ready, s_zero, i + 2, NS, ZQ)  # the next pair's, on the tensor cores
                tok_o, m_i, l_i = _pair(sp, code, j, m_i, l_i, acc, scale, k_smem, p_smem, m_mine, m_other, m_ready,
                                        p_ready, s, so, HID, p_l)
                sp, acc = warpgroup_mma_wait(0, deps=(tok_s, tok_o))
                _release(k_empty, s, so)
            j = n_pairs - 1
            i = 2 * j + HID
            s = i % NS
            so = (2 * j + 1 - HID) % NS
            code = gl.load(code_row + i * BK + cols_k, mask=i * BK + cols_k < n_keys, other=-1)
            tok_o, m_i, l_i = _pair(sp, code, j, m_i, l_i, acc, scale, k_smem, p_smem, m_mine, m_other, m_ready, p_ready,
                                    s, so, HID, p_l)
            acc = warpgroup_mma_wait(0, deps=(tok_o,))
            _release(k_empty, s, so)
        else:
            for j in range(n_pairs):
                i = 2 * j + HID
                s = i % NS
                so = (2 * j + 1 - HID) % NS
                code = gl.load(code_row + i * BK + cols_k, mask=i * BK + cols_k < n_keys, other=-1)
                sp = warpgroup_mma_wait(0, deps=(_scores(q_smem, k_smem, k_ready, s_zero, i, NS, ZQ),))
                tok_o, m_i, l_i = _pair(sp, code, j, m_i, l_i, acc, scale, k_smem, p_smem, m_mine, m_other, m_ready,
                                        p_ready, s, so, HID, p_l)
                acc = warpgroup_mma_wait(0, deps=(tok_o,))
                _release(k_empty, s, so)

        # the denominator: l_0 + l_1 (the other consumer has read my last maximum: it waited for my last P after)
        m_mine.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(m_ready.index(HID), count=1)
        mbarrier.wait(m_ready.index(1 - HID), n_pairs & 1)
        l_i = l_i + m_other.load(l_i.type.layout)
        _store_half(out_ptr, sink_ptr, cos_ptr, sin_ptr, acc, l_i, m_i, t, hb, H, HID, D, ROPE_OUT, R2)

    @fast_launch
    @gluon.jit
    def _sparse_attention_sm90_split(q_ptr, kv_ptr, code_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, comp_off, H,
                                     n_keys, scale, D: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr,
                                     PW: gl.constexpr, P_REGS: gl.constexpr, C_REGS: gl.constexpr,
                                     ROPE_Q: gl.constexpr, ROPE_OUT: gl.constexpr, R2: gl.constexpr,
                                     PIPE: gl.constexpr, ZQ: gl.constexpr = False):
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        pid = gl.program_id(0)
        n_hb = H // M
        t = (pid // n_hb).to(gl.int64)
        hb = pid % n_hb
        n_pairs = gl.cdiv(n_keys, 2 * BK)  # >= 1 (the launcher's condition); a missing last block is all empty
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        psw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BK, element_bitwidth=16, rank=2)
        ml: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, M, HALF], sw)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NS, BK, HALF], sw)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, M, BK], psw)
        m0_smem = gl.allocate_shared_memory(gl.float32, [M], ml)  # consumer 0's row maxima, then denominators
        m1_smem = gl.allocate_shared_memory(gl.float32, [M], ml)
        k_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        m_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(k_ready.index(s), count=PW * 32)  # one cp.async arrival per producer thread
            mbarrier.init(k_empty.index(s), count=2)  # one per consumer (both read every stage)
        mbarrier.init(q_ready.index(0), count=2)
        for h in gl.static_range(2):
            mbarrier.init(m_ready.index(h), count=1)
            mbarrier.init(p_ready.index(h), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (q_ptr, out_ptr, code_ptr, sink_ptr, cos_ptr, sin_ptr, q_smem, k_smem, p_smem, m0_smem,
                         m1_smem, k_ready, k_empty, q_ready, m_ready, p_ready, t, hb, H, n_keys, n_pairs, scale,
                         0, D, BK, NS, ROPE_Q, ROPE_OUT, R2, PIPE, ZQ)),
            (_consumer, (q_ptr, out_ptr, code_ptr, sink_ptr, cos_ptr, sin_ptr, q_smem, k_smem, p_smem, m1_smem,
                         m0_smem, k_ready, k_empty, q_ready, m_ready, p_ready, t, hb, H, n_keys, n_pairs, scale,
                         1, D, BK, NS, ROPE_Q, ROPE_OUT, R2, PIPE, ZQ)),
            (_producer, (kv_ptr, code_ptr, k_smem, k_ready, k_empty, comp_off, n_keys, 2 * n_pairs, t,
                         D, BK, NS, PW)),
        ], [4, PW], [C_REGS, P_REGS])


def launch_sm90_split(q: torch.Tensor, window_kv: torch.Tensor, code: torch.Tensor, sink: torch.Tensor,
                      out: torch.Tensor, comp_off: int, scale: float, rope_cos: torch.Tensor | None = None,
                      rope_sin: torch.Tensor | None = None, rope_mode: int = 0, info: dict | None = None,
                      pipe: bool = PIPE, c_regs: int = C_REGS, p_regs: int = P_REGS, zq: bool = ZQ) -> None:
    """``sparse_attention_sm90.launch_sm90``'s contract (checked contiguous tensors, ``can_run`` true, W+K >= 1;
    writes every element of out), this kernel's split of the work. ``pipe`` / ``c_regs`` / ``p_regs`` / ``zq``: the
    bench's variants (the overlap, the worker partitions' registers, Q descriptors kept in the loop)."""
    t, h, d = q.shape
    if t == 0:
        return
    r2, rope_cos, rope_sin = ws.launch_rope_args(code, sink, rope_cos, rope_sin, rope_mode, "sm90 split")
    kernel = _sparse_attention_sm90_split[(t * (h // ws.HEADS),)](
        q, window_kv, code, sink, out, rope_cos, rope_sin, comp_off, h, code.shape[1], float(scale),
        D=d, BK=BK, NS=NS, PW=PW, P_REGS=p_regs, C_REGS=c_regs, ROPE_Q=bool(rope_mode & 1),
        ROPE_OUT=bool(rope_mode & 2), R2=r2, PIPE=pipe, ZQ=zq, num_warps=4, maxnreg=MAXNREG)
    if info is not None:
        info.update(impl="gluon_sm90_split", grid=t * (h // ws.HEADS), BK=BK, NS=NS, PW=PW, pipe=pipe, c_regs=c_regs,
                    p_regs=p_regs, zq=zq)
        ws.kernel_info(kernel, info)
