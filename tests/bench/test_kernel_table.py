"""The kernel table (``bench/kernel_table.py``, ``bench/op_work.py``): synthetic Chrome traces with known answers
(ranking, calls per step, % of the step, rates and % of peak from known FLOPs / bytes, unknowns left out, names),
the work of single op calls, and one real CPU profile."""

import gzip
import json

import pytest
import torch

from bench.kernel_table import (
    annotate_flops, format_kernel_table, kernel_table, load_trace, main, profiler_flops, short_names, shorten,
)
from bench.op_work import call_work, op_work, out_positions

A = (1, 10)  # (pid, tid) of the CPU thread
GPU = (0, 7)


def _x(cat, name, thread, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": thread[0], "tid": thread[1], "ts": ts, "dur": dur,
            "args": args}


def _step(ts, dur):
    return _x("user_annotation", "minidi/step", A, ts, dur)


def _op(name, ts, dur, dims=None, types=None, strides=None, **args):
    if dims is not None:
        args.update({"Input Dims": dims, "Input type": types})
        if strides is not None:
            args["Input Strides"] = strides
    return _x("cpu_op", name, A, ts, dur, **args)


def _copy(ts, dur, n=1000, src="c10::BFloat16"):
    return _op("aten::copy_", ts, dur, [[n], [n], []], ["float", src, "Scalar"])


def _cpu_trace():
    """Two steps (1000 and 600 us). Step 1: linear (40 us of its own) around a view and a 250 us mm; a 100 us copy;
    a 50 us cat. Step 2: a 200 us mm, a 50 us copy, a 20 us add. One mm outside the steps."""
    mm = {"dims": [[64, 128], [128, 32]], "types": ["float", "float"]}
    return {"traceEvents": [
        _step(0, 1000), _step(2000, 600),
        _op("aten::linear", 100, 300), _op("aten::t", 110, 10, [[32, 128]], ["float"]),
        _op("aten::mm", 130, 250, flops=2e6, **mm),
        _copy(500, 100),
        _op("aten::cat", 700, 50, [[[8], [8]], []], ["TensorList", "Scalar"]),
        _op("aten::mm", 2100, 200, flops=2e6, **mm),
        _copy(2400, 50),
        _op("aten::add", 2500, 20, [[1000], [1000], []], ["float", "float", "Scalar"]),
        _op("aten::mm", 5000, 1000, flops=2e6, **mm),  # outside every step: not counted
        {"ph": "i", "name": "an instant event", "ts": 1},  # not a complete event: ignored
    ]}


PEAKS = {"bf16_tflops": 0.01, "copy_gbps": 0.1}


def test_cpu_ranking_calls_time_and_rates():
    t = kernel_table(_cpu_trace(), top=3, peaks=PEAKS)
    assert t.basis == "cpu op self time" and t.steps == 2
    assert t.step_ms == pytest.approx(0.8)  # the mean step range
    assert [r["name"] for r in t.rows] == ["aten::mm", "aten::copy_", "aten::cat"]  # by total self time
    mm, copy, cat = t.rows
    assert (mm["calls_per_step"], mm["ms_per_step"]) == (1.0, pytest.approx(0.225))  # (250 + 200) us / 2 steps
    assert mm["pct_step"] == pytest.approx(28.12, abs=0.01)
    assert mm["flops_per_step"] == 2_000_000
    assert mm["tflops"] == pytest.approx(2e6 / 0.225e-3 / 1e12, rel=1e-3)
    assert mm["pct_peak"] == pytest.approx(100 * mm["tflops"] / 0.01, rel=1e-3)
    assert "bytes_per_step" not in mm and "gbps" not in mm
    assert copy["bytes_per_step"] == 1000 * 4 + 1000 * 2  # fp32 destination written, bf16 source read
    assert copy["gbps"] == pytest.approx(6000 / 0.075e-3 / 1e9, rel=1e-3)
    assert copy["pct_peak"] == pytest.approx(80.0, rel=1e-3)
    assert cat["ms_per_step"] == pytest.approx(0.025) and cat["calls_per_step"] == 0.5
    assert not {"flops_per_step", "bytes_per_step", "tflops", "gbps", "pct_peak"} & set(cat)  # unknown: left out
    assert t.distinct == 6  # linear, t, mm, copy_, cat, add
    # every op's self time, the linear's 300 us less its children's 260
    assert t.all_ms_per_step == pytest.approx((40 + 10 + 450 + 150 + 50 + 20) / 2 / 1e3)


