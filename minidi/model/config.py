"""One frozen config for DeepSeek-V4.1-Flash (``arch="v41"``) and DeepSeek-V4-Flash (``arch="v4"``).

Field names follow the official ``inference/config.json`` (``dim``, ``n_layers`` ...); ``from_hf_config`` reads the
HF ``config.json`` of either release (V4.1 nests the text model under ``text_config``). Presets hold the two
full-size shapes and the tiny random-weight test models (spec V4.1 §15, V4 §13).

(Over 350 lines: one frozen dataclass whose fields, validation and HF mapping must be read together; most of its
length is the field list with a comment per field.)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config_types import MINIMA, type_problem

ARCHS = ("v41", "v4")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture + numerics switches. Per-layer schedules are tuples of length ``n_layers``."""

    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    # compressed attention / indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # V4.1 CSA2 sharing (empty for V4: every compressed layer owns its compressor/indexer)
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2048
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    n_hash_layers: int = 0
    # RoPE
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    max_position_embeddings: int = 1048576
    # Engram (V4.1)
    engram_layers: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # special tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    # numerics: fake_quant on = the released QAT semantics; dtype "bfloat16" keeps the reference's fp32 islands,
    # "float32" runs everything in fp32 (for comparisons).
    fake_quant: bool = True
    dtype: str = "bfloat16"
    # deployment, not architecture (never in config.json):
    # expert parallelism: this rank holds experts [ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size)
    ep_size: int = 1
    ep_rank: int = 0
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        problems = self.validate()
        if problems:
            raise ValueError(f"invalid ModelConfig {self.name!r}:\n  " + "\n  ".join(problems))

    # ---- derived architecture facts -------------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.arch == "v41"

    @property
    def step_ngram(self) -> int:
        """The n-gram depth a step's metadata hashes (``StepMeta``'s ``ngram``): engram_max_ngram with Engram layers,
        0 without (the field keeps its default then)."""
        return self.engram_max_ngram if self.engram_layers else 0

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def weight_block(self) -> int:
        """FP8 weight scale tile (32x32 in V4.1, 128x128 in V4)."""
        return 32 if self.is_v41 else 128

    @property
    def act_block(self) -> int:
        """fq8 block of FP8/FP4-linear inputs along K."""
        return 32 if self.is_v41 else 128

    @property
    def fp4_block(self) -> int:
        return 32

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[self.dtype]

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @property
    def n_local_experts(self) -> int:
        return self.n_routed_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.n_local_experts

    def engram_rows(self, layer: int) -> int:
        """Rows of the Engram table of ``layer`` (the sum of its primes; a model may hold fewer:
        ``Transformer(cfg, engram_rows=...)``)."""
        return self.engram_num_embeddings[self.engram_layers.index(layer)]

    def is_kv_source(self, layer: int) -> bool:
        """Layer runs its own attention compressor (V4: every compressed layer)."""
        if self.ratio(layer) == 0:
            return False
        return layer in self.kv_source_layers if self.is_v41 else True

    def is_index_source(self, layer: int) -> bool:
        """Layer runs its own indexer (owners + re-index layers in V4.1; V4: ratio-4 layers)."""
        if self.is_v41:
            return layer in self.index_source_layers
        return self.ratio(layer) == 4

    def has_indexer(self, layer: int) -> bool:
        """Layer attends to an indexer-selected top-k (own or reused); V4 ratio-128 layers attend densely."""
        if self.ratio(layer) == 0:
            return False
        return True if self.is_v41 else self.ratio(layer) == 4

    def owns_index_keys(self, layer: int) -> bool:
        """V4.1 owners (kv sources that index) compute indexer keys from their compressor latent."""
        return self.is_v41 and self.is_kv_source(layer) and self.is_index_source(layer)

    def is_candidate_filtered(self, layer: int) -> bool:
        """V4.1 re-index layers (index source, not kv source, after the candidate source) score inside candidates."""
        return (
            self.is_v41
            and self.candidate_source_layer >= 0
            and layer > self.candidate_source_layer
            and self.is_index_source(layer)
            and not self.is_kv_source(layer)
        )

    def is_candidate_source(self, layer: int) -> bool:
        """V4.1: the index-source layer whose scores pick the candidate blocks the re-index layers score inside."""
        return self.is_v41 and layer == self.candidate_source_layer and self.is_index_source(layer)

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def with_(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- validation -------------------------------------------------------------------------------------------
    def validate(self) -> list[str]:
        p = [msg for f in dataclasses.fields(self) if (msg := field_type_problem(f.name, getattr(self, f.name)))]
        if p:  # the checks below do arithmetic on the values: a str would fail them with an unrelated TypeError
            return p
        p = [f"{nm} must be >= {lo}, got {getattr(self, nm)}" for nm, lo in MINIMA.items() if getattr(self, nm) < lo]
        if any(r < 0 for r in self.compress_ratios):
            p.append(f"compress_ratios must be >= 0, got {self.compress_ratios}")
        if p:
            return p
        if self.arch not in ARCHS:
            p.append(f"arch must be one of {ARCHS}, got {self.arch!r}")
            return p
        if len(self.compress_ratios) != self.n_layers:
            p.append(f"compress_ratios has {len(self.compress_ratios)} entries, n_layers is {self.n_layers}")
            return p
        if self.dtype not in ("bfloat16", "float32"):
            p.append(f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.n_heads % self.o_groups:
            p.append(f"n_heads {self.n_heads} not divisible by o_groups {self.o_groups}")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            p.append(f"rope_head_dim {self.rope_head_dim} must be even and <= head_dim {self.head_dim}")
        if self.n_activated_experts > self.n_routed_experts:
            p.append("n_activated_experts > n_routed_experts")
        if self.ep_size < 1 or self.n_routed_experts % self.ep_size:
            p.append(f"ep_size {self.ep_size} must be >= 1 and divide n_routed_experts {self.n_routed_experts}")
        elif not 0 <= self.ep_rank < self.ep_size:
            p.append(f"ep_rank {self.ep_rank} must be in [0, ep_size {self.ep_size})")
        wb = self.weight_block if self.is_v41 else self.act_block
        for nm, v in (("dim", self.dim), ("q_lora_rank", self.q_lora_rank),
                      ("o_groups*o_lora_rank", self.o_groups * self.o_lora_rank),
                      ("moe_inter_dim", self.moe_inter_dim)):
            if v % wb:
                p.append(f"{nm}={v} must be a multiple of the FP8 input block {wb}")
        if self.head_dim % 32 or self.index_head_dim % 32:
            p.append("head_dim and index_head_dim must be multiples of 32 (fake-quant blocks)")
        if not self.is_v41 and self.index_head_dim & (self.index_head_dim - 1):
            p.append("V4 index_head_dim must be a power of two (Hadamard)")
        if self.score_func != "sqrtsoftplus":
            p.append(f"score_func {self.score_func!r} not supported (only sqrtsoftplus)")
        if self.is_v41:
            for layer in self.kv_source_layers:
                if not (0 <= layer < self.n_layers) or self.ratio(layer) == 0:
                    p.append(f"kv source layer {layer} must be a compressed layer")
            for r in set(self.compress_ratios) - {0, 1, 2}:
                p.append(f"V4.1 compress ratio {r} not supported (0, 1, 2)")
            for layer in self.index_source_layers:
                if not (0 <= layer < self.n_layers) or self.ratio(layer) == 0:
                    p.append(f"index source layer {layer} must be a compressed layer")
            if self.candidate_source_layer >= 0 and self.candidate_source_layer not in self.kv_source_layers:
                p.append(f"candidate source layer {self.candidate_source_layer} must be a kv source layer")
            first_src = min(self.kv_source_layers, default=self.n_layers)
            for layer in range(self.n_layers):
                if self.ratio(layer) and layer < first_src:
                    p.append(f"compressed layer {layer} comes before any kv source layer")
            if len(self.engram_layers) != len(self.engram_num_embeddings):
                p.append("engram_layers and engram_num_embeddings differ in length")
            if self.engram_head_dim % 32:
                p.append("engram_head_dim must be a multiple of 32")
            if self.candidate_source_layer >= 0 and (
                (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1 < self.index_topk
            ):
                p.append("candidate_topk_blocks*block_size too small for index_topk (official and HF rules diverge)")
        else:
            if self.engram_layers:
                p.append("V4 has no Engram layers")
        return p

    # ---- (de)serialisation ------------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` of this config (V4.1: wrapped in the composite config)."""
        common = {
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim, "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank, "sliding_window": self.window_size,
            "compress_ratios": list(self.compress_ratios),
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps, "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts, "num_experts_per_tok": self.n_activated_experts,
            "moe_intermediate_size": self.moe_inter_dim, "scoring_func": self.score_func,
            "norm_topk_prob": True, "topk_method": "noaux_tc",
            "routed_scaling_factor": self.route_scale, "swiglu_limit": self.swiglu_limit, "hidden_act": "silu",
            "rope_theta": self.rope_theta, "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": {"rope_type": "yarn", "factor": self.rope_factor,
                             "original_max_position_embeddings": self.original_seq_len,
                             "beta_fast": self.beta_fast, "beta_slow": self.beta_slow},
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }
        if not self.is_v41:
            return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                    **common, "num_hash_layers": self.n_hash_layers, "num_nextn_predict_layers": 0,
                    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
                    "expert_dtype": "fp4"}
        text = {
            "model_type": "deepseek_v41_text", **common,
            "kv_source_layer_ids": list(self.kv_source_layers),
            "index_source_layer_ids": list(self.index_source_layers),
            "candidate_source_layer_id": self.candidate_source_layer,
            "candidate_topk_blocks": self.candidate_topk_blocks, "candidate_block_size": self.candidate_block_size,
            "engram_layer_ids": list(self.engram_layers), "engram_num_embeddings": list(self.engram_num_embeddings),
            "engram_max_ngram_size": self.engram_max_ngram, "engram_vocab_size": self.engram_vocab_size,
            "engram_n_heads": self.engram_n_heads, "engram_head_dim": self.engram_head_dim,
            "engram_pad_token_id": self.engram_pad_id, "engram_pad_id": self.engram_pad_id,
            "engram_compressed_vocab_size": self.engram_compressed_vocab_size, "num_nextn_predict_layers": 0,
        }
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
                "text_config": text}

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], **overrides: Any) -> "ModelConfig":
        return _from_hf_dict(raw, **overrides)

    @classmethod
    def from_hf_config(cls, path: str | Path, **overrides: Any) -> "ModelConfig":
        """Read ``config.json`` (a file, or a checkpoint directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {p}")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON ({e})") from e
        return _from_hf_dict(raw, name=overrides.pop("name", str(p.parent)), **overrides)


# ---- value types (the rules: config_types.py) ---------------------------------------------------------------------
def field_type_problem(name: str, value: Any, key: str | None = None) -> str | None:
    """The problem with ``value`` as the config field ``name`` (``key``: its config.json name for the message)."""
    ann = {f.name: f.type for f in dataclasses.fields(ModelConfig)}[name]
    return type_problem(ann, value, f"config.json key {key!r}" if key else name)


# ModelConfig field -> config.json key, for messages that name the key the user has to fix
_HF_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "head_dim": "head_dim", "rope_head_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "window_size": "sliding_window", "compress_ratios": "compress_ratios", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps", "norm_eps": "rms_norm_eps",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok", "moe_inter_dim": "moe_intermediate_size",
    "score_func": "scoring_func", "route_scale": "routed_scaling_factor", "swiglu_limit": "swiglu_limit",
    "n_hash_layers": "num_hash_layers", "rope_theta": "rope_theta", "compress_rope_theta": "compress_rope_theta",
    "rope_factor": "rope_scaling.factor", "original_seq_len": "rope_scaling.original_max_position_embeddings",
    "beta_fast": "rope_scaling.beta_fast", "beta_slow": "rope_scaling.beta_slow",
    "max_position_embeddings": "max_position_embeddings", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids", "candidate_source_layer": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks", "candidate_block_size": "candidate_block_size",
    "engram_layers": "engram_layer_ids", "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram": "engram_max_ngram_size", "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads", "engram_head_dim": "engram_head_dim", "engram_pad_id": "engram_pad_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
}


def _from_hf_dict(raw: dict[str, Any], **overrides: Any) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type") or ""
    if not isinstance(model_type, str):
        raise ValueError(f"config.json key 'model_type' must be a string, got {model_type!r}")
    if "text_config" in raw:
        text = raw["text_config"]
        if not isinstance(text, dict):
            raise ValueError(f"config.json key 'text_config' must be an object, got {type(text).__name__}")
        model_type = text.get("model_type") or ("deepseek_v41_text" if model_type == "deepseek_v41" else model_type)
        if not isinstance(model_type, str):
            raise ValueError(f"config.json key 'text_config.model_type' must be a string, got {model_type!r}")
        raw = {**text}
    if model_type.startswith("deepseek_v41"):
        arch = "v41"
    elif model_type == "deepseek_v4":
        arch = "v4"
    else:
        raise ValueError(f"unsupported model_type {model_type!r} (expected deepseek_v41 or deepseek_v4)")

    def need(key: str) -> Any:
        if key not in raw:
            raise ValueError(f"config.json ({model_type}) lacks required key {key!r}")
        return raw[key]

    n_layers = need("num_hidden_layers")
    if msg := field_type_problem("n_layers", n_layers, "num_hidden_layers"):
        raise ValueError(msg)
    ratios = raw.get("compress_ratios")
    if ratios is None:
        raise ValueError("config.json lacks 'compress_ratios' (HF layer_types-only configs are not supported)")
    if msg := field_type_problem("compress_ratios", ratios, "compress_ratios"):
        raise ValueError(msg)
    if len(ratios) < n_layers:
        raise ValueError(f"compress_ratios has {len(ratios)} entries < num_hidden_layers {n_layers}")
    rs = raw.get("rope_scaling") or {}
    if not isinstance(rs, dict):
        raise ValueError(f"config.json key 'rope_scaling' must be an object, got {rs!r}")
    kw: dict[str, Any] = dict(
        arch=arch, vocab_size=need("vocab_size"), dim=need("hidden_size"), n_layers=n_layers,
        n_heads=need("num_attention_heads"), head_dim=need("head_dim"), rope_head_dim=need("qk_rope_head_dim"),
        q_lora_rank=need("q_lora_rank"), o_groups=need("o_groups"), o_lora_rank=need("o_lora_rank"),
        window_size=need("sliding_window"), compress_ratios=tuple(int(r) for r in ratios[:n_layers]),
        index_n_heads=need("index_n_heads"), index_head_dim=need("index_head_dim"), index_topk=need("index_topk"),
        hc_mult=raw.get("hc_mult", 4), hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20),
        hc_eps=raw.get("hc_eps", 1e-6), norm_eps=raw.get("rms_norm_eps", 1e-6),
        n_routed_experts=need("n_routed_experts"), n_shared_experts=raw.get("n_shared_experts", 1),
        n_activated_experts=need("num_experts_per_tok"), moe_inter_dim=need("moe_intermediate_size"),
        score_func=raw.get("scoring_func", "sqrtsoftplus"), route_scale=raw.get("routed_scaling_factor", 1.0),
        swiglu_limit=raw.get("swiglu_limit", 10.0), n_hash_layers=raw.get("num_hash_layers", 0) or 0,
        rope_theta=raw.get("rope_theta", 10000.0), compress_rope_theta=raw.get("compress_rope_theta", 160000.0),
        rope_factor=rs.get("factor", 1.0), original_seq_len=rs.get("original_max_position_embeddings", 65536),
        beta_fast=rs.get("beta_fast", 32), beta_slow=rs.get("beta_slow", 1),
        max_position_embeddings=need("max_position_embeddings"),
        bos_token_id=raw.get("bos_token_id", 0), eos_token_id=raw.get("eos_token_id", 1),
    )
    if isinstance(kw["eos_token_id"], list) and kw["eos_token_id"]:
        kw["eos_token_id"] = kw["eos_token_id"][0]
    if arch == "v41":
        kw.update(
            kv_source_layers=need("kv_source_layer_ids"),
            index_source_layers=need("index_source_layer_ids"),
            candidate_source_layer=raw.get("candidate_source_layer_id", -1),
            candidate_topk_blocks=raw.get("candidate_topk_blocks", 2048),
            candidate_block_size=raw.get("candidate_block_size", 8),
            engram_layers=raw.get("engram_layer_ids", ()),
            engram_num_embeddings=raw.get("engram_num_embeddings", ()),
            engram_max_ngram=raw.get("engram_max_ngram_size", 4),
            engram_vocab_size=raw.get("engram_vocab_size", 16000000),
            engram_n_heads=raw.get("engram_n_heads", 8), engram_head_dim=raw.get("engram_head_dim", 256),
            # HF reads `engram_pad_id`; the checkpoint's config.json names it `engram_pad_token_id` (spec §1, §16).
            engram_pad_id=raw.get("engram_pad_id", raw.get("engram_pad_token_id", 2)),
            engram_compressed_vocab_size=raw.get("engram_compressed_vocab_size", 99092),
        )
    for name, value in kw.items():  # name the config.json key, before ModelConfig names only its own field
        if name in _HF_KEYS and (msg := field_type_problem(name, value, _HF_KEYS[name])):
            raise ValueError(msg)
        if isinstance(value, list):
            kw[name] = tuple(value)
    kw.update(overrides)
    return ModelConfig(**kw)
