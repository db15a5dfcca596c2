"""``python -m minidi.inspect``: the table of passes (sites = expected from the config), the before/after graphs and
the depyf dump (aot_eager, so no Inductor codegen: depyf 0.20 + torch >= 2.13 breaks only there). The output is
coherent: one traced graph whose counts are the table's (no warning of a first graph that missed a pass), and a
``--no-depyf`` run says that depyf was skipped."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from minidi.inspect import _depyf, main


def test_inspect_cli(tmp_path, capsys):
    pytest.importorskip("depyf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--model", "tiny-v4", "--out", str(tmp_path), "--tokens", "8"]) == 0
    assert not [w for w in caught if "minidi passes" in str(w.message)]  # no graph with missed sites
    out = capsys.readouterr().out
    keys = ("A ", "B ", "C ", "D ", "E ", "F ", "G ", "H ", "I ", "J ", "K ", "L ", "M ", "N ", "R ")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:2] in keys}
    assert {k: (int(r[2]), int(r[3])) for k, r in rows.items()} == {
        "A": (4, 4), "B": (2, 2), "C": (4, 4), "D": (12, 12), "E": (4, 4), "F": (9, 9), "G": (8, 8),
        "H": (4, 4), "I": (4, 4), "J": (9, 9), "K": (8, 8), "L": (0, 0),
        "M": (0, 0), "N": (34, 34), "R": (0, 0)}  # L, R: fake quant off here; M: V4.1 only
    assert "4x sparse_attention" in out and "12x fp4_grouped_mm" in out
    before = (tmp_path / "graph_before_passes.py").read_text()
    after = (tmp_path / "graph_after_passes.py").read_text()
    assert "thd,tkd->thk" in before and "thd,tkd->thk" not in after and "sparse_attention" in after
    assert any((tmp_path / "depyf").glob("*.py"))
    assert f"depyf dump: {tmp_path / 'depyf'}" in out
    assert "graphs traced: 1" in out
    assert "step ran: yes" in out


def test_no_depyf_says_skipped(tmp_path):
    assert _depyf(Path(tmp_path), use=False)[1:] == (None, "skipped (--no-depyf)")
