"""Each rewrite on a small module holding its naive subgraph: the rewritten graph (expecttest snapshot), the exact
match count, numerics equal to the unrewritten module, and look-alikes refused (0 matches, graph unchanged).

Static shapes keep the snapshots free of symbol names; the model tests cover dynamic shapes.
Refresh the snapshots with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrites.py``.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import minidi
from minidi.model.attention import compressed_view
from minidi.model.context import RatioMeta
from minidi.model.indexer import indexer_topk_naive
from minidi.model.moe import dequant_expert_stack, gate_logits_fp32, grouped_mm, moe_combine_naive
from minidi.model.quant import fq4_ue8m0, fq8, quantize_fp4
from minidi.selection import topk_set
from minidi.model import stages
from minidi.model.layers import apply_rope, rms_norm, rope_cos_sin_lookup
from minidi.model.sparse_attention import sparse_attention_naive
from minidi.ops.sparse_attention import ROPE_OUT, ROPE_Q, sparse_attention
from minidi.passes import PassMatchError

from .helpers import Fn, call_targets, compile_with, graph_text, run


# ---- C: moe combine -------------------------------------------------------------------------------------------------
def moe_inputs(g):
    r, d, k = 8, 32, 2
    rows = torch.randn(r, d, generator=g)
    rows[1] = float("nan")  # a non-local row may hold garbage
    local = torch.ones(r, dtype=torch.bool)
    local[1] = False
    return rows, torch.randperm(r, generator=g), local, k


def test_moe_combine_rewrite():
    rows, order, local, k = moe_inputs(torch.Generator().manual_seed(0))
    m = Fn(moe_combine_naive, k=k)
    out, mgr, _, after = run(m, (rows, order, local), "C", 1, strict=True)
    assert mgr.counts == {"C": 1}
    torch.testing.assert_close(out, m(rows, order, local), rtol=1e-6, atol=1e-6)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[8, 32]", L_args_1_: "i64[8]", L_args_2_: "b8[8]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        moe_combine: "f32[4, 32]" = minidi_ops_moe_combine_moe_combine(l_args_0_, l_args_1_, l_args_2_, 2, backend = 'auto');  l_args_0_ = l_args_1_ = l_args_2_ = None
        return (moe_combine,)
""")


def test_moe_combine_lookalike_where_other_predicate():
    def combine_positive(rows, order, local, k):  # where on r > 0, not on the per-row local mask
        r = rows.float()
        r = torch.where(r > 0, r, torch.zeros_like(r))
        slots = torch.zeros_like(r).index_copy_(0, order, r)
        return slots.view(-1, k, r.shape[-1]).sum(dim=1)

    rows, order, local, k = moe_inputs(torch.Generator().manual_seed(0))
    rows = rows.nan_to_num()
    _, mgr, before, after = run(Fn(combine_positive, k=k), (rows, order, local), "C")
    assert mgr.counts == {"C": 0} and graph_text(before) == graph_text(after)


# ---- E: gate ----------------------------------------------------------------------------------------------------------
def gate(x, w):
    return torch.sqrt(F.softplus(gate_logits_fp32(x, w)))


def test_gate_rewrite():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=g), torch.randn(8, 64, generator=g).bfloat16()
    out, mgr, _, after = run(Fn(gate), (x, w), "E", 1, strict=True)
    assert mgr.counts == {"E": 1}
    torch.testing.assert_close(out, gate(x, w), rtol=1e-5, atol=1e-5)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[5, 64]", L_args_1_: "bf16[8, 64]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        gate_tf32x3: "f32[5, 8]" = minidi_ops_gate_tf32x3_gate_tf32x3(l_args_0_, l_args_1_, backend = 'auto');  l_args_0_ = l_args_1_ = None
        softplus: "f32[5, 8]" = torch._C._nn.softplus(gate_tf32x3);  gate_tf32x3 = None
        sqrt: "f32[5, 8]" = torch.sqrt(softplus);  softplus = None
        return (sqrt,)
