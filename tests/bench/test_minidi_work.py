"""The work minidi's own kernels must do (``bench/minidi_work.py``): each declared op runs under the interpreter with
the profiler recording its call, and its entry, read from that record, must equal an independent count: the bytes of
the tensors each kernel launch is handed (Triton's launches observed), or, for the local-row MoE kernels, the local
rows' bytes counted from the real tensors; the FLOPs of the matmul-like ones; the byte figures the ops' own docstrings
give at V4.1 shapes; and the recorded call in a CUDA-shaped trace gives the kernel table's rows bytes, GB/s and % of
the copy peak."""

from __future__ import annotations

import json

import pytest
import torch
from triton.runtime import interpreter

from bench import minidi_work
from bench.kernel_table import kernel_table
from minidi.ops import (candidate_blocks, expert_order, fp8_linear, fp8_quant, fq8, gate_tf32x3, hadamard,
                        hc_expand, hc_expand_mix, hc_mix, hc_sinkhorn, head_logits, moe_activation, moe_combine,
                        moe_gather, row_topk, sparse_attention)
from minidi.runtime.expert_parallel import rotated_blocks

def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, list[torch.Tensor]]]:
    """(kernel name, tensors handed) of each Triton launch of a minidi kernel while the test runs (interpreter)."""
    log: list[tuple[str, list[torch.Tensor]]] = []
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, **kwargs):
        if self.fn.__module__.startswith("minidi.ops."):
            log.append((self.fn.__name__, [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording)
    return log


def _handed(log) -> dict[str, int]:
    """Per kernel, the bytes of the distinct tensors each launch was handed (a dummy pointer passed twice: once),
    summed over its launches."""
    out: dict[str, int] = {}
    for name, tensors in log:
        distinct = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
        out[name] = out.get(name, 0) + sum(n for _, n in distinct)
    return out


def _record(run, tmp_path, op: str) -> tuple[dict, object]:
    """(the trace event of the one call of ``op`` that ``run`` makes, run's result): a CPU profile, shapes recorded."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = run()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    (event,) = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "cpu_op" and
                e["name"] == op]
    return event, result


def _declared(event: dict, ep_size: int | None = None) -> dict[str, minidi_work.Work]:
    works = minidi_work.op_kernels(event, cuda=False, ep_size=ep_size)
    assert works is not None, f"{event['name']}: the entry could not read the record {event['args']}"
    return works


# ---- kernels that move whole tensors: the declaration == the tensors each launch is handed -------------------------
def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=_gen(seed)).to(torch.bfloat16)


def _sparse_attention_args():
    t, h, d, w, k, nw, nc = 3, 16, 16, 4, 5, 9, 12
    g = _gen(3)
    widx, cidx = torch.randint(0, nw, (t, w), generator=g), torch.randint(0, nc, (t, k), generator=g)
    return (torch.randn(t, h, d, generator=g), torch.randn(nw, d, generator=g), widx, torch.randn(nc, d, generator=g),
            cidx, torch.randn(h, generator=g), 0.25)


def _fp8_linear_args():
    w = (torch.randn(48, 96, generator=_gen(4)) * 8).to(torch.float8_e4m3fn)
    return _bf16(5, 96, seed=5), w, torch.full((2, 3), 127, dtype=torch.uint8), 32, 32


WHOLE = {  # op -> a call of it (kernels of one call)
    "minidi::hc_expand": lambda: hc_expand.hc_expand(_bf16(6, 4, 40), _bf16(6, 40, seed=1), torch.rand(6, 4),
                                                     torch.rand(6, 4, 4), backend="triton"),
    "minidi::hc_mix_partials": lambda: hc_mix.hc_mix_fused(_bf16(5, 4, 128), torch.randn(24, 512, generator=_gen(1)),
                                                           torch.rand(5, 4), backend="triton"),
    "minidi::hc_expand_mix": lambda: hc_expand_mix.hc_expand_mix(
        _bf16(5, 4, 128), _bf16(5, 128, seed=1), torch.rand(5, 4), torch.rand(5, 4, 4),
        torch.randn(24, 512, generator=_gen(1)), torch.rand(5, 4), backend="triton"),
    "minidi::hc_sinkhorn": lambda: hc_sinkhorn.hc_sinkhorn(torch.randn(7, 4, 4, generator=_gen()), 3, 1e-6,
                                                           backend="triton"),
    "minidi::fq8": lambda: fq8.fq8(_bf16(3, 5, 64), 32, backend="triton"),
    "minidi::fq8_split": lambda: fp8_quant.fq8_split(_bf16(3, 256), 128, backend="triton"),
    "minidi::fp8_linear": lambda: fp8_linear.fp8_linear(*_fp8_linear_args(), backend="triton"),
    "minidi::gate_tf32x3": lambda: gate_tf32x3.gate_tf32x3(torch.randn(9, 512, generator=_gen()),
                                                           _bf16(24, 512, seed=1), backend="triton"),  # thin: K split
    "minidi::head_logits": lambda: head_logits.head_logits(_bf16(1, 64), _bf16(50, 64, seed=1), backend="triton"),
    "minidi::row_topk": lambda: row_topk.row_topk(torch.randn(2, 5, 24, generator=_gen()), 3, backend="triton"),
    "minidi::expert_order": lambda: expert_order.expert_order(torch.randint(0, 6, (150,), generator=_gen()), 6,
                                                              backend="triton"),  # 3 chunks on the CPU
    "minidi::rotated_blocks": lambda: rotated_blocks(_bf16(6, 10), 4),
    "minidi::hadamard_rotate": lambda: hadamard.hadamard_rotate(_bf16(70, 2, 64), backend="triton"),
    "minidi::sparse_attention": lambda: sparse_attention.sparse_attention(*_sparse_attention_args(), backend="triton"),
    "minidi::candidate_blocks": lambda: candidate_blocks.candidate_blocks(
        torch.randn(4, 37, generator=_gen()), torch.tensor([0, 2, 0, 5]), torch.tensor([37, 30, 9, 5]), 3, 4,
        backend="triton"),
}
NOT_DECLARED = {"_sparse_attention_kernel"}  # FLOPs from the model (model_work.py), no bytes


@pytest.mark.parametrize("op", list(WHOLE))
@pytest.mark.interpreter
def test_declared_bytes_are_the_tensors_each_kernel_is_handed(op, launches, tmp_path):
    declared = _declared(_record(WHOLE[op], tmp_path, op)[0])
    handed = {k: v for k, v in _handed(launches).items() if k not in NOT_DECLARED}
    assert handed, f"{op} launched no declared kernel"
    assert {k: declared[k].nbytes for k in handed} == handed
    assert all(w.basis is None for w in declared.values())


@pytest.mark.interpreter
def test_gate_with_a_wide_output_writes_one_plane(launches, tmp_path):
    op = "minidi::gate_tf32x3"
    event, _ = _record(lambda: gate_tf32x3.gate_tf32x3(_bf16(9, 64), _bf16(80, 64, seed=1), backend="triton"),
                       tmp_path, op)
    handed = _handed(launches)["_gate_kernel"]
    assert _declared(event)["_gate_kernel"].nbytes == handed == (9 + 80) * 64 * 2 + 9 * 80 * 4  # x, w, one plane


@pytest.mark.interpreter
def test_head_logits_past_its_rows_runs_no_kernel(launches, tmp_path):
    event, _ = _record(lambda: head_logits.head_logits(_bf16(2, 64), _bf16(50, 64, seed=1), backend="triton"),
                       tmp_path, "minidi::head_logits")
    assert _declared(event) == {} and not launches


@pytest.mark.interpreter
def test_hc_mix_on_a_narrow_width_writes_the_splits_it_runs(launches, tmp_path):
    """D 64 in splits of 32 columns: 2 of the 4 planes of g / ss are the kernel's, the other 2 zeroed by torch."""
    t, m = 5, 24
    event, _ = _record(lambda: hc_mix.hc_mix_fused(_bf16(t, 4, 64), torch.randn(m, 256, generator=_gen(1)),
                                                   torch.rand(t, 4), backend="triton"), tmp_path,
                       "minidi::hc_mix_partials")
    unused = (hc_mix.SPLITS - 2) * t * (m + 1) * 4
    assert _declared(event)["_hc_mix_kernel"].nbytes == _handed(launches)["_hc_mix_kernel"] - unused


def _flops(op: str, kernel: str, tmp_path) -> float | None:
    return _declared(_record(WHOLE[op], tmp_path, op)[0])[kernel].flops


@pytest.mark.interpreter
def test_flops_of_the_matmul_like_kernels(tmp_path):
    assert _flops("minidi::gate_tf32x3", "_gate_kernel", tmp_path) == 2 * 9 * 24 * 512  # 2 T E D
    assert _flops("minidi::head_logits", "_head_logits_kernel", tmp_path) == 2 * 1 * 50 * 64  # 2 L V D
    assert _flops("minidi::hc_mix_partials", "_hc_mix_kernel", tmp_path) == 2 * 5 * 24 * 4 * 128  # 2 T M n D
    assert _flops("minidi::fq8", "_fq8_kernel", tmp_path) is None
    # the FP8 route's GEMM (declared from the call's arguments; it runs on sm_90 only): 2 M N K
    assert _flops("minidi::fp8_linear", "_fp8_gemm_sm90_gluon", tmp_path) == 2 * 5 * 48 * 96


@pytest.mark.interpreter
def test_fp8_route_gemm_bytes_are_its_operands(tmp_path):
    """The Gluon GEMM's declared bytes equal the tensors ``fp8_gemm_linear`` hands it, built here on the CPU as the
    route builds them (the split of x, the weight, ``weight_scale_t``, the output)."""
    from minidi.ops import fp8_gemm_sm90

    x, w, s, block, act_block = _fp8_linear_args()
    event, _ = _record(lambda: fp8_linear.fp8_linear(x, w, s, block, act_block, backend="triton"), tmp_path,
                       "minidi::fp8_linear")
    q, sx = fp8_quant.fq8_split(x, block, backend="triton")
    handed = [q, sx, w, fp8_gemm_sm90.weight_scale_t(s), torch.empty(5, 48, dtype=x.dtype)]
    assert _declared(event)["_fp8_gemm_sm90_gluon"].nbytes == sum(t.numel() * t.element_size() for t in handed)


# ---- the local-row MoE kernels: the rows below offs[-1], counted from the real tensors ------------------------------
R, EP_SIZES = 24, (1, 4)  # routed rows; offs[-1] = R / ep, what ep_size tells the entries


def _offs(ep: int) -> torch.Tensor:
    n = R // ep
    return torch.tensor([n // 2, n], dtype=torch.int32)  # two local experts


@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.parametrize("fq8_block", [0, 32])
@pytest.mark.interpreter
def test_gather_moves_the_local_rows_it_selects(ep, fq8_block, tmp_path):
    x, idx, offs = _bf16(6, 64), torch.randint(0, 6, (R,), generator=_gen()), _offs(ep)
    op = "minidi::gather_rows_fq8" if fq8_block else "minidi::gather_rows"
    if fq8_block:
        run = lambda: moe_gather.gather_rows_fq8(x, idx, offs, fq8_block, backend="triton")  # noqa: E731
    else:
        run = lambda: moe_gather.gather_rows(x, idx, offs, backend="triton")  # noqa: E731
    event, out = _record(run, tmp_path, op)
    work = _declared(event, ep)["_gather_rows_kernel"]
    n = R // ep
    assert work.nbytes == idx[:n].nbytes + offs.nbytes + x[idx[:n]].nbytes + out[:n].nbytes
    assert work.basis == (None if ep == 1 else "model: uniform expert load, 1/4 of the routed rows local")


@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.interpreter
def test_moe_activation_moves_the_local_rows(ep, fp8, tmp_path):
    g, v, ws, offs = _bf16(R, 64), _bf16(R, 64, seed=1), torch.rand(R, 1), _offs(ep)
    if fp8:
        run = lambda: moe_activation.moe_activation_fp8(g, v, ws, offs, 7.0, 32, backend="triton")  # noqa: E731
    else:
        run = lambda: (moe_activation.moe_activation(g, v, ws, offs, 7.0, 32, backend="triton"),)  # noqa: E731
    op = "minidi::moe_activation_fp8" if fp8 else "minidi::moe_activation"
    event, outs = _record(run, tmp_path, op)
    work = _declared(event, ep)["_moe_activation_kernel"]
    n = R // ep
    assert work.nbytes == g[:n].nbytes + v[:n].nbytes + ws[:n].nbytes + offs.nbytes + sum(o[:n].nbytes for o in outs)


@pytest.mark.parametrize("ep", EP_SIZES)
@pytest.mark.interpreter
def test_moe_combine_reads_the_local_rows(ep, launches, tmp_path):
    k, n = 4, R // ep
    rows, order = _bf16(R, 32), torch.randperm(R, generator=_gen())
    local = torch.zeros(R, dtype=torch.bool)
    local[torch.randperm(R, generator=_gen(1))[:n]] = True
    event, out = _record(lambda: moe_combine.moe_combine(rows, order, local, k, backend="triton"), tmp_path,
                         "minidi::moe_combine")
    works = _declared(event, ep)
    assert works["_invert_kernel"].nbytes == _handed(launches)["_invert_kernel"]  # whole tensors
    assert works["_invert_kernel"].basis is None
    assert works["_combine_kernel"].nbytes == R * 4 + rows[local].nbytes + out.nbytes
    unknown = _declared(event)  # no ep_size: the local rows are unknown, the inverse is not
    assert minidi_work.kernel_work(event, "_combine_kernel", 1, False) == (None, None, None)
    assert unknown["_invert_kernel"] == works["_invert_kernel"]


# ---- the ops' own byte figures at V4.1 shapes (their docstrings) ---------------------------------------------------
def _event(name, dims, types, values=None):
    return {"name": name, "cat": "cpu_op", "args": {"Input Dims": dims, "Input type": types,
                                                    "Concrete Inputs": values or [""] * len(dims)}}


BF, F32, I32, I64 = "c10::BFloat16", "float", "int", "long int"


@pytest.mark.parametrize("event, ep, kernel, doc_mb", [
    # hc_expand.py: "the 378 MB it must move (x and x' in bf16, h)" (T 4,096, n 4, D 5,120)
    (_event("minidi::hc_expand", [[4096, 4, 5120], [4096, 5120], [4096, 4], [4096, 4, 4]], [BF, BF, F32, F32]), None,
     "_hc_expand_kernel", 378),
    # moe_gather.py: "R 98,304 rows, 1/4 local, D 5,120 bf16: the local rows' 252 MB read and 252 MB written"
    (_event("minidi::gather_rows_fq8", [[16384, 5120], [98304], [64], []], [BF, I64, I32, "Scalar"],
            ["", "", "", "32"]), 4, "_gather_rows_kernel", 252 + 252),
    # moe_activation.py: "R 98,304 rows, 1/4 local, I 2,304, bf16: reads 226 MB, writes 113 MB"
    (_event("minidi::moe_activation", [[98304, 2304], [98304, 2304], [98304, 1], [64], [], []],
            [BF, BF, F32, I32, "Scalar", "Scalar"], ["", "", "", "", "10.", "32"]), 4, "_moe_activation_kernel",
     226 + 113),
    # moe_combine.py: "T 4,096, k 6, D 5,120, bf16 rows ... EP4 (1/4 local): 63 + 84 = 147 MB"
    (_event("minidi::moe_combine", [[24576, 5120], [24576], [24576], []], [BF, I64, "bool", "Scalar"],
            ["", "", "", "6"]), 4, "_combine_kernel", 147),
    # head_logits.py: "The bytes that must move are the bf16 weight once" (V 129,280, D 5,120: 1.32 GB)
    (_event("minidi::head_logits", [[1, 5120], [129280, 5120]], [BF, BF]), None, "_head_logits_kernel", 1324),
])
def test_the_ops_docstring_figures(event, ep, kernel, doc_mb):
    assert minidi_work.op_kernels(event, cuda=True, ep_size=ep)[kernel].nbytes / 1e6 == pytest.approx(doc_mb, rel=3e-3)


def test_a_record_without_what_the_entry_needs_is_unknown():
    combine = _event("minidi::moe_combine", [[24, 8], [24], [24], []], [BF, I64, "bool", "Scalar"])  # no k value
    assert minidi_work.op_kernels(combine, cuda=True, ep_size=1) is None
    assert minidi_work.op_kernels(_event("minidi::topk_indices", [[4, 8], []], [F32, "Scalar"]), True, 1) is None
    assert minidi_work.op_kernels({"name": "minidi::fq8", "args": {}}, True) is None  # shapes not recorded
    mix = _event("minidi::hc_mix_partials", [[4, 8], [24, 8], []], [BF, F32, ""])  # x of another rank than the op's
    assert minidi_work.op_kernels(mix, True) is None
    assert not minidi_work.declared("minidi::topk_indices") and minidi_work.declared("minidi::fq8")


# ---- a recorded call in a CUDA-shaped trace: the kernel table's rows -------------------------------------------------
def _x(cat, name, thread, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": thread[0], "tid": thread[1], "ts": ts, "dur": dur,
            "args": args}


@pytest.mark.interpreter
def test_a_recorded_call_gives_its_kernels_rows_bytes_and_rates(tmp_path):
    """The real record of one moe_combine call (CPU profile, interpreter), placed in a step of a trace with two CUDA
    launches under it: each kernel's row gets its declared bytes, GB/s and % of the copy peak."""
    k, rows, order = 4, _bf16(R, 32), torch.randperm(R, generator=_gen())
    local = torch.zeros(R, dtype=torch.bool)
    local[:6] = True
    call, _ = _record(lambda: moe_combine.moe_combine(rows, order, local, k, backend="triton"), tmp_path,
                      "minidi::moe_combine")
    cpu, gpu = (1, 10), (0, 7)
    call.update(pid=cpu[0], tid=cpu[1], ts=100, dur=100)
    trace = {"traceEvents": [
        _x("user_annotation", "minidi/step", cpu, 0, 1000), call,
        _x("cuda_driver", "cuLaunchKernelEx", cpu, 120, 3, correlation=1),
        _x("cuda_driver", "cuLaunchKernelEx", cpu, 150, 3, correlation=2),
        _x("kernel", "_invert_kernel", gpu, 2000, 1, correlation=1),
        _x("kernel", "_combine_kernel", gpu, 2010, 2, correlation=2),
    ]}
    peaks = {"bf16_tflops": 1000.0, "copy_gbps": 1.0}
    got = {r["name"]: r for r in kernel_table(trace, top=5, peaks=peaks, ep_size=4).rows}
    invert, combine = got["_invert_kernel"], got["_combine_kernel"]
    assert invert["bytes_per_step"] == R * (8 + 1 + 4) and "bytes_from" not in invert
    assert invert["gbps"] == pytest.approx(R * 13 / 1e-6 / 1e9, rel=1e-3)
    assert invert["pct_peak"] == pytest.approx(100 * invert["gbps"] / 1.0, rel=1e-3)
    assert combine["bytes_per_step"] == R * 4 + R // 4 * 32 * 2 + R // k * 32 * 4
    assert combine["bytes_from"].startswith("model: uniform expert load") and combine["gbps"] > 0
    unknown = {r["name"]: r for r in kernel_table(trace, top=5, peaks=peaks).rows}  # no ep_size
    assert "bytes_per_step" not in unknown["_combine_kernel"] and "bytes_per_step" in unknown["_invert_kernel"]
