"""minidi::gate_tf32x3 vs float64 and the fp32 router (CPU under TRITON_INTERPRET=1; @gpu on CUDA).

Tolerance: max|out - ref64| / max|ref64| <= 1e-5 (fp32 level; the split drops terms of ~2^-22 relative). Top-6 expert
choices of sqrt(softplus(logits)) + bias must equal the fp32 reference's, except where the reference's own gap between
its 6th and 7th scores is below 1e-5 (a near-tie that any fp32-level difference may flip). On the CPU interpreter the
dots are exact fp32, so this checks the split algebra; the GPU tests check the tensor-core rounding: Hopper's MMA
accumulation truncates (round toward zero), the kernel sums per-K-block partials in IEEE fp32 (see the op's docstring),
and ``test_gpu_long_k`` checks that the error does not grow linearly with D (the signature of one long MMA chain).
Legend: T tokens, D width, E experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minidi.ops import _triton_utils
from minidi.ops.gate_tf32x3 import gate_tf32x3, gate_tf32x3_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("no_tf32")  # fp32 references in full fp32 (tests/conftest.py)
COMBOS = [(torch.bfloat16, torch.bfloat16, "tf32"), (torch.float32, torch.bfloat16, "tf32"),
          (torch.float32, torch.bfloat16, "bf16x3"), (torch.bfloat16, torch.float32, "tf32"),
          (torch.float32, torch.float32, "tf32")]
BUILTIN = [(torch.float32, torch.bfloat16, "tf32x3_builtin"), (torch.float32, torch.float32, "tf32x3_builtin")]


def make(t, e, d, x_dtype, w_dtype, device="cpu"):
    x = torch.randn(t, d, device=device).to(x_dtype)
    w = (torch.randn(e, d, device=device) * d**-0.5).to(w_dtype)
    return x, w


def rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.double() @ w.double().t()
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def assert_same_top6(logits: torch.Tensor, ref: torch.Tensor, bias: torch.Tensor) -> None:
    """Top-6 of sqrt(softplus(.)) + bias agree, except on rows where ref's 6th/7th scores nearly tie."""
    s_out = torch.sqrt(F.softplus(logits)) + bias
    s_ref = torch.sqrt(F.softplus(ref)) + bias
    top_out = s_out.topk(6, dim=-1).indices.sort(-1).values
    top_ref = s_ref.topk(6, dim=-1).indices.sort(-1).values
    differ = (top_out != top_ref).any(-1)
    v = s_ref.topk(7, dim=-1).values
    near_tie = (v[:, 5] - v[:, 6]).abs() < 1e-5
    assert not (differ & ~near_tie).any(), f"{int(differ.sum())} rows differ, {int(near_tie.sum())} near ties"


@pytest.mark.parametrize("x_dtype,w_dtype,split", COMBOS + BUILTIN[:1])
def test_fp32_level_error_and_top6(x_dtype, w_dtype, split):
    torch.manual_seed(0)
    t, e, d = 50, 384, 160
    x, w = make(t, e, d, x_dtype, w_dtype)
    out = gate_tf32x3(x, w, x_split=split)
    assert out.shape == (t, e) and out.dtype == torch.float32
    assert rel_err(out, x, w) <= 1e-5
    bias = torch.randn(e) * 0.1
    assert_same_top6(out, gate_tf32x3_ref(x, w), bias)


@pytest.mark.parametrize("t,e,d", [(1, 5, 7), (65, 129, 65), (3, 40, 200), (130, 3, 33)])
@pytest.mark.parametrize("x_dtype,w_dtype,split", [COMBOS[0], COMBOS[1], COMBOS[4]])
def test_ragged(t, e, d, x_dtype, w_dtype, split):
    torch.manual_seed(t + e + d)
    x, w = make(t, e, d, x_dtype, w_dtype)
    out = gate_tf32x3(x, w, x_split=split)
    assert torch.isfinite(out).all()
    assert rel_err(out, x, w) <= 1e-5


def test_strided_inputs():
    torch.manual_seed(1)
    x, w = make(20, 30, 96, torch.float32, torch.bfloat16)
    xs, ws = x[::2, :80], w[:, 8:88]  # row strides != D
    assert rel_err(gate_tf32x3(xs, ws), xs, ws) <= 1e-5


def test_empty():
    x, w = make(0, 8, 32, torch.bfloat16, torch.bfloat16)
    assert gate_tf32x3(x, w).shape == (0, 8)


@pytest.mark.interpreter
def test_opcheck():
    torch.manual_seed(2)
    x, w = make(5, 6, 40, torch.float32, torch.bfloat16)
    torch.library.opcheck(torch.ops.minidi.gate_tf32x3.default, (x, w, "tf32"))


