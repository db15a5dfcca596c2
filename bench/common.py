"""The harness every benchmark shares: peaks, timing, table rows, the final JSON line, rank-aware printing.

- ``measure_peaks(device)``: the device's bf16 matmul TFLOP/s and copy GB/s (read + write), measured now, under the
  one key set ``PEAK_KEYS`` = ``bf16_tflops``, ``copy_gbps``.
- ``median_ms(fn, device)``: median ms of repeated calls. CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed
  between calls) or, with ``flush_l2=False``, CUDA events around each call; CPU: wall clock (``time.perf_counter``).
  ``step_times_ms`` gives each call's ms (the prefill benchmark reports their mean, median and min).
- ``table_row`` / ``print_table``: one dict per timed variant (ms, TFLOP/s or GB/s, % of the measured peak, speed-up
  over the baselines measured in the same run) and a fixed-width print of a list of them.
- ``emit_json(result, out=, jsonl=)``: the last line a benchmark prints is one JSON object; ``--out`` writes the same
  line, ``--result_jsonl`` appends it.
- ``say(...)`` prints (flushed) on rank 0 only (``RANK`` from torchrun; no ``RANK``: a single process), so a
  multi-rank run reports once; ``Phases`` prints each phase of a run with its seconds as it finishes, ``Ticker`` a
  line every 10 s inside a long one.

Run the benchmarks as scripts (``python bench/bench_X.py``, ``torchrun ... bench/bench_prefill.py``: the script's
folder is on ``sys.path`` and they ``import common``) or as modules (``python -m bench.bench_X``, the tests: they
import ``bench.common``); each bench picks one of the two by ``__package__``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

PEAK_KEYS = ("bf16_tflops", "copy_gbps")


# ---- devices and ranks -------------------------------------------------------------------------------------------
def op_bench_args(doc: str | None, argv: list[str] | None = None,
                  extra: Callable[[argparse.ArgumentParser], None] | None = None) -> tuple[argparse.Namespace, str]:
    """The op benchmarks' command line, parsed: ``--out PATH`` (the JSON result) and ``--smoke`` (tiny shapes, the CPU
    interpreter ok), plus what ``extra`` adds -> (the arguments, the device: "cuda" where there is one, else "cpu").
    ``doc``: the benchmark's module docstring (its first paragraph is the description)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter ok)")
    if extra is not None:
        extra(ap)
    return ap.parse_args(argv), "cuda" if torch.cuda.is_available() else "cpu"


def is_cuda(device: str | torch.device) -> bool:
    return str(device).startswith("cuda")


def sync(device: str | torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def device_name(device: str | torch.device) -> str:
    if is_cuda(device):
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


def rank() -> int:
    """This process's rank under torchrun (``RANK``), 0 for a single process."""
    return int(os.environ.get("RANK", "0"))


def say(*args, **kwargs) -> None:
    """``print`` on rank 0 only, flushed (the other ranks run the same steps and stay quiet)."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


class Phases:
    """Prints each phase of a run with its seconds as it ends (``with phases("compile"): ...``), flushed, so that no
    long wait is silent; ``start`` lines are printed for phases expected to take a while."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, announce: bool = True):
        return _Phase(self, name, announce)


class _Phase:
    def __init__(self, phases: Phases, name: str, announce: bool) -> None:
        self.phases, self.name, self.announce = phases, name, announce

    def __enter__(self) -> _Phase:
        if self.announce:
            say(f"{self.phases.prefix}{self.name} ...")
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        dt = time.perf_counter() - self.t0
        self.phases.seconds[self.name] = self.seconds = dt
        say(f"{self.phases.prefix}{self.name}: {dt:.1f} s" + (f" (failed: {exc_type.__name__})" if exc_type else ""))


class Ticker:
    """``tick()`` after each of ``total`` steps prints ``label: i/total`` when ``every_s`` seconds have passed since the
    last line (long phases of slow steps stay audible; fast ones print nothing)."""

    def __init__(self, label: str, total: int, every_s: float = 10.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.done, self.last = 0, time.perf_counter()

    def tick(self, ms: float | None = None) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= self.every_s and self.done < self.total:
            say(f"  {self.label}: {self.done}/{self.total}" + (f" (last {ms:.1f} ms)" if ms is not None else ""))
            self.last = now


# ---- timing ------------------------------------------------------------------------------------------------------
def step_times_ms(fn: Callable[[], object], n: int, device: str | torch.device,
                  ticker: Ticker | None = None) -> list[float]:
    """ms of each of ``n`` calls of ``fn``: CUDA events around each call on a GPU, wall clock on the CPU."""
    out = []
    for _ in range(n):
        if is_cuda(device):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        if ticker is not None:
            ticker.tick(out[-1])
    return out


def host_enqueue_ms(fn: Callable[[], object], n: int, device: str | torch.device) -> list[float]:
    """Host time of each of ``n`` calls of ``fn`` until it returns (the device idle before: synced first; synced
    after, off the clock). On a GPU a step whose enqueue time nears its wall time is bound by its host (launches,
    Python), not its kernels; on the CPU it is the step's time."""
    out = []
    for _ in range(n):
        sync(device)
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
        sync(device)
    return out


def median_ms(fn: Callable[[], object], device: str | torch.device, *, warmup: int = 1, repeats: int = 10,
              flush_l2: bool = True, do_bench_ms: tuple[int, int] = (25, 100)) -> float:
    """Median ms of ``fn``.

    CUDA with ``flush_l2``: ``triton.testing.do_bench(fn, warmup, rep)`` (``do_bench_ms`` = its warm-up and repeat
    budgets in ms; CUDA events, L2 flushed before each call). Otherwise ``warmup`` untimed calls, then the median of
    ``repeats`` calls timed by ``step_times_ms`` (CUDA events, or wall clock on the CPU).
    """
    if is_cuda(device) and flush_l2:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=do_bench_ms[0], rep=do_bench_ms[1], return_mode="median"))
    for _ in range(warmup):
        fn()
    sync(device)
    return statistics.median(step_times_ms(fn, repeats, device))


