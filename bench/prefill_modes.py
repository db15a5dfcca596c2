"""The prefill benchmark's modes (``bench_prefill.py``): the step of each mode, one mode's run on a workload (first
step, warm-up, timed steps, profile) and its JSON line, or the line of a mode that could not run.

- ``make_step``: eager (bounded temporaries), or ``minidi.compile`` without (``compile``) or with (``passes``) the
  passes, per layer or whole, with the compile cache; ``compile_record``: the first step's split and the cache's.
- ``run_mode``: one mode on one workload; ``failed_mode``: the line of one that ran out of memory.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from pathlib import Path

import torch
import torch._inductor.config

import minidi
from minidi.ops import fp8_linear
from minidi.runtime.engine import dynamic_shape_config
from minidi.runtime.flops import mfu, step_flops

if __package__:  # imported as bench.prefill_modes (python -m bench.bench_prefill, the tests)
    from . import common, host_timers, launch_ab
    from .gpu_idle import profile_idle
    from .model_work import kernel_model_flops
    from .prefill_profile import Profile, profile_steps, stage_sum_note
else:  # bench_prefill.py run as a script: the script's folder is sys.path[0]
    import common
    import host_timers
    import launch_ab
    from gpu_idle import profile_idle
    from model_work import kernel_model_flops
    from prefill_profile import Profile, profile_steps, stage_sum_note

ROUNDING = {"on": True, "off": False, "exact": "exact"}  # --faithful_rounding -> minidi.compile(faithful_rounding=)


# ---- modes -------------------------------------------------------------------------------------------------------
def uncompile(model) -> None:
    """Undo an earlier mode's compile, so that each mode starts from the plain model (per-layer compile sets
    ``Block._compiled_call_impl`` and ``model.layer_hook``)."""
    torch._dynamo.reset()
    minidi.uncompile(model)


def make_step(model, mode: str, args):
    """The callable of one mode, and its pass manager / regional step (for match counts)."""
    uncompile(model)
    if mode == "eager":  # bounded temporaries at full size (the model's default: the whole chains compile traces)
        model.set_eager_budget()
        return model.step
    model.set_eager_budget(None)
    passes = args.passes if mode == "passes" else "none"
    return minidi.compile(model, passes, strict=mode == "passes", backend=args.backend, fullgraph=True,
                          dynamic=True, regional=args.compile_scope == "layer",
                          faithful_rounding=ROUNDING[args.faithful_rounding], autotune=args.autotune,
                          cpu_simd=args.cpu_simd, precompile_kernels=not args.no_precompile,
                          compile_cache=args.compile_cache, compile_workers=args.compile_workers)


def pass_matches(step) -> dict | None:
    manager = getattr(step, "pass_manager", None)
    if manager is None or not manager.keys:
        return None
    return step.counts if hasattr(step, "counts") else dict(manager.counts)


COMPILE_RECORD_KEYS = ("compile_s", "compile_detail_s", "triton_jit", "kernel_precompile", "compile_workers", "cache",
                       "compile_cache")


def compile_record(step) -> dict:
    """The first step's split (``compile_s``: first_step, dynamo_trace, passes, backend = AOT + Inductor, aot,
    inductor_lowering / codegen, kernel_compile_wait, run_and_eager, cache_load / save; nested phases overlap) and
    the compile cache's record (``cache``: hit | miss | None; ``compile_cache``: reason, entry, artifact bytes)."""
    cc, first = getattr(step, "compile_cache", None), getattr(step, "first_step", None)
    return {"compile_s": getattr(step, "compile_s", None) or None,
            "compile_detail_s": first.detail if first is not None else None,  # every torch phase >= 0.05 s
            "triton_jit": first.triton.record() if first is not None else None,  # compiles in this process
            # minidi's kernels handed to the compile pool before each graph's first run (kernel_precompile.py)
            "kernel_precompile": first.precompile if first is not None else None,
            # layer kinds compiled in worker processes during an eager first step (compile_workers.py)
            "compile_workers": first.workers if first is not None else None,
            "cache": cc.status if cc else None,
            "compile_cache": cc.summary() if cc else None}


def _compile_settings(mode: str, args):
    """``--inductor_bytes`` in a compiled mode: Inductor records its own bytes per Triton kernel (``kernel_num_gb`` in
    the kernel's launch record, from the compile's size hints). Read from torch 2.13's source, ``benchmark_kernel``
    only appends a benchmark harness to each kernel module and that metadata, not the kernels' code (not verified on
    a GPU: docs/prefill_benchmark.md); the FX graph cache is off so that no graph compiled at other sizes (another
    --context point) is served with stale byte counts."""
    if not args.inductor_bytes or mode == "eager":
        return contextlib.nullcontext()
    return torch._inductor.config.patch(benchmark_kernel=True, fx_graph_cache=False, fx_graph_remote_cache=False)


