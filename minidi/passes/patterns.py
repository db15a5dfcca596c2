"""Matchers shared by several rewrites: sub-patterns that more than one pass must recognise.

A rewrite file holds its own pass; what two passes both need lives here, so that no rewrite imports another one and
the passes stay one row of peers (``fx_utils`` < ``patterns`` < ``rewrite_*`` < ``manager``).

- ``fp32_gemm``: ``x.float() @ w.float().t()``, the router GEMM (pass E) and the mHC projections (pass F);
  ``feeds_softplus`` tells them apart.
- ``grouped_gemm_offs``: ``offs`` of a grouped GEMM in either form, ``torch._grouped_mm`` or pass D's
  ``fp4_grouped_mm`` (passes H and I, which run after D).
- ``row_gather``: ``x[idx]``, the MoE dispatch gather (pass I, and pass L's naive form of it).
- ``fq8_input``: the model's ``quant.fq8(x, block)`` as Dynamo records it (pass H's activation, pass L's expert
  inputs, pass N's linear inputs); ``fq4_ue8m0_input``: ``formats.fq4_ue8m0(x, block)`` (pass V's fused fq4), the
  same power-of-two scale chain with the e2m1 constants.
- ``topk_set_call``: ``minidi.selection.topk_set`` inlined (pass B's top-k, and inside pass P's
  ``topk_lowest_index``).
- ``fp8_weight_dequant``: the model's ``formats.dequant_fp8(weight, scale, block, dtype)`` (pass N's weights), and
  ``e8m0_decode``: ``formats.e8m0_to_float(scale)`` inside it and inside pass D's FP4 decode.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from minidi.formats import E2M1_MAX, E4M3_MAX, E8M0_MIN_BITS, E8M0_NAN_BITS, FQ8_AMAX_FLOOR
from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm
from minidi.ops.moe_gather import IDX_DTYPES, X_DTYPES

from .fx_utils import arg, const_number, dims_equal, dtype, is_call, is_literal, n_args, rank, val

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


def mean_square(z: Node) -> tuple[Node, set[Node]] | None:
    """z.square().mean(-1, keepdim=True) among z's users (the sum of squares of an RMS scale) -> (the mean node, its
    nodes); the mean over z's last dim, given as -1 or its index."""
    for sq in z.users:
        if not (is_call(sq, "square") and n_args(sq) == 1 and len(sq.users) == 1):
            continue
        mean = next(iter(sq.users))
        if not is_call(mean, "mean") or arg(mean, 0) is not sq or rank(z) is None:
            continue
        if dims_equal(arg(mean, 1, "dim", None), -1, rank(z) - 1) and arg(mean, 2, "keepdim", False) is True:
            return mean, {sq, mean}
    return None


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
    blocks = _float_blocks(g, s2, s, FQ8_AMAX_FLOOR, E4M3_MAX)
    if blocks is None:
        return None
    x, block, chain = blocks
    nodes = {node, flat, q, deq, deq.args[0], clamp, clamp.args[0]} | chain
    if not all(only_users(n, nodes) for n in nodes - {node}):
        return None
    return x, block, nodes


def _float_blocks(g: Node, s2: Node, s: Node, floor: float, fmax: float) -> tuple[Node, int, set[Node]] | None:
    """The common head of the fake quants: g = x.float().unflatten(-1, (n / block, block)) divided by s (s2 is s),
    s the power-of-two scale of g's blocks (``_pow2_ceil_chain``) -> (x, block, the nodes of g and s)."""
    if s2 is not s or not (is_call(g, "unflatten") and len(g.args) == 3 and g.args[1] == -1
                           and isinstance(g.args[2], (tuple, list)) and len(g.args[2]) == 2):
        return None
    block, xf = g.args[2][1], g.args[0]
    chain = _pow2_ceil_chain(s, g, floor, fmax)
    if not isinstance(block, int) or chain is None or not method_call(xf, "float"):
        return None
    return xf.args[0], block, {g, xf} | chain


FQ4_AMAX_FLOOR = E2M1_MAX * 2.0**-126  # formats.fq4_ue8m0's clamp_min