def test_cpu_self_time_and_composites():
    rows = {r["name"]: r for r in kernel_table(_cpu_trace(), top=10).rows}
    assert rows["aten::linear"]["ms_per_step"] == pytest.approx(0.02)  # 300 - 10 - 250 us, over 2 steps
    assert "flops_per_step" not in rows["aten::linear"]
    assert rows["aten::add"]["bytes_per_step"] == 6000  # 12,000 B in one call, over 2 steps
    assert rows["aten::add"]["calls_per_step"] == 0.5
    assert "pct_peak" not in rows["aten::mm"] and rows["aten::mm"]["tflops"] > 0  # no peaks given: no %


def test_one_unknown_call_makes_the_row_unknown():
    trace = _cpu_trace()
    trace["traceEvents"].append(_copy(2470, 10, src="TensorList"))  # a copy the trace cannot size
    copy = next(r for r in kernel_table(trace, top=10, peaks=PEAKS).rows if r["name"] == "aten::copy_")
    assert copy["calls_per_step"] == 1.5
    assert not {"bytes_per_step", "gbps", "pct_peak"} & set(copy)


def test_pct_of_the_step_sums_to_at_most_the_step():
    t = kernel_table(_cpu_trace(), top=50)
    assert sum(r["pct_step"] for r in t.rows) == pytest.approx(100 * t.all_ms_per_step / t.step_ms, abs=0.05)
    assert sum(r["pct_step"] for r in t.rows) < 100


def test_needs_step_ranges_and_a_positive_top():
    trace = {"traceEvents": [e for e in _cpu_trace()["traceEvents"] if e.get("name") != "minidi/step"]}
    with pytest.raises(ValueError, match="minidi/step"):
        kernel_table(trace, top=5)
    with pytest.raises(ValueError, match="top"):
        kernel_table(_cpu_trace(), top=0)
    with pytest.raises(ValueError, match="ep_size"):
        kernel_table(_cpu_trace(), top=5, ep_size=0)


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
EW = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
      "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(c10"
      "::BFloat16)#1}>(at::TensorIteratorBase&, {lambda(c10::BFloat16)#1} const&)::{lambda(int)#1}>(int, "
      "{lambda(int)#1})")


def _launch(corr, ts, cat="cuda_runtime"):
    return _x(cat, "cudaLaunchKernel" if cat == "cuda_runtime" else "cuLaunchKernel", A, ts, 3, correlation=corr)


def _kernel(corr, name, dur, cat="kernel"):
    return _x(cat, name, GPU, 10_000 + 100 * corr, dur, correlation=corr)  # device time: long after the launch


def _cuda_trace():
    n = 1 << 20
    return {"traceEvents": [
        _step(0, 1000),
        _op("aten::mm", 100, 100, [[256, 4096], [4096, 2048]], ["c10::BFloat16"] * 2, flops=4e9), _launch(1, 150),
        _op("aten::copy_", 300, 100, [[n], [n], []], ["c10::BFloat16", "c10::BFloat16", "Scalar"]), _launch(2, 350),
        _op("minidi::two_kernels", 500, 100), _launch(3, 520), _launch(4, 560),
        _op("triton_poi_fused_add_0", 700, 20, kernel_num_gb=0.002, kernel_backend="triton"),
        _launch(5, 710, cat="cuda_driver"),
        _launch(6, 800),  # outside every op
        _launch(7, 1100),  # after the step: not counted
        _kernel(1, GEMM, 40), _kernel(2, EW, 10), _kernel(3, "k_a", 5), _kernel(4, "k_b", 5),
        _kernel(5, "triton_poi_fused_add_0", 2), _kernel(6, "Memcpy HtoD (Pageable -> Device)", 8, "gpu_memcpy"),
        _kernel(7, GEMM, 1000),
    ]}


