"""Pass B: indexer score + top-k (``minidi.model.indexer.indexer_topk_naive``) ->
``minidi.ops.indexer_score.indexer_topk``.

Naive subgraph (Dynamo FX; the ``allowed`` line only in V4.1 re-index layers)::

    s   = einsum("thd,nd->thn", q, k.to(q.dtype))                      # [T, Hi, N]
    s   = (s.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)           # [T, N]
    j   = arange(N).unsqueeze(0); lo = k_start.unsqueeze(1); hi = k_end.unsqueeze(1)
    s   = s.masked_fill((j < lo) | (j >= hi), -inf)
    s   = s.masked_fill(~allowed, -inf)
    idx = topk_set(s, min(topk, N))                                     # minidi.selection.topk_set, inlined:
        key  = s.masked_fill(s.isnan(), inf)
        thr  = pad(key.topk(K, dim=-1)[0], (0, 1), value=inf).amin(dim=-1, keepdim=True)
        rank = where(key > thr, 1, where(key == thr, -arange(N, dtype=int32), INT32_MIN))
        idx  = rank.topk(K, dim=-1)[1].sort(dim=-1)[0]
    idx = where(s.gather(1, idx) > -inf, idx, AFTER).sort(dim=-1)[0]  # -inf picks last
    idx = idx.masked_fill(idx == AFTER, -1)                             # -> (idx, s)

Replacement::

    idx, s = indexer_topk(q, k, w, k_start, k_end, topk, allowed)      # [T, N] scores written once, Triton top-k

When q is an fq4 output (``minidi.model.quant.fq4_ue8m0``: the model's fake quant on; V4's Hadamard-then-fq4 too)
the replacement scores on FP8 tensor cores, ``indexer_topk(..., mma="fp8")``: every product is the bf16 path's
product, only the accumulation inside the MMA differs, and rows of q or k that e4m3 times one power of two cannot
hold are scored by the bf16 dot (checked at run time, so k, which reaches the graph from the cache, needs no match).
Without fq4 on q (fake quant off, the fp32 comparison mode) the op keeps today's numerics (``mma="native"``).

The op returns the same picks in the same order: the top-k set in ascending key order, exact ties to the lowest key,
then -1 for picks scored -inf. Refused: another contraction (e.g. ``"thd,tnd->thn"``), a sum over another dim, a
range mask that is not ``[k_start, k_end)``, a top-k with another tie-break or -1 rule (e.g. a plain ``topk``).
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from minidi.ops.indexer_score import indexer_topk

from .base import Match, Rewrite
from .fx_utils import (arg, const_number, dims_equal, dtype, is_call, is_literal, n_args, normalize_einsum, rank,
                       same_int, val)
from .patterns import picks_of, picks_width

_QK = (torch.bfloat16, torch.float16, torch.float32)


def _is_fq4(node) -> bool:
    """node = fq4_ue8m0(x, block) (``minidi.model.quant``), as Dynamo records it::

        g = x.float().unflatten(-1, (D / block, block)); s = pow2_ceil(...)     # [.., D / block, 1] powers of two
        y = (g / s).clamp(-6, 6); node = (copysign(round_e2m1(y), y) * s).flatten(-2).to(dtype)
    """
    if is_call(node, "to") and n_args(node) == 2:
        node = node.args[0]
    if not (is_call(node, "flatten") and n_args(node) == 2 and is_literal(arg(node, 1, "start_dim"), -2)):
        return False
    mul = node.args[0]
    if not (is_call(mul, "mul") and len(mul.args) == 2 and is_call(mul.args[0], "copysign")):
        return False
    cs, s = mul.args
    y = cs.args[1] if len(cs.args) == 2 else None
    if not (is_call(y, "clamp") and len(y.args) == 3 and const_number(y.args[1]) == -6.0
            and const_number(y.args[2]) == 6.0):
        return False
    dv = y.args[0]
    return is_call(dv, "truediv") and len(dv.args) == 2 and dv.args[1] is s and is_call(dv.args[0], "unflatten")


def _unsq(node, dim: int) -> Node | None:
    if is_call(node, "unsqueeze") and n_args(node) == 2 and is_literal(arg(node, 1, "dim"), dim):
        return node.args[0]
    return None


class IndexerTopK(Rewrite):
    key = "B"
    name = "indexer_topk"

    def match(self, node: Node) -> Match | None:  # noqa: C901
        picks = picks_of(node)  # node = _pick(scores, K): the top-k set, ascending, -1 for -inf picks
        if picks is None:
            return None
        scores, kk, n_cols, nodes = picks
        # optional: scores = s1.masked_fill(~allowed, -inf)
        allowed = None
        s1 = scores
        if is_call(scores, "masked_fill") and is_call(arg(scores, 1, "mask"), "invert"):
            inv = arg(scores, 1, "mask")
            if not (n_args(scores) == 3 and is_literal(arg(scores, 2, "value"), -math.inf) and n_args(inv) == 1):
                return None
            allowed, s1 = inv.args[0], scores.args[0]
            nodes |= {scores, inv}
        # s1 = s0.masked_fill((j < lo) | (j >= hi), -inf), j = arange(N).unsqueeze(0)
        if not (is_call(s1, "masked_fill") and n_args(s1) == 3 and is_literal(arg(s1, 2, "value"), -math.inf)):
            return None
        rng = arg(s1, 1, "mask")
        if not (is_call(rng, "or") and len(rng.args) == 2):
            return None
        jl, jh = rng.args
        if not (is_call(jl, "lt") and is_call(jh, "ge") and jl.args[0] is jh.args[0]):
            return None
        lo, hi = jl.args[1], jh.args[1]
        k_start, k_end = _unsq(lo, 1), _unsq(hi, 1)
        if k_start is None or k_end is None:
            return None
        j = _unsq(jl.args[0], 0)
        if not (is_call(j, "arange") and len(j.args) == 1):
            return None
        s0 = s1.args[0]
        nodes |= {s1, rng, jl, jh, jl.args[0], j, lo, hi}
        # s0 = (einsum("thd,nd->thn", q, k.to(q.dtype)).relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)
        if not (is_call(s0, "sum") and n_args(s0) == 2 and dims_equal(arg(s0, 1, "dim"), 1)):
            return None
        mul = s0.args[0]
        if not (is_call(mul, "mul") and len(mul.args) == 2):
            return None
        relu, wu = mul.args
        if not (is_call(relu, "relu") and n_args(relu) == 1):
            return None
        wt = _unsq(wu, -1)
        if not (is_call(wt, "to") and n_args(wt) == 2):
            return None
        qk = relu.args[0]
        if not (is_call(qk, "einsum") and n_args(qk) == 3 and normalize_einsum(qk.args[0]) == "thd,nd->thn"):
            return None
        q, kt = qk.args[1], qk.args[2]
        if not (is_call(kt, "to") and n_args(kt) == 2):
            return None
        k, w = kt.args[0], wt.args[0]
        qdt = dtype(q)
        if kt.args[1] != qdt or wt.args[1] != qdt:
            return None
        nodes |= {s0, mul, relu, wu, wt, qk, kt}
        topk = picks_width(kk)  # the top-k width is min(topk, N)
        if topk is None:
            return None
        # the op's contract
        if rank(q) != 3 or rank(k) != 2 or rank(w) != 2 or qdt not in _QK or dtype(k) not in _QK:
            return None
        if not (same_int(j.args[0], val(k).shape[0]) and same_int(n_cols, val(k).shape[0])):
            return None
        for x in (k_start, k_end):
            if rank(x) != 1 or dtype(x) not in (torch.int32, torch.int64):
                return None
        if allowed is not None and (dtype(allowed) != torch.bool or rank(allowed) != 2):
            return None
        outputs = [(node, 0), (scores, 1)]
        kwargs = {"backend": self.op_backend}
        if _is_fq4(q):  # fq4 q (and k): FP8 tensor cores, exact products
            kwargs["mma"] = "fp8"
        return Match(anchor=node, nodes=nodes, target=indexer_topk, args=(q, k, w, k_start, k_end, topk, allowed),
                     kwargs=kwargs, outputs=outputs)
