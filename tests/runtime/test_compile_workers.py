"""Layer kinds compiled in worker processes (``runtime/compile_workers.py``): a call whose label has no graph yet is
sent to a worker and runs eagerly; after ``collect`` the worker's graph runs, with no tracing in this process.

Toy layers with ``aot_eager`` (a worker spawn and a trace: seconds), then one end-to-end regional compile of a
one-layer tiny V4.1 (passes on, strict) against the same compile in-process, and the failure paths: a worker that
dies (its kind compiles here), a strict pass-count mismatch in a worker (raised here after the first step), bad
settings (clear errors).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import minidi
from minidi.passes import PassMatchError
from minidi.runtime import compile as compile_module
from minidi.runtime.compile import worker_count
from minidi.runtime.compile_workers import CompileWorkers, WorkerSettings
from minidi.runtime.precompiled import PrecompiledCalls, available
from tests.runtime.test_precompiled import Toy, check_eager

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no Dynamo aot_compile")


def settings(passes=(), expected=None) -> WorkerSettings:
    keys = list(passes)
    return WorkerSettings(strict=True, op_backend="auto", backend="aot_eager", faithful_rounding=True,
                          autotune=False, cpu_simd=False, precompile_kernels=False, dynamic=True, recompile_limit=8,
                          expected={"core": expected or {}, "front": {}, "head": {}},
                          keys={"core": keys, "front": [], "head": []})


def call(calls: PrecompiledCalls, label: str, m: Toy, x: torch.Tensor) -> tuple:
    cache, notes = torch.full((64, m.w.shape[0]), float("nan")), {}
    out = calls(label, Toy.forward, m, x, cache, notes, backend=lookup_backend("aot_eager"))
    return out, cache, notes


def test_a_kind_runs_eagerly_while_a_worker_compiles_it_then_its_graph_runs():
    torch.manual_seed(0)
    calls = PrecompiledCalls(dynamic=True)
    calls.workers = CompileWorkers(1, settings())
    a, b, plain = Toy(16, True), Toy(16, True), Toy(16, False)
    for m, rows in ((a, 5), (b, 9), (plain, 4)):  # the first step: every layer eager, one job per label
        x = torch.randn(rows, 16)
        check_eager(m, x, call(calls, "doubled" if m.doubled else "plain", m, x))
    assert calls.sent == {"doubled": [()], "plain": [()]}
    results = calls.collect()
    assert [(r.label, r.error) for r in results] == [("doubled", None), ("plain", None)]
    assert calls.workers is None and calls.from_workers == ["doubled", "plain"] and calls.compiled == []
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    for m in (a, b, plain, Toy(16, True)):  # the workers' graphs serve every layer of their kind, rows vary
        x = torch.randn(7, 16)
        check_eager(m, x, call(calls, "doubled" if m.doubled else "plain", m, x))
    assert counters["stats"]["unique_graphs"] == graphs and calls.compiled == []  # nothing traced here
    assert b"doubled" in calls.dumps()  # a compile cache entry keeps the workers' graphs


def test_a_worker_that_dies_leaves_its_kind_to_this_process():
    torch.manual_seed(1)
    calls = PrecompiledCalls(dynamic=True)
    calls.workers = CompileWorkers(1, settings())
    calls.workers.procs[0].kill()
    calls.workers.procs[0].join()
    m, x = Toy(16, True), torch.randn(5, 16)
    check_eager(m, x, call(calls, "doubled", m, x))  # sent (or not: a broken pipe) and run eagerly, or compiled here
    results = calls.collect()
    assert all(r.blob is None and "exited" in r.error for r in results)
    check_eager(m, x, call(calls, "doubled", m, x))
    assert calls.compiled == ["doubled"] and calls.from_workers == []


def test_workers_of_a_failed_first_step_are_stopped_without_waiting():
    calls = PrecompiledCalls(dynamic=True)
    calls.workers = CompileWorkers(1, settings())
    procs = list(calls.workers.procs)
    m, x = Toy(16, True), torch.randn(5, 16)
    call(calls, "doubled", m, x)  # a job in flight
    t0 = time.perf_counter()
    calls.drop_workers()
    assert time.perf_counter() - t0 < 8 and not any(p.is_alive() for p in procs)
    assert calls.workers is None and calls.fns == {} and calls.sent == {}


def one_layer_model() -> torch.nn.Module:
    from minidi.runtime.build import model_from_tensors
    from minidi.runtime.random_weights import random_state_dict

    cfg = minidi.preset("tiny-v41", n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                        candidate_source_layer=-1, engram_layers=(), engram_num_embeddings=()).with_(name="cw-v41")
    return model_from_tensors(cfg, random_state_dict(cfg, seed=3), "cpu")


def step_inputs(model):
    """A fresh 24-token step on an empty cache (same tokens every call)."""
    from minidi.model.context import ModelCache, StepMeta

    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(5))
    return StepMeta.for_sequence(ids, cfg.window_size, model.ratios, 0), ModelCache()


@torch.no_grad()
def test_regional_compile_with_a_worker_matches_the_in_process_compile():
    model = one_layer_model()
    outs = {}
    for workers in (1, 0):
        meta, cm = step_inputs(model)
        step = minidi.compile(model, "all", strict=True, regional=True, backend="aot_eager", compile_workers=workers)
        first = step(meta, cm)
        meta, cm = step_inputs(model)
        outs[workers] = (first, step(meta, cm), dict(step.counts))
        if workers:
            record = step.first_step.workers
            assert record["workers"] == 1 and all(j["ok"] for j in record["jobs"]), record
            assert {j["label"].split()[0] for j in record["jobs"]} == {"core", "head"}
            assert step.precompiled.compiled == [] and "compile_workers_wait" in step.compile_s
        step.uncompile()
        torch._dynamo.reset()
    meta, cm = step_inputs(model)
    eager = model.step(meta, cm)
    assert torch.equal(outs[1][0], eager)  # the first step ran the layers eagerly
    assert torch.equal(outs[1][1], outs[0][1])  # then the worker's graph: the in-process compile's result, bitwise
    assert outs[1][2] == outs[0][2] and outs[1][2]["C"] == 1


@torch.no_grad()
def test_a_regional_strict_mismatch_in_a_worker_fails_the_first_step():
    model = one_layer_model()
    meta, cm = step_inputs(model)
    step = minidi.compile(model, "C", strict=True, regional=True, backend="aot_eager", compile_workers=1,
                          expected={"C": [0, 0]})
    with pytest.raises(PassMatchError, match="pass C .*expected 2 site"):
        step(meta, cm)
    step.uncompile()
    torch._dynamo.reset()


@pytest.mark.parametrize("cpus, want", [(1, 0), (2, 2), (3, 3), (64, 3)])
def test_default_workers_on_a_cpu_model(monkeypatch, cpus, want):
    """A CPU model with Inductor: one worker per label (here one layer kind, the front and the head: 3) up to every
    usable CPU, none on one CPU; another backend, a backend object or pieces of graphs: none."""
    model = one_layer_model()
    monkeypatch.setattr(compile_module, "usable_cpus", lambda: cpus)
    assert worker_count(None, model, "inductor", True) == want
    assert worker_count(None, model, "aot_eager", True) == 0
    assert worker_count(None, model, lookup_backend("inductor"), True) == 0
    assert worker_count(None, model, "inductor", False) == 0


def test_usable_cpus_is_the_affinity():
    import os

    want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert compile_module.usable_cpus() == want >= 1


def test_worker_count_rules():
    model = one_layer_model()
    assert worker_count(3, model, "inductor", True) == 3 and worker_count(0, model, "inductor", True) == 0
    with pytest.raises(ValueError, match=">= 0"):
        worker_count(-1, model, "inductor", True)
    with pytest.raises(ValueError, match="by name"):
        worker_count(2, model, lookup_backend("aot_eager"), True)
    with pytest.raises(ValueError, match="fullgraph"):
        worker_count(2, model, "inductor", False)
    with pytest.raises(ValueError, match=">= 1"):
        CompileWorkers(0, settings())
    with pytest.raises(ValueError, match="needs regional=True"):
        minidi.compile(model, "none", compile_workers=2)
