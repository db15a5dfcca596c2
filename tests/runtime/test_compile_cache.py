"""The compile cache (``minidi.compile(..., compile_cache=DIR)``, ``runtime/compile_cache.py``).

- A cold run in one process saves the entry (with the layer's graph precompiled: ``runtime/precompiled.py``); a
  fresh process with an empty Inductor cache folder loads it, calls the precompiled graph without Dynamo (no
  tracing, no passes: the entry's counts, checked against the expected sites) and returns bitwise the same logits.
  A corrupted artifact or precompiled-graph file is detected, not loaded, and the entry rebuilt.
- A different key (other passes, a changed config field) never reads another key's entry, and the miss says which
  fields differ; a manifest that does not vouch for its folder's key or artifacts is a miss.

The end-to-end test compiles a one-layer tiny V4.1 with Inductor in child processes (~1.5 min on 2 cores: one
cold compile, one warm start that still runs the C++ compiler on a fresh folder, one cheap rebuild); the rest needs
no compile. Also: the stage markers' switch (a global the graphs depend on, whose guard a precompiled graph cannot
keep) is part of the key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

import minidi
from minidi.runtime.compile_cache import ARTIFACTS, MANIFEST, PRECOMPILED, CompileCache, differing, key_fields

ROOT = Path(__file__).resolve().parents[2]


def one_layer_model() -> torch.nn.Module:
    from minidi.runtime.build import model_from_tensors
    from minidi.runtime.random_weights import random_state_dict

    cfg = minidi.preset("tiny-v41", n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                        candidate_source_layer=-1, engram_layers=(), engram_num_embeddings=()).with_(name="cc-v41")
    return model_from_tensors(cfg, random_state_dict(cfg, seed=1), "cpu")


def fields_of(model, passes=("A", "C"), **kw) -> dict:
    args = dict(passes=list(passes), strict=True, op_backend="auto", faithful_rounding=True,
                codegen={"autotune": False, "cpu_simd": False}, dynamic=True,
                regional=True, fullgraph=True, backend="inductor", compile_kwargs={})
    return key_fields(model, **{**args, **kw})


def write_entry(cache: CompileCache, blob: bytes, sha: str | None = None, fields: dict | None = None,
                **extra: object) -> None:
    cache.path.mkdir(parents=True, exist_ok=True)
    (cache.path / ARTIFACTS).write_bytes(blob)
    manifest = {"fields": fields or cache.fields, "artifacts_sha256": sha or hashlib.sha256(blob).hexdigest(),
                **extra}
    (cache.path / MANIFEST).write_text(json.dumps(manifest))


# ---- keys and stale entries (no compile) ----------------------------------------------------------------------
def test_key_changes_with_passes_config_and_settings():
    model = one_layer_model()
    base = fields_of(model)
    assert CompileCache("x", base).key == CompileCache("x", fields_of(model)).key  # deterministic
    other_cfg = fields_of(type(model)(model.cfg.with_(window_size=8)))
    for other, field in [(fields_of(model, passes=("A",)), "passes"), (other_cfg, "config.window_size"),
                         (fields_of(model, faithful_rounding=False), "faithful_rounding"),
                         (fields_of(model, regional=False), "regional"), (fields_of(model, op_backend="ref"),
                                                                          "op_backend"),
                         (fields_of(model, codegen={"autotune": True, "cpu_simd": False}), "codegen.autotune"),
                         (fields_of(model, codegen={"autotune": False, "cpu_simd": True}), "codegen.cpu_simd")]:
        assert CompileCache("x", other).key != CompileCache("x", base).key, field
        assert differing(base, other) == [field]
    for name in ("minidi_source", "torch", "triton", "python", "device", "device_name", "TRITON_INTERPRET"):
        assert name in base
    from minidi.model import stages

    was = stages.enabled()
    try:
        stages.enabled(not was)  # traced graphs hold the markers or not: another key
        assert differing(base, fields_of(model)) == ["stage_markers"]
    finally:
        stages.enabled(was)


def test_other_key_is_a_miss_naming_the_fields(tmp_path, caplog):
    model = one_layer_model()
    write_entry(CompileCache(tmp_path, fields_of(model, passes=("A",))), b"never read")
    cache = CompileCache(tmp_path, fields_of(model))
    with caplog.at_level(logging.INFO, logger="minidi.compile"):
        assert cache.load() == "miss"
    assert "no entry for this key (the folder's nearest entry differs in: passes)" in cache.reason
    assert "compile cache miss" in caplog.text and "passes" in caplog.text


def test_corrupted_or_foreign_entries_are_misses(tmp_path):
    model = one_layer_model()
    cache = CompileCache(tmp_path, fields_of(model))
    write_entry(cache, b"artifacts", sha=hashlib.sha256(b"other bytes").hexdigest())
    assert cache.load() == "miss" and cache.reason.startswith("corrupted entry"), cache.reason
    write_entry(cache, b"not torch's format")  # the hash vouches for the bytes, torch refuses them
    assert cache.load() == "miss" and "stale entry: torch" in cache.reason, cache.reason
    write_entry(cache, b"x", fields=fields_of(model, passes=("A",)))  # a manifest of another key in this folder
    assert cache.load() == "miss" and cache.reason == "stale entry: key fields differ from its manifest (passes)"
    (cache.path / MANIFEST).write_text("{not json")
    assert cache.load() == "miss" and "manifest unreadable" in cache.reason
    # precompiled graphs the manifest vouches for: absent, or other bytes than it recorded
    write_entry(cache, b"x", precompiled_sha256=hashlib.sha256(b"graphs").hexdigest())
    assert cache.load() == "miss" and cache.reason == f"stale entry: {PRECOMPILED} unreadable (FileNotFoundError)"
    (cache.path / PRECOMPILED).write_bytes(b"other graphs")
    assert cache.load() == "miss" and cache.reason == (f"corrupted entry: {PRECOMPILED} does not match the sha256 "
                                                       "its manifest recorded")
    assert cache.precompiled is None


def test_new_triton_kernels_are_packed_and_unpacked_inside_the_folder(tmp_path, monkeypatch):
    """minidi's own Triton kernels (their JIT cache folders written during the first step) travel with the entry;
    unpacking writes only ``<kernel>/<file>`` inside the target folder."""
    import io
    import tarfile

    from minidi.runtime.compile_cache import _pack_kernels, _unpack_kernels, triton_dir

    src = tmp_path / "triton_a"
    (src / "old").mkdir(parents=True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(src))
    cache = CompileCache(tmp_path / "cc", {"k": 1})
    assert triton_dir(torch.device("cpu")) == src
    (src / "new").mkdir()
    (src / "new" / "kernel.so").write_bytes(b"\x7fELF")
    (src / "new" / "lock").write_text("")
    data, n = _pack_kernels(src, cache._triton_before)
    assert n == 1
    buf = io.BytesIO(data)  # add a member that tries to leave the folder
    with tarfile.open(fileobj=buf, mode="a") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    dest = tmp_path / "triton_b"
    _unpack_kernels(buf.getvalue(), dest)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == ["new/kernel.so"]
    assert not (tmp_path / "escape").exists()


# ---- a save, then warm starts in fresh processes ----------------------------------------------------------------
def _child(out: str, cache_dir: str, workers: str = "0") -> None:
    """Run in a child process: compile the one-layer model with a compile cache (its layer kind in ``workers``
    compile worker processes, or here), two steps from an empty cache each, save the second step's logits (the
    first runs the layers eagerly where a worker compiles them)."""
    from minidi.model.context import ModelCache, StepMeta
    from minidi.runtime.compile import dynamic_shape_config

    torch.manual_seed(0)
    model = one_layer_model()
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    meta = StepMeta.for_sequence(ids, cfg.window_size, model.ratios, 0)
    step = minidi.compile(model, "all", strict=True, regional=True, compile_cache=cache_dir,
                          compile_workers=int(workers))
    with torch.no_grad(), dynamic_shape_config():
        step(meta, ModelCache())
        logits = step(meta, ModelCache())
    from torch._dynamo.utils import counters

    torch.save(logits, out)
    print(json.dumps({"cache": step.compile_cache.summary(), "counts": step.counts, "compile_s": step.compile_s,
                      "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
                      "aot_hits": counters["aot_autograd"]["autograd_cache_hit"]}))


def run_child(tmp: Path, name: str, inductor_dir: str, workers: int = 0) -> dict:
    """The children run without the Triton interpreter: the graph, its passes and the cache entry are the same, the
    inserted ops run their references (``op_backend="auto"``) instead of ~12 s of interpreted kernels per child."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp / inductor_dir),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "tests.runtime.test_compile_cache", str(tmp / f"{name}.pt"),
                        str(tmp / "cc"), str(workers)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["log"] = p.stderr
    res["logits"] = torch.load(tmp / f"{name}.pt")
    return res


