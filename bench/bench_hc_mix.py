"""Benchmark of passes F and J at V4.1-Flash shapes (one H200): the mHC mixer projection z @ fn^T (F), and the
whole site's reads of the streams (J: projection, mean square and collapse from one read).

z = the 4 bf16 residual streams of T 4,096 tokens flattened to [4,096, 20,480], fn [24, 20,480] fp32; the plain path
(``hc_mixer``) upcasts z and runs an fp32 GEMM (cuBLAS picks an FFMA kernel for 24 output columns). The op reads
z in bf16 once, so it is memory-bound: bytes = z (bf16) + fn (fp32) + out (fp32); FLOPs 2 T K N are tiny.
Timed: the plain path eager and under stock ``torch.compile``, minidi's op at its default config, a small tile sweep.
Error = max|out - ref64| / max|ref64|. Peaks (bf16 matmul, device copy read + write) measured in the same run.

Second table (passes J, K): one V4.1 mHC site as the model computes it (``hc_mixer`` of x and the collapse of x with the
previous site's pre), each variant under ``torch.compile`` (Inductor does the sigmoid / Sinkhorn and whatever the
variant leaves): the plain code, pass F's form (``gate_tf32x3`` for the projection, as the step ran before J) and
pass J's form (``hc_mix_fused``), and J with K (the Sinkhorn as ``hc_sinkhorn``); then the fused op alone and its
tile sweep. Bytes: x once (bf16), u (bf16), fn.

Usage: python bench/bench_hc_mix.py [--out PATH] [--smoke]. The LAST line printed is one JSON object.
"""

from __future__ import annotations

import torch

from minidi.model.hyper_connections import hc_collapse, hc_mixer
from minidi.ops import gate_tf32x3 as op
from minidi.ops import hc_mix
from minidi.ops.hc_sinkhorn import hc_sinkhorn

if __package__:  # python -m bench.bench_hc_mix, the tests
    from . import common
else:  # python bench/bench_hc_mix.py: the script's folder is sys.path[0]
    import common

SWEEP = ((16, 32, 128, 4, 3, 1), (16, 32, 128, 4, 3, 2), (16, 32, 128, 4, 3, 4), (32, 32, 128, 4, 3, 4),
         (64, 32, 128, 4, 3, 4), (64, 32, 128, 4, 3, 8), (32, 32, 64, 4, 4, 4), (64, 32, 64, 4, 4, 8),
         (16, 32, 64, 2, 4, 2), (128, 32, 128, 8, 3, 8))  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K


FUSED_SWEEP = ((64, 64, 4, 3), (64, 32, 4, 4), (128, 32, 4, 4), (128, 32, 8, 3), (128, 64, 8, 2), (256, 32, 8, 2),
               (256, 16, 8, 3), (128, 16, 4, 4))  # BT, BD, warps, stages (D split hc_mix.SPLITS ways)
ITERS, EPS = 20, 1e-20  # V4.1-Flash's Sinkhorn iterations and norm eps