""")


def test_gate_lookalike_head_gemm_not_taken():
    def head(x, w):  # the same fp32 GEMM shape as the gate, but not feeding the router's softplus
        return x.float() @ w.float().t()

    g = torch.Generator().manual_seed(1)
    _, mgr, before, after = run(Fn(head), (torch.randn(5, 64, generator=g), torch.randn(8, 64, generator=g)), "E")
    assert mgr.counts == {"E": 0} and graph_text(before) == graph_text(after)


# ---- F: mHC mixer projection -----------------------------------------------------------------------------------------
def hc_inputs(g, n=4, d=48, t=5):
    x = torch.randn(t, n, d, generator=g).bfloat16()
    fn = torch.randn((2 + n) * n, n * d, generator=g) * (n * d) ** -0.5
    return x, fn, torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g)


def test_hc_mix_rewrite():
    from minidi.model.hyper_connections import hc_mixer

    x, fn, base, scale = hc_inputs(torch.Generator().manual_seed(2))
    m = Fn(hc_mixer, iters=3, hc_eps=1e-6, norm_eps=1e-6)
    out, mgr, _, after = run(m, (x, fn, base, scale), "F", 1, strict=True)
    assert mgr.counts == {"F": 1}
    for got, want in zip(out, hc_mixer(x, fn, base, scale, 3, 1e-6, 1e-6)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    calls = call_targets(after)
    assert "minidi.ops.gate_tf32x3.gate_tf32x3" in calls and "matmul" not in str(calls)


def test_hc_mix_lookalikes_not_taken():
    """The router GEMM (pass E's: bf16 weight, feeds softplus) and a wide fp32 GEMM (an output head) stay."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    _, mgr, before, after = run(Fn(gate), (x, torch.randn(8, 64, generator=g).bfloat16()), "F")
    assert mgr.counts == {"F": 0} and graph_text(before) == graph_text(after)

    def head(x, w):
        return x.float() @ w.float().t()

    _, mgr, before, after = run(Fn(head), (x, torch.randn(65, 64, generator=g)), "F")  # 65 > THIN_N rows
    assert mgr.counts == {"F": 0} and graph_text(before) == graph_text(after)
    _, mgr, _, after = run(Fn(head), (x, torch.randn(24, 64, generator=g)), "F")  # thin fp32: taken
    assert mgr.counts == {"F": 1}
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[5, 64]", L_args_1_: "f32[24, 64]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        gate_tf32x3: "f32[5, 24]" = minidi_ops_gate_tf32x3_gate_tf32x3(l_args_0_, l_args_1_, backend = 'auto');  l_args_0_ = l_args_1_ = None
        return (gate_tf32x3,)
""")


# ---- G: mHC stream update ------------------------------------------------------------------------------------------
def expand_inputs(g, t=5, n=4, d=24, dt=torch.bfloat16):
    x, h = torch.randn(t, n, d, generator=g).to(dt), torch.randn(t, d, generator=g).to(dt)
    return x, h, torch.rand(t, n, generator=g), torch.rand(t, n, n, generator=g)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_hc_expand_rewrite(dt):
    from minidi.model.hyper_connections import hc_expand

    x, h, post, comb = expand_inputs(torch.Generator().manual_seed(4), dt=dt)
    out, mgr, _, after = run(Fn(hc_expand), (x, h, post, comb), "G", 1, strict=True)
    assert mgr.counts == {"G": 1}
    ref = (post.double()[..., None] * h.double()[:, None] + torch.einsum("tjk,tjd->tkd", comb.double(), x.double()))
    assert out.dtype == dt
    torch.testing.assert_close(out.double(), ref.to(dt).double(), rtol=0, atol=0.02 if dt == torch.bfloat16 else 1e-5)
    naive = hc_expand(x, h, post, comb).float()  # fp32 sums in another order, then one rounding
    assert (out.float() - naive).abs().max() <= 2**-7 * naive.abs().max()
    targets = str(call_targets(after))
    assert "minidi.ops.hc_expand.hc_expand" in targets and "einsum" not in targets and "hc_stream_mix" not in targets


def test_hc_expand_snapshot():
    """The whole update becomes one hc_expand call on the streams, h, post and comb (no .float() copies left)."""
    from minidi.model.hyper_connections import hc_expand

    x, h, post, comb = expand_inputs(torch.Generator().manual_seed(6), t=3, d=8)
    out, mgr, _, after = run(Fn(hc_expand), (x, h, post, comb), "G", 1, strict=True)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "bf16[3, 4, 8]", L_args_1_: "bf16[3, 8]", L_args_2_: "f32[3, 4]", L_args_3_: "f32[3, 4, 4]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_3_ = L_args_3_
        hc_expand: "bf16[3, 4, 8]" = minidi_ops_hc_expand_hc_expand(l_args_0_, l_args_1_, l_args_2_, l_args_3_, backend = 'auto');  l_args_0_ = l_args_1_ = l_args_2_ = l_args_3_ = None
        return (hc_expand,)
""")
    assert mgr.counts == {"G": 1}


def test_hc_expand_einsum_only_snapshot():
    """The einsum alone (its tail is not the update) becomes one hc_stream_mix call (its .float() stays)."""
    g = torch.Generator().manual_seed(5)
    comb, x = torch.rand(5, 4, 4, generator=g), torch.randn(5, 4, 8, generator=g)
    mix = Fn(lambda c, v: torch.einsum("tjk,tjd->tkd", c, v.float()))
    out, mgr, _, after = run(mix, (comb, x), "G", 1, strict=True)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[5, 4, 4]", L_args_1_: "f32[5, 4, 8]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        float_1: "f32[5, 4, 8]" = l_args_1_.float();  l_args_1_ = None
        hc_stream_mix: "f32[5, 4, 8]" = minidi_ops_hc_streams_hc_stream_mix(l_args_0_, float_1);  l_args_0_ = float_1 = None
        return (hc_stream_mix,)
""")
    assert mgr.counts == {"G": 1}
    torch.testing.assert_close(out, torch.einsum("tjk,tjd->tkd", comb, x), rtol=1e-6, atol=1e-6)


def test_hc_expand_lookalikes_not_taken():
    """Another equation (sum over the second index, k), and bf16 operands: left alone."""
    g = torch.Generator().manual_seed(5)
    comb, x = torch.rand(5, 4, 4, generator=g), torch.randn(5, 4, 8, generator=g)
    for fn, args in ((lambda c, v: torch.einsum("tkj,tjd->tkd", c, v), (comb, x)),
                     (lambda c, v: torch.einsum("tjk,tjd->tkd", c, v), (comb.bfloat16(), x.bfloat16()))):
        _, mgr, before, after = run(Fn(fn), args, "G")
        assert mgr.counts == {"G": 0} and graph_text(before) == graph_text(after)


def test_hc_expand_other_tails_keep_the_einsum_rewrite():
    """Tails that are not the model's update: the einsum's result also returned, the cast to another dtype than the
    streams', post unsqueezed at another dim: only the einsum is rewritten (hc_stream_mix), the tail stays."""
    def also_mixed(x, h, post, comb):
        mixed = torch.einsum("tjk,tjd->tkd", comb, x.float())
        return (post.unsqueeze(-1) * h.float().unsqueeze(1) + mixed).to(x.dtype), mixed

    def other_dtype(x, h, post, comb):
        mixed = torch.einsum("tjk,tjd->tkd", comb, x.float())
        return (post.unsqueeze(-1) * h.float().unsqueeze(1) + mixed).to(torch.float16)

    def post_per_column(x, h, post, comb):  # post [T, n] broadcast over the wrong axis (n == D here)
        mixed = torch.einsum("tjk,tjd->tkd", comb, x.float())
        return (post.unsqueeze(1) * h.float().unsqueeze(1) + mixed).to(x.dtype)

    x, h, post, comb = expand_inputs(torch.Generator().manual_seed(7), d=4)
    for fn in (also_mixed, other_dtype, post_per_column):
        out, mgr, _, after = run(Fn(fn), (x, h, post, comb), "G", 1, strict=True)
        targets = str(call_targets(after))
        assert mgr.counts == {"G": 1} and "hc_stream_mix" in targets and "hc_expand" not in targets, fn.__name__
        torch.testing.assert_close(out, fn(x, h, post, comb), rtol=1e-6, atol=1e-6)


