"""Stage markers: profiler ranges around the parts of a step, that survive ``torch.compile``.

``torch.profiler.record_function`` is dropped by Dynamo, and Inductor reorders kernels across anything that has no
data dependency. So a marker here is a custom op that *mutates* the boundary tensor (it changes nothing): every
kernel that produces the tensor runs before it, every kernel that reads it after, in eager and compiled code alike.
It is registered on the dispatcher (``dispatch_op``): 2.27 us a call where it cost 11.0 as a ``custom_op`` (2-core CPU,
``bench/bench_host_calls.py``, ``docs/benchmarks/cpu_round38``), for 257 marker calls a V4-Flash step.
Markers sit at GEMM boundaries (module inputs / outputs), where nothing would fuse across them anyway.

Off by default (the model then has no markers at all); ``enabled(True)`` before tracing puts them into the graph
(Dynamo guards on the flag, so toggling it recompiles). A profiler then sees nested ranges ``minidi/<stage>``:

    attn          other attention (projections, compression, gathers, fake quant, output projection)
    attn.core     the sparse attention core (key assembly + attention with sink: pass A)
    indexer       indexer queries, keys and top-k (pass B)
    moe           gate, experts, combine, shared expert (passes C, D, E)
    moe.comm      expert-parallel token exchange (``DistributedEP``'s collectives; the emulated exchange has no
                  markers: its op's calls are the stage, ``bench/prefill_stages.py`` ``OP_STAGE``)
Everything outside a range (embedding, mHC, norms, Engram, head) is "other". A marker orders only the kernels that
write or read its tensor: a profile also charges minidi's op calls to their own stage (``OP_STAGE``), wherever the
compiler launched them.
"""

from __future__ import annotations

import torch

from minidi.ops._dispatch_op import dispatch_op

STAGES = ("attn", "attn.core", "indexer", "moe", "moe.comm")
PREFIX = "minidi/"

_enabled = False
_open: list = []  # record_function contexts entered and not yet exited (markers nest); None: entered unprofiled


def enabled(on: bool | None = None) -> bool:
    """Turn the markers on or off (for code traced from now on); returns the current setting."""
    global _enabled
    if on is not None:
        _enabled = bool(on)
    return _enabled


@dispatch_op("minidi::stage_mark", mutates_args=("x",))
def stage_mark(x: torch.Tensor, name: str, enter: bool) -> None:
    """Open (``enter``) or close the profiler range ``minidi/<name>``. ``x`` is declared mutated (it is not) so the
    compiler keeps the marker between the kernels that write ``x`` and those that read it. With no profiler on, no
    range is opened (a timed step's markers cost their dispatch only): an exit closes what its enter opened."""
    if enter:
        rf = None
        if torch._C._autograd._profiler_enabled():
            rf = torch.profiler.record_function(PREFIX + name)
            rf.__enter__()
        _open.append(rf)
    elif _open:
        rf = _open.pop()
        if rf is not None:
            rf.__exit__(None, None, None)


@stage_mark.register_fake
def _(x: torch.Tensor, name: str, enter: bool) -> None:
    return None


def enter(name: str, x: torch.Tensor) -> None:
    if _enabled:
        stage_mark(x, name, True)


def exit(name: str, x: torch.Tensor) -> None:  # noqa: A001 (pairs with enter)
    if _enabled:
        stage_mark(x, name, False)
