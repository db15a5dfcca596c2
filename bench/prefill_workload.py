"""The prefill benchmark's workload: the model as the reference run holds it, and one step on a cached prefix.

- Model: a checkpoint folder (real layout) or a preset. Full-size presets get random weights in the checkpoint
  formats; ``share_experts`` gives every layer the same routed-expert tensors (FLOPs and bytes moved per layer are
  unchanged; 7.2 GB of V4.1 experts per layer do not fit the 60 MB L2 either way, so nothing is served from cache that
  would not be), ``engram_rows`` holds a smaller random Engram table (``Transformer(cfg, engram_rows=...)``: ids
  taken modulo its rows; each token still gathers 24 rows of 256 B), ``gate_bias`` chooses the random router bias
  (zero: balanced routing, the default; random: the old 0.3·N, expert loads max/mean 16.6 at V4.1 EP4), and
  ``emulate_ep`` N builds one rank of EP N (``minidi.runtime.expert_parallel``).
- Cache: one sequence whose first ``cached`` positions are in the cache, filled with random rows (window ring,
  compressed KV, indexer keys (fq4 values with fake quant on, as the model writes them), pending compressor rows)
  instead of a real prefill of the prefix; then ``new`` new
  tokens in one step. Every timed step re-runs that same step: its cache writes land in rows after the prefix (and
  in the window ring / pending rows, which it overwrites with the same kind of values), so each step does identical
  work on an identical cache shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import minidi
from minidi.model.context import StepMeta
from minidi.model.model import Transformer
from minidi.model.presets import PRESETS
from minidi.model.quant import fq4_ue8m0
from minidi.runtime.batch import StepItem, build_step
from minidi.runtime.cache import CacheManager, SeqCache
from minidi.runtime.expert_parallel import EmulatedEP

FULL_SIZE = ("v41-flash", "v4-flash")
SYNTHETIC_ENGRAM_ROWS = 1 << 24  # default table of the random full-size presets: 16.8M rows (4.3 GB) instead of 384M


@dataclass
class Workload:
    model: Transformer
    cache: CacheManager
    meta: StepMeta
    new_tokens: int
    cached_tokens: int
    seqs: int
    notes: list[str]  # what differs from a real deployment, printed on the card
    pool_factor: int = 1  # cache pools this many times the positions the step needs


def is_synthetic(model: str) -> bool:
    return model in PRESETS and not model.startswith("tiny")


def build_model(name: str, device: str, dtype: str, emulate_ep: int, share_experts: str, engram_rows: int | None,
                seed: int, notes: list[str], world: int = 1, rank: int = 0, gate_bias: str | None = None
                ) -> Transformer:
    """``world`` > 1: this process is rank ``rank`` of a torchrun job (process group initialised): it holds
    1/world of the experts and exchanges tokens with the other ranks (``DistributedEP``)."""
    overrides: dict = {"dtype": dtype}  # (bench_prefill.main refuses --emulate-ep with real ranks)
    if emulate_ep > 1:
        overrides.update(ep_size=emulate_ep, ep_rank=0)
    if world > 1:  # the config refuses an ep_size that does not divide the experts, naming both
        overrides.update(ep_size=world, ep_rank=rank)
    synthetic = is_synthetic(name)
    if engram_rows is None:  # the random full-size V4.1 tables would be 98 GB each
        engram_rows = SYNTHETIC_ENGRAM_ROWS if synthetic and minidi.preset(name).engram_layers else 0
    share = synthetic if share_experts == "auto" else share_experts == "on"
    if share and not synthetic:
        raise SystemExit(f"--share_experts on needs a random-weight preset ({', '.join(FULL_SIZE)}), not {name!r}")
    if not synthetic and (gate_bias is not None or engram_rows):
        raise SystemExit(f"--gate_bias / --engram_table_rows choose random weights ({', '.join(FULL_SIZE)}); "
                         f"{name!r} loads its checkpoint's")
    if synthetic:
        overrides.update(gate_bias=gate_bias or "zero", engram_rows=engram_rows or None)
    model = minidi.load_model(name, device=device, seed=seed, share_experts=share, **overrides)
    cfg = model.cfg
    if synthetic:
        notes.append(f"router: random gate bias {gate_bias or 'zero'}" + (
            " (0.3·N: skewed expert loads, the workload before issue 17)" if gate_bias == "random" else
            " (balanced routing, as a trained router's loss-free balancing; --gate_bias random: the old 0.3·N)"))
    if share:
        notes.append(f"weights: one routed-expert set ({cfg.n_local_experts} experts) shared by all {cfg.n_layers} "
                     f"layers; FLOPs and bytes moved per layer unchanged (the experts never fit L2 either way)")
    if cfg.engram_layers and model.engram_rows:
        notes.append(f"Engram: random tables of {model.layers[cfg.engram_layers[0]].engram.rows:,} rows (real: "
                     f"{max(cfg.engram_num_embeddings):,}); hash ids taken modulo; the same 24 rows/token gathered")
    if emulate_ep > 1:
        exchange = EmulatedEP(emulate_ep)
        model.set_expert_exchange(exchange)
        notes.append(exchange.describe())
    if world > 1:
        from minidi.runtime.distributed import install_expert_parallel

        # every rank runs the same workload shape: equal token counts, no count exchange, traceable by compile
        exchange = install_expert_parallel(model, uniform=True)
        notes.append(exchange.describe())
    return model


def fill_random(cm: CacheManager, seed: int) -> None:
    """Every cache row random (unit-RMS normal rows, like the normalised KV / key rows the model writes; pending
    K|G rows: random keys and gates), generated on the cache's device. With fake quant on, the indexer's key rows are
    fq4 values, as the model writes them (``IndexerV41.keys`` / ``IndexerV4``: ``fq4_ue8m0(., 32)``): pass B's FP8
    score checks each key row for an exact e4m3 form and rescores the rows that have none with the bf16 dot, so
    non-fq4 keys would time that fallback on every row (round 11: 108 ms a step), a cache the model never holds."""
    gen = torch.Generator(device=cm.device).manual_seed(seed)
    t = cm.tensors
    for pool in [*t.window.values(), *t.comp.values(), *t.index_k.values(), *t.pending.values()]:
        fq4 = cm.cfg.fake_quant and any(pool is k for k in t.index_k.values())
        for chunk in pool.split(1 << 16):
            rows = torch.randn(chunk.shape, generator=gen, device=cm.device, dtype=torch.float32)
            chunk.copy_(fq4_ue8m0(rows, 32) if fq4 else rows)


def random_prefix(cm: CacheManager, cached: int) -> SeqCache:
    """A sequence that holds ``cached`` positions (their rows are whatever ``fill_random`` put there)."""
    seq = SeqCache()
    cm.grow(seq, cached)
    seq.length = cached
    return seq


def build_workload(model: Transformer, new: int, cached: int, seqs: int, seed: int, notes: list[str],
                   pool_factor: int = 1) -> Workload:
    """``pool_factor``: the cache pools hold that many times the positions the step's sequences need (the rest
    unused): a step's cost must not grow with the pool (issue 23: within 3 % at 8x)."""
    cfg = model.cfg
    if pool_factor < 1:
        raise SystemExit(f"--pool_factor must be >= 1, got {pool_factor}")
    total = cached + new
    if total > cfg.max_position_embeddings:
        raise SystemExit(f"cached {cached} + new {new} tokens exceed max_position_embeddings "
                         f"{cfg.max_position_embeddings} of {cfg.name}")
    device = model.embed.weight.device
    cm = CacheManager(cfg, max_slots=seqs, max_tokens=seqs * total * pool_factor, device=device)
    fill_random(cm, seed)
    gen = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(seqs):
        seq = random_prefix(cm, cached) if cached else SeqCache()
        cm.grow(seq, total)
        h = cfg.engram_max_ngram - 1  # the Engram history: the K - 1 tokens before the step
        tokens = torch.randint(0, cfg.vocab_size, (new + h,), generator=gen).tolist()
        items.append(StepItem(seq, tokens[h:], tokens[:h] if cached else []))
    if cached:
        notes.append(f"cache: {cached:,} cached positions per sequence filled with random rows (indexer keys fq4 "
                     "with fake quant on; no prefill of the "
                     f"prefix); each timed step re-runs the same {new:,}-token step on it")
    if pool_factor > 1:
        notes.append(f"cache pools: {pool_factor}x the positions the step needs")
    return Workload(model, cm, build_step(cm, items), new, cached, seqs, notes, pool_factor)
