"""minidi::fp8_linear (pass N's op: an FP8 linear's fq8, weight dequant and GEMM in one call) against the model's
own code (``quant.fq8``, ``quant.dequant_fp8``, ``F.linear``): bit for bit on finite inputs, on the interpreter and
the GPU; its dequant kernel on every e4m3 byte and the E8M0 edge codes (its fq8 kernel: ``test_fq8.py``); the fp64
product; bad input named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minidi.model.quant import dequant_fp8, fq8, quantize_fp8
from minidi.ops.fp8_linear import (dequant_launch, fp8_grouped_linear, fp8_grouped_linear_ref, fp8_linear,
                                    fp8_linear_ref)

gpu = pytest.mark.gpu
interpreter = pytest.mark.interpreter  # the kernels on CPU tensors
DEVICES = [pytest.param("cpu", marks=interpreter), pytest.param("cuda", marks=gpu)]


@pytest.fixture(autouse=True)
def bf16_gemm(monkeypatch):
    """These tests hold the bf16 GEMM to the model's bits: ``MINIDI_FP8_GEMM=off`` (the default "128" sends V4-Flash's
    128-blocks to the FP8 GEMM on sm_90; the FP8 route's tests: ``test_fp8_linear_route.py``)."""
    monkeypatch.setenv("MINIDI_FP8_GEMM", "off")


def wide(shape, gen, dtype=torch.bfloat16) -> torch.Tensor:
    """Values over 2^-24 .. 2^12 (blocks span the amax floor, e4m3 subnormals, ties) and one all-zero block."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-24, 12, shape, generator=gen).float())
    x = x.to(dtype)
    x.view(-1, shape[-1])[0, :32] = 0
    return x


def weights(n: int, k: int, block: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight with its tiles' E8M0 codes spread over 2^-20 .. 2^4 (as uint8 codes)."""
    w, s = quantize_fp8(torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-12, 6, (n, 1), generator=gen)
                                                                       .float()), block)
    return w, s.view(torch.uint8)


def model_linear(x, w, s, weight_block, act_block):
    """``FP8Linear.forward`` as the model writes it."""
    return F.linear(fq8(x, act_block) if act_block else x, dequant_fp8(w, s, weight_block, x.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


CASES = [  # x shape, N, weight block, act block, dtype
    ((7, 96), 40, 32, 32, torch.bfloat16),  # N and K not multiples of the weight tile
    ((3, 5, 256), 130, 128, 128, torch.bfloat16),  # V4's 128 blocks, a 3-D input
    ((9, 64), 33, 32, 0, torch.bfloat16),  # no fake quant of the input
    ((1, 32), 1, 32, 32, torch.bfloat16),
    ((6, 160), 48, 32, 32, torch.float32),
    ((4, 128), 20, 128, 32, torch.bfloat16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "ref"])
@pytest.mark.parametrize("shape,n,wb,ab,dtype", CASES)
def test_equals_the_model_bit_for_bit(device, backend, shape, n, wb, ab, dtype):
    gen = torch.Generator().manual_seed(sum(shape) + n + wb + ab)
    x = wide(shape, gen, dtype)
    w, s = weights(n, shape[-1], wb, gen)
    want = model_linear(x.to(device), w.to(device), s.to(device), wb, ab)
    got = fp8_linear(x.to(device), w.to(device), s.to(device), wb, ab, backend=backend)
    assert same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_the_gemm_is_the_product_of_the_quantised_operands(device):
    """Against an fp64 product of the exact fq8 values and the exact weights: only the fp32 summation and the final
    bf16 rounding differ. Per element: bf16's unit roundoff 2^-8 of the value, plus fp32 summation error bounded by
    K 2^-24 sum |x| |w| (the standard bound, K = 256)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(33, 256, generator=gen).bfloat16()
    w, s = weights(72, 256, 32, gen)
    got = fp8_linear(x.to(device), w.to(device), s.to(device), 32, 32, backend="triton").cpu().double()
    xq, wd = fq8(x, 32).double(), dequant_fp8(w, s, 32, torch.float64)
    exact = xq @ wd.t()
    bound = 2.0**-8 * exact.abs() + 256 * 2.0**-24 * (xq.abs() @ wd.abs().t())
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).abs().max() > 0  # the bf16 rounding is there: the check compares something


@pytest.mark.parametrize("device", DEVICES)
def test_dequant_kernel_every_byte_and_edge_codes_fp32(device):
    """All 256 e4m3 bytes (NaN 0x7F / 0xFF, -0) times E8M0 codes 0 (2^-127), 1, 127, 200, 254 and 255 (NaN): the
    model's dequant exactly, in fp32 (NaN where it is NaN, signs of zeros kept)."""
    w = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16).repeat(6, 2).view(torch.float8_e4m3fn)
    s = torch.tensor([[0], [1], [127], [200], [254], [255]], dtype=torch.uint8).repeat(1, 2)
    got = dequant_launch(w.contiguous().to(device), s.to(device), 16, torch.float32).cpu()
    want = dequant_fp8(w, s, 16, torch.float32)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    finite = ~want.isnan()
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))


