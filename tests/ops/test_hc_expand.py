"""minidi::hc_expand (pass G) vs float64 and its plain-torch reference (CPU under TRITON_INTERPRET=1; @gpu on CUDA).

x'_k = post_k * h + sum_j comb[j, k] * x_j in fp32, one rounding to the stream dtype. Tolerance against float64: the
one rounding (half an ulp of the stream dtype, relative) plus fp32 sums (1e-6 of the largest term). Under the
interpreter the kernel equals the reference bit for bit (the same fp32 operations in the same order); on the GPU the
compiler contracts multiply-adds into FMAs (as Inductor does), so there the check is the tolerance.
Legend: T tokens, n streams, D width.
"""

from __future__ import annotations

import pytest
import torch

from minidi.ops import _triton_utils
from minidi.ops.hc_expand import hc_expand, hc_expand_ref, launch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(DEV == "cpu" and not _triton_utils.interpreting(),
                                  reason="kernel needs CUDA or TRITON_INTERPRET=1")
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}  # half an ulp, relative


def inputs(t, n, d, dt, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g).to(dt)
    h = (torch.randn(t, d, generator=g) * 3).to(dt)
    post = torch.rand(t, n, generator=g) * 2  # 2 sigmoid(.): in (0, 2)
    comb = torch.rand(t, n, n, generator=g)
    return [a.to(DEV) for a in (x, h, post, comb)]


def ref64(x, h, post, comb):
    return post.double()[..., None] * h.double()[:, None] + torch.einsum("tjk,tjd->tkd", comb.double(), x.double())


def check(out, x, h, post, comb):
    r = ref64(x, h, post, comb)
    bound = EPS[x.dtype] * r.abs() + 1e-6 * (h.double().abs().amax() * 2 + x.double().abs().amax() * x.shape[1])
    assert out.dtype == x.dtype and out.shape == x.shape
    assert ((out.double() - r).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("t,n,d", [(1, 4, 1), (5, 4, 24), (9, 3, 33), (70, 4, 520), (3, 1, 17), (2, 8, 40),
                                   (17, 4, 1030)])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_matches_float64(t, n, d, dt):
    x, h, post, comb = inputs(t, n, d, dt, seed=t * d)
    out = hc_expand(x, h, post, comb, backend="triton")
    check(out, x, h, post, comb)
    if DEV == "cpu":
        assert torch.equal(out, hc_expand_ref(x, h, post, comb))


@needs_kernel
def test_fp16_streams_and_fp32_h():
    x, h, post, comb = inputs(6, 4, 50, torch.float16, seed=3)
    out = hc_expand(x, h.float(), post, comb, backend="triton")
    check(out, x, h.float(), post, comb)


@needs_kernel
@pytest.mark.parametrize("cfg", [dict(BT=1, BD=16), dict(BT=4, BD=32, num_warps=2), dict(BT=2, BD=64)])
def test_poisoned_output_fully_written(cfg):
    """Ragged T and D against the tile: every output element written (NaN-poisoned buffer), none outside it."""
    x, h, post, comb = inputs(7, 4, 45, torch.bfloat16, seed=11)
    out = torch.full((9, 4, 45), float("nan"), dtype=x.dtype, device=DEV)
    launch(x, h, post, comb, out[:7], **cfg)
    assert not out[:7].isnan().any() and out[7:].isnan().all()
    check(out[:7], x, h, post, comb)


@needs_kernel
def test_strided_inputs():
    """Non-contiguous inputs (a token slice of wider buffers) are made contiguous by the op."""
    x, h, post, comb = inputs(8, 4, 24, torch.bfloat16, seed=5)
    xs, hs = torch.cat([x, x], dim=-1)[..., :24], torch.cat([h, h], dim=-1)[:, 24:]
    assert not xs.is_contiguous() and not hs.is_contiguous()
    out = hc_expand(xs, hs, post.t().contiguous().t(), comb.transpose(1, 2).contiguous().transpose(1, 2),
                    backend="triton")
    check(out, x, h, post, comb)


@needs_kernel
def test_nan_stays_in_its_token():
    x, h, post, comb = inputs(6, 4, 20, torch.float32, seed=2)
    x[3, 1, 5] = float("nan")
    out = hc_expand(x, h, post, comb, backend="triton")
    assert out[3, :, 5].isnan().all() and not out[3, :, :5].isnan().any()
    keep = [0, 1, 2, 4, 5]
    assert not out[keep].isnan().any()


def test_empty_ref_backend_and_errors():
    x, h, post, comb = inputs(0, 4, 8, torch.bfloat16)
    assert hc_expand(x, h, post, comb).shape == (0, 4, 8)
    x, h, post, comb = inputs(3, 4, 8, torch.bfloat16)
    assert torch.equal(hc_expand(x, h, post, comb, backend="ref"), hc_expand_ref(x, h, post, comb))
    bad = [((x.int(), h, post, comb), "x must be"), ((x[:, :0], h, post[:, :0], comb[:, :0, :0]), "n must be"),
           ((x, h[:2], post, comb), "h must be"), ((x, h.int(), post, comb), "h must be"),
           ((x, h, post.double(), comb), "post must be"), ((x, h, post[:, :3], comb), "post must be"),
           ((x, h, post, comb[:, :, :3]), "comb must be"), ((x, h, post, comb.bfloat16()), "comb must be"),
           ((torch.randn(2, 17, 8), torch.randn(2, 8), torch.rand(2, 17), torch.rand(2, 17, 17)), "n must be")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            hc_expand(*args)


@needs_kernel
def test_opcheck():
    x, h, post, comb = inputs(9, 4, 24, torch.bfloat16)
    torch.library.opcheck(torch.ops.minidi.hc_expand.default, (x, h, post, comb))
