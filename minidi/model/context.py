"""Per-forward metadata the blocks read, and the cross-layer slots of V4.1's CSA2 sharing.

Everything here is built before the layers run (plain tensors, no host sync inside the layers). A forward covers
one sequence from position 0: window rows are the rows of this forward and index lists address them directly.
Legend: T tokens, W window size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    window_idx: torch.Tensor  # [T, W] int64 rows of the window KV for each query, -1 = empty
    engram_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, n_orders*n_heads]

    @staticmethod
    def for_sequence(input_ids: torch.Tensor, window: int) -> "ForwardContext":
        t = input_ids.shape[0]
        pos = torch.arange(t, device=input_ids.device)
        # query t sees rows t-W+1 .. t (itself included); earlier-than-0 slots are empty
        idx = pos[:, None] - (window - 1) + torch.arange(window, device=input_ids.device)[None, :]
        return ForwardContext(input_ids=input_ids, positions=pos, window_idx=torch.where(idx >= 0, idx, -1))


@dataclass
class SharedSlots:
    """V4.1: the most recently published compressed KV, indexer keys, top-k lists and candidate mask (spec §9).

    Sources write in layer order; Reuse / Reindex layers read. V4 leaves them unused.
    """

    comp_kv: torch.Tensor | None = None  # [N, d] compressed KV rows (post-RoPE, fake-quantised)
    comp_pos: torch.Tensor | None = None  # [N] first position of each entry's group
    ratio: int = 0  # compression ratio of comp_kv
    index_k: torch.Tensor | None = None  # [N, index_head_dim] indexer keys
    topk: torch.Tensor | None = None  # [T, k] rows of comp_kv, -1 = empty
    candidates: torch.Tensor | None = None  # [T, N] bool, layer-`candidate_source` pre-filter mask
