"""The MoE dispatch's row order and expert counts in one counting sort: ``flat.argsort(stable=True)`` and
``zeros(E).scatter_add_(0, flat, ones)``.

The model sorts its R = T k routed (token, slot) pairs by expert (``minidi.model.moe.RoutedExperts.forward``)::

    order  = flat.argsort(stable=True)                                   # [R]: sorted row -> token-slot
    counts = zeros(E, int64).scatter_add_(0, flat, ones_like(flat))      # [E]: rows per expert

In torch that is a radix sort of int64 keys (8 launches of cub's onesweep kernel) plus the scatter and its memset:
2.7 ms of a V4.1 EP4 step on the H200 over 400 launches (round 21's kernel table). ``expert_order(flat, E)``
returns both from three small kernels, bit-equal to the two lines above. Inserted by pass Q
(``minidi/passes/rewrite_expert_order.py``).

Kernels (ids binned 0..E-1; an id outside [0, E) goes to bin E, sorted after every expert and not counted; C chunks
of BLOCK rows):
1. ``_chunk_hist_kernel``: each chunk's histogram over the bins (``tl.histogram``; the last chunk's padding goes to
   bin E + 1, which no later step reads).
2. ``_chunk_offsets_kernel`` (one program): counts = the bins' totals; ``off[c, e]`` = where bin e starts overall +
   bin e's rows in earlier chunks - bin e's start inside chunk c.
3. ``_chunk_scatter_kernel``: each chunk sorts the keys ``bin * BLOCK + row-in-chunk`` (distinct, so the sort is
   stable by construction); the row at sorted position j goes to ``off[c, bin] + j``.

An id outside [0, E) raises on CPU tensors (the reference's scatter does); on the GPU it is sorted last, uncounted.

Legend: R rows, E experts, C chunks, BLOCK rows per chunk, EB bins (a power of two >= E + 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, resolve_backend, triton_can_run

IDX_DTYPES = (torch.int32, torch.int64)
MAX_EXPERTS = 4094  # bins E + 2 <= 4096 (more experts run the reference)


# ---- reference -----------------------------------------------------------------------------------------------------
def expert_order_ref(flat: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, the model's two lines."""
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat.long(), torch.ones_like(flat, dtype=torch.long))
    return flat.argsort(stable=True), counts


# ---- kernels -------------------------------------------------------------------------------------------------------
@triton.jit
def _bins(flat_ptr, c, R, E, BLOCK: tl.constexpr):
    """Chunk c's rows (BLOCK, in-chunk index) and bins: the id, E for an id outside [0, E), E + 1 for padding."""
    loc = tl.arange(0, BLOCK)
    row = c * BLOCK + loc
    ids = tl.load(flat_ptr + row, mask=row < R, other=0).to(tl.int64)
    b = tl.where((ids >= 0) & (ids < E), ids, E)
    return loc, tl.where(row < R, b, E + 1).to(tl.int32)


@fast_launch
@triton.jit
def _chunk_hist_kernel(flat_ptr, hist_ptr, R, E, BLOCK: tl.constexpr, EB: tl.constexpr):
    c = tl.program_id(0)
    _, b = _bins(flat_ptr, c, R, E, BLOCK)
    tl.store(hist_ptr + c * EB + tl.arange(0, EB), tl.histogram(b, EB))


@fast_launch
@triton.jit
def _chunk_offsets_kernel(hist_ptr, off_ptr, counts_ptr, C, E, EB: tl.constexpr, CB: tl.constexpr):
    bins = tl.arange(0, EB)
    cs = tl.arange(0, CB)
    total = tl.zeros([EB], dtype=tl.int32)
    for c0 in range(0, C, CB):  # pass 1: the bins' totals
        m = (c0 + cs < C)[:, None]
        total += tl.sum(tl.load(hist_ptr + (c0 + cs)[:, None] * EB + bins[None, :], mask=m, other=0), axis=0)
    tl.store(counts_ptr + bins, total.to(tl.int64), mask=bins < E)
    keep = bins <= E  # bin E (ids out of range) after every expert; bin E + 1 (padding) is never placed
    start = tl.cumsum(tl.where(keep, total, 0), axis=0) - tl.where(keep, total, 0)  # [EB] where each bin starts
    carry = tl.zeros([EB], dtype=tl.int32)  # bin e's rows in the chunks before this tile
    for c0 in range(0, C, CB):  # pass 2: the offsets
        m = (c0 + cs < C)[:, None]
        h = tl.where(keep[None, :], tl.load(hist_ptr + (c0 + cs)[:, None] * EB + bins[None, :], mask=m, other=0), 0)
        before = tl.cumsum(h, axis=0) - h + carry[None, :]  # [CB, EB] bin e's rows in earlier chunks
        inside = tl.cumsum(h, axis=1) - h  # [CB, EB] bin e's start inside its chunk
        tl.store(off_ptr + (c0 + cs)[:, None] * EB + bins[None, :], start[None, :] + before - inside, mask=m)
        carry += tl.sum(h, axis=0)


