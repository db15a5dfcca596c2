"""The routed experts' GEMMs on FP8 tensor cores, as pass L inserts them: each fq8 activation handed to the grouped
GEMM as its e4m3 values and power-of-two scales (``q * s`` is the fq8 value, bit for bit), so that the products are
those of the bf16 path (``fp4_grouped_mm`` on the fq8 values) and only the fp32 summation differs.

Up (w1 / w3; the model's ``x = fq8(x); xs = x[idx]``, after passes D and I)::

    q, s = fq8_split(x, block)                 # per token, [T, D]: k times fewer rows than the gathered ones
    qg, sg = gather_rows(q, idx, offs), gather_rows(s, idx, offs)     # local rows only, 1 + 4 / 32 bytes a value
    y_i = fp8_fp4_grouped_mm(qg, sg, packed_i, scale_i, offs)         # one per weight stack that reads the rows

Down (w2; pass H's ``moe_activation`` with fake quant)::

    q, s = moe_activation_fp8(g, v, ws, offs, limit, block)            # the activation's epilogue emits q and s
    y = fp8_fp4_grouped_mm(q, s, packed, scale, offs)

The GEMM takes one scale per 32 along K; an fq8 block of 64 or 128 repeats its scale (exact). Rows past offs[-1] are
never written, as in the ops these replace.

On sm_90 the same exact products go to bf16 tensor cores instead, measured faster (``bf16_route``;
``MINIDI_EXPERTS_ROUTE=bf16`` / ``fp8`` forces either): the fq8 values are bf16 numbers, and
``fp4_grouped_mm``'s register-operand kernel (``fp4_grouped_gemm_sm90_rs``) needs no per-32 promotion. Up:
``gather_rows_fq8`` (each local row read once and written as its fq8 values in bf16: one kernel where fq8_split, an
elementwise q * s and the gather were three); down: pass H's ``moe_activation`` (the fq8 values in bf16).
"""

from __future__ import annotations

import os

import torch

from . import fp4_grouped_gemm_hopper as hopper
from . import fp4_grouped_gemm_sm90_rs as sm90_rs
from .fp4_grouped_gemm import fp4_grouped_mm
from .fp8_grouped_gemm import fp8_fp4_grouped_mm
from .fp8_quant import fq8_split
from .moe_activation import moe_activation, moe_activation_fp8
from .moe_gather import gather_rows, gather_rows_fq8

GEMM_BLOCK = 32  # the FP8 GEMM's activation scale block along K (= the FP4 weights' block)
ROUTE_ENV = "MINIDI_EXPERTS_ROUTE"  # "auto" (default) | "bf16" | "fp8": which kernel runs the experts on sm_90
# "auto" takes the bf16 kernel wherever it runs: with its chunked tiles (round 25, H100, docs/ops/fp4_grouped_gemm.md)
# 1.23-1.45x the FP8 kernel at EP4 (96 experts) and 1.04-1.27x at EP1 (384: until round 24 the FP8 kernel was as fast
# or faster there, and "auto" kept it above 192 local experts)


def bf16_route(x: torch.Tensor, w_packed: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the experts' GEMMs take ``fp4_grouped_mm`` on the fq8 values in bf16: bf16 activations and output on
    an sm_90 device whose op runs the register-operand kernel (route "auto"); ``MINIDI_EXPERTS_ROUTE=bf16`` / ``fp8``
    forces either."""
    route = os.environ.get(ROUTE_ENV, "auto")
    if route not in ("auto", "bf16", "fp8"):
        raise ValueError(f"{ROUTE_ENV}={route!r}: expected 'auto', 'bf16' or 'fp8'")
    if route == "fp8":
        return False
    return x.dtype == out_dtype == torch.bfloat16 and hopper.hopper_kernel() == "rs" and sm90_rs.can_run(x, w_packed)


def _per_gemm_block(s: torch.Tensor, block: int) -> torch.Tensor:
    """Scales per ``block`` -> per 32 (each repeated block / 32 times): the same products, exactly."""
    return s if block == GEMM_BLOCK else s.repeat_interleave(block // GEMM_BLOCK, dim=-1)


def _check_block(block: int, where: str) -> None:
    if not isinstance(block, int) or block < GEMM_BLOCK or block % GEMM_BLOCK:
        raise ValueError(f"{where}: the fq8 block must be a multiple of {GEMM_BLOCK} (the GEMM's scale block), "
                         f"got {block!r}")


def fp8_experts_up(x: torch.Tensor, idx: torch.Tensor, offs: torch.Tensor, block: int,
                   packed: list[torch.Tensor], scales: list[torch.Tensor], out_dtype: torch.dtype,
                   backend: str = "auto") -> list[torch.Tensor]:
    """[fp4_grouped_mm(fq8(x, block)[idx], packed[i], scales[i], offs) for i] with the GEMMs on FP8 tensor cores.
    x [T, D] bf16 | fp32 (the tokens before fq8); idx [R] the token of each sorted row; offs [E] int32. Returns one
    [R, N_i] ``out_dtype`` tensor per weight stack, rows past offs[-1] unwritten."""
    _check_block(block, "fp8_experts_up")
    if len(packed) != len(scales) or not packed:
        raise ValueError(f"fp8_experts_up: packed and scales must be non-empty lists of one length, got "
                         f"{len(packed)} and {len(scales)}")
    if bf16_route(x, packed[0], out_dtype):  # the fq8 values as bf16 rows, quantised as they are gathered
        rows = gather_rows_fq8(x, idx, offs, block, backend=backend)
        return [fp4_grouped_mm(rows, p, sc, offs, backend=backend) for p, sc in zip(packed, scales)]
    q, s = fq8_split(x, block, backend=backend)
    qg = gather_rows(q, idx, offs, backend=backend)
    sg = gather_rows(_per_gemm_block(s, block), idx, offs, backend=backend)
    return [fp8_fp4_grouped_mm(qg, sg, p, sc, offs, out_dtype, backend=backend) for p, sc in zip(packed, scales)]


def fp8_experts_down(g: torch.Tensor, v: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, limit: float,
                     block: int, packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                     backend: str = "auto") -> torch.Tensor:
    """fp4_grouped_mm(moe_activation(g, v, ws, offs, limit, block), packed, scale, offs) with the GEMM on FP8
    tensor cores: [R, N] ``out_dtype``, rows past offs[-1] unwritten."""
    _check_block(block, "fp8_experts_down")
    if bf16_route(g, packed, out_dtype):
        return fp4_grouped_mm(moe_activation(g, v, ws, offs, limit, block, backend=backend), packed, scale, offs,
                              backend=backend)
    q, s = moe_activation_fp8(g, v, ws, offs, limit, block, backend=backend)
    return fp8_fp4_grouped_mm(q, _per_gemm_block(s, block), packed, scale, offs, out_dtype, backend=backend)
