"""``compressed_view`` reads the pool by index (no concatenation of the whole pool): the same view and pool writes
as the concatenation it replaced, on random pools, padding, steps with no new rows, and a view of rows this step
overwrites (the view holds the pool as it was before the step)."""

from __future__ import annotations

import pytest
import torch

from minidi.model.attention import compressed_view
from minidi.model.context import RatioMeta


def _meta(view_idx, pool_src, pool_dst) -> RatioMeta:
    e = torch.zeros(0, dtype=torch.long)
    return RatioMeta(group_idx=e.view(0, 1), prev_idx=e.view(0, 1), entry_pos=e, pend_src=e, pend_dst=e,
                     view_idx=view_idx, pool_src=pool_src, pool_dst=pool_dst, k_start=e, k_end=e)


def _by_concatenation(pool, new, rm):
    rows = torch.cat([pool, new.to(pool.dtype)])
    want_pool = pool.clone().index_copy_(0, rm.pool_dst, rows[rm.pool_src])
    view = rows[rm.view_idx.clamp(min=0)]
    return torch.where((rm.view_idx >= 0).unsqueeze(-1), view, torch.zeros_like(view)), want_pool


@pytest.mark.parametrize("n_new", [0, 1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_concatenation(n_new, dtype):
    g = torch.Generator().manual_seed(n_new)
    p, w = 40, 8
    pool = torch.randn(p, w, generator=g).to(dtype)
    new = torch.randn(n_new, w, generator=g)  # fp32 rows, as the compressor makes them
    dst = torch.randperm(p, generator=g)[:n_new]
    old = torch.randperm(p, generator=g)[:12]
    old[0] = dst[0] if n_new else old[0]  # a row this step overwrites is also in the view: its old value
    view_idx = torch.cat([old, p + torch.arange(n_new), torch.full((3,), -1)])
    view_idx = view_idx[torch.randperm(len(view_idx), generator=g)]
    rm = _meta(view_idx, p + torch.arange(n_new), dst)
    want_view, want_pool = _by_concatenation(pool, new, rm)
    got = compressed_view(pool, new, rm)
    assert got.dtype == dtype and torch.equal(got, want_view)
    assert torch.equal(pool, want_pool)


def test_without_a_pool():
    new = torch.randn(5, 4)
    rm = _meta(torch.tensor([0, 2, 4, -1]), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    got = compressed_view(None, new, rm)
    assert torch.equal(got[:3], new[[0, 2, 4]]) and torch.equal(got[3], torch.zeros(4))
