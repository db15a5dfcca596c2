"""The passes under Inductor on the GPU: match counts and logits against the uncompiled model (issue 5's check).

    PYTHONPATH=. TRITON_INTERPRET=0 python bench/gpu_passes_check.py --models tiny-v41,tiny-v4 --out results.json

fp32, fake-quant off (tight comparisons; ``../shared/PITFALLS.md``), Inductor with all passes, strict. For each model:
the step compiled per layer (``regional``) and, with ``--whole``, as one graph; two token counts (the second must
not recompile); counts against ``expected_sites``; max |logit difference| against the eager step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import minidi
from minidi.model.context import ModelCache, StepMeta
from minidi.passes import expected_sites
from minidi.runtime.engine import dynamic_shape_config


def _meta(model, n: int, seed: int) -> StepMeta:
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).to("cuda")
    return StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.engram_max_ngram if cfg.engram_layers else 0)


def check(name: str, regional: bool, lengths: tuple[int, ...]) -> dict:
    torch._dynamo.reset()
    model = minidi.load_model(name, device="cuda", dtype="float32", fake_quant=False)
    metas = [_meta(model, n, i) for i, n in enumerate(lengths)]
    with torch.no_grad():
        refs = [model.step(m, ModelCache()) for m in metas]
    t0 = time.perf_counter()
    step = minidi.compile(model, "all", strict=True, backend="inductor", regional=regional)
    out = {"model": name, "scope": "layer" if regional else "model", "errors": []}
    with torch.no_grad(), dynamic_shape_config():
        for i, (m, ref) in enumerate(zip(metas, refs)):
            got = step(m, ModelCache())
            torch.cuda.synchronize()
            if i == 0:
                out["compile_s"] = round(time.perf_counter() - t0, 1)
                graphs = len(step.pass_manager.history)
            out["errors"].append(float((got - ref).abs().max()))
    out["graphs"] = len(step.pass_manager.history)
    out["recompiled_for_second_length"] = out["graphs"] != graphs
    out["counts"] = step.counts if regional else dict(step.pass_manager.counts)
    out["expected"] = {k: len(v) for k, v in expected_sites(model.cfg, regional=regional).items()}
    out["counts_match"] = out["counts"] == out["expected"]
    out["lengths"] = list(lengths)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-v41,tiny-v4")
    ap.add_argument("--whole", action="store_true", help="also compile the whole step as one graph")
    ap.add_argument("--out", default="passes_check.json")
    args = ap.parse_args()
    results = []
    for name in args.models.split(","):
        for regional in (True, False) if args.whole else (True,):
            r = check(name, regional, (100, 77))
            print(json.dumps(r), flush=True)
            results.append(r)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
