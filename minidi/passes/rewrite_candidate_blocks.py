"""Pass T: the V4.1 candidate source's pre-filter (``minidi.model.indexer.candidate_blocks``) ->
``minidi.ops.candidate_blocks.candidate_blocks``, two kernels.

Naive subgraph (Dynamo FX), once per model step (layer ``candidate_source_layer``), on that layer's indexer scores
(pass B's op output, or the naive chain's)::

    cols = F.pad(scores.float(), (0, (-N) % B), value=-inf).view(T, NB, B).unbind(-1)      # block_max, inlined
    bs   = maximum(...maximum(maximum(cols[0], cols[1]), cols[2])..., cols[B - 1])         # (cols[0] when B = 1)
    new  = ((k_end - 1).clamp(min=0) // B).unsqueeze(1)
    x    = bs.masked_fill(zeros_like(bs, dtype=bool).scatter(1, new, (k_end > k_start).unsqueeze(1)), inf)
    ids  = _pick(x, K)                 # topk_set, then -inf picks last as -1 (``patterns.picks_of``), K = min(keep, NB)

Replacement::

    ids = candidate_blocks(scores, k_start, k_end, K, B, None)     # [T, K] int64, the same ids in the same order
    ids = candidate_blocks(s, k_start, k_end, K, B, bf16)          # scores = s.to(bf16), s fp32 (B's op output)

Taken: a rank-2 float ``scores`` padded by exactly (-N) % B columns of -inf and viewed as [T, cdiv(N, B), B]; the
maxima chain over every column of the unbind, in order; the forced block the newest visible one of ``[k_start,
k_end)``; nothing else reading the chain's nodes. Refused: another pad value or width, a partial maximum chain, another
forced block or fill value, a top-k with another tie-break or -1 rule.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from minidi.ops.candidate_blocks import candidate_blocks

from .base import Match, Rewrite
from .fx_utils import arg, dims_equal, dtype, is_call, is_literal, n_args, rank, same_int, val
from .patterns import only_users, picks_of, picks_width


def _block_maxima(bs: Node) -> tuple[Node, int, set[Node]] | None:
    """bs = the maxima chain over ``F.pad(scores.float(), (0, (-N) % B), value=-inf).view(T, NB, B).unbind(-1)``
    -> (scores, B, its nodes)."""
    nodes: set[Node] = set()
    cols: list[Node] = []
    x = bs
    while is_call(x, "maximum") and len(x.args) == 2:
        nodes.add(x)
        cols.append(x.args[1])
        x = x.args[0]
    cols.append(x)
    cols.reverse()  # cols[i] must be unbind(...)[i]
    unbind = None
    for i, c in enumerate(cols):
        if not (isinstance(c, Node) and c.op == "call_function" and c.target is operator.getitem and c.args[1] == i):
            return None
        if unbind is None:
            unbind = c.args[0]
        elif c.args[0] is not unbind:
            return None
        nodes.add(c)
    if not (is_call(unbind, "unbind") and dims_equal(arg(unbind, 1, "dim", 0), -1, 2)):
        return None
    view = unbind.args[0]
    if not (is_call(view, "view") and rank(view) == 3):
        return None
    block = val(view).shape[2]
    if not isinstance(block, int) or len(unbind.users) != block or len(cols) != block:
        return None
    pad = view.args[0]
    if not (is_call(pad, "pad") and arg(pad, 2, "mode", "constant") == "constant"
            and is_literal(arg(pad, 3, "value", None), -math.inf)):
        return None
    widths = arg(pad, 1, "pad")
    xf = pad.args[0]
    if not (is_call(xf, "float") and n_args(xf) == 1 and isinstance(widths, (tuple, list)) and len(widths) == 2):
        return None
    scores = xf.args[0]
    if not (isinstance(scores, Node) and rank(scores) == 2 and val(scores).dtype.is_floating_point):
        return None
    n = val(scores).shape[1]
    if not (is_literal(widths[0], 0) and same_int(widths[1], (-n) % block)):
        return None
    if not same_int(val(view).shape[1], (n + val(widths[1])) // block):  # cdiv(N, B), as Dynamo writes it
        return None
    return scores, block, nodes | {unbind, view, pad, xf}


def _newest_forced(x: Node, bs: Node, block: int) -> tuple[Node, Node, set[Node]] | None:
    """x = bs.masked_fill(zeros_like(bs, dtype=bool).scatter(1, ((k_end - 1).clamp(min=0) // block).unsqueeze(1),
    (k_end > k_start).unsqueeze(1)), inf) -> (k_start, k_end, its nodes)."""
    if not (is_call(x, "masked_fill") and n_args(x) == 3 and x.args[0] is bs
            and is_literal(arg(x, 2, "value"), math.inf)):
        return None
    sc = arg(x, 1, "mask")
    if not (is_call(sc, "scatter") and n_args(sc) == 4 and dims_equal(arg(sc, 1, "dim"), 1)):
        return None
    zl, new, src = sc.args[0], arg(sc, 2, "index"), arg(sc, 3, "src")
    if not (is_call(zl, "zeros_like") and zl.args[0] is bs and zl.kwargs.get("dtype") == torch.bool):
        return None
    if not (is_call(new, "unsqueeze") and dims_equal(arg(new, 1, "dim"), 1) and is_call(src, "unsqueeze")
            and dims_equal(arg(src, 1, "dim"), 1)):
        return None
    div, gt = new.args[0], src.args[0]
    if not (is_call(div, "floordiv") and len(div.args) == 2 and is_literal(div.args[1], block)):
        return None
    clamp = div.args[0]
    if not (is_call(clamp, "clamp") and is_literal(arg(clamp, 1, "min", None), 0)
            and arg(clamp, 2, "max", None) is None):
        return None
    sub = clamp.args[0]
    if not (is_call(sub, "sub") and len(sub.args) == 2 and is_literal(sub.args[1], 1)):
        return None
    if not (is_call(gt, "gt") and len(gt.args) == 2 and gt.args[0] is sub.args[0]):
        return None
    k_end, k_start = gt.args
    for k in (k_start, k_end):
        if not (isinstance(k, Node) and rank(k) == 1 and val(k).dtype in (torch.int32, torch.int64)):
            return None
    return k_start, k_end, {x, sc, zl, new, src, div, gt, clamp, sub}


def _rounded(scores: Node) -> tuple[Node, torch.dtype | None]:
    """scores = ``s.to(bf16 / fp16)`` of fp32 s (pass B's cast of its fp32 scores back to the model's dtype) -> (s,
    that dtype): the op rounds each block's max instead, so the rounded copy need not be written; else (scores,
    None). The cast node stays for any other reader."""
    if is_call(scores, "to") and n_args(scores) == 2 and not scores.kwargs and isinstance(scores.args[0], Node):
        src, to = scores.args[0], scores.args[1]
        if dtype(src) == torch.float32 and to in (torch.bfloat16, torch.float16) and dtype(scores) == to:
            return src, to
    return scores, None


class CandidateBlocks(Rewrite):
    key = "T"
    name = "candidate_blocks"

    def match(self, node: Node) -> Match | None:
        picks = picks_of(node)
        if picks is None:
            return None
        x, kk, n_cols, nodes = picks
        bs = x.args[0] if is_call(x, "masked_fill") and x.args else None
        maxima = _block_maxima(bs) if isinstance(bs, Node) else None
        if maxima is None:
            return None
        scores, block, max_nodes = maxima
        forced = _newest_forced(x, bs, block)
        if forced is None:
            return None
        k_start, k_end, force_nodes = forced
        nb = val(bs).shape[1]
        if not same_int(n_cols, nb):
            return None
        keep = picks_width(kk)  # min(keep, NB)
        if keep is None:
            return None
        nodes |= max_nodes | force_nodes
        if not all(only_users(n, nodes) for n in nodes - {node}):
            return None
        scores, round_to = _rounded(scores)
        return Match(anchor=node, nodes=nodes, target=candidate_blocks,
                     args=(scores, k_start, k_end, keep, block, round_to), kwargs={"backend": self.op_backend},
                     outputs=[(node, None)])
