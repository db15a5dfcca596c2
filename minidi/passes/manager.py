"""The pass manager and ``minidi.compile``, the one entry point that compiles a model step with the rewrites.

Graph level: the passes rewrite the **Dynamo FX graph** (torch-level calls: one ``einsum`` node, ``index_copy_``,
``cat``, ``where``) inside a custom ``torch.compile`` backend, which then hands the rewritten GraphModule to the inner
backend (Inductor on the GPU, ``aot_eager`` in CPU tests). Why this level, and not Inductor's post-grad aten graph:
see ``docs/passes.md``.

Pass order (each pass sees the graph the previous one left): C moe_combine, E gate_tf32x3, D fp4_grouped_mm,
A sparse_attention, B indexer_topk, F hc_mix, G hc_expand, H moe_activation, I moe_row_gather. The passes touch
disjoint subgraphs (B's top-k output feeds A's ``comp_idx``, and both read only the other's *result*); H and I read
the GEMMs D leaves (either form), so apart from fp32 models (where H and I need D first) the order changes no match;
it is fixed so that logs and graphs are stable.

    step = minidi.compile(model, passes="all", strict=True, backend="inductor")
    logits = step(meta, cache)
    step.pass_manager.counts          # tiny V4.1: {"C": 10, "E": 10, "D": 30, "A": 10, "B": 4, "F": 20, ...}
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import logging
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.fx import Graph, GraphModule

from minidi.model.config import ModelConfig

from .base import Rewrite, apply_match, site_of
from .rewrite_fp4_experts import FP4GroupedMM
from .rewrite_gate import GateTF32x3
from .rewrite_hc_expand import HCExpand
from .rewrite_hc_mix import HCMixTF32x3
from .rewrite_indexer import IndexerTopK
from .rewrite_moe_activation import MoEActivation
from .rewrite_moe_combine import MoECombine
from .rewrite_moe_gather import MoERowGather
from .rewrite_sparse_attention import SparseAttention

try:  # installable as an Inductor custom pass too (it then keys the FX graph cache by uuid())
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # pragma: no cover
    _PassBase = object

log = logging.getLogger("minidi.passes")

REWRITES: tuple[type[Rewrite], ...] = (MoECombine, GateTF32x3, FP4GroupedMM, SparseAttention, IndexerTopK,
                                        HCMixTF32x3, HCExpand, MoEActivation, MoERowGather)
BY_KEY: dict[str, type[Rewrite]] = {r.key: r for r in REWRITES}
BY_NAME: dict[str, type[Rewrite]] = {r.name: r for r in REWRITES}
GEMMS_PER_MOE = 3  # w1, w3, w2: pass D matches each expert GEMM
HC_SITES_PER_LAYER = 2  # the attention and the FFN mHC site: passes F (mixer) and G (stream update) match each


class PassMatchError(RuntimeError):
    """strict mode: a pass matched a different number of sites than the model has."""


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


def select(passes: str | Iterable[str] | None) -> list[str]:
    """"all" | "none" | "A,B" | "all,X" | ["A", "moe_combine"] -> pass keys in manager order. "all" is every pass
    but opt-in ones (``Rewrite.in_all = False``; none at present), which are named on their own."""
    if passes is None:
        return []
    if isinstance(passes, str):
        if passes.strip().lower() in ("none", ""):
            return []
        passes = [p for p in passes.split(",")]
    keys = set()
    for p in passes:
        p = p.strip()
        if p.lower() == "all":
            keys.update(r.key for r in REWRITES if r.in_all)
        elif p.upper() in BY_KEY:
            keys.add(p.upper())
        elif p in BY_NAME:
            keys.add(BY_NAME[p].key)
        else:
            known = ", ".join(f"{r.key} ({r.name})" for r in REWRITES)
            raise ValueError(f"unknown pass {p!r}; known: {known}, or 'all' / 'none'")
    return [r.key for r in REWRITES if r.key in keys]


def _source_hash(objs: Iterable[Any], extra: str = "") -> str:
    h = hashlib.sha256()
    for o in objs:
        try:
            h.update(Path(inspect.getsourcefile(o)).read_bytes())
        except (TypeError, OSError):
            h.update(repr(o).encode())
    h.update(extra.encode())
    return h.hexdigest()


class PassManager(_PassBase):
    """Runs the selected rewrites over one FX graph, counts their matches per pass and checks them.

    ``expected``: pass key -> layer of each site (``expected_sites(cfg)``); passes without an entry are not checked.
    ``strict``: a count that differs from the expected one raises ``PassMatchError`` naming the pass, the expected
    and matched counts and the layers missed; otherwise a warning, and the unmatched sites keep the naive code
    (each rewrite is local and exact, so a partial rewrite never changes the result).
    ``keep_graphs``: keep a copy of each graph before and after the passes (inspection and tests).
    """

    def __init__(self, passes: str | Iterable[str] | None = "all", *, strict: bool = False,
                 expected: dict[str, list[int]] | None = None, op_backend: str = "triton",
                 keep_graphs: bool = False) -> None:
        self.keys = select(passes)
        self.rewrites: list[Rewrite] = [BY_KEY[k](op_backend) for k in self.keys]
        self.strict, self.expected, self.op_backend = strict, expected, op_backend
        self.keep_graphs = keep_graphs
        self.counts: dict[str, int] = {}  # matches of the last graph, per pass key
        self.sites: dict[str, list[int | None]] = {}  # layer of each match of the last graph
        self.history: list[dict[str, int]] = []  # counts of every graph this manager rewrote
        self.graphs: list[tuple[GraphModule, GraphModule]] = []  # (before, after) when keep_graphs
        # regional compilation: the layer whose call is being compiled (sites then belong to it), and which layers
        # compiled a graph, with that graph's counts
        self.current_layer: int | None = None
        self.layer_counts: dict[int, dict[str, int]] = {}

    # -- Inductor's CustomGraphPass interface ---------------------------------------------------------------------
    def uuid(self) -> str:
        """Changes whenever a pass's source (or the manager's, or the selection) changes: Inductor's FX graph cache
        keys custom passes by it, and a stale key would serve graphs compiled with the old passes."""
        mods = [sys.modules[__name__], sys.modules[Rewrite.__module__]]
        mods += [sys.modules[type(r).__module__] for r in self.rewrites]
        mods.append(sys.modules["minidi.passes.fx_utils"])
        return _source_hash(mods, f"{self.keys}|{self.strict}|{self.op_backend}")

    def __call__(self, graph: Graph | GraphModule) -> dict[str, int]:
        return self.run(graph)

    # -- running -------------------------------------------------------------------------------------------------
    def run(self, graph: Graph | GraphModule) -> dict[str, int]:
        gm = graph if isinstance(graph, GraphModule) else None
        g = gm.graph if gm is not None else graph
        before = copy.deepcopy(gm) if (self.keep_graphs and gm is not None) else None
        counts, sites = {}, {}
        for rw in self.rewrites:
            found: list[int | None] = []
            for node in list(g.nodes):
                if getattr(node, "_erased", False):  # erased by an earlier match of this pass
                    continue
                m = rw.match(node)
                if m is not None and apply_match(g, m):
                    site = site_of(m)
                    found.append(self.current_layer if site is None else site)
            counts[rw.key], sites[rw.key] = len(found), found
            log.info("minidi pass %s (%s): %d site(s) matched", rw.key, rw.name, len(found))
        g.lint()
        if gm is not None:
            gm.recompile()
            if self.keep_graphs:
                self.graphs.append((before, copy.deepcopy(gm)))
        self.counts, self.sites = counts, sites
        self.history.append(dict(counts))
        if self.current_layer is not None:
            self.layer_counts[self.current_layer] = dict(counts)
        log.info("minidi passes: graph %d compiled%s: %s", len(self.history),
                 "" if self.current_layer is None else f" for layer {self.current_layer}", counts)
        self._check(counts, sites)
        return counts

    def _check(self, counts: dict[str, int], sites: dict[str, list[int | None]]) -> None:
        if not self.expected:
            return
        problems = []
        for key in self.keys:
            if key not in self.expected:
                continue
            want = self.expected[key]
            if self.current_layer is not None:  # a regional graph: the sites of the layer being compiled
                want = [site for site in want if site == self.current_layer]
            want, got = Counter(want), Counter(sites[key])
            if sum(want.values()) == counts[key] and want == got:
                continue
            missed = sorted((want - got).elements(), key=lambda x: (x is None, x or 0))
            extra = sorted((got - want).elements(), key=lambda x: (x is None, x or 0))
            msg = (f"pass {key} ({BY_KEY[key].name}): expected {sum(want.values())} site(s), matched {counts[key]}"
                   + (f"; missed in layers {missed}" if missed else "")
                   + (f"; unexpected matches in layers {extra}" if extra else ""))
            problems.append(msg)
        if not problems:
            return
        if self.strict:
            raise PassMatchError("minidi passes (strict): " + "; ".join(problems))
        for msg in problems:
            log.warning("%s (the naive code stays at the unmatched sites)", msg)
            warnings.warn(f"minidi passes: {msg} (the naive code stays at the unmatched sites)", stacklevel=2)

    def summary(self) -> str:
        rows = [f"{k} {BY_KEY[k].name:<18} {self.counts.get(k, 0):>4}"
                + (f" / {len(self.expected[k])} expected" if self.expected and k in self.expected else "")
                for k in self.keys]
        return "\n".join(rows)


def make_backend(manager: PassManager, inner: str | Callable = "inductor") -> Callable:
    """A ``torch.compile`` backend: run the passes on Dynamo's GraphModule, then the inner backend on the result."""
    from torch._dynamo.backends.registry import lookup_backend

    inner_fn = lookup_backend(inner) if isinstance(inner, str) else inner

    def minidi_backend(gm: GraphModule, example_inputs: list) -> Callable:
        n, layer = len(manager.history), manager.current_layer
        before = manager.layer_counts.get(layer)
        manager.run(gm)
        try:
            return inner_fn(gm, example_inputs)
        except BaseException:  # e.g. a restart of the trace: this graph is discarded, so forget its counts
            del manager.history[n:]
            if layer is not None:
                manager.layer_counts.pop(layer, None)
                if before is not None:
                    manager.layer_counts[layer] = before
            raise

    minidi_backend.pass_manager = manager  # type: ignore[attr-defined]
    return minidi_backend


