"""The engine's step under torch.compile(fullgraph=True, dynamic=True): no graph break, one graph for many batch
shapes, same logits as eager.

The CPU test traces with the ``aot_eager`` backend: Dynamo capture plus AOT functionalisation, i.e. exactly the
graph Inductor (and minidi's passes) receive, without the minutes of C++ code generation on a 2-core CI machine.
Inductor itself is exercised on the GPU by the benchmarks.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import minidi
from minidi.runtime.engine import Engine, Request

SHAPES = [(40,), (33, 7), (50, 20, 3), (64,), (13, 13, 13, 13), (5, 1)]


def test_compiled_step_one_graph_no_breaks_equal_to_eager():
    torch._dynamo.reset()
    counters.clear()
    model = minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)
    kw = dict(max_batch_tokens=64, max_seqs=8, cache_tokens=2048, page_size=8)
    # op_backend "ref": the inserted ops run their torch references, not interpreted kernels (the graph is the same;
    # the kernels against the model: tests/passes/test_models.py), so the six steps cost little beside the compile
    compiled = Engine(model, compile=True, compile_kwargs={"backend": "aot_eager", "op_backend": "ref"}, **kw)
    eager = Engine(model, **kw)
    g = torch.Generator().manual_seed(0)
    for lens in SHAPES:
        reqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
        a = compiled.prefill([Request(r) for r in reqs])
        b = eager.prefill([Request(r) for r in reqs])
        for x, y in zip(a, b):
            assert (x.logits - y.logits).abs().max() < 1e-5
    assert not counters["graph_break"], dict(counters["graph_break"])
    # one graph for all six batch shapes (tokens, sequences, pending rows, new entries all differ)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_regional_step_one_graph_per_kind_for_every_batch_shape():
    """The per-layer compile traces each layer kind once for all six batch shapes: only the leading dims of the
    layers' tensors are symbolic (``compile_settings.mark_leading_dims_only``), and no other dim of them varies
    between steps (a dim that did would fail its guard and recompile its kind: counted here)."""
    from minidi.runtime.compile import layer_kind

    torch._dynamo.reset()
    counters.clear()
    model = minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)
    kw = dict(max_batch_tokens=64, max_seqs=8, cache_tokens=2048, page_size=8)
    compiled = Engine(model, compile=True, compile_kwargs={"backend": "aot_eager", "op_backend": "ref",
                                                           "regional": True}, **kw)
    step = compiled.step_fn
    eager = Engine(minidi.load_model("tiny-v41", dtype="float32", fake_quant=False), **kw)
    g = torch.Generator().manual_seed(0)
    for lens in SHAPES:
        reqs = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
        for x, y in zip(compiled.prefill([Request(r) for r in reqs]), eager.prefill([Request(r) for r in reqs])):
            assert (x.logits - y.logits).abs().max() < 1e-5
    assert not counters["graph_break"], dict(counters["graph_break"])
    kinds = len({layer_kind(b) for b in model.layers})
    assert len(step.pass_manager.history) == kinds, (len(step.pass_manager.history), kinds)


# tiny-v41's whole-step Inductor compile: 7-8 min on 2 cores (CI at 264637b: 499 s), hence slow; in the default suite
# Inductor compiles tiny-v41 in tests/ops/test_backends.py (every pass, the ops' references) and this test runs tiny-v4
@pytest.mark.parametrize("name", [pytest.param("tiny-v41", marks=pytest.mark.slow), "tiny-v4"])
def test_compiled_engine_equals_eager_bitwise_on_cpu(name):
    """The served settings (bf16, fake quant on) through ``Engine(compile=True)`` with Inductor: faithful rounding
    (the default) rounds where eager rounds and, on a CPU graph, runs ATen's reduction / transcendental kernels
    (``minidi/runtime/exact_cpu.py``), so the compiled step is the eager step bit for bit: the same logits at every
    position of a prefill, the same greedy tokens. (Before: Inductor's own sums left the tiny V4.1 logits 0.12
    rel-RMS from eager, argmax agreement 0.83; with stock rounding 0.51 / 0.46.) Bitwise, so it holds on any CPU: both
    sides run this machine's ATen kernels. One Inductor compile per model (tiny-v4: ~3 min on 2 cores)."""
    from tests.model.test_golden import PROMPT

    torch._dynamo.reset()
    model = minidi.load_model(name)
    assert model.cfg.torch_dtype == torch.bfloat16 and model.cfg.fake_quant
    kw = dict(max_batch_tokens=64, max_seqs=4, cache_tokens=1024, page_size=8)
    eager, compiled = Engine(model, **kw), Engine(model, compile=True, **kw)
    want = eager.prefill([Request(PROMPT, all_logits=True)])[0].logits
    got = compiled.prefill([Request(PROMPT, all_logits=True)])[0].logits
    assert torch.isfinite(want).all()
    assert torch.equal(got, want), float((got - want).abs().max())
    prompts = [PROMPT[:9], PROMPT[5:]]
    a, b = compiled.generate(prompts, max_new_tokens=4), eager.generate(prompts, max_new_tokens=4)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    minidi.uncompile(model)
    assert model.layer_hook is None and all(blk._compiled_call_impl is None for blk in model.layers)
