"""Model FLOPs of one prefill step, counted from the config (for MFU and for the per-stage table of the benchmark).

The count is the work the model *means* to do, not what a given kernel executes: 2*M*N*K for every matmul or einsum,
with attention and indexer scores counted only over the keys / entries each query may actually see (a masked-dense
kernel does more; a sparse one does about this). Elementwise work (norms, RoPE, softmax, fake quant, SwiGLU, top-k,
the indexer's relu-weight-sum) is ignored. Every term is attributed to one of the profiler's stage categories, so a
FLOP column can sit next to the stage table of ``bench/prefill_stages.py``.

Legend: S seqs, P cached tokens per sequence, n new tokens per sequence, T = S*n; a new token of a sequence sits at
position p in [P, P+n). D dim, H heads, d head_dim, ql q_lora_rank, G o_groups, ol o_lora_rank, W window_size,
m compress ratio of the layer's compressed source, N_p = (p+1)//m compressed entries visible at p (spec V4.1 §7),
Hi/di index heads / head dim, k_top index_topk, E experts, k experts per token, I moe_inter_dim, hm hc_mult, V vocab.
Sums "sum_p" run over the new positions of one sequence and are multiplied by S.

Terms (category in brackets), per layer unless said:

- attention projections [other_attention], every layer:
  wq_a 2*T*D*ql; wq_b 2*T*ql*H*d; wkv 2*T*D*d; wo_a 2*T*H*d*ol (G groups of (H*d/G) x ol); wo_b 2*T*G*ol*D.
- attention compressor [other_attention], kv-source layers, run on all T new tokens:
  2*T*D*width per projection; V4.1 m=2: wkv + wgate, width d; V4.1 m=1: wkv only; V4 m=4 (overlapping windows):
  wkv + wgate of width 2*d; other V4 ratios: wkv + wgate of width d.
- sparse attention core [sparse_attention_core]: QK^T + PV = 2 * 2*H*d per (query, key), over
  sum_p (min(W, p+1) + C_p) keys, C_p = 0 (window-only), min(k_top, N_p) (top-k layers: V4.1 every compressed
  layer, V4 ratio 4), N_p (V4 layers that attend densely to every visible entry, ratio 128).
- indexer [indexer], index-source layers: queries wq_b 2*T*ql*Hi*di; head weights weights_proj 2*T*D*Hi;
  scores 2*Hi*di * sum_p E_p with E_p = N_p, or for candidate-filtered V4.1 layers the candidate entries
  E_p = N_p if ceil(N_p/B) <= Kb else (Kb-1)*B + r_p (Kb candidate_topk_blocks, B candidate_block_size; the newest,
  partly filled block of r_p = N_p - B*floor((N_p-1)/B) entries is always kept, spec V4.1 §8).
  Keys: V4.1 owners wk 2*Nn*d*di over the Nn = S*((P+n)//m - P//m) entries completed this step; V4 its own
  ratio-4 compressor, wkv + wgate of width 2*di: 2 * 2*T*D*2*di.
- MoE [moe], every layer: gate 2*T*D*E (computed in hash layers too); routed k * 3 * 2*T*D*I; shared
  n_shared_experts * 3 * 2*T*D*I.
- mHC [hc_norm_other], two sites per layer: mixer projection 2*T*(hm*D)*((2+hm)*hm); comb mix (an einsum of an
  hm x hm matrix with the streams) 2*T*hm*hm*D. V4 adds hc_head over the logit rows: 2*S*(hm*D)*hm.
- Engram [hc_norm_other], Engram layers: wkv 2*T*((max_ngram-1)*engram_heads*engram_head_dim)*((hm+1)*D).
- head [hc_norm_other], once: one logit row per sequence, 2*S*D*V. The embedding is a gather (0 FLOPs).
- communication: 0 (exchanging tokens moves bytes, it computes nothing).

Check against ``shared/perf/ROOFLINE.md`` (V4.1-Flash, n 4,096 new after P 126,976 cached, S 1): attention
projections 1.037 T per layer (anchor 1.04), sparse attention core 0.344 T per compressed layer and 0.069 T per
window-only layer (exact: every query sees 128 window keys and >= 512 entries), MoE routed + shared 2.029 T per
layer (anchor 2.03; the gate adds 0.016 T), whole step 153.0 T (anchor ~152). Two known differences, both small:
the anchor's indexer rows use the full n = 65,536 / 131,072 entries for every query, while only the visible ones
are counted here (N_p grows from 63,488 to 65,536 for m = 2): 2.165 T instead of 2.2 T per ratio-2 owner, 4.329 T
instead of 4.4 T for layer 20, 0.550 T per candidate-filtered layer (13.0 T for all indexer scores instead of 13.2).
And the anchor table's rows leave out terms counted here: Engram (1.29 T per Engram layer, 2 layers), the gates
(0.64 T), the mHC projections (0.38 T) and the indexer / compressor projections (0.51 T); its rows sum to ~149 T,
its step total of ~152 T includes about these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidi.model.config import ModelConfig

CATEGORIES = ("sparse_attention_core", "other_attention", "indexer", "moe", "communication", "hc_norm_other")


@dataclass(frozen=True)
class FlopTerm:
    """One counted matmul family: ``layer`` (-1 for model-level terms such as the head), a short ``name``
    (``"attn.wq_a"``), the stage ``category`` it runs in, and its FLOPs for the whole step."""

    layer: int
    name: str
    category: str
    flops: float


class _Positions:
    """Per-query visibility counts over the new positions [P, P+n) of one sequence, summed (exact integers)."""

    def __init__(self, cached_tokens: int, new_tokens: int) -> None:
        self.cached, self.new = cached_tokens, new_tokens
        self.pos = torch.arange(cached_tokens, cached_tokens + new_tokens, dtype=torch.int64)  # [n]

    def window_keys(self, window: int) -> int:
        """sum_p min(W, p+1): window rows max(0, p-W+1)..p."""
        return int((self.pos + 1).clamp(max=window).sum())

    def visible(self, m: int) -> torch.Tensor:
        """N_p = (p+1)//m per new position [n]."""
        return (self.pos + 1) // m

    def selected(self, m: int, topk: int) -> int:
        """sum_p min(k_top, N_p): compressed entries a top-k layer attends."""
        return int(self.visible(m).clamp(max=topk).sum())

    def candidates(self, m: int, keep_blocks: int, block: int) -> int:
        """sum_p of the entries inside the kept candidate blocks (see the module docstring)."""
        n = self.visible(m)
        newest = n - block * ((n - 1).clamp(min=0) // block)  # entries in the newest (partly filled) block
        capped = (keep_blocks - 1) * block + newest
        all_kept = (n + block - 1) // block <= keep_blocks
        return int(torch.where(all_kept, n, capped).sum())

    def completed_entries(self, m: int) -> int:
        """Compressed entries whose group completes in this step: (P+n)//m - P//m."""
        return (self.cached + self.new) // m - self.cached // m


def _check_args(cfg: ModelConfig, new_tokens: int, cached_tokens: int, seqs: int) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a minidi ModelConfig, got {type(cfg).__name__}")
    for name, v, lo in (("new_tokens", new_tokens, 1), ("cached_tokens", cached_tokens, 0), ("seqs", seqs, 1)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if cached_tokens + new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"cached_tokens + new_tokens = {cached_tokens + new_tokens} exceeds "
                         f"max_position_embeddings {cfg.max_position_embeddings} of {cfg.name!r}")


def flop_terms(cfg: ModelConfig, new_tokens: int, cached_tokens: int, seqs: int = 1) -> list[FlopTerm]:
    """Every counted term of one step (formulas in the module docstring), in layer order; see ``step_flops``."""
    _check_args(cfg, new_tokens, cached_tokens, seqs)
    c, s = cfg, seqs
    t = seqs * new_tokens
    ps = _Positions(cached_tokens, new_tokens)
    hm, d, di, hi = c.hc_mult, c.head_dim, c.index_head_dim, c.index_n_heads
    terms: list[FlopTerm] = []

    def add(layer: int, name: str, category: str, flops: int) -> None:
        terms.append(FlopTerm(layer, name, category, float(flops)))

    window_keys = ps.window_keys(c.window_size)
    src_ratio = 0  # V4.1: ratio of the most recent kv source (its entries are what later layers attend and score)
    for layer in range(c.n_layers):
        m = c.ratio(layer)
        # mHC and Engram: outside every stage range
        if layer in c.engram_layers:
            rows = (c.engram_max_ngram - 1) * c.engram_n_heads * c.engram_head_dim
            add(layer, "engram.wkv", "hc_norm_other", 2 * t * rows * (hm + 1) * c.dim)
        for site in ("attn", "ffn"):
            add(layer, f"hc.{site}_mixer", "hc_norm_other", 2 * t * hm * c.dim * (2 + hm) * hm)
            add(layer, f"hc.{site}_comb", "hc_norm_other", 2 * t * hm * hm * c.dim)
        # attention projections
        add(layer, "attn.wq_a", "other_attention", 2 * t * c.dim * c.q_lora_rank)
        add(layer, "attn.wq_b", "other_attention", 2 * t * c.q_lora_rank * c.n_heads * d)
        add(layer, "attn.wkv", "other_attention", 2 * t * c.dim * d)
        add(layer, "attn.wo_a", "other_attention", 2 * t * c.n_heads * d * c.o_lora_rank)
        add(layer, "attn.wo_b", "other_attention", 2 * t * c.o_groups * c.o_lora_rank * c.dim)
        if c.is_kv_source(layer):
            src_ratio = m
            if c.is_v41:
                n_proj, width = (2 if m == 2 else 1), d
            else:
                n_proj, width = 2, (2 * d if m == 4 else d)
            add(layer, "attn.compressor", "other_attention", n_proj * 2 * t * c.dim * width)
        # attention core: window keys + compressed entries
        if m == 0:
            comp_keys = 0
        elif c.has_indexer(layer):
            comp_keys = s * ps.selected(src_ratio if c.is_v41 else m, c.index_topk)
        else:  # V4 heavily compressed layer: dense over every visible entry
            comp_keys = s * int(ps.visible(m).sum())
        add(layer, "attn.core", "sparse_attention_core", 2 * 2 * c.n_heads * d * (s * window_keys + comp_keys))
        # indexer
        if c.is_index_source(layer):
            im = src_ratio if c.is_v41 else m
            add(layer, "indexer.wq_b", "indexer", 2 * t * c.q_lora_rank * hi * di)
            add(layer, "indexer.weights_proj", "indexer", 2 * t * c.dim * hi)
            if c.owns_index_keys(layer):
                add(layer, "indexer.wk", "indexer", 2 * s * ps.completed_entries(m) * d * di)
            elif not c.is_v41:
                add(layer, "indexer.compressor", "indexer", 2 * 2 * t * c.dim * 2 * di)
            if c.is_candidate_filtered(layer):
                entries = ps.candidates(im, c.candidate_topk_blocks, c.candidate_block_size)
            else:
                entries = int(ps.visible(im).sum())
            add(layer, "indexer.score", "indexer", 2 * hi * di * s * entries)
        # MoE
        add(layer, "moe.gate", "moe", 2 * t * c.dim * c.n_routed_experts)
        add(layer, "moe.routed", "moe", c.n_activated_experts * 3 * 2 * t * c.dim * c.moe_inter_dim)
        add(layer, "moe.shared", "moe", c.n_shared_experts * 3 * 2 * t * c.dim * c.moe_inter_dim)
    if not c.is_v41:
        add(-1, "hc.head", "hc_norm_other", 2 * s * hm * c.dim * hm)
    add(-1, "head", "hc_norm_other", 2 * s * c.dim * c.vocab_size)
    return terms


def step_flops(cfg: ModelConfig, new_tokens: int, cached_tokens: int, seqs: int = 1) -> dict[str, float]:
    """FLOPs of one prefill step: ``seqs`` sequences, each with ``cached_tokens`` cached and ``new_tokens`` new.

    Returns {category: FLOPs} for the six stage categories (``communication`` is always 0) plus ``"total"``.
    """
    out = dict.fromkeys(CATEGORIES, 0.0)
    for term in flop_terms(cfg, new_tokens, cached_tokens, seqs):
        out[term.category] += term.flops
    out["total"] = sum(out[k] for k in CATEGORIES)
    return out


def mfu(flops_per_step: float, ms_per_step: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in [0, 1]: achieved FLOP/s over ``peak_tflops`` (TFLOP/s of the device and dtype
    the caller compares against, e.g. the measured bf16 dense peak)."""
    if ms_per_step <= 0 or peak_tflops <= 0:
        raise ValueError(f"ms_per_step ({ms_per_step}) and peak_tflops ({peak_tflops}) must be positive")
    return flops_per_step / (ms_per_step * 1e-3) / (peak_tflops * 1e12)
