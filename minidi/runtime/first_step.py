"""The first call of a compiled step (``compile.py``): the split of its seconds by phase (``compile_s``), every
phase of torch's own timers (``compile_detail_s``), the Triton compiles it ran in this process (minidi's kernels,
compiled by Triton's JIT in ``kernel_precompile``'s pool or at their first launch: ``triton_jit`` seconds summed over
threads, ``TritonCompiles``; the pool's counters: ``precompile``), and the compile cache's check and save after it
(``compile_cache.py``).

Where the seconds go (H200, V4.1-Flash EP4, 7 layer kinds, ``docs/benchmarks/README.md``): Dynamo's tracing, AOT
tracing, Inductor's lowering and code generation, the wait for Inductor's Triton / C++ compiles (a worker pool), and
the first run itself, which JIT-compiles minidi's kernels and autotunes Inductor's. Nested phases overlap.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .compile_cache import CompileCache
from .kernel_precompile import precompiler

log = logging.getLogger("minidi.compile")

DETAIL_MIN_S = 0.05  # phases shorter than this are left out of ``compile_detail_s``


def phase_detail(delta: dict[str, float], min_s: float = DETAIL_MIN_S) -> dict[str, float]:
    """Torch's ``dynamo_timed`` phases of one first call (seconds, nested ones overlap), longest first, those under
    ``min_s`` left out."""
    kept = sorted(((k, v) for k, v in delta.items() if v >= min_s), key=lambda kv: (-kv[1], kv[0]))
    return {k: round(v, 2) for k, v in kept}


class TritonCompiles:
    """Triton compiles in this process between ``start`` and ``stop``, counted through Triton's compilation
    listener (``triton.knobs.compilation.listener``; absent in old Triton: ``available`` False, nothing counted).
    ``compiles``: kernels compiled, ``cache_hits``: kernels loaded from Triton's cache, ``seconds``: the compiles'
    time (IR, lowering stages, store), ``per_kernel``: kernel name -> [compiles, seconds] (a kernel compiled for
    several specialisations counts each). Chains a listener set before it and puts it back on ``stop``."""

    def __init__(self) -> None:
        self.compiles = self.cache_hits = 0
        self.seconds = 0.0
        self.per_kernel: dict[str, list] = {}
        self._knobs: Any = None
        self._previous: Any = None
        try:
            from triton import knobs
        except ImportError:  # Triton absent or too old for knobs
            knobs = None
        self.available = knobs is not None and hasattr(getattr(knobs, "compilation", None), "listener")
        if self.available:
            self._knobs = knobs.compilation

    @property
    def seen(self) -> bool:
        return self.compiles + self.cache_hits > 0

    def start(self) -> None:
        if self.available and self._knobs.listener is not self:
            self._previous, self._knobs.listener = self._knobs.listener, self

    def stop(self) -> None:
        if self.available and self._knobs.listener is self:
            self._knobs.listener, self._previous = self._previous, None

    def __call__(self, **event: Any) -> None:  # Triton's keywords: src, metadata, metadata_group, times, cache_hit
        if event.get("cache_hit"):
            self.cache_hits += 1
        else:
            self.compiles += 1
            times = event.get("times")
            us = sum(getattr(times, f, 0) or 0 for f in ("ir_initialization", "total_lowering", "store_results"))
            self.seconds += us / 1e6
            entry = self.per_kernel.setdefault(_kernel_name(event.get("src")), [0, 0.0])
            entry[0] += 1
            entry[1] += us / 1e6
        if self._previous is not None:
            self._previous(**event)

    def record(self) -> dict[str, Any] | None:
        if not self.available:
            return None
        kernels = sorted(self.per_kernel.items(), key=lambda kv: (-kv[1][1], kv[0]))
        return {"compiles": self.compiles, "cache_hits": self.cache_hits, "s": round(self.seconds, 2),
                "kernels": {k: [n, round(s, 2)] for k, (n, s) in kernels}}


def _kernel_name(src: Any) -> str:
    """A compiled kernel's name from Triton's source object (``ASTSource.name``; IR sources have none)."""
    name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", None)
    return str(name) if name else "(unnamed)"


def _torch_compile_seconds() -> dict[str, float]:
    """Seconds torch's ``dynamo_timed`` phases took so far in this process, per phase (nested phases overlap)."""
    from torch._dynamo import utils

    return {k: sum(v) for k, v in getattr(utils, "compilation_time_metrics", {}).items()}


