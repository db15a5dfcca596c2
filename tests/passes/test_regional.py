"""Regional compilation (``minidi.compile(..., regional=True)``): every layer compiled on its own, layers of one kind
sharing a graph; strict checking per layer; counts summed over the layers; logits equal to the uncompiled model.

tiny-v41, fp32, fake-quant off, aot_eager, strict. The ops run under the Triton interpreter, so the steps are short.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo

import minidi
from minidi.model.context import ModelCache, StepMeta
from minidi.passes import PassManager, PassMatchError
from minidi.runtime.compile import RegionalStep, dynamic_shape_config, expected_sites, layer_kind

TOL = 1e-4  # fp32, fake-quant off: the ops differ from the naive code only in summation order
FIRST, SECOND = 24, 17  # tokens of the two steps (the second one ragged)


def meta_of(model, n: int, seed: int) -> StepMeta:
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    return StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.step_ngram)


def compile_regional(passes: str, name: str = "tiny-v41", **kw) -> SimpleNamespace:
    """A fresh ``name`` model compiled per layer; the uncompiled logits of both steps are taken before compiling (the
    compile replaces each Block's call in place). Records the layer each graph was compiled for."""
    torch._dynamo.reset()
    model = minidi.load_model(name, dtype="float32", fake_quant=False)
    metas = [meta_of(model, FIRST, 0), meta_of(model, SECOND, 1)]
    with torch.no_grad():
        refs = [model.step(m, ModelCache()) for m in metas]
    step = minidi.compile(model, passes, strict=True, regional=True, backend="aot_eager", **kw)
    manager = step.pass_manager
    compiled_for: list[int | None] = []
    run = manager.run

    def recording_run(graph):
        compiled_for.append(manager.current_layer)
        return run(graph)

    manager.run = recording_run  # the backend calls manager.run per graph
    outs, histories = [], []
    with torch.no_grad(), dynamic_shape_config():
        for m in metas:
            outs.append(step(m, ModelCache()))
            histories.append(len(manager.history))
    return SimpleNamespace(model=model, cfg=model.cfg, step=step, manager=manager, refs=refs, outs=outs,
                           histories=histories, compiled_for=compiled_for)


def last_graph_of(compiled: SimpleNamespace, layer: int) -> int:
    """Index in ``manager.graphs`` of the graph that layer's kind runs (a re-traced layer's last one)."""
    return len(compiled.compiled_for) - 1 - compiled.compiled_for[::-1].index(layer)


@pytest.fixture(scope="module")
def regional():
    return compile_regional("all,U", keep_graphs=True)  # U: opt-in, its sites counted here too


def test_one_graph_per_layer_kind(regional):
    kinds = [layer_kind(b) for b in regional.model.layers]
    # tiny-v41: layers 5, 7 and 9 (ratio 2 and 1, no KV source) reuse layer 3's graph, the Engram layers 1 and 4
    # those of layers 0 and 2 (their Engrams compile apart, one graph, outside the pass manager's history)
    assert len(set(kinds)) == 5
    assert isinstance(regional.step, RegionalStep)
    # the graphs were compiled for the first layer of each kind, in layer order
    firsts = [i for i, k in enumerate(kinds) if k not in kinds[:i]]
    assert sorted(set(regional.compiled_for)) == firsts
    assert sorted(regional.manager.layer_counts) == firsts
    assert regional.step.graphs == len(set(kinds))


def test_history_holds_one_entry_per_compiled_graph(regional):
    kinds = {layer_kind(b) for b in regional.model.layers}
    assert regional.histories[0] == len(kinds), regional.compiled_for


def test_counts_sum_over_layers(regional):
    want = {k: len(v) for k, v in expected_sites(regional.cfg, regional=True).items()}
    want["O"] += 1  # the head graph's GEMM: no layer's site (its own check), in the step's counts
    assert regional.step.counts == want == {"A": 10, "B": 4, "C": 10, "D": 30, "E": 10, "F": 20, "J": 20,
                                                    "K": 20, "G": 20, "U": 10, "H": 10, "I": 10, "L": 0,
                                                    "M": 1, "T": 1, "N": 84, "R": 0, "O": 1, "P": 10, "Q": 10,
                                                    "S": 4, "V": 0}  # N: the 2 Engram wkv in the fronts
    for i, counts in regional.manager.layer_counts.items():  # each graph: the sites of its own layer
        assert counts == {k: v.count(i) for k, v in expected_sites(regional.cfg, regional=True).items()}, i


def test_logits_equal_uncompiled(regional):
    for out, ref in zip(regional.outs, regional.refs):
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() < TOL


def test_head_compiled_as_its_own_graph(regional):
    """The output head: one graph (both steps, 24 and 17 tokens, one logit row each), pass O's op in it, strict."""
    head = regional.step.head_backend.pass_manager
    assert head.history == [{"O": 1}] and head.keys == ["O"] and head.strict
    _, after = head.graphs[-1]
    ops = [n.target.__name__ for n in after.graph.nodes if n.op == "call_function"]
    assert ops == ["head_logits"]
    assert regional.model.head._compiled_call_impl is not None


@pytest.mark.interpreter
def test_second_token_count_reuses_the_graphs(regional):
    assert regional.histories[1] == regional.histories[0]
    assert regional.outs[1].shape[0] == SECOND


def test_layer_hook_installed_and_cleared(regional):
    assert regional.model.layer_hook is not None
    assert regional.manager.current_layer is None  # reset after each step


def test_uncompile_restores_the_eager_model():
    torch._dynamo.reset()
    model = minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)
    step = minidi.compile(model, "all", regional=True, backend="aot_eager")
    assert model.head._compiled_call_impl is not None and model.layer_hook is not None
    step.uncompile()
    assert model.head._compiled_call_impl is None and model.layer_hook is None
    assert all(b._compiled_call_impl is None for b in model.layers)


