"""The sm_90 Gluon kernel of minidi::sparse_attention (``minidi/ops/sparse_attention_sm90.py``) vs the op's references.

GPU tests (marker ``gpu``) run only where the kernel can run (an sm_90 device, Triton 3.6 with Gluon); elsewhere they
skip, and the CPU test checks that the dispatch never picks the kernel there. Tolerances as
``test_sparse_attention.py``: bf16 vs ``sparse_attention_ref`` |out - ref| <= 2^-7 |ref| + 4e-3; the rounding fixture
(padded to D 512 and 64 heads with zeros, which add nothing) to 1e-4 on its cancelling outputs; the folded rotations
bit-equal to eager's ``apply_rope`` around the kernel without them. Outputs are poisoned (NaN) before each run.
"""

from __future__ import annotations

import pytest
import torch

from minidi.model.layers import apply_rope
from minidi.ops import _triton_utils
from minidi.ops import sparse_attention_sm90 as sm90
from minidi.ops.sparse_attention import ROPE_OUT, ROPE_Q, encode_slots, launch, sparse_attention_ref

from .test_sparse_attention import BF16_TOL, _angles, _case, _rounding_fixture


def _runs() -> bool:
    return (torch.cuda.is_available() and sm90.gluon_supported()
            and torch.cuda.get_device_capability() == (9, 0))


needs_sm90 = pytest.mark.skipif(not _runs(), reason="needs an sm_90 GPU and Triton 3.6 with Gluon")


def _gluon(q, wkv, widx, ckv, cidx, sink, scale, cos=None, sin=None, mode=0) -> torch.Tensor:
    """The Gluon kernel alone, into a NaN-poisoned output (every element must be written)."""
    comp_off = (ckv.data_ptr() - wkv.data_ptr()) // 2 if ckv is not None else 0
    assert sm90.can_run(q, wkv, comp_off, cos.shape[-1] if mode else 0)
    code = encode_slots(widx, cidx, wkv.shape[0], ckv.shape[0] if ckv is not None else 0)
    out = torch.full_like(q, float("nan"))
    sm90.launch_sm90(q, wkv, code, sink, out, comp_off, scale, cos, sin, mode)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten (poisoned) outputs"
    return out


def test_cpu_never_picks_the_sm90_kernel():
    q, wkv, widx, ckv, cidx, sink = _case(3, 64, 512, 4, 3, dtype=torch.bfloat16)
    assert not sm90.can_run(q, wkv, 0, 0)
    if _triton_utils.interpreting():  # the CPU run of the op (the interpreter): the Triton kernel
        info: dict = {}
        launch(q, wkv, widx, ckv, cidx, sink, 0.1, info=info)
        assert info.get("impl") != "gluon_sm90"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("t,h,w,k,comp", [(512, 64, 128, 512, True), (37, 128, 17, 45, True), (65, 64, 128, 0, False),
                                          (9, 64, 5, 3, True)])
def test_gpu_matches_reference(t, h, w, k, comp):
    """Ragged T, 64 / 128 heads, -1 slots anywhere (25 %), a query with no compressed key, fewer keys than a block
    (W+K 62 and 8), window-only layers; fresh random inputs per case."""
    args = _case(t, h, 512, w, max(k, 1), nw=t + w + 3, nc=4096, dtype=torch.bfloat16, seed=t + h, device="cuda",
                 comp=comp)
    out = _gluon(*args, 512**-0.5)
    ref = sparse_attention_ref(*args, 512**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)
    info: dict = {}
    auto = launch(*args, 512**-0.5, info=info)  # the op's default dispatch picks the Gluon kernel here
    assert info.get("impl") == "gluon_sm90"
    assert torch.equal(auto, out)


@pytest.mark.gpu
@needs_sm90
def test_gpu_fewer_valid_keys_and_empty_rows():
    """Most slots empty, out-of-range indices, NaN rows where empty slots point, queries with no valid key (-> 0)."""
    t, h, d, w, k = 40, 64, 512, 128, 512
    q, wkv, widx, ckv, cidx, sink = _case(t, h, d, w, k, nw=t + w + 3, nc=4096, dtype=torch.bfloat16, seed=7,
                                          device="cuda")
    g = torch.Generator(device="cuda").manual_seed(8)
    cidx[torch.rand(t, k, device="cuda", generator=g) < 0.9] = -1
    cidx[2, :5] = ckv.shape[0] + 3  # out of range = empty
    widx[3], cidx[3] = -1, -1  # no valid key at all
    ckv[0] = float("nan")  # index 0 is never referenced below: a NaN there must not leak through masked slots
    cidx = torch.where(cidx == 0, 1, cidx)
    out = _gluon(q, wkv, widx, ckv, cidx, sink, 0.05)
    ref = sparse_attention_ref(q, wkv, widx, ckv, torch.where(cidx >= ckv.shape[0], -1, cidx), sink, 0.05)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    keep = torch.arange(t, device="cuda") != 3
    torch.testing.assert_close(out[keep].float(), ref[keep].float(), **BF16_TOL)


@pytest.mark.gpu
@needs_sm90
def test_gpu_rounding_fixture():
    """The bf16 probability rounding and the sink outside the max, at the kernel's shape: the fixture's 3 heads and
    36 channels padded with zeros to 64 heads x 512 (zero channels and heads add nothing to the other outputs)."""
    q, wkv, widx, ckv, cidx, sink = _rounding_fixture("cuda")
    t, h, d = q.shape
    qp = torch.zeros(t, 64, 512, dtype=q.dtype, device="cuda")
    qp[:, :h, :d] = q
    wp = torch.zeros(wkv.shape[0], 512, dtype=q.dtype, device="cuda")
    wp[:, :d] = wkv
    cp = torch.zeros(ckv.shape[0], 512, dtype=q.dtype, device="cuda")
    cp[:, :d] = ckv
    sp = torch.full((64,), -30.0, device="cuda")
    sp[:h] = sink
    out = _gluon(qp, wp, widx.cuda(), cp, cidx.cuda(), sp, 1.0)[:, :h, :d].float()
    ref = sparse_attention_ref(q, wkv, widx, ckv, cidx, sink, 1.0).float()
    torch.testing.assert_close(out[:, :, 1], ref[:, :, 1], rtol=0, atol=1e-4)
    torch.testing.assert_close(out, ref, **BF16_TOL)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("mode", [ROPE_Q, ROPE_OUT, ROPE_Q | ROPE_OUT])
def test_gpu_rotations_equal_the_model_chain(mode):
    """V4.1's shape (rope on the last 64 of 512 channels): bit-equal to eager's rotations around the kernel."""
    t, h, d, w, k = 256, 64, 512, 128, 512
    args = _case(t, h, d, w, k, nw=t + w, nc=4096, dtype=torch.bfloat16, seed=3, device="cuda")
    cos, sin = _angles(t, 32, device="cuda")
    out = _gluon(*args, d**-0.5, cos, sin, mode)
    q = apply_rope(args[0], cos, sin) if mode & ROPE_Q else args[0]
    base = _gluon(q, *args[1:], d**-0.5)
    assert torch.equal(out, apply_rope(base, cos, sin, inverse=True) if mode & ROPE_OUT else base)
