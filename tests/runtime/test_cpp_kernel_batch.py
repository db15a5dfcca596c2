"""``minidi.runtime.cpp_kernel_batch``: a CPU graph's C++ kernels compiled as a few units, not one g++ run each.

The source surgery (a kernel into a namespace, the bindings from Inductor's template), then a real compile: the same
results bit for bit as Inductor's per-kernel path, fewer compiler runs, the fallback per kernel when a unit fails,
the units another process built found through the index and loaded without a compiler run, and the switch
(``MINIDI_CPP_KERNEL_BATCH=0``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch._inductor import cpp_builder
from torch._inductor.codecache import CppPythonBindingsCodeCache

from minidi.runtime import cpp_kernel_batch as cb

KERNEL = '''#include <torch/csrc/inductor/cpp_prefix.h>
static float twice(float v) { return 2.0f * v; }
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)
{
    #pragma omp parallel
    for (int i = 0; i < 4; i++) out_ptr0[i] = twice(in_ptr0[i]);
}
'''


def test_split_kernel_namespaces_the_entry_and_hoists_includes():
    includes, body = cb.split_kernel(KERNEL)
    assert includes == ["#include <torch/csrc/inductor/cpp_prefix.h>"]
    assert "#include" not in body and 'extern "C"' not in body and "void kernel(" in body
    assert "#pragma omp parallel" in body  # pragmas stay where they are
    assert cb.split_kernel("#define N 4\n" + KERNEL) is None  # a macro would leak out of its namespace
    assert cb.split_kernel(KERNEL.replace("kernel(", "kern(")) is None  # no entry
    assert cb.split_kernel(KERNEL + KERNEL.split("\n", 1)[1]) is None  # two entries


def test_binding_source_has_one_module_and_a_function_per_kernel():
    src = cb.binding_source(CppPythonBindingsCodeCache.suffix_template, CppPythonBindingsCodeCache.call_entry_function,
                            [["const float*", "float*"], ["const float*", "float*", "const int64_t"]])
    assert src.count("PyInit_kernel(") == 1 and src.count("static PyMethodDef py_methods[]") == 1
    assert '"kernel_0", kernel_0_py' in src and '"kernel_1", kernel_1_py' in src
    assert "minidi_k0::kernel(" in src and "minidi_k1::kernel(" in src
    with pytest.raises(ValueError):
        cb.binding_source("no template here {arg_len}", "kernel({}); Py_RETURN_NONE;", [["float*"]])


def test_two_kernels_with_the_same_helper_in_one_unit(tmp_path, monkeypatch):
    """Two sources that both define ``twice`` (and ``kernel``) build as one library and each computes its own."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    k1 = cb.split_kernel(KERNEL)
    k2 = cb.split_kernel(KERNEL.replace("2.0f * v", "3.0f * v"))
    binding = cb.binding_source(CppPythonBindingsCodeCache.suffix_template,
                                CppPythonBindingsCodeCache.call_entry_function, [["const float*", "float*"]] * 2)
    module = CppPythonBindingsCodeCache.load_async(cb.unit_source([k1, k2], binding), "cpu")()
    x = torch.arange(4, dtype=torch.float32)
    y1, y2 = torch.empty(4), torch.empty(4)
    module.kernel_0(x, y1)
    module.kernel_1(x, y2)
    assert torch.equal(y1, 2 * x) and torch.equal(y2, 3 * x)


def _several_kernels(x: torch.Tensor, y: torch.Tensor):
    a = torch.sin(x) * y + 1
    b = a.sum(-1, keepdim=True)
    c = torch.relu(a - b) @ y.t()
    return c.exp().cumsum(0), (x.to(torch.bfloat16) * 3).float().amax(0), torch.where(x > 0, x.exp2(), y.log1p())


def _compiled(batch: bool, cache_dir, fn=_several_kernels, fresh: bool = True):
    """fn compiled fresh (no FX graph cache; ``fresh``: empty C++ code caches, so its kernels are built now), run
    once; its outputs and the compiler runs that took."""
    torch._dynamo.reset()
    if fresh:
        CppPythonBindingsCodeCache.cache_clear()
        cb.cache_clear()
    runs = []
    original = cpp_builder._run_compile_cmd

    def counted(cmd, cwd):
        runs.append(cmd)
        original(cmd, cwd)

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 40, generator=gen), torch.rand(48, 40, generator=gen)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
        mp.setattr(cpp_builder, "_run_compile_cmd", counted)
        with inductor_config.patch(fx_graph_cache=False), (cb.batching() if batch else contextlib.nullcontext()):
            out = torch.compile(fn)(x, y)
    torch._dynamo.reset()
    return out, runs


@pytest.fixture
def warm(tmp_path, monkeypatch):
    """One compile first, so that the process' one-time compiler runs (ISA probes, the precompiled header) are done
    before the counted ones; one compile thread (one unit)."""
    monkeypatch.setattr("torch._inductor.async_compile.get_compile_threads", lambda: 1)
    _compiled(False, tmp_path / "warm-up", lambda x, y: (x.sin() * y,))
    return tmp_path


