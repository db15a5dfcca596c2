"""Engine hardening (issue 18): no bad request or prefix handle raises out of the engine, leaks a slot or a page, or
changes another request's result.

Each test sends bad requests in one batch with good ones and asserts (1) the bad request's error names it and the
problem, (2) the good ones' logits equal a clean run of the good ones alone, (3) the pool's free counts return to
where they started and its invariants hold (``CacheManager.check``: no duplicate free ids, refcounts equal to the
live sequences' pages). Engines run with ``debug=True``, which checks the invariants after every cache change.

Model steps are slow on a shared CPU, so rejected requests are batched many to a step. Where the bad requests are
refused before admission the good ones run in exactly the packing of the clean run: logits must be bitwise equal.
Where a step fails and the good ones are recomputed in other packings, fp32 with fake-quant off differs only in
summation order (tests/runtime/test_engine.py: TOL 1e-4; a corrupted cache was measured off by 0.9-4.7).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import minidi
from minidi.runtime.engine import Engine, PrefixHandle, Request

TOL = 1e-4
PREFIX = list(range(100, 117))  # 17 tokens: a partly filled last page and an odd ratio-2 group to copy on fork
POISON = 7  # a token id the good requests never contain (the failing-step tests key on it)


@pytest.fixture(scope="module")
def model():
    return minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)


def _engine(model, **kw) -> Engine:
    kw = {"max_batch_tokens": 64, "max_seqs": 8, "cache_tokens": 512, "page_size": 8, "debug": True, **kw}
    return Engine(model, **kw)


def _good(handle: PrefixHandle | None) -> list[Request]:
    return [Request(list(range(20, 31)), request_id="good-a"),
            Request(list(range(40, 46)), prefix=handle, request_id="good-b"),
            Request(list(range(60, 63)), request_id="good-c", all_logits=True)]


@pytest.fixture(scope="module")
def reference(model) -> list[torch.Tensor]:
    """Logits of the good requests alone, in a clean engine."""
    eng = _engine(model)
    res = eng.prefill(_good(eng.cache_prefix(PREFIX)))
    assert all(r.error is None for r in res)
    return [r.logits for r in res]


def _assert_pool_clean(eng: Engine, start) -> None:
    assert eng.cache.free_counts() == start
    eng.cache.check(held=eng.live_caches())


def _assert_good(results, reference, exact: bool = True) -> None:
    by_id = {r.request_id: r for r in results}
    for rid, want in zip(("good-a", "good-b", "good-c"), reference):
        r = by_id[rid]
        assert r.error is None, r.error
        if exact:
            assert torch.equal(r.logits, want), rid
        else:
            assert (r.logits - want).abs().max() < TOL, rid


# ---- prefix handles ---------------------------------------------------------------------------------------------
def test_bad_prefix_handles_fail_alone(model, reference):
    eng, other = _engine(model), _engine(model)
    start = eng.cache.free_counts()
    handle = eng.cache_prefix(PREFIX)
    freed = eng.cache_prefix(PREFIX[:9])
    eng.release_prefix(freed)
    foreign = other.cache_prefix(PREFIX)  # same tokens, same model: only the engine identity differs
    other_start = other.cache.free_counts()
    bad = {
        "freed": (freed, "was released"),
        "foreign": (foreign, "belongs to another engine"),
        "never-issued": (dataclasses.replace(handle, handle_id=99), "id 99 was never issued"),
        "negative-id": (dataclasses.replace(handle, handle_id=-1), "never issued"),
        "altered": (dataclasses.replace(handle, tokens=(1, 2, 3)), "tokens differ"),
        "not-a-handle": (PREFIX, "must be a PrefixHandle"),
    }
    res = eng.prefill([Request([5, 6, 8], prefix=h, request_id=rid) for rid, (h, _) in bad.items()] + _good(handle))
    errors = {r.request_id: r.error for r in res}
    for rid, (_, why) in bad.items():
        assert errors[rid] is not None and f"request {rid}:" in errors[rid] and why in errors[rid], errors[rid]
    _assert_good(res, reference)
    assert other.cache.free_counts() == other_start  # the foreign handle's own engine is untouched too
    other.cache.check(held=other.live_caches())
    eng.release_prefix(handle)
    _assert_pool_clean(eng, start)


def test_release_prefix_twice_or_foreign_raises_and_changes_nothing(model):
    eng, other = _engine(model), _engine(model)
    start = eng.cache.free_counts()
    handle = eng.cache_prefix(PREFIX[:5])
    foreign = other.cache_prefix(PREFIX[:5])
    eng.release_prefix(handle)
    for h, why in ((handle, "was released"), (foreign, "another engine"), (None, "no handle"),
                   ("x", "must be a PrefixHandle")):
        with pytest.raises(ValueError, match=why):
            eng.release_prefix(h)
        _assert_pool_clean(eng, start)
    # a prefix cached after the release may reuse the freed slot and pages: the old handle must not reach it
    newer = eng.cache_prefix(PREFIX[:5])
    assert newer.handle_id != handle.handle_id
    res = eng.prefill([Request([9, 10], prefix=handle, request_id="stale")])
    assert "was released" in res[0].error
    eng.release_prefix(newer)
    _assert_pool_clean(eng, start)


# ---- request fields -----------------------------------------------------------------------------------------------
def test_bad_request_fields_fail_alone(model, reference):
    cfg = model.cfg
    eng = _engine(model)
    handle = eng.cache_prefix(PREFIX)
    start = eng.cache.free_counts()
    long = [1] * (cfg.max_position_embeddings - 20)
    bad = {
        "bool-tensor": (dict(tokens=torch.tensor([True, False])), "torch.bool tensor"),
        "none": (dict(tokens=None), "tokens is None"),
        "float-tensor": (dict(tokens=torch.tensor([1.0, 2.0])), "torch.float32 tensor"),
        "2d-tensor": (dict(tokens=torch.tensor([[1, 2]])), "2-D tensor"),
        "float-array": (dict(tokens=np.array([1.5])), "float64 array"),
        "string": (dict(tokens="hello"), "got 'hello' (str)"),
        "bytes": (dict(tokens=b"\x01\x02"), "(bytes)"),
        "dict": (dict(tokens={1: 2}), "(dict)"),
        "generator": (dict(tokens=(t for t in [1, 2])), "(generator)"),
        "nested": (dict(tokens=[[1, 2]]), "position 0 is [1, 2] (list)"),
        "float-id": (dict(tokens=[1, 5.0]), "position 1 is 5.0 (float)"),
        "bool-id": (dict(tokens=[1, True]), "position 1 is a bool"),
        "empty-tensor": (dict(tokens=torch.zeros(0, dtype=torch.long)), "empty prompt"),
        "oov-tensor": (dict(tokens=torch.tensor([1, cfg.vocab_size])), f"token id {cfg.vocab_size} at position 1"),
        "huge-id": (dict(tokens=[2 ** 70]), "outside the vocabulary"),
        "new-negative": (dict(tokens=long, max_new_tokens=-100), "max_new_tokens must be >= 0"),
        "new-float": (dict(tokens=[1], max_new_tokens=1.5), "max_new_tokens must be an int"),
        "new-bool": (dict(tokens=[1], max_new_tokens=True), "max_new_tokens must be an int"),
        "new-str": (dict(tokens=[1], max_new_tokens="3"), "max_new_tokens must be an int"),
        "new-too-long": (dict(tokens=long, max_new_tokens=21), "(prefix + prompt + max_new_tokens) exceeds"),
        "prefix-too-long": (dict(tokens=[1] * (cfg.max_position_embeddings - len(PREFIX) + 1), prefix=handle),
                            "exceeds max_position_embeddings"),
        "budget": (dict(tokens=[1] * 500, max_new_tokens=13), "length 513 exceeds the cache budget of 512"),
        "all-logits-int": (dict(tokens=[1], all_logits=1), "all_logits must be True or False"),
        "prompt-too-long-tensor": (dict(tokens=torch.ones(cfg.max_position_embeddings + 1, dtype=torch.long)),
                                   "prompt of 1025 tokens exceeds max_position_embeddings 1024"),
    }
    reqs = [Request(**kw, request_id=rid) for rid, (kw, _) in bad.items()]
    res = eng.prefill(reqs[:12] + _good(handle) + reqs[12:] + ["not a request"])
    errors = {r.request_id: r.error for r in res}
    for rid, (_, why) in bad.items():
        assert errors[rid] is not None and f"request {rid}:" in errors[rid] and why in errors[rid], errors[rid]
    assert "expected a Request, got str" in res[-1].error
    _assert_good(res, reference)
    _assert_pool_clean(eng, start)


def test_integer_token_types_are_read_as_ids(model, reference):
    # NumPy int64 arrays / ids, int32 and uint8 tensors, tuples and ranges all mean the same prompt
    eng = _engine(model)
    ids = list(range(20, 31))
    forms = [np.array(ids), [np.int64(t) for t in ids], torch.tensor(ids, dtype=torch.int32),
             torch.tensor(ids, dtype=torch.uint8), tuple(ids), range(20, 31), [torch.tensor(t) for t in ids]]
    reqs = [Request(f, request_id=i) for i, f in enumerate(forms)] + [Request(ids, max_new_tokens=np.int64(0))]
    res = eng.prefill(reqs)
    for r in res:
        assert r.error is None, r.error
        assert (r.logits - reference[0]).abs().max() < TOL


def test_generate_needs_max_new_tokens_at_least_one(model):
    eng = _engine(model)
    start = eng.cache.free_counts()
    for n in (0, -3):
        res = eng.generate([[1, 2], [3]], n)
        assert all("generation needs max_new_tokens >= 1" in r.error and f"got {n}" in r.error for r in res)
    assert eng.steps == 0
    with pytest.raises(TypeError, match="list of prompts"):
        eng.generate("hello", 2)
    with pytest.raises(TypeError, match="list of Request"):
        eng.prefill(Request([1, 2]))
    _assert_pool_clean(eng, start)


# ---- failures inside a step / admission / growth ------------------------------------------------------------------
def _poisoned(step_fn):
    def step(meta, cache):
        if bool((meta.input_ids == POISON).any()):
            raise IndexError("RoPE position 1063 outside the table")  # what a slipped-through request once raised
        return step_fn(meta, cache)
    return step


@pytest.mark.parametrize("chunk", [64, 8])  # one step for all, or chunked so the poison fails a later step
def test_failing_step_fails_only_its_request(model, reference, chunk):
    eng = _engine(model, max_batch_tokens=chunk)
    handle = eng.cache_prefix(PREFIX)
    start = eng.cache.free_counts()
    eng.step_fn = _poisoned(eng.step_fn)
    poison = Request([11, 12, 13, 14, 15, 16, 17, 18, 19, POISON], prefix=handle, request_id="poison")
    good = _good(handle)
    res = eng.prefill([good[0], poison, *good[1:]])
    assert res[1].request_id == "poison" and res[1].logits is None
    assert "request poison: step failed: IndexError: RoPE position 1063" in res[1].error
    _assert_good(res, reference, exact=False)
    _assert_pool_clean(eng, start)


def _failing_call(real, n: int, error: BaseException):
    """``real``, except that its ``n``-th call raises ``error`` (the others pass through)."""
    calls = []

    def call(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)
    return call


def test_failing_fork_fails_only_its_request(model, reference, monkeypatch):
    eng = _engine(model)
    handle = eng.cache_prefix(PREFIX)
    start = eng.cache.free_counts()
    # the first fork fails after the slot (and maybe a page) was taken: both must come back
    monkeypatch.setattr(eng.cache, "_fork_rows",
                        _failing_call(eng.cache._fork_rows, 1, RuntimeError("CUDA out of memory (simulated)")))
    res = eng.prefill([Request([5, 6], prefix=handle, request_id="victim")] + _good(handle))
    assert "request victim: admission failed: RuntimeError: CUDA out of memory" in res[0].error
    _assert_good(res, reference)
    _assert_pool_clean(eng, start)


def test_failing_growth_fails_only_its_request(model, reference, monkeypatch):
    eng = _engine(model)
    handle = eng.cache_prefix(PREFIX)
    start = eng.cache.free_counts()
    monkeypatch.setattr(eng.cache, "grow", _failing_call(eng.cache.grow, 2, MemoryError("simulated")))
    res = eng.prefill([Request([5, 6], request_id="first")] + [Request([8, 9], prefix=handle, request_id="victim")]
                      + _good(handle))
    assert res[0].error is None
    assert "request victim: cache reservation failed: MemoryError" in res[1].error
    _assert_good(res, reference, exact=False)  # the first request changes the packing
    _assert_pool_clean(eng, start)


def test_internal_error_fails_the_batch_without_raising_or_leaking(model, monkeypatch):
    import minidi.runtime.engine as engine_mod

    eng = _engine(model)
    handle = eng.cache_prefix(PREFIX)
    start = eng.cache.free_counts()
    # the second item fails after two sequences reserved their cache, one of them forked from the prefix
    monkeypatch.setattr(engine_mod, "StepItem",
                        _failing_call(engine_mod.StepItem, 2, ZeroDivisionError("scheduler bug (simulated)")))
    res = eng.prefill(_good(handle))
    assert all("internal error: ZeroDivisionError: scheduler bug" in r.error for r in res)
    _assert_pool_clean(eng, start)


def test_failed_cache_prefix_leaks_nothing(model):
    eng = _engine(model)
    start = eng.cache.free_counts()
    eng.step_fn = _poisoned(eng.step_fn)
    with pytest.raises(RuntimeError, match="prefix: request 0: step failed"):
        eng.cache_prefix([1, 2, POISON])
    with pytest.raises(ValueError, match="prefix: token at position 1 is a bool"):
        eng.cache_prefix([1, True])
    assert eng.live_caches() == []
    _assert_pool_clean(eng, start)


def test_bad_requests_under_preemption_leave_the_pool_as_it_was(model):
    # a budget that holds about two of the three good sequences: preemption and recomputation run alongside a
    # freed handle, a poisoned step and a negative max_new_tokens
    prompts = [list(range(20, 32)), list(range(40, 49)), list(range(60, 74))]
    roomy = _engine(model).generate(prompts, 3)
    eng = _engine(model, max_seqs=3, cache_tokens=28, page_size=4)  # (measured with a stub step: 1 preemption)
    start = eng.cache.free_counts()
    freed = eng.cache_prefix([1, 2, 3])
    eng.release_prefix(freed)
    eng.step_fn = _poisoned(eng.step_fn)
    reqs = [Request(p, max_new_tokens=3, request_id=f"good-{i}") for i, p in enumerate(prompts)]
    reqs[1:1] = [Request([5, 6], prefix=freed, max_new_tokens=2, request_id="freed"),
                 Request([5, 6], max_new_tokens=-1, request_id="negative")]
    reqs.append(Request([5, 6, 8, POISON], max_new_tokens=2, request_id="poison"))
    res = {r.request_id: r for r in eng.prefill(reqs)}
    assert "step failed" in res["poison"].error and "was released" in res["freed"].error
    assert "max_new_tokens must be >= 0" in res["negative"].error
    assert sum(r.preemptions for r in res.values()) > 0
    for i, want in enumerate(roomy):
        got = res[f"good-{i}"]
        assert got.error is None and got.tokens == want.tokens
        assert (got.logits - want.logits).abs().max() < TOL
    _assert_pool_clean(eng, start)
