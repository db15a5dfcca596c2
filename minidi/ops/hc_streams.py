"""mHC stream mixing without a batched GEMM: mixed[t, k, d] = sum_j comb[t, j, k] * x[t, j, d] (pass G's replacement
where only the update's einsum matches; the whole update goes to ``hc_expand``).

The model writes this as ``einsum("tjk,tjd->tkd", comb, x)`` (``minidi.model.hyper_connections.hc_expand``). Inductor
lowers that einsum to a bmm with T batches of [n, n]^T x [n, D] (n = 4): cuBLAS then runs an FFMA kernel that took
1.14 ms per call at T 4,096, D 5,120 on an H200 (two calls per layer, 91 ms of a 734 ms V4.1 step), for a
memory-bound update that reads the streams once. Written as a broadcast product summed over the n streams, Inductor
generates one pointwise kernel with the n-term sum unrolled and fuses the rest of the update (``post * h + mixed``,
the cast back to the stream dtype) into it. Plain torch on purpose: Inductor's own codegen is the right tool for
this shape, on every device.
Legend: T tokens, n streams, D width.
"""

from __future__ import annotations

import torch


def hc_stream_mix(comb: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """comb [T, n, n], x [T, n, D] (same float dtype) -> [T, n, D]: out[t, k] = sum_j comb[t, j, k] * x[t, j]."""
    if comb.dim() != 3 or x.dim() != 3 or comb.shape[1] != comb.shape[2] or comb.shape[:2] != x.shape[:2]:
        raise ValueError(f"hc_stream_mix: comb [T, n, n] and x [T, n, D] expected, got {tuple(comb.shape)} and "
                         f"{tuple(x.shape)}")
    return (comb.unsqueeze(-1) * x.unsqueeze(-2)).sum(dim=1)
