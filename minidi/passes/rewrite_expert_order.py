"""Pass Q: the MoE dispatch's stable argsort and expert counts (``minidi.model.moe.RoutedExperts.forward``) ->
``minidi.ops.expert_order.expert_order``.

Naive subgraph (Dynamo FX), once per MoE layer::

    order  = flat.argsort(stable=True)                                  # flat [R] integer expert ids
    counts = torch.zeros(E, dtype=int64).scatter_add_(0, flat, torch.ones_like(flat))

Replacement::

    order, counts = expert_order(flat, E)                               # one counting sort, three small kernels

Bit-equal results. Taken only when the argsort is stable along flat's only dim and the scatter adds ones of flat's
dtype into int64 zeros (an unstable argsort, a descending one, a count of other values are left alone).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.expert_order import IDX_DTYPES, MAX_EXPERTS, expert_order

from .base import Match, Rewrite
from .fx_utils import arg, dims_equal, dtype, is_call, is_literal, n_args, rank


def _stable_argsort(node: Node, flat: Node) -> bool:
    """node = flat.argsort(stable=True) (dim -1 or 0, ascending)."""
    if not (is_call(node, "argsort") and node.args and node.args[0] is flat):
        return False
    kw = dict(node.kwargs)
    if len(node.args) > 1 or kw.pop("stable", False) is not True:
        return False
    return dims_equal(kw.pop("dim", -1), -1, 0) and kw.pop("descending", False) is False and not kw


def _int64_zeros(node) -> int | None:
    """node = torch.zeros(E, dtype=torch.int64, ...) with a literal E -> E."""
    if not (is_call(node, "zeros") and len(node.args) == 1 and node.kwargs.get("dtype") == torch.int64):
        return None
    e = node.args[0]
    e = e[0] if isinstance(e, (tuple, list)) and len(e) == 1 else e
    return e if isinstance(e, int) and not isinstance(e, bool) and e >= 1 else None


class ExpertOrder(Rewrite):
    key = "Q"
    name = "expert_order"

    def match(self, node: Node) -> Match | None:
        # node = zeros.scatter_add_(0, flat, ones_like(flat))
        if not (is_call(node, "scatter_add_") and n_args(node) == 4 and is_literal(arg(node, 1, "dim"), 0)):
            return None
        zeros, flat, ones = node.args[0], arg(node, 2, "index"), arg(node, 3, "src")
        n_experts = _int64_zeros(zeros)
        if n_experts is None or n_experts > MAX_EXPERTS or len(zeros.users) != 1:
            return None
        if not (isinstance(flat, Node) and rank(flat) == 1 and dtype(flat) in IDX_DTYPES):
            return None
        if not (is_call(ones, "ones_like") and n_args(ones) == 1 and ones.args[0] is flat and len(ones.users) == 1):
            return None
        if dtype(flat) != torch.int64:
            return None  # the scatter's src must be int64 like the zeros: an int32 flat is not this graph
        sorts = [u for u in flat.users if _stable_argsort(u, flat)]
        if len(sorts) != 1:
            return None
        return Match(anchor=node, nodes={node, zeros, ones, sorts[0]}, target=expert_order, args=(flat, n_experts),
                     kwargs={"backend": self.op_backend}, outputs=[(sorts[0], 0), (node, 1)])
