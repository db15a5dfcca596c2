"""The top kernels of a profiled prefill step: calls, time, the work each must do and how near the measured peak it
runs, from the Chrome trace ``torch.profiler`` exports (the trace ``bench/prefill_stages.py`` reads).

A row is one name of the profiler's leaf work, its calls summed over the profiled steps (``minidi/step`` ranges):

- CUDA traces (they hold kernel / memcpy / memset events): a call is one device event launched inside a step range;
  its time is its device duration.
- CPU traces: a call is one ``cpu_op`` that starts inside a step range (same thread); its time is its *self* time
  (its duration less that of the ops it calls), so a composite op (``aten::linear``) keeps only its own overhead and
  the op doing the work (``aten::mm``) the rest. The self times of a step add up to at most the step.

Each row also splits its time by the report category each call is charged to (``stages_ms``: the innermost stage
range, a marker's or one of minidi's op calls', holding its launch, as ``prefill_stages.py`` charges it), so a
stage's total can be read kernel by kernel.

Work per call, where it is known (else the row's field stays empty; a row's work is known only if every call's is):
the FLOPs and bytes of ``bench/op_work.py`` (the profiler's FLOPs for matmuls, Inductor's own counts, the bytes of
copy-like and elementwise ops from the recorded shapes). A CPU call counts its own part (``call_work``: a composite
op's work is its children's). CUDA: a kernel gets the work of the op that launched it (the innermost ``cpu_op``
around its launch on the launching thread) only when that op launched nothing else: the work of an op cannot be
split between kernels. One exception: a matmul op whose other launches are device memsets (cuBLAS clears its
workspace before some GEMMs: V4.1's wq_b, the indexer's wq_b and the grouped wo_a on the H100) gives its FLOPs to
its one GEMM kernel. minidi's own ops declare theirs per kernel (``bench/minidi_work.py``, from the call's recorded
arguments): each of their kernels gets its declared work, a launch an equal share of its kernel's in that call; the
MoE's local-row kernels need ``ep_size`` (their rows are device data; under EP N the model's count, ``bytes_from``).
On the CPU a minidi op's call stays a composite (the interpreter runs its kernels beside its own staging copies).

Rates: FLOPs / time in TFLOP/s against the bf16 matmul peak, bytes / time in GB/s against the copy peak (read +
write), both measured in the same run (``bench/common.py`` ``measure_peaks``); ``pct_peak`` is the larger of the
two (the roof the kernel is nearest). A host<->device memcpy gets GB/s but no % of the device's copy peak.

``python bench/kernel_table.py TRACE.json[.gz] --top 25 [--bf16_tflops X --copy_gbps Y --ep N]`` prints the table
of a saved trace (the benchmark's traces keep ``args.flops`` when written with ``--kernels``; ``--ep``: the run's
``ep``, for the MoE kernels' rows).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __package__:  # imported as bench.kernel_table (the benchmark as a module, the tests)
    from . import common, minidi_work, prefill_stages
    from .op_work import MATMUL_OPS, call_work, trivial
else:  # run as a script: the script's folder is sys.path[0]
    import common
    import minidi_work
    import prefill_stages
    from op_work import MATMUL_OPS, call_work, trivial

OP_CAT = prefill_stages.OP_CAT  # the profiler category of an operator call


# ---- calls -------------------------------------------------------------------------------------------------------
@dataclass
class _Op:
    event: dict
    start: float
    end: float
    children_us: float = 0.0
    busy_children: list[str] = field(default_factory=list)  # names of the direct children that are not trivial
    launches: int = 0  # device events whose launch this op is the innermost op of
    kernels: dict[str, int] = field(default_factory=dict)  # those launches by device-event name


def ops_by_thread(events: list[dict]) -> dict[tuple, list[_Op]]:
    """cpu_ops per thread in (start, longest first) order, with their direct children's time and the names of those
    that are not trivial (one stack pass; a child is held entirely by its parent). Also ``host_ops.py``'s calls."""
    out: dict[tuple, list[_Op]] = {}
    for e in events:
        if e.get("cat") == OP_CAT:
            ts = float(e["ts"])
            out.setdefault((e.get("pid"), e.get("tid")), []).append(_Op(e, ts, ts + float(e["dur"])))
    for ops in out.values():
        ops.sort(key=lambda o: (o.start, -o.end))
        stack: list[_Op] = []
        for o in ops:
            while stack and stack[-1].end <= o.start:
                stack.pop()
            if stack:
                parent = stack[-1]
                parent.children_us += min(o.end, parent.end) - o.start
                if not trivial(o.event):
                    parent.busy_children.append(o.event.get("name", ""))
            stack.append(o)
    return out


