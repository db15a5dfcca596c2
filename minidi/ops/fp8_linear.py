"""N: an FP8 linear as one op: the model's ``FP8Linear.forward`` (fq8 of the input, the block-dequantised weight,
the GEMM) behind one graph node, with the same result bit for bit.

    y = fp8_linear(x, weight, scale, weight_block, act_block)
    # = F.linear(fq8(x, act_block), dequant_fp8(weight, scale, weight_block, x.dtype))   (act_block 0: x as it is;
    #   act_block -b: x is fq8(., b) already, pass R's shared fq8: used as it is, its block known)

Why an op and not Inductor's code: inlined, the two helper chains are about half of a layer graph's nodes (a tiny
V4.1 layer: ~370 of ~750 Dynamo nodes over its 8 FP8 linears), and every one of them is traced, functionalised,
partitioned and lowered again for each layer kind at start-up (issue 20). As one node they cost one fake call. The
op is also where the FP8 tensor-core GEMM goes (issue 21) once one beats the bf16 GEMM at these shapes.

Kernels (Triton; the interpreter runs them on CPU tensors), both memory-bound:
- ``_fq8_kernel`` (``minidi/ops/fq8.py``, shared with the ``fq8`` op that pass R inserts): fq8 of the input along K,
  ``quant.fq8`` bit for bit on finite blocks (a block holding a NaN or an infinity comes out all NaN).
- ``_dequant_kernel``: one program per [BN, BK] tile of the weight; each e4m3 byte decoded from its bits
  (``e4m3_byte_to_fp32``), times its tile's E8M0 scale (``e8m0_to_fp32``: code 0 -> 2^-127, 255 -> NaN), one
  rounding to x's dtype: ``dequant_fp8`` bit for bit.
Then ``F.linear`` on the two results, the call the model makes (the same GEMM library call, so the same bits).

The dequantised weight is the same every call: ``dequant_weight`` keeps it per weight tensor (``_weight_cache``:
recomputed when the weight or its scale changes in place) within a byte budget, ``MINIDI_FP8_WEIGHT_CACHE_GB``
(default 32 GiB on CUDA, 0 elsewhere; 0 turns it off). V4.1-Flash's FP8 linears (one rank, 40 layers): 10.23 GiB of
bf16 copies kept beside their e4m3 bytes (H200 round 21, the benchmark's ``fp8_weight_cache_gib``), against a dequant
kernel per linear per step that moves 3 bytes a weight (round 20: 7.6 ms a step over 290 launches; gone in round
21; H100 round 28 the same). ``fp8_grouped_linear`` (wo_a) keeps its weight there too: 8,192 x 4,096 bf16 x 40
layers = 2.5 GiB more at V4.1-Flash (computed; not yet measured). Weights past the budget are dequantised every call,
as before; a long-context run short of memory sets a lower budget.

FP8 tensor cores (``MINIDI_FP8_GEMM``, read every call; issue 21): "128" (the default) runs linears whose weight
tiles and input blocks are both 128 (V4-Flash) on the block-scaled FP8 GEMM (``fp8_gemm_sm90``: ``fq8_split`` of the
input, e4m3 x e4m3 products with each 128-block promoted in fp32: the model's products, summed in another order),
where that kernel can run (sm_90, Triton 3.6), or on cuBLAS's block-scaled GEMM (``fp8_gemm_cublas``, the same
semantics, on the H100 the same error as the Gluon kernel at V4-Flash's shapes and 0.99-1.40x its speed; round 34)
where its shape rules hold and ``MINIDI_FP8_GEMM_LIB`` is "auto" (the default; "gluon": the Gluon kernel
always); other linears (V4.1's 32-blocks) keep the bf16 GEMM above. "all" also takes 32-blocks, slower than bf16 in
round 27; "off" keeps the bf16 GEMM everywhere. The FP8 route keeps no bf16
weight copy (the weights' E8M0 scales, transposed for the kernel, are kept per weight). Judged at full size on one
H100 (round 30, V4-Flash EP4, ``docs/benchmarks``): per layer compiled-vs-eager error 0.99x (median) / 1.07x (max)
the bf16 GEMM's, the step 372.4 ms against 377.6 with "off", 2.69 GiB of bf16 weight copies kept against 10.91.
Linears whose input pass R already quantised (act_block -b) take the route too: ``fq8_split`` of an fq8 output is
exact (q * s equals it), so their products are the bf16 GEMM's. An input of act_block 0 (no fake quant) is not fq8
values: the bf16 GEMM.

``fp8_grouped_linear``: attention's grouped output projection ``wo_a`` (``einsum("tgi,goi->tgo", x, dequant_fp8(...)
.view(G, N / G, I))``, no fq8 of x) on the same kept weight, as one batched GEMM writing [T, G, N / G] directly.

Backends: "auto" (the kernels where they can run, else the reference), "triton", "ref" (``fp8_linear_ref``, plain
torch from ``minidi.formats``, whose ``dequant_fp8`` is the model's own; behind an opaque op so that a CPU graph
holds one node too).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minidi.formats import dequant_fp8

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_formats import e4m3_byte_to_fp32, e8m0_to_fp32
from ._triton_utils import cannot_run, resolve_backend, triton_can_run
from ._weight_cache import cached_bytes, cached_per_tensor
from .fq8 import BLOCKS as FQ8_BLOCKS
from .fq8 import X_DTYPES, fq8_launch, fq8_ref

ACT_BLOCKS = (0, *FQ8_BLOCKS, *(-b for b in FQ8_BLOCKS))  # 0: no fq8 (fake quant off); -b: x is fq8(., b) already
WEIGHT_BLOCKS = (32, 128)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
WEIGHT_CACHE_ENV = "MINIDI_FP8_WEIGHT_CACHE_GB"
FP8_GEMM_ENV = "MINIDI_FP8_GEMM"
FP8_GEMM_MODES = {"off": (), "128": (128,), "all": (32, 128)}  # mode -> the blocks it runs on FP8 tensor cores
FP8_GEMM_DEFAULT = "128"
FP8_GEMM_LIB_ENV = "MINIDI_FP8_GEMM_LIB"  # 128-blocks: "auto" (cuBLAS where it runs, else Gluon) | "gluon"
FP8_GEMM_LIBS = ("auto", "gluon")
WEIGHT_CACHE_DEFAULT_GB = {"cuda": 32.0}  # by device type; other devices: 0 (off)
_WEIGHT_CACHE = "fp8_linear dequantised weights"


# ---- reference -----------------------------------------------------------------------------------------------------
def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int,
                   act_block: int) -> torch.Tensor:
    """Plain torch: ``F.linear(fq8(x), dequant_fp8(weight, scale))`` (act_block <= 0: no fq8)."""
    xq = fq8_ref(x, act_block) if act_block > 0 else x
    return F.linear(xq, dequant_fp8(weight, scale, weight_block, x.dtype))


def fp8_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int
                           ) -> torch.Tensor:
    """Plain torch, the model's grouped output projection (``wo_a``): ``einsum("tgi,goi->tgo", x,
    dequant_fp8(weight, scale).view(G, N / G, I))``."""
    g = x.shape[-2]
    w = dequant_fp8(weight, scale, weight_block, x.dtype).view(g, weight.shape[0] // g, -1)
    return torch.einsum("tgi,goi->tgo", x, w)


# ---- kernels -------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_s, TILE: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (rows < N)[:, None] & (cols < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    w = e4m3_byte_to_fp32(tl.load(w_ptr + offs, mask=m, other=0))
    code = tl.load(s_ptr + (rows // TILE)[:, None] * stride_s + (cols // TILE)[None, :], mask=m, other=127)
    tl.store(out_ptr + offs, (w * e8m0_to_fp32(code)).to(out_ptr.dtype.element_ty), mask=m)


def dequant_launch(weight: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """The block-dequantised weight by ``_dequant_kernel`` (weight contiguous e4m3, scale uint8 codes)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if n and k:
        bn, bk = (32, 256) if weight.is_cuda else (32, 64)
        _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
            weight.view(torch.uint8), scale, out, n, k, scale.stride(0), TILE=block, BN=bn, BK=bk, num_warps=4)
    return out


