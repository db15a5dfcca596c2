"""transformers' ``DeepseekV4ForCausalLM`` as an independent reference for minidi's V4 model (helpers, no tests).

- ``hf_config_for(cfg)``: a minidi V4 ``ModelConfig`` -> ``DeepseekV4Config`` with the schedule spelled out
  (``layer_types`` + ``compress_rates`` + ``mlp_layer_types`` + ``partial_rotary_factor`` + flat yarn
  ``rope_parameters``; spec V4 §1, §13 and the audit). The legacy ``compress_ratios`` route cannot express the tiny
  model's ratio 16 (HF raises KeyError), so it is not used.
- ``official_to_hf(cfg, tensors)``: official checkpoint tensors (spec §10.1 formats, §11 names) -> HF state dict in
  fp32 (FP8 / FP4 dequantised with minidi's own ``dequant_fp8`` / ``dequant_fp4``), experts stacked.
- ``build_hf_model(cfg, tensors)``: the fp32 eval-mode HF model with those weights loaded ``strict=True``.
- ``random_official_tensors(cfg, seed)``: the shared generator ``minidi.runtime.random_weights.random_state_dict``.

HF keys that no checkpoint tensor fills: the ``rotary_emb.{main,compress}_{,original_}inv_freq`` buffers of the model
and of every compressor / indexer. They are non-persistent (absent from ``state_dict()``), computed from the config,
and must not be overwritten (audit section). ``HF_INIT_DEGENERATE`` lists the HF tensors that ``_init_weights`` leaves
zero / one / all-expert-0, so a test can assert that the mapping overwrote every one of them.
"""

from __future__ import annotations

import logging
import re
import warnings

import torch

from minidi.model.config import ModelConfig
from minidi.model.quant import dequant_fp4, dequant_fp8

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402  (tests importorskip first)

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# HF tensors that DeepseekV4PreTrainedModel._init_weights leaves degenerate (zeros / ones / tid2eid all 0), as
# regexes over HF state-dict names (spec audit: "HF random-init parameters to re-randomise before comparing").
HF_INIT_DEGENERATE: tuple[str, ...] = (
    r"model\.layers\.\d+\.self_attn\.sinks",
    r"model\.layers\.\d+\.self_attn\.compressor\.position_bias",
    r"model\.layers\.\d+\.self_attn\.compressor\.indexer\.position_bias",
    r"model\.layers\.\d+\.(attn_hc|ffn_hc)\.(base|scale)",
    r"model\.hc_head\.(hc_base|hc_scale)",
    r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias",
    r"model\.layers\.\d+\.mlp\.gate\.tid2eid",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
    r"model\.layers\.\d+\.self_attn\.(q_a_norm|kv_norm)\.weight",
    r"model\.layers\.\d+\.self_attn\.compressor\.kv_norm\.weight",
    r"model\.layers\.\d+\.self_attn\.compressor\.indexer\.kv_norm\.weight",
    r"model\.norm\.weight",
)


# ---- config ---------------------------------------------------------------------------------------------------
def _layer_type(ratio: int) -> str:
    # The official code keys overlap + indexer on ratio == 4 (spec §13); every other non-zero ratio is HCA-like.
    return SWA if ratio == 0 else CSA if ratio == 4 else HCA