def _precompile_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``KernelPrecompiler.record()`` counters between two snapshots (``stopped``: the ops that stopped early since)."""
    out = {k: round(after[k] - before.get(k, 0), 2) for k in ("submitted", "ops_run", "failed", "wait_s")}
    out["stopped"] = {k: v for k, v in after["stopped"].items() if k not in before.get("stopped", {})}
    return out


class FirstStep:
    """What the first call of a compiled step (``compile.py``) measures and does: the split of its seconds
    (``compile_s``) and the compile cache's check and save (``cache``: a ``CompileCache`` or None)."""

    # torch's own phases worth reporting (dynamo_timed names; absent ones are skipped). Dynamo's (backend included)
    # is ``fullgraph_capture`` where the layers are compiled ahead of time (``precompiled.py``)
    DYNAMO = ("_compile.compile_inner", "fullgraph_capture")
    PHASES = {"aot": "create_aot_dispatcher_function",
              "inductor_lowering": "GraphLowering.run", "inductor_codegen": "GraphLowering.compile_to_module",
              "kernel_compile_wait": "async_compile.wait"}

    def __init__(self, backend: Any, cache: CompileCache | None) -> None:
        self.times, self.cache = backend.times, cache  # type: ignore[attr-defined]
        self.t0, self.torch0, self.mine0 = 0.0, {}, {}
        self.detail: dict[str, float] = {}  # every torch phase of the first call (``phase_detail``)
        self.triton = TritonCompiles()
        self.precompile: dict[str, Any] | None = None  # the first call's share of ``kernel_precompile`` (``finish``)
        self._precompile0: dict[str, Any] = {}
        # () -> (precompiled graphs' bytes or None, per-layer pass counts): what a compile cache entry also keeps
        # when the layers were compiled ahead of time (``precompiled.py``); set by ``minidi.compile``
        self.precompiled: Callable[[], tuple[bytes | None, dict[int, dict[str, int]]]] | None = None
        self.workers: dict[str, Any] | None = None  # compile workers' record (``RegionalStep._collect_workers``)

    def start(self) -> None:
        self.t0, self.torch0, self.mine0 = time.perf_counter(), _torch_compile_seconds(), dict(self.times)
        self.triton.start()
        self._precompile0 = precompiler().record()

    def finish(self, counts: Callable[[], dict[str, int] | None]) -> dict[str, float]:
        total = time.perf_counter() - self.t0
        self.triton.stop()
        now = _torch_compile_seconds()
        delta = {k: now[k] - self.torch0.get(k, 0.0) for k in now}
        self.detail = phase_detail(delta)
        mine = {k: self.times[k] - self.mine0.get(k, 0.0) for k in self.times}
        # kernel_precompile: the graphs' minidi ops run on fake tensors (the pool's compiles run beside the rest)
        out = {"first_step": total, "passes": mine["passes"], "kernel_precompile": mine.get("precompile", 0.0),
               "backend": mine["backend"]}
        self.precompile = _precompile_delta(self._precompile0, precompiler().record())
        dynamo = [delta[k] for k in self.DYNAMO if k in delta]
        if dynamo:
            out["dynamo"] = sum(dynamo)
        for name, key in self.PHASES.items():
            if key in delta:
                out[name] = delta[key]
        if "dynamo" in out:  # Dynamo's time includes the backend's: what is left is tracing (and guards)
            out["dynamo_trace"] = max(out["dynamo"] - out["passes"] - out["kernel_precompile"] - out["backend"], 0.0)
            out["run_and_eager"] = max(total - out["dynamo"], 0.0)
        if self.workers is not None:  # the main process's wait for the compile workers after the eager layers
            out["compile_workers_wait"] = self.workers["wait_s"]
        if self.triton.seen:  # Triton compiles in this process (minidi's kernels at their first call, mostly)
            out["triton_jit"] = self.triton.seconds
        if self.cache is not None:
            out["cache_load"] = self.cache.load_s
            try:
                c = counts()
            except RuntimeError:  # a layer ran no graph (an error elsewhere): nothing to check or save
                c = None
            if c is not None:
                self.cache.check_counts(c)
                # a hit writes nothing: the precompiled graphs are serialised only for an entry that is written
                saving = self.precompiled is not None and self.cache.status != "hit"
                blob, layer_counts = self.precompiled() if saving else (None, None)
                try:
                    self.cache.save(c, total, precompiled=blob, layer_counts=layer_counts)
                except OSError as e:  # a full or read-only disk costs the next start its warm cache, not this step
                    log.warning("minidi.compile: compile cache not saved to %s (%s: %s)", self.cache.path,
                                type(e).__name__, e)
            out["cache_save"] = self.cache.save_s
        return {k: round(v, 2) for k, v in out.items()}


__all__ = ["FirstStep", "TritonCompiles", "phase_detail"]
