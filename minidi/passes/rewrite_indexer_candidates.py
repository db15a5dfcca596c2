"""Pass M: a V4.1 re-index layer's indexer scores only its candidates (``minidi.ops.indexer_candidates``).

Naive subgraph (Dynamo FX, after pass B), once per re-index layer::

    ids     = blocks.masked_fill(blocks < 0, NB)                     # candidate_allowed(blocks, N, B), inlined:
    keep    = torch.zeros(T, NB + 1, dtype=bool).scatter(1, ids, True)   # NB = cdiv(N, B)
    allowed = keep[:, torch.arange(N) // B]                           # [T, N] bool
    r       = indexer_topk(q, k, w, k_start, k_end, topk, allowed, ...)  # pass B's op: every key scored, masked
    idx     = r[0]                                                    # r[1] (the [T, N] scores) read by nothing

Replacement::

    idx = indexer_topk_candidates(q, k, w, k_start, k_end, topk, blocks, B, mma=...)   # C = KB * B keys a query

The same picks: the candidates' top-k set in ascending key order, ties to the lowest key, -1 for -inf picks, from
the same fp32 scores (B's ``mma`` kept: FP8 for fq4 q / k). ``blocks`` must list each row's ids in ascending order
(``candidate_blocks`` does; the op's docstring says what another order changes). Refused: the scores read by
anything (the candidate source layer: ``candidate_blocks`` reads them), a mask built another way, a block size or
block count that does not match N.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from minidi.ops.indexer_candidates import indexer_topk_candidates
from minidi.ops.indexer_score import indexer_topk

from .base import Match, Rewrite
from .fx_utils import arg, is_call, is_literal, n_args, rank, same_int, val
from .patterns import only_users


def _getitems(call: Node) -> dict[int, Node] | None:
    """The users of ``call``, all ``call[i]``, by i (None if anything else reads it)."""
    out: dict[int, Node] = {}
    for u in call.users:
        if not (u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)):
            return None
        out[u.args[1]] = u
    return out


def _dead_chain(node: Node) -> set[Node] | None:
    """``node`` and the pure casts hanging off it, if nothing else reads them (None otherwise)."""
    nodes, work = set(), [node]
    while work:
        n = work.pop()
        nodes.add(n)
        for u in n.users:
            if not (is_call(u, "to") and n_args(u) == 2):
                return None
            work.append(u)
    return nodes


def _allowed_from_blocks(allowed: Node) -> tuple[Node, int, object, set[Node]] | None:
    """allowed = candidate_allowed(blocks, N, B) (inlined: see the module docstring) -> (blocks, B, N, its nodes).
    N and NB may be symbolic (dynamic shapes): NB must be cdiv(N, B) and the zeros NB + 1 wide."""
    if not (is_call(allowed, "getitem") and len(allowed.args) == 2 and isinstance(allowed.args[1], tuple)):
        return None
    keep, index = allowed.args
    if len(index) != 2 or index[0] != slice(None) or not isinstance(index[1], Node):
        return None
    div = index[1]
    if not (is_call(div, "floordiv") and len(div.args) == 2 and isinstance(div.args[1], int) and div.args[1] > 0):
        return None
    jn, block = div.args
    if not (is_call(jn, "arange") and len(jn.args) == 1):
        return None
    if not (is_call(keep, "scatter") and n_args(keep) == 4 and arg(keep, 1, "dim") == 1
            and is_literal(arg(keep, 3, "value"), True)):
        return None
    zeros, ids = keep.args[0], arg(keep, 2, "index")
    if not (is_call(zeros, "zeros") and rank(zeros) == 2 and is_call(ids, "masked_fill") and n_args(ids) == 3):
        return None
    blocks, neg = ids.args[0], arg(ids, 1, "mask")
    if not (is_call(neg, "lt") and len(neg.args) == 2 and neg.args[0] is blocks and is_literal(neg.args[1], 0)):
        return None
    n, nb = jn.args[0], val(arg(ids, 2, "value"))
    if not (isinstance(nb, (int, torch.SymInt)) and same_int(-(-val(n) // block), nb)
            and same_int(val(zeros).shape[1], nb + 1)):
        return None
    nodes = {allowed, keep, div, jn, zeros, ids, neg}
    if not all(only_users(x, nodes) for x in (keep, div, jn, zeros, ids, neg)):
        return None
    return blocks, block, n, nodes


class IndexerCandidates(Rewrite):
    key = "M"
    name = "indexer_candidates"
    requires = ("B",)

    def match(self, node: Node) -> Match | None:
        if not (node.op == "call_function" and node.target is indexer_topk and len(node.args) == 7):
            return None
        q, k, w, k_start, k_end, topk, allowed = node.args
        if not isinstance(allowed, Node) or len(allowed.users) != 1:
            return None
        chain = _allowed_from_blocks(allowed)
        items = _getitems(node)
        if chain is None or items is None or 0 not in items or not isinstance(topk, int):
            return None
        blocks, block, n, nodes = chain
        if rank(blocks) != 2 or not same_int(val(k).shape[0], n):
            return None
        nodes |= {node, items[0]}
        if 1 in items:
            scores = _dead_chain(items[1])
            if scores is None:
                return None  # the candidate source layer: its scores feed candidate_blocks
            nodes |= scores
        kwargs = {"backend": self.op_backend, "mma": node.kwargs.get("mma", "native")}
        return Match(anchor=node, nodes=nodes, target=indexer_topk_candidates,
                     args=(q, k, w, k_start, k_end, topk, blocks, block), kwargs=kwargs,
                     outputs=[(items[0], None)], mutation_start=node)
