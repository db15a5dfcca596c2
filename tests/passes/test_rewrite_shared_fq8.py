"""Pass R (shared_fq8) on the model's own ``FP8Linear``: FP8 linears that read one input with one act_block get one
``fq8`` op and take its result with act_block -b (fq8 already). The rewritten graph (expecttest snapshot), exact
counts in strict mode, outputs equal to the uncompiled module and to pass N alone bit for bit; what must not be merged
(another input node, another act_block, an input written between the readers); the groups of the tiny models. Refresh
the snapshot with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_shared_fq8.py``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from expecttest import assert_expected_inline

import minidi
from minidi.model import stages
from minidi.model.context import ModelCache, StepMeta
from minidi.model.quant import fq8 as model_fq8
from minidi.ops.fp8_linear import fp8_linear
from minidi.ops.fq8 import fq8
from minidi.passes import PassMatchError, select
from minidi.passes.fx_utils import is_stage_marker
from minidi.runtime.compile import dynamic_shape_config, expected_sites

from .helpers import expected_fq8_groups, graph_text, shared_fq8_groups
from .test_rewrite_fp8_linear import fp8_layer, same_bits


def compile_nr(module: torch.nn.Module, passes: str = "N,R", n: int | None = None, r: int | None = None,
               op_backend: str = "auto"):
    """``module`` compiled (static shapes, aot_eager) with ``passes``; strict on N's and R's counts when given."""
    torch._dynamo.reset()
    expected = {k: [None] * c for k, c in (("N", n), ("R", r)) if c is not None and k in select(passes)}
    return minidi.compile(module, passes, backend="aot_eager", dynamic=False, keep_graphs=True,
                          strict=bool(expected), expected=expected or None, op_backend=op_backend)


def calls(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def x_of(k: int, seed: int, rows: int = 6) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


class Pair(torch.nn.Module):
    """Two linears on one x (attention's wq_a and wkv), a stage marker on x between them (as the indexer's marker on
    the query latent between attention's wq_b and the indexer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = fp8_layer("tiny-v41", 64, 40, seed=1), fp8_layer("tiny-v41", 64, 24, seed=2)

    def forward(self, x):
        a = self.a(x)
        stages.stage_mark(x, "indexer", True)
        b = self.b(x)
        stages.stage_mark(x, "indexer", False)
        return a, b


@pytest.mark.parametrize("op_backend", ["auto", "ref"])
def test_one_fq8_per_shared_input(op_backend):
    module, x = Pair(), x_of(64, 3)
    step = compile_nr(module, n=2, r=1, op_backend=op_backend)
    got = step(x)
    _, after = step.pass_manager.graphs[-1]
    assert step.pass_manager.counts == {"N": 2, "R": 1}
    if op_backend == "auto":
        assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_modules_a_parameters_scale_: "u8[2, 2]", L_self_modules_a_parameters_weight_: "f8e4m3fn[40, 64]", L_self_modules_b_parameters_scale_: "u8[1, 2]", L_self_modules_b_parameters_weight_: "f8e4m3fn[24, 64]", L_x_: "bf16[6, 64]"):
        l_self_modules_a_parameters_scale_ = L_self_modules_a_parameters_scale_
        l_self_modules_a_parameters_weight_ = L_self_modules_a_parameters_weight_
        l_self_modules_b_parameters_scale_ = L_self_modules_b_parameters_scale_
        l_self_modules_b_parameters_weight_ = L_self_modules_b_parameters_weight_
        l_x_ = L_x_
        fq8: "bf16[6, 64]" = minidi_ops_fq8_fq8(l_x_, 32, backend = 'auto')
        fp8_linear: "bf16[6, 40]" = minidi_ops_fp8_linear_fp8_linear(fq8, l_self_modules_a_parameters_weight_, l_self_modules_a_parameters_scale_, 32, -32, backend = 'auto');  l_self_modules_a_parameters_weight_ = l_self_modules_a_parameters_scale_ = None
        stage_mark_default = torch.ops.minidi.stage_mark.default(fq8, 'indexer', True);  stage_mark_default = None
        fp8_linear_1: "bf16[6, 24]" = minidi_ops_fp8_linear_fp8_linear(fq8, l_self_modules_b_parameters_weight_, l_self_modules_b_parameters_scale_, 32, -32, backend = 'auto');  fq8 = l_self_modules_b_parameters_weight_ = l_self_modules_b_parameters_scale_ = None
        stage_mark_default_1 = torch.ops.minidi.stage_mark.default(l_x_, 'indexer', False);  l_x_ = stage_mark_default_1 = None
        return (fp8_linear, fp8_linear_1)
