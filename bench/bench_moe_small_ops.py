"""Benchmark of the small MoE ops at V4.1-Flash shapes (one H200): combine (C), router GEMM (E), expert
activation (H), dispatch gather (I), router top-k (P) and the dispatch's sort by expert (Q). (Pass D's FP4 decode is inside the fused GEMM: bench_fp4_grouped_gemm.py.)

For each op: the plain path eager and under stock ``torch.compile`` (no minidi passes), then minidi's op at its default
config and a small sweep of tile configs (so one run tells what to change). Correctness of the op vs the plain path is
checked at the bench shape before timing. Peaks (bf16 matmul TFLOP/s, device copy GB/s counting read + write) are
measured in the same run.

  C  combine: T 4,096 x top-6 = 24,576 bf16 rows x D 5,120 -> [T, D] fp32; EP4 (experts 0..95 of 384 local, rows of
     the others NaN) and all-local. Bytes = local rows read + [T, D] fp32 written.
  E  router: x [4,096, 5,120] (bf16 or fp32) @ weight [384, 5,120] bf16 -> fp32. FLOPs = 2 T D E (counted once);
     error = max|out - ref64| / max|ref64|; top6 = rows whose top-6 of sqrt(softplus) + bias equals float64's.
     Also pass S's site with the same op: a V4.1 compressor's GEMM, x bf16 @ [512, 5,120] bf16 -> fp32.
  H  activation: g, v [R 98,304, I 2,304] bf16 (EP4: 96 experts x 256 local rows, the rest other ranks') -> clipped
     SwiGLU x weight -> bf16 -> fq8 (blocks of 32, V4.1). Bytes = the local rows' g, v read + a written (the op's
     minimum); pass L's form writes e4m3 values + one fp32 scale per 32 instead of a.
  I  gather: x [16,384, 5,120] bf16 -> x[idx] [98,304, 5,120], a quarter local. Bytes = local rows read + written.
     Also fq8(x)[idx] (pass L's bf16 route): the three-step path it replaced vs ``gather_rows_fq8``.
  P  router top-k: s + bias [16,384, 384] fp32 (EP4's tokens; values on a coarse grid, so ties are common) -> top-6
     with ties to the lowest expert id. Bytes = the scores read + values and int64 indices written.
  Q  sort by expert: flat [98,304] int64 ids in [0, 384) -> stable order + counts. Bytes = ids read + order written.

Usage: python bench/bench_moe_small_ops.py [--only C,E,H,I,P,Q] [--out PATH]; --smoke runs tiny shapes (CPU interpreter ok).
Prints a card, a table per op, and as the LAST line one JSON object.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from minidi.model.moe import gate_logits_fp32, moe_combine_naive, swiglu_clipped
from minidi.model.quant import fq8
from minidi.ops import gate_tf32x3 as e_op
from minidi.ops import moe_activation as h_op
from minidi.ops import moe_combine as c_op
from minidi.ops import expert_order as q_op
from minidi.ops.fp8_quant import fq8_split
from minidi.ops import moe_gather as i_op
from minidi.ops import row_topk as p_op
from minidi.selection import topk_lowest_index

if __package__:  # python -m bench.bench_moe_small_ops, the tests
    from . import common
else:  # python bench/bench_moe_small_ops.py: the script's folder is sys.path[0]
    import common

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FAILURES: list[str] = []  # accuracy failures, reported after all tables (one run shows every number)


def timed_graph(fn, smoke: bool) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (no CPU launch gaps: what a compiled, graphed step sees)."""
    if smoke or DEV == "cpu":
        return common.op_ms(fn, DEV, smoke)
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # capture can fail on some stacks: report it, keep going
        common.say(f"  (CUDA graph timing failed: {type(exc).__name__}: {exc})")
        return float("nan")


def free_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