def run_mode(mode: str, wl, args, card: dict, out_dir: Path, held: dict | None = None) -> dict:
    """One mode on one workload. ``held``: the last mode's step (``{"mode", "step"}``), reused when this mode is the
    same (a --context sweep compiles once; Dynamo recompiles by itself where a new size needs it) and replaced
    otherwise."""
    cfg, device = wl.model.cfg, args.device
    phase = common.Phases(f"[{mode}] ")
    run = lambda: step(wl.meta, wl.cache.tensors)  # noqa: E731
    reused = held is not None and held.get("mode") == mode
    if reused:
        step = held["step"]
    else:
        if held is not None:
            held.clear()  # make_step undoes the compile of the step held
        with phase("make step", announce=False):  # compiling is lazy: the first step compiles
            step = make_step(wl.model, mode, args)
        if held is not None and not args.inductor_bytes:  # Inductor's byte counts hold at the compile's sizes only
            held.update(mode=mode, step=step)
    with torch.no_grad(), dynamic_shape_config(), _compile_settings(mode, args):
        with phase("first step" + (" (compiles)" if mode != "eager" and not reused else "")) as first:
            logits = run()
            common.sync(device)
        if args.logits_out:  # the first step's logits, to compare two processes (a cold and a warm start) bitwise
            torch.save(logits.cpu(), f"{args.logits_out}.{mode}.pt")
        if args.warmup > 1:
            with phase(f"warm-up ({args.warmup - 1} step{'s' * (args.warmup > 2)})"):
                ticker = common.Ticker(f"[{mode}] warm-up steps", args.warmup - 1)
                for i in range(args.warmup - 1):
                    out = run()
                    common.sync(device)
                    if args.logits_out and i == 0:  # the second step's: a compiled step also where the first ran
                        torch.save(out.cpu(), f"{args.logits_out}.{mode}.step2.pt")  # eagerly (compile workers)
                    ticker.tick()
        with phase(f"timing ({args.steps} steps)"):
            times = common.step_times_ms(run, args.steps, device, common.Ticker(f"[{mode}] timed steps", args.steps))
        enqueue = common.host_enqueue_ms(run, 2, device)
        timers = host_timers.measure(run, args.host_timers, device, common.host_enqueue_ms) if args.host_timers \
            else None
        ab = launch_ab.measure(run, args.launch_ab, device) if args.launch_ab else None
        tag = f"{cfg.name}_{mode}_ep{cfg.ep_size}" + (f"_ctx{wl.cached_tokens}" if args.context else "")
        prof, trace = Profile({}, None, [], None), None
        if args.profile_steps and (not args.no_stage_markers or args.kernels):
            trace = out_dir / f"{tag}.trace.json.gz"
            with phase(f"profile ({args.profile_steps} steps)"):
                prof = profile_steps(step, wl, args.profile_steps, device, trace, args.kernels, card["peaks"],
                                     markers=not args.no_stage_markers,
                                     model_flops=kernel_model_flops(cfg, wl.new_tokens, wl.cached_tokens, wl.seqs),
                                     ep_size=cfg.ep_size)
        idle = None
        if args.profile_steps and common.is_cuda(device):
            with phase("device-only profile (1 step)"):
                idle = profile_idle(step, wl, device)
    ms = sum(times) / len(times)
    tokens = wl.new_tokens * wl.seqs
    flops = step_flops(cfg, wl.new_tokens, wl.cached_tokens, wl.seqs)["total"]
    stage_table = prof.stages
    res = {
        **_what_ran(mode, cfg, _sizes(wl), args, card),
        "ep_emulated": cfg.ep_size > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1,
        "compile_scope": args.compile_scope if mode != "eager" else None, "warmup": args.warmup,
        "ms_per_step": round(ms, 3),
        "ms_per_step_median": round(statistics.median(times), 3), "ms_per_step_min": round(min(times), 3),
        "host_enqueue_ms": [round(v, 3) for v in enqueue],
        "input_tok_per_s_per_gpu": round(tokens / ms * 1e3, 1),
        "mfu": round(mfu(flops, ms, card["peaks"]["bf16_tflops"]), 4), "tflop_per_step": round(flops / 1e12, 3),
        "flop_per_step": flops,
        "stages_ms": {k: round(v, 3) for k, v in stage_table.items()},
        "gpu_busy_ms": prof.gpu_busy_ms and round(prof.gpu_busy_ms, 3),
        "gpu_idle": idle,  # one step profiled with device activity only: its gaps (bench/gpu_idle.py)
        "host_ops": prof.host,  # the profiled steps' top-level host calls (bench/host_ops.py)
        "host_timers": timers,  # --host_timers: the host's split in steps with timers, no profiler
        "launch_ab": ab,  # --launch_ab: the step with Triton's launch path against fast_launch's, alternating
        "profile_steps": args.profile_steps, "profiled_step_sums_ms": [round(v, 3) for v in prof.step_sums],
        "pass_matches": pass_matches(step), "first_step_s": round(first.seconds, 1), "step_reused": reused,
        # from minidi.compile to the first step's logits (a warm start loads its precompiled graphs in the former)
        "startup_s": None if reused else round(phase.seconds.get("make step", 0.0) + first.seconds, 1),
        **(compile_record(step) if not reused else dict.fromkeys(COMPILE_RECORD_KEYS)),
        "logits_finite": bool(torch.isfinite(logits).all()), "stage_markers": not args.no_stage_markers,
        "cuda_graph": False, "trace": trace.name if trace else None,
        "phases_s": {k: round(v, 1) for k, v in phase.seconds.items()},
        # the FP8 linears' dequantised weights kept after the steps (minidi.ops.fp8_linear.dequant_weight)
        "fp8_weight_cache_gib": round(fp8_linear.weight_cache_bytes() / 2**30, 2),
    }
    if prof.kernels is not None:
        res["kernels"] = prof.kernels.rows
        res["kernels_summary"] = {**prof.kernels.summary(), "inductor_bytes": bool(args.inductor_bytes)}
    if stage_table:
        res["stage_sum_note"] = stage_sum_note(sum(stage_table.values()), times, common.is_cuda(device))
        res["png"] = _plot(stage_table, f"{cfg.name} {mode} EP{cfg.ep_size} {wl.cached_tokens:,} cached: "
                           f"{ms:.1f} ms/step", out_dir / f"{tag}.png")
    return res


