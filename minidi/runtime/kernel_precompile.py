"""minidi's Triton kernels compiled ahead of a graph's first run, in a thread pool (``minidi.compile``'s backend).

Triton compiles a kernel when it is first launched, one specialisation after another on the launching thread: in
the V4.1 EP4 step that was 23 s over 33 compiles inside the first run (``docs/benchmarks/README.md``, round 14).
Every launch is already decided by the graph: the passes' output names each op call and Dynamo's example values
give its inputs' shapes, dtypes and alignment. So, right after the passes rewrite a graph (before AOT tracing and
Inductor, tens of seconds on the same thread), ``KernelPrecompiler.submit_graph`` runs each minidi op of the graph
on fake tensors of those shapes with its real implementation, under a mode in which a Triton launch does not launch:
it hands the kernel's specialisation to a thread pool and returns. The workers compile while the main thread goes
on (Triton's MLIR passes and ``ptxas`` run without the GIL; its Python front end competes with the main thread);
the first run then finds the kernels compiled. H200, V4.1 EP4: first run 10.9 s against 33.1 s, cold first step
106.1 s against 138.5 s in the same call (``docs/benchmarks/README.md``, round 15).

- **Same launch code**: the launch plan (grid, constexprs, specialisation) is the op's own Python, run on fake
  tensors; nothing is written twice, so the two cannot diverge. A specialisation it does not foresee (an alignment
  the fake tensors do not have, a branch on data) is compiled at launch, as before: a miss costs time, never a
  result.
- **Never a fake launch**: while deferring, every ``JITFunction.run`` of this thread is a warmup (compile only, no
  launch) and Triton's ``jit_cache_hook`` turns the compile into a pool task; a kernel already compiled is left
  alone. Ops whose implementation needs data (a host sync on a fake tensor) stop at that point: their later
  kernels compile at launch.
- **No guard leaks**: the fake tensors are fresh (own fake mode, concrete sizes from the example values' hints), so
  nothing the implementations evaluate can add a guard to Dynamo's graph.
- **Waits, not duplicates**: a launch whose kernel is still compiling in the pool waits for that task (then Triton
  loads it from its cache); a task that failed leaves the launch to compile, and fail, as it would have.
- Off under the Triton interpreter (nothing to compile) and for graphs without CUDA tensors.

``jit_cache_hook`` is Triton's global hook: the precompiler installs itself there once per process and chains a
hook set before it. ``JITFunction.run`` is patched only while a graph's ops run on fake tensors, on that thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("minidi.compile")

MAX_WORKERS = 8  # Triton compiles per graph run concurrently; Inductor's own compile pool shares the CPUs


class _NoHint(Exception):
    """A symbolic size without a hint (data-dependent): its op's kernels compile at launch."""


