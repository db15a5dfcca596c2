"""Where the GPU waits inside a step: one step profiled with the device's activity only, its idle time and gaps.

The kernel table (``kernel_table.py``) accounts for the time kernels run; a step on the GPU also has gaps between
kernels: the launch latency between back-to-back kernels (a few us each, ~thousands a step without CUDA graphs) and
stretches where the host has not yet enqueued the next kernel (the step is then bound by its host: Python, guards,
launches). This is that missing line. The step is profiled with ``ProfilerActivity.CUDA`` only, so no CPU op is
recorded and the host runs near its unprofiled speed (the stage profile records every CPU op and its step runs ~1.5x
slower on the host); CUPTI still costs the host a little per launch, so the idle time here is an upper bound.

    span   first device event's start to the last one's end (us -> ms)
    busy   the union of the device events' intervals (overlapping streams count once)
    idle   span - busy: the gaps, by size ("<5us", "5-20us", "20-100us", ">=100us": count and ms), the largest with
           the kernels on each side
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

if __package__:
    from . import common, prefill_stages
else:
    import common
    import prefill_stages

GAP_BINS_US = ((0.0, 5.0, "<5us"), (5.0, 20.0, "5-20us"), (20.0, 100.0, "20-100us"), (100.0, float("inf"), ">=100us"))


def idle_summary(events: list[dict], top: int = 8) -> dict:
    """Device events (Chrome-trace "X" events; those of ``prefill_stages.DEVICE_CATS`` count) -> span / busy / idle
    ms, the gap histogram and the ``top`` largest gaps (ms, and the event names before and after). No device event:
    an empty summary (span 0)."""
    dev = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?")) for e in events
                  if e.get("cat") in prefill_stages.DEVICE_CATS), key=lambda r: (r[0], r[1]))
    bins = {label: {"count": 0, "ms": 0.0} for _, _, label in GAP_BINS_US}
    if not dev:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "device_events": 0, "gaps": bins, "largest_gaps": []}
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = dev[0]
    for start, end, name in dev[1:]:
        if start > cur_end:  # a gap: the device ran nothing between cur_end and start
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start, cur_end, cur_name = start, end, name
        elif end > cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    span = cur_end - dev[0][0]
    for g, _, _ in gaps:
        label = next(lb for lo, hi, lb in GAP_BINS_US if lo <= g < hi)
        bins[label]["count"] += 1
        bins[label]["ms"] += g / 1e3
    for b in bins.values():
        b["ms"] = round(b["ms"], 3)
    largest = sorted(gaps, key=lambda r: -r[0])[:top]
    return {
        "span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3), "idle_ms": round((span - busy) / 1e3, 3),
        "device_events": len(dev), "gaps": bins,
        "largest_gaps": [{"ms": round(g / 1e3, 3), "after": a[:80], "before": b[:80]} for g, a, b in largest],
    }


def profile_idle(step, wl, device: str, top: int = 8) -> dict | None:
    """One step under a device-only profile -> ``idle_summary`` of it, plus the host's time to enqueue that step
    (``host_ms``); None off CUDA (a CPU step has no device gaps)."""
    if not common.is_cuda(device):
        return None
    common.sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step(wl.meta, wl.cache.tensors)
        host_ms = (time.perf_counter() - t) * 1e3
        common.sync(device)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "idle.trace.json"
        prof.export_chrome_trace(str(path))
        events = prefill_stages.load_events(json.loads(path.read_text()))
    return {**idle_summary(events, top), "host_ms": round(host_ms, 3)}


def format_idle(s: dict) -> str:
    """Two lines for the card."""
    bins = ", ".join(f"{k} {v['count']} / {v['ms']:.2f} ms" for k, v in s["gaps"].items())
    return (f"GPU idle {s['idle_ms']:.2f} ms of a {s['span_ms']:.2f} ms span ({s['device_events']} device events; "
            f"host enqueue {s.get('host_ms', float('nan')):.1f} ms)\n  gaps: {bins}")
