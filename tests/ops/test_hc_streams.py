"""minidi.ops.hc_streams.hc_stream_mix (pass G's replacement) vs float64: out[t, k] = sum_j comb[t, j, k] x[t, j]."""

from __future__ import annotations

import pytest
import torch

from minidi.ops.hc_streams import hc_stream_mix


@pytest.mark.parametrize("t,n,d", [(1, 4, 8), (7, 4, 33), (3, 2, 5), (0, 4, 8)])
def test_matches_float64_einsum(t, n, d):
    g = torch.Generator().manual_seed(t + n + d)
    comb, x = torch.rand(t, n, n, generator=g), torch.randn(t, n, d, generator=g)
    ref = torch.einsum("tjk,tjd->tkd", comb.double(), x.double())
    out = hc_stream_mix(comb, x)
    assert out.shape == (t, n, d) and out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() <= 1e-6 if t else out.numel() == 0


def test_sums_over_the_first_index():
    """comb[t, j, k]: stream k receives comb[j, k] x_j (spec: C^T X), not comb[k, j] x_j."""
    comb = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]])  # only j = 0 -> k = 1
    x = torch.tensor([[[1.0, 2.0], [10.0, 20.0]]])
    assert torch.equal(hc_stream_mix(comb, x), torch.tensor([[[0.0, 0.0], [1.0, 2.0]]]))


def test_bad_shapes_name_both():
    with pytest.raises(ValueError, match=r"comb \[T, n, n\] and x \[T, n, D\] expected, "
                                         r"got \(2, 4, 3\) and \(2, 4, 8\)"):
        hc_stream_mix(torch.rand(2, 4, 3), torch.rand(2, 4, 8))
