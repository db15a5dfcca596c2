"""The declarative table of every text-backbone tensor of the official checkpoint (spec V4.1 §12, V4 §10.1/§11).

``expected_tensors(cfg)`` maps each official name (no ``model.`` prefix) to a ``TensorSpec`` (shape, dtype, storage
kind, init hint). The loader validates against it, the random generator fills it, and the model's ``state_dict()``
uses the same names. Layer schedules come only from the config helpers (``is_kv_source``, ``is_index_source``,
``owns_index_keys``, ``ratio``, ``is_hash_layer``), so there is one source of truth for which layer owns what.

Storage kinds:
- ``fp8_weight`` e4m3 [out, in] + ``fp8_scale`` E8M0 [ceil(out/B), ceil(in/B)] named ``<module>.scale`` (B = 32 / 128)
- ``fp4_weight`` int8 [out, in/2] (two e2m1 codes per byte) + ``fp4_scale`` E8M0 [out, in/32]
- ``fp8_rows`` e4m3 [rows, d] + ``fp8_rows_scale`` E8M0 [rows, d/32]: the Engram table, one scale per row per 32
  channels
- ``bf16``, ``f32``, ``i64``: plain tensors

Init hints (used by ``random_weights``; the V4 audit recipe, spec V4 "HF random-init parameters"):
``linear`` N(0,1)/sqrt(fan_in), ``rows`` N(0,1), ``norm`` 1+0.2·N, ``sink`` N(0,1), ``ape`` 0.5·N, ``hc_fn`` 0.05·N,
``hc_base`` 0.5·N, ``hc_scale`` U(0.5,1.5), ``bias`` 0.3·N, ``tid2eid`` first k of a random expert permutation,
``scale`` (made together with its weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minidi.model.config import ModelConfig

# Names the loader tolerates and skips: MTP / DSpark draft stages, the vision tower and its aligner (spec V4.1 §12).
SKIPPED_PREFIXES: tuple[str, ...] = ("mtp.", "vision.", "aligner.", "image_")

SCALE_KINDS = ("fp8_scale", "fp4_scale", "fp8_rows_scale")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: ``shape`` and ``dtype`` as stored, storage ``kind``, and a random-``init`` hint."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    init: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def is_skipped_name(name: str) -> bool:
    """True for names outside the text backbone that a loader should skip (MTP, DSpark, vision, aligner)."""
    return name.startswith(SKIPPED_PREFIXES)


def scale_name(weight_name: str) -> str:
    """``attn.wq_a.weight`` -> ``attn.wq_a.scale`` (the sidecar is ``<module>.scale``, not ``weight_scale_inv``)."""
    assert weight_name.endswith(".weight"), weight_name
    return weight_name[: -len(".weight")] + ".scale"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Table:
    """Builder: adds a tensor or an (quantised weight, scale) pair under a prefix."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.t: dict[str, TensorSpec] = {}

    def plain(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, init: str) -> None:
        kind = {torch.bfloat16: "bf16", torch.float32: "f32", torch.int64: "i64"}[dtype]
        self.t[name] = TensorSpec(tuple(shape), dtype, kind, init)

    def fp8(self, module: str, out: int, inp: int) -> None:
        b = self.cfg.weight_block
        self.t[f"{module}.weight"] = TensorSpec((out, inp), torch.float8_e4m3fn, "fp8_weight", "linear")
        self.t[f"{module}.scale"] = TensorSpec((_cdiv(out, b), _cdiv(inp, b)), torch.float8_e8m0fnu, "fp8_scale",
                                               "scale")

    def fp4(self, module: str, out: int, inp: int) -> None:
        b = self.cfg.fp4_block
        self.t[f"{module}.weight"] = TensorSpec((out, inp // 2), torch.int8, "fp4_weight", "linear")
        self.t[f"{module}.scale"] = TensorSpec((out, inp // b), torch.float8_e8m0fnu, "fp4_scale", "scale")

    def fp8_rows(self, module: str, rows: int, d: int) -> None:
        self.t[f"{module}.weight"] = TensorSpec((rows, d), torch.float8_e4m3fn, "fp8_rows", "rows")
        self.t[f"{module}.scale"] = TensorSpec((rows, d // 32), torch.float8_e8m0fnu, "fp8_rows_scale", "scale")


def _hc(tb: _Table, prefix: str, n_mix: int, n_scale: int) -> None:
    """mHC mixer params: fn [n_mix, hc·dim], base [n_mix], scale [n_scale], all fp32."""
    c = tb.cfg
    tb.plain(f"{prefix}_fn", (n_mix, c.hc_mult * c.dim), torch.float32, "hc_fn")
    tb.plain(f"{prefix}_base", (n_mix,), torch.float32, "hc_base")
    tb.plain(f"{prefix}_scale", (n_scale,), torch.float32, "hc_scale")


def _attention(tb: _Table, p: str, layer: int) -> None:
    """Per-layer attention core shared by both archs (spec V4.1 §6, V4 §4)."""
    c = tb.cfg
    bf, f32 = torch.bfloat16, torch.float32
    tb.plain(f"{p}attn.attn_sink", (c.n_heads,), f32, "sink")
    tb.fp8(f"{p}attn.wq_a", c.q_lora_rank, c.dim)
    tb.plain(f"{p}attn.q_norm.weight", (c.q_lora_rank,), bf, "norm")
    tb.fp8(f"{p}attn.wq_b", c.n_heads * c.head_dim, c.q_lora_rank)
    tb.fp8(f"{p}attn.wkv", c.head_dim, c.dim)
    tb.plain(f"{p}attn.kv_norm.weight", (c.head_dim,), bf, "norm")
    # wo_a is the grouped [o_groups·o_lora, heads/groups·head_dim] matrix; FP8 in the checkpoint (spec V4.1 §16).
    tb.fp8(f"{p}attn.wo_a", c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups)
    tb.fp8(f"{p}attn.wo_b", c.dim, c.o_groups * c.o_lora_rank)


def _v41_sparse(tb: _Table, p: str, layer: int) -> None:
    """V4.1 CSA2 compressor (kv sources) and indexer (index sources) tensors (spec V4.1 §7, §8, §12)."""
    c = tb.cfg
    bf = torch.bfloat16
    if c.is_kv_source(layer):
        tb.plain(f"{p}attn.compressor.wkv.weight", (c.head_dim, c.dim), bf, "linear")
        if c.ratio(layer) == 2:  # the m=1 compressor has no gate
            tb.plain(f"{p}attn.compressor.wgate.weight", (c.head_dim, c.dim), bf, "linear")
        tb.plain(f"{p}attn.compressor.norm.weight", (c.head_dim,), bf, "norm")
    if c.owns_index_keys(layer):
        tb.plain(f"{p}attn.indexer.wk.weight", (c.index_head_dim, c.head_dim), bf, "linear")
        tb.plain(f"{p}attn.indexer.k_norm.weight", (c.index_head_dim,), bf, "norm")
    if c.is_index_source(layer):
        tb.fp8(f"{p}attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        tb.plain(f"{p}attn.indexer.weights_proj.weight", (c.index_n_heads, c.dim), bf, "linear")


def _v4_compressor(tb: _Table, prefix: str, ratio: int, dc: int) -> None:
    """V4 compressor: ratio 4 overlaps (two halves, c=2), other ratios c=1 (spec V4 §5)."""
    c = tb.cfg
    cc = 2 if ratio == 4 else 1
    tb.plain(f"{prefix}.ape", (ratio, cc * dc), torch.float32, "ape")
    tb.plain(f"{prefix}.wkv.weight", (cc * dc, c.dim), torch.bfloat16, "linear")
    tb.plain(f"{prefix}.wgate.weight", (cc * dc, c.dim), torch.bfloat16, "linear")
    tb.plain(f"{prefix}.norm.weight", (dc,), torch.bfloat16, "norm")


def _v4_sparse(tb: _Table, p: str, layer: int) -> None:
    c = tb.cfg
    if c.is_kv_source(layer):
        _v4_compressor(tb, f"{p}attn.compressor", c.ratio(layer), c.head_dim)
    if c.is_index_source(layer):
        tb.fp8(f"{p}attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        tb.plain(f"{p}attn.indexer.weights_proj.weight", (c.index_n_heads, c.dim), torch.bfloat16, "linear")
        _v4_compressor(tb, f"{p}attn.indexer.compressor", c.ratio(layer), c.index_head_dim)


def _moe(tb: _Table, p: str, layer: int) -> None:
    """Gate, shared expert (FP8) and routed experts (FP4) (spec V4.1 §10, V4 §8)."""
    c = tb.cfg
    E = c.n_routed_experts
    tb.plain(f"{p}ffn.gate.weight", (E, c.dim), torch.bfloat16, "linear")
    if c.is_hash_layer(layer):
        tb.plain(f"{p}ffn.gate.tid2eid", (c.vocab_size, c.n_activated_experts), torch.int64, "tid2eid")
    else:
        tb.plain(f"{p}ffn.gate.bias", (E,), torch.float32, "bias")
    if c.is_v41:  # image-token routing bias (text uses `bias`)
        tb.plain(f"{p}ffn.gate.bias_vl", (E,), torch.float32, "bias")
    inter_s = c.moe_inter_dim * c.n_shared_experts
    tb.fp8(f"{p}ffn.shared_experts.w1", inter_s, c.dim)
    tb.fp8(f"{p}ffn.shared_experts.w2", c.dim, inter_s)
    tb.fp8(f"{p}ffn.shared_experts.w3", inter_s, c.dim)
    for e in range(c.first_local_expert, c.first_local_expert + c.n_local_experts):  # this rank's experts
        tb.fp4(f"{p}ffn.experts.{e}.w1", c.moe_inter_dim, c.dim)
        tb.fp4(f"{p}ffn.experts.{e}.w2", c.dim, c.moe_inter_dim)
        tb.fp4(f"{p}ffn.experts.{e}.w3", c.moe_inter_dim, c.dim)


def _engram(tb: _Table, p: str, rows: int) -> None:
    """Engram (spec V4.1 §5.2): table [rows, head_dim] + 1x32 row scales, wkv FP8, q/k weights [hc, dim] bf16."""
    c = tb.cfg
    tb.fp8_rows(f"{p}engram.embed", rows, c.engram_head_dim)
    n_in = (c.engram_max_ngram - 1) * c.engram_n_heads * c.engram_head_dim
    tb.fp8(f"{p}engram.wkv", (c.hc_mult + 1) * c.dim, n_in)
    tb.plain(f"{p}engram.q_weight", (c.hc_mult, c.dim), torch.bfloat16, "norm")
    tb.plain(f"{p}engram.k_weight", (c.hc_mult, c.dim), torch.bfloat16, "norm")


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every text-backbone tensor of the official checkpoint for ``cfg``: name -> TensorSpec (insertion = file order).

    MTP / DSpark / vision tensors are not listed (see ``SKIPPED_PREFIXES``).
    """
    tb = _Table(cfg)
    c = cfg
    n = c.hc_mult
    tb.plain("embed.weight", (c.vocab_size, c.dim), torch.bfloat16, "linear")
    for layer in range(c.n_layers):
        p = f"layers.{layer}."
        if layer in c.engram_layers:
            _engram(tb, p, c.engram_rows(layer))
        _hc(tb, f"{p}hc_attn", (2 + n) * n, 3)
        _hc(tb, f"{p}hc_ffn", (2 + n) * n, 3)
        tb.plain(f"{p}attn_norm.weight", (c.dim,), torch.bfloat16, "norm")
        tb.plain(f"{p}ffn_norm.weight", (c.dim,), torch.bfloat16, "norm")
        _attention(tb, p, layer)
        (_v41_sparse if c.is_v41 else _v4_sparse)(tb, p, layer)
        _moe(tb, p, layer)
    tb.plain("norm.weight", (c.dim,), torch.bfloat16, "norm")
    if not c.is_v41:  # V4 collapses the streams with an HC head; V4.1 has none (spec V4.1 §3)
        _hc(tb, "hc_head", n, 1)
    tb.plain("head.weight", (c.vocab_size, c.dim), torch.bfloat16, "linear")
    return tb.t


def table_summary(table: dict[str, TensorSpec]) -> dict[str, tuple[int, int, int]]:
    """Safetensors dtype name -> (tensor count, element count, byte count); for checking spec totals."""
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.int8: "I8",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0"}
    out: dict[str, list[int]] = {}
    for s in table.values():
        acc = out.setdefault(names[s.dtype], [0, 0, 0])
        acc[0] += 1
        acc[1] += s.numel
        acc[2] += s.nbytes
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}
