"""minidi::fq8 (pass R's op: one fq8 of an input several FP8 linears read) against the model's ``quant.fq8``: bit for
bit on finite blocks, on the interpreter and the GPU, for both backends; its kernel's ties, saturation and poisoned
blocks; ``fp8_linear`` on its result with act_block -b (fq8 already) equal to ``fp8_linear`` with the act_block (what
pass R relies on); bad input named; opcheck."""

from __future__ import annotations

import pytest
import torch

from minidi.model.quant import fq8 as model_fq8
from minidi.ops.fp8_linear import fp8_linear
from minidi.ops.fq8 import fq8, fq8_launch, fq8_ref

from .test_fp8_linear import same_bits, weights, wide

gpu = pytest.mark.gpu
interpreter = pytest.mark.interpreter  # the kernels on CPU tensors
DEVICES = [pytest.param("cpu", marks=interpreter), pytest.param("cuda", marks=gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [32, 128])
def test_fq8_kernel_is_fq8(device, block):
    gen = torch.Generator().manual_seed(block)
    for dtype in (torch.bfloat16, torch.float32):
        x = wide((19, 2 * block), gen, dtype)
        assert same_bits(fq8_launch(x.to(device), block).cpu(), model_fq8(x, block))


@pytest.mark.parametrize("device", DEVICES)
def test_fq8_kernel_ties_and_saturation(device):
    """Half-way values (normal and subnormal e4m3) go to the even code, the block max to 448 x scale, a negative value
    that rounds to zero to -0 (as eager's e4m3 cast; the GPU lost the sign once: a negation is 0 - q there)."""
    s = 2.0**-4
    halfway = torch.tensor([448.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 2.0**-7 + 2.0**-10, 3 * 2.0**-10, -(9.0 + 0.5), 0.0,
                            -(2.0**-12)])
    x = torch.zeros(1, 32)
    x[0, :8] = halfway * s
    got = fq8_launch(x.to(device), 32).cpu()
    assert same_bits(got, model_fq8(x, 32))
    assert (got[0, :8] / s).tolist() == [448.0, 1.0, 1.25, 2.0**-7, 2.0**-8, -10.0, 0.0, 0.0]
    assert torch.signbit(got[0, 7]) and not torch.signbit(got[0, 6])


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_block_comes_out_nan_and_the_others_exact(device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 96, generator=gen)
    x[0, 5], x[1, 70], x[2, 33] = float("nan"), float("inf"), -float("inf")
    got = fq8_launch(x.to(device), 32).cpu()
    poisoned = torch.zeros(3, 3, dtype=torch.bool)
    poisoned[0, 0] = poisoned[1, 2] = poisoned[2, 1] = True
    blocks = got.view(3, 3, 32)
    assert blocks[poisoned].isnan().all()
    assert torch.equal(blocks[~poisoned], model_fq8(x, 32).view(3, 3, 32)[~poisoned])


CASES = [  # x shape, block, dtype, transposed (a non-contiguous input)
    ((7, 96), 32, torch.bfloat16, False),
    ((3, 5, 256), 128, torch.bfloat16, False),  # V4's blocks, a 3-D input
    ((6, 160), 32, torch.float32, False),
    ((64, 9), 32, torch.bfloat16, True),  # x.t(): [9, 64], strides (1, 9)
    ((0, 64), 32, torch.bfloat16, False),  # an empty batch
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "ref"])
@pytest.mark.parametrize("shape,block,dtype,transposed", CASES)
def test_op_equals_the_model_bit_for_bit(device, backend, shape, block, dtype, transposed):
    gen = torch.Generator().manual_seed(sum(shape) + block)
    x = wide(shape, gen, dtype) if shape[0] else torch.zeros(shape, dtype=dtype)
    x = x.t() if transposed else x
    got = fq8(x.to(device), block, backend=backend)
    assert got.is_contiguous() and same_bits(got.cpu(), model_fq8(x, block))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "ref"])
@pytest.mark.parametrize("shape,n,wb,ab,dtype", [((7, 96), 40, 32, 32, torch.bfloat16),
                                                  ((3, 5, 256), 130, 128, 128, torch.bfloat16),
                                                  ((6, 160), 48, 32, 32, torch.float32)])
def test_fp8_linear_on_the_shared_fq8_is_fp8_linear(device, backend, shape, n, wb, ab, dtype):
    """What pass R relies on: ``fp8_linear(fq8(x), ..., act_block=-b)`` (and 0) is ``fp8_linear(x, ..., act_block)``
    bit for bit, for each of several linears on one x."""
    gen = torch.Generator().manual_seed(sum(shape) + n)
    x = wide(shape, gen, dtype).to(device)
    xq = fq8(x, ab, backend=backend)
    for _ in range(2):
        w, s = (t.to(device) for t in weights(n, shape[-1], wb, gen))
        want = fp8_linear(x, w, s, wb, ab, backend=backend).cpu()
        assert same_bits(fp8_linear(xq, w, s, wb, -ab, backend=backend).cpu(), want)
        assert same_bits(fp8_linear(xq, w, s, wb, 0, backend=backend).cpu(), want)


def test_ref_is_the_model():
    x = wide((5, 64), torch.Generator().manual_seed(8))
    assert same_bits(fq8_ref(x, 32), model_fq8(x, 32))


def test_bad_input_is_named():
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block must be one of"):
        fq8(x, 64)
    with pytest.raises(ValueError, match="last dim 48 is not a multiple of block 32"):
        fq8(torch.zeros(3, 48, dtype=torch.bfloat16), 32)
    with pytest.raises(ValueError, match="x must be"):
        fq8(x.half(), 32)
    with pytest.raises(ValueError, match="x must be"):
        fq8(torch.zeros((), dtype=torch.bfloat16), 32)


@interpreter
def test_opcheck():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.minidi.fq8_ref.default, (x, 32), test_utils=utils)
    torch.library.opcheck(torch.ops.minidi.fq8.default, (x, 32), test_utils=utils)
    torch.library.opcheck(torch.ops.minidi.fq8.default, (x.t(), 32), test_utils=utils)  # a strided input