def weight_cache_budget(device: torch.device) -> int:
    """Bytes of dequantised weights ``dequant_weight`` may keep: ``MINIDI_FP8_WEIGHT_CACHE_GB`` (GiB, read every call
    so that a test or a long-context run can change it), else ``WEIGHT_CACHE_DEFAULT_GB`` for the device type."""
    raw = os.environ.get(WEIGHT_CACHE_ENV)
    if raw is None:
        return int(WEIGHT_CACHE_DEFAULT_GB.get(device.type, 0.0) * 2**30)
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not gib >= 0 or gib == float("inf"):
        raise ValueError(f"{WEIGHT_CACHE_ENV} must be a finite number of GiB >= 0 (0: no cache), got {raw!r}")
    return int(gib * 2**30)


def weight_cache_bytes() -> int:
    """Bytes of dequantised weights kept now (every device)."""
    return cached_bytes(_WEIGHT_CACHE)


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``dequant_launch``, kept per weight tensor within ``weight_cache_budget`` (a contiguous weight and scale only:
    a copy made for the call would be a new tensor every call). The kept tensor is returned as it is: callers read
    it, never write it."""
    budget = weight_cache_budget(weight.device)
    if budget <= 0 or not (weight.is_contiguous() and scale.is_contiguous()):
        return dequant_launch(weight.contiguous(), scale.contiguous(), block, dtype)
    return cached_per_tensor(f"{_WEIGHT_CACHE} {block} {dtype}", weight,
                             lambda w: dequant_launch(w, scale, block, dtype), also=(scale,), budget=budget,
                             size=weight.numel() * dtype.itemsize, group=_WEIGHT_CACHE)


def fp8_gemm_blocks() -> tuple[int, ...]:
    """The blocks ``MINIDI_FP8_GEMM`` sends to the FP8 tensor-core GEMM (see the module doc)."""
    mode = os.environ.get(FP8_GEMM_ENV, FP8_GEMM_DEFAULT)
    if mode not in FP8_GEMM_MODES:
        raise ValueError(f"{FP8_GEMM_ENV} must be one of {sorted(FP8_GEMM_MODES)}, got {mode!r}")
    return FP8_GEMM_MODES[mode]


def fp8_gemm_route(x: torch.Tensor, weight: torch.Tensor, weight_block: int, act_block: int) -> bool:
    """Whether this call runs on the FP8 GEMM: its blocks selected by ``MINIDI_FP8_GEMM``, the input's fq8 block
    equal to the weight's tile (the kernel's one ``block``; -block: the input is fq8 already), and the kernel able to
    run on these tensors."""
    blocks = fp8_gemm_blocks()  # (a bad setting fails on every device, not only where the kernel could run)
    if abs(act_block) != weight_block or weight_block not in blocks or not (x.is_cuda and weight.is_cuda):
        return False
    from .fp8_gemm_sm90 import can_run

    return can_run(x.reshape(-1, x.shape[-1]), weight, weight_block)


def fp8_gemm_lib() -> str:
    """``MINIDI_FP8_GEMM_LIB`` (read every call): "auto" (the default) runs 128-blocks on cuBLAS where
    ``fp8_gemm_cublas.can_run`` holds, "gluon" always on ``fp8_gemm_sm90`` (A/B runs)."""
    lib = os.environ.get(FP8_GEMM_LIB_ENV, "auto")
    if lib not in FP8_GEMM_LIBS:
        raise ValueError(f"{FP8_GEMM_LIB_ENV} must be one of {list(FP8_GEMM_LIBS)}, got {lib!r}")
    return lib


@functools.cache
def _gemm_modules() -> tuple:
    """The FP8 GEMMs' modules, imported at first use (importing them here at load would be circular)."""
    from . import fp8_gemm_cublas, fp8_gemm_sm90, fp8_quant

    return fp8_gemm_cublas, fp8_gemm_sm90, fp8_quant


