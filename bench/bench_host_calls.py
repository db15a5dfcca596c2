"""Host cost of the calls a compiled step makes around its kernels, in us a call, with no GPU work in them.

    python bench/bench_host_calls.py [--calls 20000] [--compile_backend inductor] [--out F]

Why: without CUDA graphs (the prefill protocol) a step's ~1,750 minidi op calls (257 of them stage markers), ~2,000
Triton launches of minidi's kernels and ~2,000 of Inductor's (V4-Flash EP4) are each paid on the host; where the host's
enqueue nears the kernels' time (round 37: 327-339 ms against ~331 on one H100) every us a call is ~1.75 ms a step per
kind. Rows:

- ``dispatch``: an op returning an empty tensor, registered as ``torch.library.custom_op``, as minidi's
  ``dispatch_op`` (``minidi/ops/_dispatch_op.py``) and as a bare ``torch.library.Library`` op, against the plain
  Python call; each called eagerly (under ``torch.no_grad``), the ops also from a compiled graph (200 calls in one
  graph, ``--compile_backend``);
- ``stage marker``: an enter / exit pair of ``minidi.model.stages.stage_mark`` (no profiler on), per call;
- ``triton_can_run`` over four arguments, one of them None (each op call asks);
- on CUDA: a Triton launch through ``JITFunction.run`` and through ``fast_launch``'s kept kernel, an empty kernel
  (six arguments, the floor of a launch) and the mHC gate's launcher (``_gate_kernel``, 20 arguments);
- on sm_90: an FP8 linear's pieces at a shape too small to be GPU-bound (``_fp8_linear_rows``): the input's split,
  cuBLAS's block-scaled GEMM, the Gluon GEMM and the whole op on either, and on cuBLAS with its route decided anew
  each call (``fp8_linear.gemm_route``'s kept decisions cleared; V4-Flash makes 322 such calls a step).

Each row is the best of three rounds of ``--calls`` calls (wall clock); the last line is the JSON result.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import triton.language as tl

if __package__:
    from . import common
else:
    import common

from minidi.model import stages
from minidi.ops._dispatch_op import dispatch_op
from minidi.ops._triton_utils import triton_can_run

GRAPH_CALLS = 200  # op calls in one compiled graph
_LIBRARIES: list[torch.library.Library] = []  # the bare ops' libraries, kept alive


def _empty_like(a: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape)


def _register(ns: str) -> dict[str, Callable]:
    """The same op body under each registration (namespace ``ns``: one per run, the dispatcher keeps names)."""
    body = _empty_like
    custom = torch.library.custom_op(f"{ns}::custom", mutates_args=())(body)
    custom.register_fake(_empty_like)
    light = dispatch_op(f"{ns}::dispatch")(body)
    light.register_fake(_empty_like)
    lib = torch.library.Library(ns, "FRAGMENT")
    lib.define("bare(Tensor a) -> Tensor")
    lib.impl("bare", body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{ns}::bare", _empty_like, lib=lib)
    _LIBRARIES.append(lib)  # (a Library unregisters its ops when collected)
    ops = getattr(torch.ops, ns)
    return {"custom_op": ops.custom.default, "dispatch_op": ops.dispatch.default, "Library op": ops.bare.default,
            "python call": body}


def best_us(fn: Callable[[], object], calls: int, per_call: int = 1) -> float:
    """us a call: the best of three rounds of ``calls`` calls of ``fn`` (each making ``per_call`` calls)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / (calls * per_call) * 1e6)
    return best


def _in_graph(op: Callable, backend: str) -> Callable:
    def chain(x):
        for _ in range(GRAPH_CALLS):
            x = op(x)
        return x

    return torch.compile(chain, backend=backend, fullgraph=True)


