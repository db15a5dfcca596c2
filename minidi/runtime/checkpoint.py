"""Checkpoint I/O in the real HF layout: ``config.json`` + sharded safetensors + ``model.safetensors.index.json``.

- ``write_checkpoint``: shard a state dict the way the release is laid out (official names, no ``model.`` prefix).
- ``tiny_checkpoint``: the embedded default model, written once into a cache folder (atomically) and reused.
- ``load_checkpoint``: stream tensors shard by shard (headers checked with ``safe_open``; bytes read by
  ``stream_load.TensorReader`` straight into the device tensor, one at a time, in file order), validate against
  ``expected_tensors(cfg)`` and raise ONE ``CheckpointError`` listing every problem.
  MTP / DSpark / vision names (``weight_table.SKIPPED_PREFIXES``) are skipped, not unexpected.

A checkpoint folder is untrusted input (a 290 GB download can be damaged or hostile): the loader reads only files
inside the folder (index entries that are absolute or climb out with ``..`` are refused; a symlinked shard must
resolve inside the folder or, for the Hugging Face cache layout ``<repo>/snapshots/<rev>/``, inside ``<repo>/blobs``),
reports tensors in a shard that the index does not name, names the tensor or file in every decode error (the
header is re-parsed to say which entry is bad), tells a missing file from an unreadable one or a symlink loop, and
checks ``tid2eid`` ids. ``validate_values=True`` also scans every value (NaN / Inf, E8M0 scale byte 255), see
``scan_values``.

The folder's files (probes, index paths, the weight map) are checked in ``checkpoint_files.py``; the header
diagnosis, the value scan and the byte streaming live in ``safetensors_header.py``, ``value_scan.py``,
``stream_load.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minidi.model.config import ModelConfig
from minidi.model.presets import preset
from minidi.runtime.checkpoint_files import (INDEX_NAME, SINGLE_NAME, allowed_roots, header_detail, named_list,
                                            outside_folder, probe, probe_dir, read_json_file, read_weight_map)
from minidi.runtime.value_scan import scan_values
from minidi.runtime import tiny_tokenizer
from minidi.runtime.stream_load import TensorReader
from minidi.runtime.weight_table import TensorSpec, expected_tensors, is_skipped_name

log = logging.getLogger(__name__)


ST_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}


class CheckpointError(ValueError):
    """Everything wrong with a checkpoint, in one message; ``problems`` holds one line per problem."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__(f"checkpoint {path}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))