def hf_config_for(cfg: ModelConfig) -> DeepseekV4Config:
    """``DeepseekV4Config`` for a minidi V4 config, checked: layer types, ratios, hash layers and rope parameters.

    Raises if HF would warn while building it (a warning here has meant a silently different model before, e.g. an
    implicit YaRN factor) or if HF's folded fields disagree with ``cfg``.
    """
    if cfg.arch != "v4":
        raise ValueError(f"transformers 5.24 has no {cfg.arch!r} model; only arch='v4' is comparable")
    layer_types = [_layer_type(r) for r in cfg.compress_ratios]
    hca_rates = {r for r in cfg.compress_ratios if r not in (0, 4)}
    if len(hca_rates) > 1:
        raise ValueError(f"HF has one ratio per layer type; HCA-like layers use several: {sorted(hca_rates)}")
    compress_rates = {CSA: 4, HCA: hca_rates.pop() if hca_rates else 128}
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        layer_types=layer_types, compress_rates=compress_rates,
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layers)],
        num_attention_heads=cfg.n_heads, num_key_value_heads=1, head_dim=cfg.head_dim,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        sliding_window=cfg.window_size,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.n_activated_experts,
        moe_intermediate_size=cfg.moe_inter_dim, n_shared_experts=cfg.n_shared_experts,
        scoring_func=cfg.score_func, routed_scaling_factor=cfg.route_scale, norm_topk_prob=True,
        swiglu_limit=cfg.swiglu_limit, hidden_act="silu",
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        # Flat (not nested): __post_init__ turns it into the "compress" entry and injects attention_factor=1.0
        # (a nested dict without it would scale cos/sin by 0.1*ln(16)+1, spec §1 trap (b)).
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        # = factor * original only silences HF's "implicit factor" warning; the explicit factor decides the numerics.
        max_position_embeddings=int(cfg.rope_factor * cfg.original_seq_len),
        tie_word_embeddings=False, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
    )
    with _capture_warnings() as caught:
        hf = DeepseekV4Config(**kwargs)
    if caught:
        raise AssertionError("DeepseekV4Config warned:\n  " + "\n  ".join(caught))

    expect_rope = {
        "main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                 "partial_rotary_factor": cfg.rope_head_dim / cfg.head_dim},
        "compress": {"rope_type": "yarn", "factor": cfg.rope_factor,
                     "original_max_position_embeddings": cfg.original_seq_len,
                     "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                     "rope_theta": cfg.compress_rope_theta,
                     "partial_rotary_factor": cfg.rope_head_dim / cfg.head_dim, "attention_factor": 1.0},
    }
    checks = {
        "layer_types": (list(hf.layer_types), layer_types),
        "compress_rates": (dict(hf.compress_rates), compress_rates),
        "mlp_layer_types": (list(hf.mlp_layer_types), kwargs["mlp_layer_types"]),
        "qk_rope_head_dim": (hf.qk_rope_head_dim, cfg.rope_head_dim),
        "rope_parameters": (hf.rope_parameters, expect_rope),
    }
    bad = [f"{k}: HF {got!r} != expected {want!r}" for k, (got, want) in checks.items() if got != want]
    if bad:
        raise AssertionError("DeepseekV4Config folded the schedule differently:\n  " + "\n  ".join(bad))
    return hf


class _capture_warnings:
    """Collect ``warnings.warn`` and transformers-logger warnings raised inside the block (as strings)."""

    def __enter__(self) -> list[str]:
        self.caught: list[str] = []
        self._w = warnings.catch_warnings(record=True)
        self._records = self._w.__enter__()
        warnings.simplefilter("always")
        self._handler = _ListHandler(self.caught)
        self._logger = logging.getLogger("transformers")
        self._logger.addHandler(self._handler)
        return self.caught

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self._handler)
        self._w.__exit__(*exc)
        self.caught.extend(f"{w.category.__name__}: {w.message}" for w in self._records)


