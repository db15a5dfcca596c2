"""Text prompts for ``Engine.generate``: encode with the model's tokenizer, choose BOS and the stop tokens.

Kept apart from the engine so the engine's scheduling and validation stay about token ids (and imports nothing of
the engine: the engine builds its requests from what this returns).
"""

from __future__ import annotations

from typing import Any

from .tokenizer import TextTokenizer


def encode_prompts(
    tokenizer: TextTokenizer | None,
    prompts: list[Any],
    continues_prefix: bool,
    stop_at_eos: bool | None,
) -> list[tuple[Any, tuple[int, ...]]]:
    """(token ids, stop tokens) per prompt (ids or ``str``).

    Text is encoded with BOS first (when the tokenizer config asks for it) unless it continues a prefix, whose
    tokens already start the sequence. ``stop_at_eos`` None = stop at EOS for text prompts only. Id prompts pass
    through unchanged (the engine validates them).
    """
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token-id lists or strings, got {type(prompts).__name__}")
    if any(isinstance(p, str) for p in prompts) and tokenizer is None:
        raise ValueError("text prompts need a tokenizer, and this model has none (load a checkpoint folder with "
                         "tokenizer.json, e.g. load_model('tiny-v41'), or pass token ids)")
    out = []
    for p in prompts:
        is_text = isinstance(p, str)
        ids = tokenizer.encode(p, add_bos=False if continues_prefix else None) if is_text else p
        stop = is_text if stop_at_eos is None else stop_at_eos
        eos = () if not stop or tokenizer is None or tokenizer.eos_id is None else (tokenizer.eos_id,)
        out.append((ids, eos))
    return out
