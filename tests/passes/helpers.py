"""Shared helpers for the pass tests: compile a small module with one pass, and print graphs stably."""

from __future__ import annotations

import re

import torch
import torch._dynamo
from torch._dynamo.testing import normalize_gm

import minidi


def compile_with(module: torch.nn.Module, passes: str, n_sites: int | None = None, strict: bool = False):
    """Compile ``module`` (static shapes, aot_eager) with ``passes``; the compiled callable keeps its graphs."""
    torch._dynamo.reset()
    expected = None if n_sites is None else {k: [None] * n_sites for k in minidi.passes.select(passes)}
    return minidi.compile(module, passes, backend="aot_eager", dynamic=False, keep_graphs=True, strict=strict,
                          expected=expected)


def graph_text(gm: torch.fx.GraphModule) -> str:
    """The readable graph without file comments, trailing blanks or object addresses."""
    text = normalize_gm(gm.print_readable(print_output=False, include_stride=False, include_device=False))
    text = re.sub(r" at 0x[0-9a-f]+", "", text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


def call_targets(gm: torch.fx.GraphModule) -> list[str]:
    """The calls of a graph, in order, as names (``einsum``, ``minidi.ops.moe_combine.moe_combine``, ...)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_method":
            out.append(n.target)
        elif n.op == "call_function":
            t = n.target
            out.append(f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', str(t))}".lstrip("."))
    return out
