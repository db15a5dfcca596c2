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

``--compile_cache DIR`` saves the compiled artifacts after a cold first step and loads them in a later run
(``minidi/runtime/compile_cache.py``); the JSON line records ``cache`` (hit | miss), the entry's size and the first
step's split by phase (``compile_s``).

``--kernels N`` adds the top N kernels of the same profile (``kernel_table.py``: calls, ms and % of the step, FLOPs or
bytes per step, TFLOP/s or GB/s and % of the measured peak where the work is known). ``--context 16384,65536,...``
runs the benchmark once per cached-prefix length (same new tokens; one model, one workload at a time) and plots
ms/step against context beside the FLOP count (``plot_stages.py``). On a GPU, ``--profile_steps`` also profiles one
step with the device's activity only: its idle time between kernels and the largest gaps (``gpu_idle.py``); and the
host's top-level calls in the profiled steps, where a host-bound step spends its host time (``host_ops.py``).
``--host_timers N`` runs N more steps with wall-clock timers on minidi's ops and the kernel launches, no profiler
(``host_timers.py``): the host's split without the profiler's cost. ``--launch_ab N`` runs N rounds of the same step
with minidi's Triton launches through Triton's ``JITFunction.run`` and through ``fast_launch``'s kept kernels,
alternating (``launch_ab.py``).

Prints a card, a result table per mode and the stage table; the last line is one JSON object per mode (appended to
``--result_jsonl``); a Chrome trace (``.trace.json.gz``) and a PNG of the stage table go to ``--out_dir``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
from pathlib import Path

import torch
import torch._inductor.config

from minidi.model import stages
from minidi.ops.fp4_grouped_gemm_configs import default_config as fp4_default_config
from minidi.ops.fp4_grouped_gemm_configs import ptxas_version

if __package__:  # imported as bench.bench_prefill: python -m bench.bench_prefill, the tests
    from . import (common, expert_loads, gpu_idle, host_ops, host_timers, kernel_table, launch_ab, prefill_stages,
                   prefill_workload)
    from .prefill_modes import (ROUNDING, _compile_settings, _sizes, _what_ran, failed_mode, make_step,  # noqa: F401
                                run_mode)
else:  # run as a script (python / torchrun bench/bench_prefill.py): the script's folder is sys.path[0]
    import common
    import expert_loads
    import gpu_idle
    import host_ops
    import host_timers
    import kernel_table
    import launch_ab
    import prefill_stages
    import prefill_workload
    from prefill_modes import (ROUNDING, _compile_settings, _sizes, _what_ran, failed_mode, make_step,  # noqa: F401
                               run_mode)

MODES = ("eager", "compile", "passes")




