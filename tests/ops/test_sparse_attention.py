"""minidi::sparse_attention: the Triton kernel (CPU interpreter; realistic sizes under the gpu marker) vs references.

Tolerances: fp32 inputs vs an independent float64 reference, max abs error <= 5e-4 (the issue's bound; seen ~1e-6).
bf16 inputs vs ``sparse_attention_ref`` (the naive bf16 semantics: exp rounded to bf16 with the final max):
|out - ref| <= 2^-7 |ref| + 4e-3, i.e. one bf16 ulp of the output plus the online-softmax rounding noise (the kernel
rounds exp(s - running max) like FlashMLA; seen <= 2 ulps). The rounding fixture checks the bf16 rounding and the
sink-outside-the-max rule to 1e-4 on outputs near 0, where removing either moves the output by >= 8e-4.
"""

from __future__ import annotations

import pytest
import torch

from minidi.model.sparse_attention import sparse_attention_naive
from minidi.ops import _triton_utils
from minidi.model.layers import apply_rope, rms_norm
from minidi.ops.sparse_attention import (ROPE_OUT, ROPE_Q, launch, rope_ref, scale_q, sparse_attention,
                                         sparse_attention_ref)

BF16_TOL = dict(rtol=2**-7, atol=4e-3)
VARIANTS = [dict(), dict(nsplit=2, num_warps=4), dict(BLOCK_K=32, persistent=True)]


