"""Passes J (hc_mix_fused) and K (hc_sinkhorn) on small modules holding an mHC site: the rewritten graph (expecttest
snapshot), exact counts, numerics equal to the unrewritten module within fp32 level, and look-alikes refused or
taken without the collapse. Refresh the snapshots with
``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_hc_site.py``.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from minidi.model.hyper_connections import hc_collapse, hc_head, hc_mixer

from .helpers import call_targets, graph_text, run

FUSED = "minidi.ops.hc_mix.hc_mix_fused"
SINKHORN = "minidi.ops.hc_sinkhorn.hc_sinkhorn"


class Site(torch.nn.Module):
    """A V4.1 site: the mixer of x, and the collapse of x with the previous site's ``pre`` (``own``: V4, with the
    mixer's own pre)."""

    def __init__(self, own: bool = False, collapse=hc_collapse) -> None:
        super().__init__()
        self.own, self.collapse = own, collapse

    def forward(self, x, pre, fn, base, scale):
        pre_a, post, comb = hc_mixer(x, fn, base, scale, 3, 1e-6, 1e-6)
        return pre_a, post, comb, self.collapse(x, pre_a if self.own else pre)


def inputs(seed=0, t=8, n=4, d=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g).to(dtype)
    return (x, torch.rand(t, n, generator=g), torch.randn(24, n * d, generator=g) * 0.1, torch.randn(24, generator=g),
            torch.randn(3, generator=g))


