"""Benchmark of op B (lightning-indexer scores + top-512) at the V4.1-Flash prefill shape on one H200.

Shape: T 4,096 new tokens, H 32 index heads, D 128, N 131,072 keys (bf16 q/k, fp32 w), causal visibility after a
126,976-key prefix: k_end[t] = 126,976 + t + 1. FLOPs = 2 T H D N = 4.40 T counted over the full N (the
causal-effective count, over the visible keys only, is printed beside it). Top-512 of the [T, N] scores.

Paths: the plain path chunked over queries (einsum + relu + mul + sum + mask, 256 queries per chunk) eager and under
stock torch.compile (no minidi passes); torch.topk on the fp32 and bf16 scores; minidi's kernels at their default
config and a small sweep of configs (so one run tells what to change). Correctness at the bench shape is checked
before timing: scores vs float64 on sampled rows (and the bf16 plain path's error on the same rows), top-512 set
overlap vs torch.topk on the same scores, fused top-k vs standalone.

FP8 part (``--only fp8``, in ``indexer_fp8_cases.py``): fq4 q / k (the model's fake quant: ``fq4_ue8m0(randn, 32)``),
the bf16 kernel and the FP8 kernel (``mma="fp8"``: rebase to e4m3 + one power of two per row, FP8 MMA, fixup of
inexact tiles) in the same run, each with its error vs float64 on sampled rows; configs, Triton's fp8 accumulation
promotion (``promote``), the rebase / fixup costs, and a run with 0.1 % of the key rows made inexact (the fallback's
cost). % of peak against the FP8 dense peak measured here with ``torch._scaled_mm`` (quoted 1,438) and the bf16 one
(quoted 785). ``--only fp8e2e``: pass B's whole call, native vs FP8. ``--only cand`` (``indexer_candidate_cases.py``):
a V4.1 re-index layer, B's dense FP8 path on the candidate mask beside pass M's candidate-only op. ``--only src``
(``indexer_source_cases.py``): the candidate source's block selection, the model's chain beside pass T's op.

``--keys N`` sets the number of keys (the prefix then ends T keys before N): 32,768 is V4-Flash's ratio-4 layers, whose
top-k takes its own chunk maxima (at N / 64 = K blocks the score kernel's are no bound).

Usage: python bench/bench_indexer.py [--out PATH] [--no-compile] [--only score,topk,fp8,fp8e2e,cand,src] [--keys N]
Prints a card, tables, and as the LAST line one JSON object.
"""

from __future__ import annotations

import argparse
import time

import torch

from minidi.ops.indexer_score import (
    _launch_score,
    default_score_config,
    indexer_score_ref,
)
from minidi.ops.topk import _launch_topk

if __package__:  # python -m bench.bench_indexer, the tests
    from . import common
    from . import indexer_candidate_cases as cand_cases
    from . import indexer_fp8_cases as fp8_cases
    from . import indexer_source_cases as src_cases
else:  # python bench/bench_indexer.py: the script's folder is sys.path[0]
    import common
    import indexer_candidate_cases as cand_cases
    import indexer_fp8_cases as fp8_cases
    import indexer_source_cases as src_cases