def _ref64(q, wkv, widx, ckv, cidx, sink, scale):
    """Independent float64 attention over the gathered keys (no probability rounding); empty slots masked."""
    keys = wkv.double()[widx.clamp(min=0)]  # [T, W, D]
    idx = widx
    if ckv is not None:
        keys = torch.cat([keys, ckv.double()[cidx.clamp(min=0)]], 1)  # [T, W+K, D]
        idx = torch.cat([widx, cidx], 1)
    valid = idx >= 0
    s = torch.einsum("thd,tkd->thk", q.double(), keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    p = e / (e.sum(-1, keepdim=True) + torch.exp(sink.double()[None, :, None] - m))
    return torch.einsum("thk,tkd->thd", p, keys)


def _case(t, h, d, w, k, nw=None, nc=None, dtype=torch.float32, seed=0, device="cpu", comp=True, idx_dtype=torch.int64):
    """Random inputs with -1 slots anywhere, queries with fewer valid keys than slots; every query keeps >= 1 key."""
    g = torch.Generator().manual_seed(seed)
    nw, nc = nw or t + w + 3, nc or 3 * k + 5
    q = torch.randn(t, h, d, generator=g)
    wkv, ckv = torch.randn(nw, d, generator=g), torch.randn(nc, d, generator=g)
    widx = torch.randint(0, nw, (t, w), generator=g)
    cidx = torch.randint(0, nc, (t, k), generator=g)
    widx[torch.rand(t, w, generator=g) < 0.25] = -1
    cidx[torch.rand(t, k, generator=g) < 0.25] = -1
    cidx[1] = -1  # a query with no compressed key
    widx[:, 0] = torch.arange(t) % nw  # ... but every query sees one key (itself)
    sink = torch.randn(h, generator=g) * 2
    to = dict(device=device)
    args = [q.to(dtype), wkv.to(dtype), widx.to(idx_dtype), ckv.to(dtype), cidx.to(idx_dtype), sink]
    if not comp:
        args[3] = args[4] = None
    return [None if a is None else a.to(**to) for a in args]


def _poisoned_launch(*args, **cfg):
    out = launch(*args, **cfg)
    assert torch.isfinite(out).all()
    return out


# ---- numerics (CPU interpreter) -----------------------------------------------------------------------------------
@pytest.mark.parametrize("t,h,d,w,k", [(5, 3, 32, 4, 3), (7, 16, 40, 6, 11), (9, 5, 64, 8, 12), (6, 4, 48, 5, 20)])
@pytest.mark.interpreter
def test_fp32_matches_float64_reference(t, h, d, w, k):
    args = _case(t, h, d, w, k, seed=t * 100 + d)
    out = _poisoned_launch(*args, 0.3)
    ref = _ref64(*args, 0.3)
    assert out.dtype == torch.float32 and out.shape == (t, h, d)
    assert (out.double() - ref).abs().max().item() <= 5e-4


@pytest.mark.parametrize("t,h,d,w,k", [(5, 3, 32, 4, 3), (8, 16, 64, 8, 12), (7, 6, 36, 7, 9)])
@pytest.mark.interpreter
def test_bf16_matches_bf16_reference_semantics(t, h, d, w, k):
    args = _case(t, h, d, w, k, dtype=torch.bfloat16, seed=t + h)
    out = launch(*args, d**-0.5 * 2)
    ref = sparse_attention_ref(*args, d**-0.5 * 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.interpreter
def test_kernel_variants(cfg, dtype):
    """The GPU variants the bench compares (D split over two programs, other blocks, persistent grid) agree."""
    args = _case(6, 5, 40, 5, 9, dtype=dtype, seed=3)
    out = launch(*args, 0.25, **cfg)
    if dtype == torch.float32:
        assert (out.double() - _ref64(*args, 0.25)).abs().max().item() <= 5e-4
    else:
        torch.testing.assert_close(out.float(), sparse_attention_ref(*args, 0.25).float(), **BF16_TOL)


def _variant_ref(q, wkv, widx, ckv, cidx, sink, scale, round_p=True, sink_in_max=False):
    """The bf16 semantics with one rule switched off, to prove the fixture below tells them apart."""
    keys = torch.cat([wkv[widx.clamp(min=0)], ckv[cidx.clamp(min=0)]], 1).float()
    valid = torch.cat([widx, cidx], 1) >= 0
    keys = keys * valid[..., None]
    s = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    s = s.masked_fill(~valid[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sink_in_max:
        m = torch.maximum(m, sink.view(1, -1, 1))
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True) + torch.exp(sink.view(1, -1, 1) - m)
    if round_p:
        e = e.bfloat16().float()
    return (torch.einsum("thk,tkd->thd", e, keys) / den).bfloat16()


def _rounding_fixture(device="cpu"):
    """Outputs near 0 by cancellation, so bf16 output rounding is tiny while the rules move them by ~1e-3.

    Key row A = (0, -1, 0..): score 0, the max (slot 0, so the first block already holds the final max).
    Key row B = (b, c, 0..): score b = -2.015625, exp(b) = 0.13324 rounds to 0.13281 in bf16 (0.32 % low, far from a
    tie); c = 0.94140625 ~ 1 / (8 bf16(exp b)), so dim 1 of the output is -1 + 8 c bf16(exp b) ~ 0 over the sum.
    Heads: sink -20 (rounding only), 0.25 and 0.5 (> the max: the sink-in-max bug rescales and re-rounds).
    """
    t, h, d = 5, 3, 36
    q = torch.zeros(t, h, d)
    q[..., 0] = 1.0
    wkv = torch.zeros(6, d)
    wkv[0, 1] = -1.0  # A
    wkv[1:, 0], wkv[1:, 1] = -2.015625, 0.94140625  # B
    ckv = wkv[1:].repeat(3, 1)  # B rows only
    widx = torch.tensor([[0, 1, 2, 3], [0, -1, 4, 5], [0, 2, -1, 3], [0, 1, 2, -1], [0, 5, 4, 3]])
    cidx = torch.tensor([[1, 2, 3, 4, 5, -1, -1], [0, 6, -1, 7, 8, 9, 10], [11, -1, 12, 13, 14, 0, 1],
                         [-1, 1, 3, 5, 7, 9, 11], [2, -1, 4, 10, 6, 8, -1]])  # 8 B keys per query, -1 anywhere
    sink = torch.tensor([-20.0, 0.25, 0.5])
    args = [q.bfloat16(), wkv.bfloat16(), widx, ckv.bfloat16(), cidx, sink]
    return [a.to(device) for a in args]


@pytest.mark.interpreter
def test_bf16_probability_rounding_and_sink_outside_max():
    args = _rounding_fixture()
    ref = sparse_attention_ref(*args, 1.0).float()
    no_round = _variant_ref(*[a.cpu() for a in args], 1.0, round_p=False).float()
    sink_max = _variant_ref(*[a.cpu() for a in args], 1.0, sink_in_max=True).float()
    assert torch.equal(_variant_ref(*args, 1.0).float(), ref)  # the variant helper reproduces the reference
    assert (no_round - ref)[:, :, 1].abs().min() > 5e-4  # every output separates the rules (5x tol)
    assert (sink_max - ref)[:, 1:, 1].abs().min() > 5e-4
    for cfg in VARIANTS:
        out = launch(*args, 1.0, **cfg).float()
        torch.testing.assert_close(out[:, :, 1], ref[:, :, 1], rtol=0, atol=1e-4)  # the cancelling outputs
        torch.testing.assert_close(out, ref, **BF16_TOL)


@pytest.mark.interpreter
def test_empty_slots_are_never_read():
    """-1 and out-of-range slots contribute nothing and read nothing: NaN in row 0 and past the end cannot leak."""
    q, wkv, widx, ckv, cidx, sink = _case(7, 4, 32, 6, 8, seed=5)
    widx = torch.where(widx == 0, 1, widx)
    cidx = torch.where(cidx == 0, 1, cidx)
    big = torch.full((wkv.shape[0] + 50, 32), float("nan"))
    big[: wkv.shape[0]] = wkv
    big[0] = float("nan")
    wkv_view = big[: wkv.shape[0]]  # rows past the end of the view are NaN in memory
    ckv[0] = float("nan")
    out = launch(q, wkv_view, widx, ckv, cidx, sink, 0.3)
    ref = _ref64(q, torch.nan_to_num(wkv_view), widx, torch.nan_to_num(ckv), cidx, sink, 0.3)
    assert (out.double() - ref).abs().max().item() <= 5e-4
    # an index >= rows is an empty slot for the kernel (the naive path would raise)
    widx2 = torch.where(widx == -1, wkv_view.shape[0] + 7, widx)  # lands in the NaN rows past the view
    torch.testing.assert_close(launch(q, wkv_view, widx2, ckv, cidx, sink, 0.3), out, rtol=0, atol=0)


@pytest.mark.interpreter
def test_window_only_int32_indices_and_query_without_keys():
    q, wkv, widx, _, _, sink = _case(6, 3, 40, 5, 4, seed=7, comp=False, idx_dtype=torch.int32)
    widx[4] = -1  # a query with no valid key at all: the kernel gives 0 (the naive path: NaN)
    out = launch(q, wkv, widx, None, None, sink, 0.3)
    ref = _ref64(q, wkv, widx, None, None, sink, 0.3)
    keep = torch.arange(6) != 4
    assert (out[keep].double() - ref[keep]).abs().max().item() <= 5e-4
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    torch.testing.assert_close(sparse_attention(q, wkv, widx, None, None, sink, 0.3)[keep],
                               sparse_attention(q, wkv, widx, None, None, sink, 0.3, backend="ref")[keep],
                               rtol=0, atol=5e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("comp", [True, False])
def test_ref_is_the_model_naive_function(dtype, comp):
    """``sparse_attention_ref`` is a deliberate twin of the model's ``sparse_attention_naive`` (the ops import nothing
    of the model): bit-equal on the same inputs, NaN (a query without keys) included."""
    args = _case(9, 4, 32, 7, 5, dtype=dtype, seed=4, comp=comp)
    args[2][3] = -1  # query 3 sees no window key
    if comp:
        args[4][3] = -1  # ... and no compressed key: NaN in both
    ref, naive = sparse_attention_ref(*args, 0.17), sparse_attention_naive(*args, 0.17)
    assert torch.equal(ref.isnan(), naive.isnan()) and (not comp or ref[3].isnan().all())
    assert torch.equal(ref.nan_to_num(), naive.nan_to_num())


def test_empty_batch():
    q, wkv, widx, ckv, cidx, sink = _case(3, 3, 32, 4, 3)
    out = sparse_attention(q[:0], wkv, widx[:0], ckv, cidx[:0], sink, 0.3)
    assert out.shape == (0, 3, 32)


@pytest.mark.interpreter
def test_public_wrapper_and_opcheck():
    args = _case(5, 3, 32, 4, 3, dtype=torch.bfloat16, seed=11)
    out = sparse_attention(*args, 0.3)
    torch.testing.assert_close(out.float(), sparse_attention(*args, 0.3, backend="ref").float(), **BF16_TOL)
    torch.library.opcheck(torch.ops.minidi.sparse_attention.default, (*args, 0.3))
    args = _case(4, 3, 32, 4, 3, comp=False, seed=12)
    torch.library.opcheck(torch.ops.minidi.sparse_attention.default, (*args, 0.3))


def test_clear_errors(monkeypatch):
    q, wkv, widx, ckv, cidx, sink = _case(5, 3, 32, 4, 3)
    with pytest.raises(ValueError, match="backend"):
        sparse_attention(q, wkv, widx, ckv, cidx, sink, 0.3, backend="cuda")
    with pytest.raises(ValueError, match=r"q must be \[T, H, D\]"):
        sparse_attention(q.half(), wkv, widx, ckv, cidx, sink, 0.3)
    with pytest.raises(ValueError, match="window_kv must be"):
        sparse_attention(q, wkv[:, :16], widx, ckv, cidx, sink, 0.3)
    with pytest.raises(ValueError, match="window_kv must be"):
        sparse_attention(q, wkv.bfloat16(), widx, ckv, cidx, sink, 0.3)
    with pytest.raises(ValueError, match="window_idx must be"):
        sparse_attention(q, wkv, widx.float(), ckv, cidx, sink, 0.3)
    with pytest.raises(ValueError, match="comp_idx must be"):
        sparse_attention(q, wkv, widx, ckv, cidx[:2], sink, 0.3)
    with pytest.raises(ValueError, match="both be given"):
        sparse_attention(q, wkv, widx, ckv, None, sink, 0.3)
    with pytest.raises(ValueError, match="sink must be"):
        sparse_attention(q, wkv, widx, ckv, cidx, sink[:2], 0.3)
    with pytest.raises(ValueError, match="D must be <= 512"):
        big = torch.zeros(1, 1, 520)
        sparse_attention(big, torch.zeros(2, 520), widx[:1], None, None, sink[:1], 0.3)
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)  # as if imported without TRITON_INTERPRET=1
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*backend='auto'"):
        sparse_attention(q, wkv, widx, ckv, cidx, sink, 0.3, backend="triton")
    ref = sparse_attention(q, wkv, widx, ckv, cidx, sink, 0.3, backend="ref")  # the reference still runs
    assert torch.equal(sparse_attention(q, wkv, widx, ckv, cidx, sink, 0.3), ref)  # auto: the reference here


# ---- the rotations folded into the kernel (pass A with the model's q / output RoPE) ------------------------------
def _angles(t: int, r2: int, device="cpu", seed=0):
    ang = torch.rand(t, r2, generator=torch.Generator().manual_seed(seed)) * 40.0
    return ang.cos().to(device), ang.sin().to(device)


def _close_to_ref(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel's output against sparse_attention_ref's: fp32 to 1e-5; bf16 within BF16_TOL."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_ref_is_the_model_apply_rope(dtype, inverse):
    x = torch.randn(6, 5, 48, generator=torch.Generator().manual_seed(4)).to(dtype)
    cos, sin = _angles(6, 8)
    assert torch.equal(rope_ref(x, cos, sin, inverse), apply_rope(x, cos, sin, inverse))


@pytest.mark.parametrize("mode", [ROPE_Q, ROPE_OUT, ROPE_Q | ROPE_OUT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("t,h,d,w,k,r2", [(5, 4, 64, 8, 6, 8), (4, 3, 48, 5, 7, 4)])
@pytest.mark.interpreter
def test_rotations_in_load_and_store_equal_the_model_chain(t, h, d, w, k, r2, cfg, dtype, mode):
    """The fused rotations are the model's: bit-equal to rope_ref (= apply_rope) of q before and of the output
    after the unfused kernel, with each rounding where the model rounds (q's dtype after the rotation; the output
    rounded, rotated back, rounded again)."""
    args = _case(t, h, d, w, k, dtype=dtype, seed=r2 + mode)
    cos, sin = _angles(t, r2, seed=mode)
    q = args[0]
    out = launch(*args, 0.2, rope_cos=cos, rope_sin=sin, rope_mode=mode, **cfg)
    base = launch(rope_ref(q, cos, sin) if mode & ROPE_Q else q, *args[1:], 0.2, **cfg)
    assert torch.equal(out, rope_ref(base, cos, sin, inverse=True) if mode & ROPE_OUT else base)
    _close_to_ref(out, sparse_attention_ref(*args, 0.2, cos, sin, mode))


@pytest.mark.interpreter
def test_rope_arguments_are_checked_and_opcheck():
    args = _case(5, 3, 32, 4, 3, seed=13)
    cos, sin = _angles(5, 4)
    with pytest.raises(ValueError, match="rope_mode must be"):
        sparse_attention(*args, 0.3, rope_cos=cos, rope_sin=sin, rope_mode=4)
    with pytest.raises(ValueError, match="needs rope_sin"):
        sparse_attention(*args, 0.3, rope_cos=cos, rope_mode=ROPE_Q)
    with pytest.raises(ValueError, match="needs rope_cos"):
        sparse_attention(*args, 0.3, rope_cos=cos[:2], rope_sin=sin, rope_mode=ROPE_OUT)
    with pytest.raises(ValueError, match="2 r2 <= D"):
        big = _angles(5, 17)
        sparse_attention(*args, 0.3, rope_cos=big[0], rope_sin=big[1], rope_mode=ROPE_Q)
    torch.library.opcheck(torch.ops.minidi.sparse_attention.default, (*args, 0.3, cos, sin, ROPE_Q | ROPE_OUT))


def _q_scale(q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The model's per-head q RMSNorm scale, rsqrt(mean(q^2) + eps), as its graph computes it ([T, H, 1] fp32)."""
    q32 = q.float()
    return torch.rsqrt(q32.square().mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_q_is_the_model_rms_norm(dtype):
    q = (torch.randn(7, 5, 48, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    assert torch.equal(scale_q(q, _q_scale(q, 1e-6)), rms_norm(q, None, 1e-6))
    assert torch.equal(scale_q(q, _q_scale(q, 1e-6).squeeze(-1)), rms_norm(q, None, 1e-6))


@pytest.mark.parametrize("mode", [0, ROPE_Q, ROPE_Q | ROPE_OUT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("t,h,d,w,k,r2", [(5, 4, 64, 8, 6, 8), (4, 3, 48, 5, 7, 4)])
@pytest.mark.interpreter
def test_q_scale_in_load_equals_the_model_chain(t, h, d, w, k, r2, cfg, dtype, mode):
    """q's row scales in the kernel's load (pass A's fold of V4's q RMSNorm) are the model's norm, then its rotation:
    bit-equal to the unfused kernel on rms_norm's output, scales of every size (rows of 1e-3 to 1e3), ragged heads
    (3 of a 16-head block) and a padded D (48); within tolerance of the reference."""
    args = _case(t, h, d, w, k, dtype=dtype, seed=r2 + mode + 40)
    q = args[0] * torch.logspace(-3, 3, h).view(1, h, 1).to(dtype)  # row norms far from 1
    qs = _q_scale(q)
    cos, sin = _angles(t, r2, seed=mode)
    rope = dict(rope_cos=cos, rope_sin=sin, rope_mode=mode) if mode else {}
    out = launch(q, *args[1:], 0.2, q_scale=qs, **rope, **cfg)
    assert torch.equal(out, launch(rms_norm(q, None, 1e-6), *args[1:], 0.2, **rope, **cfg))
    _close_to_ref(out, sparse_attention_ref(q, *args[1:], 0.2, cos, sin, mode, q_scale=qs))


@pytest.mark.interpreter
def test_q_scale_is_checked_and_opcheck():
    args = _case(5, 3, 32, 4, 3, seed=14)
    qs = _q_scale(args[0])
    for bad, what in ((qs[:4], r"\(4, 3, 1\) torch.float32"), (qs.double(), r"\(5, 3, 1\) torch.float64"),
                      (qs.view(5, 1, 3), r"\(5, 1, 3\) torch.float32")):
        with pytest.raises(ValueError, match=r"q_scale must be \[T=5, H=3\] or \[T, H, 1\] float32, got " + what):
            sparse_attention(*args, 0.3, q_scale=bad)
    assert torch.equal(sparse_attention(*args, 0.3, q_scale=qs), sparse_attention(*args, 0.3, q_scale=qs[..., 0]))
    torch.testing.assert_close(sparse_attention(*args, 0.3, q_scale=qs),
                               sparse_attention(*args, 0.3, backend="ref", q_scale=qs), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.minidi.sparse_attention.default, (*args, 0.3, None, None, 0, qs))


# ---- realistic sizes on the GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", VARIANTS + [dict(num_stages=3), dict(nsplit=2, num_warps=4, BLOCK_K=32)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_gpu_bf16_v41_shape(cfg):
    t, h, d, w, k = 512, 64, 512, 128, 512
    args = _case(t, h, d, w, k, nw=t + w, nc=4096, dtype=torch.bfloat16, seed=1, device="cuda")
    out = launch(*args, d**-0.5, **cfg)
    ref = sparse_attention_ref(*args, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,d,w,k", [(64, 64, 512, 128, 512), (33, 20, 72, 17, 45)])
def test_gpu_fp32_and_ragged(t, h, d, w, k):
    args = _case(t, h, d, w, k, seed=2, device="cuda")
    out = sparse_attention(*args, 0.1)
    assert (out.double() - _ref64(*args, 0.1)).abs().max().item() <= 5e-4
    args = _case(t, h, d, w, k, dtype=torch.bfloat16, seed=2, device="cuda")
    torch.testing.assert_close(sparse_attention(*args, 0.1).float(), sparse_attention_ref(*args, 0.1).float(),
                               **BF16_TOL)


@pytest.mark.gpu
def test_gpu_rounding_fixture():
    args = _rounding_fixture("cuda")
    ref = sparse_attention_ref(*args, 1.0).float()
    for cfg in VARIANTS:
        out = launch(*args, 1.0, **cfg).float()
        torch.testing.assert_close(out[:, :, 1], ref[:, :, 1], rtol=0, atol=1e-4)
        torch.testing.assert_close(out, ref, **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_gpu_rotations_equal_the_model_chain(cfg):
    """V4.1's shape (rope on the last 64 of 512 channels): bit-equal to eager's rotations around the unfused kernel
    (no fused multiply-add in the rotation)."""
    t, h, d, w, k = 256, 64, 512, 128, 512
    args = _case(t, h, d, w, k, nw=t + w, nc=4096, dtype=torch.bfloat16, seed=3, device="cuda")
    cos, sin = _angles(t, 32, device="cuda")
    out = launch(*args, d**-0.5, rope_cos=cos, rope_sin=sin, rope_mode=ROPE_Q | ROPE_OUT, **cfg)
    base = launch(apply_rope(args[0], cos, sin), *args[1:], d**-0.5, **cfg)
    assert torch.equal(out, apply_rope(base, cos, sin, inverse=True))
