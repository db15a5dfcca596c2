"""``kernel_precompile``: minidi's kernels handed to a compile pool before a graph's first run.

CPU: the graph walk (each minidi call's real implementation on fresh fake tensors of the example values' concrete
sizes, strides and offsets; calls that need data stop and are reported; Dynamo's shape environment gains no guard),
the Triton hook (deferred compiles become pool tasks, once per specialisation; a launch waits for its task; a failed
task leaves the launch to compile) and the deferring patch (every launch a warmup, restored after). GPU: a real
kernel compiled by the pool, then launched without a JIT compile and equal to its reference.
"""

import threading
import time
import types

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensor

from minidi.runtime.kernel_precompile import KernelPrecompiler, _fresh_fake, _is_minidi_call

SEEN: list[tuple] = []
TEST_NS = ("minidi", "minidi_test")  # these tests' ops live apart from minidi's library (whose ops all have a stage)


@torch.library.custom_op("minidi_test::precompile_probe", mutates_args=())
def _probe(x: torch.Tensor, n: int) -> torch.Tensor:
    SEEN.append((isinstance(x, FakeTensor), tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, n))
    return x.sum(0) * n


@_probe.register_fake
def _(x, n):
    return x.new_empty(x.shape[1:])


@torch.library.custom_op("minidi_test::precompile_needs_data", mutates_args=())
def _needs_data(x: torch.Tensor) -> torch.Tensor:
    if x.max().item() > 0:  # a host sync: a fake tensor has no data
        return x.clone()
    return x * 0


@_needs_data.register_fake
def _(x):
    return torch.empty_like(x)


def _capture(fn, *args):
    """Dynamo's graph of ``fn`` (dynamic shapes) and its fake mode. The graph never runs (a run would compile its
    kernels in this process before the precompiler sees them)."""
    got = {}

    class Captured(Exception):
        pass

    def backend(gm, example_inputs):
        got["gm"], got["fake_mode"] = gm, torch._guards.detect_fake_mode()  # Dynamo's, from the tracing context

        def never(*a):
            raise Captured

        return never

    torch._dynamo.reset()
    with pytest.raises(Captured):
        torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)(*args)
    torch._dynamo.reset()
    return got["gm"], got["fake_mode"]


def test_the_walk_runs_real_implementations_on_concrete_fake_tensors_and_adds_no_guard():
    def step(x, y):
        a = torch.ops.minidi_test.precompile_probe(x[1:, 2:], x.shape[0])
        b = torch.ops.minidi_test.precompile_needs_data(y)
        return a + 1, b

    x, y = torch.randn(7, 9), torch.randn(5)
    gm, fake_mode = _capture(step, x, y)
    shape_env = fake_mode.shape_env
    guards = len(shape_env.guards)
    nodes = [n for n in gm.graph.nodes if _is_minidi_call(n, TEST_NS)]
    assert len(nodes) == 2 and not any(_is_minidi_call(n, TEST_NS) for n in gm.graph.nodes if n.op == "placeholder")
    assert not any(_is_minidi_call(n) for n in nodes)  # minidi's own library only, by default
    SEEN.clear()
    pc = KernelPrecompiler(workers=1, namespaces=TEST_NS)
    pc.run_calls(nodes)
    # the slice's view is kept: sizes from the hints, strides and the storage offset of x[1:, 2:]
    assert SEEN == [(True, (6, 7), (9, 1), 11, torch.float32, 7)]
    assert pc.ops_run == 2
    assert list(pc.stopped) == ["minidi_test.precompile_needs_data.default"]
    assert "DataDependent" in pc.stopped["minidi_test.precompile_needs_data.default"] or \
        "item" in pc.stopped["minidi_test.precompile_needs_data.default"].lower()
    assert len(shape_env.guards) == guards  # hints read, never guarded on
    assert pc.submitted == 0  # no Triton launch in these ops


