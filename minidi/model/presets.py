"""Named configs: the two released full-size shapes and the tiny random-weight test models.

``tiny-v41`` is spec V4.1 §15 with 8 index heads instead of 4 (ReLU scores tie at exactly 0.0 far less often, so
top-k picks do not hinge on rounding; PITFALLS "Comparing two implementations"). ``tiny-v4`` is spec V4 §13 with
16 index heads for the same reason (the V4 audit measured no ties with 16). ``tiny-v41-b`` is a second, differently
shaped V4.1 (other layer schedule, head counts and ratios) so that tests and passes are not tuned to one shape.
"""

from __future__ import annotations

from .config import ModelConfig

_V41_FLASH = dict(
    arch="v41", vocab_size=129280, dim=5120, n_layers=40, n_heads=64, head_dim=512, rope_head_dim=64,
    q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window_size=128,
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
    index_n_heads=32, index_head_dim=128, index_topk=512,
    kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20,
    n_routed_experts=384, n_shared_experts=1, n_activated_experts=6, moe_inter_dim=2304,
    route_scale=1.5, swiglu_limit=10.0, n_hash_layers=0,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
    max_position_embeddings=1048576,
    engram_layers=(1, 14), engram_num_embeddings=(384006168, 384016682), engram_max_ngram=4,
    engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256, engram_pad_id=2,
    engram_compressed_vocab_size=99092,
)

_V4_FLASH = dict(
    arch="v4", vocab_size=129280, dim=4096, n_layers=43, n_heads=64, head_dim=512, rope_head_dim=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window_size=128,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4,),
    index_n_heads=64, index_head_dim=128, index_topk=512,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
    n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, moe_inter_dim=2048,
    route_scale=1.5, swiglu_limit=10.0, n_hash_layers=3,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
    max_position_embeddings=1048576,
)

_TINY_V41 = dict(
    arch="v41", vocab_size=512, dim=256, n_layers=10, n_heads=4, head_dim=128, rope_head_dim=64,
    q_lora_rank=128, o_groups=2, o_lora_rank=64, window_size=16,
    compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1),
    kv_source_layers=(2, 4, 6), index_source_layers=(2, 4, 6, 8),
    candidate_source_layer=6, candidate_topk_blocks=4, candidate_block_size=4,
    index_n_heads=8, index_head_dim=128, index_topk=8,
    n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=128,
    route_scale=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=64,
    max_position_embeddings=1024,
    engram_layers=(1, 4), engram_num_embeddings=(630, 834), engram_max_ngram=4, engram_vocab_size=97,
    engram_n_heads=2, engram_head_dim=32, engram_pad_id=2, engram_compressed_vocab_size=64,
)

# A second V4.1 shape: more heads, other window / top-k / group sizes, kv sources at other depths.
_TINY_V41_B = dict(
    _TINY_V41, dim=192, n_layers=8, n_heads=8, head_dim=96, rope_head_dim=32, q_lora_rank=96, o_groups=4,
    o_lora_rank=32, window_size=8, compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1),
    kv_source_layers=(1, 4), index_source_layers=(1, 4, 6), candidate_source_layer=4,
    candidate_topk_blocks=3, candidate_block_size=4, index_n_heads=8, index_head_dim=64, index_topk=6,
    n_routed_experts=6, n_activated_experts=3, moe_inter_dim=96,
    engram_layers=(2,), engram_num_embeddings=(630,), engram_n_heads=2, engram_head_dim=32,
)

_TINY_V4 = dict(
    arch="v4", vocab_size=512, dim=256, n_layers=4, n_heads=4, head_dim=128, rope_head_dim=64,
    q_lora_rank=128, o_groups=2, o_lora_rank=128, window_size=16, compress_ratios=(0, 4, 16, 4),
    index_n_heads=16, index_head_dim=128, index_topk=4,
    n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=256, n_hash_layers=1,
    route_scale=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=64,
    max_position_embeddings=1024,
)

PRESETS: dict[str, dict] = {
    "v41-flash": _V41_FLASH,
    "v4-flash": _V4_FLASH,
    "tiny-v41": _TINY_V41,
    "tiny-v41-b": _TINY_V41_B,
    "tiny-v4": _TINY_V4,
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named config; ``overrides`` replace fields (e.g. ``dtype="float32", fake_quant=False``)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides, "name": name})
