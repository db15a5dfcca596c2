"""Top-k with a deterministic tie-break: among equal values the lowest index wins (every selection in the model).

Why: ``torch.topk`` breaks exact ties in an unspecified way that depends on the row length (and the device), and
exact ties are common in bf16 scores. With it, a sequence batched with others (a longer key pool) or continuing a
cached prefix could pick other entries or experts than the same sequence alone (up to ~1 in the logits of the tiny
models). The spec's reference (a stable descending sort) and the Triton top-k (``minidi.ops.topk``) both take the
lowest indices among ties; so do these helpers, for any row count and row length.

Legend: R rows (any leading dims), N values per row, k picks.

Cost O(N) per row, as ``torch.topk``: one top-k on the values finds the k-th largest value ``thr`` (a value, so no
tie question), a second one on an int32 rank picks every value > thr (fewer than k of them) and the lowest-index
values == thr; the sorts run over the k picks only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_NOT_PICKED = torch.iinfo(torch.int32).min  # rank of a value below the k-th largest (tie ranks are -j >= -(N - 1))
_AFTER_ALL = 1 << 62  # sorts a -inf pick after every column


def topk_set(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, exact ties to the lowest index, in ascending order.

    x [..., N] float; 0 <= k <= N. Returns [..., k] int64, each row ascending. NaN ranks as +inf (ties with +inf by
    index); -0.0 ties with +0.0; -inf values are picked (lowest indices first) when fewer than k are larger.
    """
    key = x.masked_fill(x.isnan(), float("inf"))  # [..., N]: the order torch.topk gives NaN, without its bits
    # the k-th largest value ([..., 1]; +inf for k = 0 so that nothing passes below, without a branch on k)
    thr = F.pad(key.topk(k, dim=-1).values, (0, 1), value=float("inf")).amin(dim=-1, keepdim=True)
    j = torch.arange(x.shape[-1], device=x.device, dtype=torch.int32)
    # every value > thr (rank 1, fewer than k of them), then the ties at thr by index (rank -j), never the rest
    rank = torch.where(key > thr, 1, torch.where(key == thr, -j, _NOT_PICKED))  # [..., N] int32
    return rank.topk(k, dim=-1).indices.sort(dim=-1).values


def topk_lowest_index(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` with exact ties broken by the lowest index: (values, indices) [..., k], values
    descending, equal values in ascending index order. Equals ``torch.sort(x, -1, descending=True, stable=True)``
    cut to k, up to NaN (ranked as +inf here, see ``topk_set``; the sort puts it above +inf)."""
    idx = topk_set(x, k)  # [..., k] ascending
    vals = x.gather(-1, idx)
    order = vals.masked_fill(vals.isnan(), float("inf")).sort(dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, order), idx.gather(-1, order)  # stable: ties keep the ascending index order


def topk_picks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer's picks of scores [T, N]: the top-k set (``topk_set``: ties to the lowest column, NaN as +inf),
    ascending, then -1 for picks scored -inf (or NaN). [T, k] int64: the Triton top-k's output order, so that both
    attend to the same keys in one order. The model's indexer and candidate blocks use it (``_pick`` there), and so
    does the reference of pass T's op."""
    idx = topk_set(scores, k)  # [T, k] ascending
    idx = torch.where(scores.gather(1, idx) > float("-inf"), idx, _AFTER_ALL).sort(dim=-1).values
    return idx.masked_fill(idx == _AFTER_ALL, -1)
