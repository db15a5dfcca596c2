"""The settings a compiled step runs under, and its progress lines (``compile.py``, ``regional.py``).

- **Shape settings** (``dynamic_shape_config``, ``call_settings``): one graph for every batch shape, applied around
  every call of a compiled step (Dynamo reads them when it traces, which is on a call that misses its cache),
  together with raised recompile limits for per-layer compilation. Nothing is set globally: after a call
  ``torch._dynamo.config`` is what it was. ``mark_leading_dims_only``: the dims that vary between steps are the
  leading dims of the step's tensors; the others are traced as the constants they are.
- **Rounding** (``rounding_config``): Inductor rounds fused intermediates where eager rounds (``faithful_rounding``);
  CPU graphs (or any with ``"exact"``) run ATen's reduction and transcendental kernels (``exact_cpu.py``).
- **Code generation** (``codegen_config``): no benchmarking of kernel configs at a graph's first run unless asked
  (``autotune``), and scalar C++ for CPU graphs unless asked (``cpu_simd``): both cut the first step's time.
- **Progress** (``Progress``, ``cache_note``, ``inductor_cache_counts``): lines to the ``minidi.compile`` logger (and
  an optional callback), with the hits / misses of Inductor's FX graph cache and AOTAutograd's cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from typing import Any, Callable

import torch

from minidi.runtime import cpp_kernel_batch
from minidi.runtime.exact_cpu import all_cpu, aten_kernels

log = logging.getLogger("minidi.compile")

SCALAR_SIMDLEN = 0  # ``cpp.simdlen`` no vector ISA has: Inductor's CPU code is scalar (``codegen_config``)
RECOMPILE_LIMITS = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit")


def dynamic_shape_config() -> contextlib.ExitStack:
    """Shapes of one step vary in many dims (tokens, entries, view rows, pending rows...). Two symbolic-shape
    settings keep one compiled graph for all of them: no duck sizing (two dims that happen to be equal in the first
    batch must not be assumed equal) and size-oblivious reasoning for sizes 0 and 1 (which Dynamo would otherwise
    specialise, recompiling for every batch that has, say, one sequence or no pending rows). And Python floats stay
    constants (``specialize_float``): with ``dynamic=True`` Dynamo would otherwise trace the model's float constants
    (norm eps, the e2m1 grid) as symbolic inputs, then specialise them after the backend ran and trace the whole graph
    a second time (on the H200 this compiled every layer kind twice; the first trace's graph also misses passes that
    need those constants as literals, e.g. H's clamp limit)."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    stack = contextlib.ExitStack()
    stack.enter_context(fx_config.patch(backed_size_oblivious=True, use_duck_shape=False))
    stack.enter_context(dynamo_config.patch(specialize_float=True))
    return stack


def mark_leading_dims_only(tree: Any) -> None:
    """Mark every dim but the first of each tensor in ``tree`` (tensors, dataclasses such as ``StepMeta`` /
    ``LayerCache`` / ``SharedSlots``, dicts, lists, tuples) static for Dynamo (``torch._dynamo.mark_static``), before
    a call that may trace with ``dynamic=True``.

    What differs between two steps of a model is counts: tokens, sequences, new compressed entries, pending rows,
    view rows, pool rows; each is the leading dim of the tensors it sizes. A tensor's other dims are the model's
    constants (streams, hidden and head dims, heads, window, ratio, n-gram order, top-k), so tracing them as symbols
    only costs: every one is a sympy symbol whose guards and index arithmetic Dynamo, AOT and Inductor carry through
    the graph until a parameter's shape pins it. Marked static they are constants from the start (tiny V4.1's
    per-layer compile on a 2-core CPU: docs/benchmarks/README.md, round 24). A dim marked static that does change
    later fails its guard and that call recompiles (a graph with it symbolic: the marks are set only where the
    caller chooses, ``regional.py`` / ``compile.py`` on the first step, ``precompiled.py`` on each compile)."""
    if isinstance(tree, torch.Tensor):
        if tree.dim() > 1:
            indices = getattr(tree, "_dynamo_static_indices", None)
            if indices is None or not indices.issuperset(range(1, tree.dim())):
                torch._dynamo.mark_static(tree, list(range(1, tree.dim())))
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            mark_leading_dims_only(getattr(tree, f.name))
    elif isinstance(tree, dict):
        for v in tree.values():
            mark_leading_dims_only(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            mark_leading_dims_only(v)


def call_settings(dynamic: bool | None, recompile_limit: int | None) -> contextlib.ExitStack:
    """The Dynamo settings a compiled step's call runs under (Dynamo reads them when a call traces)."""
    stack = contextlib.ExitStack()
    if dynamic is not False:
        stack.enter_context(dynamic_shape_config())
    if recompile_limit is not None:
        cfg = torch._dynamo.config
        limits = {n: max(getattr(cfg, n), recompile_limit) for n in RECOMPILE_LIMITS if hasattr(cfg, n)}
        stack.enter_context(cfg.patch(**limits))
    return stack


def rounding_config(faithful: bool | str, example_inputs: list) -> contextlib.ExitStack:
    """Inductor's setting for rounding fused intermediates where eager rounds (absent in old torch: no-op), and
    ATen's reduction and transcendental kernels (``exact_cpu``) for a faithful CPU graph, or any graph with
    ``"exact"``: a faithful CPU graph is then eager's, bitwise."""
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    if hasattr(inductor_config, "emulate_precision_casts"):  # absent before torch 2.6
        stack.enter_context(inductor_config.patch(emulate_precision_casts=bool(faithful)))
    if faithful == "exact" or (faithful is True and all_cpu(example_inputs)):
        stack.enter_context(aten_kernels())
    return stack


def scalar_cpu_patch() -> dict[str, Any]:
    """The Inductor setting that makes CPU code scalar (``codegen_config``'s ``cpu_simd=False``)."""
    return {"cpp.simdlen": SCALAR_SIMDLEN}


def load_config(scalar_cpu: bool) -> contextlib.AbstractContextManager:
    """``codegen_config``'s vector-ISA setting for loading compiled graphs (``PrecompiledCalls.loads``): a CPU
    graph's C++ kernels are compiled, or found already built, with the flags Inductor picks from that setting, so
    scalar graphs loaded without it would be built again with the machine's vector flags (tiny V4.1: ~7 s of g++ in
    the main process after its compile workers had built them). ``scalar_cpu`` False (vector CPU code, or GPU
    graphs): nothing is changed."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(scalar_cpu_patch()) if scalar_cpu else contextlib.nullcontext()


def codegen_config(example_inputs: list, *, autotune: bool, cpu_simd: bool) -> contextlib.ExitStack:
    """Inductor's code-generation settings for one graph, patched while it generates code (its FX graph cache keys on
    them, so a cached graph is never one generated under other settings).

    ``autotune=False`` (minidi's default): nothing is benchmarked when a graph first runs. Inductor's deterministic
    mode picks each reduction kernel's config by rule (its block sizes fix the order of the sums, so the compiled
    numbers never depend on which config happened to time faster on a machine: a cold start, a warm start and
    another machine sum alike) and skips its other compile-time benchmarks (mm padding); a pointwise kernel gets one
    config. It also compiles one config per kernel instead of up to seven. ``True``: Inductor's stock behaviour
    (candidate configs compiled and timed at first run; the pick, and with it the sums, may differ between runs).
    Absent settings (older torch) are skipped.

    ``cpu_simd=False`` (default): CPU graphs compile scalar C++. Inductor's vectorised CPU code costs a large part
    of a CPU compile (its vectorisation analysis in Python, the C++ compiler on vector templates): tiny V4.1's cold
    start on 2 cores is 1.28-1.73x faster scalar, its compiled step ~1.5x slower (docs/benchmarks/README.md, round
    14). The results are the same: a faithful CPU graph's reductions and transcendentals run ATen's kernels
    (``exact_cpu``) and the remaining elementwise arithmetic rounds per IEEE op either way. ``True``: Inductor's SIMD
    code, for CPU runs of many steps.

    Scalar is pinned by ``cpp.simdlen = 0`` (no ISA has width 0, so ``pick_vec_isa`` answers "none" for the code
    generator and for the C++ flags alike, on every call), not by ``cpp.vec_isa_ok = False``: Inductor caches its list
    of valid ISAs per process at the first call, so in a process whose first CPU compile had SIMD on,
    ``vec_isa_ok=False`` still generated vector code, stored in the FX graph cache under the scalar key; a process
    that started scalar then loaded it and compiled it without the vector headers ("'at::vec' has not been
    declared", CI of round 18). ``simdlen`` is part of the cache key too."""
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    patch: dict[str, Any] = {}
    if not autotune:
        if hasattr(inductor_config, "deterministic"):
            patch["deterministic"] = True
        patch["triton.autotune_pointwise"] = False
    if not cpu_simd and all_cpu(example_inputs):
        patch.update(scalar_cpu_patch())
    if patch:
        stack.enter_context(inductor_config.patch(patch))
    if all_cpu(example_inputs):  # one g++ run per few kernels instead of one per kernel (``cpp_kernel_batch``)
        stack.enter_context(cpp_kernel_batch.batching())
    return stack


def inductor_cache_counts() -> Counter:
    """Hits / misses / bypasses of Inductor's FX graph cache ("fx ...") and AOTAutograd's cache ("aot ...")."""
    from torch._dynamo.utils import counters

    fx, aot = counters["inductor"], counters["aot_autograd"]
    out = Counter({f"fx {k}": fx[f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")})
    out.update({f"aot {k}": aot[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass")})
    return out


class Progress:
    """Compile progress lines to the ``minidi.compile`` logger (INFO) and to an optional callback."""

    def __init__(self, callback: Callable[[str], None] | None) -> None:
        self.callback = callback

    def __call__(self, line: str) -> None:
        log.info("%s", line)
        if self.callback is not None:
            self.callback(line)


def cache_note(delta: Counter) -> str:
    notes = []
    for prefix, name in (("fx", "Inductor FX graph cache"), ("aot", "AOTAutograd cache")):
        parts = [f"{v} {k.split()[1]}" for k, v in delta.items() if v > 0 and k.startswith(prefix)]
        if parts:
            notes.append(f"{name}: {', '.join(parts)}")
    return "".join(f", {n}" for n in notes)
