"""Weight formats and fake-quant (spec V4.1 §11-12, V4 §10) against independent float64 references.

Every reference here is written from the spec text with Python floats / float64 tensors: the e4m3, e2m1 and E8M0
value tables are decoded from their bit layouts, rounding is a brute-force nearest search with ties to the even
code, and power-of-two scales use an exact ``frexp``-based ceil(log2). None of it calls the code under test.
Comparisons are bit-exact (sign of zero included) unless a tolerance is stated.
"""

from __future__ import annotations

import math

import pytest
import torch

from minidi.model import quant

DTYPES = (torch.float32, torch.bfloat16)


# ---- independent tables ------------------------------------------------------------------------------------------
def _e4m3_value(code: int) -> float:
    """float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf; S.1111.111 is NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * (m / 8.0) * 2.0**-6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


E4M3_TABLE = [_e4m3_value(c) for c in range(256)]
E4M3_POS = torch.tensor(E4M3_TABLE[:127], dtype=torch.float64)  # codes 0..126: 0 .. 448, ascending
E2M1_POS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)  # codes 0..7


def _nibble_value(n: int) -> float:
    mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][n & 7]
    return -mag if n & 8 else mag  # code 8 is -0.0


def _e8m0_value(b: int) -> float:
    return math.nan if b == 255 else 2.0 ** (b - 127)


def _ceil_log2(y: float) -> int:
    """Exact ceil(log2(y)) for y > 0: y = m * 2^e with m in [0.5, 1); exact power of two iff m == 0.5."""
    m, e = math.frexp(y)
    return e - 1 if m == 0.5 else e


def _rne_to_table(mag: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Nearest entry of an ascending table (index = code) to each |value|, ties to the even code. float64."""
    dist = (mag.reshape(-1, 1) - table.reshape(1, -1)).abs()
    best = dist == dist.min(dim=1, keepdim=True).values
    even = best & (torch.arange(table.numel()) % 2 == 0)
    pick = torch.where(even.any(1), even.to(torch.int8).argmax(1), best.to(torch.int8).argmax(1))
    return table[pick].reshape(mag.shape)


def _e4m3_rne(x: torch.Tensor) -> torch.Tensor:
    """Signed e4m3 round to nearest even, saturating at 448 (float64 in, float64 out)."""
    return torch.copysign(_rne_to_table(x.abs().clamp(max=448.0), E4M3_POS), x)


def _e2m1_rne(x: torch.Tensor) -> torch.Tensor:
    return torch.copysign(_rne_to_table(x.abs(), E2M1_POS), x)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape, NaN positions and bit patterns everywhere else (so -0.0 != +0.0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    bad = (_bits(got) != _bits(want)) & ~nan
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{int(bad.sum())} mismatches, first at {i}: got {got[tuple(i)].item()!r}, "
                             f"want {want[tuple(i)].item()!r}")


def _u8(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64).to(torch.uint8)


# ---- E8M0 --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_e8m0", [False, True])
def test_e8m0_all_codes(as_e8m0: bool) -> None:
    codes = _u8(range(256))
    if as_e8m0:
        codes = codes.view(torch.float8_e8m0fnu)
    got = quant.e8m0_to_float(codes)
    want = torch.tensor([_e8m0_value(b) for b in range(256)], dtype=torch.float64).float()
    assert want[0].item() == 2.0**-127 and want[0].item() > 0  # subnormal fp32, not flushed
    _assert_bit_equal(got, want)
    assert torch.isnan(got).nonzero().flatten().tolist() == [255]


def test_e8m0_encode_round_trip() -> None:
    codes = _u8(range(255))
    back = quant.float_to_e8m0(quant.e8m0_to_float(codes))
    assert back.dtype == torch.float8_e8m0fnu
    assert torch.equal(back.view(torch.uint8), codes)


