"""MoE expert activation on the local rows only: clipped SwiGLU x routing weight -> activation dtype -> fq8.

The model computes, over all R dispatched rows (``minidi.model.moe.RoutedExperts.forward``)::

    g, v = g.float().clamp(max=L), v.float().clamp(-L, L)      # [R, I] from the w1 / w3 grouped GEMMs
    a = (silu(g) * v * ws).to(dtype)                            # ws [R, 1] fp32: each row's routing weight
    a = fq8(a, block)                                           # with fake quant: e4m3 per ``block`` channels

but only the rows below offs[-1] (this rank's experts) are ever read again: the w2 grouped GEMM skips the others and
the combine masks them. At emulated EP4 that is a quarter of the rows. ``moe_activation(g, v, ws, offs, ...)``
computes those rows and leaves the rest unwritten (as ``fp4_grouped_mm`` does).

Inserted by pass H (``minidi/passes/rewrite_moe_activation.py``).

Kernel: [BR rows, NB x BLOCK channels] tiles (BLOCK = the fq8 block, NB of them: 128 columns), walked on the GPU by a
fixed set of programs (``WALK_PER_SM`` per SM, ``_triton_utils.walk_grid``) up to offs[-1] (read on the device, no
host sync), so no program is launched for the other ranks' rows; ``walk_per_sm=None``: one program per tile, those
past offs[-1] returning at once. At the V4.1 EP4 shape (H100, round 26, ``bench_moe_small_ops.py --only H``) the
walk with 32 programs per SM took 0.162 ms against 0.198 for one program per tile (three quarters of them empty)
and 0.160 with only the local rows launched; in the full step 6.43 against 8.04 ms. In the tile:
- SwiGLU in fp32;
- one rounding to the output dtype;
- the block's amax;
- the power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)), with a correctly rounded division and exact bit
  arithmetic;
- e4m3 round-to-nearest-even by adding and subtracting 2^(e + 20). e is the value's binade, at least -6 (the
  subnormal step 2^-9), so the step is 2^(e-3). This gives the same grid as torch's cast to float8_e4m3fn after the
  clamp to +-448, on any hardware.

A NaN input stays NaN: the rest of its block is scaled by the block's finite amax. torch's fq8 turns the whole block
into garbage there.

SiLU uses ``exp``, whose last fp32 bit may differ from torch's. After rounding to bf16 that changes a value only in
rare cases, and then the e4m3 pick moves by at most one step. Tests bound this.

Bytes at V4.1-Flash EP4 (R 98,304 rows, 1/4 local, I 2,304, bf16):
- reads: g and v of the local rows, 2 x 24,576 x 2,304 x 2 = 226 MB;
- writes: 113 MB;
- the whole-R Inductor chain moves about 4x that.

Legend: R rows (sorted by expert), I expert width, E local experts, BR rows per program.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minidi.formats import E4M3_MAX, fq8_split as fq8_split_ref, pow2_ceil

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_formats import pow2_ceil as pow2_ceil_k
from ._triton_formats import e4m3_bits, round_e4m3
from ._triton_utils import (cannot_run, interpreting, local_row_count, resolve_backend, round_bf16, triton_can_run,
                            walk_grid)

AMAX_FLOOR = 1e-4  # fq8's amax floor (``minidi.model.quant.fq8``)
TILE_COLS = 128  # columns of a program's tile on the GPU and in the interpreter: NB = TILE_COLS / block fq8 blocks
# (16 rows x 128 columns on 2 warps on the GPU: of the round-20 H200 sweep at the V4.1 EP4 shape, R 98,304 rows,
# 24,576 local, I 2,304, the fastest, 0.120 ms against 0.157 for 16 x 256 on 4 warps with a division by the scale;
# docs/benchmarks/h200_round20/bench_moe_activation_sweep.json)
WALK_PER_SM: int | None = 32  # programs per SM walking the tiles (``walk_grid``; None: one program per tile). Of 4,
# 8, 16, 32 at the V4.1 EP4 shape (H100, round 26) 32 was fastest: 0.162 ms, 0.170 at 8, 0.245 at 4
OUT_DTYPES = (torch.bfloat16, torch.float32)
_E4M3_MAX_K = tl.constexpr(E4M3_MAX)  # the kernel's copies: Triton 3.6 jit reads only constexpr globals
_AMAX_FLOOR_K = tl.constexpr(AMAX_FLOOR)


# ---- reference -----------------------------------------------------------------------------------------------------
def moe_activation_ref(g: torch.Tensor, v: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, limit: float,
                       block: int | None) -> torch.Tensor:
    """Plain torch on every row (rows past offs[-1] come out computed, not garbage): the same ops as the model's
    ``swiglu_clipped`` and ``quant.fq8`` (a test holds the two equal)."""
    a = (F.silu(g.float().clamp(max=limit)) * v.float().clamp(-limit, limit) * ws).to(g.dtype)
    if not block:
        return a
    blocks, s = _blocks_and_scales(a, block)
    q = (blocks / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.flatten(-2).to(g.dtype)


def _blocks_and_scales(a: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a [..., I] -> fp32 blocks [..., I/block, block] and each block's fq8 scale 2^ceil(log2(max(amax, floor)/448))
    [..., I/block, 1], exact."""
    blocks = a.float().unflatten(-1, (a.shape[-1] // block, block))
    return blocks, pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR) / E4M3_MAX)