# ---- writing --------------------------------------------------------------------------------------------------------
def _shard_file(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_checkpoint(
    path: str | Path,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int | None = 4 << 30,
) -> Path:
    """Write ``config.json``, ``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``.

    Tensors are packed greedily in dict order into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard
    of its own). ``max_shard_bytes=None`` writes one ``model.safetensors`` without an index. Returns ``path``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nb = t.numel() * t.element_size()
        if max_shard_bytes is not None and groups[-1] and size + nb > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nb
    files = [SINGLE_NAME] if max_shard_bytes is None else [_shard_file(i + 1, len(groups)) for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    for fname, names in zip(files, groups):
        save_file(_host_copies(tensors, names), str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    if max_shard_bytes is not None:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return path


def _host_copies(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, non-aliasing tensors for one shard (safetensors refuses tensors that share storage; views
    into per-layer expert stacks and shared-expert aliases are copied, one shard at a time)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for n in names:
        t = tensors[n].detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[n] = t
    return out


# ---- the embedded default -------------------------------------------------------------------------------------------
def default_cache_root() -> Path:
    """``$MINIDI_CACHE`` or ``~/.cache/minidi``."""
    env = os.environ.get("MINIDI_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "minidi"


def tiny_checkpoint(preset_name: str = "tiny-v41", seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """Path of a random-weight checkpoint of ``preset_name`` (``<cache>/<preset>-seed<seed>``), made on first use.

    Written into a temp folder and renamed into place, so a reader never sees a half-written checkpoint and
    concurrent writers do not clash. A cached copy whose config.json differs from the current preset is rebuilt.
    Several small shards even for the tiny model, so the sharded path is always exercised.
    """
    from minidi.runtime.random_weights import random_state_dict  # generator only needed on a cache miss

    cfg = preset(preset_name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / f"{preset_name}-seed{seed}"
    want = json.dumps(cfg.to_hf_dict(), sort_keys=True)
    if (final / INDEX_NAME).is_file() and _config_text(final) == want and tiny_tokenizer.is_current(final):
        return final  # (a cache from before the tokenizer shipped, or of an older one, is rebuilt)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        # gate_bias pinned to the draw these checkpoints were always made with: their tensors (and the goldens
        # pinned on them) do not move with random_state_dict's balanced default
        write_checkpoint(tmp, cfg, random_state_dict(cfg, seed=seed, gate_bias="random"), max_shard_bytes=2 << 20)
        tiny_tokenizer.write_tiny_tokenizer(tmp)  # tokenizer.json + tokenizer_config.json, as a release has
        if final.exists():  # stale (preset changed): move aside, then swap in
            old = root / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            try:
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            except OSError:
                pass  # another process moved it first
        try:
            tmp.rename(final)
        except OSError:
            if not ((final / INDEX_NAME).is_file() and _config_text(final) == want
                    and tiny_tokenizer.is_current(final)):
                raise  # not a benign race with an identical writer
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _config_text(path: Path) -> str | None:
    try:
        return json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True)
    except (OSError, ValueError):
        return None


# ---- loading --------------------------------------------------------------------------------------------------------
def load_checkpoint(
    path: str | Path,
    cfg: ModelConfig | None = None,
    device: torch.device | str = "cpu",
    only: Callable[[str], bool] | None = None,
    skipped: list[str] | None = None,
    validate_values: bool = False,
    reader: TensorReader | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load and validate a checkpoint folder; returns ``(cfg, {official name: tensor on device})``.

    cfg: overrides ``config.json`` (which is then optional); otherwise read with ``ModelConfig.from_hf_config``.
    only: predicate on names; tensors it rejects are neither read nor reported missing (e.g. one rank's experts).
    skipped: if given, receives the names skipped as outside the text backbone (``mtp.``, ``vision.``, ...).
    validate_values: also scan every loaded value (``scan_values``: NaN / Inf, E8M0 scale byte 255); off by default
    because it reads every byte (minutes at full size).
    reader: streams the validated tensors to their device (``stream_load.TensorReader``; default one for ``device``:
    each tensor goes from its shard straight to ``device``, host memory bounded, progress lines for long loads).
    Raises ``CheckpointError`` (a ValueError) listing every problem: missing / unexpected / misshaped / wrong-dtype
    tensors, missing, unreadable, looping or corrupt shard files (naming the tensor entry where the header is bad),
    names in the index absent from their shard and tensors in a shard absent from the index, index entries outside
    the folder, bad index or config (naming the key), ``tid2eid`` ids outside the experts, bad values when asked.
    """
    path = Path(path)
    problems: list[str] = []
    bad_dir = probe_dir(path)
    if bad_dir:
        raise CheckpointError(path, [bad_dir])
    if cfg is None:
        if not os.path.lexists(path / "config.json"):
            problems.append(f"missing config.json in {path}")
        elif read_json_file(path, "config.json", problems):
            try:
                cfg = ModelConfig.from_hf_config(path)
            except Exception as e:  # noqa: BLE001 - any malformed value: report it with the rest
                problems.append(f"bad config.json: {e}")
    table: dict[str, TensorSpec] | None = expected_tensors(cfg) if cfg is not None else None
    wanted = (lambda n: True) if only is None else only
    weight_map = read_weight_map(path, problems)
    reader = reader if reader is not None else TensorReader(device)
    if table is not None:
        reader.begin(sum(table[n].nbytes for n in weight_map or {} if n in table and wanted(n)))

    out: dict[str, torch.Tensor] = {}
    skip: list[str] = []
    unexpected: list[str] = []
    misshaped: list[str] = []
    wrong_dtype: list[str] = []
    by_shard: dict[str, list[str]] = {}
    for name, shard in (weight_map or {}).items():
        by_shard.setdefault(shard, []).append(name)
    roots = allowed_roots(path)
    for shard, names in by_shard.items():
        todo = []
        for n in names:
            if is_skipped_name(n):
                skip.append(n)
            elif not wanted(n):
                continue
            elif table is not None and n not in table:
                unexpected.append(n)
            else:
                todo.append(n)
        outside = outside_folder(path, shard, roots)
        if outside is not None:  # checked before touching the file: never read outside the folder
            problems.append(named_list(f"index entry {shard!r} {outside}; refused for tensors", names))
            continue
        fpath = path / shard
        why = probe(fpath)
        if why is not None and not todo:
            continue  # nothing needed from it (only skipped / other ranks' tensors): as before, not an error
        if why is not None:
            title = (f"index points at missing shard file {shard} for tensors" if why == "is missing"
                     else f"shard file {shard} {why}; cannot read tensors")
            problems.append(named_list(title, todo))
            continue
        try:
            _read_shard(fpath, set(names), todo, table, wanted, device, out, misshaped, wrong_dtype, problems,
                        reader)
        except Exception as e:  # noqa: BLE001 - header/truncation errors come as SafetensorError, OSError, ...
            problems.append(f"corrupt shard {shard}: {header_detail(fpath, e)}")

    reader.finish()
    if table is not None and weight_map is not None:
        listed = set(weight_map)
        missing = [n for n in table if n not in listed and wanted(n)]
        if missing:
            problems.append(named_list("missing tensors", missing))
    if unexpected:
        problems.append(named_list("unexpected tensors", unexpected))
    if misshaped:
        problems.append(named_list("misshaped tensors (name: expected -> got)", misshaped))
    if wrong_dtype:
        problems.append(named_list("wrong dtype (name: expected -> got)", wrong_dtype))
    if cfg is not None:
        problems.extend(_check_tid2eid(cfg, out))
    if validate_values:
        problems.extend(scan_values(out))
    if skip:
        prefixes = sorted({n.split(".")[0] for n in skip})
        log.info("skipped %d tensors outside the text backbone (%s)", len(skip), ", ".join(prefixes))
        if skipped is not None:
            skipped.extend(skip)
    if problems:
        raise CheckpointError(path, problems)
    assert cfg is not None and table is not None
    return cfg, {n: out[n] for n in table if n in out}


def _read_shard(
    fpath: Path,
    indexed: set[str],
    names: list[str],
    table: dict[str, TensorSpec] | None,
    wanted: Callable[[str], bool],
    device: torch.device | str,
    out: dict[str, torch.Tensor],
    misshaped: list[str],
    wrong_dtype: list[str],
    problems: list[str],
    reader: TensorReader,
) -> None:
    """Check each tensor's header entry against the table, then materialise it on ``device`` (one at a time).

    ``indexed``: every name the index puts in this shard; other tensors found in it are reported (a shard holding
    tensors that the index does not know is a mixed-up or tampered download, and they would be silently ignored)."""
    dev = str(torch.device(device))
    shard = fpath.name
    with safe_open(str(fpath), framework="pt", device=dev) as f, reader.shard(fpath) as r:
        present = set(f.keys())
        absent = [n for n in names if n not in present]
        if absent:
            problems.append(named_list(f"tensors named in the index but absent from shard {shard}", absent))
        extra = sorted(n for n in present - indexed if not is_skipped_name(n) and wanted(n))
        if extra:
            problems.append(named_list(f"unexpected tensors in shard {shard} that the index does not name", extra))
        for n in r.file_order(names):  # sequential reads
            if n not in present:
                continue
            if table is not None:
                try:
                    sl = f.get_slice(n)
                    shape, dt = tuple(sl.get_shape()), sl.get_dtype()
                except Exception as e:  # noqa: BLE001 - safetensors errors do not name the tensor
                    problems.append(f"tensor {n} in shard {shard}: unreadable header entry: {type(e).__name__}: {e}")
                    continue
                spec = table[n]
                ok = True
                if shape != spec.shape:
                    misshaped.append(f"{n}: {list(spec.shape)} -> {list(shape)}")
                    ok = False
                if dt != ST_DTYPES[spec.dtype]:
                    wrong_dtype.append(f"{n}: {ST_DTYPES[spec.dtype]} -> {dt}")
                    ok = False
                if not ok:
                    continue
                try:
                    out[n] = r.read(n)  # without a config nothing can be validated: headers only
                except Exception as e:  # noqa: BLE001 - e.g. a read error on a damaged disk: name the tensor
                    problems.append(f"tensor {n} in shard {shard}: cannot read its data: {type(e).__name__}: {e}")


def _check_tid2eid(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Hash-routing tables must name experts that exist (else the MoE fails later with a bare index error)."""
    bad = []
    for n, t in tensors.items():
        if n.endswith(".ffn.gate.tid2eid") and t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= cfg.n_routed_experts:
                bad.append(f"{n} (min {lo}, max {hi})")
    return [named_list(f"tid2eid expert ids outside [0, n_routed_experts={cfg.n_routed_experts})", bad)] if bad else []