def compile(  # noqa: A001 (minidi.compile mirrors torch.compile)
    model_or_step: torch.nn.Module | Callable,
    passes: str | Iterable[str] | None = "all",
    *,
    strict: bool = False,
    backend: str | Callable = "inductor",
    op_backend: str = "triton",
    expected: dict[str, list[int]] | None = None,
    keep_graphs: bool = False,
    fullgraph: bool = True,
    dynamic: bool | None = True,
    regional: bool = False,
    **compile_kwargs: Any,
) -> Callable:
    """Compile a model step (a minidi ``Transformer``: its ``step``; or any callable / module) with minidi's passes.

    ``passes``: "all", "none", "A,B" or a list of keys / names. ``strict``: fail compilation when a pass matches a
    different number of sites than ``expected`` (default: ``expected_sites(model.cfg)`` when the model has a
    config; strict needs ``fullgraph=True``: one graph must hold the whole step). ``backend``: the inner backend
    that compiles the rewritten graph ("inductor", "aot_eager", ...). ``op_backend``: "triton" (CUDA, or CPU under
    ``TRITON_INTERPRET=1``) or "ref" for the ops the passes insert. The returned callable has ``.pass_manager``.
    """
    fn = model_or_step
    owner = model_or_step
    if isinstance(model_or_step, torch.nn.Module) and callable(getattr(model_or_step, "step", None)):
        fn = model_or_step.step
    else:
        owner = getattr(model_or_step, "__self__", model_or_step)
    cfg = getattr(owner, "cfg", None)
    if expected is None and isinstance(cfg, ModelConfig):
        expected = expected_sites(cfg, regional=regional)
    manager = PassManager(passes, strict=strict, expected=expected, op_backend=op_backend, keep_graphs=keep_graphs)
    if regional:
        return _compile_regional(owner, manager, backend, fullgraph=fullgraph, dynamic=dynamic, **compile_kwargs)
    compiled = torch.compile(fn, backend=make_backend(manager, backend), fullgraph=fullgraph, dynamic=dynamic,
                             **compile_kwargs)
    compiled.pass_manager = manager
    return compiled


