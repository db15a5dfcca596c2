"""Attention of one layer: window keys + compressed keys picked by the indexer (spec V4.1 §6-9, V4 §4-7).

Every layer computes its own q, its own window KV row per token and its own output. Compressed layers add entries
from a compressor: V4 layers own theirs; V4.1 layers share them across the group of a kv source (``SharedSlots``).
Legend: T tokens, H heads, d head dim, N compressed entries, G output groups.
"""

from __future__ import annotations

import torch
from torch import nn

from .compressor import CompressorV4, CompressorV41
from .config import ModelConfig
from .context import LayerCache, RatioMeta, SharedSlots, StepMeta
from .indexer import IndexerV4, IndexerV41, candidate_allowed, candidate_blocks, indexer_topk_naive
from .layers import FP8Linear, RMSNorm, RopeTable, apply_rope, rms_norm, rope_cos_sin_lookup, weight_param
from .quant import fq4_e4m3, fq8
from . import stages
from .sparse_attention import sparse_attention_naive


class Attention(nn.Module):
    """``rope``: the cos/sin table of this layer's inv_freq variant (compressed layers: YaRN base), shared with the
    other layers of that variant (the Transformer hands the same ``RopeTable`` to each); a layer built alone builds
    its own.

    ``eager_budget`` (bytes, default None): the memory budget of an eager run for the naive indexer's score product
    (``indexer_topk_naive``); None keeps the whole chain, the graph torch.compile must see. Set by
    ``Transformer.set_eager_budget``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RopeTable | None = None) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.ratio = cfg.ratio(layer_id)
        # forward branches on this, not on the ratio: a V4.1 layer that only reads its source's compressed KV never
        # reads its own ratio, so layers of ratio 2 and 1 trace to one graph (Block.kind)
        self.compressed = self.ratio > 0
        h, d = cfg.n_heads, cfg.head_dim
        self.attn_sink = weight_param(h, dtype=torch.float32)
        self.wq_a = FP8Linear(cfg.dim, cfg.q_lora_rank, cfg)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = FP8Linear(cfg.q_lora_rank, h * d, cfg)
        self.wkv = FP8Linear(cfg.dim, d, cfg)
        self.kv_norm = RMSNorm(d, cfg.norm_eps)
        # grouped output projection: wo_a is a bf16 einsum on the dequantised weight, no activation quant
        self.wo_a = FP8Linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg, quant_input=False)
        self.wo_b = FP8Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, cfg)
        # the layer's roles, fixed at build time (forward never reads layer_id: see LayerCache)
        self.kv_source, self.index_source = cfg.is_kv_source(layer_id), cfg.is_index_source(layer_id)
        self.owns_index_keys = cfg.owns_index_keys(layer_id)
        self.candidate_filtered = cfg.is_candidate_filtered(layer_id)
        self.candidate_source = cfg.is_candidate_source(layer_id)
        self.v4_indexer = not cfg.is_v41 and cfg.has_indexer(layer_id)
        if cfg.is_kv_source(layer_id):
            self.compressor = CompressorV41(cfg, self.ratio) if cfg.is_v41 else CompressorV4(cfg, self.ratio, d)
        if cfg.is_v41 and cfg.is_index_source(layer_id):
            self.indexer = IndexerV41(cfg, owns_keys=cfg.owns_index_keys(layer_id))
        elif not cfg.is_v41 and cfg.is_index_source(layer_id):
            self.indexer = IndexerV4(cfg)
        self.rope = rope if rope is not None else RopeTable(cfg, compressed=self.ratio > 0)
        self.eager_budget: int | None = None
        if self.rope.compressed != (self.ratio > 0):
            raise ValueError(f"layer {layer_id} (ratio {self.ratio}) given the RoPE table of the other variant")

    def _quant_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """Window / compressed KV fake-quant: V4.1 fq8 over all channels (blocks 32); V4 fq8 of the non-rope
        channels (blocks 64), rope channels untouched."""
        if not self.cfg.fake_quant:
            return kv
        if self.cfg.is_v41:
            return fq8(kv, 32)
        nope = self.cfg.nope_head_dim
        return torch.cat([fq8(kv[..., :nope], 64), kv[..., nope:]], dim=-1)

    def forward(self, x: torch.Tensor, meta: StepMeta, cache: LayerCache, shared: SharedSlots) -> torch.Tensor:
        """x [T, D] (attn-normed) -> [T, D]. Reads and updates this layer's cache rows."""
        cfg = self.cfg
        t = x.shape[0]
        cos, sin = rope_cos_sin_lookup(meta.positions, self.rope.cos_sin)  # [T, r/2] each
        q_lat = self.q_norm(self.wq_a(x))  # [T, q_lora]; also the indexer's query latent
        q = self.wq_b(q_lat).view(t, cfg.n_heads, cfg.head_dim)  # [T, H, d]
        if not cfg.is_v41:
            q = rms_norm(q, None, cfg.norm_eps)  # V4: per-head unweighted RMSNorm
        q = apply_rope(q, cos, sin)
        kv = self._quant_kv(apply_rope(self.kv_norm(self.wkv(x)), cos, sin))  # [T, d]: key = value, one head
        window = _with_pool(cache.window, kv)  # [Rw + T, d]: cached ring rows, then this step's

        comp_kv, comp_idx = None, None
        if self.compressed:
            compressed = self._compressed_v41 if cfg.is_v41 else self._compressed_v4
            comp_kv, comp_idx = compressed(x, q_lat, cos, sin, meta, cache, shared)
        stages.enter("attn.core", q)
        o = sparse_attention_naive(q, window, meta.window_idx, comp_kv, comp_idx, self.attn_sink, cfg.head_dim**-0.5)
        stages.exit("attn.core", o)
        if cache.window is not None:
            cache.window.index_copy_(0, meta.window_dst, window[meta.window_src])
        o = apply_rope(o, cos, sin, inverse=True).view(t, cfg.o_groups, -1)  # [T, G, H*d/G]
        wo_a = self.wo_a.dequant(o.dtype).view(cfg.o_groups, cfg.o_lora_rank, -1)  # [G, o_lora, H*d/G]
        a = torch.einsum("tgi,goi->tgo", o, wo_a).flatten(1)  # [T, G*o_lora]
        return self.wo_b(a)

    def _new_entries(self, x: torch.Tensor, rm: RatioMeta, cache: LayerCache):
        """Run this layer's compressor on the step: -> (latent [Nn, dc], rotated + fake-quantised rows, cos, sin)."""
        latent = self.compressor(x, rm, cache.pending)
        # entry_pos = group * m of complete groups only, so in [0, P): padding exists in view_idx, never here
        ccos, csin = rope_cos_sin_lookup(rm.entry_pos, self.rope.cos_sin)  # [Nn, r/2] each
        rows = apply_rope(latent, ccos, csin)
        if self.cfg.fake_quant:
            rows = fq4_e4m3(rows, 16) if self.cfg.is_v41 else self._quant_kv(rows)
        return latent, rows, ccos, csin

    def _compressed_v41(self, x, q_lat, cos, sin, meta: StepMeta, cache: LayerCache, shared: SharedSlots):
        cfg = self.cfg
        if self.kv_source:
            rm = meta.ratios[self.ratio]
            latent, rows, ccos, csin = self._new_entries(x, rm, cache)
            shared.comp_kv, shared.ratio = compressed_view(cache.comp, rows, rm), self.ratio
            if self.owns_index_keys:
                stages.enter("indexer", latent)
                keys = self.indexer.keys(latent, ccos, csin)
                stages.exit("indexer", keys)
                shared.index_k = compressed_view(cache.index_k, keys, rm)
        if self.index_source:
            rm = meta.ratios[shared.ratio]
            stages.enter("indexer", q_lat)
            qi, wi = self.indexer.queries(x, q_lat, cos, sin)
            allowed = None
            if self.candidate_filtered:
                allowed = candidate_allowed(shared.candidates, shared.index_k.shape[0], cfg.candidate_block_size)
            idx, scores = indexer_topk_naive(qi, shared.index_k, wi, rm.k_start, rm.k_end, cfg.index_topk, allowed,
                                             self.eager_budget)
            if self.candidate_source:
                shared.candidates = candidate_blocks(scores, rm.k_start, rm.k_end, cfg.candidate_topk_blocks,
                                                   cfg.candidate_block_size)
            stages.exit("indexer", idx)
            shared.topk = idx
        return shared.comp_kv, shared.topk

    def _compressed_v4(self, x, q_lat, cos, sin, meta: StepMeta, cache: LayerCache, shared: SharedSlots):
        cfg = self.cfg
        rm = meta.ratios[self.ratio]
        _, rows, ccos, csin = self._new_entries(x, rm, cache)
        view = compressed_view(cache.comp, rows, rm)
        if self.v4_indexer:
            stages.enter("indexer", q_lat)
            keys = self.indexer.keys(x, rm, cache.pending_index, ccos, csin)  # same entries: ratio 4, same rm
            keys = compressed_view(cache.index_k, keys, rm)
            qi, wi = self.indexer.queries(x, q_lat, cos, sin)
            idx, _ = indexer_topk_naive(qi, keys, wi, rm.k_start, rm.k_end, cfg.index_topk,
                                        budget=self.eager_budget)
            stages.exit("indexer", idx)
        else:  # heavily compressed: attend densely to every visible entry of the query's sequence
            j = torch.arange(view.shape[0], device=x.device).unsqueeze(0)
            idx = torch.where((j >= rm.k_start.unsqueeze(1)) & (j < rm.k_end.unsqueeze(1)), j, -1)
        return view, idx


