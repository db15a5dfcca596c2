"""T: the V4.1 candidate source layer's pre-filter as one op: block maxima of the indexer scores, the newest visible
block forced, the top blocks by max, ascending ids (``minidi.model.indexer.candidate_blocks``, pass T).

    ids = candidate_blocks(scores, k_start, k_end, keep, block, round_to)  # [T, min(keep, NB)] int64, NB = cdiv(N, B)

The model's chain (block maxima through a padded view, a scatter for the forced block, ``topk_set`` = two
``torch.topk`` and sorts, a gather, a sort) runs at V4.1-Flash's shape ([4,096, 131,072] fp32 scores, blocks of 8,
keep 2,048 of 16,384) as ~8 kernels: the block maxima's pointwise kernel reads the scores with stride-8 loads at
~30 % of the copy bandwidth, and the two radix top-ks and sorts cost as much again (H100, round 26's kernel table).

Kernels (Triton; the interpreter runs them on CPU tensors):
- ``_block_max_kernel``: grid (T, NB / NBT): a [NBT, block] tile of a row's scores per program, one coalesced read,
  the max of each block in fp32 (NaN if the block holds one: ``torch.maximum`` propagates NaN), -inf past N, and
  the row's newest visible block ((max(k_end, 1) - 1) // block) set to +inf when k_end > k_start. -> [T, NB] fp32.
  With ``round_to`` each max is rounded to that dtype first: the model's blocks of ``scores.to(bf16)`` from pass B's
  fp32 scores, read once (without it Inductor writes the bf16 copy for the op to read: 2.5 ms a step, H100).
- ``_block_select_kernel``: one program per row holds the row's NB maxima in registers (NB <= ``MAX_REGISTER_NB``):
  the order-preserving int32 key of each (NaN ranked as +inf, -0.0 as +0.0: ``topk_set``'s order), the K-th
  largest key by a 32-step bisection, every key above it and the lowest-index keys equal to it (exactly K), then
  the picks with a finite or +inf max in ascending order and -1 for the rest (-inf and NaN maxima), as ``topk_picks``.
Rows of more than ``MAX_REGISTER_NB`` blocks (contexts past 131,072 compressed entries at blocks of 8) take the
maxima from the kernel and the model's selection in plain torch (``pick_blocks_ref``), today's cost.

Equal to the model's chain element for element (the same ids in the same order) on every input: the picks are a
selection, not a sum. Device-side values are not checked (no host sync): a k_end past N forces no block, where the
model's scatter would fail.

Legend: T rows, N scores per row, NB blocks per row, K = min(keep, NB) picks, NBT blocks per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minidi.selection import topk_picks

from ._dispatch_op import dispatch_op
from ._fast_launch import fast_launch
from ._triton_utils import cannot_run, resolve_backend, round_bf16, triton_can_run
from .topk import _key, _kth

MAX_REGISTER_NB = 16384  # blocks a row may have for the in-register selection (V4.1-Flash at 128K: exactly this)
_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUND_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}  # round_to -> the block-max kernel's ROUND
_INT32_MIN = tl.constexpr(-(2**31))  # a key below every score's (key(-inf) = -2,139,095,041)


# ---- reference -----------------------------------------------------------------------------------------------------
def block_max_ref(scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, block: int,
                  round_to: torch.dtype | None = None) -> torch.Tensor:
    """[T, N] -> [T, NB] fp32: each block's max (NaN propagates, -inf past N) of the scores rounded to ``round_to``
    (None: as they are), the newest visible block +inf."""
    t, n = scores.shape
    nb = -(-n // block)
    s = scores if round_to is None else scores.to(round_to)
    padded = torch.nn.functional.pad(s.float(), (0, nb * block - n), value=float("-inf"))
    bm = padded.view(t, nb, block).amax(-1)
    if nb == 0:  # no block to force (the model's scatter fails here; the op returns no ids)
        return bm
    newest = ((k_end - 1).clamp(min=0) // block).unsqueeze(1)
    force = torch.zeros_like(bm, dtype=torch.bool).scatter(1, newest, (k_end > k_start).unsqueeze(1))
    return bm.masked_fill(force, float("inf"))


def pick_blocks_ref(bm: torch.Tensor, keep: int) -> torch.Tensor:
    """The model's picks on block maxima [T, NB] (``minidi.selection.topk_picks``): the top min(keep, NB) (ties to
    the lowest id, NaN as +inf), ascending, then -1 for picks whose max is -inf or NaN."""
    return topk_picks(bm, min(keep, bm.shape[1]))


def candidate_blocks_ref(scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, keep: int,
                         block: int, round_to: torch.dtype | None = None) -> torch.Tensor:
    """Plain torch: the model's ``candidate_blocks`` (``minidi.model.indexer``) of ``scores.to(round_to)``,
    written with ``amax``."""
    return pick_blocks_ref(block_max_ref(scores, k_start, k_end, block, round_to), keep)


# ---- kernels -------------------------------------------------------------------------------------------------------
@fast_launch
@triton.jit
def _block_max_kernel(s_ptr, ks_ptr, ke_ptr, out_ptr, N, NB, stride_s, stride_o,
                      BLOCK: tl.constexpr, BP: tl.constexpr, NBT: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1) * NBT + tl.arange(0, NBT)  # block ids of this program
    i = tl.arange(0, BP)
    j = b[:, None] * BLOCK + i[None, :]  # [NBT, BP] columns
    m = (i[None, :] < BLOCK) & (j < N)
    x = tl.load(s_ptr + row.to(tl.int64) * stride_s + j, mask=m, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    mx = tl.where(has_nan, float("nan"), mx)
    if ROUND == 1:  # the max of the rounded scores = the rounded max: rounding is monotone
        mx = round_bf16(mx)
    elif ROUND == 2:
        mx = mx.to(tl.float16).to(tl.float32)
    ks = tl.load(ks_ptr + row)
    ke = tl.load(ke_ptr + row)
    newest = tl.maximum(ke - 1, 0) // BLOCK
    mx = tl.where((b == newest) & (ke > ks), float("inf"), mx)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + b, mx, mask=b < NB)


@fast_launch
@triton.jit
def _block_select_kernel(bm_ptr, out_ptr, NB, stride_b, stride_o, K: tl.constexpr, NBP: tl.constexpr,
                         FAST_SCANS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, NBP)
    real = c < NB
    bm_row = bm_ptr + row.to(tl.int64) * stride_b
    v = tl.load(bm_row + c, mask=real, other=float("-inf"))
    key = _key(tl.where(v != v, float("inf"), v))  # topk_set's order: NaN as +inf, -0.0 as +0.0
    key = tl.where(real, key, _INT32_MIN)  # below key(-inf): padding is never picked (K <= NB)
    lo = tl.zeros((), tl.int64) + _INT32_MIN
    thr = _kth(key, K, lo, lo + 2**32).to(tl.int32)  # the K-th largest key
    above = key > thr
    ties = key == thr
    n_above = tl.sum(above.to(tl.int32), axis=0)
    if FAST_SCANS:  # the usual row: K - n_above ties wanted and as many present (no tie rank needed)
        want_ties = K - n_above
        if tl.sum(ties.to(tl.int32), axis=0) == want_ties:
            picked = above | ties
        else:
            picked = above | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= want_ties))
    else:
        tie_rank = tl.cumsum(ties.to(tl.int32), axis=0)  # 1-based, in id order: the lowest ids win the ties
        picked = above | (ties & (tie_rank <= K - n_above))
    good = picked & (v > float("-inf"))  # NaN and -inf maxima: picked, then dropped to -1 at the end
    bad = picked & ~good
    n_good = tl.sum(good.to(tl.int32), axis=0)
    out_row = out_ptr + row.to(tl.int64) * stride_o
    tl.store(out_row + tl.cumsum(good.to(tl.int32), axis=0) - 1, c.to(tl.int64), mask=good)
    if not FAST_SCANS or n_good < K:  # FAST_SCANS: a row without NaN / -inf picks (the usual one) has no tail
        tl.store(out_row + n_good + tl.cumsum(bad.to(tl.int32), axis=0) - 1, tl.full((NBP,), -1, tl.int64),
                 mask=bad)


# ---- launchers -----------------------------------------------------------------------------------------------------
def block_max_launch(scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, block: int,
                     round_to: torch.dtype | None = None) -> torch.Tensor:
    """``block_max_ref`` by ``_block_max_kernel`` (scores with a unit column stride)."""
    t, n = scores.shape
    nb = -(-n // block)
    out = torch.empty(t, nb, device=scores.device, dtype=torch.float32)
    if t and nb:
        bp = triton.next_power_of_2(block)
        nbt = max(1, min(triton.next_power_of_2(nb), 4096 // bp))  # 4,096 scores a program
        _block_max_kernel[(t, triton.cdiv(nb, nbt))](
            scores, k_start, k_end, out, n, nb, scores.stride(0), out.stride(0), BLOCK=block, BP=bp, NBT=nbt,
            ROUND=_ROUND_CODES[round_to], num_warps=4)
    return out


def select_warps(nbp: int) -> int:
    """Warps of the selection kernel for NBP (a power of two) maxima a row: 32 a thread at most (sm_90, Triton
    3.6: 16 warps at NBP 16,384 use 128 registers and spill 168 bytes; 32 warps, 64 registers and 80 bytes)."""
    return max(4, min(16, nbp // 1024))


SELECT_VARIANTS = {"bisect": False, "bisect_fast": True}  # -> FAST_SCANS
SELECT_VARIANT = "bisect_fast"  # H100, bench_indexer --only src (round 29): 1.052 ms against 1.407 for "bisect" at
# 16 warps; 16 two-bit steps counting three thresholds in one packed sum took 1.510 (removed)


def select_launch(bm: torch.Tensor, keep: int, out: torch.Tensor | None = None, num_warps: int | None = None,
                  variant: str | None = None) -> torch.Tensor:
    """``pick_blocks_ref`` by ``_block_select_kernel`` (rows of at most ``MAX_REGISTER_NB`` blocks); ``out`` [T,
    min(keep, NB)] int64 (a test's poisoned tensor) or None; ``num_warps`` None: ``select_warps``; ``variant`` a
    key of ``SELECT_VARIANTS`` (None: ``SELECT_VARIANT``): the tie-rank / -1-tail scans always, or only on rows
    that need them (the K-th key by 32 one-bit bisection steps in both)."""
    t, nb = bm.shape
    k = min(keep, nb)
    out = torch.empty(t, k, device=bm.device, dtype=torch.int64) if out is None else out
    if t and k:
        nbp = triton.next_power_of_2(nb)
        _block_select_kernel[(t,)](bm, out, nb, bm.stride(0), out.stride(0), K=k, NBP=nbp,
                                   FAST_SCANS=SELECT_VARIANTS[variant or SELECT_VARIANT],
                                   num_warps=num_warps or select_warps(nbp))
    return out


# ---- custom op -----------------------------------------------------------------------------------------------------
@dispatch_op("minidi::candidate_blocks")
def _candidate_blocks_op(scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, keep: int,
                         block: int, round_to: torch.dtype | None = None) -> torch.Tensor:
    if not triton_can_run(scores, k_start, k_end):
        raise cannot_run("minidi::candidate_blocks", scores, k_start, k_end)
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    bm = block_max_launch(scores, k_start.contiguous(), k_end.contiguous(), block, round_to)
    if bm.shape[1] > MAX_REGISTER_NB:
        return pick_blocks_ref(bm, keep)
    return select_launch(bm, keep)


@_candidate_blocks_op.register_fake
def _(scores, k_start, k_end, keep, block, round_to=None):
    return scores.new_empty(scores.shape[0], min(keep, -(-scores.shape[1] // block)), dtype=torch.int64)


def _check(scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, keep: int, block: int,
           round_to: torch.dtype | None) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"candidate_blocks: {what}")

    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.dtype not in _SCORE_DTYPES:
        fail(f"scores must be a [T, N] tensor of {_SCORE_DTYPES}, got "
             f"{tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__} "
             f"{getattr(scores, 'dtype', '')}")
    t = scores.shape[0]
    for name, x in (("k_start", k_start), ("k_end", k_end)):
        if not isinstance(x, torch.Tensor) or x.shape != (t,) or x.dtype not in (torch.int32, torch.int64):
            fail(f"{name} must be [{t}] int32 / int64, got "
                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__} {getattr(x, 'dtype', '')}")
        if x.device != scores.device:
            fail(f"{name} is on {x.device}, scores on {scores.device}")
    if not isinstance(keep, int) or keep < 0:
        fail(f"keep must be an int >= 0, got {keep!r}")
    if not isinstance(block, int) or block < 1:
        fail(f"block must be an int >= 1, got {block!r}")
    if round_to not in _ROUND_CODES:
        fail(f"round_to must be one of {list(_ROUND_CODES)}, got {round_to!r}")


def candidate_blocks(scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, keep: int, block: int,
                     round_to: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """scores [T, N] fp32 / bf16 / fp16 (a row's visible entries in [k_start, k_end), its blocks counted from column
    0); k_start, k_end [T] int; keep, block ints -> ids [T, min(keep, cdiv(N, block))] int64: the blocks with the
    highest max score (ties to the lower id), the newest visible block always kept, ascending, then -1 for blocks
    whose max is -inf (or NaN). Equal to ``minidi.model.indexer.candidate_blocks``. ``round_to`` bf16 / fp16: the
    picks of ``scores.to(round_to)`` (the model's rounding point, applied to each block's max: the same values, since
    rounding is monotone) without that tensor in memory; None: the scores as they are. ``backend``: "auto" (the
    kernels where they can run, else the reference), "triton" or "ref" (plain torch)."""
    _check(scores, k_start, k_end, keep, block, round_to)
    if resolve_backend(backend, "candidate_blocks", scores, k_start, k_end) == "ref":
        return candidate_blocks_ref(scores, k_start, k_end, keep, block, round_to)
    return _candidate_blocks_op(scores, k_start, k_end, keep, block, round_to)
