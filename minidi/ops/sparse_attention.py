"""Sparse attention with a per-head sink, reading key rows by index (FlashMLA-style), as one Triton kernel (the
interpreter-tested path and the fallback) and, on sm_90, warp-specialised Gluon kernels (``sparse_attention_sm90.py``,
``sparse_attention_sm90_split.py`` and, the default, ``sparse_attention_sm90_stagger.py``; chosen by ``launch`` where
they can run).

Replaces (pass target A, ``minidi.model.sparse_attention.sparse_attention_naive``)::

    keys = cat(window_kv[window_idx], comp_kv[comp_idx])      # [T, W+K, D] gathered and materialised
    s = einsum(q.float(), keys.float()) * scale               # [T, H, W+K] fp32, -inf on empty (-1) slots
    e = exp(s - max_real(s)); l = sum(e) + exp(sink - max)    # the sink joins the denominator only
    out = einsum(bf16(e).float(), keys.float()) / l           # [T, H, D], q's dtype

with two launches and no [T, W+K, D] key tensor: a tiny kernel encodes both index lists into one int32 slot code
per (query, slot) (window row r -> r, compressed row r -> r | 2^30, empty -> -1), then the attention kernel runs
one program per query token (and head block of BLOCK_H <= 64 heads; ``nsplit`` programs per token split the output
columns). The heads are the M dimension of both tensor-core dots; key rows are gathered by index, BLOCK_K slots per
step, straight into shared memory (16-byte cp.async, software-pipelined), and each row is used as key and value::

    for each block of BLOCK_K slots:               # online softmax over blocks
        Kb  = kv[rows of the block]                # [BK, D] gathered rows (zeros for empty slots)
        S   = Q @ Kb^T * scale                     # [BH, BK] fp32; -inf on empty slots
        m'  = max(m, rowmax S); a = exp(m - m')    # running max over real keys only
        E   = exp(S - m'); l = l*a + rowsum E      # fp32 denominator, unrounded like the naive path
        acc = acc*a + bf16(E) @ Kb                 # bf16 probability rounding before PV, fp32 accumulation
    out = acc / (l + exp(sink - m))

Rounding: the naive path rounds exp(s - M) with the *final* max M; online softmax rounds exp(s - m_running) and
rescales in fp32 (as FlashMLA, the official kernel, does). The two agree exactly when a block's running max is
already the final max, and otherwise differ by bf16-rounding noise (~2^-9 relative per term, averaging out).

The register budget decides the design (docs/ops/sparse_attention.md): the [64, 512] fp32 accumulator is 128 KB,
more than one warpgroup can hold, so two warpgroups must share it, each owning half of D. ``nsplit=1`` (8 warps):
one program per token, rows gathered once; Triton gives a dot whose result feeds another dot a rows-only warp
layout, so with 64 rows both warpgroups compute the full Q@K^T (1.5x the useful MMA work). ``nsplit=2`` (4 warps):
two programs per token, each owning half of D and computing the full Q@K^T (also 1.5x, and every row gathered
twice). Either way the kernel is capped at 2/3 of the tensor-core peak.

``rope_mode`` (pass A folds the model's rotations in; ``docs/ops/sparse_attention.md``): ``ROPE_Q`` rotates q's
trailing 2 r2 channels by (cos, sin) as the kernel loads it, ``ROPE_OUT`` rotates the output's back as it stores it,
each with ``apply_rope``'s arithmetic and roundings (``rope_ref`` is its twin). ``q_scale`` (pass A folds V4's per-head
unweighted q RMSNorm in): q becomes bf16(q * q_scale) as the kernel loads it, before the rotation, so the normalised
q is never written to memory; the scale, rsqrt(mean(q^2) + eps) per (token, head), is computed outside.

Legend: T queries, H heads, D head dim, W window slots, K compressed slots, Nw / Nc cache rows,
BH heads per program, BK key slots per step, BD = next_pow2(D), DV = BD / nsplit output columns per program.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._sparse_attention_checks import _check
from ._sparse_attention_rope import (ROPE_OUT, ROPE_Q, _qnorm_stage, _rope_load, _rope_stage, _rope_store_values,
                                     _round_p, rope_ref, scale_q)
from . import sparse_attention_sm90 as sm90
from . import sparse_attention_sm90_split as sm90_split
from . import sparse_attention_sm90_stagger as sm90_stagger
from ._triton_utils import cannot_run, interpreting, mma, num_sms, resolve_backend, round_bf16, triton_can_run



# ---- reference -----------------------------------------------------------------------------------------------------
def sparse_attention_ref(q: torch.Tensor, window_kv: torch.Tensor, window_idx: torch.Tensor,
                         comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, sink: torch.Tensor,
                         scale: float, rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None,
                         rope_mode: int = 0, q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, the naive path's math (test oracle and fallback). Shapes and dtypes as ``sparse_attention``;
    ``rope_mode`` bits (``ROPE_Q``, ``ROPE_OUT``): ``rope_ref`` of q before, of the output (inverse) after;
    ``q_scale``: ``scale_q`` of q first.

    A deliberate twin of ``minidi.model.sparse_attention.sparse_attention_naive`` (the ops import nothing of the
    model); ``tests/ops/test_sparse_attention.py::test_ref_is_the_model_naive_function`` holds the two bit-equal.

    A query with no valid key returns NaN here (0/0), as the naive path does; the kernel returns 0 there.
    """
    if q_scale is not None:
        q = scale_q(q, q_scale)
    if rope_mode & ROPE_Q:
        q = rope_ref(q, rope_cos, rope_sin)
    out = _attention_ref(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale)
    return rope_ref(out, rope_cos, rope_sin, inverse=True) if rope_mode & ROPE_OUT else out


