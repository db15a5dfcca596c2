"""Pass O (the output head's fp32 GEMM -> ``minidi.ops.head_logits``): the rewritten graph (expecttest snapshot),
the exact count, numerics against the naive module, the look-alikes refused (the router's GEMM and a GEMM whose
result feeds another op). The head graph of a per-layer compile: ``test_regional.py``.
Refresh the snapshot with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_head_logits.py``."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from minidi.model.model import OutputHead
from minidi.model.moe import gate_logits_fp32

from .helpers import Fn, call_targets, graph_text, run


def test_head_rewrite():
    g = torch.Generator().manual_seed(0)
    head = OutputHead(40, 64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(40, 64, generator=g))
    y = torch.randn(3, 64, generator=g).bfloat16()
    out, mgr, _, after = run(head, (y,), "O", 1, strict=True)
    assert mgr.counts == {"O": 1}
    torch.testing.assert_close(out, y.float() @ head.weight.float().t(), rtol=1e-6, atol=1e-5)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_parameters_weight_: "bf16[40, 64]", L_y_: "bf16[3, 64]"):
        l_self_parameters_weight_ = L_self_parameters_weight_
        l_y_ = L_y_
        head_logits: "f32[3, 40]" = minidi_ops_head_logits_head_logits(l_y_, l_self_parameters_weight_, backend = 'auto');  l_y_ = l_self_parameters_weight_ = None
        return (head_logits,)
""")


@pytest.mark.parametrize("fn", [
    lambda x, w: torch.sqrt(torch.nn.functional.softplus(gate_logits_fp32(x, w))),  # the router (pass E's site)
    lambda x, w: (x.float() @ w.float().t()) * 2,  # the GEMM feeds another op
])
def test_lookalikes_not_taken(fn):
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(5, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16())
    _, mgr, before, after = run(Fn(fn), args, "O")
    assert mgr.counts == {"O": 0} and graph_text(before) == graph_text(after)
