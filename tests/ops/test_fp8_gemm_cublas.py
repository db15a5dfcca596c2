"""The 128-block FP8 GEMM on cuBLAS (``fp8_gemm_cublas``) and ``fp8_linear``'s choice of it.

CPU: the shape rules, argument errors, the probe's verdicts (``torch._scaled_mm`` replaced: raising, a wrong product,
the right one), and the route's plumbing through ``fp8_linear`` with ``_scaled_mm`` replaced by an fp64 product that
checks the layouts it is handed (M-major activation scales from the split kernel, the kept weight scales
transposed); ``MINIDI_FP8_GEMM_LIB=gluon`` and shapes outside the rules take the Gluon kernel. GPU (sm_90): the probe
passes, the route runs cuBLAS and holds the exact product within bf16's rounding plus 2^-11 of sum |x| |w| (the
Gluon kernel's 128-block bound) at several M, repeats bit for bit, and shapes outside the rules stay right on the
Gluon kernel.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import minidi.ops.fp8_gemm_sm90 as sm90
from minidi.ops import fp8_gemm_cublas as cublas
from minidi.ops import fp8_linear as fl
from minidi.ops.fp8_gemm import fp8_gemm_ref

from .test_fp8_linear_route import exact_and_bound, weights


def test_shape_rules():
    assert cublas.shape_ok(4096, 32768, 1024) and cublas.shape_ok(4, 128, 512)
    assert not cublas.shape_ok(4093, 128, 512)  # M % 4 (cuBLAS: not supported)
    assert not cublas.shape_ok(4096, 1100, 512)  # N % 128
    assert not cublas.shape_ok(4096, 4096, 1280)  # K / 128 = 10: a wrong product on torch 2.11
    assert not cublas.shape_ok(0, 128, 512)
    assert not cublas.can_run(torch.zeros(4, 512, dtype=torch.float8_e4m3fn),
                              torch.zeros(128, 512, dtype=torch.float8_e4m3fn))  # CPU tensors


def test_layout_errors_are_named():
    q = torch.zeros(8, 512, dtype=torch.float8_e4m3fn)
    w = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    sw = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"s_x must be fp32 \[8, 4\] with strides \(1, 8\)"):
        cublas.fp8_gemm_cublas(q, torch.ones(8, 4), w, sw, torch.bfloat16)  # K-major scales
    with pytest.raises(ValueError, match=r"w_scale_fp32 must be contiguous fp32 \[2, 4\]"):
        cublas.fp8_gemm_cublas(q, torch.ones(4, 8).t(), w, torch.ones(4, 2).t(), torch.bfloat16)


def _product(a, b, scale_a, scale_b, out_dtype):
    """``torch._scaled_mm``'s 128-block semantics in fp64, on what it is handed."""
    x = a.double() * scale_a.double().repeat_interleave(128, 1)
    w = b.t().double() * scale_b.t().double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (x @ w.t()).to(out_dtype)


def test_probe_verdicts(monkeypatch):
    cpu = torch.device("cpu")

    def raises(*a, **k):
        raise RuntimeError("Invalid scaling configuration.")

    monkeypatch.setattr(torch, "_scaled_mm", raises)
    assert "raised Invalid scaling configuration." in cublas.probe_on(cpu)
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, sa, sb, out_dtype: _product(a, b, sa, sb, out_dtype) * 1.1)
    assert "is off by" in cublas.probe_on(cpu)
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, sa, sb, out_dtype: _product(a, b, sa, sb, out_dtype))
    assert cublas.probe_on(cpu) is None


