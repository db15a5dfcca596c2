"""Pass H: the MoE expert activation over every dispatched row
(``minidi.model.moe``: ``swiglu_clipped(g, v, L) * ws``, ``.to(dtype)``, ``fq8``) ->
``minidi.ops.moe_activation.moe_activation`` on the rows below offs[-1] only.

Naive subgraph (Dynamo FX), once per MoE layer, between the w1 / w3 grouped GEMMs and the w2 one::

    a = (silu(g.float().clamp(max=L)) * v.float().clamp(-L, L) * ws).to(dtype)
    a = fq8(a, block)                  # with fake quant, inlined: unflatten, abs, amax, clamp_min, / 448,
                                       # the exact power-of-two ceiling by bit ops, / s, clamp, e4m3, * s, flatten
    y = grouped_mm(a, w2, offs)        # the only user of a

Replacement::

    a = moe_activation(g, v, ws, offs, L, block)     # rows past offs[-1] not written: nothing reads them

Taken when g and v come from grouped GEMMs with the same ``offs``, before or after pass D (``torch._grouped_mm`` or
``fp4_grouped_mm``), and every user of ``a`` is such a GEMM with that ``offs``. Those are the conditions under
which the unwritten rows are never read.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.moe_activation import moe_activation

from .base import Match, Rewrite
from .fx_utils import dtype, is_call, rank
from .patterns import fq8_input, grouped_gemm_offs, method_call, only_users


def swiglu_weighted(node: Node) -> tuple[Node, Node, Node, float, set[Node]] | None:
    """node = (silu(g.float().clamp(max=L)) * v.float().clamp(-L, L) * ws).to(dtype) -> (g, v, ws, L, nodes)."""
    if not (is_call(node, "to") and len(node.args) == 2 and node.args[1] in (torch.bfloat16, torch.float32)):
        return None
    mw = node.args[0]
    if not is_call(mw, "mul") or len(mw.args) != 2:
        return None
    mv, ws = mw.args
    if not is_call(mv, "mul") or len(mv.args) != 2:
        return None
    act, vc = mv.args
    if not (is_call(act, "silu") and len(act.args) == 1 and is_call(act.args[0], "clamp")):
        return None
    gc = act.args[0]
    if len(gc.args) != 1 or set(gc.kwargs) != {"max"} or not method_call(gc.args[0], "float"):
        return None
    limit = gc.kwargs["max"]
    if not (isinstance(limit, (int, float)) and method_call(vc, "clamp", -limit, limit)
            and method_call(vc.args[0], "float")):
        return None
    if dtype(ws) != torch.float32 or rank(ws) != 2 or rank(gc) != 2:
        return None
    nodes = {node, mw, mv, act, gc, gc.args[0], vc, vc.args[0]}
    if not all(only_users(n, nodes) for n in nodes - {node}):
        return None
    return gc.args[0].args[0], vc.args[0].args[0], ws, float(limit), nodes


class MoEActivation(Rewrite):
    key = "H"
    name = "moe_activation"

    def match(self, node: Node) -> Match | None:
        fq = fq8_input(node)
        block, end = (fq[1], fq[0]) if fq else (None, node)
        sw = swiglu_weighted(end)
        if sw is None:
            return None
        g, v, ws, limit, nodes = sw
        if fq:
            nodes = nodes | fq[2]
        offs = grouped_gemm_offs(g)
        if offs is None or grouped_gemm_offs(v) is not offs or dtype(g) != end.args[1]:
            return None
        if not node.users or any(grouped_gemm_offs(u) is not offs or u.args[0] is not node for u in node.users):
            return None  # the rows past offs[-1] would be read by something
        return Match(anchor=node, nodes=nodes, target=moe_activation, args=(g, v, ws, offs, limit, block),
                     kwargs={"backend": self.op_backend}, outputs=[(node, None)])
