"""The prefill engine on the tiny V4.1 and V4 models (CPU).

Equalities are checked in fp32 with fake-quant off (spec V4.1 §15: bf16 rounding differences are amplified by
top-k ties and expert routing into O(1) logit changes, which would hide or fake bugs). Tolerance 1e-4 on logits of
size ~5: different batch shapes only change fp32 summation order (measured <= 1.5e-5).
"""

import pytest
import torch

import minidi
from minidi.runtime.engine import Engine, Request

TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny-v41", "tiny-v4"])
def model(request):
    return minidi.load_model(request.param, dtype="float32", fake_quant=False)


def _ids(cfg, n, seed):
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, **kw):
    kw = {"max_batch_tokens": 64, "max_seqs": 8, "cache_tokens": 4096, "page_size": 8, **kw}
    return Engine(model, **kw)


def test_prefix_plus_suffix_equals_one_shot_at_every_position(model):
    cfg = model.cfg
    prefix = _ids(cfg, 70, 0)  # odd length: a ratio-2 group and a ratio-4 window straddle the boundary
    eng = _engine(model)
    handle = eng.cache_prefix(prefix)
    suffixes = [_ids(cfg, n, 10 + n) for n in (1, 6, 29)]
    results = eng.prefill([Request(s, prefix=handle, all_logits=True) for s in suffixes])
    for s, r in zip(suffixes, results):
        want = model(torch.tensor(prefix + s))[len(prefix):]
        assert r.error is None and r.logits.shape == want.shape
        assert (r.logits - want).abs().max() < TOL
    # the prefix was shared, not consumed: it serves again
    again = eng.prefill([Request(suffixes[1], prefix=handle)])[0]
    assert (again.logits - results[1].logits[-1]).abs().max() < TOL


@pytest.mark.parametrize("chunk", [3, 7, 16, 37])
def test_chunked_prefill_equals_one_shot(model, chunk):
    # chunk sizes split ratio-2/4/16 groups and the 16-token window at different offsets
    cfg = model.cfg
    ids = _ids(cfg, 90, 1)
    r = _engine(model, max_batch_tokens=chunk).prefill([Request(ids, all_logits=True)])[0]
    assert (r.logits - model(torch.tensor(ids))).abs().max() < TOL


def test_ragged_batch_equals_each_alone(model):
    cfg = model.cfg
    seqs = [_ids(cfg, n, 20 + n) for n in (37, 2, 1, 64, 11)]
    results = _engine(model, max_batch_tokens=200).prefill([Request(s, all_logits=True) for s in seqs])
    for s, r in zip(seqs, results):
        assert (r.logits - model(torch.tensor(s))).abs().max() < TOL


def test_preempted_and_recomputed_equals_uninterrupted(model):
    cfg = model.cfg
    prompts = [_ids(cfg, n, 40 + n) for n in (20, 31, 12)]
    roomy = _engine(model).generate(prompts, 10)
    # a budget that holds about two of the three sequences: the last admitted one is evicted and recomputed
    tight = _engine(model, max_seqs=3, cache_tokens=48, page_size=4 if cfg.is_v41 else 1).generate(prompts, 10)
    assert sum(r.preemptions for r in tight) > 0
    assert [r.tokens for r in tight] == [r.tokens for r in roomy]
    # Portability (issue 16): these are argmax tokens of random weights. On the AMX Xeon the smallest top-2 margin of
    # tiny-v41's 30 recomputed greedy steps is 1.4e-4, ~10x the fp32 batch-shape spread (<= 1.5e-5): it holds here,
    # but is the first thing to look at if this test fails on another CPU.
    for p, r in zip(prompts, roomy):  # greedy decoding == full recomputation
        ids = list(p)
        for _ in range(10):
            ids.append(int(model(torch.tensor(ids))[-1].argmax()))
        assert ids[len(p):] == r.tokens


def test_bad_requests_are_named_and_others_complete(model):
    cfg = model.cfg
    good = _ids(cfg, 9, 5)
    eng = _engine(model, cache_tokens=256)
    res = eng.prefill([
        Request([], request_id="empty"),
        Request([1, cfg.vocab_size + 3], request_id="oov"),
        Request(good, request_id="ok"),
        Request([1] * (cfg.max_position_embeddings + 1), request_id="too-long"),
        Request([1] * 300, request_id="over-budget"),
        Request([1, -2], request_id="negative"),
    ])
    errors = {r.request_id: r.error for r in res}
    assert "empty prompt" in errors["empty"]
    assert f"token id {cfg.vocab_size + 3} at position 1" in errors["oov"]
    assert "max_position_embeddings" in errors["too-long"]
    assert "cache budget" in errors["over-budget"]
    assert "token id -2 at position 1" in errors["negative"]
    assert errors["ok"] is None
    assert (res[2].logits - model(torch.tensor(good))[-1]).abs().max() < TOL