def op_ms(fn: Callable[[], object], device: str | torch.device, smoke: bool = False,
          do_bench_ms: tuple[int, int] = (25, 100)) -> float:
    """The op benchmarks' timing: ``median_ms`` with the L2 flushed (``triton.testing.do_bench``) on a GPU; one
    wall-clock call in ``smoke`` mode or on the CPU (the interpreter's times are not the point there)."""
    if smoke or not is_cuda(device):
        return median_ms(fn, "cpu", warmup=0, repeats=1)
    return median_ms(fn, device, do_bench_ms=do_bench_ms)


def kernel_ms(fn: Callable[[], object], device: str | torch.device, calls: int = 10) -> float:
    """GPU kernel time of one call of ``fn`` (ms): the device time of every kernel the profiler records over
    ``calls`` calls, divided by ``calls``; NaN off CUDA. Unlike ``op_ms`` it leaves out the host's launch overhead,
    which dominates a chain of small kernels timed alone but runs ahead of the GPU inside a model step."""
    if not is_cuda(device):
        return math.nan
    fn()
    sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return us / 1e3 / calls


def measure_peaks(device: str | torch.device, small: bool = False) -> dict[str, float]:
    """``{"bf16_tflops", "copy_gbps"}`` measured now: a bf16 [m, m] @ [m, m] and a copy of n fp32 (bytes read +
    written), median of 10 after one warm-up. m = 8192 and 1 GiB on a GPU; ``small`` (or the CPU) 512 and 16 MiB."""
    m, n = (8192, 1 << 28) if is_cuda(device) and not small else (512, 1 << 22)
    mm_ms, copy_ms = _peak_ms(m, n, device)
    if is_cuda(device):
        torch.cuda.empty_cache()
    return {"bf16_tflops": float(f"{2 * m**3 / mm_ms / 1e9:.4g}"), "copy_gbps": float(f"{8 * n / copy_ms / 1e6:.4g}")}


def fp8_peak_tflops(device: str | torch.device) -> float:
    """The FP8 tensor cores' rate measured now: ``torch._scaled_mm`` of two e4m3 [8192, 8192] with per-tensor scales
    (bf16 out), median of 10 after one warm-up."""
    m = 8192
    a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    ms = median_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device, flush_l2=False)
    return 2 * m**3 / ms / 1e9


def _peak_ms(m: int, n: int, device: str | torch.device) -> tuple[float, float]:
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    x = torch.empty(n, device=device)
    y = torch.empty_like(x)
    return median_ms(lambda: a @ b, device, flush_l2=False), median_ms(lambda: y.copy_(x), device, flush_l2=False)


# ---- tables ------------------------------------------------------------------------------------------------------
UNITS = {"TFLOP/s": ("bf16_tflops", 1e9), "GB/s": ("copy_gbps", 1e6)}  # unit -> (peak key, amount / ms / this)


def rate(ms: float, amount: float, unit: str, peaks: dict[str, float]) -> tuple[float, float]:
    """(rate in ``unit``, % of the measured peak) of ``amount`` FLOPs (TFLOP/s) or bytes (GB/s) done in ``ms``."""
    key, div = UNITS[unit]
    r = amount / ms / div
    peak = peaks.get(key, math.nan)
    return r, 100 * r / peak if peak and not math.isnan(peak) else math.nan


def table_row(table: list[dict], name: str, ms: float, amount: float, unit: str, peaks: dict[str, float],
              base: dict[str, float] | None = None, **extra) -> dict:
    """Append (and return) ``{name, ms, <unit>, pct_peak, x_vs_<baseline>..., **extra}``: ``base`` maps baseline
    names to their ms, measured in the same run (speed-up = baseline ms / ms)."""
    r, pct = rate(ms, amount, unit, peaks)
    row = {"name": name, "ms": round(ms, 4), unit: round(r, 1), "pct_peak": round(pct, 1)}
    for k, v in (base or {}).items():
        row[f"x_vs_{k}"] = round(v / ms, 2)
    row.update(extra)
    table.append(row)
    return row


def format_table(title: str, table: list[dict], name_width: int = 34, width: int = 14) -> str:
    """``title`` and one line per row: the name column left-aligned in ``name_width``, the others right-aligned in
    ``width``; a key a row lacks is an empty cell."""
    keys = list(dict.fromkeys(k for r in table for k in r))
    lines = [f"\n== {title}", "  ".join(f"{k:>{width}}" if k != "name" else f"{k:<{name_width}}" for k in keys)]
    for r in table:
        lines.append("  ".join(f"{str(r.get(k, '')):>{width}}" if k != "name" else f"{r[k]:<{name_width}}"
                               for k in keys))
    return "\n".join(lines)


def print_table(title: str, table: list[dict]) -> None:
    say(format_table(title, table))


# ---- the result line ---------------------------------------------------------------------------------------------
def emit_json(result: dict, out: str | Path | None = None, jsonl: str | Path | None = None) -> str:
    """Print ``result`` as one JSON line (rank 0), write it to ``out`` and append it to ``jsonl`` where given."""
    line = json.dumps(result)
    say(line)
    if out:
        Path(out).write_text(line + "\n")
    if jsonl:
        with open(jsonl, "a") as f:
            f.write(line + "\n")
    return line