# ---- C: combine ----------------------------------------------------------------------------------------------------
def bench_combine(pk: dict, smoke: bool) -> list:
    t, k, d, n_exp = (64, 6, 320, 16) if smoke else (4096, 6, 5120, 384)
    torch.manual_seed(0)
    idx = torch.rand(t, n_exp, device=DEV).topk(k, dim=-1).indices  # [T, k] distinct experts
    flat = idx.flatten()
    order = flat.argsort(stable=True)  # [R] sorted row -> token-slot
    rows = torch.randn(t * k, d, device=DEV, dtype=torch.bfloat16)
    naive_c = torch.compile(moe_combine_naive, dynamic=False)
    table = []
    for frac in (4, 1):
        local_e = torch.arange(n_exp, device=DEV) < n_exp // frac
        local = local_e[flat[order]]  # [R]
        r = rows.clone()
        r[~local] = float("nan")
        n_local = int(local.sum())
        nbytes = n_local * d * 2 + t * d * 4
        tag = f"EP{frac} ({n_local} local rows)"
        out = c_op.moe_combine(r, order, local, k)
        ref = moe_combine_naive(r, order, local, k)
        err = (out - ref).abs().max().item()
        assert torch.isfinite(out).all() and err <= 1e-6 * max(1.0, ref.abs().max().item()), err
        bitwise = torch.equal(out, ref)  # vs torch's sum(dim=1): its CUDA reduction may pair the k adds differently
        slots = torch.zeros(t * k, d, device=DEV).index_copy_(0, order, torch.where(local[:, None], r.float(), 0.0))
        seq = slots.view(t, k, d)[:, 0].clone()
        for j in range(1, k):
            seq += slots.view(t, k, d)[:, j]  # the op's contract: 0 + s_0 + ... + s_{k-1}, bitwise
        bitwise_seq = torch.equal(out, seq)
        assert bitwise_seq, "moe_combine differs from the slot-order fp32 sum"
        del slots, seq
        base = {}
        base["eager"] = common.op_ms(lambda: moe_combine_naive(r, order, local, k), DEV, smoke)
        common.table_row(table, f"{tag} naive eager", base["eager"], nbytes, "GB/s", pk, {})
        naive_c(r, order, local, k)
        base["compile"] = common.op_ms(lambda: naive_c(r, order, local, k), DEV, smoke)
        common.table_row(table, f"{tag} naive torch.compile", base["compile"], nbytes, "GB/s", pk, {})
        ms = common.op_ms(lambda: c_op.moe_combine(r, order, local, k), DEV, smoke)
        common.table_row(table, f"{tag} minidi op (default)", ms, nbytes, "GB/s", pk, base, bitwise_naive=bitwise,
                         bitwise_slot_order=bitwise_seq, max_err=err)
        ms = timed_graph(lambda: c_op.moe_combine(r, order, local, k), smoke)
        common.table_row(table, f"{tag} minidi op (default, CUDA graph)", ms, nbytes, "GB/s", pk, base)
        slot_row = c_op.invert_slots(order, local)
        ms = common.op_ms(lambda: c_op.invert_slots(order, local), DEV, smoke)
        common.table_row(table, f"{tag}   invert only", ms, t * k * 13, "GB/s", pk, {})
        out_buf = torch.empty(t, d, device=DEV)
        for bt, bd, nw in ((1, 1024, 4), (2, 1024, 4), (4, 1024, 8), (1, 2048, 8), (2, 2048, 8), (4, 512, 4),
                           (8, 512, 8), (1, 512, 2)):
            cfg = dict(BLOCK_T=bt, BLOCK_D=bd, num_warps=nw)
            c_op.combine_from_slots(r, slot_row, k, out_buf, **cfg)
            assert torch.equal(out_buf, out)
            ms = common.op_ms(lambda: c_op.combine_from_slots(r, slot_row, k, out_buf, **cfg), DEV, smoke)
            common.table_row(table, f"{tag}   kernel T{bt} D{bd} w{nw}", ms, nbytes, "GB/s", pk, base)
    common.print_table("C moe_combine (bytes: local rows read + [T, D] fp32 written)", table)
    return table


