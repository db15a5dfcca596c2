"""The DeepSeek-V4.1-Flash / V4-Flash text backbone, plain PyTorch (spec V4.1 §3-4, V4 §2-3).

Module and parameter names are the official checkpoint names (``layers.L.attn.wq_a.weight`` ...), so a checkpoint
loads with ``load_state_dict``; the routed experts translate their per-expert names to a stacked layout.
Legend: T tokens, n mHC streams, D width, V vocab.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from .attention import Attention
from .config import ModelConfig
from . import stages
from .context import LayerCache, ModelCache, SharedSlots, StepMeta
from .engram import Engram
from .engram_hash import EngramTables, engram_hash_ids_packed, engram_tables, test_token_map
from .expert_parallel import ExpertExchange
from .hyper_connections import hc_collapse, hc_expand, hc_head, hc_mixer
from .layers import RMSNorm, RopeTable, weight_param
from .moe import MoE


EAGER_BUDGET_BYTES = 1 << 30
"""The default memory budget of ``Transformer.set_eager_budget``: 1 GiB of temporaries per budgeted chain."""


class LayerKind(NamedTuple):
    """A layer's roles (``Block.kind()``): layers of one kind trace ``Block.core`` to the same graph."""

    ratio: int | str  # "shared": a V4.1 layer that reads its source's compressed KV, whatever the ratio
    kv_source: Any
    index_source: Any
    owns_index_keys: bool
    candidate_filtered: bool
    candidate_source: Any
    v4_indexer: bool
    hash_routed: bool


