"""Loader hardening (issue 18): a checkpoint folder is untrusted input.

No index entry or symlink makes the loader read outside the folder; tensors in a shard that the index does not name
are reported; every decode error names its tensor, file or key; missing, unreadable and looping files are told
apart; ``tid2eid`` ids are checked; ``validate_values=True`` names NaN / Inf / E8M0-255 tensors.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import minidi
from minidi.runtime.checkpoint import INDEX_NAME, CheckpointError, load_checkpoint, tiny_checkpoint
from minidi.runtime.value_scan import scan_values
from tests.runtime.test_checkpoint import _edit_shard, _index, _shard_of


@pytest.fixture
def ckpt(tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("tiny-v41"), dst)
    return dst


def _write_index(path: Path, idx: dict) -> None:
    (path / INDEX_NAME).write_text(json.dumps(idx))


def _replace(path: Path, name: str, t: torch.Tensor) -> None:
    _edit_shard(path, _shard_of(path, name), lambda d: d.__setitem__(name, t))


def _edit_header(path: Path, shard: str, edit) -> None:
    """Rewrite a shard's JSON header after ``edit(dict)``; the data bytes stay as they are."""
    raw = (path / shard).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    (path / shard).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _problems(path: Path, **kw) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(path, **kw)
    return str(ei.value)


# ---- nothing outside the folder -----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink", "windows"])
def test_index_entries_outside_the_folder_are_refused(ckpt, tmp_path, monkeypatch, how):
    shard = _shard_of(ckpt, "layers.3.attn.wkv.weight")
    name = next(n for n, s in _index(ckpt)["weight_map"].items() if s == shard)  # listed first in the message
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(ckpt / shard, outside / shard)  # a valid shard: following the entry would load without complaint
    entry = {"absolute": str(outside / shard), "dotdot": f"../outside/{shard}", "symlink": "evil.safetensors",
             "windows": "C:\\outside\\x.safetensors"}[how]
    if how == "symlink":
        os.symlink(outside / shard, ckpt / entry)
    idx = _index(ckpt)
    for n, s in idx["weight_map"].items():
        if s == shard:
            idx["weight_map"][n] = entry
    _write_index(ckpt, idx)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    msg = _problems(ckpt)
    absolute = "is an absolute path (shards must be named relative to the checkpoint folder)"
    why = {"absolute": absolute, "dotdot": "climbs out of the checkpoint folder with '..'",
           "symlink": f"resolves outside the checkpoint folder (to {(outside / shard).resolve()})",
           "windows": absolute}[how]
    assert f"index entry {entry!r} {why}; refused for tensors" in msg and name in msg
    assert not any(str(outside) in p for p in opened)


def test_hugging_face_cache_symlinks_into_blobs_load(tmp_path):
    # <repo>/snapshots/<rev>/<file> -> ../../blobs/<sha>: the layout huggingface_hub downloads into
    src = tiny_checkpoint("tiny-v41")
    repo = tmp_path / "models--x--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, repo / "blobs" / f"sha{i}")
        os.symlink(f"../../blobs/sha{i}", snap / f.name)
    cfg, tensors = load_checkpoint(snap)
    assert cfg == minidi.preset("tiny-v41") and len(tensors) > 100


# ---- shards and index disagree ------------------------------------------------------------------------------------
def test_tensor_in_a_shard_but_not_in_the_index(ckpt):
    shard = _shard_of(ckpt, "layers.2.attn.wq_a.weight")
    other = _shard_of(ckpt, "head.weight")
    _edit_shard(ckpt, shard, lambda d: d.__setitem__("backdoor.weight", torch.zeros(2)))
    _edit_shard(ckpt, shard if shard != other else _shard_of(ckpt, "embed.weight"),
                lambda d: d.__setitem__("head.weight", torch.zeros(512, 256, dtype=torch.bfloat16)))
    msg = _problems(ckpt)
    assert f"unexpected tensors in shard {shard} that the index does not name" in msg
    assert "backdoor.weight" in msg and "head.weight" in msg