def test_symbolic_numbers_read_without_a_guard():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from minidi.runtime.kernel_precompile import _hint

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(6, ConstantSource("s"), dynamic_dim=DimDynamic.DYNAMIC), hint=6)
    assert _hint(s) == 6 and _hint(s * 2 + 1) == 13 and _hint(7) == 7
    assert not env.guards  # read from the hint, not guarded on
    u = env.create_unbacked_symint()
    with pytest.raises(Exception, match="u0"):  # data-dependent: no value to precompile for
        _hint(u)


def test_fresh_fake_keeps_layout_and_reads_hints():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    x = torch.empty(4, 6, dtype=torch.bfloat16).t()[1:]  # non-contiguous with an offset
    f = _fresh_fake(x, mode)
    assert isinstance(f, FakeTensor) and f.shape == x.shape and f.stride() == x.stride()
    assert f.storage_offset() == x.storage_offset() and f.dtype == x.dtype
    assert _fresh_fake([3, (x, None), {"k": 2.5}], mode)[2] == {"k": 2.5}


class _Jit:
    """A stand-in for a JITFunction: ``preload`` records the thread, sleeps, may fail."""

    def __init__(self, delay=0.0, fail=False):
        self.calls, self.delay, self.fail = [], delay, fail

    def preload(self, data):
        self.calls.append((data, threading.current_thread().name))
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("compile error")


def _hook_kw(jit, key="k1", data="spec"):
    return dict(key=key, repr="r", fn=types.SimpleNamespace(jit_function=jit),
                compile={"specialization_data": data, "device": None}, is_manual_warmup=True, already_compiled=False)


def test_hook_defers_compiles_to_the_pool_once_and_a_launch_waits_for_its_task():
    chained = []
    pc = KernelPrecompiler(workers=2)
    pc._previous_hook = lambda **kw: chained.append(kw["key"])
    jit = _Jit(delay=0.3)
    pc._local.deferring = True
    assert pc._hook(**_hook_kw(jit)) is True  # skipped here: the pool compiles it
    assert pc._hook(**_hook_kw(jit)) is True  # the same specialisation: not submitted twice
    pc._local.deferring = False
    assert pc.submitted == 1 and chained == []
    t0 = time.perf_counter()
    assert pc._hook(**_hook_kw(jit)) is None  # a launch: waits for the task, then Triton goes on
    assert time.perf_counter() - t0 > 0.1 and pc.wait_s > 0.1
    assert chained == ["k1"]  # the hook set before is still called on a launch
    assert jit.calls == [("spec", jit.calls[0][1])] and jit.calls[0][1].startswith("minidi-precompile")


def test_installing_twice_chains_the_hook_before_it_once(monkeypatch):
    from triton import knobs

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(kw["key"]))
    pc = KernelPrecompiler(workers=1)
    pc._install()
    pc._install()  # a second graph: still one hook, chaining the user's (not itself)
    assert knobs.runtime.jit_cache_hook is pc._hook_fn
    assert knobs.runtime.jit_cache_hook(**_hook_kw(_Jit(), key="x")) is None and calls == ["x"]


def test_a_failed_task_leaves_the_launch_to_compile():
    pc = KernelPrecompiler(workers=1)
    jit = _Jit(fail=True)
    pc._local.deferring = True
    pc._hook(**_hook_kw(jit, key="bad"))
    pc._local.deferring = False
    pc.wait()
    assert pc._hook(**_hook_kw(jit, key="bad")) is None  # no raise here: the launch's own compile reports it
    assert pc.failed == 1 and pc.record()["failed"] == 1


def test_deferring_makes_every_launch_of_this_thread_a_warmup_and_restores_run(monkeypatch):
    from triton.runtime.jit import JITFunction

    seen = []

    def original(self, *args, grid, warmup, **kwargs):
        seen.append((threading.current_thread().name, warmup))

    monkeypatch.setattr(JITFunction, "run", original)
    pc = KernelPrecompiler(workers=1)
    with pc._deferring():
        JITFunction.run(object(), grid=(1,), warmup=False)
        other = threading.Thread(target=lambda: JITFunction.run(object(), grid=(1,), warmup=False), name="other")
        other.start()
        other.join()
    assert JITFunction.run is original
    assert seen == [(threading.current_thread().name, True), ("other", False)]  # another thread still launches


