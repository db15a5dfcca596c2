"""``minidi.ops._weight_cache.cached_per_tensor`` (values derived from a weight, once per tensor) and the FP8 linear's
dequantised-weight cache built on it (``fp8_linear.dequant_weight``): hits, recomputation when the weight or its
scale changes in place, the byte budget, the entry dropped with its weight, the setting's errors, and the op's result
bit for bit with the cache on or off."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from minidi.model.quant import dequant_fp8, fq8, quantize_fp8
from minidi.ops import fp8_linear as fl
from minidi.ops._weight_cache import cached_bytes, cached_per_tensor


class Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


def test_once_per_tensor_and_recomputed_on_change():
    w, s = torch.randn(8, 4), torch.randn(2)
    f = Counter(lambda t: t.sum() + s.sum())
    first = cached_per_tensor("t once", w, f, also=(s,))
    assert cached_per_tensor("t once", w, f, also=(s,)) is first and f.calls == 1
    w.add_(1)  # the weight changes in place: recomputed
    assert torch.equal(cached_per_tensor("t once", w, f, also=(s,)), w.sum() + s.sum()) and f.calls == 2
    s.mul_(2)  # only the tensor it was derived with changes: recomputed too
    assert torch.equal(cached_per_tensor("t once", w, f, also=(s,)), w.sum() + s.sum()) and f.calls == 3
    cached_per_tensor("t once", w.clone(), f)  # another tensor: its own entry
    assert f.calls == 4


def test_budget_and_entries_dropped_with_their_tensor():
    ws = [torch.randn(4) for _ in range(3)]
    f = Counter(lambda t: t * 2)
    for w in ws:  # 10 bytes each, budget 25: the first two are kept, the third is computed every call
        cached_per_tensor("t budget", w, f, budget=25, size=10, group="t group")
    assert cached_bytes("t group") == 20 and f.calls == 3
    cached_per_tensor("t budget", ws[2], f, budget=25, size=10, group="t group")
    assert f.calls == 4  # not kept
    cached_per_tensor("t budget", ws[0], f, budget=25, size=10, group="t group")
    assert f.calls == 4  # kept
    del ws[0]
    gc.collect()
    assert cached_bytes("t group") == 10  # dropped with its tensor: room for the third now
    cached_per_tensor("t budget", ws[1], f, budget=25, size=10, group="t group")
    assert cached_bytes("t group") == 20


def test_inference_tensors_are_computed_every_call():
    with torch.inference_mode():
        w = torch.randn(3)
    f = Counter(lambda t: t + 1)
    cached_per_tensor("t inference", w, f)
    cached_per_tensor("t inference", w, f)
    assert f.calls == 2


def _linear(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w, s = quantize_fp8(torch.randn(n, k, generator=gen) * 3, 32)
    x = torch.randn(5, k, generator=gen).bfloat16()
    return x, w, s.view(torch.uint8)


def _model(x, w, s):
    return F.linear(fq8(x, 32), dequant_fp8(w, s, 32, x.dtype))


def _same(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.interpreter
def test_fp8_linear_keeps_the_dequantised_weight(monkeypatch):
    """Cache on (1 GiB on the CPU): one dequant per weight, the op bit for bit the model's code before and after the
    weight and its scale are overwritten in place (as a checkpoint load does)."""
    monkeypatch.setenv(fl.WEIGHT_CACHE_ENV, "1")
    launches = Counter(fl.dequant_launch)
    monkeypatch.setattr(fl, "dequant_launch", launches)
    x, w, s = _linear(40, 96, 0)
    before = fl.weight_cache_bytes()
    for _ in range(3):
        assert _same(fl.fp8_linear(x, w, s, 32, 32, backend="triton"), _model(x, w, s))
    assert launches.calls == 1 and fl.weight_cache_bytes() == before + 40 * 96 * 2
    _, w2, s2 = _linear(40, 96, 1)
    w.copy_(w2)
    assert _same(fl.fp8_linear(x, w, s, 32, 32, backend="triton"), _model(x, w, s)) and launches.calls == 2
    s.copy_(s2)  # the scale alone changes
    assert _same(fl.fp8_linear(x, w, s, 32, 32, backend="triton"), _model(x, w, s)) and launches.calls == 3
    assert fl.weight_cache_bytes() == before + 40 * 96 * 2  # the stale entry replaced, not added


@pytest.mark.parametrize("setting", [None, "0", "0.000001"])
@pytest.mark.interpreter
def test_fp8_linear_without_the_cache(monkeypatch, setting):
    """Off (the CPU's default, 0) or a budget below the weight: a dequant every call, the same bits."""
    if setting is None:
        monkeypatch.delenv(fl.WEIGHT_CACHE_ENV, raising=False)
    else:
        monkeypatch.setenv(fl.WEIGHT_CACHE_ENV, setting)
    launches = Counter(fl.dequant_launch)
    monkeypatch.setattr(fl, "dequant_launch", launches)
    x, w, s = _linear(24, 64, 2)
    before = fl.weight_cache_bytes()
    for _ in range(2):
        assert _same(fl.fp8_linear(x, w, s, 32, 32, backend="triton"), _model(x, w, s))
    assert launches.calls == 2 and fl.weight_cache_bytes() == before


@pytest.mark.interpreter
def test_non_contiguous_weights_are_not_kept(monkeypatch):
    monkeypatch.setenv(fl.WEIGHT_CACHE_ENV, "1")
    x, w, s = _linear(24, 64, 3)
    wt = w.t().contiguous().t()  # same values, column-major
    before = fl.weight_cache_bytes()
    assert _same(fl.fp8_linear(x, wt, s, 32, 32, backend="triton"), _model(x, w, s))
    assert fl.weight_cache_bytes() == before


def test_defaults_and_bad_settings(monkeypatch):
    monkeypatch.delenv(fl.WEIGHT_CACHE_ENV, raising=False)
    assert fl.weight_cache_budget(torch.device("cpu")) == 0
    assert fl.weight_cache_budget(torch.device("cuda")) == 32 * 2**30
    monkeypatch.setenv(fl.WEIGHT_CACHE_ENV, "2.5")
    assert fl.weight_cache_budget(torch.device("cpu")) == int(2.5 * 2**30)
    for bad in ("-1", "lots", "inf", "nan"):
        monkeypatch.setenv(fl.WEIGHT_CACHE_ENV, bad)
        with pytest.raises(ValueError, match=f"{fl.WEIGHT_CACHE_ENV} must be a finite number of GiB"):
            fl.weight_cache_budget(torch.device("cpu"))


@pytest.mark.gpu
def test_fp8_linear_keeps_the_weight_by_default_on_cuda(monkeypatch):
    monkeypatch.delenv(fl.WEIGHT_CACHE_ENV, raising=False)
    launches = Counter(fl.dequant_launch)
    monkeypatch.setattr(fl, "dequant_launch", launches)
    x, w, s = (t.cuda() for t in _linear(520, 1024, 4))
    for _ in range(2):
        assert _same(fl.fp8_linear(x, w, s, 32, 32, backend="triton"), _model(x, w, s))
    assert launches.calls == 1
