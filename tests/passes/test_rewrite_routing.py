"""Passes P (``topk_lowest_index`` -> ``minidi.ops.row_topk``) and Q (the dispatch's stable argsort + expert counts
-> ``minidi.ops.expert_order``): the rewritten graphs (expecttest snapshots), exact counts, results equal to the
naive module, the look-alikes refused. Counts on the tiny models' graphs: ``test_models.py``.
Refresh the snapshots with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_routing.py``."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from minidi.selection import topk_lowest_index, topk_set

from .helpers import Fn, call_targets, graph_text, run


def scores(r=6, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, (r, n), generator=g).float() / 2  # many ties
    s[0, 2] = float("nan")
    return s, torch.randn(n, generator=g)


def router(s, b):  # the router's use (minidi.model.moe.Gate): the indices only
    return topk_lowest_index(s + b, 4)[1]


def test_row_topk_rewrite():
    s, b = scores()
    out, mgr, _, after = run(Fn(router), (s, b), "P", 1, strict=True)
    assert mgr.counts == {"P": 1}
    assert torch.equal(out, router(s, b))
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[6, 24]", L_args_1_: "f32[24]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        add: "f32[6, 24]" = l_args_0_ + l_args_1_;  l_args_0_ = l_args_1_ = None
        row_topk = minidi_ops_row_topk_row_topk(add, 4, backend = 'auto');  add = None
        getitem_8: "i64[6, 4]" = row_topk[1];  row_topk = None
        return (getitem_8,)
""")


def test_row_topk_values_too():
    s, b = scores(seed=1)
    fn = Fn(lambda s, b: topk_lowest_index(s * b, 5))
    (v, i), mgr, _, after = run(fn, (s, b), "P", 1, strict=True)
    rv, ri = topk_lowest_index(s * b, 5)
    assert mgr.counts == {"P": 1} and torch.equal(i, ri)
    torch.testing.assert_close(v, rv, rtol=0, atol=0, equal_nan=True)
    assert "topk" not in call_targets(after) and "sort" not in call_targets(after)


@pytest.mark.parametrize("fn", [
    lambda s, b: torch.topk(s + b, 4, dim=-1).indices,  # torch's own tie-break
    lambda s, b: topk_set(s + b, 4),  # the set in ascending order (pass B's building block), not the ranking
    lambda s, b: (s + b).sort(dim=-1, descending=True, stable=True).indices[:, :4],
])
def test_row_topk_lookalikes_not_taken(fn):
    s, b = scores(seed=2)
    _, mgr, before, after = run(Fn(fn), (s, b), "P")
    assert mgr.counts == {"P": 0} and graph_text(before) == graph_text(after)


def routing(flat):  # minidi.model.moe.RoutedExperts.forward's lines
    order = flat.argsort(stable=True)
    counts = torch.zeros(9, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order // 3, counts[:5].cumsum(0).to(torch.int32)


def test_expert_order_rewrite():
    flat = torch.randint(0, 9, (30,), generator=torch.Generator().manual_seed(3))
    (o, offs), mgr, _, after = run(Fn(routing), (flat,), "Q", 1, strict=True)
    ro, roffs = routing(flat)
    assert mgr.counts == {"Q": 1} and torch.equal(o, ro) and torch.equal(offs, roffs)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "i64[30]"):
        l_args_0_ = L_args_0_
        expert_order = minidi_ops_expert_order_expert_order(l_args_0_, 9, backend = 'auto');  l_args_0_ = None
        getitem_1: "i64[30]" = expert_order[0]
        getitem_2: "i64[9]" = expert_order[1];  expert_order = None
        floordiv: "i64[30]" = getitem_1 // 3;  getitem_1 = None
        getitem: "i64[5]" = getitem_2[slice(None, 5, None)];  getitem_2 = None
        cumsum: "i64[5]" = getitem.cumsum(0);  getitem = None
        to: "i32[5]" = cumsum.to(torch.int32);  cumsum = None
        return (floordiv, to)
""")


def _counts(flat, src):
    return torch.zeros(9, dtype=torch.long, device=flat.device).scatter_add_(0, flat, src)


@pytest.mark.parametrize("fn", [
    lambda f: (f.argsort(), _counts(f, torch.ones_like(f))),  # not stable: ties in any order
    lambda f: (f.argsort(stable=True, descending=True), _counts(f, torch.ones_like(f))),
    lambda f: (f.argsort(stable=True), _counts(f, f)),  # a sum of other values, not counts
    lambda f: (f.argsort(stable=True),),  # no counts beside it
    lambda f: (_counts(f, torch.ones_like(f)),),  # no sort beside it
])
def test_expert_order_lookalikes_not_taken(fn):
    flat = torch.randint(0, 9, (20,), generator=torch.Generator().manual_seed(4))
    _, mgr, before, after = run(Fn(fn), (flat,), "Q")
    assert mgr.counts == {"Q": 0} and graph_text(before) == graph_text(after)
