"""Pass G: the mHC stream update (``minidi.model.hyper_connections.hc_expand``) -> ``minidi.ops.hc_expand.hc_expand``
(the whole update), or, where only its einsum matches, ``minidi.ops.hc_streams.hc_stream_mix``.

Naive subgraph (Dynamo FX), twice per layer (after attention, after the MoE)::

    mixed = einsum("tjk,tjd->tkd", comb, x.float())          # comb [T, n, n] fp32, streams x [T, n, D]
    x'    = (post.unsqueeze(-1) * h.float().unsqueeze(1) + mixed).to(x.dtype)

Replacement::

    x'    = hc_expand(x, h, post, comb)                        # one memory-bound kernel: each comb / post once per
                                                              # token, each stream tile read once, x' written once

Einsum only (the einsum's result has other readers, or the tail is another computation)::

    mixed = hc_stream_mix(comb, x.float())                     # broadcast product summed over j (plain torch, fused
                                                              # by Inductor with whatever follows)

Taken: exactly this equation, both einsum operands rank 3 and fp32, comb square in its stream dims (n: static and at
most ``MAX_STREAMS`` in a whole-step graph; a symbol when a layer graph takes the streams as a dynamic input). The
whole update also needs: the ``.float()`` of x and of h, post [T, n] fp32 unsqueezed at -1, h [T, D] unsqueezed at
1, the sum in this order, the cast back to x's own dtype (bf16 / fp16 / fp32), and every intermediate read by
nothing but the next step.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.hc_expand import STREAM_DTYPES, hc_expand
from minidi.ops.hc_streams import hc_stream_mix

from .base import Match, Rewrite
from .fx_utils import dims_equal, dtype, is_call, n_args, normalize_einsum, rank, same_int, val

MAX_STREAMS = 16


def _einsum(node: Node) -> tuple[Node, Node] | None:
    """node = einsum("tjk,tjd->tkd", comb, xf), fp32 rank-3 operands, comb [T, n, n] -> (comb, xf)."""
    if not is_call(node, "einsum") or len(node.args) != 3 or node.kwargs:
        return None
    eq, comb, xf = node.args
    if normalize_einsum(eq) != "tjk,tjd->tkd":
        return None
    if rank(comb) != 3 or rank(xf) != 3 or dtype(comb) != torch.float32 or dtype(xf) != torch.float32:
        return None
    n = val(comb).shape[1]  # static in a whole-step graph; symbolic when a layer is compiled on its own
    if not same_int(n, val(comb).shape[2]) or (isinstance(n, int) and n > MAX_STREAMS):
        return None
    return comb, xf


def _float_of(node: Node) -> Node | None:
    """node = v.float() (one reader) -> v."""
    if not (is_call(node, "float") and n_args(node) == 1 and len(node.users) == 1):
        return None
    v = node.args[0]
    return v if isinstance(v, Node) else None


def _unsqueeze(node: Node, *dims: int) -> Node | None:
    """node = v.unsqueeze(dim), dim one of ``dims``, one reader -> v."""
    if not (is_call(node, "unsqueeze") and len(node.args) == 2 and not node.kwargs and len(node.users) == 1):
        return None
    v, dim = node.args
    return v if isinstance(v, Node) and dims_equal(dim, *dims) else None


def _whole_update(to: Node) -> Match | None:
    """to = (post.unsqueeze(-1) * h.float().unsqueeze(1) + einsum(...)).to(x.dtype) -> the Match for hc_expand."""
    if not (is_call(to, "to") and len(to.args) == 2 and not to.kwargs and isinstance(to.args[1], torch.dtype)):
        return None
    add = to.args[0]
    if not (is_call(add, "add") and len(add.args) == 2 and not add.kwargs and len(add.users) == 1):
        return None
    mul, ein = add.args
    if not (isinstance(ein, Node) and len(ein.users) == 1 and is_call(mul, "mul") and len(mul.args) == 2
            and not mul.kwargs and len(mul.users) == 1):
        return None
    operands = _einsum(ein)
    if operands is None:
        return None
    comb, xf = operands
    x = _float_of(xf)
    post, hu = mul.args
    post = _unsqueeze(post, -1, 2) if isinstance(post, Node) else None
    hf = _unsqueeze(hu, 1) if isinstance(hu, Node) else None
    h = _float_of(hf) if hf is not None else None
    if x is None or post is None or h is None:
        return None
    if rank(x) != 3 or dtype(x) not in STREAM_DTYPES or to.args[1] != dtype(x):
        return None
    if rank(post) != 2 or dtype(post) != torch.float32 or rank(h) != 2:
        return None
    if dtype(h) is None or not dtype(h).is_floating_point:
        return None
    xv, hv, pv = val(x), val(h), val(post)
    t, n, d = xv.shape
    if not (same_int(hv.shape[0], t) and same_int(hv.shape[1], d) and same_int(pv.shape[0], t)
            and same_int(pv.shape[1], n) and same_int(val(comb).shape[0], t) and same_int(val(comb).shape[1], n)):
        return None
    return Match(anchor=to, nodes={to, add, mul, ein, xf, mul.args[0], hu, hf}, target=hc_expand,
                 args=(x, h, post, comb), outputs=[(to, None)])


class HCExpand(Rewrite):
    key = "G"
    name = "hc_expand"

    def match(self, node: Node) -> Match | None:
        if is_call(node, "to"):
            m = _whole_update(node)
            if m is not None:
                m.kwargs = {"backend": self.op_backend}
            return m
        operands = _einsum(node)
        if operands is None:
            return None
        if len(node.users) == 1:  # the whole update matches at its cast (later in the graph): leave it to that
            (user,) = node.users
            cast = next(iter(user.users)) if len(user.users) == 1 else None
            if cast is not None and _whole_update(cast) is not None:
                return None
        return Match(anchor=node, nodes={node}, target=hc_stream_mix, args=operands, outputs=[(node, None)])
