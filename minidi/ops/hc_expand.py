"""The mHC stream update in one memory-bound kernel (pass G): x'_k = post_k * h + sum_j comb[j, k] * x_j.

The model writes it as (``minidi.model.hyper_connections.hc_expand``)::

    mixed = einsum("tjk,tjd->tkd", comb, x.float())              # fp32
    x'    = (post[..., None] * h.float()[:, None] + mixed).to(x.dtype)

Under Inductor (with pass G's broadcast sum, ``hc_streams.hc_stream_mix``) this is one pointwise kernel over the
T n D outputs that, for every output element, loads n comb coefficients, the mixer's projection row, scale and bias
and recomputes post's sigmoid: at V4.1-Flash (T 4,096, n 4, D 5,120, bf16 streams) 0.19-0.22 ms a call, 41-50 % of
the copy bandwidth on the 378 MB it must move (x and x' in bf16, h; H200 profile of round 12, 80 calls a step,
``docs/benchmarks/h200_round12/v41_ep4_passes_16a231e.jsonl``).
Here one program owns BT tokens x BD columns: it reads each token's n x n comb and n post once, each stream tile
once, and writes the n output tiles. H200, V4.1-Flash shapes (``bench/bench_hc_expand.py``,
``docs/benchmarks/h200_round12/bench_hc_expand.json``): 0.0989 ms at the default tile, 3,820 GB/s = 92.1 % of the
copy peak measured in the same run.

Numerics: the model's rounding points: products and sums in fp32 (sum over j in order 0..n-1, then post * h added),
one rounding to the stream dtype at the end. On the GPU the compiler contracts a multiply and an add into one FMA
(as Inductor's kernels do): fp32 last-bit level, before the one rounding.

Legend: T tokens, n streams, D width, BT / BD the program's tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, interpreting, resolve_backend, round_bf16, triton_can_run

MAX_STREAMS = 16
STREAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- reference -----------------------------------------------------------------------------------------------------
def hc_expand_ref(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The model's update with the sum over j as a broadcast product (pass G's plain form), plain torch."""
    mixed = (comb.float().unsqueeze(-1) * x.float().unsqueeze(-2)).sum(dim=1)  # [T, n, D]
    return (post.float().unsqueeze(-1) * h.float().unsqueeze(1) + mixed).to(x.dtype)


# ---- kernel --------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _hc_expand_kernel(x_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, T, D, sx_t, sx_n, sh_t, sp_t, sc_t, so_t, so_n,
                      N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                      ROUND_BF16: tl.constexpr):
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    rk = tl.arange(0, NP)
    rt64 = rt.to(tl.int64)
    mt = rt < T
    mk = rk < N
    m2 = mt[:, None] & (rd < D)[None, :]  # [BT, BD]
    m3 = m2[:, None, :] & mk[None, :, None]  # [BT, NP, BD]
    mtk = mt[:, None] & mk[None, :]  # [BT, NP]
    acc = tl.zeros([BT, NP, BD], dtype=tl.float32)
    for j in tl.static_range(N):  # mixed[:, k] = sum_j comb[:, j, k] * x_j, j in order
        c = tl.load(comb_ptr + rt64[:, None] * sc_t + j * N + rk[None, :], mask=mtk, other=0.0)  # [BT, NP]
        xj = tl.load(x_ptr + rt64[:, None] * sx_t + j * sx_n + rd[None, :], mask=m2, other=0.0).to(tl.float32)
        acc = acc + c[:, :, None] * xj[:, None, :]
    p = tl.load(post_ptr + rt64[:, None] * sp_t + rk[None, :], mask=mtk, other=0.0)  # [BT, NP]
    h = tl.load(h_ptr + rt64[:, None] * sh_t + rd[None, :], mask=m2, other=0.0).to(tl.float32)  # [BT, BD]
    out = p[:, :, None] * h[:, None, :] + acc
    if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest
        out = round_bf16(out)
    offs = rt64[:, None, None] * so_t + rk[None, :, None] * so_n + rd[None, None, :]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=m3)


