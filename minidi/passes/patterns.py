"""Matchers shared by several rewrites: sub-patterns that more than one pass must recognise.

A rewrite file holds its own pass; what two passes both need lives here, so that no rewrite imports another one and
the passes stay one row of peers (``fx_utils`` < ``patterns`` < ``rewrite_*`` < ``manager``).

- ``fp32_gemm``: ``x.float() @ w.float().t()``, the router GEMM (pass E) and the mHC projections (pass F);
  ``feeds_softplus`` tells them apart.
- ``grouped_gemm_offs``: ``offs`` of a grouped GEMM in either form, ``torch._grouped_mm`` or pass D's
  ``fp4_grouped_mm`` (passes H and I, which run after D).
- ``row_gather``: ``x[idx]``, the MoE dispatch gather (pass I, and pass L's naive form of it).
- ``fq8_input``: the model's ``quant.fq8(x, block)`` as Dynamo records it (pass H's activation, pass L's expert
  inputs).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.formats import E4M3_MAX
from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm
from minidi.ops.moe_gather import IDX_DTYPES, X_DTYPES

from .fx_utils import arg, const_number, dims_equal, dtype, is_call, is_literal, n_args, rank

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


def only_users(node: Node, allowed: set[Node]) -> bool:
    return all(u in allowed for u in node.users)


def method_call(node, name: str, *literal_args) -> bool:
    """node is ``x.name(*literal_args)`` with these literal arguments after x (dtypes compared by identity)."""
    if not is_call(node, name) or len(node.args) != 1 + len(literal_args):
        return False
    return all(a is b or (not isinstance(a, Node) and a == b) or (isinstance(b, (int, float)) and const_number(a) == b)
               for a, b in zip(node.args[1:], literal_args))


def fq8_input(node: Node) -> tuple[Node, int, set[Node]] | None:
    """node = quant.fq8(x, block) as Dynamo records it -> (x, block, the chain's nodes)."""
    if not (is_call(node, "to") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype)):
        return None
    flat = node.args[0]
    if not (method_call(flat, "flatten", -2) and is_call(flat.args[0], "mul")):
        return None
    q = flat.args[0]
    deq, s = q.args
    if not (method_call(deq, "float") and method_call(deq.args[0], "to", torch.float8_e4m3fn)):
        return None
    clamp = deq.args[0].args[0]
    if not (method_call(clamp, "clamp", -E4M3_MAX, E4M3_MAX) and is_call(clamp.args[0], "truediv")):
        return None
    g, s2 = clamp.args[0].args
    if s2 is not s or not (is_call(g, "unflatten") and len(g.args) == 3 and g.args[1] == -1
                           and isinstance(g.args[2], (tuple, list)) and len(g.args[2]) == 2):
        return None
    block = g.args[2][1]
    if not isinstance(block, int):
        return None
    chain = _pow2_ceil_chain(s, g)
    if chain is None:
        return None
    x = g.args[0]
    if not method_call(x, "float"):
        return None
    nodes = {node, flat, q, deq, deq.args[0], clamp, clamp.args[0], g, x} | chain
    if not all(only_users(n, nodes) for n in nodes - {node}):
        return None
    return x.args[0], block, nodes


def _pow2_ceil_chain(s: Node, g: Node) -> set[Node] | None:
    """s = quant._pow2_ceil(clamp_min(amax(abs(g), -1, keepdim=True), 1e-4) / 448) -> its nodes."""
    if not method_call(s, "view", torch.float32) or not is_call(s.args[0], "lshift"):
        return None
    shl = s.args[0]
    if not is_literal(shl.args[1], 23) or not is_call(shl.args[0], "add"):
        return None
    e, carry = shl.args[0].args
    if not (is_call(e, "and") and is_literal(e.args[1], 0xFF) and is_call(e.args[0], "rshift")
            and is_literal(e.args[0].args[1], 23)):
        return None
    bits = e.args[0].args[0]
    if not (method_call(carry, "to", torch.int32) and is_call(carry.args[0], "ne")
            and is_literal(carry.args[0].args[1], 0)):
        return None
    mant = carry.args[0].args[0]
    if not (is_call(mant, "and") and mant.args[0] is bits and is_literal(mant.args[1], 0x7FFFFF)):
        return None
    if not method_call(bits, "view", torch.int32) or not is_call(bits.args[0], "truediv"):
        return None
    div = bits.args[0]
    if not is_literal(div.args[1], E4M3_MAX) or not method_call(div.args[0], "clamp_min", 1e-4):
        return None
    amax = div.args[0].args[0]
    if not (is_call(amax, "amax") and dims_equal(arg(amax, 1, "dim", None), -1)
            and arg(amax, 2, "keepdim", False) is True and is_call(amax.args[0], "abs") and amax.args[0].args[0] is g):
        return None
    return {s, shl, shl.args[0], e, e.args[0], carry, carry.args[0], mant, bits, div, div.args[0], amax, amax.args[0]}