def _work(op: _Op | None) -> tuple[float | None, float | None]:
    return (None, None) if op is None else call_work(op.event, op.busy_children)


@dataclass
class _Call:
    name: str
    us: float
    flops: float | None
    nbytes: float | None
    device_copy: bool = True  # False: a host <-> device memcpy (no % of the device's copy peak)
    stage: str = prefill_stages.OTHER  # the report category it is charged to (``prefill_stages``)
    bytes_from: str | None = None  # where its bytes rest on the model's count (``minidi_work``: local rows)


def _span(e: dict) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def _within(ranges: list[tuple[float, float]], t: float) -> bool:
    return any(lo <= t <= hi for lo, hi in ranges)


def _cpu_calls(events: list[dict], steps: list[dict]) -> tuple[list[_Call], float]:
    by_thread: dict[tuple, list[tuple[float, float]]] = {}
    for s in steps:
        by_thread.setdefault((s.get("pid"), s.get("tid")), []).append(_span(s))
    calls = []
    stage_ranges = prefill_stages.stage_ranges_by_thread(events)
    for thread, ops in ops_by_thread(events).items():
        ranges = by_thread.get(thread, [])
        mine = [o for o in ops if _within(ranges, o.start)]
        for o, stage in zip(mine, prefill_stages.categories_at(stage_ranges, thread, [o.start for o in mine])):
            calls.append(_Call(o.event["name"], max(0.0, o.end - o.start - o.children_us), *_work(o), stage=stage))
    return calls, statistics.mean(float(s["dur"]) for s in steps) / 1e3


MEMSET = "Memset (Device)"  # a device memset: cuBLAS clears its workspace before some GEMMs (the op's one other launch)


def _launch_work(op: _Op | None, kernel: str, ep_size: int | None) -> tuple[float | None, float | None, str | None]:
    """(FLOPs, bytes, bytes_from) of one device event launched with ``op`` innermost: a declared minidi op's share
    for that kernel (``minidi_work``), else the op's work where it launched nothing else but memsets (cuBLAS clears a
    workspace before some GEMMs: the GEMM keeps the op's work, the memset gets none)."""
    if op is None:
        return None, None, None
    if minidi_work.declared(op.event.get("name", "")):
        return minidi_work.kernel_work(op.event, kernel, op.kernels.get(kernel, 0), True, ep_size)
    if op.launches == 1:
        return (*_work(op), None)
    memsets = op.kernels.get(MEMSET, 0)
    if kernel != MEMSET and memsets and op.launches - memsets == 1 and op.event.get("name") in MATMUL_OPS:
        return (*_work(op), None)
    return None, None, None


