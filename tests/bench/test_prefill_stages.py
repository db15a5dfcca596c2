"""Stage attribution of profiler traces (``bench/prefill_stages.py``): synthetic Chrome traces with known answers,
and one real trace of the stage markers profiled on the CPU."""

import json
import warnings

import pytest
import torch

from bench.prefill_stages import (
    OP_STAGE, NoStageRangesError, format_stage_table, gpu_busy_ms_per_step, has_device_events, main,
    stage_ms_per_step,
)
from minidi.model import stages
from minidi.runtime.flops import CATEGORIES

A, B = (1, 10), (1, 20)  # (pid, tid) of two CPU threads
GPU = (0, 7)  # device 0, stream 7


def _x(cat, name, thread, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": thread[0], "tid": thread[1], "ts": ts, "dur": dur,
            "args": args}


def _range(name, thread, ts, dur):
    return _x("user_annotation", name, thread, ts, dur)


def _launch(corr, thread, ts, cat="cuda_runtime"):
    return _x(cat, "cudaLaunchKernel" if cat == "cuda_runtime" else "cuLaunchKernel", thread, ts, 3, correlation=corr)


def _device(corr, dur, cat="kernel"):
    # device work runs long after its launch, outside every CPU range: only the launch time may decide
    return _x(cat, f"k{corr}", GPU, 10_000 + corr * 100, dur, correlation=corr)


def _one_step_ranges():
    """One step on thread A: attention (with its core and the indexer inside), then the MoE (with its exchange)."""
    return [
        _range("minidi/step", A, 0, 1000),
        _range("minidi/attn", A, 100, 300),
        _range("minidi/attn.core", A, 200, 100),
        _range("minidi/indexer", A, 320, 60),
        _range("minidi/moe", A, 500, 400),
        _range("minidi/moe.comm", A, 600, 100),
    ]


