"""Pass N (fp8_linear) on the model's own ``FP8Linear``: the rewritten graph (expecttest snapshot), exact counts in
strict mode, outputs equal to the uncompiled module bit for bit, with and without fake quant, V4's 128 blocks, and
what it leaves. Refresh the snapshot with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_fp8_linear.py``."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

import minidi
from minidi.model.layers import FP8Linear, Linear
from minidi.model.quant import quantize_fp8
from minidi.ops.fp8_linear import fp8_linear

from .helpers import graph_text, run


def fp8_layer(preset: str, k: int, n: int, seed: int, **cfg) -> FP8Linear:
    layer = FP8Linear(k, n, minidi.preset(preset, **cfg))
    g = torch.Generator().manual_seed(seed)
    w, s = quantize_fp8(torch.randn(n, k, generator=g) * 0.05, layer.block)
    layer.weight.copy_(w)
    layer.scale.copy_(s.view(torch.uint8))
    return layer


class Reads(torch.nn.Module):
    """y = layer(x); ``also``: something else reads the dequantised weight or the fq8 input too."""

    def __init__(self, layer: torch.nn.Module, also: str = "") -> None:
        super().__init__()
        self.layer, self.also = layer, also

    def forward(self, x):
        y = self.layer(x)
        if self.also == "weight":
            return y, self.layer.dequant(x.dtype).sum()
        return y


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_fp8_linear_rewrite():
    layer = fp8_layer("tiny-v41", 64, 40, seed=1)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    out, mgr, _, after = run(Reads(layer), (x,), "N", n_sites=1, strict=True)
    assert mgr.counts == {"N": 1}
    assert_expected_inline(graph_text(after), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_modules_layer_parameters_scale_: "u8[2, 2]", L_self_modules_layer_parameters_weight_: "f8e4m3fn[40, 64]", L_x_: "bf16[6, 64]"):
        l_self_modules_layer_parameters_scale_ = L_self_modules_layer_parameters_scale_
        l_self_modules_layer_parameters_weight_ = L_self_modules_layer_parameters_weight_
        l_x_ = L_x_
        fp8_linear: "bf16[6, 40]" = minidi_ops_fp8_linear_fp8_linear(l_x_, l_self_modules_layer_parameters_weight_, l_self_modules_layer_parameters_scale_, 32, 32, backend = 'auto');  l_x_ = l_self_modules_layer_parameters_weight_ = l_self_modules_layer_parameters_scale_ = None
        return (fp8_linear,)
""")
    assert same_bits(out, layer(x))


@pytest.mark.parametrize("preset,fake_quant,act_block", [("tiny-v41", True, 32), ("tiny-v41", False, 0),
                                                          ("tiny-v4", True, 128)])
def test_fp8_linear_blocks_and_fake_quant(preset, fake_quant, act_block):
    """V4.1's 32 x 32 tiles and fq8 per 32, no fake quant (the input as it is: act_block 0), V4's 128 blocks; a
    3-D input and N, K that are not multiples of the tile."""
    k = 256 if act_block == 128 else 96
    layer = fp8_layer(preset, k, 70, seed=3, fake_quant=fake_quant)
    x = torch.randn(2, 5, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    out, mgr, _, after = run(Reads(layer), (x,), "N", n_sites=1, strict=True)
    calls = [n for n in after.graph.nodes if n.op == "call_function" and n.target is fp8_linear]
    assert len(calls) == 1 and calls[0].args[3:] == (layer.block, act_block)
    assert same_bits(out, layer(x))


def test_a_weight_read_elsewhere_stays_for_that_reader():
    layer = fp8_layer("tiny-v41", 64, 32, seed=5)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    (y, w_sum), mgr, _, after = run(Reads(layer, also="weight"), (x,), "N", n_sites=1, strict=True)
    assert mgr.counts == {"N": 1}
    ref_y, ref_sum = Reads(layer, also="weight")(x)
    assert same_bits(y, ref_y) and torch.equal(w_sum, ref_sum)


def test_plain_linears_are_left():
    layer = Linear(64, 16)
    layer.weight.copy_(torch.randn(16, 64, generator=torch.Generator().manual_seed(7)))
    x = torch.randn(3, 64).bfloat16()
    out, mgr, _, _ = run(Reads(layer), (x,), "N", None)
    assert mgr.counts == {"N": 0}
    assert same_bits(out, layer(x))


class GroupedOut(torch.nn.Module):
    """Attention's grouped output projection as the model writes it (``Attention.forward``: ``wo_a``); ``also``: the
    dequantised weight read elsewhere too; ``eq``: another contraction."""

    def __init__(self, layer: FP8Linear, groups: int, also: bool = False, eq: str = "tgi,goi->tgo") -> None:
        super().__init__()
        self.layer, self.groups, self.also, self.eq = layer, groups, also, eq

    def forward(self, o):
        w = self.layer.dequant(o.dtype)
        a = torch.einsum(self.eq, o, w.view(self.groups, -1, o.shape[-1])).flatten(1)
        return (a, w.sum()) if self.also else a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_wo_a_rewrite(dtype):
    """wo_a's einsum on the dequantised weight -> ``fp8_grouped_linear``: one node, the weight chain gone, the output
    as close to an fp64 reference as the uncompiled module's (the same dequantised values and one GEMM per group;
    the GEMM library may sum in another order for the strided output)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    layer = fp8_layer("tiny-v41", 64, 4 * 32, seed=seed)  # G 4 groups of 32 rows, I 64
    o = torch.randn(7, 4, 64, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out, mgr, _, after = run(GroupedOut(layer, 4), (o,), "N", n_sites=1, strict=True)
    assert mgr.counts == {"N": 1}
    text = graph_text(after)
    assert "fp8_grouped_linear" in text and "einsum" not in text and "lshift" not in text, text
    ref = torch.einsum("tgi,goi->tgo", o.double(), layer.dequant(o.dtype).double().view(4, 32, 64)).flatten(1)
    eager = GroupedOut(layer, 4)(o)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    err_eager = ((eager.double() - ref).abs().max() / ref.abs().max()).item()
    assert out.shape == eager.shape == (7, 128) and out.dtype == dtype
    assert err <= 2 * err_eager + 1e-12, (seed, err, err_eager)


@pytest.mark.parametrize("form", ["also", "eq"])
def test_grouped_wo_a_refusals(form):
    """The dequantised weight read elsewhere, or another contraction: N leaves the einsum as it is."""
    layer = fp8_layer("tiny-v41", 64, 4 * 32, seed=3)
    o = torch.randn(5, 4, 64).bfloat16()
    module = GroupedOut(layer, 4, also=form == "also", eq="tgi,goi->tgo" if form == "also" else "tgi,goi->gto")
    out, mgr, _, after = run(module, (o,), "N", n_sites=None)
    assert mgr.counts == {"N": 0}
    want = module(o)
    got = out if form == "eq" else out[0]
    assert torch.equal(got, want if form == "eq" else want[0])
