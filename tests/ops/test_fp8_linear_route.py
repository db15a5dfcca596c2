"""``fp8_linear``'s FP8 tensor-core route (``MINIDI_FP8_GEMM``): which calls take it, its plumbing on the CPU (the
FP8 GEMM replaced by its fp64 reference: the input's ``fq8_split``, the kept transposed scales, the output's shape
and dtype), and on an sm_90 GPU the kernel's result against the exact product of the quantised operands."""

from __future__ import annotations

import pytest
import torch

import minidi.ops.fp8_gemm_sm90 as sm90
from minidi.model.quant import dequant_fp8, fq8, quantize_fp8
from minidi.ops import fp8_linear as fl
from minidi.ops.fp8_gemm import fp8_gemm_ref


def weights(n: int, k: int, block: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    w, s = quantize_fp8(torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-8, 4, (n, 1), generator=gen)
                                                                       .float()), block)
    return w, s.view(torch.uint8)


def exact_and_bound(x, w, s, block, rel_acc: float):
    """fp64 product of fq8(x) and the dequantised weight, and a per-element bound: bf16's rounding of the value
    plus ``rel_acc`` of sum |x| |w| (the GEMM's accumulation)."""
    xq, wd = fq8(x, block).double(), dequant_fp8(w, s, block, torch.float64)
    exact = xq @ wd.t()
    return exact, 2.0**-8 * exact.abs() + rel_acc * (xq.abs() @ wd.abs().t())


@pytest.mark.parametrize("mode,blocks", [(None, (128,)), ("off", ()), ("128", (128,)), ("all", (32, 128))])
def test_modes(monkeypatch, mode, blocks):
    if mode is None:
        monkeypatch.delenv(fl.FP8_GEMM_ENV, raising=False)
    else:
        monkeypatch.setenv(fl.FP8_GEMM_ENV, mode)
    assert fl.fp8_gemm_blocks() == blocks


def test_a_bad_setting_is_named_on_any_device(monkeypatch):
    monkeypatch.setenv(fl.FP8_GEMM_ENV, "on")
    w, s = weights(8, 128, 128, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="MINIDI_FP8_GEMM must be one of \\['128', 'all', 'off'\\], got 'on'"):
        fl.fp8_linear(torch.zeros(2, 128, dtype=torch.bfloat16), w, s, 128, 128)


def test_route_needs_the_mode_equal_blocks_and_a_gpu(monkeypatch):
    w, s = weights(8, 128, 128, torch.Generator().manual_seed(0))
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    monkeypatch.setenv(fl.FP8_GEMM_ENV, "all")
    assert not fl.fp8_gemm_route(x, w, 128, 128)  # CPU tensors: the kernel cannot run
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as if on a GPU: the other rules
    monkeypatch.setattr(sm90, "can_run", lambda q, w, block: True)
    assert fl.fp8_gemm_route(x, w, 128, 128) and fl.fp8_gemm_route(x, w, 32, 32)
    assert not fl.fp8_gemm_route(x, w, 128, 32) and not fl.fp8_gemm_route(x, w, 32, 128)
    assert fl.fp8_gemm_route(x, w, 128, -128)  # pass R's shared fq8: the input is fq8 in blocks of 128 already
    assert not fl.fp8_gemm_route(x, w, 128, 0) and not fl.fp8_gemm_route(x, w, 128, -32)  # not fq8 / another block
    monkeypatch.setenv(fl.FP8_GEMM_ENV, "128")
    assert fl.fp8_gemm_route(x, w, 128, 128) and not fl.fp8_gemm_route(x, w, 32, 32)
    monkeypatch.setenv(fl.FP8_GEMM_ENV, "off")
    assert not fl.fp8_gemm_route(x, w, 128, 128)