def _cuda_trace():
    ranges = [
        *_one_step_ranges(),
        _x("gpu_user_annotation", "minidi/attn.core", GPU, 10_000, 5_000),  # GPU-side copy of a range: ignored
    ]
    launches = [
        _launch(1, A, 50),  # in the step, outside every stage
        _launch(2, A, 150),  # attn only
        _launch(3, A, 250),  # attn.core inside attn: innermost wins
        _launch(4, A, 260, cat="cuda_runtime"),  # a memcpy in attn.core
        _launch(5, A, 330, cat="cuda_driver"),  # a Triton launch (driver API) in the indexer
        _launch(6, A, 550),  # moe
        _launch(7, A, 650),  # moe.comm inside moe
        _launch(8, A, 1100),  # after the step
        _launch(9, B, 250),  # another thread, while thread A is inside attn.core
    ]
    device = [
        _device(1, 7), _device(2, 11), _device(3, 13), _device(4, 2, "gpu_memcpy"), _device(5, 17), _device(6, 19),
        _device(7, 3, "gpu_memset"), _device(8, 5), _device(9, 23),
        _device(10, 1),  # its launch is not in the trace
    ]
    flows = [{"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 3, "pid": 1, "tid": 10, "ts": 250}]
    return {"traceEvents": ranges + launches + device + flows}


def _ms(us, steps=2):
    return us / 1e3 / steps


def test_cuda_attribution_exact():
    got = stage_ms_per_step(_cuda_trace(), steps=2, cuda=True)
    assert list(got) == list(CATEGORIES)
    want = {"sparse_attention_core": 13 + 2, "other_attention": 11, "indexer": 17, "moe": 19, "communication": 3,
            "hc_norm_other": 7 + 5 + 23 + 1}
    assert got == pytest.approx({k: _ms(v) for k, v in want.items()})
    assert gpu_busy_ms_per_step(_cuda_trace(), 2) == pytest.approx(_ms(7 + 11 + 13 + 2 + 17 + 19 + 3 + 5 + 23 + 1))
    assert sum(got.values()) == pytest.approx(gpu_busy_ms_per_step(_cuda_trace(), 2))


def test_a_minidi_op_call_is_a_range_of_its_own_stage():
    """Kernels launched by one of minidi's ops belong to the op's stage even where the compiler placed the call inside
    another stage's markers (H200: the indexer's kernels inside attn.core, the MoE's inside moe.comm); kernels
    launched next to the op call stay with the markers."""
    trace = _cuda_trace()
    trace["traceEvents"] += [
        _x("cpu_op", "minidi::topk_indices", A, 270, 15),  # the indexer's op, called inside attn.core
        _x("cpu_op", "minidi::hc_expand", A, 670, 20),  # an mHC op inside moe.comm: "other"
        _x("cpu_op", "minidi::rotated_blocks", A, 520, 10),  # the exchange's op, called in moe
        _x("cpu_op", "aten::mm", A, 560, 5),  # not minidi's: the markers decide
        _launch(11, A, 275), _launch(12, A, 675), _launch(13, A, 525), _launch(14, A, 562),
        _device(11, 29), _device(12, 31), _device(13, 37), _device(14, 41),
    ]
    got = stage_ms_per_step(trace, steps=2, cuda=True)
    want = {"sparse_attention_core": 13 + 2, "other_attention": 11, "indexer": 17 + 29, "moe": 19 + 41,
            "communication": 3 + 37, "hc_norm_other": 7 + 5 + 23 + 1 + 31}
    assert got == pytest.approx({k: _ms(v) for k, v in want.items()})


def test_every_minidi_op_has_a_stage_or_is_left_to_the_markers():
    """A new op must say which stage its kernels belong to (or None: "other"); gate_tf32x3 serves the MoE gate and the
    mHC mixers, fp8_linear every FP8 linear (attention, indexer, shared expert, Engram), fq8 the inputs those share
    (attention, shared expert; the query latent of attention and indexer), and the markers themselves are ops: these
    are left to the markers."""
    import importlib
    import pkgutil

    import minidi.ops
    import minidi.runtime.expert_parallel  # noqa: F401 (registers rotated_blocks)

    for mod in pkgutil.iter_modules(minidi.ops.__path__):
        importlib.import_module(f"minidi.ops.{mod.name}")
    registered = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("minidi::")}
    left_to_markers = {"minidi::gate_tf32x3", "minidi::stage_mark", "minidi::fp8_linear", "minidi::fp8_linear_ref",
                       "minidi::fq8", "minidi::fq8_ref"}
    assert registered - left_to_markers == set(OP_STAGE), sorted(registered - left_to_markers ^ set(OP_STAGE))
    assert {v for v in OP_STAGE.values() if v is not None} <= set(stages.STAGES)


def test_cuda_attribution_follows_the_launching_thread():
    """Moving launch 9 onto thread A (inside attn.core) must move its 23 us; a check that would miss this could not
    tell per-thread attribution from a time-only one."""
    trace = _cuda_trace()
    for e in trace["traceEvents"]:
        if e["cat"] == "cuda_runtime" and e["args"]["correlation"] == 9:
            e["tid"] = A[1]
    got = stage_ms_per_step(trace, steps=2, cuda=True)
    assert got["sparse_attention_core"] == pytest.approx(_ms(13 + 2 + 23))
    assert got["hc_norm_other"] == pytest.approx(_ms(7 + 5 + 1))
    base = stage_ms_per_step(_cuda_trace(), steps=2, cuda=True)
    assert got != pytest.approx(base)


def test_cuda_range_boundaries_and_unsorted_events():
    trace = _cuda_trace()
    trace["traceEvents"].reverse()  # order in the file must not matter
    for e in trace["traceEvents"]:  # a launch exactly at the end of attn.core still belongs to it
        if e["cat"] == "cuda_runtime" and e["args"]["correlation"] == 3:
            e["ts"] = 300
    got = stage_ms_per_step(trace, steps=1, cuda=True)
    assert got["sparse_attention_core"] == pytest.approx((13 + 2) / 1e3)
    assert got["other_attention"] == pytest.approx(11 / 1e3)


def test_cuda_without_device_events_is_an_error():
    trace = {"traceEvents": [_range("minidi/attn", A, 0, 10)]}
    assert not has_device_events(trace)
    with pytest.raises(ValueError, match="ProfilerActivity.CUDA"):
        stage_ms_per_step(trace, steps=1, cuda=True)


def _cpu_trace():
    return {"traceEvents": [
        *_one_step_ranges(),
        _range("minidi/step", A, 2000, 600),
        _range("minidi/attn", A, 2100, 100),
        _range("minidi/moe", A, 3000, 500),  # outside every step range: ignored
        _x("cpu_op", "aten::mm", A, 210, 50),
    ]}


def test_cpu_attribution_exclusive_times():
    got = stage_ms_per_step(_cpu_trace(), steps=2, cuda=False)
    want = {"sparse_attention_core": 100, "other_attention": (300 - 100 - 60) + 100, "indexer": 60,
            "moe": 400 - 100, "communication": 100}
    want["hc_norm_other"] = 1000 + 600 - sum(want.values())
    assert got == pytest.approx({k: _ms(v) for k, v in want.items()})
    assert sum(got.values()) == pytest.approx(_ms(1600))  # the step ranges, split without overlap


def test_cpu_without_step_range_warns_and_reports_no_other():
    trace = {"traceEvents": [e for e in _cpu_trace()["traceEvents"] if e["name"] != "minidi/step"]}
    with pytest.warns(UserWarning, match="minidi/step"):
        got = stage_ms_per_step(trace, steps=1, cuda=False)
    assert got["hc_norm_other"] == 0.0
    assert got["moe"] == pytest.approx((300 + 500) / 1e3)


def test_no_stage_ranges_is_a_clear_error(tmp_path, capsys):
    trace = {"traceEvents": [_range("minidi/step", A, 0, 10), _x("cpu_op", "aten::mm", A, 1, 5)]}
    with pytest.raises(NoStageRangesError, match=r"stages\.enabled\(True\)"):
        stage_ms_per_step(trace, steps=1, cuda=False)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert main([str(path), "--steps", "1"]) == 2
    assert "stages.enabled(True)" in capsys.readouterr().err


def test_bad_steps():
    with pytest.raises(ValueError, match="steps"):
        stage_ms_per_step(_cpu_trace(), steps=0, cuda=False)


def test_format_stage_table():
    table = format_stage_table({"sparse_attention_core": 1.0, "other_attention": 3.0, "indexer": 0.0},
                               gpu_busy_ms=4.5, wall_ms=5.0)
    lines = table.splitlines()
    assert lines[0].split() == ["category", "ms/step", "%", "of", "sum"]
    assert lines[1].split() == ["sparse_attention_core", "1.000", "25.0"]
    assert lines[2].split() == ["other_attention", "3.000", "75.0"]
    assert lines[3].split() == ["indexer", "0.000", "0.0"]
    assert lines[4].split() == ["sum", "4.000", "100.0"]
    assert lines[5].split()[-1] == "4.500" and lines[6].split()[-1] == "5.000"
    assert len({len(line) for line in lines[:5]}) == 1  # fixed width


@pytest.fixture
def markers_on():
    prev = stages.enabled()
    stages.enabled(True)
    try:
        yield
    finally:
        stages.enabled(prev)


def test_real_cpu_profile(markers_on, tmp_path, capsys):
    """The markers profiled for real: attn (with a nested attn.core) gets time, and the six parts add up to the
    step range."""
    x = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))

    def step(x):
        with torch.profiler.record_function("minidi/step"):
            x = x * 2  # "other"
            stages.enter("attn", x)
            for _ in range(3):
                x = torch.tanh(x @ x / 192)
            stages.enter("attn.core", x)
            x = torch.softmax(x @ x, dim=-1)
            stages.exit("attn.core", x)
            stages.exit("attn", x)
        return x

    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step(x)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step range is there: no warning
        got = stage_ms_per_step(path, steps=2, cuda=False)
    assert got["other_attention"] > 0 and got["sparse_attention_core"] > 0
    assert got["indexer"] == got["moe"] == got["communication"] == 0.0
    events = json.loads(path.read_text())["traceEvents"]
    step_ms = sum(e["dur"] for e in events if e.get("name") == "minidi/step") / 1e3 / 2
    assert sum(got.values()) == pytest.approx(step_ms)
    assert main([str(path), "--steps", "2"]) == 0
    assert "other_attention" in capsys.readouterr().out


