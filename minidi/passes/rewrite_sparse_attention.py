"""Pass A: key assembly + attention (``minidi.model.sparse_attention.sparse_attention_naive``) ->
``minidi.ops.sparse_attention.sparse_attention``.

Naive subgraph (Dynamo FX; the ``comp`` parts are absent in window-only layers)::

    keys  = cat([window_kv[window_idx.clamp(min=0)], comp_kv[comp_idx.clamp(min=0)]], dim=1)   # [T, W+K, D]
    idx   = cat([window_idx, comp_idx], dim=1)
    valid = idx >= 0
    keys  = where(valid.unsqueeze(-1), keys, zeros_like(keys))
    s     = einsum("thd,tkd->thk", q.float(), keys.float()) * scale
    s     = s.masked_fill(~valid.unsqueeze(1), -inf)
    m     = s.amax(dim=-1, keepdim=True);  e = exp(s - m)
    denom = e.sum(dim=-1, keepdim=True) + exp(sink.float().view(1, -1, 1) - m)
    out   = (einsum("thk,tkd->thd", e.to(q.dtype).float(), keys.float()) / denom).to(q.dtype)

Replacement::

    out = sparse_attention(q, window_kv, window_idx, comp_kv, comp_idx, sink, scale)  # rows read by index, no [T,K,D]

Matched from the attention end backwards, so a gather + where that does not feed this attention (the compressed
view's own ``rows[view_idx]``) is never taken; both einsum equations, the -1 test, the -inf fill, the max/exp/sum
chain and the sink term are checked exactly.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from minidi.ops.sparse_attention import sparse_attention

from .base import Match, Rewrite
from .fx_utils import arg, dims_equal, dtype, is_call, is_literal, n_args, normalize_einsum, rank


def _one(node, *names: str, n: int | None = None) -> bool:
    return is_call(node, *names) and (n is None or n_args(node) == n)


def _gather(node) -> tuple[Node, Node] | None:
    """kv[idx.clamp(min=0)] -> (kv, idx)."""
    if not (is_call(node, "getitem") and len(node.args) == 2):
        return None
    kv, cl = node.args
    if not (isinstance(kv, Node) and _one(cl, "clamp", n=2) and is_literal(arg(cl, 1, "min", None), 0)):
        return None
    if "max" in cl.kwargs or rank(kv) != 2 or rank(cl.args[0]) != 2:
        return None
    return kv, cl.args[0]


def _keepdim_last(node, name: str) -> bool:
    return (_one(node, name, n=3) and dims_equal(arg(node, 1, "dim"), -1, 2)
            and arg(node, 2, "keepdim") is True)


class SparseAttention(Rewrite):
    key = "A"
    name = "sparse_attention"

    def match(self, node: Node) -> Match | None:  # noqa: C901 (a straight walk up the naive chain)
        # out.to(q.dtype), out = pv / denom
        if not _one(node, "to", n=2):
            return None
        div = node.args[0]
        if not is_call(div, "truediv") or len(div.args) != 2:
            return None
        pv, denom = div.args
        if not (_one(pv, "einsum", n=3) and normalize_einsum(pv.args[0]) == "thk,tkd->thd"):
            return None
        pf, kf2 = pv.args[1], pv.args[2]
        # e.to(q.dtype).float()
        if not (_one(pf, "float", n=1) and _one(pf.args[0], "to", n=2)):
            return None
        e = pf.args[0].args[0]
        if not (_one(e, "exp", n=1) and is_call(e.args[0], "sub") and len(e.args[0].args) == 2):
            return None
        scores, m = e.args[0].args
        if not (_keepdim_last(m, "amax") and m.args[0] is scores):
            return None
        # denom = e.sum(-1, keepdim) + exp(sink.float().view(1, -1, 1) - m)
        if not (is_call(denom, "add") and len(denom.args) == 2):
            return None
        esum, esink = denom.args
        if not (_keepdim_last(esum, "sum") and esum.args[0] is e and _one(esink, "exp", n=1)):
            return None
        sub = esink.args[0]
        if not (is_call(sub, "sub") and len(sub.args) == 2 and sub.args[1] is m):
            return None
        sview = sub.args[0]
        if not (_one(sview, "view", n=4) and list(sview.args[1:]) == [1, -1, 1] and _one(sview.args[0], "float", n=1)):
            return None
        sink = sview.args[0].args[0]
        # scores = (einsum("thd,tkd->thk", q.float(), keys.float()) * scale).masked_fill(~valid.unsqueeze(1), -inf)
        if not (_one(scores, "masked_fill", n=3) and is_literal(arg(scores, 2, "value"), -math.inf)):
            return None
        mul, inv = scores.args[0], arg(scores, 1, "mask")
        if not (is_call(mul, "mul") and len(mul.args) == 2 and isinstance(mul.args[1], float)):
            return None
        qk, scale = mul.args
        if not (_one(qk, "einsum", n=3) and normalize_einsum(qk.args[0]) == "thd,tkd->thk"):
            return None
        qf, kf1 = qk.args[1], qk.args[2]
        if not (_one(qf, "float", n=1) and _one(kf1, "float", n=1) and _one(kf2, "float", n=1)):
            return None
        keys = kf1.args[0]
        if kf2.args[0] is not keys:
            return None
        q = qf.args[0]
        if pf.args[0].args[1] != dtype(q) or node.args[1] != dtype(q):
            return None
        if not (_one(inv, "invert", n=1) and _one(inv.args[0], "unsqueeze", n=2)
                and is_literal(arg(inv.args[0], 1, "dim"), 1)):
            return None
        valid = inv.args[0].args[0]
        # keys = where(valid.unsqueeze(-1), raw, zeros_like(raw)), valid = idx >= 0
        if not (_one(keys, "where", n=3) and not keys.kwargs):
            return None
        pred, raw, zero = keys.args
        if not (_one(pred, "unsqueeze", n=2) and is_literal(arg(pred, 1, "dim"), -1) and pred.args[0] is valid):
            return None
        if not (_one(zero, "zeros_like", n=1) and zero.args[0] is raw):
            return None
        if not (is_call(valid, "ge") and len(valid.args) == 2 and is_literal(valid.args[1], 0)):
            return None
        idx = valid.args[0]
        nodes = {node, div, pv, pf, pf.args[0], e, e.args[0], m, denom, esum, esink, sub, sview, sview.args[0],
                 scores, mul, qk, qf, kf1, kf2, inv, inv.args[0], keys, pred, zero, valid}
        # window-only: raw = window_kv[window_idx.clamp(0)], idx = window_idx
        # with compressed keys: raw = cat([that, comp_kv[comp_idx.clamp(0)]], 1), idx = cat([window_idx, comp_idx], 1)
        comp_kv = comp_idx = None
        one = _gather(raw)
        if one is not None:
            window_kv, window_idx = one
            if idx is not window_idx:
                return None
            nodes |= {raw, raw.args[1]}
        else:
            if not (_one(raw, "cat", n=2) and dims_equal(arg(raw, 1, "dim"), 1) and len(raw.args[0]) == 2):
                return None
            if not (_one(idx, "cat", n=2) and dims_equal(arg(idx, 1, "dim"), 1) and len(idx.args[0]) == 2):
                return None
            gw, gc = (_gather(x) for x in raw.args[0])
            if gw is None or gc is None or [gw[1], gc[1]] != list(idx.args[0]):
                return None
            (window_kv, window_idx), (comp_kv, comp_idx) = gw, gc
            nodes |= {raw, idx, *raw.args[0], *(x.args[1] for x in raw.args[0])}
        # the op's contract: q [T, H, D] bf16/fp32, kv rows [N, D] in q's dtype, int index lists, fp32 sink [H]
        qdt = dtype(q)
        if rank(q) != 3 or qdt not in (torch.bfloat16, torch.float32) or dtype(sink) != torch.float32:
            return None
        if any(x is not None and dtype(x) != qdt for x in (window_kv, comp_kv)):
            return None
        if any(x is not None and dtype(x) not in (torch.int32, torch.int64) for x in (window_idx, comp_idx)):
            return None
        return Match(anchor=node, nodes=nodes, target=sparse_attention,
                     args=(q, window_kv, window_idx, comp_kv, comp_idx, sink, float(scale)),
                     kwargs={"backend": self.op_backend}, outputs=[(node, None)])