def test_cuda_kernels_take_the_work_of_the_op_that_launched_them_alone():
    t = kernel_table(_cuda_trace(), top=10, peaks={"bf16_tflops": 1000.0, "copy_gbps": 4000.0})
    assert t.basis == "cuda device events" and t.steps == 1
    rows = {r.get("full_name", r["name"]): r for r in t.rows}
    assert list(rows) == [GEMM, EW, "Memcpy HtoD (Pageable -> Device)", "k_a", "k_b", "triton_poi_fused_add_0"]
    gemm, ew, triton = rows[GEMM], rows[EW], rows["triton_poi_fused_add_0"]
    assert (gemm["calls_per_step"], gemm["ms_per_step"], gemm["flops_per_step"]) == (1.0, 0.04, 4_000_000_000)
    assert gemm["tflops"] == pytest.approx(100.0) and gemm["pct_peak"] == pytest.approx(10.0)
    assert ew["bytes_per_step"] == 2 * 2 * (1 << 20) and ew["gbps"] == pytest.approx(419.4, rel=1e-3)
    assert ew["pct_peak"] == pytest.approx(10.49, rel=1e-3)
    assert triton["bytes_per_step"] == 2_000_000 and triton["gbps"] == pytest.approx(1000.0)  # Inductor's own count
    assert not {"flops_per_step", "bytes_per_step"} & (set(rows["k_a"]) | set(rows["k_b"]))  # one op, two kernels
    assert "bytes_per_step" not in rows["Memcpy HtoD (Pageable -> Device)"]  # launched outside every op
    # the step on the device: from the first kernel's start to the last one's end (launch 7 is after the step)
    assert t.step_ms == pytest.approx((10_000 + 600 + 8 - 10_100) / 1e3)
    assert t.all_ms_per_step == pytest.approx((40 + 10 + 5 + 5 + 2 + 8) / 1e3)
    assert sum(r["pct_step"] for r in t.rows) <= 100


def test_a_matmul_with_a_workspace_memset_gives_its_flops_to_its_gemm():
    """cuBLAS clears a workspace (a device memset) before some GEMMs: the mm's FLOPs go to its one GEMM kernel, the
    memset gets none; an op that is no matmul, or a matmul with two GEMM kernels, stays unknown."""
    mm = {"dims": [[4096, 1280], [1280, 32768]], "types": ["c10::BFloat16"] * 2, "flops": 2 * 4096 * 1280 * 32768}
    trace = {"traceEvents": [
        _step(0, 2000),
        _op("aten::mm", 100, 100, **mm), _launch(1, 120), _launch(2, 150),
        _op("aten::copy_", 300, 100, [[64], [64], []], ["float", "float", "Scalar"]), _launch(3, 320), _launch(4, 350),
        _op("aten::bmm", 500, 100, **mm), _launch(5, 510), _launch(6, 520), _launch(7, 530),
        _kernel(1, "Memset (Device)", 1, "gpu_memset"), _kernel(2, GEMM, 100),
        _kernel(3, "Memset (Device)", 1, "gpu_memset"), _kernel(4, EW, 10),
        _kernel(5, "Memset (Device)", 1, "gpu_memset"), _kernel(6, "gemm_a", 50), _kernel(7, "gemm_b", 50),
    ]}
    rows = {r.get("full_name", r["name"]): r for r in kernel_table(trace, top=10, peaks=PEAKS).rows}
    assert rows[GEMM]["flops_per_step"] == mm["flops"]
    assert not {"flops_per_step", "bytes_per_step"} & set(rows["Memset (Device)"])
    assert not {"flops_per_step", "bytes_per_step"} & (set(rows[EW]) | set(rows["gemm_a"]) | set(rows["gemm_b"]))


def test_model_flops_go_to_the_heaviest_kernel_of_their_term_without_counted_flops():
    """An op's two kernels (k_a 5 us, k_b 5 us: the name breaks the tie) carry no FLOPs in the trace; the model's
    count gives the term to the heaviest one present, marked; a term whose kernels are absent, or a row that has its
    own FLOPs, is left alone."""
    trace = _cuda_trace()
    trace["traceEvents"] += [_launch(8, 600), _kernel(8, "k_a", 5)]  # k_a: 2 calls, 10 us
    model = {"t1": (("k_b", "k_a", "k_absent"), 3e9), "t2": (("k_nowhere",), 1e9), "t3": ((GEMM,), 9e9)}
    t = kernel_table(trace, top=10, peaks={"bf16_tflops": 1000.0, "copy_gbps": 4000.0}, model_flops=model)
    rows = {r.get("full_name", r["name"]): r for r in t.rows}
    ka = rows["k_a"]
    assert (ka["flops_per_step"], ka["flops_from"]) == (3_000_000_000, "model: t1")
    assert ka["tflops"] == pytest.approx(300.0) and ka["pct_peak"] == pytest.approx(30.0)  # 3 GFLOP in 10 us
    assert "flops_per_step" not in rows["k_b"]
    assert rows[GEMM]["flops_per_step"] == 4_000_000_000 and "flops_from" not in rows[GEMM]  # the trace's own
    text = format_kernel_table(t.rows, t.summary(), {"bf16_tflops": 1000.0, "copy_gbps": 4000.0})
    assert "3*" in text and "the model's FLOPs" in text


