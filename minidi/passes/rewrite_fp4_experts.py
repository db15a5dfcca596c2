"""Pass D: FP4 expert dequant + grouped GEMM (``minidi.model.moe.dequant_expert_stack`` + ``grouped_mm``) ->
``minidi.ops.fp4_grouped_gemm.fp4_grouped_mm``.

Naive subgraph (Dynamo FX; ``dequant_fp4`` inlined), once per weight stack w1, w3, w2 of every MoE layer::

    b    = packed.view(uint8).to(int64)                                   # [E, N, K/2]
    vals = cat([g, -g])[stack([b & 15, b >> 4], dim=-1).flatten(-2)]      # e2m1 codes -> values, [E, N, K]
    b2   = scale.view(uint8).to(int32)
    bits = where(b2 == 255, full_like(b2, NaN bits), where(b2 == 0, full_like(b2, 2^-127 bits), b2 << 23))
    W    = (vals * bits.view(float32).repeat_interleave(32, dim=-1)).to(dtype)   # [E, N, K] dequantised stack
    # bf16: torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)
    # fp32: einsum("rk,enk->ren", x, W).gather(1, <row's expert from bucketize(arange(R), offs.long())>).squeeze(1)

Replacement::

    y = fp4_grouped_mm(x, packed, scale, offs)     # FP4 decoded in the GEMM's load path; no [E, N, K] stack

One match = one GEMM (three per MoE layer). The dequantised stack is erased once its last GEMM is rewritten. The
decode matched is ``minidi.formats.dequant_fp4`` (its grid and edge-code constants are read from there). The MoE's
token -> sorted-row gather feeding x stays in the graph (pass I turns it into a local-rows gather).
Refused: a stack that is not this exact e2m1 x E8M0 decode, another contraction.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from minidi.formats import E2M1_GRID
from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm

from .base import Match, Rewrite
from .fx_utils import arg, dims_equal, dtype, is_call, is_literal, n_args, normalize_einsum, rank, same_int, val
from .patterns import e8m0_decode


def _view_to(node, view_dtype: torch.dtype, to_dtype: torch.dtype) -> Node | None:
    """x.view(view_dtype).to(to_dtype) -> x."""
    if not (is_call(node, "to") and n_args(node) == 2 and node.args[1] == to_dtype):
        return None
    v = node.args[0]
    if not (is_call(v, "view") and n_args(v) == 2 and v.args[1] == view_dtype):
        return None
    return v.args[0]


def _grid(node) -> set[Node] | None:
    """cat([g, -g]) with g the 8 e2m1 magnitudes (literals, or floats Dynamo lifted to graph inputs)."""
    if not (is_call(node, "cat") and len(node.args[0]) == 2 and dims_equal(arg(node, 1, "dim", 0), 0)):
        return None
    g, neg = node.args[0]
    if not (is_call(neg, "neg") and neg.args[0] is g and is_call(g, "tensor") and len(g.args) == 1):
        return None
    values = g.args[0]
    if not isinstance(values, (list, tuple)) or len(values) != len(E2M1_GRID):
        return None
    if any(not isinstance(v, Node) and v != ref for v, ref in zip(values, E2M1_GRID)):
        return None
    if dtype(g) != torch.float32:
        return None
    return {node, neg, g}


def dequant_fp4_stack(w: Node) -> tuple[Node, Node, set[Node]] | None:
    """W = dequant_fp4(packed, scale, dtype) inlined -> (packed, scale, nodes)."""
    if not (is_call(w, "to") and n_args(w) == 2):
        return None
    mul = w.args[0]
    if not (is_call(mul, "mul") and len(mul.args) == 2):
        return None
    vals, s = mul.args
    # vals = grid[stack([b & 15, b >> 4], dim=-1).flatten(-2)]
    if not (is_call(vals, "getitem") and len(vals.args) == 2):
        return None
    grid = _grid(vals.args[0])
    codes = vals.args[1]
    if grid is None or not (is_call(codes, "flatten") and n_args(codes) == 2):
        return None
    if not is_literal(arg(codes, 1, "start_dim"), -2):
        return None
    st = codes.args[0]
    if not (is_call(st, "stack") and n_args(st) == 2 and dims_equal(arg(st, 1, "dim"), -1) and len(st.args[0]) == 2):
        return None
    lo, hi = st.args[0]
    if not (is_call(lo, "and") and is_call(hi, "rshift") and lo.args[0] is hi.args[0]):
        return None
    if not (is_literal(lo.args[1], 15) and is_literal(hi.args[1], 4)):
        return None
    b = lo.args[0]
    packed = _view_to(b, torch.uint8, torch.int64)
    # s = where(b2 == 255, NaN, where(b2 == 0, 2^-127, b2 << 23)).view(float32).repeat_interleave(32, dim=-1)
    if not (is_call(s, "repeat_interleave") and n_args(s) == 3 and is_literal(s.args[1], 32)):
        return None
    if not dims_equal(arg(s, 2, "dim"), -1):
        return None
    decoded = e8m0_decode(s.args[0])
    if decoded is None:
        return None
    scale, scale_nodes = decoded
    if packed is None or scale is None or rank(packed) != 3 or rank(scale) != 3:
        return None
    if dtype(packed) not in (torch.int8, torch.uint8) or dtype(scale) not in (torch.uint8, torch.float8_e8m0fnu):
        return None
    nodes = {w, mul, vals, codes, st, lo, hi, b, b.args[0], s} | scale_nodes | grid
    return packed, scale, nodes


class FP4GroupedMM(Rewrite):
    key = "D"
    name = "fp4_grouped_mm"

    def _gemm(self, node: Node) -> tuple[Node, Node, Node, set[Node]] | None:
        """-> (x, W, offs, nodes) for either grouped GEMM form."""
        if is_call(node, "_grouped_mm"):  # bf16: torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)
            if len(node.args) != 2 or set(node.kwargs) != {"offs"}:
                return None
            x, wt = node.args
            if not (is_call(wt, "transpose") and n_args(wt) == 3 and list(wt.args[1:]) == [-2, -1]):
                return None
            return x, wt.args[0], node.kwargs["offs"], {node, wt}
        # fp32: einsum("rk,enk->ren", x, W).gather(1, expert.view(-1, 1, 1).expand(-1, 1, N)).squeeze(1)
        if not (is_call(node, "squeeze") and n_args(node) == 2 and is_literal(arg(node, 1, "dim"), 1)):
            return None
        ga = node.args[0]
        if not (is_call(ga, "gather") and n_args(ga) == 3 and is_literal(arg(ga, 1, "dim"), 1)):
            return None
        ein, ex = ga.args[0], arg(ga, 2, "index")
        if not (is_call(ein, "einsum") and n_args(ein) == 3 and normalize_einsum(ein.args[0]) == "rk,enk->ren"):
            return None
        x, w = ein.args[1], ein.args[2]
        if not (is_call(ex, "expand") and len(ex.args) == 4 and list(ex.args[1:3]) == [-1, 1]):
            return None
        vw = ex.args[0]
        if not (is_call(vw, "view") and list(vw.args[1:]) == [-1, 1, 1]):
            return None
        cl = vw.args[0]
        if not (is_call(cl, "clamp") and n_args(cl) == 2 and "max" in cl.kwargs):
            return None
        bk = cl.args[0]
        if not (is_call(bk, "bucketize") and len(bk.args) == 2 and bk.kwargs == {"right": True}):
            return None
        ar, lg = bk.args
        if not (is_call(ar, "arange") and len(ar.args) == 1 and same_int(ar.args[0], val(x).shape[0])):
            return None
        if not (is_call(lg, "long") and n_args(lg) == 1):
            return None
        e = val(w).shape[0]
        if not (same_int(cl.kwargs["max"], e - 1) and same_int(ex.args[3], val(w).shape[1])):
            return None
        return x, w, lg.args[0], {node, ga, ein, ex, vw, cl, bk, ar, lg}

    def match(self, node: Node) -> Match | None:
        g = self._gemm(node)
        if g is None:
            return None
        x, w, offs, nodes = g
        d = dequant_fp4_stack(w)
        if d is None:
            return None
        packed, scale, dq_nodes = d
        if w.args[1] != dtype(x) or dtype(x) not in (torch.bfloat16, torch.float32) or rank(x) != 2:
            return None
        if dtype(offs) != torch.int32 or rank(offs) != 1:
            return None
        return Match(anchor=node, nodes=nodes | dq_nodes, target=fp4_grouped_mm, args=(x, packed, scale, offs),
                     kwargs={"backend": self.op_backend}, outputs=[(node, None)])
