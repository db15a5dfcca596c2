"""Pass O: the output head's fp32 GEMM (``minidi.model.model.OutputHead``) -> ``minidi.ops.head_logits``.

Naive subgraph (Dynamo FX)::

    logits = y.float() @ weight.float().t()      # the fp32 copy of the [V, D] bf16 weight made every step, then
                                                 # an fp32 GEMV over it (the few rows a step returns logits for)
    return logits                                # the graph's output

Replacement::

    logits = head_logits(y, weight)              # the bf16 weight read once, fp32 products and sums

Only a GEMM of this shape whose result is the graph's output is taken: the router GEMM (pass E) and the mHC
projections (pass F) have the same shape but feed the layer's next ops. Sites: one per step graph (a whole-step
compile), or one in a per-layer compile's head graph (``RegionalStep`` compiles the head on its own).
"""

from __future__ import annotations

from torch.fx import Node

from minidi.ops.head_logits import head_logits

from .base import Match, Rewrite
from .patterns import fp32_gemm


class HeadLogits(Rewrite):
    key = "O"
    name = "head_logits"

    def match(self, node: Node) -> Match | None:
        gemm = fp32_gemm(node)
        if gemm is None or not node.users or any(u.op != "output" for u in node.users):
            return None
        y, w, nodes = gemm
        return Match(anchor=node, nodes=nodes, target=head_logits, args=(y, w), kwargs={"backend": self.op_backend},
                     outputs=[(node, None)])