# ---- FP4 e2m1 ----------------------------------------------------------------------------------------------------
def _fp4_grid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row r holds all 256 bytes (16 blocks of 32 elements); block j of row r uses exponent (r + 17 j) % 256.

    As r runs over 256 rows every (byte, exponent) pair is dequantised exactly once, and the per-block exponents
    differ within a row, so a wrong block -> scale mapping shows.
    """
    packed = _u8(range(256)).repeat(256, 1)  # [256 rows, 256 bytes]
    exps = (torch.arange(256).unsqueeze(1) + 17 * torch.arange(16).unsqueeze(0)) % 256  # [256 rows, 16 blocks]
    nib = torch.tensor([_nibble_value(n) for n in range(16)], dtype=torch.float64)
    sc = torch.tensor([_e8m0_value(b) for b in range(256)], dtype=torch.float64)
    b = packed.to(torch.int64)
    vals = torch.stack([nib[b & 0xF], nib[b >> 4]], dim=-1).reshape(256, 512)  # element 2i = low nibble
    want = vals * sc[exps].repeat_interleave(32, dim=1)  # [256, 512] float64
    return packed, exps, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed_dtype", [torch.int8, torch.uint8])
def test_dequant_fp4_all_bytes_all_exponents(dtype: torch.dtype, packed_dtype: torch.dtype) -> None:
    packed, exps, want64 = _fp4_grid()
    pairs = {(int(c), int(exps[r, c // 16])) for r in range(256) for c in range(0, 256, 5)}
    assert len(pairs) == 256 * len(range(0, 256, 5))  # coverage spot-check of the construction
    scale = _u8(exps).view(torch.float8_e8m0fnu)
    got = quant.dequant_fp4(packed.view(packed_dtype), scale, dtype)
    want = want64.to(dtype)
    _assert_bit_equal(got, want)
    nan_rows_cols = (exps == 255).repeat_interleave(32, dim=1)
    assert torch.equal(torch.isnan(got), nan_rows_cols)
    # -0.0 survives: byte 0x88 (two -0 nibbles) with a finite scale
    col = 2 * 0x88
    finite = ~nan_rows_cols[:, col]
    assert torch.all(torch.signbit(got[finite, col])) and torch.all(got[finite, col] == 0)


def test_dequant_fp4_leading_dims() -> None:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 32), generator=g).to(torch.uint8)  # [E, out, in/2], in = 64
    exps = torch.randint(100, 150, (3, 5, 2), generator=g)
    got = quant.dequant_fp4(packed.view(torch.int8), _u8(exps).view(torch.float8_e8m0fnu), torch.float32)
    flat = quant.dequant_fp4(packed.reshape(15, 32), _u8(exps.reshape(15, 2)), torch.float32)
    assert got.shape == (3, 5, 64)
    _assert_bit_equal(got, flat.reshape(3, 5, 64))


def test_quantize_fp4_round_trip_on_grid() -> None:
    """On-grid values times a power of two per block come back exactly, with the expected bytes and scales."""
    g = torch.Generator().manual_seed(1)
    out, inp = 6, 128
    nb = inp // 32
    codes = torch.randint(0, 16, (out, inp), generator=g)
    codes[:, ::32] = torch.where(torch.rand(out, nb, generator=g) < 0.5, 7, 15)  # each block holds +-6
    k = torch.randint(-40, 41, (out, nb), generator=g)
    nib = torch.tensor([_nibble_value(n) for n in range(16)], dtype=torch.float64)
    w64 = nib[codes] * torch.pow(2.0, k.double()).repeat_interleave(32, dim=1)
    w = w64.float()
    packed, scale = quant.quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (out, inp // 2)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (out, nb)
    assert torch.equal(scale.view(torch.uint8).to(torch.int64), k + 127)
    want_codes = torch.where(codes == 8, 0, codes)  # -0.0 is stored as +0
    want_bytes = (want_codes[:, 0::2] | (want_codes[:, 1::2] << 4)).to(torch.uint8)
    assert torch.equal(packed.view(torch.uint8), want_bytes)
    back = quant.dequant_fp4(packed, scale, torch.float32)
    assert torch.equal(back, w)


def test_quantize_fp4_round_trip_any_on_grid_block() -> None:
    """A block whose max is any grid value (not only 6) times 2^k is still reproduced exactly, incl. zero blocks."""
    g = torch.Generator().manual_seed(2)
    blocks = []
    for top in [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]:
        allowed = E2M1_POS[E2M1_POS <= top]
        for k in (-30, -1, 0, 5, 60):
            v = allowed[torch.randint(0, allowed.numel(), (32,), generator=g)]
            v[3] = top
            sign = torch.where(torch.rand(32, generator=g) < 0.5, -1.0, 1.0).double()
            blocks.append(v * sign * 2.0**k)
    blocks.append(torch.zeros(32, dtype=torch.float64))
    w = torch.stack(blocks).reshape(-1, 64).float()  # [out, 64]: two blocks per row
    back = quant.dequant_fp4(*quant.quantize_fp4(w), torch.float32)
    assert torch.equal(back, w)
    # leading dims are kept
    w3 = w.reshape(-1, 2, 64)
    packed, scale = quant.quantize_fp4(w3)
    assert packed.shape == (w3.shape[0], 2, 32) and scale.shape == (w3.shape[0], 2, 2)
    assert torch.equal(quant.dequant_fp4(packed, scale, torch.float32), w3)


def test_quantize_fp4_agrees_with_fq4_ue8m0() -> None:
    """Storage round trip and the activation fake-quant share one semantics (ue8m0 power-of-two scale, RNE)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 96, generator=g) * torch.logspace(-3, 3, 16).unsqueeze(1)
    back = quant.dequant_fp4(*quant.quantize_fp4(w), torch.float32)
    assert torch.equal(back, quant.fq4_ue8m0(w, 32))


