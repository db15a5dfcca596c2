"""Stage bar charts (``bench/plot_stages.py``): a valid PNG from a table and from benchmark JSON lines."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.plot_stages import plot_jsonl, plot_stage_table

needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STAGES = {"sparse_attention_core": 1.5, "other_attention": 3.0, "indexer": 0.8, "moe": 6.0, "communication": 0.0,
          "hc_norm_other": 1.2}


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@needs_mpl
def test_plot_stage_table_writes_png(tmp_path):
    out = plot_stage_table(STAGES, "tiny-v41 eager", tmp_path / "sub" / "stages.png")
    w, h = _png_size(out)
    assert w > 100 and h > 100


@needs_mpl
def test_plot_rejects_bad_tables(tmp_path):
    with pytest.raises(ValueError, match="indexer"):
        plot_stage_table({**STAGES, "indexer": -1.0}, "x", tmp_path / "x.png")
    with pytest.raises(ValueError, match="no stages"):
        plot_stage_table({}, "x", tmp_path / "x.png")


@needs_mpl
def test_cli_one_png_per_line_with_stages(tmp_path):
    jsonl = tmp_path / "results.jsonl"
    lines = [{"model": "tiny-v41", "mode": "eager", "stages_ms": STAGES}, {"model": "tiny-v4"},  # no stages: skipped
             {"model": "v41/flash", "mode": "compiled", "stages_ms": {**STAGES, "moe": 2.0}}]
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out_dir = tmp_path / "png"
    proc = subprocess.run([sys.executable, "bench/plot_stages.py", str(jsonl), "--out-dir", str(out_dir)],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pngs = sorted(out_dir.glob("*.png"))
    assert [p.name for p in pngs] == ["results_1_tiny-v41.png", "results_3_v41_flash.png"]
    for p in pngs:
        _png_size(p)


@needs_mpl
def test_malformed_line_names_the_line(tmp_path):
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text('{"stages_ms": {"moe": 1.0}}\n{oops\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2"):
        plot_jsonl(jsonl, tmp_path)


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_stage_table(STAGES, "x", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