# ---- A: sparse attention ----------------------------------------------------------------------------------------------
def attn_inputs(g, comp: bool):
    t, h, d, nw, nc, w, kk = 5, 4, 32, 12, 6, 4, 3
    q = torch.randn(t, h, d, generator=g)
    wkv, ckv = torch.randn(nw, d, generator=g), torch.randn(nc, d, generator=g)
    widx = torch.randint(0, nw, (t, w), generator=g)
    widx[:, 0] = -1
    cidx = torch.randint(-1, nc, (t, kk), generator=g)
    sink = torch.randn(h, generator=g)
    return (q, wkv, widx, ckv, cidx, sink) if comp else (q, wkv, widx, None, None, sink)


@pytest.mark.parametrize("comp", [True, False], ids=["window+compressed", "window-only"])
def test_sparse_attention_rewrite(comp):
    args = attn_inputs(torch.Generator().manual_seed(2), comp)
    m = Fn(sparse_attention_naive, scale=0.125)
    out, mgr, _, after = run(m, args, "A", 1, strict=True)
    assert mgr.counts == {"A": 1}
    torch.testing.assert_close(out, m(*args), rtol=1e-5, atol=1e-5)
    targets = call_targets(after)
    assert "minidi.ops.sparse_attention.sparse_attention" in targets
    assert not {"einsum", "cat", "where", "amax"} & set(targets)
    if comp:
        assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[5, 4, 32]", L_args_1_: "f32[12, 32]", L_args_2_: "i64[5, 4]", L_args_3_: "f32[6, 32]", L_args_4_: "i64[5, 3]", L_args_5_: "f32[4]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_3_ = L_args_3_
        l_args_4_ = L_args_4_
        l_args_5_ = L_args_5_
        sparse_attention: "f32[5, 4, 32]" = minidi_ops_sparse_attention_sparse_attention(l_args_0_, l_args_1_, l_args_2_, l_args_3_, l_args_4_, l_args_5_, 0.125, backend = 'auto');  l_args_0_ = l_args_1_ = l_args_2_ = l_args_3_ = l_args_4_ = l_args_5_ = None
        return (sparse_attention,)