def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-v41", help="checkpoint directory or preset (tiny-v41, v41-flash, ...)")
    ap.add_argument("--prefill_batch_size", type=int, default=None,
                    help="new tokens per sequence per step (default 4096 full-size, 64 tiny)")
    ap.add_argument("--cached_tokens", type=int, default=None,
                    help="cached prefix per sequence (default 126976 full-size, 192 tiny; 0 = none)")
    ap.add_argument("--context", default=None, metavar="P1,P2,...",
                    help="a sweep instead of --cached_tokens: one run per cached-prefix length (e.g. 16384,65536,"
                         "131072,524288,1044480: cached + new <= the model's 1M positions), same new tokens, one JSON "
                         "line per point and mode, and a plot")
    ap.add_argument("--pool_factor", type=int, default=1,
                    help="cache pools N times the positions the step needs (a step's cost must not grow with them)")
    ap.add_argument("--seqs", type=int, default=1, help="sequences per step (each with its own cached prefix)")
    ap.add_argument("--modes", default=None, help="comma list of eager,compile,passes (default: all on CUDA, eager "
                    "on the CPU)")
    ap.add_argument("--passes", default="all",
                    help="passes of the 'passes' mode: all | A,B,... (docs/passes.md)")
    ap.add_argument("--compile_scope", choices=("layer", "model"), default="layer")
    ap.add_argument("--backend", default="inductor", help="inner torch.compile backend")
    ap.add_argument("--compile_cache", default=None, metavar="DIR",
                    help="compiled artifacts for warm starts (minidi.compile's compile_cache): loaded when an entry "
                         "for this model, settings, software and device exists, else written after the first step")
    ap.add_argument("--compile_workers", type=int, default=None, metavar="N",
                    help="per-layer compile: compile the layer kinds in N worker processes at once while the first "
                         "step runs its layers eagerly (0: in this process, one after another; default: one per kind "
                         "up to half the CPUs on a GPU, up to every CPU on a CPU with Inductor and >= 2 CPUs; "
                         "minidi.compile's compile_workers)")
    ap.add_argument("--faithful_rounding", choices=("on", "off", "exact"), default="on",
                    help="on: compiled modes round where eager does (Inductor emulate_precision_casts; CPU graphs also "
                         "run ATen's reduction / transcendental kernels: bitwise eager); exact: those kernels on GPU "
                         "graphs too; off: Inductor's stock rounding")
    ap.add_argument("--autotune", action="store_true",
                    help="compiled modes: Inductor benchmarks its kernels' candidate configs at each graph's first "
                         "run (default: one config each, reductions' by rule; minidi.compile's autotune)")
    ap.add_argument("--cpu_simd", action="store_true",
                    help="compiled modes on the CPU: vectorised C++ (default: scalar C++, same results, a faster "
                         "compile; minidi.compile's cpu_simd)")
    ap.add_argument("--no_precompile", action="store_true",
                    help="compiled modes on a GPU: compile minidi's Triton kernels at their first launch, one after "
                         "another (default: in a thread pool while AOT and Inductor work on each graph; "
                         "minidi.compile's precompile_kernels)")
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
    ap.add_argument("--profile_steps", type=int, default=None,
                    help="profiled steps of the stage table, its median per stage (default 2 on a GPU, 5 on the "
                         "CPU; 0 = no profile / stage table)")
    ap.add_argument("--no_stage_markers", action="store_true", help="time without the stage markers (no table)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="the top N kernels of the profile (calls, ms, FLOPs / bytes, rate, %% of peak; 25 is a good "
                         "size; 0 = off). Records shapes and FLOPs in the profile (the profiler's cost grows)")
    ap.add_argument("--host_timers", type=int, default=0, metavar="N",
                    help="N more steps after the timed ones with timers on minidi's ops, Triton's and Inductor's "
                         "launches, no profiler: where the host goes (host_timers.py; 0 = off)")
    ap.add_argument("--launch_ab", type=int, default=0, metavar="N",
                    help="N rounds after the timed steps of the step with every Triton launch through "
                         "JITFunction.run against fast_launch's kept kernels, alternating (launch_ab.py; 0 = off)")
    ap.add_argument("--inductor_bytes", action="store_true",
                    help="with --kernels, compiled modes: Inductor's own bytes per Triton kernel (compiles with "
                         "torch._inductor.config.benchmark_kernel, FX graph cache off, recompiled per --context point)")
    ap.add_argument("--no_cuda_graph", action="store_true",
                    help="accepted for the reference command; minidi never captures CUDA graphs for prefill")
    ap.add_argument("--expert_loads", action="store_true",
                    help="after the modes, one eager step that records the router's rows per local expert and layer "
                         "(bench/expert_loads.py; OUT_DIR/<model>_ep<N>_expert_loads.json)")
    ap.add_argument("--logits_out", default=None, metavar="PREFIX",
                    help="save each mode's first-step logits to PREFIX.<mode>.pt and, with --warmup > 1, the second "
                         "step's to PREFIX.<mode>.step2.pt (to compare runs bitwise; with compile workers the first "
                         "step runs its layers eagerly)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result_jsonl", default=None)
    ap.add_argument("--out_dir", default=None, help="traces and PNGs (default: next to --result_jsonl, or ./bench_out)")
    return ap.parse_args(argv)


def _plot_context(lines: list[dict], title: str, path: Path) -> str | None:
    try:
        if __package__:
            from .plot_stages import plot_context
        else:
            from plot_stages import plot_context

        return str(plot_context(lines, title, path))
    except ImportError as e:
        common.say(f"(no context PNG: {e}; run `python bench/plot_stages.py RESULTS.jsonl --context` where "
                   "matplotlib is installed)")
        return None


def fp4_default_tiles(device: str) -> dict[str, str] | None:
    """The FP4 expert GEMM's default tile per regime (mean rows per expert 256 / 64: EP4- / EP1-like), on a GPU."""
    if not common.is_cuda(device):
        return None
    dev = torch.device(device)
    return {f"rows_per_expert_{rows}": fp4_default_config(rows * 96, 96, 2304, 5120, torch.bfloat16, dev).name()
            for rows in (256, 64)}


# ---- main ----------------------------------------------------------------------------------------------------------
def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill the workload defaults: full-size presets 4,096 new + 126,976 cached tokens, tiny ones 64 + 192. An explicit
    value is kept, 0 included (``--cached_tokens 0``: a prefill with no cached prefix). ``--context`` becomes the list
    of its points (``args.context``; None without a sweep) and ``args.points`` the cached lengths to run."""
    full = args.model in prefill_workload.FULL_SIZE
    if args.prefill_batch_size is None:
        args.prefill_batch_size = 4096 if full else 64
    if args.context is not None:
        if args.cached_tokens is not None:
            raise SystemExit("--context is a sweep of cached-prefix lengths; it replaces --cached_tokens: give one")
        try:
            points = [int(p.strip().replace("_", "")) for p in args.context.split(",") if p.strip()]
        except ValueError:
            raise SystemExit(f"--context takes a comma list of token counts (e.g. 16384,65536), got {args.context!r}")
        if not points or any(p < 0 for p in points) or len(set(points)) != len(points):
            raise SystemExit(f"--context needs distinct token counts >= 0, got {args.context!r}")
        args.context = points
    elif args.cached_tokens is None:
        args.cached_tokens = 126_976 if full else 192
    args.points = args.context or [args.cached_tokens]
    if args.kernels < 0:
        raise SystemExit(f"--kernels N: the top N kernels (0 = off), got {args.kernels}")
    if args.host_timers < 0:
        raise SystemExit(f"--host_timers N: steps with the host's timers on (0 = off), got {args.host_timers}")
    if args.launch_ab < 0:
        raise SystemExit(f"--launch_ab N: rounds of the launch paths' A/B (0 = off), got {args.launch_ab}")
    if args.inductor_bytes and not args.kernels:
        raise SystemExit("--inductor_bytes feeds the kernel table: add --kernels N")
    if args.inductor_bytes and args.compile_cache:
        raise SystemExit("--inductor_bytes needs fresh compiles (byte counts are fixed at the compile's sizes): "
                         "drop --compile_cache")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), 0
    if world > 1:  # torchrun: data-parallel attention + expert-parallel MoE (minidi.runtime.distributed)
        if args.emulate_ep > 1:
            raise SystemExit(f"--emulate-ep {args.emulate_ep} emulates expert parallelism on one GPU; under torchrun "
                             f"with WORLD_SIZE {world} the {world} ranks are real: drop --emulate-ep")
        from minidi.runtime.distributed import init_from_env

        rank, world = init_from_env(device=args.device)
        if common.is_cuda(args.device):
            args.device = f"cuda:{os.environ['LOCAL_RANK']}"
        if rank:  # only rank 0 reports (common.say); the others run the same steps (every MoE layer needs all ranks)
            args.out_dir = str(Path(args.out_dir or (Path(args.result_jsonl).parent if args.result_jsonl
                                                     else "bench_out")) / f"rank{rank}")  # their own traces
            args.result_jsonl = None
    resolve_sizes(args)
    if args.profile_steps is None:
        args.profile_steps = 2 if common.is_cuda(args.device) else 5
    if args.kernels and not args.profile_steps:
        raise SystemExit("--kernels reads the profile: --profile_steps must be >= 1")
    modes = (args.modes or ("eager,compile,passes" if common.is_cuda(args.device) else "eager")).split(",")
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
    phase = common.Phases()
    with phase(f"build model {args.model}"):
        model = prefill_workload.build_model(args.model, args.device, args.dtype, args.emulate_ep, args.share_experts,
                                             args.engram_table_rows, args.seed, notes, world=world, rank=rank,
                                             gate_bias=args.gate_bias)
        common.sync(args.device)
    with phase("measure peaks"):  # before any workload: at 1M context the cache leaves little room
        peaks = common.measure_peaks(args.device)
    cfg = model.cfg
    card = {
        "device": common.device_name(args.device), "dtype": cfg.dtype, "torch": torch.__version__, "peaks": peaks,
        "shared_experts": any("shared by all" in n for n in notes), "engram_table_rows": model.engram_rows or 0,
        "gate_bias": (args.gate_bias or "zero") if args.model in prefill_workload.FULL_SIZE else "checkpoint",
        "ptxas": ".".join(map(str, ptxas_version() or ())) or None, "fp4_tiles": fp4_default_tiles(args.device),
    }
    common.say(f"\nminidi prefill | {card['device']} ({args.device}) | peaks: {peaks['bf16_tflops']} TFLOP/s bf16 "
               f"matmul, {peaks['copy_gbps']} GB/s copy (measured now) | torch {torch.__version__}")
    cached = " | ".join(f"{p:,}" for p in args.points)
    common.say(f"model {cfg.name} ({cfg.arch}, {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_routed_experts} experts, "
               f"EP{cfg.ep_size}) | {cfg.dtype}, fake_quant {cfg.fake_quant} | {args.seqs} x ({cached} cached + "
               f"{args.prefill_batch_size:,} new) tokens")
    if card["fp4_tiles"]:
        common.say(f"  note: ptxas {card['ptxas']}: FP4 expert GEMM default tiles "
                   + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in card["fp4_tiles"].items()))
    for n in notes:
        common.say(f"  note: {n}")
    if not args.no_stage_markers:
        common.say("  note: stage markers on (profiler ranges kept through torch.compile; --no_stage_markers to drop "
                   "them)")

    results, lines, held, wl = [], [], {}, None
    for i, point in enumerate(args.points):
        wl = None  # free the last point's cache before building the next (at 1M context memory matters)
        gc.collect()
        if common.is_cuda(args.device):
            torch.cuda.empty_cache()
        if args.context:
            common.say(f"\n== context point {i + 1}/{len(args.points)}: {point:,} cached + "
                       f"{args.prefill_batch_size:,} new tokens per sequence")
        sizes = {"new_tokens": args.prefill_batch_size, "cached_tokens": point, "seqs": args.seqs,
                 "pool_factor": args.pool_factor}
        try:
            if args.context and point + args.prefill_batch_size > cfg.max_position_embeddings:  # (else: exits)
                raise PositionsExceeded(f"cached {point} + new {args.prefill_batch_size} tokens exceed "
                                        f"max_position_embeddings {cfg.max_position_embeddings} of {cfg.name}")
            wl = _build_workload(model, point, args, phase)
        except (torch.OutOfMemoryError, PositionsExceeded) as e:  # a line for each mode; the next point still runs
            for mode in modes:
                res = failed_mode(mode, cfg, sizes, args, card, e, where="build workload")
                common.say(f"[{mode}] FAILED: {res['error']} (building the workload)")
                lines.append(res)
                common.emit_json(res, jsonl=args.result_jsonl)
            continue
        point_results: list[dict] = []
        for mode in modes:
            common.say()
            try:
                res = run_mode(mode, wl, args, card, out_dir, held)
            except torch.OutOfMemoryError as e:  # recorded, and the next mode still runs
                res = failed_mode(mode, cfg, _sizes(wl), args, card, e)
            lines.append(res)
            if res.get("error"):
                common.say(f"[{mode}] FAILED: {res['error']}")
                common.emit_json(res, jsonl=args.result_jsonl)
                continue
            results.append(res)
            point_results.append(res)
            _report_mode(res, args)
            res["speedup_vs"] = {r["mode"]: round(r["ms_per_step"] / res["ms_per_step"], 3)
                                 for r in point_results[:-1]}
            common.emit_json(res, jsonl=args.result_jsonl)  # as soon as the mode is done: a later one may run out
    if args.context and len(args.points) > 1:
        png = _plot_context(lines, f"{cfg.name} EP{cfg.ep_size}, {args.prefill_batch_size:,} new tokens",
                            out_dir / f"{cfg.name}_ep{cfg.ep_size}_context.png")
        if png:
            common.say(f"\ncontext plot: {png}")
    if args.expert_loads and wl is not None:
        _report_expert_loads(wl, args, world, out_dir)
    if world > 1:
        torch.distributed.destroy_process_group()
    return results


class PositionsExceeded(ValueError):
    """A --context point longer than the model's positions: its line records it and the sweep goes on (a single
    --cached_tokens point exits, as ``build_workload`` does)."""


def _build_workload(model, cached: int, args, phase: common.Phases):
    """One point's workload, its notes and the memory it left allocated printed."""
    notes: list[str] = []
    with phase(f"build workload ({cached:,} cached)" if args.context else "build workload"):
        wl = prefill_workload.build_workload(model, args.prefill_batch_size, cached, args.seqs, args.seed, notes,
                                             pool_factor=args.pool_factor)
        common.sync(args.device)
    if common.is_cuda(args.device):
        common.say(f"  {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated (model + cache)")
    for n in notes:
        common.say(f"  note: {n}")
    return wl