def test_clear_errors(monkeypatch):
    x, w = make(4, 6, 32, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        gate_tf32x3(x.half(), w)
    with pytest.raises(ValueError, match="weight must be"):
        gate_tf32x3(x, w[:, :16])
    with pytest.raises(ValueError, match="weight must be"):
        gate_tf32x3(x, w.half())
    with pytest.raises(ValueError, match="share a device"):
        gate_tf32x3(x, w.to("meta"))
    with pytest.raises(ValueError, match="x_split"):
        gate_tf32x3(x, w, x_split="fp16")
    with pytest.raises(ValueError, match="backend"):
        gate_tf32x3(x, w, backend="cuda")
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)  # as if imported without TRITON_INTERPRET=1
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET.*backend='auto'"):
        gate_tf32x3(x, w, backend="triton")
    assert torch.equal(gate_tf32x3(x, w, backend="ref"), x.float() @ w.float().t())
    assert torch.equal(gate_tf32x3(x, w), x.float() @ w.float().t())  # auto: the reference here


@pytest.mark.parametrize("t,e", [(37, 24), (5, 4), (70, 64)])
def test_thin_outputs_mhc_projection(t, e):
    """Pass F's use: bf16 streams [T, n D] x fp32 fn [(2 + n) n, n D] (thin tiles, E <= THIN_N), poisoned output
    buffer fully overwritten, fp32-level error against float64."""
    from minidi.ops import gate_tf32x3 as op

    assert op.default_config(t, e, 1280, torch.bfloat16, torch.float32)["BLOCK_N"] == max(16, 1 << (e - 1).bit_length())
    torch.manual_seed(6)
    x, w = make(t, e, 1280, torch.bfloat16, torch.float32, DEV)
    out = torch.full((t, e), float("nan"), device=DEV)
    op.launch(x, w, out)
    assert torch.isfinite(out).all()
    assert rel_err(out, x, w) <= 1e-5
    assert rel_err(gate_tf32x3(x, w), x, w) <= 1e-5


@pytest.mark.parametrize("d,split_k", [(1280, 3), (1000, 3), (1000, 8), (64, 4), (130, 2)])
@pytest.mark.parametrize("x_dtype,w_dtype,split", [COMBOS[0], COMBOS[3], COMBOS[4]])
def test_split_k(d, split_k, x_dtype, w_dtype, split):
    """K split over grid axis 1 into whole BLOCK_K chunks (ragged last chunk; more splits asked than chunks exist),
    planes added in fp32: same error level, poisoned output fully overwritten."""
    from minidi.ops import gate_tf32x3 as op

    torch.manual_seed(8)
    x, w = make(37, 24, d, x_dtype, w_dtype, DEV)
    out = torch.full((37, 24), float("nan"), device=DEV)
    op.launch(x, w, out, split, BLOCK_K=64, SPLIT_K=split_k)
    assert torch.isfinite(out).all()
    assert rel_err(out, x, w) <= 1e-5


@pytest.mark.gpu
def test_gpu_mhc_shape():
    """The mHC mixer at full size: T 4,096 x K 20,480 (4 streams x 5,120) x 24, bf16 x, fp32 fn."""
    torch.manual_seed(7)
    x, w = make(4096, 24, 20480, torch.bfloat16, torch.float32, DEV)
    err = rel_err(gate_tf32x3(x, w), x, w)
    print(f"mHC shape: rel err {err:.2e} (fp32 matmul {rel_err(gate_tf32x3_ref(x, w), x, w):.2e})")
    assert err <= 1e-5
    from minidi.ops import gate_tf32x3 as op

    for split_k in (2, 8, 32):
        out = torch.full((4096, 24), float("nan"), device=DEV)
        op.launch(x, w, out, SPLIT_K=split_k)
        assert rel_err(out, x, w) <= 1e-5, split_k


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype,w_dtype,split", COMBOS + BUILTIN)
def test_gpu_bench_shape(x_dtype, w_dtype, split):
    torch.manual_seed(3)
    t, e, d = 4096, 384, 5120
    x, w = make(t, e, d, x_dtype, w_dtype, DEV)
    out = gate_tf32x3(x, w, x_split=split)
    err = rel_err(out, x, w)
    ref = gate_tf32x3_ref(x, w)
    print(f"{x_dtype} x {w_dtype} ({split}): rel err {err:.2e} (fp32 matmul {rel_err(ref, x, w):.2e})")
    assert err <= 1e-5
    assert_same_top6(out, ref, torch.randn(e, device=DEV) * 0.1)


@pytest.mark.gpu
def test_gpu_ragged():
    torch.manual_seed(4)
    for t, e, d in ((1, 384, 5120), (1000, 257, 999), (77, 7, 4096)):
        for x_dtype, w_dtype, split in COMBOS + BUILTIN:
            x, w = make(t, e, d, x_dtype, w_dtype, DEV)
            err = rel_err(gate_tf32x3(x, w, x_split=split), x, w)
            assert err <= 1e-5, (t, e, d, x_dtype, w_dtype, split, err)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype,w_dtype,split", COMBOS)
def test_gpu_long_k(x_dtype, w_dtype, split):
    """D 4x the model width: an unpromoted MMA chain would give ~4x the bench-shape error (~1e-4); promoted, the
    error grows like sqrt(D) at most and stays at fp32 level."""
    torch.manual_seed(5)
    x, w = make(512, 384, 20480, x_dtype, w_dtype, DEV)
    err = rel_err(gate_tf32x3(x, w, x_split=split), x, w)
    print(f"{x_dtype} x {w_dtype} ({split}) D 20480: rel err {err:.2e}")
    assert err <= 1e-5