""")
    (fq,) = calls(after, fq8)
    assert fq.args == (fq.args[0], 32) and fq.kwargs == {"backend": op_backend}
    assert [c.args[0] is fq and c.args[4] == -32 for c in calls(after, fp8_linear)] == [True, True]
    # the marker between the readers moved to the fq8 result (it orders b after it); the one after them stays on x
    enter, leave = [n for n in after.graph.nodes if is_stage_marker(n)]
    assert enter.args[0] is fq and leave.args[0] is fq.args[0]
    want = Pair.forward(module, x)
    alone = compile_nr(module, "N", n=2)(x)  # pass N alone: each linear runs its own fq8
    for g, w, a in zip(got, want, alone):
        assert same_bits(g, w) and same_bits(g, a)


class Apart(torch.nn.Module):
    """Reads that must keep their own fq8: c on x * 3 (another input node), d on x in V4's blocks of 128 (another
    act_block); a and b on x share one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = fp8_layer("tiny-v41", 128, 40, seed=1), fp8_layer("tiny-v41", 128, 24, seed=2)
        self.c, self.d = fp8_layer("tiny-v41", 128, 16, seed=3), fp8_layer("tiny-v4", 128, 20, seed=4)

    def forward(self, x):
        return self.a(x), self.c(x * 3), self.d(x), self.b(x)


