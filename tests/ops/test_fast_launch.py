"""``@fast_launch``: a repeat launch calls the compiled kernel Triton chose for the same launch signature, with the
arguments in the kernel's parameter order; every launch Triton might compile differently, or that this module cannot
key, goes through Triton's ``JITFunction.run``.

CPU: Triton's ``run`` is replaced by a recorder that returns a stand-in compiled kernel, so the tests see exactly
what reaches Triton and what reaches the launcher. GPU: real kernels (Triton and Gluon, pointers and TMA
descriptors) give the same bytes with the fast path on and off, and repeat launches hit."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from minidi.ops import _fast_launch as fl

ROOT = Path(__file__).resolve().parents[2]


def _kernel_src(x_ptr, n, y_ptr, BLOCK: tl.constexpr, FLAG: tl.constexpr = 3):
    pass


class _Compiled:
    """A stand-in for Triton's compiled kernel: its launcher records each call."""

    def __init__(self, tag: int) -> None:
        self.tag, self.calls = tag, []
        self.function, self.packed_metadata = f"function{tag}", f"metadata{tag}"

    @property
    def run(self):
        return lambda *a: self.calls.append(a)


@pytest.fixture
def kernel(monkeypatch):
    """A fast_launch kernel whose Triton ``run`` records (args, grid, warmup, kwargs) and returns a new stand-in."""
    k = fl.fast_launch(JITFunction(_kernel_src))
    slow: list[tuple] = []

    def triton_run(self, *args, grid, warmup, **kwargs):
        slow.append((args, grid, warmup, kwargs))
        return _Compiled(len(slow))

    monkeypatch.setattr(JITFunction, "run", triton_run)
    monkeypatch.setattr(fl, "ENABLED", True)
    monkeypatch.setattr(fl, "_current_device", lambda: 0)
    monkeypatch.setattr(fl, "_current_stream", lambda device: 1000 + device)
    yield k, slow
    fl._KERNELS.remove(k)


def _tensors():
    return torch.zeros(64), torch.zeros(64)


def test_a_repeat_launches_the_kept_kernel_with_the_parameters_in_order(kernel):
    k, slow = kernel
    x, y = _tensors()
    first = k[(5,)](x, 7, y, BLOCK=32)
    assert len(slow) == 1 and slow[0][1:3] == ((5,), False) and slow[0][3] == {"BLOCK": 32}
    x2, y2 = _tensors()  # new tensors, same signature
    again = k[(6, 2)](x2, 7, y2, BLOCK=32)
    assert len(slow) == 1 and again is first
    assert first.calls == [(6, 2, 1, 1000, "function1", "metadata1", None, None, None, x2, 7, y2, 32, 3)]
    k[(1, 1, 4)](x, 7, y, BLOCK=32)
    assert first.calls[-1][:3] == (1, 1, 4) and first.calls[-1][9] is x
    assert fl.launch_counts()["_kernel_src"] == {"hits": 2, "misses": 1, "unkeyed": 0}


def test_keyword_arguments_fill_the_parameters_by_name(kernel):
    k, slow = kernel
    x, y = _tensors()
    first = k[(1,)](x, 7, y_ptr=y, FLAG=9, BLOCK=32, num_warps=8)
    k[(1,)](x, 7, y_ptr=y, FLAG=9, BLOCK=32, num_warps=8)
    assert len(slow) == 1
    assert first.calls[0][9:] == (x, 7, y, 32, 9)  # signature order, whatever the call's order; options left out


@pytest.mark.parametrize("change", [
    "misaligned pointer", "dtype", "int value", "bool for int", "float for int", "constexpr", "launch option",
    "keyword order", "positional count", "device"])
def test_a_launch_triton_could_compile_differently_goes_through_triton(kernel, monkeypatch, change):
    k, slow = kernel
    x, y = _tensors()
    k[(1,)](x, 16, y, BLOCK=32)
    args, kwargs = [x, 16, y], {"BLOCK": 32}
    if change == "misaligned pointer":
        args[0] = x[1:]  # 4 bytes off: Triton specialises pointers on 16-byte alignment
    elif change == "dtype":
        args[0] = x.to(torch.float16)
    elif change == "int value":
        args[1] = 17  # no longer divisible by 16
    elif change == "bool for int":
        args[1] = True
    elif change == "float for int":
        args[1] = 16.0
    elif change == "constexpr":
        kwargs["BLOCK"] = 64
    elif change == "launch option":
        kwargs["num_warps"] = 8
    elif change == "keyword order":
        kwargs = {"FLAG": 3, "BLOCK": 32}
        k[(1,)](*args, BLOCK=32, FLAG=3)  # the other order, kept first
        slow.clear()
    elif change == "positional count":
        args, kwargs = [x, 16], {"y_ptr": y, "BLOCK": 32}
    elif change == "device":
        monkeypatch.setattr(fl, "_current_device", lambda: 1)
    k[(1,)](*args, **kwargs)
    assert len(slow) == (2 if change != "keyword order" else 1)


