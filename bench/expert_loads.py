"""The router's expert loads in one eager step (``bench_prefill.py --expert_loads``): rows per expert, per MoE layer.

Why: the fused FP4 GEMM runs at 638.7 TFLOP/s on uniform rows at EP4 and 482.5 on skewed ones (H100, round 25:
``docs/benchmarks/README.md``, FP4 expert GEMM), so how unevenly the (random-weight) router spreads tokens decides
much of the MoE stage. Per layer, over the experts this rank holds:

    rows_e      rows routed to local expert e (emulated EP N: N times this rank's count, as the synthesised ranks
                are this rank's tokens rotated; real ranks: this rank's own tokens only)
    max / mean  the most loaded expert against the mean
    cv          standard deviation / mean of rows_e
    tile_fill   sum rows_e / (BM * sum ceil(rows_e / BM)): the share of the GEMM's BM-row tiles that holds real rows
                (BM 256 at EP4-like loads, 64 at EP1-like: ``fp4_grouped_gemm_configs``)

The step runs eagerly (whatever mode ran before), outside the timed steps; hooks on each gate read its expert ids.
The report also gives the router bias the loads came from (``gate_bias_abs_mean``, over the score-routed layers):
random full-size presets default to zero bias, balanced loads (V4.1 EP4: max/mean 1.4, cv 0.15); the old workload's
0.3·N bias (max/mean 16.6, cv 2.4) is ``bench_prefill.py --gate_bias random --expert_loads``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from minidi.runtime.engine import dynamic_shape_config

TILE_ROWS = (256, 64)


def collect_counts(model, run_step) -> dict[int, torch.Tensor]:
    """{layer: rows per global expert [E] int64, this rank's tokens} from one call of ``run_step()``."""
    counts: dict[int, torch.Tensor] = {}
    n_experts = model.cfg.n_routed_experts

    def hook(layer: int):
        def read(_module, _inputs, out):
            counts[layer] = torch.bincount(out[0].flatten(), minlength=n_experts).cpu()
        return read

    handles = [block.ffn.gate.register_forward_hook(hook(i)) for i, block in enumerate(model.layers)]
    try:
        with torch.no_grad(), dynamic_shape_config():
            run_step()
    finally:
        for h in handles:
            h.remove()
    return counts


def layer_stats(rows: torch.Tensor) -> dict:
    """rows [El] rows per local expert -> max / mean, cv, tile fill per BM."""
    r = rows.double()
    mean = r.mean().item()
    out = {"rows": int(r.sum()), "mean": round(mean, 2), "max": int(r.max()), "min": int(r.min()),
           "max_over_mean": round(r.max().item() / mean, 3) if mean else None,
           "cv": round(r.std(unbiased=False).item() / mean, 3) if mean else None}
    for bm in TILE_ROWS:
        tiles = torch.ceil(r / bm).sum().item()
        out[f"tile_fill_bm{bm}"] = round(r.sum().item() / (bm * tiles), 3) if tiles else None
    return out


def expert_loads(model, run_step, emulated_ep: int) -> dict:
    """Per MoE layer, the stats of the rows its local experts get in one step; and their medians over layers."""
    cfg = model.cfg
    first, n_local = cfg.first_local_expert, cfg.n_local_experts
    layers = {}
    for layer, c in sorted(collect_counts(model, run_step).items()):
        rows = c[first:first + n_local] * max(1, emulated_ep)
        layers[layer] = {"hash_routed": cfg.is_hash_layer(layer), **layer_stats(rows)}
    keys = ("max_over_mean", "cv") + tuple(f"tile_fill_bm{bm}" for bm in TILE_ROWS)
    summary = {k: round(statistics.median(v[k] for v in layers.values() if v[k] is not None), 3) for k in keys
               if any(v[k] is not None for v in layers.values())}
    biases = [b.ffn.gate.bias.float().abs().mean().item() for b in model.layers if not b.ffn.gate.hash]
    return {"model": cfg.name, "ep": cfg.ep_size, "emulated_ep": emulated_ep, "local_experts": n_local,
            "gate_bias_abs_mean": round(statistics.fmean(biases), 4) if biases else None,
            "first_local_expert": first, "tokens": "this rank's (x N when emulated)", "median_over_layers": summary,
            "layers": layers}


def write_report(report: dict, path: Path) -> str:
    """Write the JSON, return the one-line summary printed by the benchmark."""
    path.write_text(json.dumps(report))
    m = report["median_over_layers"]
    return ("expert loads (median over layers, local experts): "
            + ", ".join(f"{k} {v}" for k, v in m.items()) + f" | router bias |b| mean {report['gate_bias_abs_mean']}"
            + f" -> {path.name}")
