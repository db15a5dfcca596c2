"""Pass V (V4's Hadamard rotations -> ``minidi.ops.hadamard.hadamard_rotate``): the rewritten graph (expecttest
snapshot, the traced matrix gone), exact counts, numerics against the exact rotation (fp64), strict mode, the
look-alikes refused (another constant matrix, a parameter, an fp32 x, a product kept in fp32), the fq4 that follows
the rotation taken into the same call (snapshot, bit-equal result; an fq4 with other constants or a rotation read
elsewhere left out), and the real sites in tiny V4 with the served settings (bf16, fake quant on: the indexer's q and
k in each index-source layer, each with its fq4, traced only). Refresh the snapshots with ``EXPECTTEST_ACCEPT=1 pytest
tests/passes/test_rewrite_hadamard.py``."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from expecttest import assert_expected_inline

import minidi
from minidi.formats import E2M1_MAX, fq4_ue8m0, hadamard, hadamard_matrix, pow2_ceil, round_e2m1
from minidi.model.context import ModelCache, StepMeta
from minidi.runtime.compile import dynamic_shape_config, expected_sites

from .helpers import Fn, graph_text, run


def rotated_pair(q, k):
    """The indexer's two rotations as ``minidi.model.indexer.IndexerV4._quant`` applies them (the fq4 left out)."""
    return hadamard(q), hadamard(k)


def operands(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 4, 64, generator=g).to(dtype), torch.randn(3, 64, generator=g).to(dtype)


def test_both_taken_numerics_within_one_rounding():
    args = operands(seed=int(torch.randint(0, 2**31 - 1, ())))
    out, mgr, _, after = run(Fn(rotated_pair), args, "V", 2, strict=True)
    assert mgr.counts == {"V": 2}
    h = hadamard_matrix(64).double()
    for got, x in zip(out, args):
        exact = x.double() @ h
        bound = 2.0**-8 * exact.abs() + 2.0**-20 * (x.double().abs() @ h.abs())
        assert got.dtype == x.dtype and ((got.double() - exact).abs() <= bound).all()
    text = graph_text(after)
    assert "cat" not in text and "ones" not in text and "matmul" not in text  # the traced matrix is gone


def test_snapshot():
    _, _, _, after = run(Fn(lambda x: hadamard(x)), (operands()[1],), "V", 1, strict=True)
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "bf16[3, 64]"):
        l_args_0_ = L_args_0_
        hadamard_rotate: "bf16[3, 64]" = minidi_ops_hadamard_hadamard_rotate(l_args_0_, backend = 'auto');  l_args_0_ = None
        return (hadamard_rotate,)
""")


def test_fq4_taken_into_the_call_snapshot():
    x = operands()[0]
    out, mgr, _, after = run(Fn(lambda x: fq4_ue8m0(hadamard(x), 32)), (x,), "V", 1, strict=True)
    assert mgr.counts == {"V": 1}
    assert torch.equal(out.view(torch.int16), fq4_ue8m0(hadamard(x), 32).view(torch.int16))  # the reference here
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_args_0_: "bf16[5, 4, 64]"):
        l_args_0_ = L_args_0_
        hadamard_rotate: "bf16[5, 4, 64]" = minidi_ops_hadamard_hadamard_rotate(l_args_0_, fq4_block = 32, backend = 'auto');  l_args_0_ = None
        return (hadamard_rotate,)
""")


def _fq4_other_floor(x, block=32):
    """fq4_ue8m0 with fq8's amax floor (1e-4): another quantiser."""
    g = x.float().unflatten(-1, (x.shape[-1] // block, block))
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / E2M1_MAX)
    return (round_e2m1((g / s).clamp(-E2M1_MAX, E2M1_MAX)) * s).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("fn,fused", [
    (lambda x: _fq4_other_floor(hadamard(x)), 0),  # other constants: the rotation alone
    (lambda x: (fq4_ue8m0(y := hadamard(x), 32), y * 2), 0),  # the rotation read elsewhere too: alone
    (lambda x: fq4_ue8m0(hadamard(x), 32).float(), 1),  # taken: a cast of the fq4's result stays outside the call
])
def test_fq4_taken_only_as_the_rotations_one_reader(fn, fused):
    x = operands()[0]
    out, mgr, _, after = run(Fn(fn), (x,), "V", 1, strict=True)
    text = graph_text(after)
    assert mgr.counts == {"V": 1} and "matmul" not in text
    assert text.count("fq4_block = 32") == fused and ("round" in text) == (not fused)


def _other_constant(x):
    h = torch.ones(1, 1, device=x.device)
    while h.shape[0] < x.shape[-1]:  # a Sylvester matrix with the signs of its second half flipped
        h = torch.cat([torch.cat([h, h], 1), torch.cat([-h, h], 1)], 0)
    return (x.float() @ (h / 8.0)).to(x.dtype)


@pytest.mark.parametrize("fn,args", [
    (_other_constant, operands()[1:]),  # another constant matrix
    (lambda x, w: (x.float() @ w).to(x.dtype), (operands()[1], hadamard_matrix(64))),  # the matrix as an input
    (lambda x: hadamard(x), (operands(dtype=torch.float32)[1],)),  # fp32 x
    (lambda x: x.float() @ hadamard_matrix(64, x.device), operands()[1:]),  # the product kept in fp32
])
def test_lookalikes_not_taken(fn, args):
    _, mgr, before, after = run(Fn(fn), args, "V")
    assert mgr.counts == {"V": 0} and graph_text(before) == graph_text(after)


def test_strict_mode_fails_loudly_on_a_missing_site():
    with pytest.raises(Exception, match=r"pass V \(hadamard\): expected 2 site\(s\), matched 1"):
        run(Fn(lambda x: (hadamard(x), _other_constant(x))), operands()[1:], "V", 2, strict=True)


class _Traced(Exception):
    pass


def _trace_only(gm, example_inputs):
    def run_(*args):
        raise _Traced

    return run_


def test_tiny_v4_served_settings_sites_traced():
    """bf16, fake quant on: two rotations (q, k) per index-source layer, the expected sites' layers; none with fake
    quant off (``test_models.py``) or in V4.1 (``expected_sites``)."""
    model = minidi.load_model("tiny-v4")
    cfg = model.cfg
    assert cfg.fake_quant and cfg.torch_dtype == torch.bfloat16
    want = expected_sites(cfg)["V"]
    assert len(want) == 2 * sum(cfg.is_index_source(i) for i in range(cfg.n_layers)) > 0
    assert not expected_sites(minidi.load_model("tiny-v41").cfg)["V"]
    torch._dynamo.reset()
    ids = torch.arange(24) % cfg.vocab_size
    meta = StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.step_ngram)
    step = minidi.compile(model, "V", backend=_trace_only, strict=True, expected={"V": want}, keep_graphs=True)
    with dynamic_shape_config(), torch._dynamo.config.patch(specialize_float=True), pytest.raises(_Traced):
        step(meta, ModelCache())
    assert step.pass_manager.counts == {"V": len(want)}
    assert sorted(step.pass_manager.sites["V"]) == sorted(want)
    after = graph_text(step.pass_manager.graphs[-1][1])
    assert after.count("fq4_block = 32") == len(want) and "torch.round" not in after  # every site's fq4 taken
