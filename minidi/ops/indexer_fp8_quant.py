"""Rebase of fq4 rows onto e4m3 with one power-of-two scale per row: the operands of the FP8 indexer score
(``indexer_score_fp8.py``).

    x8, s, ok, gok = rebase_e4m3(x, group)    # x [R, D] -> x8 float8_e4m3fn [R, D], s fp32 [R], ok bool [R],
                                              #             gok bool [cdiv(R, group)]
    # s = 2^k, k the smallest integer with max|x[r]| <= 448 * 2^k (clamped to [-60, 60]), x8 = e4m3(x / s);
    # ok[r] = (x8[r] * s[r] == x[r] for every element) and |k| < 60; gok[g] = all ok of rows [g * group, ...)

Why it is exact on fq4 rows. The indexer's q and k are ``fq4_ue8m0(x, 32)``: e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6)
times a power-of-two scale 2^e_b per 32 channels. Dividing by one power of two s per row keeps every value of the
form c * 2^(e_b - k); e4m3fn holds c * 2^j exactly for |c * 2^j| <= 448 as long as the lowest set bit of c * 2^j is
>= 2^-9 (its subnormal step). With s chosen from the row's max, that holds when the row's smallest nonzero block
sits at most ~14 binades below its largest (the exact bound depends on the codes; ``tests/ops/
test_indexer_fp8_quant.py`` checks every code pair and spread against the bit-level rule). Rows where it does not
hold, or which hold NaN / Inf, get ok = False (x8 = 0, s = 1): the score kernel computes their tiles with the bf16
dot instead, so the op's result never depends on this rebase being lossy. Zero rows are exact (s = 2^-60).

Kernel: one program per ``group`` rows (the score kernel's tile: a query block's QB * H rows or a key block's BN
rows), loads in fp32, the row max, s from the max's bits (no division: 448 = 1.75 * 2^8, so k = e - 8 + (mantissa >
0.75)), x * (1 / s) (a power of two: exact), the nearest e4m3 value by exact fp32 arithmetic (``round_e4m3``), the
check, the store (hardware cvt on the GPU, the byte assembled in the interpreter, whose fp8 cast truncates).
Memory-bound: reads 2 B (bf16) and writes 1 B per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_formats import e4m3_bits, round_e4m3
from ._triton_utils import cannot_run, interpreting, resolve_backend, triton_can_run

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
K_MIN, K_MAX = -60, 60  # exponent range of s: rows outside it count as not exact (fp32 headroom in the epilogue)


@fast_launch
@triton.jit
def _rebase_kernel(x_ptr, x8_ptr, s_ptr, ok_ptr, gok_ptr, R, G, stride_x,
                   D: tl.constexpr, DP: tl.constexpr, GP: tl.constexpr, INTERPRET: tl.constexpr):
    g = tl.program_id(0)
    i = tl.arange(0, GP)
    r = g * G + i  # [GP] rows of this group
    rmask = (i < G) & (r < R)
    d = tl.arange(0, DP)
    m = rmask[:, None] & (d[None, :] < D)
    offs = r[:, None].to(tl.int64) * stride_x + d[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)  # [GP, DP]
    amax = tl.max(tl.abs(x), axis=1)  # [GP]
    ab = amax.to(tl.int32, bitcast=True)
    e = ((ab >> 23) & 0xFF) - 127  # binade of the max (-127 for 0 / fp32 subnormals; 128 for Inf / NaN)
    k = e - 8 + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)  # smallest k with amax <= 1.75 * 2^(8 + k)
    in_range = ((k > -60) & (k < 60)) | (amax == 0)  # zero rows: exact at any scale (s = 2^-60)
    k = tl.minimum(tl.maximum(k, -60), 60)
    s = ((k + 127) << 23).to(tl.float32, bitcast=True)  # [GP] 2^k
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 1 / s, exact
    v = x * inv[:, None]
    v = tl.where(v == v, v, 0.0)  # NaN -> 0 here; the check below still fails on it (0 * s != NaN)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    exact = (round_e4m3(v) * s[:, None] == x) | ~(d[None, :] < D)  # [GP, DP]
    ok = (tl.min(exact.to(tl.int32), axis=1) > 0) & in_range  # [GP]
    v = tl.where(ok[:, None], v, 0.0)
    if INTERPRET:
        tl.store(x8_ptr.to(tl.pointer_type(tl.uint8)) + offs, e4m3_bits(v).to(tl.uint8), mask=m)
    else:
        tl.store(x8_ptr + offs, v.to(tl.float8e4nv), mask=m)
    tl.store(s_ptr + r, tl.where(ok, s, 1.0), mask=rmask)
    tl.store(ok_ptr + r, ok.to(tl.int8), mask=rmask)
    tl.store(gok_ptr + g, tl.min(tl.where(rmask, ok.to(tl.int32), 1), axis=0).to(tl.int8))


def _check(x: torch.Tensor, group: int) -> None:
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"rebase_e4m3: x must be [R, D] with dtype in {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if not 1 <= x.shape[1] <= 256:
        raise ValueError(f"rebase_e4m3: D must be in [1, 256], got {x.shape[1]}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"rebase_e4m3: group must be a positive int, got {group!r}")


def _empty(x: torch.Tensor, group: int):
    r = x.shape[0]
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(r, dtype=torch.float32),
            x.new_empty(r, dtype=torch.bool), x.new_empty(triton.cdiv(r, group), dtype=torch.bool))


def _launch_rebase(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel on a checked [R, D] tensor (also called directly by the FP8 score op: no dispatch cost)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    x8, s, ok, gok = _empty(x, group)
    if x.shape[0]:
        d = x.shape[1]
        _rebase_kernel[(gok.shape[0],)](x, x8, s, ok.view(torch.int8), gok.view(torch.int8), x.shape[0], group,
                                        x.stride(0), D=d, DP=triton.next_power_of_2(d),
                                        GP=triton.next_power_of_2(group), INTERPRET=interpreting(), num_warps=4)
    return x8, s, ok, gok


@dispatch_op("minidi::rebase_e4m3")
def _rebase_op(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not triton_can_run(x):
        raise cannot_run("minidi::rebase_e4m3", x)
    return _launch_rebase(x, group)


@_rebase_op.register_fake
def _(x, group):
    return _empty(x, group)


def rebase_e4m3_ref(x: torch.Tensor, group: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    """Plain torch, float64: the contract of ``rebase_e4m3`` (the test oracle and the fallback)."""
    _check(x, group)
    x64 = x.double()
    amax = x64.abs().amax(1) if x.shape[1] else x64.new_zeros(x.shape[0])
    mant, ex = torch.frexp(amax)  # amax = mant * 2^ex, mant in [0.5, 1); 448 = 0.875 * 2^9
    k = ex - 9 + (mant > 0.875).to(ex.dtype)
    k = torch.where(amax == 0, torch.full_like(k, K_MIN), k)
    k = torch.where(amax.isfinite(), k, torch.full_like(k, K_MAX))
    in_range = (k > K_MIN) & (k < K_MAX) | (amax == 0)
    k = k.clamp(K_MIN, K_MAX)
    s = torch.ldexp(torch.ones_like(amax), k)  # [R]
    x8 = (x64 / s[:, None]).nan_to_num(0.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    ok = ((x8.double() * s[:, None]) == x64).all(1) & in_range
    x8 = torch.where(ok[:, None], x8.float(), 0.0).to(torch.float8_e4m3fn)
    s = torch.where(ok, s, 1.0).float()
    pad = -x.shape[0] % group
    gok = torch.cat([ok, ok.new_ones(pad)]).view(-1, group).all(1)
    return x8, s, ok, gok


def rebase_e4m3(x: torch.Tensor, group: int = 1, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor, torch.Tensor]:
    """x [R, D] bf16 / fp16 / fp32 -> (x8 float8_e4m3fn [R, D], s fp32 [R], ok bool [R], gok bool [cdiv(R, group)]):
    x8[r] * s[r] == x[r] exactly where ok[r] (x8 = 0, s = 1 elsewhere); gok[g] = all(ok[g * group : (g + 1) * group]).
    See the module doc. ``backend``: "auto" | "triton" | "ref" (``rebase_e4m3_ref``)."""
    _check(x, group)
    if resolve_backend(backend, "rebase_e4m3", x) == "ref":
        return rebase_e4m3_ref(x, group)
    return _rebase_op(x, group)


__all__ = ["rebase_e4m3", "rebase_e4m3_ref"]
