"""Benchmark of pass N at V4.1-Flash's FP8 linear shapes (one H200): the model's ``FP8Linear`` (fq8 of the input
along K per 32, the 32 x 32-tile dequantised weight, ``F.linear``) against pass N's op (``minidi.ops.fp8_linear``).

T = 4,096 token rows, bf16. Per shape, timed in one run:
- the model's code under ``torch.compile`` (static shapes): Inductor's fq8 and dequant kernels, then the GEMM;
- pass N's op with its dequantised-weight cache (``MINIDI_FP8_WEIGHT_CACHE_GB``, on by default on CUDA: its fq8
  kernel, then the same GEMM call on the weight dequantised at its first call) and without it (its fq8 and dequant
  kernels, then the GEMM);
- the GEMM alone on operands prepared outside the timing (fq8'd input, dequantised weight): what either path costs
  beyond the GEMM is its time minus this row.
TFLOP/s = 2 T N K / time (of the GEMM the linear is); ``ms`` is a call's wall time (its host launch overhead
included: the op's Python wrapper and two Triton launches weigh at the small shapes), ``kernel_ms`` its kernels' GPU
time (what a GPU-bound step pays). ``bitwise`` says whether the op's output equals the compiled
model code's, bit for bit. Error = max|out - ref64| / max|ref64| (fp64 product of the quantised operands).
Peaks (bf16 matmul, device copy) measured in the same run.

Usage: python bench/bench_fp8_linear.py [--out PATH] [--smoke]. The LAST line printed is one JSON object.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from minidi.model.presets import preset
from minidi.model.quant import dequant_fp8, fq8, quantize_fp8
from minidi.ops.fp8_linear import WEIGHT_CACHE_ENV, fp8_linear

if __package__:  # python -m bench.bench_fp8_linear, the tests
    from . import common
else:  # python bench/bench_fp8_linear.py: the script's folder is sys.path[0]
    import common


def shapes(smoke: bool) -> list[tuple[str, int, int]]:
    """(name, N, K) of every FP8 linear of a V4.1-Flash layer (the tiny preset's with --smoke)."""
    c = preset("tiny-v41" if smoke else "v41-flash")
    return [("wq_a", c.q_lora_rank, c.dim), ("wq_b", c.n_heads * c.head_dim, c.q_lora_rank),
            ("wkv", c.head_dim, c.dim), ("wo_b", c.dim, c.o_groups * c.o_lora_rank),
            ("shared w1 / w3", c.moe_inter_dim, c.dim), ("shared w2", c.dim, c.moe_inter_dim),
            ("indexer wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)]


def model_linear(x, w, s):
    """``FP8Linear.forward`` with V4.1's blocks."""
    return F.linear(fq8(x, 32), dequant_fp8(w, s, 32, x.dtype))


def uncached(fn):
    """``fn`` with the dequantised-weight cache off (the setting is read at every call)."""
    def call():
        before = os.environ.get(WEIGHT_CACHE_ENV)
        os.environ[WEIGHT_CACHE_ENV] = "0"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ[WEIGHT_CACHE_ENV]
            else:
                os.environ[WEIGHT_CACHE_ENV] = before
    return call


def main(argv: list[str] | None = None) -> dict:
    args, device = common.op_bench_args(__doc__, argv)
    t = 64 if args.smoke else 4096
    pk = common.measure_peaks(device, small=args.smoke)
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(model_linear, dynamic=False)
    table: list = []
    cases = []
    for name, n, k in shapes(args.smoke):
        x = torch.randn(t, k, generator=g).bfloat16().to(device)
        w, s = quantize_fp8(torch.randn(n, k, generator=g) * 0.02, 32)
        w, s = w.to(device), s.view(torch.uint8).to(device)
        xq, wd = fq8(x, 32), dequant_fp8(w, s, 32, x.dtype)
        ref = xq.double() @ wd.double().t()
        flops = 2.0 * t * n * k

        def err(out):
            return float(f"{((out.double() - ref).abs().max() / ref.abs().max()).item():.2e}")

        base_ms: dict = {}
        want = compiled(x, w, s)
        got = fp8_linear(x, w, s, 32, 32)
        bitwise = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        for key, label, fn in (("model", f"{name} [{n}, {k}]: model code, torch.compile", lambda: compiled(x, w, s)),
                               ("op", "  pass N op (fp8_linear)", lambda: fp8_linear(x, w, s, 32, 32)),
                               ("op_nocache", "  pass N op, weight cache off",
                                uncached(lambda: fp8_linear(x, w, s, 32, 32))),
                               ("gemm", "  the GEMM alone (operands prepared)", lambda: F.linear(xq, wd))):
            ms = common.op_ms(fn, device, args.smoke)
            common.table_row(table, label, ms, flops, "TFLOP/s", pk, base_ms, rel_err=err(fn()),
                             kernel_ms=round(common.kernel_ms(fn, device), 4))
            base_ms[key] = ms
        cases.append({"name": name, "n": n, "k": k, "bitwise_op_equals_compiled_model": bitwise})
    common.print_table(f"N FP8 linears, T {t} bf16 (TFLOP/s of 2 T N K; vs the bf16 matmul peak)", table)
    result = {"bench": "fp8_linear", "device": common.device_name(device), "torch": torch.__version__, "t": t,
              "cases": cases, "peaks": {k: round(v, 1) for k, v in pk.items()}, "table": table}
    common.emit_json(result, out=args.out)
    return result


if __name__ == "__main__":
    main()
