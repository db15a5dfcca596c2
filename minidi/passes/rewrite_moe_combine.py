"""Pass C: MoE combine (``minidi.model.moe.moe_combine_naive``) -> ``minidi.ops.moe_combine.moe_combine``.

Naive subgraph (Dynamo FX, torch-level calls)::

    r     = rows.float()                                   # [R, D]
    r     = torch.where(local.unsqueeze(-1), r, torch.zeros_like(r))      # non-local rows -> 0
    slots = torch.zeros_like(r).index_copy_(0, order, r)   # [R, D] in token-slot order
    out   = slots.view(-1, k, D).sum(dim=1)                # [T, D] fp32

Replacement::

    out = moe_combine(rows, order, local, k)               # reads only local rows, in slot order; no [R, D] scratch

Refused: a ``where`` whose predicate is not a per-row mask ``local.unsqueeze(-1)`` ([R] bool) or whose other branch is
not ``zeros_like(r)``; a scatter along another dim or into a non-zero buffer; a reduction over another dim.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.moe_combine import moe_combine

from .base import Match, Rewrite
from .fx_utils import arg, dims_equal, dtype, is_call, is_literal, n_args, rank, same_int, val


class MoECombine(Rewrite):
    key = "C"
    name = "moe_combine"

    def match(self, node: Node) -> Match | None:
        # out = slots.view(-1, k, D).sum(dim=1)
        if not is_call(node, "sum") or n_args(node) != 2 or not dims_equal(arg(node, 1, "dim", None), 1):
            return None
        view = node.args[0]
        if not is_call(view, "view", "reshape") or len(view.users) != 1 or len(view.args) != 4 or view.kwargs:
            return None
        _, minus1, k, d = view.args
        if not is_literal(minus1, -1) or not isinstance(k, int) or isinstance(k, bool) or k < 1:
            return None
        # slots = zeros_like(r).index_copy_(0, order, r)
        slots = view.args[0]
        if not is_call(slots, "index_copy_", "index_copy") or len(slots.users) != 1 or n_args(slots) != 4:
            return None
        buf, dim, order, r = (arg(slots, i, nm) for i, nm in ((0, None), (1, "dim"), (2, "index"), (3, "source")))
        if not is_literal(dim, 0) or not is_call(buf, "zeros_like") or n_args(buf) != 1 or buf.args[0] is not r:
            return None
        if len(buf.users) != 1 or rank(order) != 1 or dtype(order) != torch.int64:
            return None
        # r = where(local.unsqueeze(-1), r0, zeros_like(r0)), r0 = rows.float()
        if not is_call(r, "where") or n_args(r) != 3 or r.kwargs:
            return None
        pred, r0, zero = r.args
        if not (is_call(pred, "unsqueeze") and n_args(pred) == 2 and is_literal(arg(pred, 1, "dim"), -1)):
            return None
        local = pred.args[0]
        if rank(local) != 1 or dtype(local) != torch.bool:
            return None
        if not (is_call(zero, "zeros_like") and n_args(zero) == 1 and zero.args[0] is r0):
            return None
        if not (is_call(r0, "float") and n_args(r0) == 1):
            return None
        rows = r0.args[0]
        if rank(rows) != 2 or dtype(rows) not in (torch.float32, torch.bfloat16):
            return None
        if not same_int(d, val(rows).shape[1]) or not same_int(val(order).shape[0], val(rows).shape[0]):
            return None
        nodes = {node, view, slots, buf, r, pred, zero, r0}
        return Match(anchor=node, nodes=nodes, target=moe_combine, args=(rows, order, local, k),
                     kwargs={"backend": self.op_backend}, outputs=[(node, None)])
