"""The mHC site's reads of the streams in one pass (pass J): mixer projection, its mean square and the collapse.

Each mHC site of V4.1 reads the n residual streams x [T, n, D] (bf16) three times in the model's plain code
(``minidi.model.hyper_connections``)::

    z   = x.reshape(T, n D).float()
    g   = z @ fn.float().t()                       # the mixer's projection, fn [M, n D] fp32 (pass F: gate_tf32x3)
    ms  = z.square().mean(-1, keepdim=True)        # its RMS scale: mu = g * rsqrt(ms + eps)
    u   = (pre[..., None] * x.float()).sum(1).to(x.dtype)   # the collapse, with the previous site's pre (V4.1)

``hc_mix_fused(x, fn, pre)`` returns (g, ms, u) from one read of x: a kernel computes per split of D the partial
projection and the partial sum of squares of its D range ([S, T, M] and [S, T] fp32), and writes u for its D range;
the S planes are summed in plain torch, which Inductor fuses into the mixer's sigmoid / Sinkhorn kernel that reads
g and ms anyway. ``pre=None`` (V4's sites, whose collapse weights come from this mixer, and its head): no collapse.

Numerics: the projection as pass F's op: x is exact in bf16 and fn = f0 + f1 + f2 in bf16 pieces (residual <=
2^-24 |fn|), so the three bf16 dots have exact products; each stream's chunk of K goes to a fresh accumulator that
is added to the running sum with an IEEE fp32 add (the promotion of ``gate_tf32x3``, see there: Hopper's MMA
accumulation truncates). The sum of squares and the collapse are fp32 sums in another order than eager's; u is
rounded once to x's dtype, where the model rounds.

Bytes at V4.1-Flash (T 4,096, n 4, D 5,120): x 168 MB read once, u 42 MB written; the fn pieces (2.9 MB, split
once per weight tensor: ``_weight_cache.cached_per_tensor``) are read from L2 by every token block. H200, round 20
(``bench/bench_hc_mix.py``, ``docs/benchmarks/h200_round20/bench_hc_mix.json``): 0.111 ms (L2 flushed) = 1,914 GB/s
(46 % of the copy peak; GPU time 0.103 ms) at the default config, against 0.152 ms before (round 11: 64-bit
pointer tensors per stream, 255 registers and spills, and the pieces split every call by five small torch kernels).

Legend: T tokens, n streams, D width, M mixer outputs ((2 + n) n), S splits of D, BT tokens and BD columns per
program step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import cannot_run, interpreting, resolve_backend, round_bf16, triton_can_run
from ._weight_cache import cached_per_tensor

MAX_OUT = 64  # mixer outputs M at most (V4.1 / V4: 24; V4's head: 4)
SPLITS = 4  # S: splits of D (a function of nothing but this constant: the fake result's shape must not vary)


# ---- reference -----------------------------------------------------------------------------------------------------
def hc_mix_partials_ref(x: torch.Tensor, fn: torch.Tensor, pre: torch.Tensor | None):
    """Plain torch, one split: ([1, T, M] projection, [1, T] sum of squares, u [T, D] or empty)."""
    t, n, d = x.shape
    z = x.reshape(t, n * d).float()
    g = z @ fn.float().t()
    ss = z.square().sum(-1)
    u = x.new_empty(0) if pre is None else (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
    return g.unsqueeze(0), ss.unsqueeze(0), u


# ---- kernel --------------------------------------------------------------------------------------------------------
@triton.jit
def mix_stream_step(xj, pre_ptrs, t_ok, w_ptrs, sw_piece, wm, sq, u, acc, COLLAPSE: tl.constexpr,
                    X_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """One stream's tile xj [BT, BD] (the stream dtype) of a BD step: its squares into sq (summed per element),
    pre_j xj into u (``COLLAPSE``; pre_j read at ``pre_ptrs``), and its projection part xj @ (f2 + f1 + f0)^T of the
    pieces at ``w_ptrs`` (fn^T [BD, MP], pieces ``sw_piece`` apart) in a fresh accumulator added to acc in IEEE fp32.
    -> (sq, u, acc). ``_hc_mix_kernel`` and pass U's kernel both call it: the same arithmetic in the same order."""
    xf = xj.to(tl.float32)
    sq += xf * xf
    if COLLAPSE:
        pj = tl.load(pre_ptrs, mask=t_ok, other=0.0)
        u += pj[:, None] * xf
    w2 = tl.load(w_ptrs + 2 * sw_piece, mask=wm, other=0.0)
    w1 = tl.load(w_ptrs + sw_piece, mask=wm, other=0.0)
    w0 = tl.load(w_ptrs, mask=wm, other=0.0)
    if INTERPRET or not X_BF16:  # fp32 dots: the interpreter's bf16 dot is wrong; an fp32 x is not exact
        part = tl.dot(xf, w2.to(tl.float32), input_precision="ieee")  # in bf16 (test models), IEEE products
        part = tl.dot(xf, w1.to(tl.float32), part, input_precision="ieee")
        part = tl.dot(xf, w0.to(tl.float32), part, input_precision="ieee")
    else:  # small pieces first; the last dot's accumulator is not 0, so ``acc + part`` is not folded
        part = tl.dot(xj, w2)
        part = tl.dot(xj, w1, part)
        part = tl.dot(xj, w0, part)
    return sq, u, acc + part


