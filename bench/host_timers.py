"""Where the host goes in steps run without a profiler: wall-clock timers on the calls that enqueue a step's kernels.

``host_ops.py`` reads the profiled steps, and the profiler slows every op it records. Python's cProfile misreads a
compiled step outright: it does not see the frames of Inductor's generated code, and charges their time to a minidi
op frame it did see (one H100 call of round 37, the V4-Flash step under cProfile: 385 of its 864 ms charged to
``custom_op``'s backend wrapper as the wrapper's own time). Here ``--host_timers N`` runs N more steps after the timed
ones with ``time.perf_counter`` around:

- each minidi op's implementation (a ``dispatch_op``'s impl; every minidi op is one): its Python, its
  kernels' launches and the aten calls inside, what the op costs the host beyond its dispatch;
- Triton's JIT launches (``JITFunction.run``, and ``fast_launch``'s ``run`` in front of it: minidi's Triton and
  Gluon kernels, inside the ops), per kernel; a launch that goes through both (a first launch, or one the fast path
  leaves to Triton) counts twice in its row;
- Inductor's launches of its own kernels (``CachingAutotuner.run``), as one row;
- each call of an Inductor graph (``CompiledFxGraph.__call__``: its generated code, with the launches and op calls
  inside it), as one row.

``step_ms`` is the host time a step took to enqueue with the timers on (``common.host_enqueue_ms``); ``timed_ms`` the
part inside timed calls at the top level (not inside another timed call); ``rest_ms`` the remainder: Dynamo's guards,
AOTAutograd's wrappers around the graphs, the model's Python between them, the dispatch of ops called outside a graph.
Each row has its total and its self time (the total less the timed calls directly inside it): the graph row's self
time is Inductor's generated code between its launches and op calls (allocations, size asserts), an op's is its
Python and aten calls besides its Triton launches. A timer adds a ``perf_counter`` pair and a dict update to each
timed call (~6,000 a V4-Flash step), so ``step_ms`` reads a little above the untimed ``host_enqueue_ms``. Off by
default (the timed steps never run with timers).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

NAMESPACES = ("minidi",)  # the ops timed: these namespaces' dispatch_ops and custom ops


class HostTimers:
    """A context that installs the timers (see the module doc) and restores every patched attribute on exit.
    ``namespaces``: whose ops are timed (``NAMESPACES``; the tests add their own)."""

    def __init__(self, namespaces: tuple[str, ...] = NAMESPACES) -> None:
        self.prefixes = tuple(f"{ns}::" for ns in namespaces)
        self.rows: dict[str, list] = {}  # name -> [kind, calls, seconds, self seconds]
        self.top_s = 0.0  # seconds inside timed calls at depth 0
        self._inner: list[float] = []  # per open timed call: seconds of the timed calls directly inside it
        self._undo: list[Callable[[], None]] = []

    def timed(self, name: str | Callable[..., str], kind: str, fn: Callable) -> Callable:
        """``fn`` wrapped with a timer charged to ``name`` (a str, or a function of the call's arguments)."""
        clock, rows, inner = time.perf_counter, self.rows, self._inner

        def call(*args: Any, **kwargs: Any) -> Any:
            key = name if isinstance(name, str) else name(*args)
            inner.append(0.0)
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t
                nested = inner.pop()
                if inner:
                    inner[-1] += dt
                else:
                    self.top_s += dt
                row = rows.get(key)
                if row is None:
                    row = rows[key] = [kind, 0, 0.0, 0.0]
                row[1] += 1
                row[2] += dt
                row[3] += dt - nested

        return call

    def _patch(self, owner: Any, attr: str, new: Any) -> None:
        old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, new)
        self._undo.append(lambda: setattr(owner, attr, old))

    def __enter__(self) -> HostTimers:
        try:
            self._install()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _install(self) -> None:
        from minidi.ops import _dispatch_op

        for qualname, op in _dispatch_op._OPS.items():
            if qualname.startswith(self.prefixes):
                self._patch(op, "impl", self.timed(f"op {qualname}", "op", op.impl))
        self._patch_method("triton.runtime.jit", "JITFunction", "run", _kernel_name, "triton launch")
        self._patch_method("minidi.ops._fast_launch", "_FastRun", "run", _kernel_name, "triton launch")
        self._patch_method("torch._inductor.runtime.triton_heuristics", "CachingAutotuner", "run",
                           "inductor launches", "inductor launch")
        self._patch_method("torch._inductor.output_code", "CompiledFxGraph", "__call__", "inductor graphs",
                           "inductor graph")

    def _patch_method(self, module: str, cls_name: str, attr: str, name: str | Callable[..., str], kind: str) -> None:
        """Time ``module.cls_name.attr`` (defined on that class itself); skipped where this version has no such
        class or method."""
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            return
        if attr in cls.__dict__:
            self._patch(cls, attr, self.timed(name, kind, cls.__dict__[attr]))

    def __exit__(self, *exc: Any) -> None:
        while self._undo:
            self._undo.pop()()

    def summary(self, host_ms: list[float], top: int = 25) -> dict:
        """{steps, step_ms, timed_ms, rest_ms, rows: the ``top`` names by time, each {name, kind, calls_per_step,
        ms_per_step, self_ms_per_step, us_per_call}} (per step: averages over ``host_ms``'s steps)."""
        n = len(host_ms)
        if n < 1:
            raise ValueError("host timers: no step was timed")
        step_ms = sum(host_ms) / n
        timed_ms = self.top_s / n * 1e3
        ranked = sorted(self.rows.items(), key=lambda kv: (-kv[1][2], kv[0]))[:top]
        rows = [{"name": name, "kind": kind, "calls_per_step": round(calls / n, 2),
                 "ms_per_step": round(s / n * 1e3, 3), "self_ms_per_step": round(own / n * 1e3, 3),
                 "us_per_call": round(s / calls * 1e6, 1)}
                for name, (kind, calls, s, own) in ranked]
        return {"steps": n, "step_ms": round(step_ms, 3), "timed_ms": round(timed_ms, 3),
                "rest_ms": round(step_ms - timed_ms, 3), "rows": rows}


