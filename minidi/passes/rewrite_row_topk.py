"""Pass P: ``minidi.selection.topk_lowest_index(x, k)`` on short rows -> ``minidi.ops.row_topk.row_topk``.

Naive subgraph (Dynamo FX; the router's ``topk_lowest_index(s + bias, k)`` in ``minidi.model.moe.Gate``)::

    idx   = topk_set(x, k)                                  # two topk, a pad, an amin, where x2, a sort (inlined)
    vals  = x.gather(-1, idx)
    order = vals.masked_fill(vals.isnan(), inf).sort(dim=-1, descending=True, stable=True)[1]
    v, i  = vals.gather(-1, order), idx.gather(-1, order)   # v may have no user (the router keeps i only)

Replacement::

    v, i = row_topk(x, k)                                   # one kernel: each row read once, k picks written

Same picks in the same order (descending, equal values by ascending index, NaN as +inf); the values are x's own.
Taken only where k is a literal and x's rows are at most ``row_topk.MAX_N`` long where the shape is known (the
indexer's top-k over every key, pass B's, has another tail and is never taken here).
"""

from __future__ import annotations

import math

from torch.fx import Node

from minidi.ops.row_topk import MAX_N, X_DTYPES, row_topk

from .base import Match, Rewrite
from .fx_utils import arg, dims_equal, dtype, is_call, is_literal, n_args, rank, same_int, val
from .patterns import topk_set_call


def _gather_last(node, src: Node | None = None) -> tuple[Node, Node] | None:
    """node = src.gather(-1, index) -> (src, index)."""
    if not (is_call(node, "gather") and n_args(node) == 3 and dims_equal(arg(node, 1, "dim"), -1)):
        return None
    if src is not None and node.args[0] is not src:
        return None
    return node.args[0], arg(node, 2, "index")


def _descending_order(node, vals: Node) -> set[Node] | None:
    """node = vals.masked_fill(vals.isnan(), inf).sort(dim=-1, descending=True, stable=True)[1] -> its nodes."""
    if not (is_call(node, "getitem") and node.args[1] == 1 and is_call(node.args[0], "sort")):
        return None
    srt = node.args[0]
    if not (n_args(srt) == 4 and dims_equal(arg(srt, 1, "dim"), -1) and arg(srt, 2, "descending") is True
            and arg(srt, 3, "stable") is True and len(srt.users) == 1):
        return None
    key = srt.args[0]
    if not (is_call(key, "masked_fill") and n_args(key) == 3 and key.args[0] is vals):
        return None
    nan = arg(key, 1, "mask")
    if not (is_literal(arg(key, 2, "value"), math.inf) and is_call(nan, "isnan") and nan.args[0] is vals):
        return None
    return {node, srt, key, nan}


class RowTopK(Rewrite):
    key = "P"
    name = "row_topk"

    def match(self, node: Node) -> Match | None:
        # node = idx.gather(-1, order): the indices, the subgraph's last node
        found = _gather_last(node)
        if found is None:
            return None
        idx, order = found
        others = [u for u in idx.users if u is not node]  # vals = x.gather(-1, idx), nothing else
        if len(others) != 1 or _gather_last(others[0]) is None or _gather_last(others[0])[1] is not idx:
            return None
        vals = others[0]
        x = vals.args[0]
        order_nodes = _descending_order(order, vals)
        chosen = None if order_nodes is None else topk_set_call(idx, x)
        if chosen is None:
            return None
        k, n_cols, set_nodes = chosen
        if not isinstance(k, int) or isinstance(k, bool) or dtype(x) not in X_DTYPES or not rank(x):
            return None
        n = val(x).shape[-1]
        if not same_int(n_cols, n) or (isinstance(n, int) and n > MAX_N):
            return None
        nodes = {node, vals} | order_nodes | set_nodes
        value_nodes = [u for u in vals.users if u not in nodes]  # vals.gather(-1, order): the sorted values
        if any(_gather_last(u, vals) != (vals, order) for u in value_nodes) or len(value_nodes) > 1:
            return None
        outputs = [(node, 1)] + [(u, 0) for u in value_nodes if u.users]  # (an unused one is erased)
        return Match(anchor=node, nodes=nodes | set(value_nodes), target=row_topk, args=(x, k),
                     kwargs={"backend": self.op_backend}, outputs=outputs)