def test_other_inputs_and_blocks_are_not_merged():
    module = Apart()
    x = (x_of(128, 5).float() * torch.exp2(3.0 * (torch.arange(128) // 32))).bfloat16()  # blocks of 32 apart in scale
    step = compile_nr(module, n=4, r=1)
    got = step(x)
    _, after = step.pass_manager.graphs[-1]
    (fq,) = calls(after, fq8)
    assert fq.args[1] == 32
    blocks = {c.meta["nn_module_stack"][next(reversed(c.meta["nn_module_stack"]))][0].split(".")[-1]:
              (c.args[0] is fq, c.args[4]) for c in calls(after, fp8_linear)}
    assert blocks == {"a": (True, -32), "b": (True, -32), "c": (False, 32), "d": (False, 128)}, blocks
    want = Apart.forward(module, x)
    assert all(same_bits(g, w) for g, w in zip(got, want))
    # the check can tell: merging c or d into x's fq8 would give other bits
    c, d = module.c, module.d
    assert not same_bits(F.linear(3 * model_fq8(x, 32), c.dequant(x.dtype)), want[1])
    assert not same_bits(F.linear(model_fq8(x, 32), d.dequant(x.dtype)), want[2])


class Written(torch.nn.Module):
    """x written in place between its two readers: b must read the new values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = fp8_layer("tiny-v41", 64, 40, seed=1), fp8_layer("tiny-v41", 64, 24, seed=2)

    def forward(self, x):
        a = self.a(x)
        x.mul_(3.0)
        return a, self.b(x)


def test_an_input_written_between_its_readers_is_not_shared():
    module, x = Written(), x_of(64, 7)
    step = compile_nr(module, n=2, r=0)
    got = step(x.clone())
    _, after = step.pass_manager.graphs[-1]
    assert calls(after, fq8) == [] and [c.args[4] for c in calls(after, fp8_linear)] == [32, 32]
    want = Written.forward(module, x.clone())
    assert all(same_bits(g, w) for g, w in zip(got, want))
    stale = F.linear(model_fq8(x, 32), module.b.dequant(x.dtype))  # what b would read from a shared fq8
    assert not same_bits(stale, want[1])


def test_strict_fails_loudly_on_a_count_mismatch():
    compiled = compile_nr(Apart(), n=4, r=2)  # one group only: a and b
    with pytest.raises(Exception, match=r"pass R \(shared_fq8\): expected 2 site\(s\), matched 1") as info:
        compiled(x_of(128, 5))
    assert isinstance(info.value, PassMatchError) or "PassMatchError" in repr(info.value) + str(info.value)


def test_r_needs_n():
    with pytest.raises(ValueError, match=r"pass R \(shared_fq8\) rewrites the ops of passes N \(fp8_linear\)"):
        select("R")
    assert select("all")[-6:] == ["N", "R", "O", "P", "Q", "V"] and select("N,R") == ["N", "R"]


# ---- the tiny models, traced (no run), served settings (bf16, fake quant on) ----------------------------------------
class _Traced(Exception):
    pass


GROUPS: list[tuple[int, tuple[str, ...]]] = []
MARKERS_ON_FQ8: list[str] = []  # the stage markers that read an fq8 result


def _trace_only(gm, example_inputs):
    GROUPS[:] = shared_fq8_groups(gm.graph)
    MARKERS_ON_FQ8[:] = [n.args[1] for n in gm.graph.nodes if is_stage_marker(n) and n.args[0].target is fq8]

    def run(*args):
        raise _Traced

    return run


# tiny V4.1 with every pass (fake quant on) is checked where its graph is traced anyway: test_models.py
# (test_production_settings_counts_traced)
@pytest.mark.parametrize("markers", [False, True])
def test_tiny_v4_groups_traced(markers):
    """Per layer: the attention input (wq_a, wkv), the shared expert's input (w1, w3), and in the two ratio-4
    (index-source) layers the query latent (attention's and the indexer's wq_b); with the stage markers on (the
    benchmark's setting: the indexer's marker on the latent lies between its two readers, and moves to the fq8
    result) too."""
    model = minidi.load_model("tiny-v4")
    cfg = model.cfg
    assert cfg.fake_quant and cfg.act_block == 128
    torch._dynamo.reset()
    meta = StepMeta.for_sequence(torch.arange(24) % cfg.vocab_size, cfg.window_size, model.ratios, cfg.step_ngram)
    want = expected_sites(cfg)
    was = stages.enabled(markers)
    try:
        step = minidi.compile(model, "N,R", backend=_trace_only, strict=True, expected={k: want[k] for k in "NR"})
        with dynamic_shape_config(), torch._dynamo.config.patch(specialize_float=True), pytest.raises(_Traced):
            step(meta, ModelCache())
    finally:
        stages.enabled(was)
    assert step.pass_manager.counts == {"N": 34, "R": 10}
    assert Counter(step.pass_manager.sites["R"]) == {0: 2, 1: 3, 2: 2, 3: 3} == Counter(want["R"])
    assert GROUPS == expected_fq8_groups(cfg)
    # the indexer's marker on the query latent, between attention's wq_b and the indexer's, moved to the fq8 result
    assert MARKERS_ON_FQ8 == (["indexer"] * len(want["B"]) if markers else [])


@pytest.mark.slow  # two compiled tiny V4.1 steps under the interpreter (~85 s each on 2 cores)
def test_tiny_v41_logits_equal_pass_n_alone_bit_for_bit():
    """The whole model (bf16, fake quant on): logits with N and R equal those with N alone, bit for bit. Covered in
    the default suite by the op test ``tests/ops/test_fq8.py::test_fp8_linear_on_the_shared_fq8_is_fp8_linear``, the
    graph tests above and the traced groups (``test_models.py::test_production_settings_counts_traced``)."""
    model = minidi.load_model("tiny-v41")
    ids = torch.randint(0, model.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    meta = StepMeta.for_sequence(ids, model.cfg.window_size, model.ratios, model.cfg.step_ngram)
    logits = {}
    for passes in ("N", "N,R"):
        torch._dynamo.reset()
        step = minidi.compile(model, passes, strict=True, backend="aot_eager")
        with torch.no_grad(), dynamic_shape_config():
            logits[passes] = step(meta, ModelCache())
        step.uncompile()
    assert step.pass_manager.counts == {"N": 86, "R": 24}
    assert torch.equal(logits["N"].view(torch.int32), logits["N,R"].view(torch.int32))
