"""One rank of expert parallelism N emulated on one device, for benchmarks (an ``ExpertExchange``).

``EmulatedEP`` reproduces one rank's work at EP N on one GPU: the other ranks' tokens are synthesised (this rank's
tokens rotated, with their routing), the rank holds 1/N of the experts, and the combine keeps its own rows: the
expert GEMMs, the local-row combine and the per-rank expert weights are those of a real EP N rank; communication is
not modelled (and the output of the MoE lacks the other ranks' experts, so the model's numbers are not the model's).
The exchange over real ranks is ``minidi.runtime.distributed.DistributedEP``; the contract both follow is
``minidi.model.expert_parallel``.
"""

from __future__ import annotations

import torch

from minidi.model import stages


class EmulatedEP:
    """One rank of EP ``size`` on one device: the MoE sees ``size`` x the tokens and holds 1/size of the experts."""

    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError(f"EmulatedEP needs size >= 2, got {size} (use LocalExperts for one rank)")
        self.size = size

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank r's tokens are this rank's rotated by r*T/size rows (their routing rotates with them), so the
        synthesised ranks route like real ones: the expert loads follow this rank's routing distribution."""
        stages.enter("moe.comm", x)
        t = x.shape[0]
        shifts = [r * t // self.size for r in range(self.size)]
        xs = torch.cat([x.roll(s, 0) for s in shifts])
        idx_all = torch.cat([idx.roll(s, 0) for s in shifts])
        w_all = torch.cat([w.roll(s, 0) for s in shifts])
        stages.exit("moe.comm", xs)
        return xs, idx_all, w_all

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Keep this rank's own rows (a real combine would reduce-scatter the ``size`` partial sums)."""
        t = partial.shape[0] // self.size
        return partial[:t]

    def describe(self) -> str:
        return (f"emulated EP{self.size}: MoE sees {self.size}x this rank's tokens (the others synthesised), holds "
                f"1/{self.size} of the experts; communication not modelled")
