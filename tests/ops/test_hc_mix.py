"""minidi::hc_mix_partials / hc_mix_fused vs float64 and the model's mHC code (CPU under TRITON_INTERPRET=1; @gpu on
CUDA).

Tolerances: the projection and the mean square at fp32 level (max|out - ref64| / max|ref64| <= 1e-5, the bound of
pass F's op: the fn pieces drop ~2^-24 relative, fp32 sums in another order, on the GPU Hopper's truncating MMA
accumulation); the collapse u equals the model's ``hc_collapse`` within the fp32 error of a sum of n products in
another order, possibly fused (2^-21 of the sum of the terms' magnitudes), plus one bf16 step where the two sums
round to neighbours. The GPU test runs a full-size width (D 5,120).
Legend: T tokens, n streams, D width, M mixer outputs.
"""

from __future__ import annotations

import re

import pytest
import torch

from minidi.model.hyper_connections import hc_collapse
from minidi.ops import _triton_utils
from minidi.ops import hc_mix
from minidi.ops.hc_mix import SPLITS, hc_mix_fused, hc_mix_partials_ref, launch, tma_ok

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("no_tf32")  # fp32 references in full fp32 (tests/conftest.py)
SHAPES = [(1, 4, 64), (37, 4, 200), (70, 2, 320), (5, 4, 24)]  # ragged T, n, D (D < BD, D not a multiple of BD)


def make(t, n, d, dtype=torch.bfloat16, m=24, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, n, d, generator=g) * 3).to(dtype)
    fn = torch.randn(m, n * d, generator=g) * (n * d) ** -0.5
    pre = torch.rand(t, n, generator=g) + 0.1
    return x.to(device), fn.to(device), pre.to(device)


def rel(out, ref) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def refs(x, fn):
    z = x.reshape(x.shape[0], -1).double()
    return z @ fn.double().t(), z.square().mean(-1, keepdim=True)


def assert_collapse_close(u, x, pre):
    want = hc_collapse(x, pre)
    assert u.dtype == want.dtype and u.shape == want.shape
    tol = (pre.unsqueeze(-1) * x.float()).abs().sum(1) * 2.0**-21
    if want.dtype == torch.bfloat16:
        tol = tol + want.float().abs() * 2.0**-7
    err = (u.float() - want.float()).abs()
    assert (err <= tol).all(), f"collapse off by {(err - tol).max().item():.3g} over the bound"


needs_kernel = pytest.mark.skipif(DEV == "cpu" and not _triton_utils.interpreting(),
                                  reason="kernel needs CUDA or TRITON_INTERPRET=1")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,n,d", SHAPES)
def test_matches_float64_and_the_model(t, n, d, dtype):
    x, fn, pre = make(t, n, d, dtype)
    g, ms, u = hc_mix_fused(x, fn, pre, backend="triton")
    g_ref, ms_ref = refs(x, fn)
    assert g.shape == (t, 24) and ms.shape == (t, 1) and g.dtype == ms.dtype == torch.float32
    assert rel(g, g_ref) <= 1e-5, rel(g, g_ref)
    assert rel(ms, ms_ref) <= 1e-5, rel(ms, ms_ref)
    assert_collapse_close(u, x, pre)
    g2, ms2, u2 = hc_mix_fused(x, fn, None, backend="triton")  # no collapse: same projection, no u
    assert u2.numel() == 0 and torch.equal(g2, g) and torch.equal(ms2, ms)


@needs_kernel
def test_every_output_element_written():
    """Poisoned outputs: every element of g / ss (zeros in the splits a narrow D leaves unused) and u is written."""
    x, fn, pre = make(9, 4, 20, device=DEV)  # D 20 < one BD step (32): one split used of SPLITS
    g = torch.full((SPLITS, 9, 24), float("nan"), device=DEV)
    ss = torch.full((SPLITS, 9), float("nan"), device=DEV)
    u = torch.full((9, 20), float("nan"), device=DEV, dtype=x.dtype)
    launch(x, fn, pre, g, ss, u)
    assert not g.isnan().any() and not ss.isnan().any() and not u.isnan().any()
    assert (g[1:] == 0).all() and (ss[1:] == 0).all()


