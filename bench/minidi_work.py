"""The work minidi's own kernels must do, declared per op as a function of the recorded arguments of the ``minidi::``
op call that launches them: the bytes (and, for the matmul-like ones, the FLOPs) of the CUDA kernel table
(``kernel_table.py``), beside the ATen ops' work (``op_work.py``) and the model's FLOPs (``model_work.py``).

A custom op's call is in the trace with its arguments (``Input Dims`` / ``Input type``; ints and floats as strings
in ``Concrete Inputs``), its kernels as device events launched inside it, and no work; one call may launch several
kernels, which ``op_work``'s one-kernel rule cannot split. ``KERNELS`` maps an op to an entry: a function of one call's
arguments (``Call``) that returns, per kernel name, the ``Work`` of that kernel's launches in the call. Each launch of
that kernel under that call gets an equal share (a row sums them back). A kernel the entry does not name stays unknown.

What a kernel must move: each tensor it is handed is read once, whole, or written once, whole (its inputs, its outputs
and the scratch it writes for the op's next kernel); a kernel that reads a tile twice, or misses L2, moves more, and
that is the gap its row's % of the copy peak shows. Two rules beyond that, by the kernels' design:

- Local rows. ``gather_rows`` / ``gather_rows_fq8``, ``moe_activation`` / ``moe_activation_fp8`` and ``moe_combine``'s
  combine read and write only the rows below offs[-1] (this rank's experts'); a gather reads each row it selects (a
  token's row once per slot that picks it). How many rows that is, is device data: the trace does not hold it. The
  workload decides it where every expert is local (``ep_size`` 1: all R routed rows, exactly). Under expert
  parallelism N, emulated or real, it depends on the routing; the count used is then the model's, R / N (a uniform
  expert load, as ``minidi/runtime/flops.py`` counts the expert GEMMs' FLOPs), and the work says so (``basis``: the
  row's ``bytes_from``, ``*`` in the printed table). Without ``ep_size`` those kernels stay unknown.
- ``hc_mix_partials`` reads its fp32 projection weight fn [M, n D] as the three bf16 pieces it keeps per weight
  ([3, MP, n D]: ``hc_mix.fn_pieces``, M rows padded to MP), and writes the partial sums of the D splits its kernel
  runs.

FLOPs, for the matmul-like kernels (``gate_tf32x3``, ``head_logits``, ``hc_mix_partials``' projection, the FP8 GEMM
of ``fp8_linear``'s route): 2 M N K of the product the op computes (the tf32 / bf16 splits that make it fp32-exact do
more MMAs), against the bf16 peak as every FLOP count of the table.

Unknown on purpose: ``topk_indices`` (its chunk maxima read each row's visible range [k_start, k_end), its selection
the chunks that pass the bound: device data); the rebases (``_rebase_kernel``) inside the FP8 indexer ops (in
``indexer_score_fp8`` they run at the score kernel's tile groups, a launch config that differs between the GPU and
the interpreter, and one row holds both ops' calls); the attention and score kernels and the grouped GEMMs (their
FLOPs: ``model_work.py``); any op not in ``KERNELS``.

Why one table here, not a declaration beside each op: an entry reads the profiler's record of a call (argument
positions, values as strings), which is the benchmark's format, while the ops stay a kernel and its reference
(``docs/modules.md``: ``bench/`` measures); ``model_work.py`` is the same kind of table. Where the bytes depend on an
op's launch geometry, the entry calls the op's own function or constant (``hc_mix.default_config``,
``gate_tf32x3.default_config``, ``expert_order._block``, ``head_logits.MAX_ROWS``), and
``tests/bench/test_minidi_work.py`` runs every op here under the interpreter and checks each entry against the
tensors its kernels were handed, so a changed op fails a test instead of misreporting.

Legend: T tokens, n streams, D width, M mixer outputs, R routed rows, E experts, k slots per token / picks, I expert
width, L logit rows, V vocabulary, W / K window / compressed slots, C chunks, EB bins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import triton

from minidi.ops import candidate_blocks, expert_order, fp8_gemm_sm90, gate_tf32x3, hc_mix, head_logits

if __package__:
    from .op_work import TensorArg, tensor_args
else:  # run as a script (kernel_table.py): the script's folder is sys.path[0]
    from op_work import TensorArg, tensor_args


class Work(NamedTuple):
    """The work of one kernel's launches in one op call: bytes it must move, FLOPs (matmul-like kernels), and
    ``basis`` where the bytes rest on the model's count rather than the trace and the workload (a label)."""

    nbytes: float
    flops: float | None = None
    basis: str | None = None


