"""minidi.ops.rotated_rows (the emulated EP exchange's rows in one launch) vs the definition ``cat(x.roll(r T //
size))``, bit for bit, on every dtype the exchange moves and odd row widths (CPU under TRITON_INTERPRET=1; CUDA)."""

from __future__ import annotations

import pytest
import torch

from minidi.ops import _triton_utils
from minidi.ops.rotated_rows import rotated_rows
from minidi.runtime.expert_parallel import rotated_blocks_ref, rotated_copies

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(DEV == "cpu" and not _triton_utils.interpreting(),
                                  reason="kernel needs CUDA or TRITON_INTERPRET=1")


def rows(t, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return (torch.rand(t, *shape, generator=g) > 0.5).to(DEV)
    if dtype in (torch.uint8, torch.int64):
        return torch.randint(0, 250, (t, *shape), generator=g).to(dtype).to(DEV)
    return (torch.randn(t, *shape, generator=g) * 100).to(dtype).to(DEV)


@needs_kernel
@pytest.mark.parametrize("t,size", [(13, 4), (7, 3), (1, 4), (3, 4), (64, 4), (10, 1), (9, 2)])
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (40,)), (torch.float32, (6,)), (torch.int64, (6,)),
                                         (torch.uint8, (3,)), (torch.bool, (5,)), (torch.bfloat16, (3, 3)),
                                         (torch.float32, ())])
def test_equals_the_rolls(t, size, dtype, shape):
    x = rows(t, shape, dtype, seed=t * 7 + size)
    out = rotated_rows(x, size)
    assert out.shape == (size * t, *shape) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, rotated_blocks_ref(x, size))
    poisoned = torch.empty_like(out)
    poisoned.view(torch.uint8).fill_(0xA5)  # every byte written: none of the poison survives
    rotated_rows(x, size, out=poisoned)
    assert torch.equal(poisoned.view(torch.uint8), rotated_blocks_ref(x, size).contiguous().view(torch.uint8))


@needs_kernel
def test_wide_rows_many_word_blocks_and_a_strided_input():
    x = rows(11, (2600,), torch.bfloat16, seed=3)  # 5,200 bytes: 1,300 int32 words, two 1,024-word blocks
    assert torch.equal(rotated_rows(x, 4), rotated_blocks_ref(x, 4))
    xt = rows(9, (8, 5), torch.float32, seed=4).transpose(1, 2)  # non-contiguous rows
    assert torch.equal(rotated_rows(xt, 3), rotated_blocks_ref(xt, 3))
    xo = rows(20, (7,), torch.bfloat16, seed=5)[1:]  # a storage offset of 7 elements: 2-byte words
    assert torch.equal(rotated_rows(xo, 4), rotated_blocks_ref(xo, 4))


@needs_kernel
def test_empty_bad_size_and_bad_out():
    x = rows(0, (4,), torch.float32, seed=0)
    assert rotated_rows(x, 4).shape == (0, 4)
    y = rows(3, (2,), torch.float32, seed=0)
    with pytest.raises(ValueError, match="size >= 1"):
        rotated_rows(y, 0)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        rotated_rows(y, 2, out=torch.empty(6, 3, device=DEV))


def test_copy_path_equals_the_rolls():
    for t, size in ((13, 4), (1, 4), (0, 2), (8, 1)):
        x = torch.randn(t, 5)
        assert torch.equal(rotated_copies(x, size), rotated_blocks_ref(x, size))