@needs_kernel
def test_fn_pieces_split_once_and_redone_after_an_in_place_update(monkeypatch):
    """The pieces of fn are a weight's: computed on the first call, reused while fn is unchanged, recomputed after an
    in-place write (a stale split would give the old weight's projection)."""
    calls = []
    real = hc_mix.fn_pieces
    monkeypatch.setattr(hc_mix, "fn_pieces", lambda fn: calls.append(1) or real(fn))
    x, fn, pre = make(8, 4, 64)
    g1, _, _ = hc_mix_fused(x, fn, pre, backend="triton")
    g2, _, _ = hc_mix_fused(x, fn, pre, backend="triton")
    assert len(calls) == 1 and torch.equal(g1, g2)
    fn.mul_(-2.0)
    g3, _, _ = hc_mix_fused(x, fn, pre, backend="triton")
    assert len(calls) == 2
    assert rel(g3, refs(x, fn)[0]) <= 1e-5


@needs_kernel
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_any_split_count_sums_to_the_projection(splits):
    x, fn, pre = make(19, 4, 200)
    g = torch.full((splits, 19, 24), float("nan"), device=DEV)
    ss = torch.full((splits, 19), float("nan"), device=DEV)
    u = torch.empty(19, 200, device=DEV, dtype=x.dtype)
    launch(x, fn, pre, g, ss, u)
    g_ref, ms_ref = refs(x, fn)
    assert rel(g.sum(0), g_ref) <= 1e-5 and rel(ss.sum(0).unsqueeze(-1) / 800, ms_ref) <= 1e-5
    assert_collapse_close(u, x, pre)


@needs_kernel
def test_nan_propagates_like_eager():
    x, fn, pre = make(6, 4, 64)
    x[2, 1, 5] = float("nan")
    g, ms, u = hc_mix_fused(x, fn, pre, backend="triton")
    assert g[2].isnan().all() and ms[2].isnan().all() and u[2, 5].isnan()
    assert not g[[0, 1, 3, 4, 5]].isnan().any() and not u[2, :5].isnan().any()


def test_reference_backend_and_empty_batch():
    x, fn, pre = make(7, 4, 32, device="cpu")
    g, ms, u = hc_mix_fused(x, fn, pre, backend="ref")
    g_ref, ms_ref = refs(x, fn)
    assert rel(g, g_ref) <= 2e-6 and rel(ms, ms_ref) <= 2e-6
    assert torch.equal(u, hc_collapse(x, pre))
    g0, ms0, u0 = hc_mix_fused(x[:0], fn, pre[:0])
    assert g0.shape == (0, 24) and ms0.shape == (0, 1) and u0.shape == (0, 32)


@pytest.mark.parametrize("bad,match", [
    (lambda x, fn, pre: (x[0], fn, pre), "x must be"),
    (lambda x, fn, pre: (x.half(), fn, pre), "x must be"),
    (lambda x, fn, pre: (x, fn[:, :-1], pre), "fn must be"),
    (lambda x, fn, pre: (x, fn.bfloat16(), pre), "fn must be"),
    (lambda x, fn, pre: (x, torch.zeros(65, fn.shape[1]), pre), "fn must be"),
    (lambda x, fn, pre: (x, fn, pre[:, :2]), "pre must be"),
    (lambda x, fn, pre: (x, fn, pre.double()), "pre must be"),
    (lambda x, fn, pre: (x.to("meta"), fn, pre), "one device"),
])
def test_bad_input_named(bad, match):
    x, fn, pre = make(4, 4, 16, device="cpu")
    with pytest.raises(ValueError, match=match):
        hc_mix_fused(*bad(x, fn, pre))


@needs_kernel
def test_opcheck():
    x, fn, pre = make(5, 4, 48)
    torch.library.opcheck(torch.ops.minidi.hc_mix_partials.default, (x, fn, pre))
    torch.library.opcheck(torch.ops.minidi.hc_mix_partials.default, (x, fn, None))


def test_reference_is_the_naive_chain():
    """The *_ref and the model's plain mixer code compute the same quantities (the pass swaps one for the other)."""
    x, fn, pre = make(5, 4, 48, device="cpu")
    g, ss, u = hc_mix_partials_ref(x, fn, pre)
    z = x.reshape(5, -1).float()
    assert torch.equal(g[0], z @ fn.t()) and torch.equal(ss[0], z.square().sum(-1))
    assert torch.equal(u, hc_collapse(x, pre))


@pytest.mark.gpu
def test_gpu_full_width_fp32_level():
    """D 5,120, n 4 (V4.1-Flash): 80 stream chunks per split; per-chunk promotion keeps the error at fp32 level."""
    x, fn, pre = make(300, 4, 5120, device="cuda")
    g, ms, u = hc_mix_fused(x, fn, pre, backend="triton")
    g_ref, ms_ref = refs(x, fn)
    assert rel(g, g_ref) <= 1e-5 and rel(ms, ms_ref) <= 1e-5, (rel(g, g_ref), rel(ms, ms_ref))
    assert_collapse_close(u, x, pre)


