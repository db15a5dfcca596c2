"""Values derived from a weight tensor, computed once per tensor: the expert GEMMs' scale folds and code ranges
(``fp4_fold_device``), the mHC projection's bf16 pieces (``hc_mix``). Weights are constant between calls; an entry
is recomputed when the tensor's version counter, storage, shape or strides change, and dropped with the tensor."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

_CACHE: dict[tuple, tuple] = {}  # (name, id(tensor)) -> (weakref, signature, value)


def cached_per_tensor(name: str, w: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
    """``compute(w)`` once per tensor and ``name``: kept while the tensor lives, recomputed when its version counter,
    storage or shape changes (an in-place copy bumps the version). Tensors without a version counter (made under
    ``torch.inference_mode``) are computed every call."""
    try:
        version = w._version
    except RuntimeError:  # an inference tensor: no version counter to trust
        return compute(w)
    key = (name, id(w))
    sig = (version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.device)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is w and hit[1] == sig:
        return hit[2]
    value = compute(w)
    _CACHE[key] = (weakref.ref(w, lambda _, k=key: _CACHE.pop(k, None)), sig, value)
    return value
