"""The first call's bookkeeping (``minidi/runtime/first_step.py``): torch's phases listed longest first, and the
Triton compiles counted through Triton's compilation listener (chained with one set before, put back after)."""

from __future__ import annotations

import types

import pytest

from minidi.runtime.first_step import TritonCompiles, phase_detail


def test_phase_detail_sorts_longest_first_and_drops_short_phases():
    delta = {"GraphLowering.run": 1.234, "_compile.compile_inner": 9.87, "tiny": 0.01, "async_compile.wait": 1.234}
    out = phase_detail(delta, min_s=0.05)
    assert list(out) == ["_compile.compile_inner", "GraphLowering.run", "async_compile.wait"]  # ties by name
    assert out["GraphLowering.run"] == 1.23 and "tiny" not in out


def _times(ir_us: int, stages_us: list[int], store_us: int):
    return types.SimpleNamespace(ir_initialization=ir_us, total_lowering=sum(stages_us), store_results=store_us)


def test_triton_compiles_count_compiles_and_cache_hits_and_chain_the_previous_listener():
    counter = TritonCompiles()
    if not counter.available:
        pytest.skip("this Triton has no compilation listener (triton.knobs.compilation.listener)")
    from triton import knobs

    seen = []
    previous = knobs.compilation.listener

    def earlier(**event):
        seen.append(event["cache_hit"])

    knobs.compilation.listener = earlier
    try:
        counter.start()
        assert knobs.compilation.listener is counter
        event = dict(src=types.SimpleNamespace(name="_kernel_a"), metadata=None, metadata_group={})
        knobs.compilation.listener(**event, times=_times(1_000, [2_000, 500_000], 3_000), cache_hit=False)
        knobs.compilation.listener(**event, times=_times(7, [7], 7), cache_hit=True)
        knobs.compilation.listener(**{**event, "src": None}, times=_times(0, [20_000], 0), cache_hit=False)
        counter.stop()
        assert knobs.compilation.listener is earlier  # put back
        assert seen == [False, True, False]  # chained
        assert counter.record() == {"compiles": 2, "cache_hits": 1, "s": 0.53,
                                    "kernels": {"_kernel_a": [1, 0.51], "(unnamed)": [1, 0.02]}}
        assert counter.seen
    finally:
        knobs.compilation.listener = previous


def test_a_first_call_that_raises_leaves_no_listener_behind():
    """The step puts Triton's listener back whether or not its first call succeeds."""
    import torch

    import minidi

    if not TritonCompiles().available:
        pytest.skip("this Triton has no compilation listener (triton.knobs.compilation.listener)")
    from triton import knobs

    before = knobs.compilation.listener

    def bad(x):
        return x @ x  # [2, 3] @ [2, 3]: the shapes do not match, so the first call raises

    step = minidi.compile(bad, "none", backend="eager", dynamic=False)
    with pytest.raises(Exception):
        step(torch.ones(2, 3))
    assert knobs.compilation.listener is before


def test_dynamo_trace_is_dynamo_less_the_passes_the_precompile_and_the_backend(monkeypatch):
    """Dynamo's phase holds the whole backend call (passes, the kernels' fake runs, AOT + Inductor): what is left
    is its tracing; the fake runs' seconds are their own field."""
    from minidi.runtime import first_step
    from minidi.runtime.first_step import FirstStep

    clock = {"_compile.compile_inner": 0.0}
    monkeypatch.setattr(first_step, "_torch_compile_seconds", lambda: dict(clock))
    backend = types.SimpleNamespace(times={"passes": 0.0, "precompile": 0.0, "backend": 0.0})
    first = FirstStep(backend, None)
    first.start()
    backend.times.update(passes=1.0, precompile=2.0, backend=3.0)
    clock["_compile.compile_inner"] = 10.0
    out = first.finish(lambda: None)
    assert (out["passes"], out["kernel_precompile"], out["backend"], out["dynamo"]) == (1.0, 2.0, 3.0, 10.0)
    assert out["dynamo_trace"] == 4.0
    assert first.precompile == {"submitted": 0, "ops_run": 0, "failed": 0, "wait_s": 0.0, "stopped": {}}
