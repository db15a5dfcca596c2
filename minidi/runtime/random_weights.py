"""Random weights in exactly the checkpoint formats of ``expected_tensors(cfg)`` (names, shapes, dtypes).

Every tensor is random and non-degenerate (spec V4 audit recipe: a degenerate init such as zero sinks or unit norms
hides whole classes of bugs). Quantised tensors are made the way the release stores them: FP8 linears by
``quantize_fp8`` on N(0,1)/sqrt(fan_in) draws, routed experts by ``quantize_fp4``, the Engram table by per-row 1x32
FP8 quantisation (``quantize_fp8_rows``).

Router biases (``ffn.gate.bias`` / ``bias_vl``) are zero by default: a trained router with loss-free balancing routes
near uniformly, and zero bias comes close (V4.1 EP4 workload: expert loads max/mean 1.4, cv 0.15), where the old
0.3·N draw dominated the router's scores (max/mean 16.6, cv 2.4). ``gate_bias="random"`` keeps that draw (the
embedded tiny checkpoints are made with it, so their tensors and goldens are unchanged). The draw is made either way,
so every other tensor is the same for a given seed.

Full-size shapes are generated directly on ``device``: routed experts of a layer are drawn as one [E, out, in] stack
(in chunks of experts so fp32 temporaries stay bounded) and handed out as per-expert views.
"""

from __future__ import annotations

import torch

from minidi.model.config import ModelConfig
from minidi.model.quant import E4M3_MAX, float_to_e8m0, e8m0_to_float, quantize_fp4, quantize_fp8
from minidi.runtime.weight_table import TensorSpec, expected_tensors, scale_name

# fp32 elements per generation chunk (experts, Engram rows): 2^28 * 4 B = 1 GiB, a few GiB of temporaries.
_CHUNK_ELEMS = 1 << 28


