"""Backend choice on a CPU without the Triton interpreter (issue 16 point 3): ``backend="auto"`` (every op's default)
runs the plain-torch reference there, ``backend="triton"`` fails with a hint that works, and ``minidi.compile`` with
every pass runs and matches every site without any environment variable.

Triton decides interpretation when the kernels are decorated (at import), so these checks run in a fresh Python
process with ``TRITON_INTERPRET`` removed from its environment (the test process itself runs under the interpreter,
``tests/conftest.py``). The in-process side of the same choice (CUDA or interpreter -> the kernel) is what every other
op test exercises.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import minidi
from minidi.ops import _triton_utils

ROOT = Path(__file__).resolve().parents[2]


def run_without_interpreter(code: str, timeout: int = 900) -> dict:
    """Run ``code`` in a fresh interpreter without TRITON_INTERPRET; it prints one JSON object last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


OPS = """
import json
import torch
from minidi.ops import _triton_utils
from minidi.ops.fp4_grouped_gemm import fp4_grouped_mm
from minidi.ops.gate_tf32x3 import gate_tf32x3
from minidi.ops.indexer_score import indexer_score, indexer_topk
from minidi.ops.moe_activation import moe_activation
from minidi.ops.moe_combine import moe_combine
from minidi.ops.moe_gather import gather_rows
from minidi.ops.sparse_attention import sparse_attention
from minidi.ops.topk import topk_indices
from minidi.model.quant import quantize_fp4

g = torch.Generator().manual_seed(0)
t, h, d, n, e = 7, 4, 32, 40, 3
offs = torch.tensor([3, 3, 6], dtype=torch.int32)  # expert 1 empty; rows 6.. are other ranks'
packed, scale = quantize_fp4(torch.randn(e, 24, 64, generator=g))
ks, ke = torch.zeros(t, dtype=torch.long), torch.tensor([5, 9, 40, 1, 17, 33, 40])
calls = {
    "sparse_attention": lambda **b: sparse_attention(
        torch.randn(t, h, d, generator=g), kv, torch.randint(-1, 20, (t, 5), generator=g), kv[:9],
        torch.randint(-1, 9, (t, 3), generator=g), torch.randn(h, generator=g), 0.2, **b),
    "topk_indices": lambda **b: topk_indices(torch.randn(t, n, generator=g), 5, **b),
    "indexer_score": lambda **b: indexer_score(q, kk, w, ks, ke, **b),
    "indexer_topk": lambda **b: indexer_topk(q, kk, w, ks, ke, 6, **b),
    "moe_combine": lambda **b: moe_combine(rows, torch.randperm(8, generator=g), local, 2, **b),
    "gather_rows": lambda **b: gather_rows(x9, idx, offs, **b),
    "moe_activation": lambda **b: moe_activation(gg, vv, ws, offs, 7.0, 32, **b),
    "fp4_grouped_mm": lambda **b: fp4_grouped_mm(x9[:8, :64].contiguous(), packed, scale, offs, **b),
    "gate_tf32x3": lambda **b: gate_tf32x3(torch.randn(t, d, generator=g), torch.randn(12, d, generator=g), **b),
}
kv = torch.randn(20, d, generator=g)
q, kk, w = torch.randn(t, h, 16, generator=g), torch.randn(n, 16, generator=g), torch.rand(t, h, generator=g)
rows, local = torch.randn(8, d, generator=g), torch.rand(8, generator=g) < 0.7
x9, idx = torch.randn(9, 96, generator=g), torch.randint(0, 9, (8,), generator=g)
gg, vv, ws = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g), torch.rand(8, generator=g)

def flat(out):
    return list(out) if isinstance(out, tuple) else [out]

report = {"interpreter": _triton_utils.interpreting(), "equal": {}, "hint": {}}
for name, call in calls.items():
    state = g.get_state()
    auto = flat(call())
    g.set_state(state)
    ref = flat(call(backend="ref"))
    report["equal"][name] = all(torch.equal(a.nan_to_num(1e30), r.nan_to_num(1e30)) if a.is_floating_point()
                                else torch.equal(a, r) for a, r in zip(auto, ref))
    try:
        call(backend="triton")
        report["hint"][name] = "no error"
    except RuntimeError as err:
        report["hint"][name] = str(err)
print(json.dumps(report))
"""


def test_auto_is_the_reference_and_triton_fails_clearly_without_interpreter():
    report = run_without_interpreter(OPS)
    assert report["interpreter"] is False
    assert report["equal"] == {k: True for k in report["equal"]} and len(report["equal"]) == 9, report["equal"]
    for name, msg in report["hint"].items():
        assert "backend='triton' needs CUDA tensors" in msg and "TRITON_INTERPRET=1" in msg, (name, msg)
        assert "backend='auto'" in msg and "backend='ref'" in msg, (name, msg)