def assert_close_to_eager(out, module, args):
    want = module(*args)
    for got, ref in zip(out, want):
        if ref.dtype == torch.bfloat16:  # the collapse: one rounding of an fp32 sum of n terms
            assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-7).all()
        else:
            torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("passes", ["F,J", "J"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_v41_site_fuses_projection_mean_square_and_collapse(passes, dtype):
    args = inputs(dtype=dtype)
    out, mgr, _, after = run(Site(), args, passes, 1, strict=True)
    assert mgr.counts["J"] == 1
    assert_close_to_eager(out, Site(), args)
    calls = call_targets(after)
    assert calls.count(FUSED) == 1
    assert not {"matmul", "square", "mean", "minidi.ops.gate_tf32x3.gate_tf32x3", "unsqueeze"} & set(calls)


def test_v41_site_snapshot():
    _, _, _, after = run(Site(), inputs(), "F,J", 1, strict=True)
    head = graph_text(after).split("base: ")[0]
    assert_expected_inline(head, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_base_: "f32[24]", L_fn_: "f32[24, 64]", L_pre_: "f32[8, 4]", L_scale_: "f32[3]", L_x_: "bf16[8, 4, 16]"):
        l_base_ = L_base_
        l_fn_ = L_fn_
        l_pre_ = L_pre_
        l_scale_ = L_scale_
        l_x_ = L_x_
        hc_mix_fused = minidi_ops_hc_mix_hc_mix_fused(l_x_, l_fn_, l_pre_, backend = 'auto');  l_x_ = l_fn_ = l_pre_ = None
        getitem_9: "f32[8, 24]" = hc_mix_fused[0]
        getitem_10: "f32[8, 1]" = hc_mix_fused[1]
        getitem_11: "bf16[8, 16]" = hc_mix_fused[2];  hc_mix_fused = None
        add: "f32[8, 1]" = getitem_10 + 1e-06;  getitem_10 = None
        rsqrt: "f32[8, 1]" = torch.rsqrt(add);  add = None
        mu: "f32[8, 24]" = getitem_9 * rsqrt;  getitem_9 = rsqrt = None
        """)


def test_v4_site_keeps_its_collapse():
    """V4: the collapse weights come from this mixer (after it): the projection and mean square are fused, the
    collapse stays naive."""
    args = inputs(1)
    out, mgr, _, after = run(Site(own=True), args, "F,J", 1, strict=True)
    assert mgr.counts == {"F": 1, "J": 1}
    assert_close_to_eager(out, Site(own=True), args)
    fused = [n for n in after.graph.nodes if n.op == "call_function" and "hc_mix_fused" in str(n.target)]
    assert fused[0].args[2] is None and "sum" in call_targets(after)


def test_v4_head_taken_without_collapse():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 16, generator=g).bfloat16()
    args = (x, torch.randn(4, 64, generator=g) * 0.1, torch.randn(4, generator=g), torch.randn(1, generator=g))

    class Head(torch.nn.Module):
        def forward(self, x, fn, base, scale):
            return hc_head(x, fn, base, scale, 1e-6, 1e-6)

    out, mgr, _, _ = run(Head(), args, "F,J", 1, strict=True)
    assert mgr.counts == {"F": 1, "J": 1}
    assert ((out.float() - Head()(*args).float()).abs() <= Head()(*args).float().abs() * 2.0**-7 + 1e-6).all()


def _collapse_other_dim(x, pre):  # sums over D, not over the streams
    return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)


def _collapse_fp32_out(x, pre):  # keeps fp32: not the model's rounding point
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1)


@pytest.mark.parametrize("collapse", [_collapse_other_dim, _collapse_fp32_out])
def test_collapse_lookalikes_stay_naive(collapse):
    args = inputs(2)
    out, mgr, _, after = run(Site(collapse=collapse), args, "F,J", 1, strict=True)
    assert mgr.counts["J"] == 1  # the projection and mean square still fused
    fused = [n for n in after.graph.nodes if n.op == "call_function" and "hc_mix_fused" in str(n.target)]
    assert fused[0].args[2] is None
    for got, ref in zip(out, Site(collapse=collapse)(*args)):
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-5)


def test_mean_square_lookalikes_refused():
    """A sum of squares (not the mean), or the projection alone: J does not fire (F still does)."""

    def other_mean(x, fn):
        z = x.reshape(x.shape[0], -1).float()
        return (z @ fn.float().t()) * torch.rsqrt(z.square().sum(-1, keepdim=True) + 1e-6)

    def projection_only(x, fn):
        return x.reshape(x.shape[0], -1).float() @ fn.float().t()

    class M(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, x, fn):
            return self.f(x, fn)

    x, _, fn, _, _ = inputs(4)
    for f in (other_mean, projection_only):
        _, mgr, _, after = run(M(f), (x, fn), "F,J")
        assert mgr.counts == {"F": 1, "J": 0} and FUSED not in call_targets(after)


def test_mutation_between_mixer_and_collapse_keeps_the_collapse():
    class Mutating(torch.nn.Module):
        def forward(self, x, pre, fn, base, scale):
            pre_a, post, comb = hc_mixer(x, fn, base, scale, 3, 1e-6, 1e-6)
            x.mul_(2)  # the collapse reads the mutated streams
            return pre_a, hc_collapse(x, pre)

    args = inputs(5)
    out, mgr, _, after = run(Mutating(), tuple(a.clone() for a in args), "F,J")
    fused = [n for n in after.graph.nodes if n.op == "call_function" and "hc_mix_fused" in str(n.target)]
    assert all(n.args[2] is None for n in fused)
    want = Mutating()(*(a.clone() for a in args))
    assert torch.equal(out[1], want[1])


# ---- K: the Sinkhorn chain ------------------------------------------------------------------------------------------
def sinkhorn_naive(c, iters, eps, first_dim=-2):
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(dim=first_dim, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


class Sinkhorn(torch.nn.Module):
    def __init__(self, iters, eps=1e-6, first_dim=-2, tail=None) -> None:
        super().__init__()
        self.iters, self.eps, self.first_dim, self.tail = iters, eps, first_dim, tail

    def forward(self, c):
        out = sinkhorn_naive(c, self.iters, self.eps, self.first_dim)
        return out if self.tail is None else self.tail(out)


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_sinkhorn_rewrite_counts_iterations(iters):
    c = torch.randn(7, 4, 4, generator=torch.Generator().manual_seed(iters)) * 2
    out, mgr, _, after = run(Sinkhorn(iters), (c,), "K", 1, strict=True)
    node = next(n for n in after.graph.nodes if n.op == "call_function" and "hc_sinkhorn" in str(n.target))
    assert node.args[1:] == (iters, 1e-6)
    assert "softmax" not in call_targets(after) and "sum" not in call_targets(after)
    torch.testing.assert_close(out, sinkhorn_naive(c, iters, 1e-6), rtol=1e-5, atol=1e-7)


def test_sinkhorn_site_snapshot_tail():
    _, mgr, _, after = run(Site(), inputs(), "F,J,K", 1, strict=True)
    assert mgr.counts == {"F": 1, "J": 1, "K": 1}
    tail = graph_text(after).split("add_4.view(8, 4, 4)")[1]
    assert_expected_inline(tail, """\
;  add_4 = None
        hc_sinkhorn: "f32[8, 4, 4]" = minidi_ops_hc_sinkhorn_hc_sinkhorn(c, 3, 1e-06, backend = 'auto');  c = None
        return (pre, post, hc_sinkhorn, getitem_11)
""")


def test_sinkhorn_lookalikes():
    """Rows first: not this chain (refused). A step another node also reads: the chain ends before it, the rest
    stays naive and the result is unchanged."""
    c = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(9))
    _, mgr, before, after = run(Sinkhorn(3, first_dim=-1), (c,), "K")
    assert mgr.counts == {"K": 0} and graph_text(before) == graph_text(after)

    class Peek(torch.nn.Module):  # the first column step's result is also returned: iters 1 taken, then naive
        def forward(self, c):
            c = torch.softmax(c, dim=-1) + 1e-6
            c1 = c / (c.sum(dim=-2, keepdim=True) + 1e-6)
            c2 = c1 / (c1.sum(dim=-1, keepdim=True) + 1e-6)
            return c1 * 1.0, c2 / (c2.sum(dim=-2, keepdim=True) + 1e-6)

    out, mgr, _, after = run(Peek(), (c,), "K")
    node = next(n for n in after.graph.nodes if n.op == "call_function" and "hc_sinkhorn" in str(n.target))
    assert mgr.counts == {"K": 1} and node.args[1] == 1
    for got, want in zip(out, Peek()(c)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
