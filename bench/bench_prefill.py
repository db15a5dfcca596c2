"""Prefill benchmark in the reference engine's protocol.

    python bench/bench_prefill.py                       # tiny V4.1 default on the CPU, eager, about a minute
    torchrun --nproc-per-node 1 bench/bench_prefill.py --model v41-flash --prefill_batch_size 4096 \\
        --no_cuda_graph --result_jsonl results.jsonl --modes eager,compile,passes --emulate-ep 4

Workload (``prefill_workload.py``): a context of cached + new tokens per sequence (full-size default 126,976 cached +
4,096 new, the report's 131,072), the cached prefix filled with random cache rows and not timed. Per mode: warm-up
steps (the first one compiles), then ``--steps`` steps timed with CUDA events, then a ``--profile_steps`` torch
profile whose kernels are charged to the model's stage markers (``minidi.model.stages``), in the report's
categories. Modes: ``eager`` (no compile), ``compile`` (stock ``torch.compile``, no minidi passes), ``passes``
(``torch.compile`` with ``--passes``). Layers are compiled one by one by default (``--compile_scope layer``: layers of
one kind share a graph; ``model`` compiles the whole step as one graph).

Prints a card, a result table per mode and the stage table; the last line is one JSON object per mode (appended to
``--result_jsonl``); a Chrome trace (``.trace.json.gz``) and a PNG of the stage table go to ``--out_dir``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling bench modules, also under torchrun

import minidi  # noqa: E402
from minidi.model import stages  # noqa: E402
from minidi.ops.fp4_grouped_gemm_configs import ptxas_version, swap_tiles_enabled  # noqa: E402
from minidi.runtime.engine import dynamic_shape_config  # noqa: E402
from minidi.runtime.flops import mfu, step_flops  # noqa: E402
from expert_loads import expert_loads, write_report  # noqa: E402
from prefill_stages import format_stage_table, gpu_busy_ms_per_step, stage_ms_per_step  # noqa: E402
from prefill_workload import FULL_SIZE, build_model, build_workload  # noqa: E402

MODES = ("eager", "compile", "passes")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-v41", help="checkpoint directory or preset (tiny-v41, v41-flash, ...)")
    ap.add_argument("--prefill_batch_size", type=int, default=None,
                    help="new tokens per sequence per step (default 4096 full-size, 64 tiny)")
    ap.add_argument("--cached_tokens", type=int, default=None,
                    help="cached prefix per sequence (default 126976 full-size, 192 tiny)")
    ap.add_argument("--seqs", type=int, default=1, help="sequences per step (each with its own cached prefix)")
    ap.add_argument("--modes", default=None, help="comma list of eager,compile,passes (default: all on CUDA, eager "
                    "on the CPU)")
    ap.add_argument("--passes", default="all",
                    help="passes of the 'passes' mode: all | A,B,... (docs/passes.md)")
    ap.add_argument("--compile_scope", choices=("layer", "model"), default="layer")
    ap.add_argument("--backend", default="inductor", help="inner torch.compile backend")
    ap.add_argument("--faithful_rounding", choices=("on", "off"), default="on",
                    help="compiled modes round where eager does (Inductor emulate_precision_casts)")
    ap.add_argument("--emulate-ep", "--emulate_ep", dest="emulate_ep", type=int, default=1,
                    help="reproduce one rank of expert parallelism N on this device")
    ap.add_argument("--share_experts", "--share-experts", choices=("auto", "on", "off"), default="auto",
                    help="one routed-expert set for all layers (auto: on for random full-size presets)")
    ap.add_argument("--engram_table_rows", type=int, default=None,
                    help="rows of the random Engram tables (default 2^24 for random full-size presets; 0 = real)")
    ap.add_argument("--gate_bias", choices=("zero", "random"), default=None,
                    help="random presets' router bias: zero (default: balanced expert loads) or random (the old 0.3 x "
                         "randn: skewed loads, max/mean 16.6 at V4.1 EP4)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile_steps", type=int, default=2, help="0 = no profile / stage table")
    ap.add_argument("--no_stage_markers", action="store_true", help="time without the stage markers (no table)")
    ap.add_argument("--no_cuda_graph", action="store_true",
                    help="accepted for the reference command; minidi never captures CUDA graphs for prefill")
    ap.add_argument("--expert_loads", action="store_true",
                    help="after the modes, one eager step that records the router's rows per local expert and layer "
                         "(bench/expert_loads.py; OUT_DIR/<model>_ep<N>_expert_loads.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result_jsonl", default=None)
    ap.add_argument("--out_dir", default=None, help="traces and PNGs (default: next to --result_jsonl, or ./bench_out)")
    return ap.parse_args(argv)


# ---- measurement -----------------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_peaks(device: str, dtype: torch.dtype) -> dict:
    """bf16 (model dtype) matmul TFLOP/s and copy GB/s measured now, on this device."""
    m, n = (8192, 1 << 28) if device.startswith("cuda") else (512, 1 << 22)
    a = torch.randn(m, m, device=device, dtype=dtype)
    x = torch.empty(n, device=device)
    y = torch.empty_like(x)
    out = {}
    for name, fn, work in (("matmul_tflops", lambda: a @ a, 2 * m**3 / 1e12), ("copy_gbs", lambda: y.copy_(x),
                                                                                   8 * n / 1e9)):
        fn()
        _sync(device)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t)
        out[name] = float(f"{work / statistics.median(times):.4g}")
    del a, x, y
    return out


def time_steps(step, wl, n: int, device: str) -> list[float]:
    """ms of each of n steps: CUDA events on the GPU, wall clock on the CPU."""
    out = []
    for _ in range(n):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(wl.meta, wl.cache.tensors)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            step(wl.meta, wl.cache.tensors)
            out.append((time.perf_counter() - t) * 1e3)
    return out


def profile_steps(step, wl, n: int, device: str, trace_path: Path) -> tuple[dict, float | None]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            with torch.profiler.record_function("minidi/step"):
                step(wl.meta, wl.cache.tensors)
            _sync(device)
    raw = trace_path.with_suffix("")  # .trace.json
    prof.export_chrome_trace(str(raw))
    cuda = device.startswith("cuda")
    table = stage_ms_per_step(raw, n, cuda=cuda)
    busy = gpu_busy_ms_per_step(raw, n) if cuda else None
    with open(raw, "rb") as f, gzip.open(trace_path, "wb") as g:
        shutil.copyfileobj(f, g)
    raw.unlink()
    return table, busy


# ---- modes -------------------------------------------------------------------------------------------------------
def make_step(model, mode: str, args):
    """The callable of one mode, and its pass manager / regional step (for match counts)."""
    torch._dynamo.reset()
    minidi.uncompile(model)  # undo an earlier mode's per-layer compile
    if mode == "eager":  # bounded temporaries at full size (the model's default: the whole chains compile traces)
        model.set_eager_budget()
        return model.step
    model.set_eager_budget(None)
    passes = args.passes if mode == "passes" else "none"
    return minidi.compile(model, passes, strict=mode == "passes", backend=args.backend, fullgraph=True,
                          dynamic=True, regional=args.compile_scope == "layer",
                          faithful_rounding=args.faithful_rounding == "on")


def pass_matches(step) -> dict | None:
    manager = getattr(step, "pass_manager", None)
    if manager is None or not manager.keys:
        return None
    return step.counts if hasattr(step, "counts") else dict(manager.counts)


def run_mode(mode: str, wl, args, card: dict, out_dir: Path) -> dict:
    cfg, device = wl.model.cfg, args.device
    step = make_step(wl.model, mode, args)
    with torch.no_grad(), dynamic_shape_config():
        t0 = time.perf_counter()
        logits = step(wl.meta, wl.cache.tensors)
        _sync(device)
        first_s = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            step(wl.meta, wl.cache.tensors)
        _sync(device)
        times = time_steps(step, wl, args.steps, device)
        tag = f"{cfg.name}_{mode}_ep{cfg.ep_size}"
        stage_table, busy, trace = {}, None, None
        if args.profile_steps and not args.no_stage_markers:
            trace = out_dir / f"{tag}.trace.json.gz"
            stage_table, busy = profile_steps(step, wl, args.profile_steps, device, trace)
    ms = sum(times) / len(times)
    tokens = wl.new_tokens * wl.seqs
    flops = step_flops(cfg, wl.new_tokens, wl.cached_tokens, wl.seqs)["total"]
    res = {
        **_what_ran(mode, wl, args, card),
        "ep_emulated": cfg.ep_size > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1,
        "compile_scope": args.compile_scope if mode != "eager" else None, "warmup": args.warmup,
        "ms_per_step": round(ms, 3),
        "ms_per_step_median": round(statistics.median(times), 3), "ms_per_step_min": round(min(times), 3),
        "input_tok_per_s_per_gpu": round(tokens / ms * 1e3, 1),
        "mfu": round(mfu(flops, ms, card["peaks"]["matmul_tflops"]), 4), "tflop_per_step": round(flops / 1e12, 3),
        "stages_ms": {k: round(v, 3) for k, v in stage_table.items()}, "gpu_busy_ms": busy and round(busy, 3),
        "pass_matches": pass_matches(step), "first_step_s": round(first_s, 1), "logits_finite":
        bool(torch.isfinite(logits).all()), "stage_markers": not args.no_stage_markers, "cuda_graph": False,
        "trace": trace.name if trace else None,
    }
    if stage_table:
        res["png"] = _plot(stage_table, f"{cfg.name} {mode} EP{cfg.ep_size}: {ms:.1f} ms/step", out_dir / f"{tag}.png")
    return res


def failed_mode(mode: str, wl, args, card: dict, error: BaseException) -> dict:
    """The JSON line of a mode that could not run (out of memory): what was asked, the error, the memory peak."""
    peak = None
    if args.device.startswith("cuda"):
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        torch.cuda.empty_cache()
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return {
        **_what_ran(mode, wl, args, card), "ms_per_step": None, "input_tok_per_s_per_gpu": None, "mfu": None,
        "stages_ms": {}, "pass_matches": None, "error": f"{type(error).__name__}: {first}",
        "max_memory_allocated_gib": peak,
    }


def _what_ran(mode: str, wl, args, card: dict) -> dict:
    """The fields every result line has, run or failed: model, mode, passes, EP, workload, and the card."""
    cfg = wl.model.cfg
    return {
        "model": cfg.name, "arch": cfg.arch, "mode": mode, "passes": args.passes if mode == "passes" else "none",
        "ep": cfg.ep_size, "new_tokens": wl.new_tokens, "cached_tokens": wl.cached_tokens, "seqs": wl.seqs,
        "steps": args.steps,
        **{k: card[k] for k in ("device", "dtype", "torch", "peaks", "shared_experts", "engram_table_rows", "gate_bias",
                                  "ptxas", "fp4_swap_tiles")},
    }


def _write_line(res: dict, args) -> None:
    line = json.dumps(res)  # written as soon as the mode is done: a later mode may run out of time
    print(line, flush=True)
    if args.result_jsonl:
        with open(args.result_jsonl, "a") as f:
            f.write(line + "\n")


def _plot(table: dict, title: str, path: Path) -> str | None:
    try:
        from plot_stages import plot_stage_table

        return plot_stage_table(table, title, path).name
    except ImportError as e:  # e.g. the GPU image has no matplotlib: render later with bench/plot_stages.py
        print(f"(no PNG: {e}; run `python bench/plot_stages.py RESULTS.jsonl` where matplotlib is installed)")
        return None


# ---- main ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), 0
    if world > 1:  # torchrun: data-parallel attention + expert-parallel MoE (minidi.runtime.distributed)
        if args.emulate_ep > 1:
            raise SystemExit(f"--emulate-ep {args.emulate_ep} emulates expert parallelism on one GPU; under torchrun "
                             f"with WORLD_SIZE {world} the {world} ranks are real: drop --emulate-ep")
        from minidi.runtime.distributed import init_from_env

        rank, world = init_from_env(device=args.device)
        if args.device.startswith("cuda"):
            args.device = f"cuda:{os.environ['LOCAL_RANK']}"
        if rank:  # only rank 0 reports; the others run the same steps (every MoE layer needs all ranks)
            args.out_dir = str(Path(args.out_dir or (Path(args.result_jsonl).parent if args.result_jsonl
                                                     else "bench_out")) / f"rank{rank}")  # their own traces
            args.result_jsonl = None
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    full = args.model in FULL_SIZE
    args.prefill_batch_size = args.prefill_batch_size or (4096 if full else 64)
    args.cached_tokens = 126_976 if (args.cached_tokens is None and full) else (args.cached_tokens or 192)
    modes = (args.modes or ("eager,compile,passes" if args.device.startswith("cuda") else "eager")).split(",")
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {MODES}")
    out_dir = Path(args.out_dir or (Path(args.result_jsonl).parent if args.result_jsonl else "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    markers_were = stages.enabled()
    stages.enabled(not args.no_stage_markers)
    try:
        return _run(args, world, rank, modes, out_dir)
    finally:
        stages.enabled(markers_were)


def _run(args: argparse.Namespace, world: int, rank: int, modes: list[str], out_dir: Path) -> list[dict]:
    notes: list[str] = []
    t0 = time.perf_counter()
    model = build_model(args.model, args.device, args.dtype, args.emulate_ep, args.share_experts,
                        args.engram_table_rows, args.seed, notes, world=world, rank=rank, gate_bias=args.gate_bias)
    wl = build_workload(model, args.prefill_batch_size, args.cached_tokens, args.seqs, args.seed, notes)
    cfg = model.cfg
    card = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else (platform.processor() or "cpu"),
        "dtype": cfg.dtype, "torch": torch.__version__, "peaks": measure_peaks(args.device, cfg.torch_dtype),
        "shared_experts": any("shared by all" in n for n in notes), "engram_table_rows": model.engram_rows or 0,
        "gate_bias": (args.gate_bias or "zero") if args.model in FULL_SIZE else "checkpoint",
        "ptxas": ".".join(map(str, ptxas_version() or ())) or None, "fp4_swap_tiles": swap_tiles_enabled(),
    }
    mem = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated" if args.device.startswith("cuda") else ""
    print(f"minidi prefill | {card['device']} ({args.device}) | peaks: {card['peaks']['matmul_tflops']} TFLOP/s "
          f"{cfg.dtype} matmul, {card['peaks']['copy_gbs']} GB/s copy (measured now) | torch {torch.__version__}")
    print(f"model {cfg.name} ({cfg.arch}, {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_routed_experts} experts, "
          f"EP{cfg.ep_size}) | {cfg.dtype}, fake_quant {cfg.fake_quant} | {wl.seqs} x ({wl.cached_tokens:,} cached + "
          f"{wl.new_tokens:,} new) tokens | built in {time.perf_counter() - t0:.1f}s{mem}")
    if args.device.startswith("cuda"):
        print(f"  note: ptxas {card['ptxas']}: FP4 expert GEMM tiles "
              + ("swapped, two warpgroups (MINIDI_FP4_SWAP=1: racy with Triton 3.6, for experiments)"
                 if card["fp4_swap_tiles"] else "swapped, one warpgroup (the race-free defaults)"))
    for n in notes:
        print(f"  note: {n}")
    if not args.no_stage_markers:
        print("  note: stage markers on (profiler ranges kept through torch.compile; --no_stage_markers to drop them)")

    results = []
    for mode in modes:
        try:
            res = run_mode(mode, wl, args, card, out_dir)
        except torch.OutOfMemoryError as e:  # recorded, and the next mode still runs
            res = failed_mode(mode, wl, args, card, e)
        if res.get("error"):
            print(f"\n[{mode}] FAILED: {res['error']}")
            _write_line(res, args)
            continue
        results.append(res)
        print(f"\n[{mode}] {res['ms_per_step']:.2f} ms/step (median {res['ms_per_step_median']:.2f}) | "
              f"{res['input_tok_per_s_per_gpu']:,.0f} input tok/s/GPU | MFU {100 * res['mfu']:.1f}% of the measured "
              f"peak | {res['tflop_per_step']} TFLOP/step | first step {res['first_step_s']}s"
              + (f" | pass matches {res['pass_matches']}" if res["pass_matches"] else ""))
        if res["stages_ms"]:
            print(format_stage_table(res["stages_ms"], gpu_busy_ms=res["gpu_busy_ms"], wall_ms=res["ms_per_step"]))
        res["speedup_vs"] = {r["mode"]: round(r["ms_per_step"] / res["ms_per_step"], 3) for r in results[:-1]}
        _write_line(res, args)
    if args.expert_loads:
        _report_expert_loads(wl, args, world, out_dir)
    if world > 1:
        torch.distributed.destroy_process_group()
    return results


def _report_expert_loads(wl, args, world: int, out_dir: Path) -> None:
    """One eager step with hooks on the gates (not timed): rows per local expert, per layer (bench/expert_loads.py)."""
    step = make_step(wl.model, "eager", args)
    try:
        report = expert_loads(wl.model, lambda: step(wl.meta, wl.cache.tensors), args.emulate_ep if world == 1 else 1)
    except torch.OutOfMemoryError as e:
        print(f"\nexpert loads: not measured ({type(e).__name__})")
        return
    cfg = wl.model.cfg
    print("\n" + write_report(report, out_dir / f"{cfg.name}_ep{cfg.ep_size}_expert_loads.json"))


if __name__ == "__main__":
    main()