# ---- E: router GEMM ------------------------------------------------------------------------------------------------
GATE_SWEEP_BF16 = ((64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 64, 64, 4, 4),
                   (64, 128, 128, 4, 3), (64, 128, 32, 4, 4), (128, 128, 32, 8, 4), (32, 128, 64, 4, 4))
GATE_SWEEP_FP32 = ((64, 128, 32, 4, 3), (64, 128, 64, 4, 3), (128, 128, 32, 8, 3), (64, 64, 64, 4, 4))


def bench_gate(pk: dict, smoke: bool) -> list:
    t, d, e = (64, 256, 48) if smoke else (4096, 5120, 384)
    torch.manual_seed(2)
    x32 = torch.randn(t, d, device=DEV)
    xb = x32.bfloat16()
    w = (torch.randn(e, d, device=DEV) * d**-0.5).bfloat16()
    bias = torch.randn(e, device=DEV) * 0.1
    flop = 2 * t * d * e
    refs = {torch.bfloat16: xb.double() @ w.double().t(), torch.float32: x32.double() @ w.double().t()}
    tops = {dt: (torch.sqrt(F.softplus(r)) + bias.double()).topk(6, -1).indices.sort(-1).values
            for dt, r in refs.items()}

    def quality(out, xdt):
        r = refs[xdt]
        err = ((out.double() - r).abs().max() / r.abs().max()).item()
        top = (torch.sqrt(F.softplus(out.double())) + bias.double()).topk(6, -1).indices.sort(-1).values
        match = (top == tops[xdt]).all(-1).float().mean().item()
        return {"rel_err": float(f"{err:.2e}"), "top6_match": round(match, 5)}

    torch.backends.cuda.matmul.allow_tf32 = False
    naive_c = torch.compile(gate_logits_fp32, dynamic=False)
    table = []
    for xdt, x in ((torch.bfloat16, xb), (torch.float32, x32)):
        tag = "x bf16" if xdt == torch.bfloat16 else "x fp32"
        base = {}
        base["fp32_eager"] = common.op_ms(lambda: gate_logits_fp32(x, w), DEV, smoke)
        common.table_row(table, f"{tag} fp32 matmul eager (naive)", base["fp32_eager"], flop, "TFLOP/s", pk, {},
                         **quality(gate_logits_fp32(x, w), xdt))
        naive_c(x, w)
        base["compile"] = common.op_ms(lambda: naive_c(x, w), DEV, smoke)
        common.table_row(table, f"{tag} fp32 matmul torch.compile", base["compile"], flop, "TFLOP/s", pk, {},
                         **quality(naive_c(x, w), xdt))
        xb_ = x.bfloat16()
        ms = common.op_ms(lambda: xb_ @ w.t(), DEV, smoke)
        common.table_row(table, f"{tag} bf16 matmul (bf16 out)", ms, flop, "TFLOP/s", pk, base,
                         **quality((xb_ @ w.t()).float(), xdt))
        torch.backends.cuda.matmul.allow_tf32 = True
        ms = common.op_ms(lambda: x.float() @ w.float().t(), DEV, smoke)
        common.table_row(table, f"{tag} tf32 matmul (allow_tf32)", ms, flop, "TFLOP/s", pk, base,
                         **quality(x.float() @ w.float().t(), xdt))
        torch.backends.cuda.matmul.allow_tf32 = False
        splits = ("tf32",) if xdt == torch.bfloat16 else ("tf32", "bf16x3", "tf32x3_builtin")
        for split in splits:
            out = e_op.gate_tf32x3(x, w, x_split=split)
            q = quality(out, xdt)
            label = split if xdt == torch.float32 else "bf16 dot"
            if not (q["rel_err"] <= 1e-5 and q["top6_match"] == 1.0):  # report at the end, after the table
                FAILURES.append(f"gate_tf32x3 {tag} {label}: {q}")
            ms = common.op_ms(lambda: e_op.gate_tf32x3(x, w, x_split=split), DEV, smoke)
            common.table_row(table, f"{tag} minidi op {label} (default)", ms, flop, "TFLOP/s", pk, base, **q)
            ms = timed_graph(lambda: e_op.gate_tf32x3(x, w, x_split=split), smoke)
            common.table_row(table, f"{tag} minidi op {label} (CUDA graph)", ms, flop, "TFLOP/s", pk, base)
            buf = torch.empty(t, e, device=DEV)
            sweep = GATE_SWEEP_BF16 if xdt == torch.bfloat16 else GATE_SWEEP_FP32
            for bm, bn, bk, nw, ns in sweep:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
                name = f"{tag}   {label} M{bm} N{bn} K{bk} w{nw} s{ns}"
                try:
                    e_op.launch(x, w, buf, split, **cfg)
                except Exception as exc:  # e.g. out of shared memory for this tile: report, keep going
                    table.append({"name": name, "error": type(exc).__name__})
                    continue
                ms = common.op_ms(lambda: e_op.launch(x, w, buf, split, **cfg), DEV, smoke)
                common.table_row(table, name, ms, flop, "TFLOP/s", pk, base, **quality(buf, xdt))
    x32w = w.float()  # fp32 weight too: the classic 3xTF32 (not the checkpoint case)
    for split in ("tf32", "tf32x3_builtin"):
        out = e_op.gate_tf32x3(x32, x32w, x_split=split)
        q = quality(out, torch.float32)
        if not (q["rel_err"] <= 1e-5 and q["top6_match"] == 1.0):
            FAILURES.append(f"gate_tf32x3 x fp32, w fp32 {split}: {q}")
        ms = common.op_ms(lambda: e_op.gate_tf32x3(x32, x32w, x_split=split), DEV, smoke)
        common.table_row(table, f"x fp32, w fp32 minidi op {split}", ms, flop, "TFLOP/s", pk, {}, **q)
    _bench_compressor_gemm(table, pk, smoke)
    common.print_table("E gate_tf32x3 (FLOPs 2 T D E once; error vs float64)", table)
    return table


