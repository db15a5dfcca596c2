"""One rank of expert parallelism N emulated on one device, for benchmarks (an ``ExpertExchange``).

``EmulatedEP`` reproduces one rank's work at EP N on one GPU: the other ranks' tokens are synthesised (this rank's
tokens rotated, with their routing), the rank holds 1/N of the experts, and the combine keeps its own rows: the
expert GEMMs, the local-row combine and the per-rank expert weights are those of a real EP N rank; communication is
not modelled (and the output of the MoE lacks the other ranks' experts, so the model's numbers are not the model's).
The exchange over real ranks is ``minidi.runtime.distributed.DistributedEP``; the contract both follow is
``minidi.model.expert_parallel``.

The synthesised rows are written by ``rotated_blocks``, a custom op: on a GPU one kernel launch
(``minidi.ops.rotated_rows``; the copies below cost the host 2 N - 1 memcpy launches a call, 884 a V4.1 EP4 step,
more host time than the GPU spent on them), on the CPU contiguous copies. Written as
``torch.cat([x.roll(s, 0) for s in shifts])`` (until round 12) Inductor lowers it to one pointwise kernel that
evaluates, for every element, the masked load of every block, each index a 64-bit ``fmod`` by the (dynamic) token
count (the roll's decomposition): ``triton_poi_fused_cat_roll_*``, 0.31 ms a call at T 4,096, D 5,120 bf16 on an
H200, 12.1 ms of the round-12 V4.1 EP4 step (39 calls), 17 % of the copy bandwidth on the bytes it must move
(``docs/benchmarks/h200_round12/v41_ep4_passes_16a231e.jsonl``). A cat of row slices is the same kind of kernel with
2N-1 branches. The copies need no index math: 0.080 ms of GPU time a call for the 2N-1 copies at that shape
(``bench/bench_ep_dispatch.py``, ``docs/benchmarks/h200_round12/bench_ep_dispatch.json``).
Legend: T tokens (this rank), N ranks.
"""

from __future__ import annotations

import torch

from minidi.ops._dispatch_op import dispatch_op
from minidi.ops._triton_utils import triton_can_run
from minidi.ops.rotated_rows import rotated_rows


@dispatch_op("minidi::rotated_blocks")
def rotated_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """x [T, ...] -> [size * T, ...]: block r is ``x.roll(r * T // size, 0)`` (block 0 is x).

    On CUDA (or the interpreter) one kernel (``rotated_rows``); otherwise each block is two contiguous row copies
    (ATen ``copy_``). Either moves the bytes a copy moves: x read, size x T rows written."""
    if size < 1:
        raise ValueError(f"rotated_blocks: size >= 1 expected, got {size}")
    return rotated_rows(x, size) if triton_can_run(x) else rotated_copies(x, size)


def rotated_copies(x: torch.Tensor, size: int) -> torch.Tensor:
    """``rotated_blocks`` by 2 size - 1 contiguous row copies (ATen ``copy_``): the CPU path."""
    t = x.shape[0]
    x = x.contiguous()
    out = x.new_empty((size * t, *x.shape[1:]))
    for r in range(size):
        s = r * t // size
        block = out[r * t:(r + 1) * t]
        block[:s].copy_(x[t - s:])  # roll by s: row i is x[(i - s) mod T]
        block[s:].copy_(x[:t - s])
    return out


@rotated_blocks.register_fake
def _rotated_blocks_fake(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.new_empty((size * x.shape[0], *x.shape[1:]))


def rotated_blocks_ref(x: torch.Tensor, size: int) -> torch.Tensor:
    """The definition: ``torch.cat([x.roll(r * T // size, 0) for r in range(size)])``."""
    t = x.shape[0]
    return torch.cat([x.roll(r * t // size, 0) for r in range(size)])


class EmulatedEP:
    """One rank of EP ``size`` on one device: the MoE sees ``size`` x the tokens and holds 1/size of the experts."""

    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError(f"EmulatedEP needs size >= 2, got {size} (use LocalExperts for one rank)")
        self.size = size

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rank r's tokens are this rank's rotated by r*T/size rows (their routing rotates with them), so the
        synthesised ranks route like real ones: the expert loads follow this rank's routing distribution.

        No stage markers here: the three ``rotated_blocks`` calls are the exchange, and a profile charges an op
        call's kernels to its stage (``bench/prefill_stages.py`` ``OP_STAGE``: communication). Markers around them
        also caught whatever MoE work Inductor launched in between (the routing top-k and sort, the shared expert's
        GEMMs: 27 of the 31.5 ms the communication stage measured on the H200, V4.1 EP4)."""
        xs = rotated_blocks(x, self.size)
        idx_all = rotated_blocks(idx, self.size)
        w_all = rotated_blocks(w, self.size)
        return xs, idx_all, w_all

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Keep this rank's own rows (a real combine would reduce-scatter the ``size`` partial sums)."""
        t = partial.shape[0] // self.size
        return partial[:t]

    def describe(self) -> str:
        return (f"emulated EP{self.size}: MoE sees {self.size}x this rank's tokens (the others synthesised), holds "
                f"1/{self.size} of the experts; communication not modelled")