def layer_kind(block: torch.nn.Module) -> tuple:
    """What makes two layers trace to the same graph: their roles (the forward reads nothing else that differs)."""
    a = block.attn
    return (a.ratio, a.kv_source, a.index_source, a.owns_index_keys, a.candidate_filtered, a.candidate_source,
            a.v4_indexer, block.has_engram, block.ffn.gate.hash)


class RegionalStep:
    """A model step whose layers are compiled one by one (``minidi.compile(..., regional=True)``).

    Each ``Block`` is compiled on its own; layers of the same kind (``layer_kind``) share one compiled graph, so a
    40-layer model compiles a handful of graphs instead of one 40-layer graph (minutes less on the GPU). Everything
    between the layers (embedding, Engram hashing, head) runs eagerly. With ``strict``, every compiled graph is
    checked against the sites of the layer it was compiled for; ``counts`` is then the model's total, summing each
    layer's graph (a layer that ran a graph compiled for another layer of its kind counts that graph)."""

    def __init__(self, model: torch.nn.Module, manager: PassManager) -> None:
        self.model, self.pass_manager = model, manager
        self.kinds = [layer_kind(b) for b in model.layers]
        model.layer_hook = self._before_layer

    def _before_layer(self, i: int) -> None:
        self.pass_manager.current_layer = i

    def __call__(self, *args, **kwargs):
        try:
            return self.model.step(*args, **kwargs)
        finally:
            self.pass_manager.current_layer = None

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


def _compile_regional(model: torch.nn.Module, manager: PassManager, backend: str | Callable, **compile_kwargs: Any
                      ) -> RegionalStep:
    if not hasattr(model, "layers") or not hasattr(model, "step"):
        raise TypeError("regional compilation needs a minidi Transformer (with .layers and .step)")
    limits = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit")
    for name in limits:  # one code object (Block.forward), one graph per layer kind: raise Dynamo's per-code cap
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4 * len(model.layers)))
    fn = make_backend(manager, backend)
    for block in model.layers:
        block.compile(backend=fn, **compile_kwargs)
    return RegionalStep(model, manager)