def test_model_flops_of_the_v41_step_name_its_kernels():
    from bench.model_work import kernel_model_flops
    from minidi.model.presets import preset
    from minidi.runtime.flops import step_flops

    cfg = preset("v41-flash")
    got = kernel_model_flops(cfg, 4096, 126976)
    assert set(got) == {"moe.routed", "attn.core", "indexer.score (every visible key)",
                        "indexer.score (candidate blocks)"}
    assert "_fp8_fp4_grouped_mm_sm90" in got["moe.routed"][0] and "_candidate_score_kernel" in got[
        "indexer.score (candidate blocks)"][0]
    total = step_flops(cfg, 4096, 126976)
    assert got["attn.core"][1] == total["sparse_attention_core"]
    assert sum(f for _, f in got.values()) < total["total"]
    scores = got["indexer.score (every visible key)"][1] + got["indexer.score (candidate blocks)"][1]
    assert scores < total["indexer"]


def test_rows_split_their_time_by_stage():
    """Each call goes to the category of the innermost stage range at its launch: a marker range, or the call of one
    of minidi's ops (its own stage wherever it was launched); launches outside every range are "other"."""
    trace = _cuda_trace()
    trace["traceEvents"] += [
        _x("user_annotation", "minidi/moe", A, 90, 500),  # holds launches 1 (GEMM), 2, 3, 4
        _x("user_annotation", "minidi/moe.comm", A, 140, 20),  # holds launch 1
        _op("minidi::topk_indices", 540, 40),  # an indexer op inside the moe range: holds launch 4
        _launch(8, 950), _kernel(8, GEMM, 60),  # outside every range
    ]
    t = kernel_table(trace, top=10)
    rows = {r.get("full_name", r["name"]): r for r in t.rows}
    assert rows[GEMM]["stages_ms"] == {"hc_norm_other": 0.06, "communication": 0.04}
    assert rows[EW]["stages_ms"] == {"moe": 0.01}
    assert rows["k_a"]["stages_ms"] == {"moe": 0.005} and rows["k_b"]["stages_ms"] == {"indexer": 0.005}
    assert rows["triton_poi_fused_add_0"]["stages_ms"] == {"hc_norm_other": 0.002}
    assert all(sum(r["stages_ms"].values()) == pytest.approx(r["ms_per_step"]) for r in t.rows)


BF16 = "c10::BFloat16"


def _minidi_trace():
    """_cuda_trace plus two minidi ops (``bench/minidi_work.py``): hc_expand launching its kernel; moe_combine launching
    its two kernels and one the declaration does not name."""
    t, n, d, r, k = 16, 4, 4096, 96, 6
    trace = _cuda_trace()
    trace["traceEvents"] += [
        _op("minidi::hc_expand", 605, 30, [[t, n, d], [t, d], [t, n], [t, n, n]], [BF16, BF16, "float", "float"]),
        _launch(8, 610, "cuda_driver"), _kernel(8, "_hc_expand_kernel", 4),
        _op("minidi::moe_combine", 640, 50, [[r, d], [r], [r], []], [BF16, "long int", "bool", "Scalar"],
            **{"Concrete Inputs": ["", "", "", str(k)]}),
        _launch(9, 645, "cuda_driver"), _launch(10, 650, "cuda_driver"), _launch(11, 655, "cuda_driver"),
        _kernel(9, "_invert_kernel", 1), _kernel(10, "_combine_kernel", 2), _kernel(11, "k_c", 1),
    ]
    return trace


