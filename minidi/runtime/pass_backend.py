"""minidi's ``torch.compile`` backend (``make_backend``): the passes on Dynamo's graph, minidi's Triton kernels handed
to the compile pool, then the inner backend (Inductor by default) under minidi's rounding and code generation
settings. ``minidi.compile`` (``compile.py``) builds it for a step; a compile worker (``compile_workers.py``) builds
the same one from the step's settings."""

from __future__ import annotations

import logging
import time
from typing import Callable

from torch.fx import GraphModule

from minidi.passes import PassManager

from .compile_cache import cacheable_minidi_calls
from .compile_settings import codegen_config, rounding_config
from .kernel_precompile import precompiler

log = logging.getLogger("minidi.compile")


def make_backend(manager: PassManager, inner: str | Callable = "inductor", *,
                 faithful_rounding: bool | str = True, autotune: bool = False, cpu_simd: bool = False,
                 precompile_kernels: bool = True, times: dict[str, float] | None = None) -> Callable:
    """A ``torch.compile`` backend: run the passes on Dynamo's GraphModule, then the inner backend on the result,
    with Inductor's ``emulate_precision_casts`` set to ``faithful_rounding`` and its code generation settings
    (``codegen_config``: ``autotune``, ``cpu_simd``) while the inner backend compiles. ``precompile_kernels``: between
    the two, hand the Triton kernels of the graph's minidi ops to a compile pool (``kernel_precompile.py``), so that
    they compile while AOT and Inductor work and the graph's first run finds them compiled.
    ``times`` (default: a new one): the dict its seconds in the passes / the precompile submission / the inner
    backend add up in (two backends of one step share one)."""
    from torch._dynamo.backends.registry import lookup_backend

    if not (isinstance(faithful_rounding, bool) or faithful_rounding == "exact"):
        raise ValueError(f"faithful_rounding must be True, False or 'exact', got {faithful_rounding!r}")
    inner_fn = lookup_backend(inner) if isinstance(inner, str) else inner
    times = {"passes": 0.0, "precompile": 0.0, "backend": 0.0} if times is None else times

    def minidi_backend(gm: GraphModule, example_inputs: list) -> Callable:
        n, layer = len(manager.history), manager.current_layer
        before = manager.layer_counts.get(layer)
        t0 = time.perf_counter()
        manager.run(gm)
        t1 = time.perf_counter()
        times["passes"] += t1 - t0
        if precompile_kernels:
            try:
                precompiler().submit_graph(gm)
            except Exception as e:  # an optimisation only: the kernels then compile at their first launch
                log.warning("minidi.compile: kernels not precompiled for this graph (%s: %s)", type(e).__name__, e)
            times["precompile"] = times.get("precompile", 0.0) + time.perf_counter() - t1
            t1 = time.perf_counter()
        try:
            with rounding_config(faithful_rounding, example_inputs), cacheable_minidi_calls(gm), \
                    codegen_config(example_inputs, autotune=autotune, cpu_simd=cpu_simd):
                return inner_fn(gm, example_inputs)
        except BaseException:  # e.g. a restart of the trace: this graph is discarded, so forget its counts
            del manager.history[n:]
            if layer is not None:
                manager.layer_counts.pop(layer, None)
                if before is not None:
                    manager.layer_counts[layer] = before
            raise
        finally:
            times["backend"] += time.perf_counter() - t1

    minidi_backend.pass_manager = manager  # type: ignore[attr-defined]
    minidi_backend.times = times  # type: ignore[attr-defined]  # seconds in the passes / the inner backend
    return minidi_backend


__all__ = ["make_backend"]