def _device_calls(events: list[dict], steps: list[dict], ep_size: int | None) -> tuple[list[_Call], float]:
    launches = {}  # correlation -> (thread, launch ts)
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in prefill_stages.LAUNCH_CATS and corr is not None:
            launches[corr] = ((e.get("pid"), e.get("tid")), float(e["ts"]))
    windows = [_span(s) for s in steps]
    device = []  # (event, launch) of the device events launched inside a step
    for e in events:
        if e.get("cat") in prefill_stages.DEVICE_CATS:
            launch = launches.get((e.get("args") or {}).get("correlation"))
            if launch is not None and _within(windows, launch[1]):
                device.append((e, launch))
    ops = ops_by_thread(events)
    stage_ranges = prefill_stages.stage_ranges_by_thread(events)
    owner: dict[int, _Op | None] = {}
    stage: dict[int, str] = {}
    for thread in {launch[0] for _, launch in device}:
        mine = sorted((launch[1], i) for i, (_, launch) in enumerate(device) if launch[0] == thread)
        times = [t for t, _ in mine]
        for (_, i), op in zip(mine, prefill_stages.innermost(ops.get(thread, []), times)):
            owner[i] = op
            if op is not None:
                op.launches += 1
                name = device[i][0].get("name", "?")
                op.kernels[name] = op.kernels.get(name, 0) + 1
        for (_, i), category in zip(mine, prefill_stages.categories_at(stage_ranges, thread, times)):
            stage[i] = category
    calls = []
    for i, (e, _) in enumerate(device):
        flops, nbytes, basis = _launch_work(owner.get(i), e.get("name", "?"), ep_size)
        copy = not (e.get("cat") == "gpu_memcpy" and "DtoD" not in e.get("name", ""))
        calls.append(_Call(e.get("name", "?"), float(e["dur"]), flops, nbytes, device_copy=copy, stage=stage[i],
                           bytes_from=basis))
    spans = []  # the device time from the first to the last event of each step
    for lo, hi in windows:
        mine = [e for e, launch in device if lo <= launch[1] <= hi]
        if mine:
            spans.append(max(float(e["ts"]) + float(e["dur"]) for e in mine) - min(float(e["ts"]) for e in mine))
    return calls, (statistics.mean(spans) / 1e3 if spans else 0.0)


# ---- names -------------------------------------------------------------------------------------------------------
_NAMESPACES = re.compile(r"\(anonymous namespace\)::|\b(?:at::native::|at::cuda::|at::|c10::|std::|cub::\w+::)")
_NOISE = re.compile(r"::\{lambda\([^{}]*\)#\d+\}|\{lambda\([^{}]*\)#\d+\}|::operator\(\)\(\)(?: const)?")
MAX_NAME = 64


def _strip_parens(s: str) -> str:
    """Drop every parenthesised group (a C++ signature's parameter lists, outer and nested), balanced."""
    out, depth = [], 0
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return "".join(out)


def shorten(name: str, max_len: int = MAX_NAME) -> str:
    """A readable form of a kernel name. C++ names (CUDA kernels: ``void ns::kernel<args>(params)``) lose ``void``,
    their parameter lists, lambdas / ``operator()``, numeric template arguments (block sizes, vector widths) and
    common namespaces (``at::native::``, ``c10::``, ``std::``, ...); whitespace is squeezed; names longer than
    ``max_len`` are cut (``...``). Other names (aten ops, Triton kernels, ``Memcpy DtoD (Device -> Device)``) stay as
    they are up to the cut. Not unique by itself: ``short_names`` makes a table's names unique."""
    s = name.strip()
    if s.startswith("void ") or "::" in s or "<" in s:
        s = s[5:] if s.startswith("void ") else s
        s = _strip_parens(_NOISE.sub("", _NAMESPACES.sub("", s)))
        s = re.sub(r"\s+", " ", s).replace("> >", ">>").replace(" const&", "").replace(" const", "").strip()
        s = re.sub(r"(?<=[<,]) ?\d+[a-z]*(?=[,>])", "", s)  # numeric template arguments (block sizes, widths)
        s = re.sub(r"<,? ?", "<", re.sub(r",(?=[,>])", "", s)) or name.strip()
    return s if len(s) <= max_len else s[:max_len - 3].rstrip() + "..."