class Unknown(Exception):
    """The record lacks what an entry needs (an argument's shape, dtype or value)."""


@dataclass(frozen=True)
class Call:
    """One recorded op call, as an entry reads it: tensor arguments by position, scalar values, whether its kernels
    ran on CUDA (launch geometry), and the run's expert parallelism (``ep_size``: the local rows)."""

    tensors: list[TensorArg | None]
    types: list[str]
    values: list[str]
    cuda: bool
    ep_size: int | None

    def t(self, i: int) -> TensorArg:
        """Argument i, a tensor."""
        if i >= len(self.tensors) or self.tensors[i] is None:
            raise Unknown(f"argument {i} is not a recorded tensor")
        return self.tensors[i]

    def opt(self, i: int) -> TensorArg | None:
        """Argument i, an optional tensor: None where the call passed None."""
        return None if i < len(self.types) and self.types[i] == "" else self.t(i)

    def int(self, i: int) -> int:
        """Argument i, an int (``Concrete Inputs``)."""
        try:
            return int(self.values[i])
        except (IndexError, TypeError, ValueError):
            raise Unknown(f"argument {i}'s value is not recorded") from None

    def local_rows(self, routed: int) -> float:
        """Rows below offs[-1] of ``routed`` rows: all with every expert local, R / N under EP N (the model's uniform
        load, ``local_basis``); nan where ``ep_size`` is not given (that kernel's work stays unknown)."""
        return math.nan if self.ep_size is None else routed / self.ep_size

    @property
    def local_basis(self) -> str | None:
        return None if self.ep_size in (None, 1) else (
            f"model: uniform expert load, 1/{self.ep_size} of the routed rows local")


def _size(t: TensorArg) -> int:
    """A tensor's bytes, whole (its logical elements: an op hands its kernel a contiguous copy of a strided one)."""
    return math.prod(t.dims) * t.dtype.itemsize


# ---- entries: op arguments -> {kernel: Work} ------------------------------------------------------------------------
def _hc_expand(c: Call) -> dict[str, Work]:
    """x [T, n, D], h [T, D], post [T, n], comb [T, n, n] -> x' like x."""
    return {"_hc_expand_kernel": Work(sum(_size(c.t(i)) for i in range(4)) + _size(c.t(0)))}


def _hc_expand_mix(c: Call) -> dict[str, Work]:
    """x, h, post, comb as ``hc_expand``; fn, pre as ``hc_mix_partials`` -> x2 like x, and the partials of x2 (never
    read back: the mixer's bytes without its read of x)."""
    mix = _hc_mix_work(c.t(0), c.t(4), c.opt(5))
    if mix is None:
        return {}
    expand = _hc_expand(c)["_hc_expand_kernel"]
    return {"_hc_expand_mix_kernel": Work(expand.nbytes + mix.nbytes - _size(c.t(0)), flops=mix.flops)}


def _hc_mix(c: Call) -> dict[str, Work]:
    """x [T, n, D], fn [M, n D] fp32 (read as 3 bf16 pieces), pre [T, n] fp32 or None -> g [S, T, M] and ss [S, T]
    fp32 over the S splits of D the kernel runs (a narrow D: fewer, the rest zeroed by torch), u [T, D] (pre given).
    One of two kernels runs, the same work: the pointer loads, or tiles by the TMA (sm_90)."""
    work = _hc_mix_work(c.t(0), c.t(1), c.opt(2))
    return {} if work is None else {"_hc_mix_kernel": work, "_hc_mix_tma_kernel": work}


def _hc_mix_work(x: TensorArg, fn: TensorArg, pre: TensorArg | None) -> Work | None:
    t, n, d = x.dims
    m = fn.dims[0]
    if not t * d:
        return None
    bd = hc_mix.default_config(t, d, x.dtype)["BD"]
    splits = triton.cdiv(d, triton.cdiv(triton.cdiv(d, hc_mix.SPLITS), bd) * bd)
    read = _size(x) + 3 * hc_mix.mix_width(m) * n * d * 2 + (_size(pre) if pre is not None else 0)
    write = splits * t * (m + 1) * 4 + (t * d * x.dtype.itemsize if pre is not None else 0)
    return Work(read + write, flops=2 * t * m * n * d)


