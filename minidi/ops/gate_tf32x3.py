"""Router GEMM at fp32 accuracy on tensor cores: logits = x.float() @ weight.float().T.

Replaces (pass target E, ``minidi.model.moe.gate_logits_fp32``), a plain fp32 GEMM that runs on CUDA cores (or, with
TF32 allowed, loses 13 mantissa bits and flips expert choices).

Split-precision products per K block, summed across K blocks with IEEE fp32 adds (see "Accumulation" below):

- An fp32 operand is split a = a_hi + a_lo with a_hi = tf32(a) (round to nearest, 10 mantissa bits) and
  a_lo = tf32(a - a_hi) (also pre-rounded, so the hardware's truncation to tf32 is a no-op). |a - a_hi - a_lo| <=
  2^-22 |a|. A bf16 operand is exact in tf32 and in bf16 (lo = 0), so its lo products are skipped at compile time.
- Products per K step, by input dtypes (x, weight):
    (bf16, bf16): x @ w                               1 bf16 dot (products are exact; the fp32 result up to order)
    (fp32, bf16): x_hi @ w + x_lo @ w                 2 tf32 dots            (X_SPLIT="tf32", the default)
                  x_0 @ w + x_1 @ w + x_2 @ w         3 bf16 dots, x = x_0 + x_1 + x_2 in bf16 pieces (X_SPLIT="bf16x3":
                                                      |residual| <= 2^-24 |x|, bf16 wgmma runs at 2x the tf32 rate)
    (bf16, fp32): x @ w_hi + x @ w_lo                 2 tf32 dots
    (fp32, fp32): x_hi @ w_hi + x_hi @ w_lo + x_lo @ w_hi   3 tf32 dots (the classic 3xTF32)
  Small terms are added first. x_split="tf32x3_builtin" instead upcasts both operands and uses Triton's own
  ``tl.dot(..., input_precision="tf32x3")`` (3 tf32 dots whatever the dtypes; a comparison variant for the bench).

Accumulation (why the split alone is not enough on Hopper): the tensor core's fp32 accumulation is not IEEE. Each MMA
step aligns its products and the accumulator to the largest exponent and truncates the low bits (round toward zero,
no guard bits), so a long chain of MMAs into one accumulator of magnitude |c| loses up to ~1 ulp(|c|) per step, with
a bias that adds up linearly. First H200 round (one accumulator over all of D = 5,120): rel err 1.8e-5 (bf16x3, 960
MMA steps of k 16), 2.8e-5 (2 tf32 dots, 1,280 steps of k 8), 4.4e-5 (3 tf32 dots, 1,920 steps): ~2.2e-8 per step,
whatever the operands (bf16 pieces are exact, so the operand split was not the cause). The fix is the promotion of
DeepSeek-V3's FP8 GEMM: each K block's dots go to a fresh accumulator ``part`` (<= 24 MMA steps, |part| ~
|logit| / sqrt(D / BLOCK_K)), then ``acc += part`` in registers with a round-to-nearest fp32 add (D / BLOCK_K adds).
Bound: ~0.5 ulp(|logit|) * sqrt(D / BLOCK_K) random-signed plus the short chains' truncation, ~1e-6 of max |logit| at
D 5,120 (the plain fp32 matmul: 5e-7), 10x under the 1e-5 target. Triton's combine pass rewrites ``acc + dot(a, b,
0)`` into ``dot(a, b, acc)`` (undoing the promotion), so a single-dot block is written ``acc -= dot(-a, b)``
(negation is exact; there is no subf pattern) and chained blocks end in a dot whose accumulator is not zero. The CPU
interpreter's dots are exact fp32, so only the GPU tests see the accumulation; the CPU tests check the split algebra.

Tiling: one program per [BLOCK_M tokens, BLOCK_N experts] output tile, K loop over D in BLOCK_K steps; programs walk
N fastest so the E / BLOCK_N programs that share an x tile run together and x is read from DRAM about once.
At the bench shape (T 4,096, D 5,120, E 384): 2*T*D*E = 16.1 GFLOP (20 us at 785 TFLOP/s bf16); bytes x 42 MB (bf16)
or 84 MB (fp32) + w 3.9 MB + logits 6.3 MB. With 64 x 128 tiles: 64 x 3 = 192 programs on 132 SMs.

Legend: T tokens, D model width, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, interpreting, resolve_backend, triton_can_run

IN_DTYPES = (torch.bfloat16, torch.float32)
X_SPLITS = ("tf32", "bf16x3", "tf32x3_builtin")


# ---- reference -----------------------------------------------------------------------------------------------------
def gate_tf32x3_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain torch fp32 GEMM (TF32 off). x [T, D] bf16/fp32, weight [E, D] bf16/fp32 -> [T, E] fp32."""
    if x.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        raise RuntimeError("gate_tf32x3_ref: torch.backends.cuda.matmul.allow_tf32 is on, the reference would be TF32")
    return x.float() @ weight.float().t()


