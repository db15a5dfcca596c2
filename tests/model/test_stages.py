"""Stage markers (``minidi.model.stages``): they change no number, trace without a graph break (the marker op
"mutates" its tensor, which aot_autograd's functionalization must keep in place), and open the profiler ranges that
the prefill benchmark charges time to, in eager and compiled code.

The compiled check traces a 5-layer V4.1 (every V4.1 layer role: window-only with Engram, compressor + indexer owner,
reuse, candidate source, candidate-filtered re-index) instead of tiny-v41's 10 layers, to halve the trace time.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

import minidi
from minidi.model import stages
from minidi.model.context import ModelCache, StepMeta
from minidi.runtime.expert_parallel import EmulatedEP
from minidi.runtime.build import model_from_tensors
from minidi.runtime.random_weights import random_state_dict

RANGES = ("minidi/attn", "minidi/attn.core", "minidi/indexer", "minidi/moe")


@pytest.fixture(autouse=True)
def markers_off_after():
    """Every test starts and ends with the markers off, whatever it does or raises."""
    stages.enabled(False)
    try:
        yield
    finally:
        stages.enabled(False)


def small_v41(**overrides) -> torch.nn.Module:
    cfg = minidi.preset(
        "tiny-v41", n_layers=5, compress_ratios=(0, 2, 2, 1, 1), kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 4), candidate_source_layer=3, engram_layers=(0,), engram_num_embeddings=(630,),
        dtype="float32", fake_quant=False, **overrides)
    cfg = cfg.with_(name="small-v41")
    return model_from_tensors(cfg, random_state_dict(cfg, seed=1), "cpu")


def meta_of(model, n: int = 24, seed: int = 0) -> StepMeta:
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    return StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.step_ngram)


def profiled_ranges(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith(stages.PREFIX)}


@pytest.fixture(scope="module")
def model():
    return small_v41()


def test_roles_of_the_small_model(model):
    cfg = model.cfg
    assert [cfg.owns_index_keys(i) for i in range(5)] == [False, True, False, True, False]
    assert [cfg.is_candidate_filtered(i) for i in range(5)] == [False, False, False, False, True]
    assert [i in cfg.engram_layers for i in range(5)] == [True, False, False, False, False]


def test_enabled_switch():
    assert stages.enabled() is False
    assert stages.enabled(True) is True and stages.enabled() is True
    assert stages.enabled(False) is False


def test_markers_change_no_logit(model):
    meta = meta_of(model)
    with torch.no_grad():
        off = model.step(meta, ModelCache())
        stages.enabled(True)
        on = model.step(meta, ModelCache())
    assert torch.equal(on, off)


def test_profiler_sees_every_stage_range(model):
    meta = meta_of(model, 16)
    with torch.no_grad():
        assert profiled_ranges(lambda: model.step(meta, ModelCache())) == set()  # off: no marker at all
        stages.enabled(True)
        seen = profiled_ranges(lambda: model.step(meta, ModelCache()))
    assert seen == set(RANGES)  # no moe.comm on one device


def test_profiler_sees_the_expert_exchange():
    ep = small_v41(ep_size=2, ep_rank=1)
    ep.set_expert_exchange(EmulatedEP(2))
    meta = meta_of(ep, 16)
    stages.enabled(True)
    with torch.no_grad():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ep.step(meta, ModelCache())
        logits = ep.step(meta, ModelCache())
    names = [e.name for e in prof.events()]
    # the emulated exchange is its op's calls (x, expert ids, weights per MoE layer), charged to the communication
    # stage by the op (bench/prefill_stages.py OP_STAGE), with no marker range around them
    assert names.count("minidi::rotated_blocks") == 3 * ep.cfg.n_layers
    assert {n for n in names if n.startswith(stages.PREFIX)} == set(RANGES)
    assert torch.isfinite(logits).all()


def test_marker_op_keeps_its_tensor():
    x = torch.randn(4, 8)
    before = x.clone()
    stages.stage_mark(x, "attn", True)
    stages.stage_mark(x, "attn", False)
    assert torch.equal(x, before)
    stages.stage_mark(x, "moe", False)  # an exit without an open range is harmless


def test_unprofiled_markers_open_no_range_and_pairs_stay_matched():
    """With no profiler on a marker opens no range (a timed step pays its dispatch only); an exit closes what its own
    enter opened, also when a profiler started or stopped in between."""
    x = torch.zeros(2)
    stages.stage_mark(x, "attn", True)
    assert stages._open == [None]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        stages.stage_mark(x, "moe", True)  # opened under the profiler
        stages.stage_mark(x, "moe", False)
        stages.stage_mark(x, "attn", False)  # entered before it: nothing to close
        stages.stage_mark(x, "indexer", True)
    assert len(stages._open) == 1 and stages._open[0] is not None
    stages.stage_mark(x, "indexer", False)  # closed after the profiler stopped
    assert stages._open == []
    assert [e.name for e in prof.events() if e.name.startswith(stages.PREFIX)] == ["minidi/moe", "minidi/indexer"]


@pytest.fixture(scope="module")
def compiled(model):
    """model.step compiled once with the markers on (aot_eager, full graph), with the Dynamo graph it traced."""
    graphs = []
    inner = lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    prev = stages.enabled()
    stages.enabled(True)
    try:
        fn = torch.compile(model.step, backend=backend, fullgraph=True, dynamic=False)
        meta = meta_of(model)
        with torch.no_grad():
            out = fn(meta, ModelCache())
        breaks = dict(counters["graph_break"])
    finally:
        stages.enabled(prev)
    return fn, meta, out, graphs, breaks


def test_compiled_with_markers_is_one_graph(compiled):
    _, _, _, graphs, breaks = compiled
    assert not breaks
    assert len(graphs) == 1
    marks = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "stage_mark" in str(n.target)]
    names = [n.args[1] if len(n.args) > 1 else n.kwargs["name"] for n in marks]
    n_layers = 5
    assert names.count("attn") == names.count("moe") == names.count("attn.core") == 2 * n_layers
    # owners (1, 3): key range + query / top-k range; re-index layer 4: query / top-k; reuse layers run no indexer
    assert names.count("indexer") == 2 * (2 + 2 + 1)
    assert "moe.comm" not in names


def test_compiled_with_markers_equals_eager(compiled, model):
    _, meta, out, _, _ = compiled
    with torch.no_grad():
        ref = model.step(meta, ModelCache())
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_compiled_code_opens_the_ranges(compiled):
    fn, meta, _, graphs, _ = compiled
    stages.enabled(True)  # the flag the graph was traced with: no recompile
    with torch.no_grad():
        seen = profiled_ranges(lambda: fn(meta, ModelCache()))
    assert seen == set(RANGES)
    assert len(graphs) == 1
