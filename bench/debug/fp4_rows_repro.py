"""Reproduce and localise the rows= mismatch of the fused FP4 GEMM seen on the H200 (round 3, ``op_rows``).

The failing case: 96 experts x 256 rows (uniform), N 2,304, K 5,120 (w1/w3); tokens [4,097, K] bf16 read through
rows [24,576]. The check: the rows= result against the op on the gathered x = tokens[rows] (bitwise equal when both
are right), and for the differing rows, which of the two matches an fp32 reference.

Per config, repeated ``--repeats`` times (a race shows as a count that changes between repeats):
bad elements, bad rows, the bad rows' positions within their BM-row tile and their experts. The configs vary the
pipelining (num_stages), the tile orientation (swap), the decode and the persistent grid, to tell a codegen hazard
from a schedule bug. Writes one JSON object to stdout (and --out).

    TRITON_INTERPRET=0 PYTHONPATH=$PWD python bench/debug/fp4_rows_repro.py --out $OUT/fp4_rows_repro.json

Lead (from the TTGIR for sm_90, compiled on a CPU machine with Triton 3.9, not the device's 3.6): only the rows
variant has two layout conversions through shared memory inside the persistent tile loop. They sit just in front of
the pipeline's first cp.async copies into the x buffers:
- the [BM] row ids, from the load's layout to a slice of the pointer tile's layout;
- the [1, BM] pointer row, to the layout of the copy.
A hazard between that scratch and the in-flight copies would corrupt a few K-steps of some rows, which fits the
size of the errors. If num_stages=1 comes out clean, that points there.

Loading the ids already broadcast to [BK, BM] does not remove the conversion: the full pointer tile then goes
through shared memory, 140 KB against 112 KB.

Against that lead, the PTX from 3.9 fences the conversion with bar.sync on both sides, before the first cp.async.

A second lead: the passing and failing cases did not run the same binary. Triton specialises integer arguments
divisible by 16.
- Passing, 24 experts (the GPU test): E % 16 != 0.
- Failing, 96 experts: E % 16 == 0.
- Passing, w2: its scale row stride is 72.
So only the failing case ran the variant with E and every stride divisible by 16. Running with `--experts 100`
(not a multiple of 16) and with `--experts 48` (a multiple) tells whether the specialisation matters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from minidi.ops.fp4_grouped_gemm import Fp4GemmConfig, default_config, fp4_dequant_ref, launch

CONFIGS = {
    "default": None,
    "stages1": {"num_stages": 1},
    "stages2": {"num_stages": 2},
    "noswap": {"swap": False},
    "scaled": {"decode": "scaled", "swap": False, "BK": 128},
    "progs_tiles": {"progs": 96 * 18},  # one tile per program: no persistent loop
    "progs_66": {"progs": 66},
}


def parse_config(spec: str) -> Fp4GemmConfig:
    """'BM=256,BN=128,swap=1,decode=asm' -> Fp4GemmConfig (fields not named keep their defaults)."""
    fields = {f.name for f in dataclasses.fields(Fp4GemmConfig)}
    kw = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--base: unknown field {key!r}; known: {sorted(fields)}")
        kw[key] = value if key == "decode" else bool(int(value)) if key == "swap" else int(value)
    return Fp4GemmConfig(**kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--rows", type=int, default=256, help="rows per expert (uniform)")
    ap.add_argument("--n", type=int, default=2304)
    ap.add_argument("--k", type=int, default=5120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--base", default="BM=256,BN=128,BK=64,num_warps=8,num_stages=3,swap=1",
                    help="the config the variants change, as comma-separated Fp4GemmConfig fields (default: the "
                         "swapped EP4 tile that raced)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run in the Triton interpreter (small shapes)")
    args = ap.parse_args()
    torch.manual_seed(0)
    e, n, k = args.experts, args.n, args.k
    r = e * args.rows
    wp = torch.randint(-128, 128, (e, n, k // 2), dtype=torch.int8, device=args.device)
    ws = torch.randint(118, 123, (e, n, k // 32), dtype=torch.uint8, device=args.device).view(torch.float8_e8m0fnu)
    offs = torch.full((e,), args.rows, dtype=torch.int64).cumsum(0).to(torch.int32).to(args.device)
    tokens = torch.randn(r // 6 + 1, k, device=args.device, dtype=torch.bfloat16)
    rows = torch.randint(0, tokens.shape[0], (r,), device=args.device)
    x = tokens[rows]
    base = parse_config(args.base)
    report = {"case": {"experts": e, "rows_per_expert": args.rows, "N": n, "K": k, "tokens": tokens.shape[0]},
              "base_config": base.name(),
              "default_config": default_config(r, e, n, k, torch.bfloat16, x.device).name(), "torch": torch.__version__,
              "configs": {}}
    for name, change in CONFIGS.items():
        cfg = base if change is None else dataclasses.replace(base, **change)
        entry = {"config": cfg.name(), "runs": []}
        try:
            for _ in range(args.repeats):
                gathered = torch.full((r, n), 12345.0, dtype=torch.bfloat16, device=args.device)
                by_index = torch.full_like(gathered, 12345.0)
                launch(x, wp, ws, offs, gathered, cfg)
                launch(tokens, wp, ws, offs, by_index, cfg, rows=rows)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                diff = by_index != gathered
                bad_rows = diff.any(1).nonzero().flatten()
                run = {"bad_elements": int(diff.sum()), "bad_rows": int(bad_rows.numel()),
                       "gathered_equals_itself": bool(torch.equal(gathered, _again(x, wp, ws, offs, cfg)))}
                if bad_rows.numel():
                    sample = bad_rows[:16]
                    ref = torch.stack([x[i].float() @ fp4_dequant_ref(wp[i // args.rows], ws[i // args.rows]).t()
                                       for i in sample.tolist()])
                    err_g = (gathered[sample].float() - ref).abs().amax(1)
                    err_i = (by_index[sample].float() - ref).abs().amax(1)
                    run.update(
                        bad_row_ids=sample.tolist(),
                        row_in_tile=(sample % cfg.BM).tolist(),
                        expert=(sample // args.rows).tolist(),
                        bad_cols_per_row=diff[sample].sum(1).tolist(),
                        first_bad_col=[int(diff[i].nonzero()[0]) for i in sample.tolist()],
                        max_err_gathered=err_g.tolist(), max_err_by_index=err_i.tolist(),
                        ref_scale=float(ref.abs().max()))
                entry["runs"].append(run)
        except Exception as err:  # a config that does not compile here: report it, go on
            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        report["configs"][name] = entry
        print(name, json.dumps(entry)[:400], flush=True)
    text = json.dumps(report)
    print(text)
    if args.out:
        open(args.out, "w").write(text)


def _again(x, wp, ws, offs, cfg: Fp4GemmConfig) -> torch.Tensor:
    out = torch.full((x.shape[0], wp.shape[1]), 12345.0, dtype=x.dtype, device=x.device)
    launch(x, wp, ws, offs, out, cfg)
    return out


if __name__ == "__main__":
    main()
