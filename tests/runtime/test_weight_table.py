"""The checkpoint name table against the spec's counts and shapes, and the random generator against the table."""

from __future__ import annotations

import math
import re
import time

import pytest
import torch

from minidi.model.presets import preset
from minidi.model.quant import dequant_fp4, dequant_fp8, e8m0_to_float
from minidi.runtime.random_weights import dequant_fp8_rows, quantize_fp8_rows, random_state_dict
from minidi.runtime.weight_table import SCALE_KINDS, expected_tensors, is_skipped_name, scale_name, table_summary

TINY = ("tiny-v41", "tiny-v41-b", "tiny-v4")


@pytest.fixture(scope="module")
def v41():
    return expected_tensors(preset("v41-flash"))


@pytest.fixture(scope="module")
def v4():
    return expected_tensors(preset("v4-flash"))


def _layer_count(table, layer: int) -> int:
    return sum(1 for n in table if n.startswith(f"layers.{layer}."))


# ---- V4.1 release (spec V4.1 §12) --------------------------------------------------------------------------------
def test_v41_release_tensor_count(v41):
    # "text backbone 40×2,334 + 19 + 24 + 12 + 3 = 93,418"
    # hc, norms, sink, attn (5 FP8 pairs + 2 norms), gate, shared, experts
    per_layer = 6 + 2 + 1 + 12 + 3 + 6 + 384 * 3 * 2
    assert per_layer == 2334
    kv_extra = 4 * 4 + 3  # compressor wkv/norm + indexer wk/k_norm on 2/8/14/20, wgate on 2/8/14
    index_extra = 8 * 3  # indexer wq_b (+scale), weights_proj
    engram_extra = 2 * 6  # embed weight/scale, wkv weight/scale, q_weight, k_weight
    assert 40 * per_layer + kv_extra + index_extra + engram_extra + 3 == 93418
    assert len(v41) == 93418
    assert _layer_count(v41, 0) == 2334 and _layer_count(v41, 39) == 2334
    assert _layer_count(v41, 2) == 2334 + 5 + 3  # Full ratio-2: compressor wkv/wgate/norm, wk, k_norm; wq_b pair, wp
    assert _layer_count(v41, 20) == 2334 + 4 + 3  # Full ratio-1: no wgate
    assert _layer_count(v41, 24) == 2334 + 3  # Reindex
    assert _layer_count(v41, 14) == 2334 + 8 + 6  # Full + Engram
    assert _layer_count(v41, 1) == 2334 + 6


