"""Sparse attention with a per-head sink, reading key rows by index (FlashMLA-style), as one Triton kernel.

Replaces (pass target A, ``minidi.model.sparse_attention.sparse_attention_naive``)::

    keys = cat(window_kv[window_idx], comp_kv[comp_idx])      # [T, W+K, D] gathered and materialised
    s = einsum(q.float(), keys.float()) * scale               # [T, H, W+K] fp32, -inf on empty (-1) slots
    e = exp(s - max_real(s)); l = sum(e) + exp(sink - max)    # the sink joins the denominator only
    out = einsum(bf16(e).float(), keys.float()) / l           # [T, H, D], q's dtype

with one kernel that never builds the [T, W+K, D] key tensor. One program per query token (and head block of
BLOCK_H <= 64 heads): the heads are the M dimension of both tensor-core dots, and key rows are gathered by index,
BLOCK_K slots per step, straight into the dot operands (window slots first, then compressed slots, in one loop).
Each gathered row is both key and value, so a key block is read once per head block and used by both dots::

    for each block of BLOCK_K slots:               # online softmax over blocks
        idx = slot index (window | compressed), -1 / out of range = empty
        Kb  = kv[idx]                              # [BK, D] gathered rows (zeros for empty slots)
        S   = Q @ Kb^T * scale                     # [BH, BK] fp32; -inf on empty slots
        m'  = max(m, rowmax S); a = exp(m - m')    # running max over real keys only
        E   = exp(S - m'); l = l*a + rowsum E      # fp32 denominator, unrounded like the naive path
        acc = acc*a + bf16(E) @ Kb                 # bf16 probability rounding before PV, fp32 accumulation
    out = acc / (l + exp(sink - m))

Rounding: the naive path rounds exp(s - M) with the *final* max M; online softmax rounds exp(s - m_running) and
rescales in fp32 (as FlashMLA, the official kernel, does). The two agree exactly when a block's running max is
already the final max, and otherwise differ by bf16-rounding noise (~2^-9 relative per term, averaging out).

Register budget (the design choice, see docs/ops/sparse_attention.md): the [64, 512] fp32 output accumulator is
128 KB, more than one warpgroup can hold. ``nsplit=1`` keeps it in one program of 8 warps (two warpgroups, each owning
half of D in the PV dot; Triton then computes Q@K^T redundantly in both, 1.5x MMA work but one gather per token);
``nsplit=2`` runs two 4-warp programs per token, each owning half of D and both computing the full Q@K^T (1.5x MMA
work and 2x gathers from L2); ``p_scratch`` passes P through a small per-program scratch so that Triton splits
Q@K^T across the two warpgroups instead of duplicating it (1x MMA work; experimental).

Legend: T queries, H heads, D head dim, W window slots, K compressed slots, Nw / Nc cache rows,
BH heads per program, BK key slots per step, BD = next_pow2(D), DV = BD / nsplit output columns per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import check_backend, interpreting, triton_can_run

Q_DTYPES = (torch.bfloat16, torch.float32)
IDX_DTYPES = (torch.int32, torch.int64)
MAX_D = 512  # the [BH, D] fp32 accumulator must fit one SM's registers


# ---- reference -----------------------------------------------------------------------------------------------------
def sparse_attention_ref(q: torch.Tensor, window_kv: torch.Tensor, window_idx: torch.Tensor,
                         comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Plain torch, the naive path's math (test oracle and fallback). Shapes and dtypes as ``sparse_attention``.

    A query with no valid key returns NaN here (0/0), as the naive path does; the kernel returns 0 there.
    """
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
@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b. Interpreter: fp32 operands (its bf16 dot is wrong). GPU: bf16 tensor cores, or exact fp32."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _round_p(e, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """The unnormalised probabilities as PV consumes them: rounded to bf16 (nearest even) in bf16 mode."""
    if ROUND_BF16:
        if INTERPRET:  # the interpreter's fp32 -> bf16 cast truncates: round by hand, keep fp32 storage
            u = e.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            return u.to(tl.float32, bitcast=True)
        else:
            return e.to(tl.bfloat16)
    else:
        return e


@triton.jit
def _sparse_attention_kernel(
    q_ptr, wkv_ptr, widx_ptr, ckv_ptr, cidx_ptr, sink_ptr, out_ptr, p_scr_ptr, a_scr_ptr,
    H, W, K, Nw, Nc, n_tiles, scale, opaque,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    NSPLIT: tl.constexpr, P_SCRATCH: tl.constexpr, ROUND_BF16: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Tiles (token t, head block hb, D part) in that order, fastest last; a grid smaller than n_tiles loops."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DV: tl.constexpr = BLOCK_D // NSPLIT
    n_hb = tl.cdiv(H, BLOCK_H)
    n_keys = W + K
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    offs_hl = tl.arange(0, BLOCK_H)  # [BH]
    it = 0  # steps done by this program (scratch slot parity)
    for tile in range(pid, n_tiles, nprog):
        dpart = tile % NSPLIT
        hb = (tile // NSPLIT) % n_hb
        t = (tile // (NSPLIT * n_hb)).to(tl.int64)
        offs_h = hb * BLOCK_H + offs_hl  # [BH]
        h_ok = offs_h < H
        offs_d = dpart * DV + tl.arange(0, DV)  # [DV] own columns: PV output and one Q@K^T chunk
        d_ok = offs_d < D
        q_rows = (t * H + offs_h) * D  # [BH]
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [BH, DV]
        if NSPLIT == 2:  # the other half of D, for Q@K^T only
            offs_o = (1 - dpart) * DV + tl.arange(0, DV)
            o_ok = offs_o < D
            q_o = tl.load(q_ptr + q_rows[:, None] + offs_o[None, :], mask=h_ok[:, None] & o_ok[None, :],
                          other=0.0)  # [BH, DV]
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max over real keys
        l_i = tl.zeros([BLOCK_H], tl.float32)  # running denominator (unrounded exp)
        acc = tl.zeros([BLOCK_H, DV], tl.float32)
        widx_row = widx_ptr + t * W
        cidx_row = cidx_ptr + t * K
        for start in range(0, n_keys, BLOCK_K):
            j = start + offs_k  # [BK] slot in the concatenated list: window slots, then compressed
            in_w = j < W
            wi = tl.load(widx_row + j, mask=in_w, other=-1).to(tl.int64)
            ci = tl.load(cidx_row + (j - W), mask=(j >= W) & (j < n_keys), other=-1).to(tl.int64)
            idx = tl.where(in_w, wi, ci)
            valid = (idx >= 0) & (idx < tl.where(in_w, Nw, Nc))  # out-of-range rows are empty, never read
            rows = tl.where(valid, idx, 0)
            base = tl.where(in_w, wkv_ptr, ckv_ptr) + rows * D  # [BK] row pointers
            kb = tl.load(base[:, None] + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                         other=0.0)  # [BK, DV]
            s = _mma(q, tl.trans(kb), tl.zeros([BLOCK_H, BLOCK_K], tl.float32), IEEE, INTERPRET)  # [BH, BK]
            if NSPLIT == 2:
                ko = tl.load(base[:, None] + offs_o[None, :], mask=valid[:, None] & o_ok[None, :], other=0.0)
                s = _mma(q_o, tl.trans(ko), s, IEEE, INTERPRET)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [BH]
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no real key yet: keep exp finite
            alpha = tl.exp(m_i - m_use)  # [BH]
            e = tl.exp(s - m_use[:, None])  # [BH, BK]
            l_i = l_i * alpha + tl.sum(e, 1)
            p = _round_p(e, ROUND_BF16, INTERPRET)  # [BH, BK]
            if P_SCRATCH:
                # Hand P and alpha to the PV dot through memory: with no SSA path from the first dot to the second,
                # Triton splits Q@K^T across the warpgroups instead of computing it in each (chained-dot layout).
                slot = pid.to(tl.int64) * 2 + it % 2  # alternate slots: a slot is rewritten only after a barrier
                p_offs = offs_hl[:, None] * BLOCK_K + offs_k[None, :]
                tl.store(p_scr_ptr + slot * (BLOCK_H * BLOCK_K) + p_offs, p)
                tl.store(a_scr_ptr + slot * BLOCK_H + offs_hl, alpha)
                tl.debug_barrier()
                if opaque > 0:  # always true; hides the loads from the software pipeliner (no early issue)
                    p = tl.load(p_scr_ptr + slot * (BLOCK_H * BLOCK_K) + p_offs)
                    alpha = tl.load(a_scr_ptr + slot * BLOCK_H + offs_hl)
                else:
                    p = tl.zeros([BLOCK_H, BLOCK_K], p_scr_ptr.dtype.element_ty)
                    alpha = tl.zeros([BLOCK_H], tl.float32)
            acc = acc * alpha[:, None]
            acc = _mma(p, kb, acc, IEEE, INTERPRET)  # [BH, DV]
            m_i = m_new
            it += 1
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
        denom = l_i + tl.exp(sink - m_i)  # sink in the denominator only; no real key: exp(+inf), out = 0
        out = acc / denom[:, None]
        tl.store(out_ptr + q_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & d_ok[None, :])


# ---- launcher ------------------------------------------------------------------------------------------------------
_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _NUM_SMS:
        _NUM_SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _NUM_SMS[i]


def default_config(h: int, d: int, dtype: torch.dtype, on_gpu: bool) -> dict:
    """Launch config: BLOCK_H, BLOCK_K, nsplit, p_scratch, persistent, num_warps, num_stages.

    GPU, bf16: one 8-warp program per token and 64-head block, 64 keys per step (Q 64 KB + 2 x 64 KB key buffers in
    shared memory). Interpreter: small blocks (its cost grows with the tile sizes, not with the number of warps).
    """
    block_h = min(64, max(16, triton.next_power_of_2(h)))
    if not on_gpu:
        return dict(BLOCK_H=block_h, BLOCK_K=16, nsplit=1, p_scratch=False, persistent=False, num_warps=4,
                    num_stages=1)
    if dtype == torch.float32:  # exact fp32 dots (tests / fp32 mode): small tiles, no tensor cores
        return dict(BLOCK_H=block_h, BLOCK_K=32, nsplit=2 if d > 256 else 1, p_scratch=False, persistent=False,
                    num_warps=4, num_stages=2)
    return dict(BLOCK_H=block_h, BLOCK_K=64, nsplit=1, p_scratch=False, persistent=False, num_warps=8,
                num_stages=3)


def launch(q: torch.Tensor, window_kv: torch.Tensor, window_idx: torch.Tensor, comp_kv: torch.Tensor | None,
           comp_idx: torch.Tensor | None, sink: torch.Tensor, scale: float, **config) -> torch.Tensor:
    """Run the kernel on checked inputs; ``config`` overrides ``default_config`` (the bench compares variants)."""
    t, h, d = q.shape
    interp = q.device.type == "cpu"
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
    out = torch.empty_like(q)
    block_h, block_k, nsplit = cfg["BLOCK_H"], cfg["BLOCK_K"], cfg["nsplit"]
    block_d = max(16 * nsplit, triton.next_power_of_2(d))
    if block_d % nsplit or nsplit not in (1, 2):
        raise ValueError(f"sparse_attention: nsplit must be 1 or 2, got {nsplit}")
    n_tiles = t * triton.cdiv(h, block_h) * nsplit
    if n_tiles == 0:
        return out
    n_prog = n_tiles
    if cfg["persistent"] or cfg["p_scratch"]:  # the scratch is per program: keep the grid at the SM count
        n_prog = min(n_tiles, 1 if interp else _num_sms(q.device))
    p_dtype = torch.float32 if (interp or q.dtype == torch.float32) else q.dtype
    n_scr = 2 * n_prog if cfg["p_scratch"] else 1
    p_scr = torch.empty((n_scr, block_h * block_k), dtype=p_dtype, device=q.device)
    a_scr = torch.empty((n_scr, block_h), dtype=torch.float32, device=q.device)
    launch_kw = {} if interp else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    with torch.cuda.device(q.device) if q.is_cuda else _nullctx():
        _sparse_attention_kernel[(n_prog,)](
            q, window_kv, window_idx, comp_kv, comp_idx, sink, out, p_scr, a_scr,
            h, w, k, window_kv.shape[0], comp_kv.shape[0], n_tiles, float(scale), 3,
            D=d, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_D=block_d, NSPLIT=nsplit, P_SCRATCH=bool(cfg["p_scratch"]),
            ROUND_BF16=q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32, INTERPRET=interp, **launch_kw)
    return out


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- custom op -----------------------------------------------------------------------------------------------------
@torch.library.custom_op("minidi::sparse_attention", mutates_args=())
def _sparse_attention_op(q: torch.Tensor, window_kv: torch.Tensor, window_idx: torch.Tensor,
                         comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    _check(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale)
    tensors = [x for x in (q, window_kv, window_idx, comp_kv, comp_idx, sink) if x is not None]
    if not triton_can_run(*tensors):
        raise RuntimeError("minidi::sparse_attention: Triton needs CUDA tensors, or CPU tensors with "
                           f"TRITON_INTERPRET=1 (got {q.device}, interpreter {'on' if interpreting() else 'off'}); "
                           "use sparse_attention(..., backend='ref')")
    return launch(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale)


@_sparse_attention_op.register_fake
def _(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale):
    return q.new_empty(q.shape)


def _check(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale) -> None:
    def shape(x):
        return tuple(x.shape)

    if q.dim() != 3 or q.dtype not in Q_DTYPES:
        raise ValueError(f"sparse_attention: q must be [T, H, D] in {Q_DTYPES}, got {shape(q)} {q.dtype}")
    t, h, d = q.shape
    if d > MAX_D:
        raise ValueError(f"sparse_attention: head dim D must be <= {MAX_D} for the Triton kernel, got {d}; "
                         "use backend='ref'")
    if window_kv.dim() != 2 or window_kv.shape[1] != d or window_kv.dtype != q.dtype:
        raise ValueError(f"sparse_attention: window_kv must be [Nw, D={d}] {q.dtype}, got {shape(window_kv)} "
                         f"{window_kv.dtype}")
    if window_idx.dim() != 2 or window_idx.shape[0] != t or window_idx.dtype not in IDX_DTYPES:
        raise ValueError(f"sparse_attention: window_idx must be [T={t}, W] int32/int64, got {shape(window_idx)} "
                         f"{window_idx.dtype}")
    if (comp_kv is None) != (comp_idx is None):
        raise ValueError("sparse_attention: comp_kv and comp_idx must both be given or both be None, got "
                         f"comp_kv {'None' if comp_kv is None else shape(comp_kv)}, "
                         f"comp_idx {'None' if comp_idx is None else shape(comp_idx)}")
    if comp_kv is not None:
        if comp_kv.dim() != 2 or comp_kv.shape[1] != d or comp_kv.dtype != q.dtype:
            raise ValueError(f"sparse_attention: comp_kv must be [Nc, D={d}] {q.dtype}, got {shape(comp_kv)} "
                             f"{comp_kv.dtype}")
        if comp_idx.dim() != 2 or comp_idx.shape[0] != t or comp_idx.dtype not in IDX_DTYPES:
            raise ValueError(f"sparse_attention: comp_idx must be [T={t}, K] int32/int64, got {shape(comp_idx)} "
                             f"{comp_idx.dtype}")
    if sink.shape != (h,) or sink.dtype != torch.float32:
        raise ValueError(f"sparse_attention: sink must be [H={h}] float32, got {shape(sink)} {sink.dtype}")
    if not isinstance(scale, (float, int)):
        raise ValueError(f"sparse_attention: scale must be a Python float, got {type(scale).__name__}")
    devices = {x.device for x in (q, window_kv, window_idx, comp_kv, comp_idx, sink) if x is not None}
    if len(devices) != 1:
        raise ValueError(f"sparse_attention: all tensors must share a device, got {sorted(map(str, devices))}")


def sparse_attention(q: torch.Tensor, window_kv: torch.Tensor, window_idx: torch.Tensor,
                     comp_kv: torch.Tensor | None, comp_idx: torch.Tensor | None, sink: torch.Tensor,
                     scale: float, backend: str = "triton") -> torch.Tensor:
    """Attention of each query over key rows read by index from two caches, with a per-head sink.

    q [T, H, D] bf16 or fp32; window_kv [Nw, D] and comp_kv [Nc, D] in q's dtype (one row = key and value for all
    heads); window_idx [T, W] and comp_idx [T, K] int32/int64 row indices, -1 (or >= rows) = empty slot, anywhere;
    comp_kv / comp_idx both None for window-only layers; sink [H] fp32; scale: float. Returns [T, H, D] in q's dtype.
    Semantics of ``sparse_attention_naive``: fp32 scores, max over real keys only, exp rounded to bf16 before PV in
    bf16 mode, fp32 accumulation and denominator (sink in the denominator only). A query with no valid key gets 0
    from the kernel (the naive path and ``backend='ref'`` give NaN).
    """
    check_backend(backend)
    _check(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale)
    if backend == "ref":
        return sparse_attention_ref(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale)
    return _sparse_attention_op(q, window_kv, window_idx, comp_kv, comp_idx, sink, float(scale))
