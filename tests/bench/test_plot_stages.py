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


def _point(mode, cached, ms, flops, **kw):
    return {"model": "tiny-v41", "ep": 1, "new_tokens": 16, "mode": mode, "passes": "all" if mode == "passes" else
            "none", "cached_tokens": cached, "ms_per_step": ms, "flop_per_step": flops, **kw}


SWEEP = [_point("eager", 32, 12.0, 3e9), _point("eager", 16, 10.0, 2e9), _point("passes", 16, 4.0, 2e9),
         {**_point("passes", 32, None, None), "error": "OutOfMemoryError: ..."},  # failed: no time, no FLOPs
         _point("eager", 64, 20.0, None, tflop_per_step=0.005), {"model": "tiny-v41", "mode": "eager"}]


def test_context_series_from_result_lines():
    """Per mode the points in context order (a failed one without time), the FLOPs of the points that ran; the
    JSON's tflop_per_step where flop_per_step is missing; lines without cached_tokens skipped."""
    from bench.plot_stages import context_series

    series, flops = context_series(SWEEP)
    assert series == {"eager": [(16, 10.0), (32, 12.0), (64, 20.0)], "passes (all)": [(16, 4.0), (32, None)]}
    assert flops == [(16, 2e9), (32, 3e9), (64, 5e9)]
    again, _ = context_series(SWEEP + [_point("eager", 16, 11.0, 2e9)])  # a later line for a point replaces it
    assert again["eager"][0] == (16, 11.0)


def test_context_plot_needs_points(tmp_path):
    from bench.plot_stages import plot_context

    with pytest.raises(ValueError, match="no context points"):
        plot_context([{"mode": "eager"}], "x", tmp_path / "x.png")


@needs_mpl
def test_context_plot_and_cli(tmp_path):
    from bench.plot_stages import plot_context

    w, h = _png_size(plot_context(SWEEP, "tiny-v41 sweep", tmp_path / "sweep.png"))
    assert w > 2 * h > 200  # two panels side by side
    jsonl = tmp_path / "sweep.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in SWEEP) + "\n")
    proc = subprocess.run([sys.executable, "bench/plot_stages.py", str(jsonl), "--context", "--out-dir",
                           str(tmp_path / "png")], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "png" / "sweep_context.png")
    _png_size(tmp_path / "png" / "sweep_context.png")


def test_context_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    from bench.plot_stages import plot_context

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_context(SWEEP, "x", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