def test_v41_release_shapes(v41):
    shapes = {
        "embed.weight": (129280, 5120), "head.weight": (129280, 5120), "norm.weight": (5120,),
        "layers.0.hc_attn_fn": (24, 20480), "layers.0.hc_ffn_base": (24,), "layers.0.hc_ffn_scale": (3,),
        "layers.0.attn.attn_sink": (64,),
        "layers.0.attn.wq_a.weight": (1280, 5120), "layers.0.attn.wq_a.scale": (40, 160),
        "layers.0.attn.wq_b.weight": (32768, 1280), "layers.0.attn.wq_b.scale": (1024, 40),
        "layers.0.attn.wkv.scale": (16, 160), "layers.0.attn.kv_norm.weight": (512,),
        "layers.0.attn.wo_a.weight": (8192, 4096), "layers.0.attn.wo_a.scale": (256, 128),
        "layers.0.attn.wo_b.weight": (5120, 8192), "layers.0.attn.wo_b.scale": (160, 256),
        "layers.0.ffn.gate.weight": (384, 5120), "layers.0.ffn.gate.bias": (384,), "layers.0.ffn.gate.bias_vl": (384,),
        "layers.0.ffn.shared_experts.w1.scale": (72, 160), "layers.0.ffn.shared_experts.w2.scale": (160, 72),
        "layers.3.ffn.experts.7.w1.weight": (2304, 2560), "layers.3.ffn.experts.7.w1.scale": (2304, 160),
        "layers.3.ffn.experts.7.w2.weight": (5120, 1152), "layers.3.ffn.experts.7.w2.scale": (5120, 72),
        "layers.8.attn.compressor.wkv.weight": (512, 5120), "layers.8.attn.compressor.wgate.weight": (512, 5120),
        "layers.20.attn.compressor.norm.weight": (512,), "layers.20.attn.indexer.wk.weight": (128, 512),
        "layers.20.attn.indexer.k_norm.weight": (128,),
        "layers.36.attn.indexer.wq_b.weight": (4096, 1280), "layers.36.attn.indexer.wq_b.scale": (128, 40),
        "layers.36.attn.indexer.weights_proj.weight": (32, 5120),
        "layers.1.engram.embed.weight": (384006168, 256), "layers.1.engram.embed.scale": (384006168, 8),
        "layers.14.engram.embed.weight": (384016682, 256),
        "layers.14.engram.wkv.weight": (25600, 6144), "layers.14.engram.wkv.scale": (800, 192),
        "layers.1.engram.q_weight": (4, 5120), "layers.1.engram.k_weight": (4, 5120),
    }
    for name, shape in shapes.items():
        assert v41[name].shape == shape, name
    dtypes = {"layers.0.hc_attn_fn": torch.float32, "layers.0.attn.attn_sink": torch.float32,
              "layers.0.attn.wo_a.weight": torch.float8_e4m3fn, "layers.0.attn.wo_a.scale": torch.float8_e8m0fnu,
              "layers.3.ffn.experts.7.w2.weight": torch.int8, "layers.1.engram.embed.weight": torch.float8_e4m3fn,
              "layers.1.engram.embed.scale": torch.float8_e8m0fnu, "layers.1.engram.q_weight": torch.bfloat16,
              "layers.0.ffn.gate.bias_vl": torch.float32, "layers.20.attn.compressor.wkv.weight": torch.bfloat16}
    for name, dt in dtypes.items():
        assert v41[name].dtype == dt, name


def test_v41_release_schedule(v41):
    has = lambda suffix: sorted(int(n.split(".")[1]) for n in v41 if n.endswith(suffix))  # noqa: E731
    assert has("attn.compressor.wkv.weight") == [2, 8, 14, 20]
    assert has("attn.compressor.wgate.weight") == [2, 8, 14]
    assert has("attn.indexer.wk.weight") == [2, 8, 14, 20]
    assert has("attn.indexer.wq_b.weight") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert has("engram.wkv.weight") == [1, 14]
    # absent vs V4 (spec V4.1 §12)
    assert not [n for n in v41 if re.search(r"ape$|indexer\.compressor|tid2eid|hc_head", n)]


def test_v41_release_bytes(v41):
    # 18,800,640 bytes per routed expert (spec V4.1 §16)
    assert sum(v41[f"layers.0.ffn.experts.0.{w}.{k}"].nbytes for w in ("w1", "w2", "w3")
               for k in ("weight", "scale")) == 18_800_640
    s = table_summary(v41)
    assert s["I8"][0] == 40 * 384 * 3
    # Engram tables: "≈98.3 GB of values + 3.1 GB of scales each"
    for layer in (1, 14):
        assert round(v41[f"layers.{layer}.engram.embed.weight"].nbytes / 1e9, 1) == 98.3
        assert round(v41[f"layers.{layer}.engram.embed.scale"].nbytes / 1e9, 1) == 3.1
    # F8_E4M3: the spec's 204,015,223,296 is the whole checkpoint; the backbone holds 203,450,565,120. The remainder,
    # 564,658,176, is exactly 3 MTP stages of this layer's FP8 linears (attention + shared expert, 162,004,992 each)
    # plus one [5120, 3*5120] FP8 main_proj on stage 0 (V4.1 §12 names main_proj; its shape is our inference).
    fp8_layer = sum(t.numel for n, t in v41.items() if n.startswith("layers.0.") and t.dtype == torch.float8_e4m3fn)
    assert fp8_layer == 162_004_992
    assert s["F8_E4M3"][1] == 203_450_565_120
    assert 204_015_223_296 - s["F8_E4M3"][1] == 3 * fp8_layer + 5120 * 3 * 5120


