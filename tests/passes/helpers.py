"""Shared helpers for the pass tests: compile a small module with one pass, and print graphs stably."""

from __future__ import annotations

import re

import torch
import torch._dynamo
from torch._dynamo.testing import normalize_gm

import minidi


class Fn(torch.nn.Module):
    """A plain function as a module (what ``minidi.compile`` takes): ``forward(*args)`` = ``fn(*args, **consts)``."""

    def __init__(self, fn, **consts) -> None:
        super().__init__()
        self.fn, self.consts = fn, consts

    def forward(self, *args):
        return self.fn(*args, **self.consts)


def compile_with(module: torch.nn.Module, passes: str, n_sites: int | None = None, strict: bool = False):
    """Compile ``module`` (static shapes, aot_eager) with ``passes``; the compiled callable keeps its graphs."""
    torch._dynamo.reset()
    expected = None if n_sites is None else {k: [None] * n_sites for k in minidi.passes.select(passes)}
    return minidi.compile(module, passes, backend="aot_eager", dynamic=False, keep_graphs=True, strict=strict,
                          expected=expected)


def run(module: torch.nn.Module, args: tuple, passes: str, n_sites: int | None = None, strict: bool = False):
    """``compile_with`` and one call -> (output, the pass manager, its last graph before and after the passes)."""
    compiled = compile_with(module, passes, n_sites, strict)
    out = compiled(*args)
    mgr = compiled.pass_manager
    before, after = mgr.graphs[-1]
    return out, mgr, before, after


def graph_text(gm: torch.fx.GraphModule) -> str:
    """The readable graph without file comments, trailing blanks or object addresses, its inputs in name order
    (Dynamo orders a graph's placeholders by argument in torch 2.11, by first use in 2.13)."""
    text = normalize_gm(gm.print_readable(print_output=False, include_stride=False, include_device=False))
    text = re.sub(r" at 0x[0-9a-f]+", "", text)
    lines = _inputs_in_name_order([line.rstrip() for line in text.splitlines() if line.strip()])
    return "\n".join(lines) + "\n"


_SIGNATURE = re.compile(r"^(\s*def forward\(self, )(.*)(\):)$")
_INPUT = re.compile(r'\w+: "[^"]*"|\w+')
_ALIAS = re.compile(r"^\s+(l_\w+) = L_\w+$")


def _natural(name: str) -> list:
    """``L_args_2_`` before ``L_args_10_``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _inputs_in_name_order(lines: list[str]) -> list[str]:
    """Sorts each ``forward`` signature's inputs and the block of ``l_x_ = L_x_`` aliases that follows it by name."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _SIGNATURE.match(lines[i])
        if m is None:
            out.append(lines[i])
            i += 1
            continue
        inputs = sorted(_INPUT.findall(m.group(2)), key=lambda a: _natural(a.split(":")[0]))
        out.append(m.group(1) + ", ".join(inputs) + m.group(3))
        j = i + 1
        while j < len(lines) and _ALIAS.match(lines[j]):
            j += 1
        out += sorted(lines[i + 1:j], key=lambda line: _natural(_ALIAS.match(line).group(1)))
        i = j
    return out


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


_LAYER_MODULE = re.compile(r"layers\.(\d+)\.(.+)$")


def shared_fq8_groups(graph: torch.fx.Graph) -> list[tuple[int, tuple[str, ...]]]:
    """Pass R's fq8 calls of a model graph: (layer, the modules of the linears reading its result, sorted), in graph
    order; module names relative to the layer (``attn.wq_a``), from Dynamo's ``nn_module_stack``."""
    from minidi.ops.fp8_linear import fp8_linear
    from minidi.ops.fq8 import fq8

    out = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is fq8:
            paths = [list(u.meta["nn_module_stack"].values())[-1][0] for u in n.users if u.target is fp8_linear]
            found = [_LAYER_MODULE.search(p) for p in paths]
            assert all(found) and len({int(m.group(1)) for m in found}) == 1, paths
            out.append((int(found[0].group(1)), tuple(sorted(m.group(2) for m in found))))
    return out


def expected_fq8_groups(cfg) -> list[tuple[int, tuple[str, ...]]]:
    """The groups pass R must find in a model with fake quant on: per layer the attention input (wq_a, wkv), the
    query latent of an index-source layer (attention's and the indexer's wq_b), the shared expert's input (w1,
    w3), in graph order."""
    out = []
    for i in range(cfg.n_layers):
        out.append((i, ("attn.wkv", "attn.wq_a")))
        if cfg.is_index_source(i):
            out.append((i, ("attn.indexer.wq_b", "attn.wq_b")))
        out.append((i, ("ffn.shared_experts.w1", "ffn.shared_experts.w3")))
    return out