T, H, D, N, K, PREFIX = 4096, 32, 128, 131072, 512, 126976
DEV = "cuda"
SMOKE_TOPK = {}  # per-config overrides in --smoke mode (tiny rows on the CPU interpreter)
SCORE_CONFIGS = {  # name: (BN, QB, num_warps, num_stages, blocks_per_prog)
    "default 64x128 w4 s3": dict(BN=64, QB=4, num_warps=4, num_stages=3, blocks_per_prog=128),
    "64x128 w4 s2": dict(BN=64, QB=4, num_warps=4, num_stages=2, blocks_per_prog=128),
    "64x128 w4 s3 bpp512": dict(BN=64, QB=4, num_warps=4, num_stages=3, blocks_per_prog=512),
    "128x128 w4 s2": dict(BN=128, QB=4, num_warps=4, num_stages=2, blocks_per_prog=64),
    "128x128 w8 s3": dict(BN=128, QB=4, num_warps=8, num_stages=3, blocks_per_prog=64),
    "64x256 w4 s2": dict(BN=64, QB=8, num_warps=4, num_stages=2, blocks_per_prog=128),
    "128x256 w8 s2": dict(BN=128, QB=8, num_warps=8, num_stages=2, blocks_per_prog=64),
    "256x128 w8 s2": dict(BN=256, QB=4, num_warps=8, num_stages=2, blocks_per_prog=32),
}
TOPK_CONFIGS = {  # NS chunks per row (CH = N / NS columns each), TILE columns per compaction step, warps; "default":
    # ``default_topk_config`` at this N (rows with their own bound)
    "default": dict(),
    "NS2048 tile2048 w8": dict(NS=2048, TILE=2048, num_warps=8),  # every row's default before round 35 (K 512)
    "tile4096 w8": dict(TILE=4096, num_warps=8),
    "tile2048 w8": dict(TILE=2048, num_warps=8),
    "tile2048 w4": dict(TILE=2048, num_warps=4),
    "NS1024 tile1024 w4": dict(NS=1024, TILE=1024, num_warps=4),
    "NS2048 tile1024 w4": dict(NS=2048, TILE=1024, num_warps=4),
    "NS4096 tile1024 w4": dict(NS=4096, TILE=1024, num_warps=4),
    "NS8192 tile1024 w4": dict(NS=8192, TILE=1024, num_warps=4),
}


def timed(fn, rep: int = 100) -> float:
    """Median ms with triton's do_bench (L2 flushed between runs); one wall-clock run in --smoke mode."""
    return common.op_ms(fn, DEV, do_bench_ms=(10, rep))


def timed_slow(fn, n: int = 3) -> float:
    """Median ms of n runs after one warm-up, CUDA events (for the 20-200 ms plain paths); one run in --smoke."""
    if DEV == "cpu":
        return timed(fn)
    return common.median_ms(fn, DEV, warmup=1, repeats=n, flush_l2=False)


def free() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def plain_chunk(q, k, w, ks, ke):
    """The naive path on one query chunk: bf16 einsum, relu * w, head sum, visibility mask."""
    s = torch.einsum("thd,nd->thn", q, k)  # [c, H, N]
    s = (s.relu() * w.to(q.dtype).unsqueeze(-1)).sum(dim=1)  # [c, N]
    j = torch.arange(k.shape[0], device=q.device)
    return s.masked_fill((j < ks[:, None]) | (j >= ke[:, None]), float("-inf"))


def plain_scores(fn, q, k, w, ks, ke, chunk=256):
    return torch.cat([fn(q[a:a + chunk], k, w[a:a + chunk], ks[a:a + chunk], ke[a:a + chunk])
                      for a in range(0, q.shape[0], chunk)])


def overlap(idx: torch.Tensor, ref: torch.Tensor, n: int) -> float:
    """Mean fraction of ref's valid picks that idx also picks (rows chunked to bound memory)."""
    hits, tot = 0, 0
    for a in range(0, idx.shape[0], 512):
        r, i = ref[a:a + 512], idx[a:a + 512]
        m = torch.zeros(r.shape[0], n + 1, dtype=torch.bool, device=r.device)
        m.scatter_(1, torch.where(r >= 0, r, n), True)
        m[:, n] = False
        hits += m.gather(1, torch.where(i >= 0, i, n)).sum().item()
        tot += (r >= 0).sum().item()
    return hits / max(tot, 1)


