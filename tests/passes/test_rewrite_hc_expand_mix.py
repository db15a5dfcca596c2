"""Pass U (hc_expand_mix) on small models holding a V4.1 layer's mHC chain: the attention site's update (G) and the
MoE site's mixer reads of its result (J) become one op, with the outputs of G + J bit for bit; the rewritten graph
(expecttest snapshot); look-alikes refused (pre computed after the update, a mutation between, two layers).
Refresh the snapshot with ``EXPECTTEST_ACCEPT=1 pytest tests/passes/test_rewrite_hc_expand_mix.py``.
"""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from minidi.model.hyper_connections import hc_collapse, hc_expand, hc_mixer

from .helpers import call_targets, graph_text, run

FUSED = "minidi.ops.hc_expand_mix.hc_expand_mix"


class Chain(torch.nn.Module):
    """The V4.1 layer's mHC chain around its sublayers (``Block.core``): x -> attention mixer; update with h;
    MoE mixer of the update and the collapse of the update with the attention site's pre."""

    def forward(self, x, h, pre, fn_a, fn_f, base, scale):
        pre_a, post, comb = hc_mixer(x, fn_a, base, scale, 3, 1e-6, 1e-6)
        u_a = hc_collapse(x, pre)
        x2 = hc_expand(x, h + u_a, post, comb)
        pre_f, post_f, comb_f = hc_mixer(x2, fn_f, base, scale, 3, 1e-6, 1e-6)
        return x2, pre_f, post_f, comb_f, hc_collapse(x2, pre_a)


class Layers(torch.nn.Module):
    """``layers.0``, ``layers.1``: U's sites are per layer (Dynamo's module stack names the layer)."""

    def __init__(self, n: int = 1, block=Chain) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([block() for _ in range(n)])

    def forward(self, x, h, pre, fn_a, fn_f, base, scale):
        outs = []
        for layer in self.layers:
            out = layer(x, h, pre, fn_a, fn_f, base, scale)
            x, pre = out[0], out[1]
            outs.append(out)
        return tuple(o for out in outs for o in out)


def inputs(seed=0, t=8, n=4, d=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, n, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype),
            torch.rand(t, n, generator=g), torch.randn(24, n * d, generator=g) * 0.1,
            torch.randn(24, n * d, generator=g) * 0.1, torch.randn(24, generator=g), torch.randn(3, generator=g))


def fused_calls(after) -> int:
    return call_targets(after).count(FUSED)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_chain_fused_bit_for_bit(dtype):
    args = inputs(dtype=dtype)
    model = Layers(2)
    out, mgr, _, after = run(model, args, "F,J,K,G,U")
    assert mgr.counts["U"] == 2  # one a layer; layer 0's MoE-site update read by layer 1 is left to G + J
    assert fused_calls(after) == 2
    calls = call_targets(after)
    assert calls.count("minidi.ops.hc_expand.hc_expand") == 0  # the models' chains end in a mixer read, not G
    want, _, _, _ = run(model, args, "F,J,K,G")
    for got, ref in zip(out, want):
        assert torch.equal(got, ref)


def test_snapshot():
    _, mgr, _, after = run(Layers(1), inputs(), "F,J,K,G,U")
    assert mgr.counts["U"] == 1
    text = graph_text(after)
    fused = [line.strip() for line in text.splitlines() if "hc_expand_mix" in line]
    assert_expected_inline("\n".join(fused), """\
hc_expand_mix = minidi_ops_hc_expand_mix_hc_expand_mix(l_x_, add_11, post, hc_sinkhorn, l_fn_f_, pre, backend = 'auto');  l_x_ = add_11 = post = hc_sinkhorn = l_fn_f_ = pre = None
getitem_24: "bf16[8, 4, 16]" = hc_expand_mix[0]
getitem_25: "f32[8, 24]" = hc_expand_mix[1]
getitem_26: "f32[8, 1]" = hc_expand_mix[2]
getitem_27: "bf16[8, 16]" = hc_expand_mix[3];  hc_expand_mix = None""")


def test_pre_computed_after_the_update_refused():
    class Late(Chain):
        def forward(self, x, h, pre, fn_a, fn_f, base, scale):
            pre_a, post, comb = hc_mixer(x, fn_a, base, scale, 3, 1e-6, 1e-6)
            x2 = hc_expand(x, h, post, comb)
            late = pre_a * 2  # the collapse weights exist only after the update
            pre_f, post_f, comb_f = hc_mixer(x2, fn_f, base, scale, 3, 1e-6, 1e-6)
            return x2, pre_f, post_f, comb_f, hc_collapse(x2, late)

    _, mgr, _, after = run(Layers(1, Late), inputs(1), "F,J,K,G,U")
    assert mgr.counts["U"] == 0 and fused_calls(after) == 0


def test_mutation_between_refused():
    class Mutating(Chain):
        def forward(self, x, h, pre, fn_a, fn_f, base, scale):
            pre_a, post, comb = hc_mixer(x, fn_a, base, scale, 3, 1e-6, 1e-6)
            x2 = hc_expand(x, h, post, comb)
            pre_a.mul_(2)  # the MoE site's collapse reads the mutated weights
            pre_f, post_f, comb_f = hc_mixer(x2, fn_f, base, scale, 3, 1e-6, 1e-6)
            return x2, pre_f, post_f, comb_f, hc_collapse(x2, pre_a)

    args = inputs(2)
    out, mgr, _, after = run(Layers(1, Mutating), args, "F,J,K,G,U")
    assert mgr.counts["U"] == 0 and fused_calls(after) == 0
    want = Layers(1, Mutating)(*args)
    assert ((out[4].float() - want[4].float()).abs() <= want[4].float().abs() * 2.0**-7).all()


def test_needs_g_and_j():
    with pytest.raises(ValueError, match=r"pass U \(hc_expand_mix\) rewrites the ops of passes G"):
        run(Layers(1), inputs(), "J,U")