""")


def rope_attention(q_raw, wkv, widx, ckv, cidx, sink, table, pos, markers=False, out_reader=False, norm=None):
    """Attention.forward's shape: q = apply_rope(q_raw), the naive attention between stage markers, the output
    rotated back (``out_reader``: the unrotated output is also returned, so the output rotation must stay).
    ``norm``: V4's per-head q RMSNorm first ("plain"), one with a weight ("weighted", not V4's), or one whose output
    is also returned ("read": it must stay)."""
    cos, sin = rope_cos_sin_lookup(pos, table)
    if norm:
        q_raw = rms_norm(q_raw, torch.full_like(q_raw[0, 0], 1.5) if norm == "weighted" else None, 1e-6)
    q = apply_rope(q_raw, cos, sin)
    if markers:
        stages.enter("attn.core", q)
    o = sparse_attention_naive(q, wkv, widx, ckv, cidx, sink, 0.125)
    if markers:
        stages.exit("attn.core", o)
    r = apply_rope(o, cos, sin, inverse=True)
    if norm == "read":
        return r, q_raw
    return (r, o) if out_reader else r


def rope_inputs(dtype):
    g = torch.Generator().manual_seed(9)
    q, wkv, widx, ckv, cidx, sink = attn_inputs(g, True)
    table = torch.randn(40, 4, 2, generator=g)
    pos = torch.randint(0, 40, (q.shape[0],), generator=g)
    return (q.to(dtype), wkv.to(dtype), widx, ckv.to(dtype), cidx, sink, table, pos)


@pytest.mark.parametrize("markers", [False, True], ids=["plain", "stage-markers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_folds_the_rotations_around_it(dtype, markers):
    """q's RoPE and the output's inverse RoPE go into the op (rope_mode 3): no rotation chain (stack / unflatten)
    is left, and the result is bit-equal to eager's rotations around the op without them; stage markers keep their
    place (the exit marker now marks the op's result)."""
    args = rope_inputs(dtype)
    was = stages.enabled()
    stages.enabled(markers)
    try:
        m = Fn(rope_attention, markers=markers)
        out, mgr, _, after = run(m, args, "A", 1, strict=True)
    finally:
        stages.enabled(was)
    assert mgr.counts == {"A": 1}
    targets = call_targets(after)
    assert not {"stack", "unflatten", "einsum", "cat"} & set(targets), targets
    call = next(n for n in after.graph.nodes if "sparse_attention" in str(n.target))
    assert call.kwargs["rope_mode"] == ROPE_Q | ROPE_OUT
    assert sum("stage_mark" in t for t in targets) == (2 if markers else 0)
    q_raw, wkv, widx, ckv, cidx, sink, table, pos = args
    cos, sin = rope_cos_sin_lookup(pos, table)
    unfused = sparse_attention(apply_rope(q_raw, cos, sin), wkv, widx, ckv, cidx, sink, 0.125)
    assert torch.equal(out, apply_rope(unfused, cos, sin, inverse=True))
    if dtype == torch.float32:
        torch.testing.assert_close(out, m(*args), rtol=1e-5, atol=1e-5)
    if not markers and dtype == torch.float32:
        assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[5, 4, 32]", L_args_1_: "f32[12, 32]", L_args_2_: "i64[5, 4]", L_args_3_: "f32[6, 32]", L_args_4_: "i64[5, 3]", L_args_5_: "f32[4]", L_args_6_: "f32[40, 4, 2]", L_args_7_: "i64[5]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_3_ = L_args_3_
        l_args_4_ = L_args_4_
        l_args_5_ = L_args_5_
        l_args_6_ = L_args_6_
        l_args_7_ = L_args_7_
        cs: "f32[5, 4, 2]" = l_args_6_[l_args_7_];  l_args_6_ = l_args_7_ = None
        cos: "f32[5, 4]" = cs[(Ellipsis, 0)]
        sin: "f32[5, 4]" = cs[(Ellipsis, 1)];  cs = None
        sparse_attention: "f32[5, 4, 32]" = minidi_ops_sparse_attention_sparse_attention(l_args_0_, l_args_1_, l_args_2_, l_args_3_, l_args_4_, l_args_5_, 0.125, backend = 'auto', rope_cos = cos, rope_sin = sin, rope_mode = 3);  l_args_0_ = l_args_1_ = l_args_2_ = l_args_3_ = l_args_4_ = l_args_5_ = cos = sin = None
        return (sparse_attention,)
""")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_folds_v4_q_norm(dtype):
    """V4's per-head q RMSNorm before q's rotation goes into the op as q's row scales (q_scale, the norm's rsqrt,
    left to Inductor): the normalised q is never formed, and the result is bit-equal to the op on eager's norm and
    rotations."""
    args = rope_inputs(dtype)
    m = Fn(rope_attention, norm="plain")
    out, mgr, _, after = run(m, args, "A", 1, strict=True)
    assert mgr.counts == {"A": 1}
    call = next(n for n in after.graph.nodes if "sparse_attention" in str(n.target))
    assert call.kwargs["rope_mode"] == ROPE_Q | ROPE_OUT and "q_scale" in call.kwargs
    assert sum(t.endswith("mul") for t in call_targets(after)) == 0  # the norm's product is the op's
    q_raw, wkv, widx, ckv, cidx, sink, table, pos = args
    cos, sin = rope_cos_sin_lookup(pos, table)
    unfused = sparse_attention(apply_rope(rms_norm(q_raw, None, 1e-6), cos, sin), wkv, widx, ckv, cidx, sink, 0.125)
    assert torch.equal(out, apply_rope(unfused, cos, sin, inverse=True))
    if dtype == torch.float32:
        torch.testing.assert_close(out, m(*args), rtol=1e-5, atol=1e-5)
        assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[5, 4, 32]", L_args_1_: "f32[12, 32]", L_args_2_: "i64[5, 4]", L_args_3_: "f32[6, 32]", L_args_4_: "i64[5, 3]", L_args_5_: "f32[4]", L_args_6_: "f32[40, 4, 2]", L_args_7_: "i64[5]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_3_ = L_args_3_
        l_args_4_ = L_args_4_
        l_args_5_ = L_args_5_
        l_args_6_ = L_args_6_
        l_args_7_ = L_args_7_
        cs: "f32[5, 4, 2]" = l_args_6_[l_args_7_];  l_args_6_ = l_args_7_ = None
        cos: "f32[5, 4]" = cs[(Ellipsis, 0)]
        sin: "f32[5, 4]" = cs[(Ellipsis, 1)];  cs = None
        x32: "f32[5, 4, 32]" = l_args_0_.float()
        square: "f32[5, 4, 32]" = x32.square();  x32 = None
        mean: "f32[5, 4, 1]" = square.mean(-1, keepdim = True);  square = None
        add: "f32[5, 4, 1]" = mean + 1e-06;  mean = None
        rsqrt: "f32[5, 4, 1]" = torch.rsqrt(add);  add = None
        sparse_attention: "f32[5, 4, 32]" = minidi_ops_sparse_attention_sparse_attention(l_args_0_, l_args_1_, l_args_2_, l_args_3_, l_args_4_, l_args_5_, 0.125, backend = 'auto', rope_cos = cos, rope_sin = sin, rope_mode = 3, q_scale = rsqrt);  l_args_0_ = l_args_1_ = l_args_2_ = l_args_3_ = l_args_4_ = l_args_5_ = cos = sin = rsqrt = None
        return (sparse_attention,)
""")


@pytest.mark.parametrize("norm", ["weighted", "read"])
def test_sparse_attention_keeps_a_q_norm_it_cannot_take(norm):
    """A norm with a weight (not V4's), or one whose output is read elsewhere, stays in the graph; q's rotation is
    still folded."""
    args = rope_inputs(torch.float32)
    m = Fn(rope_attention, norm=norm)
    got, mgr, _, after = run(m, args, "A", 1, strict=True)
    call = next(n for n in after.graph.nodes if "sparse_attention" in str(n.target))
    assert "q_scale" not in call.kwargs and call.kwargs["rope_mode"] == ROPE_Q | ROPE_OUT
    assert any(t.endswith("rsqrt") for t in call_targets(after))
    want = m(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_attention_keeps_a_rotation_another_reader_needs():
    """The unrotated output is read elsewhere: the output's rotation stays in the graph (q's is still folded)."""
    args = rope_inputs(torch.float32)
    m = Fn(rope_attention, out_reader=True)
    (r, o), mgr, _, after = run(m, args, "A", 1, strict=True)
    call = next(n for n in after.graph.nodes if "sparse_attention" in str(n.target))
    assert call.kwargs["rope_mode"] == ROPE_Q
    assert sum(t.endswith("stack") for t in call_targets(after)) == 1
    want_r, want_o = m(*args)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r, want_r, rtol=1e-5, atol=1e-5)