@triton.jit
def _hc_mix_kernel(x_ptr, w_ptr, pre_ptr, g_ptr, ss_ptr, u_ptr,
                   T, D, M, D_PER_SPLIT, sx_t, sx_j, sw_piece, sw_m, sg_split, sg_t, ss_split, su_t, sp_t,
                   N: tl.constexpr, MP: tl.constexpr, COLLAPSE: tl.constexpr, X_BF16: tl.constexpr,
                   INTERPRET: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Program (token block, split of D): over its D range in BD steps, for each stream j: the squares (summed
    per element, reduced once at the end), u += pre_j x_j, and the projection part x_j @ (f2 + f1 + f0)^T (a fresh
    accumulator per stream chunk, added in IEEE fp32)."""
    t0 = tl.program_id(0) * BT
    rb = tl.arange(0, BT)  # rows of the block: int32 offsets from per-block base pointers (a [BT, BD] tensor of
    t_ok = t0 + rb < T     # 64-bit pointers per stream would hold 2 registers an element; the kernel spilled)
    x_blk = x_ptr + t0.to(tl.int64) * sx_t
    u_blk = u_ptr + t0.to(tl.int64) * su_t
    rd = tl.arange(0, BD)
    rm = tl.arange(0, MP)
    m_ok = rm < M
    x_offs = rb[:, None] * sx_t + rd[None, :]
    w_offs = rm[None, :] * sw_m + rd[:, None]  # fn^T [BD, MP] of a chunk
    d_begin = tl.program_id(1) * D_PER_SPLIT
    d_end = tl.minimum(D, d_begin + D_PER_SPLIT)
    acc = tl.zeros((BT, MP), dtype=tl.float32)
    sq = tl.zeros((BT, BD), dtype=tl.float32)
    for d0 in range(d_begin, d_end, BD):
        d_ok = d0 + rd < d_end
        xm = t_ok[:, None] & d_ok[None, :]
        wm = d_ok[:, None] & m_ok[None, :]
        u = tl.zeros((BT, BD), dtype=tl.float32)
        for j in tl.static_range(N):
            xj = tl.load(x_blk + (j * sx_j + d0) + x_offs, mask=xm, other=0.0)
            sq, u, acc = mix_stream_step(xj, pre_ptr + (t0 + rb).to(tl.int64) * sp_t + j, t_ok,
                                         w_ptr + (j * D + d0) + w_offs, sw_piece, wm, sq, u, acc,
                                         COLLAPSE, X_BF16, INTERPRET)
        if COLLAPSE:
            if X_BF16:
                u = round_bf16(u)  # the interpreter's fp32 -> bf16 cast truncates
            tl.store(u_blk + d0 + (rb[:, None] * su_t + rd[None, :]), u.to(u_ptr.dtype.element_ty), mask=xm)
    split = tl.program_id(1).to(tl.int64)
    rt64 = (t0 + rb).to(tl.int64)
    tl.store(g_ptr + split * sg_split + rt64[:, None] * sg_t + rm[None, :], acc, mask=t_ok[:, None] & m_ok[None, :])
    tl.store(ss_ptr + split * ss_split + rt64, tl.sum(sq, axis=1), mask=t_ok)


# ---- launcher ------------------------------------------------------------------------------------------------------
def default_config(t: int, d: int, x_dtype: torch.dtype = torch.bfloat16) -> dict:
    """bf16 streams: 64-token blocks, 32 columns a step, 4 warps, 3 stages (148 registers, no spills), D split
    SPLITS ways (T 4,096: 256 programs); of the round-20 H200 sweep (``docs/benchmarks/h200_round20/
    bench_hc_mix_sweep.json``, splits 4 / 8 / 16) the fastest at 4 and 8 splits (0.1003 / 0.1015 ms kernel time)
    and 6 % behind the fastest at 16 (0.0974 ms with 2 stages, which measured 0.109 / 0.116 at 4 / 8 splits): the
    steadiest; the round-11 kernel at its 128 x 64 x 8 warps took 0.115 ms there. fp32 streams (test models):
    64 x 32 steps, 2 stages (fp32 tiles of 4 streams fill shared memory sooner)."""
    if x_dtype == torch.float32:
        return dict(BT=64, BD=32, num_warps=4, num_stages=2)
    return dict(BT=64, BD=32, num_warps=4, num_stages=3)


def fn_pieces(fn: torch.Tensor) -> torch.Tensor:
    """fn [M, K] fp32 -> [3, M, K] bf16 with fn = p0 + p1 + p2 up to 2^-24 |fn| (each piece round-to-nearest)."""
    f = fn.float()
    p0 = f.to(torch.bfloat16)
    r = f - p0.float()
    p1 = r.to(torch.bfloat16)
    p2 = (r - p1.float()).to(torch.bfloat16)
    return torch.stack([p0, p1, p2])


def split_plan(fn: torch.Tensor, d: int, bd: int, g: torch.Tensor, ss: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(fn's bf16 pieces, kept per weight tensor; D per split, a multiple of ``bd``; the splits D uses) for partials
    g [S, T, M], ss [S, T] over S = g.shape[0] splits; the splits a narrow D leaves unused are zeroed."""
    pieces = cached_per_tensor("hc_mix fn pieces", fn, fn_pieces)  # fn is a weight: split once, not every call
    splits = g.shape[0]
    d_per = triton.cdiv(triton.cdiv(d, splits), bd) * bd
    used = triton.cdiv(d, d_per)
    if used < splits:  # a narrow D: the splits past it hold zeros
        g[used:].zero_()
        ss[used:].zero_()
    return pieces, d_per, used


def launch(x: torch.Tensor, fn: torch.Tensor, pre: torch.Tensor | None, g: torch.Tensor, ss: torch.Tensor,
           u: torch.Tensor, **config) -> None:
    """Checked tensors, x and fn with a unit stride in D; writes g [S, T, M], ss [S, T] and (pre given) u [T, D],
    D split S ways (S = g.shape[0]: the op's SPLITS; a bench may give other S)."""
    t, n, d = x.shape
    m = fn.shape[0]
    if t == 0:
        return
    cfg = default_config(t, d, x.dtype) | config
    pieces, d_per, used = split_plan(fn, d, cfg["BD"], g, ss)
    grid = (triton.cdiv(t, cfg["BT"]), used)
    collapse = pre is not None
    pre_arg = pre if collapse else ss
    _hc_mix_kernel[grid](
        x, pieces, pre_arg, g, ss, u if collapse else ss,
        t, d, m, d_per, x.stride(0), x.stride(1), pieces.stride(0), pieces.stride(1), g.stride(0), g.stride(1),
        ss.stride(0), u.stride(0) if collapse else 0, pre.stride(0) if collapse else 0,
        N=n, MP=max(16, triton.next_power_of_2(m)), COLLAPSE=collapse, X_BF16=x.dtype == torch.bfloat16,
        INTERPRET=interpreting(), BT=cfg["BT"], BD=cfg["BD"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])


# ---- custom op -----------------------------------------------------------------------------------------------------
def partial_outputs(x: torch.Tensor, fn: torch.Tensor, pre: torch.Tensor | None):
    """The kernel's outputs, empty: g [S, T, M] and ss [S, T] fp32, u [T, D] in x's dtype (empty without pre)."""
    t, _, d = x.shape
    g = x.new_empty((SPLITS, t, fn.shape[0]), dtype=torch.float32)
    ss = x.new_empty((SPLITS, t), dtype=torch.float32)
    u = x.new_empty(0) if pre is None else x.new_empty((t, d))
    return g, ss, u


@torch.library.custom_op("minidi::hc_mix_partials", mutates_args=())
def _hc_mix_op(x: torch.Tensor, fn: torch.Tensor, pre: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not triton_can_run(x, fn, pre):
        raise cannot_run("minidi::hc_mix_partials", x, fn, pre)
    x = x if x.stride(-1) == 1 else x.contiguous()
    pre = None if pre is None else pre.contiguous()
    g, ss, u = partial_outputs(x, fn, pre)
    launch(x, fn, pre, g, ss, u)
    return g, ss, u


@_hc_mix_op.register_fake
def _(x, fn, pre):
    return partial_outputs(x, fn, pre)


X_DTYPES = (torch.bfloat16, torch.float32)  # the streams the kernel reads


def check_args(op: str, x: torch.Tensor, fn: torch.Tensor, pre: torch.Tensor | None) -> None:
    """x [T, n, D] bf16 / fp32, fn [M <= MAX_OUT, n D] fp32, pre [T, n] fp32 or None, on one device; else a
    ValueError naming ``op`` and what is wrong."""
    def fail(what: str) -> None:
        raise ValueError(f"{op}: {what}")

    if x.dim() != 3 or x.dtype not in X_DTYPES:
        fail(f"x must be [T, n, D] bf16 / fp32, got {tuple(x.shape)} {x.dtype}")
    t, n, d = x.shape
    if fn.dim() != 2 or fn.dtype != torch.float32 or fn.shape[1] != n * d or not 0 < fn.shape[0] <= MAX_OUT:
        fail(f"fn must be [M, n*D] = [M <= {MAX_OUT}, {n * d}] float32, got {tuple(fn.shape)} {fn.dtype}")
    if pre is not None and (pre.shape != (t, n) or pre.dtype != torch.float32):
        fail(f"pre must be [T, n] = {(t, n)} float32, got {tuple(pre.shape)} {pre.dtype}")
    devs = {str(a.device) for a in (x, fn, pre) if a is not None}
    if len(devs) != 1:
        fail(f"x, fn and pre must be on one device, got {sorted(devs)}")


def hc_mix_fused(x: torch.Tensor, fn: torch.Tensor, pre: torch.Tensor | None = None, backend: str = "auto"):
    """x [T, n, D] streams, fn [M, n D] fp32, pre [T, n] fp32 or None -> (g [T, M] = z @ fn^T, ms [T, 1] =
    mean(z^2) (both fp32, z = flat(x) in fp32), u [T, D] in x's dtype = sum_j pre_j x_j, or an empty tensor when
    ``pre`` is None), from one read of x.
    ``backend``: "auto" (the kernel where it can run, else the reference), "triton" or "ref" (plain torch)."""
    check_args("hc_mix_fused", x, fn, pre)
    if resolve_backend(backend, "hc_mix_fused", x, fn, pre) == "ref":
        g, ss, u = hc_mix_partials_ref(x, fn, pre)
    else:
        g, ss, u = _hc_mix_op(x, fn, pre)
    return (*sum_splits(g, ss, x.shape[1] * x.shape[2]), u)


def sum_splits(g: torch.Tensor, ss: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's per-split partials g [S, T, M] and ss [S, T] -> (g [T, M], mean square [T, 1] over ``width``
    = n D values): plain torch, which Inductor fuses into the mixer's kernel that reads them."""
    return g.sum(0), ss.sum(0).unsqueeze(-1) / width
