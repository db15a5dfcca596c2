"""Layer kinds compiled in parallel, one worker process each: ``minidi.compile(..., regional=True, compile_workers=N)``.

A per-layer compile traces and compiles its layer kinds one after another on one Python thread, each waiting for the
last: Dynamo, the passes, AOT and Inductor are Python and hold the GIL, so threads cannot overlap them. Processes can.
With workers, the first step runs its layers eagerly (the model's own code, eager temporaries bounded as in the
benchmark's eager mode) and hands each layer kind, at its first layer, to a worker: the layer's function and its
arguments (module, activations, step metadata, cache) as they are at that call. The worker compiles it ahead of time
exactly as ``precompiled.py`` does in-process (Dynamo's ``aot_compile`` with minidi's pass backend built from the same
settings, strict counts checked against the same layer's expected sites) and sends back the serialised graph and its
pass counts. After the first step the main process loads every kind's graph (no tracing), restores the counts into
its pass managers (checked again), and later steps run the compiled graphs. The workers then exit.

- **Arguments**: CUDA tensors travel as CUDA IPC handles (no copy; views of one storage stay views of one storage),
  CPU tensors through shared memory (torch's ``multiprocessing`` reductions), modules by pickle (their parameters
  by one of the two). Nothing a worker compiles reads tensor values, and it never runs a graph.
- **Same compile**: the worker's backend is ``make_backend`` with the step's settings, under the same grad mode,
  shape settings, stage-marker switch and default dtype. The result's guards are checked at every call, as any
  precompiled graph's: a call they reject compiles a variant in the main process (time lost, never a wrong graph).
- **Failures**: a worker's pass-count mismatch (strict) is raised in the main process after the first step, like an
  in-process one; any other failure (an argument that does not pickle, a worker that died) is logged and its kind
  compiles in the main process at its next call.
- The first step's outputs are the eager model's (faithful rounding makes compiled steps round where eager rounds;
  the passes' ops sum in their own order).
"""

from __future__ import annotations

import logging
import pickle
import time
import traceback
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch

from minidi.model import stages
from minidi.passes import PassManager, PassMatchError

from .compile_cache import clear_recorded_artifacts
from .compile_settings import call_settings
from .kernel_precompile import precompiler
from .pass_backend import make_backend
from .precompiled import PrecompiledCalls

log = logging.getLogger("minidi.compile")

EXIT = b""  # the message that stops a worker


@dataclass
class WorkerSettings:
    """What a worker needs to build the backends ``minidi.compile`` built (plain data: it is pickled at spawn)."""

    strict: bool
    op_backend: str
    backend: str
    faithful_rounding: bool | str
    autotune: bool
    cpu_simd: bool
    precompile_kernels: bool
    dynamic: bool | None
    recompile_limit: int
    expected: dict[str, dict[str, list[int | None]]]  # per role: "core", "front", "head"
    keys: dict[str, list[str]]  # the passes of each role's manager
    stage_markers: bool = True
    cuda_device: int | None = None
    compile_threads: int = 1
    save_artifacts: bool = False  # send back the job's Inductor / AOT cache entries (for a compile cache entry)


@dataclass
class JobResult:
    """One layer kind's compile: ``blob`` (``PrecompiledCalls.dumps`` of that label) and ``counts``, or ``error``."""

    label: str
    layer: int | None
    worker: int
    seconds: float  # from the job's submission to its result in the main process
    compile_s: float = 0.0  # the worker's own compile
    blob: bytes | None = None
    counts: dict[str, int] | None = None
    artifacts: bytes | None = None  # the worker's ``torch.compiler.save_cache_artifacts()`` for this job
    error: str | None = None
    pass_mismatch: bool = False  # the error is a strict pass-count mismatch (raised in the main process)


ROLES = ("front", "head")  # labels of ``regional.py``'s graphs that are not a layer kind's core


def role_of(label: str) -> str:
    """Which of a regional step's pass managers a label's graph is checked by: "front", "head", else "core"
    (``regional.py``'s "core <kind>" labels, and any other)."""
    return label if label in ROLES else "core"


