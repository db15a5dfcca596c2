"""Benchmark of pass V at V4-Flash shapes: the indexer's Hadamard rotation of q ([4,096, 64, 128] bf16) and of its new
keys ([1,024, 128]), ``minidi.formats.hadamard`` against ``minidi.ops.hadamard.hadamard_rotate``.

Memory-bound: bytes = x read + y written (bf16, once each). Rows: the model's code eager (an fp32 matmul on CUDA
cores, TF32 off) and under stock ``torch.compile`` (static shapes), the op (one tensor-core dot a tile) and a tile
sweep of the op alone. Error = max|y - exact| / max|exact| against the fp64 rotation (bf16 output: ~2^-9 expected).
A second table per site times the rotation with the indexer's fq4 after it (``fq4_ue8m0(., 32)``, the served
setting): the model's code eager and compiled, the op with Inductor's fq4 after it (the step before the fusion) and
the op with ``fq4_block=32`` (one kernel); ``differ`` = the fraction of outputs unequal to the model's eager chain
(a rotation one bf16 ulp apart can move a value across an e2m1 rounding boundary or a block's scale).
Peaks (bf16 matmul, device copy read + write) measured in the same run.

Usage: python bench/bench_hadamard.py [--out PATH] [--smoke]. The LAST line printed is one JSON object.
"""

from __future__ import annotations

import torch

from minidi.formats import fq4_ue8m0, hadamard, hadamard_matrix
from minidi.ops import hadamard as op

if __package__:  # python -m bench.bench_hadamard, the tests
    from . import common
else:  # python bench/bench_hadamard.py: the script's folder is sys.path[0]
    import common

SWEEP = ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8))  # BM, warps


def main(argv: list[str] | None = None) -> dict:
    args, device = common.op_bench_args(__doc__, argv)
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
        results[site] = {"shape": list(shape), "bytes": nbytes, "table": table,
                         "with_fq4": _with_fq4(x, nbytes, pk, args.smoke, device)}
    result = {"bench": "hadamard", "device": common.device_name(device), "torch": torch.__version__,
              "peaks": {k: round(v, 1) for k, v in pk.items()}, "sites": results}
    common.emit_json(result, out=args.out)
    return result


def _model_chain(x):
    return fq4_ue8m0(hadamard(x), 32)


def _op_then_fq4(x):
    return fq4_ue8m0(op.hadamard_rotate(x), 32)


def _with_fq4(x: torch.Tensor, nbytes: int, pk: dict, smoke: bool, device: str) -> list:
    """The rotation followed by the indexer's fq4: the model's code, the op then Inductor's fq4, the fused op."""
    want = _model_chain(x)
    table: list = []
    base: dict = {}
    rows = [("model code + fq4, eager", _model_chain, "eager"),
            ("model code + fq4, torch.compile", torch.compile(_model_chain, dynamic=False), "compile"),
            ("op, then fq4 by torch.compile", torch.compile(_op_then_fq4, dynamic=False), "op_then_fq4"),
            ("op with fq4_block=32 (one kernel)", lambda x: op.hadamard_rotate(x, fq4_block=32), None)]
    for name, fn, key in rows:
        y = fn(x)
        ms = common.op_ms(lambda: fn(x), device, smoke)
        common.table_row(table, name, ms, nbytes, "GB/s", pk, base, differ=round(float((y != want).float().mean()), 6),
                         kernel_ms=round(common.kernel_ms(lambda: fn(x), device), 4))
        if key:
            base[key] = ms
    x2 = x.view(-1, x.shape[-1])
    buf = torch.empty_like(x2)
    for bm, nw in SWEEP:
        ms = common.op_ms(lambda: op.launch(x2, buf, fq4_block=32, BM=bm, num_warps=nw), device, smoke)
        common.table_row(table, f"  op fq4 alone BM{bm} w{nw}", ms, nbytes, "GB/s", pk, base,
                         differ=round(float((buf.view(x.shape) != want).float().mean()), 6))
    common.print_table(f"V rotation + fq4_ue8m0(., 32), {list(x.shape)} bf16 (bytes x + y)", table)
    return table


if __name__ == "__main__":
    main()
