"""Pass T (candidate_blocks) on a module holding the V4.1 candidate source's indexer as the model writes it (pass B's
scores -> ``candidate_blocks``: block maxima, the newest block forced, ``_pick``): the rewritten graph (expecttest
snapshot), exact counts, the same ids as the uncompiled model on fresh inputs, static and dynamic shapes, and its
refusals. Refresh the snapshot with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_candidate_blocks.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import minidi
from minidi.model.indexer import _pick, block_max, candidate_blocks, indexer_topk_naive
from minidi.ops.candidate_blocks import candidate_blocks as candidate_blocks_op

from .helpers import graph_text, run

BLOCK, KEEP, TOPK = 4, 3, 6


class Source(torch.nn.Module):
    """``form``: "model" (the candidate source: its indexer, then ``candidate_blocks`` on the scores), "scores" (the
    chain on a scores input), "pad0" (block maxima padded with 0, not -inf), "oldest" (the first visible block forced
    instead of the newest), "partial" (a maximum chain over the first B - 1 columns only), "read" (the block maxima
    also returned)."""

    def __init__(self, form: str = "model", block: int = BLOCK) -> None:
        super().__init__()
        self.form, self.block = form, block

    def forward(self, q, k, w, ks, ke):
        idx, scores = indexer_topk_naive(q, k, w, ks, ke, TOPK)
        b = self.block
        if self.form == "model":
            return idx, candidate_blocks(scores, ks, ke, KEEP, b)
        t, n = scores.shape
        if self.form in ("pad0", "partial"):
            cols = F.pad(scores.float(), (0, -n % b), value=0.0 if self.form == "pad0" else float("-inf"))
            cols = cols.view(t, -(-n // b), b).unbind(-1)
            bs = cols[0]
            for c in cols[1:b if self.form == "pad0" else b - 1]:
                bs = torch.maximum(bs, c)
        else:
            bs = block_max(scores, b)
        pos = ks if self.form == "oldest" else (ke - 1).clamp(min=0)
        force = torch.zeros_like(bs, dtype=torch.bool).scatter(1, (pos // b).unsqueeze(1), (ke > ks).unsqueeze(1))
        ids = _pick(bs.masked_fill(force, float("inf")), min(KEEP, bs.shape[1]))
        return (idx, ids, bs) if self.form == "read" else (idx, ids)


def inputs(seed: int, t: int = 5, n: int = 30):
    g = torch.Generator().manual_seed(seed)
    q, k, w = torch.randn(t, 4, 32, generator=g), torch.randn(n, 32, generator=g), torch.randn(t, 4, generator=g)
    ks = torch.randint(0, n // 4, (t,), generator=g)
    ke = torch.randint(n // 2, n + 1, (t,), generator=g)
    ke[1] = ks[1]  # a row with nothing visible
    return q, k, w, ks, ke


def test_candidate_blocks_rewrite():
    seed = int(torch.randint(0, 2**31 - 1, ()))
    args = inputs(seed)
    out, mgr, _, after = run(Source(), args, "B,T", None)
    assert mgr.counts == {"B": 1, "T": 1}
    text = graph_text(after)
    assert_expected_inline(text, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f32[30, 32]", L_ke_: "i64[5]", L_ks_: "i64[5]", L_q_: "f32[5, 4, 32]", L_w_: "f32[5, 4]"):
        l_k_ = L_k_
        l_ke_ = L_ke_
        l_ks_ = L_ks_
        l_q_ = L_q_
        l_w_ = L_w_
        indexer_topk = minidi_ops_indexer_score_indexer_topk(l_q_, l_k_, l_w_, l_ks_, l_ke_, 6, None, backend = 'auto');  l_q_ = l_k_ = l_w_ = None
        getitem_20: "i64[5, 6]" = indexer_topk[0]
        getitem_21: "f32[5, 30]" = indexer_topk[1];  indexer_topk = None
        candidate_blocks: "i64[5, 3]" = minidi_ops_candidate_blocks_candidate_blocks(getitem_21, l_ks_, l_ke_, 3, 4, None, backend = 'auto');  getitem_21 = l_ks_ = l_ke_ = None
        return (getitem_20, candidate_blocks)
""")
    assert "maximum" not in text and "topk" not in text.replace("indexer_topk", "")
    want = Source()(*args)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), seed


def test_bf16_scores_are_rounded_in_the_op():
    """bf16 q / k / w: pass B's fp32 scores reach the chain through a cast back to bf16 (its rounding point); T reads
    the fp32 scores with ``round_to`` bf16, so no bf16 copy is written, and its ids equal those of B alone (the same
    scores, the model's chain)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    args = tuple(a.bfloat16() if a.is_floating_point() else a for a in inputs(seed, 6, 203))
    out, mgr, _, after = run(Source("model", 8), args, "B,T", None)
    assert mgr.counts == {"B": 1, "T": 1}
    (node,) = [n for n in after.graph.nodes if n.target is candidate_blocks_op]
    assert node.args[5] == torch.bfloat16 and node.args[0].meta["example_value"].dtype == torch.float32
    assert not any(n.op == "call_method" and n.target == "to" for n in after.graph.nodes)
    want, _, _, _ = run(Source("model", 8), args, "B", None)
    assert torch.equal(out[1], want[1]), seed


@pytest.mark.parametrize("block", [1, 3, 8])
def test_other_block_sizes(block):
    """Blocks of 1 (no maximum chain), 3 (N not a multiple), 8 (V4.1-Flash's)."""
    args = inputs(3, n=37)
    out, mgr, _, _ = run(Source("model", block), args, "B,T", None)
    assert mgr.counts == {"B": 1, "T": 1}
    assert torch.equal(out[1], Source("model", block)(*args)[1])


def test_without_pass_b():
    """T takes the chain on the naive scores too (B not selected)."""
    args = inputs(4)
    out, mgr, _, _ = run(Source(), args, "T", None)
    assert mgr.counts == {"T": 1}
    assert torch.equal(out[1], Source()(*args)[1])


def test_dynamic_shapes_match_and_follow_new_sizes():
    """Dynamic T and N: the pad width, NB and min(keep, NB) are symbolic and still recognised."""
    torch._dynamo.reset()
    step = minidi.compile(Source(), "B,T", backend="aot_eager", dynamic=True, keep_graphs=True)
    for seed, (t, n) in enumerate([(5, 30), (7, 41), (6, 35)]):
        args = inputs(seed, t, n)
        got = step(*args)
        assert torch.equal(got[1], Source()(*args)[1])
    assert step.pass_manager.counts["T"] >= 1
    _, after = step.pass_manager.graphs[-1]
    assert any(n.target is candidate_blocks_op for n in after.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("form", ["pad0", "oldest", "partial", "read"])
def test_refusals(form):
    """Another pad value, another forced block, a maximum chain missing a column, block maxima read elsewhere: the
    model's chain stays (T matches nothing) and the result is the uncompiled one."""
    args = inputs(2)
    out, mgr, _, after = run(Source(form), args, "B,T", None)
    assert mgr.counts == {"B": 1, "T": 0}
    assert not any(n.target is candidate_blocks_op for n in after.graph.nodes if n.op == "call_function")
    want = Source(form)(*args)
    assert all(torch.equal(a, b) for a, b in zip(out[:2], want[:2]))  # the ids (B's scores may differ in the last bit)


def test_strict_counts_name_the_pass():
    with pytest.raises(Exception, match=r"pass T \(candidate_blocks\): expected 2 site\(s\), matched 1"):
        run(Source(), inputs(5), "B,T", 2, strict=True)
