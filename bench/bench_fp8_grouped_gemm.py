"""FP8 x FP4 grouped expert GEMM (minidi::fp8_fp4_grouped_mm) vs today's bf16-tensor-core op and torch's bf16
grouped GEMM, at V4.1-Flash shapes on one GPU, in one run.

Shapes: w1/w3 (N 2,304, K 5,120) and w2 (N 5,120, K 2,304); EP4 rank (96 experts x 256 rows) and EP1 (384 x 64),
R = 24,576 rows either way; rows per expert uniform, balanced (the real step's router loads: lognormal popularity
sigma 0.14, cv ~0.15, max/mean ~1.4) or skewed (sigma 1), same R, one draw per (EP, dist) shared by w1/w3 and w2
(``expert_gemm_cases.make_counts``; each case reports its cv, max/mean and tiles per expert). Compared:
- gluon sm90: the Hopper Gluon kernel of the op (``fp8_grouped_gemm_sm90.py``, weight scales folded per row by
  ``fold_fp4_rows``, computed once per weight tensor, not timed), on sm_90 with Triton 3.6; ``op_fold_per_call``:
  the op as pass L calls it (``fold_gate`` on the device every call, the exact kernel's empty launch); ``--ablate``
  also times its variants that drop a stage (wrong results, timing only): sync (every wait immediate), no
  promotion, no decode, MMA only; ``--gluon-sweep`` other tile configs;
- fp8 op (Triton): the Triton kernel of ``fp8_fp4_grouped_mm`` on the split rows (its default config, + a sweep of
  configs on uniform rows);
- fp8 op + split: the same with ``fq8_split`` of the rows in the timed call (what a pass that cannot fuse the split
  into the producer costs);
- bf16 op: ``fp4_grouped_mm`` (weights decoded to bf16 in the kernel) on the fq8 rows in bf16: on sm_90 with
  Triton 3.6 its Gluon kernel (``MINIDI_FP4_GEMM_SM90``: "rs", the default since round 18, the register-operand
  kernel below; "ws", round 17's decoder warps; "0", the Triton kernel), with the device-side code-range gate as the
  op runs it; ``--bf16-sweep`` the decoder-warp kernel's configs;
- bf16 rs: the register-operand Hopper kernel (``fp4_grouped_gemm_sm90_rs.py``: the MMA warpgroups decode their own
  weights into the registers of a register-operand wgmma, the activations the B operand) on the same bf16 rows, in
  both tilings: ``bf16_rs_fixed`` (rounds 18-24: BT-row tiles) and ``bf16_rs_chunked`` (round 25: tiles sized to the
  expert's rows in 64-row chunks, one MMA group queued ahead); ``bf16_rs`` repeats the default's row;
  ``--rs-sweep`` other configs (on the uniform and balanced rows);
- bf16 triton: the op's Triton kernel (``fp4_grouped_gemm.launch``, its default config): the reference every other
  output is checked against;
- grouped_mm bf16: ``torch._grouped_mm`` on weights dequantised beforehand (dequant not counted).
Every output is checked against the bf16 op's (the same products; only the order of the fp32 sums differs).
Peaks measured in the same run: bf16 and fp8 (``torch._scaled_mm``) 8192^3 matmuls. FLOPs = 2 R N K.
The last line is one JSON object (``--out`` writes it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

if "--smoke" in sys.argv:  # CPU dry run of the script itself (tiny shapes, Triton interpreter); set before imports
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from minidi.model.moe import grouped_mm  # noqa: E402
from minidi.model.quant import fq8  # noqa: E402
from minidi.ops import fp4_grouped_gemm as fp4_gemm  # noqa: E402
from minidi.ops import fp4_grouped_gemm_hopper as hopper  # noqa: E402
from minidi.ops import fp4_grouped_gemm_sm90 as bf16_sm90  # noqa: E402
from minidi.ops import fp4_grouped_gemm_sm90_rs as rs_sm90  # noqa: E402
from minidi.ops.fp4_grouped_gemm import fp4_dequant_ref, fp4_grouped_mm  # noqa: E402
from minidi.ops.fp8_grouped_gemm import Fp8GemmConfig, default_config, fp8_fp4_grouped_mm, launch  # noqa: E402
from minidi.ops.fp8_quant import fq8_split  # noqa: E402
from minidi.ops import fp8_grouped_gemm_sm90 as sm90  # noqa: E402

if __package__:
    from . import common  # noqa: E402
    from .expert_gemm_cases import DISTS, check, dequant_chunked, load_stats, make_counts  # noqa: E402
else:
    import common  # noqa: E402
    from expert_gemm_cases import DISTS, check, dequant_chunked, load_stats, make_counts  # noqa: E402

C = Fp8GemmConfig
SWEEP = [C(BM=128, BN=128, BK=128, num_warps=8, num_stages=3),
         C(BM=128, BN=128, BK=64, num_warps=8, num_stages=4),
         C(BM=64, BN=128, BK=128, num_warps=4, num_stages=4),
         C(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
         C(BM=256, BN=128, BK=64, num_warps=8, num_stages=3),
         C(BM=128, BN=64, BK=128, num_warps=4, num_stages=4),
         C(BM=64, BN=64, BK=128, num_warps=4, num_stages=4, progs_per_sm=2)]
SWEEP_BUDGET_S = 150.0
G = sm90.Sm90Config
GLUON_SWEEP = [G(), G(dec_warps=8, dec_regs=48, maxnreg=96), G(NS=3),
               G(BM=64, BN=256, NS=3, WM=1, WN=2, dec_regs=96),
               G(BM=64, BN=256, NS=3, WM=1, WN=2, dec_warps=8, dec_regs=48, maxnreg=96),
               G(BM=64, BN=256, NS=4, WM=1, WN=2, dec_regs=96)]
B = bf16_sm90.Bf16Sm90Config
BF16_SWEEP = [bf16_sm90.EP4, B(BN=128, maxnreg=128, dec_warps=4, dec_regs=80, NS=4), bf16_sm90.WIDE,
              B(dec_rows=2), bf16_sm90.EP1]
RS = rs_sm90.RsConfig
RS_SWEEP = [RS(NS=6),  # (the defaults of both tilings: their own rows)
            dataclasses.replace(rs_sm90.EP4_CHUNKED, NS=5), dataclasses.replace(rs_sm90.EP4_CHUNKED, ahead=False),
            rs_sm90.EP1_CHUNKED,  # (128-row chunked tiles at EP4: how much of the gain is the 256-row tile's)
            dataclasses.replace(rs_sm90.EP1_CHUNKED, BT=64, NS=10),
            dataclasses.replace(rs_sm90.EP1_CHUNKED, BT=256, NS=4)]
SWEEP_DISTS = ("uniform", "balanced")  # the rows the config sweeps run on
ABLATIONS = {"sync": dict(PIPE=False), "no_promote": dict(ABLATE=1), "no_decode": dict(ABLATE=2),
             "mma_only": dict(ABLATE=3)}


def bf16_variants(label: str, configs, kernel, args: tuple, ref: torch.Tensor, flops: float, ms) -> list[dict]:
    """One row per config of a bf16 Hopper kernel (``kernel(*args, out, config)``): checked against ``ref``, timed;
    a config that does not compile or fit reports its error."""
    rows = []
    for vcfg in configs:
        row = {"variant": f"{label} {vcfg.name()}", "config": vcfg.name()}
        try:
            o = torch.full_like(ref, float("nan"))
            kernel(*args, o, vcfg)
            row.update(check(o, ref))
            t = ms(lambda: kernel(*args, o, vcfg))
            row.update(ms=round(t, 4), tflops=round(flops / t / 1e9, 1))
        except Exception as err:  # a config that does not compile / fit: report it
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
    return rows


def rs_tilings(rows_per_expert: float) -> dict[str, "rs_sm90.RsConfig"]:
    """The register-operand kernel's two tilings at this load: fixed BT-row tiles (rounds 18-24) and chunked tiles
    sized to the expert's rows (round 25), each its regime's config."""
    ep4 = rows_per_expert >= 96
    return {"bf16_rs_fixed": rs_sm90.EP4_FIXED if ep4 else rs_sm90.EP1_FIXED,
            "bf16_rs_chunked": rs_sm90.EP4_CHUNKED if ep4 else rs_sm90.EP1_CHUNKED}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time the SWEEP configs on uniform rows")
    ap.add_argument("--ablate", action="store_true", help="time the Gluon kernel's ablations on uniform rows")
    ap.add_argument("--gluon-sweep", action="store_true", help="time the GLUON_SWEEP configs on uniform rows")
    ap.add_argument("--bf16-sweep", action="store_true", help="time the BF16_SWEEP configs on uniform rows")
    ap.add_argument("--rs-sweep", action="store_true", help="time the RS_SWEEP configs on uniform rows")
    ap.add_argument("--no-triton-fp8", action="store_true", help="skip the (slow) Triton fp8 kernel")
    ap.add_argument("--cases", default="EP4,EP1", help="comma list of EP4, EP1")
    ap.add_argument("--paths", default="w13,w2", help="comma list of w13, w2")
    ap.add_argument("--dists", default="uniform,skewed",
                    help="comma list of uniform, balanced (the step's router loads), skewed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run on tiny shapes (interpreter)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    if not smoke:  # the op's Hopper Gluon path (fp4_grouped_gemm_hopper.hopper_kernel), as the op runs it by default
        os.environ[hopper.ENV] = "rs"
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    pk = common.measure_peaks(device)
    if not smoke:
        pk["fp8_tflops"] = float(f"{common.fp8_peak_tflops(device):.4g}")
    dev = "cpu (smoke)" if smoke else common.device_name(device)
    gluon = not smoke and sm90.gluon_supported() and torch.cuda.get_device_capability() == (9, 0)
    common.say(f"fp8_fp4_grouped_mm bench | {dev} | torch {torch.__version__} | triton {triton.__version__} | "
               f"peaks: bf16 {pk['bf16_tflops']:.0f}, fp8 {pk.get('fp8_tflops', float('nan')):.0f} TFLOP/s")
    shapes = ((("EP4", 4, 40), ("EP1", 8, 8)), (("w13", 96, 128), ("w2", 64, 192))) if smoke else (
        (("EP4", 96, 256), ("EP1", 384, 64)), (("w13", 2304, 5120), ("w2", 5120, 2304)))
    wanted = set(args.cases.split(","))

    def ms(fn) -> float:
        return common.op_ms(fn, device, smoke)

    cases = []
    for ep, e, rows in shapes[0]:
        if ep not in wanted:
            continue
        for path, n, k in shapes[1]:
            if path not in args.paths.split(","):
                continue
            wp = torch.randint(-128, 128, (e, n, k // 2), dtype=torch.int8, device=device)
            ws = torch.randint(118, 123, (e, n, k // 32), dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
            w_bf16 = dequant_chunked(wp, ws, lambda a, b: fp4_dequant_ref(a, b, torch.bfloat16))
            base = sm90.fold_fp4_rows(ws) if gluon else None  # once per weight tensor (weights are constant)
            for dist in args.dists.split(","):
                # one draw per (EP, dist): w1/w3 and w2 see the same loads
                seed = args.seed * 10007 + 10 * e + DISTS.index(dist)
                counts = make_counts(e, rows, dist, torch.Generator().manual_seed(seed))
                offs = counts.cumsum(0).to(torch.int32).to(device)
                r = int(counts.sum())
                x = fq8(torch.randn(r, k, device=device, dtype=torch.bfloat16), 32)  # rows on the fq8 grid
                q, s = fq8_split(x, 32)
                flops = 2.0 * r * n * k
                case = {"ep": ep, "experts": e, "path": path, "N": n, "K": k, "dist": dist, "R": r,
                        "max_rows": int(counts.max()), "flops": flops, "loads": load_stats(counts)}
                ref = torch.full((r, n), float("nan"), dtype=torch.bfloat16, device=device)
                fp4_gemm.launch(x, wp, ws, offs, ref)  # the Triton kernel: the reference of every check
                bf16_out = fp4_grouped_mm(x, wp, ws, offs)
                out = torch.empty_like(ref)
                cfg = default_config(q.device, k, r / e)
                launch(q, s, wp, ws, offs, out, cfg)
                gcfg = sm90.default_config(r / e)
                timed = {}
                if base is not None:
                    out_g = torch.full_like(ref, float("nan"))
                    sm90.launch_sm90(q, s, wp, ws, base, offs, out_g, gcfg)
                    case["gluon_check"] = check(out_g, ref)
                    timed["gluon_sm90"] = lambda: sm90.launch_sm90(q, s, wp, ws, base, offs, out_g, gcfg)
                    # the op as pass L calls it: the fold decided on the device every call (fold_gate), no host sync
                    timed["op_fold_per_call"] = lambda: fp8_fp4_grouped_mm(q, s, wp, ws, offs, torch.bfloat16)
                    # the register-operand bf16 kernel (decode in the MMA warps), on the fq8 activations as bf16, in
                    # both tilings (the default's row is repeated as bf16_rs)
                    rcfg = rs_sm90.default_config(r / e)
                    rs_cfgs = rs_tilings(r / e)
                    out_rs = torch.full_like(ref, float("nan"))
                    for label, c in rs_cfgs.items():
                        out_rs.fill_(float("nan"))
                        rs_sm90.launch_sm90_rs(x, wp, ws, offs, out_rs, c)
                        case[f"{label}_check"] = check(out_rs, ref)
                        timed[label] = (lambda c_: lambda: rs_sm90.launch_sm90_rs(x, wp, ws, offs, out_rs, c_))(c)
                if not args.no_triton_fp8:
                    timed["fp8_op"] = lambda: launch(q, s, wp, ws, offs, out, cfg)
                    timed["fp8_op_with_split"] = lambda: launch(*fq8_split(x, 32), wp, ws, offs, out, cfg)
                timed.update({
                    "fq8_split_alone": lambda: fq8_split(x, 32),
                    "bf16_op": lambda: fp4_grouped_mm(x, wp, ws, offs),
                    "bf16_triton": lambda: fp4_gemm.launch(x, wp, ws, offs, out),
                    "grouped_mm_bf16": lambda: grouped_mm(x, w_bf16, offs),
                })
                for name, fn in timed.items():
                    t = ms(fn)
                    case[name] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1)}
                case["fq8_split_alone"]["gbps"] = round(r * k * (2 + 1 + 4 / 32) / case["fq8_split_alone"]["ms"] / 1e6)
                fp8_peak = pk.get("fp8_tflops", 1)
                case["bf16_op"].update(check(bf16_out, ref))
                case["bf16_op"]["sm90_gluon"] = gluon and hopper.can_run(x, wp)
                case["bf16_op"]["pct_bf16_peak"] = round(100 * case["bf16_op"]["tflops"] / pk["bf16_tflops"], 1)
                for label in ("bf16_rs_fixed", "bf16_rs_chunked"):
                    if label in case:
                        rr = case[label]
                        rr["config"] = rs_cfgs[label].name()
                        rr.update(case.pop(f"{label}_check"))
                        rr["pct_bf16_peak"] = round(100 * rr["tflops"] / pk["bf16_tflops"], 1)
                        for other in ("bf16_op", "gluon_sm90", "grouped_mm_bf16", "bf16_rs_fixed"):
                            rr[f"x_vs_{other}"] = round(case[other]["ms"] / rr["ms"], 2)
                        if rs_cfgs[label] == rcfg:
                            case["bf16_rs"] = dict(rr, tiling=label)
                for other in ("bf16_triton", "grouped_mm_bf16", "gluon_sm90"):
                    if other in case:
                        case["bf16_op"][f"x_vs_{other}"] = round(case[other]["ms"] / case["bf16_op"]["ms"], 2)
                if "fp8_op" in case:
                    case["fp8_op"]["config"] = cfg.name()
                    case["fp8_op"].update(check(out, ref))
                    case["fp8_op"]["pct_fp8_peak"] = round(100 * case["fp8_op"]["tflops"] / fp8_peak, 1)
                    case["fp8_op"]["x_vs_bf16_op"] = round(case["bf16_op"]["ms"] / case["fp8_op"]["ms"], 2)
                if "gluon_sm90" in case:
                    g = case["gluon_sm90"]
                    g["config"] = gcfg.name()
                    g.update(case.pop("gluon_check"))
                    g["pct_fp8_peak"] = round(100 * g["tflops"] / fp8_peak, 1)
                    g["x_vs_bf16_op"] = round(case["bf16_op"]["ms"] / g["ms"], 2)
                    g["x_vs_grouped_mm_bf16"] = round(case["grouped_mm_bf16"]["ms"] / g["ms"], 2)
                    if "fp8_op" in case:
                        g["x_vs_triton_fp8"] = round(case["fp8_op"]["ms"] / g["ms"], 2)
                gl_rows = []
                if base is not None and dist == "uniform" and (args.ablate or args.gluon_sweep):
                    variants = [(n_, dataclasses.replace(gcfg, **kw)) for n_, kw in ABLATIONS.items()] if args.ablate \
                        else []
                    variants += [(c.name(), c) for c in GLUON_SWEEP] if args.gluon_sweep else []
                    for vname, vcfg in variants:
                        row = {"variant": vname, "config": vcfg.name()}
                        try:
                            o = torch.full_like(ref, float("nan"))
                            sm90.launch_sm90(q, s, wp, ws, base, offs, o, vcfg)
                            if vcfg.ABLATE == 0:
                                row.update(check(o, ref))
                            t = ms(lambda: sm90.launch_sm90(q, s, wp, ws, base, offs, o, vcfg))
                            row.update(ms=round(t, 4), tflops=round(flops / t / 1e9, 1))
                        except Exception as err:  # a config that does not compile / fit: report it
                            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                        gl_rows.append(row)
                sweeps = ((args.bf16_sweep, "bf16", BF16_SWEEP, bf16_sm90.launch_sm90),
                          (args.rs_sweep, "rs", RS_SWEEP, rs_sm90.launch_sm90_rs))
                for wanted_sweep, label, configs, kernel in sweeps:
                    if gluon and dist in SWEEP_DISTS and wanted_sweep:
                        gl_rows += bf16_variants(label, configs, kernel, (x, wp, ws, offs), ref, flops, ms)
                case["gluon_variants"] = gl_rows
                sweep = []
                if args.sweep and dist == "uniform":
                    for c in SWEEP:
                        row = {"config": c.name()}
                        if time.perf_counter() - t0 > SWEEP_BUDGET_S:
                            row["error"] = "skipped: time budget"
                            sweep.append(row)
                            continue
                        try:
                            o = torch.empty_like(ref)
                            launch(q, s, wp, ws, offs, o, c)
                            row.update(check(o, ref))
                            t = ms(lambda: launch(q, s, wp, ws, offs, o, c))
                            row.update(ms=round(t, 4), tflops=round(flops / t / 1e9, 1))
                        except Exception as err:  # a config that does not compile / fit: report it
                            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                        sweep.append(row)
                case["sweep"] = sweep
                cases.append(case)
                def tf(name: str) -> str:
                    return f"{case[name]['tflops']:7.1f}" if name in case else "    n/a"

                gk = case.get("gluon_sm90", {})
                common.say(f"{ep} {path} {dist:<8} gluon {tf('gluon_sm90')} TFLOP/s ({gk.get('ms', float('nan')):.3f} "
                           f"ms, {gk.get('pct_fp8_peak', '')}% fp8, ok {gk.get('ok', '')}) | op, fold per call "
                           f"{tf('op_fold_per_call')} | bf16 rs fixed {tf('bf16_rs_fixed')} chunked "
                           f"{tf('bf16_rs_chunked')} (ok {case.get('bf16_rs_fixed', {}).get('ok')}/"
                           f"{case.get('bf16_rs_chunked', {}).get('ok')}) | triton fp8 "
                           f"{tf('fp8_op')} | bf16 op {tf('bf16_op')} (ok {case['bf16_op'].get('ok')}) | bf16 triton "
                           f"{tf('bf16_triton')} | grouped_mm bf16 {tf('grouped_mm_bf16')} | "
                           f"split {case['fq8_split_alone']['gbps']} GB/s")
                for row in gl_rows:
                    common.say(f"    gluon {row['variant']:<34} {row.get('tflops', '')!s:>8} {row.get('ok', '')!s:>6} "
                               f"{row.get('error', '')[:80]}")
                for row in sweep:
                    common.say(f"    {row['config']:<28} {row.get('tflops', '')!s:>8} {row.get('ok', '')!s:>6} "
                               f"{row.get('error', '')[:80]}")
                x = q = s = ref = out = out_g = out_rs = bf16_out = None
            wp = ws = w_bf16 = None
            if not smoke:
                torch.cuda.empty_cache()
    res = {"bench": "fp8_grouped_gemm", "device": dev, "torch": torch.__version__, "triton": triton.__version__,
           "peaks": pk, "cases": cases, "wall_s": round(time.perf_counter() - t0, 1)}
    common.emit_json(res, out=args.out)
    return res


if __name__ == "__main__":
    main()
