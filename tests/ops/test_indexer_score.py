"""minidi::indexer_score / indexer_topk (CPU under TRITON_INTERPRET=1; @gpu on CUDA).

Oracle: the float64 reference (``indexer_score_ref(..., compute_dtype=float64)``) on the same (bf16 or fp32) inputs.
Tolerance: |kernel - f64| <= 1e-5 * (1 + |f64|) for fp32 output (fp32 accumulation of exact products), and never
worse than the unfused bf16 path (the model's ``indexer_topk_naive`` in bf16). -inf exactly where invisible.
Legend: T queries, H heads, D head dim, N keys.
"""

from __future__ import annotations

import pytest
import torch

from minidi.model.indexer import indexer_topk_naive
from minidi.ops import _triton_utils
from minidi.ops.indexer_score import _launch_score, indexer_score, indexer_score_ref, indexer_topk
from minidi.ops.topk import topk_indices_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


def inputs(t, h, d, n, dtype=torch.float32, device=DEV):
    q = torch.randn(t, h, d, device=device).to(dtype)
    k = torch.randn(n, d, device=device).to(dtype)
    w = torch.randn(t, h, device=device) * 0.2
    return q, k, w


def assert_scores_close(out, ref64, tol=1e-5):
    fin = torch.isfinite(ref64)
    assert torch.equal(torch.isfinite(out), fin), "-inf pattern differs"
    assert torch.all(out[~fin] == float("-inf"))
    err = (out.double() - ref64)[fin].abs()
    assert torch.all(err <= tol * (1 + ref64[fin].abs())), f"max err {err.max().item():.3g}"