def _as_if_on_gpu(monkeypatch, handed: list):
    """cuBLAS's route taken on CPU tensors: ``can_run`` true where the shape rules hold, ``_scaled_mm`` the fp64
    product checking the layouts; the Gluon kernel replaced by its reference (recording its calls)."""
    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)  # M-major, from the split kernel
        assert scale_b.shape == (k // 128, b.shape[1] // 128) and scale_b.t().is_contiguous()
        handed.append("cublas")
        return _product(a, b, scale_a, scale_b, out_dtype)

    def gluon(q, s_x, w, w_scale, blk, out_dtype, w_scale_t):
        handed.append("gluon")
        return fp8_gemm_ref(q, s_x, w, w_scale, blk, out_dtype)

    monkeypatch.setattr(fl, "fp8_gemm_route", lambda *a: True)
    monkeypatch.setattr(cublas, "can_run", lambda q, w: cublas.shape_ok(q.shape[0], w.shape[0], q.shape[1]))
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(sm90, "fp8_gemm_sm90", gluon)


@pytest.mark.interpreter
def test_route_plumbing_with_the_reference_product(monkeypatch):
    handed = []
    _as_if_on_gpu(monkeypatch, handed)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    w, s = weights(256, 512, 128, gen)
    for rows, lib, want in ((12, "auto", "cublas"), (12, "gluon", "gluon"), (13, "auto", "gluon")):
        monkeypatch.setenv(fl.FP8_GEMM_LIB_ENV, lib)
        x = torch.randn(rows, 512, generator=gen).bfloat16()
        got = fl.fp8_linear(x.view(1, rows, 512), w, s, 128, 128, backend="triton")
        assert handed[-1] == want and got.shape == (1, rows, 256) and got.dtype == torch.bfloat16
        exact, bound = exact_and_bound(x, w, s, 128, 0.0)
        assert ((got.view(rows, 256).double() - exact).abs() <= bound).all()
    monkeypatch.setenv(fl.FP8_GEMM_LIB_ENV, "cublas")
    with pytest.raises(ValueError, match=r"MINIDI_FP8_GEMM_LIB must be one of \['auto', 'gluon'\], got 'cublas'"):
        fl.fp8_linear(torch.zeros(4, 512, dtype=torch.bfloat16), w, s, 128, 128)


# ---- GPU -----------------------------------------------------------------------------------------------------------
def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


@pytest.mark.gpu
def test_gpu_probe_passes_and_route_takes_cublas(monkeypatch):
    _sm90()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed probe warns
        assert cublas.probe_failure(torch.device("cuda")) is None
    monkeypatch.delenv(fl.FP8_GEMM_LIB_ENV, raising=False)
    monkeypatch.setenv(fl.FP8_GEMM_ENV, "128")
    calls = []
    real = cublas.fp8_gemm_cublas
    monkeypatch.setattr(cublas, "fp8_gemm_cublas", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(11)
    w, s = weights(1152, 2048, 128, gen)
    wc, sc = w.cuda(), s.cuda()
    for rows in (4, 300, 4096):
        x = torch.randn(rows, 2048, generator=gen).bfloat16()
        got = fl.fp8_linear(x.cuda(), wc, sc, 128, 128)
        assert len(calls) == 1
        exact, bound = exact_and_bound(x, w, s, 128, 2.0**-11)
        assert ((got.cpu().double() - exact).abs() <= bound).all()
        again = fl.fp8_linear(x.cuda(), wc, sc, 128, 128)
        assert torch.equal(again.view(torch.int16), got.view(torch.int16))
        calls.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not sm90.gluon_supported(), reason="Gluon API of a tested Triton version (3.6) not installed")
@pytest.mark.parametrize("rows,n,k", [(301, 1152, 1024), (64, 1100, 1024), (64, 1024, 1280)],
                         ids=["m301", "n1100", "k1280"])
def test_gpu_shapes_outside_the_rules_take_the_gluon_kernel(monkeypatch, rows, n, k):
    _sm90()
    monkeypatch.setattr(cublas, "fp8_gemm_cublas", lambda *a: pytest.fail("cuBLAS outside its shape rules"))
    gen = torch.Generator().manual_seed(rows + n + k)
    w, s = weights(n, k, 128, gen)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    got = fl.fp8_linear(x.cuda(), w.cuda(), s.cuda(), 128, 128)
    exact, bound = exact_and_bound(x, w, s, 128, 2.0**-11)
    assert ((got.cpu().double() - exact).abs() <= bound).all()