def _bench_compressor_gemm(table: list, pk: dict, smoke: bool) -> None:
    """Pass S's site: a V4.1 compressor's fp32 GEMM (x [T, D] bf16 @ w [512, D] bf16, fp32 out) as cuBLAS runs it
    (TF32 off) and as the op runs it."""
    t, d, n = (64, 256, 32) if smoke else (4096, 5120, 512)
    torch.manual_seed(3)
    x = torch.randn(t, d, device=DEV).bfloat16()
    w = (torch.randn(n, d, device=DEV) * d**-0.5).bfloat16()
    ref = x.double() @ w.double().t()
    flop = 2 * t * d * n

    def err(out) -> dict:
        return {"rel_err": float(f"{((out.double() - ref).abs().max() / ref.abs().max()).item():.2e}")}

    torch.backends.cuda.matmul.allow_tf32 = False
    base = {"fp32_eager": common.op_ms(lambda: x.float() @ w.float().t(), DEV, smoke)}
    common.table_row(table, "compressor GEMM (S): fp32 matmul", base["fp32_eager"], flop, "TFLOP/s", pk, {},
                     **err(x.float() @ w.float().t()))
    q = err(e_op.gate_tf32x3(x, w))
    if not q["rel_err"] <= 1e-5:
        FAILURES.append(f"gate_tf32x3 at the compressor shape: {q}")
    common.table_row(table, "compressor GEMM (S): minidi op", common.op_ms(lambda: e_op.gate_tf32x3(x, w), DEV, smoke),
                     flop, "TFLOP/s", pk, base, **q)


