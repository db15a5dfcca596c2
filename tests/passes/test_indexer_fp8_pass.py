"""Pass B on the tiny models with the served settings (bf16, fake quant on): every indexer site's q is an fq4 output,
so every replacement scores on FP8 tensor cores (``mma="fp8"``); with fake quant off none does (today's numerics).
Traced only (no run), dynamic shapes, strict counts, as ``test_models.trace_counts``."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import minidi
from minidi.model.context import ModelCache, StepMeta
from minidi.runtime.compile import dynamic_shape_config, expected_sites

MMA: list[str | None] = []  # the mma kwarg of every indexer_topk call in the traced graph


class _Traced(Exception):
    pass


def _trace_only(gm, example_inputs):
    MMA[:] = [n.kwargs.get("mma") for n in gm.graph.nodes
              if n.op == "call_function" and getattr(n.target, "__name__", "") == "indexer_topk"]

    def run(*args):
        raise _Traced

    return run


# tiny V4.1 (fake quant on, and off) is checked where its graphs are traced anyway: test_models.py
# (test_production_settings_counts_traced, test_indexer_calls_are_not_fp8_without_fake_quant)
@pytest.mark.parametrize("name,fake_quant", [("tiny-v4", True)])
def test_fq4_sites_score_on_fp8(name, fake_quant):
    model = minidi.load_model(name, fake_quant=fake_quant)
    cfg = model.cfg
    torch._dynamo.reset()
    ids = torch.arange(24) % cfg.vocab_size
    meta = StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.step_ngram)
    step = minidi.compile(model, "B", backend=_trace_only, strict=True,
                          expected={"B": expected_sites(cfg)["B"]})
    with dynamic_shape_config(), torch._dynamo.config.patch(specialize_float=True), pytest.raises(_Traced):
        step(meta, ModelCache())
    n = len(expected_sites(cfg)["B"])
    assert step.pass_manager.counts == {"B": n} and n > 0
    assert MMA == (["fp8"] if fake_quant else [None]) * n
