"""``minidi.compile``: a model step under ``torch.compile`` with minidi's passes, whole or layer by layer.

    step = minidi.compile(model, passes="all", strict=True, backend="inductor")   # the whole step as one graph
    step = minidi.compile(model, "all", regional=True)    # each Block on its own; layers of one kind share a graph
    logits = step(meta, cache)
    step.pass_manager.counts                              # tiny V4.1: {"C": 10, "E": 10, "D": 30, "A": 10, ...}
    step.uncompile()                                      # the model runs eagerly again

What lives here and not in ``minidi/passes`` (which knows passes, not models): the backend that runs the passes and
then the inner backend, the model's expected sites (``expected_sites``), per-layer compilation, and the settings a
compiled step runs under:

- **Shape settings** (``dynamic_shape_config``): one graph for every batch shape. Applied around every call of the
  compiled step (Dynamo reads them when it traces, which is on a call that misses its cache), together with raised
  recompile limits for per-layer compilation (one code object, ``Block``'s call, compiles one graph per layer kind).
  Nothing is set globally: after a call ``torch._dynamo.config`` is what it was.
- **Faithful rounding** (``faithful_rounding=True``, the default): Inductor keeps fused bf16 intermediates in fp32
  where eager rounds every op's output to bf16; with fake quant that flips FP8 roundings and top-k picks, and a
  compiled tiny model generated other greedy tokens than eager. ``torch._inductor.config.emulate_precision_casts``
  makes Inductor round where eager does. It is patched around the inner backend's call, which is where Inductor
  lowers and generates code for the graph (its FX graph cache keys on the setting). On a CPU graph the reductions
  and transcendentals also run as ATen's kernels (``runtime/exact_cpu.py``: Inductor's own sum in another order),
  so a compiled CPU step equals the eager step bitwise (tiny V4.1 / V4, no passes; the passes' ops sum in their
  own order). ``"exact"`` does that on GPU graphs too (eager's sums and exp; norms and softmax then leave Inductor's
  fused kernels); ``False`` patches both off.
- **Progress**: logger ``minidi.compile`` at INFO (and ``progress(line)`` if given): a start and an end line for the
  step's compile, and, per layer kind compiled by ``regional=True``, its layers, seconds and the hits / misses of
  Inductor's FX graph cache and AOTAutograd's cache. ``step.compile_s``: the first call's seconds by phase
  (Dynamo tracing, the passes, the inner backend, torch's own AOT / lowering / codegen / kernel-compile phases).
- **Caches**: the passes insert calls of minidi's op wrappers, which AOTAutograd's cache would refuse (it then
  re-traces every graph on every start); they are marked cacheable, keyed by the hash of minidi's sources.
  ``compile_cache=DIR`` saves / loads the compiled artifacts for warm starts in other processes or machines
  (``compile_cache.py``).

(Over 350 lines: the two step kinds share the backend, the settings context and the progress helpers; the compile
cache lives in ``compile_cache.py``, the first step's bookkeeping in ``first_step.py``.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from typing import Any, Callable, Iterable

import torch
from torch.fx import GraphModule

from minidi.model.config import ModelConfig
from minidi.passes import PassManager
from minidi.runtime.exact_cpu import all_cpu, aten_kernels

from .compile_cache import CompileCache, cacheable_minidi_calls, clear_recorded_artifacts, device_of, key_fields
from .first_step import FirstStep

log = logging.getLogger("minidi.compile")

GEMMS_PER_MOE = 3  # w1, w3, w2: pass D matches each expert GEMM
HC_SITES_PER_LAYER = 2  # the attention and the FFN mHC site: passes F (mixer) and G (stream update) match each
_RECOMPILE_LIMITS = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit")


def expected_sites(cfg: ModelConfig, regional: bool = False) -> dict[str, list[int | None]]:
    """Layer of every site each pass must match in one model step, from the config.

    A: every layer (window-only layers too); B: every index-source layer (V4.1: owners and re-index layers; V4:
    the ratio-4 layers); C, E: every layer (one MoE each, hash-routed layers still compute the gate logits);
    D: every layer, three times (w1, w3, w2); F: every layer twice (the attention and FFN mHC mixers), plus V4's
    head (``hc_head``, outside the layers: site None) unless ``regional`` (only the layers are compiled then);
    G: every layer twice (the stream update after attention and after the MoE); H and I: every layer (the MoE's
    expert activation and its dispatch gather; in fp32 models only after D). Only the selected passes are checked."""
    layers = list(range(cfg.n_layers))
    head: list[int | None] = [] if (cfg.is_v41 or regional) else [None]
    return {
        "A": layers,
        "B": [i for i in layers if cfg.is_index_source(i)],
        "C": layers,
        "D": [i for i in layers for _ in range(GEMMS_PER_MOE)],
        "E": layers,
        "F": [i for i in layers for _ in range(HC_SITES_PER_LAYER)] + head,
        "G": [i for i in layers for _ in range(HC_SITES_PER_LAYER)],
        "H": layers,
        "I": layers,
    }


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


def _call_settings(dynamic: bool | None, recompile_limit: int | None) -> contextlib.ExitStack:
    """The Dynamo settings a compiled step's call runs under (Dynamo reads them when a call traces)."""
    stack = contextlib.ExitStack()
    if dynamic is not False:
        stack.enter_context(dynamic_shape_config())
    if recompile_limit is not None:
        cfg = torch._dynamo.config
        limits = {n: max(getattr(cfg, n), recompile_limit) for n in _RECOMPILE_LIMITS if hasattr(cfg, n)}
        stack.enter_context(cfg.patch(**limits))
    return stack