# ---- H: expert activation, I: dispatch gather (EP4: a quarter of the rows local) ----------------------------------
def _ep4_offs(r: int, experts: int) -> torch.Tensor:
    return torch.full((experts,), r // 4 // experts, dtype=torch.int64, device=DEV).cumsum(0).to(torch.int32)


def bench_activation(pk: dict, smoke: bool) -> list:
    r, i, experts, limit, block = (256, 256, 4, 10.0, 32) if smoke else (98304, 2304, 96, 10.0, 32)  # V4.1: 32
    torch.manual_seed(0)
    g = torch.randn(r, i, device=DEV, dtype=torch.bfloat16) * 4
    v = torch.randn(r, i, device=DEV, dtype=torch.bfloat16) * 4
    ws = torch.rand(r, 1, device=DEV)
    offs = _ep4_offs(r, experts)
    n = int(offs[-1])

    def naive(g, v, ws):
        return fq8((swiglu_clipped(g, v, limit) * ws).to(g.dtype), block)

    naive_c = torch.compile(naive, dynamic=False)
    out = h_op.moe_activation(g, v, ws, offs, limit, block)
    ref = naive(g, v, ws)
    diff = out[:n].float() != ref[:n].float()
    share = diff.float().mean().item()
    within = bool(((out[:n].float() - ref[:n].float()).abs() <= h_op.grid_step(ref[:n], block)).all())
    if share > 1e-4 or not within:
        FAILURES.append(f"moe_activation: {share:.2e} of the local elements differ (within one e4m3 step: {within})")
    nbytes = n * i * 2 * 3
    table, base = [], {}
    base["eager"] = common.op_ms(lambda: naive(g, v, ws), DEV, smoke)
    common.table_row(table, "naive eager (all rows)", base["eager"], nbytes, "GB/s", pk, {})
    naive_c(g, v, ws)
    base["compile"] = common.op_ms(lambda: naive_c(g, v, ws), DEV, smoke)
    common.table_row(table, "naive torch.compile (all rows)", base["compile"], nbytes, "GB/s", pk, {})
    ms = common.op_ms(lambda: h_op.moe_activation(g, v, ws, offs, limit, block), DEV, smoke)
    common.table_row(table, "minidi op (local rows)", ms, nbytes, "GB/s", pk, base, differ_share=share,
                     within_one_e4m3_step=within)
    # the same local rows as the only rows: no programs past offs[-1] (they return at once; what do they cost?)
    g_loc, v_loc, ws_loc = g[:n].clone(), v[:n].clone(), ws[:n].clone()
    ms_loc = common.op_ms(lambda: h_op.moe_activation(g_loc, v_loc, ws_loc, offs, limit, block), DEV, smoke)
    common.table_row(table, "minidi op, only the local rows launched", ms_loc, nbytes, "GB/s", pk, base)
    _walk_rows(table, h_op, "minidi op", lambda: h_op.moe_activation(g, v, ws, offs, limit, block), out, n, nbytes,
               pk, base, smoke)
    q, s = h_op.moe_activation_fp8(g, v, ws, offs, limit, block)  # pass L's form: e4m3 values + scales
    same = torch.equal((q[:n].float() * s[:n].repeat_interleave(block, 1)), out[:n].float())
    if not same:
        FAILURES.append("moe_activation_fp8: q * s differs from moe_activation's output")
    ms8 = common.op_ms(lambda: h_op.moe_activation_fp8(g, v, ws, offs, limit, block), DEV, smoke)
    common.table_row(table, "minidi op, FP8 operands (pass L)", ms8, n * i * (2 * 2 + 1 + 4 / block), "GB/s", pk,
                     base, q_times_s_equal=same)
    common.print_table("H moe_activation (bytes: local rows' g, v read + a written)", table)
    return table


WALKS = (4, 8, 16, 32)  # walk_grid's programs per SM swept for moe_activation (None: one program per tile)


def _walk_rows(table: list, module, name: str, call, want, n: int, nbytes: float, pk: dict, base: dict,
               smoke: bool) -> None:
    """``call()`` with ``module.WALK_PER_SM`` set to each of WALKS: a row each, its local rows checked bit-equal to
    ``want`` (the one-program-per-tile launch's)."""
    saved = module.WALK_PER_SM
    try:
        for per_sm in WALKS:
            module.WALK_PER_SM = per_sm
            out = call()
            same = torch.equal(out[:n], want[:n])
            if not same:
                FAILURES.append(f"{name}: walk_per_sm {per_sm} differs from the one-program-per-tile launch")
            common.table_row(table, f"{name}, walk {per_sm} programs / SM", common.op_ms(call, DEV, smoke), nbytes,
                             "GB/s", pk, base, walk_per_sm=per_sm, bit_equal=same)
    finally:
        module.WALK_PER_SM = saved


def bench_gather(pk: dict, smoke: bool) -> list:
    t, d, experts = (64, 320, 4) if smoke else (16384, 5120, 96)
    r = t * 6
    torch.manual_seed(0)
    x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16)
    idx = torch.randint(0, t, (r,), device=DEV)
    offs = _ep4_offs(r, experts)
    n = int(offs[-1])
    out = i_op.gather_rows(x, idx, offs)
    if not torch.equal(out[:n], x[idx[:n]]):
        FAILURES.append("gather_rows: local rows differ from x[idx]")
    naive_c = torch.compile(lambda x, idx: x[idx], dynamic=False)
    nbytes = n * d * 2 * 2
    table, base = [], {}
    base["eager"] = common.op_ms(lambda: x[idx], DEV, smoke)
    common.table_row(table, "x[idx] eager (all rows)", base["eager"], nbytes, "GB/s", pk, {})
    naive_c(x, idx)
    base["compile"] = common.op_ms(lambda: naive_c(x, idx), DEV, smoke)
    common.table_row(table, "x[idx] torch.compile (all rows)", base["compile"], nbytes, "GB/s", pk, {})
    ms = common.op_ms(lambda: i_op.gather_rows(x, idx, offs), DEV, smoke)
    common.table_row(table, "minidi gather_rows (local rows)", ms, nbytes, "GB/s", pk, base)
    idx_loc = idx[:n].clone()  # the same local rows as the only rows: no programs past offs[-1]
    ms_loc = common.op_ms(lambda: i_op.gather_rows(x, idx_loc, offs), DEV, smoke)
    common.table_row(table, "minidi gather_rows, only the local rows launched", ms_loc, nbytes, "GB/s", pk, base)
    _bench_fq8_gather(table, x, idx, offs, n, nbytes, pk, smoke)
    common.print_table("I gather_rows (bytes: local rows read + written)", table)
    return table


