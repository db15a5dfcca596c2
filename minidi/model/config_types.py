"""The value rules of ``ModelConfig`` fields: which Python values each annotated type accepts, and the sizes that
must be positive. ``config.py`` checks every field with them (``validate``, ``from_hf_dict``), so a config.json value
of the wrong type gets an error naming its key instead of a failure deep inside the model."""

from __future__ import annotations

import math
from typing import Any

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


KINDS: dict[str, tuple[str, Any]] = {
    "int": ("an int", _is_int),
    "float": ("a finite number", lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "tuple[int, ...]": ("a list of ints", lambda v: isinstance(v, (tuple, list)) and all(_is_int(x) for x in v)),
}
# sizes that must be positive (a zero or negative one only fails deep inside the model)
MINIMA: dict[str, int] = {
    **{n: 1 for n in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                      "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
                      "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "n_shared_experts",
                      "n_activated_experts", "moe_inter_dim", "original_seq_len", "max_position_embeddings",
                      "engram_max_ngram", "engram_n_heads", "engram_head_dim")},
    "window_size": 2, "rope_head_dim": 0, "n_hash_layers": 0,
}


def type_problem(annotation: Any, value: Any, where: str) -> str | None:
    """The problem with ``value`` for a field annotated ``annotation`` (``where``: what the message names)."""
    kind = KINDS.get(annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))
    if kind is None or kind[1](value):
        return None
    return f"{where} must be {kind[0]}, got {value!r} ({type(value).__name__})"
