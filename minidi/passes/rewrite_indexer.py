"""Pass B: indexer score + top-k (``minidi.model.indexer.indexer_topk_naive``) ->
``minidi.ops.indexer_score.indexer_topk``.

Naive subgraph (Dynamo FX; the ``allowed`` line only in V4.1 re-index layers)::

    s   = einsum("thd,nd->thn", q, k.to(q.dtype))                      # [T, Hi, N]
    s   = (s.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)           # [T, N]
    j   = arange(N).unsqueeze(0); lo = k_start.unsqueeze(1); hi = k_end.unsqueeze(1)
    s   = s.masked_fill((j < lo) | (j >= hi), -inf)
    s   = s.masked_fill(~allowed, -inf)
    idx = s.topk(min(topk, N), dim=-1).indices
    idx = where((idx >= lo) & (idx < hi), idx, -1)                     # -> (idx, s)

Replacement::

    idx, s = indexer_topk(q, k, w, k_start, k_end, topk, allowed)      # [T, N] scores written once, Triton top-k

The op returns the same top-k *set* in ascending key order (attention does not depend on the order) and -1 for
picks scored -inf. Refused: another contraction (e.g. ``"thd,tnd->thn"``), a sum over another dim, a range mask
that is not ``[k_start, k_end)``, a ``where`` with another predicate or fill.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from minidi.ops.indexer_score import indexer_topk

from .base import Match, Rewrite
from .fx_utils import arg, dims_equal, dtype, is_call, is_literal, n_args, normalize_einsum, rank, same_int, val

_QK = (torch.bfloat16, torch.float16, torch.float32)


def _unsq(node, dim: int) -> Node | None:
    if is_call(node, "unsqueeze") and n_args(node) == 2 and is_literal(arg(node, 1, "dim"), dim):
        return node.args[0]
    return None


class IndexerTopK(Rewrite):
    key = "B"
    name = "indexer_topk"

    def match(self, node: Node) -> Match | None:  # noqa: C901
        # idx = where((idx0 >= lo) & (idx0 < hi), idx0, -1)
        if not (is_call(node, "where") and len(node.args) == 3 and not node.kwargs and is_literal(node.args[2], -1)):
            return None
        cond, idx0 = node.args[0], node.args[1]
        if not (is_call(cond, "and") and len(cond.args) == 2):
            return None
        ge, lt = cond.args
        if not (is_call(ge, "ge") and is_call(lt, "lt") and ge.args[0] is idx0 and lt.args[0] is idx0):
            return None
        lo, hi = ge.args[1], lt.args[1]
        k_start, k_end = _unsq(lo, 1), _unsq(hi, 1)
        if k_start is None or k_end is None:
            return None
        # idx0 = s.topk(K, dim=-1)[1]
        if not (is_call(idx0, "getitem") and idx0.args[1] == 1 and is_call(idx0.args[0], "topk")):
            return None
        tk = idx0.args[0]
        if not (n_args(tk) == 3 and dims_equal(arg(tk, 2, "dim"), -1, 1) and len(tk.users) == 1):
            return None
        kk = arg(tk, 1, "k")
        scores = tk.args[0]
        # optional: scores = s1.masked_fill(~allowed, -inf)
        allowed = None
        nodes = {node, cond, ge, lt, idx0, tk}
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
        if jl.args[1] is not lo or jh.args[1] is not hi:
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
        # the top-k width is min(topk, N): a literal, or sym_min(topk, N)
        if isinstance(kk, Node):
            if not (is_call(kk, "sym_min") and len(kk.args) == 2 and isinstance(kk.args[0], int)):
                return None
            topk = kk.args[0]  # (not in ``nodes``: Dynamo shares one sym_min node between layers)
        elif isinstance(kk, int):
            topk = kk
        else:
            return None
        # the op's contract
        if rank(q) != 3 or rank(k) != 2 or rank(w) != 2 or qdt not in _QK or dtype(k) not in _QK:
            return None
        if not same_int(j.args[0], val(k).shape[0]):
            return None
        for x in (k_start, k_end):
            if rank(x) != 1 or dtype(x) not in (torch.int32, torch.int64):
                return None
        if allowed is not None and (dtype(allowed) != torch.bool or rank(allowed) != 2):
            return None
        outputs = [(node, 0), (scores, 1)]
        return Match(anchor=node, nodes=nodes, target=indexer_topk, args=(q, k, w, k_start, k_end, topk, allowed),
                     kwargs={"backend": self.op_backend}, outputs=outputs)