# ---- FP8 block weights -------------------------------------------------------------------------------------------
RAGGED = [(33, 70, 32), (64, 96, 32), (96, 80, 32), (1, 1, 32), (130, 257, 128), (128, 128, 128), (5, 300, 128),
          (0, 40, 32)]


def _dequant_fp8_ref(codes: torch.Tensor, exps: torch.Tensor, block: int) -> torch.Tensor:
    """Per-tile float64: value table of the e4m3 codes times 2^(e - 127) of the tile's E8M0 code."""
    out, inp = codes.shape
    vals = torch.tensor(E4M3_TABLE, dtype=torch.float64)[codes.to(torch.int64)]
    ref = torch.empty(out, inp, dtype=torch.float64)
    for i in range(math.ceil(out / block)):
        for j in range(math.ceil(inp / block)):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            ref[r, c] = vals[r, c] * _e8m0_value(int(exps[i, j]))
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out, inp, block", RAGGED)
def test_dequant_fp8_bit_exact(out: int, inp: int, block: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(out * 1000 + inp)
    codes = torch.randint(0, 256, (out, inp), generator=g).to(torch.uint8)
    if out * inp >= 256:
        codes.view(-1)[:256] = _u8(range(256))  # every e4m3 code, NaNs and -0 included
    so, si = math.ceil(out / block), math.ceil(inp / block)
    exps = torch.randint(0, 256, (so, si), generator=g)
    edge = torch.tensor([0, 1, 126, 127, 128, 254, 255])
    exps.view(-1)[: min(edge.numel(), exps.numel())] = edge[: exps.numel()]
    got = quant.dequant_fp8(codes.view(torch.float8_e4m3fn), _u8(exps).view(torch.float8_e8m0fnu), block, dtype)
    _assert_bit_equal(got, _dequant_fp8_ref(codes, exps, block).to(dtype))


@pytest.mark.parametrize("out, inp, block", [s for s in RAGGED if s[0] > 0])
def test_quantize_fp8_round_trip(out: int, inp: int, block: int) -> None:
    g = torch.Generator().manual_seed(7 + out + inp)
    w = torch.randn(out, inp, generator=g) * torch.logspace(-5, 5, out).unsqueeze(1)
    so, si = math.ceil(out / block), math.ceil(inp / block)
    last = (slice((so - 1) * block, out), slice((si - 1) * block, inp))  # the ragged corner tile
    w[last] = (torch.rand(w[last].shape, generator=g) * 2 - 1) * 56.0
    w[-1, -1] = -56.0  # tile amax exactly 448 * 2^-3: the scale must be 2^-3, not 2^-2
    zero_tile = so * si > 1
    if zero_tile:
        w[: min(out, block), : min(inp, block)] = 0.0  # tile (0, 0) all zero
    q, scale = quant.quantize_fp8(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (out, inp)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (so, si)
    exps = scale.view(torch.uint8).to(torch.int64)
    w64 = w.double()
    for i in range(so):
        for j in range(si):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            tile = w64[r, c]
            amax = tile.abs().max().item()
            if amax == 0.0:
                assert 0 < exps[i, j] < 255
                continue
            e = _ceil_log2(amax / 448.0)  # smallest power of two with amax / s <= 448
            if (i, j) == (so - 1, si - 1):
                assert e == -3
            assert exps[i, j].item() == e + 127, (i, j)
            qt = torch.tensor([E4M3_TABLE[int(b)] for b in q[r, c].view(torch.uint8).flatten()],
                              dtype=torch.float64).reshape(tile.shape)
            assert torch.equal(qt, _e4m3_rne(tile / 2.0**e)), (i, j)
    deq = quant.dequant_fp8(q, scale, block, torch.float32).double()
    s_full = torch.pow(2.0, (exps - 127).double()).repeat_interleave(block, 0)[:out]
    s_full = s_full.repeat_interleave(block, 1)[:, :inp]
    # e4m3: 3 mantissa bits -> half-ulp <= |x| 2^-4 (normal), 2^-10 (subnormal), in units of the tile scale
    bound = torch.maximum(w64.abs() * 2.0**-4, s_full * 2.0**-10)
    assert torch.all((deq - w64).abs() <= bound)
    if zero_tile:
        assert torch.all(deq[: min(out, block), : min(inp, block)] == 0)


# ---- e2m1 rounding -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("x, want", [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (0.0, 0.0), (0.2, 0.0), (0.3, 0.5), (1.1, 1.0), (2.6, 3.0), (4.9, 4.0), (5.1, 6.0), (6.0, 6.0),
])
def test_round_e2m1_ties_to_even(x: float, want: float) -> None:
    got = quant.round_e2m1(torch.tensor([x, -x]))
    assert got.tolist() == [want, -want]


