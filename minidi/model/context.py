"""What one step of the model reads besides the weights: step metadata and the cache tensors.

The model runs on a *packed* batch: the new tokens of several sequences concatenated ([T], no padding), each
possibly continuing a cached prefix. Every index the layers need is built on the host before the step
(``runtime/batch.py``) and arrives here as plain tensors, so the step has no host sync and no data-dependent
Python branches. Caches are flat row pools; index lists address rows of "a pool with this step's new rows
appended" (``cat([pool, new])``), so cached and new rows are read the same way.

Legend: T new tokens, W window, m compression ratio, Nn new compressed entries this step, Nv rows of the step's
compressed view, K the shift count of Engram n-grams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RatioMeta:
    """Compressed entries of one compression ratio m (shared by every layer with that ratio)."""

    group_idx: torch.Tensor  # [Nn, m] rows of cat(pending K|G, new K|G) pooled into each new entry
    prev_idx: torch.Tensor  # [Nn, m] V4 overlap only: rows of the previous window (-1 = none -> K 0, G -inf)
    entry_pos: torch.Tensor  # [Nn] position of each new entry (its group's first token)
    pend_src: torch.Tensor  # [Np] rows of cat(pending, new K|G) to keep as pending after the step
    pend_dst: torch.Tensor  # [Np] pending-pool rows they go to
    view_idx: torch.Tensor  # [Nv] rows of cat(pool, new entries) forming the step's view; -1 = padding
    pool_src: torch.Tensor  # [Nw] rows of cat(pool, new entries) to write into the pool after the step
    pool_dst: torch.Tensor  # [Nw] pool rows they go to
    k_start: torch.Tensor  # [T] first view row of each query's sequence
    k_end: torch.Tensor  # [T] one past the last view row the query may see (k_start + (pos+1)//m)


@dataclass
class StepMeta:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 absolute positions
    window_idx: torch.Tensor  # [T, W] rows of cat(window pool, new KV rows); -1 = empty
    window_src: torch.Tensor  # [Nw] rows of cat(window pool, new KV) kept in the ring after the step
    window_dst: torch.Tensor  # [Nw] ring rows they go to
    logit_rows: torch.Tensor  # [L] rows of the step whose logits are returned
    ratios: dict[int, RatioMeta] = field(default_factory=dict)
    engram_tokens: torch.Tensor | None = None  # [H+T] token ids: cached history rows, then the new tokens
    engram_src: torch.Tensor | None = None  # [T, K] rows of engram_tokens for shifts s = 0..K-1 (-1 = before start)

    @staticmethod
    def for_sequence(input_ids: torch.Tensor, window: int, ratios: tuple[int, ...], ngram: int = 0,
                     all_logits: bool = True) -> "StepMeta":
        """One sequence from position 0, nothing cached (the plain reference forward)."""
        dev = input_ids.device
        t = input_ids.shape[0]
        pos = torch.arange(t, device=dev)
        idx = pos[:, None] - (window - 1) + torch.arange(window, device=dev)[None, :]
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        meta = StepMeta(
            input_ids=input_ids, positions=pos, window_idx=torch.where(idx >= 0, idx, -1), window_src=empty,
            window_dst=empty, logit_rows=pos if all_logits else pos[-1:],
        )
        for m in ratios:
            n = t // m
            groups = torch.arange(n * m, device=dev).view(n, m)
            prev = torch.where(groups >= m, groups - m, -1)
            meta.ratios[m] = RatioMeta(
                group_idx=groups, prev_idx=prev, entry_pos=groups[:, 0], pend_src=empty, pend_dst=empty,
                view_idx=torch.arange(n, device=dev), pool_src=empty, pool_dst=empty,
                k_start=torch.zeros_like(pos), k_end=(pos + 1) // m,
            )
        if ngram:
            src = pos[:, None] - torch.arange(ngram, device=dev)[None, :]
            meta.engram_tokens, meta.engram_src = input_ids, torch.where(src >= 0, src, -1)
        return meta


@dataclass
class ModelCache:
    """The cache tensors a step reads and updates (allocated and managed by ``runtime/cache.py``).

    window[l]: [Rw, d] ring rows of every layer; comp[l]: [Rc, d] compressed KV pool of kv-source layers;
    index_k[l]: [Rc, di] indexer-key pool of layers that own index keys; pending[name]: [Rp, 2*width] fp32 K|G rows
    of incomplete compressor groups (name = "L<l>" for the attention compressor, "L<l>.index" for V4's indexer
    compressor). Empty tensors (0 rows) for a forward with nothing cached.
    """

    window: dict[int, torch.Tensor] = field(default_factory=dict)
    comp: dict[int, torch.Tensor] = field(default_factory=dict)
    index_k: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)

    def layer(self, layer: int) -> "LayerCache":
        """The tensors of one layer (None where the layer keeps nothing, or nothing is cached)."""
        return LayerCache(window=self.window.get(layer), comp=self.comp.get(layer), index_k=self.index_k.get(layer),
                          pending=self.pending.get(f"L{layer}"), pending_index=self.pending.get(f"L{layer}.index"))


@dataclass
class LayerCache:
    """One layer's cache tensors (views into ``ModelCache``'s pools, updated in place by the layer).

    A layer receives only its own tensors, never its index: layers of the same kind then trace to the same graph, so
    a per-layer (regional) compile reuses one compiled graph for all of them (``minidi.compile(regional=True)``)."""

    window: torch.Tensor | None = None
    comp: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    pending_index: torch.Tensor | None = None


@dataclass
class SharedSlots:
    """V4.1: the most recently published compressed view, indexer keys, top-k lists and candidate mask (spec §9).

    Sources write in layer order; Reuse / Reindex layers read. V4 leaves them unused.
    """

    comp_kv: torch.Tensor | None = None  # [Nv, d] compressed view rows (post-RoPE, fake-quantised)
    ratio: int = 0  # compression ratio of comp_kv
    index_k: torch.Tensor | None = None  # [Nv, index_head_dim] indexer keys (view rows)
    topk: torch.Tensor | None = None  # [T, k] rows of comp_kv, -1 = empty
    candidates: torch.Tensor | None = None  # [T, KB] int64: layer-`candidate_source`'s kept blocks, -1 = none
