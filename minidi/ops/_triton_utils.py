"""Shared helpers for minidi's Triton ops: which backend runs, interpreter-safe dots, the SM count.

Backends: every op takes ``backend="auto" | "triton" | "ref"``. "triton" runs the kernel and raises a clear error
where it cannot run; "ref" runs the plain-torch reference; "auto" (the default) runs the kernel where it can run
(CUDA tensors, or CPU tensors under the Triton interpreter) and the reference elsewhere, so that the ops, and the
passes that insert them, work on a CPU without any environment variable.

Whether the interpreter runs is decided by Triton when a kernel is decorated (``triton.jit`` returns an
``InterpretedFunction`` when ``TRITON_INTERPRET=1`` is set at import), not when it is called: ``INTERPRETER`` reads
that decision off a decorated function, so setting the variable after ``minidi.ops`` was imported changes nothing.

Triton's CPU interpreter cannot do bf16 arithmetic: it stores bf16 as uint16 and ``tl.dot`` multiplies the raw bit
patterns (PITFALLS.md). Kernels therefore do all arithmetic in fp32 after loading, and feed ``tl.dot`` through
``dot`` / ``mma`` below, which upcast their operands only when the ``INTERPRET`` constexpr says the interpreter is
running; on the GPU the operands stay bf16 and use tensor cores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BACKENDS = ("auto", "triton", "ref")


@triton.jit
def dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc += a @ b; operands upcast to fp32 only in the interpreter (bf16 dot is wrong there)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b. IEEE: exact fp32 products (fp32 operands, not tf32); else bf16/fp16 tensor cores. Interpreter:
    fp32 operands (its bf16 dot is wrong; its fp32 dot is exact either way)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return dot(a, b, acc, INTERPRET)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32 storage; by bit arithmetic, because the
    interpreter's fp32 -> bf16 cast truncates. NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r)


@triton.jit
def local_row_count(offs_ptr, E, R):
    """Rows below offs[E-1] (this rank's experts' rows, sorted first), clamped to [0, R]; read on the device."""
    return tl.minimum(tl.maximum(tl.load(offs_ptr + E - 1), 0), R)


INTERPRETER: bool = isinstance(dot, InterpretedFunction)
"""True when minidi's kernels were decorated under ``TRITON_INTERPRET=1`` (they then run on CPU tensors)."""


def _mend_interpreter_loop_bounds() -> bool:
    """Triton <= 3.6's interpreter turns a runtime loop bound into an int with ``int(array)`` on a one-element 1-D
    array, which NumPy 2 refuses ("only 0-dimensional arrays can be converted to Python scalars"), so every kernel
    with ``for ... in range(0, n, BLOCK)`` over a runtime ``n`` fails there (seen with Triton 3.6 / NumPy 2.5 on the
    H200 machine's CPU). Later Triton squeezes the array first; install that same ``__index__`` on the old
    interpreter, only when its source shows the old form. Interpreter only: compiled kernels are untouched."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        old = original is not None and "int(self.handle.data))" in inspect.getsource(original)
    except (OSError, TypeError):
        old = False
    if not old:
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


INTERPRETER_MENDED: bool = INTERPRETER and _mend_interpreter_loop_bounds()


def interpreting() -> bool:
    """True when the kernels run in Triton's CPU interpreter (decided when they were decorated; see above)."""
    return INTERPRETER


def triton_can_run(*tensors: torch.Tensor | None) -> bool:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter (``None`` entries are skipped). One pass,
    no list: every op call asks (``bench/bench_host_calls.py``: 1.02 us for four arguments on this repository's CPU)."""
    on_cuda = on_cpu = True
    for t in tensors:
        if t is None:
            continue
        if t.is_cuda:
            on_cpu = False
        elif t.device.type == "cpu":
            on_cuda = False
        else:
            return False
    return on_cuda or (on_cpu and interpreting())


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def cannot_run(op: str, *tensors: torch.Tensor | None) -> RuntimeError:
    """The error of backend='triton' on tensors the kernels cannot run on; its hint names backends that work."""
    devices = sorted({str(t.device) for t in tensors if t is not None})
    return RuntimeError(
        f"{op}: backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before minidi.ops is "
        f"imported (got tensors on {', '.join(devices)}, interpreter {'on' if interpreting() else 'off'}); "
        "use backend='auto' (the kernel where it can run, else the plain-torch reference) or backend='ref' "
        "(op_backend= in minidi.compile)")


def resolve_backend(backend: str, op: str, *tensors: torch.Tensor | None) -> str:
    """"auto" -> "triton" where the kernels can run on ``tensors``, else "ref"; "triton" where they cannot -> the
    ``cannot_run`` error; "ref" -> "ref". Called at call time (also while tracing: fake tensors carry the device)."""
    check_backend(backend)
    if backend == "ref":
        return "ref"
    if triton_can_run(*tensors):
        return "triton"
    if backend == "auto":
        return "ref"
    raise cannot_run(op, *tensors)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (sizes persistent grids)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device, asked once per device (launchers call it per launch)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def walk_grid(row_tiles: int, col_tiles: int, device: torch.device,
              per_sm: int | None) -> tuple[tuple[int, ...], bool]:
    """(grid, walk) of a kernel over row_tiles x col_tiles tiles of which only the rows below offs[-1] hold work, a
    count known on the device only. per_sm None: one program per tile, grid (row_tiles, col_tiles), the programs
    past offs[-1] returning at once (at emulated EP4 three quarters of them). Else ``walk``: per_sm programs per SM
    (per_sm in all in the interpreter) walk the local tiles, row tile tile // col_tiles, column tile tile %
    col_tiles, and no program is launched for the rows past offs[-1]."""
    if per_sm is None:
        return (row_tiles, col_tiles), False
    sms = num_sms(device) if device.type == "cuda" else 1
    return (max(1, min(row_tiles * col_tiles, sms * per_sm)),), True
