"""Model FLOP counts (``minidi.runtime.flops``) against hand formulas on the tiny presets and the roofline anchors.

The hand formulas below loop over query positions one by one and read the shapes straight from the config, so they
share nothing with the vectorised counts they check. Visibility rules are cross-checked against the model's own
step metadata and candidate filter.
"""

import pytest
import torch

import minidi
from minidi.model.context import StepMeta
from minidi.model.indexer import candidate_mask
from minidi.runtime.flops import CATEGORIES, flop_terms, mfu, step_flops


def _layer(cfg, layer, new, cached, seqs=1):
    return {t.name: t.flops for t in flop_terms(cfg, new, cached, seqs) if t.layer == layer}


def _positions(new, cached):
    return range(cached, cached + new)


def test_owner_layer_matches_hand_formula():
    """tiny-v41 layer 2: ratio-2 kv source that owns its index keys (window 16, top-k 8, 4 heads of 128)."""
    cfg = minidi.preset("tiny-v41")
    new, cached, seqs = 12, 7, 2
    got = _layer(cfg, 2, new, cached, seqs)
    t = new * seqs
    keys = sum(min(16, p + 1) + min(8, (p + 1) // 2) for p in _positions(new, cached))
    assert got["attn.core"] == seqs * keys * 2 * 2 * 4 * 128
    assert got["attn.wq_a"] == 2 * t * 256 * 128
    assert got["attn.wq_b"] == 2 * t * 128 * 4 * 128
    assert got["attn.wo_a"] == 2 * t * 2 * (4 * 128 // 2) * 64  # 2 groups of 256 -> 64
    assert got["attn.wo_b"] == 2 * t * 2 * 64 * 256
    assert got["attn.compressor"] == 2 * (2 * t * 256 * 128)  # wkv + wgate
    visible = sum((p + 1) // 2 for p in _positions(new, cached))
    assert got["indexer.score"] == seqs * visible * 2 * 8 * 128
    completed = (cached + new) // 2 - cached // 2  # groups {6,7} .. {18,-}: entries 3..8 complete here
    assert completed == 6
    assert got["indexer.wk"] == seqs * completed * 2 * 128 * 128
    assert got["moe.routed"] == 2 * 3 * 2 * t * 256 * 128
    assert got["moe.shared"] == 3 * 2 * t * 256 * 128
    assert got["moe.gate"] == 2 * t * 256 * 8


def test_reuse_and_window_only_layers():
    cfg = minidi.preset("tiny-v41")
    got3 = _layer(cfg, 3, 10, 40)  # reuse of layer 2: attends the published top-k, no compressor or indexer
    assert not any(k.startswith(("indexer.", "attn.compressor")) for k in got3)
    assert got3["attn.core"] == sum(16 + 8 for _ in range(10)) * 2 * 2 * 4 * 128
    got1 = _layer(cfg, 1, 10, 3)  # window only, Engram layer: 3 n-gram orders x 2 heads x 32 -> 5 x 256
    assert got1["attn.core"] == sum(min(16, p + 1) for p in _positions(10, 3)) * 2 * 2 * 4 * 128
    assert got1["engram.wkv"] == 2 * 10 * (3 * 2 * 32) * (5 * 256)
    assert "engram.wkv" not in _layer(cfg, 0, 10, 3)


def test_candidate_filtered_layer_counts_candidates_only():
    """tiny-v41 layer 8 re-indexes inside layer 6's candidates (4 blocks of 4): count them with the model's own
    candidate filter on random scores, then compare with the FLOP count."""
    cfg = minidi.preset("tiny-v41")
    assert cfg.is_candidate_filtered(8) and not cfg.is_candidate_filtered(6)
    new, cached = 30, 20
    pos = torch.arange(cached, cached + new)
    n_vis = pos + 1  # ratio 1
    scores = torch.randn(new, int(n_vis.max()), generator=torch.Generator().manual_seed(0))
    j = torch.arange(scores.shape[1])
    scores = scores.masked_fill(j[None, :] >= n_vis[:, None], float("-inf"))
    mask = candidate_mask(scores, torch.zeros_like(pos), n_vis, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    entries = int((mask & (j[None, :] < n_vis[:, None])).sum())
    assert entries < int(n_vis.sum())  # the filter bites at these positions
    assert _layer(cfg, 8, new, cached)["indexer.score"] == entries * 2 * 8 * 128
    assert _layer(cfg, 6, new, cached)["indexer.score"] == int(n_vis.sum()) * 2 * 8 * 128  # the source: dense


def test_v4_dense_and_indexed_layers():
    cfg = minidi.preset("tiny-v4")  # ratios (0, 4, 16, 4), window 16, top-k 4, 16 index heads of 128
    new, cached = 20, 50
    got = _layer(cfg, 2, new, cached)  # ratio 16: dense over every visible entry, no indexer
    keys = sum(min(16, p + 1) + (p + 1) // 16 for p in _positions(new, cached))
    assert got["attn.core"] == keys * 2 * 2 * 4 * 128
    assert got["attn.compressor"] == 2 * (2 * new * 256 * 128)
    assert not any(k.startswith("indexer.") for k in got)
    got = _layer(cfg, 1, new, cached)  # ratio 4: overlapping compressor (width 2d), own indexer compressor
    assert got["attn.compressor"] == 2 * (2 * new * 256 * 256)
    assert got["indexer.compressor"] == 2 * (2 * new * 256 * 256)
    assert got["indexer.score"] == sum((p + 1) // 4 for p in _positions(new, cached)) * 2 * 16 * 128
    assert got["attn.core"] == sum(min(16, p + 1) + min(4, (p + 1) // 4) for p in _positions(new, cached)) * 2048
    head = {t.name: t.flops for t in flop_terms(cfg, new, cached, 3) if t.layer == -1}
    assert head == {"hc.head": 2 * 3 * 4 * 256 * 4, "head": 2 * 3 * 256 * 512}


def test_visibility_agrees_with_step_metadata():
    """With nothing cached, the window and compressed-entry counts equal those of the model's own StepMeta."""
    cfg = minidi.preset("tiny-v41")
    n = 37
    meta = StepMeta.for_sequence(torch.zeros(n, dtype=torch.long), cfg.window_size, (1, 2))
    window = int((meta.window_idx >= 0).sum())
    rm = meta.ratios[2]
    chosen = int((rm.k_end - rm.k_start).clamp(max=cfg.index_topk).sum())
    assert _layer(cfg, 2, n, 0)["attn.core"] == (window + chosen) * 2 * 2 * cfg.n_heads * cfg.head_dim
    assert _layer(cfg, 2, n, 0)["indexer.wk"] == rm.group_idx.shape[0] * 2 * cfg.head_dim * cfg.index_head_dim


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v41-b", "tiny-v4"])
def test_categories_and_monotonic(name):
    cfg = minidi.preset(name)
    f = step_flops(cfg, 16, 8, seqs=2)
    assert list(f) == [*CATEGORIES, "total"]
    assert f["communication"] == 0.0
    assert f["total"] == pytest.approx(sum(f[k] for k in CATEGORIES))
    assert all(f[k] > 0 for k in CATEGORIES if k != "communication")
    totals = [step_flops(cfg, n, 8)["total"] for n in (1, 2, 8, 33, 100)]
    assert totals == sorted(totals) and len(set(totals)) == len(totals)
    by_cache = [step_flops(cfg, 16, c)["total"] for c in (0, 8, 64, 300)]
    assert by_cache == sorted(by_cache) and len(set(by_cache)) == len(by_cache)
    assert step_flops(cfg, 16, 8, seqs=3)["moe"] == pytest.approx(3 * step_flops(cfg, 16, 8)["moe"])


def test_v41_flash_matches_roofline_anchors():
    """shared/perf/ROOFLINE.md, V4.1-Flash at 4,096 new tokens after 126,976 cached (within 10 %)."""
    cfg = minidi.preset("v41-flash")
    terms = flop_terms(cfg, 4096, 126976)

    def layer_sum(layer, names):
        return sum(t.flops for t in terms if t.layer == layer and t.name in names)

    proj = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b")
    assert layer_sum(3, proj) == pytest.approx(1.04e12, rel=0.1)
    assert layer_sum(3, ("moe.routed", "moe.shared")) == pytest.approx(2.03e12, rel=0.1)
    assert layer_sum(2, ("attn.core",)) == pytest.approx(0.344e12, rel=0.1)
    assert layer_sum(0, ("attn.core",)) == pytest.approx(0.069e12, rel=0.1)
    assert layer_sum(2, ("indexer.score",)) == pytest.approx(2.2e12, rel=0.1)
    assert layer_sum(20, ("indexer.score",)) == pytest.approx(4.4e12, rel=0.1)
    for layer in (24, 28, 32, 36):  # candidates only: 2,048 blocks x 8 entries, not all 131,072
        assert layer_sum(layer, ("indexer.score",)) == pytest.approx(0.55e12, rel=0.1)
    assert step_flops(cfg, 4096, 126976)["total"] == pytest.approx(152e12, rel=0.1)


def test_mfu_and_bad_arguments():
    assert mfu(1e12, 1.0, 1000.0) == pytest.approx(1.0)
    assert mfu(152e12, 400.0, 785.0) == pytest.approx(152e12 / 0.4 / 785e12)
    with pytest.raises(ValueError, match="ms_per_step"):
        mfu(1e12, 0.0, 1000.0)
    cfg = minidi.preset("tiny-v41")
    with pytest.raises(ValueError, match="new_tokens"):
        step_flops(cfg, 0, 0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        step_flops(cfg, 1000, 100)
    with pytest.raises(TypeError, match="ModelConfig"):
        step_flops("tiny-v41", 1, 0)