def short_names(names: list[str], max_len: int = MAX_NAME) -> dict[str, str]:
    """{full name: short name} with distinct short names for distinct full names: names that shorten alike get
    ``#`` and the first hex digits of a hash of their full name (stable between runs)."""
    out = {n: shorten(n, max_len) for n in names}
    for digits in range(4, 41):
        seen: dict[str, list[str]] = {}
        for n, s in out.items():
            seen.setdefault(s, []).append(n)
        clashes = [ns for ns in seen.values() if len(ns) > 1]
        if not clashes:
            return out
        for ns in clashes:
            for n in ns:
                if out[n] != n:  # the one name left as it is (if any) keeps it
                    out[n] = f"{shorten(n, max_len)} #{hashlib.sha1(n.encode()).hexdigest()[:digits]}"
    raise AssertionError("short names still clash")  # 40 hex digits: the whole hash


# ---- the table ---------------------------------------------------------------------------------------------------
@dataclass
class KernelTable:
    """``rows``: the top kernels, each ``{name, calls_per_step, ms_per_step, pct_step}`` plus, where known,
    ``flops_per_step``, ``bytes_per_step``, ``tflops``, ``gbps``, ``pct_peak`` (and ``full_name`` when ``name`` is
    shortened). ``basis``: what a call is; ``step_ms``: the step ``pct_step`` is of; ``all_ms_per_step``: all calls'
    time per step, the rows cut off included; ``distinct``: how many names there were."""

    rows: list[dict]
    basis: str
    steps: int
    step_ms: float
    all_ms_per_step: float
    distinct: int

    def summary(self) -> dict:
        return {"basis": self.basis, "steps": self.steps, "step_ms": round(self.step_ms, 4),
                "all_ms_per_step": round(self.all_ms_per_step, 4),
                "top_ms_per_step": round(sum(r["ms_per_step"] for r in self.rows), 4), "distinct": self.distinct}


def kernel_table(trace: prefill_stages.Trace, top: int, peaks: dict | None = None,
                 cuda: bool | None = None,
                 model_flops: dict[str, tuple[tuple[str, ...], float]] | None = None,
                 ep_size: int | None = None) -> KernelTable:
    """The ``top`` kernels by total time over the trace's ``minidi/step`` ranges (``cuda``: device events; False:
    CPU op self times; None: device events where the trace has them). ``peaks``: ``bf16_tflops`` / ``copy_gbps``
    for ``pct_peak`` (left out without them). ``model_flops``: label -> (kernel names, FLOPs per step) from the
    model's count (``model_work.kernel_model_flops``), given to the heaviest of those kernels in the trace where the
    trace has no FLOPs for it (the row says ``flops_from``). ``ep_size``: the run's expert parallelism, which decides
    the rows the MoE's local-row kernels move (``minidi_work``: 1 all, N the model's R / N, the row says
    ``bytes_from``; None: those kernels stay unknown). Raises ValueError when the trace has no step range."""
    if not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an int >= 1 (rows of the kernel table), got {top!r}")
    if ep_size is not None and (not isinstance(ep_size, int) or ep_size < 1):
        raise ValueError(f"ep_size must be an int >= 1 (the run's expert parallelism) or None, got {ep_size!r}")
    events = prefill_stages.load_events(trace)
    steps = [e for e in events if e.get("cat") == prefill_stages.RANGE_CAT and e.get("name") ==
             prefill_stages.STEP_RANGE]
    if not steps:
        raise ValueError(f"the trace has no {prefill_stages.STEP_RANGE} range: open `torch.profiler.record_function"
                         f"({prefill_stages.STEP_RANGE!r})` around each profiled step")
    if cuda is None:
        cuda = prefill_stages.has_device_events(events)
    calls, step_ms = _device_calls(events, steps, ep_size) if cuda else _cpu_calls(events, steps)
    groups: dict[str, list[_Call]] = {}
    for c in calls:
        groups.setdefault(c.name, []).append(c)
    n = len(steps)
    ranked = sorted(groups.items(), key=lambda kv: (-sum(c.us for c in kv[1]), kv[0]))[:top]
    names = short_names([k for k, _ in ranked])
    rows = [_row(names[k], k, cs, n, step_ms, peaks or {}) for k, cs in ranked]
    _add_model_flops(rows, groups, model_flops or {}, peaks or {})
    return KernelTable(rows, "cuda device events" if cuda else "cpu op self time", n, step_ms,
                       sum(c.us for c in calls) / 1e3 / n, len(groups))


