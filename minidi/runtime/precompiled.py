"""Layer graphs compiled ahead of time: traced by Dynamo once, saved, and called in a later process without Dynamo.

A per-layer compile (``RegionalStep``) with a compile cache (``compile_cache=DIR``) compiles each layer kind through
torch's ``aot_compile`` (``torch.compile(fn, fullgraph=True).aot_compile(example_inputs)``) instead of Dynamo's lazy
cache. The result, an ``AOTCompiledFunction``, holds everything Dynamo's own cache entry would: the transformed
bytecode (how the layer's tensors are gathered into the graph's inputs and its Python side effects replayed), the
guards, and the backend's compiled graph (minidi's passes already applied, Inductor's generated code bundled). It
serialises to bytes, which go into the compile-cache entry (``compile_cache.py``); a warm start deserialises them
and calls them directly: no Dynamo tracing, no passes, no AOT tracing, no lowering (on the H200 Dynamo's tracing was
35.9 s of a 48.2 s warm start).

    calls = PrecompiledCalls(dynamic=True)
    y = calls("core <kind>", Block.core, block, x, pre, meta, cache, shared, backend=b)  # compiles on a kind's 1st call
    blob = calls.dumps()                      # after the first step, into the cache entry
    warm = PrecompiledCalls(dynamic=True); warm.loads(blob)                # a later process: no tracing

Every call checks the guards of the variants it holds for its kind, first to last, and runs the first that passes; a
call that no variant accepts (another layer of the same kind whose parameters differ in shape, an input that breaks
an assumption the graph made) compiles a new variant, as Dynamo's recompile would. Guards Dynamo cannot serialise
are dropped by torch's filter (object identities, and guards on module globals): what they would catch must be in
the cache key instead. On the tiny V4.1 layers they are the identities of torch and minidi functions and minidi's
module constants (the key hashes minidi's sources and names torch's version), ``torch.nn.Module``'s global hooks
(a global forward hook registered later would not run inside a precompiled layer), and the stage markers' switch
(``stages._enabled``, a key field).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import Counter
from typing import Any, Callable

import torch

from . import cpp_kernel_batch
from .compile_settings import load_config, mark_leading_dims_only

log = logging.getLogger("minidi.compile")

FORMAT = 1  # layout of ``dumps``: {"format": FORMAT, "fns": {label: [bytes, ...]}}


def available() -> bool:
    """Whether this torch has Dynamo's ahead-of-time compile (used with torch 2.11 on the H200 and 2.13 on CPUs)."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch._dynamo.config, "enable_aot_compile")


