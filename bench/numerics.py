"""Numerics harness: eager vs compiled (stock and with passes) per layer and end to end, on identical cache state.

    python bench/numerics.py --model tiny-v41 --modes compile,passes --result_jsonl numerics.jsonl
    python bench/numerics.py --model v41-flash --prefill_batch_size 2048 --cached_tokens 16384   # full size, GPU

One JSON line: per mode (``compile``: stock ``torch.compile`` through minidi's backend, no passes; ``passes``: all
passes, strict) and per layer, teacher-forced (``bench/fidelity.py``): rel-RMS and max error of the layer's output
streams, of its collapse weights (V4.1) and of the cache rows it writes, the indexer's top-k and candidate
agreement (V4.1, from the layers' shared slots; V4's picks stay inside its layers and are not compared), the
router's expert agreement (at the gate input); end to end from the same cache snapshot: logits rel-RMS, max error
and argmax agreement. ``--fp32_reference on`` adds the eager fp32 twin (fake quant as configured: the QAT semantics in
high precision) to both, as the scale of bf16 noise. The workload is the prefill benchmark's
(``bench/prefill_workload.py``): full-size presets get random weights, tiny ones load the embedded checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repo importable (bench/ and minidi/)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minidi  # noqa: E402
from bench import common, fidelity, prefill_workload  # noqa: E402
from bench.bench_prefill import ROUNDING  # noqa: E402
from minidi.passes import PassManager  # noqa: E402
from minidi.runtime.compile import dynamic_shape_config, make_backend  # noqa: E402

MODES = ("compile", "passes")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-v41", help="checkpoint directory or preset")
    ap.add_argument("--prefill_batch_size", type=int, default=None, help="new tokens (full size 2,048, tiny 24)")
    ap.add_argument("--cached_tokens", type=int, default=None, help="cached prefix (full size 16,384, tiny 64)")
    ap.add_argument("--modes", default="compile,passes", help=f"comma list of {','.join(MODES)}")
    ap.add_argument("--passes", default="all", help="the passes of mode 'passes'")
    ap.add_argument("--backend", default="inductor", help="inner torch.compile backend (aot_eager: the passes' ops "
                    "alone differ from eager)")
    ap.add_argument("--faithful_rounding", choices=tuple(ROUNDING), default="on",
                    help="exact: ATen's reduction / transcendental kernels in GPU graphs too")
    ap.add_argument("--fp32_reference", choices=("on", "off"), default="on")
    ap.add_argument("--emulate-ep", "--emulate_ep", dest="emulate_ep", type=int, default=1)
    ap.add_argument("--share_experts", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16",))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result_jsonl", default=None)
    args = ap.parse_args(argv)
    full = args.model in prefill_workload.FULL_SIZE
    if args.prefill_batch_size is None:
        args.prefill_batch_size = 2048 if full else 24
    if args.cached_tokens is None:
        args.cached_tokens = 16_384 if full else 64
    if bad := [m for m in args.modes.split(",") if m not in MODES]:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {MODES}")
    return args


def logits_metrics(test: torch.Tensor, ref: torch.Tensor) -> dict:
    top2 = ref.float().topk(2, dim=-1).values
    return {"rel_rms": fidelity.rel_rms(test, ref), "max_abs": fidelity.max_abs(test, ref),
            "argmax_agree": float((test.argmax(-1) == ref.argmax(-1)).float().mean()),
            "ref_top2_margin_median": float((top2[:, 0] - top2[:, 1]).median())}


def gate_router(passes: str, args: argparse.Namespace):
    """A compiled router (the same passes as the mode's): gate module, x, ids -> expert ids. One compiled graph for
    every layer's gate (the gate's code is shared; Dynamo guards each module, so the limit allows one per layer)."""
    manager = PassManager(passes, op_backend="auto")
    backend = make_backend(manager, args.backend, faithful_rounding=ROUNDING[args.faithful_rounding])

    def route(gate, x, ids):
        return gate(x, ids)[0]

    compiled = torch.compile(route, backend=backend, dynamic=True, fullgraph=True)
    limit = 4 * 64

    def call(gate, x, ids):
        with torch._dynamo.config.patch(recompile_limit=limit, cache_size_limit=limit):
            return compiled(gate, x, ids)
    return call


def layer_summary(records: list[dict], key: str) -> dict:
    vals = [r[key] for r in records if r.get(key) is not None]
    return {"max": max(vals), "median": sorted(vals)[len(vals) // 2]} if vals else {}


def run(args: argparse.Namespace, partial: str | None = None) -> dict:
    """The harness' result; with ``partial`` (a path) the result so far is written there after each mode, so a run
    cut short (a device call's time limit) still leaves the modes it finished."""
    notes: list[str] = []
    phase = common.Phases()
    with phase(f"build model {args.model}"):
        model = prefill_workload.build_model(args.model, args.device, args.dtype, args.emulate_ep, args.share_experts,
                                             None, args.seed, notes)
    with phase("build workload"):
        wl = prefill_workload.build_workload(model, args.prefill_batch_size, args.cached_tokens, 1, args.seed, notes)
    twin = fidelity.fp32_twin(model) if args.fp32_reference == "on" else None
    mc = wl.cache.tensors
    snap = fidelity.model_cache_snapshot(mc)

    def step_from_snapshot(fn):
        fidelity.model_cache_restore(mc, snap)
        out = fn(wl.meta, mc)
        common.sync(args.device)
        return out

    result: dict = {"bench": "numerics", "model": model.cfg.name, "device": common.device_name(args.device),
                    "torch": torch.__version__, "dtype": model.cfg.dtype, "fake_quant": model.cfg.fake_quant,
                    "ep": model.cfg.ep_size, "new_tokens": wl.new_tokens, "cached_tokens": wl.cached_tokens,
                    "faithful_rounding": ROUNDING[args.faithful_rounding], "backend": args.backend,
                    "notes": notes, "modes": {}}
    with torch.no_grad(), dynamic_shape_config():
        with phase("eager step"):
            model.set_eager_budget()
            logits_e = step_from_snapshot(model.step).float()
            model.set_eager_budget(None)
        if twin is not None:
            with phase("eager fp32 step"):
                twin.set_eager_budget()
                fp32_cache = {k: {n: t.float() if t.dtype == torch.bfloat16 else t.clone() for n, t in v.items()}
                              for k, v in snap.items()}
                logits_f = twin.step(wl.meta, type(mc)(**fp32_cache))
                twin.set_eager_budget(None)
                result["eager_vs_fp32_logits"] = logits_metrics(logits_e, logits_f)
        for mode in args.modes.split(","):
            passes = args.passes if mode == "passes" else "none"
            torch._dynamo.reset()
            minidi.uncompile(model)
            step = minidi.compile(model, passes, strict=mode == "passes", regional=True, dynamic=True,
                                  backend=args.backend, faithful_rounding=ROUNDING[args.faithful_rounding])
            with phase(f"[{mode}] first step (compiles)"):  # with compile workers its layers run eagerly
                step_from_snapshot(step)
            with phase(f"[{mode}] compiled step"):
                logits_c = step_from_snapshot(step).float()
            compiled = [b._compiled_call_impl for b in model.layers]
            probe = fidelity.LayerProbe(model, compiled, twin if mode == args.modes.split(",")[0] else None,
                                        gate_router(passes, args))
            with phase(f"[{mode}] teacher-forced step"):
                with probe:
                    step_from_snapshot(step)
            counts = step.counts if step.pass_manager.keys else None
            records = probe.records
            result["modes"][mode] = {
                "passes": passes, "pass_matches": counts, "logits": logits_metrics(logits_c, logits_e),
                "layers": records,
                "summary": {k: layer_summary(records, k) for k in (
                    "compiled_rel_rms", "compiled_max_abs", "compiled_cache_rel_rms", "compiled_topk_agree",
                    "compiled_experts_agree", "eager_vs_fp32_rel_rms", "eager_vs_fp32_topk_agree",
                    "eager_vs_fp32_experts_agree")},
            }
            step.uncompile()
            if partial:
                Path(partial).write_text(json.dumps(result) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    result = run(args, partial=args.result_jsonl and f"{args.result_jsonl}.partial")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    for mode, r in result["modes"].items():
        common.say(f"[{mode}] per layer compiled vs eager rel-RMS: "
                   + " ".join(f"{x['compiled_rel_rms']:.2e}" for x in r["layers"]))
        common.say(f"[{mode}] logits vs eager: {r['logits']}")
    if "eager_vs_fp32_logits" in result:
        first = next(iter(result["modes"].values()))
        common.say("eager bf16 vs fp32 per layer rel-RMS: "
                   + " ".join(f"{x['eager_vs_fp32_rel_rms']:.2e}" for x in first["layers"]))
    common.emit_json(result, jsonl=args.result_jsonl)
    return result


if __name__ == "__main__":
    main()