def _bench_fq8_gather(table: list, x, idx, offs, n: int, nbytes: float, pk: dict, smoke: bool) -> None:
    """Pass L's bf16 route into the experts' w1 / w3: fq8(x)[idx] on the local rows. Before: fq8_split of the T
    tokens, q * s in bf16 (an elementwise kernel under compile) and gather_rows; now gather_rows_fq8 in one pass.
    Same bytes basis as the gather (the op's minimum: local rows read + written)."""
    block = 32  # V4.1's act_block

    def three_steps(x, idx, offs):
        q, s = fq8_split(x, block)
        return i_op.gather_rows((q.float() * s.repeat_interleave(block, dim=-1)).to(x.dtype), idx, offs)

    three_c = torch.compile(three_steps, dynamic=False)
    fused = i_op.gather_rows_fq8(x, idx, offs, block)
    same = torch.equal(three_c(x, idx, offs)[:n], fused[:n]) and torch.equal(fused[:n], fq8(x, block)[idx[:n]])
    if not same:
        FAILURES.append("gather_rows_fq8: local rows differ from fq8(x)[idx] or from the three-step path")
    base = {"compile": common.op_ms(lambda: three_c(x, idx, offs), DEV, smoke)}
    common.table_row(table, "fq8_split, q * s, gather_rows (compiled)", base["compile"],
                     nbytes, "GB/s", pk, {})
    common.table_row(table, "minidi gather_rows_fq8 (one pass)", common.op_ms(
        lambda: i_op.gather_rows_fq8(x, idx, offs, block), DEV, smoke), nbytes, "GB/s", pk, base, bit_equal=same)


