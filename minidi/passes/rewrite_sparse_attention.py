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

The model's rotations around it (``minidi.model.layers.apply_rope``: q = apply_rope(q_raw, cos, sin) before,
apply_rope(out, cos, sin, inverse=True) after) are folded in where the chain is exact and its tensors have no other
reader: the op then rotates q in its load and the output in its store (``rope_mode`` ROPE_Q / ROPE_OUT), and the
two elementwise kernels of [T, H, D] around the attention leave the step::

    out = sparse_attention(q_raw, ..., rope_cos=cos, rope_sin=sin, rope_mode=ROPE_Q | ROPE_OUT)

V4's per-head unweighted q RMSNorm before q's rotation (``minidi.model.layers.rms_norm(q, None, eps)``)::

    q32 = q.float(); q_n = (q32 * rsqrt(q32.square().mean(-1, keepdim=True) + eps)).to(q.dtype)

is folded the same way where the normalised q has no other reader: the op scales q by the rsqrt in its load
(``q_scale``; the product and its rounding are the model's), and Inductor computes the rsqrt alone, a reduction that
writes [T, H, 1] fp32 instead of the normalised [T, H, D] q (half of the norm's traffic)::

    out = sparse_attention(q, ..., rope_mode=..., q_scale=rsqrt(q32.square().mean(-1, keepdim=True) + eps))

Matched from the attention end backwards, so a gather + where that does not feed this attention (the compressed
view's own ``rows[view_idx]``) is never taken; both einsum equations, the -1 test, the -inf fill, the max/exp/sum
chain and the sink term are checked exactly.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from minidi.ops.sparse_attention import ROPE_OUT, ROPE_Q, sparse_attention

from .base import Match, Rewrite
from .fx_utils import (arg, dims_equal, dtype, is_call, is_literal, is_stage_marker, n_args, normalize_einsum, rank,
                       same_int, untouched_between, val)
from .patterns import mean_square


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


def _slice(node, x) -> tuple[bool, object] | None:
    """x[..., :k] -> (True, k); x[..., k:] -> (False, k); else None."""
    if not (is_call(node, "getitem") and len(node.args) == 2 and node.args[0] is x):
        return None
    key = node.args[1]
    if not (isinstance(key, tuple) and len(key) == 2 and key[0] is Ellipsis and isinstance(key[1], slice)):
        return None
    sl = key[1]
    if sl.step is not None:
        return None
    if sl.start is None and sl.stop is not None:
        return True, sl.stop
    if sl.stop is None and sl.start is not None:
        return False, sl.start
    return None


def _pair(node, pairs, i: int) -> bool:
    return (is_call(node, "getitem") and len(node.args) == 2 and node.args[0] is pairs
            and node.args[1] == (Ellipsis, i))


def _products(node, name: str, a, b) -> tuple[Node, Node] | None:
    """name(mul(a, u), mul(b, v)) -> (u, v)."""
    if not (is_call(node, name) and len(node.args) == 2 and not node.kwargs):
        return None
    m1, m2 = node.args
    if not all(is_call(m, "mul") and len(m.args) == 2 for m in (m1, m2)):
        return None
    if m1.args[0] is not a or m2.args[0] is not b:
        return None
    return m1.args[1], m2.args[1]


def rope_chain(cat) -> tuple[Node, Node, Node, bool, set[Node]] | None:  # noqa: C901 (a straight walk up one chain)
    """The chain of ``apply_rope(x, cos, sin, inverse)`` ending at ``cat`` -> (x, cos, sin, inverse, its nodes):
    x [T, H, D]; cos / sin [T, r2] viewed as [T, 1, r2]; the trailing 2 r2 channels rotated as pairs."""
    if not (is_call(cat, "cat") and n_args(cat) == 2 and dims_equal(arg(cat, 1, "dim"), -1, 2)):
        return None
    parts = cat.args[0]
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2):
        return None
    nope, out = parts
    if not (_one(out, "to", n=2) and _one(out.args[0], "flatten", n=2) and is_literal(arg(out.args[0], 1), -2)):
        return None
    stack = out.args[0].args[0]
    if not (is_call(stack, "stack") and n_args(stack) == 2 and dims_equal(arg(stack, 1, "dim"), -1)):
        return None
    ys = stack.args[0]
    if not (isinstance(ys, (list, tuple)) and len(ys) == 2):
        return None
    y0, y1 = ys
    if not (is_call(y0, "sub") and y0.args and is_call(y0.args[0], "mul") and y0.args[0].args):
        return None
    x0 = y0.args[0].args[0]
    if not (is_call(x0, "getitem") and isinstance(x0.args[0], Node)):
        return None
    pairs = x0.args[0]
    x1 = next((u for u in pairs.users if _pair(u, pairs, 1)), None)
    if x1 is None or not _pair(x0, pairs, 0):
        return None
    cs = _products(y0, "sub", x0, x1)  # x0 * c - x1 * s
    sc = _products(y1, "add", x0, x1)  # x0 * s + x1 * c
    if cs is None or sc is None or (sc[0], sc[1]) != (cs[1], cs[0]):
        return None
    c, s = cs
    if not (_one(pairs, "unflatten", n=3) and is_literal(arg(pairs, 1), -1) and _one(pairs.args[0], "float", n=1)):
        return None
    shape = arg(pairs, 2)
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2 and is_literal(shape[1], 2)):
        return None
    rot = pairs.args[0].args[0]
    x = rot.args[0] if is_call(rot, "getitem") and rot.args else None
    lo, hi = _slice(nope, x), _slice(rot, x)
    if lo is None or hi is None or not lo[0] or hi[0] or lo[1] != hi[1]:
        return None
    inverse = is_call(s, "neg") and n_args(s) == 1
    sview = s.args[0] if inverse else s
    if not (is_call(c, "view") and is_call(sview, "view") and c.args and sview.args):
        return None
    cos, sin = c.args[0], sview.args[0]
    xv, cv, sv, vv = val(x), val(cos), val(sin), val(c)
    if not all(isinstance(v, torch.Tensor) for v in (xv, cv, sv, vv)):
        return None
    if xv.dim() != 3 or cv.dim() != 2 or sv.shape != cv.shape or vv.dim() != 3 or not same_int(vv.shape[1], 1):
        return None
    if not (same_int(cv.shape[0], xv.shape[0]) and same_int(shape[0], cv.shape[1])):
        return None
    if cv.dtype != torch.float32 or sv.dtype != torch.float32 or out.args[1] != xv.dtype:
        return None
    nodes = {cat, out, out.args[0], stack, y0, y1, *y0.args, *y1.args, x0, x1, pairs, pairs.args[0], rot, nope, c,
             s, sview}
    return x, cos, sin, inverse, nodes


def qnorm_chain(x: Node) -> tuple[Node, Node, set[Node], Node] | None:
    """``x = rms_norm(q, None, eps)``'s chain -> (q, its rsqrt node [T, H, 1] fp32, the product and rounding nodes,
    which only the norm's output needs, the chain's first node: q.float())."""
    if not (_one(x, "to", n=2) and _one(x.args[0], "mul", n=2)):
        return None
    mul = x.args[0]
    f, r = mul.args
    if not (_one(f, "float", n=1) and _one(r, "rsqrt", n=1)):
        return None
    add = r.args[0]
    if not (is_call(add, "add") and len(add.args) == 2 and not add.kwargs and isinstance(add.args[1], float)):
        return None
    ms = mean_square(f)
    if ms is None or ms[0] is not add.args[0]:
        return None
    q, qv, rv = f.args[0], val(f.args[0]), val(r)
    if not (isinstance(qv, torch.Tensor) and isinstance(rv, torch.Tensor) and qv.dim() == 3 and rv.dim() == 3):
        return None
    if x.args[1] != qv.dtype or rv.dtype != torch.float32 or not same_int(rv.shape[2], 1):
        return None
    if set(mul.users) != {x} or set(r.users) != {mul}:
        return None
    return q, r, {x, mul}, f


def _readers(node: Node, inside: set[Node]) -> list[Node] | None:
    """The stage markers among node's users when every other user is in ``inside``; None otherwise."""
    if not node.users:
        return None
    markers = [u for u in node.users if u not in inside]
    return markers if all(is_stage_marker(u) for u in markers) else None


def _first(graph, nodes: set[Node]) -> Node:
    return next(n for n in graph.nodes if n in nodes)


def _cats_of_slices(node: Node) -> list[Node]:
    """The ``cat`` nodes that read a slice of ``node`` (where an apply_rope chain on node's output ends: its nope
    slice goes straight into the cat)."""
    return [c for u in node.users if is_call(u, "getitem") for c in u.users if is_call(c, "cat")]


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
        graph = node.graph
        start = _first(graph, nodes)  # the attention's own first node: the mutation check starts here
        kwargs, result, reroute = {"backend": self.op_backend}, node, []
        cos = sin = None
        mode = 0
        rq = rope_chain(q)  # q = apply_rope(q_raw, cos, sin), read by this attention (and stage markers) only
        if rq is not None and not rq[3] and dtype(rq[0]) == qdt:
            markers = _readers(q, nodes)
            if markers is not None and untouched_between(graph, _first(graph, rq[4]), start, {rq[0], rq[1], rq[2]}):
                reroute += [(mk, q, rq[0]) for mk in markers]  # a marker of the rotated q now marks q_raw
                q, cos, sin = rq[0], rq[1], rq[2]
                mode |= ROPE_Q
                nodes |= rq[4]
        for cat in _cats_of_slices(node):  # the output's apply_rope(out, cos, sin, inverse=True)
            ro = rope_chain(cat)
            if ro is None or ro[0] is not node or not ro[3] or (cos is not None and (ro[1], ro[2]) != (cos, sin)):
                continue
            markers = _readers(node, ro[4])
            if markers is not None:
                reroute += [(mk, node, None) for mk in markers]  # a marker of the output marks the op's result
                cos, sin = ro[1], ro[2]
                mode |= ROPE_OUT
                nodes |= ro[4]
                result = cat
            break
        if mode:
            kwargs.update(rope_cos=cos, rope_sin=sin, rope_mode=mode)
        qn = qnorm_chain(q)  # q = rms_norm(q_pre, None, eps), read by this attention (and stage markers) only
        if qn is not None and dtype(qn[0]) == qdt:
            markers = _readers(q, nodes)
            if markers is not None and untouched_between(graph, qn[3], start, {qn[0], qn[1]}):
                reroute += [(mk, q, qn[0]) for mk in markers]  # a marker of the normalised q now marks q_pre
                q = qn[0]
                kwargs.update(q_scale=qn[1])
                nodes |= qn[2]
        return Match(anchor=node, nodes=nodes, target=sparse_attention,
                     args=(q, window_kv, window_idx, comp_kv, comp_idx, sink, float(scale)),
                     kwargs=kwargs, outputs=[(result, None)], reroute=reroute, mutation_start=start)
