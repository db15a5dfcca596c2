"""Engram hash ids (spec V4.1 §5.1): a pure function of token ids, the tokenizer and the config.

Pipeline for one engram layer L, per position t of a sequence:

    c_s   = token_map[id_{t-s}]               s = 0..K-1 (K = engram_max_ngram); pad' before the start / from a DEAD on
    P_s   = c_s * m_s                         int64; m_s = odd multipliers from numpy default_rng(10007*L)
    R_n   = P_0 ^ P_1 ^ ... ^ P_{n-1}         n = 2..K
    id    = R_n mod prime[n][h] + offset[n][h] -> K-1 orders x H heads columns, (n=2: h0..H-1, n=3, ...)

Host-side setup (tokenizer map, primes, multipliers) is plain Python/numpy and runs once; ``engram_hash_ids`` is
pure tensor ops so it traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from .config import ModelConfig

DEAD = -1  # compressed id of a token with no text n-gram (image tokens): breaks every n-gram through it
LAYER_SEED_PRIME = 10007  # numpy seed per layer = 10007 * layer_id (spec §5.1)


# ---- compressed token map -----------------------------------------------------------------------------------------
def _normalizer() -> Any:
    """The §5.1 key normaliser, built from ``tokenizers`` normalizers rather than ``unicodedata``.

    The reference builds exactly this Sequence; using the same Rust implementation keeps its Unicode tables and
    its ``StripAccents`` definition of "combining mark", so keys match bit for bit. The private-use sentinel
    protects a text that is exactly one space from ``Strip`` and is turned back into " " at the end.
    """
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def build_token_map(tokenizer: Any) -> torch.Tensor:
    """Token id -> compressed id ``[len(tokenizer)]`` int64 (spec §5.1).

    ``tokenizer`` is a ``transformers`` fast tokenizer (its ``backend_tokenizer`` is used, and ``len(tokenizer)``
    counts added tokens) or a raw ``tokenizers.Tokenizer``. Each id is decoded alone with specials kept; its key is
    ``id_to_token(i)`` when the text holds U+FFFD (a partial UTF-8 byte token), else the normalised text (or the
    decoded text itself when that normalises to ""). Both kinds of key share one dictionary, and compressed ids
    are handed out in order of first appearance over ids 0..n-1.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(tokenizer, "backend_tokenizer"):
        n = len(tokenizer)
    else:
        n = backend.get_vocab_size(with_added_tokens=True)
    norm = _normalizer()
    key_to_new: dict[str, int] = {}
    lookup = [0] * n
    for i in range(n):
        text = backend.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        lookup[i] = key_to_new.setdefault(key, len(key_to_new))
    return torch.tensor(lookup, dtype=torch.long)


def check_token_map(token_map: torch.Tensor, cfg: ModelConfig) -> None:
    """Raise ``ValueError`` unless ``token_map`` has exactly ``cfg.engram_compressed_vocab_size`` distinct ids
    (``DEAD`` entries not counted).

    The multipliers' bound and every trained bucket depend on that count; a wrong tokenizer (or a changed
    normaliser) would silently send every n-gram to the wrong rows.
    """
    distinct = int(torch.unique(token_map[token_map != DEAD]).numel())  # DEAD (no text n-gram) is not an id
    if distinct != cfg.engram_compressed_vocab_size:
        raise ValueError(
            f"compressed token map has {distinct} distinct ids (from {token_map.numel()} tokens), but the config's "
            f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}: wrong tokenizer for this "
            f"checkpoint, or a normalisation that differs from spec §5.1"
        )


def test_token_map(vocab_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64 map ``i mod compressed_vocab_size`` for the tiny random-weight configs (spec §15).

    NOT the real map: the released model needs ``build_token_map`` on its tokenizer. This only gives tests a
    deterministic map with the configured number of compressed ids.
    """
    return torch.arange(vocab_size, dtype=torch.long) % compressed_vocab_size


test_token_map.__test__ = False  # a helper named test_*: keep pytest from collecting it when imported into a test


# ---- multipliers and primes -----------------------------------------------------------------------------------------
def hash_multipliers(layer_id: int, compressed_vocab_size: int, n: int = 4) -> torch.Tensor:
    """``[n]`` int64 odd multipliers ``m_s = 2 v_s + 1`` of one engram layer.

    ``v ~ default_rng(10007 * layer_id).integers(0, bound, n, int64)`` with ``bound = (2^63-1) // C // 2``, so
    ``c * m`` fits int64 for every compressed id ``c < C``. Kept in int64 end to end: for small C the m_s exceed
    2^53 and any float round trip would change them.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    v = np.random.default_rng(LAYER_SEED_PRIME * layer_id).integers(0, bound, size=n, dtype=np.int64)
    return torch.from_numpy(v * 2 + 1)


def _is_prime(x: int) -> bool:
    """Deterministic Miller-Rabin; these bases are exact for every x < 3.3e24 (so all of int64)."""
    if x < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if x % p == 0:
            return x == p
    d, r = x - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        y = pow(a, d, x)
        if y in (1, x - 1):
            continue
        for _ in range(r - 1):
            y = y * y % x
            if y == x - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg: ModelConfig) -> dict[int, torch.Tensor]:
    """``{layer_id: [K-1, H] int64}`` bucket sizes: for each layer (in ``engram_layers`` order), n-gram order n=2..K
    and head h, the next prime > ``engram_vocab_size - 1`` not used before (distinct across all layers)."""
    seen: set[int] = set()
    out: dict[int, torch.Tensor] = {}
    for layer in cfg.engram_layers:
        rows = []
        for _ in range(cfg.engram_max_ngram - 1):
            row, cur = [], cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                cur += 1
                while cur in seen or not _is_prime(cur):
                    cur += 1
                seen.add(cur)
                row.append(cur)
            rows.append(row)
        out[layer] = torch.tensor(rows, dtype=torch.long)
    return out