def _row(name: str, full: str, calls: list[_Call], steps: int, step_ms: float, peaks: dict) -> dict:
    ms = sum(c.us for c in calls) / 1e3 / steps
    row: dict = {"name": name, "calls_per_step": round(len(calls) / steps, 3), "ms_per_step": round(ms, 4),
                 "pct_step": round(100 * ms / step_ms, 2) if step_ms > 0 else None}
    if row["pct_step"] is None:
        del row["pct_step"]
    by_stage: dict[str, float] = {}
    for c in calls:
        by_stage[c.stage] = by_stage.get(c.stage, 0.0) + c.us
    row["stages_ms"] = {k: round(v / 1e3 / steps, 4) for k, v in sorted(by_stage.items(), key=lambda kv: -kv[1])}
    pct = []
    if all(c.flops is not None for c in calls):
        row["flops_per_step"] = round(sum(c.flops for c in calls) / steps)
        if ms > 0:
            r, p = common.rate(ms, row["flops_per_step"], "TFLOP/s", peaks)
            row["tflops"] = _sig(r)
            pct.append(p)
    if all(c.nbytes is not None for c in calls):
        row["bytes_per_step"] = round(sum(c.nbytes for c in calls) / steps)
        if ms > 0:
            r, p = common.rate(ms, row["bytes_per_step"], "GB/s", peaks)
            row["gbps"] = _sig(r)
            pct.append(p if all(c.device_copy for c in calls) else math.nan)
        if basis := sorted({c.bytes_from for c in calls if c.bytes_from}):
            row["bytes_from"] = "; ".join(basis)
    pct = [p for p in pct if not math.isnan(p)]
    if pct:
        row["pct_peak"] = _sig(max(pct))
    if name != full:
        row["full_name"] = full
    return row


def _add_model_flops(rows: list[dict], groups: dict[str, list[_Call]],
                     model_flops: dict[str, tuple[tuple[str, ...], float]], peaks: dict) -> None:
    """Each label's FLOPs per step on the row of its heaviest kernel in the trace (when that row has none)."""
    by_full = {r.get("full_name", r["name"]): r for r in rows}
    for label, (kernels, flops) in model_flops.items():
        present = [k for k in kernels if k in groups]
        if not present:
            continue
        heaviest = max(present, key=lambda k: (sum(c.us for c in groups[k]), k))
        row = by_full.get(heaviest)
        if row is None or "flops_per_step" in row:
            continue
        row["flops_per_step"], row["flops_from"] = round(flops), f"model: {label}"
        if row["ms_per_step"] > 0:
            r, p = common.rate(row["ms_per_step"], row["flops_per_step"], "TFLOP/s", peaks)
            row["tflops"] = _sig(r)
            if not math.isnan(p):
                row["pct_peak"] = _sig(max(p, row.get("pct_peak", -math.inf)))


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def format_kernel_table(rows: list[dict], summary: dict, peaks: dict | None = None) -> str:
    """A kernel table's rows (``KernelTable.rows``, the JSON line's ``kernels``) as a fixed-width table, empty where
    unknown, with a line on what they cover (``summary``: ``KernelTable.summary()``, the JSON's
    ``kernels_summary``) and the peaks ``pct_peak`` is of."""
    def num(v, fmt):
        return "" if v is None else format(v, fmt)

    shown = [{"name": r["name"], "calls/step": num(r["calls_per_step"], "g"), "ms/step": num(r["ms_per_step"], ".4f"),
              "% step": num(r.get("pct_step"), ".2f"),
              "GFLOP/step": num(r.get("flops_per_step") and r["flops_per_step"] / 1e9, ".4g")
              + ("*" if r.get("flops_from") else ""),
              "MB/step": num(r.get("bytes_per_step") and r["bytes_per_step"] / 1e6, ".4g")
              + ("*" if r.get("bytes_from") else ""),
              "TFLOP/s": num(r.get("tflops"), ".4g"), "GB/s": num(r.get("gbps"), ".4g"),
              "% peak": num(r.get("pct_peak"), ".1f")} for r in rows]
    width = max([len(r["name"]) for r in rows] + [4])
    top = sum(r["ms_per_step"] for r in rows)
    steps, peaks = summary["steps"], peaks or {}
    head = (f"top {len(rows)} of {summary['distinct']} kernels ({summary['basis']}), per step over {steps} profiled "
            f"step{'s' * (steps > 1)}; step {summary['step_ms']:.3f} ms")
    foot = (f"  these rows: {top:.3f} ms/step; all {summary['distinct']}: {summary['all_ms_per_step']:.3f} ms/step; "
            f"% peak of {peaks.get('bf16_tflops', '?')} TFLOP/s bf16 matmul or {peaks.get('copy_gbps', '?')} GB/s "
            "copy (measured)" + ("; * the model's FLOPs (flops_from) or rows (bytes_from): an effective rate" if any(
                r.get("flops_from") or r.get("bytes_from") for r in rows) else ""))
    return common.format_table(head, shown, name_width=width, width=10) + "\n" + foot


