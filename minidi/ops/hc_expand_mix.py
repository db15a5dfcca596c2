"""The mHC stream update and the next site's reads of its result in one pass (pass U): ``hc_expand`` + ``hc_mix``.

In a V4.1 layer the attention site's update writes the streams the MoE site's mixer then reads back whole
(``minidi.model.model.Block.core``)::

    x2       = hc_expand(x, h, post, comb)          # pass G: x2_k = post_k h + sum_j comb[j, k] x_j, one rounding
    g, ms, u = hc_mix_fused(x2, fn, pre)            # pass J: the mixer's projection, its mean square, the collapse
                                                    # with the attention site's pre (V4: pre None, no collapse)

``hc_expand_mix(x, h, post, comb, fn, pre)`` returns (x2, g, ms, u) from one read of x and h: a program computes its
tile of x2 in registers, stores it, and feeds the stored (rounded) values to the mixer's sums, so x2 is not read
back (at V4.1-Flash, T 4,096: 168 MB a layer). Per tile the work is exactly the two kernels': x2 as
``_hc_expand_kernel`` computes it (fp32 products and sums in stream order, post * h added last, one rounding to the
stream dtype); g / ms / u as ``_hc_mix_kernel`` computes them from x2, with its token blocks, D splits and BD steps,
so its partial sums run in the same order. On the interpreter the results are bit for bit the two ops' (the tests
check it); on the GPU the same, unless the compiler contracts a multiply-add differently (fp32 last bit, before the
one rounding).

Bytes at V4.1-Flash (T 4,096, n 4, D 5,120): x 168 MB and h 42 MB read, x2 168 MB and u 42 MB written (420 MB),
against 588 MB for the two kernels (hc_expand 378, hc_mix 210).

Legend: T tokens, n streams, D width, M mixer outputs, S splits of D, BT tokens and BD columns per program step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import hc_expand as _expand
from . import hc_mix as _mix
from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, interpreting, resolve_backend, round_bf16, triton_can_run
from .hc_mix import mix_stream_step, store_collapse, store_partials


# ---- reference -----------------------------------------------------------------------------------------------------
def hc_expand_mix_ref(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                      pre: torch.Tensor | None):
    """The two ops' references in turn: (x2, [1, T, M] projection, [1, T] sum of squares, u or empty)."""
    x2 = _expand.hc_expand_ref(x, h, post, comb)
    return (x2, *_mix.hc_mix_partials_ref(x2, fn, pre))


