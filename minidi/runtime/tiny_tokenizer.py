"""The tokenizer that ships with the embedded tiny checkpoints, in the files a release has
(``tokenizer.json`` + ``tokenizer_config.json``), so loading, the Engram token map and text in / out run in CI.

Built programmatically (no training, so bit-for-bit deterministic): a BPE over 512 tokens in 64 *key classes*.
Token id ``i`` belongs to class ``i % 64``, and every member of a class normalises (spec V4.1 §5.1) to the same key,
with the first member (ids 0..63) first in id order. So ``build_token_map(tiny tokenizer)`` is exactly the
documented test map ``id % 64`` (``engram_hash.test_token_map(512, 64)``): loading the tiny checkpoint through its
tokenizer keeps its Engram hash ids, and so its logits, goldens and spec references, bit for bit.

    classes 0-2   specials <｜begin▁of▁sentence｜> (BOS), <｜end▁of▁sentence｜> (EOS), <｜▁pad▁｜> (pad),
                  as in the release; their other members are case / width / leading-space variants (never
                  produced by merges)
    class   3     whitespace: " ", "\\n", "\\t", "\\r", "  ", "\\n\\n", "\\r\\n", "    "
    classes 4-29  letters a-z: a, A, " a", " A" and their fullwidth forms (NFKC folds them)
    classes 30-63 digits and 24 punctuation marks: c, " c", fullwidth c, " "+fullwidth, "\\n"/"\\t" + c / fullwidth

Merges join a space (or newline / tab) to the next character, so words cost about one token per letter. Text it has
no token for (other characters) encodes as the unknown token "？" (fullwidth question mark).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
N_CLASSES = 64
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
UNK = "？"
PUNCT = ".,!?'\"-:;()/&%$#@*+=_[]~"  # 24 marks; the other ASCII marks (<>{}|\^`) are unknown
WHITESPACE = [" ", "\n", "\t", "\r", "  ", "\n\n", "\r\n", "    "]
VERSION = 1  # bump when the tokenizer changes (the tiny checkpoint cache stamps it)


def _fw(c: str) -> str:
    """The fullwidth form of a printable ASCII character (U+FF01..U+FF5E); NFKC maps it back."""
    return chr(ord(c) - 0x21 + 0xFF01)


def _special_variants(tok: str) -> list[str]:
    ascii_ = tok.replace("｜", "|")
    return [tok, ascii_, ascii_.upper(), tok.upper(), " " + tok, " " + ascii_, " " + ascii_.upper(), " " + tok.upper()]


def _classes() -> list[list[str]]:
    """64 classes of 8 token strings each; member v of class c gets id ``c + 64 * v``."""
    classes = [_special_variants(t) for t in (BOS, EOS, PAD)]
    classes.append(WHITESPACE)
    for c in string.ascii_lowercase:
        u = c.upper()
        classes.append([c, u, " " + c, " " + u, _fw(c), _fw(u), " " + _fw(c), " " + _fw(u)])
    for c in string.digits + PUNCT:
        classes.append([c, " " + c, _fw(c), " " + _fw(c), "\n" + c, "\t" + c, "\n" + _fw(c), "\t" + _fw(c)])
    assert len(classes) == N_CLASSES and all(len(m) == VOCAB_SIZE // N_CLASSES for m in classes)
    return classes


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab: dict[str, int] = {}
    for c, members in enumerate(_classes()):
        for v, tok in enumerate(members):
            vocab[tok] = c + N_CLASSES * v
    assert len(vocab) == VOCAB_SIZE, "two class members share a string"
    merges: list[tuple[str, str]] = []
    for tok in sorted(vocab, key=vocab.__getitem__):  # id order: deterministic ranks
        if len(tok) == 2 and tok[0] in " \n\t" and tok[1] in vocab and tok[1] not in " \n\t\r":
            merges.append((tok[0], tok[1]))
    merges += [(" ", " "), ("  ", "  "), ("\n", "\n"), ("\r", "\n")]
    return vocab, merges


def build_tiny_tokenizer() -> Any:
    """The tiny ``tokenizers.Tokenizer`` (512 tokens, BOS 0, EOS 1, pad 2)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab, merges = _vocab_and_merges()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True))
    tok.decoder = decoders.Fuse()  # tokens are plain text: decoding concatenates them
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)])
    return tok


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json`` in the release's form (the fields the loader reads: BOS / EOS / pad, add_bos)."""
    def added(t: str) -> dict[str, Any]:
        return {"__type": "AddedToken", "content": t, "lstrip": False, "normalized": True, "rstrip": False,
                "single_word": False}

    return {"add_bos_token": True, "add_eos_token": False, "bos_token": added(BOS), "eos_token": added(EOS),
            "pad_token": added(PAD), "unk_token": UNK, "clean_up_tokenization_spaces": False, "legacy": True,
            "model_max_length": 1024, "tokenizer_class": "LlamaTokenizerFast", "minidi_tiny_tokenizer": VERSION}


def write_tiny_tokenizer(folder: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``."""
    folder = Path(folder)
    build_tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")


def is_current(folder: str | Path) -> bool:
    """True when ``folder`` holds this version of the tiny tokenizer (a cache written by older code has none)."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (folder / "tokenizer.json").is_file() and cfg.get("minidi_tiny_tokenizer") == VERSION