def packed_batch(seq_tokens, seq_keys, device=DEV):
    """Ragged packed batch: sequence s has seq_tokens[s] queries and seq_keys[s] keys in one pool; query i of s sees
    the first ceil((i + 1) * keys / tokens) keys of its sequence (causal-ish). -> k_start, k_end [T], N."""
    ks, ke, off = [], [], 0
    for t, n in zip(seq_tokens, seq_keys):
        for i in range(t):
            ks.append(off)
            ke.append(off + -(-(i + 1) * n // t))
        off += n
    return torch.tensor(ks, device=device), torch.tensor(ke, device=device), off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d,n,cfg", [
    (9, 8, 32, 300, {}),  # T, N not multiples of the tiles
    (7, 5, 24, 130, {}),  # H, D not powers of two
    (13, 4, 16, 257, dict(BN=16, QB=4, blocks_per_prog=3)),  # several key splits per query block
])
def test_dense_vs_float64(dtype, t, h, d, n, cfg):
    q, k, w = inputs(t, h, d, n, dtype)
    k_start = torch.randint(0, n // 2, (t,), device=DEV)
    k_end = k_start + torch.randint(0, n, (t,), device=DEV)  # some past N (clamped), some empty
    k_start[0], k_end[0] = 0, n
    out, _ = _launch_score(q, k, w, k_start, k_end, torch.float32, False, out=torch.full((t, n), NAN, device=DEV),
                           **cfg)
    ref = indexer_score_ref(q, k, w, k_start, k_end.clamp(max=n), compute_dtype=torch.float64)
    assert_scores_close(out, ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_error_no_worse_than_unfused_bf16(seed):
    torch.manual_seed(seed)
    t, h, d, n = 16, 8, 64, 200
    q, k, w = inputs(t, h, d, n, torch.bfloat16)
    n_vis = torch.randint(1, n + 1, (t,), device=DEV)
    ref = indexer_score_ref(q, k, w, torch.zeros_like(n_vis), n_vis, compute_dtype=torch.float64)
    fin = torch.isfinite(ref)
    ours = indexer_score(q, k, w, torch.zeros_like(n_vis), n_vis)
    # the unfused path: bf16 einsum, relu * w and head sum
    _, naive = indexer_topk_naive(q, k, w, torch.zeros_like(n_vis), n_vis, 8)
    e_ours = (ours.double() - ref)[fin].abs().max().item()
    e_naive = (naive.double() - ref)[fin].abs().max().item()
    assert e_ours <= e_naive and e_ours < 1e-4, (e_ours, e_naive)
    # bf16 scores: within one bf16 ulp of the exact value, elementwise (comparing the max error with the unfused
    # path's, itself mostly bf16 rounding, failed for about half of the seeds)
    ours16 = indexer_score(q, k, w, torch.zeros_like(n_vis), n_vis, out_dtype=torch.bfloat16)
    assert ours16.dtype == torch.bfloat16 and torch.equal(ours16.isinf(), ref.isinf())
    assert ((ours16.double() - ref)[fin].abs() <= ref[fin].abs() * 2**-7 + 1e-5).all()


def test_packed_ragged_batch_and_40_two_token_sequences():
    h, d = 8, 32
    for seq_tokens, seq_keys in (([5, 1, 17, 9, 2], [3, 1, 12, 40, 2]), ([2] * 40, [2] * 40)):
        k_start, k_end, n = packed_batch(seq_tokens, seq_keys)
        t = k_start.shape[0]
        q, k, w = inputs(t, h, d, n)
        out, _ = _launch_score(q, k, w, k_start, k_end, torch.float32, False, out=torch.full((t, n), NAN, device=DEV))
        assert_scores_close(out, indexer_score_ref(q, k, w, k_start, k_end, compute_dtype=torch.float64))


def test_indexer_topk_matches_naive():
    h, d, topk = 8, 32, 16
    k_start, k_end, n = packed_batch([7, 3, 10], [120, 9, 300])  # ragged: fewer than topk visible in places
    t = k_start.shape[0]
    q, k, w = inputs(t, h, d, n)
    k_end[0] = k_start[0]  # nothing visible
    idx, scores = indexer_topk(q, k, w, k_start, k_end, topk)
    idx_n, scores_n = indexer_topk_naive(q, k, w, k_start, k_end, topk)
    assert idx.shape == idx_n.shape and scores.shape == scores_n.shape and idx.dtype == torch.int64
    assert torch.equal(idx.sort(1).values, idx_n.sort(1).values)  # same sets (the naive path is score-ordered)
    assert torch.allclose(scores, scores_n, rtol=1e-5, atol=1e-5)
    # allowed mask (re-index layers): the same sets among finite picks; -inf picks are -1 here
    allowed = torch.rand(t, n, device=DEV) < 0.3
    idx, scores = indexer_topk(q, k, w, k_start, k_end, topk, allowed)
    idx_n, scores_n = indexer_topk_naive(q, k, w, k_start, k_end, topk, allowed)
    fin_n = torch.where(scores_n.gather(1, idx_n.clamp(min=0)) > float("-inf"), idx_n, -1)
    fin_n = torch.where(idx_n >= 0, fin_n, -1)
    assert torch.equal(idx.sort(1).values, fin_n.sort(1).values)
    ref_idx, ref_scores = indexer_topk(q, k, w, k_start, k_end, topk, allowed, backend="ref")
    assert torch.equal(idx, ref_idx) and torch.allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_empty_and_ref_backend():
    q, k, w = inputs(0, 4, 16, 10)
    z = torch.zeros(0, dtype=torch.long, device=DEV)
    assert indexer_score(q, k, w, z, z).shape == (0, 10)
    q, k, w = inputs(3, 4, 16, 0)
    z = torch.zeros(3, dtype=torch.long, device=DEV)
    assert indexer_score(q, k, w, z, z).shape == (3, 0)
    q, k, w = inputs(3, 4, 16, 10)
    ks, ke = torch.zeros(3, dtype=torch.long, device=DEV), torch.tensor([10, 4, 0], device=DEV)
    assert torch.allclose(indexer_score(q, k, w, ks, ke, backend="ref"), indexer_score(q, k, w, ks, ke), atol=1e-5)


def test_opcheck():
    q, k, w = inputs(5, 4, 16, 40)
    ks = torch.zeros(5, dtype=torch.long, device=DEV)
    ke = torch.tensor([40, 3, 0, 17, 33], device=DEV)
    torch.library.opcheck(torch.ops.minidi.indexer_score.default, (q, k, w, ks, ke, torch.float32, True))


def test_errors(monkeypatch):
    q, k, w = inputs(3, 4, 16, 10, device="cpu")
    ks, ke = torch.zeros(3, dtype=torch.long), torch.full((3,), 10)
    with pytest.raises(ValueError, match="q must be"):
        indexer_score(q[0], k, w, ks, ke)
    with pytest.raises(ValueError, match="k must be"):
        indexer_score(q, k[:, :8], w, ks, ke)
    with pytest.raises(ValueError, match="w must be"):
        indexer_score(q, k, w[:, :2], ks, ke)
    with pytest.raises(ValueError, match="k_end must be"):
        indexer_score(q, k, w, ks, ke.float())
    with pytest.raises(TypeError, match="q and k must be"):
        indexer_score(q.double(), k, w, ks, ke)
    with pytest.raises(TypeError, match="out_dtype"):
        indexer_score(q, k, w, ks, ke, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="allowed must be"):
        indexer_topk(q, k, w, ks, ke, 4, torch.ones(3, 9, dtype=torch.bool))
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)  # as if imported without TRITON_INTERPRET=1
    with pytest.raises(RuntimeError, match="backend='auto'"):
        indexer_score(q, k, w, ks, ke, backend="triton")
    assert torch.equal(indexer_score(q, k, w, ks, ke), indexer_score(q, k, w, ks, ke, backend="ref"))  # auto: ref


# ------------------------------------------------------------------------------------------------ GPU, V4.1-Flash
@pytest.mark.gpu
def test_gpu_v41_dense_and_topk():
    """T 512 of the bench's 4,096 queries, H 32, D 128, N 131,072, bf16 q/k, causal after a 126,976-key prefix."""
    t, h, d, n = 512, 32, 128, 131072
    q, k, w = inputs(t, h, d, n, torch.bfloat16, "cuda")
    ks = torch.zeros(t, dtype=torch.long, device="cuda")
    ke = 126976 + torch.arange(t, device="cuda") * 8 + 1
    out, cmax = _launch_score(q, k, w, ks, ke, torch.float32, True, out=torch.full((t, n), NAN, device="cuda"))
    rows = torch.tensor([0, 1, 63, 64, 255, 300, 510, 511], device="cuda")
    ref = indexer_score_ref(q[rows], k, w[rows], ks[rows], ke[rows], compute_dtype=torch.float64)
    assert_scores_close(out[rows], ref)
    assert not out.isnan().any()
    idx, scores = indexer_topk(q, k, w, ks, ke, 512)
    assert torch.equal(scores, out)
    assert torch.equal(idx, topk_indices_ref(out, 512, ke))


@pytest.mark.gpu
def test_gpu_v4_dense_and_topk():
    """V4-Flash's ratio-4 layers: H 64, N 32,768 (512 score blocks of 64 = K chunks, too few to bound the top-512:
    the top-k takes its own chunk maxima, ``uses_fused_bound``)."""
    from minidi.ops.indexer_score import default_score_config
    from minidi.ops.topk import uses_fused_bound

    t, h, d, n = 512, 64, 128, 32768
    assert not uses_fused_bound(512, n // default_score_config(h, torch.bfloat16)["BN"])
    q, k, w = inputs(t, h, d, n, torch.bfloat16, "cuda")
    ks = torch.zeros(t, dtype=torch.long, device="cuda")
    ke = 31744 + torch.arange(t, device="cuda") * 2 + 1
    idx, scores = indexer_topk(q, k, w, ks, ke, 512)
    rows = torch.tensor([0, 1, 255, 511], device="cuda")
    assert_scores_close(scores[rows], indexer_score_ref(q[rows], k, w[rows], ks[rows], ke[rows],
                                                        compute_dtype=torch.float64))
    assert torch.equal(idx, topk_indices_ref(scores, 512, ke))


@pytest.mark.gpu
def test_gpu_packed():
    h, d = 32, 128
    k_start, k_end, n = packed_batch([1000, 7, 3000, 2] + [2] * 40, [20000, 7, 60000, 2] + [2] * 40, "cuda")
    t = k_start.shape[0]
    q, k, w = inputs(t, h, d, n, torch.bfloat16, "cuda")
    out = indexer_score(q, k, w, k_start, k_end)
    rows = torch.tensor([0, 999, 1000, 1007, 2500, 4006, t - 1], device="cuda")
    assert_scores_close(out[rows], indexer_score_ref(q[rows], k, w[rows], k_start[rows], k_end[rows],
                                                     compute_dtype=torch.float64))
