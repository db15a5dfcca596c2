"""Benchmark of pass O at V4.1-Flash's output head (one H200): the model's fp32 head GEMM (``y.float() @
W.float().t()``: the bf16 weight cast to fp32, then cuBLAS's fp32 GEMV / GEMM) against pass O's op
(``minidi.ops.head_logits``: the bf16 weight read once), for the few logit rows a prefill step returns.

Rows L = 1, 4, 8, 32, 64; W [129,280, 4,096] bf16. Per L, timed in one run: the model's code eagerly (as a per-layer
compile ran it before pass O), the same under ``torch.compile``, and the op. GB/s = the bytes that must move (the
bf16 weight, y and the fp32 logits) / time, against the device copy peak measured in the run. Error = max|out -
ref64| / max|ref64| (fp64 product).

Usage: python bench/bench_head_logits.py [--out PATH] [--smoke]. The LAST line printed is one JSON object.
"""

from __future__ import annotations

import torch

from minidi.model.presets import preset
from minidi.ops.head_logits import head_logits

if __package__:  # python -m bench.bench_head_logits, the tests
    from . import common
else:  # python bench/bench_head_logits.py: the script's folder is sys.path[0]
    import common


def model_head(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``OutputHead.forward``."""
    return y.float() @ w.float().t()


def main(argv: list[str] | None = None) -> dict:
    args, device = common.op_bench_args(__doc__, argv)
    c = preset("tiny-v41" if args.smoke else "v41-flash")
    v, d = c.vocab_size, c.dim
    pk = common.measure_peaks(device, small=args.smoke)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(v, d, generator=g) * 0.02).bfloat16().to(device)
    compiled = torch.compile(model_head, dynamic=False)
    table: list = []
    for rows in (1, 9) if args.smoke else (1, 4, 8, 32, 64):
        y = torch.randn(rows, d, generator=g).bfloat16().to(device)
        ref = y.double() @ w.double().t()
        moved = w.numel() * 2 + y.numel() * 2 + rows * v * 4

        def err(out):
            return float(f"{((out.double() - ref).abs().max() / ref.abs().max()).item():.2e}")

        base: dict = {}
        for key, label, fn in (("eager", f"L {rows}: model code, eager", lambda: model_head(y, w)),
                               ("compiled", "  model code, torch.compile", lambda: compiled(y, w)),
                               ("op", "  pass O op (head_logits)", lambda: head_logits(y, w))):
            ms = common.op_ms(fn, device, args.smoke)
            common.table_row(table, label, ms, moved, "GB/s", pk, base, rel_err=err(fn()),
                             kernel_ms=round(common.kernel_ms(fn, device), 4))
            base[key] = ms
    common.print_table(f"O output head, V {v}, D {d} (GB/s of the bf16 weight + y + logits; vs the copy peak)", table)
    result = {"bench": "head_logits", "device": common.device_name(device), "torch": torch.__version__,
              "vocab": v, "dim": d, "peaks": {k: round(x, 1) for k, x in pk.items()}, "table": table}
    common.emit_json(result, out=args.out)
    return result


if __name__ == "__main__":
    main()
