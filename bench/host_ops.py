"""Where the host goes in a profiled step: the calls the step's thread makes at its top level, per name.

Without CUDA graphs (the benchmark's protocol) every kernel of a step is enqueued by Python: Dynamo's guards, minidi's
op wrappers (argument checks, routing, caches, Triton's launcher) and Inductor's launches of its own kernels. When
that takes longer than the kernels run, the GPU waits between them (``gpu_idle.py``: its gaps and ``host_ms``) and the
step is bound by its host. This table says which calls hold the host.

From the stage profile's trace (CPU activity on): on the thread of each ``minidi/step`` range, every ``cpu_op`` that
starts inside the range and is inside no other ``cpu_op`` of that thread is one top-level call; its time is its whole
duration (what the host spent in the call, its children included). ``between_ops_ms`` is the rest of the range:
Python and guards outside any recorded op. Times are per step, averaged over the profiled steps; the profiler itself
slows the host (each recorded op costs a few us more), so the shares are what to read, not the absolute times.

    python bench/host_ops.py TRACE.json[.gz] [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

if __package__:  # imported as bench.host_ops (the benchmark as a module, the tests)
    from . import kernel_table, prefill_stages
else:  # run as a script: the script's folder is sys.path[0]
    import kernel_table
    import prefill_stages


def host_ops(events: list[dict], top: int = 15) -> dict:
    """Chrome-trace "X" events -> {steps, step_ms, in_ops_ms, between_ops_ms, ops: the ``top`` names by time, each
    {name, calls_per_step, ms_per_step, us_per_call, pct_step}} (per step: averages over the ``minidi/step`` ranges).
    Raises ValueError when there is no step range."""
    if not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an int >= 1 (rows of the host table), got {top!r}")
    steps = [e for e in events if e.get("cat") == prefill_stages.RANGE_CAT and e.get("name") ==
             prefill_stages.STEP_RANGE]
    if not steps:
        raise ValueError(f"the trace has no {prefill_stages.STEP_RANGE} range: open `torch.profiler.record_function"
                         f"({prefill_stages.STEP_RANGE!r})` around each profiled step")
    ops = kernel_table.ops_by_thread(events)  # per thread, in (start, longest first) order
    totals: dict[str, list[float]] = {}  # name -> [calls, us]
    step_us = in_ops_us = 0.0
    for s in steps:
        start, end = float(s["ts"]), float(s["ts"]) + float(s["dur"])
        step_us += end - start
        reach = start  # the end of the last top-level call
        for op in ops.get((s.get("pid"), s.get("tid")), []):
            t0, t1 = op.start, op.end
            if t0 < start or t0 >= end or t0 < reach:  # outside the step, or inside a call already counted
                continue
            reach = t1
            row = totals.setdefault(op.event.get("name", "?"), [0.0, 0.0])
            row[0] += 1
            row[1] += min(t1, end) - t0
            in_ops_us += min(t1, end) - t0
    n = len(steps)
    step_ms = step_us / n / 1e3
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]
    rows = [{"name": name, "calls_per_step": round(calls / n, 2), "ms_per_step": round(us / n / 1e3, 3),
             "us_per_call": round(us / calls, 1), "pct_step": round(100 * us / step_us, 2) if step_us else 0.0}
            for name, (calls, us) in ranked]
    return {"steps": n, "step_ms": round(step_ms, 3), "in_ops_ms": round(in_ops_us / n / 1e3, 3),
            "between_ops_ms": round((step_us - in_ops_us) / n / 1e3, 3), "ops": rows}


def format_host_ops(h: dict) -> str:
    """A few lines for the card."""
    lines = [f"host, the step's top-level calls (profiled: {h['step_ms']:.1f} ms a step, {h['in_ops_ms']:.1f} in "
             f"calls, {h['between_ops_ms']:.1f} between them):"]
    for r in h["ops"]:
        lines.append(f"  {r['ms_per_step']:8.2f} ms {r['calls_per_step']:7.1f} calls {r['us_per_call']:8.1f} us/call "
                     f"{r['pct_step']:5.1f} %  {r['name'][:80]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a Chrome trace of profiled steps (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    path = Path(args.trace)
    text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    print(format_host_ops(host_ops(prefill_stages.load_events(json.loads(text)), args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
