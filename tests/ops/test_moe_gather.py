"""minidi::gather_rows vs ``x[idx]``, minidi::gather_rows_fq8 vs ``fq8(x)[idx]`` (CPU under TRITON_INTERPRET=1; @gpu
at the V4.1-Flash EP4 shape).

A copy: bit-equal on the rows below offs[-1]; the rows past it are never written (poisoned outputs keep their
poison); an index out of range raises on CPU tensors and gives a NaN row from the kernel."""

from __future__ import annotations

import pytest
import torch

from minidi.ops import _triton_utils
from minidi.ops.fq8 import fq8
from minidi.ops.moe_gather import gather_rows, gather_rows_fq8, gather_rows_ref, launch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 12345.0
gpu = pytest.mark.gpu


def make(t, d, counts, r, dtype, seed=0, device=DEV, idx_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=gen) * 3).to(dtype)
    idx = torch.randint(0, t, (r,), generator=gen).to(idx_dtype)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return x.to(device), idx.to(device), offs.to(device)


def run(x, idx, offs):
    out = torch.full((idx.shape[0], x.shape[1]), POISON, dtype=x.dtype, device=x.device)
    launch(x, idx, offs, out)
    return out


# ragged: empty experts (first, middle, last), offs[-1] < R (other ranks' rows), offs[-1] == R, no local rows,
# D not a multiple of the column tile, one token
CASES = [  # (T, D, counts, R)
    (11, 96, [5, 0, 15, 10], 37),
    (7, 200, [0, 24], 24),
    (5, 64, [0, 0], 19),
    (1, 130, [3, 2], 9),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}_D{c[1]}_R{c[3]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_local_rows_equal_indexing_rest_untouched(case, dtype, idx_dtype):
    t, d, counts, r = case
    x, idx, offs = make(t, d, counts, r, dtype, idx_dtype=idx_dtype)
    n = min(int(offs[-1]), r)
    out = run(x, idx, offs)
    assert torch.equal(out[:n], x[idx.long()][:n])
    assert (out[n:] == POISON).all()


def test_nan_and_inf_rows_copied_bit_exact():
    x, idx, offs = make(6, 64, [9], 9, torch.float32)
    x[2, 5], x[3, 0], x[4, 63] = float("nan"), float("inf"), -0.0
    out = run(x, idx, offs)
    assert torch.equal(out.view(torch.int32), x[idx].view(torch.int32))


@pytest.mark.interpreter
def test_out_of_range_index_raises_on_cpu_tensors():
    """The op's host check: on CPU tensors only (on CUDA it would cost a sync; the kernel gives a NaN row)."""
    x, idx, offs = make(6, 64, [4, 4], 8, torch.float32, device="cpu")
    idx[3] = 6
    with pytest.raises(IndexError, match="idx holds 6, outside x's 6 rows"):
        gather_rows(x, idx, offs)
    idx[3] = -1
    with pytest.raises(IndexError, match="idx holds -1"):
        gather_rows(x, idx, offs)


@pytest.mark.parametrize("bad", [6, -1])
def test_out_of_range_index_gives_a_nan_row(bad):
    x, idx, offs = make(6, 64, [4, 4], 8, torch.float32)
    idx[3] = bad
    out = run(x, idx, offs)  # the kernel itself (no check): a NaN row, the others exact
    assert out[3].isnan().all()
    keep = torch.arange(8, device=x.device) != 3
    assert torch.equal(out[keep], x[idx.clamp(0, 5)][keep])


def test_ref_backend_public_op_and_compile():
    x, idx, offs = make(11, 96, [5, 0, 15, 10], 37, torch.bfloat16)
    n = int(offs[-1])
    out = gather_rows(x, idx, offs)
    assert torch.equal(out[:n], gather_rows(x, idx, offs, backend="ref")[:n])
    assert torch.equal(gather_rows_ref(x, idx, offs), x[idx])
    f = torch.compile(lambda *a: gather_rows(*a) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(x, idx, offs)[:n], out[:n] * 2)
    x2, idx2, offs2 = make(5, 64, [12], 12, torch.bfloat16)  # every row local: nothing left unwritten
    torch.library.opcheck(torch.ops.minidi.gather_rows.default, (x2, idx2, offs2))


def test_clear_errors(monkeypatch):
    x, idx, offs = make(6, 64, [8], 8, torch.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        gather_rows(x.to(torch.int32), idx, offs)
    with pytest.raises(ValueError, match="x must be"):
        gather_rows(x[0], idx, offs)
    with pytest.raises(ValueError, match="idx must be"):
        gather_rows(x, idx.float(), offs)
    with pytest.raises(ValueError, match="idx must be"):
        gather_rows(x, idx.view(2, 4), offs)
    with pytest.raises(ValueError, match="offs must be"):
        gather_rows(x, idx, offs.long())
    with pytest.raises(ValueError, match="offs must be"):
        gather_rows(x, idx, offs[:0])
    with pytest.raises(ValueError, match="backend"):
        gather_rows(x, idx, offs, backend="cuda")
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)  # as if imported without TRITON_INTERPRET=1
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="backend='auto'"):
            gather_rows(x, idx, offs, backend="triton")
        assert torch.equal(gather_rows(x, idx, offs), gather_rows(x, idx, offs, backend="ref"))  # auto: the ref