def test_naive_code_gone_from_a_layer_graph(regional):
    """The graph of layer 2 (kv source, indexer owner) calls one op per site of that layer."""
    i = last_graph_of(regional, 2)
    _, after = regional.manager.graphs[i]
    ops = [n.target.__name__ for n in after.graph.nodes
           if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("minidi.ops")]
    assert sorted(ops) == sorted(["indexer_topk", "sparse_attention", "gate_tf32x3", "moe_combine", "row_topk",
                                  "expert_order"]
                                 + ["gate_tf32x3"] * 2  # the compressor's wkv and wgate GEMMs (S)
                                 + ["fp4_grouped_mm"] * 3
                                 + ["hc_mix_fused", "hc_sinkhorn", "hc_sinkhorn"]  # the mixers (F in J; K)
                                 + ["hc_expand_mix", "hc_expand"]  # the updates (G; U: the first with the MoE
                                 # site's mixer reads, J's second op)
                                 + ["moe_activation", "gather_rows"]  # the MoE's activation (H) and gather (I)
                                 + ["fp8_linear"] * 8  # wq_a, wq_b, wkv, wo_b, the indexer's wq_b, shared w1 w3 w2
                                 + ["fp8_grouped_linear"])  # wo_a


def test_strict_failure_names_pass_and_layer(regional, monkeypatch):
    """A broken pass in a regional graph: the error names the pass and the layer the graph was compiled for."""
    from minidi.passes.rewrite_indexer import IndexerTopK

    i = last_graph_of(regional, 8)  # layer 8: the candidate-filtered re-index layer
    before, _ = regional.manager.graphs[i]
    manager = PassManager("all", strict=True, expected=expected_sites(regional.cfg))
    manager.current_layer = 8
    monkeypatch.setattr(IndexerTopK, "match", lambda self, node: None)
    with pytest.raises(PassMatchError, match=r"pass B \(indexer_topk\): expected 1 site\(s\), matched 0; "
                                             r"missed in layers \[8\]"):
        manager.run(copy.deepcopy(before))


def test_strict_checks_the_layer_compiled_for(regional):
    """The same graph checked against another layer's sites: layer 8's graph has an indexer, layer 7's kind none."""
    i = last_graph_of(regional, 8)
    before, _ = regional.manager.graphs[i]
    manager = PassManager("all,U", strict=True, expected=expected_sites(regional.cfg))  # the fixture's passes
    manager.current_layer = 7
    with pytest.raises(PassMatchError, match=r"pass B \(indexer_topk\): expected 0 site\(s\), matched 1; "
                                             r"unexpected matches in layers \[7\]"):
        manager.run(copy.deepcopy(before))
    manager.current_layer = 8
    assert manager.run(copy.deepcopy(before)) == {k: v.count(8) for k, v in expected_sites(regional.cfg).items()}


def test_no_passes_regional():
    """No passes, on tiny V4 (3 layer kinds in 4 layers, and V4's head outside the layers); the regional tiny V4.1
    with its Engram fronts is the fixture above (every pass)."""
    with torch._dynamo.config.patch(specialize_float=True):  # no tensorify re-traces: half the trace time
        plain = compile_regional("none", name="tiny-v4")
    for out, ref in zip(plain.outs, plain.refs):
        assert (out - ref).abs().max().item() < TOL
    assert plain.histories[1] == plain.histories[0]
    kinds = {layer_kind(b) for b in plain.model.layers}
    assert plain.step.graphs == len(kinds) == 3  # one graph per layer kind
    assert plain.step.counts == {}
    assert all(c == {} for c in plain.manager.history)


def test_regional_needs_a_transformer():
    with pytest.raises(TypeError, match="regional"):
        minidi.compile(torch.nn.Linear(2, 2), "none", regional=True, backend="aot_eager")
