"""``minidi.compile``: a model step under ``torch.compile`` with minidi's passes, whole or layer by layer.

    step = minidi.compile(model, passes="all", strict=True, backend="inductor")   # the whole step as one graph
    step = minidi.compile(model, "all", regional=True)    # each Block on its own; layers of one kind share a graph
    logits = step(meta, cache)
    step.pass_manager.counts                              # tiny V4.1: {"C": 10, "E": 10, "D": 30, "A": 10, ...}
    step.uncompile()                                      # the model runs eagerly again

What lives here and not in ``minidi/passes`` (which knows passes, not models): the model's expected sites
(``expected_sites``), the whole-step compile (``CompiledStep``) and how many compile workers a per-layer compile
starts (``worker_count``). Beside it: the backend that runs the passes and then the inner backend
(``pass_backend.py``), per-layer compilation (``regional.py``: ``RegionalStep``, one graph per layer kind; with a
compile cache or compile workers, layers compiled ahead of time, ``precompiled.py``, in worker processes during an
eager first step, ``compile_workers.py``), the settings a compiled step runs under
and its progress lines (``compile_settings.py``: one graph for every batch shape, faithful rounding, the lines of
logger ``minidi.compile``), the compile cache (``compile_cache.py``) and the first step's bookkeeping
(``first_step.py``).

- **Faithful rounding** (``faithful_rounding=True``, the default): Inductor keeps fused bf16 intermediates in fp32
  where eager rounds every op's output to bf16; with fake quant that flips FP8 roundings and top-k picks, and a
  compiled tiny model generated other greedy tokens than eager. ``torch._inductor.config.emulate_precision_casts``
  makes Inductor round where eager does. It is patched around the inner backend's call, which is where Inductor
  lowers and generates code for the graph (its FX graph cache keys on the setting). On a CPU graph the reductions
  and transcendentals also run as ATen's kernels (``runtime/exact_cpu.py``: Inductor's own sum in another order),
  so a compiled CPU step equals the eager step bitwise (tiny V4.1 / V4, no passes; the passes' ops sum in their
  own order). ``"exact"`` does that on GPU graphs too (eager's sums and exp; norms and softmax then leave Inductor's
  fused kernels); ``False`` patches both off.
- **Caches**: the passes insert calls of minidi's op wrappers, which AOTAutograd's cache would refuse (it then
  re-traces every graph on every start); they are marked cacheable, keyed by the hash of minidi's sources.
  ``compile_cache=DIR`` saves / loads the compiled artifacts for warm starts in other processes or machines.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterable

import torch

from minidi.model import stages
from minidi.model.config import ModelConfig
from minidi.ops.fq8 import BLOCKS as FQ8_BLOCKS
from minidi.passes import PassManager

from .compile_cache import CompileCache, clear_recorded_artifacts, device_of, key_fields, triton_dir
from .compile_settings import (Progress, cache_note, call_settings, dynamic_shape_config, inductor_cache_counts,
                               mark_leading_dims_only)
from .compile_workers import CompileWorkers, WorkerSettings
from .first_step import FirstStep
from .pass_backend import make_backend
from .precompiled import PrecompiledCalls
from .precompiled import available as precompiled_available
from .regional import RegionalStep, layer_kind

log = logging.getLogger("minidi.compile")

GEMMS_PER_MOE = 3  # w1, w3, w2: pass D matches each expert GEMM
FP8_EXPERT_SITES = 2  # pass L: the w1 / w3 GEMMs on one gather (one match), the w2 GEMM on the activation
HC_SITES_PER_LAYER = 2  # the attention and the FFN mHC site: passes F (mixer) and G (stream update) match each
def expected_sites(cfg: ModelConfig, regional: bool = False) -> dict[str, list[int | None]]:
    """Layer of every site each pass must match in one model step, from the config.

    A: every layer (window-only layers too); B: every index-source layer (V4.1: owners and re-index layers; V4: the
    ratio-4 layers); C, E: every layer (one MoE each, hash-routed layers still compute the gate logits); D: every layer,
    three times (w1, w3, w2); F: every layer twice (the attention and FFN mHC mixers), plus V4's head (``hc_head``,
    outside the layers: site None) unless ``regional`` (only the layers are compiled then); J: F's sites (each mixer's
    projection, mean square and, V4.1, the collapse of its input); K: every layer twice (each mixer's Sinkhorn; V4's
    head has none); G: every layer twice (the stream update after attention and after the MoE); U: every layer (its
    attention site's update and the MoE site's mixer reads of it: G's and J's ops); H and I: every layer (the MoE's
    expert activation and its dispatch gather; in fp32 models only after D); L: every layer twice with fake quant (the
    up and down expert GEMMs on FP8), none without; M: every V4.1 re-index layer (its indexer scores only the candidate
    source's blocks); T: the V4.1 candidate source layer (its block selection); N: every FP8 linear (per layer the
    attention's wq_a, wq_b, wkv, wo_b and the shared expert's w1, w3, w2; an index-source layer's indexer wq_b; an
    Engram layer's wkv, except with ``regional``: the Engram front graph has its own check); R: every group of FP8
    linears that read one input with fake quant on (per layer attention's wq_a + wkv and the shared expert's w1 + w3; an
    index-source layer's wq_b + indexer wq_b), none without; O: the output head's GEMM (site None), except with
    ``regional`` (the head graph has its own check: ``HEAD_PASSES``); P: every layer routed by score (the router's
    top-k; hash-routed layers have none); Q: every layer (the MoE dispatch's sort by expert); S: two per softmax-pooling
    compressor a layer runs (its wkv and wgate GEMMs: ``compressor_gemms``); V: V4's index-source layers twice with
    fake quant (the Hadamard rotations of the indexer's q and k), none in V4.1. Only the selected passes are checked."""
    layers = list(range(cfg.n_layers))
    head: list[int | None] = [] if (cfg.is_v41 or regional) else [None]
    return {
        "A": layers,
        "B": [i for i in layers if cfg.is_index_source(i)],
        "C": layers,
        "D": [i for i in layers for _ in range(GEMMS_PER_MOE)],
        "E": layers,
        "F": [i for i in layers for _ in range(HC_SITES_PER_LAYER)] + head,
        "J": [i for i in layers for _ in range(HC_SITES_PER_LAYER)] + head,
        "K": [i for i in layers for _ in range(HC_SITES_PER_LAYER)],
        "G": [i for i in layers for _ in range(HC_SITES_PER_LAYER)],
        "U": layers,
        "H": layers,
        "I": layers,
        "L": [i for i in layers for _ in range(FP8_EXPERT_SITES)] if fp8_experts_apply(cfg) else [],
        "M": [i for i in layers if cfg.is_candidate_filtered(i)],
        "T": [i for i in layers if cfg.is_candidate_source(i)],
        "N": [i for i in layers for _ in range(fp8_linears(cfg, i, regional))],
        "R": [i for i in layers for _ in range(shared_fq8_inputs(cfg, i))],
        "O": [] if regional else [None],
        "P": [i for i in layers if not cfg.is_hash_layer(i)],
        "Q": layers,
        "S": [i for i in layers for _ in range(compressor_gemms(cfg, i))],
        "V": [i for i in layers for _ in range(hadamard_sites(cfg, i))],
    }


def hadamard_sites(cfg: ModelConfig, layer: int) -> int:
    """Hadamard rotations of a layer (pass V's sites): V4's indexer rotates its q and its new keys before their fq4,
    with fake quant on (``IndexerV4._quant``)."""
    return 2 if (not cfg.is_v41 and cfg.fake_quant and cfg.is_index_source(layer)) else 0


FRONT_PASSES = ("N",)  # the passes with a site in a regional step's Engram front graph (its wkv)
HEAD_PASSES = ("O",)  # the passes with a site in a regional step's head graph (its fp32 GEMM)


def fp8_linears(cfg: ModelConfig, layer: int, regional: bool = False) -> int:
    """FP8 linears of a layer (pass N's sites): 5 in attention (wq_a, wq_b, wkv, wo_b and the grouped wo_a), 3 in
    the shared expert, the indexer's wq_b where the layer is an index source, the Engram's wkv where it has one (not
    with ``regional``: the Engram front compiles apart, with its own check: one site per front graph)."""
    return 5 + 3 + int(cfg.is_index_source(layer)) + int(layer in cfg.engram_layers and not regional)


def shared_fq8_inputs(cfg: ModelConfig, layer: int) -> int:
    """Inputs of a layer that several FP8 linears fake-quantise (pass R's sites): the attention input (wq_a, wkv),
    the shared expert's input (w1, w3) and, in an index-source layer, the query latent (attention's wq_b, the
    indexer's wq_b); none without fake quant (the linears take their inputs as they are) or with an fq8 block the
    linears' op does not take (pass N then leaves each linear its own fq8 chain)."""
    if not (cfg.fake_quant and cfg.act_block in FQ8_BLOCKS):
        return 0
    return 2 + int(cfg.is_index_source(layer))


def compressor_gemms(cfg: ModelConfig, layer: int) -> int:
    """fp32 GEMMs of a layer's softmax-pooling compressors (pass S's sites, two per compressor: wkv and wgate). V4.1:
    a ratio-2 kv source runs one (a ratio-1 compressor is a bf16 projection; other layers share the source's
    entries); V4: every compressed layer its attention's, and a ratio-4 layer its indexer's as well."""
    ratio = cfg.compress_ratios[layer]
    if cfg.is_v41:
        return 2 * int(ratio == 2 and cfg.is_kv_source(layer))
    return 2 * (int(ratio > 0) + int(ratio == 4))


def fp8_experts_apply(cfg: ModelConfig) -> bool:
    """Pass L has its sites (the up and down expert GEMMs) where the experts' inputs are fq8 in blocks of a multiple
    of 32: with fake quant on (both presets)."""
    return cfg.fake_quant and cfg.act_block % 32 == 0


class CompiledStep:
    """A model step compiled as one graph (``minidi.compile(..., regional=False)``). ``pass_manager`` holds the
    counts; calls run under the step's Dynamo settings; ``uncompile()`` makes later calls run the eager step."""

    def __init__(self, fn: Callable, manager: PassManager, compiled: Callable, *, dynamic: bool | None,
                 progress: Progress, what: str, first: FirstStep) -> None:
        self.fn, self.pass_manager, self._compiled = fn, manager, compiled
        self.dynamic, self._progress, self._what = dynamic, progress, what
        self.calls = 0
        self.first_step, self.compile_cache = first, first.cache  # first_step: its phases, Triton compiles
        self.compile_s: dict[str, float] = {}  # the first call's seconds by phase (FirstStep.finish)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphs, cache0, t0 = len(self.pass_manager.history), inductor_cache_counts(), time.perf_counter()
        if self.calls == 0:
            self._progress(f"minidi.compile: compiling {self._what} as one graph ...")
            self.first_step.start()
        self.calls += 1
        if self.calls == 1 and self.dynamic is not False:
            mark_leading_dims_only((args, kwargs))  # where the step traces (later calls skip the walk)
        try:
            with call_settings(self.dynamic, None):
                out = self._compiled(*args, **kwargs)
        finally:
            self.first_step.triton.stop()  # also when the first call raised: no listener left behind
        if self.calls == 1:
            self.compile_s = self.first_step.finish(lambda: dict(self.pass_manager.counts))
        new = len(self.pass_manager.history) - graphs
        if new or self.calls == 1:
            verb = "compiled" if self.calls == 1 else "recompiled"
            self._progress(f"minidi.compile: {verb} {self._what} in {time.perf_counter() - t0:.1f} s ({new} graph(s)"
                           f"{cache_note(inductor_cache_counts() - cache0)})")
        return out

    def uncompile(self) -> None:
        """Later calls run the eager step (Dynamo's cached graphs stay until ``torch._dynamo.reset()``)."""
        self._compiled = self.fn


def _precompiled_calls(cache: CompileCache | None, dynamic: bool | None, fullgraph: bool,
                       workers: bool = False, scalar_cpu: bool = False) -> PrecompiledCalls | None:
    """Per-layer graphs compiled ahead of time where a compile cache keeps them or compile workers compile them
    (``precompiled.py``; torch >= 2.10, whole graphs): loaded from a hit's entry, else compiled on the first step (in
    the workers, or here) and saved into the entry."""
    if (cache is None and not workers) or not fullgraph or not precompiled_available():
        return None
    calls = PrecompiledCalls(dynamic=dynamic, scalar_cpu=scalar_cpu)
    if cache is not None and cache.status == "hit" and cache.precompiled:
        try:
            calls.loads(cache.precompiled)
        except Exception as e:  # a stale entry is compiled afresh, never half-used
            log.warning("minidi.compile: compile cache %s: precompiled graphs not loaded (%s: %s); compiling",
                        cache.path, type(e).__name__, e)
            calls = PrecompiledCalls(dynamic=dynamic, scalar_cpu=scalar_cpu)
            cache.status, cache.reason = "miss", f"precompiled graphs unreadable ({type(e).__name__})"
        cache.load_s += calls.load_s  # the entry's load: artifacts, kernels and these graphs
    return calls


MAX_AUTO_WORKERS = 8  # compile_workers=None: at most this many processes


def worker_count(requested: int | None, owner: Any, backend: Any, fullgraph: bool) -> int:
    """How many compile workers a regional compile starts: ``requested`` if given (0: none). None: with a string
    backend and whole graphs, one per distinct label (layer kinds, an Engram front, the head), at most
    ``MAX_AUTO_WORKERS`` and, on a CUDA model, half the CPUs this process may use (each worker also compiles Triton
    kernels in a thread pool); on a CPU model with Inductor, all of them when there are at least two (a worker's C++
    kernels compile in one batched g++ run per graph, ``cpp_kernel_batch.py``, so its Python work and the compiler
    share one core; tiny V4.1 on 2 cores: docs/benchmarks/README.md, round 27). Otherwise 0: one CPU, or a CPU model
    with another backend (aot_eager compiles a kind in about the time a worker takes to start)."""
    if requested is not None:
        if requested < 0:
            raise ValueError(f"compile_workers must be >= 0 or None, got {requested}")
        if requested and not isinstance(backend, str):
            raise ValueError("compile_workers needs the inner backend by name (a worker process builds it), got "
                             f"{backend!r}")
        if requested and not fullgraph:
            raise ValueError("compile_workers needs fullgraph=True (workers compile whole layer graphs)")
        return requested
    if not isinstance(backend, str) or not fullgraph:
        return 0
    labels = len({layer_kind(b) for b in owner.layers}) + 2
    cpus = usable_cpus()
    if device_of(owner).type == "cuda":
        return max(0, min(labels, cpus // 2, MAX_AUTO_WORKERS))
    if backend != "inductor" or cpus < 2:
        return 0
    return min(labels, cpus, MAX_AUTO_WORKERS)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS reports one, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_triton_cache(owner: Any) -> None:
    """Compile workers and this process must use one Triton cache folder, so that the kernels a worker compiles
    (minidi's ops, Inductor's launchers) are found here: ``TRITON_CACHE_DIR``, set where unset to the folder Inductor
    itself would set at its first kernel load (``compile_cache.triton_dir``); the workers inherit it. Until Inductor
    sets it, Triton's JIT would use its default folder (``~/.triton/cache``) in one process and Inductor's in
    another."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return
    folder = triton_dir(device_of(owner))
    if folder is not None:
        os.environ["TRITON_CACHE_DIR"] = str(folder)


def _cuda_index(owner: Any) -> int | None:
    d = device_of(owner)
    return (d.index if d.index is not None else torch.cuda.current_device()) if d.type == "cuda" else None


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
    if isinstance(getattr(model_or_step, "head", None), torch.nn.Module):
        model_or_step.head._compiled_call_impl = None


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
    autotune: bool = False,
    cpu_simd: bool = False,
    precompile_kernels: bool = True,
    progress: Callable[[str], None] | None = None,
    compile_cache: str | os.PathLike | None = None,
    compile_workers: int | None = None,
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
    fused-fp32 rounding. ``autotune``: let Inductor benchmark its kernels' candidate configs at a graph's first run
    (default False: one config each, reductions' by rule, so compiled sums never depend on timings, and a shorter
    first step; ``compile_settings.codegen_config``). ``cpu_simd``: vectorised C++ for CPU graphs (default False:
    scalar C++, the same results, a faster compile and a slower step; ``codegen_config``). ``precompile_kernels``:
    compile the Triton kernels of each graph's minidi ops in a thread pool while AOT and Inductor work on the graph
    (default True; GPU only; ``kernel_precompile.py``: the same kernels, compiled earlier). ``progress``: called with
    each progress line (they also go to the ``minidi.compile`` logger at INFO). ``compile_cache``: a folder of compiled
    artifacts (``compile_cache.py``): loaded before compiling when an entry for this model, these settings and this
    software and device exists, else written after the first step. The result has ``.pass_manager``,
    ``.compile_cache`` (None, or its status: ``.status`` "hit" / "miss", ``.reason``, ``.artifact_bytes``),
    ``.compile_s`` (the first call's seconds by phase) and ``.uncompile()``. ``compile_workers`` (``regional`` only):
    compile the layer kinds in that many worker processes at once while the first step runs its layers eagerly
    (``compile_workers.py``); None: one per kind, up to ``MAX_AUTO_WORKERS`` and half the CPUs on CUDA models, all
    of them on CPU models with Inductor (at least two), with a string ``backend`` (``worker_count``); else 0
    (in-process, one kind after another).
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
    codegen = {"autotune": bool(autotune), "cpu_simd": bool(cpu_simd)}
    inner = make_backend(manager, backend, faithful_rounding=faithful_rounding,
                         precompile_kernels=precompile_kernels, **codegen)
    report = Progress(progress)
    if regional and (not hasattr(owner, "layers") or not hasattr(owner, "step")):
        raise TypeError("regional compilation needs a minidi Transformer (with .layers and .step)")
    if compile_workers and not regional:
        raise ValueError(f"compile_workers={compile_workers} needs regional=True (the workers compile layer kinds)")
    cache = None
    if compile_cache is not None:
        fields = key_fields(owner, passes=manager.keys, strict=strict, op_backend=op_backend,
                            faithful_rounding=faithful_rounding, codegen=codegen, dynamic=dynamic,
                            regional=regional, fullgraph=fullgraph, backend=backend, compile_kwargs=compile_kwargs)
        cache = CompileCache(compile_cache, fields, device=device_of(owner))
        clear_recorded_artifacts()  # the entry holds this compile's artifacts, not an earlier one's in this process
        cache.load()
    first = FirstStep(inner, cache)
    if regional:
        front_keys = [k for k in manager.keys if k in FRONT_PASSES]  # an Engram front's one site: its wkv (N)
        front_manager = PassManager(front_keys, strict=strict, expected={k: [None] for k in front_keys},
                                    op_backend=op_backend, keep_graphs=keep_graphs)
        fronts = make_backend(front_manager, backend, faithful_rounding=faithful_rounding,
                              precompile_kernels=precompile_kernels, times=inner.times,  # type: ignore[attr-defined]
                              **codegen)
        head_keys = [k for k in manager.keys if k in HEAD_PASSES]  # the head graph's one site: its GEMM (O)
        head_manager = PassManager(head_keys, strict=strict, expected={k: [None] for k in head_keys},
                                   op_backend=op_backend, keep_graphs=keep_graphs)
        head = make_backend(head_manager, backend, faithful_rounding=faithful_rounding,
                            precompile_kernels=precompile_kernels, times=inner.times,  # type: ignore[attr-defined]
                            **codegen)
        n_workers = worker_count(compile_workers, owner, backend, fullgraph)
        scalar_cpu = device_of(owner).type == "cpu" and not cpu_simd  # the C++ flags its graphs load with
        precompiled = _precompiled_calls(cache, dynamic, fullgraph, workers=n_workers > 0, scalar_cpu=scalar_cpu)
        step = RegionalStep(owner, manager, inner, dynamic=dynamic, progress=report, first=first,
                            front_backend=fronts, head_backend=head, precompiled=precompiled, fullgraph=fullgraph,
                            **compile_kwargs)
        if precompiled is not None and n_workers and not precompiled.loaded:
            settings = WorkerSettings(
                strict=strict, op_backend=op_backend, backend=str(backend),
                faithful_rounding=faithful_rounding, autotune=bool(autotune), cpu_simd=bool(cpu_simd),
                precompile_kernels=precompile_kernels, dynamic=dynamic, recompile_limit=step.recompile_limit,
                expected={"core": dict(expected or {}), "front": dict(front_manager.expected or {}),
                          "head": dict(head_manager.expected or {})},
                keys={"core": manager.keys, "front": front_keys, "head": head_keys},
                stage_markers=stages.enabled(), cuda_device=_cuda_index(owner),
                compile_threads=max(1, (os.cpu_count() or 1) // n_workers), save_artifacts=cache is not None)
            share_triton_cache(owner)
            precompiled.workers = CompileWorkers(n_workers, settings)
        if precompiled is not None:
            first.precompiled = lambda: (precompiled.dumps() if precompiled.compiled or precompiled.from_workers
                                         else None, step.recorded_counts())
        return step
    compiled = torch.compile(fn, backend=inner, fullgraph=fullgraph, dynamic=dynamic, **compile_kwargs)
    name = getattr(cfg, "name", None) or type(owner).__name__
    what = f"the {name} step" + (f" (passes {','.join(manager.keys)})" if manager.keys else "")
    return CompiledStep(fn, manager, compiled, dynamic=dynamic, progress=report, what=what, first=first)


__all__ = ["CompiledStep", "RegionalStep", "compile", "dynamic_shape_config", "expected_sites", "layer_kind",
           "make_backend", "uncompile"]
