"""Pass M (indexer_candidates) on a module holding a V4.1 re-index layer's indexer as the model writes it (the
candidate source's block ids -> ``candidate_allowed`` mask -> ``indexer_topk_naive``): the rewritten graph
(expecttest snapshot), exact counts, static and dynamic shapes, picks equal to pass B alone, and its refusals.
Refresh the snapshot with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_indexer_candidates.py``.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

import minidi
from minidi.model.indexer import candidate_allowed, candidate_blocks, indexer_topk_naive
from minidi.ops.indexer_candidates import indexer_topk_candidates
from minidi.passes import select

from .helpers import graph_text, run

BLOCK, TOPK = 4, 6


class ReIndex(torch.nn.Module):
    """``form``: "model" (a re-index layer), "source" (the candidate source: its scores feed candidate_blocks),
    "mask" (a mask given as it is, not built from block ids), "block2" (the model's chain with blocks of 2),
    "spare_mismatch" (the chain by hand, its spare column not past cdiv(N, B) blocks: not candidate_allowed)."""

    def __init__(self, form: str = "model") -> None:
        super().__init__()
        self.form = form

    def forward(self, q, k, w, ks, ke, blocks):
        n = k.shape[0]
        if self.form == "mask":
            allowed = blocks
        elif self.form == "spare_mismatch":
            ids = blocks.masked_fill(blocks < 0, n)  # spare column n, not cdiv(n, B)
            keep = torch.zeros(blocks.shape[0], n + 1, dtype=torch.bool).scatter(1, ids, True)
            allowed = keep[:, torch.arange(n) // BLOCK]
        else:
            allowed = candidate_allowed(blocks, n, 2 if self.form == "block2" else BLOCK)
        idx, scores = indexer_topk_naive(q, k, w, ks, ke, TOPK, allowed)
        if self.form == "source":
            return idx, candidate_blocks(scores, ks, ke, 3, BLOCK)
        return idx


def inputs(seed: int, t: int = 5, n: int = 30, mask: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, w = torch.randn(t, 4, 32, generator=g), torch.randn(n, 32, generator=g), torch.randn(t, 4, generator=g)
    ks = torch.zeros(t, dtype=torch.long)
    ke = torch.randint(n // 2, n + 1, (t,), generator=g)
    blocks = candidate_blocks(torch.randn(t, n, generator=g), ks, ke, 3, BLOCK)
    blocks[1, -1] = -1
    return q, k, w, ks, ke, candidate_allowed(blocks, n, BLOCK) if mask else blocks


def test_indexer_candidates_rewrite():
    args = inputs(1)
    out, mgr, _, after = run(ReIndex(), args, "B,M", None)
    assert mgr.counts == {"B": 1, "M": 1}
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_blocks_: "i64[5, 3]", L_k_: "f32[30, 32]", L_ke_: "i64[5]", L_ks_: "i64[5]", L_q_: "f32[5, 4, 32]", L_w_: "f32[5, 4]"):
        l_blocks_ = L_blocks_
        l_k_ = L_k_
        l_ke_ = L_ke_
        l_ks_ = L_ks_
        l_q_ = L_q_
        l_w_ = L_w_
        indexer_topk_candidates: "i64[5, 6]" = minidi_ops_indexer_candidates_indexer_topk_candidates(l_q_, l_k_, l_w_, l_ks_, l_ke_, 6, l_blocks_, 4, backend = 'auto', mma = 'native');  l_q_ = l_k_ = l_w_ = l_ks_ = l_ke_ = l_blocks_ = None
        return (indexer_topk_candidates,)
""")
    ref, _, _, _ = run(ReIndex(), args, "B", None)
    assert torch.equal(out, ref)  # fp32 scores of exact products, one order of sums per key: the same picks
    assert torch.equal(out, indexer_topk_naive(*args[:5], TOPK, candidate_allowed(args[5], 30, BLOCK))[0])


def test_dynamic_shapes_match_and_follow_new_sizes():
    """Dynamic T and N (the served setting): N and cdiv(N, B) are symbolic and still recognised."""
    torch._dynamo.reset()
    step = minidi.compile(ReIndex(), "B,M", backend="aot_eager", dynamic=True, keep_graphs=True)
    for seed, (t, n) in enumerate([(5, 30), (7, 41), (6, 35)]):
        args = inputs(seed, t, n)
        got = step(*args)
        assert torch.equal(got, indexer_topk_naive(*args[:5], TOPK, candidate_allowed(args[5], n, BLOCK))[0])
    assert step.pass_manager.counts["M"] >= 1
    _, after = step.pass_manager.graphs[-1]
    assert any(n.target is indexer_topk_candidates for n in after.graph.nodes if n.op == "call_function")


def test_another_block_size_is_taken_with_it():
    args = inputs(4)
    out, mgr, _, _ = run(ReIndex("block2"), args, "B,M", None)
    assert mgr.counts == {"B": 1, "M": 1}
    assert torch.equal(out, indexer_topk_naive(*args[:5], TOPK, candidate_allowed(args[5], 30, 2))[0])


@pytest.mark.parametrize("form", ["source", "mask", "spare_mismatch"])
def test_refusals_leave_pass_b_s_op(form):
    """The candidate source (its scores are read), a mask not built from block ids, a hand-built chain whose spare
    column is not cdiv(N, B): B's op stays, M takes nothing."""
    args = inputs(2, mask=form == "mask")
    out, mgr, _, after = run(ReIndex(form), args, "B,M", None)
    assert mgr.counts == {"B": 1, "M": 0}
    calls = {n.target for n in after.graph.nodes if n.op == "call_function"}
    assert indexer_topk_candidates not in calls


def test_select_refuses_m_without_b():
    with pytest.raises(ValueError, match=r"pass M \(indexer_candidates\) rewrites the ops of passes B"):
        select("M")
    assert select("all")[-8:] == ["M", "T", "N", "R", "O", "P", "Q", "V"] and select("B,M") == ["B", "M"]