def test_sparse_attention_lookalike_gather_not_feeding_attention():
    g = torch.Generator().manual_seed(3)
    pool, new = torch.randn(6, 16, generator=g), torch.randn(3, 16, generator=g)
    empty = torch.zeros(0, dtype=torch.long)
    rm = RatioMeta(group_idx=empty, prev_idx=empty, entry_pos=empty, pend_src=empty, pend_dst=empty,
                   view_idx=torch.tensor([0, 2, -1, 7, 8]), pool_src=empty, pool_dst=empty, k_start=empty,
                   k_end=empty)

    def view(pool, new):  # gather + where(-1 -> 0), exactly the key assembly, but no attention after it
        return compressed_view(None, torch.cat([pool, new]), rm)

    _, mgr, before, after = run(Fn(view), (pool, new), "A")
    assert mgr.counts == {"A": 0} and graph_text(before) == graph_text(after)


def test_sparse_attention_lookalike_other_contraction():
    def attn_other(q, kv, idx, sink, scale=0.125):  # scores contracted over heads ("thd,tkd->tdk"): not attention
        keys = kv[idx.clamp(min=0)]
        valid = idx >= 0
        keys = torch.where(valid.unsqueeze(-1), keys, torch.zeros_like(keys))
        s = torch.einsum("thd,tkd->tdk", q.float(), keys.float()) * scale
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - m)
        denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink.float().view(1, -1, 1) - m)
        return (torch.einsum("thk,tkd->thd", e.to(q.dtype).float(), keys.float()) / denom).to(q.dtype)

    g = torch.Generator().manual_seed(4)
    q, kv = torch.randn(5, 16, 16, generator=g), torch.randn(9, 16, generator=g)
    idx, sink = torch.randint(-1, 9, (5, 4), generator=g), torch.randn(16, generator=g)
    _, mgr, before, after = run(Fn(attn_other), (q, kv, idx, sink), "A")
    assert mgr.counts == {"A": 0} and graph_text(before) == graph_text(after)


# ---- B: indexer top-k -------------------------------------------------------------------------------------------------
def indexer_inputs(g, allowed: bool):
    t, h, d, n = 6, 8, 32, 24
    q, k, w = torch.randn(t, h, d, generator=g), torch.randn(n, d, generator=g), torch.randn(t, h, generator=g)
    k_start = torch.tensor([0, 0, 0, 10, 10, 10])
    k_end = torch.tensor([3, 7, 10, 12, 18, 24])
    al = torch.rand(t, n, generator=g) > 0.3 if allowed else None
    return q, k, w, k_start, k_end, al


def indexer(q, k, w, k_start, k_end, allowed):
    return indexer_topk_naive(q, k, w, k_start, k_end, 4, allowed)


@pytest.mark.parametrize("allowed", [False, True], ids=["plain", "allowed"])
def test_indexer_rewrite(allowed):
    args = indexer_inputs(torch.Generator().manual_seed(5), allowed)
    m = Fn(indexer)
    (idx, scores), mgr, _, after = run(m, args, "B", 1, strict=True)
    ref_idx, ref_scores = m(*args)
    assert mgr.counts == {"B": 1}
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    # the same picks in the same order: ascending keys, -1 (last) for picks scored -inf
    assert torch.equal(idx, ref_idx)
    if not allowed:
        assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[6, 8, 32]", L_args_1_: "f32[24, 32]", L_args_2_: "f32[6, 8]", L_args_3_: "i64[6]", L_args_4_: "i64[6]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_3_ = L_args_3_
        l_args_4_ = L_args_4_
        indexer_topk = minidi_ops_indexer_score_indexer_topk(l_args_0_, l_args_1_, l_args_2_, l_args_3_, l_args_4_, 4, None, backend = 'auto');  l_args_0_ = l_args_1_ = l_args_2_ = l_args_3_ = l_args_4_ = None
        getitem_8: "i64[6, 4]" = indexer_topk[0]
        getitem_9: "f32[6, 24]" = indexer_topk[1];  indexer_topk = None
        return (getitem_8, getitem_9)
