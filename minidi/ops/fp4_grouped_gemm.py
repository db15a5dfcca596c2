"""Grouped expert GEMM with FP4 (e2m1) + E8M0 weights decoded in the load path: no bf16 expert weights in memory.

Replaces (pass target D, ``minidi.model.moe``)::

    w = dequant_expert_stack(packed, scale, x.dtype)    # [E, N, K] bf16: 4 B written per packed byte read
    y = grouped_mm(x, w, offs)                          # y[r] = x[r] @ w[e(r)].T for the rows r of expert e

with ``y = fp4_grouped_mm(x, packed, scale, offs)``. FP4 format: element 2i of a row = low nibble of byte i, 2i+1 =
high nibble; nibble bit 3 = sign, bits 0-2 index the grid {0, .5, 1, 1.5, 2, 3, 4, 6}; one E8M0 scale per 32
consecutive K elements: byte b -> 2^(b-127), 0 -> 2^-127, 255 -> NaN.

Kernel (persistent; the tile schedule is built on the device from ``offs``, no host sync):
- Each program loads ``offs`` once (a vector of E_POW2 >= E entries), counts the m-tiles of each expert
  (cdiv(rows_e, BM)) and their
  inclusive cumsum, then walks the linear tile ids t = pid, pid + P, ... with t = m_tile * n_tiles + n_tile (n fastest:
  the programs running at one time share the x rows of an m-tile through L2, and each expert's weight tile is read
  by all its m-tiles within a short window). Experts with zero rows own no tile and cost nothing.
- Tile = (up to BM rows of one expert) x (BN output columns). K loop in BK steps: x tile [BM, BK] bf16, packed
  weights [BN, BK/2] uint8 (half a byte per weight) and scales [BN, BK/32] are loaded (software-pipelined,
  ``num_stages``); the weights are decoded to bf16 in registers and fed to the tensor cores with fp32 accumulation.
  ``SWAP``: compute the tile transposed, acc[BN, BM] = W[BN, BK] @ x[BM, BK]^T, so that the decoded weights are the
  A operand of the Hopper MMA (which may come from registers) and the rows of one expert are its N dimension (>= 8,
  which suits the small per-expert row counts of EP1); otherwise acc[BM, BN] = x @ W^T.
- Decode (``decode``): "asm" (GPU) turns 4 packed bytes into 8 bf16 with byte lookups (PTX ``prmt``, about 2.5
  instructions per weight including the bf16x2 scale multiply); "scaled" hands bytes and scales to ``tl.dot_scaled``
  (Triton's own e2m1 lowering); "manual" decodes with integer/fp32 arithmetic (the magnitude bits << 9, | sign << 15,
  are an fp16 pattern equal to value * 2^-14; code 1 lands on the fp16 subnormal 2^-15; times 2^14 and the fp32
  scale, all exact) and is the fp32-x path and the interpreter's stand-in for "asm". "asm" and "scaled" map E8M0 255
  to inf; the epilogue restores NaN in every column whose weight row saw a 255 code (a running max of the codes).
  Scales are loaded as one int32 (4 codes) per weight row and 128-wide K chunk (cp.async needs >= 4 bytes).
- Rows past an expert's end are loaded clamped (in bounds, from the next expert) and masked at the store.

FLOPs / minimal bytes, V4.1-Flash (R = 24,576 rows = 4,096 tokens x top-6), w1/w3 (N 2,304, K 5,120) and w2 (N 5,120,
K 2,304) alike: 2 R N K = 0.580 TFLOP per GEMM (0.74 ms at 785 TFLOP/s). Bytes = E N K / 2 (packed) + E N K / 32
(scales) + 2 R K (x) + 2 R N (y): EP4 (96 experts x 256 rows) 0.97 GB (0.23 ms at 4.27 TB/s) -> compute-bound;
EP1 (384 experts x 64 rows) 2.77 GB (0.65 ms) -> weight streaming and compute both near the 0.74 ms floor.

Legend: R rows (sorted by expert), E experts, N output columns, K input columns, BM/BN/BK tile sizes.

(Over ~350 lines on purpose: the kernel, its two decodes and the launch with its config fallback are one unit; the
configs and their choice already live apart, in fp4_grouped_gemm_configs.py.)
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from minidi.formats import FP4_BLOCK, dequant_fp4

from . import fp4_grouped_gemm_hopper as hopper
from . import fp4_grouped_gemm_sm90 as sm90
from . import fp4_grouped_gemm_sm90_rs as sm90_rs
from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from .fp4_grouped_gemm_configs import (DECODES, SCALED_EP1, SCALED_EP4, SCALED_SMALL, Fp4GemmConfig,  # noqa: F401
                                       default_config, fallback_chain)
from ._triton_formats import e8m0_to_fp32
from ._grouped_tiles import e_pow2, expert_m_tiles, m_tile_rows
from ._triton_utils import cannot_run, dot, interpreting, num_sms, resolve_backend, triton_can_run

X_DTYPES = (torch.bfloat16, torch.float32)
PACKED_DTYPES = (torch.int8, torch.uint8)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


# ---- reference (oracle and fallback) -------------------------------------------------------------------------------
def fp4_dequant_ref(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed int8 [..., N, K/2] + E8M0 [..., N, K/32] -> ``dtype`` [..., N, K] (exact in fp32): the format's own
    decode, ``minidi.formats.dequant_fp4`` (the kernel's ``_decode_e2m1`` / ``_decode_e2m1_asm`` are its twins)."""
    return dequant_fp4(packed, scale, dtype)


