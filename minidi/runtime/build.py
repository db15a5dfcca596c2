"""Build a ready model: from a checkpoint directory (real layout) or from a preset with random weights.

``load_model("tiny-v41")`` writes (once, in a cache folder) and loads the embedded tiny checkpoint;
``load_model("v41-flash", device="cuda", share_experts=True)`` builds the full-size shapes directly in device memory
(random weights in the checkpoint formats; a 290 GB checkpoint cannot be written here).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from minidi.model.config import ModelConfig
from minidi.model.model import Transformer
from minidi.model.presets import PRESETS, preset

from .checkpoint import load_checkpoint, tiny_checkpoint
from .random_weights import random_state_dict
from .tokenizer import install_tokenizer


def model_from_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: str | torch.device) -> Transformer:
    """Build on the meta device and adopt ``tensors`` (no second copy of the weights)."""
    with torch.device("meta"):
        model = Transformer(cfg)
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
    token_map: str | torch.Tensor | None = None,
    **overrides: Any,
) -> Transformer:
    """The public entry point.

    - a directory: a checkpoint in the official layout (config.json, sharded safetensors + index, `.scale` sidecars);
    - ``tiny-*``: the embedded tiny random-weight checkpoint, written on demand in the cache and loaded from disk;
    - ``v41-flash`` / ``v4-flash``: full-size shapes with random weights built on ``device``
      (``share_experts=True`` shares one routed-expert set across layers so all layers fit on one GPU).
    ``overrides`` replace config fields (``dtype="float32"``, ``fake_quant=False``, ...).

    Tokenizer and Engram map (``runtime.tokenizer``): a folder's ``tokenizer.json`` becomes ``model.tokenizer``
    (text in / out) and, for V4.1, the source of the Engram token map; a V4.1 folder without one is refused unless
    ``token_map`` is given (a tensor, or ``"test"``). The tiny checkpoints ship a tokenizer whose map equals the test
    map. Note: the full-size random-weight presets have no tokenizer and keep the test map (``id mod C``).
    Tensors stream from the shards straight to ``device`` (``runtime.stream_load``).
    """
    name = str(path_or_preset)
    if Path(name).is_dir():
        return _from_checkpoint(Path(name), device, overrides, token_map)
    if name not in PRESETS:
        raise ValueError(f"{name!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")
    if name.startswith("tiny"):
        return _from_checkpoint(tiny_checkpoint(name, seed=seed), device, {"name": name, **overrides}, token_map)
    cfg = preset(name, **overrides)
    model = model_from_tensors(cfg, random_state_dict(cfg, seed=seed, device=device, share_experts=share_experts),
                               device)
    install_tokenizer(model, None, "test" if token_map is None else token_map)  # random weights: the test map
    return model


def _from_checkpoint(path: Path, device: str | torch.device, overrides: dict[str, Any],
                     token_map: str | torch.Tensor | None = None) -> Transformer:
    """Load a checkpoint folder; with ``ep_size > 1`` only this rank's experts are read from disk."""
    cfg = ModelConfig.from_hf_config(path) if (path / "config.json").is_file() else None
    if cfg is not None and overrides:
        cfg = cfg.with_(**overrides)
    only = rank_experts_only(cfg) if cfg is not None and cfg.ep_size > 1 else None
    cfg, tensors = load_checkpoint(path, cfg=cfg, device=device, only=only)  # streamed straight to the device
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