def _rounding_config(faithful: bool | str, example_inputs: list) -> contextlib.ExitStack:
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


def _inductor_cache_counts() -> Counter:
    """Hits / misses / bypasses of Inductor's FX graph cache ("fx ...") and AOTAutograd's cache ("aot ...")."""
    from torch._dynamo.utils import counters

    fx, aot = counters["inductor"], counters["aot_autograd"]
    out = Counter({f"fx {k}": fx[f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")})
    out.update({f"aot {k}": aot[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass")})
    return out


def make_backend(manager: PassManager, inner: str | Callable = "inductor", *,
                 faithful_rounding: bool | str = True, times: dict[str, float] | None = None) -> Callable:
    """A ``torch.compile`` backend: run the passes on Dynamo's GraphModule, then the inner backend on the result,
    with Inductor's ``emulate_precision_casts`` set to ``faithful_rounding`` while the inner backend compiles.
    ``times`` (default: a new one): the dict its seconds in the passes / the inner backend add up in (two backends
    of one step share one)."""
    from torch._dynamo.backends.registry import lookup_backend

    if not (isinstance(faithful_rounding, bool) or faithful_rounding == "exact"):
        raise ValueError(f"faithful_rounding must be True, False or 'exact', got {faithful_rounding!r}")
    inner_fn = lookup_backend(inner) if isinstance(inner, str) else inner
    times = {"passes": 0.0, "backend": 0.0} if times is None else times

    def minidi_backend(gm: GraphModule, example_inputs: list) -> Callable:
        n, layer = len(manager.history), manager.current_layer
        before = manager.layer_counts.get(layer)
        t0 = time.perf_counter()
        manager.run(gm)
        t1 = time.perf_counter()
        times["passes"] += t1 - t0
        try:
            with _rounding_config(faithful_rounding, example_inputs), cacheable_minidi_calls(gm):
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


class _Progress:
    """Compile progress lines to the ``minidi.compile`` logger (INFO) and to an optional callback."""

    def __init__(self, callback: Callable[[str], None] | None) -> None:
        self.callback = callback

    def __call__(self, line: str) -> None:
        log.info("%s", line)
        if self.callback is not None:
            self.callback(line)


def _cache_note(delta: Counter) -> str:
    notes = []
    for prefix, name in (("fx", "Inductor FX graph cache"), ("aot", "AOTAutograd cache")):
        parts = [f"{v} {k.split()[1]}" for k, v in delta.items() if v > 0 and k.startswith(prefix)]
        if parts:
            notes.append(f"{name}: {', '.join(parts)}")
    return "".join(f", {n}" for n in notes)


class CompiledStep:
    """A model step compiled as one graph (``minidi.compile(..., regional=False)``). ``pass_manager`` holds the
    counts; calls run under the step's Dynamo settings; ``uncompile()`` makes later calls run the eager step."""

    def __init__(self, fn: Callable, manager: PassManager, compiled: Callable, *, dynamic: bool | None,
                 progress: _Progress, what: str, first: FirstStep) -> None:
        self.fn, self.pass_manager, self._compiled = fn, manager, compiled
        self.dynamic, self._progress, self._what = dynamic, progress, what
        self.calls = 0
        self.first_step, self.compile_cache = first, first.cache  # first_step: its phases, Triton compiles
        self.compile_s: dict[str, float] = {}  # the first call's seconds by phase (FirstStep.finish)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphs, cache0, t0 = len(self.pass_manager.history), _inductor_cache_counts(), time.perf_counter()
        if self.calls == 0:
            self._progress(f"minidi.compile: compiling {self._what} as one graph ...")
            self.first_step.start()
        self.calls += 1
        try:
            with _call_settings(self.dynamic, None):
                out = self._compiled(*args, **kwargs)
        finally:
            self.first_step.triton.stop()  # also when the first call raised: no listener left behind
        if self.calls == 1:
            self.compile_s = self.first_step.finish(lambda: dict(self.pass_manager.counts))
        new = len(self.pass_manager.history) - graphs
        if new or self.calls == 1:
            verb = "compiled" if self.calls == 1 else "recompiled"
            self._progress(f"minidi.compile: {verb} {self._what} in {time.perf_counter() - t0:.1f} s ({new} graph(s)"
                           f"{_cache_note(_inductor_cache_counts() - cache0)})")
        return out

    def uncompile(self) -> None:
        """Later calls run the eager step (Dynamo's cached graphs stay until ``torch._dynamo.reset()``)."""
        self._compiled = self.fn


def layer_kind(block: torch.nn.Module) -> Any:
    """The block's kind (``Block.kind()``: the model names its layer kinds; a named tuple for the progress lines)."""
    return block.kind()


def _describe(kind: Any) -> str:
    """A short label: a named kind's first field, then its other fields that are set (``ratio=4, engram``)."""
    if not hasattr(kind, "_asdict"):
        return str(kind)
    (k0, v0), *rest = kind._asdict().items()
    shown = [k if v is True else f"{k}={v}" for k, v in rest if v is not False and v is not None]
    return ", ".join([f"{k0}={v0}", *shown])


def _compiled_layer(block: torch.nn.Module, backend: Callable, front_backend: Callable | None,
                    dynamic: bool | None, compile_kwargs: dict) -> Callable:
    """The block's call (``Block.forward``'s composition: ``core`` after ``front``) with each part compiled: ``core``
    by the pass backend (one graph per ``kind()``, shared by the kind's layers through Dynamo's cache of its code),
    an Engram ``front`` by ``front_backend`` (its own graph, shared by the Engram layers; no pass sites in it). Set
    as the block's ``_compiled_call_impl``, the slot ``nn.Module.compile`` uses, so that the block's eager call
    (``_call_impl``) stays the model's own."""
    core = torch.compile(block.core, backend=backend, dynamic=dynamic, **compile_kwargs)
    front = None
    if getattr(block, "has_front", False):
        front = torch.compile(block.front, backend=front_backend or backend, dynamic=dynamic, **compile_kwargs)

    def call(x, pre, meta, cache, shared, engram_ids=None):
        if front is not None:
            x = front(x, engram_ids)
        return core(x, pre, meta, cache, shared)

    return call


class RegionalStep:
    """A model step whose layers are compiled one by one (``minidi.compile(..., regional=True)``).

    Each ``Block`` is compiled on its own; layers of the same kind (``layer_kind``) share one compiled graph, so a
    40-layer model compiles a handful of graphs instead of one 40-layer graph (minutes less on the GPU). A minidi
    Block's Engram (``Block.front``) compiles apart from the rest (``Block.core``, ``_compiled_layer``): one graph for
    the Engram layers, so that they share their kind's graph (V4.1-Flash: 5 layer graphs instead of 7). Everything
    between the layers (embedding, Engram hashing, head) runs eagerly. The step owns ``model.layer_hook`` (the model
    calls it with the layer index before each layer) while compiled: it tells the pass manager which layer a graph
    is compiled for and times each layer kind's compile. With ``strict``, every compiled graph is checked against
    the sites of the layer it was compiled for; ``counts`` is then the model's total, summing each layer's graph (a
    layer that ran a graph compiled for another layer of its kind counts that graph). ``uncompile()`` restores the
    eager model (its blocks' calls and its layer hook)."""

    def __init__(self, model: torch.nn.Module, manager: PassManager, backend: Callable, *, dynamic: bool | None,
                 progress: _Progress, first: FirstStep, front_backend: Callable | None = None,
                 **compile_kwargs: Any) -> None:
        if getattr(model, "layer_hook", None) is not None:
            raise RuntimeError("the model already has a layer_hook (compiled regionally already? uncompile() first)")
        self.model, self.pass_manager = model, manager
        self.kinds = [layer_kind(b) for b in model.layers]
        self.dynamic, self._progress = dynamic, progress
        self.recompile_limit = 4 * len(model.layers)  # one code object (Block's call), one graph per layer kind
        self.calls = 0
        self.first_step, self.compile_cache = first, first.cache  # first_step: its phases, Triton compiles
        self.compile_s: dict[str, float] = {}  # the first call's seconds by phase (FirstStep.finish)
        self._open: tuple[int, int, float, Counter] | None = None  # (layer, graphs before, t0, cache counts)
        self._timed: set[Any] = set()
        self.front_backend = front_backend
        for block in model.layers:
            if callable(getattr(block, "core", None)):  # a minidi Block: its core and front compiled apart
                block._compiled_call_impl = _compiled_layer(block, backend, front_backend, dynamic, compile_kwargs)
            else:
                block.compile(backend=backend, dynamic=dynamic, **compile_kwargs)
        model.layer_hook = self._before_layer

    def _before_layer(self, i: int) -> None:
        self._close_layer()
        self.pass_manager.current_layer = i
        self._open = (i, len(self.pass_manager.history), time.perf_counter(), _inductor_cache_counts())

    def _close_layer(self) -> None:
        if self._open is None:
            return
        i, graphs, t0, cache0 = self._open
        self._open = None
        new = len(self.pass_manager.history) - graphs
        if not new:
            return
        kind = self.kinds[i]
        layers = [j for j, k in enumerate(self.kinds) if k == kind]
        order = list(dict.fromkeys(self.kinds))
        again = " again" if kind in self._timed else ""
        self._timed.add(kind)
        self._progress(f"minidi.compile: layer kind {order.index(kind) + 1}/{len(order)} ({_describe(kind)}) "
                       f"compiled{again} for layer {i} in {time.perf_counter() - t0:.1f} s ({new} graph(s); serves "
                       f"layers {layers}{_cache_note(_inductor_cache_counts() - cache0)})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first, t0 = self.calls == 0, time.perf_counter()
        graphs = len(self.pass_manager.history)
        if first:
            self._progress(f"minidi.compile: compiling {len(self.kinds)} layers ({len(set(self.kinds))} kinds) "
                           "one by one ...")
            self.first_step.start()
        self.calls += 1
        ok = False
        try:
            with _call_settings(self.dynamic, self.recompile_limit):
                out = self.model.step(*args, **kwargs)
            ok = True
            return out
        finally:
            self.first_step.triton.stop()  # also when the first call raised: no listener left behind
            self._close_layer()
            self.pass_manager.current_layer = None
            if first and ok:
                self.compile_s = self.first_step.finish(lambda: self.counts if self.pass_manager.keys else {})
            if first:
                fronts = len(getattr(getattr(self.front_backend, "pass_manager", None), "history", ()))
                extra = f" (+{fronts} Engram graph(s))" if fronts else ""
                self._progress(f"minidi.compile: compiled {len(self.pass_manager.history) - graphs} graph(s) for "
                               f"{len(set(self.kinds))} layer kinds{extra} in {time.perf_counter() - t0:.1f} s "
                               "(first step, eager parts included)")

    def uncompile(self) -> None:
        """The model's eager calls back: every block's compiled call dropped, the layer hook removed. (Dynamo's
        cached graphs stay until ``torch._dynamo.reset()``; the model is as it was before ``minidi.compile``.)"""
        for block in self.model.layers:
            block._compiled_call_impl = None  # what nn.Module.compile() set; torch has no public inverse
        if getattr(self.model, "layer_hook", None) == self._before_layer:
            self.model.layer_hook = None

    @property
    def counts(self) -> dict[str, int]:
        """Matches summed over the model's layers (each layer counted with the graph of its kind)."""
        by_kind = {self.kinds[i]: c for i, c in self.pass_manager.layer_counts.items()}
        total: Counter = Counter({k: 0 for k in self.pass_manager.keys})
        for i, kind in enumerate(self.kinds):
            if kind not in by_kind:
                raise RuntimeError(f"layer {i} ran no compiled graph of its kind {kind} (has the step run?)")
            total.update(by_kind[kind])
        return dict(total)

    @property
    def graphs(self) -> int:
        return len(self.pass_manager.layer_counts)


def uncompile(model_or_step: Any) -> None:
    """Undo ``minidi.compile``: a compiled step's ``uncompile()``, or, given the model, drop a per-layer compile
    of its blocks (and the layer hook a ``RegionalStep`` installed) without holding the step."""
    if callable(getattr(model_or_step, "uncompile", None)) and not isinstance(model_or_step, torch.nn.Module):
        model_or_step.uncompile()
        return
    hook = getattr(model_or_step, "layer_hook", None)
    owner = getattr(hook, "__self__", None)
    if isinstance(owner, RegionalStep):
        owner.uncompile()
    for block in getattr(model_or_step, "layers", ()):
        block._compiled_call_impl = None  # a Block.compile() of anyone else's too


def compile(  # noqa: A001 (minidi.compile mirrors torch.compile)
    model_or_step: torch.nn.Module | Callable,
    passes: str | Iterable[str] | None = "all",
    *,
    strict: bool = False,
    backend: str | Callable = "inductor",
    op_backend: str = "auto",
    expected: dict[str, list[int]] | None = None,
    keep_graphs: bool = False,
    fullgraph: bool = True,
    dynamic: bool | None = True,
    regional: bool = False,
    faithful_rounding: bool | str = True,
    progress: Callable[[str], None] | None = None,
    compile_cache: str | os.PathLike | None = None,
    **compile_kwargs: Any,
) -> CompiledStep | RegionalStep:
    """Compile a model step (a minidi ``Transformer``: its ``step``; or any callable / module) with minidi's passes.

    ``passes``: "all", "none", "A,B" or a list of keys / names. ``strict``: fail compilation when a pass matches a
    different number of sites than ``expected`` (default: ``expected_sites(model.cfg)`` when the model has a
    config; strict needs ``fullgraph=True``: one graph must hold the whole step). ``backend``: the inner backend
    that compiles the rewritten graph ("inductor", "aot_eager", ...). ``op_backend``: the backend of the ops the passes
    insert: "auto" (the Triton kernels on CUDA, or on the CPU under ``TRITON_INTERPRET=1``; else their plain-torch
    references), "triton" (the kernels, or a clear error where they cannot run) or "ref". ``regional``: compile each
    layer on its own (``RegionalStep``). ``faithful_rounding``: Inductor rounds fused intermediates where eager rounds
    (default; see the module docstring; on CPU graphs with ATen's reduction / transcendental kernels, bitwise eager),
    ``"exact"`` ATen's kernels on every graph (GPU too: eager's sums, unfused norms), ``False`` Inductor's stock
    fused-fp32 rounding. ``progress``: called with each
    progress line (they also go to the ``minidi.compile`` logger at INFO). ``compile_cache``: a folder of compiled
    artifacts (``compile_cache.py``): loaded before compiling when an entry for this model, these settings and this
    software and device exists, else written after the first step. The result has ``.pass_manager``,
    ``.compile_cache`` (None, or its status: ``.status`` "hit" / "miss", ``.reason``, ``.artifact_bytes``),
    ``.compile_s`` (the first call's seconds by phase) and ``.uncompile()``.
    """
    fn = model_or_step
    owner = model_or_step
    if isinstance(model_or_step, torch.nn.Module) and callable(getattr(model_or_step, "step", None)):
        fn = model_or_step.step
    else:
        owner = getattr(model_or_step, "__self__", model_or_step)
    cfg = getattr(owner, "cfg", None)
    if callable(getattr(owner, "set_eager_budget", None)):
        owner.set_eager_budget(None)  # compiled graphs trace the whole chains the passes match; budgets are eager's
    if expected is None and isinstance(cfg, ModelConfig):
        expected = expected_sites(cfg, regional=regional)
    manager = PassManager(passes, strict=strict, expected=expected, op_backend=op_backend, keep_graphs=keep_graphs)
    inner = make_backend(manager, backend, faithful_rounding=faithful_rounding)
    report = _Progress(progress)
    if regional and (not hasattr(owner, "layers") or not hasattr(owner, "step")):
        raise TypeError("regional compilation needs a minidi Transformer (with .layers and .step)")
    cache = None
    if compile_cache is not None:
        fields = key_fields(owner, passes=manager.keys, strict=strict, op_backend=op_backend,
                            faithful_rounding=faithful_rounding, dynamic=dynamic, regional=regional,
                            fullgraph=fullgraph, backend=backend, compile_kwargs=compile_kwargs)
        cache = CompileCache(compile_cache, fields, device=device_of(owner))
        clear_recorded_artifacts()  # the entry holds this compile's artifacts, not an earlier one's in this process
        cache.load()
    first = FirstStep(inner, cache)
    if regional:
        fronts = make_backend(PassManager(None, op_backend=op_backend), backend, faithful_rounding=faithful_rounding,
                              times=inner.times)  # type: ignore[attr-defined]  # Engram fronts: no pass sites
        return RegionalStep(owner, manager, inner, dynamic=dynamic, progress=report, first=first,
                            front_backend=fronts, fullgraph=fullgraph, **compile_kwargs)
    compiled = torch.compile(fn, backend=inner, fullgraph=fullgraph, dynamic=dynamic, **compile_kwargs)
    name = getattr(cfg, "name", None) or type(owner).__name__
    what = f"the {name} step" + (f" (passes {','.join(manager.keys)})" if manager.keys else "")
    return CompiledStep(fn, manager, compiled, dynamic=dynamic, progress=report, what=what, first=first)