def fq4_ue8m0_input(node: Node) -> tuple[Node, int, set[Node]] | None:
    """node = formats.fq4_ue8m0(x, block) as Dynamo records it -> (x, block, the chain's nodes)::

        g = x.float().unflatten(-1, (n / block, block)); s = pow2_ceil(clamp_min(amax(|g|), 6 * 2^-126) / 6)
        y = (g / s).clamp(-6, 6); a = y.abs()
        r = where(a < 2, round(a * 2) * 0.5, where(a < 4, round(a), round(a * 0.5) * 2))   # round_e2m1
        node = (copysign(r, y) * s).flatten(-2).to(dtype)
    Every intermediate is read by the chain only."""
    if not (is_call(node, "to") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs):
        return None
    flat = node.args[0]
    if not (method_call(flat, "flatten", -2) and is_call(flat.args[0], "mul") and len(flat.args[0].args) == 2):
        return None
    mul = flat.args[0]
    cs, s = mul.args
    if not (is_call(cs, "copysign") and len(cs.args) == 2 and not cs.kwargs):
        return None
    r, y = cs.args
    if not (method_call(y, "clamp", -E2M1_MAX, E2M1_MAX) and is_call(y.args[0], "truediv")
            and len(y.args[0].args) == 2):
        return None
    blocks = _float_blocks(*y.args[0].args, s, FQ4_AMAX_FLOOR, E2M1_MAX)
    rounding = _round_e2m1_chain(r, y)
    if blocks is None or rounding is None:
        return None
    x, block, chain = blocks
    nodes = {node, flat, mul, cs, y, y.args[0]} | rounding | chain
    if not all(only_users(n, nodes) for n in nodes - {node}):
        return None
    return x, block, nodes


def _less(node, c: float) -> bool:
    return is_call(node, "lt") and len(node.args) == 2 and not node.kwargs and is_literal(node.args[1], c)


def _scaled_round(node, a: Node, inside: float, outside: float) -> set[Node] | None:
    """node = round(a * inside) * outside -> its three nodes."""
    if not (is_call(node, "mul") and len(node.args) == 2 and is_literal(node.args[1], outside)):
        return None
    rnd = node.args[0]
    if not (is_call(rnd, "round") and len(rnd.args) == 1 and not rnd.kwargs):
        return None
    prod = rnd.args[0]
    if not (is_call(prod, "mul") and len(prod.args) == 2 and prod.args[0] is a and is_literal(prod.args[1], inside)):
        return None
    return {node, rnd, prod}


def _round_e2m1_chain(r: Node, y: Node) -> set[Node] | None:
    """r = formats.round_e2m1's magnitude of y (before its copysign) -> its nodes."""
    if not (is_call(r, "where") and len(r.args) == 3):
        return None
    lt2, half, inner = r.args
    a = lt2.args[0] if _less(lt2, 2.0) else None
    if not (method_call(a, "abs") and a.args[0] is y and is_call(inner, "where") and len(inner.args) == 3):
        return None
    lt4, mid, big = inner.args
    if not (_less(lt4, 4.0) and lt4.args[0] is a and is_call(mid, "round") and mid.args == (a,) and not mid.kwargs):
        return None
    fine, coarse = _scaled_round(half, a, 2.0, 0.5), _scaled_round(big, a, 0.5, 2.0)
    if fine is None or coarse is None:
        return None
    return {r, lt2, a, inner, lt4, mid} | fine | coarse


def _pow2_ceil_chain(s: Node, g: Node, floor: float, fmax: float) -> set[Node] | None:
    """s = formats.pow2_ceil(clamp_min(amax(abs(g), -1, keepdim=True), floor) / fmax) -> its nodes (fq8: 1e-4 and
    448, fq4_ue8m0: 6 * 2^-126 and 6)."""
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
    if not is_literal(div.args[1], fmax) or not method_call(div.args[0], "clamp_min", floor):
        return None
    amax = div.args[0].args[0]
    if not (is_call(amax, "amax") and dims_equal(arg(amax, 1, "dim", None), -1)
            and arg(amax, 2, "keepdim", False) is True and is_call(amax.args[0], "abs") and amax.args[0].args[0] is g):
        return None
    return {s, shl, shl.args[0], e, e.args[0], carry, carry.args[0], mant, bits, div, div.args[0], amax, amax.args[0]}


