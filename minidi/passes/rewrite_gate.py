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

import torch
from torch.fx import Node

from minidi.ops.gate_tf32x3 import gate_tf32x3

from .base import Match, Rewrite
from .fx_utils import dtype, is_call, n_args, rank

_IN = (torch.float32, torch.bfloat16)


def fp32_gemm(node: Node) -> tuple[Node, Node, set[Node]] | None:
    """``x.float() @ w.float().t()`` with rank-2 bf16 / fp32 operands -> (x, w, the nodes to replace), else None.
    The shape shared by the router GEMM (pass E) and the mHC projections (pass F)."""
    if not is_call(node, "matmul") or len(node.args) != 2 or node.kwargs:
        return None
    xf, wt = node.args
    if not (is_call(xf, "float") and n_args(xf) == 1 and is_call(wt, "t") and n_args(wt) == 1):
        return None
    wf = wt.args[0]
    if not (is_call(wf, "float") and n_args(wf) == 1) or len(wt.users) != 1 or len(wf.users) != 1:
        return None
    x, w = xf.args[0], wf.args[0]
    if rank(x) != 2 or rank(w) != 2 or dtype(x) not in _IN or dtype(w) not in _IN:
        return None
    return x, w, {node, wt, wf} | ({xf} if len(xf.users) == 1 else set())


def feeds_softplus(node: Node) -> bool:
    return any(is_call(u, "softplus") for u in node.users)


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
