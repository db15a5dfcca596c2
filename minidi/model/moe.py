"""Mixture of experts: sqrtsoftplus gate (or V4 hash routing), FP4 routed experts, FP8 shared expert
(spec V4.1 §10, V4 §8).

The routed experts are held stacked ([E, ...], a layout that exists only after loading); ``state_dict`` and
``load_state_dict`` still speak the checkpoint's per-expert names ``experts.{e}.w1.weight`` / ``.scale``.
Legend: T tokens, k experts per token, E experts, I expert width, D model width, R = T*k routed rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minidi.selection import topk_lowest_index

from .config import ModelConfig
from .expert_parallel import ExpertExchange, LocalExperts
from .layers import FP8Linear, e8m0_bytes, scale_param, weight_param
from .quant import dequant_fp4, fq8


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.hash = cfg.is_hash_layer(layer_id)
        self.weight = weight_param(cfg.n_routed_experts, cfg.dim, dtype=torch.bfloat16)
        if self.hash:
            self.tid2eid = weight_param(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.int64)
        else:
            self.bias = weight_param(cfg.n_routed_experts, dtype=torch.float32)
            if cfg.is_v41:
                self.bias_vl = weight_param(cfg.n_routed_experts, dtype=torch.float32)  # image tokens only

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> expert ids [T, k] int64, weights [T, k] fp32. The bias only selects: the k highest
        s + bias, in descending order, exact ties to the lowest expert id (``minidi.selection.topk_lowest_index``)."""
        logits = gate_logits_fp32(x, self.weight)  # [T, E]
        s = torch.sqrt(F.softplus(logits))
        if self.hash:
            idx = self.tid2eid[input_ids]
        else:
            idx = topk_lowest_index(s + self.bias.float(), self.cfg.n_activated_experts)[1]
        w = s.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.cfg.route_scale
        return idx, w


def gate_logits_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """**Pass target E** (gate precision): the router GEMM in fp32. x [T, D], weight [E, D] -> [T, E] fp32."""
    return x.float() @ weight.float().t()


def swiglu_clipped(g: torch.Tensor, v: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(v, -limit, limit), in fp32."""
    g, v = g.float().clamp(max=limit), v.float().clamp(-limit, limit)
    return F.silu(g) * v


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.w1 = FP8Linear(cfg.dim, cfg.moe_inter_dim, cfg)
        self.w3 = FP8Linear(cfg.dim, cfg.moe_inter_dim, cfg)
        self.w2 = FP8Linear(cfg.moe_inter_dim, cfg.dim, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_clipped(self.w1(x), self.w3(x), self.limit).to(x.dtype))


def _dequant_bytes_per_expert(packed: torch.Tensor) -> int:
    return math.prod(packed.shape[1:]) * 2 * 12  # decoded values per expert x (8 B int64 code + 4 B fp32)


def dequant_expert_stack(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                         budget: int | None = None) -> torch.Tensor:
    """**Pass target D** (FP4 expert dequant): packed e2m1 [E, out, in/2] + E8M0 [E, out, in/32] -> [E, out, in].

    ``budget`` None: one whole decode (the form torch.compile traces: pass D's target; Inductor fuses it). Bytes:
    the same values decoded a few experts at a time so the int64 codes and fp32 values of the naive decode stay
    under ``budget`` (an eager run's memory budget, ``Transformer.set_eager_budget``: at EP1, 384 experts of
    2,304 x 5,120, one whole decode holds 36 GB of int64 codes)."""
    if budget is None or packed.shape[0] * _dequant_bytes_per_expert(packed) <= budget:
        return dequant_fp4(packed, scale, dtype)
    step = max(1, budget // _dequant_bytes_per_expert(packed))
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=dtype, device=packed.device)
    for e in range(0, packed.shape[0], step):
        out[e:e + step] = dequant_fp4(packed[e:e + step], scale[e:e + step], dtype)
    return out


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """Rows of x [R, K] sorted by expert, w [E, N, K], offs [E] int32 cumulative row ends -> [R, N] in x's dtype.

    bf16: torch's grouped GEMM. fp32 (comparison mode; that GEMM's meta function, hence torch.compile, wants bf16)
    has two forms. ``budget`` None: every expert on every row, keeping each row's own expert (no host sync, so
    torch.compile traces it: pass D's fp32 target; E times the work and an [R, E, N] temporary, 90 GiB at full
    size). An eager budget smaller than that temporary: a loop over the experts' row ranges (one host sync for
    ``offs``). Rows past ``offs[-1]`` belong to other ranks' experts: garbage the combine never reads (the einsum
    gives them the last expert's product, the loop zeros)."""
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if budget is not None and x.shape[0] * w.shape[0] * w.shape[1] * x.element_size() > budget:
        out = x.new_zeros(x.shape[0], w.shape[1])
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                out[start:end] = x[start:end] @ w[e].t()
            start = end
        return out
    expert = torch.bucketize(torch.arange(x.shape[0], device=x.device), offs.long(), right=True)
    out = torch.einsum("rk,enk->ren", x, w)
    return out.gather(1, expert.clamp(max=w.shape[0] - 1).view(-1, 1, 1).expand(-1, 1, w.shape[1])).squeeze(1)


