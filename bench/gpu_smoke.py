"""GPU smoke check of the model and the engine on the device stack (torch 2.11 + CUDA), plus a full-size probe.

    python bench/gpu_smoke.py [--full-size]

1. tiny-v41 / tiny-v4 in fp32 (fake-quant off) on CUDA vs the same model on the CPU: logits agree.
2. The engine's step under torch.compile (Inductor, CUDA) over several batch shapes: graphs compiled, max error
   vs the eager engine.
3. --full-size: build V4.1-Flash shapes with shared experts on the GPU, report memory, try a short prefill.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch._dynamo.utils import counters

import minidi
from minidi.runtime.engine import Engine, Request


def check_tiny(result: dict) -> None:
    for name in ("tiny-v41", "tiny-v4"):
        cpu = minidi.load_model(name, dtype="float32", fake_quant=False)
        gpu = minidi.load_model(name, device="cuda", dtype="float32", fake_quant=False)
        ids = torch.randint(0, cpu.cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            a, b = cpu(ids), gpu(ids.cuda()).cpu()
        result[f"{name}_cuda_vs_cpu_max_abs"] = float((a - b).abs().max())
        print(f"{name}: fp32 CUDA vs CPU max |dlogit| {result[f'{name}_cuda_vs_cpu_max_abs']:.2e}")


def check_compiled_engine(result: dict) -> None:
    torch._dynamo.reset()
    counters.clear()
    model = minidi.load_model("tiny-v41", device="cuda", dtype="float32", fake_quant=False)
    kw = dict(max_batch_tokens=256, max_seqs=8, cache_tokens=4096, page_size=16)
    comp, eager = Engine(model, compile=True, **kw), Engine(model, **kw)
    g = torch.Generator().manual_seed(0)
    errs = []
    for lens in [(200,), (33, 7), (50, 20, 3), (256,), (13, 13, 13, 13)]:
        reqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
        t0 = time.perf_counter()
        a = comp.prefill([Request(r) for r in reqs])
        dt = time.perf_counter() - t0
        b = eager.prefill([Request(r) for r in reqs])
        errs.append(max(float((x.logits - y.logits).abs().max()) for x, y in zip(a, b)))
        print(f"compiled engine {lens}: max |d| vs eager {errs[-1]:.2e} ({dt:.1f} s)")
    result.update(compiled_max_abs=max(errs), compiled_graphs=counters["stats"]["unique_graphs"],
                  graph_breaks=sum(counters["graph_break"].values()))


def probe_full_size(result: dict) -> None:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = minidi.load_model("v41-flash", device="cuda", share_experts=True)
    torch.cuda.synchronize()
    result["full_build_s"] = round(time.perf_counter() - t0, 1)
    result["full_weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 1)
    print(f"v41-flash (shared experts) built in {result['full_build_s']} s, {result['full_weights_gib']} GiB")
    for n in (16, 128):
        try:
            ids = torch.randint(0, model.cfg.vocab_size, (n,), device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(ids)
            torch.cuda.synchronize()
            result[f"full_forward_{n}_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            result[f"full_forward_{n}_finite"] = bool(torch.isfinite(out).all())
            print(f"  eager forward of {n} tokens: {result[f'full_forward_{n}_ms']} ms, finite "
                  f"{result[f'full_forward_{n}_finite']}")
        except torch.OutOfMemoryError as e:
            result[f"full_forward_{n}"] = f"OOM: {str(e)[:160]}"
            print(f"  eager forward of {n} tokens: OOM")
            break
    result["full_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--full-size", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    check_tiny(result)
    check_compiled_engine(result)
    if args.full_size:
        probe_full_size(result)
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
