"""Benchmark of pass V at V4-Flash shapes: the indexer's Hadamard rotation of q ([4,096, 64, 128] bf16) and of its new
keys ([1,024, 128]), ``minidi.formats.hadamard`` against ``minidi.ops.hadamard.hadamard_rotate``.

Memory-bound: bytes = x read + y written (bf16, once each). Rows: the model's code eager (an fp32 matmul on CUDA
cores, TF32 off) and under stock ``torch.compile`` (static shapes), the op (one tensor-core dot a tile) and a tile
sweep of the op alone. Error = max|y - exact| / max|exact| against the fp64 rotation (bf16 output: ~2^-9 expected).
Peaks (bf16 matmul, device copy read + write) measured in the same run.

Usage: python bench/bench_hadamard.py [--out PATH] [--smoke]. The LAST line printed is one JSON object.
"""

from __future__ import annotations

import argparse

import torch

from minidi.formats import hadamard, hadamard_matrix
from minidi.ops import hadamard as op

if __package__:  # python -m bench.bench_hadamard, the tests
    from . import common
else:  # python bench/bench_hadamard.py: the script's folder is sys.path[0]
    import common

SWEEP = ((32, 4), (64, 4), (128, 4), (128, 8), (256, 8))  # BM, warps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter ok)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {"q": (16, 4, 128), "k": (8, 128)} if args.smoke else {"q": (4096, 64, 128), "k": (1024, 128)}
    pk = common.measure_peaks(device, small=args.smoke)
    g = torch.Generator().manual_seed(0)
    results = {}
    for site, shape in shapes.items():
        x = torch.randn(shape, generator=g).bfloat16().to(device)
        exact = x.double() @ hadamard_matrix(shape[-1], device).double()
        nbytes = 2 * x.numel() * x.element_size()

        def err(y):
            return float(f"{((y.double() - exact).abs().max() / exact.abs().max()).item():.2e}")

        table: list = []
        base: dict = {}
        ms = common.op_ms(lambda: hadamard(x), device, args.smoke)
        common.table_row(table, "model code, eager (fp32 matmul)", ms, nbytes, "GB/s", pk, base,
                         rel_err=err(hadamard(x)), kernel_ms=round(common.kernel_ms(lambda: hadamard(x), device), 4))
        base["eager"] = ms
        compiled = torch.compile(hadamard, dynamic=False)
        y = compiled(x)
        ms = common.op_ms(lambda: compiled(x), device, args.smoke)
        common.table_row(table, "model code, torch.compile", ms, nbytes, "GB/s", pk, base, rel_err=err(y),
                         kernel_ms=round(common.kernel_ms(lambda: compiled(x), device), 4))
        base["compile"] = ms
        y = op.hadamard_rotate(x)
        ms = common.op_ms(lambda: op.hadamard_rotate(x), device, args.smoke)
        common.table_row(table, "pass V op (hadamard_rotate)", ms, nbytes, "GB/s", pk, base, rel_err=err(y),
                         kernel_ms=round(common.kernel_ms(lambda: op.hadamard_rotate(x), device), 4))
        x2 = x.view(-1, shape[-1])
        buf = torch.empty_like(x2)
        for bm, nw in SWEEP:
            ms = common.op_ms(lambda: op.launch(x2, buf, BM=bm, num_warps=nw), device, args.smoke)
            common.table_row(table, f"  op alone BM{bm} w{nw}", ms, nbytes, "GB/s", pk, base,
                             rel_err=err(buf.view(shape)))
        common.print_table(f"V Hadamard rotation, {site} {list(shape)} bf16 (bytes x + y; GB/s vs copy peak)", table)
        results[site] = {"shape": list(shape), "bytes": nbytes, "table": table}
    result = {"bench": "hadamard", "device": common.device_name(device), "torch": torch.__version__,
              "peaks": {k: round(v, 1) for k, v in pk.items()}, "sites": results}
    common.emit_json(result, out=args.out)
    return result


if __name__ == "__main__":
    main()