def grid_step(ref: torch.Tensor, block: int | None) -> torch.Tensor:
    """Per element of a ``moe_activation`` result, the step of the grid it was rounded to (fp32): one e4m3 step
    (2^-3 relative, and at least the subnormal step 2^-9 x the block's scale) with fake quant, one bf16 ulp
    (2^-7 relative) without. Where exp's last bit differs from torch's, the two results differ by at most this."""
    if not block:
        return ref.float().abs() * 2.0**-7
    blocks, s = _blocks_and_scales(ref, block)
    return torch.maximum(blocks.abs() * 2.0**-3, s * 2.0**-9).flatten(-2)


# ---- kernel --------------------------------------------------------------------------------------------------------
@triton.jit
def _activation_tile(g_ptr, v_ptr, w_ptr, out_ptr, s_ptr, I, n_rows, stride_g, stride_v, stride_w, stride_o,
                     stride_s, limit, r0, ct, BR: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                     QUANT: tl.constexpr, ROUND_BF16: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows r0 .. r0 + BR - 1 (those below n_rows) x column tile ct (NB fq8 blocks of BLOCK columns)."""
    rows = r0 + tl.arange(0, BR)
    blk = ct * NB + tl.arange(0, NB)  # [NB] the tile's fq8 blocks (column groups of BLOCK)
    cols = blk[None, :, None] * BLOCK + tl.arange(0, BLOCK)[None, None, :]  # [1, NB, BLOCK]
    rm = rows < n_rows
    m = rm[:, None, None] & (cols < I)  # [BR, NB, BLOCK]
    r64 = rows.to(tl.int64)[:, None, None]
    g = tl.load(g_ptr + r64 * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + r64 * stride_v + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows.to(tl.int64) * stride_w, mask=rm, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    v = tl.minimum(tl.maximum(v, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                   propagate_nan=tl.PropagateNan.ALL)
    h = g / (1.0 + tl.exp(-g)) * v * w[:, None, None]  # silu(g) * v * weight, fp32
    if ROUND_BF16:
        h = round_bf16(h)  # the model's .to(dtype)
    if QUANT:
        amax = tl.max(tl.where(m & (h == h), tl.abs(h), 0.0), axis=2)  # [BR, NB], over the finite values
        s = pow2_ceil_k(tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR_K), _E4M3_MAX_K))  # [BR, NB] powers of 2
        y = h * tl.math.div_rn(1.0, s)[:, :, None]  # s a power of two: 1 / s and the product are exact, so this
        # is h / s correctly rounded (the division per element cost 16 % of the kernel's time on the H200)
        y = tl.minimum(tl.maximum(y, -_E4M3_MAX_K), _E4M3_MAX_K)
        if SPLIT:  # the e4m3 values and the block's scale (fq8_split's operands), not their product
            o_ptrs = out_ptr + r64 * stride_o + cols
            if INTERPRET:  # the interpreter's fp32 -> fp8 cast truncates: the byte by exact arithmetic
                b = tl.where(h != h, 0x7F, e4m3_bits(y))  # a NaN input stays NaN (the byte 0x7F)
                tl.store(o_ptrs.to(tl.pointer_type(tl.uint8)), b.to(tl.uint8), mask=m)
            else:  # cvt.rn.satfinite: round_e4m3's grid and ties; a NaN input stays NaN
                tl.store(o_ptrs, tl.where(h != h, h, y).to(tl.float8e4nv), mask=m)
            tl.store(s_ptr + rows.to(tl.int64)[:, None] * stride_s + blk[None, :], s,
                     mask=rm[:, None] & (blk * BLOCK < I)[None, :])
        else:
            h = tl.where(h != h, h, round_e4m3(y) * s[:, :, None])  # a NaN input stays NaN
    if not SPLIT:
        tl.store(out_ptr + r64 * stride_o + cols, h.to(out_ptr.dtype.element_ty), mask=m)


@fast_launch
@triton.jit
def _moe_activation_kernel(
        g_ptr, v_ptr, w_ptr, offs_ptr, out_ptr, s_ptr,
        R, I, E, NCT, stride_g, stride_v, stride_w, stride_o, stride_s, limit,
        BR: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, ROUND_BF16: tl.constexpr,
        SPLIT: tl.constexpr, INTERPRET: tl.constexpr, WALK: tl.constexpr):
    n_rows = local_row_count(offs_ptr, E, R)
    if WALK:  # a fixed set of programs walks the local tiles (row tile tile // NCT, column tile tile % NCT)
        for tile in range(tl.program_id(0), tl.cdiv(n_rows, BR) * NCT, tl.num_programs(0)):
            _activation_tile(g_ptr, v_ptr, w_ptr, out_ptr, s_ptr, I, n_rows, stride_g, stride_v, stride_w, stride_o,
                             stride_s, limit, (tile // NCT) * BR, tile % NCT, BR, NB, BLOCK, QUANT, ROUND_BF16, SPLIT,
                             INTERPRET)
    else:  # one program per tile; a tile past this rank's rows returns at once
        r0 = tl.program_id(0) * BR
        if r0 < n_rows:
            _activation_tile(g_ptr, v_ptr, w_ptr, out_ptr, s_ptr, I, n_rows, stride_g, stride_v, stride_w, stride_o,
                             stride_s, limit, r0, tl.program_id(1), BR, NB, BLOCK, QUANT, ROUND_BF16, SPLIT,
                             INTERPRET)


def _check(g, v, ws, offs, block) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"moe_activation: {what}")

    if g.dim() != 2 or g.dtype not in OUT_DTYPES:
        fail(f"g must be [R, I] bf16/fp32, got {tuple(g.shape)} {g.dtype}")
    if v.shape != g.shape or v.dtype != g.dtype:
        fail(f"v must match g {tuple(g.shape)} {g.dtype}, got {tuple(v.shape)} {v.dtype}")
    r, i = g.shape
    if ws.dtype != torch.float32 or ws.numel() != r or not (ws.dim() == 1 or ws.shape == (r, 1)):
        fail(f"ws must be [R] or [R, 1] float32 with R = {r}, got {tuple(ws.shape)} {ws.dtype}")
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.numel() == 0:
        fail(f"offs must be [E] int32 with E >= 1 (cumulative row ends), got {tuple(offs.shape)} {offs.dtype}")
    if block is not None and (block <= 0 or i % block or block & (block - 1)):
        fail(f"block must be a power of two dividing I = {i}, got {block}")
    devs = {t.device for t in (g, v, ws, offs)}
    if len(devs) != 1:
        fail(f"g, v, ws and offs must be on one device, got {sorted(map(str, devs))}")


@dispatch_op("minidi::moe_activation")
def _moe_activation_op(g: torch.Tensor, v: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, limit: float,
                       block: int) -> torch.Tensor:
    """block 0: no fake quant."""
    if not triton_can_run(g, v, ws, offs):
        raise cannot_run("minidi::moe_activation", g, v, ws, offs)
    g, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, v))
    out = torch.empty_like(g)
    launch(g, v, ws, offs, limit, block, out, walk_per_sm=WALK_PER_SM)
    return out


def _blocks_a_tile(i: int, width: int) -> int:
    """NB: the tile's column groups of ``width`` (TILE_COLS wide, fewer for a narrow I)."""
    return max(1, min(TILE_COLS // width, triton.next_power_of_2(triton.cdiv(i, width))))


def gpu_tile(i: int, width: int) -> tuple[int, int, int]:
    """(BR rows, NB column groups, warps) of the GPU launch for I columns in groups of ``width``."""
    return 16, _blocks_a_tile(i, width), 2


def launch(g: torch.Tensor, v: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, limit: float, block: int,
           out: torch.Tensor, scales: torch.Tensor | None = None, walk_per_sm: int | None = None) -> None:
    """Checked tensors with unit column strides (``block`` 0: no fake quant). Writes the rows of ``out`` below
    offs[-1] only (tests pass a poisoned ``out``). With ``scales`` [R, I / block] fp32 (and ``block``): ``out`` is
    float8_e4m3fn and receives the e4m3 values, ``scales`` each block's power-of-two scale. ``walk_per_sm``: the
    launch's form (``walk_grid``)."""
    r, i = g.shape
    if r == 0 or i == 0:
        return
    ws = ws.reshape(-1)
    width = block if block else min(128, triton.next_power_of_2(i))  # one fq8 block (or 128 columns), NB a tile
    br, nb, warps = gpu_tile(i, width) if g.is_cuda else (8, _blocks_a_tile(i, width), 4)
    nct = triton.cdiv(i, width * nb)
    grid, walk = walk_grid(triton.cdiv(r, br), nct, g.device, walk_per_sm)
    split = scales is not None
    s_arg = scales if split else out
    _moe_activation_kernel[grid](
        g, v, ws, offs, out, s_arg, r, i, offs.numel(), nct, g.stride(0), v.stride(0), ws.stride(0), out.stride(0),
        s_arg.stride(0), float(limit), BR=br, NB=nb, BLOCK=width, QUANT=bool(block),
        ROUND_BF16=g.dtype == torch.bfloat16, SPLIT=split, INTERPRET=interpreting(), WALK=walk, num_warps=warps)


@_moe_activation_op.register_fake
def _(g, v, ws, offs, limit, block):
    return torch.empty_like(g)


def moe_activation(g: torch.Tensor, v: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, limit: float,
                   block: int | None, backend: str = "auto") -> torch.Tensor:
    """a [R, I] in g's dtype: ``fq8((silu(min(g, L)) * clamp(v, -L, L) * ws).to(dtype), block)`` (no fq8 when
    ``block`` is None) for the rows below offs[-1]; the rows past it are not written (garbage), as with the grouped
    GEMMs around it. g, v [R, I] bf16 | fp32; ws [R] or [R, 1] fp32; offs [E] int32 cumulative row ends.
    ``backend``: "auto" (the kernel where it can run, else the reference), "triton" or "ref" (plain torch, every row
    computed)."""
    _check(g, v, ws, offs, block)
    if resolve_backend(backend, "moe_activation", g, v, ws, offs) == "ref":
        return moe_activation_ref(g, v, ws.reshape(-1, 1), offs, limit, block)
    return _moe_activation_op(g, v, ws, offs, float(limit), int(block or 0))


# ---- the FP8 GEMM's operands: e4m3 values and scales instead of their product ----------------------------------
def moe_activation_fp8_ref(g: torch.Tensor, v: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, limit: float,
                           block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch on every row: ``fq8_split`` of ``moe_activation_ref``'s activation before its fq8 (q * s is that
    fq8 exactly)."""
    return fq8_split_ref(moe_activation_ref(g, v, ws, offs, limit, None), block)


@dispatch_op("minidi::moe_activation_fp8")
def _moe_activation_fp8_op(g: torch.Tensor, v: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, limit: float,
                           block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not triton_can_run(g, v, ws, offs):
        raise cannot_run("minidi::moe_activation_fp8", g, v, ws, offs)
    g, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, v))
    q = torch.empty(g.shape, dtype=torch.float8_e4m3fn, device=g.device)
    s = torch.empty(g.shape[0], g.shape[1] // block, dtype=torch.float32, device=g.device)
    launch(g, v, ws, offs, limit, block, q, s, walk_per_sm=WALK_PER_SM)
    return q, s


@_moe_activation_fp8_op.register_fake
def _(g, v, ws, offs, limit, block):
    return g.new_empty(g.shape, dtype=torch.float8_e4m3fn), g.new_empty(g.shape[0], g.shape[1] // block,
                                                                         dtype=torch.float32)


def moe_activation_fp8(g: torch.Tensor, v: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, limit: float,
                       block: int = 32, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_activation`` with fake quant, as the FP8 GEMM's operands: (q float8_e4m3fn [R, I], s fp32
    [R, I / block]) with q * s = ``moe_activation(g, v, ws, offs, limit, block)`` (the same values, bit for bit) for
    the rows below offs[-1]; the rows past it are not written. ``backend`` as ``moe_activation``'s."""
    if not isinstance(block, int) or isinstance(block, bool):
        raise ValueError(f"moe_activation_fp8: block must be an int (the fq8 block), got {block!r}")
    _check(g, v, ws, offs, block)
    if resolve_backend(backend, "moe_activation_fp8", g, v, ws, offs) == "ref":
        return moe_activation_fp8_ref(g, v, ws.reshape(-1, 1), offs, limit, block)
    return _moe_activation_fp8_op(g, v, ws, offs, float(limit), int(block))
