"""Engram hash ids (spec V4.1 §5.1): primes, multipliers, token map, and the vectorised hash vs plain Python ints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minidi.model.engram_hash import (
    DEAD,
    EngramTables,
    build_token_map,
    check_token_map,
    engram_hash_ids,
    engram_primes,
    engram_tables,
    hash_multipliers,
    test_token_map,
)
from minidi.model.presets import preset

MASK64 = (1 << 64) - 1


def _wrap64(x: int) -> int:
    """Python int -> the signed int64 with the same low 64 bits (two's-complement wrap)."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def _ids_from_c(c: list[int], t: EngramTables) -> list[int]:
    """Hash of one position from its K shifted compressed ids, in plain Python ints (independent of the torch code)."""
    m = [int(v) for v in t.multipliers]
    p = [_wrap64(cs * ms) for cs, ms in zip(c, m)]
    primes, offsets = t.primes.tolist(), t.offsets.tolist()
    out, r = [], p[0]
    for n in range(2, len(c) + 1):
        r = _wrap64(r ^ p[n - 1])  # xor of signed ints stays in int64 range; wrap is a no-op kept for clarity
        out += [r % primes[n - 2][h] + offsets[n - 2][h] for h in range(len(primes[n - 2]))]  # Python % = floor mod
    return out


def _ref_hash(seq: list[int], t: EngramTables, pad: int, K: int) -> list[list[int]]:
    """Loop reference: shift s of position i is pad once i-s < 0 or a DEAD occurred at shift <= s."""
    rows = []
    for i in range(len(seq)):
        c, dead = [], False
        for s in range(K):
            dead = dead or i - s < 0 or seq[i - s] == DEAD
            c.append(pad if dead else seq[i - s])
        rows.append(_ids_from_c(c, t))
    return rows


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny-v41")
    return cfg, engram_tables(cfg)


# ---- primes ------------------------------------------------------------------------------------------------------
def test_tiny_primes_and_offsets(tiny):
    cfg, tabs = tiny
    assert tabs[1].primes.tolist() == [[97, 101], [103, 107], [109, 113]]
    assert tabs[4].primes.tolist() == [[127, 131], [137, 139], [149, 151]]
    assert [int(tabs[layer].primes.sum()) for layer in (1, 4)] == [630, 834] == list(cfg.engram_num_embeddings)
    assert tabs[1].offsets.flatten().tolist() == [0, 97, 198, 301, 408, 517]
    assert tabs[4].offsets.flatten().tolist() == [0, 127, 258, 395, 534, 683]


def test_release_primes():
    cfg = preset("v41-flash")
    primes = engram_primes(cfg)
    flat = torch.cat([primes[1].flatten(), primes[14].flatten()]).tolist()
    assert len(flat) == 48 == len(set(flat)) and min(flat) > 15_999_999
    assert flat == sorted(flat)  # handed out in increasing order, layer 1 first
    assert [int(primes[layer].sum()) for layer in (1, 14)] == [384_006_168, 384_016_682]
    assert all(all(p % d for d in range(2, int(p**0.5) + 1)) for p in flat[:3])  # spot-check by trial division
    engram_tables(cfg)  # validates both sums against the config


def test_prime_sum_mismatch_raises():
    cfg = preset("tiny-v41").with_(engram_num_embeddings=(630, 835))
    msg = r"engram layer 4: its 6 primes sum to 834 rows.*engram_num_embeddings\[1\] is 835"
    with pytest.raises(ValueError, match=msg):
        engram_tables(cfg)


# ---- multipliers -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer,C", [(1, 99092), (14, 99092), (1, 64), (4, 64), (7, 3)])
def test_multipliers(layer, C):
    m = hash_multipliers(layer, C, 4)
    assert m.dtype == torch.int64 and m.shape == (4,)
    bound = (2**63 - 1) // C // 2
    expect = [2 * int(v) + 1 for v in np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64)]
    assert m.tolist() == expect
    assert all(v % 2 == 1 and 0 < v < 2 * bound for v in m.tolist())
    assert all((C - 1) * v < 2**63 for v in m.tolist())  # products of valid compressed ids never overflow


def test_multiplier_magnitudes():
    assert max(hash_multipliers(1, 99092).tolist()) < 2**47  # released: double-exact
    assert max(hash_multipliers(1, 64).tolist()) > 2**53  # tiny: a float round trip would corrupt them
    assert hash_multipliers(1, 99092).tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]


# ---- the hash ----------------------------------------------------------------------------------------------------
def test_hand_worked_pad_and_dead(tiny):
    cfg, tabs = tiny
    pad = 2
    seq = [5, 9, DEAD, 7, 11, 13, 17]
    # The shifted ids (s = 0..3) each position hashes, written out by hand from the §5.1 rules.
    c_by_pos = [
        [5, pad, pad, pad],  # t=0: everything before the start is pad'
        [9, 5, pad, pad],
        [pad, pad, pad, pad],  # t=2 is DEAD itself: pad from shift 0 on
        [7, pad, pad, pad],  # DEAD at shift 1 pads shifts 1..3, although t-2 = 9 is a real token
        [11, 7, pad, pad],  # DEAD at shift 2
        [13, 11, 7, pad],  # DEAD at shift 3
        [17, 13, 11, 7],  # first full 4-gram
    ]
    for layer in (1, 4):
        got = engram_hash_ids(torch.tensor(seq), layer, cfg, tabs, pad)
        assert got.shape == (7, 6) and got.dtype == torch.int64
        assert got.tolist() == [_ids_from_c(c, tabs[layer]) for c in c_by_pos]
    # t=0 with the R values spelled out: columns (n=2: h0, h1), ...
    m = tabs[1].multipliers.tolist()
    r2 = (5 * m[0]) ^ (pad * m[1])
    assert engram_hash_ids(torch.tensor([5]), 1, cfg, tabs, pad)[0, :2].tolist() == [r2 % 97, r2 % 101 + 97]


