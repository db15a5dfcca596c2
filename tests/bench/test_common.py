"""The shared benchmark harness (``bench/common.py``): one key set for the peaks, the final JSON line, the CPU
timing fallback, table rows, rank-aware printing and the phase lines. Only what is reported is checked, never how
fast anything was."""

from __future__ import annotations

import json
import math
import time

import pytest

from bench import common


def test_peaks_have_the_one_key_set():
    peaks = common.measure_peaks("cpu", small=True)
    assert tuple(peaks) == common.PEAK_KEYS == ("bf16_tflops", "copy_gbps")
    assert all(isinstance(v, float) and v > 0 and math.isfinite(v) for v in peaks.values())


def test_emit_json_is_the_last_line_and_is_written(tmp_path, capsys):
    out, jsonl = tmp_path / "r.json", tmp_path / "r.jsonl"
    result = {"bench": "x", "ms": 1.5, "table": [{"name": "a", "ms": 2.0}]}
    common.say("a table line")
    line = common.emit_json(result, out=out, jsonl=jsonl)
    common.emit_json({"bench": "y"}, jsonl=jsonl)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "a table line"
    assert json.loads(printed[1]) == result and json.loads(line) == result
    assert json.loads(out.read_text()) == result and out.read_text().count("\n") == 1
    assert [json.loads(x)["bench"] for x in jsonl.read_text().splitlines()] == ["x", "y"]  # appended


def test_cpu_timing_is_wall_clock_per_call():
    calls = []

    def sleep_5ms():
        calls.append(1)
        time.sleep(0.005)

    times = common.step_times_ms(sleep_5ms, 3, "cpu")
    assert len(times) == 3 and all(t >= 4.5 for t in times)
    calls.clear()
    ms = common.median_ms(sleep_5ms, "cpu", warmup=2, repeats=3)
    assert len(calls) == 5 and ms >= 4.5  # warm-up calls untimed, then the median of the repeats
    calls.clear()
    assert common.op_ms(sleep_5ms, "cpu") >= 4.5 and len(calls) == 1  # CPU / smoke: one call


def test_host_enqueue_stops_the_clock_when_the_call_returns(monkeypatch):
    """Each call's host time until it returns; the sync after it is off the clock (a slow sync adds nothing)."""
    synced = []
    monkeypatch.setattr(common, "sync", lambda device: synced.append(device) or time.sleep(0.02))
    times = common.host_enqueue_ms(lambda: time.sleep(0.005), 3, "cuda")
    assert len(times) == 3 and all(4.5 <= t < 22 for t in times) and len(synced) == 6


def test_table_row_rates_and_speedups():
    peaks = {"bf16_tflops": 100.0, "copy_gbps": 1000.0}
    table: list[dict] = []
    row = common.table_row(table, "op", 2.0, 1e9, "GB/s", peaks, {"eager": 8.0, "compile": 4.0}, ok=True)
    assert table == [row]
    assert row == {"name": "op", "ms": 2.0, "GB/s": 500.0, "pct_peak": 50.0, "x_vs_eager": 4.0, "x_vs_compile": 2.0,
                   "ok": True}
    row = common.table_row(table, "gemm", 1.0, 50e9, "TFLOP/s", peaks)
    assert (row["TFLOP/s"], row["pct_peak"]) == (50.0, 50.0)
    assert math.isnan(common.rate(1.0, 1e9, "GB/s", {})[1])  # no peak measured: no % of it
    text = common.format_table("title", table)
    assert "title" in text and "x_vs_eager" in text and len(text.splitlines()) == 5


def test_say_prints_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    common.say("hidden")
    common.emit_json({"a": 1})
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    common.say("shown")
    assert capsys.readouterr().out == "shown\n"


def test_phases_print_as_they_end(capsys):
    phase = common.Phases("[x] ")
    with phase("build") as p:
        pass
    with pytest.raises(RuntimeError), phase("compile", announce=False):
        raise RuntimeError("boom")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[x] build ..." and lines[1].startswith("[x] build: ") and lines[1].endswith(" s")
    assert lines[2].startswith("[x] compile: ") and "failed: RuntimeError" in lines[2] and len(lines) == 3
    assert set(phase.seconds) == {"build", "compile"} and p.seconds >= 0


def test_ticker_speaks_only_after_its_interval(capsys):
    quiet = common.Ticker("steps", 3, every_s=60)
    for _ in range(3):
        quiet.tick(1.0)
    assert capsys.readouterr().out == ""
    loud = common.Ticker("steps", 3, every_s=0)
    for _ in range(3):
        loud.tick(2.0)
    assert capsys.readouterr().out.splitlines() == ["  steps: 1/3 (last 2.0 ms)", "  steps: 2/3 (last 2.0 ms)"]
