"""Pass E: the fp32 router GEMM (``minidi.model.moe.gate_logits_fp32``) -> ``minidi.ops.gate_tf32x3.gate_tf32x3``.

Naive subgraph (Dynamo FX)::

    logits = x.float() @ weight.float().t()      # [T, E] fp32 on CUDA cores (or TF32 if allowed: wrong experts)
    s      = softplus(logits)                    # the router's score function consumes it

Replacement::

    logits = gate_tf32x3(x, weight)              # fp32-accurate split-precision GEMM on tensor cores

Only a GEMM whose logits feed ``softplus`` (the router score) is taken: the output head has the very same
``y.float() @ head.weight.float().t()`` shape and is left alone, as is ``x.float() @ w.float()`` (no transpose).
"""

from __future__ import annotations

from torch.fx import Node

from minidi.ops.gate_tf32x3 import gate_tf32x3

from .base import Match, Rewrite
from .patterns import feeds_softplus, fp32_gemm


class GateTF32x3(Rewrite):
    key = "E"
    name = "gate_tf32x3"

    def match(self, node: Node) -> Match | None:
        gemm = fp32_gemm(node)
        if gemm is None or not feeds_softplus(node):
            return None
        x, w, nodes = gemm
        return Match(anchor=node, nodes=nodes, target=gate_tf32x3, args=(x, w), kwargs={"backend": self.op_backend},
                     outputs=[(node, None)])