class CompileWorkers:
    """``n`` spawned worker processes, each compiling the jobs it is sent one at a time (``submit``); ``results``
    waits for every job and ``close`` stops them. Started at construction, so that their imports overlap the main
    process's work until the first job."""

    def __init__(self, n: int, settings: WorkerSettings) -> None:
        import torch.multiprocessing as mp  # also registers torch's reductions with ForkingPickler

        if n < 1:
            raise ValueError(f"compile_workers must be >= 1, got {n}")
        ctx = mp.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, settings, i), daemon=True, name=f"minidi-compile-{i}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.pending: list[tuple[int, str, int | None, float]] = []  # (worker, label, layer, submitted at)
        self.load = [0] * n

    def submit(self, label: str, layer: int | None, fn: Callable, args: tuple) -> bool:
        """Send ``fn(*args)``'s compile under ``label`` to the least busy worker; False (and logged) if the job
        cannot be sent (an argument that does not pickle, a worker gone): the caller compiles it itself."""
        try:  # pickled now, on this thread (torch's reductions: CUDA tensors by IPC handle, CPU ones through shared
            # memory): the worker sees the arguments as they are at this call
            data = ForkingPickler.dumps((label, layer, fn, args, torch.is_grad_enabled(), torch.get_default_dtype()),
                                        pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            log.warning("minidi.compile: %s not sent to a compile worker (%s: %s); it compiles here", label,
                        type(e).__name__, e)
            return False
        i = min(range(len(self.conns)), key=lambda j: (self.load[j], j))
        try:
            self.conns[i].send_bytes(data)
        except OSError as e:
            log.warning("minidi.compile: compile worker %d unreachable (%s); %s compiles here", i, e, label)
            return False
        self.load[i] += 1
        self.pending.append((i, label, layer, time.perf_counter()))
        return True

    def results(self) -> list[JobResult]:
        """Every submitted job's result, in submission order (a worker answers its jobs in order)."""
        out = []
        for i, label, layer, t0 in self.pending:
            try:
                msg = self.conns[i].recv()
            except (EOFError, OSError) as e:
                msg = {"error": f"compile worker {i} exited ({type(e).__name__}; exit code "
                                f"{self.procs[i].exitcode})"}
            r = JobResult(label=label, layer=layer, worker=i, seconds=time.perf_counter() - t0,
                          compile_s=msg.get("compile_s", 0.0), blob=msg.get("blob"), counts=msg.get("counts"),
                          artifacts=msg.get("artifacts"),
                          error=msg.get("error"), pass_mismatch=bool(msg.get("pass_mismatch")))
            out.append(r)
        self.pending.clear()
        return out

    def close(self, wait: bool = True) -> None:
        """Stop the workers: each finishes its job and exits (``wait``), or is terminated at once."""
        for conn in self.conns:
            try:
                conn.send_bytes(EXIT)
            except OSError:
                pass
        for p in self.procs:
            if wait:
                p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


# ---- the worker process ------------------------------------------------------------------------------------------
def _serve(conn: Any, settings: WorkerSettings, index: int) -> None:
    """A worker's loop: receive a job, compile it, send the result, until ``EXIT``."""
    import torch._inductor.config as inductor_config

    if settings.cuda_device is not None:
        torch.cuda.set_device(settings.cuda_device)
    inductor_config.compile_threads = settings.compile_threads  # the workers share the machine's cores
    stages.enabled(settings.stage_markers)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if data == EXIT:
            return
        t0 = time.perf_counter()
        try:
            msg = _compile_job(settings, data)
        except BaseException as e:  # noqa: BLE001 (every failure goes back to the main process)
            msg = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}",
                   "pass_mismatch": isinstance(e, PassMatchError)}
        msg["compile_s"] = time.perf_counter() - t0
        _release_inputs()
        try:
            conn.send(msg)
        except (OSError, BrokenPipeError):
            return


def _release_inputs() -> None:
    """Drop every reference to the job's tensors before answering: a CUDA tensor received by IPC keeps its block
    allocated in the main process until the receiver frees it (torch counts the receivers' references), so the
    job's activations must not outlive the job (Dynamo's caches hold its traced frames until reset)."""
    import gc

    torch._dynamo.reset()
    gc.collect()


def _compile_job(settings: WorkerSettings, data: bytes) -> dict[str, Any]:
    label, layer, fn, args, grad, dtype = pickle.loads(data)
    role = role_of(label)
    manager = PassManager(settings.keys[role], strict=settings.strict, expected=settings.expected[role],
                          op_backend=settings.op_backend)
    manager.current_layer = layer
    backend = make_backend(manager, settings.backend, faithful_rounding=settings.faithful_rounding,
                           autotune=settings.autotune, cpu_simd=settings.cpu_simd,
                           precompile_kernels=settings.precompile_kernels)
    calls = PrecompiledCalls(dynamic=settings.dynamic)  # dumps only
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.set_grad_enabled(grad), call_settings(settings.dynamic, settings.recompile_limit):
            calls.compile(label, fn, *args, backend=backend)
    finally:
        torch.set_default_dtype(previous)
    if settings.precompile_kernels:  # minidi's kernels of this graph compiled into Triton's cache before answering
        precompiler().wait()
    counts = manager.history[-1] if manager.history else {}
    saved = torch.compiler.save_cache_artifacts() if settings.save_artifacts else None
    clear_recorded_artifacts()  # the next job's entries are its own
    return {"blob": calls.dumps(), "counts": dict(counts), "artifacts": saved[0] if saved is not None else None}


__all__ = ["CompileWorkers", "JobResult", "WorkerSettings", "role_of"]