def test_minidi_ops_declare_their_kernels_work():
    """Each kernel of a declared minidi op gets its declared bytes, rate and % of the copy peak, whatever else the op
    launched; an undeclared kernel of such an op stays unknown; the MoE kernel that moves only the local rows needs
    ``ep_size`` (4: the model's quarter of the rows, marked)."""
    t, n, d, r, k = 16, 4, 4096, 96, 6
    peaks = {"bf16_tflops": 1000.0, "copy_gbps": 4000.0}
    rows = {r_["name"]: r_ for r_ in kernel_table(_minidi_trace(), top=20, peaks=peaks, ep_size=4).rows}
    expand = rows["_hc_expand_kernel"]
    assert expand["bytes_per_step"] == 2 * t * n * d * 2 + t * d * 2 + t * n * 4 + t * n * n * 4
    assert expand["gbps"] == pytest.approx(expand["bytes_per_step"] / 4e-6 / 1e9, rel=1e-3)
    assert expand["pct_peak"] == pytest.approx(100 * expand["gbps"] / 4000.0, rel=1e-3)
    assert rows["_invert_kernel"]["bytes_per_step"] == r * (8 + 1 + 4) and "bytes_from" not in rows["_invert_kernel"]
    combine = rows["_combine_kernel"]
    assert combine["bytes_per_step"] == r * 4 + r // 4 * d * 2 + r // k * d * 4
    assert combine["bytes_from"] == "model: uniform expert load, 1/4 of the routed rows local"
    assert not {"bytes_per_step", "flops_per_step"} & set(rows["k_c"])
    assert not {"bytes_per_step", "flops_per_step"} & set(rows["k_a"])  # an undeclared op's two kernels: as before
    every = {r_["name"]: r_ for r_ in kernel_table(_minidi_trace(), top=20, ep_size=1).rows}
    assert every["_combine_kernel"]["bytes_per_step"] == r * 4 + r * d * 2 + r // k * d * 4
    assert "bytes_from" not in every["_combine_kernel"]
    unknown = {r_["name"]: r_ for r_ in kernel_table(_minidi_trace(), top=20).rows}  # no ep_size
    assert "bytes_per_step" not in unknown["_combine_kernel"] and "bytes_per_step" in unknown["_invert_kernel"]
    text = format_kernel_table(list(rows.values()), kernel_table(_minidi_trace(), top=20).summary(), peaks)
    line = next(ln for ln in text.splitlines() if ln.startswith("_combine_kernel"))
    assert f"{combine['bytes_per_step'] / 1e6:.4g}*" in line and "rows (bytes_from)" in text


def test_a_kernel_launched_twice_in_one_call_takes_half_each():
    from bench.minidi_work import kernel_work, op_kernels

    fq8 = _op("minidi::fq8", 0, 1, [[8, 64], []], [BF16, "Scalar"], **{"Concrete Inputs": ["", "32"]})
    assert op_kernels(fq8, cuda=True) == {"_fq8_kernel": (2 * 8 * 64 * 2, None, None)}
    assert kernel_work(fq8, "_fq8_kernel", 2, cuda=True) == (None, 8 * 64 * 2, None)
    assert kernel_work(fq8, "_other_kernel", 1, cuda=True) == (None, None, None)


def test_cli_takes_the_runs_expert_parallelism(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_minidi_trace()))
    assert main([str(path), "--ep", "4", "--copy_gbps", "4000"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("_combine_kernel"))
    assert "*" in line


def test_cuda_host_copies_get_no_pct_of_the_device_peak():
    trace = _cuda_trace()
    ev = trace["traceEvents"]
    ev.append(_op("aten::copy_", 790, 20, [[1000], [1000], []], ["float", "float", "Scalar"]))  # launches 6
    row = next(r for r in kernel_table(trace, top=10, peaks={"copy_gbps": 4000.0}).rows if r["name"].startswith("Mem"))
    assert row["bytes_per_step"] == 8000 and row["gbps"] == pytest.approx(1.0) and "pct_peak" not in row


def test_cuda_kernels_of_composite_ops():
    """An op that calls a copy and launches a kernel itself: a matmul keeps its FLOPs (it copied an operand first),
    an elementwise op's bytes are unknown (its copy may be part of them); the copy keeps its own bytes."""
    trace = _cuda_trace()
    for e in trace["traceEvents"]:
        if e["name"] == "aten::mm":
            e["dur"] = 300  # now holds the copy_ op: it calls a copy and launches the gemm
    rows = {r.get("full_name", r["name"]): r for r in kernel_table(trace, top=10).rows}
    assert rows[GEMM]["flops_per_step"] == 4_000_000_000
    assert rows[EW]["bytes_per_step"] == 4 * (1 << 20)  # the copy, innermost around its launch
    for e in trace["traceEvents"]:
        if e["name"] == "aten::mm":
            e["name"], e["args"] = "aten::add", {"Input Dims": [[256], [256], []], "Input type": ["float"] * 2 + [
                "Scalar"]}
    rows = {r.get("full_name", r["name"]): r for r in kernel_table(trace, top=10).rows}
    assert not {"flops_per_step", "bytes_per_step"} & set(rows[GEMM])
    assert rows[EW]["bytes_per_step"] == 4 * (1 << 20)


def test_auto_detects_device_events_and_cpu_basis_can_be_forced():
    assert kernel_table(_cuda_trace(), top=3).basis == "cuda device events"
    cpu = kernel_table(_cuda_trace(), top=3, cuda=False)  # three ops of 100 us: ties in name order
    assert cpu.basis == "cpu op self time"
    assert [r["name"] for r in cpu.rows] == ["aten::copy_", "aten::mm", "minidi::two_kernels"]


# ---- names -------------------------------------------------------------------------------------------------------
VEC_ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
           "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")