def moe_combine_naive(rows: torch.Tensor, order: torch.Tensor, local: torch.Tensor, k: int) -> torch.Tensor:
    """**Pass target C** (MoE combine).

    rows [R, D]: expert outputs in sorted-row order; order [R]: token-slot index (t*k + slot) of each sorted row;
    local [R] bool: the row was computed by an expert held here (other rows may hold garbage, even NaN).
    Returns [T, D] fp32: sum over the k slots of each token, in slot order.
    """
    r = rows.float()
    r = torch.where(local.unsqueeze(-1), r, torch.zeros_like(r))
    slots = torch.zeros_like(r).index_copy_(0, order, r)  # [R, D] in token-slot order
    return slots.view(-1, k, r.shape[-1]).sum(dim=1)


def _as_stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """[E, ...] from per-expert tensors; when they already are consecutive slices of one stack (as the random
    builder hands them out, possibly one stack shared by every layer) that stack is reused, not copied."""
    first = parts[0]
    step = first.numel()
    if all(p.is_contiguous() for p in parts) and all(
        p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.storage_offset() == first.storage_offset() + e * step for e, p in enumerate(parts)
    ):
        return first.as_strided((len(parts), *first.shape), (step, *first.stride()), first.storage_offset())
    return torch.stack(parts)


