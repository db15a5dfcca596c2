"""The FP8 part of ``bench_indexer.py`` (``--only fp8``, ``--only fp8e2e``): the FP8 score on fq4 q / k beside the bf16
kernel in the same run (configs, Triton's accumulation promotion, the rebase / fixup costs, CUDA graph replays, a
run with 0.1 % of the key rows inexact, wide block-scale spreads) and pass B's whole call native vs FP8. It runs
inside ``bench_indexer.main`` (its shape, device and timing helpers come in as ``Shape``) and writes into its
result dict. See ``bench_indexer.py``'s docstring for the workload and ``docs/ops/indexer.md`` for the results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from minidi.model.quant import fq4_ue8m0
from minidi.ops.indexer_fp8_quant import rebase_e4m3
from minidi.ops.indexer_score import _launch_score, indexer_score_ref, indexer_topk
from minidi.ops.indexer_score_fp8 import _launch_score_fp8, default_fp8_config

if __package__:  # python -m bench.bench_indexer, the tests
    from . import common
else:  # python bench/bench_indexer.py: the script's folder is sys.path[0]
    import common

FP8_CONFIGS = {  # overrides of default_fp8_config: BN, QB, num_warps, num_stages, blocks_per_prog, promote
    "fp8 default 64x128 w4 s3": dict(),
    "fp8 64x128 w4 s4": dict(num_stages=4),
    "fp8 64x128 w4 s3 bpp256": dict(blocks_per_prog=256),
    "fp8 64x256 w4 s3": dict(QB=8),
    "fp8 64x128 w4 s3 promote64": dict(promote=64),
    "fp8 64x128 w4 s3 promote32": dict(promote=32),
    "fp8 64x64 w4 s3 promote32": dict(QB=2, promote=32),
}
QUOTED_PEAKS = dict(fp8=1438.0, bf16=785.0)  # TFLOP/s measured on an H200 in earlier rounds (README, issue 21)

@dataclass(frozen=True)
class Shape:
    """bench_indexer's run: T queries, H heads, D head dim, N keys, K picks, the device, and its timing helpers."""

    T: int
    H: int
    D: int
    N: int
    K: int
    dev: str
    timed: Callable
    free: Callable
    overlap: Callable


def rel_errs(scores, q, k, w, ks, ke, rows) -> dict:
    """max |s - s64| / max |s64| and ||s - s64|| / ||s64|| over the finite entries of the sampled rows."""
    ref = indexer_score_ref(q[rows], k, w[rows], ks[rows], ke[rows], compute_dtype=torch.float64)
    fin = torch.isfinite(ref)
    d, r = (scores[rows].double() - ref)[fin], ref[fin]
    ok = bool(torch.equal(torch.isfinite(scores[rows]), fin))
    return dict(max_rel=(d.abs().max() / r.abs().max()).item(), rms_rel=(d.norm() / r.norm()).item(), inf_ok=ok)


def fp8_peak(s: Shape) -> float:
    """Dense FP8 TFLOP/s of torch._scaled_mm at 8192^3 (e4m3, bf16 out); nan where unavailable."""
    try:
        m = 8192
        a = torch.randn(m, m, device=s.dev).to(torch.float8_e4m3fn)
        b = torch.randn(m, m, device=s.dev).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=s.dev)
        ms = s.timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        return 2 * m**3 / ms / 1e9
    except Exception as e:  # report, keep going
        common.say(f"  fp8 peak: {type(e).__name__}: {str(e)[:120]}")
        return float("nan")


