"""The host's top-level calls of a profiled step (bench/host_ops.py) on hand-made traces."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.host_ops import format_host_ops, host_ops, main


def _ev(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 0, "tid": tid}


def _step(ts: float, dur: float, tid: int = 1) -> dict:
    return _ev("minidi/step", ts, dur, cat="user_annotation", tid=tid)


def _trace() -> list[dict]:
    return [
        _step(0.0, 1000.0), _step(2000.0, 1000.0),
        _ev("minidi::op", 10.0, 100.0), _ev("aten::copy_", 20.0, 40.0),  # a call and one nested in it
        _ev("triton_poi_fused_0", 200.0, 50.0), _ev("triton_poi_fused_0", 250.0, 20.0),  # back to back
        _ev("minidi::op", 900.0, 300.0),  # runs past the step's end: counted to the end
        _ev("before", -50.0, 20.0), _ev("between steps", 1500.0, 100.0),  # outside every step
        _ev("other thread", 100.0, 500.0, tid=2),  # not the step's thread
        _ev("minidi::op", 2100.0, 200.0),  # step 2
        _ev("a kernel", 2100.0, 900.0, cat="kernel"),  # not a CPU op
    ]


def test_top_level_calls_per_step():
    h = host_ops(_trace(), top=5)
    assert (h["steps"], h["step_ms"]) == (2, 1.0)
    by = {r["name"]: r for r in h["ops"]}
    assert set(by) == {"minidi::op", "triton_poi_fused_0"}  # nested, outside and other-thread calls left out
    assert by["minidi::op"]["calls_per_step"] == 1.5  # 3 calls over 2 steps
    assert by["minidi::op"]["ms_per_step"] == pytest.approx((100 + 100 + 200) / 2 / 1e3)
    assert by["minidi::op"]["us_per_call"] == pytest.approx(400 / 3, abs=0.05)
    assert by["triton_poi_fused_0"] == {"name": "triton_poi_fused_0", "calls_per_step": 1.0, "ms_per_step": 0.035,
                                        "us_per_call": 35.0, "pct_step": 3.5}
    assert h["in_ops_ms"] == pytest.approx(0.235)
    assert h["between_ops_ms"] == pytest.approx(1.0 - 0.235)
    assert [r["name"] for r in h["ops"]] == ["minidi::op", "triton_poi_fused_0"]  # most time first
    assert host_ops(_trace(), top=1)["ops"][0]["name"] == "minidi::op"
    assert "0.20 ms     1.5 calls" in format_host_ops(h)


def test_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="no minidi/step range"):
        host_ops([_ev("minidi::op", 0.0, 1.0)])
    with pytest.raises(ValueError, match="top must be an int >= 1"):
        host_ops(_trace(), top=0)


def test_command_line_reads_a_gzipped_trace(tmp_path, capsys):
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "minidi::op" in out and "triton_poi_fused_0" not in out