def default_config(n: int, d: int) -> dict:
    """BT tokens x BD columns per program: 4K fp32 accumulators (BT x n x BD; at n = 4, D >= 512: BT 2, BD 512, so
    each of the 4 warps' threads moves 16 bytes of a bf16 stream tile per load), 4 warps."""
    bd = min(512, max(16, triton.next_power_of_2(d)))
    return dict(BT=max(1, 4096 // (bd * triton.next_power_of_2(n))), BD=bd, num_warps=4)


def launch(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor,
           BT: int | None = None, BD: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Run the kernel into ``out`` [T, n, D] (inputs as ``hc_expand`` checks them, last dims contiguous); a tile
    config overrides the default (benchmarks)."""
    t, n, d = x.shape
    cfg = default_config(n, d)
    bt, bd, nw = BT or cfg["BT"], BD or cfg["BD"], num_warps or cfg["num_warps"]
    if t and d:
        _hc_expand_kernel[(triton.cdiv(t, bt), triton.cdiv(d, bd))](
            x, h, post, comb, out, t, d, x.stride(0), x.stride(1), h.stride(0), post.stride(0), comb.stride(0),
            out.stride(0), out.stride(1), N=n, NP=triton.next_power_of_2(n), BT=bt, BD=bd,
            ROUND_BF16=interpreting() and out.dtype == torch.bfloat16, num_warps=nw)
    return out


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::hc_expand")
def _hc_expand_op(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    if not triton_can_run(x):
        raise cannot_run("minidi::hc_expand", x)
    x, h = x.contiguous(), h.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    return launch(x, h, post, comb, torch.empty_like(x))


@_hc_expand_op.register_fake
def _(x, h, post, comb):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def check_args(op: str, x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    """The update's inputs as ``hc_expand`` documents them, on one device; else a ValueError naming ``op``."""
    if x.dim() != 3 or x.dtype not in STREAM_DTYPES:
        raise ValueError(f"{op}: x must be [T, n, D] bf16 / fp16 / fp32, got {tuple(x.shape)} {x.dtype}")
    t, n, d = x.shape
    if not 0 < n <= MAX_STREAMS:
        raise ValueError(f"{op}: n must be in 1..{MAX_STREAMS}, got {n}")
    if h.shape != (t, d) or not h.dtype.is_floating_point:
        raise ValueError(f"{op}: h must be [T, D] = {(t, d)} float, got {tuple(h.shape)} {h.dtype}")
    if post.shape != (t, n) or post.dtype != torch.float32:
        raise ValueError(f"{op}: post must be [T, n] = {(t, n)} float32, got {tuple(post.shape)} {post.dtype}")
    if comb.shape != (t, n, n) or comb.dtype != torch.float32:
        raise ValueError(f"{op}: comb must be [T, n, n] = {(t, n, n)} float32, got {tuple(comb.shape)} "
                         f"{comb.dtype}")
    if len({x.device, h.device, post.device, comb.device}) != 1:
        raise ValueError(f"{op}: inputs on different devices: {x.device}, {h.device}, {post.device}, "
                         f"{comb.device}")


def hc_expand(x: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              backend: str = "auto") -> torch.Tensor:
    """x [T, n, D] streams (bf16 / fp16 / fp32), h [T, D] the sublayer's output (float), post [T, n] fp32,
    comb [T, n, n] fp32 -> x' [T, n, D] in x's dtype: x'_k = post_k * h + sum_j comb[j, k] * x_j (fp32, one
    rounding). ``backend``: "auto" (the kernel where it can run, else the reference), "triton" or "ref"."""
    check_args("hc_expand", x, h, post, comb)
    if resolve_backend(backend, "hc_expand", x) == "ref":
        return hc_expand_ref(x, h, post, comb)
    return _hc_expand_op(x, h, post, comb)
