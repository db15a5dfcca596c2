"""Which FP4 grouped-GEMM configs are race-free and fast on this GPU + ptxas (round 4 of the rows / swap mismatch).

The swapped tiles (acc^T = W x^T) feed the decoded weights to the Hopper MMA from registers (an "RS" wgmma), which
Triton pipelines with wgmma groups left in flight. Triton issue 9433: ptxas before 13.3 may reuse those registers
before the MMA has read them, a race that corrupts a few weight rows of a tile (what the H200 showed: ~7 columns of
a whole 256-row tile, changing from run to run). ptxas 13.5 did not remove it (other grid sizes still raced in
``fp4_rows_repro.py``). Unswapped tiles read both operands from shared memory ("SS").

Per config and case (V4.1 w1/w3 and w2 at EP4 96 x 256 rows and EP1 384 x 64 rows, skewed rows): ``--repeats``
launches, each compared bitwise with the first (a race shows as a run that differs) and, with a tolerance, with the
plain-torch reference (bf16 weights, fp32 accumulation); then the median time. Writes one JSON object (``--out``).

    TRITON_INTERPRET=0 PYTHONPATH=$PWD python bench/debug/fp4_config_race.py --out $OUT/race.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from minidi.ops.fp4_grouped_gemm import Fp4GemmConfig, default_config, launch
from minidi.ops.fp4_grouped_gemm_configs import ptxas_version, swap_tiles_enabled

C = Fp4GemmConfig
CANDIDATES = {
    "EP4": [C(BM=256, BN=128, BK=64, num_warps=8, num_stages=3, swap=True),
            C(BM=256, BN=128, BK=64, num_warps=8, num_stages=3, swap=False),
            C(BM=256, BN=128, BK=64, num_warps=8, num_stages=4, swap=False),
            C(BM=256, BN=128, BK=128, num_warps=8, num_stages=3, swap=False),
            C(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, swap=False),
            C(BM=128, BN=128, BK=64, num_warps=8, num_stages=4, swap=False),
            # swapped with one warpgroup: no wgmma wait across warpgroups (triton issue 11047 / PR 11056)
            C(BM=128, BN=128, BK=64, num_warps=4, num_stages=3, swap=True),
            C(BM=128, BN=128, BK=64, num_warps=4, num_stages=3, swap=True, progs_per_sm=2),
            C(BM=128, BN=128, BK=64, num_warps=4, num_stages=4, swap=True, progs_per_sm=2),
            C(BM=128, BN=128, BK=128, num_warps=4, num_stages=2, swap=True, progs_per_sm=2),
            C(BM=256, BN=64, BK=64, num_warps=4, num_stages=3, swap=True, progs_per_sm=2),
            C(BM=256, BN=64, BK=64, num_warps=4, num_stages=4, swap=True),
            C(BM=128, BN=64, BK=128, num_warps=4, num_stages=3, swap=True)],
    "EP1": [C(BM=64, BN=128, BK=128, num_warps=8, num_stages=4, swap=True),
            C(BM=64, BN=128, BK=128, num_warps=4, num_stages=4, swap=False),
            C(BM=64, BN=256, BK=64, num_warps=8, num_stages=4, swap=False),
            C(BM=64, BN=128, BK=64, num_warps=4, num_stages=5, swap=False),
            C(BM=128, BN=128, BK=64, num_warps=8, num_stages=3, swap=False),
            C(BM=64, BN=128, BK=128, num_warps=4, num_stages=4, swap=True),
            C(BM=64, BN=64, BK=128, num_warps=4, num_stages=4, swap=True),
            C(BM=64, BN=128, BK=128, num_warps=4, num_stages=4, swap=True, progs_per_sm=2),
            C(BM=64, BN=128, BK=64, num_warps=4, num_stages=4, swap=True, progs_per_sm=2),
            C(BM=64, BN=64, BK=128, num_warps=4, num_stages=4, swap=True, progs_per_sm=2)],
}


def case(e: int, rows: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.exp(torch.randn(e, generator=g))
    counts = torch.multinomial(p / p.sum(), e * rows, replacement=True, generator=g).bincount(minlength=e)
    r = int(counts.sum())
    wp = torch.randint(-128, 128, (e, n, k // 2), dtype=torch.int8, generator=g).cuda()
    ws = torch.randint(118, 123, (e, n, k // 32), dtype=torch.uint8, generator=g).cuda().view(torch.float8_e8m0fnu)
    x = torch.randn(r, k, generator=g).to(torch.bfloat16).cuda()
    offs = counts.cumsum(0).to(torch.int32).cuda()
    return x, wp, ws, offs


def reference(x, wp, ws, offs) -> torch.Tensor:
    from minidi.model.quant import dequant_fp4
    out = torch.empty(x.shape[0], wp.shape[1], dtype=torch.bfloat16, device=x.device)
    for i in range(0, wp.shape[0], 16):  # bf16 weights in chunks, torch's grouped GEMM (fp32 accumulation)
        w = dequant_fp4(wp[i:i + 16], ws[i:i + 16], torch.bfloat16)
        lo = 0 if i == 0 else int(offs[i - 1])
        hi = int(offs[min(i + 16, wp.shape[0]) - 1])
        if hi > lo:
            o = (offs[i:i + 16] - lo).to(torch.int32)
            out[lo:hi] = torch._grouped_mm(x[lo:hi], w.transpose(-2, -1), offs=o)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="EP4,EP1")
    args = ap.parse_args()
    report = {"triton": triton.__version__, "ptxas": ptxas_version(), "swap_tiles_enabled": swap_tiles_enabled(),
              "cases": []}
    shapes = {"EP4": (96, 256), "EP1": (384, 64)}
    for ep in args.only.split(","):
        e, rows = shapes[ep]
        for path, n, k in (("w13", 2304, 5120), ("w2", 5120, 2304)):
            x, wp, ws, offs = case(e, rows, n, k, seed=n + e)
            ref = reference(x, wp, ws, offs).float()
            scale = ref.abs().max()
            flops = 2.0 * x.shape[0] * n * k
            for cfg in CANDIDATES[ep]:
                entry = {"ep": ep, "path": path, "config": cfg.name(), "default": cfg == default_config(
                    x.shape[0], e, n, k, x.dtype, x.device)}
                try:
                    outs = []
                    for _ in range(args.repeats):
                        out = torch.full((x.shape[0], n), 12345.0, dtype=torch.bfloat16, device="cuda")
                        launch(x, wp, ws, offs, out, cfg)
                        outs.append(out)
                    torch.cuda.synchronize()
                    first = outs[0]
                    entry["runs_differing"] = sum(int(not torch.equal(o, first)) for o in outs[1:])
                    entry["bad_vs_ref"] = [int(((o.float() - ref).abs() > 2**-7 * ref.abs() + 1e-3 * scale).sum())
                                           for o in outs]
                    buf = outs[0]
                    ms = triton.testing.do_bench(lambda: launch(x, wp, ws, offs, buf, cfg), warmup=10, rep=60,
                                                 return_mode="median")
                    entry.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
                    del outs
                except Exception as err:  # a config that does not compile here: report it, go on
                    entry["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                report["cases"].append(entry)
                print(json.dumps(entry), flush=True)
            del x, wp, ws, offs, ref
            torch.cuda.empty_cache()
    text = json.dumps(report)
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