def fp8_weight_dequant(node: Node) -> tuple[Node, Node, int, set[Node]] | None:
    """node = formats.dequant_fp8(weight, scale, block, dtype) as Dynamo records it -> (weight, scale, block, the
    chain's nodes)::

        (weight.float() * expand_tiles(e8m0_to_float(scale), out, inp, block, block)).to(dtype)

    weight a 2-D float8_e4m3fn tensor, scale its E8M0 tiles [ceil(out / block), ceil(inp / block)]."""
    if not (is_call(node, "to") and len(node.args) == 2 and isinstance(node.args[1], torch.dtype)):
        return None
    prod = node.args[0]
    if not (is_call(prod, "mul") and len(prod.args) == 2 and method_call(prod.args[0], "float")):
        return None
    wf, tiles = prod.args
    weight = wf.args[0]
    if rank(weight) != 2 or dtype(weight) != torch.float8_e4m3fn:
        return None
    found = _expanded_tiles(tiles, tuple(val(weight).shape))
    if found is None:
        return None
    s, block, expand = found
    decode = e8m0_decode(s)
    if decode is None:
        return None
    scale, chain = decode
    n, k = val(weight).shape
    if tuple(val(scale).shape) != (-(-n // block), -(-k // block)):
        return None
    nodes = {node, prod, wf} | expand | chain
    if not all(only_users(m, nodes) for m in nodes - {node}):
        return None
    return weight, scale, block, nodes


def _expanded_tiles(node: Node, shape: tuple[int, int]) -> tuple[Node, int, set[Node]] | None:
    """node = formats.expand_tiles(s, out, inp, block, block) with block > 1 for a weight of ``shape`` -> (s, block,
    nodes): ``s.repeat_interleave(block, dim=0)[:out].repeat_interleave(block, dim=1)[:, :inp]``."""
    out, inp = shape
    cols = node
    if not (is_call(cols, "getitem") and isinstance(cols.args[1], tuple) and len(cols.args[1]) == 2
            and cols.args[1][0] == slice(None) and cols.args[1][1] == slice(None, inp)):
        return None
    rep1 = cols.args[0]
    rows = rep1.args[0] if is_call(rep1, "repeat_interleave") else None
    if not (is_call(rows, "getitem") and rows.args[1] == slice(None, out)):
        return None
    rep0 = rows.args[0]
    if not is_call(rep0, "repeat_interleave"):
        return None
    block = arg(rep0, 1, "repeats", None)
    if not (isinstance(block, int) and block > 1 and arg(rep1, 1, "repeats", None) == block
            and dims_equal(arg(rep0, 2, "dim", None), 0) and dims_equal(arg(rep1, 2, "dim", None), 1)):
        return None
    return rep0.args[0], block, {cols, rep1, rows, rep0}


def e8m0_decode(s: Node) -> tuple[Node, set[Node]] | None:
    """s = formats.e8m0_to_float(scale) -> (scale, nodes)::

        b = scale.view(uint8).to(int32)
        bits = where(b == 255, full_like(b, NAN_BITS), where(b == 0, full_like(b, MIN_BITS), b << 23))
        s = bits.view(float32)"""
    if not (method_call(s, "view", torch.float32) and is_call(s.args[0], "where") and len(s.args[0].args) == 3):
        return None
    outer = s.args[0]
    is_nan, nan_bits, inner = outer.args
    if not (is_call(inner, "where") and len(inner.args) == 3):
        return None
    is_zero, min_bits, shifted = inner.args
    b = shifted.args[0] if is_call(shifted, "lshift") and is_literal(shifted.args[1], 23) else None
    if not (method_call(b, "to", torch.int32) and method_call(b.args[0], "view", torch.uint8)):
        return None
    for test, fill, code, bits in ((is_nan, nan_bits, 255, E8M0_NAN_BITS), (is_zero, min_bits, 0, E8M0_MIN_BITS)):
        if not (is_call(test, "eq") and test.args[0] is b and is_literal(test.args[1], code)
                and is_call(fill, "full_like") and fill.args[0] is b and is_literal(fill.args[1], bits)):
            return None
    return b.args[0].args[0], {s, outer, is_nan, nan_bits, inner, is_zero, min_bits, shifted, b, b.args[0]}


_INT32_MIN = torch.iinfo(torch.int32).min


def sorted_along_last(node) -> Node | None:
    """node = x.sort(dim=-1)[0] (ascending, the sort used nowhere else) -> the sort node."""
    if not (is_call(node, "getitem") and node.args[1] == 0 and is_call(node.args[0], "sort")):
        return None
    srt = node.args[0]
    if not (n_args(srt) == 2 and dims_equal(arg(srt, 1, "dim"), -1, 1)) or len(srt.users) != 1:
        return None
    return srt


def _topk_of(node, x: Node, index: int) -> Node | None:
    """node = x.topk(K, dim=-1)[index] -> K."""
    if not (is_call(node, "getitem") and node.args[1] == index and is_call(node.args[0], "topk")):
        return None
    tk = node.args[0]
    if tk.args[0] is not x or not (n_args(tk) == 3 and dims_equal(arg(tk, 2, "dim"), -1, 1)) or len(tk.users) != 1:
        return None
    return arg(tk, 1, "k")


def topk_set_call(node, s: Node) -> tuple[object, object, set[Node]] | None:
    """node = ``minidi.selection.topk_set(s, K)`` as Dynamo inlines it -> (K, N of the arange, its nodes)::

        key  = s.masked_fill(s.isnan(), inf)
        thr  = pad(key.topk(K, dim=-1)[0], (0, 1), value=inf).amin(dim=-1, keepdim=True)
        rank = where(key > thr, 1, where(key == thr, -arange(N, dtype=int32), INT32_MIN))
        node = rank.topk(K, dim=-1)[1].sort(dim=-1)[0]
    """
    srt = sorted_along_last(node)
    if srt is None or not (is_call(srt.args[0], "getitem") and is_call(srt.args[0].args[0], "topk")):
        return None
    ti = srt.args[0]
    rank_ = ti.args[0].args[0]
    kk = _topk_of(ti, rank_, 1)
    # rank = where(key > thr, 1, where(key == thr, -j, INT32_MIN))
    if kk is None or not (is_call(rank_, "where") and len(rank_.args) == 3 and is_literal(rank_.args[1], 1)):
        return None
    gt, inner = rank_.args[0], rank_.args[2]
    if not (is_call(inner, "where") and len(inner.args) == 3 and is_literal(inner.args[2], _INT32_MIN)):
        return None
    eq, neg = inner.args[0], inner.args[1]
    if not (is_call(gt, "gt") and is_call(eq, "eq") and is_call(neg, "neg") and len(neg.args) == 1):
        return None
    key, thr = gt.args
    if list(eq.args) != [key, thr]:
        return None
    j = neg.args[0]
    if not (is_call(j, "arange") and len(j.args) == 1 and j.kwargs.get("dtype") == torch.int32):
        return None
    # key = s.masked_fill(s.isnan(), inf)
    if not (is_call(key, "masked_fill") and n_args(key) == 3 and key.args[0] is s):
        return None
    nan = arg(key, 1, "mask")
    if not (is_literal(arg(key, 2, "value"), math.inf) and is_call(nan, "isnan") and nan.args[0] is s):
        return None
    # thr = pad(key.topk(K, dim=-1)[0], (0, 1), value=inf).amin(dim=-1, keepdim=True)
    if not (is_call(thr, "amin") and dims_equal(arg(thr, 1, "dim"), -1, 1) and arg(thr, 2, "keepdim") is True):
        return None
    pad = thr.args[0]
    if not (is_call(pad, "pad") and isinstance(arg(pad, 1, "pad"), (tuple, list)) and tuple(pad.args[1]) == (0, 1)):
        return None
    if not (arg(pad, 2, "mode", "constant") == "constant" and is_literal(arg(pad, 3, "value"), math.inf)):
        return None
    tv = pad.args[0]
    k2 = _topk_of(tv, key, 0)
    if not (k2 is kk or (isinstance(kk, int) and k2 == kk)):
        return None
    nodes = {node, srt, ti, ti.args[0], rank_, gt, inner, eq, neg, j, key, nan, thr, pad, tv, tv.args[0]}
    return kk, j.args[0], nodes


def picks_of(node) -> tuple[Node, object, object, set[Node]] | None:
    """node = the indexer's ``_pick(s, K)`` (``minidi.model.indexer``) as Dynamo inlines it -> (s, K, N of the
    arange, its nodes)::

        idx0 = topk_set(s, K)                                                  # see ``topk_set_call``
        idx1 = where(s.gather(1, idx0) > -inf, idx0, AFTER).sort(dim=-1)[0]    # AFTER: a sentinel past every column
        node = idx1.masked_fill(idx1 == AFTER, -1)                             # -inf picks last, as -1
    """
    if not (is_call(node, "masked_fill") and n_args(node) == 3 and is_literal(arg(node, 2, "value"), -1)):
        return None
    idx1, eq = node.args[0], arg(node, 1, "mask")
    if not (is_call(eq, "eq") and len(eq.args) == 2 and eq.args[0] is idx1 and isinstance(eq.args[1], int)):
        return None
    after = eq.args[1]
    if after < 2**31:
        return None
    srt = sorted_along_last(idx1)
    if srt is None or not (is_call(srt.args[0], "where") and len(srt.args[0].args) == 3):
        return None
    sel = srt.args[0]
    gt, idx0 = sel.args[0], sel.args[1]
    if not (is_literal(sel.args[2], after) and is_call(gt, "gt") and is_literal(gt.args[1], -math.inf)):
        return None
    ga = gt.args[0]
    if not (is_call(ga, "gather") and n_args(ga) == 3 and dims_equal(arg(ga, 1, "dim"), 1, -1)):
        return None
    if arg(ga, 2, "index") is not idx0:
        return None
    scores = ga.args[0]
    chosen = topk_set_call(idx0, scores)
    if chosen is None:
        return None
    kk, n_cols, set_nodes = chosen
    return scores, kk, n_cols, {node, eq, idx1, srt, sel, gt, ga} | set_nodes


def picks_width(kk) -> int | None:
    """The K of ``picks_of`` / ``topk_set_call`` where the model wrote ``min(K, N)``: a literal (static N), or
    ``sym_min(K, N)`` (symbolic N) -> K; None otherwise. The sym_min node is never part of a match's nodes: Dynamo
    may share one between layers."""
    if isinstance(kk, Node):
        if is_call(kk, "sym_min") and len(kk.args) == 2 and isinstance(kk.args[0], int):
            return kk.args[0]
        return None
    return kk if isinstance(kk, int) else None