# ---- P: router top-k, Q: the dispatch's sort by expert ------------------------------------------------------------
def _timed_three(table: list, naive, op, nbytes: float, pk: dict, smoke: bool) -> None:
    """The plain path eager, under stock torch.compile, and minidi's op: one row each."""
    base = {"eager": common.op_ms(naive, DEV, smoke)}
    common.table_row(table, "plain torch eager", base["eager"], nbytes, "GB/s", pk, {})
    naive_c = torch.compile(naive, dynamic=False)
    naive_c()
    base["compile"] = common.op_ms(naive_c, DEV, smoke)
    common.table_row(table, "plain torch, torch.compile", base["compile"], nbytes, "GB/s", pk, {})
    common.table_row(table, "minidi op", common.op_ms(op, DEV, smoke), nbytes, "GB/s", pk, base)


def bench_row_topk(pk: dict, smoke: bool) -> list:
    t, e, k = (64, 384, 6) if smoke else (16384, 384, 6)
    torch.manual_seed(0)
    x = torch.randint(-200, 200, (t, e), device=DEV).float() / 64  # a coarse grid: ties between experts
    v, i = p_op.row_topk(x, k)
    rv, ri = topk_lowest_index(x, k)
    if not (torch.equal(i, ri) and torch.equal(v, rv)):
        FAILURES.append("row_topk: picks differ from topk_lowest_index")
    table: list = []
    _timed_three(table, lambda: topk_lowest_index(x, k), lambda: p_op.row_topk(x, k), t * e * 4 + t * k * 12, pk,
                 smoke)
    common.print_table("P row_topk (bytes: scores read + values and indices written)", table)
    return table


def bench_expert_order(pk: dict, smoke: bool) -> list:
    r, e = (384, 384) if smoke else (98304, 384)
    torch.manual_seed(0)
    flat = torch.randint(0, e, (r,), device=DEV)
    o, c = q_op.expert_order(flat, e)
    ro, rc = q_op.expert_order_ref(flat, e)
    if not (torch.equal(o, ro) and torch.equal(c, rc)):
        FAILURES.append("expert_order: order or counts differ from argsort(stable=True) / scatter_add_")
    table: list = []
    _timed_three(table, lambda: q_op.expert_order_ref(flat, e), lambda: q_op.expert_order(flat, e), r * 16, pk,
                 smoke)
    common.print_table("Q expert_order (bytes: ids read + order written)", table)
    return table


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default="C,E,H,I,P,Q")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one timed run each (CPU interpreter ok)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    pk = common.measure_peaks(DEV, small=args.smoke)
    common.say(f"minidi small MoE ops | {dev} | torch {torch.__version__} | triton {triton.__version__} | "
               f"peaks: bf16 {pk['bf16_tflops']:.0f} TFLOP/s, copy {pk['copy_gbps']:.0f} GB/s (read + write)")
    result = {"bench": "moe_small_ops", "device": dev, "torch": torch.__version__, "triton": triton.__version__,
              "peaks": {k: round(v, 1) for k, v in pk.items()}}
    parts = {"C": ("moe_combine", bench_combine), "E": ("gate_tf32x3", bench_gate),
             "H": ("moe_activation", bench_activation), "I": ("gather_rows", bench_gather),
             "P": ("row_topk", bench_row_topk), "Q": ("expert_order", bench_expert_order)}
    with torch.inference_mode():
        for key in args.only.split(","):
            name, fn = parts[key.strip()]
            result[name] = fn(pk, args.smoke)
            free_cache()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if DEV == "cuda":
        result["max_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    result["failures"] = FAILURES
    for msg in FAILURES:
        common.say(f"FAIL {msg}")
    common.emit_json(result, out=args.out)
    if FAILURES:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