def test_round_e2m1_dense_sweep() -> None:
    g = torch.Generator().manual_seed(4)
    sweep = torch.arange(-6 * 4096, 6 * 4096 + 1, dtype=torch.float64) / 4096  # exact, holds every tie
    rand = (torch.rand(20000, generator=g, dtype=torch.float64) * 12 - 6)
    x = torch.cat([sweep, rand, torch.tensor([-0.0, 0.0])]).float()
    got = quant.round_e2m1(x)
    want = _e2m1_rne(x.double()).float()
    _assert_bit_equal(got, want)


# ---- activation fake-quant ---------------------------------------------------------------------------------------
def _fq8_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """Spec: s = 2^ceil(log2(max(amax, 1e-4)/448)); x_hat = e4m3(clamp(x/s, +-448)) * s."""
    g = x.double().reshape(-1, block)
    s = torch.tensor([2.0 ** _ceil_log2(max(row.abs().max().item(), 1e-4) / 448.0) for row in g],
                     dtype=torch.float64).unsqueeze(1)
    q = _e4m3_rne((g / s).clamp(-448.0, 448.0)) * s
    return q.reshape(x.shape).to(x.dtype)


def _fq4_ue8m0_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """Spec: s = 2^ceil(log2(max(amax, 6*2^-126)/6)); x_hat = e2m1_RNE(clamp(x/s, +-6)) * s."""
    g = x.double().reshape(-1, block)
    s = torch.tensor([2.0 ** _ceil_log2(max(row.abs().max().item(), 6 * 2.0**-126) / 6.0) for row in g],
                     dtype=torch.float64).unsqueeze(1)
    q = _e2m1_rne((g / s).clamp(-6.0, 6.0)) * s
    return q.reshape(x.shape).to(x.dtype)


