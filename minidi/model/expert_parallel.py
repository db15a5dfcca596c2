"""How the MoE of one rank meets the other ranks' tokens (expert parallelism): the exchange's contract.

Each rank holds the experts [first, first + E/N) (``ModelConfig.ep_size`` / ``ep_rank``); attention is data
parallel, so every rank routes its own T tokens. An *exchange* brings the tokens of all ranks to the experts and the
partial results back:

    xs, idx, w = exchange.dispatch(x, idx, w)   # [N*T, ...]: every rank's tokens with their routing
    partial    = experts(xs, idx, w)            # [N*T, D]: sums over the experts held here only
    y          = exchange.combine(partial)      # [T, D]: this rank's tokens, summed over all ranks' experts

``LocalExperts`` (one device, N = 1) is the identity and the model's default. The parallel exchanges live with the
runtime: ``minidi.runtime.distributed.DistributedEP`` moves real tokens between ranks (NCCL / gloo), and
``minidi.runtime.expert_parallel.EmulatedEP`` reproduces one rank's work at EP N on one GPU for benchmarks.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ExpertExchange(Protocol):
    """What ``MoE`` calls (``Transformer.set_expert_exchange`` installs one on every MoE layer)."""

    size: int  # N, the ranks of the expert parallelism; must equal the model's ``ep_size``

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D], idx [T, k] int64 global expert ids, w [T, k] -> every rank's tokens and routing, [N*T, ...]."""
        ...

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """partial [N*T, D] (sums over this rank's experts) -> [T, D] this rank's tokens, over all experts."""
        ...

    def describe(self) -> str:
        """One line for the benchmark's card."""
        ...


class LocalExperts:
    """All experts on this device: nothing to exchange."""

    size = 1

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x, idx, w

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def describe(self) -> str:
        return "all experts local"
