"""Benchmark of pass F's op at V4.1-Flash shapes (one H200): the mHC mixer projection z @ fn^T.

z = the 4 bf16 residual streams of T 4,096 tokens flattened to [4,096, 20,480], fn [24, 20,480] fp32; the plain path
(``hc_mixer``) upcasts z and runs an fp32 GEMM (cuBLAS picks an FFMA kernel for 24 output columns). The op reads
z in bf16 once, so it is memory-bound: bytes = z (bf16) + fn (fp32) + out (fp32); FLOPs 2 T K N are tiny.
Timed: the plain path eager and under stock ``torch.compile``, minidi's op at its default config, a small tile sweep.
Error = max|out - ref64| / max|ref64|. Peaks (bf16 matmul, device copy read + write) measured in the same run.

Usage: python bench/bench_hc_mix.py [--out PATH] [--smoke]. The LAST line printed is one JSON object.
"""

from __future__ import annotations

import argparse

import torch

from minidi.ops import gate_tf32x3 as op

if __package__:  # python -m bench.bench_hc_mix, the tests
    from . import common
else:  # python bench/bench_hc_mix.py: the script's folder is sys.path[0]
    import common

SWEEP = ((16, 32, 128, 4, 3, 1), (16, 32, 128, 4, 3, 2), (16, 32, 128, 4, 3, 4), (32, 32, 128, 4, 3, 4),
         (64, 32, 128, 4, 3, 4), (64, 32, 128, 4, 3, 8), (32, 32, 64, 4, 4, 4), (64, 32, 64, 4, 4, 8),
         (16, 32, 64, 2, 4, 2), (128, 32, 128, 8, 3, 8))  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K


def plain(z: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    return z.float() @ fn.float().t()


def dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter ok)")
    args = ap.parse_args(argv)
    device = dev()
    t, k, n = (64, 512, 24) if args.smoke else (4096, 4 * 5120, 24)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    z = torch.randn(t, k, device=device).bfloat16()
    fn = torch.randn(n, k, device=device) * k**-0.5
    ref = z.double() @ fn.double().t()
    pk = common.measure_peaks(device, small=args.smoke)
    nbytes = z.numel() * 2 + fn.numel() * 4 + t * n * 4

    def err(out):
        return float(f"{((out.double() - ref).abs().max() / ref.abs().max()).item():.2e}")

    table: list = []
    base = {"eager": common.op_ms(lambda: plain(z, fn), device, args.smoke)}
    common.table_row(table, "plain fp32 matmul eager", base["eager"], nbytes, "GB/s", pk, {},
                     rel_err=err(plain(z, fn)))
    compiled = torch.compile(plain, dynamic=False)
    compiled(z, fn)
    base["compile"] = common.op_ms(lambda: compiled(z, fn), device, args.smoke)
    common.table_row(table, "plain fp32 matmul torch.compile", base["compile"], nbytes, "GB/s", pk, {},
                     rel_err=err(compiled(z, fn)))
    ms = common.op_ms(lambda: op.gate_tf32x3(z, fn), device, args.smoke)
    common.table_row(table, f"minidi op (default {op.default_config(t, n, k, z.dtype, fn.dtype)})", ms, nbytes,
                     "GB/s", pk, base, rel_err=err(op.gate_tf32x3(z, fn)))
    buf = torch.empty(t, n, device=device)
    for bm, bn, bk, nw, ns, sk in SWEEP:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, SPLIT_K=sk)
        name = f"  M{bm} N{bn} K{bk} w{nw} s{ns} split{sk}"
        try:
            op.launch(z, fn, buf, **cfg)
        except Exception as exc:  # e.g. out of shared memory for this tile: report, keep going
            table.append({"name": name, "error": type(exc).__name__})
            continue
        ms = common.op_ms(lambda: op.launch(z, fn, buf, **cfg), device, args.smoke)
        common.table_row(table, name, ms, nbytes, "GB/s", pk, base, rel_err=err(buf))
    common.print_table(f"F mHC projection [{t}, {k}] bf16 x [{n}, {k}] fp32 (bytes z + fn + out; GB/s vs copy peak)",
                       table)
    result = {"bench": "hc_mix", "device": common.device_name(device),
              "torch": torch.__version__, "shape": [t, k, n], "peaks": {kk: round(v, 1) for kk, v in pk.items()},
              "table": table}
    common.emit_json(result, out=args.out)
    return result


if __name__ == "__main__":
    main()
