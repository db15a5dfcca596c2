"""Every Triton kernel of minidi.ops compiles for sm_90 (Hopper) on this CPU machine: Triton's compiler and bundled
ptxas run without a GPU. The interpreter that runs the other op tests accepts code the compiler rejects (round 4: a
kernel reading a non-constexpr global passed every CPU test and failed to compile on the H200).

The specialisations compiled are the recorded launches in ``tests/fixtures/kernel_launches.json`` (tiny-model steps
and op tests under the interpreter; ``tests/ops/kernel_launches.py`` records them), with ``INTERPRET`` off and the
arguments the launcher would mark divisible by 16 (aligned pointers, multiples of 16) marked so: the variant the GPU
compiles for those arguments. The recorded sizes are the tiny models' and the op tests', so an int that is a multiple
of 16 only at full size is compiled as it is recorded."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import minidi.ops

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "kernel_launches.json"
RECORD = "TRITON_INTERPRET=1 python -m tests.ops.kernel_launches record tests/fixtures/kernel_launches.json"


def _kernels() -> dict[str, object]:
    """name -> the function of every ``*_kernel`` of minidi.ops (jit-decorated; ``.fn`` in both Triton modes)."""
    found = {}
    for mod in pkgutil.iter_modules(minidi.ops.__path__):
        m = importlib.import_module(f"minidi.ops.{mod.name}")
        for name, obj in vars(m).items():
            if name.endswith("_kernel") and hasattr(obj, "fn"):
                found[f"minidi.ops.{mod.name}.{name}"] = obj.fn
    return found


def test_fixture_covers_every_kernel_with_current_parameters():
    launches = json.loads(FIXTURE.read_text())
    kernels = _kernels()
    recorded = {f"{e['module']}.{e['name']}" for e in launches}
    assert not set(kernels) - recorded, f"kernels never recorded: {sorted(set(kernels) - recorded)}; run {RECORD}"
    for e in launches:
        key = f"{e['module']}.{e['name']}"
        assert key in kernels, f"{key} is recorded but no longer exists; run {RECORD}"
        params = list(inspect.signature(kernels[key]).parameters)
        assert list(e["signature"]) == params, f"{key}: parameters changed {list(e['signature'])} -> {params}; " \
                                               f"run {RECORD}"
        assert "divisible" in e and set(e["divisible"]) <= set(params), f"{key}: no divisibility recorded; run {RECORD}"


def test_every_recorded_kernel_compiles_for_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.ops.kernel_launches", "compile", str(FIXTURE)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "compiled" in proc.stdout