def _with_pool(pool: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if pool is None else torch.cat([pool, new.to(pool.dtype)], dim=0)


def compressed_view(pool: torch.Tensor | None, new: torch.Tensor, rm: RatioMeta) -> torch.Tensor:
    """The step's view of compressed rows: rows of cat(pool, new) in each sequence's order ([Nv, w]; padding rows
    are zero). Writes this step's rows into the pool (in place) for later steps.

    Read by index, never through a concatenation of the pool: the view gathers its cached rows from the pool and
    its new rows from ``new`` (plus one zero row that padding and the other source's slots read), so a step reads
    and writes what its sequences hold, not the whole pool (a pool 8x larger than the step needs costs nothing)."""
    if pool is None:
        view = new[rm.view_idx.clamp(min=0)]
        return torch.where((rm.view_idx >= 0).unsqueeze(-1), view, torch.zeros_like(view))
    p, idx = pool.shape[0], rm.view_idx
    new = new.to(pool.dtype)
    padded = torch.cat([new, new.new_zeros(1, new.shape[1])])  # [Nn + 1, w]: this step's rows, then a zero row
    in_pool = (idx >= 0) & (idx < p)
    cached = pool[torch.where(in_pool, idx, 0)]  # [Nv, w]
    fresh = padded[torch.where(idx >= p, idx - p, new.shape[0])]  # [Nv, w]; padding reads the zero row
    view = torch.where(in_pool.unsqueeze(-1), cached, fresh)
    pool.index_copy_(0, rm.pool_dst, new[rm.pool_src - p])  # after the view: it reads the pool as it was
    return view
