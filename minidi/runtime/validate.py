"""Request validation for the engine: every field is checked on the host before a request is admitted.

A server takes requests from many clients into one batch, so a bad field must come back as that request's error
(``Result.error``), never as an exception that loses its batch-mates' work. Each check returns the problem in
words or normalises the value (token ids become a plain ``list[int]``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def _describe(x: Any) -> str:
    r = repr(x)
    return f"{r[:40]}... ({type(x).__name__})" if len(r) > 40 else f"{r} ({type(x).__name__})"


def token_list(tokens: Any, vocab_size: int, max_len: int) -> tuple[list[int], str | None]:
    """``tokens`` as a list of Python ints in ``[0, vocab_size)``, or the problem (``max_len``: max positions).

    Accepted: a list / tuple / range of integers (Python or NumPy), a 1-D integer tensor or NumPy array. Refused
    with a reason: ``None``, strings and bytes (iterating them would give characters / bytes, not ids), bools and
    bool tensors (``True`` is an int in Python, but never a token id), floats, nested lists and 2-D tensors (a
    batch goes in as several requests), and anything longer than ``max_len`` (checked before iterating, so a huge
    input costs nothing)."""
    if tokens is None:
        return [], "tokens is None (expected a list of token ids or a 1-D integer tensor)"
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(tokens, torch.Tensor) else "array"
        dt = tokens.dtype
        is_int = (not dt.is_floating_point and not dt.is_complex and dt != torch.bool) if kind == "tensor" \
            else np.issubdtype(dt, np.integer)
        if not is_int:
            return [], f"tokens is a {dt} {kind}; token ids need an integer dtype"
        if tokens.ndim != 1:
            return [], (f"tokens is a {tokens.ndim}-D {kind} of shape {list(tokens.shape)}; expected 1-D "
                        "(send each sequence as its own request)")
        if len(tokens) > max_len:
            return [], f"prompt of {len(tokens)} tokens exceeds max_position_embeddings {max_len}"
        if kind == "tensor" and tokens.is_meta:
            return [], "tokens is a meta tensor (it holds no values)"
        toks = [int(t) for t in tokens.tolist()]
    elif isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
        return [], f"tokens must be a list of token ids or a 1-D integer tensor, got {_describe(tokens)}"
    else:
        if len(tokens) > max_len:
            return [], f"prompt of {len(tokens)} tokens exceeds max_position_embeddings {max_len}"
        toks = []
        for i, t in enumerate(tokens):
            if isinstance(t, (bool, np.bool_)) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
                return [], f"token at position {i} is a bool {t!r}, not a token id"
            try:
                toks.append(operator.index(t))  # ints, NumPy integers, 0-d integer tensors; not floats
            except TypeError:
                return [], f"token at position {i} is {_describe(t)}, not an integer id"
    if not toks:
        return [], "empty prompt"
    for i, t in enumerate(toks):
        if not 0 <= t < vocab_size:
            return [], f"token id {t!r} at position {i} is outside the vocabulary [0, {vocab_size})"
    return toks, None


def max_new_tokens(value: Any, minimum: int) -> tuple[int, str | None]:
    """``max_new_tokens`` as an int >= ``minimum`` (0: prefill only; ``generate`` asks for >= 1), or the problem."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return 0, f"max_new_tokens must be an int, got {_describe(value)}"
    value = int(value)
    if value < minimum:
        what = "generation needs max_new_tokens >= 1" if minimum >= 1 else "max_new_tokens must be >= 0"
        return 0, f"{what} (0 = prefill only), got {value}"
    return value, None


def flag(name: str, value: Any) -> tuple[bool, str | None]:
    """A bool option (``all_logits``): ``1`` or ``"yes"`` are refused rather than guessed."""
    if not isinstance(value, (bool, np.bool_)):
        return False, f"{name} must be True or False, got {_describe(value)}"
    return bool(value), None