def failed_mode(mode: str, cfg, sizes: dict, args, card: dict, error: BaseException, where: str = "step") -> dict:
    """The JSON line of a mode that could not run (out of memory in its steps, or in building the point's workload:
    ``failed_in``): what was asked, the error, the memory peak."""
    peak = None
    if common.is_cuda(args.device):
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        torch.cuda.empty_cache()
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return {
        **_what_ran(mode, cfg, sizes, args, card), "ms_per_step": None, "input_tok_per_s_per_gpu": None, "mfu": None,
        "stages_ms": {}, "pass_matches": None, "error": f"{type(error).__name__}: {first}", "failed_in": where,
        "max_memory_allocated_gib": peak,
    }


def _sizes(wl) -> dict:
    return {"new_tokens": wl.new_tokens, "cached_tokens": wl.cached_tokens, "seqs": wl.seqs,
            "pool_factor": wl.pool_factor}


def _what_ran(mode: str, cfg, sizes: dict, args, card: dict) -> dict:
    """The fields every result line has, run or failed: model, mode, passes, EP, workload sizes, and the card."""
    return {
        "model": cfg.name, "arch": cfg.arch, "mode": mode, "passes": args.passes if mode == "passes" else "none",
        "ep": cfg.ep_size, **sizes,
        "steps": args.steps, "faithful_rounding": None if mode == "eager" else ROUNDING[args.faithful_rounding],
        "autotune": None if mode == "eager" else args.autotune, "cpu_simd": None if mode == "eager" else args.cpu_simd,
        "precompile_kernels": None if mode == "eager" else not args.no_precompile,
        **{k: card[k] for k in ("device", "dtype", "torch", "peaks", "shared_experts", "engram_table_rows", "gate_bias",
                                  "ptxas", "fp4_tiles")},
    }


def _plot(table: dict, title: str, path: Path) -> str | None:
    try:
        if __package__:
            from .plot_stages import plot_stage_table
        else:
            from plot_stages import plot_stage_table

        return plot_stage_table(table, title, path).name
    except ImportError as e:  # e.g. the GPU image has no matplotlib: render later with bench/plot_stages.py
        common.say(f"(no PNG: {e}; run `python bench/plot_stages.py RESULTS.jsonl` where matplotlib is installed)")
        return None
