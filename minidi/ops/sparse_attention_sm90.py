"""The Hopper (sm_90) kernel of ``minidi::sparse_attention``: a warp-specialised Gluon kernel (FlashMLA's design family)
that computes Q K^T once per key block instead of the Triton kernel's 1.5x (docs/ops/sparse_attention.md).

One CTA per (query token, block of 64 heads), three partitions sharing shared memory:

- producer (PW warps): slot codes -> key rows gathered with 16-byte ``cp.async`` into a ring of NS stages of
  [BK keys, D] (as two [BK, D/2] halves), each stage signalled by ``cp.async.mbarrier.arrive.noinc`` (no waiting in
  the producer: it runs NS stages ahead of the consumers); empty and out-of-range slots are zero-filled, never read.
- two consumer warpgroups; consumer h owns the D half h (columns [h D/2, (h+1) D/2)) of Q, of every key row and of the
  output. Per key block::

      S_h = Q[:, half h] @ K[:, half h]^T          # [64, BK] fp32 partial scores, m64nBKk16 wgmma, Q from smem
      swap S_h through shared memory; S = S_0 + S_1 # the same fp32 sum in both (a + b == b + a)
      online softmax on S (both consumers, identical m, l, P)
      acc_h = acc_h * alpha + bf16(P) @ K[:, half h] # [64, D/2] m64n256k16 wgmma, P from registers

  so every MMA is useful (1.0x), the [64, 512] fp32 accumulator is split over the two warpgroups, and a key row is
  gathered once per token. The only exchange between the consumers is the [64, BK] fp32 partial score tile.

Semantics are the Triton kernel's (``sparse_attention.py``): fp32 scores (two fp32 partial sums over D halves added,
instead of one sequential sum), max over real keys only, exp(s - running max) rounded to bf16 before PV, fp32
accumulation, division by the fp32 denominator + exp(sink - max); a row with no valid key gives 0. ``ROPE_Q`` rotates
q's trailing 2 R2 channels as consumer 1 loads its half (each product a ``mul.rn.f32``, rounded to bf16, as
``rope_ref``); ``ROPE_OUT`` rotates the output's back in consumer 1's store (2 R2 <= D / 2 so both live in half 1).

Legend: T queries, H heads (a multiple of 64), D = 512 head dim, BK keys per block, NS pipeline stages, PW producer
warps, HALF = D / 2 columns per consumer.
"""

from __future__ import annotations

import torch
import triton

from minidi.ops._fast_launch import fast_launch

try:  # Gluon's Hopper API as Triton 3.6 has it; absent or renamed elsewhere: the Triton kernel is used instead
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    HAVE_GLUON = True
except Exception:  # noqa: BLE001 - any import failure means "no Gluon path"
    HAVE_GLUON = False

TESTED_TRITON = ((3, 6),)  # Gluon's API moves between releases: the kernel runs only on versions it was tested on
HEADS = 64  # heads per CTA (the M of every wgmma)
D_SM90 = 512  # the head dim the kernel is written for
BK = 64  # keys per block
NS = 2  # key stages: Q 64 KB + 2 x 64 KB keys + 32 KB score exchange = 224 KB of the 227 KB
PW = 4  # producer warps (a worker partition is padded to a warpgroup anyway)
P_REGS = 72  # producer registers per thread
C_REGS = 216  # consumer registers per thread (the worker consumer; the default partition gets the rest)
PIPE = False  # overlap block i+1's Q K^T with block i's softmax (measured slower: spills, docs)
XPAD = True  # pad the score-exchange rows (bank conflicts)
MAXNREG = 168  # per-thread register cap at entry (12 warps: 65536 / 384 = 170.7); the default partition
# (consumer 0) gets the rest: (168 * 384 - 216 * 128 - 72 * 128) / 128 = 216


def _triton_version() -> tuple[int, int]:
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return major, minor


def gluon_supported() -> bool:
    """The Gluon API this file is written against is importable and its Triton version was tested."""
    return HAVE_GLUON and _triton_version() in TESTED_TRITON