def _attention_ref(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale) -> torch.Tensor:
    keys = window_kv[window_idx.clamp(min=0)]  # [T, W, D]
    idx = window_idx
    if comp_idx is not None and comp_kv is not None:
        keys = torch.cat([keys, comp_kv[comp_idx.clamp(min=0)]], dim=1)  # [T, W+K, D]
        idx = torch.cat([window_idx, comp_idx], dim=1)
    valid = idx >= 0  # [T, W+K]
    keys = torch.where(valid.unsqueeze(-1), keys, torch.zeros_like(keys))
    scores = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale  # [T, H, W+K]
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # real keys only
    e = torch.exp(scores - m)
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink.float().view(1, -1, 1) - m)
    e = e.to(q.dtype).float()  # probability rounding to the activation dtype before PV (no-op in fp32)
    out = torch.einsum("thk,tkd->thd", e, keys.float()) / denom
    return out.to(q.dtype)


# ---- kernel --------------------------------------------------------------------------------------------------------
# slot code: window row r -> r, compressed row r -> r | 2^30, empty -> -1 (rows < 2^30)
COMP_BIT = tl.constexpr(30)
COMP_FLAG = tl.constexpr(1 << 30)
ROW_MASK = tl.constexpr((1 << 30) - 1)


@fast_launch
@triton.jit
def _encode_slots_kernel(widx_ptr, cidx_ptr, code_ptr, W, K, Nw, Nc, BLOCK: tl.constexpr):
    """code[t, :] = one int32 list over the concatenated slots (window, then compressed); one program per query.

    Empty (-1) and out-of-range indices become -1. The attention kernel then reads one 4-byte code per slot instead
    of two int64 indices, which saves it registers and instructions in its inner loop.
    """
    t = tl.program_id(0).to(tl.int64)
    n = W + K
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK)  # [BLOCK]
        in_w = j < W
        wi = tl.load(widx_ptr + t * W + j, mask=in_w, other=-1).to(tl.int64)
        ci = tl.load(cidx_ptr + t * K + (j - W), mask=(j >= W) & (j < n), other=-1).to(tl.int64)
        wi = tl.where((wi >= 0) & (wi < Nw), wi, -1)
        ci = tl.where((ci >= 0) & (ci < Nc), ci + COMP_FLAG, -1)
        tl.store(code_ptr + t * n + j, tl.where(in_w, wi, ci).to(tl.int32), mask=j < n)


