"""All passes on the real tiny models through the Engine (aot_eager, dynamic shapes, strict): every site of the config
matched, logits equal to the uncompiled model, one graph and no graph break; strict mode failing loudly when a pass
is broken; the same counts traced (no run) at a second tiny config and, opt-in (MINIDI_SLOW_TESTS=1), at the
full-size shapes with fake weights.

The ops run under the Triton interpreter here, so each model runs one small step (2 requests, 37 tokens).
"""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from expecttest import assert_expected_inline
from torch._dynamo.utils import counters

import minidi
from minidi.ops.sparse_attention import ROPE_OUT, ROPE_Q
from minidi.passes.rewrite_sparse_attention import rope_chain
from minidi.model.context import ModelCache, StepMeta
from minidi.passes import PassManager, PassMatchError
from minidi.runtime.compile import dynamic_shape_config, expected_sites
from minidi.runtime.engine import Engine, Request

from .helpers import expected_fq8_groups, shared_fq8_groups

KW = dict(max_batch_tokens=64, max_seqs=8, cache_tokens=2048, page_size=8)
TOL = 1e-4  # fp32, fake-quant off: the ops differ from the naive code only in summation order


def requests() -> list[Request]:
    return [Request(list(range(5, 25))), Request(list(range(30, 47)))]


@pytest.fixture(scope="module", params=["tiny-v41", "tiny-v4"])
def compiled(request):
    torch._dynamo.reset()
    counters.clear()
    model = minidi.load_model(request.param, dtype="float32", fake_quant=False)
    engine = Engine(model, compile=True, passes="all,U",  # U: opt-in, its sites counted here too
                    compile_kwargs={"backend": "aot_eager", "strict": True, "keep_graphs": True}, **KW)
    out = engine.prefill(requests())
    ref = Engine(model, **KW).prefill(requests())
    return SimpleNamespace(name=request.param, model=model, cfg=model.cfg, manager=engine.pass_manager, out=out,
                           ref=ref, graph_breaks=dict(counters["graph_break"]), stats=dict(counters["stats"]))


def test_every_site_matched(compiled):
    want = expected_sites(compiled.cfg)
    assert compiled.manager.counts == {k: len(v) for k, v in want.items()}
    for key, layers in want.items():
        assert Counter(compiled.manager.sites[key]) == Counter(layers), key
    if compiled.name == "tiny-v41":
        assert compiled.manager.counts == {"C": 10, "E": 10, "D": 30, "A": 10, "B": 4, "F": 20, "J": 20, "K": 20,
                                           "G": 20, "U": 10, "H": 10, "I": 10, "L": 0,
                                           "M": 1, "T": 1, "N": 86, "R": 0, "O": 1, "P": 10, "Q": 10,
                                           "S": 4, "V": 0}  # L, R: fake quant off; S: 2 ratio-2 kv sources
    else:  # F, J: two mixers per layer + V4's hc_head
        assert compiled.manager.counts == {"C": 4, "E": 4, "D": 12, "A": 4, "B": 2, "F": 9, "J": 9, "K": 8, "G": 8,
                                           "U": 4, "H": 4, "I": 4, "L": 0, "M": 0, "T": 0, "N": 34, "R": 0, "O": 1,
                                           "P": 3, "Q": 4, "S": 10, "V": 0}  # P: layer 0 is hash-routed; L, R, V:
        # fake quant off


def test_logits_equal_uncompiled(compiled):
    for a, b in zip(compiled.out, compiled.ref):
        assert a.error is None and b.error is None
        assert (a.logits - b.logits).abs().max().item() < TOL


def test_one_graph_no_graph_break(compiled):
    assert not compiled.graph_breaks
    assert compiled.stats.get("unique_graphs") == 1


