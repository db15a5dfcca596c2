"""minidi::rebase_e4m3: fq4 rows -> e4m3 times one power of two per row (CPU under TRITON_INTERPRET=1; @gpu on CUDA).

Oracles: ``rebase_e4m3_ref`` (float64, frexp) bit for bit, and an independent rule written with Python fractions:
a value c * 2^e (c an e2m1 magnitude) over s = 2^k is an e4m3fn value iff it is <= 448 and a multiple of 2^-9 (the
subnormal step; e2m1 values have at most 2 significant bits, so the 3-bit mantissa never limits).
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from minidi.model.quant import fq4_ue8m0
from minidi.ops.indexer_fp8_quant import K_MAX, K_MIN, rebase_e4m3, rebase_e4m3_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CODES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the nonzero e2m1 magnitudes


def k_of(amax: Fraction) -> int:
    """The smallest k with amax <= 448 * 2^k."""
    k = -200
    while amax > 448 * Fraction(2) ** k:
        k += 1
    return k


def exact_rule(values: list[Fraction]) -> bool:
    amax = max(abs(v) for v in values)
    if amax == 0:
        return True
    k = k_of(amax)
    if not K_MIN < k < K_MAX:
        return False
    return all((abs(v) / Fraction(2) ** k * 512).denominator == 1 for v in values)


def same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(a, b))


def check(x, group, out=None):
    """Kernel == reference bit for bit; x8 * s == x where ok; zeros / ones elsewhere; group flags."""
    out = rebase_e4m3(x, group) if out is None else out
    ref = rebase_e4m3_ref(x.cpu(), group)
    assert same([o.cpu() for o in out], ref)
    x8, s, ok, gok = out
    assert torch.equal((x8.double() * s.double()[:, None])[ok], x.double()[ok])
    assert (x8[~ok].float() == 0).all() and (s[~ok] == 1).all()
    return ok


def test_every_code_pair_and_spread():
    """Rows [amax code * 2^E, +-c * 2^(E - spread), 0...]: every pair of e2m1 codes, spreads 0..20, three E."""
    rows, want = [], []
    for cmax, c, spread, e, sign in itertools.product(CODES, CODES, range(21), (-30, 0, 25), (1, -1)):
        vals = [Fraction(cmax) * Fraction(2) ** e, sign * Fraction(c) * Fraction(2) ** (e - spread)]
        if abs(vals[1]) > vals[0]:
            continue
        rows.append([float(v) for v in vals] + [0.0] * 30)
        want.append(exact_rule(vals))
    x = torch.tensor(rows, dtype=torch.float32, device=DEV)
    ok = check(x, 64)
    assert ok.cpu().tolist() == want
    for dt in (torch.bfloat16, torch.float16):  # the same values (in range) in the activation dtypes
        fits = (x.to(dt).float() == x).all(1) & (x.abs().amax(1) < 6e4 if dt == torch.float16 else True)
        assert torch.equal(check(x[fits].to(dt), 32), ok[fits])


@pytest.mark.parametrize("spread", range(17))
def test_fq4_rows_exact_up_to_spread_14(spread):
    """fq4_ue8m0 rows of D 128 whose 4 block scales span ``spread`` binades: always exact up to 14 (the bound the
    pair test shows: a 0.5 in the lowest block, 14 binades under a 4 or 6 in the highest, is 2^-9 * s)."""
    g = torch.Generator().manual_seed(spread)
    x = torch.randn(64, 4, 32, generator=g)
    x[:, 0] *= 2.0**spread  # block 0 `spread` binades up: its fq4 scale is ~2^spread times the others'
    x[:, 1] *= 2.0 ** torch.randint(0, spread + 1, (64, 1), generator=g)
    q = fq4_ue8m0(x.flatten(1), 32).bfloat16().to(DEV)
    ok = check(q, 16)
    if spread <= 13:  # the block scales of fq4 differ by at most spread + 1 (randn maxima vary)
        assert ok.all()
    if spread >= 16:
        assert not ok.all()


def test_zeros_nan_inf_range_and_ragged_groups():
    g = torch.Generator().manual_seed(1)
    x = fq4_ue8m0(torch.randn(45, 96, generator=g), 32)
    x[0] = 0.0  # zero row: exact
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3, 9] = -float("inf")
    x[4] = x[4] * 2.0**70  # scale beyond 2^60: not exact (epilogue headroom)
    x[5] = x[5] * 2.0**-75
    x[6, 3] = 0.1  # not an e2m1 value times a power of two
    x[7, :32] = 0.0  # a zero block: exact
    x = x.bfloat16().to(DEV)
    ok = check(x, 7)  # 45 rows in groups of 7: the last group is partial
    assert ok.cpu().tolist()[:8] == [True, False, False, False, False, False, False, True]
    assert ok[8:].all()
    _, s, _, gok = rebase_e4m3(x, 7)
    assert s[0].item() == 2.0**K_MIN and gok.cpu().tolist() == [False, True, True, True, True, True, True]


def test_empty_errors_opcheck():
    x8, s, ok, gok = rebase_e4m3(torch.zeros(0, 64, device=DEV), 8)
    assert x8.shape == (0, 64) and s.shape == ok.shape == gok.shape == (0,)
    with pytest.raises(ValueError, match="x must be"):
        rebase_e4m3(torch.zeros(3, 4, 32, device=DEV))
    with pytest.raises(ValueError, match="group"):
        rebase_e4m3(torch.zeros(3, 32, device=DEV), 0)
    x = fq4_ue8m0(torch.randn(10, 64), 32).bfloat16().to(DEV)
    torch.library.opcheck(torch.ops.minidi.rebase_e4m3.default, (x, 4))
    assert same(rebase_e4m3(x, 4, backend="ref"), rebase_e4m3_ref(x, 4))
