"""Pass L (fp8_experts) on a module holding the routed experts' chain as the model writes it (fq8 per token, the
dispatch gather, the w1 / w3 GEMMs, the clipped SwiGLU x weight, fq8, the w2 GEMM): the rewritten graph (expecttest
snapshot), the exact counts, numerics equal to passes D, H, I alone (the same products: fp32 sums in another order),
and its refusals. Refresh the snapshot with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_fp8_experts.py``.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from minidi.model.moe import dequant_expert_stack, grouped_mm, swiglu_clipped
from minidi.model.quant import fq8, quantize_fp4
from minidi.ops.fp8_experts import fp8_experts_down, fp8_experts_up
from minidi.passes import select

from .helpers import Fn, graph_text, run


def experts(x, packed, scale, offs):
    return grouped_mm(x, dequant_expert_stack(packed, scale, x.dtype), offs)


def inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    e, d, i, t = 3, 64, 64, 6
    w1, s1 = quantize_fp4(torch.randn(e, i, d, generator=g))
    w3, s3 = quantize_fp4(torch.randn(e, i, d, generator=g))
    w2, s2 = quantize_fp4(torch.randn(e, d, i, generator=g))
    x = torch.randn(t, d, generator=g).to(dtype)
    idx = torch.tensor([0, 3, 5, 1, 1, 2, 4, 0, 5, 3, 2, 4])  # 12 rows: 2 slots per token
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)  # expert 1 empty; rows 9..11: other ranks' experts
    ws = torch.rand(12, 1, generator=g)
    return x, idx, offs, ws, w1, s1.view(torch.uint8), w3, s3.view(torch.uint8), w2, s2.view(torch.uint8)


def moe_chain(x, idx, offs, ws, w1, s1, w3, s3, w2, s2, form="model", block=32):
    """``form``: "model" (as RoutedExperts.forward), "no_fq8" (no fake quant: nothing to take), "leak_rows" (the
    gathered rows read by something else too), "leak_act" (the activation read by something else too)."""
    xq = x if form == "no_fq8" else fq8(x, block)
    xs = xq[idx]
    a = (swiglu_clipped(experts(xs, w1, s1, offs), experts(xs, w3, s3, offs), 7.0) * ws).to(x.dtype)
    if form != "no_fq8":
        a = fq8(a, block)
    y = experts(a, w2, s2, offs)
    if form == "leak_rows":
        return y, xs.sum()
    if form == "leak_act":
        return y, a.sum()
    return y


def test_fp8_experts_rewrite():
    args = inputs(1)
    out, mgr, _, after = run(Fn(moe_chain), args, "D,H,I,L", None)
    assert mgr.counts == {"D": 3, "H": 1, "I": 1, "L": 2}
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "f32[6, 64]", L_args_1_: "i64[12]", L_args_2_: "i32[3]", L_args_3_: "f32[12, 1]", L_args_4_: "i8[3, 64, 32]", L_args_5_: "u8[3, 64, 2]", L_args_6_: "i8[3, 64, 32]", L_args_7_: "u8[3, 64, 2]", L_args_8_: "i8[3, 64, 32]", L_args_9_: "u8[3, 64, 2]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        l_args_3_ = L_args_3_
        l_args_4_ = L_args_4_
        l_args_5_ = L_args_5_
        l_args_6_ = L_args_6_
        l_args_7_ = L_args_7_
        l_args_8_ = L_args_8_
        l_args_9_ = L_args_9_
        fp8_experts_up = minidi_ops_fp8_experts_fp8_experts_up(l_args_0_, l_args_1_, l_args_2_, 32, [l_args_4_, l_args_6_], [l_args_5_, l_args_7_], torch.float32, backend = 'auto');  l_args_0_ = l_args_1_ = l_args_4_ = l_args_6_ = l_args_5_ = l_args_7_ = None
        getitem_4: "f32[12, 64]" = fp8_experts_up[0]
        getitem_5: "f32[12, 64]" = fp8_experts_up[1];  fp8_experts_up = None
        fp8_experts_down: "f32[12, 64]" = minidi_ops_fp8_experts_fp8_experts_down(getitem_4, getitem_5, l_args_3_, l_args_2_, 7.0, 32, l_args_8_, l_args_9_, torch.float32, backend = 'auto');  getitem_4 = getitem_5 = l_args_3_ = l_args_2_ = l_args_8_ = l_args_9_ = None
        return (fp8_experts_down,)
""")
    calls = {n.target for n in after.graph.nodes if n.op == "call_function"}
    assert fp8_experts_up in calls and fp8_experts_down in calls
    assert not any(getattr(t, "__name__", "") == "fp4_grouped_mm" for t in calls)
    ref, _, _, _ = run(Fn(moe_chain), args, "D,H,I", None)
    n = int(args[2][-1])
    torch.testing.assert_close(out[:n], ref[:n], rtol=1e-5, atol=1e-5 * float(ref[:n].abs().max()))


@pytest.mark.parametrize("gather_pass", ["I", ""])
@pytest.mark.parametrize("block", [32, 128])
def test_fp8_experts_with_or_without_pass_i_and_both_blocks(gather_pass, block):
    """The naive gather (I not selected) is taken too; an fq8 block of 128 (V4) as well (its scale repeated)."""
    args = inputs(2)
    if block == 128:
        x, idx, offs, ws, *w = inputs(2)
        g = torch.Generator().manual_seed(5)
        w1, s1 = quantize_fp4(torch.randn(3, 128, 128, generator=g))
        w3, s3 = quantize_fp4(torch.randn(3, 128, 128, generator=g))
        w2, s2 = quantize_fp4(torch.randn(3, 128, 128, generator=g))
        args = (torch.randn(6, 128, generator=g), idx, offs, ws, w1, s1.view(torch.uint8), w3, s3.view(torch.uint8),
                w2, s2.view(torch.uint8))
    passes = ",".join(p for p in ("D", "H", gather_pass, "L") if p)
    out, mgr, _, _ = run(Fn(moe_chain, block=block), args, passes, None)
    assert mgr.counts["L"] == 2, mgr.counts
    ref = moe_chain(*args, block=block)
    n = int(args[2][-1])
    torch.testing.assert_close(out[:n], ref[:n], rtol=1e-4, atol=1e-4 * float(ref[:n].abs().max()))


@pytest.mark.parametrize("form,taken", [("no_fq8", 0), ("leak_rows", 1), ("leak_act", 1)])
def test_fp8_experts_refusals(form, taken):
    """No fake quant: nothing to take. Rows or activation read by something else: that side stays (H / I refuse
    too, so the GEMM keeps the naive input), the other side is taken."""
    out, mgr, _, _ = run(Fn(moe_chain, form=form), inputs(3), "D,H,I,L", None)
    assert mgr.counts["L"] == taken, mgr.counts


def test_select_refuses_l_without_the_passes_it_rewrites():
    with pytest.raises(ValueError, match=r"pass L \(fp8_experts\) rewrites the ops of passes D .*H"):
        select("L")
    with pytest.raises(ValueError, match=r"passes H \(moe_activation\)"):
        select("D,I,L")
    assert select("all")[-9:] == ["L", "M", "T", "N", "R", "O", "P", "Q", "V"] and select("D,H,L") == ["D", "H", "L"]
