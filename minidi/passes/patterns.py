"""Matchers shared by several rewrites: sub-patterns that more than one pass must recognise.

A rewrite file holds its own pass; what two passes both need lives here, so that no rewrite imports another one and
the passes stay one row of peers (``fx_utils`` < ``patterns`` < ``rewrite_*`` < ``manager``).

- ``fp32_gemm``: ``x.float() @ w.float().t()``, the router GEMM (pass E) and the mHC projections (pass F);
  ``feeds_softplus`` tells them apart.
- ``grouped_gemm_offs``: ``offs`` of a grouped GEMM in either form, ``torch._grouped_mm`` or pass D's
  ``fp4_grouped_mm`` (passes H and I, which run after D).
- ``row_gather``: ``x[idx]``, the MoE dispatch gather (pass I; pass D's row-gather folding).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm
from minidi.ops.moe_gather import IDX_DTYPES, X_DTYPES

from .fx_utils import dtype, is_call, n_args, rank

_GEMM_IN = (torch.float32, torch.bfloat16)


def fp32_gemm(node: Node) -> tuple[Node, Node, set[Node]] | None:
    """``x.float() @ w.float().t()`` with rank-2 bf16 / fp32 operands -> (x, w, the nodes to replace), else None.
    The shape shared by the router GEMM (pass E) and the mHC projections (pass F)."""
    if not is_call(node, "matmul") or len(node.args) != 2 or node.kwargs:
        return None
    xf, wt = node.args
    if not (is_call(xf, "float") and n_args(xf) == 1 and is_call(wt, "t") and n_args(wt) == 1):
        return None
    wf = wt.args[0]
    if not (is_call(wf, "float") and n_args(wf) == 1) or len(wt.users) != 1 or len(wf.users) != 1:
        return None
    x, w = xf.args[0], wf.args[0]
    if rank(x) != 2 or rank(w) != 2 or dtype(x) not in _GEMM_IN or dtype(w) not in _GEMM_IN:
        return None
    return x, w, {node, wt, wf} | ({xf} if len(xf.users) == 1 else set())


def feeds_softplus(node: Node) -> bool:
    """The GEMM's logits feed ``softplus``: the router's score function (pass E's, not pass F's)."""
    return any(is_call(u, "softplus") for u in node.users)


def grouped_gemm_offs(node) -> Node | None:
    """``offs`` of a grouped GEMM node: torch._grouped_mm(x, w, offs=offs) or fp4_grouped_mm(x, p, s, offs, ...)."""
    if not isinstance(node, Node):
        return None
    if is_call(node, "_grouped_mm"):
        return node.kwargs.get("offs")
    if node.op == "call_function" and node.target is fp4_grouped_mm and len(node.args) >= 4:
        return node.args[3]
    return None


def row_gather(node) -> tuple[Node, Node] | None:
    """node = x[idx] (a 1-D integer index into a 2-D float tensor) -> (x, idx)."""
    if not (is_call(node, "getitem") and len(node.args) == 2 and isinstance(node.args[1], Node)):
        return None
    x, idx = node.args
    if not isinstance(x, Node) or rank(x) != 2 or dtype(x) not in X_DTYPES or dtype(node) != dtype(x):
        return None
    if rank(idx) != 1 or dtype(idx) not in IDX_DTYPES:
        return None
    return x, idx