def test_each_step_and_median_cpu():
    """One table per step range; each adds up to its own step; the median per category ignores one stalled step."""
    from bench.prefill_stages import median_table, stage_ms_each_step

    trace = _cpu_trace()
    tables = stage_ms_each_step(trace, cuda=False)
    assert [sum(t.values()) for t in tables] == pytest.approx([1.0, 0.6])  # the two step ranges, in time order
    assert tables[1]["other_attention"] == pytest.approx(0.1) and tables[1]["moe"] == 0.0
    assert tables[0] == pytest.approx(stage_ms_per_step({"traceEvents": _cpu_trace()["traceEvents"][:6]}, 1, False))
    stalled = [{"moe": 1.0, "indexer": 2.0}, {"moe": 9.0, "indexer": 2.0}, {"moe": 1.2, "indexer": 2.2}]
    assert median_table(stalled) == {"moe": 1.2, "indexer": 2.0}
    with pytest.raises(ValueError, match="no stage tables"):
        median_table([])


def test_each_step_cuda_by_launch_time():
    """CUDA: a step's table holds the device events launched inside its range (launch 8 is after the step)."""
    from bench.prefill_stages import stage_ms_each_step

    (table,) = stage_ms_each_step(_cuda_trace(), cuda=True)
    whole = stage_ms_per_step(_cuda_trace(), steps=1, cuda=True)
    assert table["hc_norm_other"] == pytest.approx(whole["hc_norm_other"] - (5 + 1) / 1e3)  # launch 8, no launch
    assert {k: v for k, v in table.items() if k != "hc_norm_other"} == pytest.approx(
        {k: v for k, v in whole.items() if k != "hc_norm_other"})


def test_each_step_needs_step_ranges():
    from bench.prefill_stages import stage_ms_each_step

    trace = {"traceEvents": [e for e in _cpu_trace()["traceEvents"] if e["name"] != "minidi/step"]}
    with pytest.raises(ValueError, match="minidi/step"):
        stage_ms_each_step(trace, cuda=False)
