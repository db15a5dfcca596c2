"""minidi::fp8_fp4_grouped_mm (fq8 activations x FP4 experts on FP8 tensor cores) vs the fp64 product of the
dequantised operands, on the interpreter and the GPU.

Tolerance: every product is exact (e4m3 x e2m1 x powers of two); only the fp32 sums differ in order (and, on the
GPU, the tensor core's accumulation inside a 32-block), so fp32 output: |err| <= 1e-5 * max|ref| + 1e-5 |ref|;
bf16 output adds its one rounding (2^-9 relative; 2^-7 allowed with the fp32 slack).
"""

from __future__ import annotations

import pytest
import torch

from minidi import formats
from minidi.model.quant import quantize_fp4
from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm
from minidi.ops.fp8_grouped_gemm import (SMALL, Fp8GemmConfig, fp8_fp4_grouped_mm, fp8_fp4_grouped_mm_ref,
                                         launch)
from minidi.ops.fp8_quant import fq8_split

gpu = pytest.mark.gpu
POISON = 12345.0


def make(e, n, k, counts, extra_rows=0, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    r = sum(counts) + extra_rows
    x = (torch.randn(r, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (r, k // 32), generator=gen).float()
                                                       ).repeat_interleave(32, 1)).bfloat16()
    q, s = formats.fq8_split(x, 32)
    wp, ws = quantize_fp4(torch.randn(e, n, k, generator=gen)
                          * torch.exp2(torch.randint(-3, 3, (e, n, k // 32), generator=gen).float()
                                       ).repeat_interleave(32, 2))
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return [t.to(device) for t in (x, q, s, wp, ws, offs)]


def fp64_reference(q, s, wp, ws, offs) -> torch.Tensor:
    x = q.double().cpu() * s.double().cpu().repeat_interleave(32, 1)
    out = torch.zeros(q.shape[0], wp.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        w = formats.dequant_fp4(wp[e].cpu(), ws[e].cpu(), torch.float32).double()
        out[start:end] = x[start:end] @ w.t()
        start = max(start, end)
    return out


def assert_close(out, ref, dtype, mass=None):
    """Interpreter (``mass`` None): exact products, fp32 sums in another order. GPU: the FP8 tensor core sums each
    32-block's products in a narrower accumulator (DeepGEMM measures ~14 bits), so each element may also be off by
    2^-13 of ``mass`` = sum |x| |w| over its products (a bound that scales with the cancellation, not the result)."""
    big = ref.nan_to_num(0.0).abs().max().item() or 1.0
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    if mass is None:
        torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=1e-5 * big, equal_nan=True)
        return
    err = (out.double().cpu() - ref).abs()
    bound = rtol * ref.abs() + 2**-13 * mass + 1e-6 * big
    assert bool((err <= bound).all()), float((err / bound).max())


def abs_mass(q, s, wp, ws, offs) -> torch.Tensor:
    """sum over k of |x[r, k]| |w[e(r), n, k]|, fp64."""
    x = (q.double().cpu() * s.double().cpu().repeat_interleave(32, 1)).abs()
    out = torch.zeros(q.shape[0], wp.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ formats.dequant_fp4(wp[e].cpu(), ws[e].cpu(), torch.float32).double().abs().t()
        start = max(start, end)
    return out


def run(q, s, wp, ws, offs, dtype, cfg=None):
    out = torch.full((q.shape[0], wp.shape[1]), POISON, dtype=dtype, device=q.device)
    launch(q, s, wp, ws, offs, out, cfg)
    return out


CASES = {  # experts, N, K, rows per expert (ragged, empty experts, one row), rows past offs[-1]
    "ragged": (3, 40, 128, [5, 0, 19], 3),
    "one_row": (2, 32, 64, [1, 0], 0),
    "many_tiles": (4, 72, 192, [33, 17, 0, 40], 5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.interpreter
def test_matches_fp64_and_leaves_other_rows(case, dtype):
    e, n, k, counts, extra = CASES[case]
    x, q, s, wp, ws, offs = make(e, n, k, counts, extra, seed=len(case))
    out = run(q, s, wp, ws, offs, dtype, Fp8GemmConfig(BM=16, BN=32, BK=64 if k % 64 == 0 else 32, num_stages=1))
    end = int(offs[-1])
    assert_close(out[:end], fp64_reference(q, s, wp, ws, offs)[:end], dtype)
    assert (out[end:] == POISON).all()  # rows past offs[-1]: other ranks' experts, never written


@pytest.mark.interpreter
def test_equals_the_bf16_op_on_fq8_rows():
    """The op it replaces: fp4_grouped_mm on the fq8 rows in bf16 computes the same products."""
    x, q, s, wp, ws, offs = make(3, 64, 128, [9, 20, 3], 0, seed=7)
    y8 = fp8_fp4_grouped_mm(q, s, wp, ws, offs, torch.float32, backend="triton")
    y16 = fp4_grouped_mm((q.float() * s.repeat_interleave(32, 1)).float(), wp, ws, offs, backend="triton")
    torch.testing.assert_close(y8, y16, rtol=1e-5, atol=1e-5 * float(y16.abs().max()))


@pytest.mark.interpreter
def test_every_code_and_edge_scale():
    """All 16 e2m1 codes in every weight row, E8M0 0 (2^-127), 127, 200 and 255 (NaN: the whole output column)."""
    e, n, k = 1, 32, 64
    x, q, s, _, _, _ = make(e, n, k, [20], 0, seed=1)
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16)
    codes = codes[torch.arange(n)[:, None], (torch.arange(k)[None, :] + torch.arange(n)[:, None]) % k]
    wp = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)[None]
    ws = torch.full((e, n, k // 32), 127, dtype=torch.uint8)
    ws[0, 1, 0], ws[0, 2, 1], ws[0, 3, 0], ws[0, 4, 1] = 0, 200, 255, 130
    ws = ws.view(torch.float8_e8m0fnu)
    offs = torch.tensor([20], dtype=torch.int32)
    out = run(q, s, wp, ws, offs, torch.float32, SMALL)
    ref = fp64_reference(q, s, wp, ws, offs)
    assert torch.isnan(out[:, 3]).all() and torch.isnan(ref[:, 3]).all()
    assert_close(out, ref, torch.float32)


def test_ref_backend_and_contract():
    x, q, s, wp, ws, offs = make(3, 40, 128, [5, 0, 19], 3)
    ref = fp8_fp4_grouped_mm(q, s, wp, ws, offs, torch.float32, backend="ref")
    assert (ref[24:] == 0).all()
    assert_close(ref[:24], fp64_reference(q, s, wp, ws, offs)[:24], torch.float32)
    assert torch.equal(ref, fp8_fp4_grouped_mm_ref(q, s, wp, ws, offs, torch.float32))


def test_bad_input_is_named():
    x, q, s, wp, ws, offs = make(2, 32, 64, [3, 4])
    with pytest.raises(ValueError, match="q must be"):
        fp8_fp4_grouped_mm(x, s, wp, ws, offs)
    with pytest.raises(ValueError, match=r"s must be \[R, K/32\]"):
        fp8_fp4_grouped_mm(q, s[:, :1], wp, ws, offs)
    with pytest.raises(ValueError, match="w_packed must be"):
        fp8_fp4_grouped_mm(q, s, wp[..., :8], ws, offs)
    with pytest.raises(ValueError, match="w_scale must be"):
        fp8_fp4_grouped_mm(q, s, wp, ws[..., :1], offs)
    with pytest.raises(ValueError, match="offs must be"):
        fp8_fp4_grouped_mm(q, s, wp, ws, offs.long())
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_fp4_grouped_mm(q, s, wp, ws, offs, torch.float16)
    with pytest.raises(ValueError, match="multiple of BK"):
        launch(q, s, wp, ws, offs, torch.empty(7, 32), Fp8GemmConfig(BK=128))


@pytest.mark.interpreter
def test_opcheck():
    """Fakes and AOT dispatch. opcheck's schema check is left out: it compares the inputs before and after the
    call with a multiply ATen's CPU fp8 lacks ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn)."""
    x, q, s, wp, ws, offs = make(2, 32, 64, [3, 4])
    for op in (torch.ops.minidi.fp8_fp4_grouped_mm, torch.ops.minidi.fp8_fp4_grouped_mm_ref):
        torch.library.opcheck(op, (q, s, wp, ws, offs, torch.bfloat16),
                              test_utils=("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"))


@gpu
@pytest.mark.parametrize("counts", [[256] * 8, [0, 300, 1, 77, 0, 130, 2, 500]])
def test_gpu_full_tiles_and_ragged(counts):
    x, q, s, wp, ws, offs = make(8, 384, 512, counts, 11, seed=5, device="cuda")
    q2, s2 = fq8_split(x, 32)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    out = run(q, s, wp, ws, offs, torch.bfloat16)
    end = int(offs[-1])
    assert_close(out[:end], fp64_reference(q, s, wp, ws, offs)[:end], torch.bfloat16,
                 mass=abs_mass(q, s, wp, ws, offs)[:end])
    assert (out[end:] == POISON).all()
