"""Block-scaled FP8 dense GEMM on Hopper (``minidi/ops/fp8_gemm_sm90.py``) vs the current ``fp8_linear`` path (bf16
``F.linear`` on the cached dequantised weight), at V4.1-Flash's projection shapes (T = 4,096 rows, 32-blocks) and
V4-Flash's FP8 linears (128-blocks), in one run.

Per shape [N, K]:
- fp8 sm90: the Gluon kernel on the fq8 split of x, its weight scales prepared once (``weight_scale_t``, as a caller
  keeps them); ``fp8_codes``: the same with the E8M0 codes converted every call (two small kernels more);
  ``fp8_tma_store``: the bulk-store epilogue (``EPI_TMA``);
- each GPU time twice: ``*_ms`` by ``common.op_ms`` (do_bench, L2 flushed; includes the host's launch time where
  the GPU waits for it) and ``*_kernel_ms`` by ``common.kernel_ms`` (the profiler's device time of the kernels);
- bf16 F.linear: ``F.linear(fq8(x), dequant_fp8(w))`` with the dequantised weight made beforehand (today's path, its
  input fq8 not counted);
- fq8_split: the input quantisation the fp8 path needs (``minidi.ops.fp8_quant.fq8_split``), memory-bound; for the
  cuBLAS rows also with M-major scales (``fq8_split_mmajor``, what that route runs);
- (128-blocks) cuBLAS's block-scaled GEMM (``fp8_gemm_cublas``: ``torch._scaled_mm`` with 1 x 128 / 128 x 128 block
  scales, what ``fp8_linear`` runs where its shape rules hold), on the split with M-major scales.
Every fp8 output is checked against the bf16 path's (same products; max error relative to max |y|).
Peaks measured in the same run: bf16 (``common.measure_peaks``) and fp8 (``torch._scaled_mm`` 8192^3, per-tensor
scales). FLOPs = 2 M N K. ``--sweep``: the kernel's config knobs on the two big shapes (kernel times; a second JSON
line, ``--out``'s name with ``_sweep``); ``--ablate``: the kernel with no promotion (timing only, kernel time). The
last line is one JSON object (``--out`` writes it).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F
import triton

from minidi import formats
from minidi.ops import fp8_gemm_cublas as cublas
from minidi.ops import fp8_gemm_sm90 as g
from minidi.ops.fp8_quant import fq8_split, fq8_split_launch

if __package__:
    from . import common
else:
    import common

T = 4096
V41_SHAPES = [(1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (2304, 5120), (5120, 2304), (4096, 1280)]
V4_SHAPES = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096), (4096, 2048),
             (8192, 1024)]  # V4-Flash's FP8 linears (128-blocks): wq_a, wq_b, wkv, wo_b, shared w1 / w3, w2, idx wq_b
C = g.Fp8GemmSm90Config
SWEEP = [C(), C(NS=3), C(NS=6), C(GROUP_M=16), C(GROUP_M=1), C(U=1), C(PIPE=False), C(EPI_TMA=True),
         C(EPI_TMA=True, NS=5)]
TMA_STORE = C(EPI_TMA=True)  # the default since the round that measured it; MASKED the earlier epilogue
MASKED = C(EPI_TMA=False)


def make(m: int, n: int, k: int, block: int, device: str):
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes = torch.randint(118, 134, (-(-n // block), k // block), device=device, dtype=torch.uint8)
    return x, w, codes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time the SWEEP configs on the two big shapes")
    ap.add_argument("--ablate", action="store_true", help="time the no-promotion ablation (wrong results)")
    ap.add_argument("--shapes", default="all", help="'all' or a comma list of NxK (32-blocks)")
    ap.add_argument("--sweep-blocks", type=lambda v: tuple(int(b) for b in v.split(",")), default=(32, 128),
                    help="block sizes the sweep covers (comma list)")
    args = ap.parse_args(argv)
    device = "cuda"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    pk = common.measure_peaks(device)
    pk["fp8_tflops"] = float(f"{common.fp8_peak_tflops(device):.4g}")
    common.say(f"fp8_gemm_sm90 bench | {common.device_name(device)} | torch {torch.__version__} | triton "
               f"{triton.__version__} | peaks: bf16 {pk['bf16_tflops']:.0f}, fp8 {pk['fp8_tflops']:.0f} TFLOP/s, "
               f"copy {pk['copy_gbps']:.0f} GB/s | T {T}")
    shapes = V41_SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x"))
                                                      for s in args.shapes.split(",")]
    cases = [(n, k, 32) for n, k in shapes] + [(n, k, 128) for n, k in V4_SHAPES if args.shapes == "all"]
    table, results = [], []

    def tf(ms: float, flops: float) -> float:
        return flops / ms / 1e9

    for n, k, block in cases:
        x, w, codes = make(T, n, k, block, device)
        q, s = fq8_split(x, block)
        sw_t = g.weight_scale_t(codes)
        xq = (q.float() * s.repeat_interleave(block, 1)).bfloat16()  # fq8(x), exact in bf16
        wd = formats.dequant_fp8(w, codes, block, torch.bfloat16)
        flops = 2 * T * n * k
        name = f"{n}x{k} b{block}"
        y16 = F.linear(xq, wd)
        y8 = g.fp8_gemm_sm90(q, s, w, codes, block, w_scale_t=sw_t, config=MASKED)
        err = float((y8.float() - y16.float()).abs().max() / y16.float().abs().max())
        y8t = g.fp8_gemm_sm90(q, s, w, codes, block, w_scale_t=sw_t, config=TMA_STORE)
        same_tma = bool(torch.equal(y8t, y8))
        fp8 = lambda: g.fp8_gemm_sm90(q, s, w, codes, block, w_scale_t=sw_t, config=MASKED)  # noqa: E731
        fp8_tma = lambda: g.fp8_gemm_sm90(q, s, w, codes, block, w_scale_t=sw_t, config=TMA_STORE)  # noqa: E731
        bf16 = lambda: F.linear(xq, wd)  # noqa: E731
        ms_bf16 = common.op_ms(bf16, device)
        ms_fp8 = common.op_ms(fp8, device)
        ms_codes = common.op_ms(lambda: g.fp8_gemm_sm90(q, s, w, codes, block, config=MASKED), device)
        ms_tma = common.op_ms(fp8_tma, device)
        ms_split = common.op_ms(lambda: fq8_split(x, block), device)
        k_bf16, k_fp8, k_tma = (common.kernel_ms(f, device, calls=20) for f in (bf16, fp8, fp8_tma))
        k_split = common.kernel_ms(lambda: fq8_split(x, block), device, calls=20)
        row = {"shape": name, "N": n, "K": k, "block": block, "err_vs_bf16": float(f"{err:.3g}"),
               "bf16_ms": round(ms_bf16, 4), "bf16_tflops": round(tf(ms_bf16, flops), 1),
               "fp8_ms": round(ms_fp8, 4), "fp8_tflops": round(tf(ms_fp8, flops), 1),
               "fp8_pct_fp8_peak": round(100 * tf(ms_fp8, flops) / pk["fp8_tflops"], 1),
               "fp8_pct_bf16_peak": round(100 * tf(ms_fp8, flops) / pk["bf16_tflops"], 1),
               "x_vs_bf16": round(ms_bf16 / ms_fp8, 3), "fp8_codes_ms": round(ms_codes, 4),
               "fq8_split_ms": round(ms_split, 4),
               "x_vs_bf16_incl_split": round(ms_bf16 / (ms_fp8 + ms_split), 3),
               "fp8_tma_store_ms": round(ms_tma, 4), "tma_store_same_bits": same_tma,
               "bf16_kernel_ms": round(k_bf16, 4), "fp8_kernel_ms": round(k_fp8, 4),
               "fp8_tma_store_kernel_ms": round(k_tma, 4), "fq8_split_kernel_ms": round(k_split, 4),
               "fp8_kernel_tflops": round(tf(k_fp8, flops), 1),
               "fp8_tma_store_kernel_tflops": round(tf(k_tma, flops), 1),
               "bf16_kernel_tflops": round(tf(k_bf16, flops), 1),
               "x_vs_bf16_kernel": round(k_bf16 / k_fp8, 3), "x_vs_bf16_kernel_tma_store": round(k_bf16 / k_tma, 3),
               "x_vs_bf16_kernel_incl_split": round(k_bf16 / (k_fp8 + k_split), 3)}
        if args.ablate:
            cfg = dataclasses.replace(MASKED, ABLATE=1)
            ms_ab = common.kernel_ms(lambda: g.fp8_gemm_sm90(q, s, w, codes, block, w_scale_t=sw_t, config=cfg),
                                     device, calls=20)
            row["no_promotion_kernel_ms"] = round(ms_ab, 4)
            row["no_promotion_kernel_tflops"] = round(tf(ms_ab, flops), 1)
        if block == 128:
            pf = C(EPI_TMA=False, PREFETCH=True)
            row["fp8_prefetch_kernel_ms"] = round(common.kernel_ms(
                lambda: g.fp8_gemm_sm90(q, s, w, codes, block, w_scale_t=sw_t, config=pf), device, calls=20), 4)
            row["fp8_prefetch_same_bits"] = bool(torch.equal(
                g.fp8_gemm_sm90(q, s, w, codes, block, w_scale_t=sw_t, config=pf), y8))
            if cublas.shape_ok(T, n, k):
                qt, st = fq8_split_launch(x, block, scales_t=True)
                swc = cublas.weight_scales(codes)
                fn = lambda: cublas.fp8_gemm_cublas(qt, st, w, swc, torch.bfloat16)  # noqa: E731
                ys = fn()
                ms_c, k_c = common.op_ms(fn, device), common.kernel_ms(fn, device, calls=20)
                e_c = float((ys.float() - y16.float()).abs().max() / y16.float().abs().max())
                k_st = common.kernel_ms(lambda: fq8_split_launch(x, block, scales_t=True), device, calls=20)
                row.update(cublas_ms=round(ms_c, 4), cublas_kernel_ms=round(k_c, 4),
                           fq8_split_mmajor_kernel_ms=round(k_st, 4),
                           cublas_kernel_tflops=round(tf(k_c, flops), 1),
                           cublas_pct_fp8_peak=round(100 * tf(k_c, flops) / pk["fp8_tflops"], 1),
                           cublas_x_vs_bf16_kernel=round(k_bf16 / k_c, 3),
                           cublas_x_vs_fp8_kernel=round(k_tma / k_c, 3), cublas_err_vs_bf16=float(f"{e_c:.3g}"))
                del qt, st, swc, ys
            else:
                row["cublas"] = "outside its shape rules (fp8_gemm_cublas.shape_ok)"
        results.append(row)
        cols = ("shape", "bf16_ms", "fp8_ms", "x_vs_bf16", "bf16_kernel_ms", "fp8_kernel_ms", "fp8_tma_store_kernel_ms",
                "fp8_kernel_tflops", "x_vs_bf16_kernel", "x_vs_bf16_kernel_tma_store", "fq8_split_kernel_ms",
                "err_vs_bf16")
        table.append({k_: row[k_] for k_ in cols}
                     | ({"no_prom_kernel_tflops": row["no_promotion_kernel_tflops"]} if args.ablate else {})
                     | ({"cublas_kernel_tflops": row.get("cublas_kernel_tflops", "n/a"),
                         "cublas_x_vs_bf16_kernel": row.get("cublas_x_vs_bf16_kernel", "n/a")} if block == 128 else {}))
        common.say(table[-1])
        del x, w, codes, q, s, sw_t, xq, wd, y16, y8, y8t
        torch.cuda.empty_cache()

    common.print_table("fp8_gemm_sm90 vs bf16 F.linear (T = 4096)", table)
    result = {"bench": "fp8_gemm_sm90", "device": common.device_name(device), "torch": torch.__version__,
              "triton": triton.__version__, "peaks": pk, "T": T, "default_config": g.DEFAULT.name(),
              "results": results, "seconds": round(time.perf_counter() - t0, 1)}
    common.emit_json(result, out=args.out)  # before the sweep: a config that faults cannot lose it
    sweep = []
    if args.sweep:
        for n, k in [(32768, 1280), (5120, 8192)]:
            for block in args.sweep_blocks:
                x, w, codes = make(T, n, k, block, device)
                q, s = fq8_split(x, block)
                sw_t = g.weight_scale_t(codes)
                flops = 2 * T * n * k
                for cfg in SWEEP:
                    if cfg.BN < block:
                        continue
                    try:
                        ms = common.kernel_ms(lambda: g.fp8_gemm_sm90(q, s, w, codes, block, w_scale_t=sw_t,
                                                                      config=cfg), device, calls=20)
                        sweep.append({"shape": f"{n}x{k} b{block}", "config": cfg.name(), "kernel_ms": round(ms, 4),
                                      "tflops": round(tf(ms, flops), 1)})
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                        sweep.append({"shape": f"{n}x{k} b{block}", "config": cfg.name(),
                                      "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    common.say(sweep[-1])
                del x, w, codes, q, s, sw_t
                torch.cuda.empty_cache()
        result = dict(result, sweep=sweep, seconds=round(time.perf_counter() - t0, 1))
        common.emit_json(result, out=args.out.replace(".json", "_sweep.json") if args.out else None)
    return result


if __name__ == "__main__":
    main()
