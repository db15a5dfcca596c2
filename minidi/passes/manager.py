"""The pass registry and ``PassManager``, which runs the selected rewrites over one FX graph.

Model-agnostic: the manager knows passes, not models. What a model must match comes in as data (``expected``: pass
key -> layer of every site; ``minidi.runtime.compile.expected_sites(cfg)`` derives it from a config), and the
backend and ``minidi.compile`` live in ``minidi/runtime/compile.py``, per-layer compilation in ``regional.py``.

Graph level: the passes rewrite the **Dynamo FX graph** (torch-level calls: one ``einsum`` node, ``index_copy_``,
``cat``, ``where``) inside a custom ``torch.compile`` backend, which then hands the rewritten GraphModule to the inner
backend (Inductor on the GPU, ``aot_eager`` in CPU tests). Why this level, and not Inductor's post-grad aten graph:
see ``docs/passes.md``.

Pass order (each pass sees the graph the previous one left): C moe_combine, E gate_tf32x3, S compressor_gemm, D
fp4_grouped_mm, A sparse_attention, B indexer_topk, F hc_mix, J hc_mix_fused, K hc_sinkhorn, G hc_expand, U
hc_expand_mix, H moe_activation, I moe_row_gather, L fp8_experts, M indexer_candidates, T candidate_blocks, N
fp8_linear, R shared_fq8, O head_logits, P row_topk, Q expert_order, V hadamard. The passes touch disjoint subgraphs
(B's top-k output feeds A's ``comp_idx``, and both read only the other's *result*); H and I read the GEMMs D leaves
(either form), and J takes F's projection in either form (F's op or the naive GEMM), so apart from fp32 models (where H
and I need D first) the order changes no match; it is fixed so that logs and graphs are stable. L rewrites D's and H's
ops (and I's or the naive gather), so it comes after them and ``select`` refuses it without D and H; M rewrites B's op
(a re-index layer's mask from candidate block ids -> candidate-only scoring) and needs B; T (the candidate source's
block selection) reads B's scores output (or the naive scores) and nothing else's. N (each FP8 linear's fq8, weight
dequant and GEMM -> one op) reads what the others leave of the linears' inputs; U (a layer's stream update and its MoE
site's mixer reads of it -> one op) rewrites G's and J's ops, so it comes after both and needs them; R rewrites N's ops
(linears that read one input with one act_block -> one fq8 op, the linears on its result with act_block -b: fq8 already)
and needs N. O (the output head's fp32 GEMM) takes only a GEMM that is the graph's output, which no other pass's site
is. P (the router's top-k) and Q (the dispatch's argsort and expert counts) replace values that other passes' ops only
read (C's and I's ``order``, the GEMMs' ``offs`` from Q's counts). S (a compressor's fp32 GEMMs, bf16 operands, feeding
its ``cat``) takes GEMMs that E (softplus), F (fp32 weights) and O (the graph's output) refuse. V (V4's Hadamard
rotations) takes a matmul by a constant matrix, which no other pass's site is.

    manager = PassManager("all", strict=True, expected=expected_sites(cfg))
    manager.run(gm)                   # rewrites gm in place
    manager.counts                    # tiny V4.1: {"C": 10, "E": 10, "D": 30, "A": 10, "B": 4, "F": 20, ...}
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
from typing import Any, Iterable

from torch.fx import Graph, GraphModule

from .base import Rewrite, apply_match, site_of
from .rewrite_candidate_blocks import CandidateBlocks
from .rewrite_compressor_gemm import CompressorGemm
from .rewrite_fp4_experts import FP4GroupedMM
from .rewrite_fp8_experts import FP8Experts
from .rewrite_fp8_linear import FP8LinearOp
from .rewrite_gate import GateTF32x3
from .rewrite_hc_expand import HCExpand
from .rewrite_hc_expand_mix import HCExpandMix
from .rewrite_hc_mix import HCMixTF32x3
from .rewrite_hc_mix_fused import HCMixFused
from .rewrite_hadamard import Hadamard
from .rewrite_hc_sinkhorn import HCSinkhorn
from .rewrite_head_logits import HeadLogits
from .rewrite_indexer import IndexerTopK
from .rewrite_indexer_candidates import IndexerCandidates
from .rewrite_moe_activation import MoEActivation
from .rewrite_moe_combine import MoECombine
from .rewrite_moe_gather import MoERowGather
from .rewrite_expert_order import ExpertOrder
from .rewrite_row_topk import RowTopK
from .rewrite_shared_fq8 import SharedFq8
from .rewrite_sparse_attention import SparseAttention

try:  # installable as an Inductor custom pass too (it then keys the FX graph cache by uuid())
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # pragma: no cover
    _PassBase = object

log = logging.getLogger("minidi.passes")

REWRITES: tuple[type[Rewrite], ...] = (MoECombine, GateTF32x3, CompressorGemm, FP4GroupedMM, SparseAttention,
                                        IndexerTopK, HCMixTF32x3, HCMixFused, HCSinkhorn, HCExpand, HCExpandMix,
                                        MoEActivation,
                                        MoERowGather, FP8Experts, IndexerCandidates, CandidateBlocks, FP8LinearOp,
                                        SharedFq8, HeadLogits, RowTopK, ExpertOrder, Hadamard)
BY_KEY: dict[str, type[Rewrite]] = {r.key: r for r in REWRITES}
BY_NAME: dict[str, type[Rewrite]] = {r.name: r for r in REWRITES}


class PassMatchError(RuntimeError):
    """strict mode: a pass matched a different number of sites than the model has."""


def select(passes: str | Iterable[str] | None) -> list[str]:
    """"all" | "none" | "A,B" | "all,X" | ["A", "moe_combine"] -> pass keys in manager order. "all" is every pass
    but opt-in ones (``Rewrite.in_all = False``: U, slower than G + J on the H100), which are named on their own."""
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
    for k in sorted(keys):
        missing = [r for r in BY_KEY[k].requires if r not in keys]
        if missing:
            raise ValueError(f"pass {k} ({BY_KEY[k].name}) rewrites the ops of passes "
                             f"{', '.join(f'{r} ({BY_KEY[r].name})' for r in missing)}: select them too")
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

    ``expected``: pass key -> layer of each site (``minidi.runtime.compile.expected_sites(cfg)``); passes without an
    entry are not checked.
    ``strict``: a count that differs from the expected one raises ``PassMatchError`` naming the pass, the expected
    and matched counts and the layers missed; otherwise a warning, and the unmatched sites keep the naive code
    (each rewrite is local and exact, so a partial rewrite never changes the result).
    ``keep_graphs``: keep a copy of each graph before and after the passes (inspection and tests).
    """

    def __init__(self, passes: str | Iterable[str] | None = "all", *, strict: bool = False,
                 expected: dict[str, list[int]] | None = None, op_backend: str = "auto",
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
        mods += [sys.modules["minidi.passes.fx_utils"], sys.modules["minidi.passes.patterns"],
                 sys.modules["minidi.formats"]]
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

    def restore(self, layer: int | None, counts: dict[str, int]) -> None:
        """Record the counts of a graph compiled for ``layer`` in another process (a warm start from precompiled
        graphs, which runs no passes), checked against the expected sites of that layer as ``run`` checks them
        (``layer`` None: a graph of no layer, e.g. a per-layer compile's head graph)."""
        missing = [k for k in self.keys if k not in counts]
        if missing:
            raise PassMatchError(f"minidi passes: recorded counts for layer {layer} lack passes {missing}")
        counts = {k: int(counts[k]) for k in self.keys}
        self.current_layer = layer
        try:
            self.counts, self.sites = counts, {k: [layer] * n for k, n in counts.items()}
            self.history.append(dict(counts))
            if layer is not None:
                self.layer_counts[layer] = dict(counts)
            self._check(counts, self.sites)
        finally:
            self.current_layer = None

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