def measure(calls: int, compile_backend: str | None, device: str) -> list[dict]:
    rows = []
    x = torch.zeros(4, device=device)
    ops = _register(f"minidi_host_calls_{len(_LIBRARIES)}")
    with torch.no_grad():
        for name, op in ops.items():
            rows.append({"row": "dispatch", "name": name, "where": "eager", "us": best_us(lambda: op(x), calls)})
        if compile_backend:
            for name, op in ops.items():
                if name == "python call":
                    continue  # (Dynamo traces into a plain function: no call is left in the graph)
                g = _in_graph(op, compile_backend)
                g(x)
                us = best_us(lambda: g(x), max(1, calls // GRAPH_CALLS), GRAPH_CALLS)
                rows.append({"row": "dispatch", "name": name, "where": f"compiled ({compile_backend})", "us": us})

        def marker_pair():
            stages.stage_mark(x, "attn", True)
            stages.stage_mark(x, "attn", False)

        rows.append({"row": "stage marker", "name": "stage_mark", "where": "eager",
                     "us": best_us(marker_pair, calls, 2)})
        four = (x, x, None, x)
        rows.append({"row": "triton_can_run", "name": "4 args, 1 None", "where": "eager",
                     "us": best_us(lambda: triton_can_run(*four), calls)})
        if common.is_cuda(device):
            rows += _launch_rows(x, calls)
            rows += _fp8_linear_rows(device, calls)
            common.sync(device)
    return [{**r, "us": round(r["us"], 3)} for r in rows]


def _empty_kernel(a, b, c, n, m, k, S: tl.constexpr):  # (Triton resolves ``tl`` in this module's globals)
    pass


def _launch_rows(x: torch.Tensor, calls: int) -> list[dict]:
    """A Triton launch's host cost through ``JITFunction.run`` and through ``fast_launch``'s kept kernel
    (``minidi/ops/_fast_launch.py``; its rows only where this Triton is one it was checked on): an empty kernel of six
    arguments (the floor), and ``gate_tf32x3.launch`` (its ``_gate_kernel`` has 20, the launcher's Python included)
    on a shape whose GPU time is far below it."""
    import triton

    from minidi.ops import _fast_launch as fl
    from minidi.ops.gate_tf32x3 import launch as gate_launch

    empty = fl.fast_launch(triton.jit(_empty_kernel))
    gx, gw = torch.zeros(64, 256, device=x.device), torch.zeros(8, 256, device=x.device)
    gout = torch.empty(64, 8, device=x.device)
    calls_of = {"empty kernel, 6 args": lambda: empty[(1,)](x, x, x, 1, 2, 3, S=4),
                "gate_tf32x3.launch, 20 args": lambda: gate_launch(gx, gw, gout)}
    rows, enabled = [], fl.ENABLED
    try:
        for path, on in (("JITFunction.run", False), ("fast_launch", True)):
            if on and not enabled:
                continue
            fl.ENABLED = on
            for name, fn in calls_of.items():
                fn()
                torch.cuda.synchronize()
                rows.append({"row": "triton launch", "name": f"{name}, {path}", "where": "eager",
                             "us": best_us(fn, calls)})
    finally:
        fl.ENABLED = enabled
    return rows


def _fp8_linear_rows(device: str, calls: int) -> list[dict]:
    """On sm_90: the host cost of an FP8 linear's pieces at a shape whose GPU time is far below it (M 128, N 1,024,
    K 1,024, 128-blocks): the input's split, cuBLAS's block-scaled GEMM (``torch._scaled_mm``), the Gluon GEMM, and
    the whole ``minidi::fp8_linear`` on either GEMM (``MINIDI_FP8_GEMM_LIB``)."""
    import os

    from minidi.ops import fp8_gemm_cublas as cublas
    from minidi.ops import fp8_gemm_sm90 as gluon
    from minidi.ops.fp8_linear import _ROUTES as fl_routes
    from minidi.ops.fp8_linear import FP8_GEMM_LIB_ENV, fp8_linear
    from minidi.ops.fp8_quant import fq8_split_launch

    m, n, k, b = 128, 1024, 1024, 128
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes = torch.full((n // b, k // b), 120, dtype=torch.uint8, device=device)
    q, s = fq8_split_launch(x, b)
    if not (gluon.can_run(q, w, b) and cublas.can_run(q, w)):
        return []
    q_t, s_t = fq8_split_launch(x, b, scales_t=True)
    sw, sw_t = cublas.weight_scales(codes), gluon.weight_scale_t(codes)
    pieces = {"fq8_split (scales M-major)": lambda: fq8_split_launch(x, b, scales_t=True),
              "torch._scaled_mm": lambda: cublas.fp8_gemm_cublas(q_t, s_t, w, sw, torch.bfloat16),
              "Gluon FP8 GEMM": lambda: gluon.fp8_gemm_sm90(q, s, w, codes, b, w_scale_t=sw_t)}
    rows = [{"row": "fp8 linear", "name": name, "where": "eager", "us": best_us(fn, calls)}
            for name, fn in pieces.items()]
    before = os.environ.get(FP8_GEMM_LIB_ENV)
    try:
        for lib in ("auto", "gluon"):
            os.environ[FP8_GEMM_LIB_ENV] = lib
            fp8_linear(x, w, codes, b, b)
            rows.append({"row": "fp8 linear", "name": f"minidi::fp8_linear, {lib}", "where": "eager",
                         "us": best_us(lambda: fp8_linear(x, w, codes, b, b), calls)})
        os.environ[FP8_GEMM_LIB_ENV] = "auto"  # the route decided anew each call (as before round 39 kept it)
        rows.append({"row": "fp8 linear", "name": "minidi::fp8_linear, auto, route decided every call",
                     "where": "eager", "us": best_us(lambda: (fl_routes.clear(), fp8_linear(x, w, codes, b, b)),
                                                    calls)})
    finally:
        if before is None:
            os.environ.pop(FP8_GEMM_LIB_ENV, None)
        else:
            os.environ[FP8_GEMM_LIB_ENV] = before
    return rows


def main(argv: list[str] | None = None) -> dict:
    def extra(ap):
        ap.add_argument("--calls", type=int, default=20000, help="calls per round (best of three rounds)")
        ap.add_argument("--compile_backend", default="inductor",
                        help="torch.compile backend of the in-graph rows ('none': skip them)")

    args, device = common.op_bench_args(__doc__, argv, extra)
    if args.calls < 1:
        raise SystemExit(f"--calls must be >= 1, got {args.calls}")
    calls = min(args.calls, 400) if args.smoke else args.calls
    backend = None if args.compile_backend == "none" else args.compile_backend
    rows = measure(calls, backend, device)
    common.say(f"host calls | {common.device_name(device)} | torch {torch.__version__} | best of 3 x {calls} calls")
    for r in rows:
        common.say(f"  {r['us']:8.3f} us  {r['row']:15s} {r['name']:22s} {r['where']}")
    result = {"bench": "host_calls", "device": common.device_name(device), "torch": torch.__version__,
              "calls": calls, "graph_calls": GRAPH_CALLS, "compile_backend": backend, "rows": rows}
    common.emit_json(result, out=args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