def _a_hook(*args):
    pass


class _Fake(torch.Tensor):
    """A tensor subclass, as the precompiler's fake tensors are."""


@pytest.mark.parametrize("case", ["warmup", "grid list", "grid function", "disabled", "through_triton",
                                  "launch hook", "pre-run hook", "tensor subclass", "unknown argument"])
def test_these_launches_always_go_through_triton(kernel, monkeypatch, case):
    k, slow = kernel
    x, y = _tensors()
    grid, args, run = (1,), [x, 16, y], None
    if case == "warmup":
        run = lambda: k.run(*args, grid=grid, warmup=True, BLOCK=32)  # noqa: E731
    elif case == "grid list":
        grid = [1]
    elif case == "grid function":
        grid = lambda meta: (1,)  # noqa: E731
    elif case == "disabled":
        monkeypatch.setattr(fl, "ENABLED", False)
    elif case == "launch hook":
        chain = triton.knobs.runtime.launch_enter_hook
        if hasattr(chain, "calls"):  # Triton's hook chain: a tool added its hook
            monkeypatch.setattr(chain, "calls", [_a_hook])
        else:
            monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", _a_hook)
    elif case == "pre-run hook":
        monkeypatch.setattr(k, "pre_run_hooks", [lambda *a, **kw: None])
    elif case == "tensor subclass":
        args[0] = x.as_subclass(_Fake)
    elif case == "unknown argument":
        args[1] = object()
    run = run or (lambda: k[grid](*args, BLOCK=32))
    for _ in range(3):
        if case == "through_triton":
            with fl.through_triton():
                run()
        else:
            run()
    assert len(slow) == 3
    assert all(call[2] == (case == "warmup") for call in slow)
    if case in ("tensor subclass", "unknown argument"):
        assert fl.launch_counts()["_kernel_src"]["unkeyed"] == 3


def test_kept_kernels_are_bounded_and_futures_never_kept(kernel, monkeypatch):
    k, slow = kernel
    x, y = _tensors()
    monkeypatch.setattr(fl, "MAX_PLANS", 3)
    for n in range(5):
        k[(1,)](x, n, y, BLOCK=32)
    assert len(k._fast_plans) == 3
    k[(1,)](x, 4, y, BLOCK=32)  # not kept: Triton again
    assert len(slow) == 6

    class _Future(_Compiled):
        def result(self):
            return self

    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: slow.append(a) or _Future(9))
    fl.reset()
    k[(1,)](x, 1, y, BLOCK=32)
    assert k._fast_plans == {}


def test_reset_forgets_kept_kernels_and_counts(kernel):
    k, slow = kernel
    x, y = _tensors()
    k[(1,)](x, 1, y, BLOCK=32)
    k[(1,)](x, 1, y, BLOCK=32)
    fl.reset()
    assert "_kernel_src" not in fl.launch_counts() and k._fast_plans == {}
    k[(1,)](x, 1, y, BLOCK=32)
    assert len(slow) == 2


def test_descriptors_key_on_what_triton_specialises():
    from triton.tools.tensor_descriptor import TensorDescriptor

    a, b = torch.zeros(64, 64), torch.zeros(128, 64)
    key = fl.value_key(TensorDescriptor.from_tensor(a, [16, 32]))
    assert key == fl.value_key(TensorDescriptor.from_tensor(b, [16, 32]))  # shape and address are launch values
    assert key != fl.value_key(TensorDescriptor.from_tensor(a, [32, 32]))
    assert key != fl.value_key(TensorDescriptor.from_tensor(a.to(torch.bfloat16), [16, 32]))
    with pytest.raises(fl._Unkeyed):
        fl.value_key(TensorDescriptor.from_tensor(a.as_subclass(_Fake), [16, 32]))


def test_keys_tell_apart_what_compares_equal():
    assert len({fl.value_key(v) for v in (1, True, 1.0)}) == 3
    assert fl.value_key(tl.float32) != fl.value_key(tl.bfloat16)
    assert fl.value_key(torch.nn.Parameter(torch.zeros(4))) == fl.value_key(torch.zeros(4))


