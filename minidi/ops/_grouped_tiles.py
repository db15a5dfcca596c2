"""The device-side tile schedule of minidi's persistent grouped (per-expert) GEMM kernels, built from ``offs``
without a host sync: shared by ``fp4_grouped_gemm.py`` and ``fp8_grouped_gemm.py``.

Rows are sorted by expert; ``offs[e]`` is the cumulative row end of expert e (rows past ``offs[E-1]`` belong to no
local expert and own no tile). Expert e owns cdiv(rows_e, BM) m-tiles; linear tile ids run t = m_tile * n_tiles +
n_tile (n fastest: the programs running at one time share an m-tile's rows through L2).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_m_tiles(offs_ptr, R, E, BM: tl.constexpr, E_POW2: tl.constexpr):
    """Per expert (a vector of E_POW2 >= E + 1 entries): row start, row end (both clamped to [0, R]), inclusive
    cumsum of the m-tile counts and the first m-tile id; and the total count of m-tiles."""
    ei = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + ei, mask=ei < E, other=R)
    starts = tl.load(offs_ptr + ei - 1, mask=(ei >= 1) & (ei <= E), other=R)
    starts = tl.where(ei == 0, 0, starts)
    ends = tl.minimum(tl.maximum(ends, 0), R)
    starts = tl.minimum(tl.maximum(starts, 0), R)
    ntile = tl.where(ei < E, (tl.maximum(ends - starts, 0) + BM - 1) // BM, 0)
    cum = tl.cumsum(ntile, 0)
    return starts, ends, cum, cum - ntile, tl.sum(ntile, 0)


@triton.jit
def m_tile_rows(mt, starts, ends, cum, first, BM: tl.constexpr, E_POW2: tl.constexpr):
    """m-tile ``mt`` -> (its expert e, its first row, the expert's row end)."""
    ei = tl.arange(0, E_POW2)
    e = tl.sum((cum <= mt).to(tl.int32), 0)
    sel = ei == e
    m0 = tl.sum(tl.where(sel, starts, 0), 0) + (mt - tl.sum(tl.where(sel, first, 0), 0)) * BM
    return e, m0, tl.sum(tl.where(sel, ends, 0), 0)


def e_pow2(e: int, interpreting: bool) -> int:
    """The schedule's vector length: one compiled kernel for every expert count up to 511 on the GPU (the cost is a
    few 512-wide reductions); the next power of two above E in the interpreter."""
    return triton.next_power_of_2(e + 1) if interpreting else max(512, triton.next_power_of_2(e + 1))
