"""What the two Hopper (sm_90) kernels of ``minidi::fp4_grouped_mm`` share: which one the op runs, when either can
run, the E8M0 code range their exponent-exact decodes cover and its device-side gate, the launch preparation, and
the persistent tile schedule in Gluon.

- ``fp4_grouped_gemm_sm90_rs.py`` (the default, "rs"): the MMA warpgroups decode the weights into the registers of a
  register-operand wgmma;
- ``fp4_grouped_gemm_sm90.py`` ("ws"): decoder warps write the decoded weights to shared memory.

``MINIDI_FP4_GEMM_SM90`` picks one ("rs" | "ws" | "0": the Triton kernel). Weights with an E8M0 code outside
[``CODE_LO``, ``CODE_HI``] (and not 255) are handed to the Triton kernel: ``codes_exact`` reads a weight tensor's
range once on the host (one sync at its first call), so a call launches one kernel; where no sync may run (a CUDA graph
being captured) ``range_gate`` decides on the device, and both kernels are launched, one of them with no rows.
"""

from __future__ import annotations

import os

import torch
import triton

from .fp4_fold_device import code_range_gate, code_range_known
from .fp8_grouped_gemm_sm90 import HAVE_GLUON, gluon_supported

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .fp8_grouped_gemm_sm90 import _add, _sum0

BK = 64  # K per stage: one 128-byte swizzled row of bf16
CODE_LO, CODE_HI, CODE_NAN = 2, 252, 255  # E8M0 codes the exponent-exact decodes give exactly (and NaN's)
ENV = "MINIDI_FP4_GEMM_SM90"  # which kernel the op runs on sm_90: "rs" (default), "ws", "0" (Triton)
HOPPER_KERNELS = {"rs": "rs", "1": "rs", "ws": "ws", "0": None}


def hopper_kernel() -> str | None:
    """The Gluon kernel ``fp4_grouped_mm`` takes on sm_90: "rs" (``fp4_grouped_gemm_sm90_rs``: the decode in the MMA
    warps, register-operand wgmma; the default), "ws" (``fp4_grouped_gemm_sm90``: decoder warps) or None
    (``MINIDI_FP4_GEMM_SM90=0``: the Triton kernel; A/B runs, a suspected kernel bug). ``launch_sm90`` /
    ``launch_sm90_rs`` run their kernel regardless (tests, benchmarks)."""
    v = os.environ.get(ENV, "rs")
    if v not in HOPPER_KERNELS:
        raise ValueError(f"{ENV}={v!r}: expected one of {sorted(HOPPER_KERNELS)}")
    return HOPPER_KERNELS[v]


def enabled() -> bool:
    """Whether ``fp4_grouped_mm`` takes a Gluon kernel on sm_90 (``hopper_kernel`` is not None)."""
    return hopper_kernel() is not None


def can_run(x: torch.Tensor, w_packed: torch.Tensor) -> bool:
    """bf16 CUDA tensors on an sm_90 device, a tested Triton with Gluon, K a multiple of 64, at most 511 experts."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and gluon_supported()):
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    return x.shape[1] % BK == 0 and w_packed.shape[0] <= 511


def codes_exact(w_scale: torch.Tensor) -> bool | None:
    """Whether every E8M0 code decodes exactly in the Gluon kernels (in [2, 252] or 255), known on the host: once per
    weight tensor (``fp4_fold_device.code_range_known``); None where it cannot be (``range_gate`` then decides on the
    device)."""
    return code_range_known(w_scale, CODE_LO, CODE_HI)


def range_gate(w_scale: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(offs for the Hopper kernel, offs for the Triton kernel): ``offs`` and zeros when every code decodes exactly
    (in [2, 252] or 255), else the reverse (``fp4_fold_device.code_range_gate``: a cached device flag, no host
    sync)."""
    return code_range_gate(w_scale, offs, CODE_LO, CODE_HI)


