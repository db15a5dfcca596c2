"""ATen's kernels for the reductions and transcendentals of Inductor-compiled CPU graphs: a compiled CPU step
bitwise equal to the eager one.

With ``emulate_precision_casts`` Inductor rounds where eager rounds, yet a compiled tiny V4.1 step still differed
from eager (teacher-forced, per layer, up to 4.5e-5 rel-RMS; through 10 layers of random weights the logits by
0.24 rel-RMS, since the indexer's top-k and the fake quant amplify any difference). ``torch._inductor``'s
``CompilerBisector`` named the causes: the decomposition of ``aten._softmax`` (the mHC combine, the compressor's
pooling) and the lowering of ``aten.mean`` (RMSNorm): Inductor's own reductions sum in another order than ATen's
CPU kernels; its elementwise transcendentals are its own code too. ``aten_kernels()`` makes Inductor call ATen's
kernels for those ops (``REDUCTIONS``, ``TRANSCENDENTALS``) while it compiles, fusing the exactly rounded rest (add,
mul, casts, where...) as usual: the compiled tiny V4.1 step then equals eager bitwise in every layer
(``tests/runtime/test_compile.py``, ``test_compile_settings.py``). One eager quirk it cannot remove: eager CPU
``bf16_tensor + 0.1`` rounds the scalar to bf16 first, Inductor adds it in fp32 (the model has no such op).
Two torch 2.11 Inductor behaviours that drop a rounding eager does are turned off while it is open (torch 2.13
already guards both; measured on 2.11: without them tiny V4.1's compiled layers were 0.016-0.12 rel-RMS from eager,
with them 0 in every layer): the C++ backend's cast cache (``_keep_cpu_round_trips``) and the joint-graph fold of
``x.to(bf16).to(fp32)`` (``_keep_narrowing_casts``).
By default for CPU graphs only (``faithful_rounding=True``); ``faithful_rounding="exact"`` uses it on GPU graphs
too, where an unfused softmax / RMSNorm costs a round trip through memory (not measured on the GPU yet).

The FX graph cache does not see the lowering table, so the change is keyed (``KEY_PASS``: an Inductor custom
post-grad pass that does nothing but name the setting in the cache key; no custom pass of the caller's is replaced:
where one is set, Inductor's caches are bypassed instead).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, Iterator

import torch

aten = torch.ops.aten
REDUCTIONS = ("sum", "mean", "prod", "var", "var_mean", "std", "std_mean", "_softmax", "_log_softmax", "logsumexp",
              "cumsum", "cumprod", "norm", "linalg_vector_norm")
"""Ops whose Inductor lowering or decomposition reorders a floating-point sum (max / min / argmax are exact in any
order and stay Inductor's)."""
TRANSCENDENTALS = ("exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sigmoid", "silu", "softplus", "tanh",
                   "erf", "gelu", "sin", "cos", "pow", "rsqrt")
"""Elementwise ops whose Inductor code is not ATen's (another polynomial, or a decomposition into other ops)."""


def _overloads() -> list[Any]:
    ops = []
    for name in REDUCTIONS + TRANSCENDENTALS:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops += [getattr(packet, o) for o in packet.overloads()]
    return ops


_SOURCE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # pragma: no cover (torch without custom graph passes: the caches are bypassed)
    _PassBase = None


if _PassBase is not None:
    class _AtenKernelsKey(_PassBase):
        """Does nothing to the graph; its uuid keys Inductor's FX graph / AOTAutograd caches by the setting."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return "minidi.exact_cpu.aten_kernels:" + _SOURCE_HASH  # this file's source: the op lists, the method

    KEY_PASS: Any = _AtenKernelsKey()
else:  # pragma: no cover
    KEY_PASS = None


@contextlib.contextmanager
def aten_kernels() -> Iterator[None]:
    """While open, Inductor lowers ``REDUCTIONS`` and ``TRANSCENDENTALS`` to calls of ATen's kernels (no
    decomposition, no Inductor code) and keys its caches by that. Restores Inductor's tables on exit. Not
    thread-safe (Inductor's tables are global; compiles in this process are sequential)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import decomposition, lowering

    saved = []
    undo_cast_cache = _keep_cpu_round_trips(inductor_config)
    undo_pointless_convert = _keep_narrowing_casts()
    for op in _overloads():
        saved.append((op, lowering.lowerings.get(op), decomposition.decompositions.pop(op, None),
                      op in lowering.fallbacks))
        lowering.lowerings.pop(op, None)
        lowering.make_fallback(op, warn=False, override_decomp=True)
    _forget_decomp_tables(decomposition)
    if KEY_PASS is not None and inductor_config.post_grad_custom_post_pass is None:
        keyed = inductor_config.patch(post_grad_custom_post_pass=KEY_PASS)
    else:  # the caller's own custom pass is set (or none can key): compile without Inductor's caches
        import torch._functorch.config as functorch_config

        keyed = contextlib.ExitStack()
        keyed.enter_context(inductor_config.patch(fx_graph_cache=False))
        if hasattr(functorch_config, "enable_autograd_cache"):
            keyed.enter_context(functorch_config.patch(enable_autograd_cache=False))
    try:
        with keyed:
            yield
    finally:
        for op, low, dec, was_fallback in saved:
            if low is None:
                lowering.lowerings.pop(op, None)
            else:
                lowering.lowerings[op] = low
            if dec is not None:
                decomposition.decompositions[op] = dec
            if not was_fallback:
                lowering.fallbacks.discard(op)
        _forget_decomp_tables(decomposition)
        undo_cast_cache()
        undo_pointless_convert()


def _keep_cpu_round_trips(inductor_config: Any):
    """Inductor's C++ code reuses a bf16 value's fp32 source for its later readers (a CSE "cast cache"), which skips
    the bf16 rounding eager does between two fused ops. torch 2.13 turns the cache off under
    ``emulate_precision_casts`` (pytorch #185337); torch 2.11 does not (measured there: ``x * x + x`` in bf16 differs
    from eager in 1,181 of 4,096 outputs, 0 with this). Turns it off while open; returns the undo."""
    try:
        from torch._inductor.codegen.cpp import CppKernel
    except ImportError:  # pragma: no cover (no C++ backend)
        return lambda: None
    original = CppKernel.__dict__.get("cache_dtype_convert")
    if original is None:  # pragma: no cover (another Inductor: nothing to turn off)
        return lambda: None

    def cache_dtype_convert(self, *args, **kwargs):
        if inductor_config.emulate_precision_casts:
            return None
        return original(self, *args, **kwargs)

    CppKernel.cache_dtype_convert = cache_dtype_convert

    def undo() -> None:
        CppKernel.cache_dtype_convert = original

    return undo


def _keep_narrowing_casts():
    """Inductor's joint-graph pattern ``pointless_convert`` folds ``x.to(a).to(b)`` into ``x.to(b)``. torch 2.13 does
    so only where the first cast loses nothing; torch 2.11 also folds fp32 -> bf16 -> fp32, which drops a bf16
    rounding eager does (the bisector's culprit on tiny V4.1's layer 0 there: 0.066 rel-RMS from eager, 0 without
    the fold). While open, the fold is skipped where the first cast narrows the argument's dtype; returns the undo."""
    try:
        from torch._inductor.fx_passes import joint_graph
    except ImportError:  # pragma: no cover
        return lambda: None
    wrapped = []
    for entries in getattr(getattr(joint_graph, "patterns", None), "patterns", {}).values():
        for entry in entries:
            handler = getattr(entry, "handler", None)
            if getattr(handler, "__name__", "") == "pointless_convert":
                entry.handler = _unless_narrowing(handler)
                wrapped.append((entry, handler))

    def undo() -> None:
        for entry, handler in wrapped:
            entry.handler = handler

    return undo


def _unless_narrowing(handler: Any) -> Any:
    def pointless_convert(match: Any, arg: Any, dtype1: torch.dtype, dtype2: torch.dtype, *args, **kwargs):
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if val is None or not isinstance(val, torch.Tensor) or dtype1.itemsize < val.dtype.itemsize:
            return None  # fp32 -> bf16 -> fp32 is a rounding, not a no-op (or the argument's dtype is unknown)
        return handler(match, arg, dtype1, dtype2, *args, **kwargs)

    pointless_convert.__wrapped__ = handler
    return pointless_convert


def _forget_decomp_tables(decomposition: Any) -> None:
    """Inductor caches a copy of its decomposition table (``fast_random_decomps``): rebuild it from the edited one."""
    cached = getattr(decomposition, "fast_random_decomps", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


def all_cpu(example_inputs: list) -> bool:
    """True when no tensor of a graph's inputs lives on an accelerator (a CPU graph)."""
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return devices <= {"cpu"}