@gpu
def test_gpu_v41_ep4_shape():
    """EP4-like: 4 x 4,096 tokens x top-6 = 98,304 rows, a quarter local (96 experts x 256), D 5,120."""
    x, idx, offs = make(16384, 5120, [256] * 96, 98304, torch.bfloat16, device="cuda")
    out = run(x, idx, offs)
    n = int(offs[-1])
    assert torch.equal(out[:n], x[idx][:n])
    assert (out[n:] == POISON).all()


# ---- gather_rows_fq8: fq8(x, block)[idx] on the local rows, in one pass --------------------------------------------
def fq8_of_rows(x, idx, block):
    """The oracle: minidi's fq8 op (its kernel where it runs) on the gathered rows, every row."""
    return fq8(x[idx.long()], block)


def run_fq8(x, idx, offs, block):
    out = torch.full((idx.shape[0], x.shape[1]), POISON, dtype=x.dtype, device=x.device)
    launch(x, idx, offs, out, block)
    return out


FQ8_CASES = [(11, 96, [5, 0, 15, 10], 37), (7, 256, [0, 24], 24), (5, 128, [0, 0], 19), (1, 160, [3, 2], 9),
             (3, 384, [4, 1], 6)]  # (T, D, counts, R) as CASES; D 96 / 160 / 384: not a power of two


@pytest.mark.parametrize("block,case", [(b, c) for b in (32, 128) for c in FQ8_CASES if c[1] % b == 0],
                         ids=lambda v: f"T{v[0]}_D{v[1]}_R{v[3]}" if isinstance(v, tuple) else f"block{v}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fq8_gather_equals_fq8_then_gather(case, dtype, block):
    t, d, counts, r = case
    x, idx, offs = make(t, d, counts, r, dtype, seed=block)
    x[0, :block] *= 1e-6  # a block under fq8's amax floor: scale 2^-22, its values on the subnormal grid
    n = min(int(offs[-1]), r)
    out = run_fq8(x, idx, offs, block)
    want = fq8_of_rows(x, idx, block)
    assert torch.equal(out[:n].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want[:n].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert (out[n:] == POISON).all()
    # the model's fq8 (minidi.formats' reference) gives the same bits on these finite rows
    assert torch.equal(out[:n], gather_rows_fq8(x, idx, offs, block, backend="ref")[:n])


def test_fq8_gather_poisoned_blocks_and_bad_index():
    x, idx, offs = make(6, 64, [8], 8, torch.float32)
    idx[:3] = torch.tensor([2, 3, 4])
    x[2, 5], x[3, 40] = float("nan"), float("inf")  # a NaN block and an infinite block: all NaN, their rows' other
    out = run_fq8(x, idx, offs, 32)                 # block exact
    assert out[0, :32].isnan().all() and torch.equal(out[0, 32:], fq8(x[2:3, 32:], 32)[0])
    assert out[1, 32:].isnan().all() and torch.equal(out[1, :32], fq8(x[3:4, :32], 32)[0])
    assert torch.equal(out[2], fq8(x[4:5], 32)[0])
    idx[5] = 6  # out of range: the kernel gives a NaN row (the op raises on CPU tensors: the test below)
    assert run_fq8(x, idx, offs, 32)[5].isnan().all()


@pytest.mark.interpreter
def test_fq8_gather_out_of_range_index_raises_on_cpu_tensors():
    x, idx, offs = make(6, 64, [8], 8, torch.float32, device="cpu")
    idx[5] = 6
    with pytest.raises(IndexError, match="gather_rows_fq8: idx holds 6"):
        gather_rows_fq8(x, idx, offs, 32)


def test_fq8_gather_op_compile_and_errors():
    x, idx, offs = make(11, 128, [5, 0, 15, 10], 37, torch.bfloat16)
    n = int(offs[-1])
    out = gather_rows_fq8(x, idx, offs, 32)
    f = torch.compile(lambda *a: gather_rows_fq8(*a, 32) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(x, idx, offs)[:n], out[:n] * 2)
    x2, idx2, offs2 = make(5, 64, [12], 12, torch.bfloat16)  # every row local: nothing left unwritten
    torch.library.opcheck(torch.ops.minidi.gather_rows_fq8.default, (x2, idx2, offs2, 32))
    with pytest.raises(ValueError, match="gather_rows_fq8: x must be"):
        gather_rows_fq8(x.to(torch.float16), idx, offs, 32)
    with pytest.raises(ValueError, match="multiple of block"):
        gather_rows_fq8(x[:, :96], idx, offs, 128)
    with pytest.raises(ValueError, match="block"):
        gather_rows_fq8(x, idx, offs, 64)
    with pytest.raises(ValueError, match="idx must be"):
        gather_rows_fq8(x, idx.float(), offs, 32)


@gpu
def test_gpu_fq8_gather_v41_ep4_shape():
    x, idx, offs = make(16384, 5120, [256] * 96, 98304, torch.bfloat16, device="cuda")
    out = run_fq8(x, idx, offs, 32)
    n = int(offs[-1])
    assert torch.equal(out[:n], fq8(x, 32)[idx][:n])
    assert (out[n:] == POISON).all()
