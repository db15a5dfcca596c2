"""Benchmark of pass G at V4.1-Flash shapes (one H200): the mHC stream update after a sublayer,
x'_k = post_k * h + sum_j comb[j, k] * x_j (``minidi.model.hyper_connections.hc_expand``).

x [4,096, 4, 5,120] bf16 streams, h [4,096, 5,120] bf16, post [4,096, 4] and comb [4,096, 4, 4] fp32. Memory-bound:
bytes = x + x' (bf16) + h + post + comb, read or written once. Variants, each under ``torch.compile`` (static shapes)
where it is a graph, the mixer's ``post = 2 sigmoid(mu[:, n:2n] * scale + base)`` computed in the same graph as in
the step (round 12's profile: Inductor fused it into the update's kernel):
- the model's code (einsum: a bmm of T tiny batches);
- pass G's einsum-only form (``hc_stream_mix``: one pointwise kernel, round 12's step);
- pass G's op (``hc_expand``: Inductor computes post, the op the update);
- the op alone at its default tile, and a small tile sweep.
Error = max|out - ref64| / max|ref64|. Peaks (bf16 matmul, device copy read + write) measured in the same run.

Usage: python bench/bench_hc_expand.py [--out PATH] [--smoke]. The LAST line printed is one JSON object.
"""

from __future__ import annotations

import torch

from minidi.model.hyper_connections import hc_expand as model_expand
from minidi.ops import hc_expand as op
from minidi.ops.hc_streams import hc_stream_mix

if __package__:  # python -m bench.bench_hc_expand, the tests
    from . import common
else:  # python bench/bench_hc_expand.py: the script's folder is sys.path[0]
    import common

SWEEP = ((1, 512, 4), (2, 512, 4), (4, 512, 8), (1, 1024, 4), (2, 1024, 8), (2, 256, 4), (4, 256, 4),
         (8, 256, 8), (1, 2048, 8))  # BT, BD, warps


def post_of(mu, scale, base, n):
    return 2.0 * torch.sigmoid(mu[:, n: 2 * n] * scale[1] + base[n: 2 * n])


def site_model(x, h, mu, scale, base, comb):
    return model_expand(x, h, post_of(mu, scale, base, x.shape[1]), comb)


def site_einsum_only(x, h, mu, scale, base, comb):
    """Pass G before round 12's fix: the einsum as a broadcast sum, the rest left to Inductor."""
    post = post_of(mu, scale, base, x.shape[1])
    return (post.unsqueeze(-1) * h.float().unsqueeze(1) + hc_stream_mix(comb, x.float())).to(x.dtype)


def site_op(x, h, mu, scale, base, comb):
    return op.hc_expand(x, h, post_of(mu, scale, base, x.shape[1]), comb)


def main(argv: list[str] | None = None) -> dict:
    args, device = common.op_bench_args(__doc__, argv)
    t, n, d = (32, 4, 96) if args.smoke else (4096, 4, 5120)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, n, d, generator=g).bfloat16().to(device)
    h = torch.randn(t, d, generator=g).bfloat16().to(device)
    mu = torch.randn(t, (2 + n) * n, generator=g).to(device)
    scale, base = torch.randn(3, generator=g).to(device), torch.randn((2 + n) * n, generator=g).to(device)
    comb = torch.rand(t, n, n, generator=g).to(device)
    inputs = (x, h, mu, scale, base, comb)
    post = post_of(mu, scale, base, n)
    ref = post.double()[..., None] * h.double()[:, None] + torch.einsum("tjk,tjd->tkd", comb.double(), x.double())
    pk = common.measure_peaks(device, small=args.smoke)
    nbytes = 2 * x.numel() * 2 + h.numel() * 2 + post.numel() * 4 + comb.numel() * 4

    def err(out):
        return float(f"{((out.double() - ref).abs().max() / ref.abs().max()).item():.2e}")

    table: list = []
    base_ms: dict = {}
    for key, name, f in (("model", "model code (einsum)", site_model),
                         ("einsum_only", "pass G einsum-only (round 12)", site_einsum_only),
                         ("op", "pass G op (hc_expand)", site_op)):
        compiled = torch.compile(f, dynamic=False)
        out = compiled(*inputs)
        ms = common.op_ms(lambda: compiled(*inputs), device, args.smoke)
        common.table_row(table, f"{name}, torch.compile", ms, nbytes, "GB/s", pk, base_ms, rel_err=err(out),
                         kernel_ms=round(common.kernel_ms(lambda: compiled(*inputs), device), 4))
        base_ms[key] = ms
    buf = torch.empty_like(x)
    ms = common.op_ms(lambda: op.launch(x, h, post, comb, buf), device, args.smoke)
    common.table_row(table, f"op alone (default {op.default_config(n, d)})", ms, nbytes, "GB/s", pk, base_ms,
                     rel_err=err(buf), kernel_ms=round(common.kernel_ms(lambda: op.launch(x, h, post, comb, buf),
                                                                        device), 4))
    for bt, bd, nw in SWEEP:
        cfg = dict(BT=bt, BD=bd, num_warps=nw)
        name = f"  BT{bt} BD{bd} w{nw}"
        try:
            op.launch(x, h, post, comb, buf, **cfg)
        except Exception as exc:  # e.g. out of registers / shared memory for this tile: report, keep going
            table.append({"name": name, "error": type(exc).__name__})
            continue
        ms = common.op_ms(lambda: op.launch(x, h, post, comb, buf, **cfg), device, args.smoke)
        common.table_row(table, name, ms, nbytes, "GB/s", pk, base_ms, rel_err=err(buf))
    common.print_table(f"G mHC stream update, x [{t}, {n}, {d}] bf16 (bytes x + x' + h + post + comb; GB/s vs copy "
                       f"peak)", table)
    result = {"bench": "hc_expand", "device": common.device_name(device), "torch": torch.__version__,
              "shape": [t, n, d], "bytes": nbytes, "peaks": {k: round(v, 1) for k, v in pk.items()}, "table": table}
    common.emit_json(result, out=args.out)
    return result


if __name__ == "__main__":
    main()
