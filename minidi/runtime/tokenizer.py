"""A checkpoint folder's tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, read with ``tokenizers``) and the
choice of the Engram token map (spec V4.1 §5.1), so that a V4.1 model can never run with a wrong map silently.

    tok = load_tokenizer(folder)                 # None when the folder has no tokenizer.json
    ids = tok.encode("Hello")                    # [BOS, ...] when tokenizer_config says add_bos_token
    install_tokenizer(model, folder, token_map=None)   # model.tokenizer = tok; Engram map built from it

Token-map choices (``load_model(..., token_map=...)``):
- ``None`` (default): built from the folder's tokenizer (``engram_hash.build_token_map``); a V4.1 folder without a
  tokenizer is refused (``TokenizerMissing``), since every hash id would otherwise address the wrong rows.
- ``"test"``: the documented test map ``id % C`` (random-weight models only; never right for the release).
- a tensor ``[vocab]`` int64: installed as given (checked to have ``engram_compressed_vocab_size`` distinct ids).
V4 has no Engram: it loads without a tokenizer, and offers text in / out when the folder has one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class TokenizerMissing(ValueError):
    """A V4.1 checkpoint without the tokenizer its Engram hash needs (and no explicit token map)."""


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and BOS rule of its ``tokenizer_config.json``."""

    backend: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool = True

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; BOS first when ``add_bos`` (default: the config's ``add_bos_token``), never twice
        (a tokenizer.json whose post-processor adds BOS itself is not doubled)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        bos = self.add_bos if add_bos is None else add_bos
        if bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(folder: str | Path, cfg: Any = None) -> TextTokenizer | None:
    """The folder's tokenizer, or None when it has no ``tokenizer.json``.

    BOS / EOS / pad come from ``tokenizer_config.json`` (looked up in the vocabulary), falling back to the model
    config's ``bos_token_id`` / ``eos_token_id`` (``cfg``) when the config file is absent or names none.
    Raises ValueError for an unreadable file, naming it.
    """
    folder = Path(folder)
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(f"reading {path} needs the 'tokenizers' package (a minidi dependency: pip install "
                          f"tokenizers)") from e
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for bad JSON / unknown models
        raise ValueError(f"unreadable {path}: {type(e).__name__}: {e}") from e
    conf: dict[str, Any] = {}
    cpath = folder / TOKENIZER_CONFIG_FILE
    if cpath.is_file():
        try:
            conf = json.loads(cpath.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"unreadable {cpath}: {e}") from e
        if not isinstance(conf, dict):
            raise ValueError(f"{cpath}: expected a JSON object")

    def special(key: str, fallback: int | None) -> int | None:
        text = _token_text(conf.get(key))
        if text is None:
            return fallback
        tid = backend.token_to_id(text)
        if tid is None:
            raise ValueError(f"{cpath}: {key} {text!r} is not in the vocabulary of {path}")
        return tid

    bos = special("bos_token", getattr(cfg, "bos_token_id", None))
    eos = special("eos_token", getattr(cfg, "eos_token_id", None))
    pad = special("pad_token", None)
    return TextTokenizer(backend, bos, eos, pad, add_bos=bool(conf.get("add_bos_token", True)))


def install_tokenizer(model: Any, folder: str | Path | None, token_map: Any = None) -> None:
    """Set ``model.tokenizer`` (the folder's, or None) and install the Engram token map chosen by ``token_map``
    (module docstring). Raises ``TokenizerMissing`` for a V4.1 folder without a tokenizer and no explicit map."""
    cfg = model.cfg
    tok = load_tokenizer(folder, cfg) if folder is not None else None
    model.tokenizer = tok
    if tok is not None and len(tok) > cfg.vocab_size:
        raise ValueError(f"tokenizer {Path(folder) / TOKENIZER_FILE} has {len(tok)} tokens, more than the model's "
                         f"vocab_size {cfg.vocab_size}: wrong tokenizer for this checkpoint")
    if not cfg.engram_layers:
        if isinstance(token_map, torch.Tensor):
            raise ValueError(f"token_map given, but {cfg.name or 'this model'} has no Engram layers")
        return
    if isinstance(token_map, str):
        if token_map != "test":
            raise ValueError(f"token_map must be None, 'test' or a tensor, got {token_map!r}")
        log.info("Engram: the documented test token map (id mod %d), not a tokenizer's",
                 cfg.engram_compressed_vocab_size)
        return  # the model was built with it (Transformer._register_engram_buffers)
    if token_map is None:
        if tok is None:
            raise TokenizerMissing(
                f"{folder}: no {TOKENIZER_FILE}, but this V4.1 checkpoint's Engram layers {list(cfg.engram_layers)} "
                f"hash token ids through the tokenizer's compressed token map (spec V4.1 §5.1). Put the release's "
                f"{TOKENIZER_FILE} (and {TOKENIZER_CONFIG_FILE}) into the folder, or pass token_map= (a tensor from "
                f"minidi.model.engram_hash.build_token_map, or 'test' for random-weight checkpoints)")
        from minidi.model.engram_hash import build_token_map

        token_map = build_token_map(tok.backend)
    if token_map.numel() < cfg.vocab_size:
        # ids past the tokenizer's length (spare embedding rows) never come from text: DEAD, i.e. no n-gram
        from minidi.model.engram_hash import DEAD

        token_map = torch.cat([token_map, token_map.new_full((cfg.vocab_size - token_map.numel(),), DEAD)])
    model.set_token_map(token_map)  # checks the count of compressed ids against the config