@interpreter
def test_dequant_kernel_bf16_where_the_interpreter_rounds_like_the_gpu():
    """bf16 outputs of normal magnitude (every code of a real checkpoint's tiles) are exact. Products below bf16's
    normal range (codes near 0) round in the conversion, where the interpreter's fp32 -> bf16 cast differs from the
    GPU's: the GPU test below covers them."""
    gen = torch.Generator().manual_seed(4)
    w, s = weights(70, 100, 32, gen)
    assert same_bits(dequant_launch(w, s, 32, torch.bfloat16), dequant_fp8(w, s, 32, torch.bfloat16))


@gpu
def test_dequant_kernel_bf16_subnormal_products_on_the_gpu():
    w = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16).view(torch.float8_e4m3fn)
    for code in (0, 1, 2, 3, 8):
        s = torch.full((1, 1), code, dtype=torch.uint8)
        got = dequant_launch(w.cuda(), s.cuda(), 16, torch.bfloat16).cpu()
        want = dequant_fp8(w, s, 16, torch.bfloat16)
        assert torch.equal(got.isnan(), want.isnan())
        assert same_bits(got.nan_to_num(), want.nan_to_num())


def test_ref_is_the_model():
    gen = torch.Generator().manual_seed(8)
    x = wide((5, 64), gen)
    w, s = weights(24, 64, 32, gen)
    assert same_bits(fp8_linear_ref(x, w, s, 32, 32), model_linear(x, w, s, 32, 32))


def test_bad_input_is_named():
    w, s = weights(40, 64, 32, torch.Generator().manual_seed(0))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="last dim 48 is not the weight's K 64"):
        fp8_linear(torch.zeros(3, 48, dtype=torch.bfloat16), w, s, 32, 32)
    with pytest.raises(ValueError, match="act_block must be one of"):
        fp8_linear(x, w, s, 32, 16)
    with pytest.raises(ValueError, match="weight_block must be one of"):
        fp8_linear(x, w, s, 64, 32)
    with pytest.raises(ValueError, match=r"scale must be E8M0 codes .* of shape \(2, 2\)"):
        fp8_linear(x, w, s[:1], 32, 32)
    with pytest.raises(ValueError, match="weight must be"):
        fp8_linear(x, w.float(), s, 32, 32)
    with pytest.raises(ValueError, match="x must be"):
        fp8_linear(x.half(), w, s, 32, 32)
    with pytest.raises(ValueError, match="not a multiple of act_block 128"):
        fp8_linear(torch.zeros(3, 96, dtype=torch.bfloat16), *weights(8, 96, 32, torch.Generator()), 32, 128)