def _kernel_name(jit_fn: Any, *_: Any) -> str:
    return "launch " + str(getattr(jit_fn, "__name__", None) or getattr(jit_fn, "_fn_name", "?"))


def measure(run: Callable[[], object], steps: int, device: Any, enqueue_ms: Callable[..., list[float]],
            top: int = 25, namespaces: tuple[str, ...] = NAMESPACES) -> dict:
    """``steps`` calls of ``run`` with the timers on, each timed by ``enqueue_ms(run, 1, device)`` (the device idle
    before and after each: ``common.host_enqueue_ms``), summarised (``HostTimers.summary``)."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"host timers: steps must be an int >= 1, got {steps!r}")
    with HostTimers(namespaces) as timers:
        host_ms = enqueue_ms(run, steps, device)
    return timers.summary(host_ms, top)


def format_host_timers(h: dict, top: int = 12) -> str:
    """A few lines for the card."""
    lines = [f"host, timers on ({h['steps']} steps, no profiler): {h['step_ms']:.1f} ms a step to enqueue, "
             f"{h['timed_ms']:.1f} in timed calls, {h['rest_ms']:.1f} outside them (guards, wrappers, the model's "
             f"Python between graphs); per row its total and self ms:"]
    for r in h["rows"][:top]:
        lines.append(f"  {r['ms_per_step']:8.2f} ms {r['self_ms_per_step']:8.2f} self {r['calls_per_step']:7.1f} "
                     f"calls {r['us_per_call']:8.1f} us/call {r['kind']:15s} {r['name'][:60]}")
    return "\n".join(lines)
