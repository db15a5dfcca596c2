"""minidi::row_topk vs ``minidi.selection.topk_lowest_index`` and a stable descending sort (CPU under
TRITON_INTERPRET=1; @gpu at the router's V4.1-Flash EP4 shape).

A selection: the indices are compared exactly, the values bit for bit (NaN by position: a NaN's payload is the
input's in the kernel, the reference's gather may change it). Ties are made common on purpose (values drawn from a
few levels), with NaN, +-inf and signed zeros; outputs are poisoned, so a pick left unwritten fails."""

from __future__ import annotations

import pytest
import torch

from minidi.ops import _triton_utils
from minidi.ops.row_topk import MAX_N, launch, row_topk, row_topk_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


def make(r, n, dtype, seed=0, levels=5, specials=True, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels + 1, (r, n), generator=gen).float() / 4  # exact in every dtype: many ties
    if specials and n >= 6:  # row 0: NaN and +inf; 1: all -inf; 2: signed zeros above -1; 3: one -inf
        x[0, 1] = float("nan")
        x[0, 3] = float("inf")
        x[1 % r, :] = float("-inf")
        x[2 % r, 0], x[2 % r, n - 1] = -0.0, 0.0
        x[2 % r, 1:n - 1] = -1.0
        x[3 % r, 2] = float("-inf")
    return x.to(dtype).to(device)


def poisoned(x, k):
    r = x.reshape(-1, x.shape[-1]).shape[0]
    return (torch.full((r, k), 777.0, dtype=x.dtype, device=x.device),
            torch.full((r, k), -5, dtype=torch.int64, device=x.device))


def stable_descending(x, k):
    """The spec's selection: a stable descending sort (NaN as +inf), cut to k."""
    key = x.float().masked_fill(x.isnan(), float("inf"))
    return key.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def same_values(a, b):
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(torch.where(nan, 0, a).view(torch.int16 if a.element_size() == 2 else torch.int32),
                       torch.where(nan, 0, b).view(torch.int16 if b.element_size() == 2 else torch.int32))


CASES = [(5, 384, 6), (9, 7, 7), (4, 100, 1), (3, 1, 1), (6, 33, 0), (2, 600, 40), (1, 8, 8)]  # (R, N, k)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c[0]}_N{c[1]}_k{c[2]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_reference_and_stable_sort(case, dtype):
    r, n, k = case
    x = make(r, n, dtype, seed=r * n + k)
    values, indices = poisoned(x, k)
    launch(x, k, values, indices)
    ref_v, ref_i = row_topk_ref(x, k)
    assert torch.equal(indices, ref_i)
    assert torch.equal(indices, stable_descending(x, k))
    same_values(values, ref_v)
    assert torch.equal(values.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       x.gather(1, indices).view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_fresh_random_rows_without_ties():
    x = torch.randn(17, 384, generator=torch.Generator().manual_seed(3)).to(DEV)
    v, i = row_topk(x, 6, backend="triton")
    ref = torch.topk(x, 6, dim=-1)  # no ties among random floats: torch's own top-k agrees
    assert torch.equal(i, ref.indices) and torch.equal(v, ref.values)


def test_leading_dims_and_strided_rows():
    x = make(12, 50, torch.float32, seed=5)
    x3 = x.view(3, 4, 50)
    v, i = row_topk(x3, 4, backend="triton")
    rv, ri = row_topk_ref(x3, 4)
    assert v.shape == (3, 4, 4) and torch.equal(i, ri)
    same_values(v, rv)
    wide = make(6, 80, torch.float32, seed=6)[:, 10:70]  # row stride 80, unit column stride
    v, i = row_topk(wide, 5, backend="triton")
    assert torch.equal(i, row_topk_ref(wide, 5)[1])
    cols = make(40, 6, torch.float32, seed=7).t()  # column stride 6: copied to unit stride
    assert torch.equal(row_topk(cols, 3, backend="triton")[1], row_topk_ref(cols, 3)[1])


def test_long_rows_run_the_reference_on_auto():
    x = make(2, MAX_N + 1, torch.float32, seed=8, specials=False)
    v, i = row_topk(x, 3)
    assert torch.equal(i, row_topk_ref(x, 3)[1])
    with pytest.raises(ValueError, match=f"N <= {MAX_N}"):
        row_topk(x, 3, backend="triton")


def test_public_op_compile_and_opcheck():
    x = make(6, 40, torch.float32, seed=9)
    f = torch.compile(lambda a: row_topk(a, 5)[1] * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(x), row_topk_ref(x, 5)[1] * 2)
    torch.library.opcheck(torch.ops.minidi.row_topk.default, (make(4, 24, torch.float32, specials=False), 3))


def test_clear_errors(monkeypatch):
    x = make(4, 16, torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        row_topk(x.long(), 2)
    with pytest.raises(ValueError, match="x must be"):
        row_topk(x[0, 0], 1)
    with pytest.raises(ValueError, match=r"k must be an int in \[0, N = 16\]"):
        row_topk(x, 17)
    with pytest.raises(ValueError, match="k must be"):
        row_topk(x, -1)
    with pytest.raises(ValueError, match="k must be"):
        row_topk(x, 2.0)
    with pytest.raises(ValueError, match="backend"):
        row_topk(x, 2, backend="cuda")
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)  # as if imported without TRITON_INTERPRET=1
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="backend='auto'"):
            row_topk(x, 2, backend="triton")
        assert torch.equal(row_topk(x, 2)[1], row_topk(x, 2, backend="ref")[1])  # auto: the reference


@gpu
def test_gpu_router_shape():
    """V4.1-Flash EP4's router: 16,384 tokens x 384 experts, k 6, fp32 scores with ties."""
    x = make(16384, 384, torch.float32, seed=11, levels=40, device="cuda")
    values, indices = poisoned(x, 6)
    launch(x, 6, values, indices)
    ref_v, ref_i = row_topk_ref(x, 6)
    assert torch.equal(indices, ref_i)
    same_values(values, ref_v)