def gemm_route(x: torch.Tensor, weight: torch.Tensor, weight_block: int, act_block: int) -> str:
    """The GEMM a call runs: "cublas" (cuBLAS's block-scaled GEMM), "gluon" (``fp8_gemm_sm90``) or "bf16" (the
    dequantised weight's ``F.linear``): ``fp8_gemm_route``, then ``MINIDI_FP8_GEMM_LIB`` and cuBLAS's rules. The
    decision reads only the tensors' devices, dtypes and shapes, the blocks and the two environment variables (and
    cuBLAS's probe, whose verdict is fixed per device once made), so a CUDA call outside graph capture keeps it by
    those (a V4-Flash step makes 322 calls of a handful of signatures; round 39 on an H100's host, before this: the
    op took 155.6 us a call of which its split and ``_scaled_mm`` were 62.9, the rest its dispatch and Python, the
    decision among it). CPU calls decide every time (the tests replace the deciding functions)."""
    key = None
    if x.is_cuda:
        key = (x.device, weight.device, x.dtype, x.shape, weight.shape, weight_block, act_block,
               os.environ.get(FP8_GEMM_ENV), os.environ.get(FP8_GEMM_LIB_ENV))
        route = _ROUTES.get(key)
        if route is not None:
            return route
    if not fp8_gemm_route(x, weight, weight_block, act_block):
        route = "bf16"
    else:
        cublas = _gemm_modules()[0]
        on_cublas = weight_block == cublas.BLOCK and fp8_gemm_lib() == "auto" and \
            cublas.can_run(x.reshape(-1, x.shape[-1]), weight)
        route = "cublas" if on_cublas else "gluon"
    if key is not None and len(_ROUTES) < MAX_ROUTES and not torch.cuda.is_current_stream_capturing():
        _ROUTES[key] = route
    return route