@interpreter
def test_opcheck():
    """Fake, AOT static and dynamic; the schema test is left out (it compares e4m3 inputs with ops e4m3 does not
    implement on the CPU)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    w, s = weights(24, 64, 32, gen)
    utils = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.minidi.fp8_linear_ref.default, (x, w, s, 32, 32), test_utils=utils)
    torch.library.opcheck(torch.ops.minidi.fp8_linear.default, (x, w, s, 32, 32), test_utils=utils)


# ---- the grouped form (attention's wo_a) ----------------------------------------------------------------------------
GROUPED_CASES = [  # T, G, rows per group, I, weight block, dtype
    (7, 4, 32, 64, 32, torch.bfloat16),
    (5, 2, 48, 96, 32, torch.bfloat16),  # rows per group not a multiple of the tile: tiles straddle two groups
    (3, 2, 128, 256, 128, torch.bfloat16),  # V4's 128 blocks
    (6, 4, 16, 64, 32, torch.float32),
    (0, 2, 32, 64, 32, torch.bfloat16),  # no tokens
]


def model_grouped(o, w, s, block):
    """``Attention.forward``'s wo_a as the model writes it."""
    return torch.einsum("tgi,goi->tgo", o, dequant_fp8(w, s, block, o.dtype).view(o.shape[1], -1, o.shape[2]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "ref"])
@pytest.mark.parametrize("t,g,o,i,block,dtype", GROUPED_CASES)
def test_grouped_matches_the_model(device, backend, t, g, o, i, block, dtype):
    """Every output within the model's own distance from an fp64 product of the same operands (the op's GEMMs may
    sum in another order), in x's dtype, [T, G, rows per group], contiguous (the next linear reads the rows)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    x = (wide((t, g, i), gen, dtype) if t else torch.zeros(t, g, i, dtype=dtype)).to(device)
    w, s = (a.to(device) for a in weights(g * o, i, block, gen))
    got = fp8_grouped_linear(x, w, s, block, backend=backend)
    want = model_grouped(x, w, s, block)
    ref = torch.einsum("tgi,goi->tgo", x.double(), dequant_fp8(w, s, block, x.dtype).double().view(g, o, i))
    assert got.shape == want.shape == (t, g, o) and got.dtype == dtype and got.is_contiguous()
    if t:
        scale = ref.abs().max().clamp(min=1e-300)
        err, err_model = ((got.double() - ref).abs().max() / scale).item(), ((want.double() - ref).abs().max()
                                                                               / scale).item()
        assert err <= 2 * err_model + 1e-12, (seed, err, err_model)
    assert same_bits(fp8_grouped_linear_ref(x, w, s, block), want)


@interpreter
def test_grouped_keeps_the_dequantised_weight(monkeypatch):
    """The weight is dequantised once per weight tensor (``fp8_linear``'s cache), not per call."""
    import minidi.ops.fp8_linear as fl

    monkeypatch.setenv(fl.WEIGHT_CACHE_ENV, "1")
    calls = []
    real = fl.dequant_launch
    monkeypatch.setattr(fl, "dequant_launch", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 2, 64, generator=gen).bfloat16()
    w, s = weights(64, 64, 32, gen)
    first = fp8_grouped_linear(x, w, s, 32, backend="triton")
    second = fp8_grouped_linear(x, w, s, 32, backend="triton")
    assert len(calls) == 1 and torch.equal(first, second)


def test_grouped_bad_input_is_named():
    w, s = weights(64, 64, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"x must be \[T, G, I\] with G dividing the weight's N"):
        fp8_grouped_linear(torch.zeros(3, 64, dtype=torch.bfloat16), w, s, 32)
    with pytest.raises(ValueError, match=r"x must be \[T, G, I\] with G dividing the weight's N"):
        fp8_grouped_linear(torch.zeros(3, 3, 64, dtype=torch.bfloat16), w, s, 32)
    with pytest.raises(ValueError, match="last dim 48 is not the weight's K 64"):
        fp8_grouped_linear(torch.zeros(3, 2, 48, dtype=torch.bfloat16), w, s, 32)
    with pytest.raises(ValueError, match="weight_block must be one of"):
        fp8_grouped_linear(torch.zeros(3, 2, 64, dtype=torch.bfloat16), w, s, 64)


@interpreter
def test_grouped_opcheck():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 64, generator=gen).bfloat16()
    w, s = weights(64, 64, 32, gen)
    utils = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.minidi.fp8_grouped_linear_ref.default, (x, w, s, 32), test_utils=utils)
    torch.library.opcheck(torch.ops.minidi.fp8_grouped_linear.default, (x, w, s, 32), test_utils=utils)
