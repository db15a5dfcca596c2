"""indexer_topk_candidates / minidi::indexer_topk_candidates (CPU under TRITON_INTERPRET=1; @gpu on CUDA).

Inputs: fresh random q / k / w (fq4 for mma="fp8", with rows the e4m3 rebase cannot hold), candidate blocks from
the model's own ``candidate_blocks`` on random scores, plus hand-made edge rows: -1 ids, a block past N, a block
partly past the visible range, a query with no visible candidate.
Oracles: the float64 candidate scores (``candidate_scores_ref``); the picks against the top-k reference applied to
the kernel's own scores (exact: the mapping and the tie-break) and against pass B's dense op with the model's
[T, N] mask (equal picks up to scores within the accumulation tolerance of the k-th). Tolerances: native fp32
1e-5 relative of sum_h |w| |q . k|; bf16 / fp8 operands are exact products with fp32 (interpreter) or tensor-core
accumulation: 2^-12 of sum_h |w| (|q| . |k|) + 1e-5 relative (as tests/ops/test_indexer_score_fp8.py).
Legend: T queries, H heads, D head dim, N keys, B block size, KB blocks per query.
"""

from __future__ import annotations

import pytest
import torch

from minidi.model.indexer import candidate_allowed, candidate_blocks
from minidi.model.quant import fq4_ue8m0
from minidi.ops.indexer_candidates import (_candidates_op, _launch_candidate_scores, candidate_scores_ref,
                                           indexer_topk_candidates, positions_to_keys)
from minidi.ops.indexer_score import indexer_topk
from minidi.ops.topk import topk_indices_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu  # conftest skips it without CUDA
NAN = float("nan")


