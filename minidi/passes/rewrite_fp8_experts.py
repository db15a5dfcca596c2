"""Pass L: the routed experts' grouped GEMMs on FP8 tensor cores (``minidi.ops.fp8_experts``), where their input is
an fq8 activation: the GEMM then takes the activation's e4m3 values and scales, not their bf16 product.

Naive subgraphs (Dynamo FX, after passes D, H and I), once each per MoE layer::

    xf = fq8(x, block)                                  # inlined chain (``patterns.fq8_input``)
    xs = gather_rows(xf, idx, offs)                     # pass I's op, or the naive x[idx]
    g  = fp4_grouped_mm(xs, w1, w1_scale, offs)         # every user of xs: a grouped GEMM with this offs
    u  = fp4_grouped_mm(xs, w3, w3_scale, offs)
    ...
    a  = moe_activation(g, u, ws, offs, limit, block)   # pass H's op, with fake quant (block set)
    y  = fp4_grouped_mm(a, w2, w2_scale, offs)          # its only user

Replacements::

    g, u = fp8_experts_up(x, idx, offs, block, [w1, w3], [w1_scale, w3_scale], dtype)
    y    = fp8_experts_down(g, u, ws, offs, limit, block, w2, w2_scale, dtype)

Exact in the issue's sense: ``fq8_split`` and ``moe_activation_fp8`` give q, s with q * s equal to the fq8 values
the naive GEMMs read, so every product is the same; only the fp32 summation order (per 32 along K) differs. The fq8
chain stays where something else reads it. Taken when the fq8 block is a multiple of 32; refused for an activation
that is not fq8 (no fake quant: nothing to take), or rows read by anything but grouped GEMMs with the same offs.
Needs passes D and H (``requires``); I is optional (the naive gather is taken too).
"""

from __future__ import annotations

from torch.fx import Node

from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm
from minidi.ops.fp8_experts import GEMM_BLOCK, fp8_experts_down, fp8_experts_up
from minidi.ops.moe_activation import moe_activation
from minidi.ops.moe_gather import gather_rows

from .base import Match, Rewrite
from .fx_utils import arg, dtype
from .patterns import fq8_input, row_gather


def _fp4_gemm(node) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is fp4_grouped_mm \
        and len(node.args) == 4


def _gemm_users(rows: Node, offs: Node) -> list[Node] | None:
    """Every user of ``rows``: an fp4_grouped_mm reading them as its input with this ``offs`` (else None)."""
    users = list(rows.users)
    if not users or any(not _fp4_gemm(u) or u.args[0] is not rows or u.args[3] is not offs
                        or rows in u.args[1:3] for u in users):
        return None
    return users


def _fq8_block(block) -> bool:
    return isinstance(block, int) and not isinstance(block, bool) and block >= GEMM_BLOCK and block % GEMM_BLOCK == 0


class FP8Experts(Rewrite):
    key = "L"
    name = "fp8_experts"
    requires = ("D", "H")

    def match(self, node: Node) -> Match | None:
        if not _fp4_gemm(node):
            return None
        x = node.args[0]
        if isinstance(x, Node) and x.op == "call_function" and x.target is moe_activation:
            return self._down(node, x)
        return self._up(node, x)

    def _down(self, node: Node, act: Node) -> Match | None:
        g, v, ws, offs, limit, block = (arg(act, i, n) for i, n in enumerate(("g", "v", "ws", "offs", "limit",
                                                                               "block")))
        if not _fq8_block(block) or node.args[3] is not offs or list(act.users) != [node]:
            return None
        return Match(anchor=node, nodes={node, act}, target=fp8_experts_down,
                     args=(g, v, ws, offs, limit, block, node.args[1], node.args[2], dtype(node)),
                     kwargs={"backend": self.op_backend}, outputs=[(node, None)])

    def _up(self, node: Node, xs) -> Match | None:
        if not isinstance(xs, Node):
            return None
        offs = node.args[3]
        if xs.op == "call_function" and xs.target is gather_rows:
            xf, idx, gather_offs = xs.args[:3]
            if gather_offs is not offs:
                return None
        else:
            found = row_gather(xs)
            if found is None:
                return None
            xf, idx = found
        fq = fq8_input(xf)
        if fq is None or not _fq8_block(fq[1]):
            return None
        users = _gemm_users(xs, offs)
        if users is None:
            return None
        users.sort(key=_position(node))
        if node is not users[-1]:
            return None  # one match per gather, anchored at its last GEMM
        x, block, chain = fq
        return Match(anchor=node, nodes={xs, *users} | chain, target=fp8_experts_up,
                     args=(x, idx, offs, block, [u.args[1] for u in users], [u.args[2] for u in users],
                           dtype(node)),
                     kwargs={"backend": self.op_backend}, outputs=[(u, i) for i, u in enumerate(users)])


def _position(node: Node):
    """Key: a node's position in ``node``'s graph."""
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    return index.__getitem__