def test_deferring_sends_fast_launch_kernels_through_the_patched_run(monkeypatch):
    """A ``fast_launch`` kernel with a compiled kernel kept for the launch's signature would launch it without
    calling ``JITFunction.run``: while deferring, it calls the (patched) run, so the launch is a warmup."""
    import torch
    from triton.runtime.jit import JITFunction

    from minidi.ops import _fast_launch as fl

    def src(x_ptr, BLOCK: "tl.constexpr"):  # noqa: F821 - a kernel's signature; never compiled here
        pass

    class Compiled:
        function = packed_metadata = None
        run = property(lambda self: lambda *a: launched.append(a))

    seen, launched = [], []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: seen.append(warmup) or Compiled())
    monkeypatch.setattr(fl, "ENABLED", True)
    monkeypatch.setattr(fl, "_current_device", lambda: 0)
    monkeypatch.setattr(fl, "_current_stream", lambda device: 0)
    k = fl.fast_launch(JITFunction(src))
    try:
        x = torch.zeros(16)
        k[(1,)](x, BLOCK=4)
        k[(1,)](x, BLOCK=4)
        assert seen == [False] and len(launched) == 1  # kept, then launched without Triton's run
        with KernelPrecompiler(workers=1)._deferring():
            k[(1,)](x, BLOCK=4)
        assert seen == [False, True] and len(launched) == 1
    finally:
        fl._KERNELS.remove(k)


def test_no_submission_without_a_kernel_to_compile():
    """On the CPU (or under the interpreter) the walk does not run at all."""
    gm, _ = _capture(lambda x: torch.ops.minidi_test.precompile_probe(x, 2), torch.randn(3, 4))
    SEEN.clear()
    assert KernelPrecompiler(workers=1, namespaces=TEST_NS).submit_graph(gm) == 0 and SEEN == []


@pytest.mark.gpu
def test_gpu_a_kernel_compiled_by_the_pool_launches_without_a_jit_compile():
    from minidi.ops.topk import topk_indices, topk_indices_ref
    from minidi.runtime.first_step import TritonCompiles

    t, n, k = 37, 3001, 13  # an unusual k: no test before compiled this specialisation in this process
    scores = torch.randn(t, n, device="cuda")
    gm, _ = _capture(lambda s: topk_indices(s, k), scores)
    pc = KernelPrecompiler(workers=4)
    assert pc.submit_graph(gm) >= 1, pc.record()
    pc.wait()
    assert pc.failed == 0 and not pc.stopped, pc.record()
    compiles = TritonCompiles()
    compiles.start()
    try:
        out = topk_indices(scores, k)
        torch.cuda.synchronize()
    finally:
        compiles.stop()
    assert compiles.compiles == 0, compiles.record()
    assert torch.equal(out, topk_indices_ref(scores, k))


def test_a_failing_precompile_never_fails_the_compile(monkeypatch, caplog):
    from minidi.passes import PassManager
    from minidi.runtime import kernel_precompile
    from minidi.runtime.compile import make_backend

    def broken(gm):
        raise RuntimeError("no pool today")

    monkeypatch.setattr(kernel_precompile.precompiler(), "submit_graph", broken)
    backend = make_backend(PassManager(None), "eager")
    torch._dynamo.reset()
    x = torch.randn(5)
    with caplog.at_level("WARNING", logger="minidi.compile"):
        out = torch.compile(lambda t: t * 2 + 1, backend=backend)(x)
    torch._dynamo.reset()
    assert torch.equal(out, x * 2 + 1)
    assert "kernels not precompiled for this graph (RuntimeError: no pool today)" in caplog.text
    assert backend.times["precompile"] >= 0.0
