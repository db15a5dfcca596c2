"""Per-stage time of a profiled prefill step, from the Chrome trace ``torch.profiler`` exports.

The model marks its stages with profiler ranges ``minidi/<stage>`` (``minidi.model.stages``; off unless
``stages.enabled(True)`` was set before compiling). This file turns a trace into the reference report's categories:

    sparse_attention_core <- minidi/attn.core        moe            <- minidi/moe (without moe.comm)
    other_attention       <- minidi/attn (without    communication  <- minidi/moe.comm
                             its nested ranges)      hc_norm_other  <- everything else
    indexer               <- minidi/indexer

CUDA runs: a range lives on the CPU thread that launched the work, while the kernels run later on the device, so
each kernel / memcpy / memset is tied to its launch (``cudaLaunchKernel``, ``cuLaunchKernel``, ... same
``args.correlation``) and charged to the innermost stage range *of the launching thread* that contains the launch.

The call of one of minidi's ops (its ``cpu_op`` event, e.g. ``minidi::sparse_attention``) is a range of its own
stage (``OP_STAGE``): a marker orders only the kernels that touch its tensor, so Inductor may launch an independent
kernel of a neighbouring stage between two markers (measured on the H200, V4.1 EP4: the MoE's routing top-k and
shared-expert GEMMs inside the expert-parallel exchange's range, 27 of its 31.5 ms; the indexer's score and top-k
kernels inside the sparse attention's), but a kernel launched by an op's own code belongs to that op.
Device time is summed (overlapping streams count twice; ``gpu_busy_ms_per_step`` gives the same sum unattributed,
to set against wall time). CPU runs have no device events: each stage gets the exclusive wall time of its ranges
and hc_norm_other is what is left of the step ranges (``minidi/step``, opened by the benchmark around each step;
stage ranges outside them are ignored so that "other" can never go negative).

Only the exported JSON is read (no private profiler APIs), so a trace from another machine works too:
``python bench/prefill_stages.py trace.json --steps 2``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minidi.model.stages import PREFIX, STAGES
from minidi.runtime.flops import CATEGORIES

STAGE_CATEGORY = {
    "attn.core": "sparse_attention_core",
    "attn": "other_attention",
    "indexer": "indexer",
    "moe": "moe",
    "moe.comm": "communication",
}
OTHER = "hc_norm_other"
STEP_RANGE = PREFIX + "step"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
RANGE_CAT = "user_annotation"

# minidi's ops -> the stage whose work they are, wherever the compiler placed their call (ops used by two stages, such
# as gate_tf32x3 for the MoE gate and the mHC mixers, fp8_linear and pass R's fq8 for attention, indexer and shared
# expert, are left to the markers)
OP_STAGE = {
    "minidi::sparse_attention": "attn.core",
    **{f"minidi::{op}": "indexer" for op in ("indexer_score", "indexer_score_fp8", "indexer_topk_candidates",
                                             "topk_indices", "rebase_e4m3", "candidate_blocks", "hadamard_rotate")},
    **{f"minidi::{op}": "moe" for op in ("moe_combine", "moe_activation", "moe_activation_fp8", "gather_rows",
                                         "gather_rows_fq8", "fp4_grouped_mm", "fp4_grouped_mm_ref",
                                         "fp8_fp4_grouped_mm", "fp8_fp4_grouped_mm_ref", "fq8_split",
                                         "fq8_split_ref", "row_topk", "expert_order")},
    "minidi::rotated_blocks": "moe.comm",
    **{f"minidi::{op}": "attn" for op in ("fp8_grouped_linear", "fp8_grouped_linear_ref")},  # wo_a
    **{f"minidi::{op}": None for op in ("hc_mix_partials", "hc_sinkhorn", "hc_expand", "hc_expand_mix",  # "other"
                                        "head_logits", "head_logits_ref")},
}
OP_CAT = "cpu_op"

if set(STAGE_CATEGORY) != set(STAGES):  # a stage added to the model must get a category here
    raise ImportError(f"prefill_stages maps stages {sorted(STAGE_CATEGORY)}, minidi.model.stages has {sorted(STAGES)}")


class NoStageRangesError(ValueError):
    """The trace holds no ``minidi/<stage>`` range: the markers were off when the model was compiled."""


@dataclass(frozen=True)
class _Range:
    thread: tuple[Any, Any]  # (pid, tid)
    start: float  # us
    end: float  # us
    category: str


Trace = str | Path | dict | list


def load_events(trace: Trace) -> list[dict]:
    """The complete ("X") events of a trace: a path to the exported JSON, the parsed dict, or its event list."""
    if isinstance(trace, (str, Path)):
        try:
            trace = json.loads(Path(trace).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{trace}: not a JSON Chrome trace ({e})") from e
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise ValueError("trace must be a Chrome trace (a dict with 'traceEvents', or the event list)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def _check_steps(steps: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1 (the number of profiled steps), got {steps!r}")


def _stage_ranges(events: list[dict]) -> list[_Range]:
    """Stage ranges (the markers' and minidi's op calls', ``OP_STAGE``) sorted by (thread, start, longest first), so
    that a range comes after every range holding it."""
    ranges, markers = [], 0
    for e in events:
        name, cat = e.get("name", ""), e.get("cat")
        if cat == RANGE_CAT and name.startswith(PREFIX) and name[len(PREFIX):] in STAGE_CATEGORY:
            category = STAGE_CATEGORY[name[len(PREFIX):]]
            markers += 1
        elif cat == OP_CAT and name in OP_STAGE:
            category = STAGE_CATEGORY[OP_STAGE[name]] if OP_STAGE[name] else OTHER
        else:
            continue
        start = float(e["ts"])
        ranges.append(_Range((e.get("pid"), e.get("tid")), start, start + float(e["dur"]), category))
    if not markers:
        raise NoStageRangesError(
            f"the trace has no {PREFIX}<stage> ranges ({', '.join(PREFIX + s for s in STAGES)}): turn the stage "
            "markers on with `minidi.model.stages.enabled(True)` before compiling (or tracing) the model")
    return sorted(ranges, key=lambda r: (str(r.thread), r.start, -r.end))


def _by_thread(ranges: list[_Range]) -> dict[tuple, list[_Range]]:
    out: dict[tuple, list[_Range]] = {}
    for r in ranges:
        out.setdefault(r.thread, []).append(r)
    return out


def innermost(spans: list, times: list[float]) -> list:
    """For each time (sorted ascending) the innermost span of one thread holding it (latest start), or None.
    ``spans``: objects with ``start`` / ``end``, sorted by (start, longest first): stage ranges here, profiler ops
    in ``kernel_table.py``."""
    out, active, i = [], [], 0
    for t in times:
        while i < len(spans) and spans[i].start <= t:
            active.append(spans[i])
            i += 1
        active = [r for r in active if r.end >= t]  # still in start order: the last one is the innermost
        out.append(active[-1] if active else None)
    return out


def stage_ranges_by_thread(events: list[dict]) -> dict[tuple, list]:
    """The stage ranges (markers' and op calls') per thread, each thread's in (start, longest first) order; {} when the
    trace has no marker range."""
    try:
        return _by_thread(_stage_ranges(events))
    except NoStageRangesError:
        return {}


def categories_at(ranges_by_thread: dict[tuple, list], thread: tuple, times: list[float]) -> list[str]:
    """The category of the innermost stage range of ``thread`` holding each time (sorted ascending); "other" where
    none holds it."""
    return [r.category if r else OTHER for r in innermost(ranges_by_thread.get(thread, []), times)]


def _device_stage_us(events: list[dict], ranges: list[_Range]) -> dict[str, float]:
    launches = {}  # correlation id -> (thread, launch start)
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in LAUNCH_CATS and corr is not None:
            launches[corr] = ((e.get("pid"), e.get("tid")), float(e["ts"]))
    per_thread: dict[tuple, list[tuple[float, float]]] = {}  # thread -> [(launch ts, device dur)]
    out = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        if e.get("cat") not in DEVICE_CATS:
            continue
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if launch is None:  # no launch seen (e.g. launched before the profile started): outside every range
            out[OTHER] += float(e["dur"])
        else:
            per_thread.setdefault(launch[0], []).append((launch[1], float(e["dur"])))
    threads = _by_thread(ranges)
    for thread, items in per_thread.items():
        items.sort()
        for (_, dur), category in zip(items, categories_at(threads, thread, [ts for ts, _ in items])):
            out[category] += dur
    return out


def _cpu_stage_us(events: list[dict], ranges: list[_Range]) -> dict[str, float]:
    steps = [_Range((e.get("pid"), e.get("tid")), float(e["ts"]), float(e["ts"]) + float(e["dur"]), OTHER)
             for e in events if e.get("cat") == RANGE_CAT and e.get("name") == STEP_RANGE]
    if steps:
        step_threads = _by_thread(sorted(steps, key=lambda r: (str(r.thread), r.start)))
        ranges = [r for r in ranges if any(s.start <= r.start <= s.end for s in step_threads.get(r.thread, []))]
    else:
        warnings.warn(f"no {STEP_RANGE} range in the trace: hc_norm_other is reported as 0 (open "
                      f"`torch.profiler.record_function({STEP_RANGE!r})` around each step to measure it)")
    out = dict.fromkeys(CATEGORIES, 0.0)
    for thread_ranges in _by_thread(ranges).values():
        stack: list[_Range] = []
        for r in thread_ranges:  # parents come before their children
            while stack and stack[-1].end <= r.start:
                stack.pop()
            out[r.category] += r.end - r.start
            if stack:  # the nested part belongs to the child only
                out[stack[-1].category] -= min(r.end, stack[-1].end) - r.start
            stack.append(r)
    if steps:
        out[OTHER] = sum(s.end - s.start for s in steps) - sum(out.values())
    return out


def has_device_events(trace: Trace) -> bool:
    """Whether the trace holds GPU kernel / memcpy / memset events (a run profiled with ProfilerActivity.CUDA)."""
    return any(e.get("cat") in DEVICE_CATS for e in load_events(trace))


def stage_ms_per_step(trace: Trace, steps: int, cuda: bool) -> dict[str, float]:
    """{category: ms per step} for all six categories (0.0 when absent), in the report's order.

    ``trace``: the JSON from ``export_chrome_trace`` (path, dict or event list); ``steps``: profiled steps;
    ``cuda``: attribute device events (True) or CPU wall time (False). Raises ``NoStageRangesError`` when the
    markers were off, ValueError when ``cuda`` is set but the trace has no device events.
    """
    _check_steps(steps)
    events = load_events(trace)
    ranges = _stage_ranges(events)
    if cuda:
        if not any(e.get("cat") in DEVICE_CATS for e in events):
            raise ValueError("cuda=True but the trace has no GPU kernel/memcpy/memset events: profile with "
                             "activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], or pass cuda=False")
        us = _device_stage_us(events, ranges)
    else:
        us = _cpu_stage_us(events, ranges)
    return {k: us[k] / 1e3 / steps for k in CATEGORIES}


def stage_ms_each_step(trace: Trace, cuda: bool) -> list[dict[str, float]]:
    """One ``{category: ms}`` table per profiled step, i.e. per ``minidi/step`` range, in time order.

    CPU: each table is ``stage_ms_per_step`` of that step alone (its parts add up to the step range). CUDA: the device
    events launched inside that step range (on any thread), attributed as in ``stage_ms_per_step``. Raises
    ValueError when the trace has no step range.
    """
    events = load_events(trace)
    steps = sorted((e for e in events if e.get("cat") == RANGE_CAT and e.get("name") == STEP_RANGE),
                   key=lambda e: float(e["ts"]))
    if not steps:
        raise ValueError(f"the trace has no {STEP_RANGE} range: open `torch.profiler.record_function"
                         f"({STEP_RANGE!r})` around each profiled step")
    others = [e for e in events if not (e.get("cat") == RANGE_CAT and e.get("name") == STEP_RANGE)]
    launch_ts = {(e.get("args") or {}).get("correlation"): float(e["ts"]) for e in others
                 if e.get("cat") in LAUNCH_CATS}
    tables = []
    for s in steps:
        lo, hi = float(s["ts"]), float(s["ts"]) + float(s["dur"])
        if cuda:  # the device events of this step: those whose launch lies inside its range
            mine = [e for e in others if e.get("cat") not in DEVICE_CATS
                    or lo <= launch_ts.get((e.get("args") or {}).get("correlation"), -1.0) <= hi]
        else:
            mine = others
        tables.append(stage_ms_per_step([s, *mine], 1, cuda))
    return tables


def median_table(tables: list[dict[str, float]]) -> dict[str, float]:
    """Per category, the median over the tables (a stalled step moves no category), in the categories' order."""
    if not tables:
        raise ValueError("no stage tables to take the median of")
    return {k: statistics.median(t[k] for t in tables) for k in tables[0]}


def gpu_busy_ms_per_step(trace: Trace, steps: int) -> float:
    """Summed duration of all device events per step (ms); 0.0 for a CPU-only trace."""
    _check_steps(steps)
    return sum(float(e["dur"]) for e in load_events(trace) if e.get("cat") in DEVICE_CATS) / 1e3 / steps


def format_stage_table(stages: dict[str, float], gpu_busy_ms: float | None = None,
                       wall_ms: float | None = None) -> str:
    """A fixed-width table: category, ms/step, % of the sum; then the sum and, when given, GPU busy and wall time."""
    total = sum(stages.values())
    lines = [f"{'category':<24}{'ms/step':>12}{'% of sum':>10}"]
    for name, ms in stages.items():
        pct = 100.0 * ms / total if total > 0 else 0.0
        lines.append(f"{name:<24}{ms:>12.3f}{pct:>10.1f}")
    lines.append(f"{'sum':<24}{total:>12.3f}{100.0 if total > 0 else 0.0:>10.1f}")
    if gpu_busy_ms is not None:
        lines.append(f"{'gpu busy (all events)':<24}{gpu_busy_ms:>12.3f}")
    if wall_ms is not None:
        lines.append(f"{'wall time':<24}{wall_ms:>12.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Chrome trace JSON from torch.profiler's export_chrome_trace")
    ap.add_argument("--steps", type=int, required=True, help="number of steps the profile covers")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="attribute device events (cuda) or CPU time (cpu); auto: cuda if the trace has kernels")
    args = ap.parse_args(argv)
    try:
        events = load_events(args.trace)
        cuda = has_device_events(events) if args.device == "auto" else args.device == "cuda"
        table = stage_ms_per_step(events, args.steps, cuda)
    except (OSError, ValueError) as e:  # NoStageRangesError is a ValueError
        print(f"error: {args.trace}: {e}", file=sys.stderr)
        return 2
    print(format_stage_table(table, gpu_busy_ms_per_step(events, args.steps) if cuda else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