# ---- V4 Flash (spec V4 §10.1, §11) -------------------------------------------------------------------------------
def test_v4_flash_counts(v4):
    assert 6 + 43 * 1565 + 21 * 11 + 20 * 4 + 1575 == 69187
    assert len(v4) == 69187 - 1575  # MTP (1,575) is not part of the backbone
    assert _layer_count(v4, 0) == 1565 and _layer_count(v4, 2) == 1565 + 11 and _layer_count(v4, 3) == 1565 + 4
    # spec dtype counts include mtp.0 (BF16 8, F32 11, F8_E4M3 10, I8 768, F8_E8M0 778, I64 0)
    s = table_summary(v4)
    counts = {k: v[0] for k, v in s.items()}
    assert counts == {"BF16": 433 - 8, "F32": 417 - 11, "F8_E4M3": 375 - 10, "I8": 33792 - 768,
                      "F8_E8M0": 34167 - 778, "I64": 3}


def test_v4_flash_shapes(v4):
    shapes = {
        "hc_head_fn": (4, 16384), "hc_head_base": (4,), "hc_head_scale": (1,), "layers.0.hc_attn_fn": (24, 16384),
        "layers.0.attn.wq_a.scale": (8, 32), "layers.0.attn.wq_b.weight": (32768, 1024),
        "layers.0.attn.wq_b.scale": (256, 8), "layers.0.attn.wkv.scale": (4, 32),
        "layers.0.attn.wo_a.weight": (8192, 4096), "layers.0.attn.wo_a.scale": (64, 32),
        "layers.0.attn.wo_b.scale": (32, 64), "layers.0.ffn.shared_experts.w1.scale": (16, 32),
        "layers.0.ffn.shared_experts.w2.scale": (32, 16), "layers.0.ffn.gate.tid2eid": (129280, 6),
        "layers.3.ffn.gate.bias": (256,), "layers.5.ffn.experts.255.w1.weight": (2048, 2048),
        "layers.5.ffn.experts.255.w1.scale": (2048, 128), "layers.5.ffn.experts.0.w2.weight": (4096, 1024),
        "layers.5.ffn.experts.0.w2.scale": (4096, 64),
        "layers.2.attn.compressor.ape": (4, 1024), "layers.2.attn.compressor.wkv.weight": (1024, 4096),
        "layers.2.attn.compressor.wgate.weight": (1024, 4096), "layers.2.attn.compressor.norm.weight": (512,),
        "layers.2.attn.indexer.wq_b.weight": (8192, 1024), "layers.2.attn.indexer.wq_b.scale": (64, 8),
        "layers.2.attn.indexer.weights_proj.weight": (64, 4096), "layers.2.attn.indexer.compressor.ape": (4, 256),
        "layers.2.attn.indexer.compressor.wkv.weight": (256, 4096),
        "layers.2.attn.indexer.compressor.norm.weight": (128,),
        "layers.3.attn.compressor.ape": (128, 512), "layers.3.attn.compressor.wgate.weight": (512, 4096),
    }
    for name, shape in shapes.items():
        assert v4[name].shape == shape, name
    assert v4["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    hash_layers = sorted(int(n.split(".")[1]) for n in v4 if n.endswith("tid2eid"))
    assert hash_layers == [0, 1, 2] and "layers.2.ffn.gate.bias" not in v4
    assert not [n for n in v4 if "bias_vl" in n or "engram" in n or "indexer.wk." in n]
    assert "layers.3.attn.indexer.wq_b.weight" not in v4  # HCA layers have no indexer


def test_tiny_v4_other_ratio():
    t = expected_tensors(preset("tiny-v4"))  # ratios (0, 4, 16, 4): non-4 ratios have no overlap
    assert t["layers.2.attn.compressor.ape"].shape == (16, 128)
    assert t["layers.2.attn.compressor.wkv.weight"].shape == (128, 256)
    assert t["layers.1.attn.compressor.ape"].shape == (4, 256)
    assert t["layers.1.attn.indexer.compressor.ape"].shape == (4, 256)
    assert t["layers.0.attn.wq_a.scale"].shape == (1, 2)  # ceil(128/128), ceil(256/128)


@pytest.mark.parametrize("name", TINY)
def test_tiny_table_consistent(name):
    cfg = preset(name)
    t = expected_tensors(cfg)
    for n, spec in t.items():
        if spec.kind in ("fp8_weight", "fp4_weight", "fp8_rows"):
            assert t[scale_name(n)].kind in SCALE_KINDS
    assert sum(s.kind in SCALE_KINDS for s in t.values()) == sum(
        s.kind in ("fp8_weight", "fp4_weight", "fp8_rows") for s in t.values())
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}.attn."
        assert (p + "compressor.wkv.weight" in t) == cfg.is_kv_source(layer)
        assert (p + "indexer.wq_b.weight" in t) == cfg.is_index_source(layer)
        assert (p + "indexer.wk.weight" in t) == cfg.owns_index_keys(layer)
        assert (f"layers.{layer}.ffn.gate.tid2eid" in t) == cfg.is_hash_layer(layer)
    assert not any(is_skipped_name(n) for n in t)
    assert is_skipped_name("mtp.0.e_proj.weight") and is_skipped_name("vision.blocks.0.w")
    assert is_skipped_name("aligner.proj.weight") and is_skipped_name("image_newline")