def test_shorten_keeps_short_names_and_trims_signatures():
    for name in ("aten::mm", "triton_poi_fused_cat_roll_3", "Memcpy DtoD (Device -> Device)", GEMM[:64]):
        assert shorten(name) == name
    s = shorten(VEC_ADD)
    assert s.startswith("vectorized_elementwise_kernel<CUDAFunctor_add<BFloat16>, ")  # no block size / width
    assert "void" not in s and "at::" not in s and "(int" not in s and len(s) <= 64 and s.endswith("...")
    assert shorten(EW).startswith("elementwise_kernel<gpu_kernel_impl_nocast<direct_copy_kernel_")  # no lambdas
    assert shorten("void k<float, 4>(float*, int)") == "k<float>"
    assert shorten(GEMM, max_len=20) == GEMM[:17] + "..."


def test_short_names_are_unambiguous_and_stable():
    mul = VEC_ADD.replace("CUDAFunctor_add", "CUDAFunctor_mul")
    long_a, long_b = "k_" + "x" * 80 + "_a", "k_" + "x" * 80 + "_b"  # differ only past the cut
    names = [VEC_ADD, mul, long_a, long_b, "aten::mm"]
    got = short_names(names)
    assert len(set(got.values())) == len(names)
    assert got["aten::mm"] == "aten::mm"
    assert got[long_a].startswith(shorten(long_a)) and " #" in got[long_a] and " #" in got[long_b]
    assert "mul" in got[mul] and "add" in got[VEC_ADD]
    assert short_names(list(reversed(names))) == got  # the same names whatever the order
    assert short_names(["aten::mm", "aten::bmm"]) == {"aten::mm": "aten::mm", "aten::bmm": "aten::bmm"}


def test_rows_of_shortened_names_carry_the_full_name():
    t = kernel_table(_cuda_trace(), top=10)
    ew = next(r for r in t.rows if r.get("full_name") == EW)
    assert ew["name"] == short_names([GEMM, EW, "k_a"])[EW]
    assert "full_name" not in next(r for r in t.rows if r["name"] == "k_a")


# ---- the work of one call ----------------------------------------------------------------------------------------
def _ev(name, dims, types, strides=None, **args):
    return _op(name, 0, 1, dims, types, strides, **args)