def test_duplicate_and_empty_index_entries(ckpt):
    text = (ckpt / INDEX_NAME).read_text()
    (ckpt / INDEX_NAME).write_text(text.replace('"weight_map": {', '"weight_map": {"norm.weight": "x", ', 1))
    assert "duplicate names ['norm.weight']" in _problems(ckpt)
    idx = json.loads(text)
    idx["weight_map"]["norm.weight"] = ""
    _write_index(ckpt, idx)
    assert "index entry '' is empty or holds a NUL byte; refused for tensors (1): norm.weight" in _problems(ckpt)


# ---- decode errors name the tensor --------------------------------------------------------------------------------
def test_shape_inconsistent_with_byte_length_names_the_tensor(ckpt):
    name = "layers.5.attn.wq_b.weight"
    shard = _shard_of(ckpt, name)
    _edit_header(ckpt, shard, lambda h: h[name].__setitem__("shape", [h[name]["shape"][0] + 1, h[name]["shape"][1]]))
    msg = _problems(ckpt)
    assert f"corrupt shard {shard}: SafetensorError" in msg and f"tensor {name}: shape [513, 128] of F8_E4M3" in msg


def test_offsets_past_the_end_name_the_tensor(ckpt):
    name = "layers.5.attn.wq_b.weight"
    shard = _shard_of(ckpt, name)
    raw = (ckpt / shard).read_bytes()
    (ckpt / shard).write_bytes(raw[:-100])  # a download cut short
    msg = _problems(ckpt)
    assert f"corrupt shard {shard}" in msg and "run past the end of the data" in msg and "truncated file?" in msg


def test_unknown_dtype_and_gap_name_the_tensor(ckpt):
    a, b = "layers.5.attn.wq_b.weight", "layers.5.attn.wq_b.scale"
    shard = _shard_of(ckpt, a)
    assert _shard_of(ckpt, b) == shard

    def edit(h):
        h[a]["dtype"] = "F9"
        h[b]["data_offsets"] = [h[b]["data_offsets"][0] + 1, h[b]["data_offsets"][1] + 1]

    _edit_header(ckpt, shard, edit)
    msg = _problems(ckpt)
    assert f"tensor {a}: unknown dtype 'F9'" in msg and f"tensor {b}:" in msg


# ---- config value types name the key ------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,why", [
    ("hidden_size", "256", "config.json key 'hidden_size' must be an int, got '256' (str)"),
    ("num_hidden_layers", 10.5, "config.json key 'num_hidden_layers' must be an int, got 10.5"),
    ("num_attention_heads", True, "config.json key 'num_attention_heads' must be an int, got True"),
    ("rms_norm_eps", float("nan"), "config.json key 'rms_norm_eps' must be a finite number"),
    ("compress_ratios", "0,0,2", "config.json key 'compress_ratios' must be a list of ints"),
    ("kv_source_layer_ids", 2, "config.json key 'kv_source_layer_ids' must be a list of ints"),
    ("rope_scaling", "yarn", "config.json key 'rope_scaling' must be an object"),
    ("sliding_window", 1, "window_size must be >= 2, got 1"),
    ("vocab_size", 0, "vocab_size must be >= 1, got 0"),
    ("index_topk", None, "config.json key 'index_topk' must be an int, got None"),
])
def test_config_value_types_name_the_key(ckpt, key, value, why):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"][key] = value
    (ckpt / "config.json").write_text(json.dumps(raw))
    msg = _problems(ckpt)
    assert "bad config.json" in msg and why in msg


