"""``bench/host_timers.py``: timers on minidi's op implementations and the kernel launches, with everything put back
after; the split of a step's host time; the benchmark's ``--host_timers`` line. Never how fast anything was."""

from __future__ import annotations

import time

import pytest
import torch

from bench import host_timers
from bench.host_timers import HostTimers, format_host_timers, measure
from minidi.model import stages
from minidi.ops._dispatch_op import _OPS, dispatch_op

NS = ("minidi", "minidi_test")  # this file's ops live apart from minidi's library (whose ops all have a stage)


def _inner(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _outer(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.minidi_test.host_timers_inner(x) * 2  # an op inside an op: charged to both, once at the top level


inner = dispatch_op("minidi_test::host_timers_inner")(_inner)
inner.register_fake(lambda x: torch.empty_like(x))
outer = dispatch_op("minidi_test::host_timers_outer")(_outer)
outer.register_fake(lambda x: torch.empty_like(x))


def _enqueue(fn, n, device):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def test_ops_are_counted_per_step_and_nested_time_once():
    x = torch.zeros(3)

    def step():
        for _ in range(3):
            outer(x)
        inner(x)

    with torch.no_grad():
        h = measure(step, 4, "cpu", _enqueue, namespaces=NS)
    rows = {r["name"]: r for r in h["rows"]}
    assert rows["op minidi_test::host_timers_outer"]["calls_per_step"] == 3
    assert rows["op minidi_test::host_timers_inner"]["calls_per_step"] == 4  # 3 inside outer + 1 at the top
    assert {r["kind"] for r in h["rows"]} == {"op"}
    assert h["steps"] == 4 and 0 < h["timed_ms"] <= h["step_ms"] and h["rest_ms"] == pytest.approx(
        h["step_ms"] - h["timed_ms"], abs=2e-3)
    outer_ms = rows["op minidi_test::host_timers_outer"]["ms_per_step"]
    inner_ms = rows["op minidi_test::host_timers_inner"]["ms_per_step"]
    assert h["timed_ms"] < outer_ms + inner_ms  # the inner calls inside outer are not counted twice at the top
    outer_self = rows["op minidi_test::host_timers_outer"]["self_ms_per_step"]
    assert 0 < outer_self < outer_ms  # its own time: less the inner calls inside it
    assert rows["op minidi_test::host_timers_inner"]["self_ms_per_step"] == inner_ms  # nothing timed inside it
    assert h["timed_ms"] == pytest.approx(outer_self + inner_ms, abs=2e-3)  # the self times add up to the total
    assert [r["ms_per_step"] for r in h["rows"]] == sorted((r["ms_per_step"] for r in h["rows"]), reverse=True)
    text = format_host_timers(h)
    assert "host, timers on (4 steps, no profiler)" in text and "minidi_test::host_timers_outer" in text


def test_everything_patched_is_put_back_also_after_an_error():
    from torch._inductor.output_code import CompiledFxGraph
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton.runtime.jit import JITFunction

    from minidi.ops._fast_launch import _FastRun

    def patched():
        return (dict(CachingAutotuner.__dict__)["run"], dict(JITFunction.__dict__)["run"],
                dict(CompiledFxGraph.__dict__)["__call__"], dict(_FastRun.__dict__)["run"],
                {k: op.impl for k, op in _OPS.items()})

    before = patched()
    with pytest.raises(KeyError):
        with HostTimers(NS) as t:
            now = patched()
            assert all(a is not b for a, b in zip(now[:4], before[:4]))
            assert _OPS["minidi_test::host_timers_inner"].impl is not _inner
            raise KeyError("boom")
    assert t._undo == []
    assert patched() == before


def test_an_inductor_graph_call_is_a_row_with_the_ops_inside_it_nested():
    x = torch.randn(8)
    fn = torch.compile(lambda a: torch.ops.minidi_test.host_timers_inner(a.sin()).cos(), backend="inductor",
                       fullgraph=True)
    with torch.no_grad():
        fn(x)  # compiled outside the timers
        h = measure(lambda: fn(x), 3, "cpu", _enqueue, namespaces=NS)
    rows = {r["name"]: r for r in h["rows"]}
    graph, op = rows["inductor graphs"], rows["op minidi_test::host_timers_inner"]
    assert graph["kind"] == "inductor graph" and graph["calls_per_step"] == 1 and op["calls_per_step"] == 1
    assert graph["self_ms_per_step"] == pytest.approx(graph["ms_per_step"] - op["ms_per_step"], abs=2e-3)
    assert h["timed_ms"] == pytest.approx(graph["ms_per_step"], abs=2e-3)  # the op ran inside the graph


def test_a_launch_is_charged_to_its_kernel():
    t = HostTimers()

    class Kernel:
        __name__ = "_my_kernel"

    f = t.timed(host_timers._kernel_name, "triton launch", lambda self, *a, **k: 7)
    assert f(Kernel(), 1, grid=(1,)) == 7 and f(Kernel(), 2, grid=(1,)) == 7
    assert t.rows["launch _my_kernel"][:2] == ["triton launch", 2]


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        measure(lambda: None, 0, "cpu", _enqueue)
    with pytest.raises(ValueError, match="no step was timed"):
        HostTimers().summary([])


def test_the_benchmark_line_carries_the_split(tmp_path, capsys):
    from tests.bench.test_bench_prefill import run

    prev = stages.enabled()
    try:
        _, lines = run(tmp_path, "--host_timers", "2", "--profile_steps", "0")
    finally:
        stages.enabled(prev)
    h = lines[0]["host_timers"]
    assert h["steps"] == 2 and h["step_ms"] > 0 and h["rows"]
    marks = {r["name"]: r for r in h["rows"]}["op minidi::stage_mark"]  # the eager step's marker op
    assert marks["kind"] == "op" and marks["calls_per_step"] > 0 and marks["calls_per_step"] == int(
        marks["calls_per_step"])
    assert "host, timers on (2 steps, no profiler)" in capsys.readouterr().out


def test_a_bad_count_is_refused(tmp_path):
    from bench.bench_prefill import main

    with pytest.raises(SystemExit, match="--host_timers N"):
        main(["--model", "tiny-v41", "--device", "cpu", "--out_dir", str(tmp_path), "--host_timers", "-1"])
