"""Pass L's ops: the expert GEMMs on FP8 (``minidi.ops.fp8_experts``) against the bf16-path composition they replace
(fq8 -> gather -> fp4_grouped_mm; moe_activation -> fp4_grouped_mm) and an fp64 product, their pieces
(``moe_activation_fp8``, the e4m3 row gather, the device-side weight fold), on the interpreter and the GPU.

Tolerance (as test_fp8_grouped_gemm.py): the products are the bf16 path's, exactly; the fp32 sums differ in order,
so fp32 output 1e-5 relative (+ 1e-5 of the largest), bf16 output one rounding more (2^-7 allowed)."""

from __future__ import annotations

import pytest
import torch

from minidi.model.quant import fq8, quantize_fp4
from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm
from minidi.ops import fp8_experts
from minidi.ops.fp8_experts import fp8_experts_down, fp8_experts_up
from minidi.ops.fp4_fold_device import cached_fold_rows, fold_gate
from minidi.ops.fp8_grouped_gemm_sm90 import fold_fp4_rows
from minidi.ops.moe_activation import moe_activation, moe_activation_fp8
from minidi.ops.moe_gather import gather_rows

gpu = pytest.mark.gpu
POISON = 12345.0


def weights(e, n, k, gen):
    w = torch.randn(e, n, k, generator=gen) * torch.exp2(torch.randint(-3, 3, (e, n, k // 32), generator=gen).float()
                                                         ).repeat_interleave(32, 2)
    return quantize_fp4(w)


def tokens(t, d, gen, dtype):
    scale = torch.exp2(torch.randint(-6, 6, (t, d // 32), generator=gen).float()).repeat_interleave(32, 1)
    return (torch.randn(t, d, generator=gen) * scale).to(dtype)


def close(out, ref, dtype, mass=None):
    """Interpreter: exact products, fp32 sums in another order. GPU (``mass`` given): the FP8 tensor core also sums
    each 32-block's products in a narrower accumulator, so each element may be off by 2^-13 of ``mass`` = the sum of
    |x| |w| over its products (as test_fp8_grouped_gemm.py)."""
    big = float(ref.abs().max()) or 1.0
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    if mass is None:
        torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), rtol=rtol, atol=1e-5 * big)
        return
    err = (out.double().cpu() - ref.double().cpu()).abs()
    bound = rtol * ref.double().cpu().abs() + 2**-13 * mass.double().cpu() + 1e-6 * big
    assert bool((err <= bound).all()), float((err / bound).max())


def abs_weights(packed):
    """The e2m1 codes with their sign bits cleared (|w|, same scales)."""
    return (packed.view(torch.uint8) & 0x77).view(torch.int8)


UP_CASES = {  # tokens, D, N (per stack), experts, rows per expert, rows past offs[-1], fq8 block
    "ragged": (7, 64, 40, 3, [5, 0, 6], 3, 32),
    "block128": (5, 128, 32, 2, [4, 5], 1, 128),
    "one_row": (2, 64, 32, 2, [1, 0], 3, 32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(UP_CASES))
def test_up_equals_the_bf16_path(case, dtype):
    t, d, n, e, counts, extra, block = UP_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    x = tokens(t, d, gen, dtype)
    r = sum(counts) + extra
    idx = torch.randint(0, t, (r,), generator=gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    stacks = [weights(e, n, d, gen) for _ in range(2)]
    ys = fp8_experts_up(x, idx, offs, block, [p for p, _ in stacks], [s for _, s in stacks], dtype)
    end = int(offs[-1])
    xs = fq8(x, block)[idx]  # the naive path: fq8 per token, every row gathered, the bf16 GEMM's input
    for y, (p, s) in zip(ys, stacks):
        assert y.shape == (r, n) and y.dtype == dtype
        want = fp4_grouped_mm(xs.float(), p, s, offs, backend="ref")  # fp32 sums of the same products
        close(y[:end], want[:end], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_equals_the_bf16_path(dtype):
    gen = torch.Generator().manual_seed(5)
    r, i, n, e = 13, 64, 48, 3
    g = (torch.randn(r, i, generator=gen) * 4).to(dtype)
    v = torch.randn(r, i, generator=gen).to(dtype)
    ws = torch.rand(r, 1, generator=gen)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # rows 10..12: other ranks' experts
    p, s = weights(e, n, i, gen)
    y = fp8_experts_down(g, v, ws, offs, 7.0, 32, p, s, dtype)
    a = moe_activation(g, v, ws, offs, 7.0, 32, backend="ref")
    want = fp4_grouped_mm(a.float(), p, s, offs, backend="ref")
    close(y[:10], want[:10], dtype)


def test_route_switch(monkeypatch):
    """The bf16 route needs bf16 in and out and sm_90's register-operand kernel (never taken on the CPU); a bad
    value of the switch is named."""
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    wp = torch.zeros(2, 8, 64, dtype=torch.int8)
    monkeypatch.delenv(fp8_experts.ROUTE_ENV, raising=False)
    assert fp8_experts.bf16_route(x, wp, torch.bfloat16) is False  # CPU tensors
    monkeypatch.setenv(fp8_experts.ROUTE_ENV, "fp8")
    assert fp8_experts.bf16_route(x, wp, torch.bfloat16) is False
    monkeypatch.setenv(fp8_experts.ROUTE_ENV, "bf16")
    assert fp8_experts.bf16_route(x, wp, torch.bfloat16) is False
    monkeypatch.setenv(fp8_experts.ROUTE_ENV, "fp16")
    with pytest.raises(ValueError, match="MINIDI_EXPERTS_ROUTE='fp16'"):
        fp8_experts.bf16_route(x, wp, torch.bfloat16)


def test_bad_block_is_named():
    gen = torch.Generator().manual_seed(0)
    x = tokens(4, 64, gen, torch.float32)
    p, s = weights(2, 32, 64, gen)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8_experts_up(x, torch.arange(4), offs, 16, [p], [s], torch.float32)
    with pytest.raises(ValueError, match="non-empty lists"):
        fp8_experts_up(x, torch.arange(4), offs, 32, [p], [], torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8_experts_down(x, x, torch.ones(4, 1), offs, 7.0, 48, p, s, torch.float32)
    with pytest.raises(ValueError, match="block must be an int"):
        moe_activation_fp8(x, x, torch.ones(4, 1), offs, 7.0, None)


# ---- moe_activation_fp8: q * s is moe_activation's fq8, bit for bit ----------------------------------------------
@pytest.mark.parametrize("backend", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.interpreter
def test_activation_split_is_the_fq8_activation(dtype, backend):
    gen = torch.Generator().manual_seed(9)
    r, i = 11, 96  # three blocks of 32
    g = (torch.randn(r, i, generator=gen) * 3).to(dtype)
    v = torch.randn(r, i, generator=gen).to(dtype)
    g[2, 5] = float("nan")
    g[3, 32:64] = 0.0  # an all-zero block: the amax floor's scale
    ws = torch.rand(r, 1, generator=gen)
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    q, s = moe_activation_fp8(g, v, ws, offs, 7.0, 32, backend=backend)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (r, 3) and s.dtype == torch.float32
    want = moe_activation(g, v, ws, offs, 7.0, 32, backend=backend).float()  # same backend: same exp (its last bit
    # may differ between the kernel and torch: test_moe_activation.py bounds that)
    got = q.float() * s.repeat_interleave(32, 1)
    assert torch.equal(got[:9].isnan(), want[:9].isnan()) and bool(got[2, 5].isnan())
    assert torch.equal(got[:9].nan_to_num(), want[:9].nan_to_num())
    s_log = torch.log2(s[:9][~s[:9].isnan()])
    assert torch.equal(s_log, s_log.round())  # powers of two


@pytest.mark.interpreter
def test_activation_split_leaves_other_rows_unwritten():
    from minidi.ops.moe_activation import launch

    gen = torch.Generator().manual_seed(2)
    g, v = torch.randn(10, 64, generator=gen), torch.randn(10, 64, generator=gen)
    offs = torch.tensor([6], dtype=torch.int32)
    q = torch.full((10, 64), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((10, 2), POISON)
    launch(g, v, torch.ones(10), offs, 7.0, 32, q, s)
    assert (q.view(torch.uint8)[6:] == 0x55).all() and (s[6:] == POISON).all()
    assert not (s[:6] == POISON).any()


@pytest.mark.interpreter
def test_opchecks():
    gen = torch.Generator().manual_seed(1)
    g, v = torch.randn(6, 64, generator=gen), torch.randn(6, 64, generator=gen)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    utils = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.minidi.moe_activation_fp8, (g, v, torch.ones(6), offs, 7.0, 32), test_utils=utils)
    x8 = torch.randn(5, 64, generator=gen).to(torch.float8_e4m3fn)
    torch.library.opcheck(torch.ops.minidi.gather_rows, (x8, torch.tensor([4, 0, 0, 2]), offs[1:] - 2),
                          test_utils=utils)  # offs[-1] = 4: every row written


# ---- the e4m3 row gather ------------------------------------------------------------------------------------------
@pytest.mark.interpreter
def test_e4m3_gather_copies_bytes_and_leaves_other_rows():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 96, generator=gen) * 50).to(torch.float8_e4m3fn)
    x.view(torch.uint8)[1, 3] = 0x7F  # NaN and -0 are bytes like any other
    x.view(torch.uint8)[2, 4] = 0x80
    idx = torch.tensor([1, 2, 6, 6, 0, 3, 5])
    offs = torch.tensor([2, 5], dtype=torch.int32)
    out = gather_rows(x, idx, offs)
    assert out.dtype == torch.float8_e4m3fn
    assert torch.equal(out.view(torch.uint8)[:5], x.view(torch.uint8)[idx[:5]])
    with pytest.raises(IndexError, match="outside x's 7 rows"):
        gather_rows(x, torch.tensor([7]), torch.tensor([1], dtype=torch.int32))


# ---- the device-side weight fold ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["folds", "wide_span", "nan_code", "span_11"])
@pytest.mark.interpreter
def test_fold_gate_matches_fold_and_gates_offs(case):
    gen = torch.Generator().manual_seed(4)
    c = torch.randint(110, 122, (3, 37, 12), generator=gen, dtype=torch.uint8)  # spans of at most 11 fold
    if case == "wide_span":
        c[1, 5, 3] = 140
    if case == "nan_code":
        c[2, 36, 11] = 255
    if case == "span_11":
        c[0, 0, :] = 100
        c[0, 0, 7] = 111
    ws = c.view(torch.float8_e8m0fnu)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    base, fold_offs, exact_offs = fold_gate(ws, offs)
    ref = fold_fp4_rows(ws)
    if case in ("folds", "span_11"):
        assert ref is not None and torch.equal(base, ref)
        assert fold_offs.tolist() == [4, 4, 9] and exact_offs.tolist() == [0, 0, 0]
    else:
        assert ref is None
        assert fold_offs.tolist() == [0, 0, 0] and exact_offs.tolist() == [4, 4, 9]


@pytest.mark.interpreter
def test_fold_cache_follows_the_tensor_and_its_version():
    """One fold per weight-scale tensor; an in-place change (version bump) folds again; another tensor with equal
    codes has its own entry; an inference tensor (no version counter) folds every call."""
    c = torch.full((2, 5, 4), 120, dtype=torch.uint8)
    ws = c.view(torch.float8_e8m0fnu)
    base, bad = cached_fold_rows(ws)
    assert cached_fold_rows(ws)[0] is base and int(bad) == 0
    c[1, 2, 3] = 200  # span 80: this row no longer folds
    base2, bad2 = cached_fold_rows(ws)
    assert base2 is not base and int(bad2) == 1
    other = c.clone().view(torch.float8_e8m0fnu)
    assert cached_fold_rows(other)[0] is not base2
    with torch.inference_mode():
        inf = torch.full((1, 3, 4), 121, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        b1, b2 = cached_fold_rows(inf)[0], cached_fold_rows(inf)[0]
    assert b1 is not b2 and torch.equal(b1, b2) and int(b1[0, 0]) == 126


@gpu
@pytest.mark.parametrize("route", ["bf16", "fp8"])
def test_gpu_up_and_down_match_the_bf16_path(route, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv(fp8_experts.ROUTE_ENV, route)  # sm_90: the register-operand bf16 kernel, or the FP8 one
    gen = torch.Generator().manual_seed(12)
    t, d, i, e = 300, 512, 256, 8
    x = tokens(t, d, gen, torch.bfloat16).cuda()
    counts = [0, 150, 1, 77, 0, 130, 2, 240]
    r = sum(counts) + 33
    idx = torch.randint(0, t, (r,), generator=gen).cuda()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    (p1, s1), (p3, s3), (p2, s2) = (weights(e, i, d, gen), weights(e, i, d, gen), weights(e, d, i, gen))
    p1, s1, p3, s3, p2, s2 = (a.cuda() for a in (p1, s1, p3, s3, p2, s2))
    end = int(offs[-1])
    y1, y3 = fp8_experts_up(x, idx, offs, 32, [p1, p3], [s1, s3], torch.bfloat16)
    xs = fq8(x, 32)[idx]
    for y, p, s in ((y1, p1, s1), (y3, p3, s3)):
        mass = fp4_grouped_mm(xs.float().abs(), abs_weights(p), s, offs, backend="ref")[:end]
        close(y[:end].float(), fp4_grouped_mm(xs.float(), p, s, offs, backend="ref")[:end], torch.bfloat16, mass)
    ws = torch.rand(r, 1, generator=gen).cuda()
    y2 = fp8_experts_down(y1, y3, ws, offs, 7.0, 32, p2, s2, torch.bfloat16)
    a = moe_activation(y1, y3, ws, offs, 7.0, 32)[:end].float()
    mass = fp4_grouped_mm(a.abs(), abs_weights(p2), s2, offs, backend="ref")[:end]
    close(y2[:end].float(), fp4_grouped_mm(a, p2, s2, offs, backend="ref")[:end], torch.bfloat16, mass)
