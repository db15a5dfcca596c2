"""minidi::head_logits (pass O's op: the output head's fp32 GEMM from the bf16 weight) against an fp64 product:
ragged row counts and vocabulary sizes (not multiples of the tile), every row-count tile, the fallback past
MAX_ROWS, fp32 inputs, non-finite values, the output poisoned before the run, bad input named, opcheck."""

from __future__ import annotations

import pytest
import torch

from minidi.ops import head_logits as hl
from minidi.ops.head_logits import head_logits, head_logits_ref

gpu = pytest.mark.gpu
interpreter = pytest.mark.interpreter  # the kernels on CPU tensors
DEVICES = [pytest.param("cpu", marks=interpreter), pytest.param("cuda", marks=gpu)]


def operands(rows: int, v: int, d: int, seed: int, y_dtype=torch.bfloat16, w_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    y = (torch.randn(rows, d, generator=gen) * 3).to(y_dtype)
    w = (torch.randn(v, d, generator=gen) * torch.exp2(torch.randint(-6, 3, (v, 1), generator=gen).float()))
    return y, w.to(w_dtype)


def check(got: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
    """Within the fp32 summation bound (D + 1) 2^-24 sum |y| |w| of the fp64 product (the products of bf16 values
    are exact; an fp32 y adds one rounding per product)."""
    y64, w64 = y.double().cpu(), w.double().cpu()
    exact = y64 @ w64.t()
    bound = (y.shape[1] + 1) * 2.0**-24 * (y64.abs() @ w64.abs().t())
    got = got.cpu()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,v,d", [(1, 77, 200), (2, 64, 128), (3, 130, 96), (5, 9, 300), (8, 33, 128),
                                      (9, 50, 64), (20, 41, 160)])
def test_matches_the_fp64_product(device, rows, v, d):
    y, w = operands(rows, v, d, rows * 100 + v)
    check(head_logits(y.to(device), w.to(device), backend="triton"), y, w)
    out = torch.full((rows, v), float("nan"), device=device)  # the kernel alone, into a poisoned output
    hl.launch(y.to(device), w.to(device), out)
    check(out, y, w)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_rows_and_weight(device):
    for rows in (1, 4):
        y, w = operands(rows, 70, 192, 3, torch.float32, torch.float32)
        check(head_logits(y.to(device), w.to(device), backend="triton"), y, w)
        out = torch.full((rows, 70), float("nan"), device=device)
        hl.launch(y.to(device), w.to(device), out)
        check(out, y, w)


@interpreter
def test_past_max_rows_runs_the_reference(monkeypatch):
    y, w = operands(hl.MAX_ROWS + 1, 24, 64, 4)
    launched = []
    monkeypatch.setattr(hl, "launch", lambda *a: launched.append(a))
    got = head_logits(y, w, backend="triton")
    assert not launched and torch.equal(got, head_logits_ref(y, w))


def test_tiles_cover_every_row_count():
    for rows in range(1, 20):
        r, bv, bd = hl.tile(rows)
        assert r & (r - 1) == 0 and r <= 8 and (r >= rows or r == 8) and r * bv * bd <= 8192


@interpreter
def test_non_finite_values_propagate():
    y, w = operands(2, 40, 64, 5)
    w[3, 7] = float("inf")
    y[1, 2] = float("nan")
    got, want = head_logits(y, w, backend="triton"), head_logits_ref(y, w)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


@interpreter
def test_empty():
    y, w = operands(0, 12, 64, 6)
    assert head_logits(y, w, backend="triton").shape == (0, 12)


def test_bad_input_is_named():
    y, w = operands(2, 16, 64, 7)
    with pytest.raises(ValueError, match="y must be"):
        head_logits(y.half(), w)
    with pytest.raises(ValueError, match=r"weight must be \[V, D\] = \[V, 64\]"):
        head_logits(y, w[:, :32])
    with pytest.raises(ValueError, match="weight must be"):
        head_logits(y, w.half())
    with pytest.raises(ValueError, match="y must be"):
        head_logits(y[0], w)


@interpreter
def test_opcheck():
    y, w = operands(3, 24, 64, 8)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.minidi.head_logits.default, (y, w), test_utils=utils)
    torch.library.opcheck(torch.ops.minidi.head_logits_ref.default, (y, w), test_utils=utils)