class _ListHandler(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(level=logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(f"{record.levelname}: {record.getMessage()}")


# ---- weights --------------------------------------------------------------------------------------------------
# Official per-layer suffix -> HF per-layer suffix (spec §11). Linear entries carry ".weight" on both sides.
_LAYER_RENAMES: dict[str, str] = {
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight", "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight", "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight", "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",  # fp32 buffer in HF
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",  # int64 buffer in HF
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_GLOBAL_RENAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight",
    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")


def _dequant(name: str, t: torch.Tensor, tensors: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    """fp32 value of checkpoint tensor ``name``: FP8 / FP4 with their ``.scale`` sidecar, else a plain upcast."""
    scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
    if scale_name is None or scale_name not in tensors:
        if t.dtype in (torch.float8_e4m3fn, torch.int8):
            raise KeyError(f"{name} is {t.dtype} but has no {scale_name} sidecar")
        return t if t.dtype == torch.int64 else t.float()
    scale = tensors[scale_name]
    if t.dtype == torch.float8_e4m3fn:
        want = (-(-t.shape[0] // block), -(-t.shape[1] // block))  # ceil division (spec §10.1)
        if tuple(scale.shape) != want:
            raise ValueError(f"{scale_name}: shape {tuple(scale.shape)}, expected {want} for {tuple(t.shape)}")
        return dequant_fp8(t, scale, block, torch.float32)
    if t.dtype == torch.int8:  # FP4 e2m1 packed, E8M0 [out, in/32]
        if tuple(scale.shape) != (t.shape[0], 2 * t.shape[1] // 32):
            raise ValueError(f"{scale_name}: shape {tuple(scale.shape)} does not fit packed {tuple(t.shape)}")
        return dequant_fp4(t, scale, torch.float32)
    raise TypeError(f"{name}: has a .scale sidecar but dtype {t.dtype} (expected float8_e4m3fn or int8)")


def official_to_hf(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official V4 checkpoint tensors -> HF ``DeepseekV4ForCausalLM`` state dict (fp32; tid2eid int64).

    Every input tensor is consumed (``.scale`` sidecars by their weight; ``mtp.*`` dropped as HF does); any other
    unmapped name raises. Routed experts are stacked: ``gate_up_proj[e] = cat(w1, w3)`` [E, 2I, D] and
    ``down_proj[e] = w2`` [E, D, I].
    """
    block = cfg.weight_block
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # layer -> expert -> w1/w2/w3
    unmapped: list[str] = []
    for name, t in tensors.items():
        if name.endswith(".scale") or name.startswith("mtp."):
            continue
        if name in _GLOBAL_RENAMES:
            out[_GLOBAL_RENAMES[name]] = _dequant(name, t, tensors, block)
            continue
        m = _LAYER_RE.fullmatch(name)
        if m is None:
            unmapped.append(name)
            continue
        layer, rest = int(m.group(1)), m.group(2)
        e = _EXPERT_RE.fullmatch(rest)
        if e is not None:
            experts.setdefault(layer, {}).setdefault(int(e.group(1)), {})[e.group(2)] = _dequant(
                name, t, tensors, block)
        elif rest in _LAYER_RENAMES:
            out[f"model.layers.{layer}.{_LAYER_RENAMES[rest]}"] = _dequant(name, t, tensors, block)
        else:
            unmapped.append(name)
    orphan_scales = [n for n in tensors if n.endswith(".scale") and not n.startswith("mtp.")
                     and n[: -len("scale")] + "weight" not in tensors]
    if unmapped or orphan_scales:
        raise KeyError(f"official tensors with no HF name: {sorted(unmapped + orphan_scales)}")

    for layer, per_e in experts.items():
        n_e = cfg.n_routed_experts
        if sorted(per_e) != list(range(n_e)) or any(sorted(w) != ["w1", "w2", "w3"] for w in per_e.values()):
            raise KeyError(f"layer {layer}: incomplete routed experts (have {sorted(per_e)})")
        pre = f"model.layers.{layer}.mlp.experts"
        out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([per_e[i]["w1"], per_e[i]["w3"]], 0) for i in range(n_e)])
        out[f"{pre}.down_proj"] = torch.stack([per_e[i]["w2"] for i in range(n_e)])
    return out


def build_hf_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> DeepseekV4ForCausalLM:
    """fp32 eval-mode HF model carrying the official ``tensors`` (strict load: every persistent key covered)."""
    torch.manual_seed(0)  # HF's random init is overwritten everywhere; seeded only for reproducible failures
    model = DeepseekV4ForCausalLM(hf_config_for(cfg)).float().eval()
    mapped = official_to_hf(cfg, tensors)
    model.load_state_dict(mapped, strict=True)
    return model


def hf_logits(model: DeepseekV4ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [S] int64 -> fp32 logits [S, vocab] (all positions, no cache; hash layers need input_ids)."""
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0].float()


def degenerate_hf_keys(model: DeepseekV4ForCausalLM) -> list[str]:
    """The state-dict names of ``model`` that match ``HF_INIT_DEGENERATE`` (must all come from the checkpoint)."""
    pats = [re.compile(p) for p in HF_INIT_DEGENERATE]
    return [k for k in model.state_dict() if any(p.fullmatch(k) for p in pats)]


# ---- random official tensors ------------------------------------------------------------------------------------
def random_official_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random, non-degenerate official-format tensors from the shared generator."""
    from minidi.runtime.random_weights import random_state_dict

    return random_state_dict(cfg, seed, gate_bias="random")  # non-degenerate: the router bias too