def err_vs_f64(scores, q, k, w, ks, ke, rows) -> float:
    """max |s - s64| / max |s64| over the finite entries of the sampled rows."""
    ref = indexer_score_ref(q[rows], k, w[rows], ks[rows], ke[rows], compute_dtype=torch.float64)
    fin = torch.isfinite(ref)
    return ((scores[rows].double() - ref)[fin].abs().max() / ref[fin].abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip stock torch.compile of the plain path")
    ap.add_argument("--only", default="score,topk,fp8")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    ap.add_argument("--keys", type=int, default=None, help="keys N (default 131,072; the prefix ends T keys before N)")
    args = ap.parse_args()
    global T, H, D, N, K, PREFIX, DEV
    if args.keys is not None:
        if args.keys <= T:
            raise SystemExit(f"--keys must exceed the {T} queries (the prefix ends T keys before N), got {args.keys}")
        N, PREFIX = args.keys, args.keys - T
    if args.smoke:
        T, H, D, N, K, PREFIX, DEV = 64, 8, 32, 2048, 16, 1900, "cpu"
        SMOKE_TOPK.update(NS=64, CAP=128, TILE=64)
        args.no_compile = True
        for c in SCORE_CONFIGS.values():
            c.update(QB=c["QB"] * 4, blocks_per_prog=8)  # H 8: same QB*H rows as H 32
        for name in list(fp8_cases.FP8_CONFIGS)[1:]:
            del fp8_cases.FP8_CONFIGS[name]
    parts = set(args.only.split(","))
    t_start = time.time()
    torch.manual_seed(0)
    dev = common.device_name(DEV) if DEV == "cuda" else "cpu (interpreter smoke)"
    peaks = common.measure_peaks(DEV)
    free()
    flops = 2 * T * H * D * N
    ke = PREFIX + torch.arange(T, device=DEV) + 1
    ks = torch.zeros(T, dtype=torch.long, device=DEV)
    flops_causal = 2 * H * D * ke.sum().item()
    q = torch.randn(T, H, D, device=DEV).bfloat16()
    k = torch.randn(N, D, device=DEV).bfloat16()
    w = torch.randn(T, H, device=DEV) * (D**-0.5 * H**-0.5)
    rows = torch.tensor([0, 1, T // 5, T // 2, T - 1], device=DEV)
    common.say(f"device: {dev} | bf16 GEMM {peaks['bf16_tflops']:.0f} TFLOP/s | copy {peaks['copy_gbps']:.0f} GB/s")
    common.say(f"shape: T {T} H {H} D {D} N {N} bf16 q/k fp32 w | k_end = {PREFIX} + t + 1 | {flops / 1e12:.2f} TFLOP "
               f"(causal-effective {flops_causal / 1e12:.2f}) | top-{K}")
    res = dict(op="indexer", device=dev, peaks=peaks, shape=dict(T=T, H=H, D=D, N=N, K=K, prefix=PREFIX),
               tflop=flops / 1e12, tflop_causal=flops_causal / 1e12, checks={}, score={}, topk={})
    pk = peaks["bf16_tflops"]

    def row(name, ms, work, unit, base=None, note=""):
        """work: FLOPs (unit TFLOP/s) or bytes (unit GB/s); base: ms of the path to compare with."""
        rate, pct = common.rate(ms, work, unit, peaks)
        sp = f"{base / ms:7.2f}x" if base else "        "
        common.say(f"  {name:<34} {ms:9.3f} ms {rate:9.1f} {unit:<8} {pct:5.1f}% {sp}  {note}")

    shape = fp8_cases.Shape(T, H, D, N, K, DEV, timed, free, overlap)
    if "fp8" in parts:
        fp8_cases.bench_fp8(res, shape, ks, ke, flops, flops_causal, rows)
    if "fp8e2e" in parts:
        fp8_cases.bench_fp8_e2e(res, shape, ks, ke)
    if "cand" in parts:
        cand_cases.bench_candidates(res, shape, ks, ke, smoke=args.smoke)
    if "src" in parts:
        src_cases.bench_candidate_source(res, shape, ks, ke, peaks, args.no_compile, smoke=args.smoke)
    if not parts & {"score", "topk"}:  # the FP8 / candidate parts alone
        res["wall_s"] = time.time() - t_start
        common.emit_json(res, out=args.out)
        return

    # ------------------------------------------------------------------------------------------------ scores
    scores, cmax = _launch_score(q, k, w, ks, ke, torch.float32, True)
    cmax_chunk = default_score_config(H, q.dtype)["BN"]
    if "score" in parts:
        common.say("\nscore [T, N] fp32 (TFLOP/s over the full N; % of the measured bf16 peak; speed-up vs compiled "
                   "plain)")
        e_ours = err_vs_f64(scores, q, k, w, ks, ke, rows)
        plain = plain_scores(plain_chunk, q, k, w, ks, ke)
        e_plain = err_vs_f64(plain, q, k, w, ks, ke, rows)
        res["checks"].update(score_rel_err=e_ours, plain_bf16_rel_err=e_plain, score_ok=e_ours <= e_plain,
                             inf_pattern_ok=bool(torch.equal(torch.isinf(scores), torch.isinf(plain))))
        common.say(f"  check: max rel err vs float64 ours {e_ours:.2e} | plain bf16 path {e_plain:.2e} | "
                   f"-inf pattern equal: {res['checks']['inf_pattern_ok']}")
        del plain
        free()
        ms_eager = timed_slow(lambda: plain_scores(plain_chunk, q, k, w, ks, ke))
        res["score"]["plain_eager_ms"] = ms_eager
        ms_comp = float("nan")
        if not args.no_compile:
            try:
                comp = torch.compile(plain_chunk)
                tc = time.time()
                plain_scores(comp, q, k, w, ks, ke)
                res["score"]["compile_s"] = time.time() - tc
                ms_comp = timed_slow(lambda: plain_scores(comp, q, k, w, ks, ke))
            except Exception as e:  # report, keep going
                common.say(f"  torch.compile failed: {type(e).__name__}: {str(e)[:200]}")
        res["score"]["plain_compiled_ms"] = ms_comp
        free()
        row("plain eager (chunk 256)", ms_eager, flops, "TFLOP/s", ms_comp)
        row("plain torch.compile (chunk 256)", ms_comp, flops, "TFLOP/s", ms_comp)
        res["score"]["configs"] = {}
        for name, cfg in SCORE_CONFIGS.items():
            info: dict = {}
            try:
                out, _ = _launch_score(q, k, w, ks, ke, torch.float32, False, info=info, **cfg)
                ok = bool(torch.equal(torch.isinf(out), torch.isinf(scores))) and bool(
                    (out - scores).nan_to_num().abs().max() <= 1e-5 * scores.nan_to_num(0, 0, 0).abs().max())
                ms = timed(lambda: _launch_score(q, k, w, ks, ke, torch.float32, False, **cfg))
                rec = dict(ms=ms, tflops=flops / ms / 1e9, tflops_causal=flops_causal / ms / 1e9, ok=ok, **info,
                           config=cfg)
                row(name, ms, flops, "TFLOP/s", ms_comp,
                    f"ok={ok} regs {info.get('n_regs')} spills {info.get('n_spills')} smem {info.get('shared')}")
            except Exception as e:
                rec = dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])
                common.say(f"  {name:<34} FAILED {rec['error']}")
            res["score"]["configs"][name] = rec
            free()
        for name, extra in (("default + chunk maxima (fused top-k)", dict(want_cmax=True)),
                            ("default, bf16 output", dict(out_dtype=torch.bfloat16))):
            a = {**dict(out_dtype=torch.float32, want_cmax=False), **extra}
            ms = timed(lambda: _launch_score(q, k, w, ks, ke, a["out_dtype"], a["want_cmax"]))
            res["score"][name] = ms
            row(name, ms, flops, "TFLOP/s", ms_comp)
        good = {n: r for n, r in res["score"]["configs"].items() if r.get("ok")}
        if good:
            best = min(good, key=lambda n: good[n]["ms"])
            res["score"].update(best=best, best_ms=good[best]["ms"], best_tflops=good[best]["tflops"],
                                best_tflops_causal=good[best]["tflops_causal"],
                                best_pct_peak=100 * good[best]["tflops"] / pk, speedup_vs_compiled=ms_comp /
                                good[best]["ms"], speedup_vs_eager=ms_eager / good[best]["ms"])

    # ------------------------------------------------------------------------------------------------ top-k
    if "topk" in parts:
        sbytes = T * N * 4
        common.say(f"\ntop-{K} of [T, N] (GB/s = one read of the fp32 scores / time; % of the measured copy bandwidth)")
        ref = torch.topk(scores, K, dim=1).indices
        ref = torch.where(torch.gather(scores, 1, ref) > float("-inf"), ref, -1)
        ms_t32 = timed(lambda: torch.topk(scores, K, dim=1))
        s16 = scores.bfloat16()
        ms_t16 = timed(lambda: torch.topk(s16, K, dim=1))
        res["topk"].update(torch_fp32_ms=ms_t32, torch_bf16_ms=ms_t16)
        v16 = torch.topk(s16, K, dim=1).values[:, -1:]
        res["topk"]["bf16_ties_at_kth"] = (s16 == v16).sum(1).float().mean().item()
        ties32 = (scores == torch.topk(scores, K, dim=1).values[:, -1:]).sum(1).float().mean().item()
        common.say(f"  scores sharing the {K}th value: bf16 {res['topk']['bf16_ties_at_kth']:.1f} per row "
                   f"(fp32: {ties32:.2f})")
        row("torch.topk fp32", ms_t32, sbytes, "GB/s", ms_t32)
        row("torch.topk bf16", ms_t16, sbytes / 2, "GB/s", ms_t32)
        # how tight the bound is: chunks of 64 (NS 2048 at this N, and the score kernel's key block)
        for ch in (c for c in (32, 64, 128) if N // c >= K):  # a bound needs K chunks
            cm_ = scores.view(T, -1, ch).amax(2)  # [T, N / ch]
            lb = cm_.topk(K, dim=1).values[:, -1:]
            cnt = (scores >= lb).sum(1).float()
            act = (cm_ >= lb).sum(1).float()
            res["topk"][f"bound_chunk{ch}"] = dict(cand_mean=cnt.mean().item(), cand_max=cnt.max().item(),
                                                   active_chunks_mean=act.mean().item())
            common.say(f"  bound, chunks of {ch:>3}: candidates per row mean {cnt.mean().item():.0f} max "
                       f"{cnt.max().item():.0f} (CAP 4096) | active chunks {act.mean().item():.0f} of {N // ch}")
        res["topk"]["configs"] = {}
        variants = [(n, {**c, **SMOKE_TOPK}, scores, None, 0) for n, c in TOPK_CONFIGS.items()]
        variants += [("fused bound (chunk maxima from score)", dict(SMOKE_TOPK), scores, cmax, cmax_chunk),
                     ("bf16 scores", dict(SMOKE_TOPK), s16, None, 0)]
        for name, cfg, s_in, cm, cc in variants:
            info = {}
            try:
                idx = _launch_topk(s_in, K, None, ke, cm, cc, info=info, **cfg)
                ov = overlap(idx, ref, N)
                ms = timed(lambda: _launch_topk(s_in, K, None, ke, cm, cc, **cfg))
                nb = sbytes / (2 if s_in.dtype == torch.bfloat16 else 1)
                rec = dict(ms=ms, overlap=ov, gbs=nb / ms / 1e6, **info, config=cfg)
                row(name, ms, nb, "GB/s", ms_t32, f"overlap {ov:.4f} regs {info.get('n_regs')} "
                    f"spills {info.get('n_spills')} bound {info.get('bound')}")
            except Exception as e:
                rec = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])
                common.say(f"  {name:<34} FAILED {rec['error']}")
            res["topk"]["configs"][name] = rec
        d = res["topk"]["configs"].get("default", {})
        res["checks"]["topk_overlap"] = d.get("overlap")
        f = res["topk"]["configs"].get("fused bound (chunk maxima from score)", {})
        good = {n: r for n, r in res["topk"]["configs"].items() if r.get("overlap", 0) >= 0.99 and n != "bf16 scores"}
        if good:
            best = min(good, key=lambda n: good[n]["ms"])
            res["topk"].update(best=best, best_ms=good[best]["ms"], speedup_vs_torch=ms_t32 / good[best]["ms"])
        if "ms" in f and res["score"].get("default + chunk maxima (fused top-k)"):
            e2e = res["score"]["default + chunk maxima (fused top-k)"] + f["ms"]
            plain_e2e = res["score"].get("plain_compiled_ms", float("nan")) + ms_t32
            res["indexer_topk_ms"] = e2e
            res["plain_compiled_plus_torch_topk_ms"] = plain_e2e
            common.say(f"  indexer_topk (score + chunk maxima, fused-bound top-k): {e2e:.2f} ms vs plain compiled + "
                       f"torch.topk {plain_e2e:.2f} ms ({plain_e2e / e2e:.2f}x)")
        del s16

    res["wall_s"] = time.time() - t_start
    common.say(f"\nchecks: {res['checks']} | wall {res['wall_s']:.0f} s")
    common.emit_json(res, out=args.out)


if __name__ == "__main__":
    main()