def _pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 y) for positive normal fp32 ``y``, exactly (exponent bit arithmetic)."""
    bits = y.float().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def quantize_fp8_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [rows, d] -> (e4m3 [rows, d], E8M0 [rows, d/block]); one power-of-two scale per row per ``block`` channels.

    The Engram table format (spec V4.1 §12): row r, block b dequantises as q * 2^(scale[r, b] - 127).
    """
    rows, d = w.shape
    g = w.float().view(rows, d // block, block)
    s = _pow2_ceil(g.abs().amax(-1).clamp_min(1e-30) / E4M3_MAX)  # [rows, d/block]
    q = (g / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(rows, d)
    return q, float_to_e8m0(s)


def dequant_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    """e4m3 [..., d] x E8M0 [..., d/block] -> ``dtype`` [..., d] (inverse of ``quantize_fp8_rows``)."""
    s = e8m0_to_float(scale).repeat_interleave(block, dim=-1)
    return (q.float() * s).to(dtype)


class _Gen:
    """Draws on ``device`` from one seeded generator, in table order (so a seed fixes every tensor)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.g = torch.Generator(device=device)
        self.g.manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, device=self.device, dtype=torch.float32)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, device=self.device, dtype=torch.float32)


GATE_BIASES = ("zero", "random")


def _plain(gen: _Gen, spec: TensorSpec, n_experts: int, gate_bias: str = "random") -> torch.Tensor:
    """A bf16 / f32 / i64 tensor following its init hint (``gate_bias``: see the module docstring)."""
    shape, init = spec.shape, spec.init
    if init == "tid2eid":  # each row: k distinct experts = first k of a random permutation of the n_experts
        vocab, k = shape
        return gen.rand(vocab, n_experts).argsort(dim=-1)[:, :k].contiguous().to(torch.int64)
    if init == "linear":
        x = gen.randn(*shape) / shape[-1] ** 0.5
    elif init == "norm":
        x = 1.0 + 0.2 * gen.randn(*shape)
    elif init == "sink":
        x = gen.randn(*shape)
    elif init == "ape":
        x = 0.5 * gen.randn(*shape)
    elif init == "hc_fn":
        x = 0.05 * gen.randn(*shape)
    elif init == "hc_base":
        x = 0.5 * gen.randn(*shape)
    elif init == "hc_scale":
        x = 0.5 + gen.rand(*shape)
    elif init == "bias":
        x = 0.3 * gen.randn(*shape)  # drawn either way: the draws after it do not depend on gate_bias
        if gate_bias == "zero":
            x = torch.zeros_like(x)
    else:
        raise ValueError(f"unknown init hint {init!r}")
    return x.to(spec.dtype)


def _experts_stack(gen: _Gen, n_exp: int, out: int, inp: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 weights of all experts of one projection: (packed int8 [E, out, in/2], E8M0 [E, out, in/block])."""
    packed = torch.empty(n_exp, out, inp // 2, dtype=torch.int8, device=gen.device)
    scale = torch.empty(n_exp, out, inp // block, dtype=torch.float8_e8m0fnu, device=gen.device)
    step = max(1, _CHUNK_ELEMS // (out * inp))
    for e0 in range(0, n_exp, step):
        e1 = min(n_exp, e0 + step)
        w = gen.randn(e1 - e0, out, inp) / inp**0.5
        packed[e0:e1], scale[e0:e1] = quantize_fp4(w, block)
    return packed, scale


def _engram_table(gen: _Gen, rows: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram rows N(0,1), quantised per row in chunks: (e4m3 [rows, d], E8M0 [rows, d/32])."""
    q = torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=gen.device)
    s = torch.empty(rows, d // 32, dtype=torch.float8_e8m0fnu, device=gen.device)
    step = max(1, _CHUNK_ELEMS // d)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        q[r0:r1], s[r0:r1] = quantize_fp8_rows(gen.randn(r1 - r0, d))
    return q, s


def random_state_dict(
    cfg: ModelConfig,
    seed: int = 0,
    device: torch.device | str = "cpu",
    share_experts: bool = False,
    share_engram: bool | None = None,
    gate_bias: str = "zero",
    engram_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """Random tensors for every name of ``expected_tensors(cfg)``, in checkpoint dtypes/shapes, on ``device``.

    share_experts: every layer's ``ffn.experts.E.*`` entries are the same tensor objects as layer 0's (a full-size
        model then fits one GPU: V4.1 routed experts are 7.2 GB per layer).
    share_engram: (default = ``share_experts``) every Engram layer's table is a row-prefix view of one table drawn
        for the largest row count (the full-size V4.1 tables are ~101 GB each; two do not fit one H200).
    gate_bias: "zero" (default, balanced routing) or "random" (0.3·N, the old draw): the module docstring.
    engram_rows: at most this many rows per Engram table (the tables of ``Transformer(cfg, engram_rows=...)``;
        default: the real row counts).
    Deterministic for a given (seed, device type); the draw order is the table order.
    """
    if gate_bias not in GATE_BIASES:
        raise ValueError(f"gate_bias must be one of {GATE_BIASES}, got {gate_bias!r}")
    if engram_rows is not None and engram_rows < 1:
        raise ValueError(f"engram_rows must be >= 1 (None = the real tables), got {engram_rows}")
    device = torch.device(device)
    share_engram = share_experts if share_engram is None else share_engram
    table = expected_tensors(cfg)
    gen = _Gen(seed, device)
    out: dict[str, torch.Tensor] = {}
    shared_experts: dict[str, torch.Tensor] = {}  # "w1.weight" per expert id -> layer-0 tensors
    engram_src: tuple[torch.Tensor, torch.Tensor] | None = None

    for name, spec in table.items():
        if name in out or spec.init == "scale":
            continue  # scales are produced with their weight
        if spec.kind == "fp8_weight":
            w = gen.randn(*spec.shape) / spec.shape[1] ** 0.5
            out[name], out[scale_name(name)] = quantize_fp8(w, cfg.weight_block)
        elif spec.kind == "fp4_weight":
            lp = name[: name.index("ffn.experts.")]  # "layers.L."; the first expert name makes the whole layer
            if share_experts and shared_experts:
                for k, t in shared_experts.items():
                    out[lp + k] = t
            else:
                made = _layer_experts(gen, cfg, lp)
                out.update(made)
                if share_experts:
                    shared_experts = {k[len(lp):]: v for k, v in made.items()}
        elif spec.kind == "fp8_rows":
            rows, d = spec.shape
            rows = rows if engram_rows is None else min(rows, engram_rows)
            if share_engram:
                if engram_src is None:
                    most = max(cfg.engram_rows(li) for li in cfg.engram_layers)
                    engram_src = _engram_table(gen, most if engram_rows is None else min(most, engram_rows), d)
                q, s = engram_src[0][:rows], engram_src[1][:rows]
            else:
                q, s = _engram_table(gen, rows, d)
            out[name], out[scale_name(name)] = q, s
        else:
            out[name] = _plain(gen, spec, cfg.n_routed_experts, gate_bias)
    missing = table.keys() - out.keys()
    assert not missing, f"random_state_dict left out {sorted(missing)[:5]}"
    return {k: out[k] for k in table}


def _layer_experts(gen: _Gen, cfg: ModelConfig, lp: str) -> dict[str, torch.Tensor]:
    """This rank's routed experts of one layer as per-expert views into [E_local, ...] stacks:
    ``{lp}ffn.experts.e.wX.{weight,scale}`` (with ``ep_size > 1`` expert e's draw depends on the rank layout)."""
    E, dim, inter, b = cfg.n_local_experts, cfg.dim, cfg.moe_inter_dim, cfg.fp4_block
    stacks = {
        "w1": _experts_stack(gen, E, inter, dim, b),
        "w2": _experts_stack(gen, E, dim, inter, b),
        "w3": _experts_stack(gen, E, inter, dim, b),
    }
    res: dict[str, torch.Tensor] = {}
    for e in range(E):
        for wn, (packed, scale) in stacks.items():
            res[f"{lp}ffn.experts.{cfg.first_local_expert + e}.{wn}.weight"] = packed[e]
            res[f"{lp}ffn.experts.{cfg.first_local_expert + e}.{wn}.scale"] = scale[e]
    return res