def test_naive_ops_gone(compiled):
    _, after = compiled.manager.graphs[-1]
    calls = Counter(f"{n.target.__module__}.{n.target.__name__}" for n in after.graph.nodes
                    if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("minidi.ops"))
    want = {k: len(v) for k, v in expected_sites(compiled.cfg).items()}
    assert +calls == +Counter({
        "minidi.ops.sparse_attention.sparse_attention": want["A"],
        "minidi.ops.indexer_score.indexer_topk": want["B"] - want["M"],  # M took the re-index layers' calls
        "minidi.ops.indexer_candidates.indexer_topk_candidates": want["M"],
        "minidi.ops.candidate_blocks.candidate_blocks": want["T"],
        "minidi.ops.moe_combine.moe_combine": want["C"],
        "minidi.ops.fp4_grouped_gemm.fp4_grouped_mm": want["D"],
        "minidi.ops.gate_tf32x3.gate_tf32x3": want["E"] + want["S"],  # the router, the compressors' GEMMs (J took
        # F's mHC projections)
        "minidi.ops.hc_mix.hc_mix_fused": want["J"] - want["U"],  # U took each layer's second mixer's reads
        "minidi.ops.hc_expand_mix.hc_expand_mix": want["U"],  # with the update they read
        "minidi.ops.hc_sinkhorn.hc_sinkhorn": want["K"],
        "minidi.ops.hc_expand.hc_expand": want["G"] - want["U"],
        "minidi.ops.moe_activation.moe_activation": want["H"],
        "minidi.ops.moe_gather.gather_rows": want["I"],
        "minidi.ops.fp8_linear.fp8_linear": want["N"] - want["A"],  # N's sites: every FP8 linear, and each
        "minidi.ops.fp8_linear.fp8_grouped_linear": want["A"],  # attention's grouped wo_a
        "minidi.ops.fq8.fq8": want["R"],  # none: fake quant off
        "minidi.ops.head_logits.head_logits": want["O"],
        "minidi.ops.row_topk.row_topk": want["P"],
        "minidi.ops.expert_order.expert_order": want["Q"],
    })
    einsums = [n.args[0] for n in after.graph.nodes if n.op == "call_function" and "einsum" in str(n.target)]
    assert not {"thd,tkd->thk", "thk,tkd->thd", "thd,nd->thn", "rk,enk->ren", "tgi,goi->tgo"} & set(einsums)
    # q's and the output's rotations went into the attention at every site: no apply_rope chain is left on an
    # attention's input or output (the key's and the compressor's rotations stay)
    attn = [n for n in after.graph.nodes if n.op == "call_function" and "sparse_attention" in str(n.target)]
    assert [n.kwargs.get("rope_mode") for n in attn] == [ROPE_Q | ROPE_OUT] * want["A"]
    # V4's per-head q RMSNorm went in too (q's row scales), at every V4 site; V4.1 has no such norm
    assert ["q_scale" in n.kwargs for n in attn] == [not compiled.cfg.is_v41] * want["A"]
    chains = [r for r in (rope_chain(n) for n in after.graph.nodes) if r is not None]
    assert chains and not {r[0] for r in chains} & set(attn)
    assert not any(rope_chain(n.args[0]) for n in attn)


def test_indexer_calls_are_not_fp8_without_fake_quant(compiled):
    """Fake quant off: q and k are not fq4 outputs, so no indexer call (B's or M's) takes the FP8 path."""
    _, after = compiled.manager.graphs[-1]
    mma = indexer_mma(after.graph)
    assert len(mma) == len(expected_sites(compiled.cfg)["B"]) and "fp8" not in mma, mma


@pytest.mark.interpreter
def test_inserted_ops_carry_fake_values(compiled):
    """Every op a pass inserted records its output's fake value, so later passes (H reads D's GEMM dtype) see it."""
    _, after = compiled.manager.graphs[-1]
    ops = [n for n in after.graph.nodes
           if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("minidi.ops")]
    assert ops and all(isinstance(n.meta.get("example_value"), (torch.Tensor, tuple)) for n in ops)


def test_one_layer_after_all_passes(compiled):
    """Layer 2 of tiny V4.1 (kv source + indexer owner, ratio 2): the ops it calls after the passes, in order."""
    if compiled.name != "tiny-v41":
        pytest.skip("snapshot of the V4.1 layer")
    from minidi.passes.fx_utils import layer_of

    _, after = compiled.manager.graphs[-1]
    ops = [n.target.__name__ for n in after.graph.nodes if n.op == "call_function" and layer_of(n) == 2
           and getattr(n.target, "__module__", "").startswith("minidi.ops")]
    assert_expected_inline("\n".join(ops), """\
hc_mix_fused
hc_sinkhorn
fp8_linear
fp8_linear
fp8_linear
gate_tf32x3
gate_tf32x3
fp8_linear
indexer_topk
sparse_attention
fp8_grouped_linear
fp8_linear
hc_expand_mix
hc_sinkhorn
gate_tf32x3
row_topk
expert_order
gather_rows
fp4_grouped_mm
fp4_grouped_mm
moe_activation
fp4_grouped_mm
moe_combine
fp8_linear
fp8_linear
fp8_linear
hc_expand""")


def _rerun(compiled, passes: str, strict: bool) -> PassManager:
    before, _ = compiled.manager.graphs[-1]
    manager = PassManager(passes, strict=strict, expected=expected_sites(compiled.cfg))
    manager.run(copy.deepcopy(before))
    return manager


def test_strict_fails_naming_pass_and_layers_when_a_pass_breaks(compiled, monkeypatch):
    from minidi.passes.rewrite_sparse_attention import SparseAttention

    n = compiled.cfg.n_layers
    monkeypatch.setattr(SparseAttention, "match", lambda self, node: None)
    with pytest.raises(PassMatchError, match=rf"pass A \(sparse_attention\): expected {n} site\(s\), matched 0; "
                                             rf"missed in layers \[0, 1, .*{n - 1}\]"):
        _rerun(compiled, "all", strict=True)


def test_disabled_pass_changes_the_counts(compiled):
    manager = _rerun(compiled, "A,B,D,E", strict=True)  # strict checks the selected passes only
    assert "C" not in manager.counts
    assert manager.counts != compiled.manager.counts  # so test_every_site_matched fails when C is left out


# ---- traced only (no run): a second tiny config, and the full-size shapes with fake weights ------------------------
class _Traced(Exception):
    pass


