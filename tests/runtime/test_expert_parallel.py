"""Expert parallelism: the config fields, one rank's experts loaded from the checkpoint (and only those), the MoE
identity the distributed exchange relies on (the ranks' routed outputs sum to the one-device output), the emulated
exchange of the benchmarks, and the smaller random Engram tables of ``Transformer(cfg, engram_rows=...)``."""

from __future__ import annotations

import pytest
import torch

import minidi
from minidi.model.context import ModelCache, StepMeta
from minidi.model.expert_parallel import ExpertExchange, LocalExperts
from minidi.runtime.expert_parallel import EmulatedEP, rotated_blocks, rotated_blocks_ref
from minidi.runtime.build import model_from_tensors, rank_experts_only
from minidi.runtime.checkpoint import CheckpointError, load_checkpoint, tiny_checkpoint, write_checkpoint
from minidi.runtime.random_weights import random_state_dict
from minidi.runtime.weight_table import expected_tensors

KW = dict(dtype="float32", fake_quant=False)
STACKS = ("w1", "w1_scale", "w2", "w2_scale", "w3", "w3_scale")


def _meta(cfg, n: int = 24, seed: int = 0) -> StepMeta:
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    return StepMeta.for_sequence(ids, cfg.window_size, tuple(sorted(set(cfg.compress_ratios) - {0})),
                                 cfg.step_ngram)


@pytest.fixture(scope="module")
def full():
    return minidi.load_model("tiny-v41", **KW)


@pytest.fixture(scope="module")
def ranks():
    """tiny-v41 at EP2: rank 0 and rank 1, loaded from the same tiny checkpoint."""
    return [minidi.load_model("tiny-v41", ep_size=2, ep_rank=r, **KW) for r in range(2)]


# ---- config ---------------------------------------------------------------------------------------------------------
def test_config_local_expert_range():
    cfg = minidi.preset("tiny-v41", ep_size=4, ep_rank=3)
    assert cfg.n_routed_experts == 8
    assert (cfg.n_local_experts, cfg.first_local_expert) == (2, 6)
    one = minidi.preset("tiny-v41")
    assert (one.ep_size, one.ep_rank, one.n_local_experts, one.first_local_expert) == (1, 0, 8, 0)


@pytest.mark.parametrize("changes, field", [
    (dict(ep_size=3), "ep_size 3"),  # does not divide 8 experts
    (dict(ep_size=0), "ep_size 0"),
    (dict(ep_size=2, ep_rank=2), "ep_rank 2"),
    (dict(ep_size=2, ep_rank=-1), "ep_rank -1"),
])
def test_config_rejects_bad_ep(changes, field):
    with pytest.raises(ValueError, match=field):
        minidi.preset("tiny-v41", **changes)


# ---- loading one rank's experts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_loads_its_slice_of_the_experts(full, ranks, rank):
    model = ranks[rank]
    assert model.cfg.ep_size == 2 and model.cfg.ep_rank == rank
    lo, hi = 4 * rank, 4 * rank + 4
    for i, (a, b) in enumerate(zip(model.layers, full.layers)):
        for name in STACKS:
            got, whole = getattr(a.ffn.experts, name), getattr(b.ffn.experts, name)
            assert got.shape == (4, *whole.shape[1:]), (i, name)
            assert torch.equal(got, whole[lo:hi]), (i, name)
        # everything else is the whole model's
        assert torch.equal(a.ffn.gate.weight, b.ffn.gate.weight)
        assert torch.equal(a.ffn.shared_experts.w1.weight, b.ffn.shared_experts.w1.weight)


@pytest.mark.parametrize("rank", [0, 1])
def test_state_dict_names_carry_global_expert_ids(ranks, rank):
    sd = ranks[rank].state_dict()
    ids = {int(k.split(".")[4]) for k in sd if ".ffn.experts." in k}
    assert ids == set(range(4 * rank, 4 * rank + 4))
    assert set(sd) == set(expected_tensors(ranks[rank].cfg))
    # and they round-trip: the rank's own state dict loads into a fresh rank model
    again = model_from_tensors(ranks[rank].cfg, dict(sd), "cpu")
    assert torch.equal(again.layers[5].ffn.experts.w2, ranks[rank].layers[5].ffn.experts.w2)