class PrecompiledCalls:
    """The ahead-of-time compiled graphs of a per-layer compile, per label (``"core <kind>"``, ``"front"``).

    ``dynamic``: as ``torch.compile``'s. ``scalar_cpu``: the graphs are CPU graphs compiled with scalar C++
    (``minidi.compile``'s ``cpu_simd=False`` on a CPU model): ``loads`` builds or finds their kernels under that
    setting. ``compiled``: labels compiled in this process; ``loaded``: variants read by ``loads``; ``load_s``: its
    seconds."""

    def __init__(self, *, dynamic: bool | None, scalar_cpu: bool = False) -> None:
        self.dynamic = dynamic
        self.scalar_cpu = scalar_cpu
        self.fns: dict[str, list[Any]] = {}
        self.dropped: dict[str, list[str]] = {}  # guards left out of each label's last compiled variant
        self.compiled: list[str] = []
        self.loaded = 0
        self.load_s = 0.0
        self.workers: Any = None  # a ``CompileWorkers`` for the first step (``compile_workers.py``), or None
        self.sent: dict[str, list[Any]] = {}  # labels handed to the workers -> the variant of each job
        self.from_workers: list[str] = []  # labels whose graphs came from the workers

    def __call__(self, label: str, fn: Callable, *args: Any, backend: Callable, variant: Any = ()) -> Any:
        """``fn(*args)`` through the first variant of ``label`` whose guards accept ``args``, compiling one with
        ``backend`` (a ``torch.compile`` backend: minidi's pass backend) if none does. ``fn`` is a plain function
        (``Block.core``, the module passed as its first argument), so that every layer of a kind runs the one
        compiled variant with its own parameters. With ``workers`` (the first step), a label without a variant is
        sent to a worker at its first call and runs eagerly until ``collect`` loads what the worker compiled;
        ``variant`` (hashable) tells calls apart that need another graph of the same label: a call whose variant
        was not sent yet is sent too (``regional.py``: the Engram fronts' parameter shapes)."""
        for compiled in self.fns.get(label, ()):
            if compiled.guard_check(*args):
                return compiled.fn(*args)
        if self.workers is not None and label not in self.fns:
            if variant in self.sent.get(label, ()) or self._send(label, fn, args, backend, variant):
                return eager_call(fn, args)
        if self.fns.get(label):
            log.info("minidi.compile: no compiled variant of %s accepts this call's inputs (guards: %s); compiling "
                     "another", label, self._why(self.fns[label][-1], args))
        return self.compile(label, fn, *args, backend=backend).fn(*args)

    def compile(self, label: str, fn: Callable, *args: Any, backend: Callable) -> Any:
        """Compile a variant of ``label`` for ``fn(*args)`` ahead of time (nothing runs) and keep it; with
        ``dynamic``, only the leading dims of ``args``' tensors are symbolic (``mark_leading_dims_only``)."""
        if self.dynamic is not False:
            mark_leading_dims_only(args)
        with torch._dynamo.config.patch(enable_aot_compile=True):  # torch 2.11 attaches .aot_compile only then
            wrapper = torch.compile(fn, backend=_serializable(backend), fullgraph=True, dynamic=self.dynamic,
                                    options={"guard_filter_fn": self._guard_filter(label)})
        compiled = wrapper.aot_compile((args, {}))
        self.fns.setdefault(label, []).append(compiled)
        self.compiled.append(label)
        return compiled

    def _send(self, label: str, fn: Callable, args: tuple, backend: Callable, variant: Any) -> bool:
        manager = getattr(backend, "pass_manager", None)
        layer = getattr(manager, "current_layer", None)
        if not self.workers.submit(label, layer, fn, args):
            return False
        self.sent.setdefault(label, []).append(variant)
        return True

    def drop_workers(self) -> None:
        """Stop the workers without waiting for their compiles (the first step failed); nothing is loaded."""
        workers, self.workers = self.workers, None
        if workers is not None:
            workers.close(wait=False)
        self.sent.clear()

    def collect(self) -> list[Any]:
        """After the first step: wait for the workers' results (``JobResult``s, submission order), load each graph
        that compiled, stop the workers. A label whose job failed keeps no variant: it compiles at its next call."""
        workers, self.workers = self.workers, None
        if workers is None:
            return []
        try:
            results = workers.results()
        finally:
            workers.close()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.ipc_collect()  # the blocks the workers received by IPC and released: reusable again
        for r in results:
            if r.blob is None:
                continue
            try:
                self.loads(r.blob)
            except Exception as e:  # a graph that does not load is compiled here at its next call
                r.blob, r.error = None, f"not loaded ({type(e).__name__}: {e})"
                continue
            self.from_workers.append(r.label)
        self.sent.clear()
        return results

    def _guard_filter(self, label: str) -> Callable:
        """torch's own filter for precompiled graphs (guards on globals and on object identities cannot be saved),
        recording what it leaves out (``dropped[label]``, logged): what those guards would check must be in the cache
        key or equal in every process."""
        from torch._dynamo.guards import CheckFunctionManager

        unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES

        def keep(entries: Any) -> list[bool]:
            flags = [not (g.is_global or g.guard_type in unsupported) for g in entries]
            dropped = sorted({f"{g.guard_type} {g.name}" for g, k in zip(entries, flags) if not k})
            self.dropped[label] = dropped
            kinds = Counter(g.guard_type for g, k in zip(entries, flags) if not k)
            log.info("minidi.compile: precompiled %s: %d of %d guards kept; not kept: %s", label, sum(flags),
                     len(flags), ", ".join(f"{n} {t}" for t, n in sorted(kinds.items())) or "none")
            log.debug("minidi.compile: precompiled %s: guards not kept: %s", label, "; ".join(dropped))
            return flags

        return keep

    @staticmethod
    def _why(compiled: Any, args: tuple) -> str:
        try:
            f_locals = compiled.prepare_f_locals(*args)
            return str(compiled._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)[:500]
        except Exception as e:  # the reason is a courtesy: never fail the call over it
            return f"unknown ({type(e).__name__})"

    def dumps(self) -> bytes:
        """Every variant as bytes (``AOTCompiledFunction.serialize``), by label."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        fns = {label: [AOTCompiledFunction.serialize(f).serialized_data for f in fs] for label, fs in self.fns.items()}
        return pickle.dumps({"format": FORMAT, "fns": fns})

    def loads(self, blob: bytes) -> None:
        """Read ``dumps``'s bytes (a trusted cache entry: it is a pickle). Raises ValueError on another format."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        t0 = time.perf_counter()
        data = pickle.loads(blob)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"precompiled graphs: format {data.get('format') if isinstance(data, dict) else '?'}, "
                             f"this minidi reads {FORMAT}")
        # a fresh machine compiles the graphs' C++ kernels (CPU) as it loads them, under the flags they were made for
        with cpp_kernel_batch.batching(), load_config(self.scalar_cpu):
            for label, blobs in data["fns"].items():
                self.fns.setdefault(label, []).extend(AOTCompiledFunction.deserialize(b) for b in blobs)
                self.loaded += len(blobs)
        self.load_s += time.perf_counter() - t0

    def labels(self) -> list[str]:
        return sorted(self.fns)


