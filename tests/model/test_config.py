"""ModelConfig: parsing the released HF config.json of both models, layer roles, round trips and errors.

The fixtures under ``tests/fixtures`` are the released ``config.json`` files rebuilt key by key from spec V4.1 §1
and V4 §1 (V4.1: composite wrapper with ``text_config``; V4: flat). Expected layer roles are written out from the
spec tables (V4.1 §2, §15; V4 §1), not derived from the code under test.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from minidi.model.config import ModelConfig
from minidi.model.presets import PRESETS, preset

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
V41_JSON = FIXTURES / "deepseek_v41_flash_config.json"
V4_JSON = FIXTURES / "deepseek_v4_flash_config.json"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _assert_fields_equal(got: ModelConfig, want: ModelConfig) -> None:
    """Field by field (all but ``name``), so a failure names the field."""
    diffs = [
        f"{f.name}: got {getattr(got, f.name)!r}, want {getattr(want, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name != "name" and getattr(got, f.name) != getattr(want, f.name)
    ]
    assert not diffs, "\n".join(diffs)


# ---- released configs -> presets ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path, name", [(V41_JSON, "v41-flash"), (V4_JSON, "v4-flash")])
def test_release_config_matches_preset(path: Path, name: str) -> None:
    cfg = ModelConfig.from_hf_config(path)
    _assert_fields_equal(cfg, preset(name))
    assert cfg.arch == ("v41" if name == "v41-flash" else "v4")


def test_v41_fixture_is_the_composite_release_layout() -> None:
    """Guard the fixture itself against spec V4.1 §1 (the wrapper, extra schedule slots, both pad-id spellings)."""
    raw = _load(V41_JSON)
    assert raw["model_type"] == "deepseek_v41" and raw["image_token_id"] == 129264
    assert "fmt" not in raw["quantization_config"]
    assert raw["quantization_config"]["weight_block_size"] == [32, 32]
    text = raw["text_config"]
    assert text["compress_ratios"] == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    assert len(text["compress_ratios"]) == text["num_hidden_layers"] + text["num_nextn_predict_layers"]
    assert text["engram_pad_token_id"] == text["engram_pad_id"] == 2
    assert "num_hash_layers" not in text
    v4 = _load(V4_JSON)
    assert v4["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4, 0]
    assert v4["quantization_config"]["fmt"] == "e4m3"


def test_parsing_does_not_mutate_input() -> None:
    for path in (V41_JSON, V4_JSON):
        raw = _load(path)
        before = copy.deepcopy(raw)
        ModelConfig.from_hf_dict(raw)
        assert raw == before


@pytest.mark.parametrize("keys, want", [
    ({"engram_pad_token_id": 7}, 7),  # checkpoint spelling only
    ({"engram_pad_id": 5}, 5),  # HF / inference spelling only
    ({}, 2),  # neither: the released value
])
def test_v41_engram_pad_id_spellings(keys: dict[str, int], want: int) -> None:
    raw = _load(V41_JSON)
    del raw["text_config"]["engram_pad_token_id"], raw["text_config"]["engram_pad_id"]
    raw["text_config"].update(keys)
    assert ModelConfig.from_hf_dict(raw).engram_pad_id == want


def test_eos_list_takes_first() -> None:
    raw = _load(V4_JSON)
    raw["eos_token_id"] = [1, 7]
    assert ModelConfig.from_hf_dict(raw).eos_token_id == 1


def test_overrides_and_name() -> None:
    cfg = ModelConfig.from_hf_config(V41_JSON, dtype="float32", fake_quant=False, name="rel")
    assert (cfg.dtype, cfg.fake_quant, cfg.name) == ("float32", False, "rel")


# ---- layer roles -------------------------------------------------------------------------------------------------
def _layers(cfg: ModelConfig, pred) -> set[int]:
    return {layer for layer in range(cfg.n_layers) if pred(layer)}


def _v41_modes(cfg: ModelConfig) -> dict[int, str]:
    """CSA2 mode per layer from the role helpers (spec V4.1 §2: Full / Reindex / Reuse / SWA)."""
    modes = {}
    for layer in range(cfg.n_layers):
        if cfg.ratio(layer) == 0:
            modes[layer] = "swa"
        elif cfg.is_kv_source(layer):
            modes[layer] = "full"
        elif cfg.is_index_source(layer):
            modes[layer] = "reindex"
        else:
            modes[layer] = "reuse"
    return modes


def test_v41_release_layer_roles() -> None:
    """Spec V4.1 §2 table, written out."""
    cfg = ModelConfig.from_hf_config(V41_JSON)
    every = set(range(40))
    assert cfg.n_layers == 40 and len(cfg.compress_ratios) == 40  # 3 DSpark slots dropped
    assert _layers(cfg, lambda i: cfg.ratio(i) == 0) == {0, 1}
    assert _layers(cfg, lambda i: cfg.ratio(i) == 2) == set(range(2, 20))
    assert _layers(cfg, lambda i: cfg.ratio(i) == 1) == set(range(20, 40))
    assert _layers(cfg, cfg.is_kv_source) == {2, 8, 14, 20}
    assert _layers(cfg, cfg.is_index_source) == {2, 8, 14, 20, 24, 28, 32, 36}
    assert _layers(cfg, cfg.is_candidate_filtered) == {24, 28, 32, 36}
    assert _layers(cfg, cfg.owns_index_keys) == {2, 8, 14, 20}
    assert _layers(cfg, cfg.has_indexer) == every - {0, 1}  # every compressed layer attends to a top-k
    assert _layers(cfg, cfg.is_hash_layer) == set()
    assert cfg.candidate_source_layer == 20
    want = {0: "swa", 1: "swa"}
    want.update({i: "reuse" for i in range(2, 40)})
    want.update({i: "full" for i in (2, 8, 14, 20)})
    want.update({i: "reindex" for i in (24, 28, 32, 36)})
    assert _v41_modes(cfg) == want
    assert cfg.engram_layers == (1, 14)


def test_tiny_v41_layer_roles() -> None:
    """Spec V4.1 §15: 2 Full, 3 Reuse, 4 Full, 5 Reuse, 6 Full (candidate source), 7 Reuse, 8 Reindex, 9 Reuse."""
    cfg = preset("tiny-v41")
    assert _v41_modes(cfg) == {0: "swa", 1: "swa", 2: "full", 3: "reuse", 4: "full", 5: "reuse", 6: "full",
                               7: "reuse", 8: "reindex", 9: "reuse"}
    assert _layers(cfg, cfg.is_candidate_filtered) == {8}
    assert _layers(cfg, cfg.owns_index_keys) == {2, 4, 6}


def test_v4_release_layer_roles() -> None:
    """Spec V4 §1: SWA {0,1}, CSA (m=4, indexer) even 2..42, HCA (m=128, dense) odd 3..41, hash layers 0..2."""
    cfg = ModelConfig.from_hf_config(V4_JSON)
    csa, hca = set(range(2, 43, 2)), set(range(3, 42, 2))
    assert cfg.n_layers == 43 and len(cfg.compress_ratios) == 43  # MTP slot dropped
    assert len(csa) == 21 and len(hca) == 20
    assert _layers(cfg, lambda i: cfg.ratio(i) == 0) == {0, 1}
    assert _layers(cfg, lambda i: cfg.ratio(i) == 4) == csa
    assert _layers(cfg, lambda i: cfg.ratio(i) == 128) == hca
    assert _layers(cfg, cfg.is_kv_source) == csa | hca
    assert _layers(cfg, cfg.is_index_source) == csa
    assert _layers(cfg, cfg.has_indexer) == csa
    assert _layers(cfg, cfg.is_hash_layer) == {0, 1, 2}
    assert _layers(cfg, cfg.owns_index_keys) == set()
    assert _layers(cfg, cfg.is_candidate_filtered) == set()


@pytest.mark.parametrize("name, blocks", [("v41-flash", (32, 32, 32)), ("v4-flash", (128, 128, 32))])
def test_block_sizes(name: str, blocks: tuple[int, int, int]) -> None:
    cfg = preset(name)
    assert (cfg.weight_block, cfg.act_block, cfg.fp4_block) == blocks
    assert cfg.nope_head_dim == 448


# ---- round trips -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_to_hf_dict_round_trip(name: str) -> None:
    cfg = preset(name)
    d = cfg.to_hf_dict()
    d = json.loads(json.dumps(d))  # must be plain JSON
    _assert_fields_equal(ModelConfig.from_hf_dict(d), cfg)
    if cfg.is_v41:
        assert d["model_type"] == "deepseek_v41" and d["text_config"]["model_type"] == "deepseek_v41_text"
    else:
        assert d["model_type"] == "deepseek_v4"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_dir_as_path(name: str, tmp_path: Path) -> None:
    cfg = preset(name)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    from_dir = ModelConfig.from_hf_config(tmp_path)
    from_file = ModelConfig.from_hf_config(tmp_path / "config.json")
    from_str = ModelConfig.from_hf_config(str(tmp_path))
    for got in (from_dir, from_file, from_str):
        _assert_fields_equal(got, cfg)
    assert from_dir.name == str(tmp_path)


# ---- errors ------------------------------------------------------------------------------------------------------
def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf_config(tmp_path)  # empty dir
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf_config(tmp_path / "nope" / "config.json")


def test_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4", ')
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf_config(tmp_path)


@pytest.mark.parametrize("raw", [
    {"model_type": "deepseek_v3"},
    {"model_type": "llama", "num_hidden_layers": 2},
    {},
    {"model_type": "qwen2_vl", "text_config": {"model_type": "qwen2"}},
])
def test_unsupported_model_type(raw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "head_dim", "index_topk",
                                 "max_position_embeddings", "kv_source_layer_ids", "index_source_layer_ids"])
def test_v41_missing_required_key(key: str) -> None:
    raw = _load(V41_JSON)
    del raw["text_config"][key]
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("key", ["vocab_size", "moe_intermediate_size", "num_experts_per_tok", "compress_ratios"])
def test_v4_missing_required_key(key: str) -> None:
    raw = _load(V4_JSON)
    del raw[key]
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("path, get", [
    (V41_JSON, lambda raw: raw["text_config"]),
    (V4_JSON, lambda raw: raw),
])
def test_compress_ratios_too_short(path: Path, get) -> None:
    raw = _load(path)
    get(raw)["compress_ratios"] = get(raw)["compress_ratios"][:30]
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.from_hf_dict(raw)


def _v41_with(**text_changes: Any) -> dict[str, Any]:
    raw = _load(V41_JSON)
    raw["text_config"].update(text_changes)
    return raw


@pytest.mark.parametrize("changes, pattern", [
    ({"hidden_size": 5136}, r"dim=5136 .*multiple .*32"),
    ({"moe_intermediate_size": 2300}, r"moe_inter_dim=2300"),
    ({"q_lora_rank": 1270}, r"q_lora_rank=1270"),
    ({"head_dim": 496, "qk_rope_head_dim": 64}, r"head_dim"),
    ({"o_groups": 7}, r"o_groups"),
    ({"qk_rope_head_dim": 63}, r"rope_head_dim"),
    ({"num_experts_per_tok": 400}, r"n_activated_experts"),
    ({"scoring_func": "softmax"}, r"score_func"),
    ({"compress_ratios": [0, 0, 4] + [2] * 17 + [1] * 20}, r"ratio 4 not supported"),
    ({"kv_source_layer_ids": [1, 8, 14, 20]}, r"kv source layer 1"),
    ({"kv_source_layer_ids": [8, 14, 20]}, r"compressed layer 2 comes before any kv source"),
    ({"engram_num_embeddings": [384006168]}, r"engram"),
    ({"engram_head_dim": 200}, r"engram_head_dim"),
    ({"candidate_topk_blocks": 2, "candidate_block_size": 8, "index_topk": 512}, r"candidate_topk_blocks"),
])
def test_v41_invalid_values(changes: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_hf_dict(_v41_with(**changes))


@pytest.mark.parametrize("changes, pattern", [
    ({"hidden_size": 4160}, r"dim=4160 .*multiple .*128"),  # % 32 == 0 but not % 128 (V4 fq8 block)
    ({"index_head_dim": 96}, r"power of two"),
])
def test_v4_invalid_values(changes: dict[str, Any], pattern: str) -> None:
    raw = _load(V4_JSON)
    raw.update(changes)
    with pytest.raises(ValueError, match=pattern):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("changes, pattern", [
    ({"arch": "v5"}, r"arch must be one of"),
    ({"dtype": "float16"}, r"dtype"),
    ({"engram_layers": (1,), "engram_num_embeddings": (630,)}, r"V4 has no Engram"),
])
def test_direct_construction_errors(changes: dict[str, Any], pattern: str) -> None:
    base = "tiny-v4" if "engram_layers" in changes else "tiny-v41"
    with pytest.raises(ValueError, match=pattern):
        preset(base, **changes)


@pytest.mark.parametrize("name, ratios", [
    ("v41-flash", (0, 0) + (2,) * 18),  # shorter than n_layers
    ("tiny-v41", (0, 0, 2, 2)),
    ("v4-flash", (0, 0) + (4, 128) * 10),
    ("tiny-v41", (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1)),  # longer than n_layers
])
def test_compress_ratios_length_mismatch_is_a_clear_error(name: str, ratios: tuple[int, ...]) -> None:
    """Validation must report the length mismatch, not crash indexing the short schedule (IndexError)."""
    with pytest.raises(ValueError, match="compress_ratios has"):
        preset(name, compress_ratios=ratios)


def test_unknown_preset() -> None:
    with pytest.raises(KeyError, match="unknown preset"):
        preset("v5-flash")


def test_config_is_frozen_and_hashable() -> None:
    cfg = preset("tiny-v41")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 1  # type: ignore[misc]
    assert cfg == cfg.with_(name="other") and hash(cfg) == hash(preset("tiny-v41"))
    assert cfg.with_(dtype="float32").dtype == "float32"
