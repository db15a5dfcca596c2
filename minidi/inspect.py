"""``python -m minidi.inspect --model tiny-v41 --out DIR``: compile one step with the passes, dump the graphs before and
after them (with depyf when installed: Dynamo bytecode, the backend's graphs, Inductor's code), and print a table of
pass, sites matched / expected, ops removed and added, and where the dumps are.

    pass                 sites  expected  removed  added  inserted
    C moe_combine           10        10       80     10  10x moe_combine
    ...

The step is compiled with ``minidi.compile`` (its shape settings, so the traced graph is the engine's); the table
re-runs the passes one at a time, in manager order, on a copy of the graph before them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections import Counter
from pathlib import Path

import torch

from minidi.passes import BY_KEY, PassManager, select
from minidi.runtime.compile import compile as minidi_compile
from minidi.runtime.compile import expected_sites


def _ops(gm: torch.fx.GraphModule) -> Counter:
    out: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_method":
            out[n.target] += 1
        elif n.op == "call_function":
            out[getattr(n.target, "__name__", str(n.target))] += 1
    return out


def pass_table(before: torch.fx.GraphModule, keys: list[str], expected: dict[str, list[int]] | None) -> list[dict]:
    """Run the passes one at a time on a copy of ``before``: per pass, sites and the calls removed / added."""
    gm = copy.deepcopy(before)
    rows = []
    for i, key in enumerate(keys):
        ops0 = _ops(gm)
        mgr = PassManager(keys[:i + 1])  # with the passes before it (they match nothing again): a pass that
        # rewrites another's ops (L) is selected only with them
        mgr.run(gm)
        diff = _ops(gm)
        diff.subtract(ops0)
        added = {k: v for k, v in diff.items() if v > 0}
        rows.append(dict(key=key, name=BY_KEY[key].name, sites=mgr.counts[key],
                         expected=len(expected[key]) if expected and key in expected else None,
                         removed=-sum(v for v in diff.values() if v < 0), added=sum(added.values()),
                         inserted=", ".join(f"{v}x {k}" for k, v in sorted(added.items()) if k != "getitem")))
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'pass':<22}{'sites':>6}{'expected':>10}{'removed':>9}{'added':>7}  inserted"
    lines = [head, "-" * len(head)]
    for r in rows:
        exp = "-" if r["expected"] is None else str(r["expected"])
        lines.append(f"{r['key'] + ' ' + r['name']:<22}{r['sites']:>6}{exp:>10}{r['removed']:>9}{r['added']:>7}  "
                     f"{r['inserted']}")
    return "\n".join(lines)


def _depyf(out: Path, use: bool) -> tuple[contextlib.AbstractContextManager, Path | None, str]:
    """(context to compile under, dump directory, what to print about it)."""
    if not use:
        return contextlib.nullcontext(), None, "skipped (--no-depyf)"
    try:
        import depyf
    except ImportError:
        return contextlib.nullcontext(), None, "depyf not installed (pip install depyf)"
    return depyf.prepare_debug(str(out / "depyf")), out / "depyf", str(out / "depyf")


def inspect_model(model_name: str, out: str | Path, passes: str = "all", backend: str = "aot_eager",
                  op_backend: str = "auto", tokens: int = 16, use_depyf: bool = True) -> dict:
    """Compile one prefill step of ``model_name`` (fp32, fake-quant off) and write the dumps under ``out``."""
    import minidi
    from minidi.model.context import ModelCache, StepMeta

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = minidi.load_model(model_name, dtype="float32", fake_quant=False)
    cfg = model.cfg
    ids = torch.arange(tokens) % cfg.vocab_size
    meta = StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.step_ngram)
    torch._dynamo.reset()
    step = minidi_compile(model, passes, backend=backend, op_backend=op_backend, keep_graphs=True)
    ctx, depyf_dir, depyf_note = _depyf(out, use_depyf)
    ran = "yes"
    with ctx, torch.no_grad():
        try:
            step(meta, ModelCache())
        except RuntimeError as e:  # compiled, but the Triton ops cannot run here (CPU without TRITON_INTERPRET=1)
            if not step.pass_manager.graphs:
                raise
            ran = f"no ({str(e).splitlines()[0][:160]})"
    before, after = step.pass_manager.graphs[-1]
    (out / "graph_before_passes.py").write_text(before.print_readable(print_output=False))
    (out / "graph_after_passes.py").write_text(after.print_readable(print_output=False))
    rows = pass_table(before, select(passes), expected_sites(cfg))
    table = format_table(rows)
    (out / "passes.txt").write_text(table + "\n")
    return dict(rows=rows, table=table, out=out, depyf=depyf_dir, depyf_note=depyf_note,
                counts=step.pass_manager.counts, graphs=len(step.pass_manager.history), ran=ran)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minidi.inspect", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-v41", help="preset or checkpoint directory (default tiny-v41)")
    ap.add_argument("--out", required=True, help="dump directory")
    ap.add_argument("--passes", default="all", help='"all", "none" or e.g. "A,B"')
    ap.add_argument("--backend", default="aot_eager", help="inner torch.compile backend (aot_eager, inductor)")
    ap.add_argument("--op-backend", choices=("auto", "triton", "ref"), default="auto",
                    help="ops the passes insert (triton: CUDA, or CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens of the traced step")
    ap.add_argument("--no-depyf", action="store_true", help="only write the before/after graphs")
    a = ap.parse_args(argv)
    res = inspect_model(a.model, a.out, a.passes, a.backend, a.op_backend, a.tokens, not a.no_depyf)
    print(res["table"])
    print(f"\ngraphs: {res['out'] / 'graph_before_passes.py'}, {res['out'] / 'graph_after_passes.py'}")
    print(f"depyf dump: {res['depyf_note']}")
    print(f"graphs traced: {res['graphs']}")
    print(f"step ran: {res['ran']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
