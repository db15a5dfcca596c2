"""minidi::moe_combine vs the naive combine (CPU under TRITON_INTERPRET=1; realistic sizes under @gpu).

Tolerance: the kernel sums each token's slots in slot order (0 + s_0 + ... + s_{k-1}, fp32), so it must be bitwise
equal to that sum (``slot_order_sum``) and bitwise equal across runs. torch's own ``sum(dim=1)`` uses that order too,
except that on the CPU the columns of the last partial 32-wide vector chunk are summed in another order: against the
reference (``moe_combine_ref``) the bound is rtol = atol = 1e-6 (bitwise where D % 32 == 0); against float64,
rtol 1e-6, atol 2e-6.
Legend: T tokens, k slots, R = T*k rows, D width.
"""

from __future__ import annotations

import pytest
import torch

from minidi.ops.moe_combine import moe_combine, moe_combine_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(t: int, k: int, d: int, dtype=torch.bfloat16, p_local: float = 0.5, device="cpu", poison=float("nan")):
    """rows [R, D] with non-local rows poisoned, order [R] (a random routing's argsort), local [R]."""
    r = t * k
    rows = torch.randn(r, d, device=device).to(dtype)
    order = torch.randperm(r, device=device)
    local = torch.rand(r, device=device) < p_local
    rows[~local] = poison
    return rows, order, local


def slot_order_sum(rows, order, local, k):
    """fp32 sum of each token's slots in slot order, 0 + s_0 + s_1 + ... (the order the kernel promises)."""
    r = torch.where(local[:, None], rows.float(), torch.zeros((), device=rows.device))
    slots = torch.zeros_like(r).index_copy_(0, order, r).view(-1, k, rows.shape[1])
    acc = torch.zeros_like(slots[:, 0])
    for j in range(k):
        acc = acc + slots[:, j]
    return acc


def f64_combine(rows, order, local, k):
    """float64 oracle: independent of summation order up to fp32 rounding of the result."""
    r = torch.where(local[:, None], rows.double(), torch.zeros((), dtype=torch.float64, device=rows.device))
    slots = torch.zeros_like(r)
    slots[order] = r
    return slots.view(-1, k, rows.shape[1]).sum(1)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_matches_reference_bitwise(k):
    torch.manual_seed(k)
    t, d = 13 + 2 * k, 72 + 37 * k  # ragged T and D (not multiples of the tile)
    rows, order, local = make(t, k, d)
    out = moe_combine(rows, order, local, k)
    ref = moe_combine_ref(rows, order, local, k)
    assert out.shape == (t, d) and out.dtype == torch.float32
    assert torch.equal(out, slot_order_sum(rows, order, local, k))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    n = d // 32 * 32  # torch's CPU sum keeps slot order on whole 32-column chunks
    assert torch.equal(out[:, :n], ref[:, :n])
    torch.testing.assert_close(out.double(), f64_combine(rows, order, local, k), rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_row_dtypes_and_strided_rows(dtype):
    torch.manual_seed(1)
    t, k, d = 9, 4, 1100  # D > one BLOCK_D tile
    rows, order, local = make(t, k, d + 16, dtype)
    rows = rows[:, 5:5 + d]  # row stride D + 16, not contiguous
    out = moe_combine(rows, order, local, k)
    assert torch.equal(out, slot_order_sum(rows, order, local, k))
    torch.testing.assert_close(out, moe_combine_ref(rows, order, local, k), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_poisoned_nonlocal_rows_never_leak(poison):
    torch.manual_seed(2)
    t, k, d = 21, 6, 100
    rows, order, local = make(t, k, d, torch.float32, p_local=0.3, poison=poison)
    out = moe_combine(rows, order, local, k)
    assert torch.isfinite(out).all()
    clean = rows.clone()
    clean[~local] = 0.0
    assert torch.equal(out, slot_order_sum(clean, order, local, k))


def test_all_nonlocal_tokens_are_exact_zeros():
    torch.manual_seed(3)
    t, k, d = 17, 6, 65
    rows, order, local = make(t, k, d, p_local=0.7)
    dead = torch.tensor([0, 5, 16])  # tokens with no local expert
    slot_of_row = order // k  # token of each sorted row
    local[torch.isin(slot_of_row, dead)] = False
    rows[~local] = float("nan")
    out = moe_combine(rows, order, local, k)
    assert torch.equal(out[dead].view(torch.int32), torch.zeros(len(dead), d, dtype=torch.int32))  # +0.0 bits
    assert torch.equal(out, slot_order_sum(rows, order, local, k))
    none = moe_combine(rows, order, torch.zeros_like(local), k)
    assert torch.equal(none.view(torch.int32), torch.zeros(t, d, dtype=torch.int32))


def test_deterministic_across_runs():
    torch.manual_seed(4)
    rows, order, local = make(31, 6, 257)
    a = moe_combine(rows, order, local, 6)
    b = moe_combine(rows, order, local, 6)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_empty():
    rows = torch.empty(0, 64, dtype=torch.bfloat16)
    out = moe_combine(rows, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bool), 6)
    assert out.shape == (0, 64) and out.dtype == torch.float32


def test_opcheck():
    torch.manual_seed(5)
    rows, order, local = make(5, 3, 40)
    torch.library.opcheck(torch.ops.minidi.moe_combine.default, (rows, order, local, 3))


def test_clear_errors(monkeypatch):
    rows, order, local = make(4, 2, 16)
    with pytest.raises(ValueError, match="rows must be"):
        moe_combine(rows.to(torch.int32), order, local, 2)
    with pytest.raises(ValueError, match="order must be"):
        moe_combine(rows, order.int(), local, 2)
    with pytest.raises(ValueError, match="local must be"):
        moe_combine(rows, order, local.int(), 2)
    with pytest.raises(ValueError, match="k must be"):
        moe_combine(rows, order, local, 3)
    with pytest.raises(ValueError, match="share a device"):
        moe_combine(rows, order.to("meta"), local, 2)
    with pytest.raises(ValueError, match="backend"):
        moe_combine(rows, order, local, 2, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        moe_combine(rows, order, local, 2)
    assert torch.equal(moe_combine(rows, order, local, 2, backend="ref"), moe_combine_ref(rows, order, local, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("p_local", [0.25, 1.0])
def test_gpu_bench_shape(p_local):
    torch.manual_seed(6)
    t, k, d = 4096, 6, 5120
    rows, order, local = make(t, k, d, device=DEV, p_local=p_local)
    out = moe_combine(rows, order, local, k)
    ref = moe_combine_ref(rows, order, local, k)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out, slot_order_sum(rows, order, local, k))
    torch.testing.assert_close(out.double(), f64_combine(rows, order, local, k), rtol=1e-6, atol=2e-6)
    again = moe_combine(rows, order, local, k)
    assert torch.equal(out.view(torch.int32), again.view(torch.int32))
    print(f"bitwise equal to the eager reference: {torch.equal(out, ref)}")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 5])
def test_gpu_ragged(k):
    torch.manual_seed(7)
    rows, order, local = make(333, k, 1000, device=DEV)
    out = moe_combine(rows, order, local, k)
    torch.testing.assert_close(out, moe_combine_ref(rows, order, local, k), rtol=1e-6, atol=1e-6)