def test_ids_in_range_and_matches_reference(tiny):
    cfg, tabs = tiny
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 64, (40,), generator=g)
    seq[[0, 17, 18, 33]] = DEAD
    for layer in (1, 4):
        t = tabs[layer]
        got = engram_hash_ids(seq, layer, cfg, tabs, 2)
        assert got.tolist() == _ref_hash(seq.tolist(), t, 2, 4)
        lo, hi = t.offsets.flatten(), (t.offsets + t.primes).flatten()
        assert bool(((got >= lo) & (got < hi)).all())


def test_int64_wraps_like_python(tiny):
    """Ids >= C break the no-overflow bound: the products must wrap exactly like numpy int64, never via float."""
    cfg, tabs = tiny
    seq = [(1 << 50) + 12345, (1 << 62) - 1, 3, (1 << 61) + 7, 63]
    t = tabs[1]
    assert any(abs(s * int(m)) >= 2**63 for s in seq for m in t.multipliers)  # at least one product overflows
    np_p = np.array(seq, dtype=np.int64) * t.multipliers.numpy()[0]  # numpy wraps silently
    py_p = [_wrap64(s * int(t.multipliers[0])) for s in seq]
    assert (torch.tensor(seq) * t.multipliers[0]).tolist() == np_p.tolist() == py_p
    assert engram_hash_ids(torch.tensor(seq), 1, cfg, tabs, 2).tolist() == _ref_hash(seq, t, 2, 4)


@pytest.mark.parametrize("cuts", [(1,), (2, 3), (5, 6, 7, 20), (3, 9, 10, 11)])
def test_chunked_equals_one_shot(tiny, cuts):
    cfg, tabs = tiny
    seq = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(1))
    seq[[4, 10]] = DEAD
    full = engram_hash_ids(seq, 4, cfg, tabs, 2)
    bounds = [0, *cuts, len(seq)]
    parts = [
        engram_hash_ids(seq[a:b], 4, cfg, tabs, 2, history=seq[max(a - 3, 0):a] if a else None)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    assert torch.equal(torch.cat(parts), full)
    # A longer history is cut to its last K-1 ids; an empty one means "starts here".
    assert torch.equal(engram_hash_ids(seq[12:], 4, cfg, tabs, 2, history=seq[:12]), full[12:])
    assert torch.equal(engram_hash_ids(seq, 4, cfg, tabs, 2, history=seq[:0]), full)


def test_compiled_matches_eager(tiny):
    cfg, tabs = tiny
    t = tabs[4]

    def run(comp: torch.Tensor, hist: torch.Tensor, pad: torch.Tensor, m: torch.Tensor, p: torch.Tensor,
            o: torch.Tensor) -> torch.Tensor:
        return engram_hash_ids(comp, 4, cfg, {4: EngramTables(p, o, m)}, pad, history=hist)

    compiled = torch.compile(run, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(2)
    for S in (9, 23):
        comp = torch.randint(0, 64, (S,), generator=g)
        comp[S // 2] = DEAD
        args = (comp, torch.tensor([3, DEAD, 5]), torch.tensor(2), t.multipliers, t.primes, t.offsets)
        assert torch.equal(compiled(*args), run(*args))


# ---- token map ---------------------------------------------------------------------------------------------------
def test_test_token_map():
    m = test_token_map(512, 64)
    assert m.dtype == torch.int64 and m.shape == (512,)
    assert m[:3].tolist() == [0, 1, 2] and m[64].item() == 0 and m[511].item() == 511 % 64
    check_token_map(m, preset("tiny-v41"))  # 64 distinct ids: passes


def test_check_token_map_message():
    with pytest.raises(ValueError, match=r"63 distinct ids \(from 512 tokens\).*engram_compressed_vocab_size is 64"):
        check_token_map(test_token_map(512, 63), preset("tiny-v41"))


def _word_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models

    words = ["[UNK]", "Hello", "hello", " hello", "HÉLLO", "é", "e", "\ufb01", "fi", " ", "\t\n",
             "a\ufffd", "A\ufffd", "\u0301", "<eos>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.add_special_tokens([AddedToken("<EOS>", special=True)])  # id 15
    return tok


# id:         0  Hello hello " hello" HÉLLO  é  e  ﬁ  fi " " \t\n a� A�  ◌́  <eos> <EOS>
TOKEN_MAP = [0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 8]


def test_build_token_map_tokenizers():
    # Case, leading space and accents merge into "hello"; é -> e; the ligature NFKC-folds to "fi"; whitespace
    # runs collapse to a protected " "; U+FFFD texts key by the raw token (so "a\ufffd" and "A\ufffd" stay apart);
    # a lone combining accent normalises to "" and keys by its own text; the special <EOS> is decoded, not
    # skipped, and lowercases onto <eos>. New ids follow first appearance.
    m = build_token_map(_word_tokenizer())
    assert m.dtype == torch.int64
    assert m.tolist() == TOKEN_MAP
    with pytest.raises(ValueError, match="9 distinct ids"):
        check_token_map(m, preset("tiny-v41"))


def test_build_token_map_transformers():
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer())
    assert len(hf) == 16
    assert build_token_map(hf).tolist() == TOKEN_MAP