# ---- random weights ------------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def tiny_sd():
    """The draws of the tiny checkpoints (router bias 0.3·N: every tensor non-degenerate)."""
    return {name: random_state_dict(preset(name), seed=0, gate_bias="random") for name in TINY}


@pytest.mark.parametrize("name", TINY)
def test_default_gate_bias_is_zero_and_changes_nothing_else(name, tiny_sd):
    """Balanced routing by default: zero router biases; every other tensor is the gate_bias="random" draw's, bit for
    bit (the bias is drawn either way), so the old workload is one flag away."""
    cfg, old = preset(name), tiny_sd[name]
    sd = random_state_dict(cfg, seed=0)
    biases = [n for n in sd if n.endswith((".ffn.gate.bias", ".ffn.gate.bias_vl"))]
    assert biases and all(not sd[n].any() for n in biases) and all(old[n].std() > 0.1 for n in biases)
    assert all(torch.equal(_bits(sd[n]), _bits(old[n])) for n in sd if n not in biases)
    with pytest.raises(ValueError, match="gate_bias must be one of"):
        random_state_dict(cfg, gate_bias="uniform")


@pytest.mark.parametrize("name", TINY)
def test_random_matches_table(name, tiny_sd):
    cfg, sd = preset(name), tiny_sd[name]
    t = expected_tensors(cfg)
    assert list(sd) == list(t)
    for n, spec in t.items():
        assert tuple(sd[n].shape) == spec.shape and sd[n].dtype == spec.dtype, n
        assert torch.isfinite(e8m0_to_float(sd[n]) if spec.kind in SCALE_KINDS else sd[n].float()).all(), n


@pytest.mark.parametrize("name", TINY)
def test_random_non_degenerate(name, tiny_sd):
    cfg, sd = preset(name), tiny_sd[name]
    t = expected_tensors(cfg)
    for n, spec in t.items():
        x = sd[n]
        if ".experts." in n and not n.startswith(("layers.0.", f"layers.{cfg.n_layers - 1}.")):
            continue  # same code path for every layer; keep the test fast
        if spec.kind == "fp8_weight":
            w = dequant_fp8(x, sd[scale_name(n)], cfg.weight_block, torch.float32)
            assert abs(w.std().item() * math.sqrt(spec.shape[1]) - 1) < 0.1, n
        elif spec.kind == "fp4_weight":
            w = dequant_fp4(x, sd[scale_name(n)], torch.float32)
            assert abs(w.std().item() * math.sqrt(2 * spec.shape[1]) - 1) < 0.1, n
        elif spec.kind == "fp8_rows":
            w = dequant_fp8_rows(x, sd[scale_name(n)], torch.float32)
            assert abs(w.std().item() - 1) < 0.1, n
        elif spec.init == "norm":
            assert 0.1 < x.float().std() < 0.3 and abs(x.float().mean() - 1) < 0.1, n
        elif spec.init == "hc_scale":
            assert ((x >= 0.5) & (x <= 1.5)).all() and x.unique().numel() == x.numel(), n
        elif spec.init == "tid2eid":
            k = cfg.n_activated_experts
            assert ((x >= 0) & (x < cfg.n_routed_experts)).all()
            assert (x.sort(-1).values.diff(dim=-1) > 0).all()  # distinct ids per row
            assert x.unique(dim=0).shape[0] > 1 and x[:, 0].unique().numel() == cfg.n_routed_experts
            assert x.shape[1] == k
        elif spec.kind in ("bf16", "f32"):
            assert x.float().std() > 0.01 and x.unique().numel() >= min(x.numel(), 16), n