@pytest.mark.interpreter
@pytest.mark.parametrize("block", [32, 128])
def test_plumbing_with_the_reference_gemm(monkeypatch, block):
    """The op's FP8 branch on the CPU with ``fp8_gemm_sm90`` replaced by ``fp8_gemm_ref`` (fp64, rounded once):
    the result is the exact product rounded to bf16, for a 3-D input; the transposed scales are built once per
    weight and handed to the GEMM."""
    calls = []

    def gemm(q, s_x, w, w_scale, blk, out_dtype, w_scale_t):
        assert torch.equal(w_scale_t, sm90.weight_scale_t(w_scale)) and blk == block
        calls.append(w_scale_t.data_ptr())
        return fp8_gemm_ref(q, s_x, w, w_scale, blk, out_dtype)

    monkeypatch.setattr(fl, "fp8_gemm_route", lambda *a: True)
    monkeypatch.setattr(sm90, "fp8_gemm_sm90", gemm)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = torch.randn(3, 5, 256, generator=gen).bfloat16()
    w, s = weights(72, 256, block, gen)
    for xin, ab in ((x, block), (fq8(x, block), -block)):  # own fq8; pass R's shared one (the split is exact)
        got = fl.fp8_linear(xin, w, s, block, ab, backend="triton")
        assert got.shape == (3, 5, 72) and got.dtype == torch.bfloat16
        exact, bound = exact_and_bound(x.view(15, 256), w, s, block, 0.0)
        assert ((got.view(15, 72).double() - exact).abs() <= bound).all()
    assert len(calls) == 2 and calls[0] == calls[1]  # one transposed scale tensor, kept


@pytest.mark.gpu
@pytest.mark.skipif(not sm90.gluon_supported(), reason="Gluon API of a tested Triton version (3.6) not installed")
def test_fp8_route_on_sm90(monkeypatch):
    """V4-Flash's 128-blocks on the GPU: the route runs the kernel (not the bf16 GEMM), and its result is the exact
    product within bf16's rounding plus 2^-11 of sum |x| |w| (the kernel's bound for 128-blocks)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.setenv(fl.FP8_GEMM_ENV, "128")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, 1024, generator=gen).bfloat16()
    w, s = weights(1100, 1024, 128, gen)
    xc, wc, sc = x.cuda(), w.cuda(), s.cuda()
    assert fl.fp8_gemm_route(xc, wc, 128, 128)
    got = fl.fp8_linear(xc, wc, sc, 128, 128).cpu().double()
    exact, bound = exact_and_bound(x, w, s, 128, 2.0**-11)
    assert ((got - exact).abs() <= bound).all()
    before = fl.weight_cache_bytes()
    fl.fp8_linear(xc, wc, sc, 128, 128)
    assert fl.weight_cache_bytes() == before  # no bf16 weight copy on this route


def _counting_route(monkeypatch) -> list:
    decided = []
    real = fl.fp8_gemm_route

    def route(*args):
        decided.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(fl, "fp8_gemm_route", route)
    return decided


def test_cpu_calls_decide_their_route_every_time(monkeypatch):
    decided = _counting_route(monkeypatch)
    x, w = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    assert [fl.gemm_route(x, w, 128, 128) for _ in range(3)] == ["bf16"] * 3
    assert len(decided) == 3 and fl._ROUTES == {}


@pytest.mark.gpu
def test_gpu_a_route_is_decided_once_per_signature_and_environment(monkeypatch):
    """A CUDA call's route is kept by its signature: a repeat decides nothing, another row count, block or value of
    either environment variable decides again, and the kept route is the one deciding gives."""
    decided = _counting_route(monkeypatch)
    fl._ROUTES.clear()
    w = torch.zeros(256, 512, dtype=torch.float8_e4m3fn, device="cuda")
    x = torch.zeros(12, 512, dtype=torch.bfloat16, device="cuda")
    first = fl.gemm_route(x, w, 128, 128)
    assert [fl.gemm_route(torch.zeros_like(x), w, 128, 128) for _ in range(3)] == [first] * 3 and len(decided) == 1
    fl.gemm_route(x[:8], w, 128, 128)
    fl.gemm_route(x, w, 128, 0)
    monkeypatch.setenv(fl.FP8_GEMM_ENV, "off")
    assert fl.gemm_route(x, w, 128, 128) == "bf16"
    monkeypatch.setenv(fl.FP8_GEMM_ENV, "128")
    monkeypatch.setenv(fl.FP8_GEMM_LIB_ENV, "gluon")
    lib_gluon = fl.gemm_route(x, w, 128, 128)
    assert len(decided) == 5
    if first != "bf16":  # (an sm_90 GPU with a tested Triton)
        assert lib_gluon == "gluon"
    fl._ROUTES.clear()
