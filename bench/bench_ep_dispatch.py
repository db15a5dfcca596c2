"""Benchmark of the emulated EP dispatch's rows at V4.1-Flash shapes (one H200): this rank's tokens x [4,096, 5,120]
bf16 -> every synthesised rank's, [4 x 4,096, 5,120], block r = x rotated by r T / 4 rows
(``minidi.runtime.expert_parallel.EmulatedEP.dispatch``).

A copy: bytes = x read once + 4 x written. Variants, each under ``torch.compile`` with the token count dynamic and the
width static, as in the prefill step (T is a symbol there, so the roll's modulo is a runtime division; round 12's raw
file was measured with the width dynamic too, which slows the two cats further):
- ``cat`` of ``roll``s (round 12's step: ``triton_poi_fused_cat_roll_*``);
- ``cat`` of row slices (the same rotation without a modulo; Inductor's pointwise cat);
- the ``rotated_blocks`` op (contiguous copies), compiled and eager.
Every variant's output is checked equal to the cat of rolls. Peaks (bf16 matmul, device copy read + write) measured
in the same run.

Usage: python bench/bench_ep_dispatch.py [--out PATH] [--smoke]. The LAST line printed is one JSON object.
"""

from __future__ import annotations

import argparse

import torch

from minidi.runtime.expert_parallel import rotated_blocks, rotated_blocks_ref

if __package__:  # python -m bench.bench_ep_dispatch, the tests
    from . import common
else:  # python bench/bench_ep_dispatch.py: the script's folder is sys.path[0]
    import common

RANKS = 4


def rows_cat_slices(x: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    pieces = [x]
    for r in range(1, RANKS):
        s = r * t // RANKS
        pieces += [x[t - s:], x[:t - s]]
    return torch.cat(pieces)


def rows_op(x: torch.Tensor) -> torch.Tensor:
    return rotated_blocks(x, RANKS)


def rows_rolls(x: torch.Tensor) -> torch.Tensor:
    return rotated_blocks_ref(x, RANKS)


def dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU ok)")
    args = ap.parse_args(argv)
    device = dev()
    t, d = (64, 96) if args.smoke else (4096, 5120)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    ref = rows_rolls(x)
    pk = common.measure_peaks(device, small=args.smoke)
    nbytes = (1 + RANKS) * x.numel() * x.element_size()
    table: list = []
    base_ms: dict = {}
    for key, name, f in (("cat_roll", "cat of rolls (round 12)", rows_rolls),
                         ("cat_slices", "cat of row slices", rows_cat_slices),
                         ("op", "rotated_blocks op", rows_op)):
        torch._dynamo.reset()
        torch._dynamo.mark_dynamic(x, 0)  # T a symbol, D static (the step's layer graphs)
        compiled = torch.compile(f, dynamic=False)
        out = compiled(x)
        ms = common.op_ms(lambda: compiled(x), device, args.smoke)
        common.table_row(table, f"{name}, torch.compile", ms, nbytes, "GB/s", pk, base_ms, equal=torch.equal(out, ref),
                         kernel_ms=round(common.kernel_ms(lambda: compiled(x), device), 4))
        base_ms.setdefault(key, ms)
    ms = common.op_ms(lambda: rows_op(x), device, args.smoke)
    common.table_row(table, "rotated_blocks op, eager", ms, nbytes, "GB/s", pk, base_ms,
                     equal=torch.equal(rows_op(x), ref))
    common.print_table(f"EP{RANKS} emulated dispatch rows, x [{t}, {d}] bf16 -> [{RANKS * t}, {d}] (bytes x + out; "
                       f"GB/s vs copy peak)", table)
    result = {"bench": "ep_dispatch", "device": common.device_name(device), "torch": torch.__version__,
              "shape": [t, d], "ranks": RANKS, "bytes": nbytes, "peaks": {k: round(v, 1) for k, v in pk.items()},
              "table": table}
    common.emit_json(result, out=args.out)
    return result


if __name__ == "__main__":
    main()
