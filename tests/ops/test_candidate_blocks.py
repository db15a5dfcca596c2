"""minidi::candidate_blocks (pass T's op) against the model's ``candidate_blocks`` (CPU under TRITON_INTERPRET=1;
@gpu at the V4.1-Flash shape on CUDA).

The op is a selection: its ids must equal the model's element for element (same blocks, same order, -1 in the same
places) on every input, so every comparison is ``torch.equal``. Inputs are fresh each run (the seed is in the
message): ragged visible ranges, rows with nothing visible, blocks that straddle N, exact ties (integer scores,
-0.0 against +0.0, ties made by ``round_to``), NaN and -inf blocks, keep above the block count, block sizes 1, 3, 4
and 8, the torch selection for rows past ``MAX_REGISTER_NB`` blocks, and a poisoned output the selection kernel must
fill.
"""

from __future__ import annotations

import pytest
import torch

import minidi.ops.candidate_blocks as cb
from minidi.model.indexer import candidate_blocks as model_candidate_blocks

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(t: int, n: int, seed: int, dtype=torch.float32, levels: int = 0):
    """Scores masked to -inf outside each row's [k_start, k_end) as the indexer writes them; ``levels`` > 0: integer
    scores in [0, levels) (exact ties). Row 1 has nothing visible, row 2 a NaN, row 3 -0.0 against +0.0."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, levels, (t, n), generator=g).float() if levels else torch.randn(t, n, generator=g)
    ks = torch.randint(0, max(1, n // 3), (t,), generator=g)
    ke = torch.randint(n // 2, n + 1, (t,), generator=g)
    ke[1 % t] = ks[1 % t]  # empty row: no block forced, every pick -1
    if t > 2:
        s[2, int(ks[2])] = float("nan")
    if t > 3:
        s[3] = 0.0
        s[3, ::2] = -0.0
    j = torch.arange(n)
    s = s.masked_fill((j < ks[:, None]) | (j >= ke[:, None]), float("-inf"))
    return s.to(dtype).to(DEV), ks.to(DEV), ke.to(DEV)


def check(scores, ks, ke, keep, block, seed):
    want = model_candidate_blocks(scores, ks, ke, keep, block)
    got = cb.candidate_blocks(scores, ks, ke, keep, block, backend="triton")
    assert got.dtype == torch.int64 and got.shape == want.shape, (seed, got.shape, want.shape)
    assert torch.equal(got, want), f"seed {seed}: {got} != {want}"
    assert torch.equal(cb.candidate_blocks_ref(scores, ks, ke, keep, block), want), seed
    return got


@pytest.mark.parametrize("t,n,keep,block", [(6, 30, 3, 4), (5, 64, 8, 8), (4, 100, 50, 8), (5, 33, 4, 1),
                                            (6, 257, 16, 8), (4, 47, 5, 3), (3, 10, 0, 4)])
def test_equals_the_model(t, n, keep, block):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    check(*make(t, n, seed), keep, block, seed)


@pytest.mark.parametrize("levels", [2, 5])
def test_exact_ties_go_to_the_lowest_block(levels):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    check(*make(6, 200, seed, levels=levels), 7, 4, seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_scores(dtype):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    check(*make(5, 120, seed, dtype), 6, 8, seed)


@pytest.mark.parametrize("round_to", [torch.bfloat16, torch.float16])
def test_round_to_equals_the_model_on_the_rounded_scores(round_to):
    """fp32 scores with ``round_to``: the picks of ``scores.to(round_to)`` (pass B's fp32 scores, the model's bf16).
    Scores 1 + i 2^-14 (i < 64) collapse to a few values in either dtype, so rounding makes exact ties across blocks
    that fp32 does not have; values past the dtype's largest finite one round to inf; NaN stays NaN."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    s, ks, ke = make(6, 203, seed)
    g = torch.Generator().manual_seed(seed)
    s = torch.where(s.isfinite(), 1 + torch.randint(0, 64, s.shape, generator=g).to(DEV) * 2.0**-14, s)
    big = torch.finfo(round_to).max * 1.001  # fp32, rounds to +inf (bf16: 3.39e38 < big < fp32 max)
    s[0, int(ks[0]) + 9], s[4, int(ks[4])] = big, -big
    rounded = s.to(round_to)
    assert not torch.equal(rounded.float(), s)  # the test needs values that rounding changes
    want = model_candidate_blocks(rounded, ks, ke, 7, 8)
    got = cb.candidate_blocks(s, ks, ke, 7, 8, round_to, backend="triton")
    assert torch.equal(got, want), f"seed {seed}: {got} != {want}"
    assert torch.equal(cb.candidate_blocks_ref(s, ks, ke, 7, 8, round_to), want), seed
    assert not torch.equal(got, model_candidate_blocks(s, ks, ke, 7, 8)), seed  # the rounding decided some picks
    bm = cb.block_max_launch(s, ks, ke, 8, round_to)
    assert same_with_nan(bm, cb.block_max_ref(rounded, ks, ke, 8)), seed


