"""Pass J: an mHC site's three reads of the streams (``minidi.model.hyper_connections``) ->
``minidi.ops.hc_mix.hc_mix_fused``, one read.

Naive subgraph (Dynamo FX), at every mixer (two per layer, and V4's head), after pass F or without it::

    z    = x.reshape(T, n * D).float()                # x [T, n, D] streams
    g    = gate_tf32x3(x.reshape(T, n * D), fn)        # pass F's op, or the naive  z @ fn.float().t()
    ms   = z.square().mean(-1, keepdim=True)           # the mixer's RMS scale (its rsqrt follows)
    # and, where the site collapses x with weights known before its mixer (V4.1: the previous site's pre):
    u    = (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)

Replacement::

    g, ms, u = hc_mix_fused(x, fn, pre)                # one kernel reads x once; pre None: no collapse (V4: its
                                                       # collapse weights come from this mixer; V4's head)

Taken: x rank 3 bf16 / fp32 and ``reshape`` to [T, n D]; fn a rank-2 fp32 weight of at most ``MAX_OUT`` rows; the
square-mean of exactly that ``z``; the collapse only when ``pre`` [T, n] fp32 exists before the mixer, every node
of it has no other user and nothing mutates a tensor between the mixer and the collapse.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.gate_tf32x3 import gate_tf32x3
from minidi.ops.hc_mix import MAX_OUT, X_DTYPES, hc_mix_fused

from .base import Match, Rewrite
from .fx_utils import arg, dims_equal, dtype, is_call, mutation_between, n_args, rank, same_int, val
from .patterns import fp32_gemm, mean_square


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _projection(node: Node) -> tuple[Node, Node, set[Node]] | None:
    """``gate_tf32x3(x2d, fn)`` (pass F's form) or ``x2d.float() @ fn.float().t()`` -> (x2d, fn, its nodes)."""
    if node.op == "call_function" and node.target is gate_tf32x3 and len(node.args) == 2:
        return node.args[0], node.args[1], {node}
    return fp32_gemm(node)


def _collapse(x: Node, anchor: Node) -> tuple[Node, Node, set[Node]] | None:
    """(pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype) with pre defined before ``anchor`` -> (the cast
    node, pre, its nodes)."""
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    t, n = val(x).shape[0], val(x).shape[1]
    for xf in x.users:
        if not (is_call(xf, "float") and n_args(xf) == 1):
            continue
        mul = _only_user(xf)
        if mul is None or not is_call(mul, "mul") or len(mul.args) != 2:
            continue
        unsq = mul.args[0] if mul.args[1] is xf else mul.args[1]
        if not (is_call(unsq, "unsqueeze") and len(unsq.users) == 1 and dims_equal(arg(unsq, 1, "dim", None), -1, 2)):
            continue
        pre = arg(unsq, 0)
        if not isinstance(pre, Node) or order.get(pre, len(order)) >= order[anchor] or rank(pre) != 2:
            continue
        if dtype(pre) != torch.float32 or not (same_int(val(pre).shape[0], t) and same_int(val(pre).shape[1], n)):
            continue
        total = _only_user(mul)
        if total is None or not is_call(total, "sum") or not dims_equal(arg(total, 1, "dim", None), 1):
            continue
        if arg(total, 2, "keepdim", False) is not False:
            continue
        cast = _only_user(total)
        if cast is None or not is_call(cast, "to") or len(cast.args) != 2 or cast.args[1] != dtype(x) or cast.kwargs:
            continue
        nodes = {xf, unsq, mul, total, cast}
        if mutation_between(anchor.graph, anchor, cast, nodes) is not None:
            continue
        return cast, pre, nodes
    return None


class HCMixFused(Rewrite):
    key = "J"
    name = "hc_mix_fused"

    def match(self, node: Node) -> Match | None:
        proj = _projection(node)
        if proj is None:
            return None
        x2d, fn, nodes = proj
        if not (is_call(x2d, "reshape") and rank(x2d) == 2) or dtype(fn) != torch.float32 or rank(fn) != 2:
            return None
        x = arg(x2d, 0)
        if not isinstance(x, Node) or rank(x) != 3 or dtype(x) not in X_DTYPES or dtype(x2d) != dtype(x):
            return None
        rows = val(fn).shape[0]
        if not isinstance(rows, int) or rows > MAX_OUT or not same_int(val(x2d).shape[0], val(x).shape[0]):
            return None
        z = next((u for u in x2d.users if is_call(u, "float") and n_args(u) == 1), None)
        ms = None if z is None else mean_square(z)
        if ms is None:
            return None
        mean, ms_nodes = ms
        nodes |= ms_nodes | {z, x2d}
        collapse = _collapse(x, node)
        outputs = [(node, 0), (mean, 1)]
        pre = None
        if collapse is not None:
            cast, pre, c_nodes = collapse
            nodes |= c_nodes
            outputs.append((cast, 2))
        return Match(anchor=node, nodes=nodes, target=hc_mix_fused, args=(x, fn, pre),
                     kwargs={"backend": self.op_backend}, outputs=outputs)
