"""The candidate part of ``bench_indexer.py`` (``--only cand``): a V4.1 re-index layer's indexer, today's dense path
(pass B: every key scored on FP8, masked to the candidates, top-512) beside pass M's candidate-only op, same run.

Workload: bench_indexer's shape (T 4,096 x N 131,072, H 32, D 128, causal after a 126,976-key prefix) with fq4 q / k,
and candidates as the model makes them (``candidate_blocks`` of random scores: 2,048 blocks of 8 a query, the newest
block forced), so C = 16,384 keys a query. FLOPs: 2 T H D C for the candidate scores (every candidate is visible),
2 T H D N for the dense score. Rows: the mask build (``candidate_allowed``, eager), the dense FP8 score, B's whole
call with the mask, the candidate score kernel at a few configs, M's whole call (scores + top-k + key mapping); CUDA
graph replays. Checks: candidate scores vs float64 on sampled rows; M's picks vs B's on the mask.
"""

from __future__ import annotations

import torch

from minidi.model.indexer import candidate_allowed, candidate_blocks
from minidi.model.quant import fq4_ue8m0
from minidi.ops.indexer_candidates import _launch_candidate_scores, candidate_scores_ref, indexer_topk_candidates
from minidi.ops.indexer_score import indexer_topk
from minidi.ops.indexer_score_fp8 import _launch_score_fp8

if __package__:
    from . import common
    from .indexer_fp8_cases import Shape, replay
else:
    import common
    from indexer_fp8_cases import Shape, replay

KEEP_BLOCKS, BLOCK = 2048, 8
CAND_CONFIGS = {  # overrides of default_candidate_config: BN, num_warps, num_stages, tiles_per_prog
    "cand default 128 w4 s3": dict(),
    "cand 64 w4 s3": dict(BN=64),
    "cand 128 w4 s2": dict(num_stages=2),
    "cand 128 w4 s4": dict(num_stages=4),
    "cand 256 w8 s3": dict(BN=256, num_warps=8),
    "cand 128 w8 s3": dict(num_warps=8),
    "cand 128 w4 s3 tpp8": dict(tiles_per_prog=8),
    "cand 128 w4 s3 tpp128": dict(tiles_per_prog=128),
}


def bench_candidates(res: dict, s: Shape, ks, ke, smoke: bool = False) -> None:
    keep, block = (KEEP_BLOCKS, BLOCK) if not smoke else (16, 4)
    q = fq4_ue8m0(torch.randn(s.T, s.H, s.D, device=s.dev), 32).bfloat16()
    k = fq4_ue8m0(torch.randn(s.N, s.D, device=s.dev), 32).bfloat16()
    w = torch.randn(s.T, s.H, device=s.dev) * (s.D**-0.5 * s.H**-0.5)
    j = torch.arange(s.N, device=s.dev)
    rnd = torch.rand(s.T, s.N, device=s.dev).masked_fill((j < ks[:, None]) | (j >= ke[:, None]), float("-inf"))
    blocks = candidate_blocks(rnd, ks, ke, keep, block)
    del rnd, j
    s.free()
    c = blocks.shape[1] * block
    flops_c, flops_n = 2 * s.T * s.H * s.D * c, 2 * s.T * s.H * s.D * s.N
    out = res["candidates"] = dict(keep_blocks=keep, block=block, C=c, tflop_candidates=flops_c / 1e12,
                                   valid_blocks_mean=(blocks >= 0).sum(1).float().mean().item(), configs={})
    common.say(f"\nre-index layer: {keep} blocks of {block} = {c} candidate keys a query "
               f"({flops_c / 1e12:.3f} TFLOP) vs all {s.N} ({flops_n / 1e12:.2f} TFLOP); graph replays")
    # checks first
    rows = torch.tensor([0, 1, s.T // 2, s.T - 1], device=s.dev)
    sc = _launch_candidate_scores(q, k, w, ks, ke, blocks, block, True)
    ref = candidate_scores_ref(q[rows], k, w[rows], ks[rows], ke[rows], blocks[rows], block).double()
    fin = torch.isfinite(ref)
    d = (sc[rows].double() - ref)[fin]
    out["check"] = dict(max_rel=(d.abs().max() / ref[fin].abs().max()).item(),
                        inf_ok=bool(torch.equal(torch.isfinite(sc[rows]), fin)))
    allowed = candidate_allowed(blocks, s.N, block)
    i_m = indexer_topk_candidates(q, k, w, ks, ke, s.K, blocks, block, mma="fp8")
    i_b, _ = indexer_topk(q, k, w, ks, ke, s.K, allowed, mma="fp8")
    out["check"].update(picks_equal_rows=(i_m == i_b).all(1).float().mean().item(),
                        picks_overlap=s.overlap(i_m, i_b, s.N))
    common.say(f"  check: candidate scores max rel err vs float64 {out['check']['max_rel']:.2e} (-inf pattern "
               f"{out['check']['inf_ok']}) | M's picks == B's on the mask in {out['check']['picks_equal_rows']:.4f} "
               f"of rows, overlap {out['check']['picks_overlap']:.5f}")
    del sc, i_m, i_b
    s.free()
    t = out["ms"] = {}
    replay(s, t, "mask build (candidate_allowed)", lambda: candidate_allowed(blocks, s.N, block))
    replay(s, t, "dense FP8 score (all N)", lambda: _launch_score_fp8(q, k, w, ks, ke, torch.float32, False),
           flops_n)
    replay(s, t, "B: indexer_topk fp8 + mask", lambda: indexer_topk(q, k, w, ks, ke, s.K, allowed, mma="fp8"))
    allowed = None
    s.free()
    for name, cfg in CAND_CONFIGS.items():
        if smoke and name != "cand default 128 w4 s3":
            continue
        info: dict = {}
        try:
            _launch_candidate_scores(q, k, w, ks, ke, blocks, block, True, info=info, **cfg)
        except Exception as e:  # report, keep going
            out["configs"][name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            common.say(f"  {name}: FAILED {out['configs'][name]['error']}")
            continue
        replay(s, t, name, lambda: _launch_candidate_scores(q, k, w, ks, ke, blocks, block, True, **cfg), flops_c)
        if isinstance(t[name], float):
            out["configs"][name] = dict(ms=t[name], tflops=flops_c / t[name] / 1e9, config=cfg, **info)
    replay(s, t, "M: indexer_topk_candidates fp8",
           lambda: indexer_topk_candidates(q, k, w, ks, ke, s.K, blocks, block, mma="fp8"))
    good = {n: r for n, r in out["configs"].items() if "ms" in r}
    if good:
        best = min(good, key=lambda n: good[n]["ms"])
        out.update(best=best, best_tflops=good[best]["tflops"])
    b, m = t.get("B: indexer_topk fp8 + mask"), t.get("M: indexer_topk_candidates fp8")
    if isinstance(b, float) and isinstance(m, float):
        out["speedup_m_vs_b"] = b / m
        common.say(f"  M vs B (whole call, the mask build not counted): {b / m:.2f}x")