""")


def indexer_fq4(q, k, w, k_start, k_end, allowed):  # the model's indexer with fake quant on: q is an fq4 output
    return indexer_topk_naive(fq4_ue8m0(q, 32), k, w, k_start, k_end, 4, allowed)


def indexer_fq8(q, k, w, k_start, k_end, allowed):  # another quantiser on q: the op keeps today's numerics
    return indexer_topk_naive(fq8(q, 32), k, w, k_start, k_end, 4, allowed)


def test_indexer_rewrite_fq4_scores_on_fp8():
    q, k, w, ks, ke, _ = indexer_inputs(torch.Generator().manual_seed(7), False)
    args = (q, fq4_ue8m0(k, 32), w, ks, ke, None)
    m = Fn(indexer_fq4)
    (idx, scores), mgr, _, after = run(m, args, "B", 1, strict=True)
    ref_idx, ref_scores = m(*args)
    assert mgr.counts == {"B": 1}
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(idx, ref_idx)
    text = graph_text(after)
    call = [line.strip() for line in text.splitlines() if "indexer_topk(" in line]
    assert_expected_inline("\n".join(call), """indexer_topk = minidi_ops_indexer_score_indexer_topk(to_1, l_args_1_, l_args_2_, l_args_3_, l_args_4_, 4, None, backend = 'auto', mma = 'fp8');  to_1 = l_args_1_ = l_args_2_ = l_args_3_ = l_args_4_ = None""")
    _, mgr, _, after = run(Fn(indexer_fq8), args, "B", 1, strict=True)
    assert mgr.counts == {"B": 1} and "mma" not in graph_text(after)


def _picks(s, kk):  # the naive indexer's picks (indexer._pick), written out
    idx = topk_set(s, kk)
    idx = torch.where(s.gather(1, idx) > float("-inf"), idx, 1 << 62).sort(dim=-1).values
    return idx.masked_fill(idx == 1 << 62, -1)


def test_indexer_lookalike_other_contraction_range_and_tie_break():
    def per_token_keys(q, k, w, k_start, k_end, topk=4):  # "thd,tnd->thn": another contraction
        s = torch.einsum("thd,tnd->thn", q, k.to(q.dtype))
        s = (s.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)
        j = torch.arange(k.shape[1]).unsqueeze(0)
        lo, hi = k_start.unsqueeze(1), k_end.unsqueeze(1)
        s = s.masked_fill((j < lo) | (j >= hi), float("-inf"))
        return _picks(s, topk), s

    def other_range(q, k, w, k_start, k_end, topk=4):  # the mask tests only j < lo
        s = torch.einsum("thd,nd->thn", q, k.to(q.dtype))
        s = (s.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)
        j = torch.arange(k.shape[0]).unsqueeze(0)
        s = s.masked_fill(j < k_start.unsqueeze(1), float("-inf"))
        return _picks(s, topk), s

    def plain_topk(q, k, w, k_start, k_end, topk=4):  # torch.topk's tie-break (the naive chain before issue 19)
        s = torch.einsum("thd,nd->thn", q, k.to(q.dtype))
        s = (s.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)
        j = torch.arange(k.shape[0]).unsqueeze(0)
        lo, hi = k_start.unsqueeze(1), k_end.unsqueeze(1)
        s = s.masked_fill((j < lo) | (j >= hi), float("-inf"))
        idx = s.topk(topk, dim=-1).indices
        return torch.where((idx >= lo) & (idx < hi), idx, -1), s

    def small_sentinel(q, k, w, k_start, k_end, topk=4):  # a "past every column" sentinel that is a column
        s = torch.einsum("thd,nd->thn", q, k.to(q.dtype))
        s = (s.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)
        j = torch.arange(k.shape[0]).unsqueeze(0)
        lo, hi = k_start.unsqueeze(1), k_end.unsqueeze(1)
        s = s.masked_fill((j < lo) | (j >= hi), float("-inf"))
        idx = topk_set(s, topk)
        idx = torch.where(s.gather(1, idx) > float("-inf"), idx, 5).sort(dim=-1).values
        return idx.masked_fill(idx == 5, -1), s

    q, k, w, ks, ke, _ = indexer_inputs(torch.Generator().manual_seed(6), False)
    assert run(Fn(indexer_topk_naive), (q, k, w, ks, ke, 4), "B")[1].counts == {"B": 1}  # the control matches
    for fn, kk in ((per_token_keys, k.expand(q.shape[0], -1, -1)), (other_range, k), (plain_topk, k),
                   (small_sentinel, k)):
        _, mgr, before, after = run(Fn(fn), (q, kk, w, ks, ke), "B")
        assert mgr.counts == {"B": 0} and graph_text(before) == graph_text(after), fn.__name__


# ---- D: FP4 dequant + grouped GEMM --------------------------------------------------------------------------------------
def experts_inputs(g):
    e, n, kd, r = 3, 16, 64, 7
    packed, scale = quantize_fp4(torch.randn(e, n, kd, generator=g))
    x = torch.randn(r, kd, generator=g)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 gets no rows
    return x, packed, scale.view(torch.uint8), offs


def experts(x, packed, scale, offs):
    return grouped_mm(x, dequant_expert_stack(packed, scale, x.dtype), offs)


def test_fp4_grouped_mm_rewrite():
    args = experts_inputs(torch.Generator().manual_seed(7))
    out, mgr, _, after = run(Fn(experts), args, "D", 1, strict=True)
    assert mgr.counts == {"D": 1}
    torch.testing.assert_close(out, experts(*args), rtol=1e-5, atol=1e-5)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[7, 64]", L_args_1_: "i8[3, 16, 32]", L_args_2_: "u8[3, 16, 2]", L_args_3_: "i32[3]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_3_ = L_args_3_
        fp4_grouped_mm: "f32[7, 16]" = minidi_ops_fp4_grouped_gemm_fp4_grouped_mm(l_args_0_, l_args_1_, l_args_2_, l_args_3_, backend = 'auto');  l_args_0_ = l_args_1_ = l_args_2_ = l_args_3_ = None
        return (fp4_grouped_mm,)
""")


def test_fp4_grouped_mm_keeps_the_row_gather():
    """bf16 (``torch._grouped_mm`` form) with x = tokens[rows], two GEMMs on the same gathered rows (w1, w3): both
    are rewritten and the [R, K] gather stays and feeds both (pass I, not D, rewrites the gather). Compared with the
    op on the gathered rows (CPU torch has no bf16 grouped GEMM to run the naive graph)."""
    from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm

    g = torch.Generator().manual_seed(9)
    x, packed, scale, offs = experts_inputs(g)
    tokens = torch.randn(5, x.shape[1], generator=g).bfloat16()
    rows = torch.tensor([4, 0, 0, 3, 1, 2, 4])

    def two_gemms(tokens, rows, packed, scale, offs):
        xs = tokens[rows]
        return experts(xs, packed, scale, offs) + experts(xs, packed, scale, offs)

    out, mgr, _, after = run(Fn(two_gemms), (tokens, rows, packed, scale, offs), "D", 2, strict=True)
    assert mgr.counts == {"D": 2}
    one = fp4_grouped_mm(tokens[rows], packed, scale, offs)
    assert torch.equal(out, one + one)
    calls = [n for n in after.graph.nodes if n.op == "call_function" and "fp4_grouped_mm" in str(n.target)]
    assert len(calls) == 2 and all(c.args[0] is calls[0].args[0] for c in calls)
    gathers = [n for n in after.graph.nodes if n.op == "call_function" and "getitem" in str(n.target)]
    assert len(gathers) == 1 and calls[0].args[0] is gathers[0]