def test_weight_table_holds_the_rank_experts_only():
    cfg = minidi.preset("tiny-v41", ep_size=4, ep_rank=1)
    names = [n for n in expected_tensors(cfg) if n.startswith("layers.0.ffn.experts.")]
    assert sorted({int(n.split(".")[4]) for n in names}) == [2, 3]
    sd = random_state_dict(cfg, seed=1)
    assert set(sd) == set(expected_tensors(cfg))
    model = model_from_tensors(cfg, sd, "cpu")
    assert model.layers[0].ffn.experts.w1.shape[0] == 2


@pytest.fixture(scope="module")
def tiny_tensors():
    cfg, tensors = load_checkpoint(tiny_checkpoint("tiny-v41"))
    return cfg, tensors


def test_other_ranks_experts_are_skipped_but_unknown_ids_reported(tiny_tensors, tmp_path):
    cfg, tensors = tiny_tensors
    bogus = {"layers.0.ffn.experts.999.w1.weight": tensors["layers.0.ffn.experts.0.w1.weight"],
             "layers.3.ffn.experts.8.w2.scale": tensors["layers.3.ffn.experts.0.w2.scale"]}  # 8 = n_routed_experts
    path = write_checkpoint(tmp_path / "ckpt", cfg, {**tensors, **bogus}, max_shard_bytes=2 << 20)
    rank1 = cfg.with_(ep_size=2, ep_rank=1)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, cfg=rank1, only=rank_experts_only(rank1))
    assert len(err.value.problems) == 1, err.value.problems
    problem = err.value.problems[0]
    assert problem.startswith("unexpected tensors (2)")
    assert "layers.0.ffn.experts.999.w1.weight" in problem and "layers.3.ffn.experts.8.w2.scale" in problem
    assert "experts.0." not in problem and "experts.3." not in problem  # rank 0's experts are not "unexpected"
    with pytest.raises(CheckpointError, match=r"experts\.999"):
        minidi.load_model(path, ep_size=2, ep_rank=1, **KW)


def test_rank_checkpoint_without_other_ranks_experts(tiny_tensors, tmp_path):
    """A checkpoint holding only rank 1's experts loads at rank 1 (nothing missing), not at EP1."""
    cfg, tensors = tiny_tensors
    keep = rank_experts_only(cfg.with_(ep_size=2, ep_rank=1))
    path = write_checkpoint(tmp_path / "rank1", cfg, {k: v for k, v in tensors.items() if keep(k)},
                            max_shard_bytes=2 << 20)
    model = minidi.load_model(path, ep_size=2, ep_rank=1, token_map="test", **KW)  # written without a tokenizer
    assert torch.equal(model.layers[2].ffn.experts.w3, tensors_stack(tensors, 2, "w3", range(4, 8)))
    with pytest.raises(CheckpointError, match=r"missing tensors .*layers\.0\.ffn\.experts\.0\.w1\.weight"):
        minidi.load_model(path, **KW)


def tensors_stack(tensors: dict, layer: int, name: str, ids) -> torch.Tensor:
    return torch.stack([tensors[f"layers.{layer}.ffn.experts.{e}.{name}.weight"] for e in ids])


def test_rank_filter():
    keep = rank_experts_only(minidi.preset("tiny-v41", ep_size=4, ep_rank=2))
    assert keep("layers.7.ffn.experts.4.w1.weight") and keep("layers.7.ffn.experts.5.w2.scale")
    assert not keep("layers.7.ffn.experts.3.w1.weight") and not keep("layers.7.ffn.experts.6.w1.weight")
    assert keep("layers.7.ffn.shared_experts.w1.weight") and keep("layers.7.ffn.gate.weight")
    assert keep("layers.7.ffn.experts.999.w1.weight")  # not a real expert: kept so the loader reports it


