"""Data-parallel attention + expert-parallel MoE over gloo: N = 2 and N = 4 ranks give the logits of N = 1.

Each spawned rank loads ``tiny-v41`` (fp32, no fake quant) as EP rank r of N (only its experts), installs
``DistributedEP`` and runs its own packed batch (ranks differ in sequences and token counts: ragged), three ways:
counts exchanged per MoE layer, counts planned once per step, and a uniform exchange on equal-length batches. The
parent runs each rank's batches through one N = 1 model (all experts, ``LocalExperts``) and compares.
Tolerance 1e-4: the only difference is the order of the fp32 sum over a token's k experts (per-rank partial sums,
then the reduce-scatter).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import minidi
from minidi.model.expert_parallel import ExpertExchange
from minidi.runtime.batch import StepItem, build_step
from minidi.runtime.cache import CacheManager, SeqCache
from minidi.runtime.distributed import (DistributedEP, check_experts_divisible, init_from_env,
                                        install_expert_parallel)

MODEL = dict(dtype="float32", fake_quant=False)
TOL = 1e-4
UNIFORM_LEN = 13  # tokens per rank of the equal-count batch


def rank_batch(rank: int) -> list[list[int]]:
    """Rank r's sequences: different counts and lengths per rank (T_r = 19, 20, 23, 12 + ...)."""
    lens = [[12, 7], [20], [9, 14], [16, 5, 3]][rank % 4]
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lens]


def uniform_batch(rank: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(200 + rank)
    return [torch.randint(3, 512, (UNIFORM_LEN,), generator=gen).tolist()]


def run_batch(model, seqs: list[list[int]], exchange: DistributedEP | None = None) -> torch.Tensor:
    """One step over the packed sequences (nothing cached) -> logits of every row [sum len, V]."""
    cm = CacheManager(model.cfg, max_slots=len(seqs), max_tokens=sum(map(len, seqs)) + 64)
    items = []
    for toks in seqs:
        seq = SeqCache()
        cm.grow(seq, len(toks))
        items.append(StepItem(seq, toks, [], all_logits=True))
    meta = build_step(cm, items)
    if exchange is not None:
        exchange.plan(meta.input_ids.shape[0], "cpu")
    with torch.no_grad():
        return model.step(meta, cm.tensors)


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N processes share 2 cores
    try:
        assert init_from_env(expected_world=world, device="cpu") == (rank, world)
        model = minidi.load_model("tiny-v41", ep_size=world, ep_rank=rank, **MODEL)
        assert model.layers[0].ffn.experts.w1.shape[0] == 8 // world  # only this rank's experts were loaded
        ex = install_expert_parallel(model, measure=True)
        assert isinstance(ex, ExpertExchange)  # the contract MoE types its exchange with
        per_layer = run_batch(model, rank_batch(rank))  # counts all-gathered in every MoE layer
        planned = run_batch(model, rank_batch(rank), exchange=ex)  # counts once per step
        uni = install_expert_parallel(model, uniform=True)
        uniform = run_batch(model, uniform_batch(rank))
        if world == 4:  # 8 experts split 4 ways is fine; a 6-expert model would not be
            with pytest.raises(ValueError, match="6 routed experts cannot be split over 4 ranks"):
                DistributedEP(n_experts=6)
        torch.save({"per_layer": per_layer, "planned": planned, "uniform": uniform, "stats": ex.stats,
                    "uniform_stats": uni.stats}, Path(out) / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference():
    """The N = 1 model (also writes the tiny checkpoint before ranks race to read it)."""
    return minidi.load_model("tiny-v41", **MODEL)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_matches_one_rank(world: int, reference, tmp_path) -> None:
    mp.spawn(_rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        want = run_batch(reference, rank_batch(r))
        assert want.shape == got["per_layer"].shape == (sum(map(len, rank_batch(r))), reference.cfg.vocab_size)
        for key in ("per_layer", "planned"):
            err = (got[key] - want).abs().max().item()
            assert err <= TOL, f"rank {r} of {world} ({key}): max |logits - N=1 logits| = {err:.3g} > {TOL}"
        err = (got["uniform"] - run_batch(reference, uniform_batch(r))).abs().max().item()
        assert err <= TOL, f"rank {r} of {world} (uniform): max |logits - N=1 logits| = {err:.3g} > {TOL}"
        stats = got["stats"]
        layers = reference.cfg.n_layers
        assert stats["calls"] == 2 * layers and stats["dispatch_bytes"] > 0 and stats["combine_bytes"] > 0
        # one count exchange per MoE layer in the first step, one for the planned step
        assert stats["count_bytes"] == (layers + 1) * (world - 1) * 8
        assert got["uniform_stats"]["count_bytes"] == 0


def test_experts_not_divisible() -> None:
    with pytest.raises(ValueError, match="8 routed experts cannot be split over 3 ranks"):
        check_experts_divisible(8, 3)
    with pytest.raises(ValueError, match="ep_size 3"):
        minidi.load_model("tiny-v41", ep_size=3, ep_rank=0, **MODEL)


def test_world_size_mismatch(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE 4 but the job expects 2"):
        init_from_env(expected_world=2, device="cpu")
    monkeypatch.delenv("RANK")
    with pytest.raises(RuntimeError, match=r"\['RANK'\] not set"):
        init_from_env(device="cpu")


def test_model_not_built_for_this_world() -> None:
    """A model loaded as EP2 installed in a world of 1 (in-process gloo group) is refused, naming both."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = minidi.load_model("tiny-v41", ep_size=2, ep_rank=0, **MODEL)
        with pytest.raises(ValueError, match="EP rank 0 of 2, but this process is rank 0 of a world of 1"):
            install_expert_parallel(model)
    finally:
        dist.destroy_process_group()
