"""minidi::moe_combine vs the naive combine (CPU under TRITON_INTERPRET=1; realistic sizes under @gpu).

Tolerance: the kernel sums each token's slots in slot order (0 + s_0 + ... + s_{k-1}, fp32), so it must be bitwise
equal to that sum (``slot_order_sum``) and bitwise equal across runs. torch's own ``sum(dim=1)`` uses that order too,
except that on the CPU the columns of the last partial 32-wide vector chunk are summed in another order: against the
reference (``moe_combine_ref``) the bound is rtol = atol = 1e-6; against float64, rtol 1e-6, atol 2e-6.
Legend: T tokens, k slots, R = T*k rows, D width.
"""

from __future__ import annotations

import pytest
import torch

from minidi.model.moe import moe_combine_naive
from minidi.ops import _triton_utils
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


def routed(t: int, k: int, d: int, n_exp: int, ep: int, device="cpu", seed: int = 0):
    """The bench's structure: top-k distinct experts per token, ``order`` = stable argsort of the flat expert ids
    (sorted row -> token-slot), local = rows of experts 0 .. n_exp/ep - 1, non-local rows NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.rand(t, n_exp, device=device, generator=g).topk(k, dim=-1).indices  # [T, k]
    flat = idx.flatten()
    order = flat.argsort(stable=True)  # [R]
    local = (flat[order] < n_exp // ep)  # [R] expert of each sorted row is local
    rows = torch.randn(t * k, d, device=device, generator=g).to(torch.bfloat16)
    rows[~local] = float("nan")
    return rows, order, local


@pytest.mark.parametrize("ep", [4, 1])
def test_routed_structure_ragged_d(ep):
    """Realistic routing (sorted by expert, EP mask by expert range), D not a multiple of BLOCK_D (1,000 = 1,024 - 24,
    and 1,100 spans two tiles)."""
    for d in (1000, 1100):
        rows, order, local = routed(19, 6, d, 16, ep, seed=d + ep)
        out = moe_combine(rows, order, local, 6)
        assert torch.isfinite(out).all()
        assert torch.equal(out, slot_order_sum(rows, order, local, 6))
        torch.testing.assert_close(out, moe_combine_ref(rows, order, local, 6), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out.double(), f64_combine(rows, order, local, 6), rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
@pytest.mark.interpreter
def test_matches_reference_bitwise(k):
    torch.manual_seed(k)
    t, d = 13 + 2 * k, 72 + 37 * k  # ragged T and D (not multiples of the tile)
    rows, order, local = make(t, k, d, torch.float32 if k % 2 else torch.bfloat16)
    out = moe_combine(rows, order, local, k)
    ref = moe_combine_ref(rows, order, local, k)
    assert out.shape == (t, d) and out.dtype == torch.float32
    assert torch.equal(out, slot_order_sum(rows, order, local, k))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
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
@pytest.mark.interpreter
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ref_is_the_model_naive_function(dtype):
    """``moe_combine_ref`` is a deliberate twin of the model's ``moe_combine_naive`` (the ops import nothing of the
    model): bit-equal, NaN-poisoned non-local rows included."""
    torch.manual_seed(11)
    rows, order, local = make(13, 6, 48, dtype)
    assert torch.equal(moe_combine_ref(rows, order, local, 6), moe_combine_naive(rows, order, local, 6))


def test_empty():
    rows = torch.empty(0, 64, dtype=torch.bfloat16)
    out = moe_combine(rows, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bool), 6)
    assert out.shape == (0, 64) and out.dtype == torch.float32


@pytest.mark.interpreter
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
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)  # as if imported without TRITON_INTERPRET=1
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET.*backend='auto'"):
        moe_combine(rows, order, local, 2, backend="triton")
    assert torch.equal(moe_combine(rows, order, local, 2, backend="ref"), moe_combine_ref(rows, order, local, 2))
    assert torch.equal(moe_combine(rows, order, local, 2), moe_combine_ref(rows, order, local, 2))  # auto: the ref


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
@pytest.mark.parametrize("ep", [4, 1])
def test_gpu_bench_routing(ep):
    """The bench's exact shape and structure (T 4,096, k 6, D 5,120, 384 experts, EP4 / all local). The op must be
    bitwise equal to the slot-order fp32 sum; torch's CUDA ``sum(dim=1)`` over the k = 6 slots may pair the adds in
    another order, so against the naive combine the bound is the one for any two summation orders of k terms,
    |diff| <= 2 (k - 1) 2^-24 sum_j |s_j| per element (the bench's "bitwise False, max_err 2.4e-7 / 9.5e-7" of the first
    H200 round was that: ~1 ulp differences, not a wrong row)."""
    t, k, d = 4096, 6, 5120
    rows, order, local = routed(t, k, d, 384, ep, device=DEV, seed=ep)
    out = moe_combine(rows, order, local, k)
    assert torch.isfinite(out).all()
    assert torch.equal(out, slot_order_sum(rows, order, local, k))
    ref = moe_combine_ref(rows, order, local, k)  # the naive combine's code
    bound = 2 * (k - 1) * 2.0**-24 * slot_order_sum(rows.abs(), order, local, k)
    diff = (out - ref).abs()
    assert (diff <= bound).all(), f"{int((diff > bound).sum())} elements over the reordering bound, max {diff.max()}"
    torch.testing.assert_close(out.double(), f64_combine(rows, order, local, k), rtol=1e-6, atol=2e-6)
    print(f"EP{ep}: bitwise equal to the naive combine at {(diff == 0).float().mean().item():.4%} of elements")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 5])
def test_gpu_ragged(k):
    torch.manual_seed(7)
    rows, order, local = make(333, k, 1000, device=DEV)
    out = moe_combine(rows, order, local, k)
    torch.testing.assert_close(out, moe_combine_ref(rows, order, local, k), rtol=1e-6, atol=1e-6)