def eager_call(fn: Callable, args: tuple) -> Any:
    """``fn(*args)`` run eagerly (a layer whose graph a worker is compiling), the eager temporaries of the module it
    is given bounded as in the benchmark's eager mode, then unbounded again: the state a compiled step keeps
    (``minidi.compile`` sets ``None``) and compiled graphs are traced in."""
    from minidi.model.model import set_eager_budget

    module = args[0] if args and isinstance(args[0], torch.nn.Module) else None
    if module is None:
        return fn(*args)
    set_eager_budget(module)
    try:
        return fn(*args)
    finally:
        set_eager_budget(module, None)


def _serializable(backend: Callable) -> Callable:
    """``backend`` whose compiled graph is a ``SerializableCallable``: torch 2.11's ``aot_compile`` wraps only the
    results of its own Inductor / AOTAutograd backends (2.13 also any result with a ``serialize`` method), and refuses
    others; minidi's pass backend returns AOTAutograd's bundled result (Inductor's or ``aot_eager``'s), which this
    wraps itself, in a class that exposes no ``serialize`` of its own so that a newer torch does not wrap it twice."""

    def serializable_backend(gm: Any, example_inputs: list) -> Any:
        out = backend(gm, example_inputs)
        if callable(getattr(out, "serialize", None)):
            return SerializedGraph(out)
        return out

    for attr in ("pass_manager", "times"):  # minidi's backend attributes, for whoever reads them
        if hasattr(backend, attr):
            setattr(serializable_backend, attr, getattr(backend, attr))
    return serializable_backend


def _bundled() -> type:
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    return BundledAOTAutogradSerializableCallable


try:
    from torch._dynamo.aot_compile_types import SerializableCallable as _SerializableBase
except ImportError:  # torch without aot_compile: ``available()`` is False and nothing below is used
    _SerializableBase = object  # type: ignore[assignment,misc]


class SerializedGraph(_SerializableBase):  # type: ignore[misc,valid-type]
    """AOTAutograd's bundled compiled graph as torch's ``SerializableCallable`` (through torch's own bundled
    wrapper), without forwarding attributes (torch 2.13 wraps any callable that has ``serialize``)."""

    def __init__(self, compiled_fn: Any) -> None:
        self.bundled = _bundled()(compiled_fn)

    @classmethod
    def serialize_compile_artifacts(cls, fn: SerializedGraph) -> bytes:
        return _bundled().serialize_compile_artifacts(fn.bundled)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Any:
        return _bundled().deserialize_compile_artifacts(data)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.bundled(*args, **kwargs)


__all__ = ["PrecompiledCalls", "SerializedGraph", "available", "eager_call"]
