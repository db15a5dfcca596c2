"""Pass I: the MoE dispatch gather over every routed row
(``minidi.model.moe``: ``xs = x[order // k]``) -> ``minidi.ops.moe_gather.gather_rows`` on the rows below offs[-1].

Naive subgraph (Dynamo FX), once per MoE layer::

    xs = x[idx]                        # getitem: x [T, D], idx [R] integer; R = T k rows (EP N: N T k)
    g = grouped_mm(xs, w1, offs)       # every user of xs is a grouped GEMM with one offs, reading xs as its input
    v = grouped_mm(xs, w3, offs)

Replacement::

    xs = gather_rows(x, idx, offs)     # rows past offs[-1] not written: nothing reads them

The GEMMs may be ``torch._grouped_mm`` or pass D's ``fp4_grouped_mm`` (I runs after D). Pass L (after I) then takes
the gather and its GEMMs onto FP8 where the gathered tokens are fq8 (``rewrite_fp8_experts.py``).
"""

from __future__ import annotations

from torch.fx import Node

from minidi.ops.moe_gather import gather_rows

from .base import Match, Rewrite
from .patterns import grouped_gemm_offs, row_gather


class MoERowGather(Rewrite):
    key = "I"
    name = "moe_row_gather"

    def match(self, node: Node) -> Match | None:
        found = row_gather(node)
        if found is None or not node.users:
            return None
        x, idx = found
        offs = grouped_gemm_offs(next(iter(node.users)))
        if offs is None or any(grouped_gemm_offs(u) is not offs or u.args[0] is not node
                               or node in u.args[1:] or node in u.kwargs.values() for u in node.users):
            return None  # the rows past offs[-1] would be read by something
        # offs computed after the gather: apply_match refuses (the replacement is inserted at the gather)
        return Match(anchor=node, nodes={node}, target=gather_rows, args=(x, idx, offs),
                     kwargs={"backend": self.op_backend}, outputs=[(node, None)])