# ---- the MoE identity under EP --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("ep", [2, 4])
def test_routed_outputs_of_the_ranks_sum_to_the_one_device_output(ep, dtype, tol):
    """sum_r experts_r(x) == experts(x): what a dispatch / reduce-scatter exchange computes, checked per layer."""
    kw = dict(dtype=dtype, fake_quant=False)
    one = minidi.load_model("tiny-v41", **kw)
    ranks = [minidi.load_model("tiny-v41", ep_size=ep, ep_rank=r, **kw) for r in range(ep)]
    g = torch.Generator().manual_seed(ep)
    x = torch.randn(29, one.cfg.dim, generator=g).to(one.cfg.torch_dtype)  # 29 tokens: ragged
    ids = torch.randint(0, one.cfg.vocab_size, (29,), generator=g)
    with torch.no_grad():
        for layer in (0, 3, 9):
            idx, w = one.layers[layer].ffn.gate(x, ids)
            want = one.layers[layer].ffn.experts(x, idx, w, one.cfg)
            parts = []
            for m in ranks:
                assert isinstance(m.layers[layer].ffn.exchange, LocalExperts)
                xs, i2, w2 = m.layers[layer].ffn.exchange.dispatch(x, idx, w)
                parts.append(m.layers[layer].ffn.exchange.combine(m.layers[layer].ffn.experts(xs, i2, w2, m.cfg)))
            assert want.dtype == torch.float32 and torch.isfinite(want).all()
            torch.testing.assert_close(sum(parts), want, atol=tol, rtol=tol)
            # each rank adds something only for tokens routed to one of its experts
            for r, p in enumerate(parts):
                lo, hi = r * (8 // ep), (r + 1) * (8 // ep)
                untouched = ~((idx >= lo) & (idx < hi)).any(-1)
                assert (p[untouched] == 0).all()


def test_one_device_has_no_expert_parallel_remap(full, ranks, monkeypatch):
    """N = 1 keeps the graph it had before expert parallelism existed: no key remapping op runs (a rank does)."""
    calls = []
    real = torch.remainder
    monkeypatch.setattr(torch, "remainder", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(5, full.cfg.dim)
    ids = torch.randint(0, full.cfg.vocab_size, (5,))
    with torch.no_grad():
        for model, want in ((full, 0), (ranks[1], 1)):
            calls.clear()
            ffn = model.layers[0].ffn
            idx, w = ffn.gate(x, ids)
            ffn.experts(x, idx, w, model.cfg)
            assert len(calls) == want


def test_rank_output_ignores_garbage_in_other_ranks_rows(ranks, full):
    """The rows routed to other ranks' experts are masked in the combine: NaN weights there change nothing."""
    m = ranks[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, m.cfg.dim, generator=g)
    idx = torch.randint(0, 8, (16, 2), generator=g)
    idx[:, 1] = (idx[:, 0] + 1) % 8
    w = torch.rand(16, 2, generator=g)
    with torch.no_grad():
        clean = m.layers[1].ffn.experts(x, idx, w, m.cfg)
        w_nan = torch.where(idx >= 4, torch.full_like(w, float("nan")), w)
        dirty = m.layers[1].ffn.experts(x, idx, w_nan, m.cfg)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, atol=1e-6, rtol=0)


# ---- the emulated exchange ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_emulated_dispatch_and_combine(n):
    g = torch.Generator().manual_seed(n)
    t, k = 10, 2
    x, idx, w = torch.randn(t, 8, generator=g), torch.randint(0, 8, (t, k), generator=g), torch.rand(t, k, generator=g)
    ep = EmulatedEP(n)
    assert ep.size == n and f"EP{n}" in ep.describe()
    xs, idx_all, w_all = ep.dispatch(x, idx, w)
    assert xs.shape == (n * t, 8) and idx_all.shape == w_all.shape == (n * t, k)
    assert torch.equal(xs[:t], x) and torch.equal(idx_all[:t], idx) and torch.equal(w_all[:t], w)
    for r in range(n):  # every synthesised rank keeps each token with its own routing
        rows = slice(r * t, (r + 1) * t)
        order = [int((xs[rows] == x[j]).all(-1).nonzero()) for j in range(t)]
        assert torch.equal(idx_all[rows][order], idx) and torch.equal(w_all[rows][order], w)
    partial = torch.randn(n * t, 8, generator=g)
    assert torch.equal(ep.combine(partial), partial[:t])


@pytest.mark.parametrize("t,n", [(10, 3), (7, 4), (13, 4), (1, 4), (0, 2), (64, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_rotated_blocks_equal_the_rolls(t, n, dtype):
    """The copy op is ``cat(x.roll(r T // n, 0))`` bit for bit, on ragged T (T not a multiple of n, T < n, empty)."""
    g = torch.Generator().manual_seed(t * 10 + n)
    x = (torch.randn(t, 5, 3, generator=g) * 100).to(dtype)
    out = rotated_blocks(x, n)
    assert out.shape == (n * t, 5, 3) and out.is_contiguous()
    assert torch.equal(out, rotated_blocks_ref(x, n))
    assert torch.equal(rotated_blocks(x.transpose(1, 2), n), rotated_blocks_ref(x.transpose(1, 2), n))


def test_rotated_blocks_op_contract():
    torch.library.opcheck(torch.ops.minidi.rotated_blocks.default, (torch.randn(9, 4), 3))
    torch.library.opcheck(torch.ops.minidi.rotated_blocks.default, (torch.randint(0, 9, (5, 2)), 2))
    with pytest.raises(ValueError, match="size >= 1"):
        rotated_blocks(torch.randn(3, 2), 0)


def test_emulated_dispatch_compiles_to_the_copy_op():
    """Under torch.compile (dynamic T, full graph) the dispatch is the op, not a roll, and gives the same bits at
    two token counts from one graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ep = EmulatedEP(4)
    f = torch.compile(ep.dispatch, backend=backend, dynamic=True, fullgraph=True)
    for t in (12, 13):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, 8, generator=g).bfloat16()
        idx, w = torch.randint(0, 8, (t, 2), generator=g), torch.rand(t, 2, generator=g)
        for got, a in zip(f(x, idx, w), (x, idx, w)):
            assert torch.equal(got, rotated_blocks_ref(a, 4))
    assert len(graphs) == 1
    code = graphs[0].code
    assert code.count("minidi.rotated_blocks") == 3 and "roll" not in code


def test_emulated_ep_needs_two_ranks():
    with pytest.raises(ValueError, match="size >= 2"):
        EmulatedEP(1)
    local = LocalExperts()
    x = torch.randn(3, 4)
    assert local.size == 1 and local.dispatch(x, x, x)[0] is x and local.combine(x) is x


def test_exchange_size_must_match_the_config(full, ranks):
    with pytest.raises(ValueError, match=r"EP2.*ep_size 1"):
        full.set_expert_exchange(EmulatedEP(2))
    with pytest.raises(ValueError, match=r"EP4.*ep_size 2"):
        ranks[0].set_expert_exchange(EmulatedEP(4))
    with pytest.raises(ValueError, match=r"EP1.*ep_size 2"):
        ranks[0].set_expert_exchange(LocalExperts())
    assert all(isinstance(b.ffn.exchange, LocalExperts) for b in full.layers)  # nothing installed on failure


def test_emulated_ep_model_runs():
    model = minidi.load_model("tiny-v41", ep_size=2, ep_rank=0, **KW)
    ep = EmulatedEP(2)
    model.set_expert_exchange(ep)
    assert all(b.ffn.exchange is ep for b in model.layers)
    meta = _meta(model.cfg, 24)
    with torch.no_grad():
        logits = model.step(meta, ModelCache())
    assert logits.shape == (24, model.cfg.vocab_size) and torch.isfinite(logits).all()


def test_emulated_rank_computes_its_own_tokens_like_a_local_rank(ranks):
    """The routed output of an emulated rank on its own tokens is its experts' part of them: the other (synthesised)
    ranks' tokens change the GEMM sizes, not this rank's rows."""
    m = ranks[1]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, m.cfg.dim, generator=g)
    ids = torch.randint(0, m.cfg.vocab_size, (20,), generator=g)
    experts, ep = m.layers[6].ffn.experts, EmulatedEP(2)
    with torch.no_grad():
        idx, w = m.layers[6].ffn.gate(x, ids)
        local = experts(x, idx, w, m.cfg)
        emulated = ep.combine(experts(*ep.dispatch(x, idx, w), m.cfg))
    torch.testing.assert_close(emulated, local, atol=1e-5, rtol=1e-5)


# ---- smaller Engram tables (a construction-time option, not a config field) -----------------------------------------
def test_smaller_engram_tables():
    cfg = minidi.preset("tiny-v41", **KW)
    assert not hasattr(cfg, "engram_table_rows")  # no benchmark field in the config
    assert [cfg.engram_rows(l) for l in cfg.engram_layers] == list(cfg.engram_num_embeddings) == [630, 834]
    sd = random_state_dict(cfg, seed=0, engram_rows=100)
    assert sd["layers.1.engram.embed.weight"].shape == (100, cfg.engram_head_dim)
    assert sd["layers.4.engram.embed.weight"].shape == (100, cfg.engram_head_dim)
    assert random_state_dict(cfg, seed=0, engram_rows=700)["layers.1.engram.embed.weight"].shape[0] == 630

    model = model_from_tensors(cfg, sd, "cpu", engram_rows=100)
    assert model.engram_rows == 100
    assert model.layers[1].engram.rows == model.layers[1].engram.embed.weight.shape[0] == 100
    assert model.layers[4].engram.embed.weight.shape[0] == 100
    meta = _meta(cfg, 32)
    ids = model.engram_ids(meta)
    assert set(ids) == {1, 4}
    assert all(int(v.min()) >= 0 and int(v.max()) < 100 for v in ids.values())
    with torch.no_grad():
        assert torch.isfinite(model.step(meta, ModelCache())).all()

    full_model = minidi.load_model("tiny-v41", **KW)  # the real tables, ids over all their rows
    full_ids = full_model.engram_ids(meta)
    assert full_model.engram_rows is None and full_model.layers[4].engram.embed.weight.shape[0] == 834
    assert int(full_ids[4].max()) >= 100 and int(full_ids[4].max()) < 834
    assert all(torch.equal(ids[l], full_ids[l] % 100) for l in (1, 4))  # the small table takes the ids modulo
    with pytest.raises(RuntimeError, match="size mismatch"):  # the real-size model refuses the small tables
        model_from_tensors(cfg, sd, "cpu")
    with pytest.raises(ValueError, match="engram_rows must be >= 1"):
        random_state_dict(cfg, engram_rows=0)
    with pytest.raises(ValueError, match="gate_bias / engram_rows"):  # checkpoints hold their real tables
        minidi.load_model("tiny-v41", engram_rows=100)


def test_exchanges_follow_the_protocol():
    """LocalExperts (the model's default), EmulatedEP and DistributedEP are ExpertExchanges (the distributed one is
    also checked on live ranks in tests/runtime/test_distributed.py)."""
    from minidi.runtime.distributed import DistributedEP

    for ex in (LocalExperts(), EmulatedEP(2)):
        assert isinstance(ex, ExpertExchange)
    for name in ("dispatch", "combine", "describe"):
        assert callable(getattr(DistributedEP, name))
    assert not isinstance(object(), ExpertExchange)
    model = minidi.load_model("tiny-v41", **KW)
    assert all(isinstance(b.ffn.exchange, ExpertExchange) for b in model.layers)