def test_fp4_lookalike_dequant_without_grouped_gemm():
    def dense(x, packed, scale, offs):  # the dequantised stack used by a plain GEMM of expert 0
        return x @ dequant_expert_stack(packed, scale, x.dtype)[0].t() + offs.sum()

    args = experts_inputs(torch.Generator().manual_seed(7))
    _, mgr, before, after = run(Fn(dense), args, "D")
    assert mgr.counts == {"D": 0} and graph_text(before) == graph_text(after)


# ---- strict mode on a small module --------------------------------------------------------------------------------------
def test_strict_fails_loudly_when_a_pass_is_broken(monkeypatch):
    from minidi.passes.rewrite_moe_combine import MoECombine

    monkeypatch.setattr(MoECombine, "match", lambda self, node: None)  # a pass that silently stopped matching
    rows, order, local, k = moe_inputs(torch.Generator().manual_seed(0))
    compiled = compile_with(Fn(moe_combine_naive, k=k), "C", n_sites=1, strict=True)
    with pytest.raises(Exception, match=r"pass C \(moe_combine\): expected 1 site\(s\), matched 0") as info:
        compiled(rows, order, local)
    assert isinstance(info.value, PassMatchError) or "PassMatchError" in repr(info.value) + str(info.value)


def test_non_strict_warns_and_keeps_the_naive_path(monkeypatch):
    from minidi.passes.rewrite_moe_combine import MoECombine

    monkeypatch.setattr(MoECombine, "match", lambda self, node: None)
    rows, order, local, k = moe_inputs(torch.Generator().manual_seed(0))
    m = Fn(moe_combine_naive, k=k)
    compiled = compile_with(m, "C", n_sites=1, strict=False)
    with pytest.warns(UserWarning, match=r"pass C \(moe_combine\): expected 1 site\(s\), matched 0"):
        out = compiled(rows, order, local)
    torch.testing.assert_close(out, m(rows, order, local))


def test_pass_selection_and_uuid():
    from minidi.passes import PassManager, select

    assert select("all") == ["C", "E", "S", "D", "A", "B", "F", "J", "K", "G", "H", "I", "L", "M", "T", "N", "R", "O",
                             "P", "Q", "V"]  # U: opt-in
    assert select("all,U") == select("all")[:10] + ["U"] + select("all")[10:]
    assert select("none") == [] and select(None) == []
    assert select("B,a") == ["A", "B"] and select(["moe_combine", "E"]) == ["C", "E"]
    with pytest.raises(ValueError, match="unknown pass 'Z'"):
        select("Z")
    assert PassManager("all").uuid() == PassManager("all").uuid()
    assert PassManager("all").uuid() != PassManager("A,B").uuid()
    assert minidi.compile is minidi.runtime.compile.compile


# ---- H: MoE expert activation on the local rows (opt-in) --------------------------------------------------------
def activation_inputs(g):
    e, i, d, r = 3, 64, 64, 9
    w13, s13 = quantize_fp4(torch.randn(e, i, d, generator=g))
    w2, s2 = quantize_fp4(torch.randn(e, d, i, generator=g))
    x = torch.randn(r, d, generator=g)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 gets no rows; rows 7, 8: other ranks' experts
    ws = torch.rand(r, 1, generator=g)
    return x, w13, s13.view(torch.uint8), w2, s2.view(torch.uint8), offs, ws


def activation_chain(x, w13, s13, w2, s2, offs, ws, form="direct"):
    """The routed experts' middle, as the model writes it: w1 / w3 GEMMs (one stack stands in for both), clipped
    SwiGLU x weight, fq8 (blocks of 32), w2 GEMM. ``form``: "direct" (the model's), "slice" (the w2 GEMM reads a
    view of the activation), "leak" (a second user reads every row, garbage rows included)."""
    from minidi.model.moe import swiglu_clipped
    from minidi.model.quant import fq8

    a = (swiglu_clipped(experts(x, w13, s13, offs), experts(x, w13, s13, offs), 10.0) * ws).to(x.dtype)
    a = fq8(a, 32)
    if form == "slice":
        return experts(a[:, :32].repeat(1, 2), w2, s2, offs)
    y = experts(a, w2, s2, offs)
    return y + a.sum() if form == "leak" else y


def test_moe_activation_rewrite_after_d_and_its_refusals():
    """fp32 after pass D: H takes the chain, and the rows below offs[-1] equal the naive ones (exp's last bit aside).
    It refuses when the activation does not go straight into a grouped GEMM with the same offs."""
    from minidi.ops.moe_activation import moe_activation

    args = activation_inputs(torch.Generator().manual_seed(3))
    out, mgr, _, after = run(Fn(activation_chain), args, "D,H", None)
    assert mgr.counts == {"D": 3, "H": 1}
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[9, 64]", L_args_1_: "i8[3, 64, 32]", L_args_2_: "u8[3, 64, 2]", L_args_3_: "i8[3, 64, 32]", L_args_4_: "u8[3, 64, 2]", L_args_5_: "i32[3]", L_args_6_: "f32[9, 1]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_3_ = L_args_3_
        l_args_4_ = L_args_4_
        l_args_5_ = L_args_5_
        l_args_6_ = L_args_6_
        fp4_grouped_mm: "f32[9, 64]" = minidi_ops_fp4_grouped_gemm_fp4_grouped_mm(l_args_0_, l_args_1_, l_args_2_, l_args_5_, backend = 'auto')
        fp4_grouped_mm_1: "f32[9, 64]" = minidi_ops_fp4_grouped_gemm_fp4_grouped_mm(l_args_0_, l_args_1_, l_args_2_, l_args_5_, backend = 'auto');  l_args_0_ = l_args_1_ = l_args_2_ = None
        moe_activation: "f32[9, 64]" = minidi_ops_moe_activation_moe_activation(fp4_grouped_mm, fp4_grouped_mm_1, l_args_6_, l_args_5_, 10.0, 32, backend = 'auto');  fp4_grouped_mm = fp4_grouped_mm_1 = l_args_6_ = None
        fp4_grouped_mm_2: "f32[9, 64]" = minidi_ops_fp4_grouped_gemm_fp4_grouped_mm(moe_activation, l_args_3_, l_args_4_, l_args_5_, backend = 'auto');  moe_activation = l_args_3_ = l_args_4_ = l_args_5_ = None
        return (fp4_grouped_mm_2,)
