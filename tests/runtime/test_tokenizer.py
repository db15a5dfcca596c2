"""The checkpoint's tokenizer end to end: the tiny tokenizer and its Engram map, the token-map choice at load time
(a V4.1 folder loads with its true map or not at all), the tiny cache's version stamp, and text in / out."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import minidi
from minidi.model.engram_hash import DEAD, build_token_map, test_token_map
from minidi.model.presets import preset
from minidi.runtime import tiny_tokenizer
from minidi.runtime.checkpoint import INDEX_NAME, tiny_checkpoint
from minidi.runtime.engine import Engine
from minidi.runtime.tokenizer import TokenizerMissing, load_tokenizer


@pytest.fixture(scope="module")
def tiny_dir():
    return tiny_checkpoint("tiny-v41")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return minidi.load_model(tiny_dir, dtype="float32", fake_quant=False)


def _copy_without_tokenizer(src, dst):
    shutil.copytree(src, dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).unlink()
    return dst


# ---- the tiny tokenizer ----------------------------------------------------------------------------------------
def test_tiny_tokenizer_map_is_the_test_map():
    """The decision that keeps tiny-v41's numerics: its tokenizer's §5.1 map is exactly ``id % 64``."""
    tok = tiny_tokenizer.build_tiny_tokenizer()
    cfg = preset("tiny-v41")
    assert tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size == 512
    assert torch.equal(build_token_map(tok), test_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size))


def test_tiny_tokenizer_deterministic_and_round_trips(tmp_path):
    tiny_tokenizer.write_tiny_tokenizer(tmp_path)
    a = (tmp_path / "tokenizer.json").read_bytes()
    tiny_tokenizer.write_tiny_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == a
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (0, 1, 2, True)
    text = "Hello, World! 42 (tiny) - ok?\n\tyes"
    ids = tok.encode(text)
    assert ids[0] == 0 and 0 not in ids[1:] and len(ids) < len(text)  # BOS once; merges join " x"
    assert tok.decode(ids) == text and tok.decode(ids, skip_special_tokens=False).startswith(tiny_tokenizer.BOS)
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(tok.encode("é <x>", add_bos=False)) == "？ ？x？"  # no token for these: the unknown token


# ---- the token-map choice ----------------------------------------------------------------------------------------
def test_tiny_checkpoint_ships_tokenizer_and_loads_its_map(tiny_dir, model):
    assert (tiny_dir / "tokenizer.json").is_file() and tiny_tokenizer.is_current(tiny_dir)
    assert model.tokenizer is not None and len(model.tokenizer) == 512
    cfg = model.cfg
    assert torch.equal(model.engram_token_map, test_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size))


def test_v41_folder_without_tokenizer_is_refused(tiny_dir, tmp_path, model):
    bare = _copy_without_tokenizer(tiny_dir, tmp_path / "bare")
    with pytest.raises(TokenizerMissing, match=r"no tokenizer\.json.*Engram layers \[1, 4\].*token_map="):
        minidi.load_model(bare)
    m = minidi.load_model(bare, token_map="test", dtype="float32", fake_quant=False)  # explicitly the test map
    assert m.tokenizer is None and torch.equal(m.engram_token_map, model.engram_token_map)
    ids = torch.tensor([0, 7, 7, 300, 12])
    assert torch.equal(m(ids), model(ids))
    # an explicit map is used as given (and checked)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))[test_token_map(512, 64)]
    m2 = minidi.load_model(bare, token_map=perm)
    assert torch.equal(m2.engram_token_map, perm)
    with pytest.raises(ValueError, match="63 distinct ids"):
        minidi.load_model(bare, token_map=test_token_map(512, 63))


def test_wrong_tokenizer_is_refused(tiny_dir, tmp_path):
    """A tokenizer whose map has the wrong number of compressed ids (another model's) fails at load time."""
    from tokenizers import Tokenizer, models

    other = _copy_without_tokenizer(tiny_dir, tmp_path / "other")
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0")).save(str(other / "tokenizer.json"))
    with pytest.raises(ValueError, match="100 distinct ids .*engram_compressed_vocab_size is 64"):
        minidi.load_model(other)


def test_short_tokenizer_map_pads_spare_rows_dead(tiny_dir, tmp_path):
    """Ids past the tokenizer's length (spare embedding rows) map to DEAD, so every model id indexes the map."""
    from minidi.runtime.tokenizer import install_tokenizer

    tok = tiny_tokenizer.build_tiny_tokenizer()
    small = _copy_without_tokenizer(tiny_dir, tmp_path / "small")
    m = minidi.load_model(small, token_map="test")
    vocab = {tok.id_to_token(i): i for i in range(500) if i not in (0, 1, 2)}
    from tokenizers import AddedToken, Tokenizer, models

    t2 = Tokenizer(models.BPE(vocab={**vocab, **{tok.id_to_token(i): i for i in (0, 1, 2)}}, merges=[]))
    t2.add_special_tokens([AddedToken(tok.id_to_token(i), special=True) for i in (0, 1, 2)])
    t2.save(str(small / "tokenizer.json"))
    install_tokenizer(m, small)
    assert m.engram_token_map.shape == (512,) and (m.engram_token_map[500:] == DEAD).all()
    assert torch.equal(m.engram_token_map[:500], test_token_map(500, 64))


def test_v4_loads_without_tokenizer_and_keeps_text_when_it_has_one(tmp_path):
    v4 = tiny_checkpoint("tiny-v4")
    assert minidi.load_model(v4).tokenizer is not None
    bare = _copy_without_tokenizer(v4, tmp_path / "v4")
    assert minidi.load_model(bare).tokenizer is None


def test_stale_tiny_cache_without_tokenizer_is_rewritten(tmp_path, monkeypatch):
    """A cache written by code from before the tokenizer shipped is detected and rebuilt, weights unchanged."""
    monkeypatch.setenv("MINIDI_CACHE", str(tmp_path))
    src = tiny_checkpoint("tiny-v4")  # the shared cache (env read at call time: this is tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    before = {p.name: p.read_bytes() for p in src.glob("*.safetensors")}
    again = tiny_checkpoint("tiny-v4")
    assert again == src and tiny_tokenizer.is_current(again) and (again / INDEX_NAME).is_file()
    assert {p.name: p.read_bytes() for p in again.glob("*.safetensors")} == before  # bit-identical weights
    # an older tokenizer version is rebuilt too
    conf = json.loads((again / "tokenizer_config.json").read_text())
    (again / "tokenizer_config.json").write_text(json.dumps({**conf, "minidi_tiny_tokenizer": 0}))
    assert not tiny_tokenizer.is_current(again)
    assert tiny_tokenizer.is_current(tiny_checkpoint("tiny-v4"))


def test_random_full_size_preset_keeps_test_map_explicitly():
    from minidi.runtime.tokenizer import install_tokenizer

    class Stub:  # the full-size model is too big for a CPU test: the choice is a function of the config only
        cfg = preset("v41-flash")

        def set_token_map(self, m):  # pragma: no cover - must not be called
            raise AssertionError("the test map must stay")

    s = Stub()
    install_tokenizer(s, None, "test")
    assert s.tokenizer is None
    with pytest.raises(TokenizerMissing):
        install_tokenizer(s, None, None)


# ---- text in / out --------------------------------------------------------------------------------------------
def test_generate_text(model):
    eng = Engine(model, max_batch_tokens=64, max_seqs=4, cache_tokens=2048, page_size=8)
    prompts = ["Hello, world!", "The tiny model"]
    res = eng.generate(prompts, max_new_tokens=3)
    tok = model.tokenizer
    for p, r in zip(prompts, res):
        assert r.error is None and 1 <= len(r.tokens) <= 3 and isinstance(r.text, str)
        assert r.text == tok.decode(r.tokens)
        # the same as the id path with BOS first
        ids = eng.generate([tok.encode(p)], max_new_tokens=len(r.tokens))[0]
        assert ids.tokens == r.tokens and ids.text == r.text
    eng.tokenizer = None  # a model without one (a V4 folder with no tokenizer.json)
    with pytest.raises(ValueError, match="need a tokenizer"):
        eng.generate(["x"], max_new_tokens=1)


def test_generate_stops_at_eos(model):
    """With EOS forced to win every step: text prompts stop after it, id prompts keep their exact count."""
    eng = Engine(model, max_batch_tokens=64, max_seqs=4, cache_tokens=2048, page_size=8)
    pages = {m: len(p) for m, p in eng.cache.free_pages.items()}
    eos, step = model.tokenizer.eos_id, eng.step_fn

    def eos_wins(meta, cache):
        logits = step(meta, cache)
        logits[:, eos] = logits.max() + 1
        return logits

    eng.step_fn = eos_wins
    text, ids = eng.generate(["Stop", model.tokenizer.encode("Stop")], max_new_tokens=3)
    assert text.error is None and text.tokens == [eos] and text.text == ""  # EOS ends it, decoded without specials
    assert ids.tokens == [eos] * 3
    assert eng.generate([[0, 5]], max_new_tokens=3, stop_at_eos=True)[0].tokens == [eos]
    assert len(eng.cache.free_slots) == eng.cache.max_slots  # a stopped sequence returns its slot and pages
    assert {m: len(p) for m, p in eng.cache.free_pages.items()} == pages