ROPE_MODES: list[int] = []  # rope_mode of every sparse_attention the last trace_counts graph calls
Q_SCALED: list[bool] = []  # whether each of those calls takes q's row scales (V4's q RMSNorm folded)
INDEXER_MMA: list[str | None] = []  # mma of every indexer call (B's and M's ops) in that graph
INDEXER_OPS = ("indexer_topk", "indexer_topk_candidates")
FQ8_GROUPS: list[tuple[int, tuple[str, ...]]] = []  # pass R's fq8 calls in that graph: (layer, the linears reading it)


def indexer_mma(graph: torch.fx.Graph) -> list[str | None]:
    return [n.kwargs.get("mma") for n in graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "") in INDEXER_OPS]


def _trace_only(gm, example_inputs):
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") ==
             "sparse_attention"]
    ROPE_MODES[:] = [n.kwargs.get("rope_mode", 0) for n in calls]
    Q_SCALED[:] = ["q_scale" in n.kwargs for n in calls]
    INDEXER_MMA[:] = indexer_mma(gm.graph)
    FQ8_GROUPS[:] = shared_fq8_groups(gm.graph)

    def run(*args):
        raise _Traced

    return run


def trace_counts(model: torch.nn.Module, n_tokens: int) -> dict[str, int]:
    torch._dynamo.reset()
    cfg = model.cfg
    dev = next(model.parameters()).device
    ids = torch.arange(n_tokens, device=dev) % cfg.vocab_size
    meta = StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.step_ngram)
    step = minidi.compile(model, "all,U", backend=_trace_only, strict=True)  # U: opt-in
    # specialize_float: Dynamo cannot build ``torch.tensor`` of lifted symbolic floats (the e2m1 grid) on meta
    with dynamic_shape_config(), torch._dynamo.config.patch(specialize_float=True), pytest.raises(_Traced):
        step(meta, ModelCache())
    return step.pass_manager.counts


def test_second_tiny_config_counts_traced():
    model = minidi.load_model("tiny-v41-b", dtype="float32", fake_quant=False)
    want = {k: len(v) for k, v in expected_sites(model.cfg).items()}
    assert trace_counts(model, 24) == want == {"A": 8, "B": 3, "C": 8, "D": 24, "E": 8, "F": 16, "J": 16, "K": 16,
                                                "G": 16, "U": 8, "H": 8, "I": 8, "L": 0, "M": 1, "T": 1,
                                                "N": 68, "R": 0, "O": 1, "P": 8, "Q": 8, "S": 2, "V": 0}


def test_production_settings_counts_traced():
    """bf16 with fake-quant on (the served settings): D then matches the ``torch._grouped_mm`` form of the GEMMs, and
    every indexer site's q and k are fq4 outputs, so every indexer call (B's, and M's at the re-index layer) scores on
    FP8 tensor cores (``mma="fp8"``; with fake quant off none does, see
    ``test_indexer_calls_are_not_fp8_without_fake_quant``; tiny V4: ``test_indexer_fp8_pass.py``); and the FP8
    linears' inputs are fq8'd, so pass R finds its groups: per layer wq_a + wkv and the shared expert's w1 + w3, in
    the four index-source layers also attention's and the indexer's wq_b (tiny V4: ``test_rewrite_shared_fq8.py``)."""
    model = minidi.load_model("tiny-v41")
    assert model.cfg.torch_dtype == torch.bfloat16 and model.cfg.fake_quant
    want = {k: len(v) for k, v in expected_sites(model.cfg).items()}
    assert trace_counts(model, 24) == want
    assert INDEXER_MMA == ["fp8"] * want["B"] and want["M"] > 0
    assert want["R"] == 24 and FQ8_GROUPS == expected_fq8_groups(model.cfg)


def fake_model(name: str) -> torch.nn.Module:
    """The full-size model with fake parameters: built on meta, each tensor wrapped as a fake *CPU* tensor (Dynamo
    cannot trace the model on the meta device itself: it builds constants such as the e2m1 grid on the weights'
    device, and real meta constants do not mix with its fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from minidi.model.model import Transformer

    with torch.device("meta"):
        model = Transformer(minidi.preset(name, dtype="float32", fake_quant=False))
    mode, cpu = FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu")
    for mod in model.modules():
        for k, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[k] = torch.nn.Parameter(FakeTensor(mode, p.data.to("meta"), cpu), requires_grad=False)
        for k, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[k] = FakeTensor(mode, b.to("meta"), cpu)
    return model.eval()


@pytest.mark.slow  # 138 s (V4.1) and 172 s (V4) per full-size trace on 2 cores
@pytest.mark.parametrize("name", ["v41-flash", "v4-flash"])
def test_full_size_counts_traced_with_fake_weights(name):
    model = fake_model(name)
    want = {k: len(v) for k, v in expected_sites(model.cfg).items()}
    assert trace_counts(model, 24) == want
    assert ROPE_MODES == [ROPE_Q | ROPE_OUT] * want["A"]  # both rotations folded at every site
    assert Q_SCALED == [not model.cfg.is_v41] * want["A"]  # V4's q RMSNorm folded at every site (V4.1 has none)