@pytest.mark.parametrize("event, want", [
    (_ev("aten::copy_", [[4, 8], [4, 8], []], ["float", "c10::BFloat16", "Scalar"]), 32 * 4 + 32 * 2),
    (_ev("aten::fill_", [[4, 8], []], ["c10::BFloat16", "Scalar"]), 64),
    (_ev("aten::add", [[4, 8], [8], []], ["float", "float", "Scalar"]), 128 + 32 + 128),  # broadcast read once
    (_ev("aten::add", [[4, 8], [4, 8], []], ["float", "float", "Scalar"], [[8, 1], [0, 1], []]), 128 + 32 + 128),
    (_ev("aten::mul", [[4, 8], [4, 8]], ["c10::BFloat16", "float"]), 64 + 128 + 128),  # promoted to fp32
    (_ev("aten::mul", [[4, 8], []], ["c10::BFloat16", "long int"]), 64 + 8 + 64),  # a wrapped number: no promotion
    (_ev("aten::mul_", [[4, 8], []], ["c10::BFloat16", "long int"]), 64 + 8 + 64),  # in place: self read + written
    (_ev("aten::abs", [[16], [0]], ["float", "float"]), 64 + 64),  # abs.out: out= gives the dtype, not the size
    (_ev("aten::eq", [[4], [4]], ["float", "float"]), 16 + 16 + 4),  # a bool output
    (_ev("aten::where", [[4], [4], []], ["bool", "c10::BFloat16", "Scalar"]), 4 + 8 + 8),
    (_ev("aten::bitwise_and", [[16], []], ["int", "Scalar"]), 64 + 64),
    (_ev("aten::sqrt", [[4]], ["long int"]), None),  # an integral input gives the default float dtype
    (_ev("aten::mul", [[4], []], ["int", "double"]), None),  # a 0-dim float could be a tensor or a wrapped number
    (_ev("aten::cat", [[[8], [8]], []], ["TensorList", "Scalar"]), None),  # not a copy-like / elementwise op
    (_ev("aten::add", [[8], [8], []], ["c10::SomeNewType", "float", "Scalar"]), None),  # a dtype not known here
    (_op("aten::add", 0, 1), None),  # shapes not recorded
])
def test_bytes_of_one_call(event, want):
    flops, nbytes = op_work(event)
    assert flops is None
    assert nbytes == want


def test_flops_of_one_call():
    mm = _ev("aten::mm", [[64, 128], [128, 32]], ["float", "float"], flops=524288.0)
    assert op_work(mm) == (524288.0, None)
    assert op_work(_ev("aten::mm", [[0, 128], [128, 32], [0, 32]], ["float"] * 3)) == (0.0, None)  # an empty expert
    assert op_work(_ev("aten::mm", [[64, 128], [128, 32]], ["float", "float"])) == (None, None)  # no count: unknown
    assert op_work(_ev("aten::mul", [[4], [4]], ["float", "float"], flops=4.0))[0] is None  # not a matmul
    assert op_work(_op("triton_tem_fused_mm_0", 0, 1, kernel_flop=8e9, kernel_num_gb=0.5)) == (8e9, 5e8)
    fp8 = ["c10::Float8_e4m3fn", "c10::Float8_e4m3fn", "float", "float", "", "", "ScalarType", "Scalar"]
    scaled = _ev("aten::_scaled_mm", [[4096, 1024], [1024, 32768], [4096, 8], [8, 256], [], [], [], []], fp8)
    assert op_work(scaled) == (2.0 * 4096 * 1024 * 32768, None)  # the FP8 route's cuBLAS GEMM: the profiler counts none


def test_call_work_of_composites():
    scalar_and = _ev("aten::bitwise_and", [[16], []], ["int", "Scalar"])
    assert call_work(scalar_and, []) == (None, 128)
    assert call_work(scalar_and, ["aten::bitwise_and"]) == (None, 0.0)  # the Tensor overload it calls does the work
    assert call_work(_ev("aten::fill_", [[16], []], ["float", "float"]), ["aten::copy_"]) == (None, 0.0)
    assert call_work(_ev("aten::add", [[4], [4], []], ["float", "float", "Scalar"]), ["aten::copy_"]) == (None, None)
    mm = _ev("aten::bmm", [[2, 4, 8], [2, 8, 4]], ["float", "float"], flops=512.0)
    assert call_work(mm, ["aten::contiguous"]) == (512.0, None)  # an operand copied first: the FLOPs are its own
    assert call_work(mm, ["aten::_some_inner_matmul"]) == (None, None)
    fp8 = ["c10::Float8_e4m3fn", "c10::Float8_e4m3fn", "float", "float"]
    scaled = _ev("aten::_scaled_mm", [[8, 512], [512, 256], [8, 4], [4, 2]], fp8)
    assert call_work(scaled, ["aten::clone"]) == (2.0 * 8 * 512 * 256, None)  # whatever it calls: its own FLOPs