def test_batched_compile_gives_the_same_bits_in_fewer_runs(warm):
    before = dict(cb.STATS)
    out_b, runs_b = _compiled(True, warm / "batched")
    assert cb.STATS["units"] == before["units"] + 1 and cb.STATS["fallback_kernels"] == before["fallback_kernels"]
    kernels = cb.STATS["kernels"] - before["kernels"]
    assert kernels >= 3
    out_s, runs_s = _compiled(False, warm / "stock")
    assert all(torch.equal(a, b) for a, b in zip(out_b, out_s))
    assert (len(runs_b), len(runs_s)) == (1, kernels)  # one compiler run instead of one per kernel


def test_a_kernel_built_for_an_earlier_graph_is_not_built_again(warm):
    out_1, runs_1 = _compiled(True, warm / "first")
    before = dict(cb.STATS)
    out_2, runs_2 = _compiled(True, warm / "second", fresh=False)  # the same kernels in a new graph
    assert len(runs_1) == 1 and runs_2 == [] and cb.STATS == before
    assert all(torch.equal(a, b) for a, b in zip(out_1, out_2))


def test_kernels_another_process_built_are_loaded_not_built_again(warm, monkeypatch):
    """A process that groups the same kernels otherwise (two compile threads here: two units) finds each of them in the
    unit an earlier process built (the index in Inductor's cache folder) and runs no compiler."""
    out_1, runs_1 = _compiled(True, warm / "shared")
    assert len(runs_1) == 1
    assert len(list((warm / "shared" / cb.INDEX_DIR).glob("*.cpp"))) == 1
    monkeypatch.setattr("torch._inductor.async_compile.get_compile_threads", lambda: 2)
    before = dict(cb.STATS)
    out_2, runs_2 = _compiled(True, warm / "shared")  # this process' caches emptied, the folder kept
    assert runs_2 == [] and cb.STATS["units"] == before["units"]
    assert cb.STATS["found_kernels"] - before["found_kernels"] >= 3
    assert all(torch.equal(a, b) for a, b in zip(out_1, out_2))


def test_a_damaged_index_is_ignored_and_rewritten(warm):
    out_1, _ = _compiled(True, warm / "damaged")
    for f in (warm / "damaged" / cb.INDEX_DIR).glob("*.cpp"):
        f.write_text(f.read_text().replace("kernel", "kernal", 1))
    before = dict(cb.STATS)
    out_2, _ = _compiled(True, warm / "damaged")  # grouped again (Inductor's cache still has the library)
    assert cb.STATS["found_kernels"] == before["found_kernels"] and cb.STATS["units"] == before["units"] + 1
    out_3, runs_3 = _compiled(True, warm / "damaged")
    assert runs_3 == [] and cb.STATS["found_kernels"] > before["found_kernels"]  # the index holds again
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(out_1, out_2, out_3))


def test_an_index_folder_that_cannot_be_written_costs_only_the_reuse(warm, monkeypatch):
    (warm / "a-file").write_text("")
    monkeypatch.setattr(cb, "_index_dir", lambda: str(warm / "a-file" / cb.INDEX_DIR))
    out_1, runs_1 = _compiled(True, warm / "unwritable")
    out_2, runs_2 = _compiled(False, warm / "stock")
    assert len(runs_1) == 1 and all(torch.equal(a, b) for a, b in zip(out_1, out_2))


def test_a_unit_that_fails_falls_back_to_one_compile_per_kernel(warm, monkeypatch):
    def broken(*args):
        raise ValueError("binding template changed")

    monkeypatch.setattr(cb, "binding_source", broken)
    before = dict(cb.STATS)
    out_b, runs_b = _compiled(True, warm / "batched")
    fell_back = cb.STATS["fallback_kernels"] - before["fallback_kernels"]
    assert cb.STATS["units"] == before["units"] and fell_back >= 3 and len(runs_b) == fell_back
    out_s, _ = _compiled(False, warm / "stock")
    assert all(torch.equal(a, b) for a, b in zip(out_b, out_s))


def test_switched_off_by_the_environment(warm, monkeypatch):
    monkeypatch.setenv(cb.ENV, "0")
    before = dict(cb.STATS)
    _, runs = _compiled(True, warm / "off")
    assert cb.STATS == before and len(runs) >= 3  # nothing collected: Inductor's own path, a run per kernel


def test_codegen_config_batches_cpu_graphs_only():
    from minidi.runtime.compile_settings import codegen_config

    def active():
        return getattr(cb._STATE, "active", 0)

    with codegen_config([torch.zeros(2)], autotune=False, cpu_simd=False):
        assert active() == 1
    assert active() == 0
    with codegen_config([torch.zeros(2, device="meta")], autotune=False, cpu_simd=False):
        assert active() == 0