class Block(nn.Module):
    """One layer. ``engram_rows``: rows its Engram table holds (default: the config's ``engram_num_embeddings``)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RopeTable | None = None,
                 engram_rows: int | None = None) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", weight_param(mix, cfg.hc_mult * cfg.dim, dtype=torch.float32))
            setattr(self, f"hc_{site}_base", weight_param(mix, dtype=torch.float32))
            setattr(self, f"hc_{site}_scale", weight_param(3, dtype=torch.float32))
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer_id, rope)
        self.ffn = MoE(cfg, layer_id)
        self.has_engram = layer_id in cfg.engram_layers
        if self.has_engram:
            real = cfg.engram_rows(layer_id)
            self.engram = Engram(cfg, real if engram_rows is None else min(real, engram_rows))

    def kind(self) -> LayerKind:
        """What makes two layers trace ``core`` to the same graph: their roles (attention ratio, kv / index source,
        index-key owner, candidate filter / source, V4 indexer, hash routing); ``core`` reads nothing else that
        differs between layers (it never reads ``layer_id``: see ``LayerCache``). A per-layer compile reuses one
        graph for every layer of a kind. An Engram is not part of it: it runs in front of ``core`` (``front``) and
        compiles as a graph of its own, so an Engram layer shares the graph of its kind. A V4.1 compressed layer
        that is no KV source never reads its own ratio: it attends the source's compressed KV (ratio "shared"), and,
        re-indexing, reads the metadata of the source's ratio (the source's ratio is its kind's)."""
        a, cfg = self.attn, self.cfg
        ratio: int | str = a.ratio
        if cfg.is_v41 and a.compressed and not a.kv_source:
            source = max(j for j in range(self.layer_id + 1) if cfg.is_kv_source(j))
            ratio = cfg.ratio(source) if a.index_source else "shared"
        return LayerKind(ratio, a.kv_source, a.index_source, a.owns_index_keys, a.candidate_filtered,
                         a.candidate_source, a.v4_indexer, self.ffn.gate.hash)

    @property
    def has_front(self) -> bool:
        """Whether ``front`` does anything: a V4.1 Engram layer."""
        return self.has_engram and self.cfg.is_v41

    def _mix(self, site: str, x: torch.Tensor):
        c = self.cfg
        return hc_mixer(x, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                        getattr(self, f"hc_{site}_scale"), c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)

    def _attn(self, x: torch.Tensor, meta: StepMeta, cache: LayerCache, shared: SharedSlots) -> torch.Tensor:
        stages.enter("attn", x)
        h = self.attn(x, meta, cache, shared)
        stages.exit("attn", h)
        return h

    def _ffn(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        stages.enter("moe", x)
        h = self.ffn(x, input_ids)
        stages.exit("moe", h)
        return h

    def forward(self, x: torch.Tensor, pre: torch.Tensor | None, meta: StepMeta, cache: LayerCache,
                shared: SharedSlots, engram_ids: torch.Tensor | None = None):
        """x [T, n, D] streams; ``cache`` this layer's tensors; ``engram_ids`` this layer's hash ids (Engram layers).
        The layer is ``core`` after ``front`` (a per-layer compile compiles the two apart, composed the same way:
        ``minidi.runtime.regional.RegionalStep``). Returns (streams, pre for next)."""
        if self.has_front:
            x = self.front(x, engram_ids)
        return self.core(x, pre, meta, cache, shared)

    def front(self, x: torch.Tensor, engram_ids: torch.Tensor | None) -> torch.Tensor:
        """The Engram (V4.1 Engram layers; ``has_front``): its n-gram memory added to the streams [T, n, D]."""
        return self.engram(x, engram_ids)

    def core(self, x: torch.Tensor, pre: torch.Tensor | None, meta: StepMeta, cache: LayerCache,
             shared: SharedSlots):
        """The layer but its Engram. V4.1 (single pass): ``pre`` comes from the previous site and the one computed
        here collapses the next site's input; V4: every site uses its own ``pre``. Returns (streams, pre for
        next)."""
        if self.cfg.is_v41:
            pre_a, post, comb = self._mix("attn", x)
            h = self._attn(self.attn_norm(hc_collapse(x, pre)), meta, cache, shared)
            x = hc_expand(x, h, post, comb)
            pre_f, post, comb = self._mix("ffn", x)
            h = self._ffn(self.ffn_norm(hc_collapse(x, pre_a)), meta.input_ids)
            return hc_expand(x, h, post, comb), pre_f
        pre_a, post, comb = self._mix("attn", x)
        x = hc_expand(x, self._attn(self.attn_norm(hc_collapse(x, pre_a)), meta, cache, shared), post, comb)
        pre_f, post, comb = self._mix("ffn", x)
        return hc_expand(x, self._ffn(self.ffn_norm(hc_collapse(x, pre_f)), meta.input_ids), post, comb), None


def _rope_key(compressed: bool) -> str:
    return "compressed" if compressed else "window"


class OutputHead(nn.Module):
    """The output projection (checkpoint name ``head.weight``, bf16 [V, D]): fp32 logits of the final-normed rows,
    the official fp32 head GEMM. Its own module so that a per-layer compile compiles it too (pass O's site)."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = weight_param(vocab_size, dim, dtype=torch.bfloat16)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """y [L, D] -> logits [L, V] fp32."""
        return y.float() @ self.weight.float().t()


def set_eager_budget(module: nn.Module, nbytes: int | None = EAGER_BUDGET_BYTES) -> None:
    """``Transformer.set_eager_budget`` for any part of a model (a Block run eagerly on its own): every submodule
    with an ``eager_budget`` gets ``nbytes``."""
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"eager budget must be >= 0 bytes or None, got {nbytes}")
    for m in module.modules():
        if hasattr(m, "eager_budget"):
            m.eager_budget = nbytes


class Transformer(nn.Module):
    """``model(input_ids [S])`` -> fp32 logits [S, V] for one sequence starting at position 0.

    ``engram_rows`` (default None: the real tables): hold at most this many rows per Engram table and take each
    hash id modulo the table's rows (a smaller random table for benchmarks: the full-size tables are ~100 GB each;
    every token still gathers the same number of rows). A construction-time choice, not a config field."""

    def __init__(self, cfg: ModelConfig, engram_rows: int | None = None) -> None:
        super().__init__()
        if engram_rows is not None and engram_rows < 1:
            raise ValueError(f"engram_rows must be >= 1 (None = the real tables), got {engram_rows}")
        self.cfg = cfg
        self.engram_rows = engram_rows
        self.embed = nn.Module()
        self.embed.weight = weight_param(cfg.vocab_size, cfg.dim, dtype=torch.bfloat16)
        # RoPE cos/sin tables, one per inv_freq variant in use, each shared by all layers of its variant (not per
        # layer: 256 MB each at 1M positions); non-persistent, so not in the checkpoint
        self.rope = nn.ModuleDict({_rope_key(c): RopeTable(cfg, c)
                                   for c in sorted({cfg.ratio(i) > 0 for i in range(cfg.n_layers)})})
        self.layers = nn.ModuleList(Block(cfg, i, self.rope[_rope_key(cfg.ratio(i) > 0)], engram_rows)
                                    for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = OutputHead(cfg.vocab_size, cfg.dim)
        if not cfg.is_v41:
            self.hc_head_fn = weight_param(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=torch.float32)
            self.hc_head_base = weight_param(cfg.hc_mult, dtype=torch.float32)
            self.hc_head_scale = weight_param(1, dtype=torch.float32)
        self._register_engram_buffers()
        self.layer_hook = None  # called with the layer index before each layer (regional compilation's bookkeeping)

    # ---- Engram host-side tables (not in the checkpoint) -------------------------------------------------------------
    def _register_engram_buffers(self) -> None:
        cfg = self.cfg
        if not cfg.engram_layers:
            return
        # default: the documented test map (token id mod C); a real tokenizer's map replaces it (set_token_map).
        # Host-side constants: built on the CPU even when the module is being built on the meta device.
        with torch.device("cpu"):
            token_map = test_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
            tables = engram_tables(cfg)
        self.register_buffer("engram_token_map", token_map, persistent=False)
        for layer, t in tables.items():
            for name, value in t._asdict().items():
                self.register_buffer(f"engram_{name}_{layer}", value, persistent=False)

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """Install the compressed token map built from the tokenizer (``engram_hash.build_token_map``)."""
        from .engram_hash import check_token_map

        check_token_map(token_map, self.cfg)
        self.engram_token_map = token_map.to(self.embed.weight.device)

    def reset_buffers(self) -> None:
        """Recompute non-checkpoint buffers (after building on the meta device and loading with assign=True).
        The RoPE tables are built on the weights' device (cos/sin as that device computes them), once each."""
        device = self.embed.weight.device
        if self.cfg.engram_layers:
            self._register_engram_buffers()
        for module in self.modules():  # modules() yields a shared module (a RoPE table) once
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers(device)
        self.to(device)

    def engram_ids(self, meta: StepMeta) -> dict[int, torch.Tensor]:
        cfg = self.cfg
        comp = self.engram_token_map[meta.engram_tokens]
        pad = self.engram_token_map[cfg.engram_pad_id]
        out = {}
        for layer in cfg.engram_layers:
            t = EngramTables(*(getattr(self, f"engram_{n}_{layer}") for n in EngramTables._fields))
            ids = engram_hash_ids_packed(comp, meta.engram_src, t, pad)
            rows = self.layers[layer].engram.rows
            if rows < cfg.engram_rows(layer):  # a smaller table (``engram_rows``): ids taken modulo its rows
                ids = ids % rows
            out[layer] = ids
        return out

    def set_expert_exchange(self, exchange: ExpertExchange) -> None:
        """Install how every MoE meets the other ranks' tokens (``expert_parallel``); its size must be the config's
        ``ep_size`` (the experts this model holds)."""
        if exchange.size != self.cfg.ep_size:
            raise ValueError(f"expert exchange for EP{exchange.size} on a model built with ep_size "
                             f"{self.cfg.ep_size}: build the model with ep_size={exchange.size}")
        for layer in self.layers:
            layer.ffn.exchange = exchange

    def set_eager_budget(self, nbytes: int | None = EAGER_BUDGET_BYTES) -> None:
        """Bound the temporaries of the chains that are huge at long contexts when the model runs eagerly: the naive
        indexer's [T, Hi, N] score product, the FP4 expert-stack decode, the fp32 grouped GEMM's [R, E, N] einsum.
        With a budget they are built in pieces under ``nbytes`` each (same values; the fp32 grouped GEMM becomes a
        loop over experts, one host sync). ``None`` (a built model's state) keeps the whole chains: the form
        ``torch.compile`` must trace (passes B and D match it; Inductor fuses it, so it builds none of those
        temporaries). The model never asks whether it is being compiled: runtime code that runs it eagerly at long
        contexts sets a budget (the benchmark's eager mode and expert-loads step; a full-size fp32 reference), and
        code that compiles it leaves (or sets) None."""
        set_eager_budget(self, nbytes)

    @property
    def ratios(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.cfg.compress_ratios) - {0}))

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """The plain reference forward: one sequence from position 0, nothing cached -> logits [S, V] (fp32).
        ``input_ids``: integer token ids, a 1-D tensor [S] (or [1, S]) or a list of ints."""
        cfg = self.cfg
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.tensor(input_ids, device=self.embed.weight.device)
            input_ids = input_ids.long() if input_ids.numel() == 0 else input_ids  # [] is a float tensor
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be integer token ids (a 1-D integer tensor [S] or a list of ints), "
                            f"got dtype {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D sequence of token ids (a tensor [S] or a list of "
                             f"ints), got shape {tuple(input_ids.shape)}; batches of sequences go through "
                             f"minidi.Engine")
        bad = (input_ids < 0) | (input_ids >= cfg.vocab_size)
        if bad.any():
            pos = int(bad.nonzero()[0, 0])
            raise ValueError(f"token id {int(input_ids[pos])} at position {pos} is outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
        if input_ids.numel() > cfg.max_position_embeddings:
            raise ValueError(f"sequence of {input_ids.numel()} tokens exceeds max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        meta = StepMeta.for_sequence(input_ids, cfg.window_size, self.ratios, cfg.step_ngram)
        return self.step(meta, ModelCache())

    def step(self, meta: StepMeta, cache: ModelCache) -> torch.Tensor:
        """One step over a packed batch (``meta`` built on the host; ``cache`` updated in place).
        Returns fp32 logits [L, V] of the rows ``meta.logit_rows``. No host sync, no data-dependent branches."""
        cfg = self.cfg
        engram_ids = self.engram_ids(meta) if cfg.engram_layers else {}
        h = self.embed.weight[meta.input_ids].to(cfg.torch_dtype)  # [T, D]
        x = h.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()  # [T, n, D]: n identical streams
        pre = None
        if cfg.is_v41:  # the first site collapses with a one-hot on stream 0
            pre = torch.zeros(h.shape[0], cfg.hc_mult, device=h.device)
            pre[:, 0] = 1.0
        shared = SharedSlots()
        for i, layer in enumerate(self.layers):
            if self.layer_hook is not None:
                self.layer_hook(i)
            x, pre = layer(x, pre, meta, cache.layer(i), shared, engram_ids.get(i))
        x = x[meta.logit_rows]
        if cfg.is_v41:
            y = hc_collapse(x, pre[meta.logit_rows])
        else:
            y = hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.hc_eps, cfg.norm_eps)
        return self.head(self.norm(y))
