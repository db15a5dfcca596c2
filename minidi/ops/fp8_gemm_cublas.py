"""The 128-block FP8 GEMM on cuBLAS: ``torch._scaled_mm`` with 1 x 128 activation scales and 128 x 128 weight scales
(cuBLASLt's block-scaled FP8 matmul, the DeepSeek-V3 recipe), for ``fp8_linear``'s FP8 route on V4-Flash's linears.

    y = fp8_gemm_cublas(q, s_x, w, w_scale_fp32, out_dtype)
    # q [M, K] e4m3, s_x [M, K / 128] fp32 with strides (1, M) (``fq8_split_launch(x, 128, scales_t=True)``),
    # w [N, K] e4m3, w_scale_fp32 [N / 128, K / 128] fp32 (contiguous; ``weight_scales``) -> y [M, N] out_dtype

The same semantics as ``fp8_gemm_sm90`` with 128-blocks (``fp8_gemm.py``'s reference): e4m3 x e4m3 products, each
128-block's partial sum promoted in fp32 with its two scales; the sums differ in order. The GPU test holds it to
the Gluon kernel's bound (2^-11 of sum |x| |w| beside bf16's rounding).

Where it runs (``can_run``), from what torch 2.11's ``_scaled_mm`` did on an H100 (a layout probe, round 34:
docs/ops/fp8_gemm.md, ``docs/benchmarks/h100_round34/scaled_mm_layouts.txt``):
- the activation scales in M-major order (strides (1, M)) and the weight scales as the transpose of a contiguous
  [N / 128, K / 128] tensor; every other layout tried (K-major activations, padded rows of either) was refused
  ("Invalid scaling configuration");
- K / 128 a multiple of 4: at K = 1,280 (10 scale columns, rows not 16-byte aligned) the call ran and returned a
  wrong product (relative error ~1, both N 4,096 and 32,768), so ``can_run`` refuses K not a multiple of 512;
- M a multiple of 4 (M = 4,093: CUBLAS_STATUS_NOT_SUPPORTED); N a multiple of 128 (not probed otherwise: a rule of
  caution, V4-Flash's N are);
- a sm_90 GPU, and a probe of this torch's cuBLAS path once per device (a small product against its reference, on
  the first call outside CUDA-graph capture): a torch without the path, or one that returns a wrong product, leaves
  the Gluon kernel in place (``probe_failure`` says why).
Elsewhere ``fp8_linear`` runs ``fp8_gemm_sm90``.

Measured (one H100, round 34, ``bench/bench_fp8_gemm.py``, kernel times at T = 4,096; docs/ops/fp8_gemm.md): at
V4-Flash's seven linear shapes 1,006-1,262 TFLOP/s (71-89 % of the fp8 peak measured in the run), 1.31-1.60x the bf16
GEMM and 0.99-1.40x the Gluon kernel, with the Gluon kernel's error against the bf16 GEMM; in the V4-Flash EP4 step
its 322 launches take 30.51 ms against the Gluon kernel's 38.10.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ._triton_utils import capability

BLOCK = 128
_PROBE_TOL = 2.0**-7  # the probe's bound on max |y - ref| / max |ref| (bf16 output: 2^-9; a wrong layout: ~1)


def shape_ok(m: int, n: int, k: int) -> bool:
    """The shapes the cuBLAS path computes right (see the module doc): M % 4, N % 128, K % 512 all 0."""
    return m % 4 == 0 and n % BLOCK == 0 and k % (4 * BLOCK) == 0 and min(m, n, k) > 0


def can_run(q: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``fp8_gemm_cublas`` runs this product: CUDA tensors on an sm_90 GPU, ``shape_ok``, and the device's
    probe passed (run here on the first call outside CUDA-graph capture)."""
    if not (q.is_cuda and w.is_cuda) or capability(q.device) != (9, 0):
        return False
    if not shape_ok(q.shape[0], w.shape[0], q.shape[1]):
        return False
    if torch.cuda.is_current_stream_capturing() and _index(q.device) not in _probed:
        return False  # (no probe inside a capture)
    return probe_failure(q.device) is None


