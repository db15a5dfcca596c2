"""The benchmark's profiled steps (``bench_prefill.py``): one torch profile of ``--profile_steps`` steps, written as a
gzipped Chrome trace, and what is read from it: the stage table (``prefill_stages.py``), GPU busy time, the host's
top-level calls (``host_ops.py``), and with ``--kernels N`` the top kernels (``kernel_table.py``); and the note the
card prints when the stage table's sum is off the timed step."""

from __future__ import annotations

import gzip
import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__:
    from . import common, host_ops, kernel_table, prefill_stages
else:
    import common
    import host_ops
    import kernel_table
    import prefill_stages

STAGE_SUM_TOLERANCE = 0.10  # the stage table's sum should be within 10 % of the timed step; the card says why if not


@dataclass
class Profile:
    """What ``profile_steps`` measured: the stage table (per category, the median over the profiled steps; empty
    without stage markers), GPU busy ms per step (CUDA), each profiled step's stage sum (ms), the kernel table and the
    host's top-level calls (``host_ops.host_ops``)."""

    stages: dict[str, float]
    gpu_busy_ms: float | None
    step_sums: list[float]
    kernels: kernel_table.KernelTable | None
    host: dict | None = None


def profile_steps(step, wl, n: int, device: str, trace_path: Path, kernels: int = 0, peaks: dict | None = None,
                  markers: bool = True, model_flops: dict | None = None, ep_size: int | None = None) -> Profile:
    """Profile ``n`` steps into one trace (written gzipped to ``trace_path``); from it the stage table (one stalled
    step does not move its medians) and, with ``kernels`` > 0, the top ``kernels`` kernels (shapes and FLOPs are
    recorded then: ``kernel_table.py``; the trace keeps the profiler's FLOPs as ``args.flops``; ``model_flops``: the
    model's FLOPs of minidi's compute-bound kernels, ``model_work.py``; ``ep_size``: the model's expert parallelism,
    the rows minidi's MoE kernels move, ``minidi_work.py``)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if common.is_cuda(device):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    ticker = common.Ticker("profiled steps", n)
    with torch.profiler.profile(activities=acts, record_shapes=kernels > 0, with_flops=kernels > 0) as prof:
        for _ in range(n):
            with torch.profiler.record_function(prefill_stages.STEP_RANGE):
                step(wl.meta, wl.cache.tensors)
            common.sync(device)
            ticker.tick()
    raw = trace_path.with_suffix("")  # .trace.json
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    if kernels:
        kernel_table.annotate_flops(trace["traceEvents"], kernel_table.profiler_flops(prof))
    events = prefill_stages.load_events(trace)
    cuda = common.is_cuda(device)
    per_step = prefill_stages.stage_ms_each_step(events, cuda=cuda) if markers else []
    table = prefill_stages.median_table(per_step) if per_step else {}
    busy = prefill_stages.gpu_busy_ms_per_step(events, n) if cuda else None
    kt = kernel_table.kernel_table(events, kernels, peaks, cuda=cuda, model_flops=model_flops,
                                   ep_size=ep_size) if kernels else None
    if kernels:  # the annotated trace
        with gzip.open(trace_path, "wt") as g:
            json.dump(trace, g)
    else:
        with open(raw, "rb") as f, gzip.open(trace_path, "wb") as g:
            shutil.copyfileobj(f, g)
    raw.unlink()
    return Profile(table, busy, [sum(t.values()) for t in per_step], kt, host_ops.host_ops(events))


def stage_sum_note(stage_sum: float, times: list[float], cuda: bool) -> str | None:
    """Why the stage table's sum is more than 10 % off the median timed step, or None when it is within."""
    step_ms = statistics.median(times)
    ratio = stage_sum / step_ms if step_ms else float("nan")
    if abs(ratio - 1) <= STAGE_SUM_TOLERANCE:
        return None
    spread = max(times) / min(times) if min(times) > 0 else float("nan")
    if spread > 1 + STAGE_SUM_TOLERANCE:  # the timed steps disagree among themselves as much
        why = (f"the timed steps themselves range {min(times):.2f}-{max(times):.2f} ms ({spread:.2f}x): the "
               "machine's load varies between steps (a shared CPU), so no table can match one timed step closer")
    elif cuda:
        why = "device time summed over streams (overlapping kernels count twice) against event time between steps"
    else:
        why = ("the profiler's own cost per recorded op (a CPU step is tens of thousands of small ops), which timed "
               "steps do not pay")
    return f"stage sum {stage_sum:.2f} ms is {ratio:.2f}x the median timed step ({step_ms:.2f} ms): {why}"
