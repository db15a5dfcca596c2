"""Several ranks under ``torchrun``: data-parallel attention, expert-parallel MoE (``torch.distributed``).

Each rank runs attention on its own batch of T_r tokens and holds E/N of the routed experts
(``ModelConfig.ep_size`` / ``ep_rank``; the loader reads only those experts). Every MoE layer then meets the other
ranks through ``DistributedEP``, an ``ExpertExchange`` (the contract in ``minidi.model.expert_parallel``):

    dispatch  all-gather every rank's tokens and routing          x [T, D], idx/w [T, k] -> [sum_r T_r, D], [.., k]
    experts   each token's sum over the experts held here         (rows of other ranks' experts are masked: the
                                                                   combine reads only local experts' rows)
    combine   reduce-scatter the partial sums; keep this rank's   [sum_r T_r, D] fp32 -> [T, D]

Why all-gather + reduce-scatter rather than all-to-all: docs/distributed.md (bytes measured and by formula).

Ragged ranks (T_r differ): the ranks first all-gather their counts (one int64 each, one host sync), pad to the
largest count, gather, and drop the padding rows before the experts (no GEMM on padding); the combine scatters the
partial sums back into the padded layout for the reduce-scatter. ``plan(t)`` does that count exchange once per step
instead of once per MoE layer, and ``uniform=True`` (every rank always has the same T, as in the benchmark) skips it:
no host sync at all, and the exchange traces under ``torch.compile`` (functional collectives).

Legend: N ranks, T this rank's tokens, T_r rank r's, Tm = max_r T_r, k experts per token, D model width.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from minidi.model import stages

# the non-deprecated names of torch >= 2.10, the older ones before
_all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_reduce_scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor


# ---- set-up ----------------------------------------------------------------------------------------------------------
def check_experts_divisible(n_experts: int, world: int) -> None:
    """Each rank must hold the same number of whole experts."""
    if world < 1 or n_experts % world:
        raise ValueError(f"{n_experts} routed experts cannot be split over {world} ranks: expert parallelism needs "
                         f"the world size to divide the expert count (try one of "
                         f"{[n for n in range(1, n_experts + 1) if n_experts % n == 0]})")


def init_from_env(expected_world: int | None = None, device: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``).

    NCCL on CUDA (and ``cuda:LOCAL_RANK`` becomes the current device), gloo on the CPU (tests). ``device`` forces
    the choice ("cpu" / "cuda"); default: CUDA when available. ``expected_world``: the N the job was configured for;
    a launch with another world size is refused before anything blocks on the missing / extra ranks.
    Returns (rank, world). Already initialised: checks and returns the existing group's.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in os.environ]
    if missing:
        raise RuntimeError(f"environment variable(s) {missing} not set: launch with "
                           f"`torchrun --nproc-per-node N ...` (or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                           f"MASTER_PORT)")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if expected_world is not None and world != expected_world:
        raise ValueError(f"launched with WORLD_SIZE {world} but the job expects {expected_world} ranks: run "
                         f"`torchrun --nproc-per-node {expected_world}` or configure {world} ranks")
    if not 0 <= rank < world:
        raise ValueError(f"RANK {rank} is outside [0, WORLD_SIZE {world})")
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise RuntimeError(f"a process group of world {dist.get_world_size()} (rank {dist.get_rank()}) already "
                               f"exists, but the environment says world {world} (rank {rank})")
        return rank, world
    cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA device(s) visible: "
                               f"--nproc-per-node must not exceed the GPUs of the host")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    if dist.get_world_size() != world:  # defensive: the rendezvous disagrees with the environment
        raise RuntimeError(f"process group has {dist.get_world_size()} ranks, WORLD_SIZE says {world}")
    return rank, world


def install_expert_parallel(model, group: dist.ProcessGroup | None = None, **kwargs) -> "DistributedEP":
    """Check that ``model`` was built as this rank of this group's EP (ep_size = world, ep_rank = rank; its config
    already refused an ep_size that does not divide the experts), install a ``DistributedEP`` on it and return the
    exchange. ``kwargs`` go to ``DistributedEP``."""
    cfg = model.cfg
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if cfg.ep_size != world or cfg.ep_rank != rank:
        raise ValueError(f"model built as EP rank {cfg.ep_rank} of {cfg.ep_size}, but this process is rank {rank} of "
                         f"a world of {world}: load it with ep_size={world}, ep_rank={rank}")
    exchange = DistributedEP(group, n_experts=cfg.n_routed_experts, **kwargs)
    model.set_expert_exchange(exchange)
    return exchange


# ---- the exchange ---------------------------------------------------------------------------------------------------
class DistributedEP:
    """The expert exchange over a process group: all-gather dispatch, reduce-scatter combine (module docstring).

    ``uniform``: every rank always routes the same number of tokens (no count exchange, no host sync, traceable).
    ``reduce_dtype``: dtype of the combine's reduce-scatter (default: the partial sums' fp32; bf16 halves the
    combine's bytes but rounds each rank's partial sum before the sum over ranks).
    ``n_experts`` (optional) lets ``stats`` also count what an all-to-all exchange would have moved (host syncs:
    for measurements, not for timing runs; ``measure=True`` turns it on).
    ``stats`` counts bytes *received per rank* (ring collectives send the same), eager calls only.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, uniform: bool = False,
                 reduce_dtype: torch.dtype | None = None, n_experts: int | None = None, measure: bool = False) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedEP needs an initialised process group (minidi.runtime.distributed."
                               "init_from_env under torchrun)")
        self.group = group if group is not None else dist.group.WORLD
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if n_experts is not None:
            check_experts_divisible(n_experts, self.size)
        self.uniform, self.reduce_dtype, self.n_experts, self.measure = uniform, reduce_dtype, n_experts, measure
        self._planned: list[int] | None = None  # per-rank counts set by plan(), used until the next plan()
        self._counts: list[int] = []  # counts of the dispatch in flight (its combine needs them)
        self._keep: dict = {}  # (counts, device) -> indices of the real rows in the padded gather
        self.stats = {"calls": 0, "count_bytes": 0, "dispatch_bytes": 0, "combine_bytes": 0,
                      "a2a_dispatch_bytes": 0, "a2a_combine_bytes": 0}

    # counts ----------------------------------------------------------------------------------------------------------
    def gather_counts(self, t: int, device: torch.device | str) -> list[int]:
        """Every rank's token count (one small all-gather and one host sync)."""
        mine = torch.tensor([t], dtype=torch.int64, device=device)
        counts = fc.wait_tensor(_all_gather(mine, 0, self.group)).tolist()
        self._add("count_bytes", (self.size - 1) * 8)
        return counts

    def plan(self, t: int, device: torch.device | str) -> list[int]:
        """Exchange the counts once for the coming step (every MoE layer of it reuses them); call on every rank
        before each step whose counts differ from the last plan's. Returns the counts."""
        if self.uniform:
            raise ValueError("plan() on a uniform DistributedEP: uniform exchanges assume equal counts, nothing "
                             "to plan")
        self._planned = self.gather_counts(t, device)
        return self._planned

    def _counts_for(self, t: int, device: torch.device) -> list[int]:
        if self.uniform:
            return [t] * self.size
        if self._planned is not None:
            if self._planned[self.rank] != t:
                raise ValueError(f"rank {self.rank} dispatches {t} tokens but plan() announced "
                                 f"{self._planned[self.rank]}: call plan() again before a step of a new size")
            return self._planned
        return self.gather_counts(t, device)  # one count exchange per MoE layer (eager only)

    def _keep_rows(self, counts: list[int], device: torch.device) -> torch.Tensor:
        key = (tuple(counts), str(device))
        if key not in self._keep:
            tm = max(counts)
            self._keep[key] = torch.cat([torch.arange(r * tm, r * tm + c) for r, c in enumerate(counts)]).to(device)
        return self._keep[key]

    def _add(self, key: str, n: int) -> None:
        if not torch.compiler.is_compiling():
            self.stats[key] += int(n)

    # dispatch / combine ----------------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D], idx [T, k] int64 global expert ids, w [T, k] fp32 -> every rank's, in rank order:
        [sum_r T_r, D], [sum_r T_r, k] int64, [sum_r T_r, k] (w's dtype)."""
        stages.enter("moe.comm", x)
        t, k = idx.shape
        n = self.size
        if self.uniform:  # no bookkeeping at all: under torch.compile t is symbolic, and nothing is stored
            tm, counts = t, None
        else:
            counts = self._counts_for(t, x.device)
            self._counts = counts
            tm = max(counts)
        # one collective for the routing: ids as int32 next to the weights' fp32 bits
        route = torch.cat([idx.to(torch.int32), w.to(torch.float32).view(torch.int32)], dim=1)  # [T, 2k] int32
        if counts is not None and tm != t:  # pad to the largest rank's count: the gather needs equal pieces
            x = torch.cat([x, x.new_zeros(tm - t, x.shape[1])])
            route = torch.cat([route, route.new_zeros(tm - t, 2 * k)])
        # wait before returning: functional collectives finish lazily, and the inputs (padded temporaries) must
        # outlive the backend's reads (gloo runs them on its own thread; a freed input corrupted the heap once)
        xs = fc.wait_tensor(_all_gather(x.contiguous(), 0, self.group))  # [N*Tm, D]
        routes = fc.wait_tensor(_all_gather(route, 0, self.group))  # [N*Tm, 2k]
        if counts is not None and any(c != tm for c in counts):  # drop the padding rows: the experts never see them
            keep = self._keep_rows(counts, x.device)
            xs, routes = xs[keep], routes[keep]
        idx_all = routes[:, :k].to(torch.int64)
        w_all = routes[:, k:].contiguous().view(torch.float32).to(w.dtype)
        self._add("calls", 1)
        self._add("dispatch_bytes", (n - 1) * tm * (x.shape[1] * x.element_size() + 8 * k))
        if self.measure and self.n_experts is not None and not torch.compiler.is_compiling():
            self._measure_a2a(idx[:t], x.shape[1] * x.element_size() + 8 * k, x.shape[1])
        stages.exit("moe.comm", xs)
        return xs, idx_all, w_all

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """partial [sum_r T_r, D] (sums over this rank's experts, every rank's tokens) -> [T, D] this rank's tokens,
        summed over all ranks' experts, in partial's dtype."""
        stages.enter("moe.comm", partial)
        n = self.size
        if self.uniform:
            counts, tm = None, partial.shape[0] // n
            t = tm
        else:
            counts = self._counts
            tm, t = max(counts), counts[self.rank]
        out_dtype = partial.dtype
        p = partial if self.reduce_dtype is None else partial.to(self.reduce_dtype)
        if counts is not None and any(c != tm for c in counts):  # back into the padded layout (padding rows: 0)
            keep = self._keep_rows(counts, p.device)
            p = p.new_zeros(n * tm, p.shape[1]).index_copy_(0, keep, p)
        y = fc.wait_tensor(_reduce_scatter(p.contiguous(), "sum", 0, self.group))  # [Tm, D] (waited: see dispatch)
        self._add("combine_bytes", (n - 1) * tm * p.shape[1] * p.element_size())
        if t != tm:
            y = y[:t]
        y = y.to(out_dtype)
        stages.exit("moe.comm", y)
        return y

    def _measure_a2a(self, idx: torch.Tensor, row_bytes: int, d: int) -> None:
        """What an all-to-all exchange would move for this rank's tokens: each token goes once to every *other*
        rank that holds one of its experts (row_bytes: token + routing) and comes back as one partial sum (fp32 or
        ``reduce_dtype``). Counted on this rank's own tokens (sent = received on average over ranks)."""
        n_local = self.n_experts // self.size
        owner = idx // n_local  # [T, k] rank of each chosen expert
        hit = torch.zeros(idx.shape[0], self.size, dtype=torch.bool, device=idx.device)
        hit.scatter_(1, owner, True)
        hit[:, self.rank] = False
        pairs = int(hit.sum())  # (token, remote rank) pairs
        psize = (self.reduce_dtype or torch.float32).itemsize
        self.stats["a2a_dispatch_bytes"] += pairs * row_bytes
        self.stats["a2a_combine_bytes"] += pairs * d * psize

    def describe(self) -> str:
        backend = dist.get_backend(self.group)
        counts = "equal counts assumed" if self.uniform else ("counts planned per step" if self._planned is not None
                                                              else "counts exchanged per MoE layer")
        return (f"EP{self.size} over {backend} (rank {self.rank}): all-gather dispatch, reduce-scatter combine "
                f"({self.reduce_dtype or 'fp32'}), {counts}")
