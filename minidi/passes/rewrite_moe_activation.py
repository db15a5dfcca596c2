"""Pass H: the MoE expert activation over every dispatched row
(``minidi.model.moe``: ``swiglu_clipped(g, v, L) * ws``, ``.to(dtype)``, ``fq8``) ->
``minidi.ops.moe_activation.moe_activation`` on the rows below offs[-1] only.

Naive subgraph (Dynamo FX), once per MoE layer, between the w1 / w3 grouped GEMMs and the w2 one::

    a = (silu(g.float().clamp(max=L)) * v.float().clamp(-L, L) * ws).to(dtype)
    a = fq8(a, block)                  # with fake quant, inlined: unflatten, abs, amax, clamp_min, / 448,
                                       # the exact power-of-two ceiling by bit ops, / s, clamp, e4m3, * s, flatten
    y = grouped_mm(a, w2, offs)        # the only user of a

Replacement::

    a = moe_activation(g, v, ws, offs, L, block)     # rows past offs[-1] not written: nothing reads them

Taken when g and v come from grouped GEMMs with the same ``offs``, before or after pass D (``torch._grouped_mm`` or
``fp4_grouped_mm``), and every user of ``a`` is such a GEMM with that ``offs``. Those are the conditions under
which the unwritten rows are never read.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.model.quant import E4M3_MAX
from minidi.ops.moe_activation import moe_activation

from .base import Match, Rewrite
from .fx_utils import arg, const_number, dims_equal, dtype, is_call, is_literal, rank
from .patterns import grouped_gemm_offs


def _only_users(node: Node, allowed: set[Node]) -> bool:
    return all(u in allowed for u in node.users)


def _method(node, name: str, *literal_args) -> bool:
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
    if not (_method(flat, "flatten", -2) and is_call(flat.args[0], "mul")):
        return None
    q = flat.args[0]
    deq, s = q.args
    if not (_method(deq, "float") and _method(deq.args[0], "to", torch.float8_e4m3fn)):
        return None
    clamp = deq.args[0].args[0]
    if not (_method(clamp, "clamp", -E4M3_MAX, E4M3_MAX) and is_call(clamp.args[0], "truediv")):
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
    if not _method(x, "float"):
        return None
    nodes = {node, flat, q, deq, deq.args[0], clamp, clamp.args[0], g, x} | chain
    if not all(_only_users(n, nodes) for n in nodes - {node}):
        return None
    return x.args[0], block, nodes


def _pow2_ceil_chain(s: Node, g: Node) -> set[Node] | None:
    """s = quant._pow2_ceil(clamp_min(amax(abs(g), -1, keepdim=True), 1e-4) / 448) -> its nodes."""
    if not _method(s, "view", torch.float32) or not is_call(s.args[0], "lshift"):
        return None
    shl = s.args[0]
    if not is_literal(shl.args[1], 23) or not is_call(shl.args[0], "add"):
        return None
    e, carry = shl.args[0].args
    if not (is_call(e, "and") and is_literal(e.args[1], 0xFF) and is_call(e.args[0], "rshift")
            and is_literal(e.args[0].args[1], 23)):
        return None
    bits = e.args[0].args[0]
    if not (_method(carry, "to", torch.int32) and is_call(carry.args[0], "ne")
            and is_literal(carry.args[0].args[1], 0)):
        return None
    mant = carry.args[0].args[0]
    if not (is_call(mant, "and") and mant.args[0] is bits and is_literal(mant.args[1], 0x7FFFFF)):
        return None
    if not _method(bits, "view", torch.int32) or not is_call(bits.args[0], "truediv"):
        return None
    div = bits.args[0]
    if not is_literal(div.args[1], E4M3_MAX) or not _method(div.args[0], "clamp_min", 1e-4):
        return None
    amax = div.args[0].args[0]
    if not (is_call(amax, "amax") and dims_equal(arg(amax, 1, "dim", None), -1)
            and arg(amax, 2, "keepdim", False) is True and is_call(amax.args[0], "abs") and amax.args[0].args[0] is g):
        return None
    return {s, shl, shl.args[0], e, e.args[0], carry, carry.args[0], mant, bits, div, div.args[0], amax, amax.args[0]}


def swiglu_weighted(node: Node) -> tuple[Node, Node, Node, float, set[Node]] | None:
    """node = (silu(g.float().clamp(max=L)) * v.float().clamp(-L, L) * ws).to(dtype) -> (g, v, ws, L, nodes)."""
    if not (is_call(node, "to") and len(node.args) == 2 and node.args[1] in (torch.bfloat16, torch.float32)):
        return None
    mw = node.args[0]
    if not is_call(mw, "mul") or len(mw.args) != 2:
        return None
    mv, ws = mw.args
    if not is_call(mv, "mul") or len(mv.args) != 2:
        return None
    act, vc = mv.args
    if not (is_call(act, "silu") and len(act.args) == 1 and is_call(act.args[0], "clamp")):
        return None
    gc = act.args[0]
    if len(gc.args) != 1 or set(gc.kwargs) != {"max"} or not _method(gc.args[0], "float"):
        return None
    limit = gc.kwargs["max"]
    if not (isinstance(limit, (int, float)) and _method(vc, "clamp", -limit, limit) and _method(vc.args[0], "float")):
        return None
    if dtype(ws) != torch.float32 or rank(ws) != 2 or rank(gc) != 2:
        return None
    nodes = {node, mw, mv, act, gc, gc.args[0], vc, vc.args[0]}
    if not all(_only_users(n, nodes) for n in nodes - {node}):
        return None
    return gc.args[0].args[0], vc.args[0].args[0], ws, float(limit), nodes


class MoEActivation(Rewrite):
    key = "H"
    name = "moe_activation"

    def match(self, node: Node) -> Match | None:
        fq = fq8_input(node)
        block, end = (fq[1], fq[0]) if fq else (None, node)
        sw = swiglu_weighted(end)
        if sw is None:
            return None
        g, v, ws, limit, nodes = sw
        if fq:
            nodes = nodes | fq[2]
        offs = grouped_gemm_offs(g)
        if offs is None or grouped_gemm_offs(v) is not offs or dtype(g) != end.args[1]:
            return None
        if not node.users or any(grouped_gemm_offs(u) is not offs or u.args[0] is not node for u in node.users):
            return None  # the rows past offs[-1] would be read by something
        return Match(anchor=node, nodes=nodes, target=moe_activation, args=(g, v, ws, offs, limit, block),
                     kwargs={"backend": self.op_backend}, outputs=[(node, None)])
