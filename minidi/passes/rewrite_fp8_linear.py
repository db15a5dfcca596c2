"""Pass N: every FP8 linear (``minidi.model.layers.FP8Linear.forward``) -> ``minidi.ops.fp8_linear.fp8_linear``, one
graph node in place of the two helper chains it inlines.

Naive subgraph (Dynamo FX), per FP8 linear: a layer's wq_a, wq_b, wkv, wo_b, its shared expert's w1, w3, w2, an
index-source layer's indexer wq_b, an Engram layer's wkv::

    xq = fq8(x, act_block)                                     # inlined chain (``patterns.fq8_input``); absent
                                                               # without fake quant
    w  = dequant_fp8(weight, scale, block, x.dtype)            # inlined chain (``patterns.fp8_weight_dequant``)
    y  = F.linear(xq, w)

Replacement::

    y = fp8_linear(x, weight, scale, block, act_block)         # act_block 0: x is not fake-quantised

Exact: the op computes the same fq8 values, the same dequantised weight and makes the same GEMM call (its tests hold
it equal bit for bit). Why: the chains are about half of a layer graph's nodes, and every node costs start-up
time in AOT and Inductor (issue 20); the op is also where the FP8 GEMM goes (issue 21). ``wo_a`` (its dequantised
weight feeds an einsum, not a linear) keeps the naive code. Where the fq8 or dequant result has another user, that
chain stays for it (the op recomputes its own).
"""

from __future__ import annotations

from torch.fx import Node

from minidi.ops.fp8_linear import ACT_BLOCKS, WEIGHT_BLOCKS, X_DTYPES, fp8_linear

from .base import Match, Rewrite
from .fx_utils import dtype, is_call
from .patterns import fp8_weight_dequant, fq8_input


class FP8LinearOp(Rewrite):
    key = "N"
    name = "fp8_linear"

    def match(self, node: Node) -> Match | None:
        if not (is_call(node, "linear") and len(node.args) == 2 and not node.kwargs):
            return None
        xq, w = node.args
        found = fp8_weight_dequant(w) if isinstance(w, Node) else None
        if found is None or dtype(node) not in X_DTYPES:
            return None
        weight, scale, block, chain = found
        if block not in WEIGHT_BLOCKS or w.args[1] != dtype(node):
            return None
        fq = fq8_input(xq) if isinstance(xq, Node) else None
        if fq is not None and fq[1] in ACT_BLOCKS and dtype(fq[0]) == dtype(node):
            x, act_block, fq_nodes = fq
        else:
            x, act_block, fq_nodes = xq, 0, set()
        if not isinstance(x, Node) or dtype(x) != dtype(node):
            return None
        return Match(anchor=node, nodes={node} | chain | fq_nodes, target=fp8_linear,
                     args=(x, weight, scale, block, act_block), kwargs={"backend": self.op_backend},
                     outputs=[(node, None)])