_ROUTES: dict[tuple, str] = {}  # gemm_route's kept decisions (CUDA calls)
MAX_ROUTES = 1024


def fp8_gemm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int,
                    on_cublas: bool) -> torch.Tensor:
    """``F.linear(fq8(x, block), dequant_fp8(weight, scale, block))`` on FP8 tensor cores: the input split into
    e4m3 + scales (``fq8_split``), the block-scaled FP8 GEMM (128-blocks: cuBLAS's, ``fp8_gemm_cublas``, where it
    runs; else ``fp8_gemm_sm90``), out in x's dtype. ``on_cublas``: the library as ``gemm_route`` decided it."""
    cublas, sm90, quant = _gemm_modules()
    x2 = x.reshape(-1, x.shape[-1])
    q, s = quant.fq8_split_launch(x2, block, scales_t=on_cublas)  # (M-major scales for cuBLAS)
    if on_cublas:
        sw = cached_per_tensor("fp8_linear weight_scale fp32", weight, lambda _: cublas.weight_scales(scale),
                               also=(scale,))
        y = cublas.fp8_gemm_cublas(q, s, weight, sw, x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])
    scale_t = cached_per_tensor(f"fp8_linear weight_scale_t {block}", weight, lambda _: sm90.weight_scale_t(scale),
                                also=(scale,))  # keyed on the weight: the op gets a new view of its scale each call
    y = sm90.fp8_gemm_sm90(q, s, weight, scale, block, out_dtype=x.dtype, w_scale_t=scale_t)
    return y.view(*x.shape[:-1], weight.shape[0])


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int, act_block: int) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"fp8_linear: {what}")

    if x.dim() < 1 or x.dtype not in X_DTYPES:
        fail(f"x must be [..., K] with dtype in {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        fail(f"weight must be [N, K] float8_e4m3fn, got {tuple(weight.shape)} {weight.dtype}")
    if weight_block not in WEIGHT_BLOCKS:
        fail(f"weight_block must be one of {WEIGHT_BLOCKS}, got {weight_block}")
    if act_block not in ACT_BLOCKS:
        fail(f"act_block must be one of {ACT_BLOCKS} (0: no fq8 of the input; -b: the input is fq8 in blocks of b "
             f"already), got {act_block}")
    n, k = weight.shape
    if x.shape[-1] != k:
        fail(f"x's last dim {x.shape[-1]} is not the weight's K {k} (weight {tuple(weight.shape)})")
    if act_block and k % abs(act_block):
        fail(f"K {k} is not a multiple of act_block {abs(act_block)} (fq8 blocks along K)")
    tiles = (-(-n // weight_block), -(-k // weight_block))
    if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != tiles:
        fail(f"scale must be E8M0 codes (uint8 / float8_e8m0fnu) of shape {tiles} (ceil of {tuple(weight.shape)} / "
             f"{weight_block}), got {tuple(scale.shape)} {scale.dtype}")
    devs = {t.device for t in (x, weight, scale)}
    if len(devs) != 1:
        fail(f"x, weight and scale must be on one device, got {sorted(map(str, devs))}")


def _out_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---- custom ops ----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::fp8_linear")
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int,
                   act_block: int) -> torch.Tensor:
    if not triton_can_run(x, weight, scale):
        raise cannot_run("minidi::fp8_linear", x, weight, scale)
    x = x.contiguous()
    route = gemm_route(x, weight, weight_block, act_block)
    if route != "bf16":
        return fp8_gemm_linear(x, weight, scale, weight_block, on_cublas=route == "cublas")
    xq = fq8_launch(x, act_block) if act_block > 0 else x
    return F.linear(xq, dequant_weight(weight, scale, weight_block, x.dtype))


@_fp8_linear_op.register_fake
def _(x, weight, scale, weight_block, act_block):
    return _out_fake(x, weight)


@dispatch_op("minidi::fp8_linear_ref")
def _fp8_linear_ref_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int,
                       act_block: int) -> torch.Tensor:
    return fp8_linear_ref(x, weight, scale, weight_block, act_block)


@_fp8_linear_ref_op.register_fake
def _(x, weight, scale, weight_block, act_block):
    return _out_fake(x, weight)


# ---- the grouped form (wo_a) ---------------------------------------------------------------------------------------
def _grouped_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    t, g, _ = x.shape
    return x.new_empty(t, g, weight.shape[0] // g)


@dispatch_op("minidi::fp8_grouped_linear")
def _fp8_grouped_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int
                           ) -> torch.Tensor:
    if not triton_can_run(x, weight, scale):
        raise cannot_run("minidi::fp8_grouped_linear", x, weight, scale)
    t, g, i = x.shape
    w = dequant_weight(weight, scale, weight_block, x.dtype).view(g, -1, i)  # the kept copy, read only
    out = _grouped_out(x, weight)  # [T, G, O]: each group's GEMM writes its columns of the row (no permuted copy)
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out


@_fp8_grouped_linear_op.register_fake
def _(x, weight, scale, weight_block):
    return _grouped_out(x, weight)


@dispatch_op("minidi::fp8_grouped_linear_ref")
def _fp8_grouped_linear_ref_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int
                               ) -> torch.Tensor:
    return fp8_grouped_linear_ref(x, weight, scale, weight_block).contiguous()


