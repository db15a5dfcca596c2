"""indexer_score(..., mma="fp8") / minidi::indexer_score_fp8 (CPU under TRITON_INTERPRET=1; @gpu on CUDA).

Inputs: fresh random fq4 q / k (``fq4_ue8m0(randn, 32)``, the model's indexer operands) in bf16, with rows the
e4m3 rebase cannot hold (a block 2^20 under the rest) and, where stated, NaN / Inf.
Oracle: the float64 reference. Tolerance: exact products, the tensor core's accumulation: |out - f64| <=
2^-12 * (sum_h |w| (|q| . |k|)) + 1e-5 * |f64| (the interpreter accumulates exactly in fp32; on the H200 the
measured error equals the bf16 kernel's, ~1e-7 relative, docs/ops/indexer.md). Inexact rows: the bf16 kernel's
tolerance (1e-5 relative) and, with ``fixup=False``, a visible difference (the fallback did the work).
Legend: T queries, H heads, D head dim, N keys.
"""

from __future__ import annotations

import pytest
import torch

from minidi.model.quant import fq4_ue8m0
from minidi.ops.indexer_score import _launch_score, indexer_score, indexer_score_ref, indexer_topk
from minidi.ops.indexer_score_fp8 import _launch_score_fp8, default_fp8_config
from minidi.ops.topk import topk_indices_ref

from .test_indexer_score import packed_batch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


def fq4_inputs(t, h, d, n, device=DEV, bad_q=(), bad_k=(), gen=None):
    """fq4 q [T, H, D], k [N, D] in bf16, w [T, H]; rows in bad_q ((t, h) pairs) / bad_k get a block 2^20 below."""
    q = fq4_ue8m0(torch.randn(t, h, d, generator=gen), 32)
    k = fq4_ue8m0(torch.randn(n, d, generator=gen), 32)
    for tt, hh in bad_q:
        q[tt, hh, :32] *= 2.0**-20
    for j in bad_k:
        k[j, :32] *= 2.0**-20
    w = torch.randn(t, h, generator=gen) * 0.2
    return q.bfloat16().to(device), k.bfloat16().to(device), w.to(device)


def abs_bound(q, k, w):
    """sum_h |w| (|q| . |k|) [T, N] in float64: the scale of the accumulation error."""
    return torch.einsum("th,thd,nd->tn", w.double().abs(), q.double().abs(), k.double().abs())


def assert_fp8_close(out, q, k, w, ks, ke, rel=2.0**-12):
    ref = indexer_score_ref(q, k, w, ks, ke.clamp(max=k.shape[0]), compute_dtype=torch.float64)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin), "-inf pattern differs"
    assert torch.all(out[~fin] == float("-inf"))
    err = (out.double() - ref)[fin].abs()
    tol = rel * abs_bound(q, k, w)[fin] + 1e-5 * ref[fin].abs() + 1e-30
    assert torch.all(err <= tol), f"max err / tol {(err / tol).max().item():.3g}"
    return ref


