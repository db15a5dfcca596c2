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

Two kernels, one arithmetic (``mix_stream_math``), the same bits: ``_hc_mix_kernel`` loads its tiles with pointers
(the CPU interpreter's path, fp32 streams, odd strides); ``_hc_mix_tma_kernel`` has them brought by the tensor-memory
accelerator (sm_90+, bf16, D a multiple of BD: ``tma_ok``), the default on such a GPU.

Bytes at V4.1-Flash (T 4,096, n 4, D 5,120): x 168 MB read once, u 42 MB written; the fn pieces (3.9 MB, padded to
MP rows, split once per weight tensor: ``_weight_cache.cached_per_tensor``) are read from L2 by every token block.
One H100, round 33 (``bench/bench_hc_mix.py``, ``docs/benchmarks/h100_round33/bench_hc_mix.json``): the TMA kernel
0.1094 ms (L2 flushed) = 1,935 GB/s (64 % of the copy peak) against 0.1284 ms for the pointer loads; in the V4.1
step 9.15 against 9.98 ms for 80 calls. Ablations of the pointer kernel (same folder): without its dots 0.142 ms,
without the squares and collapse 0.103 ms, both 0.118: the loads limit it, not the 12 wgmma waits of a step.

Legend: T tokens, n streams, D width, M mixer outputs ((2 + n) n), MP M padded (``mix_width``), S splits of D, BT
tokens and BD columns per program step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, capability, interpreting, resolve_backend, round_bf16, triton_can_run
from ._weight_cache import cached_per_tensor

try:  # host-side TMA descriptors (Triton >= 3.4); without them the pointer kernel runs everywhere
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    _TensorDescriptor = None

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
    """One stream's tile xj [BT, BD] (the stream dtype) of a BD step: pre_j read at ``pre_ptrs`` (``COLLAPSE``) and
    the pieces of fn^T [BD, MP] at ``w_ptrs`` (``sw_piece`` apart), then ``mix_stream_math``. -> (sq, u, acc).
    ``_hc_mix_kernel`` and pass U's kernel both call it: the same arithmetic in the same order."""
    pj = tl.load(pre_ptrs, mask=t_ok, other=0.0) if COLLAPSE else None
    w2 = tl.load(w_ptrs + 2 * sw_piece, mask=wm, other=0.0)
    w1 = tl.load(w_ptrs + sw_piece, mask=wm, other=0.0)
    w0 = tl.load(w_ptrs, mask=wm, other=0.0)
    return mix_stream_math(xj, pj, w2, w1, w0, sq, u, acc, COLLAPSE, X_BF16, INTERPRET)


@triton.jit
def mix_stream_math(xj, pj, w2, w1, w0, sq, u, acc, COLLAPSE: tl.constexpr, X_BF16: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """A stream tile's arithmetic: its squares into sq (summed per element), pj xj into u (``COLLAPSE``; pj [BT]),
    and its projection part xj @ (f2 + f1 + f0)^T of the pieces w2, w1, w0 (fn^T [BD, MP] each) in a fresh
    accumulator added to acc in IEEE fp32. -> (sq, u, acc). Every hc_mix kernel calls it."""
    xf = xj.to(tl.float32)
    sq += xf * xf
    if COLLAPSE:
        u += pj[:, None] * xf
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
def store_collapse(u_blk, u, rb, rd, su_t, d0, mask, X_BF16: tl.constexpr):
    """u [BT, BD] of a BD step, rounded once to u's dtype, at columns d0.. of the block's rows (``u_blk``)."""
    if X_BF16:
        u = round_bf16(u)  # the interpreter's fp32 -> bf16 cast truncates
    tl.store(u_blk + d0 + (rb[:, None] * su_t + rd[None, :]), u.to(u_blk.dtype.element_ty), mask=mask)


@triton.jit
def store_partials(g_ptr, ss_ptr, acc, sq, rows, t_ok, rm, M, sg_split, sg_t, ss_split):
    """A program's partials of its D split (program id 1): the projection acc [BT, MP] (M columns of it) into
    g [S, T, M] and its squares' row sums into ss [S, T]; ``rows`` int64 token ids, ``t_ok`` those below T."""
    split = tl.program_id(1).to(tl.int64)
    tl.store(g_ptr + split * sg_split + rows[:, None] * sg_t + rm[None, :], acc, mask=t_ok[:, None] & (rm < M)[None, :])
    tl.store(ss_ptr + split * ss_split + rows, tl.sum(sq, axis=1), mask=t_ok)


@fast_launch
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
            store_collapse(u_blk, u, rb, rd, su_t, d0, xm, X_BF16)
    store_partials(g_ptr, ss_ptr, acc, sq, (t0 + rb).to(tl.int64), t_ok, rm, M, sg_split, sg_t, ss_split)


@fast_launch
@triton.jit
def _hc_mix_tma_kernel(x_desc, w_desc, pre_ptr, g_ptr, ss_ptr, u_ptr,
                       T, D, M, D_PER_SPLIT, sg_split, sg_t, ss_split, su_t, sp_t,
                       N: tl.constexpr, MP: tl.constexpr, COLLAPSE: tl.constexpr, INTERPRET: tl.constexpr,
                       BT: tl.constexpr, BD: tl.constexpr, STAGES: tl.constexpr):
    """``_hc_mix_kernel`` with its tiles brought by the tensor-memory accelerator (sm_90): x as [T, n D] in [BT, BD]
    boxes at column j D + d0 (D a multiple of BD, so a box never crosses into the next stream; rows past T read as
    0), the padded pieces as [3 MP, n D] in [MP, BD] boxes; the same ``mix_stream_math`` per stream. bf16 only."""
    t0 = tl.program_id(0) * BT
    rb = tl.arange(0, BT)
    t_ok = t0 + rb < T
    u_blk = u_ptr + t0.to(tl.int64) * su_t
    rd = tl.arange(0, BD)
    rm = tl.arange(0, MP)
    d_begin = tl.program_id(1) * D_PER_SPLIT
    d_end = tl.minimum(D, d_begin + D_PER_SPLIT)
    acc = tl.zeros((BT, MP), dtype=tl.float32)
    sq = tl.zeros((BT, BD), dtype=tl.float32)
    for d0 in tl.range(d_begin, d_end, BD, num_stages=STAGES):
        u = tl.zeros((BT, BD), dtype=tl.float32)
        for j in tl.static_range(N):
            xj = x_desc.load([t0, j * D + d0])
            pj = tl.load(pre_ptr + (t0 + rb).to(tl.int64) * sp_t + j, mask=t_ok, other=0.0) if COLLAPSE else None
            w2 = tl.trans(w_desc.load([2 * MP, j * D + d0]))
            w1 = tl.trans(w_desc.load([MP, j * D + d0]))
            w0 = tl.trans(w_desc.load([0, j * D + d0]))
            sq, u, acc = mix_stream_math(xj, pj, w2, w1, w0, sq, u, acc, COLLAPSE, True, INTERPRET)
        if COLLAPSE:
            store_collapse(u_blk, u, rb, rd, su_t, d0, t_ok[:, None] & (d0 + rd < d_end)[None, :], True)
    store_partials(g_ptr, ss_ptr, acc, sq, (t0 + rb).to(tl.int64), t_ok, rm, M, sg_split, sg_t, ss_split)


# ---- launcher ------------------------------------------------------------------------------------------------------
def default_config(t: int, d: int, x_dtype: torch.dtype = torch.bfloat16) -> dict:
    """bf16 streams: 64-token blocks, 32 columns a step, 4 warps, 3 stages, D split SPLITS ways (T 4,096: 256 programs),
    tiles by the tensor-memory accelerator where ``tma_ok`` (``TMA``: None = on a GPU where it can, True = also in the
    interpreter, False = the pointer loads). One H100, round 33 (``docs/benchmarks/h100_round33/
    bench_hc_mix_variants.json``, kernel times): the TMA kernel 0.0962 ms against 0.1175 for the pointer loads at this
    config, same bits; 2, 4 or 5 stages, 8 or 16 splits, BD 64, 8 warps or 128-token blocks were slower with TMA there
    (4 stages: 0.147 ms, one program per SM; in ``bench_hc_mix.json``'s sweep BT 128, BD 64, 8 warps, 2 stages took
    0.1057 ms against the default's 0.1094: within the calls' spread, not adopted). The pointer kernel's config is of
    the round-20 H200 sweep (``docs/benchmarks/h200_round20/bench_hc_mix_sweep.json``, splits 4 / 8 / 16): the fastest
    at 4 and 8 splits (0.1003 / 0.1015 ms) and 6 % behind the fastest at 16, the steadiest. fp32 streams (test models):
    64 x 32 steps, 2 stages (fp32 tiles of 4 streams fill shared memory sooner)."""
    if x_dtype == torch.float32:
        return dict(BT=64, BD=32, num_warps=4, num_stages=2, TMA=False)
    return dict(BT=64, BD=32, num_warps=4, num_stages=3, TMA=None)


def mix_width(m: int) -> int:
    """MP: the mixer outputs M padded to a power of two >= 16 (the dots' N; the pieces' rows)."""
    return max(16, triton.next_power_of_2(m))


def fn_pieces(fn: torch.Tensor) -> torch.Tensor:
    """fn [M, K] fp32 -> [3, MP, K] bf16 with fn = p0 + p1 + p2 up to 2^-24 |fn| (each piece round-to-nearest),
    rows M..MP zero (``mix_width``: whole [MP, BD] boxes for the TMA kernel)."""
    f = fn.float()
    p0 = f.to(torch.bfloat16)
    r = f - p0.float()
    p1 = r.to(torch.bfloat16)
    p2 = (r - p1.float()).to(torch.bfloat16)
    pieces = fn.new_zeros((3, mix_width(fn.shape[0]), fn.shape[1]), dtype=torch.bfloat16)
    pieces[:, : fn.shape[0]] = torch.stack([p0, p1, p2])
    return pieces


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


def tma_ok(x: torch.Tensor, bd: int) -> str | None:
    """None where the TMA kernel can read x [T, n, D] in [BT, bd] boxes of its [T, n D] view, else why not: bf16,
    streams back to back (strides (s, D, 1)), 16-byte aligned base and row stride, D a multiple of bd, and a
    Triton with host tensor descriptors; on CUDA also an sm_90+ device."""
    t, n, d = x.shape
    if _TensorDescriptor is None:
        return "this Triton has no triton.tools.tensor_descriptor"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}, not bfloat16"
    if x.stride(2) != 1 or x.stride(1) != d or (x.stride(0) * 2) % 16 or x.data_ptr() % 16:
        return f"x's strides {tuple(x.stride())} / base are not a 16-byte aligned [T, n D] view"
    if d % bd:
        return f"D {d} is not a multiple of BD {bd}"
    if x.is_cuda and capability(x.device)[0] < 9:
        return "the device has no tensor-memory accelerator (sm_90+)"
    return None


def launch(x: torch.Tensor, fn: torch.Tensor, pre: torch.Tensor | None, g: torch.Tensor, ss: torch.Tensor,
           u: torch.Tensor, **config) -> None:
    """Checked tensors, x and fn with a unit stride in D; writes g [S, T, M], ss [S, T] and (pre given) u [T, D],
    D split S ways (S = g.shape[0]: the op's SPLITS; a bench may give other S). ``TMA=True`` where ``tma_ok``
    refuses raises a ValueError naming why; the default (None) takes it on CUDA where it can."""
    t, n, d = x.shape
    m = fn.shape[0]
    if t == 0:
        return
    cfg = default_config(t, d, x.dtype) | config
    pieces, d_per, used = split_plan(fn, d, cfg["BD"], g, ss)
    grid = (triton.cdiv(t, cfg["BT"]), used)
    collapse = pre is not None
    pre_arg = pre if collapse else ss
    mp = mix_width(m)
    use_tma = cfg["TMA"]
    if use_tma is None:
        use_tma = x.is_cuda and tma_ok(x, cfg["BD"]) is None
    elif use_tma and (why_not := tma_ok(x, cfg["BD"])):
        raise ValueError(f"hc_mix: TMA=True, but {why_not}")
    if use_tma:
        x_desc = _TensorDescriptor.from_tensor(x.as_strided((t, n * d), (x.stride(0), 1)), [cfg["BT"], cfg["BD"]])
        w_desc = _TensorDescriptor.from_tensor(pieces.view(3 * mp, n * d), [mp, cfg["BD"]])
        _hc_mix_tma_kernel[grid](
            x_desc, w_desc, pre_arg, g, ss, u if collapse else ss, t, d, m, d_per, g.stride(0), g.stride(1),
            ss.stride(0), u.stride(0) if collapse else 0, pre.stride(0) if collapse else 0,
            N=n, MP=mp, COLLAPSE=collapse, INTERPRET=interpreting(), BT=cfg["BT"], BD=cfg["BD"],
            STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])
        return
    _hc_mix_kernel[grid](
        x, pieces, pre_arg, g, ss, u if collapse else ss,
        t, d, m, d_per, x.stride(0), x.stride(1), pieces.stride(0), pieces.stride(1), g.stride(0), g.stride(1),
        ss.stride(0), u.stride(0) if collapse else 0, pre.stride(0) if collapse else 0,
        N=n, MP=mp, COLLAPSE=collapse, X_BF16=x.dtype == torch.bfloat16,
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


@dispatch_op("minidi::hc_mix_partials")
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