@fast_launch
@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, code_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, qs_ptr,
    comp_off, H, n_keys, n_tiles, scale,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    NSPLIT: tl.constexpr, ROUND_BF16: tl.constexpr, IEEE: tl.constexpr,
    ROPE_Q: tl.constexpr, ROPE_OUT: tl.constexpr, R2: tl.constexpr, RB: tl.constexpr, QNORM: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Tiles (token t, head block hb, D part) in that order, fastest last; a grid smaller than n_tiles loops."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DV: tl.constexpr = BLOCK_D // NSPLIT
    n_hb = tl.cdiv(H, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    offs_hl = tl.arange(0, BLOCK_H)  # [BH]
    for tile in range(pid, n_tiles, nprog):
        dpart = tile % NSPLIT
        hb = (tile // NSPLIT) % n_hb
        t = (tile // (NSPLIT * n_hb)).to(tl.int64)
        offs_h = hb * BLOCK_H + offs_hl  # [BH]
        h_ok = offs_h < H
        offs_d = dpart * DV + tl.arange(0, DV)  # [DV] own columns: PV output and one Q@K^T chunk
        d_ok = (offs_d < D) | (D == BLOCK_D)  # constant-true when D fills the block: masks stay per row
        q_rows = (t * H + offs_h) * D  # [BH]
        qs = tl.full([BLOCK_H], 1.0, tl.float32)  # [BH] q's row scales (QNORM)
        if QNORM:
            qs = tl.load(qs_ptr + t * H + offs_h, mask=h_ok, other=1.0)
        if QNORM and NSPLIT == 1:  # the scaled (and rotated) q staged in out's rows, then one load
            _qnorm_stage(q_ptr, out_ptr, q_rows, h_ok, qs, cos_ptr, sin_ptr, t, D, R2, BLOCK_D, ROPE_Q, ROUND_BF16,
                         INTERPRET)
            tl.debug_barrier()  # the staged rows are visible to every thread of the program
            q = tl.load(out_ptr + q_rows[:, None] + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                        other=0.0)  # [BH, DV]
        elif ROPE_Q and NSPLIT == 1:  # q's rotation staged in out's rows, then one load (the rest from q)
            _rope_stage(q_ptr, out_ptr, q_rows, h_ok, cos_ptr, sin_ptr, t, D, R2, RB, ROUND_BF16, INTERPRET)
            tl.debug_barrier()  # the staged channels are visible to every thread of the program
            rot = offs_d >= D - 2 * R2
            q = tl.load(tl.where(rot[None, :], out_ptr, q_ptr) + q_rows[:, None] + offs_d[None, :],
                        mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BH, DV]
        elif ROPE_Q or QNORM:  # two programs share the token's rows (NSPLIT 2): scale / rotate in registers
            q = _rope_load(q_ptr, q_rows, offs_d, d_ok, h_ok, cos_ptr, sin_ptr, t, qs, D, R2, ROPE_Q, QNORM,
                           ROUND_BF16, INTERPRET)
        else:
            q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                        other=0.0)  # [BH, DV]
        if NSPLIT == 2:  # the other half of D, for Q@K^T only
            offs_o = (1 - dpart) * DV + tl.arange(0, DV)
            o_ok = (offs_o < D) | (D == BLOCK_D)
            if ROPE_Q or QNORM:
                q_o = _rope_load(q_ptr, q_rows, offs_o, o_ok, h_ok, cos_ptr, sin_ptr, t, qs, D, R2, ROPE_Q, QNORM,
                                 ROUND_BF16, INTERPRET)
            else:
                q_o = tl.load(q_ptr + q_rows[:, None] + offs_o[None, :], mask=h_ok[:, None] & o_ok[None, :],
                              other=0.0)  # [BH, DV]
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max over real keys
        l_i = tl.zeros([BLOCK_H], tl.float32)  # running denominator (unrounded exp)
        acc = tl.zeros([BLOCK_H, DV], tl.float32)
        code_row = code_ptr + t * n_keys
        for start in range(0, n_keys, BLOCK_K):
            j = start + offs_k  # [BK] slots
            code = tl.load(code_row + j, mask=j < n_keys, other=-1)  # [BK] int32 slot codes
            valid = code >= 0
            # Row pointers: both caches are addressed from kv_ptr (= window_kv), comp_kv sitting comp_off elements
            # after it. The offset is arithmetic, not a select: Triton's alignment analysis then proves 16-byte
            # rows and vectorises and software-pipelines the gather (a select of pointers or offsets turns it
            # into a synchronous load).
            roff = (code >> COMP_BIT).to(tl.int64) * comp_off + (code & ROW_MASK).to(tl.int64) * D
            base = kv_ptr + roff  # [BK] row pointers (garbage, never read, for empty slots)
            kb = tl.load(base[:, None] + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                         other=0.0)  # [BK, DV]
            s = mma(q, tl.trans(kb), tl.zeros([BLOCK_H, BLOCK_K], tl.float32), IEEE, INTERPRET)  # [BH, BK]
            if NSPLIT == 2:
                ko = tl.load(base[:, None] + offs_o[None, :], mask=valid[:, None] & o_ok[None, :], other=0.0)
                s = mma(q_o, tl.trans(ko), s, IEEE, INTERPRET)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BH]
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no real key yet: keep exp finite
            alpha = tl.exp(m_i - m_use)  # [BH]
            e = tl.exp(s - m_use[:, None])  # [BH, BK]
            l_i = l_i * alpha + tl.sum(e, 1)
            p = _round_p(e, ROUND_BF16, INTERPRET)  # [BH, BK]
            acc = acc * alpha[:, None]
            acc = mma(p, kb, acc, IEEE, INTERPRET)  # [BH, DV]
            m_i = m_new
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
        denom = l_i + tl.exp(sink - m_i)  # sink in the denominator only; no real key: exp(+inf), out = 0
        out = acc / denom[:, None]
        if ROPE_OUT:  # the output's inverse rotation in the store
            out = _rope_store_values(out, dpart * DV, cos_ptr, sin_ptr, t, D, R2, BLOCK_H, DV, ROUND_BF16,
                                     INTERPRET)
        elif ROUND_BF16 and INTERPRET:
            out = round_bf16(out)  # the interpreter's fp32 -> bf16 store truncates: hand it the rounded value
        tl.store(out_ptr + q_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & d_ok[None, :])


# ---- launcher ------------------------------------------------------------------------------------------------------
def default_config(h: int, d: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    """Launch config: BLOCK_H, BLOCK_K, nsplit, persistent, num_warps, num_stages.

    GPU, bf16: one 8-warp program per token and 64-head block, 64 keys per step; shared memory holds Q (64 KB) and
    two key buffers (2 x 64 KB); num_stages=2 (the gather one step ahead) measured 2.5% faster than 3 on the H200.
    Interpreter: small blocks (its cost grows with the tile sizes, not with the number of warps).
    """
    block_h = min(64, max(16, triton.next_power_of_2(h)))
    if not on_gpu:
        return dict(BLOCK_H=block_h, BLOCK_K=16, nsplit=1, persistent=False, num_warps=4,
                    num_stages=1)
    if dtype == torch.float32:  # exact fp32 FMA dots (tests / fp32 mode): small tiles keep them out of local memory
        return dict(BLOCK_H=16, BLOCK_K=32, nsplit=2 if d > 64 else 1, persistent=False, num_warps=4, num_stages=2)
    return dict(BLOCK_H=block_h, BLOCK_K=64, nsplit=1, persistent=False, num_warps=8,
                num_stages=2)  # H200 round 1: s2 1.676 ms (14 spills) vs s3 1.719 ms (36 spills)


def encode_slots(window_idx: torch.Tensor, comp_idx: torch.Tensor | None, nw: int, nc: int) -> torch.Tensor:
    """window_idx [T, W], comp_idx [T, K] or None (int32/int64, contiguous) -> slot codes [T, W+K] int32."""
    t, w = window_idx.shape
    k = 0 if comp_idx is None else comp_idx.shape[1]
    code = torch.empty((t, w + k), dtype=torch.int32, device=window_idx.device)
    if t and w + k:
        _encode_slots_kernel[(t,)](window_idx, window_idx if comp_idx is None else comp_idx, code, w, k, nw, nc,
                                   BLOCK=min(1024, triton.next_power_of_2(w + k)))
    return code


SM90_KERNELS = {"gluon": sm90.launch_sm90, "gluon_split": sm90_split.launch_sm90_split,  # impl -> launcher
                "gluon_stagger": sm90_stagger.launch_sm90_stagger}
SM90_DEFAULT = "gluon_stagger"  # the Gluon kernel the op takes on sm_90 with no impl asked for (round 24: 1.26x
# round 19's "gluon_split" on the H100)


def launch(q: torch.Tensor, window_kv: torch.Tensor, window_idx: torch.Tensor, comp_kv: torch.Tensor | None,
           comp_idx: torch.Tensor | None, sink: torch.Tensor, scale: float, info: dict | None = None,
           rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None, rope_mode: int = 0,
           q_scale: torch.Tensor | None = None, **config) -> torch.Tensor:
    """Run the kernel on checked inputs; ``config`` overrides ``default_config`` (the bench compares variants).
    ``q_scale``: q's row scales (``scale_q``), applied in the kernel's Q load by the Triton kernel and the staggered
    Gluon kernel with its Q copied ahead; for the other Gluon kernels q is scaled here first (the same values).

    ``impl`` in config: "gluon" forces the sm_90 Gluon kernel (``sparse_attention_sm90``; extra keys go to its
    launcher), "gluon_split" its sibling with FlashMLA's split of the work (``sparse_attention_sm90_split``),
    "gluon_stagger" the one with FlashMLA's staggered schedule (``sparse_attention_sm90_stagger``), "triton" the
    Triton kernel; unset, ``SM90_DEFAULT`` of the Gluon kernels runs where ``sm90.can_run`` holds and no Triton
    config was given, else the Triton kernel.

    ``info``, if given, receives the config used and, on the GPU, the compiled kernel (registers, spills, shared
    memory, and the MMA layouts Triton chose, read from its TTGIR).
    """
    t, h, d = q.shape
    interp = interpreting()  # CPU tensors, or any tensors under TRITON_INTERPRET=1
    impl = config.pop("impl", None)  # "gluon" (sm_90 kernel), "triton"; None: gluon where it can run, unless
    if impl not in (None, "triton", *SM90_KERNELS):  # Triton config knobs were given
        raise ValueError(f"sparse_attention: impl must be one of {['triton', *SM90_KERNELS]}, got {impl!r}")
    cfg = default_config(h, d, q.dtype, not interp) | config
    q = q.contiguous()
    window_kv, window_idx = window_kv.contiguous(), window_idx.contiguous()
    if comp_kv is None or comp_idx is None:  # no compressed keys: K = 0, dummy (never read) pointers
        comp_kv, comp_idx = window_kv, window_idx
        k = 0
    else:
        comp_kv, comp_idx = comp_kv.contiguous(), comp_idx.contiguous()
        k = comp_idx.shape[1]
    w = window_idx.shape[1]
    comp_off = (comp_kv.data_ptr() - window_kv.data_ptr()) // comp_kv.element_size()  # comp_kv - window_kv, elems
    code = encode_slots(window_idx, comp_idx if k else None, window_kv.shape[0], comp_kv.shape[0])  # [T, W+K]
    out = torch.empty_like(q)
    r2 = rope_cos.shape[-1] if rope_mode else 0
    if q_scale is not None:
        q_scale = q_scale.reshape(t, h).contiguous()
    if impl != "triton" and not interp and (impl in SM90_KERNELS or not config):
        if sm90.can_run(q, window_kv, comp_off, r2) and w + k > 0:
            if rope_mode:
                rope_cos, rope_sin = rope_cos.contiguous(), rope_sin.contiguous()
            name = impl or SM90_DEFAULT
            if q_scale is not None and sm90_stagger.scales_q(name, config):
                config = config | dict(q_scale=q_scale)
            elif q_scale is not None:  # a kernel without the scale in its Q load: q scaled first
                q = scale_q(q, q_scale)
            with torch.cuda.device(q.device):
                SM90_KERNELS[name](q, window_kv, code, sink, out, comp_off, scale, rope_cos, rope_sin, rope_mode, info,
                                   **config)  # the bench's knobs, if any
            return out
        if impl in SM90_KERNELS:
            raise ValueError("sparse_attention: the sm_90 Gluon kernel cannot run here (needs an sm_90 GPU, Triton "
                             "3.6 with Gluon, bf16, D 512, H a multiple of 64, 16-byte aligned caches, 2 r2 <= 256)")
    block_h, block_k, nsplit = cfg["BLOCK_H"], cfg["BLOCK_K"], cfg["nsplit"]
    block_d = max(16 * nsplit, triton.next_power_of_2(d))
    if block_d % nsplit or nsplit not in (1, 2):
        raise ValueError(f"sparse_attention: nsplit must be 1 or 2, got {nsplit}")
    n_tiles = t * triton.cdiv(h, block_h) * nsplit
    if n_tiles == 0:
        return out
    n_prog = n_tiles
    if cfg["persistent"]:  # one program per SM, looping over tiles in order
        n_prog = min(n_tiles, 1 if interp else num_sms(q.device))
    launch_kw = {} if interp else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    r2 = rope_cos.shape[-1] if rope_mode else 1
    if rope_mode:
        rope_cos, rope_sin = rope_cos.contiguous(), rope_sin.contiguous()
    else:  # dummy (never read) pointers
        rope_cos = rope_sin = sink
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        kernel = _sparse_attention_kernel[(n_prog,)](
            q, window_kv, code, sink, out, rope_cos, rope_sin, sink if q_scale is None else q_scale, comp_off, h,
            w + k, n_tiles, float(scale),
            D=d, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_D=block_d, NSPLIT=nsplit,
            ROUND_BF16=q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
            ROPE_Q=bool(rope_mode & ROPE_Q), ROPE_OUT=bool(rope_mode & ROPE_OUT),
            R2=r2, RB=triton.next_power_of_2(2 * r2), QNORM=q_scale is not None, INTERPRET=interp, **launch_kw)
    if info is not None:
        info.update(cfg, grid=n_prog)
        if not interp and kernel is not None:
            ttgir = kernel.asm.get("ttgir", "")
            info.update(n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=kernel.metadata.shared,
                        mma=sorted({ln.split("=", 1)[1].strip() for ln in ttgir.splitlines()
                                    if ln.startswith("#mma") and "nvidia_mma" in ln}))
    return out


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::sparse_attention")
def _sparse_attention_op(q: torch.Tensor, window_kv: torch.Tensor, window_idx: torch.Tensor,
                         comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, sink: torch.Tensor,
                         scale: float, rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None,
                         rope_mode: int = 0, q_scale: torch.Tensor | None = None) -> torch.Tensor:
    _check(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale, rope_cos, rope_sin, rope_mode, q_scale)
    tensors = [x for x in (q, window_kv, window_idx, comp_kv, comp_idx, sink, rope_cos, rope_sin, q_scale)
               if x is not None]
    if not triton_can_run(*tensors):
        raise cannot_run("minidi::sparse_attention", *tensors)
    return launch(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale, rope_cos=rope_cos, rope_sin=rope_sin,
                  rope_mode=rope_mode, q_scale=q_scale)


@_sparse_attention_op.register_fake
def _(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale, rope_cos=None, rope_sin=None, rope_mode=0,
      q_scale=None):
    return q.new_empty(q.shape)


def sparse_attention(q: torch.Tensor, window_kv: torch.Tensor, window_idx: torch.Tensor,
                     comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, sink: torch.Tensor,
                     scale: float, backend: str = "auto", rope_cos: torch.Tensor | None = None,
                     rope_sin: torch.Tensor | None = None, rope_mode: int = 0,
                     q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query over key rows read by index from two caches, with a per-head sink.

    q [T, H, D] bf16 or fp32; window_kv [Nw, D] and comp_kv [Nc, D] in q's dtype (one row = key and value for all
    heads); window_idx [T, W] and comp_idx [T, K] int32/int64 row indices, -1 (or >= rows) = empty slot, anywhere;
    comp_kv / comp_idx both None for window-only layers; sink [H] fp32; scale: float. Returns [T, H, D] in q's dtype.
    Semantics of ``sparse_attention_naive``: fp32 scores, max over real keys only, exp rounded to bf16 before PV in
    bf16 mode, fp32 accumulation and denominator (sink in the denominator only). A query with no valid key gets 0
    from the kernel (the naive path and ``backend='ref'`` give NaN). ``backend``: "auto" (the kernel where it can run,
    else the reference), "triton" or "ref" (plain torch). ``rope_mode`` (pass A folds the model's rotations in):
    ``ROPE_Q`` rotates q's trailing 2 r2 channels by rope_cos / rope_sin [T, r2] fp32 in the load (q is then the
    unrotated query; ``rope_ref``'s math and bf16 rounding), ``ROPE_OUT`` rotates the output's back (by -angle) in
    the store, after its rounding to q's dtype; ``ROPE_Q | ROPE_OUT`` both. ``q_scale`` [T, H] or [T, H, 1] fp32
    (pass A folds V4's per-head q RMSNorm): q is first replaced by bf16(q * q_scale) (``scale_q``; q's dtype), in
    the kernel's load.
    """
    _check(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale, rope_cos, rope_sin, rope_mode, q_scale)
    if resolve_backend(backend, "sparse_attention", q, window_kv, window_idx, comp_kv, comp_idx, sink, rope_cos,
                       rope_sin, q_scale) == "ref":
        return sparse_attention_ref(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale, rope_cos, rope_sin,
                                    rope_mode, q_scale)
    return _sparse_attention_op(q, window_kv, window_idx, comp_kv, comp_idx, sink, float(scale), rope_cos, rope_sin,
                                rope_mode, q_scale)
