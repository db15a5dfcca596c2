"""``minidi/runtime/exact_cpu.py``: while ``aten_kernels()`` is open Inductor calls ATen's kernels for the reductions
and transcendentals, and keys its caches by that; on exit Inductor's tables are as they were. (That a faithful
compiled CPU step equals eager bitwise: ``test_compile_settings.py`` on a chain, ``test_compile.py`` on the tiny
models.)"""

from __future__ import annotations

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor import decomposition, lowering

from minidi.runtime import exact_cpu

aten = torch.ops.aten


def _tables():
    ops = exact_cpu._overloads()
    return ({o: lowering.lowerings.get(o) for o in ops}, {o: decomposition.decompositions.get(o) for o in ops},
            {o for o in ops if o in lowering.fallbacks}, inductor_config.post_grad_custom_post_pass)


def test_tables_are_restored_and_the_setting_keys_the_cache():
    before = _tables()
    assert aten._softmax.default in before[1] and before[0][aten.mean.dim] is not None  # Inductor's own, today
    with exact_cpu.aten_kernels():
        assert inductor_config.post_grad_custom_post_pass is exact_cpu.KEY_PASS
        assert aten._softmax.default not in decomposition.select_decomp_table()  # the cached copy too
        assert aten.mean.dim in lowering.fallbacks and aten.exp.default in lowering.fallbacks
    after = _tables()
    assert after == before
    assert aten._softmax.default in decomposition.select_decomp_table()


def _compile_counts(fn, x, inside: bool) -> dict:
    torch._dynamo.reset()
    counters.clear()
    ctx = exact_cpu.aten_kernels() if inside else inductor_config.patch({})
    with ctx:
        out = torch.compile(fn, backend="inductor", dynamic=False)(x)
    c = counters["inductor"]
    return {"out": out, "hit": c["fxgraph_cache_hit"], "miss": c["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}


def test_a_graph_compiled_with_aten_kernels_is_not_served_without(tmp_path, monkeypatch):
    """Same graph, same Inductor config otherwise: the artifact of one setting never serves the other."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))

    def fn(x):
        return torch.softmax(x * 2.0, -1).exp()

    with inductor_config.patch(fx_graph_cache=True):
        inside = _compile_counts(fn, x, inside=True)
        outside = _compile_counts(fn, x, inside=False)
        again = _compile_counts(fn, x, inside=True)
    assert inside["miss"] == 1 and inside["hit"] == 0, inside
    assert outside["hit"] == 0 and outside["aot_hit"] == 0, outside  # not the artifact compiled inside
    assert again["hit"] + again["aot_hit"] >= 1, again  # the setting's own artifact is reused
    assert torch.equal(inside["out"], fn(x)) and torch.equal(again["out"], fn(x))


def test_all_cpu():
    assert exact_cpu.all_cpu([torch.zeros(1), 3, None])
    assert exact_cpu.all_cpu([])
    meta = torch.empty(1, device="meta")
    assert not exact_cpu.all_cpu([torch.zeros(1), meta])
