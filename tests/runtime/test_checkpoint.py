"""Checkpoint write -> load round trips, the cached tiny checkpoint, and every loader error case."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minidi.model.presets import preset
from minidi.runtime.checkpoint import INDEX_NAME, CheckpointError, load_checkpoint, tiny_checkpoint, write_checkpoint
from minidi.runtime.random_weights import random_state_dict
from minidi.runtime.weight_table import expected_tensors

SHARD = 1 << 20  # 1 MiB shards: the tiny models span several files


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(_bits(a[n]), _bits(b[n])), n


@pytest.fixture(scope="module")
def sds() -> dict[str, dict[str, torch.Tensor]]:
    """seed-1 random tensors of each tiny preset (quantising the experts dominates the test time: make them once)."""
    return {name: random_state_dict(preset(name), seed=1, gate_bias="random")  # as tiny_checkpoint makes them
            for name in ("tiny-v41", "tiny-v41-b", "tiny-v4")}


@pytest.fixture(scope="module")
def base(tmp_path_factory, sds) -> tuple[Path, dict[str, torch.Tensor]]:
    """A written tiny-v41 checkpoint (copy it before changing anything) and its tensors."""
    sd = sds["tiny-v41"]
    path = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", preset("tiny-v41"), sd, max_shard_bytes=SHARD)
    return path, sd


@pytest.fixture
def ckpt(base, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(base[0], dst)
    return dst


def _index(path: Path) -> dict:
    return json.loads((path / INDEX_NAME).read_text())


def _shard_of(path: Path, name: str) -> str:
    return _index(path)["weight_map"][name]


def _edit_shard(path: Path, shard: str, edit) -> None:
    """Rewrite one shard file after ``edit(dict)`` changed its tensors (the index is left alone)."""
    with safe_open(str(path / shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path / shard))


def _add(path: Path, name: str, t: torch.Tensor, shard: str | None = None) -> None:
    """Add a tensor to a shard and to the index."""
    idx = _index(path)
    shard = shard or next(iter(idx["weight_map"].values()))
    _edit_shard(path, shard, lambda d: d.__setitem__(name, t))
    idx["weight_map"][name] = shard
    (path / INDEX_NAME).write_text(json.dumps(idx))


def _replace(path: Path, name: str, t: torch.Tensor) -> None:
    _edit_shard(path, _shard_of(path, name), lambda d: d.__setitem__(name, t))


def _remove(path: Path, name: str) -> None:
    _edit_shard(path, _shard_of(path, name), lambda d: d.pop(name))
    idx = _index(path)
    del idx["weight_map"][name]
    (path / INDEX_NAME).write_text(json.dumps(idx))


def _problems(path: Path, **kw) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(path, **kw)
    assert isinstance(ei.value, ValueError)
    return str(ei.value)


# ---- round trips ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v41-b", "tiny-v4"])
def test_round_trip(name, tmp_path, sds):
    cfg = preset(name)
    sd = sds[name]
    path = write_checkpoint(tmp_path / name, cfg, sd, max_shard_bytes=SHARD)
    idx = _index(path)
    shards = sorted({*idx["weight_map"].values()})
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in path.glob("*.safetensors")) == shards
    assert set(idx["weight_map"]) == set(sd)
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    cfg2, loaded = load_checkpoint(path)
    assert cfg2 == cfg
    _assert_bitwise_equal(sd, loaded)
    assert loaded["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert loaded["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn


def test_round_trip_shared_experts_and_single_file(tmp_path):
    cfg = preset("tiny-v41-b")
    sd = random_state_dict(cfg, share_experts=True)  # aliased tensors and views: the writer must copy them
    path = write_checkpoint(tmp_path / "one", cfg, sd, max_shard_bytes=None)
    assert not (path / INDEX_NAME).exists() and (path / "model.safetensors").is_file()
    _, loaded = load_checkpoint(path)
    _assert_bitwise_equal(sd, loaded)


def test_cfg_argument_overrides_config_json(base, ckpt):
    (ckpt / "config.json").unlink()
    cfg = preset("tiny-v41", dtype="float32")
    cfg2, loaded = load_checkpoint(ckpt, cfg=cfg)
    assert cfg2 is cfg and len(loaded) == len(base[1])


def test_tiny_checkpoint_cached(tmp_path, monkeypatch, sds):
    monkeypatch.setenv("MINIDI_CACHE", str(tmp_path / "cache"))
    p = tiny_checkpoint("tiny-v41-b", seed=1)
    assert p == tmp_path / "cache" / "tiny-v41-b-seed1"
    assert len(list(p.glob("model-*.safetensors"))) > 2
    assert [q.name for q in p.parent.iterdir()] == [p.name]  # no temp folders left behind
    stamp = (p / INDEX_NAME).stat().st_mtime_ns
    assert tiny_checkpoint("tiny-v41-b", seed=1) == p and (p / INDEX_NAME).stat().st_mtime_ns == stamp
    cfg, sd = load_checkpoint(p)
    _assert_bitwise_equal(sds["tiny-v41-b"], sd)
    # a cache whose config no longer matches the preset is rebuilt
    (p / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert tiny_checkpoint("tiny-v41-b", seed=1) == p
    assert load_checkpoint(p)[0] == preset("tiny-v41-b")
    # an explicit cache_dir is the same root
    stamp = (p / INDEX_NAME).stat().st_mtime_ns
    assert tiny_checkpoint("tiny-v41-b", seed=1, cache_dir=tmp_path / "cache") == p
    assert (p / INDEX_NAME).stat().st_mtime_ns == stamp


# ---- tolerated extras and the `only` filter ----------------------------------------------------------------------
def test_skips_mtp_vision_names(base, ckpt, caplog):
    extras = ["mtp.0.e_proj.weight", "mtp.2.markov_head.w", "vision.blocks.0.attn.qkv.weight", "aligner.proj.weight",
              "image_newline"]
    for n in extras:
        _add(ckpt, n, torch.zeros(2, 2))
    skipped: list[str] = []
    with caplog.at_level(logging.INFO, logger="minidi.runtime.checkpoint"):
        _, loaded = load_checkpoint(ckpt, skipped=skipped)
    assert sorted(skipped) == sorted(extras)
    assert not set(extras) & set(loaded) and len(loaded) == len(base[1])
    assert "skipped 5 tensors" in caplog.text


def test_only_filter(base, ckpt):
    def mine(n: str) -> bool:  # "rank 1 of 4": experts 2..3 of every layer, plus everything that is not an expert
        if ".ffn.experts." not in n:
            return True
        return int(n.split(".")[4]) in (2, 3)

    _remove(ckpt, "layers.5.ffn.experts.0.w1.weight")  # not ours: not reported missing
    _, loaded = load_checkpoint(ckpt, only=mine)
    assert set(loaded) == {n for n in base[1] if mine(n)}
    _assert_bitwise_equal({n: base[1][n] for n in loaded}, loaded)
    _remove(ckpt, "layers.5.ffn.experts.2.w1.weight")  # ours: missing
    msg = _problems(ckpt, only=mine)
    assert "layers.5.ffn.experts.2.w1.weight" in msg and "experts.0.w1" not in msg


# ---- error cases --------------------------------------------------------------------------------------------------
def test_missing_tensor(ckpt):
    _remove(ckpt, "layers.4.engram.embed.scale")
    msg = _problems(ckpt)
    assert "missing tensors (1): layers.4.engram.embed.scale" in msg


def test_unexpected_tensor(ckpt):
    _add(ckpt, "layers.3.attn.compressor.wkv.weight", torch.zeros(128, 256, dtype=torch.bfloat16))  # Reuse layer
    _add(ckpt, "model.layers.0.attn_norm.weight", torch.zeros(256, dtype=torch.bfloat16))  # HF-renamed
    msg = _problems(ckpt)
    assert "unexpected tensors (2)" in msg
    assert "layers.3.attn.compressor.wkv.weight" in msg and "model.layers.0.attn_norm.weight" in msg


def test_misshaped_tensor(ckpt):
    _replace(ckpt, "layers.2.attn.wq_b.scale", torch.zeros(16, 5, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    msg = _problems(ckpt)
    assert "layers.2.attn.wq_b.scale: [16, 4] -> [16, 5]" in msg


def test_wrong_dtype(ckpt):
    _replace(ckpt, "layers.0.attn_norm.weight", torch.ones(256))  # f32 instead of bf16
    _replace(ckpt, "layers.0.ffn.experts.1.w1.scale", torch.zeros(128, 8, dtype=torch.uint8))  # U8, not E8M0
    msg = _problems(ckpt)
    assert "layers.0.attn_norm.weight: BF16 -> F32" in msg
    assert "layers.0.ffn.experts.1.w1.scale: F8_E8M0 -> U8" in msg


def test_missing_shard_file(ckpt):
    shard = _shard_of(ckpt, "layers.6.attn.wkv.weight")
    (ckpt / shard).unlink()
    msg = _problems(ckpt)
    assert f"missing shard file {shard}" in msg and "layers.6.attn.wkv.weight" in msg


def test_index_entry_absent_from_shard(ckpt):
    name = "layers.7.ffn.gate.bias"
    _edit_shard(ckpt, _shard_of(ckpt, name), lambda d: d.pop(name))  # index still lists it
    msg = _problems(ckpt)
    assert f"absent from shard {_shard_of(ckpt, name)}" in msg and name in msg


@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_corrupt_shard(ckpt, how):
    shard = _shard_of(ckpt, "layers.9.attn.wo_b.weight")
    f = ckpt / shard
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if how == "truncate" else b"\x00\x01not a safetensors file" * 3)
    msg = _problems(ckpt)
    assert f"corrupt shard {shard}" in msg


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": {"a": 3}}', "[]"])
def test_bad_index(ckpt, text):
    (ckpt / INDEX_NAME).write_text(text)
    msg = _problems(ckpt)
    assert INDEX_NAME in msg and ("unreadable" in msg or "malformed" in msg)


def test_missing_config_and_weights(ckpt):
    (ckpt / "config.json").unlink()
    assert "missing config.json" in _problems(ckpt)
    for p in ckpt.glob("*.safetensors*"):
        p.unlink()
    msg = _problems(ckpt)
    assert "missing config.json" in msg and "no model.safetensors.index.json and no model.safetensors" in msg


def test_many_problems_reported_together(ckpt):
    _remove(ckpt, "head.weight")
    _remove(ckpt, "layers.1.engram.q_weight")
    _replace(ckpt, "layers.1.hc_attn_fn", torch.zeros(24, 100))
    _replace(ckpt, "layers.8.attn.indexer.weights_proj.weight", torch.zeros(8, 256, dtype=torch.float16))
    _add(ckpt, "layers.0.ffn.experts.8.w1.weight", torch.zeros(128, 128, dtype=torch.int8))  # expert 8 of 8
    shard = _shard_of(ckpt, "layers.9.attn.wo_b.weight")
    (ckpt / shard).write_bytes(b"junk")
    msg = _problems(ckpt)
    assert "missing tensors" in msg and "head.weight" in msg and "layers.1.engram.q_weight" in msg
    assert "layers.1.hc_attn_fn: [24, 1024] -> [24, 100]" in msg
    assert "layers.8.attn.indexer.weights_proj.weight: BF16 -> F16" in msg
    assert "unexpected tensors (1): layers.0.ffn.experts.8.w1.weight" in msg
    assert f"corrupt shard {shard}" in msg
    assert msg.count("\n  - ") == 5  # one line per problem category / shard


def test_table_matches_loaded_names(base):
    # the loader returns names in table order, so model.load_state_dict sees the official names
    cfg = preset("tiny-v41")
    assert list(base[1]) == list(expected_tensors(cfg))


@pytest.mark.gpu
def test_load_onto_gpu(base):
    cfg, loaded = load_checkpoint(base[0], device="cuda")
    assert all(t.is_cuda for t in loaded.values())
    _assert_bitwise_equal(base[1], {n: t.cpu() for n, t in loaded.items()})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a CUDA device")
@pytest.mark.parametrize("what", ["tiny-v41", "v41-flash"])
def test_cuda_without_a_gpu_is_a_plain_error(what):
    import minidi

    with pytest.raises(RuntimeError, match=r"no CUDA device is available \(torch.cuda.is_available\(\) is False\); "
                                           r"use device='cpu'"):
        minidi.load_model(what, device="cuda")
