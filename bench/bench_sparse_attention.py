"""Benchmark minidi::sparse_attention (pass target A) at the V4.1-Flash compressed-layer shape, on one GPU.

Shape (ROOFLINE.md): T 4,096 new tokens, H 64, D 512, bf16; window_kv of Nw = 4,096 + 127 rows (the previous 127
positions + this step's tokens), window_idx = the previous 128 positions of each token; comp_kv of Nc = 65,536 rows
(the ratio-2 cache at 128K context), comp_idx = 512 distinct sorted picks per query below the causal bound, drawn as
a random walk in which each query replaces ``--churn`` picks of its predecessor (neighbours share most picks).
FLOPs = 4 T H (W+K) D (QK^T + PV) = 343.6 GFLOP.

Times, in one run, with ``triton.testing.do_bench`` (median): the plain path (``sparse_attention_naive``) eager and
under stock ``torch.compile`` (no minidi passes), then each kernel variant (after checking it against the plain
path's output), plus the default variant on independent random picks (no reuse between neighbours: the L2 worst
case). Measures the device's bf16 GEMM and copy peaks in the same run. Prints a card, a table and, as the last line,
one JSON object (``--out PATH`` writes it too).

    python bench/bench_sparse_attention.py [--out results.json] [--variants a,b] [--churn 32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import minidi
from minidi.model.layers import apply_rope, rms_norm
from minidi.model.sparse_attention import sparse_attention_naive
from minidi.ops.sparse_attention import ROPE_OUT, ROPE_Q, encode_slots, launch

if __package__:  # python -m bench.bench_sparse_attention, the tests
    from . import common
else:  # python bench/bench_sparse_attention.py: the script's folder is sys.path[0]
    import common

# name -> launch config (BLOCK_H is 64 at H = 64). See docs/ops/sparse_attention.md for what each one trades.
VARIANTS = {
    "tok_w8_bk64_s2": dict(impl="triton", nsplit=1, num_warps=8, BLOCK_K=64, num_stages=2),  # the Triton default
    "tok_w8_bk64_s3": dict(impl="triton", nsplit=1, num_warps=8, BLOCK_K=64, num_stages=3),
    "tok_w8_bk32_s3": dict(impl="triton", nsplit=1, num_warps=8, BLOCK_K=32, num_stages=3),
    "tok_w8_bk64_s3_persist": dict(impl="triton", nsplit=1, num_warps=8, BLOCK_K=64, num_stages=3, persistent=True),
    "split2_w4_bk64_s3": dict(impl="triton", nsplit=2, num_warps=4, BLOCK_K=64, num_stages=3),
    "split2_w4_bk64_s2": dict(impl="triton", nsplit=2, num_warps=4, BLOCK_K=64, num_stages=2),
    "split2_w4_bk32_s3": dict(impl="triton", nsplit=2, num_warps=4, BLOCK_K=32, num_stages=3),
    "sm90_ws": dict(impl="gluon"),  # the warp-specialised Gluon kernel (minidi/ops/sparse_attention_sm90.py)
    "sm90_ws_nopad": dict(impl="gluon", xpad=False),  # score exchange without padded rows (8-way bank conflicts)
    "sm90_ws_pipe": dict(impl="gluon", pipe=True, c_regs=224, p_regs=56),  # Q K^T(i+1) overlapping softmax(i)
    "sm90_split": dict(impl="gluon_split"),  # FlashMLA's split (minidi/ops/sparse_attention_sm90_split.py)
    "sm90_split_r216": dict(impl="gluon_split", c_regs=216, p_regs=72),  # sparse_attention_sm90's register split
    "sm90_split_pipe": dict(impl="gluon_split", pipe=True),  # next pair's Q K^T issued before this pair's softmax
    "sm90_split_pipe_r216": dict(impl="gluon_split", pipe=True, c_regs=216, p_regs=72),
    "sm90_split_hoisted": dict(impl="gluon_split", zq=False),  # round 19's build: Q descriptors hoisted, 28 spills
    "sm90_stagger": dict(impl="gluon_stagger"),  # staggered consumers, 64-key blocks, 2 stages released by D half,
    # one CTA per SM looping over the (token, head block) items, the producer copying each item's Q ahead
    # the output through shared memory + bulk tensor stores (the default since round 26)
    "sm90_stagger_stores": dict(impl="gluon_stagger", otma=False),  # ... or by 4-byte stores from the accumulators
    "sm90_stagger_qload": dict(impl="gluon_stagger", qasync=False),  # the consumers load Q at each item's start
    "sm90_stagger_grid": dict(impl="gluon_stagger", persistent=False, qasync=False),  # ... and one CTA per item
    "sm90_stagger_bk32": dict(impl="gluon_stagger", bk=32),  # 32-key blocks, 4 stages
    "sm90_stagger_qrope0": dict(impl="gluon_stagger", qrope=0, angles_ahead=False),  # q's rotation over Q's whole
    # half 1, by consumer 1, before either consumer's first Q K^T (the default until round 36)
    "sm90_stagger_qrope1": dict(impl="gluon_stagger", qrope=1, angles_ahead=False),  # q's rotation over its chunks
    # only, by consumer 1, consumer 0 issuing its first Q K^T over D half 0 before waiting for it (rounds 36-38)
    "sm90_stagger_qrope2": dict(impl="gluon_stagger", qrope=2, angles_ahead=False),  # ... by consumer 0, behind that
    # first Q K^T
    "sm90_stagger_qrope1_ang": dict(impl="gluon_stagger", qrope=1, angles_ahead=True),  # qrope1, consumer 1 pulling
    # the next item's cos / sin rows into L1 an item ahead (round 38; the default since round 39)
}
DEFAULT = "tok_w8_bk64_s2"  # the Triton kernel's default config
GLUON = "sm90_ws"
SPLIT = "sm90_split"
STAGGER = "sm90_stagger"
STAGGER_STORES = "sm90_stagger_stores"
QROPE = ("sm90_stagger_qrope0", "sm90_stagger_qrope1", "sm90_stagger_qrope2", "sm90_stagger_qrope1_ang")
TOL = dict(rtol=2**-7, atol=1e-3)  # one bf16 ulp at the output's scale (|out| ~ 0.1-0.5 here)


def bench_ms(fn) -> float:
    return common.op_ms(fn, "cuda", do_bench_ms=(10, 60))


def comp_picks(t: int, k: int, bound0: int, churn: int, seed: int) -> torch.Tensor:
    """[t, k] int64 sorted distinct picks; query i picks below bound0 + i // 2; each replaces ``churn`` of the last
    query's picks (churn >= k: independent picks)."""
    if churn >= k:  # independent picks (below the first query's bound), drawn on the GPU
        g = torch.Generator(device="cuda").manual_seed(seed)
        picks = torch.rand(t, bound0, device="cuda", generator=g).topk(k, dim=1).indices
        return picks.sort(dim=1).values.cpu()
    rng = np.random.default_rng(seed)
    out = np.empty((t, k), dtype=np.int64)
    cur = rng.choice(bound0, size=k, replace=False)
    for i in range(t):
        bound = bound0 + i // 2
        if i:
            taken = set(cur.tolist())
            drop = rng.choice(k, size=churn, replace=False)
            new = []
            while len(new) < churn:
                v = int(rng.integers(bound))
                if v not in taken:
                    taken.add(v)
                    new.append(v)
            cur = cur.copy()
            cur[drop] = new
        out[i] = np.sort(cur)
    return torch.from_numpy(out)