def _hint(v: Any) -> Any:
    """A symbolic number's value in the traced example (a constant's value, else its hint), read without a guard."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = v.node
        for value in (getattr(node, "constant", None), getattr(node, "hint", None)):
            if value is not None:
                return value
        expr = getattr(node, "expr", None)
        if expr is not None and getattr(expr, "is_number", False):  # e.g. a size Dynamo specialised to a number
            return bool(expr) if isinstance(v, torch.SymBool) else int(expr) if isinstance(v, torch.SymInt) \
                else float(expr)
        raise _NoHint(str(v))
    return v


def _fresh_fake(v: Any, mode: Any) -> Any:
    """``v`` with every tensor a fresh fake tensor of its concrete (hinted) sizes, strides, storage offset, dtype and
    device in ``mode``, and every symbolic number its hint."""
    if isinstance(v, torch.Tensor):
        size = [int(_hint(s)) for s in v.size()]
        stride = [int(_hint(s)) for s in v.stride()]
        offset = int(_hint(v.storage_offset()))
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride) if n > 0)
        with mode:
            base = torch.empty(extent, dtype=v.dtype, device=v.device)
            return base.as_strided(size, stride, offset)
    if isinstance(v, (list, tuple)):
        return type(v)(_fresh_fake(x, mode) for x in v)
    if isinstance(v, dict):
        return {k: _fresh_fake(x, mode) for k, x in v.items()}
    return _hint(v)


def _is_minidi_call(node: Any, namespaces: tuple[str, ...] = ("minidi",)) -> bool:
    if node.op != "call_function":
        return False
    module = str(getattr(node.target, "__module__", ""))
    # an OpOverload / OpOverloadPacket of minidi's library, or an op wrapper (minidi.ops.*) the passes inserted
    return module in {f"torch._ops.{ns}" for ns in namespaces} or module.startswith("minidi.")


def _real_impl(func: Any, args: tuple, kwargs: dict) -> Callable | None:
    """The implementation a ``dispatch_op`` or a ``torch.library.custom_op`` runs for these arguments' device (None:
    not such an op)."""
    from minidi.ops._dispatch_op import impl_of

    impl = impl_of(func)
    if impl is not None:
        return impl
    try:
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(func)
    except Exception:  # private API moved: nothing to precompile through this op
        return None
    if opdef is None:
        return None
    devices = [a.device.type for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    fns = getattr(opdef, "_backend_fns", {})
    return fns.get(devices[0]) if devices and devices[0] in fns else getattr(opdef, "_init_fn", None)


class _RealImpls(TorchDispatchMode):
    """Runs each minidi op's real implementation on the (fake) arguments it sees, then returns the op's fake result
    so that the caller goes on. An implementation that stops (a host sync on a fake tensor, a shape it rejects) is
    counted in ``stopped``; its op still returns."""

    def __init__(self, namespaces: tuple[str, ...]) -> None:
        super().__init__()
        self.namespaces = namespaces
        self.ran: list[str] = []
        self.stopped: dict[str, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) in self.namespaces:
            impl = _real_impl(func, args, kwargs)
            if impl is not None:
                name = str(func)
                self.ran.append(name)
                try:
                    impl(*args, **kwargs)
                except Exception as e:  # data-dependent code on a fake tensor: the rest compiles at launch
                    self.stopped[name] = f"{type(e).__name__}: {str(e)[:120]}"
        return func(*args, **kwargs)


class KernelPrecompiler:
    """Submits the Triton kernels of a graph's minidi ops to a thread pool (``submit_graph``); launches wait for
    theirs. Counters: ``submitted`` kernel specialisations, ``ops_run`` op calls run on fake tensors, ``stopped``
    (op -> why it stopped early), ``failed`` pool compiles, ``wait_s`` seconds launches waited for pool tasks.
    ``namespaces``: the op libraries whose calls run (minidi's; tests add their own)."""

    def __init__(self, workers: int | None = None, namespaces: tuple[str, ...] = ("minidi",)) -> None:
        self.workers = workers or min(MAX_WORKERS, os.cpu_count() or 1)
        self.namespaces = namespaces
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[tuple[int, Any], Future] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # deferring (this thread's launches are pool tasks), worker
        self._previous_hook: Any = None
        self._hook_fn = self._hook  # one bound method: a new one per attribute access would never be ``is`` it
        self.submitted = self.ops_run = self.failed = 0
        self.stopped: dict[str, str] = {}
        self.wait_s = 0.0

    # -- the graph side ---------------------------------------------------------------------------------------------
    def submit_graph(self, gm: Any) -> int:
        """Hand the Triton kernels of the graph's minidi calls to the pool (nothing where no kernel can compile: the
        interpreter, no GPU, no CUDA tensor in those calls); returns how many kernel specialisations were
        submitted."""
        if not _compiling_available():
            return 0
        nodes = [n for n in gm.graph.nodes if _is_minidi_call(n, self.namespaces)]
        if not any(_on_cuda(n) for n in nodes):
            return 0
        self._install()
        before = self.submitted
        self.run_calls(nodes)
        return self.submitted - before

    def run_calls(self, nodes: list) -> None:
        """Run these graph calls on fresh fake tensors (their example values' concrete sizes) with the minidi ops'
        real implementations and every Triton launch of this thread deferred to the pool."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with self._deferring(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FakeTensor.data_ptr (Triton's alignment check) warns
            for node in nodes:
                try:
                    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _example_value)
                    args, kwargs = _fresh_fake((args, kwargs), mode)
                except (_NoHint, _NoExample) as e:
                    self.stopped[_name(node)] = f"{type(e).__name__}: {e}"
                    continue
                impls = _RealImpls(self.namespaces)
                try:
                    with mode, impls:
                        node.target(*args, **kwargs)
                except Exception as e:  # the wrapper itself needed data: its ops ran up to there
                    self.stopped[_name(node)] = f"{type(e).__name__}: {str(e)[:120]}"
                self.ops_run += len(impls.ran)
                self.stopped.update(impls.stopped)

    def wait(self) -> None:
        """Block until every submitted compile finished (tests; a launch waits only for its own)."""
        for fut in list(self._pending.values()):
            fut.exception()

    # -- the Triton side --------------------------------------------------------------------------------------------
    def _install(self) -> None:
        from triton import knobs

        if knobs.runtime.jit_cache_hook is not self._hook_fn:  # installed once; a hook set since then is chained
            self._previous_hook = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook_fn

    @contextlib.contextmanager
    def _deferring(self) -> Iterator[None]:
        """Every ``JITFunction.run`` of this thread is a warmup (compile, never launch) while inside."""
        from triton.runtime.jit import JITFunction

        from minidi.ops._fast_launch import through_triton

        original = JITFunction.run
        local = self._local

        def run(jit_self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if getattr(local, "deferring", False):
                warmup = True
            return original(jit_self, *args, grid=grid, warmup=warmup, **kwargs)

        JITFunction.run = run  # type: ignore[method-assign]
        local.deferring = True
        try:
            with through_triton():  # (fast_launch kernels would launch a kept kernel without calling run)
                yield
        finally:
            local.deferring = False
            JITFunction.run = original  # type: ignore[method-assign]

    def _hook(self, *args: Any, **kw: Any) -> Any:
        """Triton's ``jit_cache_hook``: called before each JIT compile. Deferring: the compile becomes a pool task
        and is skipped here (True). A launch (not a worker) whose kernel is a pending task waits for it, then lets
        Triton go on (it loads the kernel from its cache)."""
        fn, compile_info, key = kw.get("fn"), kw.get("compile") or {}, kw.get("key")
        jit = getattr(fn, "jit_function", None)
        if getattr(self._local, "deferring", False):
            data, device = compile_info.get("specialization_data"), compile_info.get("device")
            if jit is not None and data is not None:
                self._submit(jit, key, data, device)
            return True  # never compile (or launch) on the fake run's thread
        if jit is not None and not getattr(self._local, "worker", False):
            with self._lock:
                fut = self._pending.pop((id(jit), _hashable(key)), None)
            if fut is not None:
                t0 = time.perf_counter()
                fut.exception()  # a failed task: the launch compiles, and reports, as it would have
                self.wait_s += time.perf_counter() - t0
        previous = self._previous_hook
        return previous(*args, **kw) if previous is not None else None

    def _submit(self, jit: Any, key: Any, data: str, device: Any) -> None:
        k = (id(jit), _hashable(key))
        with self._lock:
            if k in self._pending:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="minidi-precompile")
            self._pending[k] = self._pool.submit(self._compile, k, jit, data, device)
            self.submitted += 1

    def _compile(self, k: tuple[int, Any], jit: Any, data: str, device: Any) -> None:
        """A pool task: Triton compiles the specialisation (``preload``: into the kernel's cache, as a launch would),
        then loads it (``_init_handles``): that builds Triton's C launcher for the kernel's signature (a C compile,
        ~0.3 s each, cached on disk), which a first launch would otherwise do on the launching thread, one after
        another (28 of them, 8.2 s, in the first compiled V4.1 step after compile workers; H100, round 23)."""
        self._local.worker = True
        try:
            with torch.cuda.device(device) if isinstance(device, int) else contextlib.nullcontext():
                kernel = jit.preload(data)
                init = getattr(kernel, "_init_handles", None)
                if callable(init):
                    init()
        except Exception:
            with self._lock:
                self.failed += 1
            raise
        finally:
            with self._lock:  # done: a launch now finds the kernel compiled (or, failed, compiles it itself)
                self._pending.pop(k, None)

    def record(self) -> dict[str, Any]:
        return {"submitted": self.submitted, "ops_run": self.ops_run, "failed": self.failed,
                "wait_s": round(self.wait_s, 2), "stopped": dict(sorted(self.stopped.items()))}


class _NoExample(Exception):
    """A graph node without Dynamo's example value: its op's kernels compile at launch."""


def _example_value(n: Any) -> Any:
    if "example_value" in n.meta:
        return n.meta["example_value"]
    if "val" in n.meta:
        return n.meta["val"]
    raise _NoExample(n.name)


def _on_cuda(node: Any) -> bool:
    vals = [a.meta.get("example_value", a.meta.get("val")) for a in node.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.device.type == "cuda"
               for v in torch.utils._pytree.tree_leaves(vals))


def _name(node: Any) -> str:
    t = node.target
    if str(getattr(t, "__module__", "")).startswith("torch._ops."):
        return str(t)
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', t)}"


def _hashable(key: Any) -> Any:
    try:
        hash(key)
        return key
    except TypeError:
        return repr(key)


def _compiling_available() -> bool:
    """Triton present with the hooks used here, not interpreting, and a GPU to compile for."""
    from minidi.ops._triton_utils import interpreting

    if interpreting() or not torch.cuda.is_available():
        return False
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return hasattr(knobs.runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")


_PRECOMPILER: KernelPrecompiler | None = None


def precompiler() -> KernelPrecompiler:
    """The process's precompiler (one: Triton's hook is global)."""
    global _PRECOMPILER
    if _PRECOMPILER is None:
        _PRECOMPILER = KernelPrecompiler()
    return _PRECOMPILER


__all__ = ["KernelPrecompiler", "precompiler"]