def test_save_then_warm_start_in_fresh_processes(tmp_path):
    # the cold start compiles its layer kind and head in a compile worker: the entry holds the worker's artifacts
    cold = run_child(tmp_path, "cold", "inductor_a", workers=1)
    assert cold["cache"]["status"] == "miss" and cold["cache"]["saved"], cold["cache"]
    assert cold["cache"]["artifact_bytes"] > 0 and "compile cache saved" in cold["log"]
    assert "compiled in worker 0" in cold["log"] and "compile workers' artifact sets" in cold["log"]
    assert cold["counts"] == {"A": 1, "B": 0, "C": 1, "D": 3, "E": 1, "F": 2, "J": 2, "K": 2, "G": 2, "H": 1,
                              "I": 1, "L": 2, "M": 0, "T": 0, "N": 8, "R": 2, "O": 1, "P": 1, "Q": 1, "S": 0, "V": 0}
    # a fresh process and an empty Inductor folder: everything it skips comes from the saved entry
    warm = run_child(tmp_path, "warm", "inductor_b")
    assert warm["cache"]["status"] == "hit" and not warm["cache"]["saved"], warm["cache"]
    # the layer's graph and the head's were precompiled: loaded and called without Dynamo (no tracing, no passes,
    # no caches asked)
    assert "2 precompiled graph(s) loaded" in warm["log"] and "dynamo" not in warm["compile_s"], warm["compile_s"]
    assert warm["fx_hits"] == 0 and warm["aot_hits"] == 0 and warm["compile_s"]["passes"] == 0
    assert warm["counts"] == cold["counts"]  # the entry's per-layer counts, checked against the expected sites
    assert torch.equal(warm["logits"], cold["logits"])  # bitwise
    # a corrupted artifact file: detected, not loaded, rebuilt in this process (no workers; from inductor_b's local
    # caches: cheap) and rewritten
    entry = Path(cold["cache"]["path"])
    blob = bytearray((entry / ARTIFACTS).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (entry / ARTIFACTS).write_bytes(bytes(blob))
    again = run_child(tmp_path, "again", "inductor_b")
    assert again["cache"]["status"] == "miss" and again["cache"]["reason"].startswith("corrupted entry")
    assert again["cache"]["saved"] and "compile cache miss: corrupted entry" in again["log"]
    assert again["counts"] == cold["counts"] and torch.equal(again["logits"], cold["logits"])
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["artifacts_sha256"] == hashlib.sha256((entry / ARTIFACTS).read_bytes()).hexdigest()
    assert manifest["counts"] == cold["counts"]


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("minidi.compile").setLevel(logging.INFO)
    _child(*sys.argv[1:4])
