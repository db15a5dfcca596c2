"""Build a ready model: from a checkpoint directory (real layout) or from a preset with random weights.

``load_model("tiny-v41")`` writes (once, in a cache folder) and loads the embedded tiny checkpoint;
``load_model("v41-flash", device="cuda", share_experts=True)`` builds the full-size shapes directly in device memory
(random weights in the checkpoint formats; a 290 GB checkpoint cannot be written here).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from minidi.model.config import ModelConfig
from minidi.model.model import Transformer
from minidi.model.presets import PRESETS, preset

from .checkpoint import CheckpointError, load_checkpoint, tiny_checkpoint
from .random_weights import random_state_dict
from .tokenizer import install_tokenizer
from .value_scan import scan_values


def model_from_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: str | torch.device,
                       engram_rows: int | None = None) -> Transformer:
    """Build on the meta device and adopt ``tensors`` (no second copy of the weights). ``engram_rows``: the
    tensors hold smaller Engram tables (``Transformer``'s option of that name)."""
    with torch.device("meta"):
        model = Transformer(cfg, engram_rows=engram_rows)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    model.reset_buffers()
    return model.eval()


def load_model(
    path_or_preset: str | Path,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    share_experts: bool = False,
    gate_bias: str | None = None,
    engram_rows: int | None = None,
    validate_values: bool = False,
    token_map: str | torch.Tensor | None = None,
    **overrides: Any,
) -> Transformer:
    """The public entry point.

    - a directory: a checkpoint in the official layout (config.json, sharded safetensors + index, `.scale` sidecars);
    - ``tiny-*``: the embedded tiny random-weight checkpoint, written on demand in the cache and loaded from disk;
    - ``v41-flash`` / ``v4-flash``: full-size shapes with random weights built on ``device``
      (``share_experts=True`` shares one routed-expert set across layers so all layers fit on one GPU;
      ``gate_bias`` "zero" (None: the default, balanced routing) or "random" (the old 0.3·N router bias:
      ``random_weights``); ``engram_rows`` holds smaller random Engram tables, hash ids taken modulo).
    ``overrides`` replace config fields (``dtype="float32"``, ``fake_quant=False``, ...).
    ``validate_values``: scan every weight for NaN / Inf and E8M0 scale byte 255 (``value_scan.scan_values``) and
    raise ``CheckpointError`` naming the tensors; off by default (it reads every byte).

    Tokenizer and Engram map (``runtime.tokenizer``): a folder's ``tokenizer.json`` becomes ``model.tokenizer``
    (text in / out) and, for V4.1, the source of the Engram token map; a V4.1 folder without one is refused unless
    ``token_map`` is given (a tensor, or ``"test"``). The tiny checkpoints ship a tokenizer whose map equals the test
    map. Note: the full-size random-weight presets have no tokenizer and keep the test map (``id mod C``).
    Tensors stream from the shards straight to ``device`` (``runtime.stream_load``).
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"load_model(..., device={str(device)!r}): no CUDA device is available "
                           f"(torch.cuda.is_available() is False); use device='cpu'")
    name = str(path_or_preset)
    random = name in PRESETS and not name.startswith("tiny")
    if not random and (gate_bias is not None or engram_rows is not None):
        raise ValueError(f"gate_bias / engram_rows choose the random weights of a full-size preset; {name!r} loads "
                         f"a checkpoint's tensors (the tiny ones are made with gate_bias='random')")
    if Path(name).is_dir() or (name not in PRESETS and os.path.lexists(name)):  # the loader says what is wrong
        return _from_checkpoint(Path(name), device, overrides, validate_values, token_map)
    if name not in PRESETS:
        raise ValueError(f"{name!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")
    if name.startswith("tiny"):
        return _from_checkpoint(tiny_checkpoint(name, seed=seed), device, {"name": name, **overrides},
                                validate_values, token_map)
    cfg = preset(name, **overrides)
    tensors = random_state_dict(cfg, seed=seed, device=device, share_experts=share_experts,
                                gate_bias=gate_bias or "zero", engram_rows=engram_rows)
    if validate_values:
        problems = scan_values(tensors)
        if problems:
            raise CheckpointError(Path(name), problems)
    model = model_from_tensors(cfg, tensors, device, engram_rows=engram_rows)
    install_tokenizer(model, None, "test" if token_map is None else token_map)  # random weights: the test map
    return model


def _from_checkpoint(path: Path, device: str | torch.device, overrides: dict[str, Any],
                     validate_values: bool = False, token_map: str | torch.Tensor | None = None) -> Transformer:
    """Load a checkpoint folder; with ``ep_size > 1`` only this rank's experts are read from disk.

    The config is read here (to apply ``overrides`` and pick the rank's experts) only when it parses; otherwise
    ``load_checkpoint`` reports it together with every other problem in one ``CheckpointError``."""
    cfg = None
    if (path / "config.json").is_file():
        try:
            cfg = ModelConfig.from_hf_config(path)
        except Exception:  # noqa: BLE001 - load_checkpoint reports it, naming the key
            cfg = None
        if cfg is None:
            load_checkpoint(path, validate_values=validate_values)  # raises, listing the config problem
    if cfg is not None and overrides:
        cfg = cfg.with_(**overrides)
    only = rank_experts_only(cfg) if cfg is not None and cfg.ep_size > 1 else None
    cfg, tensors = load_checkpoint(path, cfg=cfg, device=device, only=only,  # streamed straight to the device
                                   validate_values=validate_values)
    model = model_from_tensors(cfg, tensors, device)
    install_tokenizer(model, path, token_map)
    return model


_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def rank_experts_only(cfg: ModelConfig):
    """Name filter that skips the routed experts of other ranks (they are neither read nor reported)."""
    lo, hi = cfg.first_local_expert, cfg.first_local_expert + cfg.n_local_experts

    def wanted(name: str) -> bool:
        m = _EXPERT.search(name)
        return m is None or not (0 <= int(m.group(1)) < cfg.n_routed_experts) or lo <= int(m.group(1)) < hi

    return wanted