def test_fast_launch_keeps_the_kernel_a_triton_jit_function():
    src = JITFunction(_kernel_src)
    k = fl.fast_launch(src)
    try:
        assert k is src and isinstance(k, JITFunction) and isinstance(k, fl._FastRun)
        assert fl.fast_launch(_kernel_src) is _kernel_src  # not a JIT function (the interpreter's): as it is
        assert type(fl.fast_launch(JITFunction(_kernel_src))) is type(k)  # one class per Triton class
    finally:
        fl._KERNELS[:] = [x for x in fl._KERNELS if x.fn is not _kernel_src]


def test_enabled_only_on_the_triton_versions_checked():
    code = "from minidi.ops import _fast_launch as f; print(f.ENABLED)"
    for env, want in (({}, triton.__version__.startswith(fl.CHECKED_TRITON)), ({fl.ENV: "0"}, False)):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.split()[-1]
        assert out == str(want)


def test_every_host_launched_kernel_of_minidi_ops_is_fast():
    """With the interpreter off, each kernel minidi launches from the host (``name[grid](...)``) is a fast_launch
    kernel; the launch sites are read from the sources."""
    import re

    code = inspect.cleandoc("""
        import importlib, json, pkgutil, re, sys
        import minidi.ops
        from minidi.ops._fast_launch import _FastRun
        from triton.runtime.jit import JITFunction
        out = {}
        for m in pkgutil.iter_modules(minidi.ops.__path__):
            mod = importlib.import_module("minidi.ops." + m.name)
            for name, obj in vars(mod).items():
                if isinstance(obj, JITFunction) and obj.__module__ == mod.__name__:
                    out[mod.__name__ + "." + name] = isinstance(obj, _FastRun)
        print(json.dumps(out))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    import json

    kernels = json.loads(subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                                        capture_output=True, check=True).stdout.splitlines()[-1])
    launched = set()
    for path in (ROOT / "minidi" / "ops").glob("*.py"):
        src = path.read_text()
        for name in re.findall(r"(?:^|[^\w.])(_\w+)\[[^\]\n]*\]\(", src, re.M):
            launched.add(f"minidi.ops.{path.stem}.{name}")
        if "kernel_for(cfg)[" in src:  # the register-operand kernels are launched through their chooser
            launched.update(f"minidi.ops.{path.stem}.{n}" for n in re.findall(r"def (_fp4_grouped_mm_sm90_rs\w*)\(",
                                                                                src))
    launched &= set(kernels)  # (Gluon kernels exist only where Gluon imports)
    assert len(launched) >= 30
    assert sorted(n for n in launched if not kernels[n]) == []


# ---- GPU ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_real_kernels_give_the_same_bytes_fast_and_through_triton(monkeypatch):
    """Triton kernels (pointers, ints, constexprs) and a Gluon kernel (TMA descriptors): the outputs with every launch
    through Triton equal those of repeat launches on the fast path, bit for bit, and the repeats hit."""
    from minidi.ops.fp8_quant import fq8_split_launch
    from minidi.ops.gate_tf32x3 import launch as gate_launch
    from minidi.ops.rotated_rows import rotated_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 1024, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(384, 1024, device="cuda", generator=g).to(torch.bfloat16)

    def run_all():
        q, s = fq8_split_launch(x, 32)
        gate = torch.full((300, 384), float("nan"), device="cuda")
        gate_launch(x, w, gate)
        rolled = rotated_rows(x[1:], 4)  # a misaligned source after aligned ones
        outs = [q.view(torch.uint8), s, gate, rolled]
        if torch.cuda.get_device_capability() == (9, 0):  # a Gluon kernel with TMA descriptors
            from minidi.ops import fp8_gemm_sm90

            wq = torch.randn(256, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
            wq = wq.mul(64).clamp(-448, 448).to(torch.float8_e4m3fn)
            if fp8_gemm_sm90.can_run(q, wq, 32):
                codes = torch.full((8, 32), 120, dtype=torch.uint8, device="cuda")
                outs.append(fp8_gemm_sm90.fp8_gemm_sm90(q, s, wq, codes, 32, out_dtype=torch.bfloat16))
        torch.cuda.synchronize()
        return outs

    monkeypatch.setattr(fl, "ENABLED", False)
    want = run_all()
    monkeypatch.setattr(fl, "ENABLED", True)
    fl.reset()
    for _ in range(3):
        got = run_all()
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    counts = fl.launch_counts()
    assert counts["_fq8_split_kernel"]["hits"] >= 2 and counts["_rotated_rows_kernel"]["hits"] >= 2
    assert all(c["unkeyed"] == 0 for c in counts.values())