def case(t, h, d, n, block, kb, dtype, fp8, gen, inexact=True):
    q = torch.randn(t, h, d, generator=gen)
    k = torch.randn(n, d, generator=gen)
    if fp8:
        q, k = fq4_ue8m0(q, 32), fq4_ue8m0(k, 32)
    if fp8 and inexact:  # rows e4m3 times one power of two cannot hold: the bf16 fallback (query 1, key 3)
        q[1, 0, :32] *= 2.0**-20
        k[3, :32] *= 2.0**-20
    w = torch.randn(t, h, generator=gen) * 0.3
    k_start = torch.randint(0, n // 3, (t,), generator=gen)
    k_end = (k_start + torch.randint(1, n, (t,), generator=gen)).clamp(max=n)
    k_start[0], k_end[0] = 0, n
    scores = torch.randn(t, n, generator=gen)
    j = torch.arange(n)
    scores = scores.masked_fill((j < k_start[:, None]) | (j >= k_end[:, None]), float("-inf"))
    blocks = candidate_blocks(scores, k_start, k_end, kb, block)
    blocks[2, -1] = -1  # a dropped block
    blocks[3] = torch.arange(kb) + (-(-n // block) - kb + 1)  # the last id starts past N (partly past if N % B)
    k_start[4] = k_end[4] = 0  # nothing visible: every pick -1
    to = {"device": DEV}
    return (q.to(dtype).to(**to), k.to(dtype).to(**to), w.to(**to), k_start.to(**to), k_end.to(**to),
            blocks.to(**to))


def abs_bound(q, k, w, blocks, block):
    """sum_h |w| (|q| . |k_row|) per candidate [T, C], float64: the scale of the accumulation error."""
    n = k.shape[0]
    pos = torch.arange(blocks.shape[1] * block, device=q.device)
    row = (blocks[:, pos // block] * block + pos % block).clamp(0, n - 1)
    return torch.einsum("th,thd,tcd->tc", w.double().abs(), q.double().abs(), k.double().abs()[row])


CASES = [  # t, h, d, n, block, kb, dtype, fp8, cfg (fp8 cases: inexact rows unless cfg says inexact=False)
    (7, 8, 64, 75, 4, 5, torch.float32, False, {}),
    (7, 8, 64, 75, 4, 5, torch.bfloat16, True, dict(inexact=False)),  # every row exact: the loop without flags
    (9, 5, 32, 101, 8, 6, torch.bfloat16, False, dict(BN=16, tiles_per_prog=1)),  # H not a power of two
    (8, 8, 64, 90, 4, 7, torch.bfloat16, True, {}),
    (6, 4, 96, 67, 2, 9, torch.float32, True, dict(BN=32, tiles_per_prog=3)),  # D not a power of two; fp32 fq4
    (5, 8, 64, 61, 4, 4, torch.bfloat16, True, dict(fp8_min_heads=32, fp8_min_dim=128)),  # the GPU's padding
]


@pytest.mark.parametrize("t,h,d,n,block,kb,dtype,fp8,cfg", CASES)
def test_candidate_scores_vs_float64(t, h, d, n, block, kb, dtype, fp8, cfg):
    gen = torch.Generator().manual_seed(t * n + kb)
    cfg = dict(cfg)
    q, k, w, ks, ke, blocks = case(t, h, d, n, block, kb, dtype, fp8, gen, cfg.pop("inexact", True))
    assert_scores_close(q, k, w, ks, ke, blocks, block, fp8, 1e-5 if dtype == torch.float32 and not fp8 else 2.0**-12,
                        **cfg)


def assert_scores_close(q, k, w, ks, ke, blocks, block, fp8, rel, **cfg):
    """The kernel's scores (into a NaN-poisoned output) against the float64 reference: the -inf pattern exactly
    (query 4 sees nothing), the finite ones within rel * sum_h |w| (|q| . |k|) + 1e-5 relative."""
    out = _launch_candidate_scores(q, k, w, ks, ke, blocks, block, fp8,
                                   out=torch.full((q.shape[0], blocks.shape[1] * block), NAN, device=DEV), **cfg)
    ref = candidate_scores_ref(q, k, w, ks, ke, blocks, block).double()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), fin), "-inf pattern differs"
    assert torch.all(out[~fin] == float("-inf")) and not fin[4].any() and fin.any()
    err = (out.double() - ref)[fin].abs()
    tol = rel * abs_bound(q, k, w, blocks, block)[fin] + 1e-5 * ref[fin].abs() + 1e-30
    assert torch.all(err <= tol), f"max err / tol {(err / tol).max().item():.3g}"


@pytest.mark.parametrize("t,h,d,n,block,kb,dtype,fp8,cfg", CASES)
def test_picks_equal_the_dense_op_on_the_mask(t, h, d, n, block, kb, dtype, fp8, cfg):
    gen = torch.Generator().manual_seed(t * n + kb + 1)
    q, k, w, ks, ke, blocks = case(t, h, d, n, block, kb, dtype, fp8, gen, cfg.get("inexact", True))
    topk = 6
    mma = "fp8" if fp8 else "native"
    idx = indexer_topk_candidates(q, k, w, ks, ke, topk, blocks, block, mma=mma)
    # exact: the top-k of the kernel's own scores, mapped to keys (ties to the lowest position = the lowest key)
    own = _launch_candidate_scores(q, k, w, ks, ke, blocks, block, fp8)
    assert torch.equal(idx, positions_to_keys(topk_indices_ref(own, topk), blocks, block))
    assert (idx[4] == -1).all()
    # against pass B's op on the model's mask: the same set, up to picks scored within tolerance of each other
    dense, scores = indexer_topk(q, k, w, ks, ke, topk, candidate_allowed(blocks, n, block), mma=mma)
    assert_same_picks(idx, dense, scores)


def assert_same_picks(a_idx, b_idx, scores, rel=1e-5):
    """Equal pick sets per row, except picks whose scores lie within ``rel`` of the row's k-th score (near-ties the
    two summation orders may break differently); both in ascending key order, -1 last."""
    for r in range(a_idx.shape[0]):
        a, b = a_idx[r].tolist(), b_idx[r].tolist()
        for x in (a, b):
            valid = [i for i in x if i >= 0]
            assert valid == sorted(valid) and x == valid + [-1] * (len(x) - len(valid)), (r, x)
        sa, sb = set(a) - {-1}, set(b) - {-1}
        if sa != sb:
            kth = scores[r, sorted(sa & sb or sa)].min()
            diff = scores[r, sorted(sa ^ sb)]
            assert torch.all((diff - kth).abs() <= rel * kth.abs() + 1e-6), (r, sa, sb)


def test_exact_ties_go_to_the_lowest_key():
    """Duplicated key rows tie exactly (small integers and power-of-two weights: every sum exact in any order, so
    no BLAS or tensor-core order can split them): the lower key wins, as in the dense op."""
    gen = torch.Generator().manual_seed(11)
    t, h, d, n, block = 3, 4, 32, 40, 4
    q = torch.randint(-3, 4, (t, h, d), generator=gen).float().to(DEV)
    k = torch.randint(-3, 4, (n, d), generator=gen).float()
    k[20:24] = k[4:8]
    k[36:40] = k[4:8]  # blocks 1, 5 and 9 hold the same keys
    k = k.to(DEV)
    w = 2.0 ** torch.randint(-2, 2, (t, h), generator=gen).float().to(DEV)
    ks, ke = torch.zeros(t, dtype=torch.long, device=DEV), torch.full((t,), n, device=DEV)
    blocks = torch.tensor([[1, 5, 9], [5, 9, -1], [0, 1, 9]], device=DEV)
    idx = indexer_topk_candidates(q, k, w, ks, ke, 2, blocks, block)
    dense, _ = indexer_topk(q, k, w, ks, ke, 2, candidate_allowed(blocks, n, block))
    assert torch.equal(idx, dense)
    exact = candidate_scores_ref(q, k, w, ks, ke, blocks, block)  # integers times powers of two: exact
    for r in range(t):  # brute force: by score descending, then key ascending
        keys = positions_to_keys(torch.arange(12, device=DEV).expand(1, 12), blocks[r:r + 1], block)[0].tolist()
        ranked = sorted((-float(exact[r, i]), key) for i, key in enumerate(keys) if key >= 0)
        assert idx[r].tolist() == sorted(key for _, key in ranked[:2]), r
    assert max(idx[0].tolist()) < 36  # block 9's copies never win a tie against blocks 1 and 5


def test_topk_past_the_candidates_pads_with_minus_one():
    gen = torch.Generator().manual_seed(3)
    q, k, w, ks, ke, blocks = case(5, 4, 32, 30, 2, 3, torch.float32, False, gen)
    idx = indexer_topk_candidates(q, k, w, ks, ke, 9, blocks, 2)  # 6 candidates, top-9
    assert idx.shape == (5, 9) and (idx[:, 6:] == -1).all()
    ref = indexer_topk_candidates(q, k, w, ks, ke, 9, blocks, 2, backend="ref")
    assert_same_picks(idx, ref, indexer_topk(q, k, w, ks, ke, 9, candidate_allowed(blocks, 30, 2))[1])


@pytest.mark.parametrize("change,msg", [
    (dict(blocks=torch.zeros(5, 3)), "blocks must be"),
    (dict(blocks=torch.zeros(4, 3, dtype=torch.long)), "blocks must be"),
    (dict(block=0), "block must be a positive int"),
    (dict(topk=5000), "topk must be an int"),
    (dict(mma="int8"), "mma must be one of"),
    (dict(w=torch.zeros(5, 3)), "w must be"),
])
def test_bad_inputs_are_named(change, msg):
    gen = torch.Generator().manual_seed(4)
    q, k, w, ks, ke, blocks = case(5, 4, 32, 30, 2, 3, torch.float32, False, gen)
    kw = dict(q=q, k=k, w=w, k_start=ks, k_end=ke, topk=4, blocks=blocks, block=2)
    kw.update({a: (b.to(DEV) if isinstance(b, torch.Tensor) else b) for a, b in change.items()})
    with pytest.raises((ValueError, TypeError), match=msg):
        indexer_topk_candidates(**kw)


def test_opcheck():
    gen = torch.Generator().manual_seed(5)
    q, k, w, ks, ke, blocks = case(5, 4, 32, 30, 2, 3, torch.bfloat16, True, gen)
    torch.library.opcheck(_candidates_op.op, (q, k, w, ks, ke, blocks, 2, 4, True))


@gpu
@pytest.mark.parametrize("inexact", [False, True])
def test_gpu_small_head_count_vs_float64(inexact):
    """A tiny model's index shape (8 heads of 64) on the GPU's tile config: its FP8 dot unpadded ([128, 64] x [64, 16]
    e4m3) faulted with an illegal address (H100, Triton 3.6, round 30); the launcher pads it to 32 heads of 128."""
    gen = torch.Generator().manual_seed(7)
    t, h, d, n, block, kb = 7, 8, 64, 75, 4, 5
    q, k, w, ks, ke, blocks = case(t, h, d, n, block, kb, torch.bfloat16, True, gen, inexact)
    assert_scores_close(q, k, w, ks, ke, blocks, block, True, 2.0**-12)


@gpu
def test_gpu_full_head_count_vs_float64():
    """V4.1's head shape (32 heads of 128, blocks of 8) on the GPU's tile config, fq4 operands."""
    gen = torch.Generator().manual_seed(6)
    t, h, d, n, block, kb = 33, 32, 128, 4099, 8, 70
    q, k, w, ks, ke, blocks = case(t, h, d, n, block, kb, torch.bfloat16, True, gen)
    assert_scores_close(q, k, w, ks, ke, blocks, block, True, 2.0**-12)
