"""minidi::expert_order vs ``flat.argsort(stable=True)`` and ``scatter_add_`` counts (CPU under TRITON_INTERPRET=1;
@gpu at the V4.1-Flash EP4 dispatch shape).

Integer results, compared exactly: the order is the stable one (each expert's rows in their original order), the
counts are every expert's rows, empty experts included. Outputs are poisoned, so an element left unwritten fails;
sizes cover one row, a single chunk, many chunks with a ragged last one, one expert, experts that get no row."""

from __future__ import annotations

import pytest
import torch

from minidi.ops import _triton_utils
from minidi.ops.expert_order import MAX_EXPERTS, expert_order, expert_order_ref, launch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


def run(flat, e):
    order = torch.full((flat.numel(),), -7, dtype=torch.int64, device=flat.device)
    counts = torch.full((e,), -7, dtype=torch.int64, device=flat.device)
    launch(flat, e, order, counts)
    return order, counts


def check(flat, e):
    order, counts = run(flat, e)
    ref_o, ref_c = expert_order_ref(flat, e)
    assert torch.equal(order, ref_o)
    assert torch.equal(counts, ref_c)
    assert torch.equal(counts, torch.bincount(flat.long(), minlength=e))


CASES = [(1, 1), (1, 9), (37, 5), (64, 384), (300, 384), (513, 3), (200, 1), (130, 70)]  # (R, E)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c[0]}_E{c[1]}")
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_equals_stable_argsort_and_counts(case, idx_dtype):
    r, e = case
    gen = torch.Generator().manual_seed(r * 31 + e)
    flat = torch.randint(0, e, (r,), generator=gen).to(idx_dtype).to(DEV)
    check(flat, e)


def test_skewed_and_sorted_inputs():
    gen = torch.Generator().manual_seed(4)
    hot = torch.where(torch.rand(400, generator=gen) < 0.8, 3, torch.randint(0, 50, (400,), generator=gen))
    check(hot.to(DEV), 50)  # one expert takes most rows, most experts none
    check(torch.arange(150, device=DEV) % 10, 10)  # every chunk holds every expert
    check(torch.arange(150, device=DEV).flip(0) // 15, 10)  # already sorted descending
    check(torch.full((90,), 6, device=DEV), 7)  # every row to the last expert


def test_empty():
    order, counts = run(torch.empty(0, dtype=torch.int64, device=DEV), 4)
    assert order.numel() == 0 and torch.equal(counts, torch.zeros(4, dtype=torch.int64, device=DEV))


def test_out_of_range_ids():
    flat = torch.tensor([2, 0, 5, 1, -1, 2], device=DEV)
    if DEV == "cpu":
        with pytest.raises(IndexError, match=r"flat holds 5, outside \[0, 4\)"):
            expert_order(flat.clamp(min=0), 4)
        with pytest.raises(IndexError, match="flat holds -1"):
            expert_order(flat, 4)
    order, counts = run(flat, 4)  # the kernels themselves: out-of-range rows last, in order, not counted
    assert order.tolist() == [1, 3, 0, 5, 2, 4] and counts.tolist() == [1, 1, 2, 0]


def test_public_op_compile_and_opcheck():
    flat = torch.randint(0, 12, (70,), generator=torch.Generator().manual_seed(5)).to(DEV)
    f = torch.compile(lambda a: expert_order(a, 12)[0] // 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(flat), expert_order_ref(flat, 12)[0] // 2)
    torch.library.opcheck(torch.ops.minidi.expert_order.default, (flat, 12))


def test_many_experts_run_the_reference_on_auto():
    flat = torch.randint(0, MAX_EXPERTS + 5, (40,), generator=torch.Generator().manual_seed(6)).to(DEV)
    o, c = expert_order(flat, MAX_EXPERTS + 5)
    assert torch.equal(o, flat.argsort(stable=True)) and int(c.sum()) == 40
    with pytest.raises(ValueError, match=f"n_experts <= {MAX_EXPERTS}"):
        expert_order(flat, MAX_EXPERTS + 5, backend="triton")


def test_clear_errors(monkeypatch):
    flat = torch.randint(0, 4, (10,)).to(DEV)
    with pytest.raises(ValueError, match="flat must be"):
        expert_order(flat.float(), 4)
    with pytest.raises(ValueError, match="flat must be"):
        expert_order(flat.view(2, 5), 4)
    with pytest.raises(ValueError, match="n_experts must be"):
        expert_order(flat, 0)
    with pytest.raises(ValueError, match="n_experts must be"):
        expert_order(flat, True)
    with pytest.raises(ValueError, match="backend"):
        expert_order(flat, 4, backend="cuda")
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)  # as if imported without TRITON_INTERPRET=1
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="backend='auto'"):
            expert_order(flat, 4, backend="triton")
        assert torch.equal(expert_order(flat, 4)[0], expert_order(flat, 4, backend="ref")[0])


@gpu
@pytest.mark.parametrize("r,e", [(98304, 384), (12288, 384), (1_572_864, 384), (98304, 3000)])
def test_gpu_dispatch_shapes(r, e):
    """EP4: 4 x 4,096 tokens x top-6 over 384 ids (the rank's 96 first); EP1 2,048 x 6; a 262,144-token batch; many
    experts (the offsets kernel's tile loop)."""
    gen = torch.Generator().manual_seed(r + e)
    check(torch.randint(0, e, (r,), generator=gen).cuda(), e)
