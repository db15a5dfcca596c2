"""The candidate source part of ``bench_indexer.py`` (``--only src``): V4.1's pre-filter of layer 20's scores
(``minidi.model.indexer.candidate_blocks``: block maxima, the newest block forced, the top 2,048 of 16,384 blocks of
8, ascending ids) as the model writes it, eager and under stock ``torch.compile`` (the chain the step ran before pass
T), beside pass T's op (``minidi.ops.candidate_blocks``) and its two kernels, same run.

Workload: bench_indexer's shape (T 4,096 x N 131,072 fp32 scores, causal after a 126,976-key prefix: -inf past
k_end), random scores. Bytes: the block maxima read the scores once (T N 4 B = 2.15 GB) and write T NB 4 B (0.27 GB);
the selection reads the maxima (twice: before and after its bisection, the second from L2) and writes the ids.
Also the step's form (pass B's fp32 scores, the model's chain on their bf16 rounding): stock compile of it beside the
op with ``round_to`` bf16. Checks: every path's ids equal the model's, element for element.
"""

from __future__ import annotations

import torch

from minidi.model.indexer import candidate_blocks as model_candidate_blocks
from minidi.ops import candidate_blocks as cb

if __package__:
    from . import common
    from .indexer_fp8_cases import Shape
else:
    import common
    from indexer_fp8_cases import Shape

KEEP_BLOCKS, BLOCK = 2048, 8
SELECT_WARPS = (16, 32)  # the selection kernel at NB 16,384: 16 warps (the default, 128 registers) or 32 (64)


def _row(res: dict, name: str, ms: float, nbytes: float | None, peaks: dict, base: float | None = None) -> None:
    rec = dict(ms=ms)
    note = ""
    if nbytes:
        gbs, pct = common.rate(ms, nbytes, "GB/s", peaks)
        rec.update(gbps=gbs, pct_copy=pct)
        note = f"{gbs:8.1f} GB/s {pct:5.1f}% of copy"
    if base:
        rec["speedup"] = base / ms
        note += f"  {base / ms:6.2f}x"
    res[name.strip()] = rec
    common.say(f"  {name:<40} {ms:9.3f} ms {note}")


def bench_candidate_source(res: dict, s: Shape, ks, ke, peaks: dict, no_compile: bool, smoke: bool = False) -> None:
    keep, block = (KEEP_BLOCKS, BLOCK) if not smoke else (16, 4)
    out = res.setdefault("candidate_source", {})
    j = torch.arange(s.N, device=s.dev)
    scores = torch.randn(s.T, s.N, device=s.dev).masked_fill((j < ks[:, None]) | (j >= ke[:, None]), float("-inf"))
    del j
    nb = -(-s.N // block)
    read, written = s.T * s.N * 4, s.T * nb * 4
    common.say(f"\ncandidate source: [{s.T}, {s.N}] fp32 scores, blocks of {block}, keep {keep} of {nb} "
               f"(block maxima: {read / 1e9:.2f} GB read, {written / 1e9:.2f} GB written)")
    want = model_candidate_blocks(scores, ks, ke, keep, block)
    checks = {"op": torch.equal(cb.candidate_blocks(scores, ks, ke, keep, block), want)}
    stock = {}  # the baseline's ids (information: Inductor may drop the bf16 cast's rounding, minidi may not)
    ms_eager = s.timed(lambda: model_candidate_blocks(scores, ks, ke, keep, block), rep=10)
    _row(out, "model chain, eager", ms_eager, None, peaks)
    base = ms_eager
    if not no_compile:
        comp = torch.compile(model_candidate_blocks, dynamic=False)
        stock["stock_compile"] = torch.equal(comp(scores, ks, ke, keep, block), want)
        base = s.timed(lambda: comp(scores, ks, ke, keep, block), rep=20)
        _row(out, "model chain, stock torch.compile", base, None, peaks, ms_eager)
        del comp
    ms_op = s.timed(lambda: cb.candidate_blocks(scores, ks, ke, keep, block))
    _row(out, "pass T's op (candidate_blocks)", ms_op, read + written, peaks, base)
    # the step's form: pass B's fp32 scores, the model's chain on their bf16 rounding (before T: Inductor fused the
    # cast into its block-max kernel; T without round_to made it write the bf16 copy for the op to read)
    want16 = model_candidate_blocks(scores.bfloat16(), ks, ke, keep, block)
    checks["op_round_bf16"] = torch.equal(cb.candidate_blocks(scores, ks, ke, keep, block, torch.bfloat16), want16)
    if not no_compile:
        comp16 = torch.compile(lambda x: model_candidate_blocks(x.bfloat16(), ks, ke, keep, block), dynamic=False)
        stock["stock_compile_bf16"] = torch.equal(comp16(scores), want16)
        base16 = s.timed(lambda: comp16(scores), rep=20)
        _row(out, "model chain on bf16(scores), stock compile", base16, None, peaks)
        del comp16
    else:
        base16 = None
    ms_op16 = s.timed(lambda: cb.candidate_blocks(scores, ks, ke, keep, block, torch.bfloat16))
    _row(out, "pass T's op, round_to bf16", ms_op16, read + written, peaks, base16)
    del want16
    ms_bm = s.timed(lambda: cb.block_max_launch(scores, ks, ke, block))
    _row(out, "  block maxima kernel", ms_bm, read + written, peaks)
    bm = cb.block_max_launch(scores, ks, ke, block)
    if nb <= cb.MAX_REGISTER_NB:
        for variant in cb.SELECT_VARIANTS:
            for warps in SELECT_WARPS:
                got = cb.select_launch(bm, keep, num_warps=warps, variant=variant)
                checks[f"select_{variant}_w{warps}"] = torch.equal(got, want)
                ms = s.timed(lambda: cb.select_launch(bm, keep, num_warps=warps, variant=variant))
                is_default = (variant, warps) == (cb.SELECT_VARIANT, cb.select_warps(cb.MAX_REGISTER_NB))
                default = " (default)" if is_default else ""
                _row(out, f"  selection, {variant}, {warps} warps{default}", ms, written, peaks)
    out["checks"] = checks
    out["stock_compile_same_ids"] = stock
    common.say(f"  checks (ids equal to the model's): {checks}")
    common.say(f"  stock torch.compile's ids equal to the model's (not a check of minidi): {stock}")
    res["checks"]["candidate_source_ok"] = all(checks.values())
    del scores, bm, want
    s.free()