def fp4_grouped_mm_ref(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                       offs: torch.Tensor) -> torch.Tensor:
    """Plain torch, one expert at a time in fp32 (host sync on ``offs``). Same contract as ``fp4_grouped_mm``."""
    r, n = x.shape[0], w_packed.shape[1]
    out = torch.zeros(r, n, dtype=torch.float32, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        end = max(start, min(end, r))
        if end > start:
            w = fp4_dequant_ref(w_packed[e], w_scale[e])  # [N, K] fp32
            out[start:end] = x[start:end].float() @ w.t()
        start = end
    return out.to(x.dtype)


# ---- kernel --------------------------------------------------------------------------------------------------------
@triton.jit
def _decode_e2m1(p, s, BN: tl.constexpr, BK: tl.constexpr, OUT: tl.constexpr):
    """packed uint8 [BN, BK/2] + E8M0 codes uint8 [BN, BK/32] -> weights [BN, BK] in ``OUT`` (bf16/fp32), exact.
    Twin of ``minidi.formats.dequant_fp4`` in integer/fp32 arithmetic (a kernel cannot call torch); the op tests
    hold the two equal on every code and edge scale (test_fp4_grouped_gemm.py::test_decode_matches_formats)."""
    c = p.to(tl.int32)
    c = tl.reshape(tl.join(c & 0xF, c >> 4), (BN, BK))  # [BN, BK] codes; element 2i = low nibble
    h = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)  # value * 2^-14, exact
    sf = e8m0_to_fp32(s)  # [BN, BK/32] 2^(b-127), NaN for 255
    v = tl.reshape(h.to(tl.float32) * 16384.0, (BN, BK // 32, 32)) * sf[:, :, None]
    return tl.reshape(v, (BN, BK)).to(OUT)


# e2m1 -> bf16 by byte lookups (prmt), 8 values per 32-bit register, then times the bf16 scale (fma.rn.bf16x2 with
# a -0.0 addend = exact product). $4: four packed bytes b0..b3; $5, $6: bf16x2 scales of (b0, b1), (b2, b3).
# Out: $0, $1 = low-nibble values of (b0, b1), (b2, b3); $2, $3 = high-nibble values. Nibble n_j = bits 4j..4j+3.
# Tables: value byte pairs (lo, hi) of the bf16 of 0, .5, 1, 1.5, 2, 3, 4, 6 (index = the 3 magnitude bits).
_E2M1_BF16_ASM = tl.constexpr("""
{
.reg .b32 m, s, m2, s2, la, ha, lb, hb, sa, sb, t0, t1, t2, t3, z;
mov.b32 z, 0x80008000;
and.b32 m, $4, 0x77777777;
and.b32 s, $4, 0x88888888;
shr.u32 s, s, 3;
shr.u32 m2, m, 16;
shr.u32 s2, s, 16;
prmt.b32 la, 0xC0800000, 0xC0804000, m;
prmt.b32 ha, 0x3F3F3F00, 0x40404040, m;
prmt.b32 lb, 0xC0800000, 0xC0804000, m2;
prmt.b32 hb, 0x3F3F3F00, 0x40404040, m2;
prmt.b32 sa, 0x00008000, 0, s;
prmt.b32 sb, 0x00008000, 0, s2;
or.b32 ha, ha, sa;
or.b32 hb, hb, sb;
prmt.b32 t0, la, ha, 0x6240;
prmt.b32 t1, lb, hb, 0x6240;
prmt.b32 t2, la, ha, 0x7351;
prmt.b32 t3, lb, hb, 0x7351;
fma.rn.bf16x2 $0, t0, $5, z;
fma.rn.bf16x2 $1, t1, $6, z;
fma.rn.bf16x2 $2, t2, $5, z;
fma.rn.bf16x2 $3, t3, $6, z;
}
""")


@triton.jit
def _decode_e2m1_asm(p, s, BN: tl.constexpr, BK: tl.constexpr):
    """GPU decode: packed uint8 [BN, BK/2] + E8M0 uint8 [BN, BK/32] -> bf16 [BN, BK]. E8M0 0 -> 2^-127 (the bf16
    subnormal 0x0040), 255 -> inf (so 0 * inf = NaN, others +-inf: the caller restores NaN from the scale codes)."""
    # in int32, then an explicit 16-bit cast before the bitcast: Triton 3.6 promotes uint16 op python-int to int32
    sb = tl.maximum(s.to(tl.int32) << 7, 0x40).to(tl.int16).to(tl.bfloat16, bitcast=True)  # [BN, BK/32] 2^(b-127)
    sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))  # per packed byte
    lo, hi = tl.inline_asm_elementwise(_E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r", [p, sb],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.reshape(tl.join(lo, hi), (BN, BK))


@fast_launch
@triton.jit
def _fp4_grouped_mm_kernel(
        x_ptr, w_ptr, s_ptr, offs_ptr, out_ptr,
        R, N, K, E, NUM_PROGS,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_POW2: tl.constexpr,
        SWAP: tl.constexpr, DECODE: tl.constexpr, EVEN_K: tl.constexpr, SCALE32: tl.constexpr,
        IS_FP32: tl.constexpr, INTERPRET: tl.constexpr):
    """out[r, n] = sum_k x[r, k] * W[e(r), n, k], W decoded from (w_ptr, s_ptr) in the K loop; see module doc."""
    pid = tl.program_id(0)
    starts, ends, cum, first, m_tiles = expert_m_tiles(offs_ptr, R, E, BM, E_POW2)  # see _grouped_tiles.py
    n_tiles = tl.cdiv(N, BN)
    total = m_tiles * n_tiles

    for t in range(pid, total, NUM_PROGS):
        mt = t // n_tiles
        nt = t % n_tiles
        e, m0, m_end = m_tile_rows(mt, starts, ends, cum, first, BM, E_POW2)
        rows = m0 + tl.arange(0, BM)  # [BM]
        cols = nt * BN + tl.arange(0, BN)  # [BN]
        src = tl.minimum(rows, R - 1).to(tl.int64)  # clamped: in bounds, masked at the store
        cols_ld = tl.minimum(cols, N - 1)
        e_ld = tl.minimum(e, E - 1).to(tl.int64)
        kx = tl.arange(0, BK)
        kp = tl.arange(0, BK // 2)
        ks = tl.arange(0, BK // 32)
        if SWAP:  # x^T tile [BK, BM] (the B operand), addressed directly rather than through tl.trans
            x_ptrs = x_ptr + src[None, :] * stride_xm + kx[:, None]  # [BK, BM]
        else:
            x_ptrs = x_ptr + src[:, None] * stride_xm + kx[None, :]  # [BM, BK]
        w_ptrs = w_ptr + e_ld * stride_we + cols_ld[:, None] * stride_wn + kp[None, :]  # [BN, BK/2]
        if SCALE32:  # a row's 4 scale codes of a 128-wide K chunk as one int32 (cp.async needs >= 4 bytes)
            s_ptrs = s_ptr.to(tl.pointer_type(tl.int32)) + (e_ld * stride_se + cols_ld * stride_sn) // 4  # [BN]
        else:
            s_ptrs = s_ptr + e_ld * stride_se + cols_ld[:, None] * stride_sn + ks[None, :]  # [BN, BK/32]
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        smax = tl.zeros((BN,), dtype=tl.int32)
        for k0 in range(0, K, BK):
            if EVEN_K:
                xt = tl.load(x_ptrs)
                wq = tl.load(w_ptrs)
                if SCALE32:  # the BK/32 codes of this step out of the chunk's int32 (little-endian)
                    sh = ((k0 // 32) % 4 + ks) * 8  # [BK/32]
                    ws = ((tl.load(s_ptrs + k0 // 128)[:, None] >> sh[None, :]) & 0xFF).to(tl.uint8)  # [BN, BK/32]
                else:
                    ws = tl.load(s_ptrs)
            else:
                if SWAP:
                    xt = tl.load(x_ptrs, mask=(k0 + kx < K)[:, None], other=0.0)
                else:
                    xt = tl.load(x_ptrs, mask=(k0 + kx < K)[None, :], other=0.0)
                wq = tl.load(w_ptrs, mask=(k0 // 2 + kp < K // 2)[None, :], other=0)
                ws = tl.load(s_ptrs, mask=(k0 // 32 + ks < K // 32)[None, :], other=127)
            if DECODE == 2:  # Triton's e2m1 decode (tl.dot_scaled), fast math: NaN scales restored below
                if SWAP:
                    acc = tl.dot_scaled(wq, ws, "e2m1", xt, None, "bf16", acc, fast_math=True)
                else:
                    acc = tl.dot_scaled(xt, None, "bf16", tl.trans(wq), ws, "e2m1", acc, fast_math=True)
            else:
                if DECODE == 1 and not INTERPRET:  # PTX byte-lookup decode (E8M0 255 -> inf, fixed below)
                    w = _decode_e2m1_asm(wq, ws, BN, BK)  # [BN, BK] bf16
                else:
                    w = _decode_e2m1(wq, ws, BN, BK, x_ptr.dtype.element_ty)  # [BN, BK]
                if IS_FP32:
                    if SWAP:
                        acc = tl.dot(w, xt, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
                else:
                    if SWAP:
                        acc = dot(w, xt, acc, INTERPRET)
                    else:
                        acc = dot(xt, tl.trans(w), acc, INTERPRET)
            if DECODE != 0:
                smax = tl.maximum(smax, tl.max(ws.to(tl.int32), 1))
            x_ptrs += BK
            w_ptrs += BK // 2
            if not SCALE32:
                s_ptrs += BK // 32
        row_ok = rows < m_end
        col_ok = cols < N
        if SWAP:
            if DECODE != 0:
                acc = tl.where((smax == 255)[:, None], float("nan"), acc)
            y = acc.to(out_ptr.dtype.element_ty)
            o_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]  # [BN, BM]
            tl.store(o_ptrs, y, mask=row_ok[None, :] & col_ok[:, None])
        else:
            if DECODE != 0:
                acc = tl.where((smax == 255)[None, :], float("nan"), acc)
            y = acc.to(out_ptr.dtype.element_ty)
            o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]  # [BM, BN]
            tl.store(o_ptrs, y, mask=row_ok[:, None] & col_ok[None, :])


# ---- launch (configs: fp4_grouped_gemm_configs.py) -----------------------------------------------------------------
def launch(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
           config: Fp4GemmConfig | None = None) -> None:
    """Checked tensors (unit last-dim strides): x [R, K], w_packed [E, N, K/2], w_scale [E, N, K/32], offs [E] int32,
    out [R, N] in x's dtype. Writes the rows below offs[-1] of ``out``; the rows past it are left as they are
    (torch._grouped_mm's contract). ``config``: the default's heuristic unless given (experiments pass the named
    configs of fp4_grouped_gemm_configs.py)."""
    r, k = x.shape
    e, n = w_packed.shape[:2]
    if r == 0 or n == 0:
        return
    cfg = config or default_config(r, e, n, k, x.dtype, x.device)
    if cfg.decode not in DECODES:
        raise ValueError(f"fp4_grouped_mm: decode must be one of {DECODES}, got {cfg.decode!r}")
    if cfg.decode != "manual" and x.dtype != torch.bfloat16:
        raise ValueError(f"fp4_grouped_mm: config {cfg.name()} needs bf16 x (fp32 x: decode='manual'), got {x.dtype}")
    if cfg.BK % 32 or cfg.BK < 32:
        raise ValueError(f"fp4_grouped_mm: BK must be a multiple of 32, got {cfg.BK}")
    if out.shape != (r, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"fp4_grouped_mm: out must be [{r}, {n}] {x.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    n_tiles = triton.cdiv(n, cfg.BN)
    max_tiles = (r // cfg.BM + e) * n_tiles  # bound on sum_e cdiv(rows_e, BM)
    if cfg.progs is not None:
        progs = cfg.progs
    elif x.is_cuda:
        progs = num_sms(x.device) * cfg.progs_per_sm
    else:
        progs = 4
    progs = max(1, min(progs, max_tiles))
    e_vec = e_pow2(e, interpreting())
    even_k = k % cfg.BK == 0
    scale32 = (k % 128 == 0 and cfg.BK <= 128 and w_scale.stride(0) % 4 == 0 and w_scale.stride(1) % 4 == 0
               and w_scale.data_ptr() % 4 == 0)
    _fp4_grouped_mm_kernel[(progs,)](
        x, w_packed.view(torch.uint8), w_scale.view(torch.uint8), offs, out,
        r, n, k, e, progs,
        x.stride(0), w_packed.stride(0), w_packed.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, E_POW2=e_vec, SWAP=cfg.swap, DECODE=DECODES.index(cfg.decode),
        EVEN_K=even_k, SCALE32=scale32, IS_FP32=x.dtype == torch.float32, INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


_GOOD: set[tuple] = set()  # (config, dtype, device type) that compiled and launched
_BAD: set[tuple] = set()  # ... that failed to compile/launch: never retried (a retry costs a failed compile, ~20 ms)


def _launch_with_fallback(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
                          out: torch.Tensor) -> Fp4GemmConfig:
    """Run the first config of ``fallback_chain`` that is not known to fail. A config that fails to compile or launch
    (Triton versions differ in ``dot_scaled``/inline-asm support and shared-memory use) is remembered as bad, with
    one warning, and the next known-good config runs. The last config of the chain re-raises. Returns the config."""
    r, k = out.shape[0], x.shape[1]
    chain = fallback_chain(r, w_packed.shape[0], w_packed.shape[1], k, x.dtype, x.device)
    live = [c for c in chain if (c, x.dtype, x.device.type) not in _BAD] or chain[-1:]
    for i, c in enumerate(live):
        key = (c, x.dtype, x.device.type)
        if key in _GOOD or i == len(live) - 1:
            launch(x, w_packed, w_scale, offs, out, c)
            _GOOD.add(key)
            return c
        try:
            launch(x, w_packed, w_scale, offs, out, c)
            _GOOD.add(key)
            return c
        except Exception as err:  # compile-time failure of this config only (a known-good config re-raises above)
            _BAD.add(key)
            warnings.warn(f"fp4_grouped_mm: config {c.name()} failed ({type(err).__name__}: {str(err)[-300:]}); "
                          f"falling back to {live[i + 1].name()}")
    raise AssertionError("unreachable")


def chosen_config(x: torch.Tensor, w_packed: torch.Tensor) -> Fp4GemmConfig | None:
    """The config the op runs for these shapes now (after any fallback), or None before its first launch."""
    r, k = x.shape
    for c in fallback_chain(r, w_packed.shape[0], w_packed.shape[1], k, x.dtype, x.device):
        if (c, x.dtype, x.device.type) in _GOOD:
            return c
    return None


def _check(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"fp4_grouped_mm: {what}")

    if x.dim() != 2 or x.dtype not in X_DTYPES:
        fail(f"x must be [R, K] with dtype in {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    r, k = x.shape
    if k % FP4_BLOCK:
        fail(f"x: K = {k} must be a multiple of {FP4_BLOCK} (one E8M0 scale per 32 values)")
    if w_packed.dim() != 3 or w_packed.dtype not in PACKED_DTYPES:
        fail(f"w_packed must be [E, N, K/2] int8, got {tuple(w_packed.shape)} {w_packed.dtype}")
    e, n = w_packed.shape[:2]
    if w_packed.shape[2] * 2 != k:
        fail(f"w_packed must be [E, N, K/2] = [{e}, {n}, {k // 2}] for x with K = {k}, got {tuple(w_packed.shape)}")
    if w_scale.dtype not in SCALE_DTYPES or tuple(w_scale.shape) != (e, n, k // FP4_BLOCK):
        fail(f"w_scale must be [E, N, K/32] = [{e}, {n}, {k // FP4_BLOCK}] float8_e8m0fnu, got "
             f"{tuple(w_scale.shape)} {w_scale.dtype}")
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != e:
        fail(f"offs must be [E] = [{e}] int32 (cumulative row ends), got {tuple(offs.shape)} {offs.dtype}")
    if e == 0:
        fail("w_packed has no experts (E = 0)")
    devs = {t.device for t in (x, w_packed, w_scale, offs)}
    if len(devs) != 1:
        fail(f"x, w_packed, w_scale and offs must be on one device, got {sorted(map(str, devs))}")
    if n * (k // 2) >= 2**31:
        fail(f"one expert's packed weights must hold < 2^31 bytes, got N = {n}, K = {k}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::fp4_grouped_mm")
def _fp4_grouped_mm_op(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                       offs: torch.Tensor) -> torch.Tensor:
    if not triton_can_run(x, w_packed, w_scale, offs):
        raise cannot_run("minidi::fp4_grouped_mm", x, w_packed, w_scale, offs)
    x, w_packed, w_scale = _unit_last(x), _unit_last(w_packed), _unit_last(w_scale)
    out = torch.empty(x.shape[0], w_packed.shape[1], dtype=x.dtype, device=x.device)
    offs = offs.contiguous()
    kernel = hopper.hopper_kernel()
    if kernel == "rs" and not sm90_rs.can_run(x, w_packed):
        kernel = "ws"  # (K not a multiple of 128)
    if kernel and hopper.can_run(x, w_packed):  # Hopper, bf16 x: a Gluon kernel, unless some E8M0 code would not
        # decode exactly
        launch = sm90_rs.launch_sm90_rs if kernel == "rs" else sm90.launch_sm90
        exact = hopper.codes_exact(w_scale)  # known on the host after the weight's first call
        if exact:
            launch(x, w_packed, w_scale, offs, out)
            return out
        if exact is None:  # (a CUDA graph being captured): decided on the device, both kernels launched
            fast_offs, offs = hopper.range_gate(w_scale, offs)
            launch(x, w_packed, w_scale, fast_offs, out)  # then the Triton kernel below runs no tile
    _launch_with_fallback(x, w_packed, w_scale, offs, out)
    return out


@_fp4_grouped_mm_op.register_fake
def _(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w_packed.shape[1])


# The reference behind a custom op too: its host loop over experts (``offs.tolist()``) cannot be traced, so pass D
# inserts it as one opaque call (its fake gives the shape), exactly as it inserts the kernel.
@dispatch_op("minidi::fp4_grouped_mm_ref")
def _fp4_grouped_mm_ref_op(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                           offs: torch.Tensor) -> torch.Tensor:
    return fp4_grouped_mm_ref(x, w_packed, w_scale, offs)


@_fp4_grouped_mm_ref_op.register_fake
def _(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w_packed.shape[1])


def fp4_grouped_mm(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
                   backend: str = "auto") -> torch.Tensor:
    """Grouped GEMM over experts with FP4 weights decoded in the kernel's load path.

    x [R, K] bf16 | fp32, rows sorted by expert; w_packed [E, N, K/2] int8 (two e2m1 codes per byte, element 2i in
    the low nibble); w_scale [E, N, K/32] float8_e8m0fnu; offs [E] int32, cumulative row ends (non-decreasing,
    offs[-1] <= R). Returns y [R, N] in x's dtype,
    y[r] = x[r] @ dequant(w)[e(r)].T with fp32 accumulation for r < offs[-1]; the rows past offs[-1] (other ranks'
    experts in the MoE) are not written and hold garbage, as with ``torch._grouped_mm`` (the ref backend gives
    zeros there), so that no time goes to rows nobody reads. ``backend``: "auto" (the kernel where it can run, else
    the reference), "triton" or "ref" (plain torch, one expert at a time; traceable: an opaque custom op).
    """
    _check(x, w_packed, w_scale, offs)
    if resolve_backend(backend, "fp4_grouped_mm", x, w_packed, w_scale, offs) == "ref":
        return _fp4_grouped_mm_ref_op(x, w_packed, w_scale, offs)
    return _fp4_grouped_mm_op(x, w_packed, w_scale, offs)

