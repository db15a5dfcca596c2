"""Per-layer fidelity of a compiled step against the eager model, on identical cache state (``bench/numerics.py``).

Teacher forcing: the step runs eagerly, and at every layer the compiled layer (and the fp32 twin's layer) is run
on the eager layer's own inputs and cache state, then thrown away; the eager outputs and cache writes go on to the
next layer. So layer i's numbers say what compiling layer i does to one layer's output, not what 40 layers of
random weights make of a small difference (depth amplifies it through top-k and routing flips).

- ``LayerProbe`` wraps each block's call (``Block._compiled_call_impl``, the slot ``nn.Module.compile`` uses) for one
  teacher-forced step; the compiled callable it compares is the one the block had (a ``minidi.compile(regional=True)``
  step's), or none (only the fp32 twin).
- ``fp32_twin``: the same model in fp32 activations (fake quant as configured), sharing every tensor that is not
  bf16 with the original (FP8 / FP4 weights, scales): the QAT semantics in high precision, the scale of bf16 noise.
- Routing agreement is measured at the gate: the gate input the eager layer produced, fed to the eager gate and to
  a compiled gate (the same passes), so it isolates the router (a compiled block does not expose its routing).

Metrics: ``rel_rms(test, ref)`` = ||test - ref|| / ||ref|| in fp64; ``agreement`` = the share of the reference's
picks (row-wise sets, -1 = empty) that the test also picked.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from minidi.model.context import LayerCache, ModelCache, SharedSlots
from minidi.model.model import EAGER_BUDGET_BYTES, Transformer

CACHE_FIELDS = tuple(f.name for f in dataclasses.fields(LayerCache))


# ---- metrics -------------------------------------------------------------------------------------------------------
def rel_rms(test: torch.Tensor, ref: torch.Tensor) -> float:
    d, r = test.double() - ref.double(), ref.double()
    return float(d.norm() / r.norm().clamp_min(1e-300))


def max_abs(test: torch.Tensor, ref: torch.Tensor) -> float:
    return float((test.double() - ref.double()).abs().max()) if test.numel() else 0.0


def agreement(test: torch.Tensor, ref: torch.Tensor, columns: int) -> float | None:
    """Share of ``ref``'s picks ([T, k] column ids, -1 empty) that ``test`` holds in the same row (None if no picks)."""
    def as_mask(idx: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(idx.shape[0], columns + 1, dtype=torch.bool, device=idx.device)
        return m.scatter_(1, torch.where(idx < 0, columns, idx), True)[:, :columns]

    r, t = as_mask(ref), as_mask(test)
    n = int(r.sum())
    return float((r & t).sum()) / n if n else None


# ---- state ---------------------------------------------------------------------------------------------------------
def snapshot(lc: LayerCache) -> dict[str, torch.Tensor]:
    return {f: getattr(lc, f).clone() for f in CACHE_FIELDS if getattr(lc, f) is not None}


def restore(lc: LayerCache, snap: dict[str, torch.Tensor]) -> None:
    for f, t in snap.items():
        getattr(lc, f).copy_(t)


def cast_cache(snap: dict[str, torch.Tensor], dtype: torch.dtype) -> LayerCache:
    return LayerCache(**{f: (t.to(dtype) if t.dtype == torch.bfloat16 else t.clone()) for f, t in snap.items()})


def cast_shared(shared: SharedSlots, dtype: torch.dtype) -> SharedSlots:
    out = copy.copy(shared)
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16:
            setattr(out, f.name, v.to(dtype))
    return out


def model_cache_snapshot(mc: ModelCache) -> dict:
    return {name: {k: t.clone() for k, t in getattr(mc, name).items()} for name in ("window", "comp", "index_k",
                                                                                     "pending")}


def model_cache_restore(mc: ModelCache, snap: dict) -> None:
    for name, pools in snap.items():
        for k, t in pools.items():
            getattr(mc, name)[k].copy_(t)


def written_rows(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per cache tensor, the rows the layer changed (bool [rows])."""
    return {f: (after[f] != before[f]).reshape(after[f].shape[0], -1).any(-1) for f in after}


def cache_error(test: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rows: dict[str, torch.Tensor]
                ) -> float | None:
    """rel-RMS over the rows the reference wrote (all cache tensors of the layer together)."""
    num = den = 0.0
    for f, m in rows.items():
        if m.any():
            a, b = test[f][m].double(), ref[f][m].double()
            num += float((a - b).pow(2).sum())
            den += float(b.pow(2).sum())
    return (num / den) ** 0.5 if den else None


def set_budget(module: nn.Module, nbytes: int | None) -> None:
    for m in module.modules():
        if hasattr(m, "eager_budget"):
            m.eager_budget = nbytes


# ---- the fp32 twin -------------------------------------------------------------------------------------------------
def fp32_twin(model: Transformer) -> Transformer:
    """The model with fp32 activations and fp32 copies of its bf16 tensors; every other tensor (FP8 / FP4 weights,
    scales, fp32 tensors, tables) is shared with ``model``, so the twin costs twice the bf16 weights, not a model."""
    cfg = dataclasses.replace(model.cfg, dtype="float32")
    with torch.device("meta"):
        twin = Transformer(cfg, engram_rows=model.engram_rows)
    mods = dict(model.named_modules())
    for name, mod in twin.named_modules():
        src = mods[name]
        for k, p in src._parameters.items():
            mod._parameters[k] = None if p is None else (
                nn.Parameter(p.detach().float(), requires_grad=False) if p.dtype == torch.bfloat16 else p)
        for k, b in src._buffers.items():
            mod._buffers[k] = None if b is None else (b.float() if b.dtype == torch.bfloat16 else b)
        for attr in ("exchange", "eager_budget"):
            if hasattr(src, attr):
                setattr(mod, attr, getattr(src, attr))
    for attr in ("tokenizer",):
        if hasattr(model, attr):
            setattr(twin, attr, getattr(model, attr))
    meta = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"fp32 twin: tensors left on meta (not in the model?): {meta[:5]}")
    return twin


# ---- the probe -----------------------------------------------------------------------------------------------------
class LayerProbe:
    """Installs a teacher-forcing wrapper on every block for the next step; ``records`` has one dict per layer.

    ``compiled[i]``: layer i's compiled call (or None); ``twin``: the fp32 twin (or None); ``gates``: mode name ->
    callable(gate module, x, input_ids) giving expert ids, for the router agreement (or None)."""

    def __init__(self, model: Transformer, compiled: list[Callable | None], twin: Transformer | None,
                 gate_fn: Callable | None = None, budget: int | None = EAGER_BUDGET_BYTES) -> None:
        self.model, self.compiled, self.twin, self.gate_fn, self.budget = model, compiled, twin, gate_fn, budget
        self.records: list[dict[str, Any]] = []

    def __enter__(self) -> LayerProbe:
        self.saved = [b._compiled_call_impl for b in self.model.layers]
        for i, block in enumerate(self.model.layers):
            block._compiled_call_impl = self._wrap(i, block)
        return self

    def __exit__(self, *exc: Any) -> None:
        for block, c in zip(self.model.layers, self.saved):
            block._compiled_call_impl = c

    def _wrap(self, i: int, block: nn.Module) -> Callable:
        def call(x, pre, meta, lc, shared, engram_ids=None):
            return self._layer(i, block, x, pre, meta, lc, shared, engram_ids)
        return call

    def _layer(self, i, block, x, pre, meta, lc, shared, engram_ids):
        rec: dict[str, Any] = {"layer": i, "kind": _kind(block)}
        before, shared0 = snapshot(lc), copy.copy(shared)
        gate_in: list = []
        hook = None
        gate = getattr(block.ffn, "gate", None)
        if self.gate_fn is not None and gate is not None and not gate.hash:
            hook = gate.register_forward_hook(lambda m, args, out: gate_in.append((args[0].detach(), args[1], out[0])))
        set_budget(block, self.budget)
        try:
            x_e, pre_e = block._call_impl(x, pre, meta, lc, shared, engram_ids)
        finally:
            set_budget(block, None)
            if hook is not None:
                hook.remove()
        after = snapshot(lc)
        rows = written_rows(after, before)
        if self.compiled[i] is not None:
            restore(lc, before)
            shared_c = copy.copy(shared0)
            x_c, pre_c = self.compiled[i](x, pre, meta, lc, shared_c, engram_ids)
            rec.update(_compare(x_c, pre_c, shared_c, snapshot(lc), x_e, pre_e, shared, after, rows, "compiled"))
            restore(lc, after)
        if gate_in:
            gx, gids, idx_e = gate_in[0]
            idx_c = self.gate_fn(gate, gx, gids)
            rec["compiled_experts_agree"] = agreement(idx_c, idx_e, gate.weight.shape[0])
        if self.twin is not None:
            tb = self.twin.layers[i]
            lc32 = cast_cache(before, torch.float32)
            sh32 = cast_shared(shared0, torch.float32)
            set_budget(tb, self.budget)
            try:
                x_f, pre_f = tb._call_impl(x.float(), pre, meta, lc32, sh32, engram_ids)
            finally:
                set_budget(tb, None)
            after32 = snapshot(lc32)
            rec.update(_compare(x_e, pre_e, shared, after, x_f, pre_f, sh32, after32, rows, "eager_vs_fp32"))
            if gate_in:
                gx, gids, idx_e = gate_in[0]
                idx_f = tb.ffn.gate(gx.float(), gids)[0]
                rec["eager_vs_fp32_experts_agree"] = agreement(idx_e, idx_f, gate.weight.shape[0])
        self.records.append(rec)
        return x_e, pre_e


def _kind(block: nn.Module) -> str:
    kind = block.kind()
    return ", ".join(f"{k}={v}" for k, v in kind._asdict().items()) if hasattr(kind, "_asdict") else str(kind)


def _compare(x_t, pre_t, shared_t, cache_t, x_r, pre_r, shared_r, cache_r, rows, tag: str) -> dict[str, Any]:
    """Test (x_t ...) against reference (x_r ...): hidden streams, the next site's collapse weights (V4.1), the cache
    rows the layer wrote, and the indexer's top-k and candidate picks where the layer made them."""
    out: dict[str, Any] = {f"{tag}_rel_rms": rel_rms(x_t, x_r), f"{tag}_max_abs": max_abs(x_t, x_r)}
    if pre_r is not None and pre_t is not None:
        out[f"{tag}_pre_rel_rms"] = rel_rms(pre_t, pre_r)
    out[f"{tag}_cache_rel_rms"] = cache_error(cache_t, cache_r, rows)
    if shared_r.topk is not None and shared_t.topk is not None and shared_r.topk is not shared_t.topk:
        cols = shared_r.comp_kv.shape[0] if shared_r.comp_kv is not None else int(shared_r.topk.max()) + 1
        out[f"{tag}_topk_agree"] = agreement(shared_t.topk, shared_r.topk, max(cols, 1))
    if shared_r.candidates is not None and shared_t.candidates is not None \
            and shared_r.candidates is not shared_t.candidates:
        blocks = max(int(shared_r.candidates.max()), int(shared_t.candidates.max())) + 1  # block ids, -1 empty
        out[f"{tag}_candidates_agree"] = agreement(shared_t.candidates, shared_r.candidates, max(blocks, 1))
    return out