""")
    calls = [n.target for n in after.graph.nodes if n.op == "call_function"]
    assert moe_activation in calls and torch.nn.functional.silu not in calls
    n = int(args[5][-1])
    torch.testing.assert_close(out[:n], activation_chain(*args)[:n], rtol=1e-5, atol=1e-5)
    for form in ("slice", "leak"):
        _, mgr, _, _ = run(Fn(activation_chain, form=form), args, "D,H", None)
        assert mgr.counts.get("H", 0) == 0, form


# ---- I: MoE dispatch gather on the local rows (opt-in) ----------------------------------------------------------
def gather_chain(x, w13, s13, w2, s2, offs, ws, form="direct"):
    """The routed experts' dispatch as the model writes it: xs = x[idx] read by the w1 / w3 GEMMs. ``form``:
    "direct" (the model's), "leak" (a second user reads every gathered row), "late_offs" (offs computed after the
    gather)."""
    idx = (torch.arange(x.shape[0] * 2, device=x.device) * 5) % x.shape[0]  # [2 T] rows, some tokens twice
    if form == "late_offs":
        xs = x[idx]
        offs = offs + 0
    else:
        xs = x[idx]
    g, v = experts(xs, w13, s13, offs), experts(xs, w13, s13, offs)
    y = g * v
    if form == "leak":
        return y + xs.sum()
    return y


def test_moe_row_gather_rewrite_and_its_refusals():
    """fp32 after pass D: I takes the gather; the rows below offs[-1] equal the naive ones bit for bit (a copy).
    It refuses when anything but the grouped GEMMs reads the gathered rows."""
    from minidi.ops.moe_gather import gather_rows

    x, w13, s13, w2, s2, offs, ws = activation_inputs(torch.Generator().manual_seed(4))
    offs = torch.tensor([4, 4, 13], dtype=torch.int32)  # 18 gathered rows, 13 local
    args = (x, w13, s13, w2, s2, offs, ws)
    out, mgr, _, after = run(Fn(gather_chain), args, "D,I", None)
    assert mgr.counts == {"D": 2, "I": 1}
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[9, 64]", L_args_1_: "i8[3, 64, 32]", L_args_2_: "u8[3, 64, 2]", L_args_5_: "i32[3]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_5_ = L_args_5_
        arange: "i64[18]" = torch.arange(18, device = device(type='cpu'))
        mul: "i64[18]" = arange * 5;  arange = None
        idx: "i64[18]" = mul % 9;  mul = None
        gather_rows: "f32[18, 64]" = minidi_ops_moe_gather_gather_rows(l_args_0_, idx, l_args_5_, backend = 'auto');  l_args_0_ = idx = None
        fp4_grouped_mm: "f32[18, 64]" = minidi_ops_fp4_grouped_gemm_fp4_grouped_mm(gather_rows, l_args_1_, l_args_2_, l_args_5_, backend = 'auto')
        fp4_grouped_mm_1: "f32[18, 64]" = minidi_ops_fp4_grouped_gemm_fp4_grouped_mm(gather_rows, l_args_1_, l_args_2_, l_args_5_, backend = 'auto');  gather_rows = l_args_1_ = l_args_2_ = l_args_5_ = None
        y: "f32[18, 64]" = fp4_grouped_mm * fp4_grouped_mm_1;  fp4_grouped_mm = fp4_grouped_mm_1 = None
        return (y,)
""")
    calls = [n.target for n in after.graph.nodes if n.op == "call_function"]
    assert gather_rows in calls
    assert not [n for n in after.graph.nodes if n.op == "call_function" and "getitem" in str(n.target)]
    n = int(offs[-1])
    assert torch.equal(out[:n], run(Fn(gather_chain), args, "D", None)[0][:n])
    torch.testing.assert_close(out[:n], gather_chain(*args)[:n], rtol=1e-5, atol=1e-5)
    for form in ("leak", "late_offs"):
        _, mgr, _, _ = run(Fn(gather_chain, form=form), args, "D,I", None)
        assert mgr.counts.get("I", 0) == 0, form
    _, mgr, _, _ = run(Fn(gather_chain), args, "I", None)  # before D (fp32): the GEMMs are einsums, not grouped
    assert mgr.counts.get("I", 0) == 0


def test_select_all_leaves_out_opt_in_passes(monkeypatch):
    """A pass with ``in_all = False`` is left out of "all" and taken when named."""
    from minidi.passes import select
    from minidi.passes.rewrite_moe_gather import MoERowGather

    monkeypatch.setattr(MoERowGather, "in_all", False)
    assert "I" not in select("all") and set(select("all,I")) == set(select("all")) | {"I"}
    assert select(["moe_row_gather"]) == ["I"] and select("H") == ["H"]
    with pytest.raises(ValueError, match="unknown pass"):
        select("all,Z")
