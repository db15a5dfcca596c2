"""FP4 grouped expert GEMM (minidi::fp4_grouped_mm) vs dequant + grouped_mm, at V4.1-Flash shapes on one GPU.

Shapes: w1/w3 (N 2,304, K 5,120) and w2 (N 5,120, K 2,304); (a) EP4 rank: 96 experts x 256 rows, (b) EP1: 384
experts x 64 rows (R = 24,576 rows = 4,096 tokens x top-6 either way); rows per expert uniform, or skewed (lognormal
expert popularity, sigma 1, same R). Compared, in one run:
- op: the op's default config (+ a sweep of configs on the uniform rows: ``--sweep short|full|none``);
- naive eager: the model's plain ``dequant_expert_stack`` (chunked over experts only to bound its int64
  temporaries) + ``grouped_mm`` (torch._grouped_mm, bf16);
- naive compiled: the same under stock ``torch.compile`` (Inductor, no minidi passes);
- grouped_mm bf16: torch._grouped_mm on weights dequantised beforehand (the ceiling of any non-fused path, dequant
  not counted).
Peaks measured in the same run: bf16 matmul 8192^3, device copy (read + write). FLOPs = 2 R N K (real rows only);
minimal bytes = packed + scales + x + y. Prints a table; the last line is one JSON object (``--out`` writes it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

if "--smoke" in sys.argv:  # CPU dry run of the script itself (tiny shapes, Triton interpreter); set before imports
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from minidi.model.moe import dequant_expert_stack, grouped_mm  # noqa: E402
from minidi.ops.fp4_grouped_gemm import (  # noqa: E402
    Fp4GemmConfig,
    chosen_config,
    fp4_dequant_ref,
    fp4_grouped_mm,
    launch,
)
from minidi.ops.fp4_grouped_gemm_configs import (  # noqa: E402
    SS_EP1, SS_EP4, SWAP1WG_EP1, SWAP1WG_EP4, SWAP2WG_EP1, SWAP2WG_EP4)

if __package__:  # python -m bench.bench_fp4_grouped_gemm, the tests
    from . import common  # noqa: E402
    from .expert_gemm_cases import check, dequant_chunked, make_counts  # noqa: E402
else:  # python bench/bench_fp4_grouped_gemm.py: the script's folder is sys.path[0]
    import common  # noqa: E402
    from expert_gemm_cases import check, dequant_chunked, make_counts  # noqa: E402

C = Fp4GemmConfig
SWEEP = {  # rows per expert >= 160 (EP4) / < 160 (EP1); "short" is the default, "full" adds the rest
    "ep4_short": [SWAP1WG_EP4,  # the op's default
                  SWAP2WG_EP4,  # racy with Triton 3.6 (experiments only: config=)
                  SS_EP4,
                  C(BM=256, BN=128, BK=64, num_warps=8, num_stages=4, swap=True, decode="asm"),
                  C(BM=256, BN=128, BK=64, num_warps=8, num_stages=3, swap=False, decode="asm"),
                  C(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, swap=True, decode="asm"),
                  C(BM=256, BN=128, BK=128, num_warps=8, num_stages=3, swap=False, decode="scaled"),  # 226 TFLOP/s
                  C(BM=256, BN=128, BK=64, num_warps=8, num_stages=4, swap=False, decode="scaled")],
    "ep4_full": [C(BM=128, BN=128, BK=128, num_warps=8, num_stages=3, swap=True, decode="asm"),
                 C(BM=256, BN=64, BK=64, num_warps=4, num_stages=3, swap=True, decode="asm"),
                 C(BM=128, BN=128, BK=128, num_warps=8, num_stages=3, swap=False, decode="scaled"),
                 C(BM=128, BN=128, BK=64, num_warps=4, num_stages=4, swap=True, decode="manual")],
    "ep1_short": [SWAP1WG_EP1,  # the op's default
                  SWAP2WG_EP1,  # racy with Triton 3.6 (experiments only: config=)
                  SS_EP1,
                  C(BM=64, BN=256, BK=64, num_warps=8, num_stages=4, swap=True, decode="asm"),
                  C(BM=64, BN=64, BK=128, num_warps=4, num_stages=4, swap=True, decode="asm", progs_per_sm=2),
                  C(BM=64, BN=128, BK=128, num_warps=8, num_stages=4, swap=False, decode="scaled"),  # 83 TFLOP/s
                  C(BM=64, BN=256, BK=128, num_warps=8, num_stages=3, swap=False, decode="scaled")],
    "ep1_full": [C(BM=64, BN=128, BK=128, num_warps=4, num_stages=4, swap=True, decode="asm"),
                 C(BM=32, BN=128, BK=128, num_warps=4, num_stages=4, swap=True, decode="asm")],
}
SWEEP_BUDGET_S = 75.0  # sweep configs left when the run has taken this long are reported as skipped (total <~ 90 s)


SMOKE = False


def bench_ms(fn) -> float:
    return common.op_ms(fn, "cuda", SMOKE)


def result(ms: float, flops: float, nbytes: float, pk: dict) -> dict:
    tf, pct = common.rate(ms, flops, "TFLOP/s", pk)
    gbps, pct_bw = common.rate(ms, nbytes, "GB/s", pk)
    return {"ms": ms, "tflops": tf, "pct_peak": pct, "gbps_min_bytes": gbps, "pct_copy_bw": pct_bw}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--sweep", default="short", choices=["none", "short", "full"])
    ap.add_argument("--no-naive", action="store_true", help="skip the naive eager/compiled baselines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run on tiny shapes (interpreter), no timing value")
    args = ap.parse_args(argv)
    global SMOKE
    SMOKE = args.smoke
    device = "cpu" if SMOKE else "cuda"
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    pk = common.measure_peaks(device)
    dev = "cpu (smoke)" if SMOKE else common.device_name(device)
    common.say(f"fp4_grouped_mm bench | {dev} | torch {torch.__version__} | triton {triton.__version__} | "
               f"peaks: bf16 {pk['bf16_tflops']:.0f} TFLOP/s, copy {pk['copy_gbps']:.0f} GB/s")
    naive_compiled = torch.compile(lambda x, wp, ws, offs: grouped_mm(x, dequant_expert_stack(wp, ws, x.dtype), offs),
                                   backend="aot_eager" if SMOKE else "inductor")
    shapes = ((("EP4", 4, 40), ("EP1", 8, 8)), (("w13", 96, 128), ("w2", 64, 192))) if SMOKE else (
        (("EP4", 96, 256), ("EP1", 384, 64)), (("w13", 2304, 5120), ("w2", 5120, 2304)))
    cases = []
    hdr = (f"{'case':<26} {'variant':<40} {'ms':>8} {'TFLOP/s':>8} {'%peak':>6} {'GB/s*':>7} {'x naive':>8} "
           f"{'x comp':>7}")
    common.say(hdr + "\n" + "-" * len(hdr))
    for ep, e, rows in shapes[0]:
        for path, n, k in shapes[1]:
            wp = torch.randint(-128, 128, (e, n, k // 2), dtype=torch.int8, device=device)
            ws = torch.randint(118, 123, (e, n, k // 32), dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
            w_bf16 = dequant_chunked(wp, ws, lambda a, b: fp4_dequant_ref(a, b, torch.bfloat16))
            for dist in ("uniform", "skewed"):
                counts = make_counts(e, rows, dist, gen)
                offs = counts.cumsum(0).to(torch.int32).to(device)
                r = int(counts.sum())
                x = torch.randn(r, k, device=device, dtype=torch.bfloat16)
                flops = 2.0 * r * n * k
                nbytes = e * n * k / 2 + e * n * k / 32 + 2.0 * r * k + 2.0 * r * n
                name = f"{ep} {path} {dist}"
                case = {"ep": ep, "experts": e, "rows_per_expert": rows, "path": path, "N": n, "K": k, "dist": dist,
                        "R": r, "max_rows": int(counts.max()), "empty_experts": int((counts == 0).sum()),
                        "flops": flops, "min_bytes": nbytes,
                        "compute_floor_ms": flops / pk["bf16_tflops"] / 1e9,
                        "bytes_floor_ms": nbytes / pk["copy_gbps"] / 1e6}
                case["floor_ms"] = max(case["compute_floor_ms"], case["bytes_floor_ms"])
                ref = grouped_mm(x, w_bf16, offs)
                base = {}
                base["grouped_mm_bf16"] = result(bench_ms(lambda: grouped_mm(x, w_bf16, offs)), flops, nbytes, pk)
                if not args.no_naive and dist == "uniform":  # (the dequant half does not depend on the rows)
                    buf = torch.empty_like(w_bf16)
                    eager = lambda: grouped_mm(  # noqa: E731
                        x, dequant_chunked(wp, ws, lambda a, b: dequant_expert_stack(a, b, x.dtype), buf), offs)
                    base["naive_eager"] = result(bench_ms(eager), flops, nbytes, pk)
                    del buf
                if not args.no_naive:
                    base["naive_compiled"] = result(bench_ms(lambda: naive_compiled(x, wp, ws, offs)), flops,
                                                    nbytes, pk)
                out = fp4_grouped_mm(x, wp, ws, offs)
                cfg = chosen_config(x, wp)  # after any fallback
                op = {"config": cfg.name() if cfg else "?", **check(out, ref),
                      **result(bench_ms(lambda: fp4_grouped_mm(x, wp, ws, offs)), flops, nbytes, pk)}
                case.update(op=op, **base)
                sweep = []
                if dist == "uniform" and args.sweep != "none":
                    tag = "ep4" if rows >= (20 if SMOKE else 160) else "ep1"
                    cfgs = SWEEP[f"{tag}_short"] + (SWEEP[f"{tag}_full"] if args.sweep == "full" else [])
                    for c in cfgs:
                        if SMOKE:  # interpreter: same decode/swap variants on tiny tiles
                            c = dataclasses.replace(c, BM=min(c.BM, 32), BN=32, BK=64, num_stages=1, progs=3)
                        row = {"config": c.name()}
                        if time.perf_counter() - t_start > (1e9 if SMOKE else SWEEP_BUDGET_S):
                            row.update(ok=False, error="skipped: time budget")
                            sweep.append(row)
                            continue
                        try:
                            o = torch.empty_like(ref)
                            launch(x, wp, ws, offs, o, c)
                            row.update(check(o, ref))
                            row.update(result(bench_ms(lambda: launch(x, wp, ws, offs, o, c)), flops, nbytes, pk))
                        except Exception as err:  # a config that does not compile/fit on this Triton: report it
                            row.update(ok=False, error=f"{type(err).__name__}: {str(err)[:300]}")
                        sweep.append(row)
                case["sweep"] = sweep
                cases.append(case)
                nv = base.get("naive_eager", {}).get("ms", math.nan)
                cp = base.get("naive_compiled", {}).get("ms", math.nan)
                rows_out = [(f"op {op['config']}" + ("" if op["ok"] else " WRONG"), op)]
                rows_out += [(kname, v) for kname, v in base.items()]
                rows_out += [(f"  sweep {s['config']}" + ("" if s.get("ok") else " FAIL"), s) for s in sweep]
                for i, (vname, v) in enumerate(rows_out):
                    label = f"{name} (floor {case['floor_ms']:.2f})" if i == 0 else ""
                    if "ms" not in v:
                        common.say(f"{label:<26} {vname:<40} {v.get('error', '')[:60]}")
                        continue
                    common.say(f"{label:<26} {vname:<40} {v['ms']:8.3f} {v['tflops']:8.1f} {v['pct_peak']:6.1f} "
                               f"{v['gbps_min_bytes']:7.0f} {nv / v['ms']:8.2f} {cp / v['ms']:7.2f}")
                x = ref = out = None  # free before the next case (a del would leave the lambdas above unbound)
            wp = ws = w_bf16 = None
            if not SMOKE:
                torch.cuda.empty_cache()
    summary = {f"{c['ep']}_{c['path']}_{c['dist']}": {"op_ms": c["op"]["ms"], "op_tflops": c["op"]["tflops"],
                                                       "ok": c["op"]["ok"], "floor_ms": c["floor_ms"]} for c in cases}
    best = {}
    for c in cases:
        for s in c["sweep"]:
            if s.get("ok") and "ms" in s:
                key = f"{c['ep']}_{c['path']}"
                if key not in best or s["ms"] < best[key]["ms"]:
                    best[key] = {"config": s["config"], "ms": s["ms"], "tflops": s["tflops"]}
    common.say("GB/s* = minimal bytes / time; x naive / x comp = speedup over naive eager / naive compiled")
    common.say("best sweep configs: "
               + ", ".join(f"{k} {v['config']} {v['tflops']:.0f} TFLOP/s" for k, v in best.items()))
    res = {"bench": "fp4_grouped_gemm", "device": dev, "torch": torch.__version__, "triton": triton.__version__,
           "peaks": pk, "summary": summary, "best_sweep": best, "cases": cases,
           "wall_s": time.perf_counter() - t_start}
    common.emit_json(res, out=args.out)
    return res


if __name__ == "__main__":
    main()