def test_random_deterministic_and_seeded(tiny_sd):
    cfg = preset("tiny-v41-b")
    a, b, c = (tiny_sd["tiny-v41-b"], random_state_dict(cfg, seed=0, gate_bias="random"),
               random_state_dict(cfg, seed=1, gate_bias="random"))
    assert all(torch.equal(_bits(a[n]), _bits(b[n])) for n in a)
    differ = [n for n in a if not torch.equal(_bits(a[n]), _bits(c[n]))]
    # every tensor changes with the seed (scales may coincide when the draws land in the same binade)
    assert set(differ) >= {n for n, s in expected_tensors(cfg).items() if s.kind not in SCALE_KINDS}


def test_share_experts_aliases(tiny_sd):
    cfg = preset("tiny-v41")
    sd = random_state_dict(cfg, share_experts=True)
    for layer in range(1, cfg.n_layers):
        for e in range(cfg.n_routed_experts):
            for k in ("w1.weight", "w2.scale", "w3.weight"):
                assert sd[f"layers.{layer}.ffn.experts.{e}.{k}"] is sd[f"layers.0.ffn.experts.{e}.{k}"]
    assert not torch.equal(sd["layers.1.attn.wq_a.weight"].view(torch.uint8),
                           sd["layers.0.attn.wq_a.weight"].view(torch.uint8))
    # Engram tables (630 and 834 rows) share one draw: the smaller is a row prefix of the larger
    t1, t4 = sd["layers.1.engram.embed.weight"], sd["layers.4.engram.embed.weight"]
    assert t1.shape == (630, 32) and t4.shape == (834, 32) and t1.data_ptr() == t4.data_ptr()
    unshared = tiny_sd["tiny-v41"]
    assert unshared["layers.1.ffn.experts.0.w1.weight"] is not unshared["layers.0.ffn.experts.0.w1.weight"]
    assert unshared["layers.1.engram.embed.weight"].data_ptr() != unshared["layers.4.engram.embed.weight"].data_ptr()


def test_quantize_fp8_rows_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q, s = quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (64, 3)
    back = dequant_fp8_rows(q, s, torch.float32)
    assert ((back - w).abs() <= w.abs() * 2**-4 + 1e-30).all()  # e4m3 has 3 mantissa bits
    # re-quantising the dequantised values reproduces them exactly (codes may differ where a block's amax rounded
    # down to the next binade, which halves its scale)
    q2, s2 = quantize_fp8_rows(back)
    assert torch.equal(dequant_fp8_rows(q2, s2, torch.float32), back)
    amax = w.view(64, 3, 32).abs().amax(-1)
    assert ((amax <= 448 * e8m0_to_float(s)) & (amax > 224 * e8m0_to_float(s))).all()  # tightest power of two


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["v41-flash", "v4-flash"])
def test_full_size_on_gpu(name):
    cfg = preset(name)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sd = random_state_dict(cfg, device="cuda", share_experts=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    t = expected_tensors(cfg)
    assert list(sd) == list(t)
    for n, spec in t.items():
        assert tuple(sd[n].shape) == spec.shape and sd[n].dtype == spec.dtype, n
    print(f"{name}: {dt:.1f} s, {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak")
    del sd
    torch.cuda.empty_cache()
