"""Grouped expert GEMM on FP8 tensor cores: fq8 activations (e4m3 + a power-of-two scale per 32 along K) times FP4
expert weights (e2m1 + E8M0 per 32 along K), exact products, fp32 accumulation.

Replaces the bf16 path of the routed experts (``minidi.model.moe``; today ``fp4_grouped_mm`` on bf16 tensor cores)::

    y = fp4_grouped_mm(fq8(x), w_packed, w_scale, offs)          # x's fq8 values in bf16, weights decoded to bf16

with ``q, s = fq8_split(x); y = fp8_fp4_grouped_mm(q, s, w_packed, w_scale, offs)``. Semantics (exact, as the FP8
issue defines them): for each K block b of 32, partial = FP8 MMA of the block's e4m3 operands (an e2m1 value is an
e4m3 value: a 16-entry table), then acc += partial * s_x[r, b] * s_w[n, b] in fp32. Every product is the bf16
path's product; only the order of the fp32 sums and the tensor core's accumulation inside a block differ.

GPU path on Hopper (sm_90, Triton 3.6): the warp-specialised Gluon kernel of ``fp8_grouped_gemm_sm90.py`` (the
weights' scales folded per output row where lossless, ``fold_fp4_rows``, or on the device per call, ``fold_gate``);
elsewhere, and for weights that do not fold, the Triton kernel below (also the interpreter-tested path on CPU).

Kernel (persistent; the tile schedule of ``_grouped_tiles.py``, from ``offs`` on the device): a tile is BN weight
rows x BM activation rows of one expert, computed transposed, acc[BN, BM] = W[BN, K] @ x[BM, K]^T, so that the
decoded weights are the MMA's A operand (from registers) and an expert's rows its N dimension. K advances BK at a
time (``num_stages`` software pipelining of the loads); each of the BK / 32 blocks of a step is one FP8 dot of its
own, promoted into acc with the outer product of the two scale vectors. Rows past an expert's end are loaded
clamped and masked at the store; rows past offs[E-1] are not written (``torch._grouped_mm``'s contract).

Legend: R rows (sorted by expert), E experts, N output columns, K input columns, BM/BN/BK tile sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from minidi.formats import FP4_BLOCK, dequant_fp4

from . import fp8_grouped_gemm_sm90 as sm90
from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from .fp4_fold_device import fold_gate
from ._triton_formats import e8m0_to_fp32
from ._grouped_tiles import e_pow2, expert_m_tiles, m_tile_rows
from ._triton_utils import cannot_run, interpreting, num_sms, resolve_backend, triton_can_run

OUT_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Fp8GemmConfig:
    BM: int = 128  # activation rows per tile (the MMA's N)
    BN: int = 64  # weight rows per tile (the MMA's M)
    BK: int = 128  # K per pipelined step: BK / 32 scaled blocks
    num_warps: int = 4
    num_stages: int = 4
    progs_per_sm: int = 1

    def name(self) -> str:
        return f"BM{self.BM}_BN{self.BN}_BK{self.BK}_w{self.num_warps}_s{self.num_stages}"


SMALL = Fp8GemmConfig(BM=16, BN=32, BK=64, num_warps=4, num_stages=1)  # the interpreter's tiles


def default_config(device: torch.device, k: int, rows_per_expert: float = 256.0) -> Fp8GemmConfig:
    """GPU: one warpgroup (two-warpgroup swapped tiles race with Triton 3.6, see docs/benchmarks/README.md's FP4
    GEMM rows), BN 64, BM 128 for EP4-like loads (>= 160 rows per expert) else 64, BK 128 (or the largest of 64 / 32
    dividing K): the fastest one-warpgroup tiles of the round-8 sweep (docs/ops/fp8_grouped_gemm.md). Small tiles
    elsewhere."""
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    if device.type == "cuda":
        return Fp8GemmConfig(BM=128 if rows_per_expert >= 160 else 64, BN=64, BK=bk, num_warps=4, num_stages=4)
    return SMALL if k % SMALL.BK == 0 else dataclasses.replace(SMALL, BK=32)


# ---- reference -----------------------------------------------------------------------------------------------------
def fp8_fp4_grouped_mm_ref(q: torch.Tensor, s: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                           offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Plain torch, one expert at a time, fp32 operands (q * s and the decoded weights are exact in fp32): the
    op's contract, zeros in the rows past offs[-1]."""
    x = q.float() * s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
    r, n = x.shape[0], w_packed.shape[1]
    out = torch.zeros(r, n, dtype=torch.float32, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        end = max(start, min(end, r))
        if end > start:
            out[start:end] = x[start:end] @ dequant_fp4(w_packed[e], w_scale[e], torch.float32).t()
        start = end
    return out.to(out_dtype)


# ---- kernel --------------------------------------------------------------------------------------------------------
@triton.jit
def e2m1_to_e4m3(p, ROWS: tl.constexpr, COLS: tl.constexpr):
    """packed uint8 [ROWS, COLS / 2] (element 2i = low nibble) -> float8e4nv [ROWS, COLS] holding the e2m1 values
    themselves (0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives), exact: magnitude code m >= 2 has e4m3 byte
    (m + 12) << 2, code 1 (0.5) is 0x30, the sign moves from bit 3 to bit 7. Twin of ``minidi.formats.e2m1_grid``
    (held equal on all 16 codes by the op tests)."""
    c = p.to(tl.int32)
    c = tl.reshape(tl.join(c & 0xF, c >> 4), (ROWS, COLS))
    m = c & 7
    byte = tl.where(m >= 2, (m + 12) << 2, tl.where(m == 1, 0x30, 0)) | ((c & 8) << 4)
    return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@fast_launch
@triton.jit
def _fp8_fp4_grouped_mm_kernel(
        q_ptr, s_ptr, w_ptr, ws_ptr, offs_ptr, out_ptr,
        R, N, K, E, NUM_PROGS,
        stride_qm, stride_sm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_POW2: tl.constexpr):
    pid = tl.program_id(0)
    starts, ends, cum, first, m_tiles = expert_m_tiles(offs_ptr, R, E, BM, E_POW2)
    n_tiles = tl.cdiv(N, BN)
    total = m_tiles * n_tiles
    for t in range(pid, total, NUM_PROGS):
        mt = t // n_tiles
        nt = t % n_tiles
        e, m0, m_end = m_tile_rows(mt, starts, ends, cum, first, BM, E_POW2)
        rows = m0 + tl.arange(0, BM)  # [BM]
        cols = nt * BN + tl.arange(0, BN)  # [BN]
        src = tl.minimum(rows, R - 1).to(tl.int64)  # clamped: in bounds, masked at the store
        cols_ld = tl.minimum(cols, N - 1).to(tl.int64)
        e_ld = tl.minimum(e, E - 1).to(tl.int64)
        kq = tl.arange(0, 32)
        kp = tl.arange(0, 16)
        q_ptrs = q_ptr + src[None, :] * stride_qm + kq[:, None]  # [32, BM]: x^T, K-major
        s_ptrs = s_ptr + src * stride_sm  # [BM]
        w_ptrs = w_ptr + e_ld * stride_we + cols_ld[:, None] * stride_wn + kp[None, :]  # [BN, 16]
        ws_ptrs = ws_ptr + e_ld * stride_wse + cols_ld * stride_wsn  # [BN]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kb0 = k0 // 32
            for j in tl.static_range(BK // 32):
                xt = tl.load(q_ptrs + (k0 + 32 * j))  # [32, BM] e4m3
                wq = tl.load(w_ptrs + (k0 // 2 + 16 * j))  # [BN, 16] packed e2m1
                sx = tl.load(s_ptrs + (kb0 + j))  # [BM] fp32
                sw = e8m0_to_fp32(tl.load(ws_ptrs + (kb0 + j)))  # [BN]
                part = tl.dot(e2m1_to_e4m3(wq, BN, 32), xt)  # [BN, BM] exact products, fp32
                acc += part * (sw[:, None] * sx[None, :])
        y = acc.to(out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]  # [BN, BM]
        tl.store(o_ptrs, y, mask=(rows < m_end)[None, :] & (cols < N)[:, None])


def launch(q: torch.Tensor, s: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
           out: torch.Tensor, config: Fp8GemmConfig | None = None) -> None:
    """Checked tensors (unit last-dim strides): q [R, K] e4m3, s [R, K/32] fp32, w_packed [E, N, K/2],
    w_scale [E, N, K/32], offs [E] int32, out [R, N]. Writes the rows below offs[-1] of ``out``."""
    r, k = q.shape
    e, n = w_packed.shape[:2]
    if r == 0 or n == 0:
        return
    cfg = config or default_config(q.device, k, r / e)
    if cfg.BK % 32 or k % cfg.BK:
        raise ValueError(f"fp8_fp4_grouped_mm: config {cfg.name()}: K = {k} must be a multiple of BK = {cfg.BK}, "
                         "itself a multiple of 32")
    max_tiles = (r // cfg.BM + e) * triton.cdiv(n, cfg.BN)
    progs = num_sms(q.device) * cfg.progs_per_sm if q.is_cuda else 4
    progs = max(1, min(progs, max_tiles))
    _fp8_fp4_grouped_mm_kernel[(progs,)](
        q, s, w_packed.view(torch.uint8), w_scale.view(torch.uint8), offs, out,
        r, n, k, e, progs,
        q.stride(0), s.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0),
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, E_POW2=e_pow2(e, interpreting()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check(q: torch.Tensor, s: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
           out_dtype: torch.dtype, w_row_base: torch.Tensor | None = None) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"fp8_fp4_grouped_mm: {what}")

    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        fail(f"q must be [R, K] float8_e4m3fn, got {tuple(q.shape)} {q.dtype}")
    r, k = q.shape
    if k % FP4_BLOCK:
        fail(f"q: K = {k} must be a multiple of {FP4_BLOCK}")
    if s.dtype != torch.float32 or tuple(s.shape) != (r, k // FP4_BLOCK):
        fail(f"s must be [R, K/32] = [{r}, {k // FP4_BLOCK}] float32 (fq8_split's scales), got {tuple(s.shape)} "
             f"{s.dtype}")
    if w_packed.dim() != 3 or w_packed.dtype not in (torch.int8, torch.uint8) or w_packed.shape[2] * 2 != k:
        fail(f"w_packed must be [E, N, K/2] int8 with K/2 = {k // 2}, got {tuple(w_packed.shape)} {w_packed.dtype}")
    e, n = w_packed.shape[:2]
    if e == 0:
        fail("w_packed has no experts (E = 0)")
    if w_scale.dtype not in (torch.float8_e8m0fnu, torch.uint8) or tuple(w_scale.shape) != (e, n, k // FP4_BLOCK):
        fail(f"w_scale must be [E, N, K/32] = [{e}, {n}, {k // FP4_BLOCK}] float8_e8m0fnu, got "
             f"{tuple(w_scale.shape)} {w_scale.dtype}")
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != e:
        fail(f"offs must be [E] = [{e}] int32 (cumulative row ends), got {tuple(offs.shape)} {offs.dtype}")
    if out_dtype not in OUT_DTYPES:
        fail(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if w_row_base is not None and (w_row_base.dtype != torch.int32 or tuple(w_row_base.shape) != (e, n)
                                   or w_row_base.device != q.device):
        fail(f"w_row_base must be [E, N] = [{e}, {n}] int32 on {q.device} (fold_fp4_rows of w_scale), got "
             f"{tuple(w_row_base.shape)} {w_row_base.dtype} on {w_row_base.device}")
    devs = {t.device for t in (q, s, w_packed, w_scale, offs)}
    if len(devs) != 1:
        fail(f"q, s, w_packed, w_scale and offs must be on one device, got {sorted(map(str, devs))}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dispatch_op("minidi::fp8_fp4_grouped_mm")
def _fp8_fp4_grouped_mm_op(q: torch.Tensor, s: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                           offs: torch.Tensor, out_dtype: torch.dtype,
                           w_row_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    if not triton_can_run(q, s, w_packed, w_scale, offs):
        raise cannot_run("minidi::fp8_fp4_grouped_mm", q, s, w_packed, w_scale, offs)
    q, s, w_packed, w_scale = _unit_last(q), _unit_last(s), _unit_last(w_packed), _unit_last(w_scale)
    out = torch.empty(q.shape[0], w_packed.shape[1], dtype=out_dtype, device=q.device)
    offs = offs.contiguous()
    if sm90.can_run(q, w_packed):  # Hopper: the Gluon kernel where the weights' scales fold, else the exact Triton
        if w_row_base is not None:
            sm90.launch_sm90(q, s, w_packed, w_scale, w_row_base, offs, out)
            return out
        base, fold_offs, exact_offs = fold_gate(w_scale, offs)  # decided on the device: no host sync
        sm90.launch_sm90(q, s, w_packed, w_scale, base, fold_offs, out)
        launch(q, s, w_packed, w_scale, exact_offs, out)  # no tile runs unless some weight row does not fold
        return out
    launch(q, s, w_packed, w_scale, offs, out)
    return out


@_fp8_fp4_grouped_mm_op.register_fake
def _(q, s, w_packed, w_scale, offs, out_dtype, w_row_base=None):
    return q.new_empty(q.shape[0], w_packed.shape[1], dtype=out_dtype)


@dispatch_op("minidi::fp8_fp4_grouped_mm_ref")
def _fp8_fp4_grouped_mm_ref_op(q: torch.Tensor, s: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                               offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_fp4_grouped_mm_ref(q, s, w_packed, w_scale, offs, out_dtype)


@_fp8_fp4_grouped_mm_ref_op.register_fake
def _(q, s, w_packed, w_scale, offs, out_dtype):
    return q.new_empty(q.shape[0], w_packed.shape[1], dtype=out_dtype)


def fp8_fp4_grouped_mm(q: torch.Tensor, s: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                       offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                       backend: str = "auto", w_row_base: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped GEMM over experts on FP8 tensor cores. q [R, K] float8_e4m3fn and s [R, K/32] fp32 (``fq8_split`` of
    the rows, sorted by expert); w_packed [E, N, K/2] int8 (two e2m1 codes per byte, element 2i in the low nibble);
    w_scale [E, N, K/32] float8_e8m0fnu; offs [E] int32 cumulative row ends (non-decreasing, offs[-1] <= R).
    Returns y [R, N] in ``out_dtype``: y[r] = (q[r] * s[r]) @ dequant(w)[e(r)].T, fp32 accumulation, for
    r < offs[-1]; the rows past offs[-1] are not written (garbage; the ref backend gives zeros). ``backend``: "auto"
    (the kernel where it can run, else the reference), "triton" (the GPU / interpreter kernel: on sm_90 the Gluon
    kernel where the weight scales fold) or "ref" (plain torch, one expert at a time). ``w_row_base``: the weights'
    ``fold_fp4_rows(w_scale)``, computed once per weight tensor (without it, the sm_90 path folds on the device every
    call, ``fold_gate``: two small launches, no host sync, the exact kernel where a row does not fold); ignored
    elsewhere."""
    _check(q, s, w_packed, w_scale, offs, out_dtype, w_row_base)
    if resolve_backend(backend, "fp8_fp4_grouped_mm", q, s, w_packed, w_scale, offs) == "ref":
        return _fp8_fp4_grouped_mm_ref_op(q, s, w_packed, w_scale, offs, out_dtype)
    return _fp8_fp4_grouped_mm_op(q, s, w_packed, w_scale, offs, out_dtype, w_row_base)


fold_fp4_rows = sm90.fold_fp4_rows
