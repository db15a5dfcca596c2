"""Pass S (a compressor's fp32 GEMMs -> ``minidi.ops.gate_tf32x3``): the rewritten graph (expecttest snapshot), exact
counts, numerics against the fp32 GEMMs (fp64 reference), strict mode, and the look-alikes refused (the router's
GEMM, an fp32 weight, a GEMM whose result feeds another op). The real compressors' sites in whole models:
``test_models.py`` (``expected_sites``' S). Refresh the snapshot with
``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_compressor_gemm.py``."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from minidi.model.moe import gate_logits_fp32

from .helpers import Fn, graph_text, run


def compressor_kg(x, wkv, wgate):
    """The compressors' GEMMs as ``minidi.model.compressor`` writes them (kg [T, 2w] fp32)."""
    xf = x.float()
    return torch.cat([xf @ wkv.float().t(), xf @ wgate.float().t()], dim=-1)


def operands(t=7, d=96, w=40, x_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, d, generator=g).to(x_dtype), torch.randn(w, d, generator=g).bfloat16(),
            torch.randn(w, d, generator=g).bfloat16())


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_both_gemms_taken_numerics_at_fp32_level(x_dtype):
    args = operands(x_dtype=x_dtype)
    out, mgr, _, after = run(Fn(compressor_kg), args, "S", 2, strict=True)
    assert mgr.counts == {"S": 2}
    x, wkv, wgate = (a.double() for a in args)
    w = torch.cat([wkv, wgate])
    # fp32 level, element by element: |error| <= 2^-20 sum |x| |w| (measured over 200 seeds, default and
    # ATEN_CPU_CAPABILITY=avx2: at most 1.8e-7 of it, fp32 torch.matmul 2.7e-7; a bf16 rounding would be ~2^-9)
    assert ((out.double() - x @ w.t()).abs() <= 2**-20 * (x.abs() @ w.abs().t())).all()
    assert "float" not in graph_text(after)  # neither the fp32 copies of the weights nor of x remain


def test_snapshot():
    _, _, _, after = run(Fn(compressor_kg), operands(), "S", 2, strict=True)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "bf16[7, 96]", L_args_1_: "bf16[40, 96]", L_args_2_: "bf16[40, 96]"):
        l_args_0_ = L_args_0_
        l_args_1_ = L_args_1_
        l_args_2_ = L_args_2_
        gate_tf32x3: "f32[7, 40]" = minidi_ops_gate_tf32x3_gate_tf32x3(l_args_0_, l_args_1_, backend = 'auto');  l_args_1_ = None
        gate_tf32x3_1: "f32[7, 40]" = minidi_ops_gate_tf32x3_gate_tf32x3(l_args_0_, l_args_2_, backend = 'auto');  l_args_0_ = l_args_2_ = None
        cat: "f32[7, 80]" = torch.cat([gate_tf32x3, gate_tf32x3_1], dim = -1);  gate_tf32x3 = gate_tf32x3_1 = None
        return (cat,)
""")


@pytest.mark.parametrize("fn", [
    lambda x, w, _: torch.nn.functional.softplus(gate_logits_fp32(x, w)),  # the router (pass E's site)
    lambda x, w, _: torch.cat([x.float() @ w.float().t(), x.float() @ w.float().t() * 2], dim=-1),  # one feeds a mul
    lambda x, w, _: torch.cat([x.float() @ w.float().t().contiguous()], dim=-1),  # not the t(float(w)) form
])
def test_lookalikes_not_taken(fn):
    args = operands()
    _, mgr, before, after = run(Fn(fn), args, "S")
    if mgr.counts["S"]:  # the second case: the GEMM that feeds cat alone is a site, its twin is not
        assert mgr.counts == {"S": 1} and graph_text(after).count("gate_tf32x3(") == 1
    else:
        assert graph_text(before) == graph_text(after)


def test_fp32_weight_not_taken():
    x, wkv, wgate = operands()
    _, mgr, before, after = run(Fn(compressor_kg), (x, wkv.float(), wgate.float()), "S")
    assert mgr.counts == {"S": 0} and graph_text(before) == graph_text(after)


def test_strict_mode_fails_loudly_on_a_missing_site():
    x, wkv, wgate = operands()
    with pytest.raises(Exception, match=r"pass S \(compressor_gemm\): expected 2 site\(s\), matched 0"):
        run(Fn(compressor_kg), (x, wkv.float(), wgate.float()), "S", 2, strict=True)
