"""minidi::fp4_dequant / fp4_dequant_into vs the plain-torch dequant (CPU under TRITON_INTERPRET=1; @gpu on CUDA).

Tolerance: none. Every output must be bit-identical to ``(e2m1 * 2^(b-127)).to(dtype)`` computed in fp32 (NaN where
the reference is NaN, any NaN payload).
Legend: E experts, O rows, I values per row (I/2 packed bytes), S = ceil(I/32) scales per row.
"""

from __future__ import annotations

import pytest
import torch

from minidi.ops.fp4_dequant import fp4_dequant, fp4_dequant_into, fp4_dequant_ref

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2^127 -> inf, on purpose
DEV = "cuda" if torch.cuda.is_available() else "cpu"
INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def assert_bits_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    iv = INT_VIEW[ref.dtype]
    assert torch.equal(out.view(iv)[~nan], ref.view(iv)[~nan])  # includes -0.0, +-inf, subnormals


def random_weights(e: int, o: int, i: int, device="cpu", exp_lo: int = 110, exp_hi: int = 135):
    packed = torch.randint(-128, 128, (e, o, i // 2), dtype=torch.int8, device=device)
    scale = torch.randint(exp_lo, exp_hi, (e, o, -(-i // 32)), dtype=torch.uint8, device=device)
    return packed, scale.view(torch.float8_e8m0fnu)


def all_codes(device="cpu"):
    """[1, 256, 256] packed: row b holds every byte 0..255 under exponent byte b (16 scale groups per row)."""
    packed = torch.arange(256, device=device).to(torch.uint8).view(torch.int8).repeat(256, 1)[None]
    scale = torch.arange(256, device=device).to(torch.uint8)[:, None].repeat(1, 16)[None]
    return packed, scale.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_all_bytes_times_all_exponents_bit_exact(dtype):
    packed, scale = all_codes()
    out = fp4_dequant(packed, scale, dtype)
    ref = fp4_dequant_ref(packed, scale, dtype)
    assert_bits_equal(out, ref)
    assert ref.isnan().any() and ref.isinf().any() and (torch.signbit(ref) & (ref == 0)).any()  # edge codes covered


@pytest.mark.parametrize("shape", [(3, 37, 96), (2, 5, 80), (1, 9, 544), (4, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ragged_shapes(shape, dtype):
    torch.manual_seed(sum(shape))
    packed, scale = random_weights(*shape)
    assert_bits_equal(fp4_dequant(packed, scale, dtype), fp4_dequant_ref(packed, scale, dtype))


def test_two_dim_input_and_uint8_scale():
    torch.manual_seed(1)
    packed, scale = random_weights(1, 19, 128)
    out = fp4_dequant(packed[0], scale[0].view(torch.uint8))
    assert out.shape == (19, 128)
    assert_bits_equal(out, fp4_dequant_ref(packed[0], scale[0], torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_into_slice_leaves_the_rest_untouched(dtype):
    torch.manual_seed(2)
    e, o, i = 3, 11, 96
    packed, scale = random_weights(e, o, i)
    stack = torch.full((5, 2 * o, i), float("nan"), dtype=dtype)  # poisoned [E_total, 2*O, I] (a w13-style stack)
    before = stack.clone()
    fp4_dequant_into(packed, scale, stack[1:4, o:])  # experts 1..3, second half of the rows: non-contiguous slice
    ref = fp4_dequant_ref(packed, scale, dtype)
    assert_bits_equal(stack[1:4, o:], ref)
    mask = torch.ones(stack.shape, dtype=torch.bool)
    mask[1:4, o:] = False
    iv = INT_VIEW[dtype]
    assert torch.equal(stack.view(iv)[mask], before.view(iv)[mask])


def test_into_full_buffer_poisoned():
    torch.manual_seed(3)
    packed, scale = random_weights(2, 7, 64)
    out = torch.full((2, 7, 64), float("nan"), dtype=torch.bfloat16)
    fp4_dequant_into(packed, scale, out)
    assert_bits_equal(out, fp4_dequant_ref(packed, scale, torch.bfloat16))


def test_empty():
    packed, scale = random_weights(0, 4, 64)
    assert fp4_dequant(packed, scale).shape == (0, 4, 64)


def test_opcheck():
    torch.manual_seed(4)
    packed, scale = random_weights(2, 3, 64)
    scale = scale.view(torch.uint8)  # opcheck's schema check cannot compare float8_e8m0fnu tensors on the CPU
    torch.library.opcheck(torch.ops.minidi.fp4_dequant.default, (packed, scale, torch.bfloat16))
    out = torch.full((2, 3, 64), float("nan"), dtype=torch.float32)
    torch.library.opcheck(torch.ops.minidi.fp4_dequant_into.default, (packed, scale, out))


def test_clear_errors(monkeypatch):
    packed, scale = random_weights(2, 4, 64)
    with pytest.raises(ValueError, match="packed must be"):
        fp4_dequant(packed.float(), scale)
    with pytest.raises(ValueError, match="scale must be"):
        fp4_dequant(packed, scale[..., :1])
    with pytest.raises(ValueError, match="scale must be"):
        fp4_dequant(packed, scale.view(torch.uint8).float())
    with pytest.raises(ValueError, match="dtype must be"):
        fp4_dequant(packed, scale, torch.float16)
    with pytest.raises(ValueError, match="share a device"):
        fp4_dequant(packed, scale.to("meta"))
    with pytest.raises(ValueError, match="out must be"):
        fp4_dequant_into(packed, scale, torch.empty(2, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        fp4_dequant_into(packed, scale, torch.empty(2, 4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="unit stride"):
        fp4_dequant_into(packed, scale, torch.empty(2, 64, 4, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match="backend"):
        fp4_dequant(packed, scale, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fp4_dequant(packed, scale)
    assert_bits_equal(fp4_dequant(packed, scale, backend="ref"), fp4_dequant_ref(packed, scale, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_all_codes(dtype):
    packed, scale = all_codes(DEV)
    assert_bits_equal(fp4_dequant(packed, scale, dtype), fp4_dequant_ref(packed, scale, dtype))


@pytest.mark.gpu
def test_gpu_bench_shapes_and_into():
    torch.manual_seed(5)
    for o, i in ((2304, 5120), (5120, 2304), (333, 1000)):
        packed, scale = random_weights(4, o, i, DEV)
        assert_bits_equal(fp4_dequant(packed, scale), fp4_dequant_ref(packed, scale, torch.bfloat16))
    packed, scale = random_weights(4, 2304, 5120, DEV)
    w13 = torch.full((6, 2 * 2304, 5120), float("nan"), dtype=torch.bfloat16, device=DEV)
    fp4_dequant_into(packed, scale, w13[1:5, 2304:])
    assert_bits_equal(w13[1:5, 2304:], fp4_dequant_ref(packed, scale, torch.bfloat16))
    assert w13[1:5, :2304].isnan().all() and w13[0].isnan().all() and w13[5].isnan().all()
