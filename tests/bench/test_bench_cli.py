"""The benchmarks run both ways without ``sys.path`` edits: as scripts (``python bench/bench_X.py``, the reference
``torchrun --nproc-per-node N bench/bench_prefill.py ...``: the script's folder is on ``sys.path``) and as modules
(``python -m bench.bench_X``, the tests' imports). Each bench picks its ``common`` import by ``__package__``."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ("bench_prefill", "bench_fp4_grouped_gemm", "bench_fp8_grouped_gemm", "bench_hc_mix", "bench_hc_expand",
           "bench_ep_dispatch", "bench_indexer", "bench_moe_small_ops", "bench_sparse_attention", "bench_fp8_linear",
           "bench_head_logits", "bench_fp8_gemm", "bench_hadamard")


def _run(*cmd: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_uses_the_one_harness(name):
    mod = importlib.import_module(f"bench.{name}")
    assert mod.common is importlib.import_module("bench.common")
    src = (ROOT / "bench" / f"{name}.py").read_text()
    assert not re.search(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=|sys\.stdout\s*=|runpy", src)
    siblings = [b for b in BENCHES if b != name]
    assert not any(f"import {b}" in src or f"from {b}" in src for b in siblings), "no bench imports another's helpers"


@pytest.mark.parametrize("name", BENCHES)
def test_script_help(name):
    proc = _run(f"bench/{name}.py", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_module_help():
    proc = _run("-m", "bench.bench_prefill", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--cached_tokens" in proc.stdout


def test_torchrun_reference_cli(tmp_path):
    """The reference command's form, on the CPU with one rank: phase lines, then one JSON line per mode, last."""
    proc = _run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "bench/bench_prefill.py",
                "--device", "cpu", "--steps", "1", "--warmup", "1", "--profile_steps", "0", "--cached_tokens", "16",
                "--prefill_batch_size", "8", "--out_dir", str(tmp_path), "--result_jsonl", str(tmp_path / "r.jsonl"),
                timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert (res["mode"], res["cached_tokens"], res["new_tokens"]) == ("eager", 16, 8)
    assert json.loads((tmp_path / "r.jsonl").read_text()) == res
    assert any(line.startswith("build model tiny-v41: ") for line in lines)
    assert any(line.startswith("[eager] timing (1 steps): ") for line in lines)


def test_head_logits_smoke():
    from bench import bench_head_logits

    res = bench_head_logits.main(["--smoke"])
    assert len(res["table"]) == 6 and all(r["rel_err"] < 1e-5 for r in res["table"])


@pytest.mark.interpreter
def test_fp8_grouped_gemm_smoke():
    """The FP8 expert GEMM bench end to end on tiny shapes (interpreter): every case's output checked against the
    bf16 op it would replace."""
    from bench import bench_fp8_grouped_gemm

    res = bench_fp8_grouped_gemm.main(["--smoke", "--cases", "EP4"])
    assert len(res["cases"]) == 4
    assert all(c["fp8_op"]["ok"] for c in res["cases"]), [c["fp8_op"] for c in res["cases"]]