@_fp8_grouped_linear_ref_op.register_fake
def _(x, weight, scale, weight_block):
    return _grouped_out(x, weight)


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int,
                       backend: str = "auto") -> torch.Tensor:
    """The grouped output projection (V4 / V4.1 attention's ``wo_a``): x [T, G, I] bf16 | fp32, weight [N, I]
    float8_e4m3fn holding G groups of N / G rows, scale its E8M0 tiles -> [T, G, N / G] in x's dtype: group g's rows
    times x[:, g] (``einsum("tgi,goi->tgo", x, dequant_fp8(weight, scale).view(G, N / G, I))``, the model's code).
    The dequantised weight is kept per weight tensor as ``fp8_linear``'s (``dequant_weight``), where the model's
    code dequantises it every call; the G GEMMs (one batched call) write straight into the [T, G, N / G] rows the
    next linear reads, where Inductor's lowering of the einsum writes [G, T, N / G] and copies it. No fq8 of x (the
    model quantises no input of ``wo_a``). ``backend``: "auto" | "triton" | "ref"."""
    if x.dim() != 3 or weight.dim() != 2 or x.shape[1] < 1 or weight.shape[0] % x.shape[1]:
        raise ValueError(f"fp8_grouped_linear: x must be [T, G, I] with G dividing the weight's N, got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    _check(x, weight, scale, weight_block, 0)
    scale = scale.view(torch.uint8)
    if resolve_backend(backend, "fp8_grouped_linear", x, weight, scale) == "ref":
        return _fp8_grouped_linear_ref_op(x, weight, scale, weight_block)
    return _fp8_grouped_linear_op(x, weight, scale, weight_block)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_block: int, act_block: int,
               backend: str = "auto") -> torch.Tensor:
    """x [..., K] bf16 | fp32; weight [N, K] float8_e4m3fn; scale [ceil(N / weight_block), ceil(K /
    weight_block)] E8M0 codes (uint8 or float8_e8m0fnu); act_block 32 | 128 (fq8 of x along K), 0 (x as it is) or
    -32 | -128 (x as it is, known to be fq8 in those blocks: pass R's shared fq8).
    -> [..., N] in x's dtype, equal bit for bit to ``F.linear(fq8(x, act_block), dequant_fp8(weight, scale,
    weight_block, x.dtype))`` on finite inputs (see the module doc). ``backend``: "auto" | "triton" | "ref"."""
    _check(x, weight, scale, weight_block, act_block)
    fp8_gemm_blocks()  # a bad MINIDI_FP8_GEMM or MINIDI_FP8_GEMM_LIB fails on every backend, not only where the
    fp8_gemm_lib()  # route is looked at
    scale = scale.view(torch.uint8)
    if resolve_backend(backend, "fp8_linear", x, weight, scale) == "ref":
        return _fp8_linear_ref_op(x, weight, scale, weight_block, act_block)
    return _fp8_linear_op(x, weight, scale, weight_block, act_block)
