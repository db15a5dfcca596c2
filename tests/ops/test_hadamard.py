"""minidi::hadamard_rotate (pass V's op): the model's Hadamard rotation (``minidi.formats.hadamard``) as one tensor-core
dot. Against the exact rotation (fp64): within the one rounding to x's dtype plus 2^-20 of c sum |x_i| (fp32-level
differences of order from the model's fp32 matmul), on fresh random inputs over a wide exponent range, ragged row
counts, poisoned outputs, both kernel dtypes; the model's own rotation meets the same bound. With ``fq4_block`` the
result is ``fq4_ue8m0`` of the op's own rotation bit for bit, and the model's fq4 of its rotation wherever the two
rotations agree; the epilogue's fq4 (``_triton_formats.fq4_ue8m0_blocks``) equals ``minidi.formats.fq4_ue8m0`` on every
e2m1 rounding boundary, the amax floor, signed zeros and the largest bf16 values. Errors name what is wrong; fp32 x
runs the reference."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from minidi.formats import fq4_ue8m0, hadamard, hadamard_matrix
from minidi.ops import hadamard as hd
from minidi.ops._triton_formats import fq4_ue8m0_blocks

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,dtype,block", [((5, 3, 128), torch.bfloat16, 32), ((131, 64), torch.bfloat16, 16),
                                               ((70, 16), torch.float16, 16), ((9, 256), torch.bfloat16, 2)])
def test_fq4_is_the_fq4_of_the_rotation(device, shape, dtype, block):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x = wide(shape, gen, dtype)
    x[0] = 0  # a zero row: every block at the amax floor
    x = x.to(device)
    rotated = hd.hadamard_rotate(x, backend="triton")
    got = hd.hadamard_rotate(x, fq4_block=block, backend="triton")
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got.view(torch.int16), fq4_ue8m0(rotated, block).view(torch.int16))  # -0 included
    model = hadamard(x.cpu())  # the model's chain: equal in every block whose rotation is equal
    same = (rotated.cpu() == model).unflatten(-1, (-1, block)).all(-1, keepdim=True)
    assert same.float().mean() > 0.5
    want = fq4_ue8m0(model, block)
    assert torch.equal(torch.where(same, got.cpu().unflatten(-1, (-1, block)), 0),
                       torch.where(same, want.unflatten(-1, (-1, block)), 0))


@pytest.mark.parametrize("device", DEVICES)
def test_fq4_every_row_written(device):
    gen = torch.Generator().manual_seed(5)
    for m in (1, 63, 65):
        x = wide((m, 128), gen, torch.bfloat16).to(device)
        out = torch.full_like(x, float("nan"))
        hd.launch(x, out, fq4_block=32, BM=64)
        assert torch.equal(out, fq4_ue8m0(hd.hadamard_rotate(x, backend="triton"), 32))


@triton.jit
def _fq4_rows_kernel(x_ptr, y_ptr, R: tl.constexpr, B: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * B + tl.arange(0, B)[None, :]
    tl.store(y_ptr + offs, tl.reshape(fq4_ue8m0_blocks(tl.reshape(tl.load(x_ptr + offs), [R, 1, B])), [R, B]))


def _boundary_blocks() -> torch.Tensor:
    """[16, 32] fp32 blocks: each e2m1 rounding boundary (ties, and one fp32 ulp either side) at scales 1 and 2^-20,
    both signs and -0; the amax floor (a zero block, values near 6 * 2^-126); the largest bf16 values; an amax just
    above 6 (scale 2) and one whose quotient by 6 rounds (to the scale's edge); random values."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up, down = torch.nextafter(ties, torch.tensor(9.0)), torch.nextafter(ties, torch.tensor(0.0))
    vals = torch.cat([ties, up, down, torch.tensor([6.0, 0.0, -0.0, 2.0, 4.0])])  # 26
    blocks = [torch.cat([vals, -vals[:6]]), torch.cat([-vals, vals[:6]]) * 2.0**-20]
    blocks.append(torch.zeros(32))
    blocks.append(torch.full((32,), 6 * 2.0**-126) * torch.linspace(-1, 1, 32))
    blocks.append(torch.linspace(-1, 1, 32) * torch.finfo(torch.bfloat16).max)  # the model's 4 * 2^126 is inf
    blocks.append(torch.cat([torch.tensor([torch.nextafter(torch.tensor(6.0), torch.tensor(7.0)).item()]),
                             vals[:26], -vals[:5]]))
    blocks.append(torch.linspace(-1, 1, 32) * 6.0 * (1 + 2.0**-23))  # amax / 6 rounds to 1: scale 1, values clamp
    gen = torch.Generator().manual_seed(7)
    for _ in range(9):
        blocks.append(torch.randn(32, generator=gen) * 2.0 ** torch.randint(-30, 30, (), generator=gen).item())
    return torch.stack(blocks)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # see the block's note
@pytest.mark.parametrize("device", DEVICES)
def test_fq4_twin_on_rounding_boundaries(device):
    x = _boundary_blocks()
    got = torch.empty_like(x, device=device)
    _fq4_rows_kernel[(1,)](x.to(device), got, R=16, B=32)
    assert torch.equal(got.cpu().view(torch.int32), fq4_ue8m0(x, 32).view(torch.int32))  # bits: -0 kept


@pytest.mark.parametrize("device", DEVICES)
def test_fq4_twin_nonfinite_block_is_nan(device):
    x = torch.ones(2, 32)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    got = torch.empty_like(x, device=device)
    _fq4_rows_kernel[(1,)](x.to(device), got, R=2, B=32)
    assert got.isnan().all()


def test_bad_fq4_block_is_named():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    for bad in (3, 128, -32, 1, True):
        want = rf"fq4_block must be 0 \(no fake quant\) or a power of two in \[2, n = 64\], got {bad!r}"
        with pytest.raises(ValueError, match=want):
            hd.hadamard_rotate(x, fq4_block=bad)


@interpreter
def test_opcheck():
    x = torch.randn(3, 4, 64).bfloat16()
    torch.library.opcheck(torch.ops.minidi.hadamard_rotate, (x,))
    torch.library.opcheck(torch.ops.minidi.hadamard_rotate, (x, 32))
