"""Prefill benchmark (first slice): eager prefill of one sequence through the plain model.

`python bench/bench_prefill.py` prefills the embedded tiny V4.1 checkpoint on the CPU. The reference protocol
(cached prefix, ragged batches, compiled modes, profile stage table, EP emulation) arrives with the runtime, ops
and passes; the flags below already follow the reference report's names.
Prints a card, a table, and as the last line one JSON object (appended to --result_jsonl when given).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import minidi


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny-v41", help="checkpoint directory or preset (tiny-v41, tiny-v4, ...)")
    ap.add_argument("--prefill_batch_size", type=int, default=256, help="new tokens per step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result_jsonl", default=None)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = minidi.load_model(args.model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    cfg = model.cfg
    n = min(args.prefill_batch_size, cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (n,), device=args.device)
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"minidi prefill | device {dev_name} ({args.device}) | model {cfg.name} ({cfg.arch}, {cfg.n_layers} layers, "
          f"dim {cfg.dim}) | dtype {cfg.dtype} | fake_quant {cfg.fake_quant} | mode eager | loaded in {load_s:.1f}s")
    with torch.inference_mode():
        for _ in range(args.warmup):
            model(ids)
        _sync(args.device)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            logits = model(ids)
            _sync(args.device)
            times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    ok = bool(torch.isfinite(logits).all())
    print(f"{'tokens':>8} {'ms/step':>10} {'tok/s':>10} {'finite':>7}")
    print(f"{n:>8} {ms:>10.1f} {n / ms * 1e3:>10.1f} {str(ok):>7}")
    result = {
        "model": cfg.name, "arch": cfg.arch, "mode": "eager", "passes": "none", "ep": 1, "device": dev_name,
        "dtype": cfg.dtype, "new_tokens": n, "cached_tokens": 0, "steps": args.steps, "ms_per_step": round(ms, 3),
        "input_tok_per_s_per_gpu": round(n / ms * 1e3, 1), "logits_finite": ok,
    }
    line = json.dumps(result)
    print(line)
    if args.result_jsonl:
        with open(args.result_jsonl, "a") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    main()