@pytest.mark.parametrize("t,h,d,n,cfg", [
    (9, 8, 64, 300, {}),  # T, N not multiples of the tiles
    (7, 5, 32, 130, {}),  # H not a power of two
    (13, 4, 96, 257, dict(BN=16, QB=4, blocks_per_prog=3)),  # D not a power of two; several key splits
])
def test_fp8_vs_float64_with_inexact_rows(t, h, d, n, cfg):
    gen = torch.Generator().manual_seed(t * n)
    q, k, w = fq4_inputs(t, h, d, n, bad_q=[(2, 1)], bad_k=[5, n - 1], gen=gen)
    k_start = torch.randint(0, n // 2, (t,), generator=gen).to(DEV)
    k_end = k_start + torch.randint(0, n, (t,), generator=gen).to(DEV)  # some past N (clamped), some empty
    k_start[0], k_end[0] = 0, n
    if "BN" in cfg:
        cfg = {**cfg, "cmax_split": 4 if cfg["BN"] % 4 == 0 else 1}
    nb = -(-n // cfg.get("BN", default_fp8_config(h)["BN"]))
    out, cmax = _launch_score_fp8(q, k, w, k_start, k_end, torch.float32, True,
                                  out=torch.full((t, n), NAN, device=DEV), cmax=torch.full((t, nb), NAN, device=DEV),
                                  **cfg)
    ref = assert_fp8_close(out, q, k, w, k_start, k_end)
    # chunk maxima: each query's max over each key block of the scores written
    bn = cfg.get("BN", default_fp8_config(h)["BN"])
    pad = torch.nn.functional.pad(out, (0, nb * bn - n), value=float("-inf"))
    assert torch.equal(cmax, pad.view(t, nb, bn).amax(2))
    # the inexact rows went through the fallback: their scores meet the bf16 kernel's tolerance
    rows = ref[2].isfinite()
    assert ((out[2] - ref[2]).abs()[rows] <= 1e-5 * (1 + ref[2].abs()[rows])).all()


def test_fallback_does_the_work():
    """Without the fixup launch the tiles of inexact rows are wrong (their e4m3 rows are 0): the fixup is what
    makes them right."""
    q, k, w = fq4_inputs(8, 8, 64, 200, bad_k=[70], gen=torch.Generator().manual_seed(3))
    ks, ke = torch.zeros(8, dtype=torch.long, device=DEV), torch.full((8,), 200, device=DEV)
    bad, _ = _launch_score_fp8(q, k, w, ks, ke, torch.float32, False, fixup=False)
    good, _ = _launch_score_fp8(q, k, w, ks, ke, torch.float32, False)
    ref = indexer_score_ref(q, k, w, ks, ke, compute_dtype=torch.float64)
    assert (bad[:, 70] == 0).all() and (ref[:, 70] != 0).any()
    assert_fp8_close(good, q, k, w, ks, ke)


def test_nan_inf_rows_as_bf16_kernel():
    """NaN / Inf rows are not exact as e4m3: their tiles are the bf16 kernel's, NaN for NaN."""
    q, k, w = fq4_inputs(6, 8, 64, 100, gen=torch.Generator().manual_seed(4))
    q[1, 2, 5] = NAN
    k[40, 3] = float("inf")
    ks, ke = torch.zeros(6, dtype=torch.long, device=DEV), torch.full((6,), 100, device=DEV)
    ours, _ = _launch_score_fp8(q, k, w, ks, ke, torch.float32, False)
    nat, _ = _launch_score(q, k, w, ks, ke, torch.float32, False)
    torch.testing.assert_close(ours, nat, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert ours[1].isnan().any() and not ours[0, :40].isnan().any()


def test_packed_ragged_batch_topk_and_wrappers():
    h, d = 8, 32
    k_start, k_end, n = packed_batch([5, 1, 17, 9, 2], [3, 1, 12, 40, 2], DEV)
    t = k_start.shape[0]
    q, k, w = fq4_inputs(t, h, d, n, bad_k=[20], gen=torch.Generator().manual_seed(5))
    out = indexer_score(q, k, w, k_start, k_end, mma="fp8")
    assert_fp8_close(out, q, k, w, k_start, k_end)
    idx, scores = indexer_topk(q, k, w, k_start, k_end, 8, mma="fp8")
    assert torch.equal(scores, out) and torch.equal(idx, topk_indices_ref(out, 8, k_end, k_start))
    allowed = torch.rand(t, n, generator=torch.Generator().manual_seed(6)).to(DEV) < 0.5
    idx_a, scores_a = indexer_topk(q, k, w, k_start, k_end, 8, allowed, mma="fp8")
    assert torch.equal(scores_a, out.masked_fill(~allowed, float("-inf")))
    ref_idx, _ = indexer_topk(q, k, w, k_start, k_end, 8, allowed, backend="ref", mma="fp8")
    assert torch.equal(idx_a, ref_idx)  # the same picks as the fp32 reference (no near-ties at this size)


def test_empty_errors_opcheck():
    q, k, w = fq4_inputs(0, 4, 32, 10)
    z = torch.zeros(0, dtype=torch.long, device=DEV)
    assert indexer_score(q, k, w, z, z, mma="fp8").shape == (0, 10)
    q, k, w = fq4_inputs(3, 4, 32, 0)
    z = torch.zeros(3, dtype=torch.long, device=DEV)
    assert indexer_score(q, k, w, z, z, mma="fp8").shape == (3, 0)
    q, k, w = fq4_inputs(5, 4, 32, 40)
    ks = torch.zeros(5, dtype=torch.long, device=DEV)
    ke = torch.tensor([40, 3, 0, 17, 33], device=DEV)
    with pytest.raises(ValueError, match="mma must be"):
        indexer_score(q, k, w, ks, ke, mma="fp4")
    torch.library.opcheck(torch.ops.minidi.indexer_score_fp8.default, (q, k, w, ks, ke, torch.float32, True))


# ------------------------------------------------------------------------------------------------ GPU, V4.1-Flash
@pytest.mark.gpu
@pytest.mark.parametrize("promote", [0, 64])
def test_gpu_v41_fp8_vs_float64_and_bf16_kernel(promote):
    """T 512, H 32, D 128, N 131,072, causal after a 126,976-key prefix, fq4 inputs with inexact rows: sampled
    rows vs float64 (the FP8 bound), the error no worse than 4x the bf16 kernel's, chunk maxima, top-512."""
    t, h, d, n = 512, 32, 128, 131072
    gen = torch.Generator().manual_seed(11)
    q, k, w = fq4_inputs(t, h, d, n, "cuda", bad_q=[(300, 7)], bad_k=[3, 70000, n - 5], gen=gen)
    ks = torch.zeros(t, dtype=torch.long, device="cuda")
    ke = 126976 + torch.arange(t, device="cuda") * 8 + 1
    out, cmax = _launch_score_fp8(q, k, w, ks, ke, torch.float32, True, promote=promote,
                                  out=torch.full((t, n), NAN, device="cuda"))
    nat, _ = _launch_score(q, k, w, ks, ke, torch.float32, False)
    rows = torch.tensor([0, 1, 63, 64, 255, 300, 510, 511], device="cuda")
    ref = assert_fp8_close(out[rows], q[rows], k, w[rows], ks[rows], ke[rows])
    fin = ref.isfinite()
    e8 = (out[rows].double() - ref)[fin].norm() / ref[fin].norm()
    e16 = (nat[rows].double() - ref)[fin].norm() / ref[fin].norm()
    assert e8 <= 4 * e16 + 1e-7, (e8.item(), e16.item())
    assert not out.isnan().any()
    bn = default_fp8_config(h)["BN"]
    assert torch.equal(cmax, out.view(t, n // bn, bn).amax(2))
    idx, scores = indexer_topk(q, k, w, ks, ke, 512, mma="fp8")
    assert torch.equal(idx, topk_indices_ref(scores, 512, ke))


@pytest.mark.gpu
def test_gpu_packed_fp8():
    h, d = 32, 128
    k_start, k_end, n = packed_batch([1000, 7, 3000, 2] + [2] * 40, [20000, 7, 60000, 2] + [2] * 40, "cuda")
    t = k_start.shape[0]
    q, k, w = fq4_inputs(t, h, d, n, "cuda", bad_k=[19999, 20003], gen=torch.Generator().manual_seed(12))
    out = indexer_score(q, k, w, k_start, k_end, mma="fp8")
    rows = torch.tensor([0, 999, 1000, 1007, 2500, 4006, t - 1], device="cuda")
    assert_fp8_close(out[rows], q[rows], k, w[rows], k_start[rows], k_end[rows])