_probed: set[int] = set()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _probe(index: int) -> str | None:
    return probe_on(torch.device("cuda", index))


def probe_on(device: torch.device) -> str | None:
    """A 64 x 256 x 1024 product with random scales on ``device`` against its fp32 reference: None where right, else
    what went wrong (the call raised, or its error)."""
    gen = torch.Generator(device=device).manual_seed(0)
    m, n, k = 64, 256, 1024
    q = (torch.randn(m, k, device=device, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device=device, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s_x = torch.exp2(torch.randint(-12, -4, (k // BLOCK, m), device=device, generator=gen).float()).t()
    s_w = torch.exp2(torch.randint(-12, -4, (n // BLOCK, k // BLOCK), device=device, generator=gen).float())
    ref = (q.float() * s_x.repeat_interleave(BLOCK, 1)) @ (
        w.float() * s_w.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)).t()
    try:
        y = fp8_gemm_cublas(q, s_x, w, s_w, torch.bfloat16)
    except RuntimeError as e:
        return f"torch {torch.__version__}: _scaled_mm with 128-block scales raised {str(e).splitlines()[0][:200]}"
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    if not err <= _PROBE_TOL:
        return f"torch {torch.__version__}: _scaled_mm with 128-block scales is off by {err:.3g} of max |y|"
    return None


def probe_failure(device: torch.device) -> str | None:
    """None where this torch's block-scaled ``_scaled_mm`` gave the right product on ``device`` (checked once),
    else why not (warned once)."""
    index = _index(device)
    fresh = index not in _probed
    _probed.add(index)
    why = _probe(index)
    if why is not None and fresh:
        warnings.warn(f"fp8_gemm_cublas: {why}; fp8_linear keeps the Gluon FP8 GEMM", stacklevel=2)
    return why


def weight_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (or fp32) [N / 128, K / 128] -> fp32, contiguous: the kernel's weight scales (passed transposed).
    Constant per weight: ``fp8_linear`` keeps it."""
    from .fp8_gemm import weight_scale_fp32

    return weight_scale_fp32(w_scale).contiguous()


def fp8_gemm_cublas(q: torch.Tensor, s_x: torch.Tensor, w: torch.Tensor, w_scale_fp32: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = the 128-block product of q [M, K] e4m3 (scales s_x [M, K / 128], strides (1, M)) and w [N, K] e4m3
    (scales [N / 128, K / 128] fp32 contiguous), out_dtype; see the module doc for the layouts and where it runs."""
    m, k = q.shape
    if s_x.shape != (m, k // BLOCK) or s_x.stride() != (1, m) or s_x.dtype != torch.float32:
        raise ValueError(f"fp8_gemm_cublas: s_x must be fp32 [{m}, {k // BLOCK}] with strides (1, {m}) "
                         f"(fq8_split_launch(x, 128, scales_t=True)), got {tuple(s_x.shape)} {s_x.dtype} "
                         f"strides {s_x.stride()}")
    nb = w.shape[0] // BLOCK
    if w_scale_fp32.shape != (nb, k // BLOCK) or not w_scale_fp32.is_contiguous() or \
            w_scale_fp32.dtype != torch.float32:
        raise ValueError(f"fp8_gemm_cublas: w_scale_fp32 must be contiguous fp32 [{nb}, {k // BLOCK}] "
                         f"(weight_scales), got {tuple(w_scale_fp32.shape)} {w_scale_fp32.dtype}")
    return torch._scaled_mm(q, w.t(), s_x, w_scale_fp32.t(), out_dtype=out_dtype)


__all__ = ["BLOCK", "can_run", "fp8_gemm_cublas", "probe_failure", "probe_on", "shape_ok", "weight_scales"]
