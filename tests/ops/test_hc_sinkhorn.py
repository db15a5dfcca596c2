"""minidi::hc_sinkhorn vs float64 and the model's code (CPU under TRITON_INTERPRET=1; @gpu on CUDA).

Tolerance: max|out - ref64| <= 1e-6 (entries in [0, 1]: fp32 level; Triton's exp and another softmax sum order).
Legend: T tokens, n streams.
"""

from __future__ import annotations

import pytest
import torch

from minidi.ops import _triton_utils
from minidi.ops.hc_sinkhorn import hc_sinkhorn, hc_sinkhorn_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(DEV == "cpu" and not _triton_utils.interpreting(),
                                  reason="kernel needs CUDA or TRITON_INTERPRET=1")


@needs_kernel
@pytest.mark.parametrize("t,n,iters", [(1, 4, 1), (70, 4, 20), (129, 3, 2), (5, 2, 7), (33, 8, 20)])
def test_matches_float64(t, n, iters):
    x = (torch.randn(t, n, n, generator=torch.Generator().manual_seed(t)) * 4).to(DEV)
    out = hc_sinkhorn(x, iters, 1e-6, backend="triton")
    ref = hc_sinkhorn_ref(x.double(), iters, 1e-6)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert (out.double() - ref).abs().max().item() <= 1e-6


@needs_kernel
def test_nan_row_stays_in_its_token():
    x = torch.randn(6, 4, 4).to(DEV)
    x[3, 1, 2] = float("nan")
    out = hc_sinkhorn(x, 5, 1e-6, backend="triton")
    ref = hc_sinkhorn_ref(x, 5, 1e-6)
    assert out[3].isnan().any() and ref[3].isnan().any()
    keep = [0, 1, 2, 4, 5]
    assert not out[keep].isnan().any()
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-5, atol=1e-6)


def test_empty_ref_backend_and_errors():
    assert hc_sinkhorn(torch.zeros(0, 4, 4), 3, 1e-6).shape == (0, 4, 4)
    x = torch.randn(3, 4, 4)
    assert torch.equal(hc_sinkhorn(x, 3, 1e-6, backend="ref"), hc_sinkhorn_ref(x, 3, 1e-6))
    for bad, match in ((torch.randn(3, 4, 5), "logits must be"), (torch.randn(3, 4, 4).double(), "logits must be"),
                       (torch.randn(2, 17, 17), "n must be")):
        with pytest.raises(ValueError, match=match):
            hc_sinkhorn(bad, 3, 1e-6)
    with pytest.raises(ValueError, match="iters"):
        hc_sinkhorn(x, 0, 1e-6)


@needs_kernel
def test_opcheck():
    torch.library.opcheck(torch.ops.minidi.hc_sinkhorn.default, (torch.randn(9, 4, 4).to(DEV), 4, 1e-6))
