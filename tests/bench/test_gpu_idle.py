"""The step's device idle time (bench/gpu_idle.py) on hand-made traces: overlap counted once, gaps binned."""

from __future__ import annotations

import pytest

from bench.gpu_idle import format_idle, idle_summary, profile_idle


def _ev(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_gaps_binned_and_overlap_counted_once():
    events = [
        _ev("a", 0.0, 10.0),
        _ev("b", 5.0, 10.0),  # overlaps a (another stream): busy 0-15, no gap
        _ev("c", 18.0, 2.0),  # gap 3 us (<5)
        _ev("copy", 30.0, 5.0, cat="gpu_memcpy"),  # gap 10 us (5-20)
        _ev("d", 85.0, 15.0),  # gap 50 us (20-100)
        _ev("e", 300.0, 100.0),  # gap 200 us (>=100)
        _ev("cpu op", 120.0, 500.0, cat="cpu_op"),  # not a device event: ignored
        _ev("f", 350.0, 10.0),  # inside e
    ]
    s = idle_summary(events, top=2)
    assert s["span_ms"] == pytest.approx(0.4)
    assert s["busy_ms"] == pytest.approx((15 + 2 + 5 + 15 + 100) / 1e3)
    assert s["idle_ms"] == pytest.approx((3 + 10 + 50 + 200) / 1e3)
    assert s["busy_ms"] + s["idle_ms"] == pytest.approx(s["span_ms"])
    assert s["device_events"] == 7
    assert {k: v["count"] for k, v in s["gaps"].items()} == {"<5us": 1, "5-20us": 1, "20-100us": 1, ">=100us": 1}
    assert s["gaps"][">=100us"]["ms"] == pytest.approx(0.2)
    assert s["largest_gaps"] == [{"ms": 0.2, "after": "d", "before": "e"},
                                 {"ms": 0.05, "after": "copy", "before": "d"}]
    assert "GPU idle 0.26 ms of a 0.40 ms span" in format_idle(s | {"host_ms": 1.0})


def test_the_gap_names_the_event_that_ended_last():
    # b ends after a although it starts later: the gap that follows is after b
    s = idle_summary([_ev("a", 0.0, 10.0), _ev("b", 2.0, 20.0), _ev("c", 40.0, 1.0)])
    assert s["largest_gaps"] == [{"ms": 0.018, "after": "b", "before": "c"}]


def test_no_device_events():
    s = idle_summary([_ev("cpu", 0.0, 5.0, cat="cpu_op")])
    assert s["span_ms"] == 0.0 and s["idle_ms"] == 0.0 and s["largest_gaps"] == []
    assert all(v["count"] == 0 for v in s["gaps"].values())


def test_cpu_step_has_no_device_profile():
    assert profile_idle(lambda *a: None, None, "cpu") is None