def _hc_sinkhorn(c: Call) -> dict[str, Work]:
    """logits [T, n, n] fp32 -> like it."""
    return {"_sinkhorn_kernel": Work(2 * _size(c.t(0)))}


def _fq8(c: Call) -> dict[str, Work]:
    """x [..., K] -> y like x."""
    return {"_fq8_kernel": Work(2 * _size(c.t(0)))}


def _fq8_split(c: Call) -> dict[str, Work]:
    """x [..., K], block -> q [..., K] e4m3, s [..., K / block] fp32."""
    x = c.t(0)
    n = math.prod(x.dims)
    return {"_fq8_split_kernel": Work(_size(x) + n + n // c.int(1) * 4)}


def _fp8_linear(c: Call) -> dict[str, Work]:
    """x [..., K], weight [N, K] e4m3, scale E8M0 tiles, weight_block, act_block: the fq8 of x (act_block > 0) and
    the weight's dequant to x's dtype (launched only where the weight is not kept: ``fp8_linear.dequant_weight``);
    the GEMM is an ATen op's. On the FP8 route (``MINIDI_FP8_GEMM``, 128-blocks by default) the input's split (act_block
    +-b: e4m3 + one fp32 scale per b) and the Gluon GEMM: 2 M N K FLOPs; bytes, its operands once each (the split's
    e4m3 rows and scales, the e4m3 weight, its transposed fp32 scales padded to 4 columns, the output)."""
    x, w = c.t(0), c.t(1)
    act_block = c.int(4)
    out = {"_dequant_kernel": Work(_size(w) + _size(c.t(2)) + math.prod(w.dims) * x.dtype.itemsize)}
    if act_block > 0:
        out["_fq8_kernel"] = Work(2 * _size(x))
    if act_block:
        b = abs(act_block)
        (n, k), m = w.dims, math.prod(x.dims[:-1])
        out["_fq8_split_kernel"] = Work(_size(x) + m * k + m * k // b * 4)
        scales_t = math.prod(fp8_gemm_sm90.weight_scale_t_shape(n, k, b)) * 4
        out["_fp8_gemm_sm90_gluon"] = Work(m * k + m * k // b * 4 + n * k + scales_t + m * n * x.dtype.itemsize,
                                           flops=2 * m * n * k)
    return out


def _fp8_grouped_linear(c: Call) -> dict[str, Work]:
    """x [T, G, I], weight [N, I] e4m3, scale, weight_block: the weight's dequant (launched only where it is not
    kept); the G GEMMs are one ATen bmm's."""
    x, w = c.t(0), c.t(1)
    return {"_dequant_kernel": Work(_size(w) + _size(c.t(2)) + math.prod(w.dims) * x.dtype.itemsize)}


def _gate(c: Call) -> dict[str, Work]:
    """x [T, D], weight [E, D] -> [T, E] fp32, written as one plane per split of D (thin E: split, the planes summed
    by a torch op after)."""
    x, w = c.t(0), c.t(1)
    (t, d), e = x.dims, w.dims[0]
    cfg = gate_tf32x3.default_config(t, e, d, x.dtype, w.dtype)
    k_per = triton.cdiv(triton.cdiv(d, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    planes = triton.cdiv(d, k_per) if d else 1
    return {"_gate_kernel": Work(_size(x) + _size(w) + planes * t * e * 4, flops=2 * t * e * d)}


def _head_logits(c: Call) -> dict[str, Work]:
    """y [L, D], weight [V, D] -> [L, V] fp32; more than MAX_ROWS rows run the reference GEMM (no kernel of its own)."""
    y, w = c.t(0), c.t(1)
    (rows, d), v = y.dims, w.dims[0]
    if rows > head_logits.MAX_ROWS:
        return {}
    return {"_head_logits_kernel": Work(_size(y) + _size(w) + rows * v * 4, flops=2 * rows * v * d)}


def _row_topk(c: Call) -> dict[str, Work]:
    """x [..., N], k -> values [..., k] in x's dtype, indices [..., k] int64."""
    x, k = c.t(0), c.int(1)
    rows = math.prod(x.dims[:-1])
    return {"_row_topk_kernel": Work(_size(x) + rows * k * (x.dtype.itemsize + 8))}


def _expert_order(c: Call) -> dict[str, Work]:
    """flat [R] int, E -> order [R] int64, counts [E] int64, through two [C, EB] int32 tables (chunk histograms,
    offsets)."""
    flat, e = c.t(0), c.int(1)
    r = math.prod(flat.dims)
    if not r:
        return {}
    table = triton.cdiv(r, expert_order._block(r, c.cuda)) * triton.next_power_of_2(e + 2) * 4
    return {"_chunk_hist_kernel": Work(_size(flat) + table),
            "_chunk_offsets_kernel": Work(2 * table + e * 8),
            "_chunk_scatter_kernel": Work(_size(flat) + table + r * 8)}


def _rotated_blocks(c: Call) -> dict[str, Work]:
    """x [T, ...], size -> [size T, ...]: x read once (each row is re-read size times, from L2 or not)."""
    return {"_rotated_rows_kernel": Work(_size(c.t(0)) * (1 + c.int(1)))}


def _sparse_attention(c: Call) -> dict[str, Work]:
    """The slot codes: window_idx [T, W], comp_idx [T, K] (with comp_kv; else K = 0) -> [T, W + K] int32. The
    attention kernel: FLOPs from the model (``model_work.py``)."""
    widx, comp_kv, cidx = c.t(2), c.opt(3), c.opt(4)
    t, w = widx.dims
    k = cidx.dims[1] if comp_kv is not None and cidx is not None else 0
    return {"_encode_slots_kernel": Work(_size(widx) + (_size(cidx) if k else 0) + t * (w + k) * 4)}


def _gather_rows(c: Call) -> dict[str, Work]:
    """x [T, D], idx [R], offs [E] (, block) -> [R, D] like x: the local rows' idx read, x rows read, rows written."""
    x, idx, offs = c.t(0), c.t(1), c.t(2)
    n = c.local_rows(idx.dims[0])
    row = x.dims[1] * x.dtype.itemsize
    return {"_gather_rows_kernel": Work(n * idx.dtype.itemsize + _size(offs) + 2 * n * row, basis=c.local_basis)}


def _activation_reads(c: Call) -> tuple[float, int, float]:
    """(local rows n, I, bytes read: g and v rows, ws, offs) of moe_activation(_fp8)(g, v, ws, offs, limit, block)."""
    g, v, ws, offs = c.t(0), c.t(1), c.t(2), c.t(3)
    r, i = g.dims
    n = c.local_rows(r)
    return n, i, n * i * (g.dtype.itemsize + v.dtype.itemsize) + n * ws.dtype.itemsize + _size(offs)


def _moe_activation(c: Call) -> dict[str, Work]:
    """g, v [R, I], ws [R] | [R, 1] fp32, offs [E], limit, block -> [R, I] like g (local rows)."""
    n, i, read = _activation_reads(c)
    return {"_moe_activation_kernel": Work(read + n * i * c.t(0).dtype.itemsize, basis=c.local_basis)}


def _moe_activation_fp8(c: Call) -> dict[str, Work]:
    """As ``moe_activation`` -> q [R, I] e4m3, s [R, I / block] fp32 (local rows)."""
    n, i, read = _activation_reads(c)
    return {"_moe_activation_kernel": Work(read + n * i + n * (i // c.int(5)) * 4, basis=c.local_basis)}


def _moe_combine(c: Call) -> dict[str, Work]:
    """rows [R, D], order [R] int64, local [R] bool, k -> [R / k, D] fp32, through slot_row [R] int32 (the inverse
    permutation, written whole by the first kernel); the combine reads the local rows only."""
    rows, order, local, k = c.t(0), c.t(1), c.t(2), c.int(3)
    r, d = rows.dims
    combine = r * 4 + c.local_rows(r) * d * rows.dtype.itemsize + r // k * d * 4
    return {"_invert_kernel": Work(_size(order) + _size(local) + r * 4),
            "_combine_kernel": Work(combine, basis=c.local_basis)}


def _hadamard(c: Call) -> dict[str, Work]:
    """x [..., n] -> y (x's dtype): x read, y written, the +-1 signs [n, n] (x's dtype) read once."""
    x = c.t(0)
    n = x.dims[-1]
    return {"_hadamard_kernel": Work(2 * _size(x) + n * n * x.dtype.itemsize)}


def _candidate_blocks(c: Call) -> dict[str, Work]:
    """scores [T, N], k_start, k_end [T], keep, block -> block maxima [T, NB] fp32; the selection (rows of at most
    ``MAX_REGISTER_NB`` blocks) reads them (again after its bisection: from L2) and writes ids [T, min(keep, NB)]."""
    scores, keep, block = c.t(0), c.int(3), c.int(4)
    t, n = scores.dims
    nb = -(-n // block)
    out = {"_block_max_kernel": Work(_size(scores) + _size(c.t(1)) + _size(c.t(2)) + t * nb * 4)}
    if nb <= candidate_blocks.MAX_REGISTER_NB and min(keep, nb):
        out["_block_select_kernel"] = Work(t * nb * 4 + t * min(keep, nb) * 8)
    return out


KERNELS: dict[str, Callable[[Call], dict[str, Work]]] = {
    "minidi::candidate_blocks": _candidate_blocks,
    "minidi::hc_expand": _hc_expand,
    "minidi::hc_mix_partials": _hc_mix,
    "minidi::hc_expand_mix": _hc_expand_mix,
    "minidi::hc_sinkhorn": _hc_sinkhorn,
    "minidi::fq8": _fq8,
    "minidi::fq8_split": _fq8_split,
    "minidi::fp8_linear": _fp8_linear,
    "minidi::fp8_grouped_linear": _fp8_grouped_linear,
    "minidi::gate_tf32x3": _gate,
    "minidi::hadamard_rotate": _hadamard,
    "minidi::head_logits": _head_logits,
    "minidi::row_topk": _row_topk,
    "minidi::expert_order": _expert_order,
    "minidi::rotated_blocks": _rotated_blocks,
    "minidi::sparse_attention": _sparse_attention,
    "minidi::gather_rows": _gather_rows,
    "minidi::gather_rows_fq8": _gather_rows,
    "minidi::moe_activation": _moe_activation,
    "minidi::moe_activation_fp8": _moe_activation_fp8,
    "minidi::moe_combine": _moe_combine,
}
"""op name -> entry. The local-rows ops (``Call.local_rows``): gather_rows(_fq8), moe_activation(_fp8), moe_combine."""


# ---- reading a trace event ------------------------------------------------------------------------------------------
def declared(name: str) -> bool:
    """Whether ``KERNELS`` declares the kernels of op ``name``."""
    return name in KERNELS


def op_kernels(event: dict, cuda: bool, ep_size: int | None = None) -> dict[str, Work] | None:
    """{kernel: Work of its launches in this call} of one recorded ``minidi::`` op call; None where the op is not
    declared or the record lacks what its entry needs. ``cuda``: its kernels ran on CUDA (the trace has device
    events), which some launch geometries depend on."""
    entry = KERNELS.get(event.get("name", ""))
    args = event.get("args") or {}
    tensors = tensor_args(args)
    if entry is None or tensors is None:
        return None
    values = args.get("Concrete Inputs")
    try:
        return entry(Call(tensors, args.get("Input type") or [], values if isinstance(values, list) else [], cuda,
                          ep_size))
    except (Unknown, ValueError, IndexError, ZeroDivisionError):  # or a record whose arguments do not fit the op's
        return None


def kernel_work(event: dict, kernel: str, launches: int, cuda: bool, ep_size: int | None = None
                ) -> tuple[float | None, float | None, str | None]:
    """(FLOPs, bytes, basis) of one launch of ``kernel``, one of ``launches`` launches of that name under this op
    call (an equal share of the entry's work for it); None where unknown."""
    work = (op_kernels(event, cuda, ep_size) or {}).get(kernel)
    if work is None or launches < 1 or math.isnan(work.nbytes):
        return None, None, None
    flops = None if work.flops is None else work.flops / launches
    return flops, work.nbytes / launches, work.basis


__all__ = ["KERNELS", "Call", "Unknown", "Work", "declared", "kernel_work", "op_kernels"]
