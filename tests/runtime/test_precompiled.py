"""Precompiled layer graphs (``runtime/precompiled.py``): Dynamo's ahead-of-time compile per label, guard-checked
variants, and the bytes a warm start calls without tracing. A toy layer with ``aot_eager`` (seconds); the model's
own layers through the compile cache are ``test_compile_cache.py``'s end-to-end test."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from minidi.runtime.precompiled import PrecompiledCalls, available

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no Dynamo aot_compile")


class Toy(torch.nn.Module):
    """A layer with a role flag (a guard on the module), a cache it writes in place (a mutated input) and a Python
    side effect on an argument (Dynamo replays it after the graph)."""

    def __init__(self, width: int, doubled: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width, width), requires_grad=False)
        self.doubled = doubled

    def forward(self, x: torch.Tensor, cache: torch.Tensor, notes: dict) -> torch.Tensor:
        y = x @ self.w
        if self.doubled:
            y = y * 2
        cache[: y.shape[0], : y.shape[1]].copy_(y)
        notes["rows"] = y.shape[0]
        return torch.relu(y) + 1


def run(calls: PrecompiledCalls, label: str, m: Toy, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    cache, notes = torch.full((64, m.w.shape[0]), float("nan")), {}
    out = calls(label, Toy.forward, m, x, cache, notes, backend=lookup_backend("aot_eager"))
    return out, cache, notes


def check_eager(m: Toy, x: torch.Tensor, got: tuple) -> None:
    cache, notes = torch.full((64, m.w.shape[0]), float("nan")), {}
    want = m(x, cache, notes)
    assert torch.equal(got[0], want)
    assert torch.equal(got[1].nan_to_num(7.0), cache.nan_to_num(7.0))  # the rows written, the poison kept
    assert got[2] == notes


def test_variants_are_shared_by_equal_layers_and_compiled_for_others():
    torch.manual_seed(0)
    calls = PrecompiledCalls(dynamic=True)
    a, b = Toy(16, True), Toy(16, True)
    for m, rows in ((a, 5), (b, 9), (a, 3)):  # same kind, other weights and row counts: one variant
        x = torch.randn(rows, 16)
        check_eager(m, x, run(calls, "kind", m, x))
    assert calls.compiled == ["kind"] and len(calls.fns["kind"]) == 1
    plain = Toy(16, False)  # a role the first variant's guards refuse: a second variant, not a wrong answer
    x = torch.randn(4, 16)
    check_eager(plain, x, run(calls, "kind", plain, x))
    wide = Toy(24, True)  # parameters of another shape (static): a third
    x = torch.randn(4, 24)
    check_eager(wide, x, run(calls, "kind", wide, x))
    assert calls.compiled == ["kind"] * 3 and len(calls.fns["kind"]) == 3


def test_round_trip_runs_without_tracing():
    torch.manual_seed(1)
    calls = PrecompiledCalls(dynamic=True)
    layers = [Toy(16, True), Toy(16, False)]
    for m in layers:
        run(calls, f"doubled={m.doubled}", m, torch.randn(6, 16))
    blob = calls.dumps()

    warm = PrecompiledCalls(dynamic=True)
    warm.loads(blob)
    assert warm.loaded == 2 and warm.labels() == ["doubled=False", "doubled=True"]
    from torch._dynamo.utils import counters

    frames = counters["stats"]["unique_graphs"]
    for m in layers + [Toy(16, True)]:  # a layer the cold process never saw: its kind's variant serves it
        x = torch.randn(11, 16)  # a row count the cold process never saw
        check_eager(m, x, run(warm, f"doubled={m.doubled}", m, x))
    assert warm.compiled == [] and counters["stats"]["unique_graphs"] == frames  # nothing traced


def test_loads_refuses_another_format():
    import pickle

    with pytest.raises(ValueError, match="format 99, this minidi reads 1"):
        PrecompiledCalls(dynamic=True).loads(pickle.dumps({"format": 99, "fns": {}}))


def test_loads_compiles_the_graphs_cpp_kernels_in_batches(monkeypatch):
    """A fresh machine compiles the loaded graphs' C++ kernels as it deserialises them: under
    ``cpp_kernel_batch.batching()`` (a graph's kernels in a few units, not one g++ run each)."""
    import contextlib
    import pickle

    from minidi.runtime import precompiled

    active = []

    @contextlib.contextmanager
    def batching():
        active.append(True)
        yield
        active.append(False)

    monkeypatch.setattr(precompiled.cpp_kernel_batch, "batching", batching)
    PrecompiledCalls(dynamic=True).loads(pickle.dumps({"format": precompiled.FORMAT, "fns": {}}))
    assert active == [True, False]


@pytest.mark.parametrize("scalar_cpu", [True, False])
def test_loads_builds_cpu_kernels_under_the_compile_s_vector_setting(monkeypatch, scalar_cpu):
    """CPU graphs compiled scalar (``cpp.simdlen`` 0) are loaded under that setting too: their C++ kernels get the
    flags they were built with, so the libraries a compile worker or an earlier run built are found instead of built
    again with the machine's vector flags; otherwise (vector CPU code, GPU graphs) the setting is left alone."""
    import pickle

    import torch._inductor.config as inductor_config
    from torch._dynamo.aot_compile import AOTCompiledFunction

    from minidi.runtime import precompiled

    seen = []
    monkeypatch.setattr(AOTCompiledFunction, "deserialize",
                        staticmethod(lambda b: seen.append(inductor_config.cpp.simdlen) or b))
    before = inductor_config.cpp.simdlen
    calls = PrecompiledCalls(dynamic=True, scalar_cpu=scalar_cpu)
    calls.loads(pickle.dumps({"format": precompiled.FORMAT, "fns": {"core kind": [b"graph"]}}))
    assert seen == [0 if scalar_cpu else before] and calls.fns == {"core kind": [b"graph"]}
    assert inductor_config.cpp.simdlen == before
