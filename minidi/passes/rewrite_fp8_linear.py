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
time in AOT and Inductor (issue 20); the op is also where the FP8 GEMM goes (issue 21). Where the fq8 or dequant
result has another user, that chain stays for it (the op recomputes its own).

Attention's grouped output projection ``wo_a`` (no fq8 of its input), per layer::

    a = einsum("tgi,goi->tgo", o, dequant_fp8(weight, scale, block, o.dtype).view(G, N / G, I))
 -> a = fp8_grouped_linear(o, weight, scale, block)

The op keeps the dequantised weight (``fp8_linear``'s cache) and writes the G GEMMs' outputs straight into [T, G,
N / G]: Inductor's code dequantised the weight every call and copied the GEMMs' [G, T, N / G] output into that
layout (round 28's H100 step, V4.1 EP4: 1.11 + 1.35 ms a step over 32 calls of each kernel; the first kernel also
carries the window ring's ``index_copy_``, which stays).
"""

from __future__ import annotations

from torch.fx import Node

from minidi.ops.fp8_linear import ACT_BLOCKS, WEIGHT_BLOCKS, X_DTYPES, fp8_grouped_linear, fp8_linear

from .base import Match, Rewrite
from .fx_utils import dtype, is_call, n_args, normalize_einsum, rank, same_int, val
from .patterns import fp8_weight_dequant, fq8_input, only_users


class FP8LinearOp(Rewrite):
    key = "N"
    name = "fp8_linear"

    def match(self, node: Node) -> Match | None:
        if is_call(node, "einsum"):
            return self._grouped(node)
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

    def _grouped(self, node: Node) -> Match | None:
        """``einsum("tgi,goi->tgo", x, dequant_fp8(weight, scale, block, x.dtype).view(G, N / G, I))`` (``wo_a``)
        -> ``fp8_grouped_linear(x, weight, scale, block)``."""
        if not (n_args(node) == 3 and normalize_einsum(node.args[0]) == "tgi,goi->tgo"):
            return None
        x, wv = node.args[1], node.args[2]
        if not (is_call(wv, "view") and isinstance(wv.args[0], Node) and rank(x) == 3 and rank(wv) == 3):
            return None
        found = fp8_weight_dequant(wv.args[0])
        if found is None or dtype(node) not in X_DTYPES or dtype(x) != dtype(node):
            return None
        weight, scale, block, chain = found
        g, o, i = val(wv).shape
        if block not in WEIGHT_BLOCKS or wv.args[0].args[1] != dtype(node) or not same_int(g, val(x).shape[1]):
            return None
        if not (same_int(i, val(weight).shape[1]) and only_users(wv.args[0], {wv})):
            return None
        return Match(anchor=node, nodes={node, wv} | chain, target=fp8_grouped_linear,
                     args=(x, weight, scale, block), kwargs={"backend": self.op_backend}, outputs=[(node, None)])