def plain(z: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    return z.float() @ fn.float().t()


def site_plain(x, pre, fn, base, scale):
    """One V4.1 site's stream reads, as the model writes them."""
    return (*hc_mixer(x, fn, base, scale, ITERS, 1e-6, EPS), hc_collapse(x, pre))


def site_pass_f(x, pre, fn, base, scale):
    """The site as the step ran with pass F: the projection on ``gate_tf32x3``, the rest plain."""
    t, n, d = x.shape
    z = x.reshape(t, n * d)
    mu = op.gate_tf32x3(z, fn) * torch.rsqrt(z.float().square().mean(-1, keepdim=True) + EPS)
    return (*_mixer_tail(mu, base, scale, n), hc_collapse(x, pre))


def site_pass_j(x, pre, fn, base, scale):
    """The site with pass J: one read of x for the projection, the mean square and the collapse."""
    g, ms, u = hc_mix.hc_mix_fused(x, fn, pre)
    return (*_mixer_tail(g * torch.rsqrt(ms + EPS), base, scale, x.shape[1]), u)


def site_pass_jk(x, pre, fn, base, scale):
    """The site with passes J and K (the Sinkhorn chain as one kernel too)."""
    g, ms, u = hc_mix.hc_mix_fused(x, fn, pre)
    return (*_mixer_tail(g * torch.rsqrt(ms + EPS), base, scale, x.shape[1], fused_sinkhorn=True), u)


def _mixer_tail(mu, base, scale, n, fused_sinkhorn=False):
    """``hc_mixer`` after its projection (the same code, so the variants differ only where they say)."""
    t = mu.shape[0]
    pre = torch.sigmoid(mu[:, :n] * scale[0] + base[:n]) + 1e-6
    post = 2.0 * torch.sigmoid(mu[:, n: 2 * n] * scale[1] + base[n: 2 * n])
    logits = (mu[:, 2 * n:] * scale[2] + base[2 * n:]).view(t, n, n)
    if fused_sinkhorn:
        return pre, post, hc_sinkhorn(logits, ITERS, 1e-6)
    c = torch.softmax(logits, dim=-1) + 1e-6
    c = c / (c.sum(dim=-2, keepdim=True) + 1e-6)
    for _ in range(ITERS - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + 1e-6)
        c = c / (c.sum(dim=-2, keepdim=True) + 1e-6)
    return pre, post, c


def fused_site_table(device: str, smoke: bool, pk: dict) -> tuple[list, list]:
    """The pass-J table: the three compiled site variants, the fused op alone, its sweep."""
    t, n, d = (64, 4, 256) if smoke else (4096, 4, 5120)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(t, n, d, generator=g).bfloat16().to(device)
    pre = (torch.rand(t, n, generator=g) + 0.1).to(device)
    fn = (torch.randn(24, n * d, generator=g) * (n * d) ** -0.5).to(device)
    base, scale = torch.randn(24, generator=g).to(device), torch.randn(3, generator=g).to(device)
    args = (x, pre, fn, base, scale)
    nbytes = x.numel() * 2 + t * d * 2 + fn.numel() * 4
    ref = site_plain(*(a.double() if a.is_floating_point() and a.dtype != torch.bfloat16 else a for a in args))
    table: list = []
    base_ms: dict = {}
    for name, f in (("plain", site_plain), ("pass F form", site_pass_f), ("pass J form", site_pass_j),
                    ("pass J+K form", site_pass_jk)):
        compiled = torch.compile(f, dynamic=False)
        out = compiled(*args)
        ms = common.op_ms(lambda: compiled(*args), device, smoke)
        errs = {k: float(f"{((o.double() - r.double()).abs().max() / r.double().abs().max()).item():.2e}")
                for k, o, r in zip(("pre", "post", "comb", "u"), out, ref)}
        common.table_row(table, f"site {name}, torch.compile", ms, nbytes, "GB/s", pk, base_ms, rel_err=errs,
                         kernel_ms=round(common.kernel_ms(lambda: compiled(*args), device), 4))
        base_ms.setdefault("plain_compile", ms)
        if name == "pass F form":
            base_ms["pass_f"] = ms
    gbuf = torch.empty(hc_mix.SPLITS, t, 24, device=device)
    sbuf = torch.empty(hc_mix.SPLITS, t, device=device)
    ubuf = torch.empty(t, d, device=device, dtype=x.dtype)
    ms = common.op_ms(lambda: hc_mix.launch(x, fn, pre, gbuf, sbuf, ubuf), device, smoke)
    default = hc_mix.default_config(t, d, x.dtype)
    common.table_row(table, f"fused op alone (default {default})", ms, nbytes, "GB/s", pk, base_ms,
                     kernel_ms=round(common.kernel_ms(lambda: hc_mix.launch(x, fn, pre, gbuf, sbuf, ubuf), device), 4))
    pointer = dict(TMA=False)  # the pointer loads (the kernel before round 33, and the CPU interpreter's path)
    ms = common.op_ms(lambda: hc_mix.launch(x, fn, pre, gbuf, sbuf, ubuf, **pointer), device, smoke)
    common.table_row(table, "fused op, pointer loads (TMA=False)", ms, nbytes, "GB/s", pk, base_ms,
                     kernel_ms=round(common.kernel_ms(lambda: hc_mix.launch(x, fn, pre, gbuf, sbuf, ubuf, **pointer),
                                                      device), 4))
    for bt, bd, nw, ns in FUSED_SWEEP:
        cfg = dict(BT=bt, BD=bd, num_warps=nw, num_stages=ns)
        name = f"  BT{bt} BD{bd} w{nw} s{ns}"
        try:
            hc_mix.launch(x, fn, pre, gbuf, sbuf, ubuf, **cfg)
        except Exception as exc:  # e.g. out of shared memory for this tile: report, keep going
            table.append({"name": name, "error": type(exc).__name__})
            continue
        ms = common.op_ms(lambda: hc_mix.launch(x, fn, pre, gbuf, sbuf, ubuf, **cfg), device, smoke)
        common.table_row(table, name, ms, nbytes, "GB/s", pk, base_ms)
    return [t, n, d], table


def main(argv: list[str] | None = None) -> dict:
    args, device = common.op_bench_args(__doc__, argv)
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
    site_shape, site = fused_site_table(device, args.smoke, pk)
    common.print_table(f"J one V4.1 mHC site, x {site_shape} bf16 (bytes x + u + fn; GB/s vs copy peak)", site)
    result = {"bench": "hc_mix", "device": common.device_name(device),
              "torch": torch.__version__, "shape": [t, k, n], "peaks": {kk: round(v, 1) for kk, v in pk.items()},
              "table": table, "site_shape": site_shape, "site_table": site}
    common.emit_json(result, out=args.out)
    return result


if __name__ == "__main__":
    main()
