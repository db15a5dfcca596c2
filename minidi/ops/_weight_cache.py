"""Values derived from a weight tensor, computed once per tensor: the expert GEMMs' scale folds and code ranges
(``fp4_fold_device``), the mHC projection's bf16 pieces (``hc_mix``), the FP8 linears' dequantised weights
(``fp8_linear``). Weights are constant between calls; an entry is recomputed when the tensor's (or a tensor it was
derived with: ``also``) version counter, storage, shape or strides change, and dropped with the tensor."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

_CACHE: dict[tuple, tuple] = {}  # (name, id(tensor)) -> (weakref, signature, value, (group, bytes counted))


def _signature(t: torch.Tensor) -> tuple:
    return (t._version, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.device)


def cached_bytes(group: str) -> int:
    """The bytes held by the live entries of a budget ``group`` (as their callers sized them)."""
    return sum(entry[3][1] for entry in list(_CACHE.values()) if entry[3][0] == group)


def cached_per_tensor(name: str, w: torch.Tensor, compute: Callable[[torch.Tensor], Any],
                      also: Sequence[torch.Tensor] = (), budget: int | None = None, size: int = 0,
                      group: str | None = None) -> Any:
    """``compute(w)`` once per tensor and ``name``: kept while the tensor lives, recomputed when the version counter,
    storage or shape of ``w`` or of a tensor in ``also`` changes (an in-place copy bumps the version). Tensors without
    a version counter (made under ``torch.inference_mode``) are computed every call. ``budget`` (bytes): a value of
    ``size`` bytes is kept only while the live entries of its ``group`` (default: ``name``) stay within it; past it,
    it is computed and returned without being kept (first come, first kept)."""
    try:
        sig = (_signature(w), *(_signature(t) for t in also))
    except RuntimeError:  # an inference tensor: no version counter to trust
        return compute(w)
    key = (name, id(w))
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is w and hit[1] == sig:
        return hit[2]
    _CACHE.pop(key, None)  # a stale entry: its bytes no longer count
    value = compute(w)
    group = name if group is None else group
    if budget is not None and cached_bytes(group) + size > budget:
        return value
    _CACHE[key] = (weakref.ref(w, lambda _, k=key: _CACHE.pop(k, None)), sig, value, (group, size))
    return value
