"""Per-layer compilation (``minidi.compile(..., regional=True)``): ``RegionalStep``.

Each ``Block`` is compiled on its own and layers of one kind (``Block.kind()``) share one graph: a 40-layer model
compiles a handful of graphs instead of one 40-layer graph. A Block's Engram (``front``) compiles apart from the rest
(``core``). With a compile cache, each kind is compiled ahead of time instead (``precompiled.py``): saved in the
cache entry and called without Dynamo on a warm start.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

import torch

from minidi.passes import PassManager

from .compile_settings import Progress, cache_note, call_settings, inductor_cache_counts, mark_leading_dims_only
from .compile_workers import role_of
from .first_step import FirstStep
from .precompiled import PrecompiledCalls


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


def core_label(kind: Any) -> str:
    """The precompiled label of a layer kind's core graph (``PrecompiledCalls``, compile workers' results)."""
    return f"core {_describe(kind)}"


def _compiled_layer(block: torch.nn.Module, backend: Callable, front_backend: Callable | None,
                    dynamic: bool | None, compile_kwargs: dict, precompiled: PrecompiledCalls | None,
                    before_call: Callable[[tuple], None]) -> Callable:
    """The block's call (``Block.forward``'s composition: ``core`` after ``front``) with each part compiled: ``core``
    by the pass backend (one graph per ``kind()``, shared by the kind's layers through Dynamo's cache of its code),
    an Engram ``front`` by ``front_backend`` (its own graph, shared by the Engram layers; no pass sites in it). Set
    as the block's ``_compiled_call_impl``, the slot ``nn.Module.compile`` uses, so that the block's eager call
    (``_call_impl``) stays the model's own. With ``precompiled`` (a compile cache), both parts are compiled ahead of
    time per kind instead (``precompiled.py``: saved with the cache entry, called without Dynamo on a warm start).
    ``before_call(args)`` runs before each lazily compiled call (the step's shape marks on its first step)."""
    if precompiled is not None:
        return _precompiled_layer(block, backend, front_backend, precompiled)
    core = torch.compile(block.core, backend=backend, dynamic=dynamic, **compile_kwargs)
    front = None
    if getattr(block, "has_front", False):
        front = torch.compile(block.front, backend=front_backend or backend, dynamic=dynamic, **compile_kwargs)

    def call(x, pre, meta, cache, shared, engram_ids=None):
        before_call((x, pre, meta, cache, shared, engram_ids))
        if front is not None:
            x = front(x, engram_ids)
        return core(x, pre, meta, cache, shared)

    return call


def _compiled_head(head: torch.nn.Module, backend: Callable, dynamic: bool | None, compile_kwargs: dict,
                   precompiled: PrecompiledCalls | None, before_call: Callable[[tuple], None]) -> Callable:
    """The output head's call (``OutputHead.forward``) compiled by ``backend`` (its own graph: pass O's one site),
    through ``PrecompiledCalls`` (label "head") with a compile cache; ``before_call`` as ``_compiled_layer``'s."""
    if precompiled is None:
        compiled = torch.compile(head.forward, backend=backend, dynamic=dynamic, **compile_kwargs)

        def lazy(y):
            before_call((y,))
            return compiled(y)

        return lazy
    forward = type(head).forward

    def call(y):
        return precompiled("head", forward, head, y, backend=backend)

    return call


def _precompiled_layer(block: torch.nn.Module, backend: Callable, front_backend: Callable | None,
                       calls: PrecompiledCalls) -> Callable:
    """``_compiled_layer`` through ``PrecompiledCalls``: the class's ``core`` / ``front`` functions (the block as
    their first argument), ``core`` labelled by the block's kind, so that a kind's layers share one compiled variant,
    and every Engram ``front`` by one label (its guards tell apart Engram layers that differ, e.g. in table rows)."""
    cls, label = type(block), core_label(layer_kind(block))
    has_front = getattr(block, "has_front", False)

    # Engram fronts share the label "front"; Dynamo guards parameter shapes as constants, so fronts whose tables
    # differ in size need graphs of their own: a compile worker is sent one per parameter-shape set
    front_variant = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()) if has_front else ()

    def call(x, pre, meta, cache, shared, engram_ids=None):
        if has_front:
            x = calls("front", cls.front, block, x, engram_ids, backend=front_backend or backend,
                      variant=front_variant)
        return calls(label, cls.core, block, x, pre, meta, cache, shared, backend=backend)

    return call


