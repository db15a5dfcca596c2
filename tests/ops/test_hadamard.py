"""minidi::hadamard_rotate (pass V's op): the model's Hadamard rotation (``minidi.formats.hadamard``) as one tensor-core
dot. Against the exact rotation (fp64): within the one rounding to x's dtype plus 2^-20 of c sum |x_i| (fp32-level
differences of order from the model's fp32 matmul), on fresh random inputs over a wide exponent range, ragged row
counts, poisoned outputs, both kernel dtypes; the model's own rotation meets the same bound. Errors name what is
wrong; fp32 x runs the reference."""

from __future__ import annotations

import pytest
import torch

from minidi.formats import hadamard, hadamard_matrix
from minidi.ops import hadamard as hd

gpu = pytest.mark.gpu
interpreter = pytest.mark.interpreter
DEVICES = [pytest.param("cpu", marks=interpreter), pytest.param("cuda", marks=gpu)]


def wide(shape, gen, dtype) -> torch.Tensor:
    """Values over 2^-12 .. 2^12 with random signs (a row's terms then cancel and add at many scales)."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 12, shape, generator=gen).float())
    return x.to(dtype)


def exact_and_bound(x: torch.Tensor):
    """fp64 x H and the per-element bound: half an ulp of x's dtype at the exact value, plus 2^-20 c sum |x_i|."""
    n = x.shape[-1]
    h = hadamard_matrix(n).double()
    exact = x.double() @ h
    eps = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x.dtype]
    return exact, eps * exact.abs() + 2.0**-20 * (x.double().abs() @ h.abs())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,dtype", [((5, 3, 128), torch.bfloat16), ((131, 64), torch.bfloat16),
                                         ((70, 16), torch.float16), ((1, 256), torch.bfloat16)])
def test_within_one_rounding_of_the_exact_rotation(device, shape, dtype):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = wide(shape, gen, dtype)
    got = hd.hadamard_rotate(x.to(device), backend="triton")
    assert got.shape == x.shape and got.dtype == dtype
    exact, bound = exact_and_bound(x)
    assert ((got.cpu().double() - exact).abs() <= bound).all()
    model = hadamard(x)  # the model's fp32 matmul meets the same bound
    assert ((model.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
def test_every_row_written_and_ragged_tiles(device):
    gen = torch.Generator().manual_seed(3)
    for m in (1, 63, 64, 65, 200):
        x = wide((m, 128), gen, torch.bfloat16).to(device)
        out = torch.full_like(x, float("nan"))
        hd.launch(x, out, BM=64)
        assert not out.isnan().any()
        exact, bound = exact_and_bound(x.cpu())
        assert ((out.cpu().double() - exact).abs() <= bound).all()


@interpreter
def test_signs_and_scale_are_the_models_matrix():
    for n in (16, 128, 256):
        s = hd.signs(n, torch.bfloat16, torch.device("cpu"))
        assert set(s.unique().tolist()) == {-1.0, 1.0}
        assert torch.equal(s.float() * hd.scale_of(n), hadamard_matrix(n))  # the model's entries, bit for bit


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"power of two in \[16, 256\], got 96"):
        hd.hadamard_rotate(torch.zeros(2, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"power of two in \[16, 256\], got 512"):
        hd.hadamard_rotate(torch.zeros(2, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype in"):
        hd.hadamard_rotate(torch.zeros(2, 16, dtype=torch.int32))


@interpreter
def test_fp32_runs_the_reference_and_triton_names_it():
    x = torch.randn(4, 32)
    assert torch.equal(hd.hadamard_rotate(x), hadamard(x))
    with pytest.raises(ValueError, match="no kernel for torch.float32"):
        hd.hadamard_rotate(x, backend="triton")


@interpreter
def test_opcheck():
    x = torch.randn(3, 4, 64).bfloat16()
    torch.library.opcheck(torch.ops.minidi.hadamard_rotate, (x,))