def test_prefix_pages_are_shared_not_copied(model):
    eng = _engine(model)
    cm = eng.cache
    handle = eng.cache_prefix(_ids(model.cfg, 64, 3))
    used = {m: cm.n_pages[m] - len(cm.free_pages[m]) for m in cm.ratios}
    forks = [cm.fork(handle.seq) for _ in range(3)]
    extra = {m: cm.n_pages[m] - len(cm.free_pages[m]) - used[m] for m in cm.ratios}
    # each fork owns at most its copied partly-filled last page; full pages are refcounted
    for m in cm.ratios:
        assert extra[m] <= 3
        full = (64 // m) // cm.page_size
        assert all(cm.page_refs[m][p] == 4 for p in handle.seq.pages[m][:full])
    for f in forks:
        cm.release(f)
    assert {m: cm.n_pages[m] - len(cm.free_pages[m]) for m in cm.ratios} == used


class TestGoldenGeneration:
    """Greedy tokens of both embedded tiny checkpoints through the engine (incremental decode steps), in fp32.

    In fp32 the engine's one-token decode steps equal full recomputation token for token, with fake quant off and on
    (measured; test_preempted_and_recomputed_equals_uninterrupted holds it without fake quant), so the engine must
    give tests/model/test_golden.py's pinned tokens, whose top-2 margins that file asserts. Not in bf16: there a
    one-token decode step rounds differently from a batched prefill (GEMV vs GEMM), the tiny random model's top-2
    margins are ~0.01-0.1, and the tokens differ between CPUs (they failed on an AMX Xeon where they were not
    pinned). tiny-v4 with fake quant on has no pinned tokens (test_golden: its fake-quant spread exceeds its
    margins); its engine check compares the prefill logits with the pinned values instead."""

    @pytest.mark.parametrize("fake_quant", [False, True], ids=["fq_off", "fq_on"])
    def test_tiny_v41(self, fake_quant):
        self._check("tiny-v41", fake_quant)

    @pytest.mark.parametrize("fake_quant", [False, True], ids=["fq_off", "fq_on"])
    def test_tiny_v4(self, fake_quant):
        self._check("tiny-v4", fake_quant)

    @staticmethod
    def _check(name, fake_quant):
        from tests.model.test_golden import FP32_GOLDEN, PROMPT, N_NEW, check_values

        last6, mean_abs, tol, tokens = FP32_GOLDEN[(name, fake_quant)]
        eng = Engine(minidi.load_model(name, dtype="float32", fake_quant=fake_quant), max_batch_tokens=16,
                     cache_tokens=1024, page_size=8)
        if tokens is None:
            logits = eng.prefill([Request(PROMPT, all_logits=True)])[0].logits  # chunks of 16 + 8 tokens
            check_values(logits, last6, mean_abs, tol, f"{name} engine fp32 fake_quant={fake_quant}")
            return
        assert eng.generate([PROMPT], N_NEW)[0].tokens == tokens


def test_chunked_prefill_with_a_longer_engram_ngram():
    """Issue 17 bug: the Engram history handed to each chunk was 3 tokens, where a K-gram needs K - 1 = 4 here: the
    hash ids at each chunk boundary were wrong (shifts past the history read as 'before the start')."""
    from minidi.model.engram_hash import engram_primes
    from minidi.model.presets import preset
    from minidi.runtime.build import model_from_tensors
    from minidi.runtime.random_weights import random_state_dict

    base = preset("tiny-v41", dtype="float32", fake_quant=False)
    rows = tuple(int(p.sum()) for p in engram_primes(base.with_(engram_max_ngram=5)).values())
    cfg = base.with_(engram_max_ngram=5, engram_num_embeddings=rows)
    model = model_from_tensors(cfg, random_state_dict(cfg, seed=2), "cpu")
    ids = _ids(cfg, 40, 3)
    want = model(torch.tensor(ids))
    for chunk in (5, 13):
        r = _engine(model, max_batch_tokens=chunk).prefill([Request(ids, all_logits=True)])[0]
        assert (r.logits - want).abs().max() < TOL, chunk


def test_result_repr_is_short():
    from minidi.runtime.engine import Result

    r = Result(request_id="a", logits=torch.zeros(512), tokens=list(range(40)))
    text = repr(r)
    assert text.startswith("Result(request_id='a', error=None, tokens=[0, 1, 2,") and "(40 tokens)" in text
    assert "logits=[512] float32" in text and len(text) < 200
    assert repr(Result(request_id=3, error="request 3: empty prompt")) == (
        "Result(request_id=3, error='request 3: empty prompt', tokens=[], logits=None, preemptions=0)")


def test_eager_engine_bounds_temporaries_and_compile_clears_the_budget():
    """The model never asks whether it is compiled: an eager engine sets its eager budget (the long-context chains
    built in pieces), ``minidi.compile`` clears it (the whole chains that the passes match)."""
    from minidi.model.model import EAGER_BUDGET_BYTES

    model = minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)
    budgets = lambda: {m.eager_budget for m in model.modules() if hasattr(m, "eager_budget")}  # noqa: E731
    assert budgets() == {None}
    Engine(model, max_batch_tokens=16, cache_tokens=1024, page_size=8)
    assert budgets() == {EAGER_BUDGET_BYTES}
    minidi.compile(model, "none", backend="eager")  # lazy: nothing is traced until the first call
    assert budgets() == {None}