def _fq4_e4m3_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """Spec: s = e4m3_RNE(max(amax, 6*2^-9)/6) (saturating); x_hat = e2m1_RNE(clamp(x/s, +-6)) * s.

    s is not a power of two, so x/s is inexact: it is rounded to fp32, the compute dtype (spec §11). A float64
    quotient of fp32 operands rounded to fp32 is the correctly rounded fp32 quotient.
    """
    g = x.double().reshape(-1, block)
    amax = g.abs().amax(1, keepdim=True).clamp(min=6 * 2.0**-9)
    s = _e4m3_rne(amax / 6.0)
    q = _e2m1_rne((g / s).float().double().clamp(-6.0, 6.0)) * s
    return q.reshape(x.shape).to(x.dtype)


def _inputs(block: int, clamp: float, fmt_max: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Blocks of many kinds, [n_blocks // 2, 2 * block] in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for mag in (1e-30, 1e-8, 1e-5, 1e-3, 0.1, 1.0, 7.0, 1e3, 1e6, clamp * 0.5, clamp * 0.99, clamp, clamp * 1.01):
        for _ in range(3):
            blocks.append(torch.randn(block, generator=g) * mag)
    blocks.append(torch.zeros(block))
    blocks.append(-torch.zeros(block))
    mixed = torch.randn(block, generator=g)
    mixed[::3] = 0.0
    mixed[1::3] = -0.0
    blocks.append(mixed)
    for k in (-20, -3, 0, 1, 9):
        for top in (fmt_max * 2.0**k, 2.0**k):  # amax exactly fmt_max * 2^k and exactly 2^k
            b = (torch.rand(block, generator=g) * 2 - 1) * top
            b[block // 2] = -top
            blocks.append(b)
    wide = torch.randn(block, generator=g)
    wide[0] = 1e4  # one outlier: the rest of the block underflows to 0
    blocks.append(wide)
    if len(blocks) % 2:
        blocks.append(torch.randn(block, generator=g))
    return torch.stack(blocks).reshape(-1, 2 * block).to(dtype)


FQ_CASES = [
    # fn, reference, blocks, clamp on amax, format max
    (quant.fq8, _fq8_ref, (32, 64, 128), 1e-4, 448.0),
    (quant.fq4_ue8m0, _fq4_ue8m0_ref, (32,), 6 * 2.0**-126, 6.0),
    (quant.fq4_e4m3, _fq4_e4m3_ref, (16, 32), 6 * 2.0**-9, 6.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn, ref, blocks, clamp, fmt_max", FQ_CASES, ids=["fq8", "fq4_ue8m0", "fq4_e4m3"])
def test_fake_quant_matches_reference(fn, ref, blocks, clamp, fmt_max, dtype: torch.dtype) -> None:
    for block in blocks:
        x = _inputs(block, clamp, fmt_max, dtype, seed=block)
        got = fn(x, block)
        _assert_bit_equal(got, ref(x, block))
        # leading dims and a second layout of the same data
        x3 = x.reshape(2, -1, 4 * block) if x.shape[0] % 2 == 0 else x.reshape(1, -1, 2 * block)
        _assert_bit_equal(fn(x3, block), ref(x3, block))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fq4_e4m3_large_amax_saturates_scale(dtype: torch.dtype) -> None:
    """amax/6 beyond e4m3's 448 takes the largest scale (saturating cast), never NaN."""
    x = torch.randn(4, 16) * 10
    x[:, 0] = torch.tensor([2688.0, 2800.0, 1e5, -3e7])
    x = x.to(dtype)
    got = quant.fq4_e4m3(x, 16)
    assert torch.isfinite(got).all()
    _assert_bit_equal(got, _fq4_e4m3_ref(x, 16))
    assert torch.all(got[:, 0].abs() == 6 * 448.0)


@pytest.mark.parametrize("fn, block", [(quant.fq8, 32), (quant.fq8, 128), (quant.fq4_ue8m0, 32),
                                       (quant.fq4_e4m3, 16)])
def test_fake_quant_properties(fn, block: int) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4 * block, generator=g)
    once = fn(x, block)
    assert torch.equal(fn(once, block), once)  # idempotent: quantised values are fixed points
    assert torch.equal(fn(-x, block), -once)  # odd
    if fn is not quant.fq4_e4m3:  # power-of-two scales: scaling the input by 2^k scales the output by 2^k
        assert torch.equal(fn(x * 2.0**7, block), once * 2.0**7)
    empty = fn(torch.empty(0, 2 * block, dtype=torch.bfloat16), block)
    assert empty.shape == (0, 2 * block) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("fn, block, n", [(quant.fq8, 32, 48), (quant.fq8, 128, 64), (quant.fq4_ue8m0, 32, 16),
                                          (quant.fq4_e4m3, 16, 24), (quant.fq8, 64, 1)])
def test_fake_quant_block_shape_error(fn, block: int, n: int) -> None:
    with pytest.raises(ValueError, match=f"last dim {n} is not a multiple of block {block}"):
        fn(torch.randn(2, n), block)


# ---- Hadamard ----------------------------------------------------------------------------------------------------
def _sylvester(n: int) -> torch.Tensor:
    """Entry (i, j) of the Sylvester-order Hadamard matrix is (-1)^popcount(i & j); float64, unscaled."""
    return torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=torch.float64)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 128])
def test_hadamard_matrix(n: int) -> None:
    h = quant.hadamard_matrix(n)
    assert h.dtype == torch.float32 and h.shape == (n, n)
    assert torch.equal(h, (_sylvester(n) / math.sqrt(n)).float())
    eye = h.double() @ h.double().T
    torch.testing.assert_close(eye, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-6)
    assert torch.equal(h, h.T)


def test_hadamard_first_rows() -> None:
    h = quant.hadamard_matrix(4) * 2
    assert h.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    h8 = torch.sign(quant.hadamard_matrix(8))
    assert h8[1].tolist() == [1, -1] * 4
    assert h8[2].tolist() == [1, 1, -1, -1] * 2
    assert h8[4].tolist() == [1] * 4 + [-1] * 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard_rotation(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 128, generator=g).to(dtype)
    y = quant.hadamard(x)
    assert y.dtype == dtype and y.shape == x.shape
    want = x.double() @ (_sylvester(128) / math.sqrt(128))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(quant.hadamard(y), x, rtol=1e-5, atol=1e-5)  # H is an involution


@pytest.mark.parametrize("n", [0, 3, 6, 12, 100])
def test_hadamard_non_power_of_two(n: int) -> None:
    with pytest.raises(ValueError, match="not a power of two"):
        quant.hadamard_matrix(n)
    if n:
        with pytest.raises(ValueError, match="not a power of two"):
            quant.hadamard(torch.randn(2, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fq8_commutes_with_a_row_gather(dtype):
    """The MoE quantises each token once and then gathers its k expert rows: equal, bit for bit, to quantising the
    gathered rows (fq8's blocks lie within a row), including repeated and skipped rows."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(9, 256, generator=g) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    x[4] = 0.0
    rows = torch.randint(0, 9, (40,), generator=g)
    assert torch.equal(quant.fq8(x, 128)[rows], quant.fq8(x[rows], 128))
