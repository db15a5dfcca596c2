"""Pass K: the mHC mixer's Sinkhorn chain (``minidi.model.hyper_connections.hc_mixer``) ->
``minidi.ops.hc_sinkhorn.hc_sinkhorn``.

Naive subgraph (Dynamo FX), at every mixer (two per layer), the loop unrolled by Dynamo::

    c = softmax(logits, dim=-1) + eps                           # logits [T, n, n] fp32
    c = c / (c.sum(dim=-2, keepdim=True) + eps)                 # columns
    c = c / (c.sum(dim=-1, keepdim=True) + eps)                 # rows    } iters - 1 times
    c = c / (c.sum(dim=-2, keepdim=True) + eps)                 # columns }

Replacement::

    c = hc_sinkhorn(logits, iters, eps)                         # one kernel, the matrices in registers

Taken: softmax over the last dim of a rank-3 fp32 tensor with square last dims; then one column step and any number
of (row, column) pairs, every ``+ eps`` the same literal, each intermediate read by nothing but its own step (the
chain ends at the first step that breaks the pattern: iters counts the steps taken).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.hc_sinkhorn import MAX_STREAMS, hc_sinkhorn

from .base import Match, Rewrite
from .fx_utils import arg, const_number, dims_equal, dtype, is_call, rank, same_int, val

_COLUMNS, _ROWS = (-2, 1), (-1, 2)


def _plus_eps(node: Node) -> tuple[Node, float] | None:
    """node = a + eps (a literal) -> (a, eps)."""
    if not (is_call(node, "add") and len(node.args) == 2 and not node.kwargs):
        return None
    a, eps = node.args
    eps = const_number(eps)
    return (a, float(eps)) if isinstance(a, Node) and eps is not None else None


def _step(c: Node, dims: tuple[int, int], eps: float) -> tuple[Node, set[Node]] | None:
    """The users of c are exactly ``s = c.sum(dim, keepdim=True)`` and ``c / (s + eps)`` -> (the division, nodes)."""
    if len(c.users) != 2:
        return None
    total = next((u for u in c.users if is_call(u, "sum")), None)
    div = next((u for u in c.users if is_call(u, "truediv", "div")), None)
    if total is None or div is None or arg(total, 0) is not c:
        return None
    if not dims_equal(arg(total, 1, "dim", None), *dims) or arg(total, 2, "keepdim", False) is not True:
        return None
    if len(total.users) != 1:
        return None
    add = next(iter(total.users))
    pe = _plus_eps(add)
    if pe is None or pe[0] is not total or pe[1] != eps or len(add.users) != 1 or div.args != (c, add):
        return None
    return div, {total, add, div}


class HCSinkhorn(Rewrite):
    key = "K"
    name = "hc_sinkhorn"

    def match(self, node: Node) -> Match | None:
        if not is_call(node, "softmax") or not dims_equal(arg(node, 1, "dim", None), -1, 2):
            return None
        logits = arg(node, 0)
        if rank(logits) != 3 or dtype(logits) != torch.float32 or dtype(node) != torch.float32:
            return None
        n = val(logits).shape[1]
        if not same_int(n, val(logits).shape[2]) or (isinstance(n, int) and n > MAX_STREAMS):
            return None
        if len(node.users) != 1:
            return None
        first = next(iter(node.users))
        pe = _plus_eps(first)
        if pe is None or pe[0] is not node:
            return None
        eps = pe[1]
        nodes = {node, first}
        step = _step(first, _COLUMNS, eps)
        if step is None:
            return None
        c, more = step
        nodes |= more
        iters = 1
        while True:  # (rows, columns) pairs
            rows = _step(c, _ROWS, eps)
            cols = None if rows is None else _step(rows[0], _COLUMNS, eps)
            if cols is None:
                break
            nodes |= rows[1] | cols[1]
            c = cols[0]
            iters += 1
        return Match(anchor=c, nodes=nodes, target=hc_sinkhorn, args=(logits, iters, eps),
                     kwargs={"backend": self.op_backend}, outputs=[(c, None)])
