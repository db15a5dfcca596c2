"""minidi::moe_activation vs the model's own ops (CPU under TRITON_INTERPRET=1; @gpu at the V4.1-Flash shape).

Exact on the interpreter: SwiGLU in fp32, one bf16 rounding (ties to even), the fq8 block scale and the e4m3 grid by
bit arithmetic. The rows past offs[-1] are never written (poisoned outputs keep their poison)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from minidi.formats import pow2_ceil
from minidi.model.moe import swiglu_clipped
from minidi.model.quant import fq8
from minidi.ops import _triton_utils
from minidi.ops._triton_utils import round_bf16 as _round_bf16
from minidi.ops._triton_formats import pow2_ceil as _pow2_ceil
from minidi.ops._triton_formats import round_e4m3 as _round_e4m3
from minidi.ops.moe_activation import grid_step, launch, moe_activation, moe_activation_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 12345.0
gpu = pytest.mark.gpu


def make(r, i, counts, dtype, scale=4.0, seed=0, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(r, i, generator=gen) * scale).to(dtype)
    v = (torch.randn(r, i, generator=gen) * scale).to(dtype)
    ws = torch.rand(r, 1, generator=gen)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return g.to(device), v.to(device), ws.to(device), offs.to(device)


def assert_matches(out, ref, dtype, block, max_share=1e-3):
    """Equal, but for a few elements where exp's last fp32 bit (interpreter / GPU vs torch) moved the value across a
    rounding boundary: each of those within one step of the grid it was rounded to (e4m3 with fake quant, else bf16
    or, in fp32, a few fp32 ulps)."""
    o, r = out.double(), ref.double()
    if o.numel() == 0:
        return
    if dtype == torch.float32 and not block:  # nothing rounds the fp32 SwiGLU: a few ulps everywhere
        torch.testing.assert_close(o, r, rtol=2.0**-20, atol=1e-30, equal_nan=True)
        return
    diff = o != r
    assert diff.double().mean().item() <= max_share, diff.sum().item()
    step = 2.0**-3 if block else 2.0**-7
    assert ((o - r).abs() <= r.abs() * step + 1e-30)[diff].all()


def run(g, v, ws, offs, limit, block, walk=None):
    out = torch.full_like(g, POISON)
    launch(g, v, ws, offs, limit, block or 0, out, walk_per_sm=walk)
    return out


# ragged: empty experts (first, middle, last), offs[-1] < R (other ranks' rows), offs[-1] == R, no local rows
CASES = [  # (R, I, counts)
    (37, 256, [5, 0, 15, 10]),
    (24, 384, [0, 24]),
    (19, 128, [0, 0]),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [128, 64, None])
@pytest.mark.parametrize("walk", [None, 3], ids=["tile_grid", "walk3"])  # walk: 3 programs walk the local tiles
def test_equals_the_model_ops_on_local_rows(case, dtype, block, walk):
    r, i, counts = case
    g, v, ws, offs = make(r, i, counts, dtype)
    n = int(offs[-1])
    out = run(g, v, ws, offs, 10.0, block, walk)
    ref = moe_activation_ref(g, v, ws, offs, 10.0, block)
    assert_matches(out[:n], ref[:n], dtype, block)
    assert (out[n:] == POISON).all()
    model = (swiglu_clipped(g, v, 10.0) * ws).to(dtype)  # the reference really is the model's chain
    assert torch.equal(ref, fq8(model, block) if block else model)


def test_grid_step():
    ref = torch.tensor([[448.0, 1.0, 0.0] + [0.0] * 125])  # one block of 128: scale 1, e4m3 steps 32, 0.125, 2^-9
    step = grid_step(ref, 128)
    assert step[0, :3].tolist() == [56.0, 0.125, 2.0**-9]
    assert grid_step(ref, None)[0, :2].tolist() == [448.0 * 2.0**-7, 2.0**-7]


def test_edge_values():
    """Clipping (|g|, |v| above the limit), an all-zero block (amax floor 1e-4), tiny values (e4m3 subnormals after the
    scale), a block whose max lands on 448; a NaN stays NaN (the rest of its block scaled by the finite amax)."""
    r, i = 8, 128
    g, v, ws, offs = make(r, i, [r], torch.float32, scale=1.0, seed=3)
    g[0, :64], v[0, 64:] = 50.0, -50.0  # clipped
    g[1], v[1] = 0.0, 0.0  # all-zero block
    g[2] *= 1e-4  # tiny
    g[3, 0], v[3, 0], ws[3] = 10.0, 10.0, 1.0  # the block max
    out = run(g, v, ws, offs, 10.0, 128)
    ref = moe_activation_ref(g, v, ws, offs, 10.0, 128)
    assert_matches(out, ref, torch.float32, 128, max_share=0.01)
    assert (out[1] == 0).all()
    g[5, 7] = float("nan")
    out = run(g, v, ws, offs, 10.0, 128)
    assert out[5, 7].isnan() and out[5].isnan().sum() == 1 and not out[:5].isnan().any()


@triton.jit
def _rounding_probe(x_ptr, e4_ptr, bf_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N, other=0.0)
    tl.store(e4_ptr + i, _round_e4m3(tl.minimum(tl.maximum(x, -448.0), 448.0)), mask=i < N)
    tl.store(bf_ptr + i, _round_bf16(x), mask=i < N)


def test_e4m3_and_bf16_rounding_bit_exact():
    """The kernel's bit-arithmetic roundings equal torch's casts: every e4m3 value, the midpoints between them (ties
    to even), their neighbours, the subnormal range, +-0 and 448; bf16 on random values, ties, inf and NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = codes[codes.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                   torch.tensor([0.0, -0.0, 447.9, 1e-12, 2.0**-10, 3 * 2.0**-11])])
    x = torch.cat([x, -x])
    gen = torch.Generator().manual_seed(7)
    top = torch.randint(0, 0x7F80, (64,), dtype=torch.int32, generator=gen)  # finite bf16 patterns
    bf_ties = (top << 16 | 0x8000).view(torch.float32)  # exactly halfway between two bf16 values
    y = torch.cat([x, bf_ties, -bf_ties, torch.randn(512, generator=gen) * 1e3,
                   torch.tensor([float("inf"), -float("inf"), float("nan")])])
    yd = y.to(DEV)
    e4, bf = torch.empty_like(yd), torch.empty_like(yd)
    _rounding_probe[(triton.cdiv(y.numel(), 128),)](yd, e4, bf, y.numel(), BLOCK=128)
    n = x.numel()
    assert torch.equal(e4.cpu()[:n], x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(bf.cpu()[:-1], y[:-1].bfloat16().float()) and bf.cpu()[-1].isnan()


@triton.jit
def _pow2_probe(x_ptr, o_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + i, _pow2_ceil(tl.load(x_ptr + i, mask=i < N, other=1.0)), mask=i < N)


def test_pow2_ceil_twin():
    """The kernel's ``_pow2_ceil`` equals ``minidi.formats.pow2_ceil`` (the fq8 scale) bit for bit: powers of two,
    their neighbours, the smallest and largest normals, random positive normals."""
    gen = torch.Generator().manual_seed(3)
    p2 = 2.0 ** torch.arange(-126, 127, dtype=torch.float64)
    x = torch.cat([p2.float(), p2.float().nextafter(torch.tensor(0.0)), p2.float().nextafter(torch.tensor(1e38)),
                   torch.tensor([torch.finfo(torch.float32).tiny, 1e-4 / 448, 3.0, 448.0 * 1.5]),
                   torch.rand(512, generator=gen) * 1e3 + 1e-30])
    x = x[(x >= torch.finfo(torch.float32).tiny) & (x < 2.0**127)]  # positive normals with a normal ceiling
    out = torch.empty_like(x, device=DEV)
    _pow2_probe[(triton.cdiv(x.numel(), 128),)](x.to(DEV), out, x.numel(), BLOCK=128)
    assert torch.equal(out.cpu(), pow2_ceil(x))


def test_ref_backend_public_op_and_compile():
    g, v, ws, offs = make(37, 256, [5, 0, 15, 10], torch.bfloat16)
    n = int(offs[-1])
    out = moe_activation(g, v, ws.flatten(), offs, 10.0, 128)
    assert torch.equal(out[:n], moe_activation(g, v, ws, offs, 10.0, 128, backend="ref")[:n])
    f = torch.compile(lambda *a: moe_activation(*a, 10.0, 128) * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(g, v, ws, offs)[:n], out[:n] * 2)
    g2, v2, ws2, offs2 = make(12, 128, [12], torch.bfloat16)  # every row local: nothing left unwritten
    torch.library.opcheck(torch.ops.minidi.moe_activation.default, (g2, v2, ws2, offs2, 10.0, 128))


def test_clear_errors(monkeypatch):
    g, v, ws, offs = make(8, 128, [8], torch.bfloat16)
    with pytest.raises(ValueError, match="g must be"):
        moe_activation(g.half(), v, ws, offs, 10.0, 128)
    with pytest.raises(ValueError, match="v must match"):
        moe_activation(g, v[:4], ws, offs, 10.0, 128)
    with pytest.raises(ValueError, match="ws must be"):
        moe_activation(g, v, ws.bfloat16(), offs, 10.0, 128)
    with pytest.raises(ValueError, match="ws must be"):
        moe_activation(g, v, ws[:4], offs, 10.0, 128)
    with pytest.raises(ValueError, match="offs must be"):
        moe_activation(g, v, ws, offs.long(), 10.0, 128)
    with pytest.raises(ValueError, match="block must be"):
        moe_activation(g, v, ws, offs, 10.0, 96)
    with pytest.raises(ValueError, match="backend"):
        moe_activation(g, v, ws, offs, 10.0, 128, backend="cuda")
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)  # as if imported without TRITON_INTERPRET=1
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="backend='auto'"):
            moe_activation(g, v, ws, offs, 10.0, 128, backend="triton")
        assert torch.equal(moe_activation(g, v, ws, offs, 10.0, 128),  # auto: the reference here
                           moe_activation(g, v, ws, offs, 10.0, 128, backend="ref"))


@gpu
@pytest.mark.parametrize("block", [128, None])
@pytest.mark.parametrize("walk", [None, 8], ids=["tile_grid", "walk8"])
def test_gpu_v41_shape(block, walk):
    """EP4-like: 8,192 rows, a quarter local, I 2,304. exp may differ from torch's in the last fp32 bit: equal but for
    rare elements, each within one e4m3 step (one bf16 ulp without fake quant)."""
    g, v, ws, offs = make(8192, 2304, [64] * 32, torch.bfloat16, device="cuda")
    n = int(offs[-1])
    out = run(g, v, ws, offs, 10.0, block, walk)
    ref = moe_activation_ref(g, v, ws, offs, 10.0, block)
    assert (out[n:] == POISON).all()
    d = out[:n].float() != ref[:n].float()
    assert d.float().mean().item() < 1e-4
    assert ((out[:n].float() - ref[:n].float()).abs() <= grid_step(ref[:n], block) + 1e-30).all()
