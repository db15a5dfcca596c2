"""minidi::hc_expand_mix (pass U's op) against the two ops it fuses, ``hc_expand`` then ``hc_mix_fused`` of the
result (bit for bit: the same arithmetic in the same order), against float64 and the model's code (CPU under
TRITON_INTERPRET=1; @gpu on CUDA, where the GPU test also runs a full-size width).
Legend: T tokens, n streams, D width, M mixer outputs.
"""

from __future__ import annotations

import pytest
import torch

from minidi.model.hyper_connections import hc_collapse
from minidi.model.hyper_connections import hc_expand as model_expand
from minidi.ops import _triton_utils
from minidi.ops.hc_expand import hc_expand
from minidi.ops.hc_expand_mix import hc_expand_mix, launch
from minidi.ops.hc_mix import SPLITS, hc_mix_fused

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("no_tf32")  # fp32 references in full fp32 (tests/conftest.py)
SHAPES = [(1, 4, 64), (37, 4, 200), (70, 2, 320), (5, 4, 24)]  # ragged T, n, D (D < BD, D not a multiple of BD)
needs_kernel = pytest.mark.skipif(DEV == "cpu" and not _triton_utils.interpreting(),
                                  reason="kernel needs CUDA or TRITON_INTERPRET=1")


def make(t, n, d, dtype=torch.bfloat16, m=24, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, d, generator=g) * 3).to(dtype)
    h = torch.randn(t, d, generator=g).to(dtype)
    post = 2 * torch.rand(t, n, generator=g)
    comb = torch.rand(t, n, n, generator=g)
    fn = torch.randn(m, n * d, generator=g) * (n * d) ** -0.5
    pre = torch.rand(t, n, generator=g) + 0.1
    return tuple(a.to(device) for a in (x, h, post, comb, fn, pre))


def two_ops(x, h, post, comb, fn, pre, backend="triton"):
    x2 = hc_expand(x, h, post, comb, backend=backend)
    return (x2, *hc_mix_fused(x2, fn, pre, backend=backend))


def assert_same(got, want):
    names = ("x2", "g", "ms", "u")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs: max {(a.double() - b.double()).abs().max().item():.3g}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,n,d", SHAPES)
def test_equals_the_two_ops_bit_for_bit(t, n, d, dtype):
    args = make(t, n, d, dtype, seed=t + d)
    got = hc_expand_mix(*args, backend="triton")
    assert_same(got, two_ops(*args))
    x, h, post, comb, fn, _ = args
    got = hc_expand_mix(x, h, post, comb, fn, None, backend="triton")  # no collapse (V4's sites)
    assert got[3].numel() == 0
    assert_same(got[:3], two_ops(x, h, post, comb, fn, None)[:3])


@needs_kernel
def test_close_to_float64_and_the_model():
    """Independent of the two ops: x2 the model's update (one bf16 rounding apart at most), g / ms at fp32 level
    of the float64 products of x2, u the model's collapse of x2."""
    x, h, post, comb, fn, pre = make(37, 4, 200)
    x2, g, ms, u = hc_expand_mix(x, h, post, comb, fn, pre, backend="triton")
    want = model_expand(x, h, post, comb)
    assert ((x2.float() - want.float()).abs() <= want.float().abs() * 2.0**-7 + 1e-30).all()
    z = x2.reshape(37, -1).double()
    g64, ms64 = z @ fn.double().t(), z.square().mean(-1, keepdim=True)
    assert ((g.double() - g64).abs().max() / g64.abs().max()).item() <= 1e-5
    assert ((ms.double() - ms64).abs().max() / ms64.abs().max()).item() <= 1e-5
    uw = hc_collapse(x2, pre)
    assert ((u.float() - uw.float()).abs() <= uw.float().abs() * 2.0**-7 + 1e-6).all()


@needs_kernel
def test_every_output_element_written():
    """Poisoned outputs: x2, every split's g / ss (zeros where a narrow D leaves a split unused) and u."""
    x, h, post, comb, fn, pre = make(9, 4, 20)  # D 20 < one BD step: one split of SPLITS used
    out = torch.full_like(x, float("nan"))
    g = torch.full((SPLITS, 9, 24), float("nan"), device=DEV)
    ss = torch.full((SPLITS, 9), float("nan"), device=DEV)
    u = torch.full((9, 20), float("nan"), device=DEV, dtype=x.dtype)
    launch(x, h, post, comb, fn, pre, out, g, ss, u)
    assert not (out.isnan().any() or g.isnan().any() or ss.isnan().any() or u.isnan().any())


@needs_kernel
def test_nan_stays_in_its_token():
    x, h, post, comb, fn, pre = make(6, 4, 64)
    x[2, 1, 5] = float("nan")
    x2, g, ms, u = hc_expand_mix(x, h, post, comb, fn, pre, backend="triton")
    bad = torch.zeros(6, dtype=torch.bool, device=DEV)
    bad[2] = True
    assert x2[2, :, 5].isnan().all() and not x2[~bad].isnan().any()
    assert g[2].isnan().all() and ms[2].isnan().all() and not g[~bad].isnan().any() and not ms[~bad].isnan().any()


def test_reference_backend_and_empty_batch():
    args = make(5, 4, 24, device="cpu")
    assert_same(hc_expand_mix(*args, backend="ref"), two_ops(*args, backend="ref"))
    empty = make(0, 4, 24, device="cpu")
    for backend in ("ref",) + (("triton",) if _triton_utils.interpreting() else ()):
        x2, g, ms, u = hc_expand_mix(*empty, backend=backend)
        assert x2.shape == (0, 4, 24) and g.shape == (0, 24) and ms.shape == (0, 1) and u.shape == (0, 24)


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.zeros(3, 4, 8, dtype=torch.float16)), "x must be"),
    (dict(h=torch.zeros(3, 9)), "h must be"),
    (dict(post=torch.zeros(3, 4, dtype=torch.float64)), "post must be"),
    (dict(comb=torch.zeros(3, 4, 3)), "comb must be"),
    (dict(fn=torch.zeros(24, 31)), "fn must be"),
    (dict(pre=torch.zeros(3, 2)), "pre must be"),
])
def test_bad_input_named(bad, match):
    args = dict(x=torch.zeros(3, 4, 8, dtype=torch.bfloat16), h=torch.zeros(3, 8), post=torch.zeros(3, 4),
                comb=torch.zeros(3, 4, 4), fn=torch.zeros(24, 32), pre=torch.zeros(3, 4)) | bad
    with pytest.raises(ValueError, match=f"hc_expand_mix: {match}"):
        hc_expand_mix(**args)


@needs_kernel
def test_opcheck():
    args = make(5, 4, 24)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.minidi.hc_expand_mix.default, args, test_utils=utils)
    x, h, post, comb, fn, _ = args
    torch.library.opcheck(torch.ops.minidi.hc_expand_mix.default, (x, h, post, comb, fn, None), test_utils=utils)


@pytest.mark.gpu
def test_gpu_full_width_bit_for_bit():
    args = make(300, 4, 5120, device="cuda", seed=3)
    assert_same(hc_expand_mix(*args, backend="triton"), two_ops(*args))
