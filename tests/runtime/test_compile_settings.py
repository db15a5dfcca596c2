"""``minidi.compile``'s settings (``minidi/runtime/compile.py``): Dynamo's shape settings and recompile limits hold
while a compiled step traces and are back to what they were after every call and after ``uncompile()``; faithful
rounding is in effect where the inner backend compiles (and Inductor then rounds like eager); progress lines.

A toy "transformer" (``.layers``, ``.step``, ``layer_hook``, ``Block.kind()``) keeps these tests to seconds.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config

import minidi
from minidi.runtime import exact_cpu
from minidi.runtime.compile import CompiledStep, RegionalStep, layer_kind


class ToyBlock(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 8, requires_grad=False)

    def kind(self) -> tuple:
        return ("toy", self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) * self.scale + x


class ToyModel(torch.nn.Module):
    def __init__(self, scales=(1.0, 2.0, 1.0, 2.0, 1.0)) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(ToyBlock(s) for s in scales)
        self.layer_hook = None

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.layer_hook is not None:
                self.layer_hook(i)
            x = layer(x)
        return x


def _settings() -> dict:
    c = torch._dynamo.config
    return dict(recompile_limit=c.recompile_limit, accumulated_recompile_limit=c.accumulated_recompile_limit,
                specialize_float=c.specialize_float, backed_size_oblivious=fx_config.backed_size_oblivious,
                use_duck_shape=fx_config.use_duck_shape, emulate=inductor_config.emulate_precision_casts,
                aten_kernels=inductor_config.post_grad_custom_post_pass is exact_cpu.KEY_PASS)


class Recorder:
    """An inner backend that records the settings in effect when it is called (where Inductor would lower)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def __call__(self, gm, example_inputs):
        self.seen.append(_settings())
        return gm.forward


def test_regional_settings_in_effect_at_trace_time_and_restored():
    torch._dynamo.reset()
    before = _settings()
    model, rec = ToyModel(), Recorder()
    x = torch.randn(6, 8)
    want = model.step(x)
    step = minidi.compile(model, "none", regional=True, backend=rec)
    assert isinstance(step, RegionalStep) and model.layer_hook is not None
    assert _settings() == before  # compiling sets nothing
    torch.testing.assert_close(step(x), want)
    assert len(rec.seen) == 2  # one graph per layer kind
    for seen in rec.seen:  # Dynamo read these while it traced (the first call)
        assert seen["recompile_limit"] >= 4 * len(model.layers)
        assert seen["specialize_float"] and seen["backed_size_oblivious"] and not seen["use_duck_shape"]
        assert seen["emulate"] is True  # faithful rounding, the default
    assert _settings() == before  # and after the call they are back
    step.uncompile()
    assert model.layer_hook is None and all(b._compiled_call_impl is None for b in model.layers)
    assert _settings() == before
    torch.testing.assert_close(model.step(x), want)


def test_uncompile_given_the_model():
    torch._dynamo.reset()
    model = ToyModel()
    minidi.compile(model, "none", regional=True, backend=Recorder())
    with pytest.raises(RuntimeError, match="layer_hook"):  # compiling twice without uncompiling
        minidi.compile(model, "none", regional=True, backend=Recorder())
    minidi.uncompile(model)
    assert model.layer_hook is None and all(b._compiled_call_impl is None for b in model.layers)
    minidi.compile(model, "none", regional=True, backend=Recorder())  # compilable again


def test_layer_kind_is_the_blocks_own():
    model = ToyModel()
    assert [layer_kind(b) for b in model.layers][:2] == [("toy", 1.0), ("toy", 2.0)]