def annotate_flops(events: list[dict], flops: dict[int, float]) -> int:
    """Write the profiler's FLOPs (``{External id: flops}``, ``profiler_flops``) into the matching ``cpu_op``
    events' ``args.flops`` (the Chrome trace does not carry them); returns how many events got one."""
    n = 0
    for e in events:
        args = e.get("args")
        if e.get("cat") == OP_CAT and isinstance(args, dict) and args.get("External id") in flops:
            args["flops"] = flops[args["External id"]]
            n += 1
    return n


def profiler_flops(prof) -> dict[int, float]:
    """{External id: FLOPs} of the CPU ops a ``torch.profiler.profile(with_flops=True)`` counted (the id is the
    correlation id the Chrome trace exports as ``args["External id"]``)."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is not None:  # the raw events: fast (FunctionEvents take seconds per 100k ops)
        return {k.correlation_id(): float(k.flops()) for k in results.events()
                if k.flops() and k.device_type() == torch.autograd.DeviceType.CPU}
    return {e.id: float(e.flops) for e in prof.events() if e.flops and e.device_type == torch.autograd.DeviceType.CPU}


def load_trace(path: str | Path) -> dict:
    """A Chrome trace from ``.json`` or ``.json.gz``."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a JSON Chrome trace ({e})") from e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Chrome trace (.json or .json.gz) with minidi/step ranges")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--bf16_tflops", type=float, default=None, help="matmul peak for %% peak (the run's card)")
    ap.add_argument("--copy_gbps", type=float, default=None, help="copy peak for %% peak (the run's card)")
    ap.add_argument("--ep", type=int, default=None, metavar="N",
                    help="the run's expert parallelism (its JSON line's ep): the rows minidi's MoE kernels move (1: "
                         "all routed rows; N: the model's 1/N, marked *); unset: those kernels' bytes stay unknown")
    args = ap.parse_args(argv)
    peaks = {k: v for k, v in (("bf16_tflops", args.bf16_tflops), ("copy_gbps", args.copy_gbps)) if v}
    try:
        table = kernel_table(load_trace(args.trace), args.top, peaks,
                             None if args.device == "auto" else args.device == "cuda", ep_size=args.ep)
    except (OSError, ValueError) as e:
        print(f"error: {args.trace}: {e}", file=sys.stderr)
        return 2
    print(format_kernel_table(table.rows, table.summary(), peaks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