def make_inputs(t=4096, h=64, d=512, w=128, k=512, nc=65536, ctx=131072, churn=32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, h, d, device="cuda", generator=g).bfloat16()
    window_kv = torch.randn(t + w - 1, d, device="cuda", generator=g).bfloat16()  # [Nw, D]
    comp_kv = torch.randn(nc, d, device="cuda", generator=g).bfloat16()  # [Nc, D]
    window_idx = (torch.arange(t, device="cuda")[:, None] + torch.arange(w, device="cuda")[None, :])  # [T, W]
    bound0 = (ctx - t) // 2  # ratio-2 compressed rows visible to the first new token
    comp_idx = comp_picks(t, k, bound0, churn, seed).cuda()  # [T, K]
    sink = torch.randn(h, device="cuda", generator=g)
    return q, window_kv, window_idx, comp_kv, comp_idx, sink, d**-0.5


def picked_sweep(args, picks: list[int], t: int, h: int, d: int, w: int) -> dict:
    """Each variant's ms at several counts of picked keys and the least-squares line through them against the
    number of 128-key pairs: ``per_pair_ms`` (what scales with the keys) and ``fixed_ms`` (what does not: Q in, O out,
    the pipeline's fill and drain per item)."""
    out: dict = {}
    for k in picks:
        inputs = make_inputs(t, h, d, w, k, churn=args.churn)
        for name in [v for v in args.variants.split(",") if v]:
            cfg = VARIANTS[name]
            try:
                launch(*inputs, **cfg)
                torch.cuda.synchronize()
                out.setdefault(name, {"ms": {}})["ms"][k] = ms = bench_ms(lambda: launch(*inputs, **cfg))
                common.say(f"picked sweep: {name:<24} keys {w + k:5d} ({(w + k) / 128:.0f} pairs) {ms:.4f} ms")
            except Exception as e:  # reported, not fatal
                out.setdefault(name, {"ms": {}})["error"] = f"{type(e).__name__}: {e}"[:200]
        del inputs
        torch.cuda.empty_cache()
    for rec in out.values():
        if len(rec["ms"]) >= 2:
            pairs = np.array([(w + k) / 128 for k in rec["ms"]])
            slope, fixed = np.polyfit(pairs, np.array(list(rec["ms"].values())), 1)
            rec.update(per_pair_ms=float(slope), fixed_ms=float(fixed))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    ap.add_argument("--churn", type=int, default=32, help="compressed picks each query replaces vs its neighbour")
    ap.add_argument("--no-compile", action="store_true", help="skip stock torch.compile of the plain path")
    ap.add_argument("--no-rotations", action="store_true", help="skip the folded-rotation rows")
    ap.add_argument("--picked_sweep", default=None, metavar="K1,K2,...",
                    help="also time each variant at these counts of picked keys (with the 128 window keys) and fit "
                         "ms = per-pair x (128-key pairs) + fixed: what scales with the keys and what does not")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    dev = common.device_name("cuda")
    peaks = common.measure_peaks("cuda")
    T, H, D, W, K = 4096, 64, 512, 128, 512
    inputs = make_inputs(T, H, D, W, K, churn=args.churn)
    flops = 4 * T * H * (W + K) * D
    key_bytes = T * (W + K) * D * 2  # rows gathered once per token
    common.say(f"device: {dev} | bf16 GEMM {peaks['bf16_tflops']:.0f} TFLOP/s | copy {peaks['copy_gbps']:.0f} GB/s")
    common.say(f"shape: T {T} H {H} D {D} W {W} K {K} Nw {inputs[1].shape[0]} Nc {inputs[3].shape[0]} bf16 "
               f"| churn {args.churn} | {flops / 1e9:.1f} GFLOP | key rows {key_bytes / 1e9:.2f} GB")

    rows = []  # (name, ms, ok, err, extra)
    result = dict(op="sparse_attention", device=dev, peaks=peaks,
                  shape=dict(T=T, H=H, D=D, W=W, K=K, Nw=inputs[1].shape[0], Nc=inputs[3].shape[0], churn=args.churn),
                  gflop=flops / 1e9, variants={})

    ref = sparse_attention_naive(*inputs)
    ms_eager = bench_ms(lambda: sparse_attention_naive(*inputs))
    rows.append(("naive eager", ms_eager, True, 0.0, ""))
    result["naive_eager_ms"] = ms_eager
    if not args.no_compile:
        compiled = torch.compile(sparse_attention_naive)
        try:
            out = compiled(*inputs)
            err = (out.float() - ref.float()).abs().max().item()
            ms_c = bench_ms(lambda: compiled(*inputs))
            rows.append(("naive torch.compile", ms_c, True, err, ""))
            result["naive_compile_ms"] = ms_c
        except Exception as e:  # report, keep going
            rows.append(("naive torch.compile", float("nan"), False, float("nan"), f"{type(e).__name__}: {e}"[:200]))
        del compiled
    torch.cuda.empty_cache()

    for name in [v for v in args.variants.split(",") if v]:
        cfg = VARIANTS[name]
        info: dict = {}
        rec = dict(config=cfg)
        try:
            out = launch(*inputs, info=info, **cfg)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            ok = bool(torch.isclose(out.float(), ref.float(), **TOL).all())
            ms = bench_ms(lambda: launch(*inputs, **cfg))
            rec.update(ms=ms, tflops=flops / ms / 1e9, ok=ok, max_err=err,
                       **{k: info.get(k) for k in ("n_regs", "n_spills", "shared", "mma", "grid")})
            extra = f"regs {info.get('n_regs')} spills {info.get('n_spills')} smem {info.get('shared')}"
            rows.append((name, ms, ok, err, extra))
        except Exception as e:  # a variant that does not compile (e.g. out of shared memory) is reported, not fatal
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            rec.update(ok=False, error=msg)
            rows.append((name, float("nan"), False, float("nan"), msg))
        result["variants"][name] = rec
        torch.cuda.empty_cache()

    # the slot-encoding launch alone (part of every variant's time above)
    ms_enc = bench_ms(lambda: encode_slots(inputs[2], inputs[4], inputs[1].shape[0], inputs[3].shape[0]))
    rows.append(("  of which: encode_slots", ms_enc, True, 0.0, "int64 index lists -> int32 slot codes"))
    result["encode_slots_ms"] = ms_enc

    # the default on independent picks: no reuse between neighbouring queries (L2 worst case)
    indep = make_inputs(T, H, D, W, K, churn=K, seed=1)
    for vname in [v for v in (DEFAULT, GLUON, SPLIT, STAGGER, STAGGER_STORES) if v in args.variants.split(",")]:
        try:
            ms = bench_ms(lambda x=indep, c=VARIANTS[vname]: launch(*x, **c))
            rows.append((f"{vname} (independent picks)", ms, True, 0.0, "no neighbour reuse"))
            result.setdefault("independent_picks_ms", {})[vname] = ms
        except Exception as e:
            rows.append((f"{vname} (independent picks)", float("nan"), False, float("nan"), str(e)[:120]))
    del indep

    # the model's rotations around the attention (64 of 512 channels): folded into the kernel (pass A's rope_mode 3)
    # vs the kernel plus stock Inductor's two rotation kernels, as the step ran them before
    ang = torch.rand(T, 32, device="cuda") * 1000.0
    cos, sin = ang.cos(), ang.sin()
    q_raw = inputs[0]
    # compiled as the step compiles them (minidi.compile, no passes, faithful rounding: no FMA contraction)
    rot_q = minidi.compile(lambda x, c, s_: apply_rope(x, c, s_), "none", dynamic=False)
    rot_o = minidi.compile(lambda x, c, s_: apply_rope(x, c, s_, inverse=True), "none", dynamic=False)
    rot_names = [] if args.no_rotations else (DEFAULT, GLUON, SPLIT, STAGGER, STAGGER_STORES, *QROPE)
    for vname in [v for v in rot_names if v in args.variants.split(",")]:
        cfg = VARIANTS[vname]
        try:
            fused = launch(*inputs, rope_cos=cos, rope_sin=sin, rope_mode=ROPE_Q | ROPE_OUT, **cfg)
            unfused = rot_o(launch(rot_q(q_raw, cos, sin), *inputs[1:], **cfg), cos, sin)
            same = bool(torch.equal(fused, unfused))
            ms_mode = {}
            for mode, what in ((ROPE_Q, "q's rotation folded"), (ROPE_OUT, "output's rotation folded"),
                               (ROPE_Q | ROPE_OUT, "rotations folded")):
                info: dict = {}
                launch(*inputs, rope_cos=cos, rope_sin=sin, rope_mode=mode, info=info, **cfg)
                ms_mode[mode] = bench_ms(lambda m=mode: launch(*inputs, rope_cos=cos, rope_sin=sin, rope_mode=m, **cfg))
                note = f"rope_mode {mode}; regs {info.get('n_regs')} spills {info.get('n_spills')}"
                if mode == ROPE_Q | ROPE_OUT:
                    note += "; ok = bit-equal to unfused"
                rows.append((f"{vname} + {what}", ms_mode[mode], same if mode == 3 else True, 0.0, note))
            ms_u = bench_ms(lambda: rot_o(launch(rot_q(q_raw, cos, sin), *inputs[1:], **cfg), cos, sin))
            ms_r = bench_ms(lambda: rot_q(q_raw, cos, sin))
            rows.append((f"{vname} + 2 Inductor rotations", ms_u, True, 0.0, f"one rotation kernel {ms_r:.3f} ms"))
            result.setdefault("rotations", {})[vname] = dict(
                folded_ms=ms_mode[ROPE_Q | ROPE_OUT], q_folded_ms=ms_mode[ROPE_Q], out_folded_ms=ms_mode[ROPE_OUT],
                unfused_ms=ms_u, one_rotation_kernel_ms=ms_r, bit_equal=same,
                rotation_kernel_gbps=2 * q_raw.numel() * 2 / ms_r / 1e6)
        except Exception as e:
            rows.append(("rotations", float("nan"), False, float("nan"), f"{type(e).__name__}: {e}"[:200]))

    # V4's per-head q RMSNorm before the rotation, folded as q's row scales (pass A's q_scale): the op after Inductor's
    # rsqrt reduction against the op after Inductor's whole norm (the normalised q written and read back)
    if STAGGER in args.variants.split(",") and not args.no_rotations:
        try:
            norm = minidi.compile(lambda x: rms_norm(x, None, 1e-6), "none", dynamic=False)
            rsq = minidi.compile(lambda x: torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6), "none",
                                 dynamic=False)
            rope = dict(rope_cos=cos, rope_sin=sin, rope_mode=ROPE_Q | ROPE_OUT)
            folded = launch(q_raw, *inputs[1:], q_scale=rsq(q_raw), **rope)
            same = bool(torch.equal(folded, launch(norm(q_raw), *inputs[1:], **rope)))
            ms_f = bench_ms(lambda: launch(q_raw, *inputs[1:], q_scale=rsq(q_raw), **rope))
            ms_u = bench_ms(lambda: launch(norm(q_raw), *inputs[1:], **rope))
            ms_n, ms_s = bench_ms(lambda: norm(q_raw)), bench_ms(lambda: rsq(q_raw))
            rows.append((f"{STAGGER} + q norm folded (q_scale)", ms_f, same, 0.0,
                         f"Inductor's rsqrt {ms_s:.3f} ms inside; ok = bit-equal to the unfused"))
            rows.append((f"{STAGGER} + Inductor's q norm", ms_u, True, 0.0, f"the norm kernel {ms_n:.3f} ms inside"))
            result["q_norm"] = dict(folded_ms=ms_f, unfused_ms=ms_u, norm_kernel_ms=ms_n, rsqrt_kernel_ms=ms_s,
                                    bit_equal=same, norm_kernel_gbps=2 * q_raw.numel() * 2 / ms_n / 1e6,
                                    rsqrt_kernel_gbps=q_raw.numel() * 2 / ms_s / 1e6)
        except Exception as e:
            rows.append(("q norm", float("nan"), False, float("nan"), f"{type(e).__name__}: {e}"[:200]))

    if args.picked_sweep:
        result["picked_sweep"] = picked_sweep(args, [int(k) for k in args.picked_sweep.split(",")], T, H, D, W)

    common.say(f"\n{'path':<40} {'ms':>8} {'TFLOP/s':>8} {'%peak':>6} {'keyGB/s':>8} {'x eager':>8} {'x comp':>7}  "
               f"{'ok':<5} {'max err':>8}  notes")
    ms_comp = result.get("naive_compile_ms", float("nan"))
    for name, ms, ok, err, extra in rows:
        tf = flops / ms / 1e9
        common.say(f"{name:<40} {ms:8.3f} {tf:8.1f} {100 * tf / peaks['bf16_tflops']:6.1f} {key_bytes / ms / 1e6:8.0f} "
                   f"{ms_eager / ms:8.2f} {ms_comp / ms:7.2f}  {str(ok):<5} {err:8.2e}  {extra}")
    for name, rec in result["variants"].items():
        if rec.get("mma"):
            common.say(f"  {name}: mma layouts {rec['mma']}")
    good = {n: r for n, r in result["variants"].items() if r.get("ok")}
    if good:
        best = min(good, key=lambda n: good[n]["ms"])
        result.update(best=best, best_ms=good[best]["ms"], best_tflops=good[best]["tflops"],
                      best_pct_peak=100 * good[best]["tflops"] / peaks["bf16_tflops"],
                      speedup_vs_compile=ms_comp / good[best]["ms"])
    result["wall_s"] = time.time() - t0
    common.emit_json(result, out=args.out)


if __name__ == "__main__":
    main()