def _report_mode(res: dict, args) -> None:
    """A mode's result lines: speed, MFU, compile; the stage table; the kernel table."""
    mode = res["mode"]
    common.say(f"[{mode}] {res['ms_per_step']:.2f} ms/step (median {res['ms_per_step_median']:.2f}) | "
               f"{res['input_tok_per_s_per_gpu']:,.0f} input tok/s/GPU | MFU {100 * res['mfu']:.1f}% of the "
               f"measured peak | {res['tflop_per_step']} TFLOP/step | first step {res['first_step_s']}s"
               + (f" (start-up {res['startup_s']}s)" if res.get("startup_s") and mode != "eager" else "")
               + ((" (compiled step reused)" if mode != "eager" else " (step reused)") if res["step_reused"] else "")
               + (f" (compile cache {res['cache']})" if res["cache"] else "")
               + (f" | pass matches {res['pass_matches']}" if res["pass_matches"] else ""))
    if res["stages_ms"]:
        common.say(f"stages, median over {args.profile_steps} profiled steps (their sums: "
                   f"{', '.join(f'{v:.2f}' for v in res['profiled_step_sums_ms'])} ms):")
        common.say(prefill_stages.format_stage_table(res["stages_ms"], gpu_busy_ms=res["gpu_busy_ms"],
                   wall_ms=res["ms_per_step_median"]))
        if res["stage_sum_note"]:
            common.say(f"  note: {res['stage_sum_note']}")
    if "kernels" in res:
        common.say(kernel_table.format_kernel_table(res["kernels"], res["kernels_summary"], res["peaks"]))
    if res.get("gpu_idle"):
        common.say(gpu_idle.format_idle(res["gpu_idle"]))
    if res.get("host_ops"):
        common.say(host_ops.format_host_ops({**res["host_ops"], "ops": res["host_ops"]["ops"][:10]}))
    if res.get("host_timers"):
        common.say(host_timers.format_host_timers(res["host_timers"]))
    if res.get("launch_ab"):
        common.say(launch_ab.format_launch_ab(res["launch_ab"]))


def _report_expert_loads(wl, args, world: int, out_dir: Path) -> None:
    """One eager step with hooks on the gates (not timed): rows per local expert, per layer (bench/expert_loads.py)."""
    step = make_step(wl.model, "eager", args)
    try:
        with common.Phases()("expert loads (one eager step)"):
            report = expert_loads.expert_loads(wl.model, lambda: step(wl.meta, wl.cache.tensors),
                                               args.emulate_ep if world == 1 else 1)
    except torch.OutOfMemoryError as e:
        common.say(f"\nexpert loads: not measured ({type(e).__name__})")
        return
    cfg = wl.model.cfg
    common.say("\n" + expert_loads.write_report(report, out_dir / f"{cfg.name}_ep{cfg.ep_size}_expert_loads.json"))


def _log_minidi() -> None:
    """minidi's own progress lines (compile phases, pass matches: logger ``minidi``, INFO) on rank 0."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if common.rank() == 0:
        logging.getLogger("minidi").setLevel(logging.INFO)


if __name__ == "__main__":
    _log_minidi()
    main()