class RoutedExperts(nn.Module):
    """This rank's FP4 experts, stacked: w1/w3 [El, I, D/2] int8 + [El, I, D/32] E8M0; w2 [El, D, I/2] + [El, D, I/32].

    El = n_local_experts: all E on one device, E / ep_size under expert parallelism, where the stack holds the global
    experts [first, first + El) (``ModelConfig.first_local_expert``).

    ``eager_budget`` (bytes, default None): the memory budget of an eager run for the expert-stack decode and the
    fp32 grouped GEMM (``dequant_expert_stack``, ``grouped_mm``); None keeps their whole, traceable forms, the
    graph torch.compile must see. Set by ``Transformer.set_eager_budget``, never read from the compile state."""

    NAMES = ("w1", "w2", "w3")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, d, b = cfg.n_local_experts, cfg.moe_inter_dim, cfg.dim, cfg.fp4_block
        self.n_experts, self.first = cfg.n_routed_experts, cfg.first_local_expert
        self.all_local = cfg.n_local_experts == cfg.n_routed_experts  # one device: no expert-parallel remapping
        self.eager_budget: int | None = None
        shapes = {"w1": (i, d), "w3": (i, d), "w2": (d, i)}
        for name, (out, inp) in shapes.items():
            setattr(self, name, weight_param(e, out, inp // 2, dtype=torch.int8))
            setattr(self, f"{name}_scale", scale_param(e, out, inp // b))

    # checkpoint names <-> stacked layout ----------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in self.NAMES:
            w, s = getattr(self, name), getattr(self, f"{name}_scale")
            for e in range(w.shape[0]):
                g = self.first + e  # checkpoint names carry the global expert id
                destination[f"{prefix}{g}.{name}.weight"] = w[e] if keep_vars else w[e].detach()
                destination[f"{prefix}{g}.{name}.scale"] = (s[e] if keep_vars else s[e].detach()).view(
                    torch.float8_e8m0fnu)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        ids = range(self.first, self.first + getattr(self, "w1").shape[0])  # global ids of this rank's experts
        for name in self.NAMES:
            for suffix, attr in (("weight", name), ("scale", f"{name}_scale")):
                param = getattr(self, attr)
                keys = [f"{prefix}{e}.{name}.{suffix}" for e in ids]
                missing = [k for k in keys if k not in state_dict]
                if missing:
                    missing_keys.extend(missing)
                    continue
                parts = [e8m0_bytes(state_dict[k]) if suffix == "scale" else state_dict[k] for k in keys]
                bad = [k for k, p in zip(keys, parts) if p.shape != param.shape[1:] or p.dtype != param.dtype
                       or (suffix == "scale" and state_dict[k].dtype not in (torch.float8_e8m0fnu, torch.uint8))]
                if bad:
                    want = torch.float8_e8m0fnu if suffix == "scale" else param.dtype
                    error_msgs.extend(
                        f"{k}: expected {tuple(param.shape[1:])} {want}, got {tuple(state_dict[k].shape)} "
                        f"{state_dict[k].dtype}" for k in bad)
                    continue
                stacked = _as_stack(parts)
                if local_metadata.get("assign_to_params_buffers", False) or param.is_meta:
                    setattr(self, attr, nn.Parameter(stacked, requires_grad=False))
                else:
                    with torch.no_grad():
                        param.copy_(stacked)
        if strict:
            known = {f"{prefix}{e}.{n}.{s}" for e in ids for n in self.NAMES for s in ("weight", "scale")}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in known)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """x [T, D], idx/weights [T, k] (global expert ids) -> [T, D] fp32: each token's sum over those of its experts
        held here (all of them on one device)."""
        t, k = idx.shape
        dtype = x.dtype
        n_local = self.w1.shape[0]
        flat = idx.flatten()  # [R]
        if not self.all_local:  # this rank's experts first: local expert j has key j, the others keys >= n_local
            flat = torch.remainder(flat - self.first, self.n_experts)  # (one device: the graph of before EP existed)
        order = flat.argsort(stable=True)  # sorted row -> token-slot
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))  # (bincount has a data-dependent output size)
        offs = counts[:n_local].cumsum(0).to(torch.int32)  # rows past offs[-1] belong to other ranks' experts
        if cfg.fake_quant:  # per token, before the rows are gathered: fq8 is row-wise, so this equals quantising
            x = fq8(x, cfg.act_block)  # the R = T k gathered rows, on k times fewer rows (as an FP8 dispatch does)
        xs = x[order // k]  # [R, D] rows sorted by expert
        ws = weights.flatten()[order].unsqueeze(-1)  # [R, 1]
        b = self.eager_budget
        w1 = dequant_expert_stack(self.w1, self.w1_scale, dtype, b)
        w3 = dequant_expert_stack(self.w3, self.w3_scale, dtype, b)
        w2 = dequant_expert_stack(self.w2, self.w2_scale, dtype, b)
        a = swiglu_clipped(grouped_mm(xs, w1, offs, b), grouped_mm(xs, w3, offs, b), cfg.swiglu_limit) * ws
        a = a.to(dtype)
        if cfg.fake_quant:
            a = fq8(a, cfg.act_block)
        rows = grouped_mm(a, w2, offs, b)  # [R, D]
        return moe_combine_naive(rows, order, flat[order] < n_local, k)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg, layer_id)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = SharedExpert(cfg)
        self.exchange: ExpertExchange = LocalExperts()  # expert parallelism (model.set_expert_exchange)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, D] (ffn-normed) -> [T, D]: bf16(sum_e y_e + shared(x)), fp32 accumulation."""
        idx, w = self.gate(x, input_ids)
        xs, idx, w = self.exchange.dispatch(x, idx, w)  # all ranks' tokens (identity on one device)
        routed = self.exchange.combine(self.experts(xs, idx, w, self.cfg))
        return (routed + self.shared_experts(x).float()).to(x.dtype)