# ---- kernel --------------------------------------------------------------------------------------------------------
@triton.jit
def _tf32_round(a):
    """fp32 -> nearest tf32 (10 mantissa bits, ties away from zero), kept in an fp32 container."""
    u = a.to(tl.uint32, bitcast=True)
    return ((u + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@fast_launch
@triton.jit
def _gate_kernel(x_ptr, w_ptr, o_ptr, T, E, D, sx_t, sw_e, so_t, K_PER_SPLIT, so_split,
                 X_EXACT: tl.constexpr, W_EXACT: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """o[t, e] = sum_d x[t, d] * w[e, d] in fp32 (X_EXACT / W_EXACT: the operand is bf16, its lo part is 0).

    SPLIT: 0 tf32 hi/lo split, 1 bf16x3 split of an fp32 x, 2 Triton's built-in ``input_precision="tf32x3"``.
    Each K block's products go to a fresh MMA accumulator ``part`` (a short chain), then ``acc += part`` with an
    IEEE fp32 add (promotion, see the module docstring). A single-dot block is written ``acc -= dot(-a, b)``: Triton's
    combine pass folds ``acc + dot(a, b, 0)`` back into ``dot(a, b, acc)`` (the long truncating chain), not a subf.
    Split K (grid axis 1): program k sums D range [k K_PER_SPLIT, (k + 1) K_PER_SPLIT) into its own output plane
    (o_ptr + k so_split); the launcher adds the planes in IEEE fp32.
    """
    n_n = tl.cdiv(E, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // n_n
    pid_n = pid % n_n
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] tokens
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] experts
    k_begin = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(D, k_begin + K_PER_SPLIT)
    rk = tl.arange(0, BLOCK_K)  # [BK]
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * sx_t + (k_begin + rk)[None, :]  # [BM, BK]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * sw_e + (k_begin + rk)[:, None]  # [BK, BN] (w^T tile)
    m_ok = (rm < T)[:, None]
    n_ok = (rn < E)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # IEEE fp32 sum of the per-block partials
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_ok = rk + k0 < k_end
        a = tl.load(x_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        if SPLIT == 2:  # Triton's 3xTF32 (both operands as fp32; 3 tf32 dots)
            acc -= tl.dot(-a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
        elif X_EXACT and W_EXACT:  # bf16 x bf16: exact products, one dot
            if INTERPRET:
                acc -= tl.dot(-a.to(tl.float32), b.to(tl.float32))
            else:
                acc -= tl.dot(-a, b)
        elif SPLIT == 1 and W_EXACT:  # fp32 x bf16: x = x0 + x1 + x2 in bf16, small terms first
            a0 = a.to(tl.bfloat16)
            r = a - a0.to(tl.float32)
            a1 = r.to(tl.bfloat16)
            a2 = (r - a1.to(tl.float32)).to(tl.bfloat16)
            if INTERPRET:
                bf = b.to(tl.float32)
                part = tl.dot(a2.to(tl.float32), bf)
                part = tl.dot(a1.to(tl.float32), bf, part)
                part = tl.dot(a0.to(tl.float32), bf, part)
            else:
                part = tl.dot(a2, b)
                part = tl.dot(a1, b, part)
                part = tl.dot(a0, b, part)
            acc += part  # (the last dot's accumulator is not 0: not folded)
        else:  # tf32 split products (hi, lo exact in tf32); a bf16 operand is its own hi part; small terms first
            af = a.to(tl.float32)
            bf = b.to(tl.float32)
            a_hi = af if X_EXACT else _tf32_round(af)
            b_hi = bf if W_EXACT else _tf32_round(bf)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if not W_EXACT:
                part = tl.dot(a_hi, _tf32_round(bf - b_hi), part, input_precision="tf32")
            if not X_EXACT:
                part = tl.dot(_tf32_round(af - a_hi), b_hi, part, input_precision="tf32")
            acc += tl.dot(a_hi, b_hi, part, input_precision="tf32")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    o_ptrs = o_ptr + tl.program_id(1).to(tl.int64) * so_split + rm.to(tl.int64)[:, None] * so_t + rn[None, :]
    tl.store(o_ptrs, acc, mask=m_ok & n_ok)


# ---- launcher ------------------------------------------------------------------------------------------------------
THIN_N = 64
"""Outputs at most this wide (the mHC mixers' 24 = (2 + n) n columns, pass F) get thin tiles."""


def default_config(t: int, e: int, d: int, x_dtype: torch.dtype, w_dtype: torch.dtype, x_split: str = "tf32") -> dict:
    """Router (E 384): 64 x 128 x 64 tiles (192 programs at T 4,096: enough for 132 SMs), fewer stages for fp32
    tiles. Thin outputs (E <= THIN_N, e.g. the mHC mixer's [T, 20,480] x [20,480, 24]): BLOCK_N the next power of two
    (>= 16), 64-token tiles and K split 4 ways, so T 4,096 gives 256 programs that each stream a quarter of their x
    rows once (H200 sweep, ``bench/bench_hc_mix.py``: 0.098 ms = 41 % of the copy peak, against 0.17 ms unsplit with
    16-token tiles and 0.42 ms for the fp32 matmul)."""
    fp32 = x_dtype == torch.float32 or w_dtype == torch.float32 or x_split == "tf32x3_builtin"
    if e <= THIN_N:
        return dict(BLOCK_M=64, BLOCK_N=max(16, triton.next_power_of_2(e)), BLOCK_K=128, num_warps=4, num_stages=3,
                    SPLIT_K=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32 if fp32 else 64, num_warps=4, num_stages=3 if fp32 else 4,
                SPLIT_K=1)


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, x_split: str = "tf32", **config) -> None:
    """x [T, D], weight [E, D] (unit stride in D) -> out [T, E] fp32."""
    t, d = x.shape
    e = weight.shape[0]
    if not (t and e):
        return
    cfg = default_config(t, e, d, x.dtype, weight.dtype, x_split) | config
    # SPLIT_K > 1: each split sums whole K blocks into its own plane of a workspace, added afterwards in fp32
    k_per = triton.cdiv(triton.cdiv(d, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    splits = triton.cdiv(d, k_per) if d else 1
    dst = out if splits == 1 else torch.empty((splits, t, e), dtype=torch.float32, device=out.device)
    grid = (triton.cdiv(t, cfg["BLOCK_M"]) * triton.cdiv(e, cfg["BLOCK_N"]), splits)
    _gate_kernel[grid](x, weight, dst, t, e, d, x.stride(0), weight.stride(0), dst.stride(-2), k_per,
                       dst.stride(0) if splits > 1 else 0,
                       X_EXACT=x.dtype == torch.bfloat16, W_EXACT=weight.dtype == torch.bfloat16,
                       SPLIT=X_SPLITS.index(x_split), INTERPRET=interpreting(),
                       BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        torch.sum(dst, dim=0, out=out)


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::gate_tf32x3")
def _gate_op(x: torch.Tensor, weight: torch.Tensor, x_split: str = "tf32") -> torch.Tensor:
    if not triton_can_run(x, weight):
        raise cannot_run("minidi::gate_tf32x3", x, weight)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    launch(x, weight, out, x_split)
    return out


@_gate_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, x_split: str = "tf32") -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def gate_tf32x3(x: torch.Tensor, weight: torch.Tensor, backend: str = "auto", x_split: str = "tf32") -> torch.Tensor:
    """fp32-accurate router logits on tensor cores.

    x [T, D] bf16/fp32, weight [E, D] bf16/fp32 -> [T, E] fp32 = x.float() @ weight.float().T, error at fp32 level
    (<= ~1e-6 of max |logit| on random data). ``x_split`` picks how an fp32 x meets a bf16 weight: "tf32" (2 tf32
    dots) or "bf16x3" (3 bf16 dots); "tf32x3_builtin" uses Triton's ``input_precision="tf32x3"`` (3 tf32 dots).
    ``backend``: "auto" (the kernel where it can run, else the reference), "triton" or "ref" (plain torch, fp32).
    """
    if x.dim() != 2 or x.dtype not in IN_DTYPES:
        raise ValueError(f"gate_tf32x3: x must be [T, D] in {IN_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if weight.dim() != 2 or weight.dtype not in IN_DTYPES or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gate_tf32x3: weight must be [E, D] = [E, {x.shape[1]}] in {IN_DTYPES}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"gate_tf32x3: x and weight must share a device, got {x.device}, {weight.device}")
    if x_split not in X_SPLITS:
        raise ValueError(f"gate_tf32x3: x_split must be one of {X_SPLITS}, got {x_split!r}")
    if resolve_backend(backend, "gate_tf32x3", x, weight) == "ref":
        return gate_tf32x3_ref(x, weight)
    return _gate_op(x, weight, x_split)