@fast_launch
@triton.jit
def _chunk_scatter_kernel(flat_ptr, off_ptr, order_ptr, R, E, BLOCK: tl.constexpr, EB: tl.constexpr):
    c = tl.program_id(0)
    loc, b = _bins(flat_ptr, c, R, E, BLOCK)
    key = tl.sort(b * BLOCK + loc)  # distinct keys: by bin, then by row (stable)
    sb = key // BLOCK
    row = c * BLOCK + key % BLOCK
    j = tl.arange(0, BLOCK)  # sorted position in the chunk
    ok = sb <= E
    dest = tl.load(off_ptr + c * EB + sb, mask=ok, other=0) + j
    tl.store(order_ptr + dest, row.to(tl.int64), mask=ok)


def _block(r: int, cuda: bool) -> int:
    return 1024 if cuda else max(16, min(64, triton.next_power_of_2(max(r, 1))))


def launch(flat: torch.Tensor, n_experts: int, order: torch.Tensor, counts: torch.Tensor) -> None:
    """Checked tensors: flat [R] int32 / int64 contiguous, order [R] int64, counts [E] int64, E <= MAX_EXPERTS.
    Writes every element of both (tests pass poisoned outputs)."""
    r, e = flat.numel(), n_experts
    if r == 0:
        counts.zero_()
        return
    block = _block(r, flat.is_cuda)
    c = triton.cdiv(r, block)
    eb = triton.next_power_of_2(e + 2)
    hist = torch.empty(c, eb, dtype=torch.int32, device=flat.device)
    off = torch.empty(c, eb, dtype=torch.int32, device=flat.device)
    _chunk_hist_kernel[(c,)](flat, hist, r, e, BLOCK=block, EB=eb, num_warps=4)
    cb = max(1, min(triton.next_power_of_2(c), 16384 // eb))
    _chunk_offsets_kernel[(1,)](hist, off, counts, c, e, EB=eb, CB=cb, num_warps=8)
    _chunk_scatter_kernel[(c,)](flat, off, order, r, e, BLOCK=block, EB=eb, num_warps=4)


def _check(flat: torch.Tensor, n_experts: int) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"expert_order: {what}")

    if flat.dim() != 1 or flat.dtype not in IDX_DTYPES:
        fail(f"flat must be [R] int32/int64 (each row's expert), got {tuple(flat.shape)} {flat.dtype}")
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        fail(f"n_experts must be an int >= 1, got {n_experts!r}")
    if flat.numel() >= 2**31:
        fail(f"flat has {flat.numel()} rows; at most 2**31 - 1")


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::expert_order")
def _expert_order_op(flat: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not triton_can_run(flat):
        raise cannot_run("minidi::expert_order", flat)
    if flat.device.type == "cpu" and flat.numel():  # real tensors here (the op body): a host check costs no sync
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= n_experts:
            raise IndexError(f"expert_order: flat holds {lo if lo < 0 else hi}, outside [0, {n_experts})")
    order = torch.empty(flat.numel(), dtype=torch.int64, device=flat.device)
    counts = torch.empty(n_experts, dtype=torch.int64, device=flat.device)
    launch(flat.contiguous(), n_experts, order, counts)
    return order, counts


@_expert_order_op.register_fake
def _(flat, n_experts):
    return flat.new_empty(flat.shape, dtype=torch.int64), flat.new_empty(n_experts, dtype=torch.int64)


def expert_order(flat: torch.Tensor, n_experts: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(``flat.argsort(stable=True)``, ``zeros(n_experts).scatter_add_(0, flat, ones)``): order [R] int64 (rows
    sorted by expert, each expert's rows in their original order) and counts [E] int64. flat [R] int32 | int64 in
    [0, n_experts) (checked on CPU tensors; on the GPU an id outside is sorted last and not counted). ``backend``:
    "auto" (the kernels where they can run and E <= MAX_EXPERTS, else the reference), "triton" or "ref"."""
    _check(flat, n_experts)
    if resolve_backend(backend, "expert_order", flat) == "ref" or (backend == "auto" and n_experts > MAX_EXPERTS):
        return expert_order_ref(flat, n_experts)
    if n_experts > MAX_EXPERTS:
        raise ValueError(f"expert_order: backend='triton' takes n_experts <= {MAX_EXPERTS}, got {n_experts}; use "
                         "backend='auto' (the reference for more)")
    return _expert_order_op(flat, n_experts)