def test_text_config_not_an_object(ckpt):
    (ckpt / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": [1]}))
    assert "config.json key 'text_config' must be an object, got list" in _problems(ckpt)


# ---- missing, unreadable, looping ---------------------------------------------------------------------------------
def test_missing_unreadable_looping_shards_are_told_apart(ckpt, monkeypatch):
    shards = sorted({*_index(ckpt)["weight_map"].values()})
    loop, broken, unreadable, directory = shards[:4]
    for s in (loop, broken, directory):
        (ckpt / s).unlink()
    os.symlink(loop, ckpt / loop)  # points at itself
    os.symlink("nowhere.safetensors", ckpt / broken)
    (ckpt / directory).mkdir()
    real_open = os.open

    def deny(p, *a, **k):  # the tests run as root, where chmod 000 does not stop a read
        if str(p).endswith(unreadable):
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real_open(p, *a, **k)

    monkeypatch.setattr(os, "open", deny)
    msg = _problems(ckpt)
    assert f"shard file {loop} is a symlink loop" in msg
    assert f"shard file {broken} is a broken symlink (to nowhere.safetensors)" in msg
    assert f"shard file {unreadable} is unreadable (Permission denied)" in msg
    assert f"shard file {directory} is not a regular file (a directory)" in msg
    assert "missing shard" not in msg and "corrupt" not in msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_shard_without_read_permission(ckpt):
    shard = _shard_of(ckpt, "head.weight")
    (ckpt / shard).chmod(0)
    assert f"shard file {shard} is unreadable (Permission denied)" in _problems(ckpt)


def test_looping_folder_config_and_index(tmp_path, ckpt):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    assert f"checkpoint folder {loop} is a symlink loop" in _problems(loop)
    with pytest.raises(CheckpointError, match="is a symlink loop"):
        minidi.load_model(str(loop))
    assert f"checkpoint folder {tmp_path / 'nope'} does not exist" in _problems(tmp_path / "nope")
    (ckpt / "config.json").unlink()
    os.symlink("config.json", ckpt / "config.json")
    (ckpt / INDEX_NAME).unlink()
    os.symlink(INDEX_NAME, ckpt / INDEX_NAME)
    msg = _problems(ckpt)
    assert "config.json is a symlink loop" in msg and f"{INDEX_NAME} is a symlink loop" in msg
    assert "missing config.json" not in msg and "no model.safetensors" not in msg


# ---- values ------------------------------------------------------------------------------------------------------
def test_tid2eid_out_of_range(tmp_path):
    path = tmp_path / "v4"
    shutil.copytree(tiny_checkpoint("tiny-v4"), path)
    name = "layers.0.ffn.gate.tid2eid"
    with safe_open(str(path / _shard_of(path, name)), framework="pt") as f:
        t = f.get_tensor(name)
    t[5, 0], t[9, 1] = 99, -1
    _replace(path, name, t)
    assert f"tid2eid expert ids outside [0, n_routed_experts=8) (1): {name} (min -1, max 99)" in _problems(path)


def test_validate_values_names_nan_inf_and_e8m0_255(ckpt):
    nan_w, inf_w, scale = "layers.1.attn_norm.weight", "layers.2.hc_attn_fn", "layers.3.attn.wq_a.scale"
    _, clean = load_checkpoint(ckpt, validate_values=True)  # the clean checkpoint passes the scan
    assert scan_values(clean) == []
    t = clean[nan_w].clone()
    t[7] = float("nan")
    _replace(ckpt, nan_w, t)
    t = clean[inf_w].clone()
    t[0, 3] = float("-inf")
    _replace(ckpt, inf_w, t)
    t = clean[scale].clone().view(torch.uint8)
    t[0, 0] = 255
    _replace(ckpt, scale, t.view(torch.float8_e8m0fnu))
    load_checkpoint(ckpt)  # off by default: structurally fine
    msg = _problems(ckpt, validate_values=True)
    assert "bad values in tensors (3)" in msg
    assert f"{nan_w}: 1 NaN value(s)" in msg and f"{inf_w}: 1 Inf value(s)" in msg
    assert f"{scale}: 1 E8M0 scale byte(s) 255 (NaN)" in msg
    with pytest.raises(CheckpointError, match="E8M0 scale byte"):
        minidi.load_model(str(ckpt), validate_values=True)
