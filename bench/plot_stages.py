"""Charts of the benchmark's JSON lines: bar charts of the per-stage table (``stages_ms``), and a context sweep's
ms/step against cached tokens beside the FLOP count (``--context``).

The benchmark machine may lack matplotlib, so the benchmark only writes numbers; PNGs are made later, anywhere:
``python bench/plot_stages.py results.jsonl [--out-dir DIR]`` writes one PNG per JSON line that has ``stages_ms``;
``--context`` writes one PNG of the sweep instead (``<jsonl stem>_context.png``). matplotlib is imported only when a
chart is drawn.
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
        raise ImportError("the benchmark's charts need matplotlib: `pip install matplotlib` (their numbers are in "
                          "the JSON lines either way; the stage table: bench/prefill_stages.py)") from e
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    """Lay the figure out and write it as a PNG (its folder made if missing)."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    return path


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
        return _save(fig, path)
    finally:
        plt.close(fig)


def context_series(records: list[dict]) -> tuple[dict[str, list[tuple[int, float | None]]], list[tuple[int, float]]]:
    """From result lines (a --context sweep's, in any order): per mode (``passes`` modes with their passes), the
    (cached tokens, ms/step or None where the point failed) in context order, and the (cached tokens, model FLOPs per
    step) of the points that ran. A later line for the same mode and context replaces an earlier one."""
    ms: dict[str, dict[int, float | None]] = {}
    flops: dict[int, float] = {}
    for rec in records:
        if not isinstance(rec, dict) or not isinstance(rec.get("cached_tokens"), int):
            continue
        label = str(rec.get("mode", "?")) + (f" ({rec['passes']})" if rec.get("mode") == "passes" else "")
        ctx, step_ms = rec["cached_tokens"], rec.get("ms_per_step")
        ms.setdefault(label, {})[ctx] = float(step_ms) if isinstance(step_ms, (int, float)) else None
        f = rec.get("flop_per_step")
        if not isinstance(f, (int, float)) and isinstance(rec.get("tflop_per_step"), (int, float)):
            f = rec["tflop_per_step"] * 1e12
        if isinstance(f, (int, float)):
            flops[ctx] = float(f)
    return ({k: sorted(v.items()) for k, v in ms.items()}, sorted(flops.items()))


def plot_context(records: list[dict], title: str, path: str | Path) -> Path:
    """Two panels side by side, written to the PNG ``path``: ms/step against cached tokens (one line per mode; a
    point that failed, e.g. out of memory, is an x on the axis) and the model FLOPs per step against cached tokens
    (``flop_per_step``, from the config: the same for every mode). Returns the path."""
    series, flops = context_series(records)
    if not series:
        raise ValueError(f"no context points to plot for {title!r}: lines need cached_tokens")
    plt = _pyplot()
    contexts = sorted({c for pts in series.values() for c, _ in pts})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    try:
        for label, pts in series.items():
            ok = [(c, v) for c, v in pts if v is not None]
            line = left.plot([c for c, _ in ok], [v for _, v in ok], marker="o", label=label)[0]
            failed = [c for c, v in pts if v is None]
            if failed:
                left.plot(failed, [0.0] * len(failed), "x", color=line.get_color(), markersize=10,
                          label=f"{label}: failed")
        ran = [v for pts in series.values() for _, v in pts if v is not None]
        left.set_ylabel("ms per step")
        left.set_ylim(0, 1.15 * max(ran) if ran else 1.0)
        left.legend(fontsize=8)
        if flops:
            scale, unit = next((s, u) for s, u in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1.0, "FLOP"))
                               if max(f for _, f in flops) >= s or s == 1.0)
            right.plot([c for c, _ in flops], [f / scale for _, f in flops], marker="s", color="tab:gray")
            right.set_ylabel(f"model {unit} per step")
            right.set_ylim(0, 1.15 * max(f for _, f in flops) / scale)
        for ax, name in ((left, "time"), (right, "work")):
            if contexts and min(contexts) > 0:
                ax.set_xscale("log", base=2)
            ax.set_xticks(contexts)
            ax.set_xticklabels([_tokens(c) for c in contexts], fontsize=8)
            ax.set_xlabel("cached tokens per sequence")
            ax.set_title(name, fontsize=9)
            ax.grid(alpha=0.3)
        fig.suptitle(title, fontsize=10)
        return _save(fig, path)
    finally:
        plt.close(fig)


def _tokens(n: int) -> str:
    """16384 -> 16k, 1048576 -> 1M, 192 -> 192."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}k" if n >= 1 << 10 and n % (1 << 10) == 0 else str(n)


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON object ({e})") from e
    return out


def plot_context_jsonl(path: str | Path, out_dir: str | Path | None = None) -> Path:
    """The context plot of every line of ``path`` (``<jsonl stem>_context.png`` in ``out_dir``, default: next to
    it); the title names the model(s), EP and new tokens of the lines."""
    src = Path(path)
    records = _read_jsonl(src)
    keys = ("model", "ep", "new_tokens")
    seen = {tuple(r.get(k) for k in keys) for r in records if isinstance(r, dict) and "cached_tokens" in r}
    title = "; ".join(f"{m} EP{ep}, {n} new tokens" for m, ep, n in sorted(seen, key=str)) or src.name
    return plot_context(records, title, (Path(out_dir) if out_dir is not None else src.parent) /
                        f"{src.stem}_context.png")


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
    ap.add_argument("--context", action="store_true",
                    help="one PNG of a --context sweep: ms/step against cached tokens beside the FLOP count")
    args = ap.parse_args(argv)
    try:
        if args.context:
            written = [plot_context_jsonl(args.jsonl, args.out_dir)]
        else:
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