def can_run(q: torch.Tensor, window_kv: torch.Tensor, comp_off: int, rope_r2: int) -> bool:
    """bf16 CUDA tensors on an sm_90 device with a tested Gluon; D 512; H a multiple of 64; 16-byte aligned key rows
    (both caches addressed from window_kv); the rotated channels (2 r2, if any) within the second D half."""
    if not (q.is_cuda and q.dtype == torch.bfloat16 and gluon_supported()):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    t, h, d = q.shape
    # comp_off % 16: Triton then specialises it as divisible by 16, so the gathered rows' 16-byte copies are proven
    return (d == D_SM90 and h % HEADS == 0 and window_kv.data_ptr() % 16 == 0 and comp_off % 16 == 0
            and 2 * rope_r2 <= d // 2)


if HAVE_GLUON:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _max(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _mul_rn(a, b):
        """a * b rounded on its own (``mul.rn.f32``: never contracted into an FMA), as eager's rotation rounds it."""
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _arrive(bar):
        """Arrive once on ``bar`` for the calling warpgroup, after all of its warps are past what it releases."""
        gl.thread_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _q_half(q_ptr, cos_ptr, sin_ptr, t, hb, H, HID: gl.constexpr, D: gl.constexpr, ROPE_Q: gl.constexpr,
                R2: gl.constexpr):
        """Columns [HID D/2, (HID+1) D/2) of the block's 64 query rows ([64, D/2] bf16), q's rotation applied to
        the trailing 2 R2 channels (half 1) as ``rope_ref`` rounds it."""
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [64, HALF]
        rows = gl.arange(0, M, layout=gl.SliceLayout(1, ld_l))
        cols = HID * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_l))
        q_rows = (t * H + hb * M + rows).to(gl.int64) * D  # [64]
        x = gl.load(q_ptr + q_rows[:, None] + cols[None, :])  # [64, HALF] bf16
        if ROPE_Q:
            if HID == 1:
                rot = cols >= D - 2 * R2
                pair = gl.where(rot, (cols - (D - 2 * R2)) // 2, 0)
                c = gl.load(cos_ptr + t * R2 + pair, mask=rot, other=1.0)
                sn = gl.load(sin_ptr + t * R2 + pair, mask=rot, other=0.0)
                sn = gl.where(cols % 2 == 0, -sn, sn)  # even: x0 c - x1 s; odd: x1 c + x0 s
                xp = gl.load(q_ptr + q_rows[:, None] + (cols ^ 1)[None, :], mask=rot[None, :], other=0.0)
                y = _mul_rn(x.to(gl.float32), c[None, :]) + _mul_rn(xp.to(gl.float32), sn[None, :])
                x = gl.where(rot[None, :], y.to(gl.bfloat16), x)
        return x

    @gluon.jit
    def _out_half(acc, l_i, m_i, sink, cos_ptr, sin_ptr, t, HID: gl.constexpr, D: gl.constexpr,
                  ROPE_OUT: gl.constexpr, R2: gl.constexpr):
        """The output values of the consumer owning D half HID, fp32 in acc's layout: acc [64, D/2] / (l + exp(sink -
        m)); half 1 with ROPE_OUT: rounded to bf16 (the model's rounding point), its rope pairs rotated back."""
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        o_l: gl.constexpr = acc.type.layout
        denom = l_i + gl.exp(sink - m_i)  # no real key: exp(+inf), out = 0
        out = acc / gl.convert_layout(denom, gl.SliceLayout(1, o_l))[:, None]
        if ROPE_OUT:
            if HID == 1:
                o = out.to(gl.bfloat16).to(gl.float32)  # the model's rounding point, then the rotation
                x0, x1 = gl.split(gl.reshape(o, [M, HALF // 2, 2]))  # [64, HALF/2] each: even / odd channels
                d0 = HID * HALF + 2 * gl.arange(0, HALF // 2, layout=gl.SliceLayout(0, x0.type.layout))
                rot = d0 >= D - 2 * R2
                pair = gl.where(rot, (d0 - (D - 2 * R2)) // 2, 0)
                c = gl.load(cos_ptr + t * R2 + pair, mask=rot, other=1.0)[None, :]
                sn = -gl.load(sin_ptr + t * R2 + pair, mask=rot, other=0.0)[None, :]  # inverse rotation
                y0 = gl.where(rot[None, :], _mul_rn(x0, c) - _mul_rn(x1, sn), x0)
                y1 = gl.where(rot[None, :], _mul_rn(x0, sn) + _mul_rn(x1, c), x1)
                out = gl.convert_layout(gl.reshape(gl.join(y0, y1), [M, HALF]), o_l)
        return out

    @gluon.jit
    def _store_half(out_ptr, sink_ptr, cos_ptr, sin_ptr, acc, l_i, m_i, t, hb, H, HID: gl.constexpr,
                    D: gl.constexpr, ROPE_OUT: gl.constexpr, R2: gl.constexpr):
        """The epilogue of the consumer owning D half HID: ``_out_half``'s values stored as bf16 from the
        accumulator's layout."""
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        o_l: gl.constexpr = acc.type.layout
        offs_h = hb * M + gl.arange(0, M, layout=m_i.type.layout)
        sink = gl.load(sink_ptr + offs_h)
        out = _out_half(acc, l_i, m_i, sink, cos_ptr, sin_ptr, t, HID, D, ROPE_OUT, R2)
        o_rows = (t * H + hb * M + gl.arange(0, M, layout=gl.SliceLayout(1, o_l))).to(gl.int64) * D
        o_cols = HID * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
        gl.store(out_ptr + o_rows[:, None] + o_cols[None, :], out.to(gl.bfloat16))

    @gluon.jit
    def _producer(kv_ptr, code_ptr, k_smem, k_ready, k_empty, comp_off, n_keys, n_blocks, t,
                  D: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr, PW: gl.constexpr):
        """Blocks 0 .. n_blocks - 1 of the slot list (slots >= n_keys are empty) into the ring of NS stages."""
        HALF: gl.constexpr = D // 2
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PW, 1], [1, 0])  # [BK, HALF]: 16 B per copy
        rows = gl.arange(0, BK, layout=gl.SliceLayout(1, lay))
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, lay))
        code_row = code_ptr + t * n_keys
        code_next = gl.load(code_row + rows, mask=rows < n_keys, other=-1)  # [BK] slot codes, one block ahead
        for i in range(n_blocks):
            s = i % NS
            code = code_next
            j = (i + 1) * BK + rows
            code_next = gl.load(code_row + j, mask=j < n_keys, other=-1)
            valid = code >= 0
            # both caches from kv_ptr (comp_kv sits comp_off elements after window_kv); arithmetic, no select
            roff = (code >> 30).to(gl.int64) * comp_off + (code & 0x3FFFFFFF).to(gl.int64) * D
            ptrs = kv_ptr + roff[:, None] + cols[None, :]  # [BK, HALF]
            mbarrier.wait(k_empty.index(s), ((i // NS) & 1) ^ 1)  # both consumers are done with the stage
            for h in gl.static_range(2):
                async_copy.async_copy_global_to_shared(k_smem.index(2 * s + h), ptrs + h * HALF, mask=valid[:, None])
            async_copy.mbarrier_arrive(k_ready.index(s), increment_count=False)  # when this thread's copies land

    @gluon.jit
    def _scores_softmax(sp, code, i, m_i, l_i, scale, x_my, x_other, s_ready, x_free, HID: gl.constexpr,
                        o_l: gl.constexpr, p_l: gl.constexpr):
        """Block i: swap the partial scores sp [64, BK] with the other consumer, S = S_0 + S_1 (the same fp32 sum
        in both), online softmax -> (bf16 P as the PV A operand, alpha for the accumulator rows, m, l)."""
        s_l: gl.constexpr = sp.type.layout
        mbarrier.wait(x_free.index(HID), (i & 1) ^ 1)  # the other consumer has read my previous partial
        x_my.store(sp)
        gl.thread_barrier()
        mbarrier.arrive(s_ready.index(HID), count=1)
        mbarrier.wait(s_ready.index(1 - HID), i & 1)
        so = x_other.load(s_l)
        gl.thread_barrier()
        mbarrier.arrive(x_free.index(1 - HID), count=1)
        sc = sp + so
        sc = gl.where((code >= 0)[None, :], sc * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.reduce(sc, 1, _max))  # [64] running max over real keys
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no real key yet: keep exp finite
        alpha = gl.exp(m_i - m_use)
        e = gl.exp(sc - m_use[:, None])  # [64, BK]
        l_new = l_i * alpha + gl.reduce(e, 1, _add)
        p = gl.convert_layout(e.to(gl.bfloat16), p_l)  # the bf16 probability rounding before PV
        return p, gl.convert_layout(alpha, gl.SliceLayout(1, o_l)), m_new, l_new

    @gluon.jit
    def _consumer(q_ptr, out_ptr, code_ptr, sink_ptr, cos_ptr, sin_ptr, q_smem, k_smem, x_smem,
                  k_ready, k_empty, s_ready, x_free, t, hb, H, n_keys, scale,
                  HID: gl.constexpr, D: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr,
                  ROPE_Q: gl.constexpr, ROPE_OUT: gl.constexpr, R2: gl.constexpr, PIPE: gl.constexpr):
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HALF, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)

        # ---- Q half -> shared memory (q's rotation in consumer 1's load) ----
        q_my = q_smem.index(HID)
        q_my.store(_q_half(q_ptr, cos_ptr, sin_ptr, t, hb, H, HID, D, ROPE_Q, R2))
        fence_async_shared()
        gl.thread_barrier()

        x_my = x_smem.index(HID)
        x_other = x_smem.index(1 - HID)
        cols_k = gl.arange(0, BK, layout=gl.SliceLayout(0, s_l))
        code_row = code_ptr + t * n_keys
        m_i = gl.full([M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))  # running max over real keys
        l_i = gl.zeros([M], gl.float32, gl.SliceLayout(1, s_l))  # running denominator (unrounded exp)
        acc = gl.zeros([M, HALF], gl.float32, o_l)
        s_zero = gl.zeros([M, BK], gl.float32, s_l)
        n_blocks = gl.cdiv(n_keys, BK)  # >= 1 (the launcher's condition)
        if PIPE:  # block i + 1's Q K^T runs on the tensor cores while block i's softmax runs (FA3's overlap)
            mbarrier.wait(k_ready.index(0), 0)
            fence_async_shared()  # cp.async wrote the stage (generic proxy); the wgmma reads it (async proxy)
            sp = warpgroup_mma(q_my, k_smem.index(HID).permute((1, 0)), s_zero, use_acc=False)
            code = gl.load(code_row + cols_k, mask=cols_k < n_keys, other=-1)
            for i in range(n_blocks - 1):
                s = i % NS
                s1 = (i + 1) % NS
                j = (i + 1) * BK + cols_k
                code_n = gl.load(code_row + j, mask=j < n_keys, other=-1)
                mbarrier.wait(k_ready.index(s1), ((i + 1) // NS) & 1)
                fence_async_shared()
                tok_s = warpgroup_mma(q_my, k_smem.index(2 * s1 + HID).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                p, alpha, m_i, l_i = _scores_softmax(sp, code, i, m_i, l_i, scale, x_my, x_other, s_ready, x_free,
                                                     HID, o_l, p_l)
                acc = acc * alpha[:, None]
                tok_o = warpgroup_mma(p, k_smem.index(2 * s + HID), acc, is_async=True)
                sp = warpgroup_mma_wait(1, deps=(tok_s,))  # issued first: done
                acc = warpgroup_mma_wait(0, deps=(tok_o,))
                gl.thread_barrier()
                mbarrier.arrive(k_empty.index(s), count=1)
                code = code_n
            i = n_blocks - 1
            p, alpha, m_i, l_i = _scores_softmax(sp, code, i, m_i, l_i, scale, x_my, x_other, s_ready, x_free,
                                                 HID, o_l, p_l)
            acc = acc * alpha[:, None]
            acc = warpgroup_mma(p, k_smem.index(2 * (i % NS) + HID), acc)
        else:  # one block at a time
            for i in range(n_blocks):
                s = i % NS
                j = i * BK + cols_k
                code = gl.load(code_row + j, mask=j < n_keys, other=-1)  # [BK]
                mbarrier.wait(k_ready.index(s), (i // NS) & 1)
                fence_async_shared()
                kb = k_smem.index(2 * s + HID)  # [BK, HALF]
                sp = warpgroup_mma(q_my, kb.permute((1, 0)), s_zero, use_acc=False)  # [64, BK] partial, half HID
                p, alpha, m_i, l_i = _scores_softmax(sp, code, i, m_i, l_i, scale, x_my, x_other, s_ready, x_free,
                                                     HID, o_l, p_l)
                acc = acc * alpha[:, None]
                acc = warpgroup_mma(p, kb, acc)  # [64, HALF] += P [64, BK] @ V half [BK, HALF]
                gl.thread_barrier()
                mbarrier.arrive(k_empty.index(s), count=1)

        # ---- epilogue: / (l + exp(sink - m)), bf16, the output's rotation in consumer 1's store ----
        _store_half(out_ptr, sink_ptr, cos_ptr, sin_ptr, acc, l_i, m_i, t, hb, H, HID, D, ROPE_OUT, R2)

    @fast_launch
    @gluon.jit
    def _sparse_attention_sm90(q_ptr, kv_ptr, code_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, comp_off, H, n_keys,
                               scale, D: gl.constexpr, BK: gl.constexpr, NS: gl.constexpr, PW: gl.constexpr,
                               P_REGS: gl.constexpr, C_REGS: gl.constexpr,
                               ROPE_Q: gl.constexpr, ROPE_OUT: gl.constexpr, R2: gl.constexpr,
                               PIPE: gl.constexpr, XPAD: gl.constexpr):
        HALF: gl.constexpr = D // 2
        M: gl.constexpr = 64
        pid = gl.program_id(0)
        n_hb = H // M
        t = (pid // n_hb).to(gl.int64)
        hb = pid % n_hb
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        if XPAD:  # rows padded by 4 floats: the wgmma-layout stores / loads of the exchange are conflict-free
            xl: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[BK, 4]], [M, BK], [1, 0])
        else:
            xl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, M, HALF], sw)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NS, BK, HALF], sw)
        x_smem = gl.allocate_shared_memory(gl.float32, [2, M, BK], xl)
        k_ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        s_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        x_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(k_ready.index(s), count=PW * 32)  # one cp.async arrival per producer thread
            mbarrier.init(k_empty.index(s), count=2)  # one per consumer
        for h in gl.static_range(2):
            mbarrier.init(s_ready.index(h), count=1)
            mbarrier.init(x_free.index(h), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (q_ptr, out_ptr, code_ptr, sink_ptr, cos_ptr, sin_ptr, q_smem, k_smem, x_smem,
                         k_ready, k_empty, s_ready, x_free, t, hb, H, n_keys, scale, 0, D, BK, NS,
                         ROPE_Q, ROPE_OUT, R2, PIPE)),
            (_consumer, (q_ptr, out_ptr, code_ptr, sink_ptr, cos_ptr, sin_ptr, q_smem, k_smem, x_smem,
                         k_ready, k_empty, s_ready, x_free, t, hb, H, n_keys, scale, 1, D, BK, NS,
                         ROPE_Q, ROPE_OUT, R2, PIPE)),
            (_producer, (kv_ptr, code_ptr, k_smem, k_ready, k_empty, comp_off, n_keys, gl.cdiv(n_keys, BK), t,
                         D, BK, NS, PW)),
        ], [4, PW], [C_REGS, P_REGS])


def launch_rope_args(code: torch.Tensor, sink: torch.Tensor, rope_cos: torch.Tensor | None,
                     rope_sin: torch.Tensor | None, rope_mode: int, what: str) -> tuple:
    """What both Gluon launchers pass for the rotations: (R2, cos, sin), dummy never-read pointers (sink) without
    them; refuses a slot list with no slot (the kernels need one key block)."""
    if code.shape[1] == 0:
        raise ValueError(f"sparse_attention ({what}): needs at least one key slot")
    if not rope_mode:
        return 1, sink, sink
    return rope_cos.shape[-1], rope_cos, rope_sin


def kernel_info(kernel, info: dict) -> None:
    """The compiled kernel's registers, spills and shared memory into ``info`` (absent under a cache-less launch)."""
    if kernel is not None:
        info.update(n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=kernel.metadata.shared)


def launch_sm90(q: torch.Tensor, window_kv: torch.Tensor, code: torch.Tensor, sink: torch.Tensor, out: torch.Tensor,
                comp_off: int, scale: float, rope_cos: torch.Tensor | None = None,
                rope_sin: torch.Tensor | None = None, rope_mode: int = 0, info: dict | None = None,
                pipe: bool = PIPE, c_regs: int = C_REGS, p_regs: int = P_REGS, xpad: bool = XPAD) -> None:
    """Checked contiguous tensors (``can_run`` true): q [T, H, 512] bf16, window_kv (comp_kv comp_off elements after
    it), slot codes [T, W+K] int32, W+K >= 1 (``sparse_attention.encode_slots``), sink [H] fp32, out [T, H, 512] bf16;
    rope_cos / rope_sin [T, r2] fp32 when rope_mode (ROPE_Q = 1, ROPE_OUT = 2) is set. Writes every element of out.
    ``pipe`` / ``c_regs`` / ``p_regs``: the bench's variants (overlap on or off, the worker partitions' registers)."""
    t, h, d = q.shape
    if t == 0:
        return
    r2, rope_cos, rope_sin = launch_rope_args(code, sink, rope_cos, rope_sin, rope_mode, "sm90")
    kernel = _sparse_attention_sm90[(t * (h // HEADS),)](
        q, window_kv, code, sink, out, rope_cos, rope_sin, comp_off, h, code.shape[1], float(scale),
        D=d, BK=BK, NS=NS, PW=PW, P_REGS=p_regs, C_REGS=c_regs, ROPE_Q=bool(rope_mode & 1),
        ROPE_OUT=bool(rope_mode & 2), R2=r2, PIPE=pipe, XPAD=xpad, num_warps=4, maxnreg=MAXNREG)
    if info is not None:
        info.update(impl="gluon_sm90", grid=t * (h // HEADS), BK=BK, NS=NS, PW=PW, pipe=pipe, c_regs=c_regs,
                    p_regs=p_regs, xpad=xpad)
        kernel_info(kernel, info)