# ---- kernel --------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _hc_expand_mix_kernel(x_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, w_ptr, pre_ptr, g_ptr, ss_ptr, u_ptr,
                          T, D, M, D_PER_SPLIT, sx_t, sx_j, sh_t, sp_t, sc_t, so_t, so_j, sw_piece, sw_m, sg_split,
                          sg_t, ss_split, su_t, spre_t,
                          N: tl.constexpr, MP: tl.constexpr, COLLAPSE: tl.constexpr, X_BF16: tl.constexpr,
                          ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Program (token block, split of D), over its D range in BD steps: for each output stream k, x2_k = post_k h +
    sum_j comb[j, k] x_j (``_hc_expand_kernel``'s arithmetic), stored; then on the stored values the step
    ``_hc_mix_kernel`` takes for stream k, ``mix_stream_step`` itself (squares, u += pre_k x2_k, the projection
    part)."""
    t0 = tl.program_id(0) * BT
    rb = tl.arange(0, BT)
    t_ok = t0 + rb < T
    rows = (t0 + rb).to(tl.int64)
    x_blk = x_ptr + t0.to(tl.int64) * sx_t
    h_blk = h_ptr + t0.to(tl.int64) * sh_t
    o_blk = out_ptr + t0.to(tl.int64) * so_t
    u_blk = u_ptr + t0.to(tl.int64) * su_t
    rd = tl.arange(0, BD)
    rm = tl.arange(0, MP)
    m_ok = rm < M
    x_offs = rb[:, None] * sx_t + rd[None, :]
    h_offs = rb[:, None] * sh_t + rd[None, :]
    o_offs = rb[:, None] * so_t + rd[None, :]
    w_offs = rm[None, :] * sw_m + rd[:, None]  # fn^T [BD, MP] of a chunk
    d_begin = tl.program_id(1) * D_PER_SPLIT
    d_end = tl.minimum(D, d_begin + D_PER_SPLIT)
    acc = tl.zeros((BT, MP), dtype=tl.float32)
    sq = tl.zeros((BT, BD), dtype=tl.float32)
    for d0 in range(d_begin, d_end, BD):
        d_ok = d0 + rd < d_end
        xm = t_ok[:, None] & d_ok[None, :]
        wm = d_ok[:, None] & m_ok[None, :]
        hf = tl.load(h_blk + d0 + h_offs, mask=xm, other=0.0).to(tl.float32)
        xs = ()  # the n stream tiles, each read once
        for j in tl.static_range(N):
            xs = xs + (tl.load(x_blk + (j * sx_j + d0) + x_offs, mask=xm, other=0.0),)
        u = tl.zeros((BT, BD), dtype=tl.float32)
        for k in tl.static_range(N):
            mixed = tl.zeros((BT, BD), dtype=tl.float32)
            for j in tl.static_range(N):  # in order j = 0..n-1
                c = tl.load(comb_ptr + rows * sc_t + (j * N + k), mask=t_ok, other=0.0)
                mixed = mixed + c[:, None] * xs[j].to(tl.float32)
            pk = tl.load(post_ptr + rows * sp_t + k, mask=t_ok, other=0.0)
            xk = pk[:, None] * hf + mixed
            if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest
                xk = round_bf16(xk)
            xk = xk.to(out_ptr.dtype.element_ty)  # x2_k as stored: the mixer reads these values
            tl.store(o_blk + (k * so_j + d0) + o_offs, xk, mask=xm)
            sq, u, acc = mix_stream_step(xk, pre_ptr + rows * spre_t + k, t_ok, w_ptr + (k * D + d0) + w_offs,
                                         sw_piece, wm, sq, u, acc, COLLAPSE, X_BF16, INTERPRET)
        if COLLAPSE:
            store_collapse(u_blk, u, rb, rd, su_t, d0, xm, X_BF16)
    store_partials(g_ptr, ss_ptr, acc, sq, rows, t_ok, rm, M, sg_split, sg_t, ss_split)


# ---- launcher ------------------------------------------------------------------------------------------------------
def default_config(t: int, d: int, x_dtype: torch.dtype = torch.bfloat16) -> dict:
    """``hc_mix``'s tiles and D splits (so the partial sums run in its order); bf16 streams with 8 warps and 3
    stages: with 4 warps ptxas spills (sm_90, Triton 3.6: 255 registers and 280 bytes of stack at 4 warps, 255 and
    none at 8)."""
    cfg = _mix.default_config(t, d, x_dtype)
    return cfg | dict(num_warps=8, num_stages=3) if x_dtype == torch.bfloat16 else cfg


def launch(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
           pre: torch.Tensor | None, out: torch.Tensor, g: torch.Tensor, ss: torch.Tensor, u: torch.Tensor,
           **config) -> None:
    """Checked tensors with a unit stride in D (x, h, out; fn); writes out [T, n, D], g [S, T, M], ss [S, T] and
    (pre given) u [T, D], D split S = g.shape[0] ways; ``config`` overrides tiles, warps and stages (the same
    tiles give the same sums as ``hc_mix``; the default: ``default_config``)."""
    t, n, d = x.shape
    m = fn.shape[0]
    if t == 0:
        return
    cfg = default_config(t, d, x.dtype) | config
    pieces, d_per, used = _mix.split_plan(fn, d, cfg["BD"], g, ss)  # hc_mix's pieces entry for this weight
    collapse = pre is not None
    _hc_expand_mix_kernel[(triton.cdiv(t, cfg["BT"]), used)](
        x, h, post, comb, out, pieces, pre if collapse else ss, g, ss, u if collapse else ss,
        t, d, m, d_per, x.stride(0), x.stride(1), h.stride(0), post.stride(0), comb.stride(0), out.stride(0),
        out.stride(1), pieces.stride(0), pieces.stride(1), g.stride(0), g.stride(1), ss.stride(0),
        u.stride(0) if collapse else 0, pre.stride(0) if collapse else 0,
        N=n, MP=_mix.mix_width(m), COLLAPSE=collapse, X_BF16=x.dtype == torch.bfloat16,
        ROUND_BF16=interpreting() and x.dtype == torch.bfloat16, INTERPRET=interpreting(), BT=cfg["BT"],
        BD=cfg["BD"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


# ---- custom op -----------------------------------------------------------------------------------------------------
def _outputs(x: torch.Tensor, fn: torch.Tensor, pre: torch.Tensor | None):
    g, ss, u = _mix.partial_outputs(x, fn, pre)
    return torch.empty_like(x, memory_format=torch.contiguous_format), g, ss, u


@dispatch_op("minidi::hc_expand_mix")
def _hc_expand_mix_op(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                      pre: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not triton_can_run(x, h, post, comb, fn, pre):
        raise cannot_run("minidi::hc_expand_mix", x, h, post, comb, fn, pre)
    x, h, post, comb = x.contiguous(), h.contiguous(), post.contiguous(), comb.contiguous()
    pre = None if pre is None else pre.contiguous()
    out, g, ss, u = _outputs(x, fn, pre)
    launch(x, h, post, comb, fn, pre, out, g, ss, u)
    return out, g, ss, u


@_hc_expand_mix_op.register_fake
def _(x, h, post, comb, fn, pre):
    return _outputs(x, fn, pre)


def hc_expand_mix(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                  pre: torch.Tensor | None = None, backend: str = "auto"):
    """``hc_expand(x, h, post, comb)`` and ``hc_mix_fused`` of its result in one pass: x [T, n, D] streams (bf16 /
    fp32), h [T, D] float, post [T, n] and comb [T, n, n] fp32, fn [M, n D] fp32, pre [T, n] fp32 or None ->
    (x2 [T, n, D] in x's dtype, g [T, M], ms [T, 1], u [T, D] in x's dtype or an empty tensor), each as the two ops
    return it. ``backend``: "auto" (the kernel where it can run, else the reference), "triton" or "ref"."""
    _mix.check_args("hc_expand_mix", x, fn, pre)  # x bf16 / fp32 (the mixer's dtypes), fn, pre, one device
    _expand.check_args("hc_expand_mix", x, h, post, comb)
    if resolve_backend(backend, "hc_expand_mix", x, h, post, comb, fn, pre) == "ref":
        x2, g, ss, u = hc_expand_mix_ref(x, h, post, comb, fn, pre)
    else:
        x2, g, ss, u = _hc_expand_mix_op(x, h, post, comb, fn, pre)
    return (x2, *_mix.sum_splits(g, ss, x.shape[1] * x.shape[2]), u)
