"""minidi::fq8_split (activations -> e4m3 + power-of-two scales) vs ``minidi.formats.fq8_split``: bit for bit, on
the interpreter and the GPU; and the split's product is the model's fq8, exactly."""

from __future__ import annotations

import pytest
import torch

from minidi import formats
from minidi.model.quant import fq8
from minidi.ops.fp8_quant import fq8_split, fq8_split_launch

gpu = pytest.mark.gpu
interpreter = pytest.mark.interpreter  # the kernels on CPU tensors
DEVICES = [pytest.param("cpu", marks=interpreter), pytest.param("cuda", marks=gpu)]


def wide(shape, gen, dtype=torch.bfloat16) -> torch.Tensor:
    """Random values over 2^-24 .. 2^12 (so blocks span the clamp floor, e4m3 subnormals and ties), zero blocks."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-24, 12, shape, generator=gen).float())
    x = x.to(dtype)
    x.view(-1, shape[-1])[0, :32] = 0  # an all-zero block: the amax floor sets its scale
    return x


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,block,dtype", [((7, 96), 32, torch.bfloat16), ((3, 5, 256), 128, torch.bfloat16),
                                               ((33, 64), 32, torch.float32), ((1, 32), 32, torch.float16),
                                               ((129, 160), 32, torch.bfloat16)])
def test_matches_the_format_bit_for_bit(device, shape, block, dtype):
    gen = torch.Generator().manual_seed(sum(shape) + block)
    x = wide(shape, gen, dtype).to(device)
    q = torch.full(x.shape, 1.0).to(torch.float8_e4m3fn)
    q, s = fq8_split(x, block, backend="triton")
    rq, rs = formats.fq8_split(x, block)
    assert q.shape == x.shape and s.shape == (*x.shape[:-1], x.shape[-1] // block)
    assert torch.equal(bits(q), bits(rq))
    assert torch.equal(s, rs)
    assert torch.equal((q.float() * s.repeat_interleave(block, -1)).to(dtype), fq8(x, block))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,k,block", [(13, 512, 128), (70, 128, 32), (4, 96, 32), (0, 256, 128)])
def test_scales_in_m_major_order_are_the_same_values(device, rows, k, block):
    """``fq8_split_launch(..., scales_t=True)`` (cuBLAS's activation-scale layout): the same e4m3 bytes and scales,
    the scales an [R, K / block] view with strides (1, R) of a [K / block, R] tensor."""
    gen = torch.Generator().manual_seed(rows + k)
    x = wide((max(rows, 1), k), gen)[:rows].to(device)
    q, s = fq8_split_launch(x, block)
    qt, st = fq8_split_launch(x, block, scales_t=True)
    assert st.shape == (rows, k // block) and st.t().is_contiguous() and (rows == 0 or st.stride() == (1, rows))
    assert torch.equal(bits(qt), bits(q)) and torch.equal(st, s)  # (an element left unwritten would differ)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_round_to_even_and_saturate(device):
    """Values half-way between e4m3 neighbours (normal and subnormal) go to the even code; the block max maps to
    at most 448."""
    s = 2.0**-4  # block amax 448 * 2^-4 = 28 -> scale 2^-4 exactly
    halfway = torch.tensor([448.0, 1.0 + 1 / 16, 1.0 + 3 / 16, 2.0**-7 + 2.0**-10, 3 * 2.0**-10, -(9.0 + 0.5), 0.0])
    x = torch.zeros(1, 32)
    x[0, :halfway.numel()] = halfway * s
    q, sc = fq8_split(x.to(device), 32, backend="triton")
    assert float(sc[0, 0]) == s
    want = formats.fq8_split(x, 32)[0]
    assert torch.equal(bits(q).cpu(), bits(want))
    assert q.float()[0, :7].cpu().tolist() == [448.0, 1.0, 1.25, 2.0**-7, 2.0**-8, -10.0, 0.0]


@interpreter
def test_an_fq8_output_splits_exactly():
    """fq8's output is already on the grid: its split multiplies back to it (the FP8 GEMMs' products are then the
    bf16 GEMMs' products)."""
    gen = torch.Generator().manual_seed(3)
    y = fq8(wide((17, 128), gen), 32)
    q, s = fq8_split(y, 32, backend="triton")
    assert torch.equal((q.float() * s.repeat_interleave(32, -1)).bfloat16(), y)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="block must be one of"):
        fq8_split(torch.zeros(2, 64), 64)
    with pytest.raises(ValueError, match="not a multiple of block 32"):
        fq8_split(torch.zeros(2, 48), 32)
    with pytest.raises(ValueError, match="dtype"):
        fq8_split(torch.zeros(2, 32, dtype=torch.int32), 32)


@interpreter
def test_opcheck():
    x = torch.randn(4, 64).bfloat16()
    torch.library.opcheck(torch.ops.minidi.fq8_split, (x, 32))
    torch.library.opcheck(torch.ops.minidi.fq8_split_ref, (x, 32))