def tma_ready(x: torch.Tensor, w_packed: torch.Tensor,
              w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TMA needs 16-byte aligned bases and row strides: contiguous copies where not (the scales are read by
    pointer, contiguous)."""
    x = x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.contiguous()
    w_packed = w_packed if w_packed.is_contiguous() and w_packed.data_ptr() % 16 == 0 else w_packed.contiguous()
    return x, w_packed, w_scale.contiguous()


def launch_grid(x: torch.Tensor, e: int, n: int, bm: int, bn: int, progs_per_sm: int) -> int:
    """Persistent programs: the SMs x ``progs_per_sm``, at most the tile bound (R / bm + E) x cdiv(N, bn)."""
    from ._triton_utils import num_sms

    max_tiles = (x.shape[0] // bm + e) * triton.cdiv(n, bn)
    return max(1, min(num_sms(x.device) * progs_per_sm, max_tiles))


if HAVE_GLUON:

    @gluon.jit
    def _schedule(offs_ptr, R, E, BM: gl.constexpr, E_POW2: gl.constexpr, NW: gl.constexpr):
        """Per expert (E_POW2 >= E + 1 entries): its first row (clamped to [0, R]; entry E is the last expert's end) and
        the inclusive cumsum of its m-tile counts; and the number of m-tiles. The FP8 kernel's ``_expert_tiles`` with
        two vectors instead of four (registers: the MMA warpgroups hold them beside a 128-register accumulator)."""
        lay: gl.constexpr = gl.BlockedLayout([E_POW2 // (32 * NW)], [32], [NW], [0])
        ei = gl.arange(0, E_POW2, layout=lay)
        ends = gl.minimum(gl.maximum(gl.load(offs_ptr + ei, mask=ei < E, other=R), 0), R)
        starts = gl.load(offs_ptr + ei - 1, mask=(ei >= 1) & (ei <= E), other=R)
        starts = gl.minimum(gl.maximum(gl.where(ei == 0, 0, starts), 0), R)
        ntile = gl.where(ei < E, (gl.maximum(ends - starts, 0) + BM - 1) // BM, 0)
        return starts, gl.associative_scan(ntile, 0, _add), _sum0(ntile)

    @gluon.jit
    def _rows(mt, starts, cum, BM: gl.constexpr, E_POW2: gl.constexpr, NW: gl.constexpr):
        """m-tile ``mt`` -> (its expert, its first row, the expert's row end)."""
        lay: gl.constexpr = gl.BlockedLayout([E_POW2 // (32 * NW)], [32], [NW], [0])
        ei = gl.arange(0, E_POW2, layout=lay)
        e = _sum0((cum <= mt).to(gl.int32))
        first = _sum0(gl.where(ei == e - 1, cum, 0))  # m-tiles of the experts before e
        m0 = _sum0(gl.where(ei == e, starts, 0)) + (mt - first) * BM
        return e, m0, _sum0(gl.where(ei == e + 1, starts, 0))

    # A scalar form of the same schedule: the vectors above cost a one-warp loader 16 registers each (E_POW2 = 512
    # over 32 lanes), which the MMA partition wants (setmaxnreg shares one budget), and ``_rows``'s reductions cost
    # the MMA partition barriers each tile. The walk reads offs with scalar loads as the tile ids grow.

    @gluon.jit
    def _clamped_end(offs_ptr, e, R):
        """Row end of expert e, clamped to [0, R] (``_schedule``'s ends)."""
        return gl.minimum(gl.maximum(gl.load(offs_ptr + e), 0), R)

    @gluon.jit
    def _m_tile_count(offs_ptr, R, E, BM: gl.constexpr, NW: gl.constexpr):
        """``_schedule``'s m-tile count, 32 NW experts at a time (registers: one element of a vector per thread)."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        total = 0
        for e0 in range(0, E, 32 * NW):
            ei = e0 + gl.arange(0, 32 * NW, layout=lay)
            ends = gl.minimum(gl.maximum(gl.load(offs_ptr + ei, mask=ei < E, other=R), 0), R)
            starts = gl.load(offs_ptr + ei - 1, mask=(ei >= 1) & (ei < E), other=0)
            starts = gl.minimum(gl.maximum(starts, 0), R)
            total += _sum0(gl.where(ei < E, (gl.maximum(ends - starts, 0) + BM - 1) // BM, 0))
        return total

    @gluon.jit
    def _walk(mt, e, first, lo, hi, offs_ptr, R, E, BM: gl.constexpr):
        """Advance the walk state (expert e, its first m-tile id, its clamped rows [lo, hi)) to m-tile ``mt`` (not
        before the state's): the same (e, first row, row end) as ``_rows``, with scalar loads. Returns (e, m0,
        m_end, first, lo, hi)."""
        while (mt >= first + (gl.maximum(hi - lo, 0) + BM - 1) // BM) & (e < E - 1):
            first += (gl.maximum(hi - lo, 0) + BM - 1) // BM
            e += 1
            lo = hi
            hi = _clamped_end(offs_ptr, e, R)
        return e, lo + (mt - first) * BM, hi, first, lo, hi


__all__ = ["BK", "CODE_HI", "CODE_LO", "CODE_NAN", "ENV", "HOPPER_KERNELS", "can_run", "enabled", "gluon_supported",
           "codes_exact", "hopper_kernel", "launch_grid", "range_gate", "tma_ready"]
