"""``bench/bench_host_calls.py`` on the CPU: every row it promises, in us, and its JSON line. Never how fast."""

from __future__ import annotations

import json

import pytest

from bench.bench_host_calls import main


def test_rows_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    res = main(["--smoke", "--calls", "50", "--compile_backend", "aot_eager", "--out", str(out)])
    rows = {(r["row"], r["name"], r["where"]): r["us"] for r in res["rows"]}
    names = {"custom_op", "dispatch_op", "Library op"}
    assert {n for (row, n, w) in rows if row == "dispatch" and w == "eager"} == names | {"python call"}
    assert {n for (row, n, w) in rows if row == "dispatch" and w == "compiled (aot_eager)"} == names
    assert ("stage marker", "stage_mark", "eager") in rows and ("triton_can_run", "4 args, 1 None", "eager") in rows
    assert all(us > 0 for us in rows.values())
    assert res["calls"] == 50 and res["compile_backend"] == "aot_eager"
    assert json.loads(out.read_text()) == res
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == res


def test_no_compiled_rows_and_bad_counts():
    res = main(["--smoke", "--calls", "20", "--compile_backend", "none"])
    assert {r["where"] for r in res["rows"]} == {"eager"}
    with pytest.raises(SystemExit, match="--calls must be >= 1"):
        main(["--calls", "0"])