@pytest.mark.parametrize("faithful", [True, False, "exact"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_faithful_rounding_set_while_the_inner_backend_compiles(faithful, device):
    """Emulated casts for True and "exact"; ATen's kernels on a CPU graph for True, on any graph for "exact" (a meta
    graph stands in for a GPU one: not all-CPU)."""
    torch._dynamo.reset()
    before = _settings()
    rec = Recorder()
    step = minidi.compile(lambda x: (x * 3.3).sigmoid() * 1.7, "none", backend=rec, faithful_rounding=faithful)
    assert isinstance(step, CompiledStep)
    step(torch.randn(16, device=device))
    assert [s["emulate"] for s in rec.seen] == [bool(faithful)]
    want_aten = faithful == "exact" or (faithful is True and device == "cpu")
    assert [s["aten_kernels"] for s in rec.seen] == [want_aten]
    assert _settings() == before


def test_faithful_rounding_refuses_other_values():
    with pytest.raises(ValueError, match="faithful_rounding must be True, False or 'exact', got 'yes'"):
        minidi.compile(lambda x: x + 1, "none", backend=Recorder(), faithful_rounding="yes")


def test_inductor_rounds_like_eager_with_faithful_rounding():
    """A bf16 chain Inductor fuses, with the reductions and transcendentals the model uses: eager rounds each op's
    output to bf16 and runs ATen's kernels; stock Inductor keeps the intermediates in fp32 and uses its own exp /
    sigmoid / sums (measured: 1,423 of 4,096 outputs of the chain differ from eager, 3,930 of its softmax). Faithful
    rounding on a CPU graph rounds where eager does and calls ATen's kernels (``minidi/runtime/exact_cpu.py``):
    every output bit-equal."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def f(x):
        y = ((x * 3.3).sigmoid() * 1.7 - x).exp()
        rows = y.view(64, 64).float()
        return (y, torch.softmax(rows, -1), rows * rows.pow(2).mean(-1, keepdim=True).rsqrt(),
                torch.nn.functional.silu(x), torch.nn.functional.softplus(rows), rows.sum(0))

    want = f(x)
    off = {}
    for faithful in (True, False):
        torch._dynamo.reset()
        out = minidi.compile(f, "none", backend="inductor", dynamic=False, faithful_rounding=faithful)(x)
        off[faithful] = [int((a != b).sum()) for a, b in zip(out, want)]
    assert off[True] == [0] * 6, off
    assert off[False][0] > 1000, off  # a compile that lost the rounding points is seen


def test_scalar_cpu_code_whatever_isa_list_the_process_cached_first():
    """Inductor caches its list of valid vector ISAs per process at the first call. Scalar mode must make both the
    code generator and the C++ flags scalar even where that list was filled with SIMD allowed (a stock compile
    first): under the former ``vec_isa_ok=False`` such a process wrote vector code into the FX graph cache under the
    scalar key, and a process that started scalar failed to compile it ("'at::vec' has not been declared")."""
    from torch._inductor import cpu_vec_isa

    from minidi.runtime.compile_settings import codegen_config

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    simd = cpu_vec_isa.pick_vec_isa()  # the list filled under the default settings, as a stock compile fills it
    cpu = [torch.randn(4)]
    with codegen_config(cpu, autotune=False, cpu_simd=False):
        assert not cpu_vec_isa.pick_vec_isa()
    with codegen_config(cpu, autotune=False, cpu_simd=True):
        assert cpu_vec_isa.pick_vec_isa() == simd
    with codegen_config([torch.randn(4, device="meta")], autotune=False, cpu_simd=False):
        assert cpu_vec_isa.pick_vec_isa() == simd  # not an all-CPU graph: nothing patched


def test_progress_lines(caplog):
    torch._dynamo.reset()
    seen: list[str] = []
    with caplog.at_level(logging.INFO, logger="minidi"):
        step = minidi.compile(ToyModel(), "none", regional=True, backend=Recorder(), progress=seen.append)
        step(torch.randn(6, 8))
        step(torch.randn(6, 8))  # no compile: no lines
    logged = [r.getMessage() for r in caplog.records if r.name == "minidi.compile"]
    assert logged == seen and len(seen) == 4, seen
    assert seen[0].startswith("minidi.compile: compiling 5 layers (2 kinds)")
    assert "layer kind 1/2 (('toy', 1.0))" in seen[1] and "serves layers [0, 2, 4]" in seen[1] and " s (" in seen[1]
    assert "layer kind 2/2 (('toy', 2.0))" in seen[2] and "serves layers [1, 3]" in seen[2]
    assert seen[3].startswith("minidi.compile: compiled 2 graph(s) for 2 layer kinds in ")
    torch._dynamo.reset()
    whole: list[str] = []
    step = minidi.compile(ToyModel(), "none", backend=Recorder(), progress=whole.append)
    step.pass_manager  # noqa: B018 (the attribute callers read)
    step(torch.randn(6, 8))
    assert len(whole) == 2 and "compiling" in whole[0] and "compiled" in whole[1] and " s (1 graph(s)" in whole[1]