class EngramTables(NamedTuple):
    """Per-layer constants of the hash, as tensors so a compiled caller can take them as inputs."""

    primes: torch.Tensor  # [K-1, H] int64
    offsets: torch.Tensor  # [K-1, H] int64, running sum of primes in (n, h) order
    multipliers: torch.Tensor  # [K] int64


def engram_tables(cfg: ModelConfig) -> dict[int, EngramTables]:
    """Primes, row offsets and multipliers for every engram layer; checks each table's row count.

    A layer's embedding has sum(primes) rows, which the config states as ``engram_num_embeddings``; a mismatch
    means the prime recipe (or the config) is off and every id would address the wrong row.
    """
    primes = engram_primes(cfg)
    out: dict[int, EngramTables] = {}
    for i, layer in enumerate(cfg.engram_layers):
        p = primes[layer]
        total = int(p.sum())
        if total != cfg.engram_num_embeddings[i]:
            raise ValueError(
                f"engram layer {layer}: its {p.numel()} primes sum to {total} rows, but engram_num_embeddings[{i}] "
                f"is {cfg.engram_num_embeddings[i]} (engram_vocab_size={cfg.engram_vocab_size}, "
                f"n_heads={cfg.engram_n_heads}, max_ngram={cfg.engram_max_ngram})"
            )
        flat = p.flatten()
        offsets = (torch.cumsum(flat, 0) - flat).view_as(p)  # exclusive running sum
        mult = hash_multipliers(layer, cfg.engram_compressed_vocab_size, cfg.engram_max_ngram)
        out[layer] = EngramTables(p, offsets, mult)
    return out


# ---- the hash ----------------------------------------------------------------------------------------------------
def engram_hash_ids(
    comp_ids: torch.Tensor,
    layer_id: int,
    cfg: ModelConfig,
    tables: dict[int, EngramTables],
    pad_comp_id: int | torch.Tensor,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row ids ``[S, (K-1)*H]`` int64 of one sequence (or one chunk of it) for engram layer ``layer_id``.

    comp_ids:    [S] int64 compressed ids (``token_map[ids]``), ``DEAD`` (-1) for tokens outside text n-grams.
    pad_comp_id: pad' = ``token_map[cfg.engram_pad_id]``.
    history:     [<=K-1] compressed ids of the positions just before this chunk (a continued sequence); None or
                 empty = the sequence starts at position 0. Longer histories are cut to their last K-1 ids.
    Column order: n=2 (h0..H-1), n=3, ..., n=K. Values of order n, head h lie in [offset, offset + prime).
    """
    K = cfg.engram_max_ngram
    t = tables[layer_id]
    if history is None:
        history = comp_ids.new_empty(0)
    hist = history[max(history.shape[0] - (K - 1), 0):]
    ext = torch.cat([hist, comp_ids])  # [Hn+S]
    S = comp_ids.shape[0]
    pos = torch.arange(S, device=comp_ids.device) + hist.shape[0]  # index of position t in ext
    src = pos[:, None] - torch.arange(K, device=comp_ids.device)  # [S, K] index of t-s
    return hash_shifted(ext[src.clamp_min(0)], src >= 0, t, pad_comp_id)


def engram_hash_ids_packed(
    comp_ext: torch.Tensor, src: torch.Tensor, tables: EngramTables, pad_comp_id: int | torch.Tensor
) -> torch.Tensor:
    """Packed-batch form: ``comp_ext`` [H+T] compressed ids (cached history rows, then the new tokens) and
    ``src`` [T, K] the row of position t-s for shift s (-1 = before the sequence start), built on the host.
    Returns [T, (K-1)*H] like ``engram_hash_ids``."""
    return hash_shifted(comp_ext[src.clamp_min(0)], src >= 0, tables, pad_comp_id)


def hash_shifted(
    c: torch.Tensor, inside: torch.Tensor, t: EngramTables, pad_comp_id: int | torch.Tensor
) -> torch.Tensor:
    """c [S, K] compressed ids of positions t-s, inside [S, K] whether t-s is in the sequence -> ids [S, (K-1)*H]."""
    K = c.shape[1]
    ok = inside & (c != DEAD)
    # Once shift s falls before the start or hits a DEAD, shifts >= s are padded too: cumulative AND over s.
    valid = torch.cumprod(ok.long(), dim=1).bool()
    c = torch.where(valid, c, pad_comp_id)
    p = c * t.multipliers.to(c.device)  # [S, K]; int64 multiply wraps two's-complement, like numpy
    r = [p[:, 0]]
    for s in range(1, K):  # K is a small static int: unrolled at trace time
        r.append(torch.bitwise_xor(r[-1], p[:, s]))
    rn = torch.stack(r[1:], dim=1)  # [S, K-1]: R_2..R_K
    primes, offsets = t.primes.to(c.device), t.offsets.to(c.device)
    ids = torch.remainder(rn[:, :, None], primes) + offsets  # [S, K-1, H]; floor mod in [0, prime) like numpy %
    return ids.flatten(1)
