"""``--launch_ab N``: one compiled step, its Triton launches through ``JITFunction.run`` and through
``fast_launch``'s kept kernels (``minidi/ops/_fast_launch.py``), alternating, N rounds after the timed steps.

Each round runs, per path: a step timed with CUDA events, a step's host enqueue (``common.host_enqueue_ms``) and a
step whose logits are kept. The same graphs, the same process and the alternation make the two paths' difference the
launches' own, not a machine's or a compile's. Reported per path: the mean step ms and enqueue ms, and the two paths'
largest logit difference (the same kernels: 0 is expected where the step's kernels are deterministic);
``launch_counts``: the fast path's hits, misses and unkeyed launches summed over its kernels in the rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

if __package__:
    from . import common
else:
    import common

PATHS = (("JITFunction.run", False), ("fast_launch", True))


def measure(run: Callable[[], torch.Tensor], rounds: int, device: Any) -> dict:
    """The A/B above; ``run`` returns the step's logits."""
    import triton

    from minidi.ops import _fast_launch as fl

    if not fl.ENABLED:
        return {"skipped": f"fast_launch is off in this process ({fl.ENV}=0, or Triton {triton.__version__} is not "
                           f"one of {fl.CHECKED_TRITON})"}
    got: dict[str, dict[str, list[float]]] = {path: {"ms": [], "enqueue_ms": []} for path, _ in PATHS}
    logits: dict[str, torch.Tensor] = {}
    fl.reset()
    try:
        for _ in range(rounds):
            for path, on in PATHS:
                fl.ENABLED = on
                got[path]["ms"] += common.step_times_ms(run, 1, device)
                got[path]["enqueue_ms"] += common.host_enqueue_ms(run, 1, device)
                logits[path] = run().float()
                common.sync(device)
    finally:
        fl.ENABLED = True
    counts = [sum(c[key] for c in fl.launch_counts().values()) for key in ("hits", "misses", "unkeyed")]
    out = {path: {"ms_mean": round(sum(v["ms"]) / rounds, 3),
                  "enqueue_ms_mean": round(sum(v["enqueue_ms"]) / rounds, 3),
                  "ms": [round(x, 3) for x in v["ms"]], "enqueue_ms": [round(x, 3) for x in v["enqueue_ms"]]}
           for path, v in got.items()}
    a, b = (logits[path] for path, _ in PATHS)
    return {"rounds": rounds, **out, "logits_max_abs_diff": float((a - b).abs().max()),
            "launch_counts": dict(zip(("hits", "misses", "unkeyed"), counts))}


def format_launch_ab(r: dict) -> str:
    if "skipped" in r:
        return f"launch A/B skipped: {r['skipped']}"
    lines = [f"launch A/B ({r['rounds']} rounds, alternating):"]
    for path, _ in PATHS:
        row = r[path]
        lines.append(f"  {path:16s} {row['ms_mean']:9.3f} ms/step, host enqueue {row['enqueue_ms_mean']:9.3f} ms")
    lines.append(f"  logits max |diff| {r['logits_max_abs_diff']:.3g}; fast path launches {r['launch_counts']}")
    return "\n".join(lines)