def bench_fp8(res: dict, s: Shape, ks, ke, flops, flops_causal, rows) -> None:
    """The FP8 path beside the bf16 kernel on the same fq4 inputs (see the module doc)."""
    pk8 = fp8_peak(s) if s.dev == "cuda" else float("nan")
    pk16 = res["peaks"]["bf16_tflops"]
    out = res["fp8"] = dict(fp8_peak_tflops=pk8, quoted_peaks=QUOTED_PEAKS, configs={})
    common.say(f"\nFP8 score on fq4 q/k (TFLOP/s over the full N; % of the fp8 peak measured now {pk8:.0f} / quoted "
               f"{QUOTED_PEAKS['fp8']:.0f}, and of bf16 {pk16:.0f} / quoted {QUOTED_PEAKS['bf16']:.0f})")
    q = fq4_ue8m0(torch.randn(s.T, s.H, s.D, device=s.dev), 32).bfloat16()
    k = fq4_ue8m0(torch.randn(s.N, s.D, device=s.dev), 32).bfloat16()
    w = torch.randn(s.T, s.H, device=s.dev) * (s.D**-0.5 * s.H**-0.5)

    def line(name, ms, errs, note=""):
        tf = flops / ms / 1e9
        common.say(f"  {name:<34} {ms:8.3f} ms {tf:7.1f} TFLOP/s {100 * tf / QUOTED_PEAKS['fp8']:5.1f}% fp8 "
                   f"{100 * tf / QUOTED_PEAKS['bf16']:5.1f}% bf16 | err max {errs.get('max_rel', float('nan')):.2e} "
                   f"rms {errs.get('rms_rel', float('nan')):.2e} {note}")
        return dict(ms=ms, tflops=tf, tflops_causal=flops_causal / ms / 1e9, pct_fp8_quoted=100 * tf /
                    QUOTED_PEAKS["fp8"], pct_bf16_quoted=100 * tf / QUOTED_PEAKS["bf16"], **errs)

    nat, _ = _launch_score(q, k, w, ks, ke, torch.float32, False)
    ms = s.timed(lambda: _launch_score(q, k, w, ks, ke, torch.float32, False))
    out["bf16_kernel"] = line("bf16 kernel (default)", ms, rel_errs(nat, q, k, w, ks, ke, rows))
    del nat
    s.free()
    for name, cfg in FP8_CONFIGS.items():
        info: dict = {}
        try:
            s8, _ = _launch_score_fp8(q, k, w, ks, ke, torch.float32, False, info=info, **cfg)
            errs = rel_errs(s8, q, k, w, ks, ke, rows)
            del s8
            ms = s.timed(lambda: _launch_score_fp8(q, k, w, ks, ke, torch.float32, False, **cfg))
            rec = line(name, ms, errs, f"regs {info.get('n_regs')} spills {info.get('n_spills')} "
                       f"smem {info.get('shared')}")
            rec.update(info, config=cfg)
        except Exception as e:
            rec = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
            common.say(f"  {name:<34} FAILED {rec['error']}")
        out["configs"][name] = rec
        s.free()
    good = {n: r for n, r in out["configs"].items() if "ms" in r and r.get("inf_ok")}
    if good:
        best = min(good, key=lambda n: good[n]["ms"])
        out.update(best=best, best_ms=good[best]["ms"], best_tflops=good[best]["tflops"],
                   speedup_vs_bf16_kernel=out["bf16_kernel"]["ms"] / good[best]["ms"])
    # GPU time of the launches alone (CUDA graph replay: no Python / dispatch time), and the chunk maxima the fused
    # top-k needs (pass B's call): the bf16 kernel's, the FP8 kernel's per quarter block (default) and per block
    q2 = q.view(s.T * s.H, s.D)
    g = out["graph_ms"] = {}
    for name, fn in (
            ("bf16 kernel", lambda: _launch_score(q, k, w, ks, ke, torch.float32, False)),
            ("bf16 kernel + chunk maxima", lambda: _launch_score(q, k, w, ks, ke, torch.float32, True)),
            ("fp8 default", lambda: _launch_score_fp8(q, k, w, ks, ke, torch.float32, False)),
            ("fp8 default + chunk maxima", lambda: _launch_score_fp8(q, k, w, ks, ke, torch.float32, True)),
            ("fp8 + chunk maxima, cmax_split 1",
             lambda: _launch_score_fp8(q, k, w, ks, ke, torch.float32, True, cmax_split=1)),
            ("fp8 default, no fixup launch", lambda: _launch_score_fp8(q, k, w, ks, ke, torch.float32, False,
                                                                        fixup=False)),
            ("rebase q (groups of 4 H rows)", lambda: rebase_e4m3(q2, 4 * s.H)),
            ("rebase k (groups of 64 rows)", lambda: rebase_e4m3(k, 64))):
        replay(s, g, name, fn, flops)
    if isinstance(g.get("bf16 kernel + chunk maxima"), float) and isinstance(g.get("fp8 default + chunk maxima"),
                                                                           float):
        out["speedup_with_cmax_graph"] = g["bf16 kernel + chunk maxima"] / g["fp8 default + chunk maxima"]
    # pass B's whole call (scores + top-512), graph replay: the fused bound (chunk maxima from the score kernel)
    # against the top-k's own bound kernel on scores written without maxima
    sc8, cm8 = _launch_score_fp8(q, k, w, ks, ke, torch.float32, True)
    topk, bn8 = torch.ops.minidi.topk_indices, default_fp8_config(s.H)["BN"]
    e2e = out["topk_graph_ms"] = {}
    for name, fn in (
            ("top-512, fused bound", lambda: topk(sc8, s.K, ks, ke, cm8, bn8)),
            ("top-512, own bound", lambda: topk(sc8, s.K, ks, ke, None, 0)),
            ("indexer_topk native", lambda: indexer_topk(q, k, w, ks, ke, s.K)),
            ("indexer_topk fp8", lambda: indexer_topk(q, k, w, ks, ke, s.K, mma="fp8"))):
        replay(s, e2e, name, fn)
    i8, _ = indexer_topk(q, k, w, ks, ke, s.K, mma="fp8")
    i16, _ = indexer_topk(q, k, w, ks, ke, s.K)
    out["topk_overlap_fp8_vs_native"] = s.overlap(i8, i16, s.N)
    common.say(f"  top-{s.K} picks fp8 vs native: overlap {out['topk_overlap_fp8_vs_native']:.6f}")
    sc8 = cm8 = i8 = i16 = None
    s.free()
    # 0.1 % of key rows inexact (a block 2^20 below the rest): their key blocks run the bf16 dot
    bad = torch.randperm(s.N, device=s.dev)[: s.N // 1000]
    kb = k.clone()
    kb[bad, :32] *= 2.0**-20
    s8, _ = _launch_score_fp8(q, kb, w, ks, ke, torch.float32, False)
    errs = rel_errs(s8, q, kb, w, ks, ke, rows)
    del s8
    ms = s.timed(lambda: _launch_score_fp8(q, kb, w, ks, ke, torch.float32, False))
    n_blocks = torch.zeros(s.N // 64, dtype=torch.bool, device=s.dev).index_fill_(0, bad // 64, True).sum().item()
    out["inexact_0p1pct"] = line("fp8, 0.1% key rows inexact", ms, errs, f"({n_blocks} of {s.N // 64} key blocks)")
    s.free()
    # accumulation: fq4 inputs whose blocks span up to 2^12 (still exact as e4m3 * 2^s), so the products of a row
    # span ~2^19: the FP8 MMA's reduced-precision adds show here (Triton's promotion every 64 / 32 of D beside it)
    common.say("  wide block-scale spread (blocks x 2^U{0..12} before fq4): error vs float64")
    qw = fq4_ue8m0(torch.randn(s.T, s.H, s.D, device=s.dev)
                   * 2.0 ** torch.randint(0, 13, (s.T, s.H, s.D // 32, 1), device=s.dev)
                   .repeat_interleave(32, 2).squeeze(-1).float(), 32).bfloat16()
    kw = fq4_ue8m0(torch.randn(s.N, s.D, device=s.dev)
                   * 2.0 ** torch.randint(0, 13, (s.N, s.D // 32, 1), device=s.dev)
                   .repeat_interleave(32, 1).squeeze(-1).float(), 32).bfloat16()
    wide = out["wide_spread"] = dict(q_rows_exact=rebase_e4m3(qw.view(s.T * s.H, s.D))[2].float().mean().item(),
                                     k_rows_exact=rebase_e4m3(kw)[2].float().mean().item())
    s16, _ = _launch_score(qw, kw, w, ks, ke, torch.float32, False)
    wide["bf16 kernel"] = rel_errs(s16, qw, kw, w, ks, ke, rows)
    del s16
    for name, p in (("fp8", 0), ("fp8 promote64", 64), ("fp8 promote32", 32)):
        s8, _ = _launch_score_fp8(qw, kw, w, ks, ke, torch.float32, False, promote=p)
        wide[name] = rel_errs(s8, qw, kw, w, ks, ke, rows)
        del s8
    for name in ("bf16 kernel", "fp8", "fp8 promote64", "fp8 promote32"):
        common.say(f"    {name:<16} max {wide[name]['max_rel']:.2e} rms {wide[name]['rms_rel']:.2e}")
    common.say(f"    rows exact as e4m3 * 2^s: q {wide['q_rows_exact']:.4f} k {wide['k_rows_exact']:.4f}")
    s.free()


def bench_fp8_e2e(res: dict, s: Shape, ks, ke) -> None:
    """Pass B's call, ``indexer_topk`` (scores + top-512), native vs mma="fp8", graph replay, on fq4 inputs."""
    q = fq4_ue8m0(torch.randn(s.T, s.H, s.D, device=s.dev), 32).bfloat16()
    k = fq4_ue8m0(torch.randn(s.N, s.D, device=s.dev), 32).bfloat16()
    w = torch.randn(s.T, s.H, device=s.dev) * (s.D**-0.5 * s.H**-0.5)
    out = res["fp8_e2e"] = {}
    common.say(f"\nindexer_topk (scores + top-{s.K}) on fq4 q/k, graph replay")
    for name, mma in (("indexer_topk native", "native"), ("indexer_topk fp8", "fp8")):
        out[name] = timed_graph(s, lambda: indexer_topk(q, k, w, ks, ke, s.K, mma=mma))
        common.say(f"  {name:<34} {out[name]:8.3f} ms")
    i8, s8 = indexer_topk(q, k, w, ks, ke, s.K, mma="fp8")
    i16, s16 = indexer_topk(q, k, w, ks, ke, s.K)
    out["speedup"] = out["indexer_topk native"] / out["indexer_topk fp8"]
    out["picks_equal"] = bool(torch.equal(i8, i16))
    out["scores_max_abs_diff"] = (s8 - s16).nan_to_num(0, 0, 0).abs().max().item()
    common.say(f"  speed-up {out['speedup']:.2f}x | picks equal {out['picks_equal']} | scores max |diff| "
               f"{out['scores_max_abs_diff']:.2e}")


def replay(s: Shape, table: dict, name: str, fn, flops: float | None = None) -> None:
    """table[name] = ``timed_graph(s, fn)`` and a line (with TFLOP/s for ``flops``), or the error if it fails."""
    try:
        table[name] = timed_graph(s, fn)
        rate = f" {flops / table[name] / 1e9:7.1f} TFLOP/s" if flops else ""
        common.say(f"  graph replay: {name:<34} {table[name]:8.3f} ms{rate}")
    except Exception as e:  # report, keep going
        table[name] = f"{type(e).__name__}: {str(e)[:200]}"
        common.say(f"  graph replay: {name:<34} FAILED {table[name]}")


def timed_graph(s: Shape, fn) -> float:
    """Median ms of CUDA graph replays (triton's do_bench_cudagraph); the wall clock of one call on the CPU."""
    if s.dev == "cpu":
        return s.timed(fn)
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