class RegionalStep:
    """A model step whose layers are compiled one by one (``minidi.compile(..., regional=True)``).

    Each ``Block`` is compiled on its own; layers of the same kind (``layer_kind``) share one compiled graph, so a
    40-layer model compiles a handful of graphs instead of one 40-layer graph (minutes less on the GPU). A minidi
    Block's Engram (``Block.front``) compiles apart from the rest (``Block.core``, ``_compiled_layer``): one graph for
    the Engram layers, so that they share their kind's graph (V4.1-Flash: 5 layer graphs instead of 7). Everything
    between the layers (embedding, Engram hashing, the final collapse and norm) runs eagerly; the output head's GEMM
    (``model.head``, when ``head_backend`` is given) compiles as a graph of its own. The step owns
    ``model.layer_hook`` (the model calls it with the layer index before each layer) while compiled: it tells the pass manager which layer a graph
    is compiled for and times each layer kind's compile. With ``strict``, every compiled graph is checked against
    the sites of the layer it was compiled for; ``counts`` is then the model's total, summing each layer's graph (a
    layer that ran a graph compiled for another layer of its kind counts that graph). ``uncompile()`` restores the
    eager model (its blocks' calls and its layer hook)."""

    def __init__(self, model: torch.nn.Module, manager: PassManager, backend: Callable, *, dynamic: bool | None,
                 progress: Progress, first: FirstStep, front_backend: Callable | None = None,
                 head_backend: Callable | None = None, precompiled: PrecompiledCalls | None = None,
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
        self.front_backend, self.head_backend, self.precompiled = front_backend, head_backend, precompiled
        self.head_counts: dict[str, int] | None = None  # the head graph's pass counts (compiled or restored)
        if precompiled is not None and precompiled.loaded:
            self._restore_counts()
        for block in model.layers:
            if callable(getattr(block, "core", None)):  # a minidi Block: its core and front compiled apart
                block._compiled_call_impl = _compiled_layer(block, backend, front_backend, dynamic, compile_kwargs,
                                                            precompiled, self._mark_shapes)
            else:
                block.compile(backend=backend, dynamic=dynamic, **compile_kwargs)
        head = getattr(model, "head", None)
        if head_backend is not None and isinstance(head, torch.nn.Module):
            head._compiled_call_impl = _compiled_head(head, head_backend, dynamic, compile_kwargs, precompiled,
                                                      self._mark_shapes)
        model.layer_hook = self._before_layer

    def _mark_shapes(self, args: tuple) -> None:
        """The shape policy (``mark_leading_dims_only``) on a layer's arguments during the first step, where each
        kind traces (later calls skip the walk: it would cost the host ~40 us a layer for nothing)."""
        if self.calls <= 1 and self.dynamic is not False:
            mark_leading_dims_only(args)

    def _restore_counts(self) -> None:
        """A warm start from precompiled graphs runs no passes: the counts are those the entry recorded, per layer
        that compiled a graph, checked against this model's expected sites as a compile would (``strict``)."""
        manifest = self.compile_cache.manifest if self.compile_cache is not None else None
        recorded = (manifest or {}).get("layer_counts")
        if not recorded:
            raise RuntimeError("minidi.compile: the compile cache entry holds precompiled graphs but no per-layer "
                               "pass counts")
        recorded = dict(recorded)
        head = recorded.pop("head", None)
        for layer, counts in sorted((int(k), v) for k, v in recorded.items()):
            self.pass_manager.restore(layer, counts)
        if head is not None and self.head_backend is not None:
            self.head_backend.pass_manager.restore(None, head)
            self.head_counts = dict(self.head_backend.pass_manager.counts)
        self._progress(f"minidi.compile: {self.precompiled.loaded} precompiled graph(s) loaded in "
                       f"{self.precompiled.load_s:.1f} s (no tracing); pass counts from the entry: {self.counts}")

    def _before_layer(self, i: int) -> None:
        self._close_layer()
        self.pass_manager.current_layer = i
        self._open = (i, len(self.pass_manager.history), time.perf_counter(), inductor_cache_counts())

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
                       f"layers {layers}{cache_note(inductor_cache_counts() - cache0)})")

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
            with call_settings(self.dynamic, self.recompile_limit):
                out = self.model.step(*args, **kwargs)
            ok = True
            return out
        finally:
            self.first_step.triton.stop()  # also when the first call raised: no listener left behind
            self._close_layer()
            self.pass_manager.current_layer = None
            if first and self.precompiled is not None and self.precompiled.workers is not None:
                if ok:
                    self._collect_workers()
                else:  # the step failed: its error, not the workers' compiles, is what the caller waits for
                    self.precompiled.drop_workers()
            if first and ok:
                self.compile_s = self.first_step.finish(lambda: self.counts if self.pass_manager.keys else {})
            if first:
                fronts = len(getattr(getattr(self.front_backend, "pass_manager", None), "history", ()))
                extra = f" (+{fronts} Engram graph(s))" if fronts else ""
                self._progress(f"minidi.compile: compiled {len(self.pass_manager.history) - graphs} graph(s) for "
                               f"{len(set(self.kinds))} layer kinds{extra} in {time.perf_counter() - t0:.1f} s "
                               "(first step, eager parts included)")

    def _collect_workers(self) -> None:
        """The end of a first step whose layer kinds compiled in worker processes (``compile_workers.py``): wait for
        them, load their graphs, restore their pass counts into this step's managers (checked as a compile checks
        them: a strict mismatch raises here) and report one line per kind."""
        t0 = time.perf_counter()
        results = self.precompiled.collect()
        wait = time.perf_counter() - t0
        self.first_step.workers = {"workers": len({r.worker for r in results}), "wait_s": round(wait, 2),
                                   "jobs": [{"label": r.label, "layer": r.layer, "worker": r.worker,
                                             "s": round(r.seconds, 2), "compile_s": round(r.compile_s, 2),
                                             "ok": r.blob is not None} for r in results]}
        order = list(dict.fromkeys(self.kinds))
        by_label = {core_label(k): k for k in order}
        managers = {"front": getattr(self.front_backend, "pass_manager", None),
                    "head": getattr(self.head_backend, "pass_manager", None)}
        mismatches = []
        for r in results:
            if r.blob is None:
                if r.pass_mismatch:
                    mismatches.append(r.error.splitlines()[0] if r.error else r.label)
                else:
                    self._progress(f"minidi.compile: {r.label} did not compile in its worker ({(r.error or '')[:300]});"
                                   " it compiles here at its next call")
                continue
            if self.compile_cache is not None and r.artifacts:
                self.compile_cache.worker_artifacts.append(r.artifacts)  # saved in the entry with this process's
            role = role_of(r.label)
            manager = self.pass_manager if role == "core" else managers.get(role)
            if manager is not None and r.counts is not None:
                manager.restore(r.layer if role == "core" else None, r.counts)
            kind = by_label.get(r.label)
            what = (f"layer kind {order.index(kind) + 1}/{len(order)} ({_describe(kind)}), serves layers "
                    f"{[j for j, k in enumerate(self.kinds) if k == kind]}" if kind is not None else r.label)
            self._progress(f"minidi.compile: {what}: compiled in worker {r.worker} in {r.compile_s:.1f} s (ready "
                           f"{r.seconds:.1f} s after it was sent)")
        if mismatches:
            from minidi.passes import PassMatchError

            raise PassMatchError("; ".join(mismatches))
        self._progress(f"minidi.compile: {len(results)} graph(s) from {self.first_step.workers['workers']} compile "
                       f"worker(s); waited {wait:.1f} s for them after the eager first step")

    def uncompile(self) -> None:
        """The model's eager calls back: every block's compiled call dropped, the layer hook removed. (Dynamo's
        cached graphs stay until ``torch._dynamo.reset()``; the model is as it was before ``minidi.compile``.)"""
        for block in self.model.layers:
            block._compiled_call_impl = None  # what nn.Module.compile() set; torch has no public inverse
        if isinstance(getattr(self.model, "head", None), torch.nn.Module):
            self.model.head._compiled_call_impl = None
        if getattr(self.model, "layer_hook", None) == self._before_layer:
            self.model.layer_hook = None

    @property
    def counts(self) -> dict[str, int]:
        """Matches summed over the model's layers (each layer counted with the graph of its kind), plus the head
        graph's (pass O)."""
        by_kind = {self.kinds[i]: c for i, c in self.pass_manager.layer_counts.items()}
        total: Counter = Counter({k: 0 for k in self.pass_manager.keys})
        for i, kind in enumerate(self.kinds):
            if kind not in by_kind:
                raise RuntimeError(f"layer {i} ran no compiled graph of its kind {kind} (has the step run?)")
            total.update(by_kind[kind])
        total.update(self._head_counts())
        return dict(total)

    def _head_counts(self) -> dict[str, int]:
        if self.head_counts is not None:
            return self.head_counts
        history = getattr(getattr(self.head_backend, "pass_manager", None), "history", None)
        return dict(history[-1]) if history else {}

    def recorded_counts(self) -> dict:
        """What a compile cache entry keeps of the counts: each layer's, and the head graph's under "head"."""
        head = self._head_counts()
        return {**self.pass_manager.layer_counts, **({"head": head} if head else {})}

    @property
    def graphs(self) -> int:
        return len(self.pass_manager.layer_counts)


__all__ = ["RegionalStep", "layer_kind"]