def test_nan_and_inf_blocks_and_forced_newest():
    """A NaN block ranks as +inf and comes out -1 (the model's ``> -inf`` test); the newest visible block is kept
    even when its max is -inf or NaN; a row with fewer finite blocks than keep pads with -1 at the end."""
    n, block = 40, 4
    s = torch.full((4, n), float("-inf"))
    s[0, 5], s[0, 17] = 1.0, float("nan")  # blocks 1 and 4; newest visible block 9 (k_end 40)
    s[1, 3] = float("nan")  # the newest visible block (k_end 4) is itself NaN: forced to +inf, kept
    s[2, :] = 2.0
    s[2, 36:] = float("-inf")  # newest visible block 9 (k_end 40) is all -inf: forced, kept
    ks = torch.tensor([0, 0, 0, 3])
    ke = torch.tensor([40, 4, 40, 3])  # row 3: nothing visible
    got = check(s.to(DEV), ks.to(DEV), ke.to(DEV), 5, block, 0)
    assert got[0].tolist() == [1, 9, -1, -1, -1]  # NaN block 4 picked (as +inf) and dropped
    assert got[1].tolist() == [0, -1, -1, -1, -1]
    assert got[2].tolist() == [0, 1, 2, 3, 9]  # ties at 2.0: the lowest blocks, plus the forced newest
    assert got[3].tolist() == [-1] * 5


def test_rows_past_the_register_bound_take_the_torch_selection(monkeypatch):
    monkeypatch.setattr(cb, "MAX_REGISTER_NB", 8)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    check(*make(4, 90, seed), 5, 4, seed)  # 23 blocks > 8


def test_select_kernel_fills_every_slot():
    seed = int(torch.randint(0, 2**31 - 1, ()))
    s, ks, ke = make(5, 96, seed)
    bm = cb.block_max_launch(s, ks, ke, 4)
    assert same_with_nan(bm, cb.block_max_ref(s, ks, ke, 4)), seed
    out = torch.full((5, 9), 123456789, dtype=torch.int64, device=DEV)
    assert torch.equal(cb.select_launch(bm, 9, out=out), cb.pick_blocks_ref(bm, 9)), seed


@pytest.mark.parametrize("variant", sorted(cb.SELECT_VARIANTS))
@pytest.mark.parametrize("levels", [0, 3])
def test_every_select_variant_equals_the_reference(variant, levels):
    """Each selection variant (the tie-rank / -1-tail scans always or only where needed) on maxima with
    exact ties (``levels``), NaN, -inf and forced blocks, keep = 1, a few, all blocks; a poisoned output."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    s, ks, ke = make(6, 150, seed, levels=levels)
    bm = cb.block_max_launch(s, ks, ke, 4)
    bm[5, :10] = float("-inf")  # a row with -inf maxima among its top picks when keep is large
    for keep in (1, 7, 38):
        out = torch.full((6, min(keep, 38)), 123456789, dtype=torch.int64, device=DEV)
        got = cb.select_launch(bm, keep, out=out, variant=variant)
        assert torch.equal(got, cb.pick_blocks_ref(bm, keep)), (seed, variant, keep)


def same_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN in the same places (+-inf compared as they are)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0, float("inf"), float("-inf")),
                                                             b.nan_to_num(0.0, float("inf"), float("-inf")))


def test_block_max_equals_reference_with_nan():
    s, ks, ke = make(5, 50, 3)
    assert same_with_nan(cb.block_max_launch(s, ks, ke, 8), cb.block_max_ref(s, ks, ke, 8))


def test_empty_shapes():
    for t, n, keep in ((0, 16, 3), (3, 0, 3), (3, 16, 0)):
        s = torch.randn(t, n, device=DEV)
        ks = ke = torch.zeros(t, dtype=torch.long, device=DEV)
        got = cb.candidate_blocks(s, ks, ke, keep, 4, backend="triton")
        assert got.shape == (t, min(keep, -(-n // 4))) and torch.equal(got, cb.candidate_blocks_ref(s, ks, ke, keep, 4))
        if n:  # (the model's scatter fails on a row of no block)
            assert torch.equal(got, model_candidate_blocks(s, ks, ke, keep, 4))


def test_opcheck():
    s, ks, ke = make(4, 40, 5)
    torch.library.opcheck(torch.ops.minidi.candidate_blocks.default, (s, ks, ke, 3, 4))
    torch.library.opcheck(torch.ops.minidi.candidate_blocks.default, (s, ks, ke, 3, 4, torch.bfloat16))


@pytest.mark.parametrize("bad,match", [
    (dict(scores=torch.zeros(3, 4, dtype=torch.int32)), "scores must be a \\[T, N\\]"),
    (dict(k_start=torch.zeros(2, dtype=torch.long)), "k_start must be \\[3\\]"),
    (dict(k_end=torch.zeros(3)), "k_end must be \\[3\\] int32 / int64"),
    (dict(keep=-1), "keep must be an int >= 0"),
    (dict(block=0), "block must be an int >= 1"),
    (dict(round_to=torch.int32), "round_to must be one of"),
])
def test_errors_name_the_argument(bad, match):
    args = dict(scores=torch.zeros(3, 16), k_start=torch.zeros(3, dtype=torch.long),
                k_end=torch.full((3,), 16, dtype=torch.long), keep=2, block=4) | bad
    with pytest.raises(ValueError, match=match):
        cb.candidate_blocks(**args)


@pytest.mark.gpu
def test_v41_flash_shape():
    """V4.1-Flash's candidate source at 128K context: [4,096, 131,072] scores, blocks of 8, keep 2,048 of 16,384."""
    torch.manual_seed(0)
    t, n = 4096, 131072
    s = torch.randn(t, n, device="cuda")
    ks = torch.zeros(t, dtype=torch.long, device="cuda")
    ke = torch.arange(n - t + 1, n + 1, device="cuda")
    s = s.masked_fill(torch.arange(n, device="cuda") >= ke[:, None], float("-inf"))
    check(s, ks, ke, 2048, 8, 0)