def run_both(x, fn, pre, splits=SPLITS):
    """The TMA kernel and the pointer kernel on poisoned outputs -> ((g, ss, u) TMA, (g, ss, u) pointers)."""
    outs = []
    for tma in (True, False):
        t, _, d = x.shape
        g = torch.full((splits, t, fn.shape[0]), float("nan"), device=x.device)
        ss = torch.full((splits, t), float("nan"), device=x.device)
        u = torch.full((t, d), float("nan"), device=x.device, dtype=x.dtype)
        launch(x, fn, pre, g, ss, u, TMA=tma)
        outs.append((g, ss, u if pre is not None else None))
    return outs


def assert_same_bits(a, b):
    for p, q in zip(a, b):
        assert (p is None) == (q is None) and (p is None or torch.equal(p, q))


@needs_kernel
@pytest.mark.parametrize("t,n,d,m", [(1, 4, 64, 24), (37, 4, 64, 24), (70, 2, 320, 24), (130, 4, 96, 4)])
@pytest.mark.parametrize("collapse", [True, False])
def test_tma_kernel_gives_the_pointer_kernels_bits(t, n, d, m, collapse):
    """The TMA kernel (the GPU default on sm_90) runs the pointer kernel's arithmetic (``mix_stream_math``) on the
    same tiles: the same bits, every output element written (poisoned), rows past T (a partial last block) and the
    zero pad rows of the pieces (M 4 -> 16, 24 -> 32) included."""
    x, fn, pre = make(t, n, d, m=m)
    pre = pre if collapse else None
    (g, ss, u), want = run_both(x, fn, pre)
    assert_same_bits((g, ss, u), want)
    assert not g.isnan().any() and not ss.isnan().any() and (u is None or not u.isnan().any())
    g_ref, ms_ref = refs(x, fn)
    assert rel(g.sum(0), g_ref) <= 1e-5 and rel(ss.sum(0).unsqueeze(-1) / (n * d), ms_ref) <= 1e-5
    if collapse:
        assert_collapse_close(u, x, pre)


@needs_kernel
def test_tma_kernel_reads_a_strided_row_view():
    """x a view with padded rows (row stride n D + 32): the descriptor takes the stride, not a copy."""
    t, n, d = 19, 4, 64
    buf = torch.randn(t, n * d + 32, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEV)
    x = buf[:, : n * d].view(t, n, d)
    _, fn, pre = make(t, n, d)
    assert tma_ok(x, 32) is None
    (g, ss, u), want = run_both(x, fn, pre)
    assert_same_bits((g, ss, u), want)
    assert rel(g.sum(0), refs(x, fn)[0]) <= 1e-5


@pytest.mark.parametrize("case,match", [
    (lambda x: x.float(), "not bfloat16"),
    (lambda x: x[:, :, :40], "strides"),
    (lambda x: x[..., :48].contiguous(), "not a multiple of BD"),
])
def test_tma_refusals_are_named(case, match):
    x, fn, pre = make(4, 4, 64, device="cpu")
    x = case(x)
    why = tma_ok(x, 32)
    assert why is not None and re.search(match, why), why
    if hc_mix._TensorDescriptor is None:
        return
    fn = fn[:, : x.shape[1] * x.shape[2]].contiguous()
    g, ss = torch.empty(SPLITS, 4, 24), torch.empty(SPLITS, 4)
    with pytest.raises(ValueError, match="TMA=True, but"):
        launch(x, fn, pre, g, ss, torch.empty(4, x.shape[2], dtype=x.dtype), TMA=True)


@pytest.mark.gpu
def test_gpu_tma_kernel_gives_the_pointer_kernels_bits():
    """Full width (D 5,120, n 4; the step's shape but 300 tokens) on the GPU: the TMA kernel (the default on sm_90)
    and the pointer kernel give the same bits, with and without the collapse."""
    x, fn, pre = make(300, 4, 5120, device="cuda")
    if tma_ok(x, 32) is not None:
        pytest.skip(tma_ok(x, 32))
    for p in (pre, None):
        (g, ss, u), want = run_both(x, fn, p)
        assert_same_bits((g, ss, u), want)
        assert rel(g.sum(0), refs(x, fn)[0]) <= 1e-5
