"""RoPE cos/sin tables: lookups equal the formula bitwise, positions are checked, one table per variant is shared."""

import pytest
import torch

from minidi.model.context import ModelCache, StepMeta
from minidi.model.layers import RopeTable, apply_rope, rope_cos_sin, rope_cos_sin_lookup, rope_inv_freq, rope_table
from minidi.model.model import Transformer
from minidi.model.presets import preset
from minidi.runtime.build import model_from_tensors
from minidi.runtime.random_weights import random_state_dict


def _positions(p: int, n: int, seed: int) -> torch.Tensor:
    rand = torch.randint(0, p, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.tensor([0, p - 1, 1, p - 2]), rand, torch.tensor([0, p - 1])])  # ends and repeats


# one full-size table (1M positions, 256 MB, ~2 s): the YaRN variant, largest angles
@pytest.mark.parametrize("name, compressed", [("tiny-v41", False), ("tiny-v41", True), ("tiny-v4", False),
                                              ("tiny-v4", True), ("v41-flash", True)])
def test_lookup_equals_rope_cos_sin_bitwise(name, compressed):
    cfg = preset(name)
    p = cfg.max_position_embeddings
    inv = rope_inv_freq(cfg, compressed)
    table = rope_table(inv, p)
    assert table.shape == (p, cfg.rope_head_dim // 2, 2) and table.dtype == torch.float32
    for n in (1, 7, 300):
        pos = _positions(p, n, seed=n)
        cos, sin = rope_cos_sin_lookup(pos, table)
        want_cos, want_sin = rope_cos_sin(pos, inv)
        assert cos.shape == sin.shape == (len(pos), cfg.rope_head_dim // 2)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_positions_past_the_table_are_rejected_on_the_host():
    """The lookup is plain (no host check inside the step); positions are checked where they are made: the step
    builder refuses an item whose positions pass max_position_embeddings, and the reference forward a longer
    sequence. The lookup itself takes an empty position list (no compressed entries)."""
    from minidi.runtime.batch import StepItem, build_step
    from minidi.runtime.cache import CacheManager, SeqCache

    cfg = preset("tiny-v41")
    p = cfg.max_position_embeddings
    cm = CacheManager(cfg, max_slots=2, max_tokens=2 * (p + 8), page_size=8)
    ok, bad = SeqCache(), SeqCache()
    cm.grow(ok, p)
    cm.grow(bad, p + 1)
    build_step(cm, [StepItem(ok, list(range(p)), [])])
    with pytest.raises(ValueError, match=f"step item 1: positions \\[0, {p + 1}\\) pass max_position_embeddings {p}"):
        build_step(cm, [StepItem(ok, [1], []), StepItem(bad, list(range(p + 1)), [])])
    table = rope_table(rope_inv_freq(cfg, True), p)
    cos, sin = rope_cos_sin_lookup(torch.zeros(0, dtype=torch.long), table)
    assert cos.shape == sin.shape == (0, cfg.rope_head_dim // 2)


@pytest.mark.parametrize("name", ["tiny-v41", "tiny-v4"])
def test_one_table_per_variant_shared_not_in_state_dict(name):
    cfg = preset(name)
    model = model_from_tensors(cfg, random_state_dict(cfg, seed=0), "cpu")  # meta build + reset_buffers
    by_variant: dict[bool, list] = {}
    for layer in model.layers:
        by_variant.setdefault(layer.attn.ratio > 0, []).append(layer.attn.rope.cos_sin)
    assert set(by_variant) == {False, True} and len(by_variant[True]) >= 2
    for compressed, tables in by_variant.items():
        assert len({t.data_ptr() for t in tables}) == 1  # one storage for all layers of the variant
        assert torch.equal(tables[0], rope_table(rope_inv_freq(cfg, compressed), cfg.max_position_embeddings))
    assert by_variant[False][0].data_ptr() != by_variant[True][0].data_ptr()
    rope_buffers = [n for n, _ in model.named_buffers() if n.endswith("cos_sin")]
    assert sorted(rope_buffers) == ["rope.compressed.cos_sin", "rope.window.cos_sin"]
    assert not any("cos_sin" in k or "inv_freq" in k for k in model.state_dict())

    model.reset_buffers()  # rebuilt, still shared
    assert len({layer.attn.rope.cos_sin.data_ptr() for layer in model.layers if layer.attn.ratio > 0}) == 1
    model.to("meta")  # moved once: the layers keep sharing the moved table
    tables = {id(layer.attn.rope.cos_sin) for layer in model.layers if layer.attn.ratio > 0}
    assert len(tables) == 1 and model.rope["compressed"].cos_sin.is_meta


def test_meta_build_then_reset_builds_on_the_weights_device():
    cfg = preset("tiny-v41")
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.rope["window"].cos_sin.is_meta  # nothing computed on meta
    table = RopeTable(cfg, compressed=True)
    table.reset_buffers("meta")
    assert table.cos_sin.is_meta and table.cos_sin.shape == (cfg.max_position_embeddings, cfg.rope_head_dim // 2, 2)


def test_compiled_rope_only_loads_the_table():
    """The point of the table: the traced step has no sin/cos (Inductor would recompute them per rotated element)."""
    cfg = preset("tiny-v41", dtype="float32")
    model = model_from_tensors(cfg, random_state_dict(cfg, seed=0), "cpu")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    meta = StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.step_ngram)
    torch._dynamo.reset()
    out = torch.compile(model.step, backend=record, fullgraph=True)(meta, ModelCache())
    torch._dynamo.reset()
    assert torch.equal(out, model.step(meta, ModelCache()))
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op in ("call_function", "call_method")}
    assert graphs and not any("sin" in t or "cos" in t for t in targets), sorted(targets)


def test_compiled_lookup_and_rope_match_eager():
    cfg = preset("tiny-v41")
    table = rope_table(rope_inv_freq(cfg, True), cfg.max_position_embeddings)
    g = torch.Generator().manual_seed(0)

    def rotate(x, pos, table):
        cos, sin = rope_cos_sin_lookup(pos, table)
        return apply_rope(x, cos, sin)

    compiled = torch.compile(rotate, dynamic=True, fullgraph=True)
    for t in (7, 33):
        x = torch.randn(t, 3, 96, generator=g).to(torch.bfloat16)
        pos = _positions(cfg.max_position_embeddings, t - 6, seed=t)
        torch.testing.assert_close(compiled(x, pos, table), rotate(x, pos, table), atol=0, rtol=0)
