"""Bar charts of the per-stage table (``stages_ms`` in the benchmark's JSON lines).

The benchmark machine may lack matplotlib, so the benchmark only writes numbers; PNGs are made later, anywhere:
``python bench/plot_stages.py results.jsonl [--out-dir DIR]`` writes one PNG per JSON line that has ``stages_ms``.
matplotlib is imported only when a chart is drawn.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plotting the stage table needs matplotlib: `pip install matplotlib` "
                          "(the table itself does not; see bench/prefill_stages.py)") from e
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_stage_table(stages: dict[str, float], title: str, path: str | Path) -> Path:
    """Write a horizontal bar chart of {category: ms/step} (first category on top, bars labelled with ms and % of
    the sum) to the PNG ``path``; returns the path."""
    if not stages:
        raise ValueError(f"no stages to plot for {title!r}")
    bad = {k: v for k, v in stages.items() if not isinstance(v, (int, float)) or v < 0}
    if bad:
        raise ValueError(f"stage times must be non-negative numbers (ms/step); bad entries: {bad}")
    plt = _pyplot()
    names, ms = list(stages), [float(v) for v in stages.values()]
    total = sum(ms)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.4))
    try:
        bars = ax.barh(names, ms, color="tab:blue")
        ax.invert_yaxis()  # table order, top to bottom
        for bar, v in zip(bars, ms):
            pct = 100.0 * v / total if total > 0 else 0.0
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.2f} ms ({pct:.0f}%)",
                    va="center", fontsize=9)
        ax.set_xlabel("ms per step")
        ax.set_xlim(0, max(ms) * 1.3 if max(ms) > 0 else 1.0)
        ax.set_title(f"{title}  (sum {total:.2f} ms/step)", fontsize=10)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


def _title(rec: dict, line_no: int) -> str:
    keys = ("model", "mode", "passes", "device", "new_tokens", "cached_tokens")
    parts = [f"{k}={rec[k]}" for k in keys if k in rec]
    return " ".join(parts) or f"line {line_no}"


def plot_jsonl(path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """One PNG per line of ``path`` with a ``stages_ms`` object, named ``<jsonl stem>_<line>.png`` in ``out_dir``
    (default: next to the JSONL). Lines without ``stages_ms`` are skipped; malformed lines raise naming the line."""
    src = Path(path)
    out = Path(out_dir) if out_dir is not None else src.parent
    written = []
    for n, line in enumerate(src.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{src}:{n}: not a JSON object ({e})") from e
        stages = rec.get("stages_ms") if isinstance(rec, dict) else None
        if stages is None:
            continue
        if not isinstance(stages, dict):
            raise ValueError(f"{src}:{n}: stages_ms must be an object of category -> ms, got {type(stages).__name__}")
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(rec.get("model", "")))
        name = f"{src.stem}_{n}_{slug}.png" if slug else f"{src.stem}_{n}.png"
        written.append(plot_stage_table(stages, _title(rec, n), out / name))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", help="benchmark results, one JSON object per line (uses each line's stages_ms)")
    ap.add_argument("--out-dir", default=None, help="where the PNGs go (default: next to the JSONL)")
    args = ap.parse_args(argv)
    try:
        written = plot_jsonl(args.jsonl, args.out_dir)
    except (OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    if not written:
        print(f"no line of {args.jsonl} has a stages_ms field; nothing plotted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
