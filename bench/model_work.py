"""FLOPs per step of minidi's compute-bound kernels, from the model's FLOP count (``minidi/runtime/flops.py``), for the
kernel table (``kernel_table.py``): a custom op's launch carries no FLOPs in the profiler's trace, and its work
depends on data the trace does not hold (how many rows each local expert got, how many keys each query sees), while
the model's count states it for the workload.

``KERNEL_TERMS``: a count term -> the kernels that compute it (a layer filter where one term runs in two kernels,
e.g. the indexer scores every visible key in some layers and only candidate blocks in others). In a trace the
term's FLOPs go to the heaviest of its kernels present (an op's fallback kernel that runs beside it with no tiles
gets none). The rate is then the *effective* one: the model's FLOPs over the kernel's time (a kernel that computes
masked tiles or padded slots does more).
"""

from __future__ import annotations

from typing import Callable

from minidi.model.config import ModelConfig
from minidi.runtime.flops import flop_terms


def _every_layer(cfg: ModelConfig, layer: int) -> bool:
    return True


def _scores_every_key(cfg: ModelConfig, layer: int) -> bool:
    return not cfg.is_candidate_filtered(layer)


def _scores_candidates(cfg: ModelConfig, layer: int) -> bool:
    return cfg.is_candidate_filtered(layer)


# label -> (term name, which layers' terms, kernels that compute them)
KERNEL_TERMS: dict[str, tuple[str, Callable[[ModelConfig, int], bool], tuple[str, ...]]] = {
    "moe.routed": ("moe.routed", _every_layer,
                   ("_fp8_fp4_grouped_mm_sm90", "_fp8_fp4_grouped_mm_kernel", "_fp4_grouped_mm_sm90_rs_chunked",
                    "_fp4_grouped_mm_sm90_rs", "_fp4_grouped_mm_sm90", "_fp4_grouped_mm_kernel")),
    "attn.core": ("attn.core", _every_layer,
                  ("_sparse_attention_sm90_stagger", "_sparse_attention_sm90_split", "_sparse_attention_sm90",
                   "_sparse_attention_kernel")),
    "indexer.score (every visible key)": ("indexer.score", _scores_every_key, ("_score_fp8_kernel", "_score_kernel")),
    "indexer.score (candidate blocks)": ("indexer.score", _scores_candidates, ("_candidate_score_kernel",)),
}


def kernel_model_flops(cfg: ModelConfig, new_tokens: int, cached_tokens: int,
                       seqs: int = 1) -> dict[str, tuple[tuple[str, ...], float]]:
    """label -> (kernel names, FLOPs per step of the model's terms they compute); labels with no FLOPs left out."""
    terms = flop_terms(cfg, new_tokens, cached_tokens, seqs)
    out = {}
    for label, (name, layers, kernels) in KERNEL_TERMS.items():
        flops = sum(t.flops for t in terms if t.name == name and layers(cfg, t.layer))
        if flops > 0:
            out[label] = (kernels, flops)
    return out


__all__ = ["KERNEL_TERMS", "kernel_model_flops"]