def test_out_arguments_from_the_schemas():
    assert out_positions("aten::abs", (True, True)) == (1,)
    assert out_positions("aten::abs", (True,)) == ()
    assert out_positions("aten::add", (True, True, False)) == ()
    assert out_positions("aten::mm", (True, True, True)) == (2,)  # mm.out, not mm.dtype (its 3rd is a dtype)
    assert out_positions("aten::no_such_op", (True,)) is None


# ---- the profiler's own events -----------------------------------------------------------------------------------
def test_real_cpu_profile(tmp_path, capsys):
    """A real profile with shapes and FLOPs: the mm row carries the profiler's count (copied into the trace), the
    bf16 -> fp32 copy its bytes; the saved trace gives the same table from the command line."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 128, generator=gen), torch.randn(128, 32, generator=gen)
    x = torch.randn(1000, generator=gen).to(torch.bfloat16)
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, record_shapes=True, with_flops=True) as prof:
        for _ in range(2):
            with torch.profiler.record_function("minidi/step"):
                torch.mm(a, b)
                x.float()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    flops = profiler_flops(prof)
    assert sorted(flops.values()) == [2 * 64 * 128 * 32] * 2
    assert annotate_flops(trace["traceEvents"], flops) == 2
    t = kernel_table(trace, top=20, peaks={"bf16_tflops": 1.0, "copy_gbps": 1.0}, cuda=False)
    rows = {r["name"]: r for r in t.rows}
    assert t.steps == 2 and rows["aten::mm"]["calls_per_step"] == 1.0
    assert rows["aten::mm"]["flops_per_step"] == 2 * 64 * 128 * 32 and rows["aten::mm"]["tflops"] > 0
    assert rows["aten::copy_"]["bytes_per_step"] == 1000 * 4 + 1000 * 2
    assert "flops_per_step" not in rows["aten::_to_copy"] and "bytes_per_step" not in rows["aten::_to_copy"]
    assert 0 < sum(r["pct_step"] for r in t.rows) <= 100.01
    gz = tmp_path / "trace.json.gz"
    with gzip.open(gz, "wt") as f:
        json.dump(trace, f)
    assert load_trace(gz) == trace
    assert main([str(gz), "--top", "3", "--bf16_tflops", "1.0", "--copy_gbps", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "aten::mm" in out and "cpu op self time" in out
    peaks = {"bf16_tflops": 1.0, "copy_gbps": 1.0}
    top3 = kernel_table(trace, 3, peaks, cuda=False)
    assert out.strip() == format_kernel_table(top3.rows, top3.summary(), peaks).strip()


def test_cli_error_on_a_trace_without_steps(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_op("aten::mm", 0, 5)]}))
    assert main([str(path)]) == 2
    assert "minidi/step" in capsys.readouterr().err


def test_format_leaves_unknowns_empty():
    t = kernel_table(_cpu_trace(), top=3, peaks=PEAKS)
    lines = format_kernel_table(t.rows, t.summary(), PEAKS).splitlines()
    head = lines[2].split()
    assert head[:4] == ["name", "calls/step", "ms/step", "%"]
    mm, copy, cat = (line.split() for line in lines[3:6])
    assert mm[0] == "aten::mm" and len(mm) == 7  # name, calls, ms, %, GFLOP, TFLOP/s, % peak
    assert copy[0] == "aten::copy_" and len(copy) == 7  # name, calls, ms, %, MB, GB/s, % peak
    assert cat == ["aten::cat", "0.5", "0.0250", "3.12"]  # nothing else known
    assert "top 3 of 6 kernels" in lines[1] and "0.01 TFLOP/s" in lines[-1]


def test_inductor_launch_record_carries_its_byte_count(tmp_path):
    """Inductor opens a ``_RecordFunctionFast`` record named after each Triton kernel around its launch, with
    ``kernel_num_gb`` among its kwargs when ``benchmark_kernel`` was set at compile time: the exported trace keeps
    it as ``args.kernel_num_gb``, and the record's row gets those bytes (here on the CPU, without a launch)."""
    x = torch.randn(64, 128)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.profiler.record_function("minidi/step"):
            with torch._C._profiler._RecordFunctionFast("triton_poi_fused_add_0", (x,), {
                    "kernel_num_gb": 0.25, "kernel_backend": "triton"}):
                pass
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    (row,) = [r for r in kernel_table(load_trace(path), top=10).rows if r["name"] == "triton_poi_fused_add_0"]
    assert row["bytes_per_step"] == 250_000_000 and row["gbps"] > 0