def test_resolve_backend_in_process(monkeypatch):
    """The choice itself: auto follows where the kernels can run; an unknown name is a ValueError."""
    import torch

    x = torch.zeros(2)
    assert _triton_utils.resolve_backend("ref", "op", x) == "ref"
    monkeypatch.setattr(_triton_utils, "INTERPRETER", True)  # CI's process; a GPU machine runs with it off
    assert _triton_utils.resolve_backend("auto", "op", x) == "triton"
    assert _triton_utils.resolve_backend("triton", "op", x) == "triton"
    monkeypatch.setattr(_triton_utils, "INTERPRETER", False)
    assert _triton_utils.resolve_backend("auto", "op", x, None) == "ref"
    with pytest.raises(RuntimeError, match="op: backend='triton' needs CUDA"):
        _triton_utils.resolve_backend("triton", "op", x)
    with pytest.raises(ValueError, match="backend must be one of"):
        _triton_utils.resolve_backend("cuda", "op", x)


def test_triton_can_run_by_device(monkeypatch):
    """CUDA tensors always (fake ones stand in here), CPU tensors only under the interpreter, None skipped, a mix or
    another device refused."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    with FakeTensorMode():
        cuda = torch.empty(2, device="cuda")
    can = _triton_utils.triton_can_run
    for interp in (True, False):
        monkeypatch.setattr(_triton_utils, "INTERPRETER", interp)
        assert can(cpu, None, cpu) is interp
        assert can(cuda, None, cuda) is True and can() is True and can(None) is True
        assert can(cuda, cpu) is False and can(cpu, cuda) is False
        assert can(meta) is False and can(cpu, meta) is False and can(cuda, meta) is False


COMPILE = """
import json, sys, warnings
import torch
import minidi
from minidi.runtime.engine import Engine, Request

name, op_backend = sys.argv[1], sys.argv[2]
kw = dict(max_batch_tokens=64, max_seqs=8, cache_tokens=2048, page_size=8)
reqs = lambda: [Request(list(range(5, 25))), Request(list(range(30, 47)))]
model = minidi.load_model(name, dtype="float32", fake_quant=False)
ckw = {"backend": "aot_eager", "strict": True}
if op_backend != "default":
    ckw["op_backend"] = op_backend
engine = Engine(model, compile=True, passes="all", compile_kwargs=ckw, **kw)
out = engine.prefill(reqs())
ref = Engine(model, **kw).prefill(reqs())
print(json.dumps({
    "counts": engine.pass_manager.counts,
    "max_err": max((a.logits - b.logits).abs().max().item() for a, b in zip(out, ref)),
}))
"""

COUNTS = {  # every site of the config (as tests/passes/test_models.py; strict mode checks the layers too)
    "tiny-v41": {"C": 10, "E": 10, "D": 30, "A": 10, "B": 4, "F": 20, "J": 20, "K": 20, "G": 20, "H": 10, "I": 10,
                 "L": 0, "M": 1, "T": 1, "N": 86, "R": 0, "O": 1, "P": 10, "Q": 10,
                 "S": 4, "V": 0},  # L, R: fake quant off here
    "tiny-v4": {"C": 4, "E": 4, "D": 12, "A": 4, "B": 2, "F": 9, "J": 9, "K": 8, "G": 8, "H": 4, "I": 4, "L": 0,
                "M": 0, "T": 0, "N": 34, "R": 0, "O": 1, "P": 3, "Q": 4, "S": 10, "V": 0},  # P: one hash-routed layer
}
_DEFAULT = inspect.signature(minidi.compile).parameters["op_backend"].default


# Two compiles, not three: without the interpreter "auto" (the default, asserted below) resolves to "ref"
# (test_resolve_backend_in_process), so an explicit "auto" run and an explicit "ref" run of one model run the same
# graph and ops; one model passes "ref" explicitly, the other nothing
@pytest.mark.parametrize("name,op_backend", [
    ("tiny-v41", "ref"),
    ("tiny-v4", "default"),  # minidi.compile's own default (asserted "auto" below)
])
def test_compile_all_passes_without_interpreter(name, op_backend):
    """The default op backend is "auto", so a CPU without the interpreter needs no setting at all.
    Every pass, strict (all sites matched, pass D inserting the FP4 GEMM's reference too), logits equal to eager
    (fp32, fake quant off: the references are the naive math up to summation order)."""
    assert _DEFAULT == "auto"
    code = COMPILE.replace("sys.argv[1], sys.argv[2]", f"{name!r}, {op_backend!r}")
    res = run_without_interpreter(code)
    assert res["counts"] == COUNTS[name], res
    assert res["max_err"] < 1e-4, res
